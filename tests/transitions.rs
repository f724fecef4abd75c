//! The database enforces and announces transitions for every writer: the
//! 16-pair agreement with the Rust machine, raw SQL seen by subscribers,
//! illegal changes rejected, and the commit-ordered log.

mod common;

use common::{first_column, move_on, refusal, within, TestDb};
use newsnack::generation::machine::IssueMachine;
use newsnack::model::status::Status;

/// SQL that moves a fresh (PENDING) issue into `status` by legal steps.
fn path_to(status: Status) -> &'static [&'static str] {
    match status {
        Status::Pending => &[],
        Status::InProgress => &["IN_PROGRESS"],
        Status::Done => &["IN_PROGRESS", "DONE"],
        Status::Failed => &["IN_PROGRESS", "FAILED"],
    }
}

#[tokio::test]
async fn sql_rules_and_rust_machine_agree_on_all_16_pairs() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    for from in Status::ALL {
        for to in Status::ALL {
            let id: i64 = sql
                .query_one(
                    "INSERT INTO issue (title) VALUES ('pair') RETURNING id",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            for step in path_to(from) {
                sql.execute(
                    "UPDATE issue SET processing_status = $2 WHERE id = $1",
                    &[&id, step],
                )
                .await
                .unwrap();
            }
            let logged_before: i64 = sql
                .query_one(
                    "SELECT count(*) FROM issue_transition WHERE issue_id = $1",
                    &[&id],
                )
                .await
                .unwrap()
                .get(0);
            let result = sql
                .execute(
                    "UPDATE issue SET processing_status = $2 WHERE id = $1",
                    &[&id, &to.as_str()],
                )
                .await;
            let row = sql
                .query_one(
                    "SELECT processing_status, (SELECT count(*) FROM issue_transition WHERE issue_id = $1) FROM issue WHERE id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            let (now, logged_after): (String, i64) = (row.get(0), row.get(1));
            let sql_says_transition = result.is_ok() && from != to;
            if let Err(e) = &result {
                let msg = e.as_db_error().unwrap().message().to_string();
                assert!(
                    msg.contains(&id.to_string())
                        && msg.contains(from.as_str())
                        && msg.contains(to.as_str()),
                    "error must name the issue and both statuses: {msg}"
                );
                assert_eq!(now, from.as_str(), "a rejected change leaves the status");
                assert_eq!(
                    logged_after, logged_before,
                    "a rejected change is not logged"
                );
            } else if from == to {
                assert_eq!(logged_after, logged_before, "no change is not a transition");
            } else {
                assert_eq!(now, to.as_str());
                assert_eq!(logged_after, logged_before + 1);
            }
            assert_eq!(
                sql_says_transition,
                IssueMachine::is_legal(from, to),
                "SQL and the machine disagree on {from} -> {to}"
            );
            let sql_fn: bool = sql
                .query_one(
                    "SELECT issue_transition_is_legal($1, $2)",
                    &[&from.as_str(), &to.as_str()],
                )
                .await
                .unwrap()
                .get(0);
            assert_eq!(sql_fn, IssueMachine::is_legal(from, to), "{from} -> {to}");
        }
    }
}

#[tokio::test]
async fn raw_sql_transition_reaches_a_subscriber_with_from_to_and_seq() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    let (hub, stop) = db.listener().await;
    let mut live = hub.subscribe();
    let other = db.raw().await;
    move_on(&other, &[id], &["IN_PROGRESS"]).await;
    let t = within(10, "the transition", live.recv()).await.unwrap();
    let logged: i64 = other
        .query_one(
            "SELECT seq FROM issue_transition WHERE issue_id=$1 AND to_status='IN_PROGRESS'",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        (t.issue_id, t.from, t.to, t.seq),
        (id, Some(Status::Pending), Status::InProgress, logged)
    );
    stop.cancel();
}

