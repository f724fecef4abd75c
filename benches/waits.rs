//! Benchmark: from the commit that decides a smart wait to the wait's
//! answer, the listener working three ways in one run: publishing payloads
//! that the log's trigger signed (the service's way, migration 18; the log
//! is read on a gap or a bad MAC), reading every transition from the log (a
//! notification only a doorbell: the service's way when it cannot read the
//! key), and publishing payloads as they come (the earliest way, which a
//! forged NOTIFY could fool). Prints one JSON object.
//!
//! A throwaway cluster with default durability. The ways alternate in
//! [`ROUNDS`] rounds each, so drift in the machine's speed weighs on both
//! alike. In every round a listener of that way starts; background traffic
//! of `BENCH_WAIT_BACKGROUND` transitions per second (default 500) commits
//! from a connection of its own, ten every 20 ms in one statement; and
//! `BENCH_WAIT_RATE` waits per second (default 50) are armed, each on one
//! `IN_PROGRESS` issue whose `DONE` is then committed from a pooled
//! session. Latency: from the commit's acknowledgement (the `UPDATE`
//! returned) to the wait's answer.
//!
//! `cargo bench --bench waits` (`BENCH_SECONDS`: each way's length, summed
//! over its rounds; default 10).

mod common;

use common::{create_database, knob, round3, start_cluster};

use std::sync::Arc;
use std::time::{Duration, Instant};

use newsnack::briefing::wait::{ArmedWait, WaitOutcome, WaitRequest};
use newsnack::db::{self, DbPool, PoolOptions, Statements};
use newsnack::embedded::EmbeddedOptions;
use newsnack::events::listener::{Listener, ListenerOptions};
use tokio_util::sync::CancellationToken;

const ROUNDS: u32 = 5;

