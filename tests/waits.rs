//! The smart wait resolves on events: each outcome, early resolution, no
//! query between the deciding commit and the answer, and the HTTP form.

mod common;

use std::time::Duration;

use common::{until_published, within, Apart, GeneratorApart, TestDb};
use newsnack::briefing::wait::{smart_wait, ArmedWait, WaitError, WaitOutcome, WaitRequest};
use newsnack::db::DbError;
use newsnack::events::listener::ListenerOptions;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

fn request(ids: &[i64], timeout: Duration, min: usize) -> WaitRequest {
    WaitRequest {
        issue_ids: ids.to_vec(),
        timeout,
        min_completion: min,
        max_attempts: 3,
    }
}

async fn set_status(sql: &Client, id: i64, status: &str) {
    sql.execute(
        "UPDATE issue SET processing_status = $2 WHERE id = $1",
        &[&id, &status],
    )
    .await
    .unwrap();
}

/// `n` issues claimed by another system (IN_PROGRESS).
async fn in_progress(db: &TestDb, sql: &Client, n: usize) -> Vec<i64> {
    let ids = db.add_issues(n).await;
    for &id in &ids {
        set_status(sql, id, "IN_PROGRESS").await;
    }
    ids
}

#[tokio::test]
async fn all_pass_the_moment_the_last_target_is_done() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    let ids = in_progress(&db, &sql, 5).await;
    let (hub, stop) = db.listener().await;
    let started = std::time::Instant::now();
    let armed = ArmedWait::arm(&hub, request(&ids, Duration::from_secs(600), 3))
        .await
        .unwrap();
    let cancel = CancellationToken::new();
    let waiting = tokio::spawn(async move { armed.outcome(&cancel).await });
    for &id in &ids {
        set_status(&sql, id, "DONE").await;
    }
    let report = within(30, "all_pass", waiting).await.unwrap().unwrap();
    assert_eq!(report.outcome, WaitOutcome::AllPass);
    assert_eq!(report.completed, ids);
    assert!(report.failed.is_empty() && report.unfinished.is_empty());
    // `waited_ms` is the time the wait took, which this test saw pass.
    assert!(
        u128::from(report.waited_ms) <= started.elapsed().as_millis(),
        "waited {} ms",
        report.waited_ms
    );
    stop.cancel();
}

/// A wait gets only its targets' transitions, so it cannot fall behind:
/// far more transitions than the broadcast's buffer holds go by (the
/// targets finishing among them) while the pool's only session is taken,
/// and the wait still passes, without a read.
#[tokio::test]
async fn a_wait_never_falls_behind_and_never_reads_the_log() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    let ids = in_progress(&db, &sql, 3).await;
    let pool = db.pool_of_one(Duration::from_millis(100));
    let (hub, stop) = db
        .listener_on(
            pool.clone(),
            ListenerOptions {
                capacity: 8,
                ..ListenerOptions::default()
            },
        )
        .await;
    let armed = ArmedWait::arm(&hub, request(&ids, Duration::from_secs(600), 3))
        .await
        .unwrap();
    // Other issues' transitions, and a subscriber that falls behind on
    // them, do not reach the wait.
    let mut lagging = hub.subscribe();
    let busy = pool.get().await.unwrap();
    sql.batch_execute("INSERT INTO issue (title) SELECT 'filler' FROM generate_series(1, 50)")
        .await
        .unwrap();
    for &id in &ids {
        set_status(&sql, id, "DONE").await;
    }
    let cancel = CancellationToken::new();
    let report = within(30, "all_pass", armed.outcome(&cancel))
        .await
        .unwrap();
    assert_eq!(report.outcome, WaitOutcome::AllPass);
    assert_eq!(report.completed, ids);
    assert!(
        matches!(
            lagging.try_recv(),
            Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_))
        ),
        "more went by than the broadcast holds"
    );
    drop(busy);
    stop.cancel();
}

/// The listener is cut off (its session ended, and no new session let into
/// the database) while the targets finish: at the deadline the wait reads
/// them once more and passes on what the database says, instead of
/// skipping on a stream that stopped.
#[tokio::test]
async fn a_listener_that_is_behind_at_the_deadline_does_not_turn_done_into_skip() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    let ids = in_progress(&db, &sql, 2).await;
    let (hub, stop) = db.listener().await;
    // A session in the pool for the wait's reads, opened while it still can.
    drop(hub.pool().get().await.unwrap());
    let mut status = hub.status();
    let pid = db.cut_off_listener(&hub).await;
    within(20, "the listener to notice", async {
        status
            .wait_for(|s| s.backend_pid != Some(pid))
            .await
            .map(|_| ())
    })
    .await
    .unwrap();

    let armed = ArmedWait::arm(&hub, request(&ids, Duration::from_secs(2), 1))
        .await
        .unwrap();
    for &id in &ids {
        set_status(&sql, id, "DONE").await;
    }
    let report = within(30, "the deadline", armed.outcome(&CancellationToken::new())).await;
    db.admit_sessions(true).await;
    let report = report.unwrap();
    assert_eq!(report.outcome, WaitOutcome::AllPass, "{report:?}");
    assert_eq!(report.completed, ids);
    stop.cancel();
}

