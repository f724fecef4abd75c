//! Counts per status (migration 27) stay exact while claims, completions,
//! failures, raw-SQL updates, inserts, deletes, folds and a TRUNCATE run at
//! once: every snapshot's counts equal `count(*) ... GROUP BY` in that
//! snapshot. A count kept by read-then-write instead of appended deltas
//! loses updates under the same load, and the same check catches it.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::TestDb;
use tokio_postgres::IsolationLevel;

/// Each writer's rounds; enough overlap that lost updates show.
const ROUNDS: usize = 150;
const WRITERS: usize = 6;

/// The trigger function a careless design would write: it reads the
/// current count and writes it back changed, with nothing to stop two
/// transactions reading the same value.
const READ_THEN_WRITE: &str = "
CREATE OR REPLACE FUNCTION issue_status_count_changed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE was_old bigint; was_new bigint;
BEGIN
    SELECT COALESCE(sum(n), 0) INTO was_old FROM issue_status_delta WHERE status = OLD.processing_status;
    SELECT COALESCE(sum(n), 0) INTO was_new FROM issue_status_delta WHERE status = NEW.processing_status;
    DELETE FROM issue_status_delta WHERE status IN (OLD.processing_status, NEW.processing_status);
    INSERT INTO issue_status_delta VALUES (OLD.processing_status, was_old - 1), (NEW.processing_status, was_new + 1);
    RETURN NULL;
END $$";

/// The kept counts and the counted ones, read in one snapshot.
async fn both_counts(
    client: &mut tokio_postgres::Client,
) -> (BTreeMap<String, i64>, BTreeMap<String, i64>) {
    let tx = client
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .start()
        .await
        .unwrap();
    // A count that cannot even be read (the careless variant's overflow)
    // shows as a mismatch too.
    let kept = match newsnack::db::issue::count_by_status(&tx).await {
        Ok(counts) => counts
            .into_iter()
            .map(|(s, n)| (s.as_str().to_string(), n))
            .collect(),
        Err(e) => {
            return (
                BTreeMap::from([(format!("unreadable: {e}"), -1)]),
                BTreeMap::new(),
            )
        }
    };
    let mut counted: BTreeMap<String, i64> = ["PENDING", "IN_PROGRESS", "DONE", "FAILED"]
        .iter()
        .map(|s| (s.to_string(), 0))
        .collect();
    for row in tx
        .query(
            "SELECT processing_status, count(*) FROM issue GROUP BY processing_status",
            &[],
        )
        .await
        .unwrap()
    {
        counted.insert(row.get(0), row.get(1));
    }
    tx.commit().await.unwrap();
    (kept, counted)
}

