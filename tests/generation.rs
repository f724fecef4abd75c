//! Generation end to end: the service claims over HTTP, the OpenAI-compatible
//! client talks to a local fake LLM that fails on purpose, and every issue
//! still ends with exactly one article — or `FAILED` with the reason when
//! the failure is fatal or the attempts run out. Includes the crash test:
//! two `serve` processes, one SIGKILLed mid-generation.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::fake_llm::{FakeLlm, Reply};
use common::gate::DbGate;
use common::http::{completions_deferred, post_ids, until_recording_meets_a_held_row};
use common::process::ServeProcess;
use common::{
    offline, until_done_count, until_sql, until_sql_polled, until_status, within, Apart,
    GeneratorApart, Setup, TestDb,
};
use newsnack::writer::{self, OfflineWriter};
use tokio::sync::watch;

const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_issues_with_transient_failures_all_end_done_once() {
    let db = TestDb::new().await;
    db.set("retry_backoff_ms", "50").await;
    // One request in four fails, in every transient way; with 12 attempts
    // the chance that some issue meets a failure every time is about 1e-5.
    db.set("max_attempts", "12").await;
    let fake = FakeLlm::start(|n, _| match n % 10 {
        3 => Reply::RateLimited { retry_after_s: 1 },
        7 => Reply::ServerError,
        9 if n % 20 == 9 => Reply::Hang,
        _ => Reply::Ok(ARTICLE.into()),
    })
    .await;
    let service = db.serve("gen", fake.writer(Duration::from_secs(1))).await;
    let ids = db.add_issues(200).await;
    let http = reqwest::Client::new();
    for chunk in ids.chunks(50) {
        let (status, body) = post_ids(&http, service.addr, chunk).await;
        assert_eq!(status, 202, "{body}");
        assert_eq!(body["claimed"].as_array().unwrap().len(), 50);
    }
    until_done_count(&db, &service.hub, 120, 200).await;
    assert_eq!(db.scalar_i64("SELECT count(*) FROM ai_article").await, 200);
    assert_eq!(
        db.scalar_i64("SELECT count(DISTINCT issue_id) FROM ai_article")
            .await,
        200
    );
    let retried = db
        .scalar_i64("SELECT count(*) FROM issue WHERE attempts > 1")
        .await;
    assert!(
        retried >= 20,
        "transient failures were retried ({retried} issues took more than one attempt)"
    );
    let failures_logged = db
        .scalar_i64("SELECT count(*) FROM issue_transition WHERE to_status = 'FAILED' AND reason IS NOT NULL")
        .await;
    let rate_limited = db
        .scalar_i64("SELECT count(*) FROM issue_transition WHERE to_status = 'FAILED' AND reason LIKE '%429%'")
        .await;
    assert!(rate_limited > 0, "429s are recorded with their reason");
    // Every failure spent an attempt, but a 429 with Retry-After: the
    // quota failed, not the article, and its attempt was given back.
    assert_eq!(
        failures_logged - rate_limited,
        db.scalar_i64("SELECT sum(attempts - 1) FROM issue").await
    );
    let first = &db
        .raw()
        .await
        .query_one("SELECT headline FROM ai_article LIMIT 1", &[])
        .await
        .unwrap();
    assert_eq!(first.get::<_, String>(0), "A headline");
    service.stop().await.unwrap();
}

