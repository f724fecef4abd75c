//! Benchmark: newsnack beside graphile-worker (the Node.js PostgreSQL job
//! queue) on one throwaway cluster with default durability (`fsync` on), on
//! the same machine, with the same workload. Prints one JSON object.
//!
//! The workload: `BENCH_PEERS_ITEMS` (default 2,000) items enqueued in bulk
//! with one SQL statement (timed apart), then processed to completion with
//! `BENCH_PEERS_CONCURRENCY` (default 16) -way concurrency; items/s from the
//! start of processing to the last completion.
//!
//! - **newsnack**: the issues are inserted with one `INSERT ... SELECT`;
//!   then `newsnack serve` runs as a separate process (the binary `cargo
//!   bench` builds, found through `CARGO_BIN_EXE_newsnack`; the offline
//!   writer; `generation_concurrency` set to the concurrency), and as many
//!   HTTP clients post disjoint batches of `BENCH_PEERS_BATCH` (default 10)
//!   ids to `POST /ai-articles`. Timed from the first request to the last
//!   transition into `DONE`, counted on the gapless transition stream of a
//!   listener this process runs; then every issue is checked to be `DONE`
//!   with exactly one article.
//! - **graphile-worker**: `benches/peers/graphile.mjs` adds the jobs with
//!   `graphile_worker.add_jobs` in one statement and runs a worker (`run()`,
//!   `concurrency` the same, a no-op task, a pool of concurrency + 2 as its
//!   documentation recommends), timed from the first `job:start` event to
//!   the queue reading empty after the last `job:complete` event. Once with
//!   its defaults, and once with its documented batching options (a local
//!   queue of concurrency + 1 jobs, completions batched with a 0 ms delay).
//!
//! The two do not do the same work per item: a newsnack issue is claimed
//! under `FOR UPDATE SKIP LOCKED`, gets an article row written, and each of
//! its two status changes is logged with a signed row in `issue_transition`
//! and announced with `NOTIFY`; a graphile-worker job is locked, runs a
//! function that does nothing, and is deleted. The service also answers
//! HTTP, and its clients run in this process, on the same cores.
//!
//! The three alternate in `BENCH_PEERS_ROUNDS` (default 3) rounds, each on a
//! database of its own, the order turning each round, so drift in the
//! machine's speed weighs on all alike; the report has each round, the
//! medians and newsnack's median over each graphile-worker median.
//!
//! `cargo bench --bench peers`. Needs Node.js and npm (graphile-worker
//! 0.17.3, the newest that runs on Node 20, is installed with npm under
//! `target/peers/` on the first run).

mod common;

use common::{connect, knob, round1, round3, start_cluster};

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use newsnack::db::{self, PoolOptions};
use newsnack::embedded::EmbeddedOptions;
use newsnack::events::listener::{Listener, ListenerOptions};
use newsnack::model::status::Status;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::Barrier;
use tokio_util::sync::CancellationToken;

/// The newest graphile-worker whose `engines` admit Node 20 (0.18 asks for
/// Node 22.18 or newer).
const GRAPHILE_WORKER: &str = "0.17.3";

#[derive(Clone, Copy, Debug)]
enum Peer {
    Newsnack,
    GraphileWorker,
    GraphileWorkerBatched,
}

impl Peer {
    const ALL: [Peer; 3] = [
        Peer::Newsnack,
        Peer::GraphileWorker,
        Peer::GraphileWorkerBatched,
    ];

    fn key(self) -> &'static str {
        match self {
            Peer::Newsnack => "newsnack",
            Peer::GraphileWorker => "graphile_worker",
            Peer::GraphileWorkerBatched => "graphile_worker_batched",
        }
    }
}

