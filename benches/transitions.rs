//! Benchmark: status transitions per second through the claim statement at
//! 8 concurrent clients, with the transition triggers on and, in the same
//! run on the same cluster, disabled; and `pgbench -b simple-update` at the
//! same concurrency as the machine's ceiling. Prints one JSON object.
//!
//! Two claim paths are measured: the service's [`Claimer`] (concurrent
//! requests share a commit) and the bare statement, one transaction per
//! claim, which shows what NOTIFY's commit serialisation costs. On and off
//! alternate in [`ROUNDS`] rounds, so drift in the machine's speed during
//! the run weighs on both alike; each figure is the mean over the rounds.
//!
//! Last, the claim statement's ceiling with PostgreSQL alone: `pgbench`
//! runs it on [`CEILING_CONNECTIONS`] connections, each transaction claiming
//! a fresh window of [`CEILING_BATCH`] ids (the largest batch the seeds'
//! workload gives the claimer: 16 clients asking for 2 new ids each), with
//! the transition log trigger on and disabled. No service, no HTTP: what the
//! database can do with the whole machine.
//!
//! `cargo bench --bench transitions` (BENCH_SECONDS sets each phase's
//! length, summed over its rounds; default 10). Uses a throwaway cluster
//! with default durability.

mod common;

use common::{claim_rate, connect, round3, start_cluster, Path};

use std::process::Command;
use std::time::Duration;

use newsnack::db::{self, PoolOptions, Statements};
use newsnack::embedded::{find_bin_dir, EmbeddedOptions, EmbeddedPostgres};

const CLIENTS: usize = 8;
/// Rounds of triggers on, then off, each a share of `BENCH_SECONDS`.
const ROUNDS: u32 = 4;
/// Ids per transaction in the ceiling phase.
const CEILING_BATCH: i64 = 32;
/// Connections in the ceiling phase: two saturate the two cores (four and
/// eight give no more).
const CEILING_CONNECTIONS: usize = 2;

