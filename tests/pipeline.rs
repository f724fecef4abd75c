//! The daily pipeline: a run from selection to briefing, a skip that
//! publishes nothing, assembly from exactly the given ids, settings changed
//! by SQL taking effect on the next scheduled run, and two schedulers that
//! run each tick once, surviving the loss of one; a run that loses
//! its lock, or was taken over, publishes nothing; a run whose last commit
//! lands but whose answer is lost reports what it recorded; a scheduled
//! run stopped by a shutdown decides on what is done.

mod common;

use std::process::Output;
use std::sync::Arc;

use common::fake_llm::{FakeLlm, Reply};
use common::http::get_json;
use common::process::{self, ServeProcess};
use common::{
    first_column, refusal, until_done_count, until_sql, until_sql_polled, within, Setup, TestDb,
};
use newsnack::briefing::run::Trigger;
use newsnack::writer::OfflineWriter;

fn newsnack(db: &TestDb, args: &[&str], llm: Option<&str>) -> Output {
    newsnack_at(&db.url, args, llm)
}

/// Runs the binary on the database at `url`.
fn newsnack_at(url: &str, args: &[&str], llm: Option<&str>) -> Output {
    let mut command = process::command(url, args);
    if let Some(url) = llm {
        command.env("NEWSNACK_LLM_URL", url);
    }
    command.output().unwrap()
}

/// Asserts that `run-pipeline` ended with `outcome` and no briefing (exit 3:
/// a skip, not a failure).
fn assert_no_briefing(out: &Output, outcome: &str) {
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["outcome"], outcome);
    assert_eq!(summary["briefing_id"], serde_json::Value::Null);
}

/// Runs `run-pipeline` (offline writer), asserts it published; its summary.
fn published_run(db: &TestDb) -> serde_json::Value {
    let out = tokio::task::block_in_place(|| newsnack(db, &["run-pipeline"], None));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Adds issues titled by their score, hottest last.
async fn scored_issues(db: &TestDb, scores: &[f64]) -> Vec<i64> {
    let sql = db.raw().await;
    let mut ids = Vec::new();
    for s in scores {
        let id: i64 = sql
            .query_one(
                "INSERT INTO issue (title, body, score) VALUES ($1, 'Something happened. Then more.', $2) RETURNING id",
                &[&format!("Story scored {s}"), s],
            )
            .await
            .unwrap()
            .get(0);
        ids.push(id);
    }
    ids
}

/// A one-shot `run-pipeline` retries its own targets only: failures of
/// other issues (older than `lookback_hours`, so not candidates) are left
/// to the `serve` instances. Before, its retry scheduler took every retryable
/// failure in the database: LLM slots spent on unrelated work while the
/// run's own articles waited, and claims abandoned when it exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_retries_its_own_targets_only() {
    let db = TestDb::new().await;
    db.set("retry_backoff_ms", "1").await;
    let sql = db.raw().await;
    let old: Vec<i64> = first_column(
        &sql,
        "INSERT INTO issue (title, body, score, collected_at)
             SELECT 'Last week ' || g, 'Old news.', 100, now() - interval '7 days'
               FROM generate_series(1, 10) g
             RETURNING id",
        &[],
    )
    .await;
    db.move_with_sql(&old, &["IN_PROGRESS", "FAILED"]).await;
    let before = db.scalar_i64("SELECT max(seq) FROM issue_transition").await;
    let fresh = scored_issues(&db, &[1.0, 2.0, 3.0]).await;

    let summary = published_run(&db);
    let mut targets: Vec<i64> = serde_json::from_value(summary["targets"].clone()).unwrap();
    targets.sort();
    assert_eq!(targets, fresh, "{summary}");
    let touched = db
        .ids(&format!(
            "SELECT DISTINCT issue_id FROM issue_transition
              WHERE seq > {before} AND NOT issue_id = ANY(ARRAY{fresh:?}::bigint[])
              ORDER BY 1"
        ))
        .await;
    assert_eq!(
        touched,
        Vec::<i64>::new(),
        "issues outside the run were claimed"
    );
}