#[tokio::main]
async fn main() {
    let items = knob("BENCH_PEERS_ITEMS", 2_000) as usize;
    let concurrency = knob("BENCH_PEERS_CONCURRENCY", 16) as usize;
    let batch = knob("BENCH_PEERS_BATCH", 10) as usize;
    let rounds = knob("BENCH_PEERS_ROUNDS", 3) as usize;
    let node = node_version().unwrap_or_else(|| {
        eprintln!("peers bench: node and npm not found; install Node.js 14 or newer with npm (e.g. apt-get install nodejs npm)");
        std::process::exit(1);
    });
    let graphile_dir = install_graphile_worker().await;
    let load_before = load_average();
    let started = Instant::now();

    let cluster = start_cluster(EmbeddedOptions {
        durable: true,
        ..EmbeddedOptions::default()
    })
    .await;
    let admin = connect(&cluster.url("postgres")).await;

    let mut runs: Vec<serde_json::Value> = Vec::new();
    for round in 0..rounds {
        let mut this_round = serde_json::Map::new();
        for k in 0..Peer::ALL.len() {
            let peer = Peer::ALL[(round + k) % Peer::ALL.len()];
            let database = format!("{}_{round}", peer.key());
            admin
                .batch_execute(&format!("CREATE DATABASE {database}"))
                .await
                .unwrap();
            let url = cluster.url(&database);
            let result = match peer {
                Peer::Newsnack => newsnack_round(&url, items, concurrency, batch).await,
                Peer::GraphileWorker => {
                    graphile_round(&graphile_dir, &url, items, concurrency, false).await
                }
                Peer::GraphileWorkerBatched => {
                    graphile_round(&graphile_dir, &url, items, concurrency, true).await
                }
            };
            this_round.insert(peer.key().into(), result);
        }
        runs.push(this_round.into());
    }

    let median_of = |peer: Peer, field: &str| {
        median(
            runs.iter()
                .map(|r| r[peer.key()][field].as_f64().unwrap())
                .collect(),
        )
    };
    let medians: serde_json::Map<String, serde_json::Value> = Peer::ALL
        .iter()
        .map(|&peer| {
            (
                peer.key().to_string(),
                json!({
                    "items_per_s": round1(median_of(peer, "items_per_s")),
                    "seconds": round3(median_of(peer, "seconds")),
                    "enqueue_seconds": round3(median_of(peer, "enqueue_seconds")),
                }),
            )
        })
        .collect();
    let ratio = |peer: Peer| {
        round3(median_of(Peer::Newsnack, "items_per_s") / median_of(peer, "items_per_s"))
    };
    let report = json!({
        "benchmark": "newsnack beside graphile-worker: bulk enqueue, then processing with the same concurrency",
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "durable": true,
        "items": items,
        "concurrency": concurrency,
        "newsnack_batch": batch,
        "rounds": rounds,
        "node": node,
        "graphile_worker": GRAPHILE_WORKER,
        "runs": runs,
        "medians": medians,
        "newsnack_over_graphile_worker": {
            "items_per_s": ratio(Peer::GraphileWorker),
            "items_per_s_vs_batched": ratio(Peer::GraphileWorkerBatched),
        },
        "total_seconds": round1(started.elapsed().as_secs_f64()),
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    drop(admin);
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

/// `node --version` when both node and npm run.
fn node_version() -> Option<String> {
    let run = |program: &str| {
        std::process::Command::new(program)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    run("npm")?;
    run("node")
}

/// The directory whose `node_modules` holds graphile-worker, installed with
/// npm under the target directory when it is not there yet.
async fn install_graphile_worker() -> PathBuf {
    // This bench runs as <target>/<profile>/deps/peers-<hash>.
    let exe = std::env::current_exe().unwrap();
    let target = exe
        .ancestors()
        .nth(3)
        .expect("the bench runs from <target>/<profile>/deps");
    let dir = target
        .join("peers")
        .join(format!("graphile-worker-{GRAPHILE_WORKER}"));
    if dir
        .join("node_modules/graphile-worker/package.json")
        .exists()
    {
        return dir;
    }
    std::fs::create_dir_all(&dir).unwrap();
    eprintln!(
        "peers bench: installing graphile-worker {GRAPHILE_WORKER} into {}",
        dir.display()
    );
    let status = Command::new("npm")
        .args([
            "install",
            "--no-audit",
            "--no-fund",
            "--loglevel=error",
            "--prefix",
        ])
        .arg(&dir)
        .arg(format!("graphile-worker@{GRAPHILE_WORKER}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .await
        .expect("run npm");
    assert!(
        status.success(),
        "npm install graphile-worker@{GRAPHILE_WORKER} failed"
    );
    dir
}

/// One graphile-worker round: the Node script does the work and reports.
async fn graphile_round(
    graphile_dir: &Path,
    url: &str,
    items: usize,
    concurrency: usize,
    batched: bool,
) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/peers/graphile.mjs");
    let out = Command::new("node")
        .arg(&script)
        .env("GRAPHILE_WORKER_DIR", graphile_dir)
        .env("DATABASE_URL", url)
        .env("PEERS_ITEMS", items.to_string())
        .env("PEERS_CONCURRENCY", concurrency.to_string())
        .env("PEERS_BATCHED", if batched { "1" } else { "0" })
        .env("NO_LOG_SUCCESS", "1")
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .await
        .expect("run node");
    assert!(
        out.status.success(),
        "{} failed: {}",
        script.display(),
        out.status
    );
    let line = String::from_utf8_lossy(&out.stdout);
    let report: serde_json::Value = serde_json::from_str(line.trim())
        .unwrap_or_else(|e| panic!("graphile.mjs printed {line:?}: {e}"));
    assert_eq!(report["jobs_completed"], json!(items), "{report}");
    assert_eq!(report["jobs_failed"], json!(0), "{report}");
    assert_eq!(report["jobs_left"], json!(0), "{report}");
    report
}

/// One newsnack round: issues inserted, the service started, the clients
/// run until every issue is `DONE`, the result checked.
async fn newsnack_round(
    url: &str,
    items: usize,
    concurrency: usize,
    batch: usize,
) -> serde_json::Value {
    let endpoint = db::Endpoint::parse(url, "newsnack-bench").unwrap();
    let mut migrator = endpoint.connect().await.unwrap();
    db::migrate::migrate(&mut migrator).await.unwrap();
    drop(migrator);
    let sql = connect(url).await;
    sql.execute(
        "UPDATE setting SET value = $1 WHERE key = 'generation_concurrency'",
        &[&concurrency.to_string()],
    )
    .await
    .unwrap();

    let enqueue_started = Instant::now();
    let ids: Vec<i64> = sql
        .query(
            "INSERT INTO issue (title, body, score)
             SELECT 'Bench issue ' || g,
                    'Something happened for the ' || g || 'th time. Officials said more would follow.',
                    g
               FROM generate_series(1, $1::bigint) g
             RETURNING id",
            &[&(items as i64)],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let enqueue_seconds = enqueue_started.elapsed().as_secs_f64();

    let service = Service::start(url).await;
    // This process's own listener counts the transitions into DONE.
    let pool = db::pool(&endpoint, &PoolOptions::default()).unwrap();
    let stop_listener = CancellationToken::new();
    let (hub, _) = Listener::start(
        endpoint.clone(),
        pool.clone(),
        ListenerOptions::default(),
        stop_listener.clone(),
    )
    .await
    .unwrap();
    let after_seq: i64 = sql
        .query_one("SELECT COALESCE(max(seq), 0) FROM issue_transition", &[])
        .await
        .unwrap()
        .get(0);
    let mut stream = hub.stream_after(after_seq, None);
    let all_done = tokio::spawn(async move {
        let mut seen = 0;
        let count = async {
            while seen < items {
                if stream.next().await.expect("transition stream").to == Status::Done {
                    seen += 1;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(120), count)
            .await
            .unwrap_or_else(|_| panic!("only {seen} of {items} issues became DONE in 120 s"));
        Instant::now()
    });

    // Batch k goes to client k % concurrency.
    let mut plans: Vec<Vec<Vec<i64>>> = vec![Vec::new(); concurrency];
    for (k, chunk) in ids.chunks(batch).enumerate() {
        plans[k % concurrency].push(chunk.to_vec());
    }
    let endpoint_url = format!("http://{}/ai-articles", service.addr);
    let start = Arc::new(Barrier::new(concurrency + 1));
    let clients: Vec<_> = plans
        .into_iter()
        .map(|plan| {
            let (start, endpoint_url) = (start.clone(), endpoint_url.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                // A connection opened before the clock starts.
                let health = endpoint_url.replace("/ai-articles", "/healthz");
                assert!(http
                    .get(&health)
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .is_success());
                start.wait().await;
                let mut claimed = 0;
                for ids in plan {
                    let answer = http
                        .post(&endpoint_url)
                        .json(&json!({ "issue_ids": ids }))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(answer.status().as_u16(), 202, "POST /ai-articles");
                    let body: serde_json::Value = answer.json().await.unwrap();
                    claimed += body["claimed"].as_array().map_or(0, Vec::len);
                }
                claimed
            })
        })
        .collect();
    start.wait().await;
    let began = Instant::now();
    let mut claimed = 0;
    for client in clients {
        claimed += client.await.unwrap();
    }
    let requests_done = Instant::now();
    let done = all_done.await.unwrap();
    let seconds = (done - began).as_secs_f64();

    let count = |query: &'static str| {
        let sql = &sql;
        async move { sql.query_one(query, &[]).await.unwrap().get::<_, i64>(0) }
    };
    let checks = json!({
        "issues_done": count("SELECT count(*) FROM issue WHERE processing_status = 'DONE'").await,
        "articles": count("SELECT count(*) FROM ai_article").await,
        "issues_without_exactly_one_article": count(
            "SELECT count(*) FROM issue i
              WHERE (SELECT count(*) FROM ai_article a WHERE a.issue_id = i.id) <> 1"
        ).await,
        "issues_attempted_more_than_once": count("SELECT count(*) FROM issue WHERE attempts > 1").await,
        "transitions_logged": sql
            .query_one("SELECT count(*) FROM issue_transition WHERE seq > $1", &[&after_seq])
            .await
            .unwrap()
            .get::<_, i64>(0),
    });
    assert_eq!(claimed, items, "every issue claimed once");
    assert_eq!(checks["issues_done"], json!(items), "{checks}");
    assert_eq!(checks["articles"], json!(items), "{checks}");
    assert_eq!(
        checks["issues_without_exactly_one_article"],
        json!(0),
        "{checks}"
    );
    stop_listener.cancel();
    drop(hub);
    let exited_cleanly = service.stop().await;
    json!({
        "items": items,
        "clients": concurrency,
        "batch": batch,
        "enqueue_seconds": round3(enqueue_seconds),
        "seconds": round3(seconds),
        "items_per_s": round1(items as f64 / seconds),
        "requests_seconds": round3((requests_done - began).as_secs_f64()),
        "issues_claimed": claimed,
        "checks": checks,
        "service_exited_cleanly": exited_cleanly,
    })
}

/// `newsnack serve` as a child process, ready.
struct Service {
    child: tokio::process::Child,
    addr: std::net::SocketAddr,
}

impl Service {
    async fn start(url: &str) -> Service {
        let mut child = Command::new(env!("CARGO_BIN_EXE_newsnack"))
            .arg("serve")
            .env("DATABASE_URL", url)
            .env("NEWSNACK_LISTEN", "127.0.0.1:0")
            .env("NEWSNACK_INSTANCE", "bench-peers")
            .env("RUST_LOG", "warn")
            .env_remove("NEWSNACK_LLM_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("run newsnack serve");
        // The binary prints its address once it is listening.
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let addr = loop {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .expect("serve printed its address");
            if let Some(rest) = line.strip_prefix("newsnack serving on http://") {
                break rest.trim().parse().unwrap();
            }
        };
        // Nothing more is printed on stdout; keep reading so it never blocks.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let http = reqwest::Client::new();
        for _ in 0..200 {
            let ready = http
                .get(format!("http://{addr}/readyz"))
                .send()
                .await
                .is_ok_and(|a| a.status().is_success());
            if ready {
                return Service { child, addr };
            }
            // Readiness is a probe, not an event: ask again shortly.
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("newsnack serve was not ready within 5 s");
    }

    /// SIGTERM, then waits; whether it exited with success.
    async fn stop(mut self) -> bool {
        if let Some(pid) = self.child.id() {
            // SAFETY: sends SIGTERM to the child started above.
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
        }
        self.child.wait().await.is_ok_and(|s| s.success())
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The 1, 5 and 15 minute load averages: other work on the machine shows.
fn load_average() -> Option<String> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}
