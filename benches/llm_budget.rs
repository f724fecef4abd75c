//! The LLM budget under a feed backlog: three `serve` instances on one
//! database, an OpenAI-compatible LLM (a fake in this process) answering
//! every call in 200 ms, `llm_max_in_flight` 4; 240 feed articles queued,
//! then 5 briefing articles. Prints one JSON report:
//!
//! - how long each briefing article took from its claim to being written,
//!   in LLM call-times (target: within 3), and how much of the feed was
//!   still unwritten when the last one was. The five come again in later
//!   rounds (`BENCH_BRIEFING_ROUNDS`, every `BENCH_BRIEFING_EVERY_MS`, not
//!   a multiple of a call): the calls in flight end together, so how long
//!   the first briefing article waits for a slot depends on when in a
//!   call's 200 ms it is claimed (at its start, five articles on four
//!   slots take three call-times, however the slots are handed out);
//! - the most calls the LLM ever had in flight (target: never above the
//!   limit);
//! - the LLM's utilisation while work was queued: calls in flight,
//!   averaged over the time from the first call to the last call's start,
//!   over the limit (target: at least 90%);
//! - the database statements the clients sent per LLM call
//!   (`pg_stat_statements`, top-level only: not those the triggers and
//!   functions run), all of them and the budget's own.
//!
//! `cargo bench --bench llm_budget`. Knobs: `BENCH_FEED` (240),
//! `BENCH_BRIEFING` (5), `BENCH_BRIEFING_ROUNDS` (3),
//! `BENCH_BRIEFING_EVERY_MS` (2050), `BENCH_LIMIT` (4), `BENCH_CALL_MS`
//! (200), `BENCH_INSTANCES` (3), `BENCH_DURABLE` (1: the cluster flushes
//! its WAL).

#[path = "common/mod.rs"]
mod common;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use common::{
    average_in_flight, connect, create_database, knob, round1, round3, serve_options,
    start_cluster, titled,
};
use newsnack::embedded::EmbeddedOptions;
use newsnack::model::status::Status;
use newsnack::serve::RunningService;
use newsnack::writer::{self, WriterConfig};
use serde_json::{json, Value};

const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";

/// What the fake LLM saw.
#[derive(Default)]
struct Llm {
    /// Calls in flight now, the most ever, and every change as (when, how
    /// many after it).
    in_flight: u64,
    max_in_flight: u64,
    changes: Vec<(Instant, u64)>,
    /// Arrivals: when, and the issue's title.
    arrivals: Vec<(Instant, String)>,
}

struct Fake {
    llm: Mutex<Llm>,
    call: Duration,
}

/// Leaves the in-flight count when the answer is sent (or the caller left).
struct Leaving(Arc<Fake>);

impl Drop for Leaving {
    fn drop(&mut self) {
        let mut llm = self.0.llm.lock().unwrap();
        llm.in_flight -= 1;
        let now = llm.in_flight;
        llm.changes.push((Instant::now(), now));
    }
}

async fn chat(State(fake): State<Arc<Fake>>, Json(request): Json<Value>) -> Json<Value> {
    let prompt = request["messages"][1]["content"].as_str().unwrap_or("");
    let title = prompt
        .split("Title: ")
        .nth(1)
        .and_then(|rest| rest.split('\n').next())
        .unwrap_or("")
        .to_string();
    {
        let mut llm = fake.llm.lock().unwrap();
        llm.in_flight += 1;
        let now = llm.in_flight;
        llm.max_in_flight = llm.max_in_flight.max(now);
        llm.changes.push((Instant::now(), now));
        llm.arrivals.push((Instant::now(), title));
    }
    let _leaving = Leaving(fake.clone());
    tokio::time::sleep(fake.call).await;
    Json(json!({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ARTICLE}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 200, "completion_tokens": 60, "total_tokens": 260},
    }))
}

async fn start_fake(call: Duration) -> (Arc<Fake>, SocketAddr) {
    let fake = Arc::new(Fake {
        llm: Mutex::default(),
        call,
    });
    let router = Router::new()
        .route("/v1/chat/completions", post(chat))
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (fake, addr)
}