/// A bounded read waits for a free session as long as its own limit
/// allows, not just the pool's usual wait: a wait's first snapshot taken
/// while the pool is briefly busy must not fail a run that has minutes.
#[tokio::test]
async fn a_bounded_read_waits_for_a_session_up_to_its_own_limit() {
    let db = TestDb::new().await;
    let pool = db.pool_of_one(Duration::from_millis(100));
    let busy = pool.get().await.unwrap();
    let read = tokio::spawn({
        let pool = pool.clone();
        async move {
            newsnack::db::bounded(&pool, Duration::from_secs(30), |client| {
                Box::pin(async move {
                    let row = client.query_one("SELECT 41 + 1", &[]).await?;
                    Ok(row.get::<_, i32>(0))
                })
            })
            .await
        }
    });
    // The read queues for the session...
    within(10, "the bounded read to queue for the session", async {
        while pool.status().waiting == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    // ... and is still waiting when a borrower that came after it has
    // given up after the pool's usual wait.
    let later = within(10, "a later borrower to give up", pool.get()).await;
    assert!(later.is_err(), "the session is busy");
    assert!(!read.is_finished(), "the bounded read waits on");
    drop(busy);
    let answer = within(20, "the bounded read", read).await.unwrap();
    assert_eq!(answer.unwrap(), 42);
}

/// Sessions of this database waiting for a lock.
async fn queued_behind_locks(sql: &tokio_postgres::Client) -> i64 {
    sql.query_one(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND wait_event_type = 'Lock'",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// Cancelling a wait (Ctrl-C, shutdown) ends it at once even while its
/// first read is held behind another system's lock on the table, instead
/// of when the read gives up at the wait's timeout (an hour here).
#[tokio::test]
async fn a_wait_is_cancelled_while_its_first_read_is_held_by_a_lock() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    let ids = in_progress(&db, &sql, 1).await;
    let (hub, _stop) = db.listener().await;
    let locker = db.raw().await;
    locker
        .batch_execute("BEGIN; LOCK TABLE issue IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let cancel = CancellationToken::new();
    let wait = tokio::spawn({
        let (hub, cancel, ids) = (hub.clone(), cancel.clone(), ids.clone());
        async move { smart_wait(&hub, request(&ids, Duration::from_secs(3600), 1), &cancel).await }
    });
    within(20, "the wait's read to queue behind the lock", async {
        while queued_behind_locks(&sql).await == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    cancel.cancel();
    let ended = within(10, "the cancelled wait to end", wait).await.unwrap();
    assert!(
        matches!(ended, Err(WaitError::ShuttingDown)),
        "{:?}",
        ended.err()
    );
    locker.batch_execute("COMMIT").await.unwrap();
}

/// Another system holds the table locked: the wait's first read gives up
/// at the timeout instead of hanging with it, and its statement is
/// cancelled on the server, so nothing is left queued behind the lock.
#[tokio::test]
async fn a_lock_on_the_table_cannot_hold_a_wait_past_its_timeout() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    let ids = in_progress(&db, &sql, 1).await;
    let (hub, stop) = db.listener().await;
    let locker = db.raw().await;
    locker
        .batch_execute("BEGIN; LOCK TABLE issue IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let armed = within(
        20,
        "the wait to give up",
        ArmedWait::arm(&hub, request(&ids, Duration::from_secs(1), 1)),
    )
    .await;
    assert!(
        matches!(armed, Err(WaitError::Db(DbError::TimedOut(_)))),
        "{:?}",
        armed.err()
    );
    let queued = || queued_behind_locks(&sql);
    // The lock is still held: only a cancel ends the read's statement.
    within(20, "the timed-out read to be cancelled", async {
        while queued().await > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // A caller that stops waiting (a client hanging up) mid-read leaves
    // nothing queued either, once the read's limit passes.
    let abandoned = tokio::spawn({
        let hub = hub.clone();
        let ids = ids.clone();
        async move { ArmedWait::arm(&hub, request(&ids, Duration::from_secs(1), 1)).await }
    });
    within(20, "the second read to queue behind the lock", async {
        while queued().await == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    abandoned.abort();
    within(20, "the abandoned read to be cancelled", async {
        while queued().await > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    locker.batch_execute("COMMIT").await.unwrap();
    // The pool's sessions still answer.
    set_status(&sql, ids[0], "DONE").await;
    let report = within(
        30,
        "a wait once the lock is gone",
        smart_wait(
            &hub,
            request(&ids, Duration::from_secs(30), 1),
            &CancellationToken::new(),
        ),
    )
    .await
    .unwrap();
    assert_eq!(report.outcome, WaitOutcome::AllPass);
    stop.cancel();
}

#[tokio::test]
async fn at_the_deadline_enough_done_passes_and_too_few_skips() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    let ids = in_progress(&db, &sql, 5).await;
    for &id in &ids[..3] {
        set_status(&sql, id, "DONE").await;
    }
    let (hub, stop) = db.listener().await;
    let cancel = CancellationToken::new();
    let pass = smart_wait(&hub, request(&ids, Duration::from_millis(300), 3), &cancel)
        .await
        .unwrap();
    assert_eq!(pass.outcome, WaitOutcome::TimeoutPass);
    assert_eq!(pass.completed, ids[..3].to_vec());
    assert_eq!(pass.unfinished, ids[3..].to_vec());
    let skip = smart_wait(&hub, request(&ids, Duration::from_millis(300), 4), &cancel)
        .await
        .unwrap();
    assert_eq!(skip.outcome, WaitOutcome::Skip);
    assert_eq!(skip.completed.len(), 3);
    stop.cancel();
}

#[tokio::test]
async fn resolves_early_once_no_target_can_change() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    let ids = in_progress(&db, &sql, 5).await;
    let (hub, stop) = db.listener().await;
    // max_attempts 1: a FAILED target with one attempt is final.
    let mut req = request(&ids, Duration::from_secs(600), 3);
    req.max_attempts = 1;
    let started = std::time::Instant::now();
    let armed = ArmedWait::arm(&hub, req).await.unwrap();
    let cancel = CancellationToken::new();
    let waiting = tokio::spawn(async move { armed.outcome(&cancel).await });
    for &id in &ids[..3] {
        set_status(&sql, id, "DONE").await;
    }
    for &id in &ids[3..] {
        set_status(&sql, id, "FAILED").await;
    }
    let report = within(30, "early timeout_pass", waiting)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.outcome, WaitOutcome::TimeoutPass);
    assert_eq!(report.failed, ids[3..].to_vec());
    // Decided long before the 600 s deadline (within the 30 s above), and
    // `waited_ms` says how long it really took.
    assert!(
        u128::from(report.waited_ms) <= started.elapsed().as_millis(),
        "waited {} ms",
        report.waited_ms
    );

    // Fatal failures are final whatever the attempts: too few DONE -> skip.
    let others = in_progress(&db, &sql, 3).await;
    let armed = ArmedWait::arm(&hub, request(&others, Duration::from_secs(600), 2))
        .await
        .unwrap();
    let cancel = CancellationToken::new();
    let waiting = tokio::spawn(async move { armed.outcome(&cancel).await });
    set_status(&sql, others[0], "DONE").await;
    for &id in &others[1..] {
        sql.execute(
            "UPDATE issue SET processing_status='FAILED', retry_not_before='infinity', last_error='400' WHERE id=$1",
            &[&id],
        )
        .await
        .unwrap();
    }
    let report = within(30, "early skip", waiting).await.unwrap().unwrap();
    assert_eq!(report.outcome, WaitOutcome::Skip);
    stop.cancel();
}

#[tokio::test]
async fn the_deciding_raw_sql_commit_resolves_the_wait_without_any_query_in_between() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    db.count_statements().await;
    let ids = in_progress(&db, &sql, 1).await;
    // No health queries during the test, so every statement is counted.
    let (hub, stop) = db
        .listener_with(ListenerOptions {
            health_interval: Duration::from_secs(3600),
            ..ListenerOptions::default()
        })
        .await;
    // The listener reads its key and catches up on the log just after it
    // starts; once it has published a transition made now, those reads are
    // behind it, out of the counts below.
    in_progress(&db, &sql, 1).await;
    let end: i64 = sql
        .query_one("SELECT max(seq) FROM issue_transition", &[])
        .await
        .unwrap()
        .get(0);
    within(
        30,
        "the listener's first session",
        until_published(&hub, end),
    )
    .await;
    let armed = ArmedWait::arm(&hub, request(&ids, Duration::from_secs(600), 1))
        .await
        .unwrap();
    // Every statement in this database except this count itself and the
    // transition trigger's own statements (which run inside the UPDATE's
    // commit and are counted separately by pg_stat_statements: its log
    // row and its signing key; its lock and NOTIFY are expressions,
    // migration 19), the listener's probe of its new session (a NOTIFY to
    // itself, which may come after the first count), and the listener's
    // reads of the log, counted on their own.
    let count = |what: &str| {
        format!(
            "SELECT COALESCE(sum(calls), 0)::bigint FROM pg_stat_statements
              WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND query NOT LIKE '%pg_stat_statements%'
                AND query NOT LIKE 'SELECT pg_notify%'
                AND query NOT LIKE 'INSERT INTO %issue_transition%'
                AND query NOT LIKE 'SELECT k.key%FROM %.notification_key k'
                AND {what} (query = '{}')",
            newsnack::db::transition::READ_AFTER.replace('\'', "''")
        )
    };
    let (others, log_reads) = (count("NOT"), count(""));
    let others_before: i64 = sql.query_one(&others, &[]).await.unwrap().get(0);
    let reads_before: i64 = sql.query_one(&log_reads, &[]).await.unwrap().get(0);
    let cancel = CancellationToken::new();
    let waiting = tokio::spawn(async move { armed.outcome(&cancel).await });
    set_status(&sql, ids[0], "DONE").await;
    let report = within(30, "the wait", waiting).await.unwrap().unwrap();
    let others_after: i64 = sql.query_one(&others, &[]).await.unwrap().get(0);
    let reads_after: i64 = sql.query_one(&log_reads, &[]).await.unwrap().get(0);
    assert_eq!(report.outcome, WaitOutcome::AllPass);
    assert_eq!(
        others_after - others_before,
        1,
        "only the raw UPDATE ran: the wait issued no query"
    );
    assert_eq!(
        reads_after - reads_before,
        0,
        "the listener published the payload the trigger signed without reading the log"
    );
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_waits_answers_the_outcome_and_a_disconnect_cancels_it() {
    let db = TestDb::new().await;
    let service = db
        .serve(
            "waits",
            std::sync::Arc::new(newsnack::writer::OfflineWriter),
        )
        .await;
    let sql = db.raw().await;
    let ids = in_progress(&db, &sql, 2).await;
    let http = reqwest::Client::new();
    let url = format!("http://{}/waits", service.addr);
    let hub = service.hub.clone();
    let baseline = hub.watch_count();

    let post = http
        .post(&url)
        .json(&serde_json::json!({"issue_ids": ids, "timeout_s": 600, "min_completion": 1}))
        .send();
    let answer = tokio::spawn(post);
    set_status(&sql, ids[0], "DONE").await;
    set_status(&sql, ids[1], "DONE").await;
    let response = within(30, "POST /waits", answer).await.unwrap().unwrap();
    assert_eq!(response.status(), 200);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["outcome"], "all_pass");
    assert_eq!(body["completed"], serde_json::json!(ids));
    assert!(body["waited_ms"].is_u64());

    // A client that goes away takes its wait with it.
    let more = in_progress(&db, &sql, 1).await;
    let hanging = tokio::spawn(
        http.post(&url)
            .json(&serde_json::json!({"issue_ids": more, "timeout_s": 600}))
            .send(),
    );
    within(10, "the wait to subscribe", async {
        while hub.watch_count() <= baseline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    hanging.abort();
    within(10, "the wait to be dropped", async {
        while hub.watch_count() > baseline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;

    let unknown = http
        .post(&url)
        .json(&serde_json::json!({"issue_ids": [987654]}))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    let bad = http
        .post(&url)
        .json(&serde_json::json!({"issue_ids": ids, "timeout_s": -1}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 422);
    assert!(bad.json::<serde_json::Value>().await.unwrap()["error"].is_string());
    service.stop().await.unwrap();
}

/// A `POST /waits` that shutdown ends answers 503 with `Retry-After`,
/// saying the server is shutting down (not that the database is busy). The
/// API runs here on a shutdown token cancelled before the request: the
/// wait is armed, then ended by shutdown, as one in flight would be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_waits_ended_by_shutdown_answers_503_saying_so() {
    use std::sync::Arc;

    let db = TestDb::new().await;
    let sql = db.raw().await;
    let ids = in_progress(&db, &sql, 1).await;
    let GeneratorApart {
        hub,
        stop,
        settings,
        handle,
        ..
    } = db
        .generator_apart(
            Arc::new(newsnack::writer::OfflineWriter),
            Apart {
                grace: Some(Duration::from_secs(1)),
                ..Apart::default()
            },
        )
        .await;
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    let app = newsnack::http::router(newsnack::http::Services {
        pool: db.pool.clone(),
        hub: hub.clone(),
        claimer: newsnack::claims::claim::Claimer::start(
            db.pool.clone(),
            "waits-shutdown".into(),
            1,
        ),
        done: newsnack::claims::known_done::DoneIssues::follow(&hub, stop.clone()),
        generator: handle,
        settings,
        shutdown,
        draining: CancellationToken::new(),
        tokens: Default::default(),
        max_backlog: 10,
    });
    let socket = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/waits", socket.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(socket, app).await });

    let response = within(
        30,
        "POST /waits",
        reqwest::Client::new()
            .post(&url)
            .json(&serde_json::json!({"issue_ids": ids, "timeout_s": 600}))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(
        body,
        serde_json::json!({"error": "the server is shutting down; try again"})
    );
    stop.cancel();
}

/// `deadline` in RFC 3339, `offset_ms` from now.
fn deadline_in(offset_ms: i64) -> String {
    (time::OffsetDateTime::now_utc() + time::Duration::milliseconds(offset_ms))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap()
}

/// A wait asked again with the deadline the first ask computed ends at
/// that deadline, not a new timeout later; a deadline already past decides
/// at once by the deadline's rule; `timeout_s` with `deadline` is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_waits_keeps_an_absolute_deadline() {
    let db = TestDb::new().await;
    let service = db
        .serve(
            "waits-deadline",
            std::sync::Arc::new(newsnack::writer::OfflineWriter),
        )
        .await;
    let sql = db.raw().await;
    let ids = in_progress(&db, &sql, 3).await;
    set_status(&sql, ids[0], "DONE").await;
    let http = reqwest::Client::new();
    let url = format!("http://{}/waits", service.addr);
    let post = |body: serde_json::Value| {
        let request = http.post(&url).json(&body);
        async move {
            let response = within(30, "POST /waits", request.send()).await.unwrap();
            let status = response.status().as_u16();
            (status, response.json::<serde_json::Value>().await.unwrap())
        }
    };

    // Ends at the deadline (1.5 s from now), by the rule: 1 DONE of 3.
    let deadline = time::OffsetDateTime::now_utc() + time::Duration::milliseconds(1500);
    let text = deadline
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    let (status, passed) = post(serde_json::json!(
        {"issue_ids": ids, "deadline": text, "min_completion": 1}
    ))
    .await;
    let ended = time::OffsetDateTime::now_utc();
    assert_eq!(status, 200, "{passed}");
    assert_eq!(passed["outcome"], "timeout_pass");
    assert_eq!(passed["completed"], serde_json::json!([ids[0]]));
    assert!(
        (ended - deadline).abs() < time::Duration::milliseconds(900),
        "answered {} after the deadline",
        ended - deadline
    );

    // The same deadline asked again, now past: decided at once, same rule.
    for (min, outcome) in [(1, "timeout_pass"), (2, "skip")] {
        let (status, again) = post(serde_json::json!(
            {"issue_ids": ids, "deadline": text, "min_completion": min}
        ))
        .await;
        assert_eq!(status, 200, "{again}");
        assert_eq!(again["outcome"], outcome, "{again}");
        assert_eq!(again["unfinished"], serde_json::json!(&ids[1..]));
        assert!(again["waited_ms"].as_u64().unwrap() < 1000, "{again}");
    }

    // A future deadline still ends early when every target is DONE.
    let waiting = tokio::spawn(post(serde_json::json!(
        {"issue_ids": [ids[0]], "deadline": deadline_in(600_000)}
    )));
    let (status, all) = within(30, "all_pass", waiting).await.unwrap();
    assert_eq!((status, all["outcome"].as_str()), (200, Some("all_pass")));

    let refused = [
        (
            serde_json::json!({"issue_ids": ids, "deadline": deadline_in(1000), "timeout_s": 1}),
            400,
            "give timeout_s or deadline, not both",
        ),
        (
            serde_json::json!({"issue_ids": ids, "deadline": deadline_in(90_000_000)}),
            422,
            "deadline must be at most 86400 s ahead",
        ),
        (
            serde_json::json!({"issue_ids": ids, "deadline": "tomorrow"}),
            422,
            "deadline",
        ),
    ];
    for (body, want, message) in refused {
        let (status, error) = post(body.clone()).await;
        assert_eq!(status, want, "{body}: {error}");
        let text = error["error"].as_str().unwrap();
        assert!(text.contains(message), "{body}: {text}");
    }
    service.stop().await.unwrap();
}
