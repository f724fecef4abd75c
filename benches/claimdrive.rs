//! Benchmark: the seeds' claim workload measured from outside, as a neutral
//! driver sees it. Prints one JSON object on stdout.
//!
//! A throwaway cluster with its default durability (fsync and synchronous
//! commit on); for each run a database of its own, migrated by the binary
//! under test (`newsnack migrate`), `BENCH_ISSUES` (default 2,000) issues
//! inserted with plain SQL, and `newsnack serve` started as a process of its
//! own with the built-in writer, so generation runs while the claims come.
//! Then `BENCH_CLIENTS` (default 16) closed-loop clients, each on its own
//! keep-alive connection, walk THE SAME windows of 5 ids (advancing by 2)
//! and `POST` each to `/ai-articles`: most requests overlap and answer 409.
//! The clients run on one thread of their own, so the driver costs the same
//! whatever it drives. Once every issue is `DONE`, the run checks that no id
//! was claimed twice and that every issue has exactly one article, and
//! reports requests/s, p50/p99 latency, the answers' codes, and the CPU
//! seconds of the `serve` process and of the PostgreSQL processes.
//!
//! The issues are the reference run's: 2,000 short rows, about thirty pages.
//! That shape matters: on it, a generic plan that cannot see how many ids
//! come finds a pass over the table cheaper than looking the ids up in the
//! key, which the other benches' tables (wider rows, or tens of thousands
//! of issues) never show. The cluster is durable because every transition
//! commits under the log's lock, fsync included: what the database does on
//! the same cores meanwhile stretches that serial chain.
//!
//! `BENCH_BASELINE_BIN=/path/to/newsnack` runs another build's binary too,
//! alternately with this one (baseline first), `BENCH_PAIRS` (default 1)
//! pairs, and reports both builds' medians and their ratio.
//! `BENCH_BIN` replaces this build's binary. `BENCH_STATEMENTS=1` loads
//! `pg_stat_statements` with `track_functions = 'pl'` and reports, per run,
//! the statements and functions that took the server's time (it costs the
//! server time of its own: compare such runs only with each other).
//! `BENCH_OTLP=1` starts a real OTLP receiver (the `rotel` collector the
//! trace tests use, discarding what it receives) and runs this build with
//! every span exported to it (`OTEL_TRACES_SAMPLER=always_on`) against the
//! baseline with tracing off; without `BENCH_BASELINE_BIN` the baseline is
//! this build, so the ratio is what exporting costs. Each run then reports
//! the spans the receiver counted and those the service lost.
//! `BENCH_DURABLE=0` turns fsync off (not the reference run);
//! `BENCH_PG_SETTINGS=name=value,..` adds server settings, and
//! `BENCH_KEEP_LOG=path` keeps the server's log there.
//!
//! `cargo bench --bench claimdrive`

mod common;

#[path = "../tests/common/python.rs"]
#[allow(dead_code)]
mod python;

use common::{
    connect, knob, migrate_with, postgres_cpu_seconds, process_cpu_seconds, reference_issues,
    round1, round3, start_cluster, stop, until_all_done, wait_ready,
};

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use newsnack::embedded::{EmbeddedOptions, EmbeddedPostgres};
use serde_json::json;

const WINDOW: usize = 5;
const STRIDE: usize = 2;