#[tokio::test]
async fn illegal_raw_sql_is_rejected_and_changes_nothing() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    let other = db.raw().await;
    let before = db.scalar_i64("SELECT count(*) FROM issue_transition").await;
    let err = other
        .execute(
            "UPDATE issue SET processing_status='DONE', last_error='x' WHERE id=$1",
            &[&id],
        )
        .await
        .unwrap_err();
    let msg = err.as_db_error().unwrap().message().to_string();
    assert_eq!(
        msg,
        format!("illegal status transition for issue {id}: PENDING -> DONE")
    );
    let row = other
        .query_one(
            "SELECT processing_status, last_error FROM issue WHERE id=$1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "PENDING");
    assert_eq!(row.get::<_, Option<String>>(1), None);
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue_transition").await,
        before
    );

    let err = refusal(
        &other,
        "INSERT INTO issue (title, processing_status) VALUES ('x', 'DONE')",
    )
    .await;
    assert!(err.contains("must start PENDING"));
    let err = other
        .execute(
            "UPDATE issue SET processing_status='SOMETHING' WHERE id=$1",
            &[&id],
        )
        .await
        .unwrap_err();
    assert!(err.as_db_error().is_some());
}

/// Every other date or time the service reads back must be one it can
/// represent, from any writer (migration 13); nothing changes when refused.
/// The log's `at` is the trigger's `clock_timestamp()`: only the owner
/// writes the log (migration 15; tests/roles.rs), and migration 19 dropped
/// its constraint, which cost every transition a compiled check.
#[tokio::test]
async fn dates_the_service_cannot_read_are_refused_everywhere_from_raw_sql() {
    let db = TestDb::new().await;
    let other = db.raw().await;
    let id = db.add_issues(1).await[0];
    let writes = [
        (
            format!("UPDATE issue SET updated_at = $1::text::timestamptz WHERE id = {id}"),
            "issue_updated_at_in_range",
        ),
        (
            format!(
                "INSERT INTO briefing (title, briefing_date, issue_ids, body, created_at)
                 VALUES ('t', '2026-01-01', ARRAY[{id}::bigint], 'b', $1::text::timestamptz)"
            ),
            "briefing_created_at_in_range",
        ),
        (
            "INSERT INTO pipeline_run (trigger, instance, started_at)
             VALUES ('manual', 'elsewhere', $1::text::timestamptz)"
                .into(),
            "pipeline_run_times_in_range",
        ),
        (
            "INSERT INTO pipeline_run (trigger, instance, tick)
             VALUES ('schedule', 'elsewhere', $1::text::timestamptz)"
                .into(),
            "pipeline_run_times_in_range",
        ),
    ];
    let snapshot = "SELECT (SELECT count(*) FROM briefing) + (SELECT count(*) FROM pipeline_run)
                         + (SELECT count(*) FROM issue WHERE isfinite(updated_at))
                         + (SELECT count(*) FROM issue_transition WHERE isfinite(at))";
    let before = db.scalar_i64(snapshot).await;
    for (write, constraint) in &writes {
        for at in ["infinity", "-infinity", "10000-01-01 00:00:00+00"] {
            let err = other.execute(write.as_str(), &[&at]).await.unwrap_err();
            assert_eq!(
                err.as_db_error().and_then(|e| e.constraint()),
                Some(*constraint),
                "{write} with {at}: {err}"
            );
        }
    }
    assert_eq!(db.scalar_i64(snapshot).await, before);
}

