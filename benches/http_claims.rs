//! Benchmark: the HTTP claim path and the whole pipeline, on a throwaway
//! cluster with default durability. Prints one JSON object on stdout.
//!
//! Phases, each on a database of its own:
//!
//! 1. **idle RSS**: the real binary (`newsnack serve`, built by `cargo bench`
//!    itself, found through `CARGO_BIN_EXE_newsnack`) is started, answers
//!    `/readyz`, sits idle for `BENCH_IDLE_SECONDS` (default 2), and its
//!    `VmRSS`/`VmHWM` (and `Pss`) are read from `/proc/<pid>`.
//! 2. **the seeds' workload over HTTP**: `BENCH_ISSUES` (default 2,000)
//!    issues, `BENCH_CLIENTS` (default 16) lean keep-alive HTTP/1.1 clients; each
//!    posts every window of 5 consecutive ids (windows advancing by 2) to
//!    `POST /ai-articles`, so most requests overlap and get 409. Two starts:
//!    *staggered* (each client at its own offset) and *together* (all at the
//!    first window, colliding on every window). The service runs in this process with the offline
//!    writer (issues complete almost at once). Requests/s, p50/p99 latency
//!    (also for each tenth of the run, so a slow start shows apart from a
//!    backlog that builds up), 202/409 counts (and the latency of the requests that claimed), then,
//!    once every claimed issue is `DONE` (counted on the gapless transition
//!    stream), duplicates checked with SQL. Run twice: as fast as the
//!    clients go (closed loop), and paced at `BENCH_PACED_RATE` (default
//!    6,000) requests/s in all, the clients' requests evenly interleaved
//!    and released by a thread on the OS's high-resolution timer, latency
//!    timed from when each request was due (no coordinated omission).
//! 3. **direct claims**: the same workload through `claim_issues`, one
//!    statement per transaction, 16 tasks with a connection each, no HTTP;
//!    and once more through the service's group-committing `Claimer`.
//! 4. **end to end, two instances**: two services on one database,
//!    `BENCH_E2E_ISSUES` (default 4,000) issues, 16 clients posting disjoint
//!    batches of `BENCH_E2E_BATCH` (default 10) ids, alternately to each
//!    instance; issues/s from the first request to the last `DONE`.
//!
//! The bench process runs the in-process services and, on a runtime of
//! their own, their clients, on the same cores as PostgreSQL, so the HTTP
//! figures include the clients' cost.
//! 5. **pool pressure**: a service with a pool of 4 sessions and 40
//!    issues; a burst of 200 requests at once (reads, adds, claims and
//!    one-second waits, in turn): how many queued and were served, how
//!    many were turned away with 503, and how long answers took. Then
//!    another session locks the `issue` table and 24 reads come: how long
//!    the 503s of those beyond the pool took (the pool's wait, 5 s), and
//!    whether any read was answered 200 before the lock went. (The fault
//!    test `an_exhausted_pool_queues_or_answers_503_and_never_hangs` checks
//!    the answers themselves; these are the timings it leaves to the
//!    machine.)
//!
//! `BENCH_STATEMENTS=1` loads `pg_stat_statements` and reports, for each
//! phase's database, the statements and the triggers that took the most of
//! the server's time (`database_time_by_statement`); it costs the server
//! some time of its own, so compare such runs only with each other.
//!
//! `BENCH_DURABLE=0` turns fsync off. `BENCH_ONLY` (comma-separated:
//! `idle`, `seeds`, `seeds_paced`, `seeds_together`, `seeds_together_paced`,
//! `direct`, `direct_claimer`, `e2e`, `pool_pressure`) runs just those
//! phases; the others and their targets report null. Runs in well under
//! three minutes.

mod common;

use common::{connect, knob, round1, round3, serve_options, start_cluster};

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use newsnack::claims::claim::Claimer;
use newsnack::db::issue::{claim_issues, insert_issues, ClaimScope, NewIssue};
use newsnack::db::{self, DbPool, PoolOptions, Statements};
use newsnack::embedded::{EmbeddedOptions, EmbeddedPostgres};
use newsnack::events::hub::EventHub;
use newsnack::model::status::Status;
use newsnack::serve::RunningService;
use newsnack::writer::{OfflineWriter, SharedWriter};
use serde_json::json;
use tokio::sync::Barrier;

const WINDOW: usize = 5;
const STEP: usize = 2;
const LEASE: Duration = Duration::from_secs(60);
const SERVICE_POOL: usize = 16;