#[tokio::main]
async fn main() {
    let issues = knob("BENCH_ISSUES", 2_000) as usize;
    let clients = knob("BENCH_CLIENTS", 16) as usize;
    let pairs = knob("BENCH_PAIRS", 1).max(1) as usize;
    let durable = knob("BENCH_DURABLE", 1) != 0;
    let statements = knob("BENCH_STATEMENTS", 0) != 0;
    let this: PathBuf = std::env::var_os("BENCH_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_newsnack")));
    let otlp = (knob("BENCH_OTLP", 0) != 0).then_some(());
    let baseline: Option<PathBuf> = std::env::var_os("BENCH_BASELINE_BIN")
        .map(PathBuf::from)
        .or_else(|| otlp.map(|()| this.clone()));
    let receiver = match otlp {
        Some(()) => Some(Receiver::start().await),
        None => None,
    };

    let mut settings = vec![("max_connections".to_string(), "200".to_string())];
    if statements {
        settings.push((
            "shared_preload_libraries".into(),
            "pg_stat_statements".into(),
        ));
        settings.push(("pg_stat_statements.track".into(), "all".into()));
        settings.push(("track_functions".into(), "pl".into()));
    }
    // `BENCH_PG_SETTINGS=name=value,name=value`: more server settings.
    if let Ok(extra) = std::env::var("BENCH_PG_SETTINGS") {
        for pair in extra.split(',').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').expect("name=value");
            settings.push((name.trim().into(), value.trim().into()));
        }
    }
    let cluster = start_cluster(EmbeddedOptions {
        durable,
        settings,
        ..EmbeddedOptions::default()
    })
    .await;
    let admin = connect(&cluster.url("postgres")).await;
    if statements {
        admin
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .await
            .unwrap();
    }

    let workload = Workload {
        issues,
        clients,
        statements,
    };
    let mut builds: Vec<(&str, &Path)> = Vec::new();
    if let Some(b) = &baseline {
        builds.push(("baseline", b));
    }
    builds.push(("this", &this));
    let mut runs = Vec::new();
    let mut by_build: HashMap<&str, Vec<(f64, f64)>> = HashMap::new();
    for pair in 0..pairs {
        for &(name, bin) in &builds {
            let database = format!("claimdrive_{name}_{pair}");
            let export = receiver.as_ref().filter(|_| name == "this");
            let run = one_run(&cluster, &admin, bin, &database, workload, export).await;
            let rps = run["requests_per_s"].as_f64().unwrap();
            let p99 = run["latency_ms_p99"].as_f64().unwrap();
            by_build.entry(name).or_default().push((rps, p99));
            eprintln!("{name} #{pair}: {rps:.0} requests/s, p99 {p99:.2} ms");
            runs.push(json!({ "build": name, "pair": pair, "run": run }));
            // Each run's database goes, so the next one starts on a
            // cluster as small as the first did.
            admin
                .batch_execute(&format!("DROP DATABASE {database}"))
                .await
                .unwrap();
        }
    }
    let summary = |name: &str| {
        by_build.get(name).map(|v| {
            let rps: Vec<f64> = v.iter().map(|r| r.0).collect();
            let p99: Vec<f64> = v.iter().map(|r| r.1).collect();
            json!({ "median_requests_per_s": round1(median(&rps)), "median_p99_ms": round3(median(&p99)) })
        })
    };
    let ratio = baseline.as_ref().map(|_| {
        let m = |name: &str| median(&by_build[name].iter().map(|r| r.0).collect::<Vec<_>>());
        // Per pair too, to see how much the machine moved between runs.
        let per_pair: Vec<f64> = by_build["this"]
            .iter()
            .zip(&by_build["baseline"])
            .map(|(t, b)| round3(t.0 / b.0))
            .collect();
        json!({ "median": round3(m("this") / m("baseline")), "per_pair": per_pair })
    });
    // `BENCH_KEEP_LOG=path`: the server's log, kept after the cluster goes.
    if let Some(path) = std::env::var_os("BENCH_KEEP_LOG") {
        std::fs::copy(cluster.dir().unwrap().join("server.log"), path).unwrap();
    }
    println!(
        "{}",
        json!({
            "bench": "claimdrive",
            "durable": durable,
            "exported_to_otlp_receiver": otlp.is_some(),
            "issues": issues,
            "clients": clients,
            "window": WINDOW,
            "stride": STRIDE,
            "this": { "bin": this, "summary": summary("this") },
            "baseline": baseline.as_ref().map(|b| json!({ "bin": b, "summary": summary("baseline") })),
            "requests_per_s_this_over_baseline": ratio,
            "runs": runs,
        })
    );
}

