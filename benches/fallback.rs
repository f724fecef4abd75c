//! Two LLM providers: what a dead or flaky primary costs. Prints one JSON
//! report with two scenarios, each on a throwaway cluster with default
//! durability and two OpenAI-compatible fakes in this process answering
//! in `BENCH_CALL_MS` (default 400):
//!
//! - `primary_down`: the primary answers every call with a 500 at once; a
//!   `newsnack run-pipeline` process (this build's binary, both providers
//!   configured, `llm_fallback_max_in_flight` = `top_k` = 5) picks five
//!   issues. Reported: from the primary's first failure to the briefing's
//!   commit, in the fallback's call-times (target: within 2), and the
//!   calls each provider got.
//! - `primary_flaky`: the primary fails every other call with a 500 at
//!   once, answers the others in a call-time; `BENCH_INSTANCES` (default
//!   2) `serve` instances work through `BENCH_ARTICLES` (default 120)
//!   briefing articles with `llm_max_in_flight` 4. Reported: the
//!   primary's utilisation, calls in flight averaged from its first call
//!   to its last call's start over the limit (target: at least 90%), and
//!   where the articles were written.
//!
//! `cargo bench --bench fallback`

#[path = "common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use common::{average_in_flight, connect, knob, round3, serve_options, start_cluster, titled};
use newsnack::embedded::{EmbeddedOptions, EmbeddedPostgres};
use newsnack::serve::RunningService;
use newsnack::writer::{self, FallbackConfig, WriterConfig};
use serde_json::{json, Value};

const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";

#[derive(Clone, Copy)]
enum Mode {
    /// Every call: a 500 at once.
    Dead,
    /// Every other call: a 500 at once; the rest answered in a call-time.
    Flaky,
    /// Every call answered in a call-time.
    Healthy,
}

/// What a fake saw: every change of its calls in flight, and when each
/// call arrived (wall clock, to compare with the database's).
#[derive(Default)]
struct Seen {
    in_flight: u64,
    changes: Vec<(Instant, u64)>,
    arrivals: Vec<SystemTime>,
    last_arrival: Option<Instant>,
}

struct Fake {
    mode: Mode,
    call: Duration,
    calls: AtomicU64,
    seen: Mutex<Seen>,
}

/// Leaves the in-flight count when the answer is sent (or the caller left).
struct Leaving(Arc<Fake>);

impl Drop for Leaving {
    fn drop(&mut self) {
        let mut seen = self.0.seen.lock().unwrap();
        seen.in_flight -= 1;
        let now = seen.in_flight;
        seen.changes.push((Instant::now(), now));
    }
}

async fn chat(State(fake): State<Arc<Fake>>, Json(_): Json<Value>) -> Response {
    let n = fake.calls.fetch_add(1, Ordering::SeqCst);
    {
        let mut seen = fake.seen.lock().unwrap();
        seen.in_flight += 1;
        let now = seen.in_flight;
        seen.changes.push((Instant::now(), now));
        seen.arrivals.push(SystemTime::now());
        seen.last_arrival = Some(Instant::now());
    }
    let _leaving = Leaving(fake.clone());
    let fails = match fake.mode {
        Mode::Dead => true,
        Mode::Flaky => n % 2 == 0,
        Mode::Healthy => false,
    };
    if fails {
        return (StatusCode::INTERNAL_SERVER_ERROR, "{\"error\":\"down\"}").into_response();
    }
    tokio::time::sleep(fake.call).await;
    Json(json!({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ARTICLE}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 200, "completion_tokens": 60, "total_tokens": 260},
    }))
    .into_response()
}

async fn start_fake(mode: Mode, call: Duration) -> (Arc<Fake>, SocketAddr) {
    let fake = Arc::new(Fake {
        mode,
        call,
        calls: AtomicU64::new(0),
        seen: Mutex::default(),
    });
    let router = Router::new()
        .route("/v1/chat/completions", post(chat))
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (fake, addr)
}

