//! A fallback LLM provider: with the primary dead (500s, timeouts, a 429
//! storm), a `run-pipeline` process and two `serve` instances on one
//! database write their briefing articles on the fallback at once, every
//! issue on its first attempt, the run publishing within its wait; the
//! primary meanwhile gets only what opened its circuit and, one at a time,
//! the circuit's probes. Feed calls stay off the fallback unless
//! `llm_fallback_for` says `all`; a primary that recovers gets its calls
//! back; articles name the provider and model that wrote them; `/metrics`
//! and the dashboard show each provider's state. And what the shared
//! circuit guards against: instances that each learn alone that the
//! primary is down each spend calls on it.

mod common;

use std::process::Output;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::fake_llm::{FakeLlm, Reply};
use common::http::{claim_all, get_json};
use common::process;
use common::{until_sql, until_sql_polled, TestDb};
use futures::future::BoxFuture;
use newsnack::writer::{Article, IssueText, SharedWriter, WriteError, Writer};
use serde_json::Value;

const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";
const TIMEOUT: Duration = Duration::from_secs(1);

/// How the dead primary answers.
#[derive(Clone, Copy, Debug)]
enum Dead {
    ServerErrors,
    Timeouts,
    RateLimited,
}

impl Dead {
    fn reply(self) -> Reply {
        match self {
            Dead::ServerErrors => Reply::ServerError,
            Dead::Timeouts => Reply::Hang,
            Dead::RateLimited => Reply::RateLimited { retry_after_s: 60 },
        }
    }
}

async fn fallback_fake() -> FakeLlm {
    FakeLlm::start(|_, _| Reply::Slow {
        delay: Duration::from_millis(100),
        content: ARTICLE.into(),
    })
    .await
}

/// Issues titled `prefix N` with a score, so a pipeline run picks the
/// hottest.
async fn issues(db: &TestDb, prefix: &str, n: usize, score: f64) -> Vec<i64> {
    let sql = db.raw().await;
    let mut ids = Vec::new();
    for i in 0..n {
        let id: i64 = sql
            .query_one(
                "INSERT INTO issue (title, body, score) VALUES ($1, 'Something happened.', $2) RETURNING id",
                &[&format!("{prefix} {i}"), &score],
            )
            .await
            .unwrap()
            .get(0);
        ids.push(id);
    }
    ids
}

fn id_list(ids: &[i64]) -> String {
    format!(
        "'{{{}}}'",
        ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
    )
}

/// The titles in the user prompts `fake` was sent.
fn titles_sent(fake: &FakeLlm) -> Vec<String> {
    fake.arrivals()
        .iter()
        .filter_map(|a| {
            a.user_prompt()
                .lines()
                .find_map(|l| l.strip_prefix("Title: ").map(str::to_string))
        })
        .collect()
}

/// `newsnack run-pipeline` with both providers configured.
fn run_pipeline(db: &TestDb, primary: &FakeLlm, fallback: &FakeLlm) -> Output {
    let mut command = process::command(&db.url, &["run-pipeline"]);
    command
        .env("NEWSNACK_LLM_URL", &primary.url)
        .env("NEWSNACK_LLM_FALLBACK_URL", &fallback.url)
        .env("NEWSNACK_LLM_FALLBACK_MODEL", "fallback-model")
        .env("NEWSNACK_LLM_TIMEOUT_S", TIMEOUT.as_secs().to_string());
    command.output().unwrap()
}