/// What every run drives: the issues added, the clients, whether the
/// server's statements are tracked.
#[derive(Clone, Copy)]
struct Workload {
    issues: usize,
    clients: usize,
    statements: bool,
}

/// One run of `bin` on a fresh database: migrate, add the issues, serve,
/// drive, wait for every issue to be `DONE`, check, stop.
async fn one_run(
    cluster: &EmbeddedPostgres,
    admin: &tokio_postgres::Client,
    bin: &Path,
    database: &str,
    workload: Workload,
    export: Option<&Receiver>,
) -> serde_json::Value {
    let Workload {
        issues,
        clients,
        statements,
    } = workload;
    admin
        .batch_execute(&format!("CREATE DATABASE {database}"))
        .await
        .unwrap();
    let url = cluster.url(database);
    migrate_with(bin, &url);
    let db = connect(&url).await;
    let ids = reference_issues(&db, issues).await;
    let (first, last) = (*ids.iter().min().unwrap(), *ids.iter().max().unwrap());
    if statements {
        db.batch_execute("SELECT pg_stat_reset()").await.unwrap();
        admin
            .batch_execute("SELECT pg_stat_statements_reset()")
            .await
            .unwrap();
    }

    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let db_cpu_before = postgres_cpu_seconds(cluster);
    let wal_before = wal(admin).await;
    let work_before = database_work(admin, database).await;
    let spans_before = export.map(Receiver::spans);
    let receiver_cpu_before = export.map(|r| process_cpu_seconds(r.rotel.pid()));
    let mut serve = Command::new(bin);
    if let Some(receiver) = export {
        serve
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint)
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            .env("OTEL_TRACES_SAMPLER", "always_on");
    } else {
        serve
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    }
    let mut serve = serve
        .arg("serve")
        .env("DATABASE_URL", &url)
        .env("NEWSNACK_LISTEN", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .env_remove("NEWSNACK_LLM_URL")
        .stdout(Stdio::null())
        .spawn()
        .expect("start newsnack serve");
    let base = format!("http://127.0.0.1:{port}");
    wait_ready(&base, &mut serve).await;
    let serve_cpu_before = process_cpu_seconds(serve.id());

    let target = format!("{base}/ai-articles");
    let sampling = statements.then(|| {
        let (url, name) = (cluster.url("postgres"), database.to_string());
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        (stop.clone(), tokio::spawn(sample_waits(url, name, stop)))
    });
    let driven = tokio::task::spawn_blocking(move || drive(&target, first, last, clients))
        .await
        .unwrap();
    let waits = match sampling {
        Some((stop, task)) => {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            Some(task.await.unwrap())
        }
        None => None,
    };

    // Every issue DONE: the writer finishes what was claimed.
    until_all_done(&db, issues, Duration::from_secs(120)).await;
    let serve_cpu = process_cpu_seconds(serve.id()) - serve_cpu_before;
    let spans_lost = match export {
        Some(_) => Some(spans_lost(&base).await),
        None => None,
    };
    stop(&mut serve);
    let spans_received = export
        .zip(spans_before)
        .map(|(r, before)| r.settled() - before);
    let receiver_cpu = export
        .zip(receiver_cpu_before)
        .map(|(r, before)| process_cpu_seconds(r.rotel.pid()) - before);
    let db_cpu = postgres_cpu_seconds(cluster) - db_cpu_before;
    let wal_after = wal(admin).await;
    let work: serde_json::Map<String, serde_json::Value> = database_work(admin, database)
        .await
        .iter()
        .zip(&work_before)
        .map(|((name, after), (_, before))| (name.to_string(), json!(after - before)))
        .collect();
    let wal_delta: serde_json::Map<String, serde_json::Value> = wal_after
        .iter()
        .zip(&wal_before)
        .map(|((name, after), (_, before))| (name.to_string(), json!(after - before)))
        .collect();

    let not_one_article: i64 = db
        .query_one(
            "SELECT count(*) FROM issue i
              WHERE (SELECT count(*) FROM ai_article a WHERE a.issue_id = i.id) <> 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        not_one_article, 0,
        "issues without exactly one article: {not_one_article}"
    );
    assert_eq!(driven.claimed_twice, 0, "ids claimed twice");
    assert_eq!(driven.codes.get(&0), None, "requests that failed outright");
    let database_time = if statements {
        Some(database_time(admin, &db, database).await)
    } else {
        None
    };
    json!({
        "requests": driven.latencies_ms.len(),
        "seconds": round3(driven.seconds),
        "requests_per_s": round1(driven.latencies_ms.len() as f64 / driven.seconds),
        "latency_ms_p50": round3(percentile(&driven.latencies_ms, 50.0)),
        "latency_ms_p99": round3(percentile(&driven.latencies_ms, 99.0)),
        "codes": driven.codes,
        "claimed": driven.claimed,
        "claimed_twice": driven.claimed_twice,
        "issues_without_exactly_one_article": not_one_article,
        "cpu_s": {
            "serve": round3(serve_cpu),
            "postgres": round3(db_cpu),
            "otlp_receiver": receiver_cpu.map(round3),
        },
        "wal": wal_delta,
        "database_work": work,
        "database_time": database_time,
        "backend_samples_while_driven": waits,
        "spans_exported": { "received": spans_received, "lost": spans_lost },
    })
}

