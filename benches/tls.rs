//! Benchmark: claims per second over TLS against plain TCP, in one run on
//! one cluster. Prints one JSON object.
//!
//! A throwaway cluster with `ssl = on` (a certificate made for the run) and
//! default durability; its `pg_hba.conf` (initdb's: trust on loopback)
//! takes both kinds of session. [`CLIENTS`] clients claim single issues
//! through the service's `Claimer`, as in `cargo bench --bench
//! transitions`, from a pool whose URL says `sslmode=require` or
//! `sslmode=disable`; the two alternate in [`ROUNDS`] rounds each, so drift
//! in the machine's speed weighs on both alike.
//!
//! `cargo bench --bench tls` (`BENCH_SECONDS`: each way's length, summed
//! over its rounds; default 10).

mod common;

use common::{knob, round3};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use newsnack::claim::Claimer;
use newsnack::db::issue::{ClaimScope, NewIssue};
use newsnack::db::{self, DbPool, PoolOptions};
use newsnack::embedded::{EmbeddedOptions, EmbeddedPostgres};

const CLIENTS: usize = 8;
const ROUNDS: u32 = 4;

#[tokio::main]
async fn main() {
    let seconds = knob("BENCH_SECONDS", 10);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let cluster = tokio::task::spawn_blocking(move || {
        EmbeddedPostgres::start(&EmbeddedOptions {
            durable: true,
            settings: vec![
                ("max_connections".into(), "100".into()),
                ("ssl".into(), "on".into()),
                ("ssl_cert_file".into(), "server.crt".into()),
                ("ssl_key_file".into(), "server.key".into()),
            ],
            files: vec![
                ("server.crt".into(), cert.pem().into_bytes()),
                ("server.key".into(), key.serialize_pem().into_bytes()),
            ],
            ..EmbeddedOptions::default()
        })
    })
    .await
    .unwrap()
    .expect("start a throwaway cluster with TLS");
    let plain = db::Endpoint::parse(
        &format!("{}?sslmode=disable", cluster.url("postgres")),
        "bench",
    )
    .unwrap();
    plain
        .connect()
        .await
        .unwrap()
        .batch_execute("CREATE DATABASE bench")
        .await
        .unwrap();
    let pool = |mode: &str| {
        let endpoint =
            db::Endpoint::parse(&format!("{}?sslmode={mode}", cluster.url("bench")), "bench")
                .unwrap();
        db::pool(
            &endpoint,
            &PoolOptions {
                max_size: CLIENTS + 2,
                ..PoolOptions::default()
            },
        )
        .unwrap()
    };
    let (tls_pool, plain_pool) = (pool("require"), pool("disable"));
    db::migrate::migrate(&mut tls_pool.endpoint().connect().await.unwrap())
        .await
        .unwrap();
    let (_, connection, security) = tls_pool.endpoint().connect_raw().await.unwrap();
    drop(connection);
    assert!(security.encrypted, "sslmode=require encrypts");

    let round = Duration::from_secs_f64(seconds as f64 / ROUNDS as f64);
    let (mut tls, mut plain_rate) = (0.0, 0.0);
    for _ in 0..ROUNDS {
        tls += claim_rate(&tls_pool, round).await / ROUNDS as f64;
        plain_rate += claim_rate(&plain_pool, round).await / ROUNDS as f64;
    }
    let report = serde_json::json!({
        "benchmark": "claims per second over TLS and plain TCP",
        "clients": CLIENTS,
        "seconds_per_way": seconds,
        "rounds_per_way": ROUNDS,
        "claims_per_s_tls": tls.round(),
        "claims_per_s_plain": plain_rate.round(),
        "tls_vs_plain": round3(tls / plain_rate),
        "tls_sessions": tls_pool.endpoint().security(),
        "plain_sessions": plain_pool.endpoint().security(),
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    tls_pool.close();
    plain_pool.close();
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

/// Each client claims single issues of its own, one request per claim,
/// through a `Claimer` on `pool`, for `duration`. Claims per second.
async fn claim_rate(pool: &DbPool, duration: Duration) -> f64 {
    let per_client = (duration.as_secs_f64() * 2_000.0).ceil() as usize + 1_000;
    let issues: Vec<NewIssue> = (0..per_client * CLIENTS)
        .map(|i| NewIssue {
            title: format!("bench {i}"),
            body: String::new(),
            score: 0.0,
            collected_at: None,
        })
        .collect();
    let client = pool.get().await.unwrap();
    let mut ids = Vec::new();
    for chunk in issues.chunks(5000) {
        ids.extend(db::issue::insert_issues(&client, chunk).await.unwrap());
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
        let (ids, claims, stop, claimer) =
            (ids.clone(), claims.clone(), stop.clone(), claimer.clone());
        tasks.push(tokio::spawn(async move {
            for &id in &ids[c * per_client..(c + 1) * per_client] {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let out = claimer
                    .claim(vec![id], lease, ClaimScope::Claimable)
                    .await
                    .unwrap();
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