#[tokio::main]
async fn main() {
    let issues = knob("BENCH_ISSUES", 2_000) as usize;
    let clients = knob("BENCH_CLIENTS", 16) as usize;
    let e2e_issues = knob("BENCH_E2E_ISSUES", 4_000) as usize;
    let e2e_batch = knob("BENCH_E2E_BATCH", 10) as usize;
    let idle_seconds = knob("BENCH_IDLE_SECONDS", 2);
    let target_rate = knob("BENCH_PACED_RATE", 6_000);
    let durable = knob("BENCH_DURABLE", 1) != 0;
    let started = Instant::now();

    let statements = knob("BENCH_STATEMENTS", 0) != 0;
    let mut settings = vec![("max_connections".to_string(), "300".to_string())];
    if statements {
        settings.push((
            "shared_preload_libraries".into(),
            "pg_stat_statements".into(),
        ));
        settings.push(("pg_stat_statements.track".into(), "all".into()));
        settings.push(("track_functions".into(), "all".into()));
    }
    let cluster = start_cluster(EmbeddedOptions {
        durable,
        settings,
        ..EmbeddedOptions::default()
    })
    .await;
    let admin = connect(&cluster.url("postgres")).await;
    // `BENCH_ONLY=seeds_together_paced,e2e` runs just those phases.
    let only = std::env::var("BENCH_ONLY").ok();
    let wanted = |phase: &str| {
        only.as_deref()
            .is_none_or(|list| list.split(',').any(|p| p.trim() == phase))
    };
    for name in [
        "idle",
        "seeds",
        "seeds_paced",
        "seeds_together",
        "seeds_together_paced",
        "direct",
        "direct_claimer",
        "e2e",
        "pool_pressure",
    ]
    .into_iter()
    .filter(|name| wanted(name))
    {
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
    }
    let server_log = cluster.dir().map(|d| d.join("server.log"));

    let idle = match wanted("idle") {
        true => Some(idle_rss(&cluster.url("idle"), Duration::from_secs(idle_seconds)).await),
        false => None,
    };
    let paced_rate = Some(target_rate as f64);
    let seeds_run = |db: &'static str, start: Start, rate: Option<f64>| {
        let url = wanted(db).then(|| cluster.url(db));
        async move {
            match url {
                Some(url) => Some(seeds_over_http(url, issues, clients, start, rate).await),
                None => None,
            }
        }
    };
    let seeds = seeds_run("seeds", Start::Staggered, None).await;
    let paced = seeds_run("seeds_paced", Start::Staggered, paced_rate).await;
    let together = seeds_run("seeds_together", Start::Together, None).await;
    let together_paced = seeds_run("seeds_together_paced", Start::Together, paced_rate).await;
    let direct = match wanted("direct") {
        true => Some(direct_claims(&cluster.url("direct"), issues, clients, false).await),
        false => None,
    };
    let grouped = match wanted("direct_claimer") {
        true => Some(direct_claims(&cluster.url("direct_claimer"), issues, clients, true).await),
        false => None,
    };
    let e2e = match wanted("e2e") {
        true => Some(two_instances(&cluster.url("e2e"), e2e_issues, clients, e2e_batch).await),
        false => None,
    };
    let pressure = match wanted("pool_pressure") {
        true => Some(pool_pressure(&cluster.url("pool_pressure")).await),
        false => None,
    };

    let database_time = match statements {
        true => Some(database_time(&admin, &cluster).await),
        false => None,
    };
    let unique_violations = server_log
        .and_then(|p| std::fs::read_to_string(p).ok())
        .map(|log| {
            log.matches("duplicate key value violates unique constraint")
                .count()
        });
    // A target is null when its phase did not run.
    let serves = |run: &Option<serde_json::Value>| {
        run.as_ref()
            .map(|run| run["requests_per_s"].as_f64().unwrap() >= 6000.0)
    };
    let fast_at_rate = |run: &Option<serde_json::Value>| {
        run.as_ref().map(|run| {
            target_rate >= 6000
                && run["requests_per_s"].as_f64().unwrap() >= 0.98 * target_rate as f64
                && run["latency_ms"]["p99"].as_f64().unwrap() <= 10.0
        })
    };
    let e2e_fast = e2e
        .as_ref()
        .map(|e2e| e2e["issues_per_s"].as_f64().unwrap() >= 2000.0);
    let rss_small = idle
        .as_ref()
        .and_then(|idle| idle["vm_rss_mb"].as_f64())
        .map(|mb| mb <= 30.0);
    let report = json!({
        "benchmark": "HTTP claims and the pipeline end to end",
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "durable": durable,
        "idle_rss": idle,
        "seeds_workload_http": seeds,
        "seeds_workload_http_paced": paced,
        "seeds_workload_http_together": together,
        "seeds_workload_http_together_paced": together_paced,
        "direct_claims": { "claim_issues": direct, "claimer_group_commit": grouped },
        "end_to_end_two_instances": e2e,
        "pool_pressure": pressure,
        "unique_violations_in_server_log": unique_violations,
        "database_time_by_statement": database_time,
        "total_seconds": round1(started.elapsed().as_secs_f64()),
        "targets": {
            "http_at_least_6000_requests_per_s":
                { "staggered": serves(&seeds), "together": serves(&together) },
            "http_p99_at_most_10_ms_when_serving_6000_requests_per_s":
                { "staggered": fast_at_rate(&paced), "together": fast_at_rate(&together_paced) },
            "end_to_end_at_least_2000_issues_per_s_two_instances": e2e_fast,
            "idle_rss_at_most_30_mb": rss_small,
        }
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    drop(admin);
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

/// With `BENCH_STATEMENTS=1`: for each phase's database, the statements
/// that took the most of the server's time (`pg_stat_statements`, nested
/// ones included, so a trigger's statements appear beside the statement
/// that fired them) and the time of each trigger and function
/// (`pg_stat_user_functions`).
async fn database_time(
    admin: &tokio_postgres::Client,
    cluster: &EmbeddedPostgres,
) -> serde_json::Value {
    admin
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await
        .unwrap();
    let databases = admin
        .query(
            "SELECT datname FROM pg_database WHERE datname NOT IN ('postgres', 'template0', 'template1')
              ORDER BY datname",
            &[],
        )
        .await
        .unwrap();
    let mut by_database = serde_json::Map::new();
    for row in databases {
        let name: String = row.get(0);
        let statements = admin
            .query(
                "SELECT s.calls, round(s.total_exec_time::numeric, 1)::float8,
                        round((1000 * s.total_exec_time / s.calls)::numeric, 1)::float8,
                        s.rows, s.toplevel, left(regexp_replace(s.query, '\\s+', ' ', 'g'), 120)
                   FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
                  WHERE d.datname = $1 AND s.calls > 0
                  ORDER BY s.total_exec_time DESC LIMIT 10",
                &[&name],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| {
                json!({
                    "calls": r.get::<_, i64>(0),
                    "total_ms": r.get::<_, f64>(1),
                    "mean_us": r.get::<_, f64>(2),
                    "rows": r.get::<_, i64>(3),
                    "top_level": r.get::<_, bool>(4),
                    "statement": r.get::<_, String>(5),
                })
            })
            .collect::<Vec<_>>();
        let functions = connect(&cluster.url(&name))
            .await
            .query(
                "SELECT funcname::text, calls, round(self_time::numeric, 1)::float8
                   FROM pg_stat_user_functions ORDER BY self_time DESC LIMIT 10",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| {
                json!({
                    "function": r.get::<_, String>(0),
                    "calls": r.get::<_, i64>(1),
                    "self_ms": r.get::<_, f64>(2),
                })
            })
            .collect::<Vec<_>>();
        by_database.insert(
            name,
            json!({ "statements": statements, "functions": functions }),
        );
    }
    serde_json::Value::Object(by_database)
}

/// Starts `newsnack serve` as a child, waits until it is ready, lets it
/// idle, and reads its memory figures.
async fn idle_rss(url: &str, idle: Duration) -> serde_json::Value {
    let binary = env!("CARGO_BIN_EXE_newsnack");
    let mut child = Command::new(binary)
        .arg("serve")
        .env("DATABASE_URL", url)
        .env("NEWSNACK_LISTEN", "127.0.0.1:0")
        .env("NEWSNACK_INSTANCE", "idle")
        .env("RUST_LOG", "warn")
        .env_remove("NEWSNACK_LLM_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run target/release/newsnack");
    let pid = child.id();
    let stdout = child.stdout.take().unwrap();
    // The binary prints its address once it is listening.
    let (addr, lines) = tokio::task::spawn_blocking(move || {
        let mut lines = BufReader::new(stdout).lines();
        loop {
            let line = lines.next().expect("serve printed its address").unwrap();
            if let Some(rest) = line.strip_prefix("newsnack serving on http://") {
                break (rest.trim().parse::<SocketAddr>().unwrap(), lines);
            }
        }
    })
    .await
    .unwrap();
    let http = reqwest::Client::new();
    let mut ready = None;
    for _ in 0..100 {
        let answer = http
            .get(format!("http://{addr}/readyz"))
            .send()
            .await
            .unwrap();
        if answer.status().is_success() {
            ready = Some(answer.json::<serde_json::Value>().await.unwrap());
            break;
        }
        // Readiness is a probe, not an event: ask again shortly.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(http);
    tokio::time::sleep(idle).await;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let threads = proc_field(&status, "Threads:");
    let rss = proc_field(&status, "VmRSS:");
    let hwm = proc_field(&status, "VmHWM:");
    let pss = proc_field(&rollup, "Pss:");
    // SAFETY: sends SIGTERM to the child started above.
    unsafe {
        libc::kill(pid as i32, libc::SIGTERM);
    }
    let exited = tokio::task::spawn_blocking(move || {
        drop(lines);
        child.wait()
    })
    .await
    .unwrap();
    json!({
        "what": "newsnack serve (release binary, separate process, offline writer), idle after /readyz",
        "ready": ready,
        "idle_seconds": idle.as_secs(),
        "vm_rss_mb": rss.map(kb_to_mb),
        "vm_hwm_mb": hwm.map(kb_to_mb),
        "pss_mb": pss.map(kb_to_mb),
        "threads": threads,
        "exited_cleanly_on_sigterm": exited.map(|s| s.success()).unwrap_or(false),
        "bench_process_rss_mb_for_reference": proc_field(
            &std::fs::read_to_string("/proc/self/status").unwrap_or_default(),
            "VmRSS:"
        ).map(kb_to_mb),
    })
}

/// Phase 5: a pool of 4 under a burst, then under a locked table.
async fn pool_pressure(url: &str) -> serde_json::Value {
    const POOL: usize = 4;
    const BURST: usize = 200;
    const READS: usize = 24;
    let service = newsnack::serve::start(
        serve_options(url, "pool-pressure", POOL),
        Arc::new(OfflineWriter) as SharedWriter,
    )
    .await
    .expect("start the service");
    let sql = connect(url).await;
    let ids: Vec<i64> = sql
        .query(
            "INSERT INTO issue (title) SELECT 'pressure ' || g FROM generate_series(1, 40) g RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();

    // The burst: every request at once; each answer with how long it took.
    let burst_started = Instant::now();
    let answers = futures::future::join_all((0..BURST).map(|n| {
        let (http, base, id) = (http.clone(), base.clone(), ids[n % ids.len()]);
        async move {
            let request = match n % 4 {
                0 => http.get(format!("{base}/issues/{id}")),
                1 => http
                    .post(format!("{base}/issues"))
                    .json(&json!({"issues": [{"title": format!("burst {n}")}]})),
                2 => http
                    .post(format!("{base}/ai-articles"))
                    .json(&json!({"issue_ids": [id]})),
                _ => http
                    .post(format!("{base}/waits"))
                    .json(&json!({"issue_ids": [id], "timeout_s": 1, "min_completion": 0})),
            };
            let started = Instant::now();
            let status = request.send().await.unwrap().status().as_u16();
            (status, started.elapsed().as_secs_f64() * 1000.0)
        }
    }))
    .await;
    let burst_seconds = burst_started.elapsed().as_secs_f64();
    let turned_away = answers.iter().filter(|(s, _)| *s == 503).count();
    let mut served_ms: Vec<f64> = answers
        .iter()
        .filter(|(s, _)| *s != 503)
        .map(|(_, ms)| *ms)
        .collect();
    served_ms.sort_by(f64::total_cmp);
    let mut refused_ms: Vec<f64> = answers
        .iter()
        .filter(|(s, _)| *s == 503)
        .map(|(_, ms)| *ms)
        .collect();
    refused_ms.sort_by(f64::total_cmp);
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    for (status, _) in &answers {
        *statuses.entry(*status).or_default() += 1;
    }
    // Let the claims of the burst finish before the table is locked.
    for _ in 0..600 {
        let in_progress: i64 = sql
            .query_one(
                "SELECT count(*) FROM issue WHERE processing_status = 'IN_PROGRESS'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if in_progress == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The table locked: reads beyond the pool give up after its wait.
    let mut locker = connect(url).await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE issue IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let locked_at = Instant::now();
    let (answers_tx, mut answers_rx) = tokio::sync::mpsc::unbounded_channel();
    for &id in ids.iter().take(READS) {
        let (http, url, answers) = (
            http.clone(),
            format!("{base}/issues/{id}"),
            answers_tx.clone(),
        );
        tokio::spawn(async move {
            let status = http.get(&url).send().await.unwrap().status().as_u16();
            let _ = answers.send((status, locked_at.elapsed().as_secs_f64() * 1000.0));
        });
    }
    drop(answers_tx);
    let mut while_locked = Vec::new();
    while while_locked.iter().filter(|(s, _)| *s == 503).count() < READS - POOL {
        match tokio::time::timeout(Duration::from_secs(60), answers_rx.recv()).await {
            Ok(Some(answer)) => while_locked.push(answer),
            _ => break,
        }
    }
    let held_ms = locked_at.elapsed().as_secs_f64() * 1000.0;
    lock.commit().await.unwrap();
    let mut after_unlock = Vec::new();
    while let Ok(Some(answer)) =
        tokio::time::timeout(Duration::from_secs(60), answers_rx.recv()).await
    {
        after_unlock.push(answer);
    }
    let mut lock_refused_ms: Vec<f64> = while_locked
        .iter()
        .chain(&after_unlock)
        .filter(|(s, _)| *s == 503)
        .map(|(_, ms)| *ms)
        .collect();
    lock_refused_ms.sort_by(f64::total_cmp);
    let mut unblocked_ms: Vec<f64> = after_unlock
        .iter()
        .filter(|(s, _)| *s == 200)
        .map(|(_, ms)| *ms)
        .collect();
    unblocked_ms.sort_by(f64::total_cmp);
    service.stop().await.unwrap();
    json!({
        "what": "a service with a pool of 4: a burst of 200 requests, then 24 reads while another session locks the issue table",
        "burst": {
            "requests": BURST,
            "statuses": statuses.iter().map(|(s, n)| (s.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
            "served": BURST - turned_away,
            "turned_away_503": turned_away,
            "seconds": round3(burst_seconds),
            "served_ms": { "p50": percentile(&served_ms, 0.5), "max": served_ms.last().copied().map(round3) },
            "turned_away_ms": { "p50": percentile(&refused_ms, 0.5), "max": refused_ms.last().copied().map(round3) },
        },
        "locked_table": {
            "reads": READS,
            "turned_away_503": lock_refused_ms.len(),
            "turned_away_ms": {
                "what": "from the lock to each 503 (the pool's wait is 5 s)",
                "p50": percentile(&lock_refused_ms, 0.5),
                "max": lock_refused_ms.last().copied().map(round3),
            },
            "answered_200_while_locked": while_locked.iter().filter(|(s, _)| *s == 200).count(),
            "lock_held_ms": round3(held_ms),
            "served_after_unlock_ms": {
                "what": "from the lock to each 200, all after it went",
                "min": unblocked_ms.first().copied().map(round3),
                "max": unblocked_ms.last().copied().map(round3),
            },
        },
    })
}

/// A `Field:   123 kB` value from a /proc file, in kB (or a plain count).
fn proc_field(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

fn kb_to_mb(kb: u64) -> f64 {
    round1(kb as f64 / 1024.0)
}

/// Windows of 5 consecutive ids advancing by 2 (the last ones shorter), so
/// every id is in two or three windows.
fn windows(ids: &[i64]) -> Vec<Vec<i64>> {
    (0..ids.len())
        .step_by(STEP)
        .map(|s| ids[s..(s + WINDOW).min(ids.len())].to_vec())
        .collect()
}

async fn bench_pool(url: &str, size: usize) -> DbPool {
    let endpoint = db::Endpoint::parse(url, "newsnack-bench").unwrap();
    let mut migrator = endpoint.connect().await.unwrap();
    db::migrate::migrate(&mut migrator).await.unwrap();
    db::pool(
        &endpoint,
        &PoolOptions {
            max_size: size,
            // As `serve` sends them with no pooler in front.
            statements: Statements::Named,
            ..PoolOptions::default()
        },
    )
    .unwrap()
}

async fn add_issues(pool: &DbPool, n: usize) -> Vec<i64> {
    let client = pool.get().await.unwrap();
    let new: Vec<NewIssue> = (0..n)
        .map(|i| NewIssue {
            title: format!("Bench issue {i}"),
            body: format!(
                "Something happened for the {i}th time. Officials said more would follow."
            ),
            score: i as f64,
            collected_at: None,
            source_key: None,
        })
        .collect();
    let mut ids = Vec::with_capacity(n);
    for chunk in new.chunks(1000) {
        ids.extend(insert_issues(&client, chunk).await.unwrap());
    }
    ids
}

async fn start_service(url: &str, instance: &str) -> RunningService {
    newsnack::serve::start(
        serve_options(url, instance, SERVICE_POOL),
        Arc::new(OfflineWriter) as SharedWriter,
    )
    .await
    .expect("start the service")
}

async fn last_seq(pool: &DbPool) -> i64 {
    scalar(pool, "SELECT COALESCE(max(seq), 0) FROM issue_transition").await
}

async fn scalar(pool: &DbPool, sql: &str) -> i64 {
    pool.get()
        .await
        .unwrap()
        .query_one(sql, &[])
        .await
        .unwrap()
        .get(0)
}

/// Waits until `want` transitions into `DONE` after `after_seq` have been
/// seen on the gapless stream; returns when the last one arrived.
async fn wait_for_done(hub: &EventHub, after_seq: i64, want: usize) -> Instant {
    let mut stream = hub.stream_after(after_seq, None);
    let mut seen = 0;
    let wait = async {
        while seen < want {
            if stream.next().await.expect("transition stream").to == Status::Done {
                seen += 1;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(120), wait)
        .await
        .unwrap_or_else(|_| panic!("only {seen} of {want} issues became DONE in 120 s"));
    Instant::now()
}

/// A lean keep-alive HTTP/1.1 client on one connection, so the load
/// generator takes as little of the shared cores as it can (a full client
/// stack costs about as much per request as the service does).
struct LeanClient {
    reader: tokio::io::BufReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
    host: String,
}

impl LeanClient {
    /// Connects to the host of `url` (`http://ADDR/...`).
    async fn connect(url: &str) -> LeanClient {
        let host = url
            .strip_prefix("http://")
            .and_then(|rest| rest.split('/').next())
            .expect("an http:// URL")
            .to_string();
        let stream = tokio::net::TcpStream::connect(&host).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let (read, writer) = stream.into_split();
        LeanClient {
            reader: tokio::io::BufReader::new(read),
            writer,
            host,
        }
    }

    /// Sends one request and reads the whole answer: status and body.
    async fn request(&mut self, method: &str, url: &str, body: &[u8]) -> (u16, Vec<u8>) {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        let path = url
            .strip_prefix("http://")
            .and_then(|rest| rest.find('/').map(|i| &rest[i..]))
            .unwrap_or("/");
        let mut message = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.host,
            body.len()
        )
        .into_bytes();
        message.extend_from_slice(body);
        self.writer.write_all(&message).await.unwrap();
        let mut line = String::new();
        self.reader.read_line(&mut line).await.unwrap();
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP status line: {line:?}"));
        let mut length = None;
        loop {
            line.clear();
            self.reader.read_line(&mut line).await.unwrap();
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse::<usize>().ok();
                }
            }
        }
        let mut answer = vec![0; length.expect("a Content-Length")];
        self.reader.read_exact(&mut answer).await.unwrap();
        (status, answer)
    }
}

/// What one client will post: (URL, ids) per request, in order.
type Plan = Vec<(String, Vec<i64>)>;

#[derive(serde::Deserialize)]
struct ClaimAnswer {
    #[serde(default)]
    claimed: Vec<i64>,
}

#[derive(Default)]
struct ClientTally {
    latencies_ms: Vec<f64>,
    /// When each request of `latencies_ms` was due (paced) or sent.
    timed_from: Vec<Instant>,
    /// Latencies of the requests that claimed something (202).
    claiming_latencies_ms: Vec<f64>,
    statuses: HashMap<u16, u64>,
    claimed: Vec<i64>,
}

/// Posts each of `requests` (an id list and the instance to send it to) in
/// order, timing each request. Unpaced, each request goes as soon as the
/// previous one was answered, and is timed from when it was sent. Paced,
/// request `k` is due at `first_due + k * every` and is timed from when it
/// was due, not sent, so a slow answer also counts against the requests it
/// held up (no coordinated omission).
async fn post_all(
    mut http: LeanClient,
    requests: Vec<(String, Vec<i64>)>,
    mut pace: Option<PacedClient>,
) -> ClientTally {
    let mut tally = ClientTally {
        latencies_ms: Vec::with_capacity(requests.len()),
        ..ClientTally::default()
    };
    for (url, ids) in requests {
        let sent = match pace.as_mut() {
            Some(pace) => pace.next_due().await,
            None => Instant::now(),
        };
        let request = serde_json::to_vec(&json!({ "issue_ids": ids })).unwrap();
        let (status, body) = http.request("POST", &url, &request).await;
        let took_ms = sent.elapsed().as_secs_f64() * 1000.0;
        tally.latencies_ms.push(took_ms);
        tally.timed_from.push(sent);
        *tally.statuses.entry(status).or_default() += 1;
        if status == 202 {
            tally.claiming_latencies_ms.push(took_ms);
            let answer: ClaimAnswer = serde_json::from_slice(&body).unwrap();
            tally.claimed.extend(answer.claimed);
        }
    }
    tally
}

/// Releases paced requests at their due times. Request `n` of the whole
/// schedule is due `n / rate` after the start and belongs to client
/// `n mod clients`, so each client sends every `clients / rate`, the clients
/// evenly interleaved. A thread of its own sleeps to each due time on the
/// operating system's high-resolution timer (tokio's timer ticks in whole
/// milliseconds and would make each request 1–2 ms late before it is even
/// sent) and hands the client a permit; latency is timed from the due time,
/// so a client that falls behind is charged for it (no coordinated omission).
struct Pacer {
    rate: f64,
    requests_per_client: usize,
    permits: Vec<Arc<tokio::sync::Semaphore>>,
    /// The start, once [`Pacer::start`] has run.
    began: Arc<std::sync::OnceLock<Instant>>,
}

/// One client's side of a [`Pacer`].
struct PacedClient {
    permits: Arc<tokio::sync::Semaphore>,
    began: Arc<std::sync::OnceLock<Instant>>,
    every: Duration,
    offset: Duration,
    sent: u32,
}

impl Pacer {
    fn new(clients: usize, requests_per_client: usize, rate: f64) -> Self {
        Pacer {
            rate,
            requests_per_client,
            permits: (0..clients)
                .map(|_| Arc::new(tokio::sync::Semaphore::new(0)))
                .collect(),
            began: Arc::new(std::sync::OnceLock::new()),
        }
    }

    fn client(&self, c: usize) -> PacedClient {
        let clients = self.permits.len();
        PacedClient {
            permits: self.permits[c].clone(),
            began: self.began.clone(),
            every: Duration::from_secs_f64(clients as f64 / self.rate),
            offset: Duration::from_secs_f64(c as f64 / self.rate),
            sent: 0,
        }
    }

    /// Starts releasing the schedule from `began`.
    fn start(&self, began: Instant) {
        self.began.set(began).expect("a pacer starts once");
        let permits = self.permits.clone();
        let (rate, total) = (self.rate, self.requests_per_client * permits.len());
        std::thread::Builder::new()
            .name("bench-pacer".into())
            .spawn(move || {
                for n in 0..total {
                    let due = began + Duration::from_secs_f64(n as f64 / rate);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    permits[n % permits.len()].add_permits(1);
                }
            })
            .expect("start the pacer thread");
    }
}

impl PacedClient {
    /// Waits for this client's next request to be due; returns when it was.
    async fn next_due(&mut self) -> Instant {
        self.permits
            .acquire()
            .await
            .expect("the pacer's semaphore is never closed")
            .forget();
        let began = *self.began.get().expect("a permit comes after the start");
        let due = began + self.offset + self.every * self.sent;
        self.sent += 1;
        due
    }
}

/// The clients' own runtime (two threads), so that the operating system,
/// not one shared task queue, divides the cores between the service (and
/// PostgreSQL) and the load generator, as when they are separate processes.
fn client_runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("bench-client")
            .enable_all()
            .build()
            .unwrap()
    })
}

/// Runs one request list per client, all starting together, each client a
/// keep-alive connection opened before the clock starts, paced to `rate`
/// requests/s in all when given (see [`post_all`]); returns the merged
/// tallies and the wall time from the start to the last answer.
async fn run_clients(plans: Vec<Plan>, rate: Option<f64>) -> (ClientTally, Instant, Instant) {
    let start = Arc::new(Barrier::new(plans.len() + 1));
    let requests = plans.iter().map(Vec::len).max().unwrap_or(0);
    let pacer = rate.map(|rate| Arc::new(Pacer::new(plans.len(), requests, rate)));
    let mut tasks = Vec::new();
    for (c, requests) in plans.into_iter().enumerate() {
        let (start, pacer) = (start.clone(), pacer.clone());
        tasks.push(client_runtime().spawn(async move {
            let first = requests.first().map_or("", |(url, _)| url.as_str());
            assert!(
                requests.iter().all(|(url, _)| url == first),
                "a client posts to one endpoint"
            );
            let mut http = LeanClient::connect(first).await;
            let origin = first.rsplit_once('/').map_or(first, |(o, _)| o);
            let (status, _) = http.request("GET", &format!("{origin}/healthz"), b"").await;
            assert_eq!(status, 200);
            let pace = pacer.map(|p| p.client(c));
            start.wait().await;
            post_all(http, requests, pace).await
        }));
    }
    start.wait().await;
    let began = Instant::now();
    if let Some(pacer) = pacer {
        pacer.start(began);
    }
    let mut all = ClientTally::default();
    for task in tasks {
        let tally = task.await.unwrap();
        all.latencies_ms.extend(tally.latencies_ms);
        all.timed_from.extend(tally.timed_from);
        all.claiming_latencies_ms
            .extend(tally.claiming_latencies_ms);
        for (status, n) in tally.statuses {
            *all.statuses.entry(status).or_default() += n;
        }
        all.claimed.extend(tally.claimed);
    }
    (all, began, Instant::now())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((sorted.len() - 1) as f64 * p).round() as usize;
    round3(sorted[rank])
}

fn claimed_twice(claimed: &[i64]) -> usize {
    let mut counts: HashMap<i64, usize> = HashMap::new();
    for &id in claimed {
        *counts.entry(id).or_default() += 1;
    }
    counts.values().filter(|&&n| n > 1).count()
}

/// Every issue's article count, attempts and status, as checks.
async fn integrity(pool: &DbPool) -> serde_json::Value {
    json!({
        "issues": scalar(pool, "SELECT count(*) FROM issue").await,
        "done": scalar(pool, "SELECT count(*) FROM issue WHERE processing_status = 'DONE'").await,
        "articles": scalar(pool, "SELECT count(*) FROM ai_article").await,
        "issues_with_more_than_one_article": scalar(
            pool,
            "SELECT count(*) FROM (SELECT issue_id FROM ai_article GROUP BY issue_id HAVING count(*) > 1) d"
        ).await,
        "issues_attempted_more_than_once": scalar(pool, "SELECT count(*) FROM issue WHERE attempts > 1").await,
        // A failed ai_article insert (e.g. a unique violation) burns an id.
        "failed_article_inserts": scalar(
            pool,
            "SELECT (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM ai_article_id_seq)
                    - (SELECT count(*) FROM ai_article)"
        ).await,
    })
}

/// Where each client of the seeds' workload starts walking the windows.
#[derive(Clone, Copy, Debug)]
enum Start {
    /// At its own offset (client `c` of `n` at window `c/n` of the way):
    /// each client claims a stretch of its own, one request after another.
    Staggered,
    /// All at the first window: every window is asked for by all clients
    /// at about the same moment, one claims it, the rest collide.
    Together,
}

/// Each client's requests for the seeds' workload over `ids`.
fn seeds_plans(endpoint: &str, ids: &[i64], clients: usize, start: Start) -> Vec<Plan> {
    let windows = windows(ids);
    (0..clients)
        .map(|c| {
            let first = match start {
                Start::Staggered => c * windows.len() / clients,
                Start::Together => 0,
            };
            (0..windows.len())
                .map(|k| {
                    (
                        endpoint.to_owned(),
                        windows[(first + k) % windows.len()].clone(),
                    )
                })
                .collect()
        })
        .collect()
}

/// p50 and p99 of the requests timed from each tenth of the run, in order,
/// so a slow start (or end) shows apart from the rest.
fn latency_by_tenth(tally: &ClientTally, began: Instant, elapsed: Duration) -> serde_json::Value {
    let mut tenths = vec![Vec::new(); 10];
    for (&ms, &from) in tally.latencies_ms.iter().zip(&tally.timed_from) {
        let at = from.saturating_duration_since(began).as_secs_f64() / elapsed.as_secs_f64();
        tenths[((at * 10.0) as usize).min(9)].push(ms);
    }
    tenths
        .into_iter()
        .map(|mut ms| {
            ms.sort_by(f64::total_cmp);
            json!({ "requests": ms.len(), "p50": percentile(&ms, 0.5), "p99": percentile(&ms, 0.99) })
        })
        .collect()
}

async fn seeds_over_http(
    url: String,
    issues: usize,
    clients: usize,
    start: Start,
    rate: Option<f64>,
) -> serde_json::Value {
    let pool = bench_pool(&url, 4).await;
    let ids = add_issues(&pool, issues).await;
    let service = start_service(&url, "bench-seeds").await;
    let endpoint = format!("http://{}/ai-articles", service.addr);
    let plans = seeds_plans(&endpoint, &ids, clients, start);
    let seq = last_seq(&pool).await;
    let skipped_from_memory_before = ids_skipped_known_done();
    let (mut tally, began, finished) = run_clients(plans, rate).await;
    let skipped_from_memory = ids_skipped_known_done() - skipped_from_memory_before;
    let elapsed = finished - began;
    let distinct: std::collections::BTreeSet<i64> = tally.claimed.iter().copied().collect();
    wait_for_done(&service.hub, seq, distinct.len()).await;
    let by_tenth = latency_by_tenth(&tally, began, elapsed);
    tally.latencies_ms.sort_by(f64::total_cmp);
    tally.claiming_latencies_ms.sort_by(f64::total_cmp);
    let requests = tally.latencies_ms.len();
    let count = |s: u16| tally.statuses.get(&s).copied().unwrap_or(0);
    let other: u64 = tally
        .statuses
        .iter()
        .filter(|(s, _)| **s != 202 && **s != 409)
        .map(|(_, n)| n)
        .sum();
    let checks = integrity(&pool).await;
    service.stop().await.unwrap();
    json!({
        "issues": issues,
        "clients": clients,
        "start": format!("{start:?}").to_lowercase(),
        "paced_at_requests_per_s": rate,
        "latency_from": if rate.is_some() { "when each request was due" } else { "when each request was sent" },
        "requests": requests,
        "seconds": round3(elapsed.as_secs_f64()),
        "requests_per_s": round1(requests as f64 / elapsed.as_secs_f64()),
        "latency_ms": {
            "p50": percentile(&tally.latencies_ms, 0.50),
            "p90": percentile(&tally.latencies_ms, 0.90),
            "p99": percentile(&tally.latencies_ms, 0.99),
            "max": percentile(&tally.latencies_ms, 1.0),
        },
        "latency_ms_by_tenth_of_the_run": by_tenth,
        "latency_ms_of_claiming_requests": {
            "p50": percentile(&tally.claiming_latencies_ms, 0.50),
            "p90": percentile(&tally.claiming_latencies_ms, 0.90),
            "p99": percentile(&tally.claiming_latencies_ms, 0.99),
        },
        "status_202": count(202),
        "status_409": count(409),
        "status_other": other,
        "issues_claimed": distinct.len(),
        "ids_skipped_as_known_done_without_sql": skipped_from_memory,
        "ids_claimed_twice": claimed_twice(&tally.claimed),
        "duplicates": checks["issues_with_more_than_one_article"],
        "checks_after_all_done": checks,
    })
}

/// The service's count of requested ids it skipped as known `DONE`.
fn ids_skipped_known_done() -> u64 {
    let text = newsnack::metrics::render().unwrap_or_default();
    text.lines()
        .find(|l| l.contains("result=\"skipped_known_done\""))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or(0.0) as u64
}

async fn direct_claims(
    url: &str,
    issues: usize,
    clients: usize,
    grouped: bool,
) -> serde_json::Value {
    let pool = bench_pool(url, clients + 4).await;
    let ids = add_issues(&pool, issues).await;
    let windows = Arc::new(windows(&ids));
    let claimer = Claimer::start(pool.clone(), "bench-direct".into(), 2);
    let start = Arc::new(Barrier::new(clients + 1));
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (pool, windows, start, claimer) = (
            pool.clone(),
            windows.clone(),
            start.clone(),
            claimer.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let client = pool.get().await.unwrap();
            let first = c * windows.len() / clients;
            let mut won = Vec::new();
            start.wait().await;
            for k in 0..windows.len() {
                let window = &windows[(first + k) % windows.len()];
                let outcome = if grouped {
                    claimer
                        .claim(window.clone(), LEASE, ClaimScope::Claimable)
                        .await
                } else {
                    claim_issues(
                        &pool.session(&client),
                        window,
                        "bench-direct",
                        LEASE,
                        ClaimScope::Claimable,
                    )
                    .await
                };
                won.extend(outcome.unwrap().claimed_ids());
            }
            won
        }));
    }
    start.wait().await;
    let began = Instant::now();
    let mut won = Vec::new();
    for task in tasks {
        won.extend(task.await.unwrap());
    }
    let elapsed = began.elapsed().as_secs_f64();
    let requests = clients * windows.len();
    json!({
        "path": if grouped { "Claimer (merged statements, group commit)" } else { "claim_issues, one statement per transaction" },
        "tasks": clients,
        "claim_requests": requests,
        "seconds": round3(elapsed),
        "claim_requests_per_s": round1(requests as f64 / elapsed),
        "issues_claimed": won.len(),
        "issues_claimed_per_s": round1(won.len() as f64 / elapsed),
        "ids_claimed_twice": claimed_twice(&won),
    })
}

async fn two_instances(
    url: &str,
    issues: usize,
    clients: usize,
    batch: usize,
) -> serde_json::Value {
    let pool = bench_pool(url, 4).await;
    let ids = add_issues(&pool, issues).await;
    let a = start_service(url, "bench-a").await;
    let b = start_service(url, "bench-b").await;
    let endpoints = [
        format!("http://{}/ai-articles", a.addr),
        format!("http://{}/ai-articles", b.addr),
    ];
    // Batch k goes to client k % clients; client c talks to instance c % 2.
    let mut plans: Vec<Plan> = vec![Vec::new(); clients];
    for (k, chunk) in ids.chunks(batch).enumerate() {
        let c = k % clients;
        plans[c].push((endpoints[c % 2].clone(), chunk.to_vec()));
    }
    let seq = last_seq(&pool).await;
    let hub = a.hub.clone();
    let done = tokio::spawn(async move { wait_for_done(&hub, seq, issues).await });
    let (tally, began, requests_done) = run_clients(plans, None).await;
    let all_done = done.await.unwrap();
    let elapsed = (all_done - began).as_secs_f64();
    let checks = integrity(&pool).await;
    let per_instance: Vec<i64> = {
        let client = pool.get().await.unwrap();
        let mut counts = Vec::new();
        for name in ["bench-a", "bench-b"] {
            counts.push(
                client
                    .query_one("SELECT count(*) FROM issue WHERE claimed_by = $1", &[&name])
                    .await
                    .unwrap()
                    .get(0),
            );
        }
        counts
    };
    let gen_concurrency = scalar(
        &pool,
        "SELECT value::bigint FROM setting WHERE key = 'generation_concurrency'",
    )
    .await;
    a.stop().await.unwrap();
    b.stop().await.unwrap();
    json!({
        "issues": issues,
        "clients": clients,
        "batch": batch,
        "requests": tally.latencies_ms.len(),
        "status_202": tally.statuses.get(&202).copied().unwrap_or(0),
        "status_other": tally.statuses.iter().filter(|(s, _)| **s != 202).map(|(_, n)| n).sum::<u64>(),
        "generation_concurrency_per_instance": gen_concurrency,
        "requests_seconds": round3((requests_done - began).as_secs_f64()),
        "seconds_to_all_done": round3(elapsed),
        "issues_per_s": round1(issues as f64 / elapsed),
        "done_by_instance": { "bench-a": per_instance[0], "bench-b": per_instance[1] },
        "ids_claimed_twice": claimed_twice(&tally.claimed),
        "checks_after_all_done": checks,
    })
}