/// `issue`'s and `ai_article`'s checks hold by themselves, with every
/// trigger bypassed as logical replication and `pg_restore` do (migration
/// 21 wrote them in fewer nodes; the meaning is as before): a status
/// outside the four, a score that is not finite, a time outside the years
/// 1 to 9999 are refused, each by its constraint, and the bounds
/// themselves are taken.
#[tokio::test]
async fn the_checks_refuse_by_themselves_what_the_triggers_would() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    let bypassing = db.raw().await;
    bypassing
        .batch_execute("SET session_replication_role = replica")
        .await
        .unwrap();
    let snapshot = "SELECT (SELECT count(*) FROM ai_article)
                         + (SELECT count(*) FROM issue WHERE processing_status = 'PENDING'
                               AND score = 0 AND updated_at < '9000-01-01' AND collected_at < '9000-01-01')";
    let before = db.scalar_i64(snapshot).await;
    let refused = [
        (
            format!("UPDATE issue SET processing_status = 'SHIPPED' WHERE id = {id}"),
            "issue_processing_status_valid",
        ),
        (
            format!("UPDATE issue SET processing_status = 'done' WHERE id = {id}"),
            "issue_processing_status_valid",
        ),
        (
            format!("UPDATE issue SET score = 'NaN' WHERE id = {id}"),
            "issue_score_finite",
        ),
        (
            format!("UPDATE issue SET score = 'Infinity' WHERE id = {id}"),
            "issue_score_finite",
        ),
        (
            format!("UPDATE issue SET score = '-Infinity' WHERE id = {id}"),
            "issue_score_finite",
        ),
        (
            format!("UPDATE issue SET updated_at = 'infinity' WHERE id = {id}"),
            "issue_updated_at_in_range",
        ),
        (
            format!("UPDATE issue SET updated_at = '10000-01-01 00:00:00+00' WHERE id = {id}"),
            "issue_updated_at_in_range",
        ),
        (
            format!("UPDATE issue SET collected_at = '10000-01-01 00:00:00+00' WHERE id = {id}"),
            "issue_collected_at_in_range",
        ),
        (
            format!("UPDATE issue SET collected_at = '-infinity' WHERE id = {id}"),
            "issue_collected_at_in_range",
        ),
        (
            format!("UPDATE issue SET collected_at = '0001-01-01 00:00:00+01' WHERE id = {id}"),
            "issue_collected_at_in_range",
        ),
        (
            format!(
                "INSERT INTO ai_article (issue_id, headline, body, writer, claim_id, created_at)
                     VALUES ({id}, 'h', 'b', 'w', 1, '10000-01-01 00:00:00+00')"
            ),
            "ai_article_created_at_in_range",
        ),
        (
            format!(
                "INSERT INTO ai_article (issue_id, headline, body, writer, claim_id, created_at)
                     VALUES ({id}, 'h', 'b', 'w', 1, 'infinity')"
            ),
            "ai_article_created_at_in_range",
        ),
    ];
    for (write, constraint) in &refused {
        let err = bypassing.batch_execute(write).await.unwrap_err();
        assert_eq!(
            err.as_db_error().and_then(|e| e.constraint()),
            Some(*constraint),
            "{write}: {err}"
        );
    }
    assert_eq!(db.scalar_i64(snapshot).await, before);
    for taken in [
        format!("UPDATE issue SET processing_status = 'FAILED', score = -1e308 WHERE id = {id}"),
        format!(
            "UPDATE issue SET updated_at = '0001-01-01 00:00:00+00',
                              collected_at = '9999-12-31 23:59:59.999999+00' WHERE id = {id}"
        ),
        format!(
            "INSERT INTO ai_article (issue_id, headline, body, writer, claim_id, created_at)
             VALUES ({id}, 'h', 'b', 'w', 1, '9999-12-31 23:59:59.999999+00')"
        ),
    ] {
        bypassing.batch_execute(&taken).await.unwrap();
    }
    assert_eq!(
        db.scalar_i64(&format!(
            "SELECT count(*) FROM issue WHERE id = {id} AND processing_status = 'FAILED'
                AND updated_at = '0001-01-01 00:00:00+00'"
        ))
        .await,
        1
    );
}