/// Issues `FAILED` beyond a run's reach — fatal, out of attempts, or told
/// by the server not to retry before the run's wait would be over — are not
/// its targets: they stay as they are. One with attempts left that may be
/// retried now is a target, and the run claims it as a retry would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_leaves_issues_failed_beyond_its_reach_alone() {
    let db = TestDb::new().await;
    // The run's own retry scheduler would wait this long: the run claims.
    db.set("retry_backoff_ms", "3600000").await;
    let ids = scored_issues(&db, &[1.0, 9.0, 8.0, 7.0, 8.5]).await;
    let (fatal, exhausted, retryable, later) = (ids[1], ids[2], ids[3], ids[4]);
    db.move_with_sql(&[fatal, retryable, later], &["IN_PROGRESS", "FAILED"])
        .await;
    db.move_with_sql(
        &[exhausted],
        &[
            "IN_PROGRESS",
            "FAILED",
            "IN_PROGRESS",
            "FAILED",
            "IN_PROGRESS",
            "FAILED",
        ],
    )
    .await;
    let sql = db.raw().await;
    sql.execute(
        "UPDATE issue SET retry_not_before = CASE id WHEN $1 THEN 'infinity'
                                                     ELSE now() + interval '1 day' END
          WHERE id IN ($1, $2)",
        &[&fatal, &later],
    )
    .await
    .unwrap();

    let summary = published_run(&db);
    assert_eq!(summary["outcome"], "all_pass");
    assert_eq!(summary["targets"], serde_json::json!([retryable, ids[0]]));
    assert_eq!(summary["completed"], serde_json::json!([retryable, ids[0]]));
    for (id, attempts) in [(fatal, 1), (exhausted, 3), (later, 1)] {
        let row = sql
            .query_one(
                "SELECT processing_status, attempts FROM issue WHERE id = $1",
                &[&id],
            )
            .await
            .unwrap();
        assert_eq!(
            (row.get::<_, String>(0), row.get::<_, i32>(1)),
            ("FAILED".to_string(), attempts),
            "issue {id} is left alone"
        );
    }
}