#[tokio::main]
async fn main() {
    let seconds = knob("BENCH_SECONDS", 10);
    let background_rate = knob("BENCH_WAIT_BACKGROUND", 500);
    let wait_rate = knob("BENCH_WAIT_RATE", 50).max(1);
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
            // As `serve` sends them with no pooler in front.
            statements: Statements::Named,
            ..PoolOptions::default()
        },
    )
    .unwrap();

    let round = Duration::from_secs_f64(seconds as f64 / ROUNDS as f64);
    let waits_per_round = (round.as_secs_f64() * wait_rate as f64).ceil() as usize + 10;
    let background_per_round = (round.as_secs_f64() * background_rate as f64).ceil() as usize + 100;
    let mut latencies = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..ROUNDS {
        for (way, options) in [
            ListenerOptions::default(),
            ListenerOptions {
                read_log_always: true,
                ..ListenerOptions::default()
            },
            ListenerOptions {
                trust_payloads: true,
                ..ListenerOptions::default()
            },
        ]
        .into_iter()
        .enumerate()
        {
            let targets = claimed_issues(&pool, waits_per_round).await;
            let background = claimed_issues(&pool, background_per_round).await;
            latencies[way].extend(
                run_round(
                    &endpoint,
                    &pool,
                    options,
                    round,
                    wait_rate,
                    background_rate,
                    targets,
                    background,
                )
                .await,
            );
        }
    }

    let [mut signed, mut log, mut payload] = latencies;
    let signed_p99 = percentile(&mut signed, 0.99);
    let log_p99 = percentile(&mut log, 0.99);
    let payload_p99 = percentile(&mut payload, 0.99);
    let ratio = signed_p99 / payload_p99.max(1e-6);
    let report = serde_json::json!({
        "benchmark": "commit -> smart wait answer",
        "seconds_per_way": seconds,
        "rounds_per_way": ROUNDS,
        "waits_per_s": wait_rate,
        "background_transitions_per_s": background_rate,
        "signed_payloads_checked": summary(&mut signed),
        "transitions_read_from_the_log": summary(&mut log),
        "payloads_published_as_they_come": summary(&mut payload),
        "p99_ratio_signed_vs_payload": round3(ratio),
        "p99_ratio_log_vs_payload": round3(log_p99 / payload_p99.max(1e-6)),
        "targets": { "p99_ratio_at_most_1_5": ratio <= 1.5 },
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    pool.close();
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

/// `n` new issues, claimed (`IN_PROGRESS`) with plain SQL.
async fn claimed_issues(pool: &DbPool, n: usize) -> Vec<i64> {
    let client = pool.get().await.unwrap();
    let rows = client
        .query(
            "INSERT INTO issue (title) SELECT 'bench ' || g FROM generate_series(1, $1::int) g RETURNING id",
            &[&(n as i32)],
        )
        .await
        .unwrap();
    let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    client
        .execute(
            "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = ANY($1)",
            &[&ids],
        )
        .await
        .unwrap();
    ids
}

/// One round with a listener of one way; the latency of each wait, in ms.
#[allow(clippy::too_many_arguments)]
async fn run_round(
    endpoint: &db::Endpoint,
    pool: &DbPool,
    options: ListenerOptions,
    length: Duration,
    wait_rate: u64,
    background_rate: u64,
    targets: Vec<i64>,
    background: Vec<i64>,
) -> Vec<f64> {
    let stop_listener = CancellationToken::new();
    let (hub, _) = Listener::start(
        endpoint.clone(),
        pool.clone(),
        options,
        stop_listener.clone(),
    )
    .await
    .unwrap();
    let stop = CancellationToken::new();
    let traffic = {
        let (pool, stop) = (pool.clone(), stop.clone());
        let per_tick = ((background_rate as f64) / 50.0).ceil().max(1.0) as usize;
        tokio::spawn(async move {
            let client = pool.get().await.unwrap();
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            for chunk in background.chunks(per_tick) {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                client
                    .execute(
                        "UPDATE issue SET processing_status = 'DONE' WHERE id = ANY($1)",
                        &[&chunk],
                    )
                    .await
                    .unwrap();
            }
        })
    };
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / wait_rate as f64));
    let mut waits = Vec::new();
    for id in targets {
        tick.tick().await;
        if started.elapsed() >= length {
            break;
        }
        let (hub, pool) = (hub.clone(), pool.clone());
        waits.push(tokio::spawn(async move {
            let armed = ArmedWait::arm(
                &hub,
                WaitRequest {
                    issue_ids: vec![id],
                    timeout: Duration::from_secs(60),
                    min_completion: 1,
                    max_attempts: 3,
                },
            )
            .await
            .unwrap();
            let answered = Arc::new(std::sync::OnceLock::new());
            let outcome = {
                let answered = answered.clone();
                tokio::spawn(async move {
                    let report = armed.outcome(&CancellationToken::new()).await.unwrap();
                    answered.set(Instant::now()).unwrap();
                    report
                })
            };
            pool.get()
                .await
                .unwrap()
                .execute(
                    "UPDATE issue SET processing_status = 'DONE' WHERE id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            let acknowledged = Instant::now();
            let report = outcome.await.unwrap();
            assert_eq!(report.outcome, WaitOutcome::AllPass);
            let answered = *answered.get().unwrap();
            answered
                .saturating_duration_since(acknowledged)
                .as_secs_f64()
                * 1000.0
        }));
    }
    let mut latencies = Vec::with_capacity(waits.len());
    for wait in waits {
        latencies.push(wait.await.unwrap());
    }
    stop.cancel();
    traffic.await.unwrap();
    stop_listener.cancel();
    latencies
}

fn percentile(sorted_or_not: &mut [f64], p: f64) -> f64 {
    sorted_or_not.sort_by(f64::total_cmp);
    if sorted_or_not.is_empty() {
        return 0.0;
    }
    let index = ((sorted_or_not.len() as f64 - 1.0) * p).round() as usize;
    sorted_or_not[index]
}

fn summary(latencies: &mut [f64]) -> serde_json::Value {
    serde_json::json!({
        "waits": latencies.len(),
        "p50_ms": round3(percentile(latencies, 0.50)),
        "p90_ms": round3(percentile(latencies, 0.90)),
        "p99_ms": round3(percentile(latencies, 0.99)),
        "max_ms": round3(percentile(latencies, 1.0)),
    })
}
