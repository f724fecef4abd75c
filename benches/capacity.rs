//! Benchmark: what one PostgreSQL holds as instances are added — the
//! figures of the capacity model in docs/production.md. Prints one JSON
//! object per instance count on stdout.
//!
//! For each count in `BENCH_INSTANCES` (default `1,2,4,8`): a database of
//! its own on one durable throwaway cluster (fsync and synchronous commit
//! on, as the reference claim run), `newsnack migrate`, `BENCH_ISSUES`
//! (default 2,000) issues, that many `newsnack serve` processes with the
//! built-in writer and the default pool (16), then the claim workload of
//! `cargo bench --bench claimdrive` from outside: 16 closed-loop clients
//! per instance, each on a keep-alive connection of its own to its
//! instance, walking the same windows of 5 ids (advancing by 2) over every
//! issue, on one thread. Once every issue is `DONE` it reports requests/s
//! and latency, the CPU seconds of PostgreSQL per 1,000 requests and of
//! each instance, each instance's peak resident memory, and the server
//! sessions the instances held at most (sampled every 100 ms from
//! `pg_stat_activity`, by what they are for).
//!
//! `cargo bench --bench capacity`; a few minutes. The machine's other load
//! weighs on every figure: say how loaded it was (`uptime`) beside them.

mod common;

use common::{
    connect, knob, migrate_with, postgres_cpu_seconds, process_cpu_seconds, reference_issues,
    round1, round3, start_cluster, stop, until_all_done, wait_ready,
};

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use newsnack::embedded::EmbeddedOptions;
use serde_json::json;

const WINDOW: usize = 5;
const STRIDE: usize = 2;
const CLIENTS_PER_INSTANCE: usize = 16;

#[tokio::main]
async fn main() {
    let issues = knob("BENCH_ISSUES", 2_000) as usize;
    let counts: Vec<usize> = std::env::var("BENCH_INSTANCES")
        .unwrap_or_else(|_| "1,2,4,8".into())
        .split(',')
        .map(|n| {
            n.trim()
                .parse()
                .expect("BENCH_INSTANCES: numbers separated by commas")
        })
        .collect();
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_newsnack"));
    let cluster = start_cluster(EmbeddedOptions {
        durable: true,
        settings: vec![("max_connections".into(), "400".into())],
        ..EmbeddedOptions::default()
    })
    .await;
    let admin = connect(&cluster.url("postgres")).await;
    for instances in counts {
        let database = format!("capacity_{instances}");
        admin
            .batch_execute(&format!("CREATE DATABASE {database}"))
            .await
            .unwrap();
        let url = cluster.url(&database);
        migrate_with(&bin, &url);
        let db = connect(&url).await;
        let ids = reference_issues(&db, issues).await;

        let mut serves: Vec<(Child, String)> = (0..instances)
            .map(|i| {
                let port = TcpListener::bind("127.0.0.1:0")
                    .unwrap()
                    .local_addr()
                    .unwrap()
                    .port();
                let child = Command::new(&bin)
                    .arg("serve")
                    .env("DATABASE_URL", &url)
                    .env("NEWSNACK_LISTEN", format!("127.0.0.1:{port}"))
                    .env("NEWSNACK_INSTANCE", format!("capacity-{i}"))
                    .env("RUST_LOG", "warn")
                    .env_remove("NEWSNACK_LLM_URL")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start newsnack serve");
                (child, format!("http://127.0.0.1:{port}"))
            })
            .collect();
        for (child, base) in &mut serves {
            wait_ready(base, child).await;
        }

        let sampling = Arc::new(AtomicBool::new(true));
        let sessions = tokio::spawn(sample_sessions(
            cluster.url("postgres"),
            database.clone(),
            sampling.clone(),
        ));
        let db_cpu_before = postgres_cpu_seconds(&cluster);
        let serve_cpu_before: Vec<f64> = serves
            .iter()
            .map(|(c, _)| process_cpu_seconds(c.id()))
            .collect();
        let targets: Vec<String> = serves
            .iter()
            .map(|(_, b)| format!("{b}/ai-articles"))
            .collect();
        let (first, last) = (ids[0], *ids.last().unwrap());
        let driven = tokio::task::spawn_blocking(move || drive(&targets, first, last))
            .await
            .unwrap();

        until_all_done(&db, issues, Duration::from_secs(300)).await;
        let db_cpu = postgres_cpu_seconds(&cluster) - db_cpu_before;
        let serve_cpu: Vec<f64> = serves
            .iter()
            .zip(&serve_cpu_before)
            .map(|((c, _), before)| round3(process_cpu_seconds(c.id()) - before))
            .collect();
        let peak_rss_mib: Vec<f64> = serves
            .iter()
            .map(|(c, _)| round1(peak_rss_kib(c.id()) / 1024.0))
            .collect();
        sampling.store(false, Ordering::SeqCst);
        let sessions = sessions.await.unwrap();
        for (child, _) in &mut serves {
            stop(child);
        }
        assert_eq!(driven.failed, 0, "requests that failed outright");
        let requests = driven.latencies_ms.len();
        println!(
            "{}",
            json!({
                "bench": "capacity",
                "instances": instances,
                "clients": instances * CLIENTS_PER_INSTANCE,
                "requests": requests,
                "seconds": round3(driven.seconds),
                "requests_per_s": round1(requests as f64 / driven.seconds),
                "latency_ms_p50": round3(percentile(&driven.latencies_ms, 50.0)),
                "latency_ms_p99": round3(percentile(&driven.latencies_ms, 99.0)),
                "postgres_cpu_s": round3(db_cpu),
                "postgres_cpu_ms_per_request": round3(db_cpu * 1000.0 / requests as f64),
                "serve_cpu_s": serve_cpu,
                "serve_peak_rss_mib": peak_rss_mib,
                "sessions_at_most": sessions,
            })
        );
    }
}