fn epoch_s(at: SystemTime) -> f64 {
    at.duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// A database of its own on `cluster`, migrated, with `settings` set.
async fn database(cluster: &EmbeddedPostgres, name: &str, settings: &[(&str, u64)]) -> String {
    let admin = connect(&cluster.url("postgres")).await;
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let url = cluster.url(name);
    let endpoint = newsnack::db::Endpoint::parse(&url, "newsnack-bench").unwrap();
    newsnack::db::migrate::migrate(&mut endpoint.connect().await.unwrap())
        .await
        .unwrap();
    let sql = connect(&url).await;
    for (key, value) in settings {
        sql.execute(
            "UPDATE setting SET value = $2 WHERE key = $1",
            &[key, &value.to_string()],
        )
        .await
        .unwrap();
    }
    url
}

async fn primary_down(cluster: &EmbeddedPostgres, call: Duration) -> Value {
    let url = database(cluster, "down", &[("llm_fallback_max_in_flight", 5)]).await;
    let sql = connect(&url).await;
    titled(&sql, "story", 5).await;
    let (primary, primary_addr) = start_fake(Mode::Dead, call).await;
    let (fallback, fallback_addr) = start_fake(Mode::Healthy, call).await;
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_newsnack"))
        .arg("run-pipeline")
        .env("DATABASE_URL", &url)
        .env("NEWSNACK_LLM_URL", format!("http://{primary_addr}/v1"))
        .env(
            "NEWSNACK_LLM_FALLBACK_URL",
            format!("http://{fallback_addr}/v1"),
        )
        .env("RUST_LOG", "warn")
        .output()
        .await
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let summary: Value = serde_json::from_slice(&run.stdout).unwrap();
    let published: f64 = sql
        .query_one(
            "SELECT extract(epoch FROM created_at)::float8 FROM briefing ORDER BY id DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let first_failure = epoch_s(primary.seen.lock().unwrap().arrivals[0]);
    let call_times = (published - first_failure) / call.as_secs_f64();
    json!({
        "outcome": summary["outcome"],
        "articles": summary["completed"].as_array().map_or(0, Vec::len),
        "published_after_first_failure_call_times": round3(call_times),
        "target_call_times": 2,
        "met": call_times <= 2.0,
        "calls_to_primary": primary.calls.load(Ordering::SeqCst),
        "calls_to_fallback": fallback.calls.load(Ordering::SeqCst),
        "attempts_spent": sql.query_one("SELECT sum(attempts)::bigint FROM issue", &[]).await.unwrap().get::<_, i64>(0),
    })
}

async fn start_service(
    url: &str,
    instance: &str,
    primary: SocketAddr,
    fallback: SocketAddr,
) -> RunningService {
    let writers = writer::build_all(&WriterConfig {
        llm_url: Some(format!("http://{primary}/v1")),
        model: "bench".into(),
        api_key: None,
        timeout: Duration::from_secs(60),
        fallback: Some(FallbackConfig {
            llm_url: format!("http://{fallback}/v1"),
            model: "bench-fallback".into(),
            api_key: None,
        }),
    })
    .unwrap();
    newsnack::serve::start(serve_options(url, instance, 16), writers)
        .await
        .expect("start the service")
}

async fn primary_flaky(cluster: &EmbeddedPostgres, call: Duration) -> Value {
    let limit = 4;
    let articles = knob("BENCH_ARTICLES", 120) as usize;
    let instances = knob("BENCH_INSTANCES", 2) as usize;
    let url = database(
        cluster,
        "flaky",
        &[
            ("llm_max_in_flight", limit),
            ("llm_fallback_max_in_flight", limit),
        ],
    )
    .await;
    let sql = connect(&url).await;
    let ids = titled(&sql, "story", articles).await;
    let (primary, primary_addr) = start_fake(Mode::Flaky, call).await;
    let (fallback, fallback_addr) = start_fake(Mode::Healthy, call).await;
    let mut services = Vec::new();
    for i in 0..instances {
        services
            .push(start_service(&url, &format!("flaky-{i}"), primary_addr, fallback_addr).await);
    }
    let mut done = services[0].hub.subscribe();
    let http = reqwest::Client::new();
    for (service, ids) in services
        .iter()
        .zip(ids.chunks(articles.div_ceil(instances)))
    {
        let response = http
            .post(format!("http://{}/ai-articles", service.addr))
            .json(&json!({ "issue_ids": ids, "priority": "briefing" }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 202);
    }
    let mut written = 0;
    while written < articles {
        let t = tokio::time::timeout(Duration::from_secs(600), done.recv())
            .await
            .expect("every article within 10 minutes")
            .unwrap();
        if t.to == newsnack::model::status::Status::Done {
            written += 1;
        }
    }
    for service in services {
        service.stop().await.unwrap();
    }
    let utilisation = {
        let seen = primary.seen.lock().unwrap();
        let (first, last) = (seen.changes[0].0, seen.last_arrival.unwrap());
        average_in_flight(&seen.changes, first, last) / limit as f64
    };
    let by: serde_json::Map<String, Value> = sql
        .query(
            "SELECT writer, count(*) FROM ai_article GROUP BY writer ORDER BY writer",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), json!(r.get::<_, i64>(1))))
        .collect();
    json!({
        "articles": articles,
        "instances": instances,
        "llm_max_in_flight": limit,
        "primary_utilisation": round3(utilisation),
        "target_utilisation": 0.9,
        "met": utilisation >= 0.9,
        "calls_to_primary": primary.calls.load(Ordering::SeqCst),
        "calls_to_fallback": fallback.calls.load(Ordering::SeqCst),
        "written_by": by,
        "attempts_above_one": sql.query_one("SELECT count(*) FROM issue WHERE attempts > 1", &[]).await.unwrap().get::<_, i64>(0),
    })
}

#[tokio::main]
async fn main() {
    let call = Duration::from_millis(knob("BENCH_CALL_MS", 400));
    let cluster = start_cluster(EmbeddedOptions {
        durable: true,
        settings: vec![("max_connections".into(), "200".into())],
        ..EmbeddedOptions::default()
    })
    .await;
    let started = Instant::now();
    let down = primary_down(&cluster, call).await;
    let flaky = primary_flaky(&cluster, call).await;
    let report = json!({
        "bench": "fallback",
        "call_ms": call.as_millis() as u64,
        "primary_down": down,
        "primary_flaky": flaky,
        "wall_s": round3(started.elapsed().as_secs_f64()),
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}