/// What the clients saw.
struct Driven {
    latencies_ms: Vec<f64>,
    seconds: f64,
    codes: HashMap<u16, u64>,
    claimed: usize,
    claimed_twice: usize,
}

/// The clients: each walks every window over `[first, last]` in order on a
/// keep-alive connection of its own, one request at a time. One thread.
fn drive(url: &str, first: i64, last: i64, clients: usize) -> Driven {
    let ids: Vec<i64> = (first..=last).collect();
    let mut windows: Vec<Vec<i64>> = (0..=ids.len().saturating_sub(WINDOW))
        .step_by(STRIDE)
        .map(|s| ids[s..s + WINDOW].to_vec())
        .collect();
    if windows.last().and_then(|w| w.last()) != ids.last() {
        windows.push(ids[ids.len() - WINDOW..].to_vec());
    }
    let windows = std::sync::Arc::new(windows);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let started = Instant::now();
        let tasks: Vec<_> = (0..clients)
            .map(|_| {
                let (url, windows) = (url.to_string(), windows.clone());
                tokio::spawn(async move {
                    let client = reqwest::Client::builder()
                        .pool_max_idle_per_host(1)
                        .build()
                        .unwrap();
                    let (mut lat, mut codes, mut claimed) =
                        (Vec::new(), HashMap::<u16, u64>::new(), Vec::new());
                    for w in windows.iter() {
                        let t = Instant::now();
                        let answer = client
                            .post(&url)
                            .json(&json!({ "issue_ids": w }))
                            .send()
                            .await;
                        let Ok(answer) = answer else {
                            *codes.entry(0).or_default() += 1;
                            continue;
                        };
                        let code = answer.status().as_u16();
                        let body: serde_json::Value =
                            answer.json().await.unwrap_or(serde_json::Value::Null);
                        lat.push(t.elapsed().as_secs_f64() * 1000.0);
                        *codes.entry(code).or_default() += 1;
                        if code == 202 {
                            if let Some(v) = body.get("claimed").and_then(|v| v.as_array()) {
                                claimed.extend(v.iter().filter_map(|x| x.as_i64()));
                            }
                        }
                    }
                    (lat, codes, claimed)
                })
            })
            .collect();
        let (mut lat, mut codes, mut claimed) =
            (Vec::new(), HashMap::<u16, u64>::new(), Vec::<i64>::new());
        for t in tasks {
            let (l, c, cl) = t.await.unwrap();
            lat.extend(l);
            for (k, v) in c {
                *codes.entry(k).or_default() += v;
            }
            claimed.extend(cl);
        }
        let seconds = started.elapsed().as_secs_f64();
        lat.sort_by(f64::total_cmp);
        let n = claimed.len();
        claimed.sort_unstable();
        claimed.dedup();
        Driven {
            latencies_ms: lat,
            seconds,
            codes,
            claimed: n,
            claimed_twice: n - claimed.len(),
        }
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((p / 100.0) * (sorted.len() - 1) as f64).round() as usize]
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The statements and functions that took the server's time in this run's
/// database (`pg_stat_statements`, nested statements included;
/// `pg_stat_user_functions`).
async fn database_time(
    admin: &tokio_postgres::Client,
    db: &tokio_postgres::Client,
    database: &str,
) -> serde_json::Value {
    let statements: Vec<_> = admin
        .query(
            "SELECT s.calls, s.total_exec_time, s.total_exec_time / s.calls, s.rows, s.toplevel,
                    left(regexp_replace(s.query, '\\s+', ' ', 'g'), 160)
               FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
              WHERE d.datname = $1 AND s.calls > 0
              ORDER BY s.total_exec_time DESC LIMIT 25",
            &[&database],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| {
            json!({
                "calls": r.get::<_, i64>(0),
                "total_ms": round1(r.get::<_, f64>(1)),
                "mean_ms": round3(r.get::<_, f64>(2)),
                "rows": r.get::<_, i64>(3),
                "top_level": r.get::<_, bool>(4),
                "statement": r.get::<_, String>(5),
            })
        })
        .collect();
    let all: (i64, f64) = admin
        .query_one(
            "SELECT COALESCE(sum(s.calls), 0)::int8, COALESCE(sum(s.total_exec_time), 0)
               FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
              WHERE d.datname = $1 AND s.toplevel",
            &[&database],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    // Function statistics reach the view when the sessions that ran them
    // report, which they do at the latest when they end (serve has ended).
    let functions: Vec<_> = db
        .query(
            "SELECT funcname::text, calls, total_time, self_time
               FROM pg_stat_user_functions ORDER BY total_time DESC LIMIT 8",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| {
            json!({
                "function": r.get::<_, String>(0),
                "calls": r.get::<_, i64>(1),
                "total_ms": round1(r.get::<_, f64>(2)),
                "self_ms": round1(r.get::<_, f64>(3)),
            })
        })
        .collect();
    let tables: Vec<_> = db
        .query(
            "SELECT relname::text, seq_scan, seq_tup_read, COALESCE(idx_scan, 0), COALESCE(idx_tup_fetch, 0)
               FROM pg_stat_user_tables WHERE seq_scan + COALESCE(idx_scan, 0) > 0
              ORDER BY seq_tup_read + COALESCE(idx_tup_fetch, 0) DESC",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| {
            json!({
                "table": r.get::<_, String>(0),
                "seq_scans": r.get::<_, i64>(1),
                "rows_seq_read": r.get::<_, i64>(2),
                "index_scans": r.get::<_, i64>(3),
                "rows_index_fetched": r.get::<_, i64>(4),
            })
        })
        .collect();
    json!({
        "tables": tables,
        "top_level_statements": { "calls": all.0, "total_ms": round1(all.1) },
        "statements": statements,
        "functions": functions,
    })
}

