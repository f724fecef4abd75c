//! Benchmark: a year's prune while claims run. Prints one JSON object.
//!
//! A throwaway cluster with default durability; `BENCH_LOG_ROWS` (default
//! 1,000,000) `issue_transition` rows bulk-loaded by SQL and backdated 60
//! days, past the default `log_retention_days` (30). `BENCH_CLIENTS`
//! (default 8) clients each claim single issues through the service's
//! batching claimer, one request at a time, timing every claim. Three
//! phases of the same workload: claims alone (`BENCH_SECONDS`, default
//! 10), claims while `retention::prune` removes the old rows (as `serve`'s
//! pruner runs it: one session, a batch per transaction), and claims alone
//! again; the ratio compares the prune phase's p99 with the worse of the
//! two quiet phases'.
//!
//! `cargo bench --bench prune`

mod common;

use common::{connect, create_database, knob, round1, round3, start_cluster};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use newsnack::claims::claim::Claimer;
use newsnack::db::issue::ClaimScope;
use newsnack::db::retention::{self, Retention};
use newsnack::db::{self, PoolOptions, Statements};
use newsnack::embedded::EmbeddedOptions;
use serde_json::json;

#[tokio::main]
async fn main() {
    let log_rows = knob("BENCH_LOG_ROWS", 1_000_000) as i64;
    let clients = knob("BENCH_CLIENTS", 8) as usize;
    let seconds = knob("BENCH_SECONDS", 10);
    let cluster = start_cluster(EmbeddedOptions {
        durable: true,
        settings: vec![("max_connections".into(), "100".into())],
        ..EmbeddedOptions::default()
    })
    .await;
    let url = create_database(&cluster, "bench").await;
    let endpoint = db::Endpoint::parse(&url, "newsnack-bench").unwrap();
    db::migrate::migrate(&mut endpoint.connect().await.unwrap())
        .await
        .unwrap();
    let pool = db::pool(
        &endpoint,
        &PoolOptions {
            max_size: 16,
            statements: Statements::Named,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let sql = connect(&url).await;
    let loaded = Instant::now();
    sql.execute(
        "INSERT INTO issue_transition (issue_id, from_status, to_status, at, attempts)
         SELECT g, 'PENDING', 'IN_PROGRESS', now() - interval '60 days', 1
           FROM generate_series(1, $1::bigint) g",
        &[&log_rows],
    )
    .await
    .unwrap();
    sql.batch_execute("VACUUM ANALYZE issue_transition")
        .await
        .unwrap();
    let load_s = loaded.elapsed().as_secs_f64();

    // Enough issues for every phase: the clients claim at most ~1,000/s
    // each, the prune moves ~10,000 rows/s, so one issue per log row
    // outlasts it with room to spare.
    let quiet = clients * (seconds as usize * 1_000 + 1_000);
    let supply = [quiet, quiet.max(log_rows as usize), quiet];
    sql.execute(
        "INSERT INTO issue (title) SELECT 'bench ' || g FROM generate_series(1, $1::int) g",
        &[&(supply.iter().sum::<usize>() as i32)],
    )
    .await
    .unwrap();
    let ids: Vec<i64> = sql
        .query("SELECT id FROM issue ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (before_ids, rest) = ids.split_at(supply[0]);
    let (during_ids, after_ids) = rest.split_at(supply[1]);
    let claimer = Claimer::start(pool.clone(), "bench".into(), 2);

    let before = claims(&claimer, before_ids, clients, async {
        tokio::time::sleep(Duration::from_secs(seconds)).await;
    })
    .await;
    let mut pruned = None;
    let during = claims(&claimer, during_ids, clients, async {
        let started = Instant::now();
        let report = retention::prune(
            &sql,
            &Retention {
                log_days: 30,
                issue_days: 0,
                max_attempts: 3,
            },
            false,
        )
        .await
        .unwrap();
        pruned = Some((report, started.elapsed()));
    })
    .await;
    let after = claims(&claimer, after_ids, clients, async {
        tokio::time::sleep(Duration::from_secs(seconds)).await;
    })
    .await;
    let (report, took) = pruned.unwrap();
    for (phase, latencies, supply) in [
        ("before", &before, supply[0]),
        ("during", &during, supply[1]),
        ("after", &after, supply[2]),
    ] {
        assert!(
            latencies.claims < supply / clients * clients,
            "the clients ran out of issues {phase} the prune: raise the supply"
        );
    }
    assert_eq!(report.issue_transition, log_rows, "every old row pruned");

    let quiet_p99 = before.p99.max(after.p99);
    let ratio = during.p99 / quiet_p99.max(1e-6);
    let report = json!({
        "benchmark": "claim latency while a year's log is pruned",
        "log_rows_pruned": report.issue_transition,
        "batch_rows": retention::BATCH,
        "load_s": round1(load_s),
        "prune_s": round3(took.as_secs_f64()),
        "prune_rows_per_s": (report.issue_transition as f64 / took.as_secs_f64()).round(),
        "clients": clients,
        "claims_before": before.json(),
        "claims_during_prune": during.json(),
        "claims_after": after.json(),
        "p99_ratio_during_vs_quiet": round3(ratio),
        "targets": { "p99_ratio_at_most_2": ratio <= 2.0 },
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    drop(claimer);
    pool.close();
    drop(sql);
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

struct Latencies {
    claims: usize,
    seconds: f64,
    p50: f64,
    p99: f64,
    max: f64,
}

impl Latencies {
    fn json(&self) -> serde_json::Value {
        json!({
            "claims": self.claims,
            "claims_per_s": round1(self.claims as f64 / self.seconds),
            "p50_ms": round3(self.p50),
            "p99_ms": round3(self.p99),
            "max_ms": round3(self.max),
        })
    }
}

/// `clients` clients claim single issues from `ids` until `phase` ends.
async fn claims(
    claimer: &Claimer,
    ids: &[i64],
    clients: usize,
    phase: impl std::future::Future<Output = ()>,
) -> Latencies {
    let stop = Arc::new(AtomicBool::new(false));
    let per_client = ids.len() / clients;
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (claimer, stop) = (claimer.clone(), stop.clone());
            let mine = ids[c * per_client..(c + 1) * per_client].to_vec();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                for id in mine {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let t = Instant::now();
                    let out = claimer
                        .claim(vec![id], Duration::from_secs(600), ClaimScope::Claimable)
                        .await
                        .unwrap();
                    assert_eq!(out.claimed.len(), 1);
                    latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                latencies
            })
        })
        .collect();
    phase.await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let seconds = started.elapsed().as_secs_f64();
    all.sort_by(f64::total_cmp);
    let at = |p: f64| {
        if all.is_empty() {
            0.0
        } else {
            all[((p / 100.0) * (all.len() - 1) as f64).round() as usize]
        }
    };
    Latencies {
        claims: all.len(),
        seconds,
        p50: at(50.0),
        p99: at(99.0),
        max: at(100.0),
    }
}
