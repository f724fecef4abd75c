//! Benchmark: 1,000 deferred waits in one triggerer-like process. Prints
//! one JSON object on stdout.
//!
//! A throwaway cluster and an in-process `serve`; `BENCH_WAITS` (default
//! 1,000) issues made `IN_PROGRESS` by plain SQL for each of two ways:
//! `trigger` runs one `NewsnackWaitTrigger.run()` per issue in one asyncio
//! loop (`benches/airflow_waits.py`, in the Airflow 3 venv the tests
//! cache), as one triggerer process holds them; `raw` sends the same
//! `POST /waits` with aiohttp alone, the service's own wait seen from the
//! same kind of client, run second (`BENCH_RAW_FIRST=1`: first). Once
//! the service's hub counts every wait's watch, the Python process's
//! resident memory is read (its growth over the warmed-up process, per
//! wait), one `UPDATE` commits every issue `DONE`, and each wait's latency
//! runs from that commit's acknowledgement to the moment its answer (the
//! trigger's event) arrived (both wall clocks of this machine).
//!
//! `cargo bench --bench airflow_waits`

#[path = "../tests/common/python.rs"]
#[allow(dead_code)]
mod python;

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{
    connect, create_database, in_progress, knob, round1, round3, serve_options, start_cluster,
};
use newsnack::embedded::EmbeddedOptions;
use serde_json::{json, Value};

const DRIVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/airflow_waits.py");

#[tokio::main]
async fn main() {
    let waits = knob("BENCH_WAITS", 1_000) as usize;
    raise_open_files();
    let bin = python::provider_venv("airflow3-provider", python::AIRFLOW_3).await;
    let cluster = start_cluster(EmbeddedOptions {
        durable: true,
        settings: vec![("max_connections".into(), "100".into())],
        ..EmbeddedOptions::default()
    })
    .await;
    let url = create_database(&cluster, "bench").await;
    let service = newsnack::serve::start(
        serve_options(&url, "airflow-waits", 16),
        std::sync::Arc::new(newsnack::writer::OfflineWriter),
    )
    .await
    .expect("start the service");
    let db = connect(&url).await;
    let mut results = serde_json::Map::new();
    // The second way meets a service the first has warmed up:
    // BENCH_RAW_FIRST=1 swaps them, to tell order from way.
    let order = if knob("BENCH_RAW_FIRST", 0) == 1 {
        ["raw", "trigger"]
    } else {
        ["trigger", "raw"]
    };
    for way in order {
        let ids = in_progress(&db, waits + 5).await;
        results.insert(way.into(), run(&bin, way, &service, &db, &ids).await);
    }
    let report = json!({
        "benchmark": "deferred waits: one asyncio loop of NewsnackWaitTrigger.run() beside plain POST /waits",
        "waits": waits,
        "order": order,
        "ways": results,
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    service.stop().await.unwrap();
    drop(db);
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

/// One way's run on `ids` (the first five warm it up).
async fn run(
    bin: &std::path::Path,
    way: &str,
    service: &newsnack::serve::RunningService,
    db: &tokio_postgres::Client,
    ids: &[i64],
) -> Value {
    let connection =
        json!({"conn_type": "newsnack", "host": "127.0.0.1", "port": service.addr.port()});
    let deadline = (time::OffsetDateTime::now_utc() + time::Duration::minutes(10))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    let mut driver = Command::new(bin.join("python"))
        .arg(DRIVER)
        .args([way, &deadline])
        .env("AIRFLOW_CONN_NEWSNACK_DEFAULT", connection.to_string())
        .env(
            "AIRFLOW_HOME",
            std::env::temp_dir().join("newsnack-bench-airflow"),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the Python driver");
    let pid = driver.id();
    let mut input = driver.stdin.take().unwrap();
    let mut output = BufReader::new(driver.stdout.take().unwrap());
    writeln!(input, "{}", json!(ids)).unwrap();
    let mut line = String::new();
    output.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "warm", "the driver's first line");
    let warm_kb = rss_kb(pid);
    let before = open_waits(service);
    writeln!(input, "go").unwrap();
    let opening = Instant::now();
    while open_waits(service) < before + ids.len() - 5 {
        assert!(
            opening.elapsed() < Duration::from_secs(300),
            "waits not open in 300 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let armed_s = opening.elapsed().as_secs_f64();
    let open_kb = rss_kb(pid);
    db.execute(
        "UPDATE issue SET processing_status = 'DONE' WHERE id = ANY($1)",
        &[&ids],
    )
    .await
    .unwrap();
    let committed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let answers: Value = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        output.read_line(&mut line).unwrap();
        serde_json::from_str(&line).expect("the driver's answers")
    })
    .await
    .unwrap();
    assert!(driver.wait().unwrap().success());
    let mut latencies: Vec<f64> = answers["answered"]
        .as_object()
        .unwrap()
        .values()
        .map(|at| (at.as_f64().unwrap() - committed) * 1000.0)
        .collect();
    assert_eq!(latencies.len(), ids.len() - 5);
    latencies.sort_by(f64::total_cmp);
    let per_wait = (open_kb as f64 - warm_kb as f64) * 1024.0 / latencies.len() as f64;
    json!({
        "rss_kb": {"warm": warm_kb, "waits_open": open_kb},
        "bytes_per_wait": per_wait.round(),
        "added_mb": round1((open_kb as f64 - warm_kb as f64) / 1024.0),
        "seconds_to_open_all": round3(armed_s),
        "latency_ms_from_commit": {
            "p50": round3(percentile(&latencies, 50.0)),
            "p99": round3(percentile(&latencies, 99.0)),
            "max": round3(percentile(&latencies, 100.0)),
        },
    })
}

/// Waits armed on the service: each holds one watch on its issue.
fn open_waits(service: &newsnack::serve::RunningService) -> usize {
    service.hub.watch_count()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn raise_open_files() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reading and raising this process's own limit (children inherit it).
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
}