#[tokio::test]
async fn a_fatal_failure_ends_failed_with_the_reason_and_is_not_retried() {
    let db = TestDb::new().await;
    db.set("retry_backoff_ms", "10").await;
    let fake = FakeLlm::start(|_, request| {
        let prompt = request.to_string();
        if prompt.contains("poison") {
            Reply::BadRequest
        } else {
            Reply::Ok(ARTICLE.into())
        }
    })
    .await;
    let service = db.serve("fatal", fake.writer(Duration::from_secs(5))).await;
    let sql = db.raw().await;
    let poison: i64 = sql
        .query_one(
            "INSERT INTO issue (title, body) VALUES ('poison pill', 'x') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let fine = db.add_issues(1).await[0];
    let (status, _) = post_ids(&reqwest::Client::new(), service.addr, &[poison, fine]).await;
    assert_eq!(status, 202);
    let check = format!(
        "SELECT bool_and(processing_status IN ('DONE','FAILED')) FROM issue WHERE id IN ({poison}, {fine})"
    );
    until_sql(&db, &service.hub, 30, &check).await;
    let row = sql
        .query_one(
            "SELECT processing_status, attempts, last_error FROM issue WHERE id = $1",
            &[&poison],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "FAILED");
    assert_eq!(row.get::<_, i32>(1), 1, "a fatal failure is not retried");
    assert!(
        row.get::<_, String>(2).contains("400"),
        "{}",
        row.get::<_, String>(2)
    );
    assert_eq!(
        db.scalar_i64(&format!(
            "SELECT count(*) FROM ai_article WHERE issue_id = {poison}"
        ))
        .await,
        0
    );
    service.stop().await.unwrap();
}

/// Malformed answers fail the attempt and are retried until `max_attempts`
/// (the contract's rule for "malformed bodies"): a passing fault ends in an
/// article, a persistent one in `FAILED` with the reason, not fatal.
#[tokio::test]
async fn malformed_answers_are_retried_until_max_attempts() {
    let db = TestDb::new().await;
    db.set("retry_backoff_ms", "10").await;
    db.set("max_attempts", "3").await;
    let fake = FakeLlm::start(|n, request| {
        if request.to_string().contains("always garbled") {
            Reply::Malformed
        } else if n == 0 {
            Reply::Custom {
                status: 200,
                retry_after: None,
                body: "<html>502 Bad Gateway</html>".into(),
            }
        } else {
            Reply::Ok(ARTICLE.into())
        }
    })
    .await;
    let service = db
        .serve("malformed", fake.writer(Duration::from_secs(5)))
        .await;
    let passing = post_new_issues(&db, service.addr, 1).await[0];
    until_status(&db, &service.hub, 30, passing, "DONE").await;

    let garbled = post_issue_titled(&db, service.addr, "always garbled").await;
    until_failed_after(&db, &service.hub, garbled, 3).await;
    let row = db
        .raw()
        .await
        .query_one(
            "SELECT last_error, COALESCE(retry_not_before = 'infinity', false) FROM issue WHERE id = $1",
            &[&garbled],
        )
        .await
        .unwrap();
    let reason: String = row.get(0);
    assert!(reason.contains("malformed response"), "{reason}");
    assert!(
        !row.get::<_, bool>(1),
        "not fatal: an operator's reset retries it"
    );
    service.stop().await.unwrap();
}

/// Raising `max_attempts` at run time gives exhausted issues their new
/// attempts without a restart.
#[tokio::test]
async fn raising_max_attempts_retries_exhausted_issues() {
    let db = TestDb::new().await;
    db.set("retry_backoff_ms", "10").await;
    db.set("max_attempts", "1").await;
    let fake = FakeLlm::start(|n, _| {
        if n == 0 {
            Reply::ServerError
        } else {
            Reply::Ok(ARTICLE.into())
        }
    })
    .await;
    let service = db.serve("raise", fake.writer(Duration::from_secs(5))).await;
    let id = post_new_issues(&db, service.addr, 1).await[0];
    until_failed_after(&db, &service.hub, id, 1).await;
    assert_eq!(
        fake.requests(),
        1,
        "exhausted: not retried at max_attempts 1"
    );
    db.set("max_attempts", "2").await;
    until_status(&db, &service.hub, 30, id, "DONE").await;
    assert_eq!(fake.requests(), 2);
    service.stop().await.unwrap();
}

#[tokio::test]
async fn failures_written_by_other_systems_are_retried_and_exhausted_ones_stay_failed() {
    let db = TestDb::new().await;
    db.set("retry_backoff_ms", "10").await;
    db.set("max_attempts", "2").await;
    let fake = FakeLlm::start(|_, request| {
        if request.to_string().contains("always broken") {
            Reply::ServerError
        } else {
            Reply::Ok(ARTICLE.into())
        }
    })
    .await;
    let service = db.serve("retry", fake.writer(Duration::from_secs(5))).await;
    let sql = db.raw().await;
    // Another system claims an issue and gives up on it with plain SQL.
    let theirs = db.add_issues(1).await[0];
    sql.execute(
        "UPDATE issue SET processing_status='IN_PROGRESS' WHERE id=$1",
        &[&theirs],
    )
    .await
    .unwrap();
    sql.execute(
        "UPDATE issue SET processing_status='FAILED', last_error='their worker died' WHERE id=$1",
        &[&theirs],
    )
    .await
    .unwrap();
    until_status(&db, &service.hub, 30, theirs, "DONE").await;

    let broken = post_issue_titled(&db, service.addr, "always broken").await;
    until_failed_after(&db, &service.hub, broken, 2).await;
    // Exhausted: nothing more happens to it until an operator resets it.
    let logged = db
        .scalar_i64(&format!(
            "SELECT count(*) FROM issue_transition WHERE issue_id = {broken}"
        ))
        .await;
    assert_eq!(logged, 5, "PENDING, 2 x (IN_PROGRESS, FAILED)");
    service.stop().await.unwrap();
}

/// Adds `n` issues and claims them through `POST /ai-articles`.
async fn post_new_issues(db: &TestDb, addr: std::net::SocketAddr, n: usize) -> Vec<i64> {
    let ids = db.add_issues(n).await;
    let (status, body) = post_ids(&reqwest::Client::new(), addr, &ids).await;
    assert_eq!(status, 202, "{body}");
    ids
}

/// Adds an issue titled `title` and claims it through `POST /ai-articles`.
async fn post_issue_titled(db: &TestDb, addr: std::net::SocketAddr, title: &str) -> i64 {
    let id: i64 = db
        .raw()
        .await
        .query_one(
            "INSERT INTO issue (title) VALUES ($1) RETURNING id",
            &[&title],
        )
        .await
        .unwrap()
        .get(0);
    let (status, body) = post_ids(&reqwest::Client::new(), addr, &[id]).await;
    assert_eq!(status, 202, "{body}");
    id
}

/// Waits until issue `id` is `FAILED` after `attempts` attempts.
async fn until_failed_after(
    db: &TestDb,
    hub: &newsnack::events::hub::EventHub,
    id: i64,
    attempts: i32,
) {
    until_sql(
        db,
        hub,
        30,
        &format!(
            "SELECT processing_status = 'FAILED' AND attempts = {attempts} FROM issue WHERE id = {id}"
        ),
    )
    .await;
}

/// Waits until every issue in the database is `DONE`.
async fn until_all_done(db: &TestDb, hub: &newsnack::events::hub::EventHub) {
    until_sql(
        db,
        hub,
        60,
        "SELECT bool_and(processing_status = 'DONE') FROM issue",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_llm_concurrency_cap_follows_the_setting() {
    let db = TestDb::new().await;
    db.set("generation_concurrency", "2").await;
    let fake = FakeLlm::start(|_, _| Reply::Slow {
        delay: Duration::from_millis(100),
        content: ARTICLE.into(),
    })
    .await;
    let service = db.serve("cap", fake.writer(Duration::from_secs(5))).await;
    post_new_issues(&db, service.addr, 12).await;
    until_all_done(&db, &service.hub).await;
    assert_eq!(
        fake.max_in_flight(),
        2,
        "never more than the setting allows"
    );
    service.stop().await.unwrap();
}

/// Lowering the cap takes effect at the next call, not after the calls
/// already queued for a slot: with a backlog of 8 behind 4 running calls,
/// a change to 1 leaves the backlog running one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_llm_cap_applies_to_the_calls_already_queued() {
    let db = TestDb::new().await;
    db.set("generation_concurrency", "4").await;
    let (open, gate) = tokio::sync::watch::channel(false);
    let (arrived, mut arrivals) = tokio::sync::watch::channel(0u64);
    let fake = FakeLlm::start(move |n, _| {
        arrived.send_modify(|count| *count += 1);
        if n < 4 {
            // The first four are held until the cap is lowered.
            Reply::Gated {
                open: gate.clone(),
                content: ARTICLE.into(),
            }
        } else {
            // The first calls of the backlog are long enough for the
            // service to apply the new cap before any of them ends, however
            // loaded the machine: until then they may overlap.
            let delay = if n < 8 { 1_000 } else { 200 };
            Reply::Slow {
                delay: Duration::from_millis(delay),
                content: ARTICLE.into(),
            }
        }
    })
    .await;
    let service = db
        .serve("cap-shrink", fake.writer(Duration::from_secs(10)))
        .await;
    post_new_issues(&db, service.addr, 12).await;
    arrivals.wait_for(|count| *count >= 4).await.unwrap();
    let mut changed = service.hub.settings_changed();
    changed.borrow_and_update();
    db.set("generation_concurrency", "1").await;
    changed.changed().await.unwrap();
    open.send(true).unwrap();
    until_all_done(&db, &service.hub).await;
    let seen = fake.in_flight_at_arrival();
    assert_eq!(seen.len(), 12, "one call per issue: {seen:?}");
    assert_eq!(&seen[..4], &[1, 2, 3, 4], "four at first: {seen:?}");
    // The service may read the new setting a moment after the gate opens,
    // so the first calls of the backlog may still overlap; the rest not.
    assert!(
        seen[8..].iter().all(|&n| n == 1),
        "the backlog ran one call at a time once the cap was lowered: {seen:?}"
    );
    service.stop().await.unwrap();
}

fn spawn_serve(db: &TestDb, name: &str, llm_url: &str) -> ServeProcess {
    ServeProcess::spawn(
        &db.url,
        name,
        &[
            ("NEWSNACK_LLM_URL", llm_url),
            ("NEWSNACK_LLM_TIMEOUT_S", "5"),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_instance_leaves_nothing_stuck_or_duplicated() {
    let db = TestDb::new().await;
    db.set("lease_s", "2").await;
    db.set("retry_backoff_ms", "50").await;
    let fake = FakeLlm::start(|_, _| Reply::Slow {
        delay: Duration::from_millis(150),
        content: ARTICLE.into(),
    })
    .await;
    let (hub, stop_listener) = db.listener().await;
    let mut victim = tokio::task::block_in_place(|| spawn_serve(&db, "victim", &fake.url));
    let mut survivor = tokio::task::block_in_place(|| spawn_serve(&db, "survivor", &fake.url));
    let ids = db.add_issues(100).await;
    let http = reqwest::Client::new();
    let (status, _) = post_ids(&http, victim.addr, &ids[..60]).await;
    assert_eq!(status, 202);
    let (status, _) = post_ids(&http, survivor.addr, &ids[60..]).await;
    assert_eq!(status, 202);
    // Kill the victim while it is mid-generation.
    let stranded = db.kill_mid_generation(&hub, &mut victim, 5).await;

    until_done_count(&db, &hub, 90, 100).await;
    assert_eq!(db.scalar_i64("SELECT count(*) FROM ai_article").await, 100);
    assert_eq!(
        db.scalar_i64("SELECT count(DISTINCT issue_id) FROM ai_article")
            .await,
        100
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue WHERE processing_status = 'IN_PROGRESS'")
            .await,
        0
    );
    db.assert_stranded_came_back(&stranded, "victim").await;
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM ai_article a JOIN issue i ON i.id = a.issue_id WHERE a.claim_id <> i.claim_id").await,
        0,
        "every article was written under the issue's final claim"
    );
    // The survivor shuts down cleanly on SIGTERM.
    let status = within(30, "the survivor to exit", async {
        tokio::task::block_in_place(|| survivor.terminate())
    })
    .await;
    assert!(status.success(), "{status:?}");
    stop_listener.cancel();
}

#[tokio::test]
async fn a_retry_that_finds_its_issue_locked_is_scheduled_again() {
    let db = TestDb::new().await;
    db.count_statements().await;
    db.set("retry_backoff_ms", "50").await;
    let service = db.serve("retry-locked", offline()).await;
    let id = db.add_issues(1).await[0];
    let sql = db.raw().await;
    let mut holder = db.raw().await;
    let before = db.claim_statements().await;
    // Another system fails the issue, asking for the retry in 3 s, and at
    // once someone holds the row: when the retry comes, SKIP LOCKED passes
    // it by.
    db.move_with_sql(&[id], &["IN_PROGRESS"]).await;
    sql.execute(
        "UPDATE issue SET processing_status = 'FAILED', last_error = 'theirs',
                retry_not_before = now() + interval '3 seconds' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    let lock = holder.transaction().await.unwrap();
    lock.execute("SELECT 1 FROM issue WHERE id = $1 FOR UPDATE", &[&id])
        .await
        .unwrap();
    within(
        30,
        "the retry's claim to run while the row is held",
        async {
            while db.claim_statements().await == before {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        },
    )
    .await;
    assert_eq!(
        db.status_of(id).await,
        "FAILED",
        "the held row was passed by"
    );
    lock.commit().await.unwrap();
    // Not forgotten: it is tried again and done.
    until_status(&db, &service.hub, 30, id, "DONE").await;
    service.stop().await.unwrap();
}

#[tokio::test]
async fn a_retry_due_in_years_neither_runs_early_nor_stops_the_others() {
    let db = TestDb::new().await;
    db.set("retry_backoff_ms", "10").await;
    let service = db.serve("retry-far", offline()).await;
    let ids = db.add_issues(2).await;
    let (far, near) = (ids[0], ids[1]);
    let sql = db.raw().await;
    db.move_with_sql(&ids, &["IN_PROGRESS"]).await;
    // Written by hand (or from a huge Retry-After): due in ten years.
    sql.execute(
        "UPDATE issue SET processing_status = 'FAILED', last_error = 'later',
                retry_not_before = now() + interval '10 years' WHERE id = $1",
        &[&far],
    )
    .await
    .unwrap();
    sql.execute(
        "UPDATE issue SET processing_status = 'FAILED', last_error = 'now' WHERE id = $1",
        &[&near],
    )
    .await
    .unwrap();
    until_status(&db, &service.hub, 30, near, "DONE").await;
    // A failure after the far one was scheduled is retried too: the
    // scheduler is still running.
    let later = db.add_issues(1).await[0];
    db.move_with_sql(&[later], &["IN_PROGRESS", "FAILED"]).await;
    until_status(&db, &service.hub, 30, later, "DONE").await;
    assert_eq!(db.status_of(far).await, "FAILED", "the far retry waits");
    service.stop().await.unwrap();
}

#[tokio::test]
async fn an_outcome_that_cannot_be_recorded_fails_at_once_with_the_reason() {
    let db = TestDb::new().await;
    db.set("max_attempts", "1").await;
    let service = db.serve("unrecordable", offline()).await;
    let id = db.add_issues(1).await[0];
    // Another system already stored an article for it: recording ours
    // violates the one-article-per-issue index.
    db.raw()
        .await
        .execute(
            "INSERT INTO ai_article (issue_id, headline, body, writer, claim_id) VALUES ($1, 'theirs', 'theirs', 'elsewhere', 0)",
            &[&id],
        )
        .await
        .unwrap();
    let (status, _) = post_ids(&reqwest::Client::new(), service.addr, &[id]).await;
    assert_eq!(status, 202);
    // Not a lease's wait (60 s) and "lease expired", but the real reason.
    until_sql(
        &db,
        &service.hub,
        20,
        &format!(
            "SELECT processing_status = 'FAILED' AND last_error LIKE 'could not record the outcome:%'
               FROM issue WHERE id = {id}"
        ),
    )
    .await;
    service.stop().await.unwrap();
}

/// Failed issues left from before an instance started are retried even when
/// the first look for them fails: the look is tried again. Here the
/// service's sessions go through a gate that turns the first connection
/// away (the database is out of reach at start-up), then lets them through.
#[tokio::test]
async fn failures_left_from_before_start_are_retried_after_a_failed_first_look() {
    use newsnack::claims::claim::Claimer;
    use newsnack::generation::retry::RetryScheduler;

    let db = TestDb::new().await;
    db.set("retry_backoff_ms", "1").await;
    let id = db.add_issues(1).await[0];
    db.move_with_sql(&[id], &["IN_PROGRESS", "FAILED"]).await;

    // The database is out of reach until the gate opens.
    let gate = DbGate::start(&db, false).await;
    let pool = gate.pool();

    let GeneratorApart {
        hub,
        stop,
        settings,
        generator,
        handle,
    } = db
        .generator_apart(
            Arc::new(OfflineWriter),
            Apart {
                pool: Some(pool.clone()),
                ..Apart::default()
            },
        )
        .await;
    // Nothing else uses the pool until the generator runs.
    tokio::spawn(
        RetryScheduler {
            hub: hub.clone(),
            pool: pool.clone(),
            claimer: Claimer::start(pool.clone(), "gated".into(), 1),
            generator: handle,
            settings,
            scope: newsnack::generation::retry::RetryScope::everything(),
        }
        .run(stop.clone()),
    );
    gate.until_turned_away(1).await;
    gate.open();
    tokio::spawn(generator.run(stop.clone()));
    until_status(&db, &hub, 30, id, "DONE").await;
    assert_eq!(
        db.scalar_i64(&format!(
            "SELECT attempts::bigint FROM issue WHERE id = {id}"
        ))
        .await,
        2
    );
    stop.cancel();
}

/// Answers once `release` turns true; counts the calls in `called`.
struct HeldWriter {
    called: watch::Sender<u32>,
    release: watch::Receiver<bool>,
}

/// A [`HeldWriter`], the count of its calls, and its release.
fn held_writer() -> (Arc<HeldWriter>, watch::Receiver<u32>, watch::Sender<bool>) {
    let (called, calls) = watch::channel(0u32);
    let (release, held) = watch::channel(false);
    let writer = HeldWriter {
        called,
        release: held,
    };
    (Arc::new(writer), calls, release)
}

impl writer::Writer for HeldWriter {
    fn name(&self) -> &str {
        "held"
    }
    fn write<'a>(
        &'a self,
        issue: writer::IssueText<'a>,
    ) -> futures::future::BoxFuture<'a, Result<writer::Article, writer::WriteError>> {
        Box::pin(async move {
            self.called.send_modify(|n| *n += 1);
            let mut release = self.release.clone();
            release.wait_for(|go| *go).await.unwrap();
            OfflineWriter.write(issue).await
        })
    }
}

/// A generator on `pool` with a [`held_writer`], its listener and settings
/// on the test database's own pool; `stop` ends them.
struct HeldGenerator {
    hub: newsnack::events::hub::EventHub,
    stop: tokio_util::sync::CancellationToken,
    handle: newsnack::generation::worker::GeneratorHandle,
    calls: watch::Receiver<u32>,
    release: watch::Sender<bool>,
}

async fn held_generator(db: &TestDb, pool: newsnack::db::DbPool) -> HeldGenerator {
    let (writer, calls, release) = held_writer();
    let GeneratorApart {
        hub,
        stop,
        generator,
        handle,
        ..
    } = db
        .generator_apart(
            writer,
            Apart {
                generator_pool: Some(pool),
                ..Apart::default()
            },
        )
        .await;
    tokio::spawn(generator.run(stop.clone()));
    HeldGenerator {
        hub,
        stop,
        handle,
        calls,
        release,
    }
}

/// An issue whose row another system holds (a transaction editing it with
/// plain SQL, left open) holds up its own completion only: the completion
/// skips the row rather than wait for it, so the other issues' articles are
/// recorded meanwhile, and it is recorded itself, within the same attempt,
/// once the row is free. Before, it waited for the row, and every
/// completion queued behind it waited too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_held_by_another_system_holds_up_only_its_own_completion() {
    let db = TestDb::new().await;
    db.set("lease_s", "600").await;
    let ids = db.add_issues(3).await;
    let (held, others) = (ids[0], &ids[1..]);
    let (writer, mut calls, release) = held_writer();
    let service = db.serve("row-held", writer).await;
    let deferred_before = completions_deferred(service.addr).await;
    let http = reqwest::Client::new();
    let (status, body) = post_ids(&http, service.addr, &[held]).await;
    assert_eq!(status, 202, "{body}");
    within(30, "the writer to be called", calls.wait_for(|n| *n == 1))
        .await
        .unwrap();

    let mut holder = db.raw().await;
    let lock = holder.transaction().await.unwrap();
    lock.execute("UPDATE issue SET score = score + 1 WHERE id = $1", &[&held])
        .await
        .unwrap();
    release.send_replace(true);
    let sql = db.raw().await;
    until_recording_meets_a_held_row(&sql, service.addr, deferred_before).await;

    let (status, body) = post_ids(&http, service.addr, others).await;
    assert_eq!(status, 202, "{body}");
    for &id in others {
        until_status(&db, &service.hub, 10, id, "DONE").await;
    }
    assert_eq!(db.status_of(held).await, "IN_PROGRESS");
    lock.commit().await.unwrap();
    until_status(&db, &service.hub, 30, held, "DONE").await;
    let row = sql
        .query_one(
            "SELECT (SELECT attempts FROM issue WHERE id = $1),
                    (SELECT count(*) FROM ai_article WHERE issue_id = ANY($2))",
            &[&held, &ids],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 1, "recorded within the first attempt");
    assert_eq!(row.get::<_, i64>(1), 3, "one article each");
    service.stop().await.unwrap();
}

/// An instance holding `max_backlog` unfinished claims turns further
/// requests away with 503 and `Retry-After`, claiming nothing, and takes
/// work again once its backlog is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_backlog_turns_claims_away_until_it_is_written() {
    let db = TestDb::new().await;
    let ids = db.add_issues(4).await;
    let (writer, mut calls, release) = held_writer();
    let service = db
        .serve_with(
            "backlogged",
            writer,
            Setup {
                max_backlog: Some(3),
                ..Setup::default()
            },
        )
        .await;
    let http = reqwest::Client::new();
    let (status, body) = post_ids(&http, service.addr, &ids[..3]).await;
    assert_eq!(status, 202, "{body}");
    within(30, "the writer to be called", calls.wait_for(|n| *n >= 1))
        .await
        .unwrap();

    let refused = http
        .post(format!("http://{}/ai-articles", service.addr))
        .json(&serde_json::json!({ "issue_ids": [ids[3]] }))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "5");
    let body: serde_json::Value = refused.json().await.unwrap();
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("limit 3"), "{error}");
    assert_eq!(db.status_of(ids[3]).await, "PENDING", "nothing claimed");

    release.send_replace(true);
    for &id in &ids[..3] {
        until_status(&db, &service.hub, 30, id, "DONE").await;
    }
    // The backlog counts down as each task ends, just after its commit.
    within(30, "the backlog to empty", async {
        loop {
            let (status, body) = post_ids(&http, service.addr, &ids[3..]).await;
            if status != 503 {
                assert_eq!(status, 202, "{body}");
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    until_status(&db, &service.hub, 30, ids[3], "DONE").await;
    service.stop().await.unwrap();
}

/// An article written while the database is briefly out of reach is
/// recorded once it is back, within the same attempt: the fenced write is
/// tried again (the heartbeat keeps the claim meanwhile) instead of the
/// article being thrown away and the issue left to its lease.
#[tokio::test]
async fn an_article_is_recorded_after_a_database_outage_not_thrown_away() {
    use newsnack::claims::claim::Claimer;
    use newsnack::db::issue::ClaimScope;

    let db = TestDb::new().await;
    // A lease far longer than the test: only the retried write can finish it.
    db.set("lease_s", "600").await;
    let id = db.add_issues(1).await[0];
    let gate = DbGate::start(&db, true).await;
    let pool = gate.pool();
    let HeldGenerator {
        hub,
        stop,
        handle,
        mut calls,
        release,
    } = held_generator(&db, pool.clone()).await;
    let claimed = Claimer::start(pool.clone(), "gated".into(), 1)
        .claim(vec![id], Duration::from_secs(600), ClaimScope::Claimable)
        .await
        .unwrap()
        .claimed;
    assert_eq!(claimed.len(), 1);
    handle.submit(claimed).await;
    within(30, "the writer to be called", calls.wait_for(|n| *n == 1))
        .await
        .unwrap();

    // The database goes out of reach while the article is being written.
    gate.close();
    release.send_replace(true);
    gate.until_turned_away(2).await;
    gate.open();

    until_status(&db, &hub, 30, id, "DONE").await;
    let row = db
        .query_one(
            "SELECT attempts, (SELECT count(*) FROM ai_article WHERE issue_id = $1)
               FROM issue WHERE id = $1",
            &[&id],
        )
        .await;
    assert_eq!(row.get::<_, i32>(0), 1, "recorded within the first attempt");
    assert_eq!(row.get::<_, i64>(1), 1, "exactly one article");
    stop.cancel();
}

/// A claim taken under a short lease is kept alive although `lease_s` has
/// grown by the time its generation starts: the first heartbeat comes
/// within the claim's own lease, not a third of the new one (which here
/// would be 200 s after the claim had run out).
#[tokio::test]
async fn a_claim_taken_under_a_shorter_lease_is_beaten_before_it_runs_out() {
    use newsnack::claims::claim::Claimer;
    use newsnack::db::issue::ClaimScope;

    let db = TestDb::new().await;
    db.set("lease_s", "600").await;
    let id = db.add_issues(1).await[0];
    let HeldGenerator {
        hub,
        stop,
        handle,
        mut calls,
        release,
    } = held_generator(&db, db.pool.clone()).await;
    // Claimed as under `lease_s = 1`, before the setting grew.
    let lease = Duration::from_secs(1);
    let claimed = Claimer::start(db.pool.clone(), "short".into(), 1)
        .claim(vec![id], lease, ClaimScope::Claimable)
        .await
        .unwrap()
        .claimed;
    assert_eq!(claimed.len(), 1);
    let (claim_id, first_lease_until) = (claimed[0].claim_id, claimed[0].lease_until);
    handle.submit(claimed).await;
    within(30, "the writer to be called", calls.wait_for(|n| *n == 1))
        .await
        .unwrap();
    // The first beat extends the lease by the grown `lease_s` (600 s) from
    // when it came; it must have come before the claim's own lease ran out.
    until_sql_polled(
        &db,
        30,
        &format!(
            "SELECT lease_until > '{}'::timestamptz + interval '5 minutes' FROM issue WHERE id = {id}",
            first_lease_until
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap()
        ),
    )
    .await;
    let row = db
        .query_one(
            "SELECT processing_status, claim_id, lease_until - interval '600 seconds'
               FROM issue WHERE id = $1",
            &[&id],
        )
        .await;
    assert_eq!(row.get::<_, String>(0), "IN_PROGRESS");
    assert_eq!(row.get::<_, i64>(1), claim_id);
    let beaten_at: time::OffsetDateTime = row.get(2);
    assert!(
        beaten_at < first_lease_until,
        "beaten at {beaten_at}, after the claim's lease ran out at {first_lease_until}"
    );
    release.send_replace(true);
    until_status(&db, &hub, 30, id, "DONE").await;
    stop.cancel();
}

/// Graceful shutdown: generations still running when the grace period ends
/// are released as `FAILED` with reason `shutdown`, so another instance
/// retries them at once instead of after their lease. The one that reached
/// the writer has spent its attempt; those still queued for an LLM slot are
/// released at once and get theirs back, so restarts do not use up issues
/// that were never tried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_releases_unfinished_generations_as_failed() {
    let db = TestDb::new().await;
    db.set("lease_s", "600").await;
    db.set("generation_concurrency", "1").await;
    let ids = db.add_issues(3).await;
    // A writer that is never released: the first call hangs, the others
    // wait for its slot.
    let (writer, mut calls, _release) = held_writer();
    // A grace period long enough that the state between the queued
    // releases and the started one's is seen however loaded the machine.
    let grace = Duration::from_secs(15);
    let service = db
        .serve_with(
            "stopping",
            writer,
            Setup {
                grace: Some(grace),
                ..Setup::default()
            },
        )
        .await;
    let (status, body) = post_ids(&reqwest::Client::new(), service.addr, &ids).await;
    assert_eq!(status, 202, "{body}");
    within(30, "the first call to start", calls.wait_for(|n| *n == 1))
        .await
        .unwrap();
    // A listener of the test's own: the service's stops with it.
    let (hub, _listening) = db.listener().await;
    let stopping = tokio::spawn(service.stop());
    // The queued ones are released at once, while the started one still
    // has its grace period to finish.
    until_sql(
        &db,
        &hub,
        grace.as_secs() - 3,
        "SELECT count(*) FILTER (WHERE processing_status = 'FAILED' AND attempts = 0) = 2
            AND count(*) FILTER (WHERE processing_status = 'IN_PROGRESS') = 1
           FROM issue",
    )
    .await;
    within(30, "a clean stop after the grace period", stopping)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(*calls.borrow(), 1, "one slot, one call");
    let rows = db
        .pool
        .get()
        .await
        .unwrap()
        .query(
            "SELECT processing_status, last_error, attempts FROM issue
              WHERE id = ANY($1) ORDER BY attempts DESC",
            &[&ids],
        )
        .await
        .unwrap();
    let released: Vec<(String, Option<String>, i32)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let shutdown = || ("FAILED".to_string(), Some("shutdown".to_string()));
    assert_eq!(
        released,
        [
            (shutdown().0, shutdown().1, 1),
            (shutdown().0, shutdown().1, 0),
            (shutdown().0, shutdown().1, 0),
        ],
        "the started generation spent its attempt, the queued ones did not"
    );
}

/// The reaper works on the session that holds its lock, not through the
/// pool: an instance whose pool is saturated (here: its one session taken)
/// still returns expired claims, instead of holding the lock that keeps
/// every other instance from reaping while it cannot. (It then ticks at
/// the default lease's pace, having no settings.)
#[tokio::test]
async fn the_reaper_reaps_while_its_pool_is_saturated() {
    let db = TestDb::new().await;
    db.set("lease_s", "1").await;
    let id = db.add_issues(1).await[0];
    let (hub, stop) = db.listener().await;
    db.raw()
        .await
        .batch_execute(&format!(
            "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = {id}"
        ))
        .await
        .unwrap();
    // The instance's pool is saturated: even its settings cannot be read.
    let pool = db.pool_of_one(Duration::from_millis(100));
    let _busy = pool.get().await.unwrap();
    let settings = Arc::new(newsnack::settings::SettingsCache::new(
        pool,
        hub.settings_changed(),
    ));
    let reaper = tokio::spawn(
        newsnack::generation::reaper::LeaseReaper {
            endpoint: db.endpoint.clone(),
            settings,
            instance: "saturated".into(),
        }
        .run(stop.clone()),
    );
    until_status(&db, &hub, 30, id, "FAILED").await;
    assert_eq!(
        db.scalar_i64(&format!(
            "SELECT count(*) FROM issue WHERE id = {id} AND last_error = 'lease expired'"
        ))
        .await,
        1
    );
    stop.cancel();
    reaper.await.unwrap();
}
