//! Benchmark: status transitions per second through the claim statement at
//! 8 concurrent clients, with the transition triggers on and, in the same
//! run on the same cluster, disabled; and `pgbench -b simple-update` at the
//! same concurrency as the machine's ceiling. Prints one JSON object.
//!
//! Two claim paths are measured: the service's [`Claimer`] (concurrent
//! requests share a commit) and the bare statement, one transaction per
//! claim, which shows what NOTIFY's commit serialisation costs.
//!
//! `cargo bench --bench transitions` (BENCH_SECONDS sets each phase's
//! length, default 10). Uses a throwaway cluster with default durability.

mod common;

use common::{connect, round3};

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use newsnack::claim::Claimer;
use newsnack::db::issue::{claim_issues, ClaimScope, NewIssue};
use newsnack::db::{self, DbPool, PoolOptions};
use newsnack::embedded::{find_bin_dir, EmbeddedOptions, EmbeddedPostgres};

const CLIENTS: usize = 8;

#[tokio::main]
async fn main() {
    let seconds: u64 = std::env::var("BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let cluster = tokio::task::spawn_blocking(|| {
        EmbeddedPostgres::start(&EmbeddedOptions {
            durable: true,
            settings: vec![("max_connections".into(), "100".into())],
        })
    })
    .await
    .unwrap()
    .expect("start a throwaway cluster");
    let admin = connect(&cluster.url("postgres")).await;
    admin.batch_execute("CREATE DATABASE bench").await.unwrap();
    admin
        .batch_execute("CREATE DATABASE bench_pgbench")
        .await
        .unwrap();
    let url = cluster.url("bench");
    let config = db::pg_config(&url, "newsnack-bench").unwrap();
    let mut migrator = db::connect(&config).await.unwrap();
    db::migrate::migrate(&mut migrator).await.unwrap();
    let pool = db::pool(
        config,
        &PoolOptions {
            max_size: CLIENTS + 2,
            ..PoolOptions::default()
        },
    )
    .unwrap();

    let duration = Duration::from_secs(seconds);
    let on = claim_rate(&pool, Path::Claimer, duration).await;
    let direct_on = claim_rate(&pool, Path::Direct, duration).await;
    migrator
        .batch_execute("ALTER TABLE issue DISABLE TRIGGER USER")
        .await
        .unwrap();
    let off = claim_rate(&pool, Path::Claimer, duration).await;
    let direct_off = claim_rate(&pool, Path::Direct, duration).await;
    migrator
        .batch_execute("ALTER TABLE issue ENABLE TRIGGER USER")
        .await
        .unwrap();
    let pgbench = pgbench_tps(&cluster, seconds);

    let ratio_vs_pgbench = on / pgbench;
    let trigger_cost = 1.0 - on / off;
    let report = serde_json::json!({
        "benchmark": "claim transitions per second",
        "clients": CLIENTS,
        "seconds_per_phase": seconds,
        "claims_per_s_triggers_on": round(on),
        "claims_per_s_triggers_off": round(off),
        "direct_one_claim_per_transaction": {
            "claims_per_s_triggers_on": round(direct_on),
            "claims_per_s_triggers_off": round(direct_off),
            "ratio_on_vs_pgbench": round3(direct_on / pgbench),
            "trigger_cost": round3(1.0 - direct_on / direct_off),
        },
        "pgbench_simple_update_tps": round(pgbench),
        "ratio_on_vs_pgbench": round3(ratio_vs_pgbench),
        "trigger_cost": round3(trigger_cost),
        "targets": {
            "ratio_on_vs_pgbench_at_least_0_70": ratio_vs_pgbench >= 0.70,
            "trigger_cost_at_most_0_20": trigger_cost <= 0.20,
        }
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    drop(admin);
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

#[derive(Clone, Copy)]
enum Path {
    /// Through the service's batching claimer.
    Claimer,
    /// The bare statement, one transaction per claim.
    Direct,
}

/// Each client claims single issues from its own slice, one request per
/// claim, for `duration`. Returns claims per second.
async fn claim_rate(pool: &DbPool, path: Path, duration: Duration) -> f64 {
    let per_client = 40_000;
    let client = pool.get().await.unwrap();
    let issues: Vec<NewIssue> = (0..per_client * CLIENTS)
        .map(|i| NewIssue {
            title: format!("bench {i}"),
            body: String::new(),
            score: 0.0,
            collected_at: None,
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
    for c in 0..CLIENTS {
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

fn pgbench_tps(cluster: &EmbeddedPostgres, seconds: u64) -> f64 {
    let bin = find_bin_dir().expect("server binaries");
    let pgbench = if bin.join("pgbench").is_file() {
        bin.join("pgbench")
    } else {
        "pgbench".into()
    };
    let port = cluster.port().to_string();
    let base = ["-h", "127.0.0.1", "-p", port.as_str(), "-U", "postgres"];
    let init = Command::new(&pgbench)
        .args(base)
        .args(["-i", "-q", "-s", "8", "bench_pgbench"])
        .output()
        .expect("run pgbench");
    assert!(
        init.status.success(),
        "pgbench -i: {}",
        String::from_utf8_lossy(&init.stderr)
    );
    let clients = CLIENTS.to_string();
    let secs = seconds.to_string();
    let run = Command::new(&pgbench)
        .args(base)
        .args([
            "-b",
            "simple-update",
            "-c",
            &clients,
            "-j",
            "2",
            "-T",
            &secs,
            "bench_pgbench",
        ])
        .output()
        .expect("run pgbench");
    let out = String::from_utf8_lossy(&run.stdout);
    out.lines()
        .find_map(|l| {
            l.strip_prefix("tps = ")
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or_else(|| panic!("no tps in pgbench output: {out}"))
}

fn round(x: f64) -> f64 {
    x.round()
}