/// The most server sessions of `database` seen at once while `on`, in
/// all and by what they are for (a lock session names its lock in its
/// application name; the rest are the pools' and the listeners', which
/// share the instance's), sampled every 100 ms.
async fn sample_sessions(
    admin_url: String,
    database: String,
    on: Arc<AtomicBool>,
) -> serde_json::Value {
    let admin = connect(&admin_url).await;
    let mut most: BTreeMap<String, i64> = BTreeMap::new();
    let mut total_most = 0;
    while on.load(Ordering::SeqCst) {
        let rows = admin
            .query(
                "SELECT CASE WHEN application_name LIKE 'newsnack-lock:%' THEN 'locks'
                             ELSE 'pools_and_listeners' END, count(*)
                   FROM pg_stat_activity WHERE datname = $1 GROUP BY 1",
                &[&database],
            )
            .await
            .unwrap();
        let mut total = 0;
        for row in rows {
            let (kind, n): (String, i64) = (row.get(0), row.get(1));
            total += n;
            let seen = most.entry(kind).or_default();
            *seen = (*seen).max(n);
        }
        total_most = total_most.max(total);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    json!({ "all": total_most, "by_use": most })
}

/// The peak resident memory of a process (VmHWM), in KiB.
fn peak_rss_kib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0.0)
}

/// What the clients saw.
struct Driven {
    latencies_ms: Vec<f64>,
    seconds: f64,
    failed: u64,
}

/// The clients, 16 per target, each walking every window over
/// `[first, last]` on a keep-alive connection of its own. One thread.
fn drive(targets: &[String], first: i64, last: i64) -> Driven {
    let ids: Vec<i64> = (first..=last).collect();
    let mut windows: Vec<Vec<i64>> = (0..=ids.len() - WINDOW)
        .step_by(STRIDE)
        .map(|s| ids[s..s + WINDOW].to_vec())
        .collect();
    if windows.last().and_then(|w| w.last()) != ids.last() {
        windows.push(ids[ids.len() - WINDOW..].to_vec());
    }
    let windows = Arc::new(windows);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let started = Instant::now();
        let tasks: Vec<_> = targets
            .iter()
            .flat_map(|t| std::iter::repeat_n(t.clone(), CLIENTS_PER_INSTANCE))
            .map(|url| {
                let windows = windows.clone();
                tokio::spawn(async move {
                    let client = reqwest::Client::builder()
                        .pool_max_idle_per_host(1)
                        .build()
                        .unwrap();
                    let (mut latencies, mut failed) = (Vec::new(), 0u64);
                    for w in windows.iter() {
                        let t = Instant::now();
                        match client
                            .post(&url)
                            .json(&json!({ "issue_ids": w }))
                            .send()
                            .await
                        {
                            Ok(r) if r.status() == 202 || r.status() == 409 => {
                                let _ = r.bytes().await;
                                latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                            }
                            _ => failed += 1,
                        }
                    }
                    (latencies, failed)
                })
            })
            .collect();
        let (mut latencies, mut failed) = (Vec::new(), 0);
        for task in tasks {
            let (l, f) = task.await.unwrap();
            latencies.extend(l);
            failed += f;
        }
        latencies.sort_by(f64::total_cmp);
        Driven {
            latencies_ms: latencies,
            seconds: started.elapsed().as_secs_f64(),
            failed,
        }
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((p / 100.0) * (sorted.len() - 1) as f64).round() as usize]
}