/// A new target whose row another session has locked when the run claims
/// (another system's UPDATE in an open transaction) is skipped by `SKIP
/// LOCKED`; the run claims it again once the lock is gone, rather than
/// wait out its timeout on an issue nobody would claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_locked_by_another_session_is_claimed_once_released() {
    let db = TestDb::new().await;
    db.set("content_gen_timeout_s", "60").await;
    let ids = scored_issues(&db, &[4.0, 3.0, 2.0, 1.0]).await;
    let locked = ids[0];
    let mut other = db.raw().await;
    let transaction = other.transaction().await.unwrap();
    transaction
        .execute("UPDATE issue SET score = 5.0 WHERE id = $1", &[&locked])
        .await
        .unwrap();
    let (hub, stop) = db.listener().await;
    let url = db.url.clone();
    let run = tokio::task::spawn_blocking(move || newsnack_at(&url, &["run-pipeline"], None));
    // The others are claimed and written while the row is locked.
    until_sql(
        &db,
        &hub,
        30,
        &format!(
            "SELECT count(*) = 3 FROM issue WHERE processing_status = 'DONE' AND id <> {locked}"
        ),
    )
    .await;
    transaction.commit().await.unwrap();
    // Well before its 60 s timeout.
    let out = within(30, "the run", run).await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["outcome"], "all_pass", "{summary}");
    assert_eq!(
        summary["completed"].as_array().unwrap().len(),
        4,
        "{summary}"
    );
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_selects_the_hottest_generates_waits_and_publishes_a_briefing() {
    let db = TestDb::new().await;
    let ids = scored_issues(&db, &[1.0, 9.0, 3.0, 7.0, 5.0, 8.0, 2.0]).await;
    // An old issue is not a candidate, however hot.
    db.raw()
        .await
        .execute(
            "INSERT INTO issue (title, score, collected_at) VALUES ('stale', 100, now() - interval '3 days')",
            &[],
        )
        .await
        .unwrap();
    let summary = published_run(&db);
    let hottest = vec![ids[1], ids[5], ids[3], ids[4], ids[2]];
    assert_eq!(summary["outcome"], "all_pass");
    assert_eq!(summary["targets"], serde_json::json!(hottest));
    assert_eq!(summary["completed"], serde_json::json!(hottest));
    let briefing_id = summary["briefing_id"].as_i64().unwrap();
    let sql = db.raw().await;
    let row = sql
        .query_one(
            "SELECT issue_ids, body FROM briefing WHERE id = $1",
            &[&briefing_id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Vec<i64>>(0), hottest);
    let body: String = row.get(1);
    let order: Vec<usize> = ["9", "8", "7", "5", "3"]
        .iter()
        .map(|s| {
            body.find(&format!("Story scored {s}"))
                .expect("every article is in the document")
        })
        .collect();
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "hottest first:\n{body}"
    );
    let run = sql
        .query_one(
            "SELECT outcome, trigger, briefing_id, settings->>'top_k' FROM pipeline_run",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(run.get::<_, String>(0), "all_pass");
    assert_eq!(run.get::<_, String>(1), "manual");
    assert_eq!(run.get::<_, Option<i64>>(2), Some(briefing_id));
    assert_eq!(run.get::<_, Option<String>>(3).as_deref(), Some("5"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_articles_cannot_be_written_skips_and_publishes_nothing() {
    let db = TestDb::new().await;
    scored_issues(&db, &[1.0, 2.0, 3.0, 4.0, 5.0]).await;
    let fake = FakeLlm::start(|_, _| Reply::BadRequest).await;
    let out = tokio::task::block_in_place(|| newsnack(&db, &["run-pipeline"], Some(&fake.url)));
    assert_no_briefing(&out, "skip");
    assert_eq!(db.scalar_i64("SELECT count(*) FROM briefing").await, 0);
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM pipeline_run WHERE outcome = 'skip'")
            .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_with_no_article_records_its_outcome_and_no_briefing() {
    let db = TestDb::new().await;
    // With a minimum of 0 a run passes even when every article failed.
    db.set("content_gen_min_completion", "0").await;
    scored_issues(&db, &[1.0, 2.0, 3.0]).await;
    let fake = FakeLlm::start(|_, _| Reply::BadRequest).await;
    let out = tokio::task::block_in_place(|| newsnack(&db, &["run-pipeline"], Some(&fake.url)));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    // Every article failed: not all_pass, which needs every target DONE,
    // but timeout_pass (0 DONE meets the minimum of 0), decided as soon as
    // no target could change.
    assert_eq!(summary["outcome"], "timeout_pass", "{summary}");
    assert_eq!(summary["completed"], serde_json::json!([]), "{summary}");
    assert_eq!(summary["briefing_id"], serde_json::Value::Null);
    assert_eq!(db.scalar_i64("SELECT count(*) FROM briefing").await, 0);
    assert_eq!(
        db.scalar_i64(
            "SELECT count(*) FROM pipeline_run
              WHERE outcome = 'timeout_pass' AND error = 'no article completed: no briefing'"
        )
        .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn today_newsnack_uses_exactly_the_given_ids_or_says_which_are_not_done() {
    let db = TestDb::new().await;
    let service = db.serve("assembly", Arc::new(OfflineWriter)).await;
    let ids = scored_issues(&db, &[1.0, 2.0, 3.0, 4.0]).await;
    let http = reqwest::Client::new();
    let base = format!("http://{}", service.addr);
    let claimed = http
        .post(format!("{base}/ai-articles"))
        .json(&serde_json::json!({"issue_ids": &ids[..3]}))
        .send()
        .await
        .unwrap();
    assert_eq!(claimed.status(), 202);
    until_done_count(&db, &service.hub, 30, 3).await;

    let conflict = http
        .post(format!("{base}/today-newsnack"))
        .json(&serde_json::json!({"issue_ids": [ids[0], ids[3], 424242]}))
        .send()
        .await
        .unwrap();
    assert_eq!(conflict.status(), 409);
    let body: serde_json::Value = conflict.json().await.unwrap();
    assert_eq!(body["not_done"], serde_json::json!([ids[3], 424242]));
    assert_eq!(body["without_article"], serde_json::json!([]));
    assert!(body["error"].is_string());
    assert_eq!(db.scalar_i64("SELECT count(*) FROM briefing").await, 0);

    // Another system marks an issue DONE with plain SQL: DONE, but there is
    // no article to publish, and the answer says so.
    db.move_with_sql(&ids[3..], &["IN_PROGRESS", "DONE"]).await;
    let conflict = http
        .post(format!("{base}/today-newsnack"))
        .json(&serde_json::json!({"issue_ids": [ids[0], ids[3]]}))
        .send()
        .await
        .unwrap();
    assert_eq!(conflict.status(), 409);
    let body: serde_json::Value = conflict.json().await.unwrap();
    assert_eq!(body["not_done"], serde_json::json!([]));
    assert_eq!(body["without_article"], serde_json::json!([ids[3]]));
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("without an article"), "{error}");
    assert_eq!(db.scalar_i64("SELECT count(*) FROM briefing").await, 0);

    let made = http
        .post(format!("{base}/today-newsnack"))
        .json(&serde_json::json!({"issue_ids": [ids[2], ids[0]]}))
        .send()
        .await
        .unwrap();
    assert_eq!(made.status(), 201);
    let made: serde_json::Value = made.json().await.unwrap();
    assert_eq!(made["issue_ids"], serde_json::json!([ids[2], ids[0]]));
    let latest: serde_json::Value = get_json(&http, &format!("{base}/briefings/latest")).await;
    assert_eq!(latest["id"], made["briefing_id"]);
    let doc = latest["body"].as_str().unwrap();
    assert!(doc.contains("Story scored 3") && doc.contains("Story scored 1"));
    assert!(
        !doc.contains("Story scored 2"),
        "never pulls in other articles"
    );
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setting_changed_with_sql_changes_the_next_scheduled_run() {
    let db = TestDb::new().await;
    scored_issues(&db, &(1..=100).map(f64::from).collect::<Vec<_>>()).await;
    let service = db.serve("scheduler", Arc::new(OfflineWriter)).await;
    let sql = db.raw().await;
    sql.execute(
        "UPDATE setting SET value = 'every 1s' WHERE key = 'schedule'",
        &[],
    )
    .await
    .unwrap();
    until_sql(
        &db,
        &service.hub,
        30,
        "SELECT count(*) >= 1 FROM pipeline_run WHERE outcome = 'all_pass' AND cardinality(targets) = 5",
    )
    .await;
    sql.execute("UPDATE setting SET value = '2' WHERE key = 'top_k'", &[])
        .await
        .unwrap();
    until_sql(
        &db,
        &service.hub,
        30,
        "SELECT count(*) >= 1 FROM pipeline_run WHERE outcome = 'all_pass' AND cardinality(targets) = 2",
    )
    .await;
    sql.execute(
        "UPDATE setting SET value = 'off' WHERE key = 'schedule'",
        &[],
    )
    .await
    .unwrap();
    let bad = refusal(
        &sql,
        "UPDATE setting SET value = 'whenever' WHERE key = 'schedule'",
    )
    .await;
    assert!(bad.contains("cron expression"));
    service.stop().await.unwrap();
}

/// An instance that comes late for a tick whose run is recorded leaves that
/// run alone, even while it is `running` with no lock held: its instance may
/// be between lock sessions, about to take the lock back and finish it.
/// Other triggers still mark such runs `abandoned` (they run instead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_instance_leaves_a_tick_that_already_has_a_run_alone() {
    let db = TestDb::new().await;
    scored_issues(&db, &[1.0]).await;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let core = db.core("late", &shutdown).await;
    let tick = time::macros::datetime!(2026-11-30 06:00:00 UTC);
    let sql = db.raw().await;
    let first: i64 = sql
        .query_one(
            "INSERT INTO pipeline_run (trigger, tick, instance) VALUES ('schedule', $1, 'first')
             RETURNING id",
            &[&tick],
        )
        .await
        .unwrap()
        .get(0);
    let outcome_of_first = || async {
        db.raw()
            .await
            .query_one("SELECT outcome FROM pipeline_run WHERE id = $1", &[&first])
            .await
            .unwrap()
            .get::<_, String>(0)
    };
    let pipeline = core.pipeline();
    let late = pipeline
        .run_locked(Trigger::Schedule(tick), &shutdown)
        .await
        .unwrap();
    assert!(late.is_none(), "{late:?}");
    assert_eq!(outcome_of_first().await, "running");
    // A manual run runs instead, so it calls the first one abandoned.
    let manual = pipeline
        .run_locked(Trigger::Manual, &shutdown)
        .await
        .unwrap();
    assert!(manual.is_some());
    assert_eq!(outcome_of_first().await, "abandoned");
    shutdown.cancel();
    core.stopped().await;
}

fn spawn_serve(db: &TestDb, name: &str) -> ServeProcess {
    ServeProcess::spawn(&db.url, name, &[])
}

/// Advisory locks held by sessions that are not dedicated lock sessions
/// (i.e. pooled connections). Must always be none.
async fn locks_on_pooled_sessions(db: &TestDb) -> i64 {
    db.scalar_i64(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
          WHERE l.locktype = 'advisory' AND l.granted
            AND NOT a.application_name LIKE 'newsnack-lock:%'
            AND ((l.classid::bigint << 32) | l.objid::bigint) <> 7236284560371893001",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_schedulers_run_each_tick_once_and_the_survivor_takes_over() {
    let db = TestDb::new().await;
    scored_issues(&db, &(1..=40).map(f64::from).collect::<Vec<_>>()).await;
    db.set("top_k", "1").await;
    // The victim may die holding a claim the survivor's next run targets:
    // a short lease brings it back well within the bounds below.
    db.set("lease_s", "2").await;
    db.set("retry_backoff_ms", "50").await;
    let (hub, stop) = db.listener().await;
    let mut a = tokio::task::block_in_place(|| spawn_serve(&db, "alpha"));
    let mut b = tokio::task::block_in_place(|| spawn_serve(&db, "beta"));
    db.raw()
        .await
        .execute(
            "UPDATE setting SET value = 'every 1s' WHERE key = 'schedule'",
            &[],
        )
        .await
        .unwrap();
    until_sql(
        &db,
        &hub,
        60,
        "SELECT count(*) >= 4 FROM pipeline_run WHERE outcome <> 'running'",
    )
    .await;
    assert_eq!(locks_on_pooled_sessions(&db).await, 0);
    // Kill whichever instance ran the latest tick.
    let latest: String = db
        .raw()
        .await
        .query_one(
            "SELECT instance FROM pipeline_run ORDER BY tick DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let (victim, survivor_name) = if latest == "alpha" {
        (&mut a, "beta")
    } else {
        (&mut b, "alpha")
    };
    victim.kill();
    let killed_at = db
        .scalar_i64("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .await;
    until_sql(
        &db,
        &hub,
        60,
        &format!(
            "SELECT count(*) >= 2 FROM pipeline_run WHERE instance = '{survivor_name}'
               AND tick > to_timestamp({killed_at} / 1000.0) AND outcome <> 'running'"
        ),
    )
    .await;
    assert_eq!(locks_on_pooled_sessions(&db).await, 0);
    // One run per tick is the unique index's to keep; what two schedulers
    // could still do wrong is publish a tick twice, or publish for a run
    // they did not record. Every briefing is exactly one tick's: that of
    // the tick's one scheduled run.
    let briefings = db.scalar_i64("SELECT count(*) FROM briefing").await;
    assert!(briefings > 0, "the ticks published briefings");
    assert_eq!(
        db.scalar_i64(
            "SELECT count(*) FROM briefing b
              WHERE (SELECT count(*) FROM pipeline_run r
                      WHERE r.briefing_id = b.id AND r.trigger = 'schedule') <> 1"
        )
        .await,
        0,
        "every briefing is one tick's"
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM pipeline_run WHERE outcome IN ('error')")
            .await,
        0
    );
    let survivor = if survivor_name == "alpha" {
        &mut a
    } else {
        &mut b
    };
    let status = tokio::task::block_in_place(|| survivor.terminate());
    assert!(status.success());
    stop.cancel();
}

/// Starts `run-pipeline` over five fresh issues against `llm`, and returns
/// it once all five are claimed (so the run holds its lock and waits).
async fn run_pipeline_in_flight(
    db: &TestDb,
    hub: &newsnack::events::hub::EventHub,
    llm: &str,
) -> std::process::Child {
    let ids = scored_issues(db, &[1.0, 2.0, 3.0, 4.0, 5.0]).await;
    let child = process::command(&db.url, &["run-pipeline"])
        .env("NEWSNACK_LLM_URL", llm)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let in_list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    until_sql(
        db,
        hub,
        30,
        &format!("SELECT count(*) = 5 FROM issue WHERE id IN ({in_list}) AND processing_status = 'IN_PROGRESS'"),
    )
    .await;
    child
}

/// Ends the session holding the pipeline lock (as `pg_terminate_backend`,
/// a failover or a broken connection would). When `take_it`, `sql`'s
/// session first queues for the lock, and only then is the holder ended,
/// so it is granted the lock the moment the ended session lets go, before
/// the run can take it again; otherwise waits until the session is gone.
async fn end_the_lock_session(db: &TestDb, sql: &tokio_postgres::Client, take_it: bool) {
    let holders = "SELECT pid FROM pg_stat_activity
                    WHERE datname = current_database() AND application_name LIKE 'newsnack-lock:pipeline:%'";
    if !take_it {
        let ended: i64 = sql
            .query_one(
                &format!("SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) FROM ({holders}) h"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(ended, 1, "the one session holding the pipeline lock ended");
        return;
    }
    let ender = db.raw().await;
    let queued = sql.query_one("SELECT pg_advisory_lock(7236284560371893004)::text", &[]);
    let end = async {
        // The lock request is queued once the server shows it waiting.
        let waiting = "SELECT count(*) FROM pg_locks
                        WHERE locktype = 'advisory' AND NOT granted
                          AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";
        within(10, "the lock request to queue", async {
            while ender
                .query_one(waiting, &[])
                .await
                .unwrap()
                .get::<_, i64>(0)
                != 1
            {
                tokio::task::yield_now().await;
            }
        })
        .await;
        ender
            .query_one(
                &format!(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM ({holders}) h"
                ),
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let (granted, ended) = tokio::join!(queued, end);
    granted.unwrap();
    assert_eq!(ended, 1, "the one session holding the pipeline lock ended");
}

async fn finished(child: std::process::Child) -> Output {
    within(
        60,
        "run-pipeline to finish",
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await
    .unwrap()
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_lock_another_session_took_stops_at_once_and_publishes_nothing() {
    let db = TestDb::new().await;
    // Generations never finish, and the wait would last ten minutes.
    let fake = FakeLlm::start(|_, _| Reply::Hang).await;
    let (hub, stop) = db.listener().await;
    let child = run_pipeline_in_flight(&db, &hub, &fake.url).await;
    let other = db.raw().await;
    end_the_lock_session(&db, &other, true).await;

    let out = finished(child).await;
    // A run that failed is a failure (exit 1, why on stderr), not a skip.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the run ended as error: the pipeline lock was lost"),
        "{stderr}"
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["outcome"], "error");
    assert_eq!(summary["briefing_id"], serde_json::Value::Null);
    let run = other
        .query_one(
            "SELECT outcome, error, briefing_id, finished_at IS NOT NULL FROM pipeline_run",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(run.get::<_, String>(0), "error");
    assert!(
        run.get::<_, String>(1).contains("pipeline lock was lost"),
        "{:?}",
        run.get::<_, String>(1)
    );
    assert_eq!(run.get::<_, Option<i64>>(2), None);
    assert!(run.get::<_, bool>(3));
    assert_eq!(db.scalar_i64("SELECT count(*) FROM briefing").await, 0);
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_lock_session_ends_takes_the_lock_again_and_publishes() {
    let db = TestDb::new().await;
    let fake = FakeLlm::start(|_, _| Reply::Slow {
        delay: std::time::Duration::from_secs(6),
        content: "A headline\n\nFirst paragraph.\n\nSecond paragraph.".into(),
    })
    .await;
    let (hub, stop) = db.listener().await;
    let child = run_pipeline_in_flight(&db, &hub, &fake.url).await;
    let other = db.raw().await;
    end_the_lock_session(&db, &other, false).await;

    let out = finished(child).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["outcome"], "all_pass");
    assert!(summary["briefing_id"].is_i64(), "{summary}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("took the lock again"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(db.scalar_i64("SELECT count(*) FROM briefing").await, 1);
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_another_instance_took_over_cannot_record_its_outcome() {
    use newsnack::db::pipeline_run::{self, RunRecord};
    let db = TestDb::new().await;
    let client = db.pool.get().await.unwrap();
    let run_id = pipeline_run::start(&client, "manual", None, "alpha", &serde_json::json!({}))
        .await
        .unwrap()
        .unwrap();
    // Instance beta took the lock after alpha lost it, and so marked
    // alpha's run abandoned.
    assert_eq!(pipeline_run::abandon_stale(&client).await.unwrap(), 1);
    let late = RunRecord {
        outcome: "all_pass".into(),
        ..RunRecord::default()
    };
    assert!(!pipeline_run::finish(&client, run_id, &late).await.unwrap());
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM pipeline_run WHERE outcome = 'abandoned'")
            .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_alone_says_which_session_holds_the_pipeline_lock() {
    use newsnack::db::advisory::{self, AdvisoryLock};
    let db = TestDb::new().await;
    let first = AdvisoryLock::try_acquire(&db.endpoint, advisory::PIPELINE, "first")
        .await
        .unwrap()
        .expect("the lock is free");
    let client = db.pool.get().await.unwrap();
    assert!(advisory::held_by(&client, advisory::PIPELINE, first.pid())
        .await
        .unwrap());
    assert!(
        AdvisoryLock::try_acquire(&db.endpoint, advisory::PIPELINE, "second")
            .await
            .unwrap()
            .is_none(),
        "held, so not taken"
    );
    // Once the server has ended the holder's session, it holds nothing,
    // whether or not its own side has noticed yet; the lock is free.
    let ended: bool = db
        .raw()
        .await
        .query_one("SELECT pg_terminate_backend($1, 10000)", &[&first.pid()])
        .await
        .unwrap()
        .get(0);
    assert!(ended);
    assert!(!advisory::held_by(&client, advisory::PIPELINE, first.pid())
        .await
        .unwrap());
    let second = AdvisoryLock::acquire_within(
        &db.endpoint,
        advisory::PIPELINE,
        "second",
        std::time::Duration::from_secs(2),
    )
    .await
    .unwrap()
    .expect("free once its holder is gone");
    assert!(advisory::held_by(&client, advisory::PIPELINE, second.pid())
        .await
        .unwrap());
    // Held by another, waiting gives up after its bound.
    assert!(AdvisoryLock::acquire_within(
        &db.endpoint,
        advisory::PIPELINE,
        "third",
        std::time::Duration::from_millis(200),
    )
    .await
    .unwrap()
    .is_none());
}

/// A lock session this process let go of but the server still keeps (its
/// connection broken silently, so the server notices only when its TCP
/// keepalive gives up, two hours by default) is ended when this process
/// takes the lock again; a session of another process is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_session_this_process_let_go_of_does_not_keep_the_lock() {
    use newsnack::db::advisory::{self, AdvisoryLock};
    let db = TestDb::new().await;
    // A session like the ones this process's locks open, holding the lock
    // with no `AdvisoryLock` of this process owning it.
    let hold_as = |name: String| {
        let mut config = db.config.clone();
        config.application_name(name);
        async move {
            let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
            let ended = tokio::spawn(connection);
            client
                .execute("SELECT pg_advisory_lock($1)", &[&advisory::PIPELINE])
                .await
                .unwrap();
            (client, ended)
        }
    };
    let (foreign, _foreign_connection) =
        hold_as("newsnack-lock:pipeline:0000beef:another-process".into()).await;
    assert!(
        AdvisoryLock::try_acquire(&db.endpoint, advisory::PIPELINE, "taker")
            .await
            .unwrap()
            .is_none(),
        "another process's lock is never taken away"
    );
    assert!(!foreign.is_closed());
    drop(foreign);

    let (orphan, orphan_connection) =
        hold_as(advisory::session_name(advisory::PIPELINE, "orphan")).await;
    let orphan_pid: i32 = orphan
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let taken = AdvisoryLock::try_acquire(&db.endpoint, advisory::PIPELINE, "taker")
        .await
        .unwrap()
        .expect("the orphaned session is ended and the lock taken");
    within(10, "the orphaned session to end", orphan_connection)
        .await
        .unwrap()
        .expect_err("ended by the server");
    let client = db.pool.get().await.unwrap();
    assert!(advisory::held_by(&client, advisory::PIPELINE, taken.pid())
        .await
        .unwrap());
    assert!(!advisory::held_by(&client, advisory::PIPELINE, orphan_pid)
        .await
        .unwrap());
}

/// A TCP proxy to the test database that loses the answer to one commit:
/// on the first connection that records a run's outcome (`UPDATE
/// pipeline_run SET finished_at ...`), it lets the `COMMIT` that follows
/// through to the server, swallows the server's answer and closes the
/// connection on the client's side, as a network failure mid-commit would.
struct LosesACommitAnswer {
    addr: std::net::SocketAddr,
    /// Set once an answer was lost.
    lost: Arc<std::sync::atomic::AtomicBool>,
}

impl LosesACommitAnswer {
    async fn start(server: std::net::SocketAddr) -> LosesACommitAnswer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let lost = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let lost_flag = lost.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = tokio::net::TcpStream::connect(server).await else {
                    continue;
                };
                tokio::spawn(relay(client, upstream, armed.clone(), lost_flag.clone()));
            }
        });
        LosesACommitAnswer { addr, lost }
    }
}

async fn relay(
    client: tokio::net::TcpStream,
    upstream: tokio::net::TcpStream,
    armed: Arc<std::sync::atomic::AtomicBool>,
    lost: Arc<std::sync::atomic::AtomicBool>,
) {
    use std::sync::atomic::Ordering::SeqCst;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = upstream.into_split();
    let cut = tokio_util::sync::CancellationToken::new();
    let cut_up = cut.clone();
    let up = async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut records_outcome = false;
        while let Ok(n) = from_client.read(&mut buf).await {
            if n == 0 {
                break;
            }
            let chunk = &buf[..n];
            let commit = memchr::memmem::find(chunk, b"COMMIT\0").is_some();
            records_outcome |=
                memchr::memmem::find(chunk, b"UPDATE pipeline_run SET finished_at").is_some();
            if records_outcome && commit && armed.swap(false, SeqCst) {
                // Cut before the server can answer, then let the commit through.
                cut_up.cancel();
                let _ = to_server.write_all(chunk).await;
                return;
            }
            if commit {
                records_outcome = false;
            }
            if to_server.write_all(chunk).await.is_err() {
                break;
            }
        }
    };
    let down = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = from_server.read(&mut buf).await {
            if n == 0 {
                break;
            }
            if cut.is_cancelled() {
                // The commit's answer: dropped, and the client cut off.
                eprintln!(
                    "DBG dropped {:?}",
                    String::from_utf8_lossy(&buf[..n.min(80)])
                );
                lost.store(true, SeqCst);
                break;
            }
            if to_client.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    tokio::join!(up, down);
}

/// A run whose last commit landed but whose answer was lost reports what it
/// recorded: its briefing is published once, and the run is not mistaken
/// for one another instance took over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_last_commit_answer_is_lost_reports_what_it_recorded() {
    let db = TestDb::new().await;
    let ids = scored_issues(&db, &[4.0, 3.0, 2.0]).await;
    let (host, port) = match (db.config.get_hosts(), db.config.get_ports()) {
        ([tokio_postgres::config::Host::Tcp(host)], [port]) => (host.clone(), *port),
        _ => panic!("this test needs the database over TCP, got {:?}", db.config),
    };
    let server = tokio::net::lookup_host((host.as_str(), port))
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = LosesACommitAnswer::start(server).await;
    let through_proxy =
        db.url
            .replacen(&format!(":{port}/"), &format!(":{}/", proxy.addr.port()), 1);
    assert_ne!(through_proxy, db.url, "the proxy's URL");

    let out = tokio::task::block_in_place(|| newsnack_at(&through_proxy, &["run-pipeline"], None));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        proxy.lost.load(std::sync::atomic::Ordering::SeqCst),
        "no commit answer was lost: {stderr}"
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("reported an error but was recorded"),
        "{stderr}"
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["outcome"], "all_pass");
    let briefing_id = summary["briefing_id"].as_i64().expect("a briefing");
    let sql = db.raw().await;
    let run = sql
        .query_one("SELECT outcome, briefing_id FROM pipeline_run", &[])
        .await
        .unwrap();
    assert_eq!(run.get::<_, String>(0), "all_pass");
    assert_eq!(run.get::<_, Option<i64>>(1), Some(briefing_id));
    let briefings: Vec<Vec<i64>> = first_column(&sql, "SELECT issue_ids FROM briefing", &[]).await;
    assert_eq!(briefings, vec![ids.clone()]);
}

/// Writes like the built-in writer, except for the issues in `never`,
/// whose generation never ends.
struct NeverFor {
    never: Vec<i64>,
}

impl newsnack::writer::Writer for NeverFor {
    fn name(&self) -> &str {
        "never-for-some"
    }
    fn write<'a>(
        &'a self,
        issue: newsnack::writer::IssueText<'a>,
    ) -> futures::future::BoxFuture<
        'a,
        Result<newsnack::writer::Article, newsnack::writer::WriteError>,
    > {
        Box::pin(async move {
            if self.never.contains(&issue.id) {
                std::future::pending::<()>().await;
            }
            OfflineWriter.write(issue).await
        })
    }
}

/// An instance stopped (SIGTERM, a rolling restart) while its scheduled
/// run waits decides that wait at once, as at its timeout: three of five
/// articles are done, enough, so the tick's briefing is published with
/// them instead of the run being abandoned and the tick lost (its record
/// keeps any other instance from running it again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_run_stopped_by_a_shutdown_publishes_what_was_done() {
    let db = TestDb::new().await;
    let ids = scored_issues(&db, &[1.0, 2.0, 3.0, 4.0, 5.0]).await;
    db.set("content_gen_timeout_s", "3600").await;
    db.set("content_gen_min_completion", "3").await;
    // The two coldest never finish.
    let writer = NeverFor {
        never: ids[..2].to_vec(),
    };
    let service = db
        .serve_with(
            "restarting",
            Arc::new(writer),
            Setup {
                grace: Some(std::time::Duration::from_millis(200)),
                ..Setup::default()
            },
        )
        .await;
    db.set("schedule", "every 1s").await;
    until_sql(
        &db,
        &service.hub,
        30,
        "SELECT (SELECT count(*) FROM issue WHERE processing_status = 'DONE') = 3
            AND EXISTS (SELECT 1 FROM pipeline_run WHERE outcome = 'running')",
    )
    .await;
    service.stop().await.unwrap();
    let row = db
        .query_one(
            "SELECT r.outcome, r.completed, b.issue_ids
               FROM pipeline_run r LEFT JOIN briefing b ON b.id = r.briefing_id",
            &[],
        )
        .await;
    let hottest_three: Vec<i64> = ids[2..].iter().rev().copied().collect();
    assert_eq!(row.get::<_, String>(0), "timeout_pass");
    assert_eq!(row.get::<_, Vec<i64>>(1), hottest_three);
    assert_eq!(row.get::<_, Option<Vec<i64>>>(2), Some(hottest_three));
}

/// A tick at which another session holds the pipeline lock but records no
/// run (an instance that took the lock, then failed before its run began)
/// is tried again while it is fresh, so it is not lost on every instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_whose_lock_holder_records_no_run_is_run_by_another_instance() {
    use newsnack::db::advisory::{self, AdvisoryLock};
    let db = TestDb::new().await;
    db.count_statements().await;
    scored_issues(&db, &[1.0, 2.0, 3.0]).await;
    let service = db.serve("second", Arc::new(OfflineWriter)).await;
    let holder = AdvisoryLock::try_acquire(&db.endpoint, advisory::PIPELINE, "first")
        .await
        .unwrap()
        .expect("the lock is free");
    // One tick, a few seconds from now (a daily cron expression with
    // seconds, UTC), while the lock is held.
    let tick = (time::OffsetDateTime::now_utc() + time::Duration::seconds(4))
        .replace_nanosecond(0)
        .unwrap();
    db.set(
        "schedule",
        &format!("{} {} {} * * *", tick.second(), tick.minute(), tick.hour()),
    )
    .await;
    // The holder lets go without recording a run, once the service has met
    // the tick with the lock held: it then looks for the tick's run (the
    // statement below), which it runs only when it could not take the lock.
    until_sql_polled(
        &db,
        30,
        "SELECT COALESCE(sum(calls), 0) > 0 FROM pg_stat_statements
          WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
            AND query LIKE 'SELECT EXISTS (SELECT % FROM pipeline_run WHERE trigger = % AND tick = %'",
    )
    .await;
    holder.release().await;
    // The run's outcome is recorded after its last transition, so this
    // looks at the table until it is there.
    let ran = format!(
        "SELECT count(*) FROM pipeline_run WHERE tick = '{}' AND outcome = 'all_pass'",
        tick.format(&time::format_description::well_known::Rfc3339)
            .unwrap()
    );
    within(30, "the tick's run", async {
        while db.scalar_i64(&ran).await == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;
    service.stop().await.unwrap();
}
