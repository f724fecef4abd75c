//! The transition log is commit-ordered: a transaction that took a `seq`
//! first commits first, so a reader following `seq > last` never skips a
//! row. Shown against a naive log without that rule, which does skip. And
//! one issue's transitions are read without scanning the rest of the log.

mod common;

use common::{first_column, within, TestDb};
use newsnack::model::status::Status;
use tokio_postgres::Client;

/// Waits until `pid` is blocked on a lock.
async fn until_blocked(observer: &Client, pid: i32) {
    within(10, "the second transaction to block", async {
        loop {
            let blocked: bool = observer
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted)",
                    &[&pid],
                )
                .await
                .unwrap()
                .get(0);
            if blocked {
                return;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
}

/// Reads `seq > last` like a naive follower would.
async fn read_after(client: &Client, table: &str, last: i64) -> Vec<i64> {
    first_column(
        client,
        &format!("SELECT seq FROM {table} WHERE seq > $1 ORDER BY seq"),
        &[&last],
    )
    .await
}

#[tokio::test]
async fn a_naive_sequence_log_lets_a_follower_skip_a_late_commit() {
    // The broken variant: `seq` from a plain sequence, no commit ordering.
    let db = TestDb::new().await;
    let setup = db.raw().await;
    setup
        .batch_execute("CREATE TABLE naive_log (seq bigserial PRIMARY KEY, note text)")
        .await
        .unwrap();
    let a = db.raw().await;
    let b = db.raw().await;
    a.batch_execute("BEGIN; INSERT INTO naive_log (note) VALUES ('a')")
        .await
        .unwrap();
    b.batch_execute("BEGIN; INSERT INTO naive_log (note) VALUES ('b'); COMMIT")
        .await
        .unwrap();
    let follower = db.raw().await;
    let first = read_after(&follower, "naive_log", 0).await;
    assert_eq!(first, vec![2], "the higher seq is visible first");
    a.batch_execute("COMMIT").await.unwrap();
    let next = read_after(&follower, "naive_log", *first.last().unwrap()).await;
    assert!(
        next.is_empty(),
        "the follower never sees seq 1: it was skipped"
    );
}

#[tokio::test]
async fn the_transition_log_never_lets_a_lower_seq_commit_after_a_higher_one() {
    let db = TestDb::new().await;
    let ids = db.add_issues(2).await;
    let a = db.raw().await;
    let b = db.raw().await;
    let observer = db.raw().await;
    // A takes its seq now (constraints immediate) and stays open.
    a.batch_execute("BEGIN; SET CONSTRAINTS ALL IMMEDIATE")
        .await
        .unwrap();
    a.execute(
        "UPDATE issue SET processing_status='IN_PROGRESS' WHERE id=$1",
        &[&ids[0]],
    )
    .await
    .unwrap();
    let a_seq: i64 = a
        .query_one(
            "SELECT max(seq) FROM issue_transition WHERE issue_id=$1",
            &[&ids[0]],
        )
        .await
        .unwrap()
        .get(0);
    // B tries to commit a later transition first: it must wait for A.
    let b_pid: i32 = b
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let b_id = ids[1];
    let b_commit = tokio::spawn(async move {
        b.execute(
            "UPDATE issue SET processing_status='IN_PROGRESS' WHERE id=$1",
            &[&b_id],
        )
        .await
        .unwrap();
        b
    });
    until_blocked(&observer, b_pid).await;
    let last_before = db
        .scalar_i64("SELECT COALESCE(max(seq), 0) FROM issue_transition")
        .await;
    assert!(last_before < a_seq, "nothing of A or B is visible yet");
    a.batch_execute("COMMIT").await.unwrap();
    let b = within(10, "B to commit", b_commit).await.unwrap();
    let b_seq: i64 = b
        .query_one(
            "SELECT max(seq) FROM issue_transition WHERE issue_id=$1",
            &[&b_id],
        )
        .await
        .unwrap()
        .get(0);
    assert!(b_seq > a_seq, "B's seq ({b_seq}) must follow A's ({a_seq})");
    // A follower resuming from what it saw before gets both, in order.
    let seen = read_after(&observer, "issue_transition", last_before).await;
    assert_eq!(seen, vec![a_seq, b_seq]);
}

#[tokio::test]
async fn stream_after_gives_history_then_live_without_gaps_or_repeats() {
    let db = TestDb::new().await;
    let ids = db.add_issues(30).await;
    let (hub, stop) = db.listener().await;
    let mut stream = hub.stream_after(0, None);
    let claim = db.claim_one_by_one(ids.clone()).await;
    let mut seqs = Vec::new();
    let mut claimed = Vec::new();
    within(30, "60 transitions", async {
        while seqs.len() < 60 {
            let t = stream.next().await.unwrap();
            seqs.push(t.seq);
            if t.to == Status::InProgress {
                claimed.push(t.issue_id);
            }
        }
    })
    .await;
    claim.await.unwrap();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "strictly increasing: {seqs:?}"
    );
    assert_eq!(claimed, ids, "every claim once, in commit order");
    let total = db.scalar_i64("SELECT count(*) FROM issue_transition").await;
    assert_eq!(total, 60);
    // Nothing more was pending in the stream: the next item is a
    // transition committed after all of these.
    let sentinel = db.add_issues(1).await[0];
    let next = within(30, "the sentinel's transition", stream.next())
        .await
        .unwrap();
    assert_eq!(
        (next.issue_id, next.to),
        (sentinel, Status::Pending),
        "no repeat or stray transition before it"
    );
    stop.cancel();
}

#[tokio::test]
async fn a_filtered_stream_resumes_from_a_seq_for_one_issue() {
    let db = TestDb::new().await;
    let ids = db.add_issues(3).await;
    let writer = db.raw().await;
    for id in &ids {
        writer
            .execute(
                "UPDATE issue SET processing_status='IN_PROGRESS' WHERE id=$1",
                &[id],
            )
            .await
            .unwrap();
    }
    let (hub, stop) = db.listener().await;
    let mut stream = hub.stream_after(0, Some(ids[1]));
    let first = within(10, "the insert", stream.next()).await.unwrap();
    let second = within(10, "the claim", stream.next()).await.unwrap();
    assert_eq!((first.issue_id, first.to), (ids[1], Status::Pending));
    assert_eq!((second.issue_id, second.to), (ids[1], Status::InProgress));
    // Resume after the first: only the second again.
    let mut resumed = hub.stream_after(first.seq, Some(ids[1]));
    assert_eq!(within(10, "resume", resumed.next()).await.unwrap(), second);
    stop.cancel();
}

/// Reading one issue's transitions (`GET /events?issue_id=`, `tail
/// --issue`) reads that issue's rows of the log, not the whole log after
/// the resume point: the generic plan (the pool's sessions use generic
/// plans) reads a handful of rows among 3,000 other issues' transitions.
#[tokio::test]
async fn one_issues_transitions_are_read_without_scanning_the_log() {
    let db = TestDb::new().await;
    let ids = db.add_issues(3_000).await;
    let target = ids[1_500];
    db.move_with_sql(&[target], &["IN_PROGRESS", "FAILED", "IN_PROGRESS", "DONE"])
        .await;
    let pool_client = db.pool.get().await.unwrap();
    let read = newsnack::db::transition::read_after(&**pool_client, 0, Some(target), 100)
        .await
        .unwrap();
    let statuses: Vec<Status> = read.iter().map(|t| t.to).collect();
    assert_eq!(
        statuses,
        [
            Status::Pending,
            Status::InProgress,
            Status::Failed,
            Status::InProgress,
            Status::Done
        ]
    );
    assert!(read.iter().all(|t| t.issue_id == target));

    let client = db.raw().await;
    client
        .batch_execute(&format!(
            "SET plan_cache_mode = force_generic_plan;
             PREPARE for_issue(bigint, bigint, bigint) AS {};",
            newsnack::db::transition::READ_AFTER_FOR_ISSUE
        ))
        .await
        .unwrap();
    let rows = common::rows_read(
        &client,
        "issue_transition",
        &format!("EXECUTE for_issue(0, {target}, 100)"),
    )
    .await;
    assert!(
        rows <= 10.0,
        "reading one issue's 5 transitions read {rows} rows"
    );
}