async fn start_service(url: &str, instance: &str, llm: SocketAddr) -> RunningService {
    let writer = writer::build(&WriterConfig {
        llm_url: Some(format!("http://{llm}/v1")),
        model: "bench".into(),
        api_key: None,
        timeout: Duration::from_secs(60),
        fallback: None,
    })
    .unwrap();
    newsnack::serve::start(serve_options(url, instance, 16), writer)
        .await
        .expect("start the service")
}

async fn claim(http: &reqwest::Client, service: &RunningService, ids: &[i64], priority: &str) {
    let response = http
        .post(format!("http://{}/ai-articles", service.addr))
        .json(&json!({ "issue_ids": ids, "priority": priority }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
}

#[tokio::main]
async fn main() {
    let feed = knob("BENCH_FEED", 240) as usize;
    let briefing = knob("BENCH_BRIEFING", 5) as usize;
    let rounds = knob("BENCH_BRIEFING_ROUNDS", 3) as usize;
    let every = Duration::from_millis(knob("BENCH_BRIEFING_EVERY_MS", 2050));
    let limit = knob("BENCH_LIMIT", 4);
    let call = Duration::from_millis(knob("BENCH_CALL_MS", 200));
    let instances = knob("BENCH_INSTANCES", 3) as usize;
    let durable = knob("BENCH_DURABLE", 1) != 0;

    let cluster = start_cluster(EmbeddedOptions {
        durable,
        settings: vec![
            ("max_connections".into(), "300".into()),
            (
                "shared_preload_libraries".into(),
                "pg_stat_statements".into(),
            ),
        ],
        ..EmbeddedOptions::default()
    })
    .await;
    let url = create_database(&cluster, "budget").await;
    let (fake, llm) = start_fake(call).await;

    let mut services = Vec::new();
    for i in 0..instances {
        services.push(start_service(&url, &format!("bench-{i}"), llm).await);
    }
    let sql = connect(&url).await;
    sql.batch_execute(&format!(
        "CREATE EXTENSION IF NOT EXISTS pg_stat_statements;
         UPDATE setting SET value = '{limit}' WHERE key = 'llm_max_in_flight';"
    ))
    .await
    .unwrap();
    let feed_ids = titled(&sql, "feed", feed).await;
    let mut briefing_rounds = Vec::new();
    for round in 0..rounds {
        briefing_rounds.push(titled(&sql, &format!("briefing {round}"), briefing).await);
    }
    sql.batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .unwrap();

    // Written times of every issue, from one instance's transition stream.
    let mut transitions = services[0].hub.subscribe();
    let watched = tokio::spawn(async move {
        let mut done: HashMap<i64, Instant> = HashMap::new();
        while let Ok(t) = transitions.recv().await {
            if t.to == Status::Done {
                done.insert(t.issue_id, Instant::now());
                if done.len() == feed + briefing * rounds {
                    break;
                }
            }
        }
        done
    });

    let http = reqwest::Client::new();
    let started = Instant::now();
    let per_instance = feed.div_ceil(instances);
    futures::future::join_all(
        services
            .iter()
            .zip(feed_ids.chunks(per_instance))
            .map(|(service, ids)| claim(&http, service, ids, "feed")),
    )
    .await;
    // The briefing comes while the backlog runs, at times that do not
    // follow the calls' rhythm.
    while fake.llm.lock().unwrap().arrivals.is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let first_call = fake.llm.lock().unwrap().arrivals[0].0;
    let mut claimed_at = Vec::new();
    for (round, ids) in briefing_rounds.iter().enumerate() {
        tokio::time::sleep_until((first_call + every * (round as u32 + 1)).into()).await;
        let asked = Instant::now();
        claim(&http, &services[round % instances], ids, "briefing").await;
        claimed_at.push((asked, Instant::now()));
    }
    let done = tokio::time::timeout(Duration::from_secs(600), watched)
        .await
        .expect("every article written within 10 minutes")
        .unwrap();
    let finished = Instant::now();

    let statements: Vec<(String, i64)> = sql
        .query(
            "SELECT regexp_replace(query, '\\s+', ' ', 'g'), calls FROM pg_stat_statements
              WHERE toplevel
                AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
              ORDER BY calls DESC",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    for service in services {
        service.stop().await.unwrap();
    }

    let llm = fake.llm.lock().unwrap();
    let calls = llm.arrivals.len() as u64;
    let call_s = call.as_secs_f64();
    let mut slowest = 0.0f64;
    let briefing_report: Vec<Value> = briefing_rounds
        .iter()
        .zip(&claimed_at)
        .enumerate()
        .map(|(round, (ids, &(claimed, answered)))| {
            let prefix = format!("briefing {round} ");
            let written: Vec<Instant> = ids.iter().map(|id| done[id]).collect();
            let last = *written.iter().max().unwrap();
            let call_times: Vec<f64> = written
                .iter()
                .map(|&at| round3((at - claimed).as_secs_f64() / call_s))
                .collect();
            slowest = call_times.iter().cloned().fold(slowest, f64::max);
            let reached: Vec<usize> = llm
                .arrivals
                .iter()
                .enumerate()
                .filter(|(_, (_, title))| title.starts_with(&prefix))
                .map(|(i, _)| i)
                .collect();
            let feed_written = feed_ids.iter().filter(|id| done[id] <= last).count();
            json!({
                "claimed_s_after_first_call": round3((claimed - llm.arrivals[0].0).as_secs_f64()),
                "claim_request_ms": round1((answered - claimed).as_secs_f64() * 1000.0),
                "first_reached_llm_after_claim_call_times": llm.arrivals.iter()
                    .find(|(_, title)| title.starts_with(&prefix))
                    .map(|(at, _)| round3((*at - claimed).as_secs_f64() / call_s)),
                "reached_llm_as_calls": reached,
                "written_after_call_times": call_times,
                "feed_unwritten_when_last_written": round3(1.0 - feed_written as f64 / feed as f64),
            })
        })
        .collect();
    let first_call = llm.arrivals.first().map(|a| a.0).unwrap_or(started);

    let last_start = llm.arrivals.last().map(|a| a.0).unwrap_or(finished);
    let utilisation = average_in_flight(&llm.changes, first_call, last_start) / limit as f64;
    // The commit-time trigger of the transition log runs its statements at
    // COMMIT, where pg_stat_statements counts them as top-level: they are
    // the database's, not the clients'.
    let by_log_trigger = |q: &str| {
        q.contains("public.issue_transition")
            || q.contains("pg_advisory_xact_lock(")
            || q.contains("json_build_object(")
            || q.contains("lease_until + open_for")
            // Migration 18: the signing key's read and the signed NOTIFY.
            || q.contains("public.notification_key")
            || (q.contains("pg_notify(") && q.ends_with(", payload)"))
    };
    let trigger_statements: i64 = statements
        .iter()
        .filter(|(q, _)| by_log_trigger(q))
        .map(|(_, n)| n)
        .sum();
    let all_statements: i64 = statements
        .iter()
        .filter(|(q, _)| !by_log_trigger(q))
        .map(|(_, n)| n)
        .sum();
    let budget_statements: i64 = statements
        .iter()
        .filter(|(q, _)| q.contains("newsnack_llm_exchange"))
        .map(|(_, n)| n)
        .sum();
    let top: BTreeMap<String, i64> = statements
        .iter()
        .filter(|(q, _)| !by_log_trigger(q))
        .take(8)
        .map(|(q, n)| (q.chars().take(90).collect(), *n))
        .collect();
    let report = json!({
        "bench": "llm_budget",
        "instances": instances,
        "llm_max_in_flight": limit,
        "llm_call_ms": call.as_millis() as u64,
        "feed_articles": feed,
        "briefing_articles": briefing,
        "llm_calls": calls,
        "briefing": {
            "rounds": briefing_report,
            "slowest_written_after_call_times": slowest,
            "target_call_times": 3,
        },
        "max_in_flight_seen_by_llm": llm.max_in_flight,
        "limit_held": llm.max_in_flight <= limit,
        "utilisation_while_queued": round3(utilisation),
        "target_utilisation": 0.9,
        "wall_s": round1((finished - started).as_secs_f64()),
        "ideal_wall_s": round1(calls as f64 * call_s / limit as f64),
        "statements": {
            "per_llm_call": round3(all_statements as f64 / calls as f64),
            "budget_per_llm_call": round3(budget_statements as f64 / calls as f64),
            "total": all_statements,
            "budget_exchanges": budget_statements,
            "run_at_commit_by_the_log_trigger": trigger_statements,
            "top": top,
        },
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
}
