//! `newsnack_scale_hint(per_pod)` (migration 32), the number KEDA's
//! PostgreSQL scaler reads: the work ready to claim and in flight, in pods
//! of `per_pod` issues, capped by the pods the shared LLM budget keeps
//! busy, at least 1, and 1 while generation is paused or the day's token
//! budget is spent. The same
//! checks run against a variant that counts the backlog (every
//! unfinished row, no cap), and must catch it. Its cost at a million
//! issues is measured by `cargo bench --bench flat_costs`.

mod common;

use common::TestDb;

/// What a scaler on the backlog would answer: every unfinished issue
/// counted row by row, and as many pods as it takes, budget or not.
const BACKLOG_VARIANT: &str = "
CREATE OR REPLACE FUNCTION newsnack_scale_hint(per_pod integer) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT greatest(1, ceil((SELECT count(*) FROM issue
                              WHERE processing_status <> 'DONE')::numeric / per_pod))::integer
$$";

async fn hint(db: &TestDb, per_pod: i32) -> Result<i32, tokio_postgres::Error> {
    let client = db.raw().await;
    client
        .query_one("SELECT newsnack_scale_hint($1)", &[&per_pod])
        .await
        .map(|row| row.get(0))
}

/// Every expectation on one database, from an empty one on; the first
/// that does not hold, as a message.
async fn check(db: &TestDb) -> Result<(), String> {
    let expect = |what: &str, got: i32, want: i32| {
        if got == want {
            Ok(())
        } else {
            Err(format!("{what}: answered {got}, expected {want}"))
        }
    };
    expect("no work at all", hint(db, 4).await.unwrap(), 1)?;

    let ids = db.add_issues(103).await;
    db.move_with_sql(&ids[..3], &["IN_PROGRESS"]).await;
    db.move_with_sql(&ids[3..13], &["IN_PROGRESS", "DONE"])
        .await;
    db.move_with_sql(&ids[13..23], &["IN_PROGRESS", "FAILED"])
        .await;
    // 80 PENDING and 3 IN_PROGRESS; the DONE and FAILED ones are no work.
    db.set("llm_max_in_flight", "1000").await;
    db.set("generation_concurrency", "8").await;
    expect(
        "83 issues of work, 4 a pod, budget unbounded",
        hint(db, 4).await.unwrap(),
        21,
    )?;
    expect(
        "83 issues of work, 8 a pod, budget unbounded",
        hint(db, 8).await.unwrap(),
        11,
    )?;

    db.set("llm_max_in_flight", "8").await;
    expect(
        "8 calls in flight allowed, 4 a pod",
        hint(db, 4).await.unwrap(),
        2,
    )?;
    db.set("generation_concurrency", "2").await;
    expect(
        "8 calls in flight allowed, 2 calls a pod",
        hint(db, 4).await.unwrap(),
        4,
    )?;
    expect(
        "8 calls in flight allowed, 100 a pod",
        hint(db, 100).await.unwrap(),
        1,
    )?;

    db.set("generation_paused", "true").await;
    expect("generation paused", hint(db, 4).await.unwrap(), 1)?;
    db.set("generation_paused", "false").await;

    db.set("llm_daily_token_budget", "1000").await;
    expect(
        "a day's budget not yet spent",
        hint(db, 4).await.unwrap(),
        4,
    )?;
    db.raw()
        .await
        .execute(
            "INSERT INTO llm_token_day (day, tokens)
             VALUES ((now() AT TIME ZONE 'UTC')::date, 1000)",
            &[],
        )
        .await
        .unwrap();
    expect("the day's budget spent", hint(db, 4).await.unwrap(), 1)?;
    Ok(())
}

#[tokio::test]
async fn scale_hint_answers_the_pods_the_budget_keeps_busy() {
    let db = TestDb::new().await;
    check(&db).await.unwrap();
}

#[tokio::test]
async fn the_checks_catch_a_hint_that_counts_the_backlog() {
    let db = TestDb::new().await;
    db.raw().await.batch_execute(BACKLOG_VARIANT).await.unwrap();
    let caught = check(&db).await;
    assert!(
        caught.is_err(),
        "the checks let a hint on the backlog through"
    );
}

#[tokio::test]
async fn a_per_pod_below_one_is_refused_with_a_clear_error() {
    let db = TestDb::new().await;
    for per_pod in [0, -3] {
        let e = hint(&db, per_pod).await.unwrap_err();
        let message = e.as_db_error().unwrap().message().to_string();
        assert!(
            message.contains("per_pod must be at least 1")
                && message.contains(&per_pod.to_string()),
            "{message}"
        );
    }
    let client = db.raw().await;
    let e = client
        .query_one("SELECT newsnack_scale_hint(NULL)", &[])
        .await
        .unwrap_err();
    let message = e.as_db_error().unwrap().message();
    assert!(message.contains("not NULL"), "{message}");
}

#[tokio::test]
async fn a_reader_role_may_ask() {
    let db = TestDb::new().await;
    db.add_issues(5).await;
    let role = format!("{}_scaler", db.name);
    let mut client = db.raw().await;
    client
        .batch_execute(&format!("CREATE ROLE {role} LOGIN"))
        .await
        .unwrap();
    newsnack::db::role::grant(&mut client, newsnack::db::role::RoleKind::Reader, &role)
        .await
        .unwrap();
    client
        .batch_execute(&format!("SET ROLE {role}"))
        .await
        .unwrap();
    let pods: i32 = client
        .query_one("SELECT newsnack_scale_hint(2)", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(pods, 3);
}
