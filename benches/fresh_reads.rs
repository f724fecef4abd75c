//! Benchmark: what `GET /dashboard.json` and `GET /metrics` cost on a
//! fresh install, as a client sees them. Prints one JSON object: per
//! install, per endpoint, the median and p90 of a request (ms), and
//! whether every median is within the target (25 ms).
//!
//! A fresh install is a new cluster and a new database that nothing has
//! analyzed: `newsnack serve` migrates it at start-up, and the planner
//! estimates every table by its default size. Two installs, each served
//! by two `serve` processes of the binary under test: one with the
//! built-in writer, one with `NEWSNACK_LLM_URL` pointing at an
//! OpenAI-compatible fake in this process (it only has to be there: no
//! issue is generated). The requests go one at a time, turn by turn to
//! every process, so a machine that speeds up or slows down weighs on all
//! alike.
//!
//! Knobs: `FRESH_READS_SAMPLES` (requests per endpoint and process,
//! default 40); `BENCH_BIN` measures another build's binary (this build's
//! otherwise), e.g. the one before the service's sessions planned without
//! JIT.
//!
//! `cargo bench --bench fresh_reads`; about half a minute.

mod common;

use common::{create_database, knob, round3, start_cluster, stop, wait_ready};

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use axum::routing::post;
use axum::{Json, Router};
use newsnack::embedded::EmbeddedOptions;
use serde_json::{json, Map, Value};

/// The median a request must stay within, in ms.
const TARGET_MS: f64 = 25.0;

const ENDPOINTS: [&str; 2] = ["/dashboard.json", "/metrics"];

#[tokio::main]
async fn main() {
    let samples = knob("FRESH_READS_SAMPLES", 40) as usize;
    let bin = std::env::var_os("BENCH_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_newsnack")));
    let llm = start_fake_llm().await;
    let cluster = start_cluster(EmbeddedOptions::default()).await;

    // Two installs, two processes each.
    let installs = [("offline", None), ("llm", Some(format!("http://{llm}/v1")))];
    let mut processes: Vec<(&str, String, Child)> = Vec::new();
    for (install, llm_url) in &installs {
        let url = create_database(&cluster, &format!("fresh_{install}")).await;
        for n in 0..2 {
            let (base, mut child) = serve(&bin, &url, &format!("{install}-{n}"), llm_url);
            wait_ready(&base, &mut child).await;
            processes.push((install, base, child));
        }
    }

    let http = reqwest::Client::new();
    let mut times: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); ENDPOINTS.len()]; processes.len()];
    for _ in 0..samples {
        for (p, (_, base, _)) in processes.iter().enumerate() {
            for (e, endpoint) in ENDPOINTS.iter().enumerate() {
                let started = Instant::now();
                let response = http.get(format!("{base}{endpoint}")).send().await.unwrap();
                assert!(
                    response.status().is_success(),
                    "GET {endpoint}: {}",
                    response.status()
                );
                response.bytes().await.unwrap();
                times[p][e].push(started.elapsed().as_secs_f64() * 1000.0);
            }
        }
    }

    let mut report = Map::new();
    let mut met = true;
    for (install, _) in &installs {
        let mut per_endpoint = Map::new();
        for (e, endpoint) in ENDPOINTS.iter().enumerate() {
            let mut all: Vec<f64> = processes
                .iter()
                .zip(&times)
                .filter(|((i, _, _), _)| i == install)
                .flat_map(|(_, t)| t[e].iter().copied())
                .collect();
            all.sort_by(f64::total_cmp);
            let median = all[all.len() / 2];
            met &= median <= TARGET_MS;
            per_endpoint.insert(
                endpoint.to_string(),
                json!({
                    "median_ms": round3(median),
                    "p90_ms": round3(all[all.len() * 9 / 10]),
                    "max_ms": round3(*all.last().unwrap()),
                    "requests": all.len(),
                }),
            );
        }
        report.insert(install.to_string(), Value::Object(per_endpoint));
    }
    for (_, _, child) in &mut processes {
        stop(child);
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({
            "benchmark": "fresh_reads",
            "binary": bin.display().to_string(),
            "processes_per_install": 2,
            "samples_per_endpoint_and_process": samples,
            "installs": report,
            "target_median_ms": TARGET_MS,
            "met": met,
        }))
        .unwrap()
    );
}

/// `newsnack serve` on `url` at a free loopback port, as `instance`, with
/// the LLM at `llm_url` or the built-in writer; its base URL and process.
fn serve(bin: &PathBuf, url: &str, instance: &str, llm_url: &Option<String>) -> (String, Child) {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut command = Command::new(bin);
    command
        .arg("serve")
        .env("DATABASE_URL", url)
        .env("NEWSNACK_LISTEN", format!("127.0.0.1:{port}"))
        .env("NEWSNACK_INSTANCE", instance)
        .env("RUST_LOG", "warn")
        .env_remove("NEWSNACK_DIRECT_DATABASE_URL")
        .env_remove("NEWSNACK_LLM_URL")
        .stdout(Stdio::null());
    if let Some(llm_url) = llm_url {
        command.env("NEWSNACK_LLM_URL", llm_url);
    }
    let child = command.spawn().expect("start newsnack serve");
    (format!("http://127.0.0.1:{port}"), child)
}

/// An OpenAI-compatible fake that answers every call with one short
/// article; its address.
async fn start_fake_llm() -> SocketAddr {
    async fn chat(Json(_): Json<Value>) -> Json<Value> {
        Json(json!({
            "choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant",
                "content": "{\"headline\": \"A headline\", \"body\": \"A body.\"}"}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }))
    }
    let router = Router::new().route("/v1/chat/completions", post(chat));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}