/// Any writer's `collected_at` must be one the service can read back
/// (migration 8): `infinity` or the year 10000 would make every read of
/// the issue fail.
#[tokio::test]
async fn a_collected_at_the_service_cannot_read_is_refused_from_raw_sql() {
    let db = TestDb::new().await;
    let other = db.raw().await;
    let before = db.scalar_i64("SELECT count(*) FROM issue").await;
    for at in [
        "infinity",
        "-infinity",
        "10000-01-01 00:00:00+00",
        "0001-01-01 00:00:00+01",
    ] {
        let err = other
            .execute(
                "INSERT INTO issue (title, collected_at) VALUES ('x', $1::text::timestamptz)",
                &[&at],
            )
            .await
            .unwrap_err();
        let constraint = err.as_db_error().and_then(|e| e.constraint());
        assert_eq!(
            constraint,
            Some("issue_collected_at_in_range"),
            "{at}: {err}"
        );
    }
    assert_eq!(db.scalar_i64("SELECT count(*) FROM issue").await, before);
    // The bounds themselves are fine, and read back.
    let id = db.add_issues(1).await[0];
    other
        .execute(
            "UPDATE issue SET collected_at = '9999-12-31 23:59:59+00' WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let collected_at: time::OffsetDateTime = other
        .query_one("SELECT collected_at FROM issue WHERE id = $1", &[&id])
        .await
        .unwrap()
        .get(0);
    assert_eq!(collected_at.year(), 9999);
}

#[tokio::test]
async fn inserts_are_logged_as_the_initial_pending() {
    let db = TestDb::new().await;
    let (hub, stop) = db.listener().await;
    let mut live = hub.subscribe();
    let id = db.add_issues(1).await[0];
    let t = within(10, "the insert's transition", live.recv())
        .await
        .unwrap();
    assert_eq!((t.issue_id, t.from, t.to), (id, None, Status::Pending));
    stop.cancel();
}

#[tokio::test]
async fn a_raw_sql_claim_cannot_go_without_a_token_or_reuse_an_old_one() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    let other = db.raw().await;
    let token = || async {
        other
            .query_one("SELECT claim_id FROM issue WHERE id=$1", &[&id])
            .await
            .unwrap()
            .get::<_, Option<i64>>(0)
    };
    db.move_with_sql(&[id], &["IN_PROGRESS", "FAILED"]).await;
    let first = token().await.expect("a claim has a token");
    // Claiming with no token, then with the token of the earlier claim.
    for stale in [None, Some(first)] {
        other
            .execute(
                "UPDATE issue SET processing_status='IN_PROGRESS', claim_id=$2 WHERE id=$1",
                &[&id, &stale],
            )
            .await
            .unwrap();
        let now = token().await.expect("never without a token");
        assert!(now > first, "a fresh token, not {stale:?}: {now}");
        db.move_with_sql(&[id], &["FAILED"]).await;
    }
    // A writer that drew a newer token itself keeps it.
    let drawn: i64 = other
        .query_one(
            "UPDATE issue SET processing_status='IN_PROGRESS', claim_id=nextval('issue_claim_id_seq')
              WHERE id=$1 RETURNING claim_id",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(token().await, Some(drawn));
}

/// Plain SQL cannot put a claim beyond the lease reaper's reach (a lease
/// set NULL, 'infinity' or years ahead), nor clear a token on the way out
/// so that a later claim takes an earlier token again.
#[tokio::test]
async fn plain_sql_cannot_hide_a_claim_from_the_reaper_or_rewind_its_token() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    let sql = db.raw().await;
    // Seconds from now to the lease, and the token.
    let lease = || async {
        let row = sql
            .query_one(
                "SELECT extract(epoch FROM lease_until - now())::float8, claim_id
                   FROM issue WHERE id = $1",
                &[&id],
            )
            .await
            .unwrap();
        (row.get::<_, Option<f64>>(0), row.get::<_, Option<i64>>(1))
    };
    // A claim bringing an unreadable lease gets the default one (60 s).
    sql.execute(
        "UPDATE issue SET processing_status = 'IN_PROGRESS', lease_until = 'infinity' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    let (claimed_lease, token) = lease().await;
    let claimed_lease = claimed_lease.expect("a claim has a lease");
    assert!((50.0..=70.0).contains(&claimed_lease), "{claimed_lease}");
    let token = token.expect("a claim has a token");
    for (wanted, what) in [
        ("NULL", "cleared"),
        ("'infinity'", "infinite"),
        ("'-infinity'", "minus infinite"),
    ] {
        sql.execute(
            &format!("UPDATE issue SET lease_until = {wanted} WHERE id = $1"),
            &[&id],
        )
        .await
        .unwrap();
        let kept = lease().await.0.expect("still leased");
        assert!((claimed_lease - kept).abs() < 5.0, "a {what} lease: {kept}");
    }
    sql.execute(
        "UPDATE issue SET lease_until = now() + interval '10 years' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    let bounded = lease().await.0.expect("still leased");
    assert!(bounded <= 86_400.0 + 5.0, "a lease years ahead: {bounded}");
    // The service reads the issue.
    let client = db.pool.get().await.unwrap();
    let read = newsnack::db::issue::get_issue(&client, id).await.unwrap();
    assert!(read.is_some());

    // A token cleared on the way out is kept; the next claim, even one
    // naming the cleared token, gets a newer one.
    sql.execute(
        "UPDATE issue SET processing_status = 'FAILED', claim_id = NULL WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    assert_eq!(lease().await.1, Some(token), "the token is kept");
    sql.execute(
        "UPDATE issue SET processing_status = 'IN_PROGRESS', claim_id = $2 WHERE id = $1",
        &[&id, &token],
    )
    .await
    .unwrap();
    let again = lease().await.1.expect("a claim has a token");
    assert!(
        again > token,
        "a fresh token, not the earlier {token}: {again}"
    );
}

/// Migration 11 also gives claims already beyond the reaper's reach (a
/// lease NULL, infinite or years ahead, written before it) the default
/// lease, and leaves a sound lease as it is.
#[tokio::test]
async fn migration_11_brings_claims_already_out_of_reach_back() {
    use newsnack::db::migrate::{migrate, MIGRATIONS};
    let db = TestDb::empty().await;
    let mut sql = db.raw().await;
    // The schema as of migration 10.
    sql.batch_execute(
        "CREATE TABLE newsnack_migration (
             version integer PRIMARY KEY, name text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .await
    .unwrap();
    for m in MIGRATIONS.iter().filter(|m| m.version <= 10) {
        sql.batch_execute(m.sql).await.unwrap();
        sql.execute(
            "INSERT INTO newsnack_migration (version, name) VALUES ($1, $2)",
            &[&m.version, &m.name],
        )
        .await
        .unwrap();
    }
    let leases = [
        "NULL",
        "'infinity'",
        "now() + interval '10 years'",
        "now() + interval '30 seconds'",
    ];
    let mut ids = Vec::new();
    for lease in leases {
        let id: i64 = sql
            .query_one(
                "INSERT INTO issue (title) VALUES ('held') RETURNING id",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        sql.execute(
            "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
        sql.execute(
            &format!("UPDATE issue SET lease_until = {lease} WHERE id = $1"),
            &[&id],
        )
        .await
        .unwrap();
        ids.push(id);
    }
    migrate(&mut sql).await.unwrap();
    let seconds_left: Vec<f64> = first_column(
        &sql,
        "SELECT extract(epoch FROM lease_until - now())::float8 FROM issue
              WHERE id = ANY($1) ORDER BY id",
        &[&ids],
    )
    .await;
    // The default lease (60 s) for the first three; the sound one kept.
    for (lease, left) in leases.iter().zip(&seconds_left[..3]) {
        assert!((50.0..=70.0).contains(left), "{lease}: {left}");
    }
    assert!((0.0..=35.0).contains(&seconds_left[3]), "{seconds_left:?}");
}

/// An attempt is given back on entry into `FAILED` only by the transaction
/// that names itself in `newsnack.attempt_unspent` (a claim released before
/// its generation began); a session- or database-wide setting is ignored,
/// so no writer lowers the count by accident.
#[tokio::test]
async fn only_the_releasing_transaction_gives_an_attempt_back() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    let mut sql = db.raw().await;
    async fn attempts_of(sql: &tokio_postgres::Client, id: i64) -> i32 {
        sql.query_one("SELECT attempts FROM issue WHERE id = $1", &[&id])
            .await
            .unwrap()
            .get(0)
    }
    async fn claim(sql: &tokio_postgres::Client, id: i64) {
        sql.execute(
            "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    }
    const FAIL: &str =
        "UPDATE issue SET processing_status = 'FAILED', last_error = 'x' WHERE id = $1";

    // Set for the whole session (or the database): ignored.
    sql.batch_execute("SET newsnack.attempt_unspent = 'on'")
        .await
        .unwrap();
    claim(&sql, id).await;
    sql.execute(FAIL, &[&id]).await.unwrap();
    assert_eq!(attempts_of(&sql, id).await, 1);
    sql.batch_execute("RESET newsnack.attempt_unspent")
        .await
        .unwrap();

    // Named by the transaction that fails the claim: given back.
    claim(&sql, id).await;
    assert_eq!(attempts_of(&sql, id).await, 2);
    let tx = sql.transaction().await.unwrap();
    tx.execute(
        "SELECT set_config('newsnack.attempt_unspent', txid_current()::text, true)",
        &[],
    )
    .await
    .unwrap();
    tx.execute(FAIL, &[&id]).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(attempts_of(&sql, id).await, 1);
}

#[tokio::test]
async fn claim_bumps_attempts_and_issues_a_new_fencing_token_for_any_writer() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    let other = db.raw().await;
    let mut tokens = Vec::new();
    for attempt in 1..=2 {
        other
            .execute(
                "UPDATE issue SET processing_status='IN_PROGRESS' WHERE id=$1",
                &[&id],
            )
            .await
            .unwrap();
        let row = other
            .query_one(
                "SELECT attempts, claim_id, lease_until > now() FROM issue WHERE id=$1",
                &[&id],
            )
            .await
            .unwrap();
        assert_eq!(row.get::<_, i32>(0), attempt);
        assert!(row.get::<_, bool>(2), "a raw-SQL claim gets a lease");
        tokens.push(row.get::<_, i64>(1));
        other
            .execute(
                "UPDATE issue SET processing_status='FAILED', last_error='boom' WHERE id=$1",
                &[&id],
            )
            .await
            .unwrap();
    }
    assert_ne!(tokens[0], tokens[1]);
    other
        .execute(
            "UPDATE issue SET processing_status='PENDING' WHERE id=$1",
            &[&id],
        )
        .await
        .unwrap();
    let row = other
        .query_one("SELECT attempts, last_error FROM issue WHERE id=$1", &[&id])
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, i32>(0),
        0,
        "an operator reset restores the retry budget"
    );
    assert_eq!(row.get::<_, Option<String>>(1), None);
    let reason: Option<String> = other
        .query_one(
            "SELECT reason FROM issue_transition WHERE issue_id=$1 AND to_status='FAILED' ORDER BY seq LIMIT 1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(reason.as_deref(), Some("boom"));
}

/// A claim's lease counts from the claim's commit, not from its
/// transaction's start (migration 15): a raw-SQL claim whose transaction
/// stays open longer than the lease is not expired when it commits, and
/// its lease ends `lease_s` after the commit. A claim that commits
/// promptly is written once, as before.
#[tokio::test]
async fn a_lease_counts_from_the_claims_commit() {
    let db = TestDb::new().await;
    db.set("lease_s", "2").await;
    let ids = db.add_issues(3).await;
    let (slow, finished, prompt) = (ids[0], ids[1], ids[2]);
    let mut sql = db.raw().await;

    let tx = sql.transaction().await.unwrap();
    let claimed_version: String = tx
        .query_one(
            "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = $1 RETURNING ctid::text",
            &[&slow],
        )
        .await
        .unwrap()
        .get(0);
    // Claimed and finished in the same transaction: no lease to move.
    move_on(&tx, &[finished], &["IN_PROGRESS", "DONE"]).await;
    // The client is slow: its transaction stays open past the lease.
    tx.execute("SELECT pg_sleep(2.5)", &[]).await.unwrap();
    tx.commit().await.unwrap();
    let reaped = newsnack::db::issue::reap_expired(&sql, 100).await.unwrap();
    assert_eq!(reaped, Vec::<i64>::new(), "a claim just committed is live");
    let row = sql
        .query_one(
            "SELECT extract(epoch FROM i.lease_until - t.at)::float8, i.ctid::text
               FROM issue i JOIN issue_transition t ON t.issue_id = i.id AND t.to_status = 'IN_PROGRESS'
              WHERE i.id = $1",
            &[&slow],
        )
        .await
        .unwrap();
    let (after_commit, version): (f64, String) = (row.get(0), row.get(1));
    // The log's `at` is the commit-time trigger's clock, taken just after
    // the lease was moved.
    assert!(
        (1.9..=2.0).contains(&after_commit),
        "the lease ends lease_s after the commit: {after_commit}"
    );
    assert_ne!(version, claimed_version, "the lease was moved at commit");
    let row = sql
        .query_one(
            "SELECT processing_status, lease_until IS NULL FROM issue WHERE id = $1",
            &[&finished],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, bool>(1)),
        ("DONE".to_string(), true)
    );

    let tx = sql.transaction().await.unwrap();
    let claimed = tx
        .query_one(
            "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = $1
             RETURNING ctid::text, lease_until::text",
            &[&prompt],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let stored = sql
        .query_one(
            "SELECT ctid::text, lease_until::text FROM issue WHERE id = $1",
            &[&prompt],
        )
        .await
        .unwrap();
    assert_eq!(
        (stored.get::<_, String>(0), stored.get::<_, String>(1)),
        (claimed.get::<_, String>(0), claimed.get::<_, String>(1)),
        "a prompt claim is one row version with the lease it was given"
    );
}