/// While the clients run: every millisecond, what each of the run
/// database's active backends is doing (its wait event, or `CPU`, and the
/// start of its statement), counted, most frequent first.
async fn sample_waits(
    url: String,
    database: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> serde_json::Value {
    let client = connect(&url).await;
    let sample = client
        .prepare(
            "SELECT COALESCE(wait_event_type || ':' || wait_event, 'CPU') || ' | '
                    || left(regexp_replace(query, '\\s+', ' ', 'g'), 40)
               FROM pg_stat_activity
              WHERE datname = $1 AND state = 'active' AND pid <> pg_backend_pid()",
        )
        .await
        .unwrap();
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut samples = 0u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        for row in client.query(&sample, &[&database]).await.unwrap() {
            *counts.entry(row.get(0)).or_default() += 1;
        }
        samples += 1;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut counts: Vec<_> = counts.into_iter().collect();
    counts.sort_by_key(|c| std::cmp::Reverse(c.1));
    counts.truncate(15);
    json!({ "samples": samples, "busiest": counts.into_iter().map(|(k, n)| json!([n, k])).collect::<Vec<_>>() })
}

/// The cluster's WAL counters (`pg_stat_wal`): records, full-page images,
/// bytes, and how many times it was written and flushed to disk.
async fn wal(admin: &tokio_postgres::Client) -> Vec<(&'static str, i64)> {
    let row = admin
        .query_one(
            "SELECT wal_records, wal_fpi, wal_bytes::int8, wal_write, wal_sync FROM pg_stat_wal",
            &[],
        )
        .await
        .unwrap();
    ["records", "full_page_images", "bytes", "writes", "flushes"]
        .into_iter()
        .enumerate()
        .map(|(i, name)| (name, row.get(i)))
        .collect()
}

/// What the run's database did (`pg_stat_database`): transactions
/// committed, rows returned by scans and fetched by index, buffers read.
async fn database_work(admin: &tokio_postgres::Client, database: &str) -> Vec<(&'static str, i64)> {
    // Counters reach the view when sessions report them: at most every
    // second while they run, and when they end.
    let row = admin
        .query_one(
            "SELECT xact_commit, tup_returned, tup_fetched, tup_updated, blks_hit + blks_read
               FROM pg_stat_database WHERE datname = $1",
            &[&database],
        )
        .await
        .unwrap();
    [
        "commits",
        "rows_returned",
        "rows_fetched",
        "rows_updated",
        "buffers",
    ]
    .into_iter()
    .enumerate()
    .map(|(i, name)| (name, row.get(i)))
    .collect()
}

/// A real OTLP receiver (the `rotel` collector, discarding what it
/// receives) that counts the spans it took in on its log.
struct Receiver {
    rotel: python::Rotel,
    endpoint: String,
}

impl Receiver {
    async fn start() -> Receiver {
        let rotel = python::Rotel::start("basic").await;
        let endpoint = format!("http://{}", rotel.grpc);
        Receiver { rotel, endpoint }
    }

    /// The spans received so far: the sum of its `spans=N` log fields.
    fn spans(&self) -> u64 {
        let text = std::fs::read_to_string(&self.rotel.print).unwrap_or_default();
        // Its log is coloured: `spans` ESC[0m ESC[2m = ESC[0m 2.
        let mut plain = String::with_capacity(text.len());
        let mut rest = text.as_str();
        while let Some(at) = rest.find('\x1b') {
            plain.push_str(&rest[..at]);
            rest = rest[at..].split_once('m').map_or("", |(_, after)| after);
        }
        plain.push_str(rest);
        plain
            .lines()
            .filter_map(|l| l.rsplit_once("spans=")?.1.split_whitespace().next())
            .filter_map(|n| n.parse::<u64>().ok())
            .sum()
    }

    /// The count once the service's last batches are in: unchanged for
    /// half a second (the service has exited, so nothing more comes).
    fn settled(&self) -> u64 {
        let mut last = self.spans();
        loop {
            std::thread::sleep(Duration::from_millis(500));
            let now = self.spans();
            if now == last {
                return now;
            }
            last = now;
        }
    }
}

/// The spans the service says it lost (`newsnack_trace_spans_lost_total`,
/// every reason).
async fn spans_lost(base: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with("newsnack_trace_spans_lost_total"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}