/// The primary dead as `dead` says: two instances claim briefing
/// articles and a `run-pipeline` process runs the pipeline; every article
/// is written by the fallback, on its first attempt, and the run publishes
/// with all five; the primary gets at most what opened its circuit (with
/// two calls in flight, the threshold of three, or the one 429 that paused
/// it) and then one probe at a time.
async fn dead_primary(dead: Dead) {
    let db = TestDb::new().await;
    db.set("llm_max_in_flight", "2").await;
    db.set("llm_fallback_max_in_flight", "4").await;
    db.set("llm_circuit_open_s", "1").await;
    db.set("content_gen_timeout_s", "60").await;
    let primary = FakeLlm::start(move |_, _| dead.reply()).await;
    let fallback = fallback_fake().await;
    let a = db
        .serve("fb-a", primary.writers_with_fallback(&fallback, TIMEOUT))
        .await;
    let b = db
        .serve("fb-b", primary.writers_with_fallback(&fallback, TIMEOUT))
        .await;
    let alpha = issues(&db, "alpha", 3, 1.0).await;
    let beta = issues(&db, "beta", 3, 1.0).await;
    let hottest = issues(&db, "hottest", 5, 100.0).await;
    claim_all(a.addr, &alpha, Some("briefing")).await;
    claim_all(b.addr, &beta, Some("briefing")).await;
    let run = tokio::task::block_in_place(|| run_pipeline(&db, &primary, &fallback));
    assert!(
        run.status.success(),
        "{dead:?}: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let summary: Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(summary["outcome"], "all_pass", "{dead:?}: {summary}");
    let all = [alpha.clone(), beta.clone(), hottest.clone()].concat();
    until_sql(
        &db,
        &a.hub,
        30,
        &format!(
            "SELECT count(*) = {} FROM issue WHERE processing_status = 'DONE' AND id = ANY({})",
            all.len(),
            id_list(&all)
        ),
    )
    .await;

    assert_eq!(
        db.scalar_i64(&format!(
            "SELECT count(*) FROM issue WHERE id = ANY({}) AND attempts <> 1",
            id_list(&all)
        ))
        .await,
        0,
        "{dead:?}: the switch spent no attempt"
    );
    assert_eq!(
        db.scalar_i64(&format!(
            "SELECT count(*) FROM ai_article WHERE issue_id = ANY({}) AND writer = 'fallback:fallback-model'",
            id_list(&all)
        ))
        .await,
        all.len() as i64,
        "{dead:?}: every article names the fallback and its model"
    );
    let sent = titles_sent(&fallback);
    for group in ["alpha", "beta", "hottest"] {
        assert!(
            sent.iter().any(|t| t.starts_with(group)),
            "{dead:?}: the fallback got calls from every instance: {sent:?}"
        );
    }
    let to_primary = primary.arrivals();
    let opening = match dead {
        Dead::RateLimited => 2,
        Dead::ServerErrors | Dead::Timeouts => 3 + 1,
    };
    let probes = &to_primary[opening.min(to_primary.len())..];
    assert!(
        probes.iter().all(|p| p.in_flight == 1),
        "{dead:?}: after the circuit opened, one probe at a time: {:?}",
        to_primary.iter().map(|p| p.in_flight).collect::<Vec<_>>()
    );
    assert!(
        to_primary.len() <= opening + 4,
        "{dead:?}: the primary got {} calls",
        to_primary.len()
    );
    for service in [a, b] {
        service.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_answering_500_sends_briefing_calls_to_the_fallback() {
    dead_primary(Dead::ServerErrors).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_times_out_sends_briefing_calls_to_the_fallback() {
    dead_primary(Dead::Timeouts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_in_a_429_storm_sends_briefing_calls_to_the_fallback() {
    dead_primary(Dead::RateLimited).await;
}

/// With the default `llm_fallback_for` (briefing), feed calls wait for the
/// primary while briefing calls go to the fallback; with `none`, nothing
/// goes there; with `all`, feed too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llm_fallback_for_decides_which_classes_go_to_the_fallback() {
    let db = TestDb::new().await;
    db.set("llm_circuit_open_s", "60").await;
    let primary = FakeLlm::start(|_, _| Reply::ServerError).await;
    let fallback = fallback_fake().await;
    let service = db
        .serve("classes", primary.writers_with_fallback(&fallback, TIMEOUT))
        .await;

    let briefing = issues(&db, "briefing", 3, 1.0).await;
    let feed = issues(&db, "feed", 3, 1.0).await;
    claim_all(service.addr, &briefing, Some("briefing")).await;
    claim_all(service.addr, &feed, Some("feed")).await;
    until_sql(
        &db,
        &service.hub,
        30,
        &format!(
            "SELECT count(*) = 3 FROM issue WHERE processing_status = 'DONE' AND id = ANY({})",
            id_list(&briefing)
        ),
    )
    .await;
    // Every feed call has failed on the primary or waits for it.
    until_sql_polled(
        &db,
        30,
        &format!(
            "SELECT count(*) = 3 FROM issue i WHERE id = ANY({}) AND (processing_status = 'FAILED'
                OR EXISTS (SELECT 1 FROM llm_call c WHERE c.issue_id = i.id AND c.granted_at IS NULL))",
            id_list(&feed)
        ),
    )
    .await;
    assert!(
        titles_sent(&fallback)
            .iter()
            .all(|t| !t.starts_with("feed")),
        "feed stayed off the fallback"
    );

    db.set("llm_fallback_for", "none").await;
    let more = issues(&db, "none", 2, 1.0).await;
    let before = fallback.requests();
    claim_all(service.addr, &more, Some("briefing")).await;
    until_sql_polled(
        &db,
        30,
        &format!(
            "SELECT count(*) = 2 FROM issue i WHERE id = ANY({}) AND (processing_status = 'FAILED'
                OR EXISTS (SELECT 1 FROM llm_call c WHERE c.issue_id = i.id AND c.granted_at IS NULL))",
            id_list(&more)
        ),
    )
    .await;
    assert_eq!(
        fallback.requests(),
        before,
        "none: nothing goes to the fallback"
    );

    db.set("llm_fallback_for", "all").await;
    until_sql(
        &db,
        &service.hub,
        30,
        &format!(
            "SELECT count(*) = 5 FROM issue WHERE processing_status = 'DONE' AND id = ANY({})",
            id_list(&[feed.clone(), more.clone()].concat())
        ),
    )
    .await;
    service.stop().await.unwrap();
}

/// The primary fails three calls in a row, its circuit opens for a second;
/// then it answers again: the probe closes the circuit and the next calls
/// go to the primary. `/metrics` and the dashboard show the provider down,
/// then up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_recovers_gets_its_calls_back() {
    let db = TestDb::new().await;
    db.set("llm_max_in_flight", "1").await;
    db.set("llm_circuit_open_s", "1").await;
    let healthy = Arc::new(AtomicBool::new(false));
    let primary = {
        let healthy = healthy.clone();
        FakeLlm::start(move |_, _| {
            if healthy.load(Ordering::SeqCst) {
                Reply::Ok(ARTICLE.into())
            } else {
                Reply::ServerError
            }
        })
        .await
    };
    let fallback = fallback_fake().await;
    let service = db
        .serve(
            "recovers",
            primary.writers_with_fallback(&fallback, TIMEOUT),
        )
        .await;
    let first = issues(&db, "first", 4, 1.0).await;
    claim_all(service.addr, &first, Some("briefing")).await;
    until_sql_polled(
        &db,
        30,
        "SELECT COALESCE(down_until > now(), false) FROM llm_provider WHERE provider = 'primary'",
    )
    .await;
    let metrics = reqwest::get(format!("http://{}/metrics", service.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("newsnack_llm_provider_up{provider=\"primary\"} 0"),
        "{metrics}"
    );
    let dashboard: Value = get_json(
        &reqwest::Client::new(),
        &format!("http://{}/dashboard.json", service.addr),
    )
    .await;
    assert_eq!(dashboard["llm"]["providers"][0]["provider"], "primary");
    assert_eq!(dashboard["llm"]["providers"][0]["state"], "down");
    assert_eq!(dashboard["llm"]["providers"][1]["state"], "up");

    healthy.store(true, Ordering::SeqCst);
    until_sql(
        &db,
        &service.hub,
        30,
        &format!(
            "SELECT count(*) = 4 FROM issue WHERE processing_status = 'DONE' AND id = ANY({})",
            id_list(&first)
        ),
    )
    .await;
    // Past its time down, the next call probes the primary and closes the
    // circuit.
    until_sql_polled(
        &db,
        30,
        "SELECT down_until <= now() FROM llm_provider WHERE provider = 'primary'",
    )
    .await;
    let later = issues(&db, "later", 3, 1.0).await;
    claim_all(service.addr, &later, Some("briefing")).await;
    until_sql(
        &db,
        &service.hub,
        30,
        &format!(
            "SELECT count(*) = 3 FROM issue WHERE processing_status = 'DONE' AND id = ANY({})",
            id_list(&later)
        ),
    )
    .await;
    until_sql_polled(
        &db,
        30,
        "SELECT failures = 0 AND down_until IS NULL FROM llm_provider WHERE provider = 'primary'",
    )
    .await;
    let later_by_primary = db
        .scalar_i64(&format!(
            "SELECT count(*) FROM ai_article WHERE issue_id = ANY({}) AND writer = 'primary:fake-model'",
            id_list(&later)
        ))
        .await;
    assert!(later_by_primary >= 1, "the primary writes again");
    let metrics = reqwest::get(format!("http://{}/metrics", service.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("newsnack_llm_provider_up{provider=\"primary\"} 1"),
        "{metrics}"
    );
    service.stop().await.unwrap();
}

/// A writer with a circuit of its own, as an instance that learns alone
/// that the primary is down would have: after three failures in a row it
/// calls the fallback.
struct LocalCircuit {
    primary: SharedWriter,
    fallback: SharedWriter,
    failures: AtomicU32,
}

impl Writer for LocalCircuit {
    fn name(&self) -> &str {
        "local-circuit"
    }

    fn write<'a>(&'a self, issue: IssueText<'a>) -> BoxFuture<'a, Result<Article, WriteError>> {
        Box::pin(async move {
            if self.failures.load(Ordering::SeqCst) < 3 {
                match self.primary.write(issue).await {
                    Ok(article) => return Ok(article),
                    Err(_) => {
                        self.failures.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
            self.fallback.write(issue).await
        })
    }
}

/// What the shared circuit guards against: three instances, each with a
/// circuit of its own, each spend three calls on the dead primary before
/// they stop, nine in all, where the shared circuit stops every instance
/// at the threshold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_with_circuits_of_their_own_each_spend_calls_on_a_dead_primary() {
    let db = TestDb::new().await;
    db.set("generation_concurrency", "1").await;
    let primary = FakeLlm::start(|_, _| Reply::ServerError).await;
    let fallback = fallback_fake().await;
    let local = || -> SharedWriter {
        Arc::new(LocalCircuit {
            primary: primary.writer(TIMEOUT),
            fallback: fallback.writer(TIMEOUT),
            failures: AtomicU32::new(0),
        })
    };
    let services = [
        db.serve("own-a", local()).await,
        db.serve("own-b", local()).await,
        db.serve("own-c", local()).await,
    ];
    let ids = issues(&db, "story", 15, 1.0).await;
    for (service, ids) in services.iter().zip(ids.chunks(5)) {
        claim_all(service.addr, ids, Some("briefing")).await;
    }
    until_sql(
        &db,
        &services[0].hub,
        30,
        "SELECT count(*) = 15 FROM issue WHERE processing_status = 'DONE'",
    )
    .await;
    assert_eq!(primary.requests(), 9, "three per instance");
    for service in services {
        service.stop().await.unwrap();
    }
}
