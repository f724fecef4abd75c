//! Helpers every benchmark shares: knobs from the environment, a throwaway
//! cluster and its databases, a plain connection, a service's options, a
//! `newsnack serve` process waited for and stopped, the claim workload,
//! issues held `IN_PROGRESS` for waits, the wait for every issue `DONE`, the CPU seconds of processes and of a
//! cluster, and rounding for the JSON reports.
#![allow(dead_code)]

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use newsnack::claims::claim::Claimer;
use newsnack::db::issue::{claim_issues, ClaimScope, NewIssue};
use newsnack::db::DbPool;
use newsnack::embedded::{EmbeddedOptions, EmbeddedPostgres};
use newsnack::serve::ServeOptions;

/// Waits until all `issues` of the database are `DONE`: the writer
/// finishes what the driver claimed. Fails after `within`.
pub async fn until_all_done(db: &tokio_postgres::Client, issues: usize, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let done: i64 = db
            .query_one(
                "SELECT count(*) FROM issue WHERE processing_status = 'DONE'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if done as usize == issues {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "only {done} of {issues} issues DONE after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A numeric knob from the environment, or its default.
pub fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One connection outside any pool, its driver spawned.
pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

/// A throwaway cluster started with `options` (starting blocks, so on a
/// blocking thread).
pub async fn start_cluster(options: EmbeddedOptions) -> EmbeddedPostgres {
    tokio::task::spawn_blocking(move || EmbeddedPostgres::start(&options))
        .await
        .unwrap()
        .expect("start a throwaway cluster")
}

/// Creates the database `name` on `cluster`; its URL.
pub async fn create_database(cluster: &EmbeddedPostgres, name: &str) -> String {
    connect(&cluster.url("postgres"))
        .await
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    cluster.url(name)
}

/// Migrates the database at `url` with the binary `bin` (`newsnack
/// migrate`), as an operator would.
pub fn migrate_with(bin: &std::path::Path, url: &str) {
    let status = Command::new(bin)
        .arg("migrate")
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .status()
        .expect("run newsnack migrate");
    assert!(status.success(), "{} migrate failed", bin.display());
}

/// A service on a free loopback port of `url`'s database, without a token,
/// given 5 s to drain.
pub fn serve_options(url: &str, instance: &str, pool_size: usize) -> ServeOptions {
    ServeOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        database_url: Some(url.into()),
        direct_database_url: None,
        instance: instance.into(),
        pool_size,
        grace: Duration::from_secs(5),
        tokens: Default::default(),
        max_backlog: ServeOptions::DEFAULT_MAX_BACKLOG,
    }
}

/// Waits until the `serve` process `serve`, listening at `base`
/// (`http://host:port`), answers `/readyz` with 200; panics if it exits
/// first or is not ready within 30 s.
pub async fn wait_ready(base: &str, serve: &mut std::process::Child) {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = serve.try_wait().unwrap() {
            panic!("newsnack serve exited before it was ready: {status}");
        }
        if let Ok(r) = client.get(format!("{base}/readyz")).send().await {
            if r.status().is_success() {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "newsnack serve not ready in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// SIGTERM, then waits for the process to end.
pub fn stop(child: &mut std::process::Child) {
    // SAFETY: a plain kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    child.wait().unwrap();
}

/// Adds the reference run's `n` issues (short rows: `issue g`, `body g`,
/// a random score) with plain SQL; their ids.
pub async fn reference_issues(client: &tokio_postgres::Client, n: usize) -> Vec<i64> {
    client
        .query(
            "INSERT INTO issue (title, body, score)
             SELECT 'issue ' || g, 'body ' || g, random() FROM generate_series(1, $1::int) g
             RETURNING id",
            &[&(n as i32)],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Adds `n` issues and moves them to `IN_PROGRESS`, as if claimed: targets
/// for waits that stay open until the benchmark finishes them; their ids.
pub async fn in_progress(client: &tokio_postgres::Client, n: usize) -> Vec<i64> {
    let ids: Vec<i64> = client
        .query(
            "INSERT INTO issue (title) SELECT 'wait ' || g FROM generate_series(1, $1::int) g
             RETURNING id",
            &[&(n as i32)],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    client
        .execute(
            "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = ANY($1)",
            &[&ids],
        )
        .await
        .unwrap();
    ids
}

/// Adds `n` issues titled `{prefix} N`, with a body each; their ids.
pub async fn titled(client: &tokio_postgres::Client, prefix: &str, n: usize) -> Vec<i64> {
    let issues: Vec<NewIssue> = (0..n)
        .map(|i| NewIssue {
            title: format!("{prefix} {i}"),
            body: format!("What happened in {prefix} {i}."),
            score: 1.0,
            collected_at: None,
            source_key: None,
        })
        .collect();
    newsnack::db::issue::insert_issues(client, &issues)
        .await
        .unwrap()
}

pub fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[derive(Clone, Copy)]
pub enum Path {
    /// Through the service's batching claimer.
    Claimer,
    /// The bare statement, one transaction per claim.
    Direct,
}

/// Each of `clients` claims single issues from its own slice, one request
/// per claim, for `duration`. Returns claims per second.
pub async fn claim_rate(pool: &DbPool, path: Path, clients: usize, duration: Duration) -> f64 {
    // More than a client can claim in `duration` (about 1,000/s at most).
    let per_client = (duration.as_secs_f64() * 2_000.0).ceil() as usize + 1_000;
    let client = pool.get().await.unwrap();
    let issues: Vec<NewIssue> = (0..per_client * clients)
        .map(|i| NewIssue {
            title: format!("bench {i}"),
            body: String::new(),
            score: 0.0,
            collected_at: None,
            source_key: None,
        })
        .collect();
    let mut ids = Vec::new();
    for chunk in issues.chunks(5000) {
        ids.extend(
            newsnack::db::issue::insert_issues(&client, chunk)
                .await
                .unwrap(),
        );
    }
    drop(client);
    let ids = Arc::new(ids);
    let claims = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let claimer = Claimer::start(pool.clone(), "bench".into(), 2);
    let lease = Duration::from_secs(60);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (pool, ids, claims, stop, claimer) = (
            pool.clone(),
            ids.clone(),
            claims.clone(),
            stop.clone(),
            claimer.clone(),
        );
        tasks.push(tokio::spawn(async move {
            for &id in &ids[c * per_client..(c + 1) * per_client] {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let out = match path {
                    Path::Claimer => claimer
                        .claim(vec![id], lease, ClaimScope::Claimable)
                        .await
                        .unwrap(),
                    Path::Direct => {
                        let client = pool.get().await.unwrap();
                        claim_issues(&client, &[id], "bench", lease, ClaimScope::Claimable)
                            .await
                            .unwrap()
                    }
                };
                claims.fetch_add(out.claimed.len() as u64, Ordering::Relaxed);
            }
        }));
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    claims.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// Calls in flight averaged over `[from, to]`, from a fake LLM's record of
/// `(when, in flight from then on)` changes.
pub fn average_in_flight(changes: &[(Instant, u64)], from: Instant, to: Instant) -> f64 {
    let mut area = 0.0;
    let mut level = 0u64;
    let mut at = from;
    for &(when, now) in changes {
        if when > to {
            break;
        }
        if when > at {
            area += level as f64 * (when - at).as_secs_f64();
            at = when;
        }
        level = now;
    }
    area += level as f64 * (to - at).as_secs_f64();
    area / (to - from).as_secs_f64()
}

/// User and system CPU seconds of one process (`/proc/PID/stat`), with
/// those of its children that have ended if `children`.
pub fn cpu_of(pid: u32, children: bool) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command's closing parenthesis: state is field 3;
    // utime, stime, cutime, cstime are fields 14 to 17.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<f64> = rest
        .split(' ')
        .skip(11)
        .take(4)
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let sum = if children {
        f.iter().sum()
    } else {
        f[0] + f[1]
    };
    sum / ticks
}

/// User and system CPU seconds of one running process.
pub fn process_cpu_seconds(pid: u32) -> f64 {
    cpu_of(pid, false)
}

/// The CPU seconds of the cluster's processes: the postmaster with every
/// child that has ended (backends end with their sessions), plus those
/// still running (the background processes).
pub fn postgres_cpu_seconds(cluster: &EmbeddedPostgres) -> f64 {
    let pid_file = cluster.dir().unwrap().join("data").join("postmaster.pid");
    let postmaster: u32 = std::fs::read_to_string(pid_file)
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut total = cpu_of(postmaster, true);
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let rest = &stat[stat.rfind(')').unwrap_or(0) + 2..];
        let ppid: u32 = rest
            .split(' ')
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if ppid == postmaster {
            total += cpu_of(pid, false);
        }
    }
    total
}