#[tokio::main]
async fn main() {
    let seconds: u64 = std::env::var("BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let cluster = start_cluster(EmbeddedOptions {
        durable: true,
        settings: vec![("max_connections".into(), "100".into())],
        ..EmbeddedOptions::default()
    })
    .await;
    let admin = connect(&cluster.url("postgres")).await;
    admin.batch_execute("CREATE DATABASE bench").await.unwrap();
    admin
        .batch_execute("CREATE DATABASE bench_pgbench")
        .await
        .unwrap();
    let url = cluster.url("bench");
    let endpoint = db::Endpoint::parse(&url, "newsnack-bench").unwrap();
    let mut migrator = endpoint.connect().await.unwrap();
    db::migrate::migrate(&mut migrator).await.unwrap();
    let pool = db::pool(
        &endpoint,
        &PoolOptions {
            max_size: CLIENTS + 2,
            // As `serve` sends them with no pooler in front.
            statements: Statements::Named,
            ..PoolOptions::default()
        },
    )
    .unwrap();

    // On and off alternate in ROUNDS short rounds, so a machine that
    // speeds up or slows down during the run weighs on both alike.
    let round_length = Duration::from_secs_f64(seconds as f64 / ROUNDS as f64);
    let (mut on, mut direct_on, mut off, mut direct_off) = (0.0, 0.0, 0.0, 0.0);
    for _ in 0..ROUNDS {
        on += claim_rate(&pool, Path::Claimer, CLIENTS, round_length).await / ROUNDS as f64;
        direct_on += claim_rate(&pool, Path::Direct, CLIENTS, round_length).await / ROUNDS as f64;
        set_triggers(&migrator, "USER", false).await;
        off += claim_rate(&pool, Path::Claimer, CLIENTS, round_length).await / ROUNDS as f64;
        direct_off += claim_rate(&pool, Path::Direct, CLIENTS, round_length).await / ROUNDS as f64;
        set_triggers(&migrator, "USER", true).await;
    }
    let pgbench = pgbench_tps(&cluster, seconds);
    let ceiling_on = claim_ceiling(&cluster, &migrator, seconds).await;
    set_triggers(&migrator, "issue_transition_on_update", false).await;
    let ceiling_off = claim_ceiling(&cluster, &migrator, seconds).await;
    set_triggers(&migrator, "issue_transition_on_update", true).await;

    let ratio_vs_pgbench = on / pgbench;
    let trigger_cost = 1.0 - on / off;
    let report = serde_json::json!({
        "benchmark": "claim transitions per second",
        "clients": CLIENTS,
        "seconds_per_phase": seconds,
        "rounds_of_on_then_off": ROUNDS,
        "claims_per_s_triggers_on": round(on),
        "claims_per_s_triggers_off": round(off),
        "direct_one_claim_per_transaction": {
            "claims_per_s_triggers_on": round(direct_on),
            "claims_per_s_triggers_off": round(direct_off),
            "ratio_on_vs_pgbench": round3(direct_on / pgbench),
            "trigger_cost": round3(1.0 - direct_on / direct_off),
        },
        "pgbench_simple_update_tps": round(pgbench),
        "claim_statement_ceiling_postgres_alone": {
            "what": "pgbench running the claim statement, each transaction a fresh window of ids",
            "ids_per_transaction": CEILING_BATCH,
            "connections": CEILING_CONNECTIONS,
            "claims_per_s_triggers_on": round(ceiling_on),
            "claims_per_s_transition_log_trigger_off": round(ceiling_off),
        },
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

fn pgbench_tps(cluster: &EmbeddedPostgres, seconds: u64) -> f64 {
    let port = cluster.port().to_string();
    let init = Command::new(pgbench())
        .args(["-h", "127.0.0.1", "-p", port.as_str(), "-U", "postgres"])
        .args(["-i", "-q", "-s", "8", "bench_pgbench"])
        .output()
        .expect("run pgbench");
    assert!(
        init.status.success(),
        "pgbench -i: {}",
        String::from_utf8_lossy(&init.stderr)
    );
    run_pgbench(
        cluster,
        &[
            "-b",
            "simple-update",
            "-c",
            &CLIENTS.to_string(),
            "-j",
            "2",
            "-T",
            &seconds.to_string(),
            "bench_pgbench",
        ],
    )
}

/// The server's own `pgbench` (or the one on `PATH`).
fn pgbench() -> std::path::PathBuf {
    let bin = find_bin_dir().expect("server binaries");
    if bin.join("pgbench").is_file() {
        bin.join("pgbench")
    } else {
        "pgbench".into()
    }
}

/// Runs `pgbench` against the cluster with `args`; its reported tps.
fn run_pgbench(cluster: &EmbeddedPostgres, args: &[&str]) -> f64 {
    let port = cluster.port().to_string();
    let run = Command::new(pgbench())
        .args(["-h", "127.0.0.1", "-p", port.as_str(), "-U", "postgres"])
        .args(args)
        .output()
        .expect("run pgbench");
    assert!(
        run.status.success(),
        "pgbench {args:?}: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let out = String::from_utf8_lossy(&run.stdout);
    out.lines()
        .find_map(|l| {
            l.strip_prefix("tps = ")
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or_else(|| panic!("no tps in pgbench output: {out}"))
}

/// Enables or disables `which` of the issue table's triggers (`USER`: all).
async fn set_triggers(client: &tokio_postgres::Client, which: &str, on: bool) {
    let verb = if on { "ENABLE" } else { "DISABLE" };
    client
        .batch_execute(&format!("ALTER TABLE issue {verb} TRIGGER {which}"))
        .await
        .unwrap();
}

/// Claims per second when `pgbench` runs the service's claim as a session
/// keeps it where no pooler stands in front (the call of `newsnack_claim`,
/// named: [`newsnack::db::issue::CLAIM_STATEMENT`]) on
/// fresh windows of [`CEILING_BATCH`] ids.
async fn claim_ceiling(
    cluster: &EmbeddedPostgres,
    client: &tokio_postgres::Client,
    seconds: u64,
) -> f64 {
    // Comfortably more issues than the phase can claim (about 11,000/s
    // with the triggers on, 16,000/s without, on a 2-core machine).
    let issues = 40_000 * seconds.max(1) as i64;
    client
        .batch_execute(&format!(
            "INSERT INTO issue (title, body)
             SELECT 'ceiling ' || g, repeat('An issue of a realistic length. ', 15)
               FROM generate_series(1, {issues}) g"
        ))
        .await
        .unwrap();
    client.batch_execute("VACUUM ANALYZE issue").await.unwrap();
    let first: i64 = client
        .query_one(
            "SELECT min(id) FROM issue WHERE processing_status = 'PENDING'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    client
        .batch_execute(&format!(
            "DROP SEQUENCE IF EXISTS bench_window;
             CREATE SEQUENCE bench_window START WITH {first} INCREMENT BY {CEILING_BATCH};"
        ))
        .await
        .unwrap();
    // The claim as the claimer sends it, its parameters bound in SQL:
    // each transaction takes the next window of ids from a sequence.
    let window = format!(
        "(SELECT array_agg(g) FROM (SELECT nextval('bench_window') AS n) w, \
          generate_series(w.n, w.n + {last}) g)",
        last = CEILING_BATCH - 1
    );
    let statement = newsnack::db::issue::CLAIM_STATEMENT
        .replace("$1", &window)
        .replace("$2", "'bench'")
        .replace("$3", "60")
        .replace("$4", "NULL")
        .replace("$5", "NULL");
    let statement = format!("{statement};\n");
    let script = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(script.path(), statement).unwrap();
    let tps = run_pgbench(
        cluster,
        &[
            "-n",
            // Named, as the service sends it with no pooler in front.
            "-M",
            "prepared",
            "-f",
            script.path().to_str().unwrap(),
            "-c",
            &CEILING_CONNECTIONS.to_string(),
            "-j",
            &CEILING_CONNECTIONS.to_string(),
            "-T",
            &seconds.to_string(),
            "bench",
        ],
    );
    tps * CEILING_BATCH as f64
}

fn round(x: f64) -> f64 {
    x.round()
}
