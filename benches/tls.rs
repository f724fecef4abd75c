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

use common::{claim_rate, knob, round3, start_cluster, Path};

use std::time::Duration;

use newsnack::db::{self, PoolOptions, Statements};
use newsnack::embedded::EmbeddedOptions;

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
    let cluster = start_cluster(EmbeddedOptions {
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
    .await;
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
                // As `serve` sends them with no pooler in front.
                statements: Statements::Named,
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
        tls += claim_rate(&tls_pool, Path::Claimer, CLIENTS, round).await / ROUNDS as f64;
        plain_rate += claim_rate(&plain_pool, Path::Claimer, CLIENTS, round).await / ROUNDS as f64;
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