/// Runs the mixed load on `db` and answers every snapshot where the kept
/// counts differed from the counted ones.
async fn mismatches_under_load(db: &TestDb) -> Vec<String> {
    let ids = db.add_issues(WRITERS * 20).await;
    let done = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for (w, mine) in ids.chunks(20).map(|c| c.to_vec()).enumerate() {
        let client = db.raw().await;
        writers.push(tokio::spawn(async move {
            for round in 0..ROUNDS {
                let id = mine[round % mine.len()];
                // A claim as the service makes it, then a failure and a
                // retry or a completion by raw SQL; refusals (a deadlock of
                // the careless variant, an issue already DONE) change nothing.
                let _ = client
                    .query(
                        "SELECT id FROM newsnack_claim(ARRAY[$1::bigint], 'w', 60, NULL)",
                        &[&id],
                    )
                    .await;
                let next = if round % 5 == w % 5 { "DONE" } else { "FAILED" };
                let _ = client
                    .execute(
                        "UPDATE issue SET processing_status = $2 WHERE id = $1 AND processing_status = 'IN_PROGRESS'",
                        &[&id, &next],
                    )
                    .await;
                let _ = client
                    .execute(
                        "UPDATE issue SET processing_status = 'PENDING' WHERE id = $1 AND processing_status = 'FAILED'",
                        &[&id],
                    )
                    .await;
            }
        }));
    }
    // Inserts and deletes (as a prune would), several rows a statement.
    let churn = {
        let client = db.raw().await;
        tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let _ = client
                    .execute(
                        "INSERT INTO issue (title) SELECT 'churn ' || g FROM generate_series(1, 3) g",
                        &[],
                    )
                    .await;
                let _ = client
                    .execute(
                        "DELETE FROM issue WHERE id IN (SELECT id FROM issue WHERE title LIKE 'churn %'
                                                        ORDER BY id LIMIT 2)",
                        &[],
                    )
                    .await;
            }
        })
    };
    // Folds as the reaper makes them, racing the writers and each other.
    let mut folders = Vec::new();
    for _ in 0..2 {
        let client = db.raw().await;
        let done = done.clone();
        folders.push(tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                let _ = client
                    .query("SELECT newsnack_fold_status_counts(0)", &[])
                    .await;
            }
        }));
    }
    let mut checker = db.raw().await;
    let mut mismatches = Vec::new();
    let mut finished = false;
    while !finished {
        finished = writers.iter().all(|w| w.is_finished()) && churn.is_finished();
        let (kept, counted) = both_counts(&mut checker).await;
        if kept != counted {
            mismatches.push(format!("kept {kept:?}, counted {counted:?}"));
        }
    }
    done.store(true, Ordering::Relaxed);
    for task in writers.into_iter().chain([churn]).chain(folders) {
        task.await.unwrap();
    }
    let (kept, counted) = both_counts(&mut checker).await;
    if kept != counted {
        mismatches.push(format!("at the end: kept {kept:?}, counted {counted:?}"));
    }
    mismatches
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn counts_stay_exact_under_concurrent_writes_folds_and_truncate() {
    let db = TestDb::new().await;
    let mismatches = mismatches_under_load(&db).await;
    assert!(mismatches.is_empty(), "counts drifted: {mismatches:#?}");

    // A TRUNCATE leaves zeros, and counting starts again from there.
    let mut client = db.raw().await;
    client.execute("TRUNCATE issue CASCADE", &[]).await.unwrap();
    let (kept, _) = both_counts(&mut client).await;
    assert!(kept.values().all(|&n| n == 0), "after TRUNCATE: {kept:?}");
    db.add_issues(7).await;
    let (kept, counted) = both_counts(&mut client).await;
    assert_eq!(kept, counted);
    assert_eq!(kept["PENDING"], 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_then_write_count_drifts_under_the_same_load() {
    let db = TestDb::new().await;
    db.raw().await.batch_execute(READ_THEN_WRITE).await.unwrap();
    let mismatches = mismatches_under_load(&db).await;
    assert!(
        !mismatches.is_empty(),
        "the read-then-write count stayed exact, so the load does not test concurrency"
    );
}

#[tokio::test]
async fn folding_keeps_the_counts_and_leaves_one_row_per_status() {
    let db = TestDb::new().await;
    let ids = db.add_issues(40).await;
    db.move_with_sql(&ids[..30], &["IN_PROGRESS"]).await;
    db.move_with_sql(&ids[..20], &["DONE"]).await;
    db.move_with_sql(&ids[20..25], &["FAILED"]).await;
    let mut client = db.raw().await;
    let before = both_counts(&mut client).await;
    assert_eq!(before.0, before.1);

    let rows = "SELECT count(*) FROM issue_status_delta";
    let many = db.scalar_i64(rows).await;
    assert!(many > 4, "the moves appended deltas: {many}");
    // Below the threshold nothing is folded.
    let left = newsnack::db::issue::fold_status_counts(&client, many as i32)
        .await
        .unwrap();
    assert_eq!(left, 0);
    assert_eq!(db.scalar_i64(rows).await, many);
    let folded = newsnack::db::issue::fold_status_counts(&client, 0)
        .await
        .unwrap();
    assert_eq!(folded, many);
    // PENDING 10, IN_PROGRESS 5, DONE 20, FAILED 5: one row each.
    assert_eq!(db.scalar_i64(rows).await, 4);
    let after = both_counts(&mut client).await;
    assert_eq!(after, before);
}
