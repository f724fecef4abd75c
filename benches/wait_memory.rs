//! Benchmark: what open `POST /waits` cost the service's memory, and how
//! soon they are all answered. Prints one JSON object on stdout.
//!
//! A throwaway cluster; a database migrated by the binary under test, with
//! `BENCH_WAITS` (default 10,000) issues made `IN_PROGRESS` by plain SQL;
//! `newsnack serve` started as a process of its own. Its resident memory
//! (`VmRSS` and `smaps_rollup`'s anonymous part) is read idle, after a
//! warm-up of a few waits, and again once every wait is open: one
//! connection per wait, each asking for one issue, armed when the service's
//! `newsnack_waits_open` gauge says so. Then one `UPDATE` commits every
//! issue `DONE`, and each wait's latency runs from that commit's
//! acknowledgement to its full answer. The clients are raw HTTP/1.1 over
//! TCP on one thread of this process, so none of their memory is counted.
//!
//! `cargo bench --bench wait_memory` (`BENCH_BIN` replaces this build's
//! binary; `BENCH_SERVE_ENV=NAME=value,..` adds to serve's environment;
//! `BENCH_TOKEN=<token>` starts serve with it as `NEWSNACK_API_TOKEN` and
//! sends it with every request, so the token check is on every wait).

mod common;

use common::{
    connect, create_database, in_progress, knob, migrate_with, round1, round3, start_cluster, stop,
};

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use newsnack::embedded::EmbeddedOptions;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Waits connecting at once.
const CONNECTING: usize = 200;

#[tokio::main]
async fn main() {
    let waits = knob("BENCH_WAITS", 10_000) as usize;
    let bin: PathBuf = std::env::var_os("BENCH_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_newsnack")));
    raise_open_files();
    let cluster = start_cluster(EmbeddedOptions {
        durable: true,
        settings: vec![("max_connections".into(), "100".into())],
        ..EmbeddedOptions::default()
    })
    .await;
    let url = create_database(&cluster, "bench").await;
    migrate_with(&bin, &url);
    let db = connect(&url).await;
    let ids = in_progress(&db, waits + 10).await;
    let (warmup, targets) = ids.split_at(10);

    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut serve = Command::new(&bin);
    serve
        .arg("serve")
        .env("DATABASE_URL", &url)
        .env("NEWSNACK_LISTEN", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .env_remove("NEWSNACK_LLM_URL")
        .stdout(Stdio::null());
    if let Some(token) = token() {
        serve.env("NEWSNACK_API_TOKEN", token);
    }
    if let Ok(extra) = std::env::var("BENCH_SERVE_ENV") {
        for pair in extra.split(',').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').expect("NAME=value");
            serve.env(name, value);
        }
    }
    let mut serve = serve.spawn().expect("start newsnack serve");
    let pid = serve.id();
    let addr = format!("127.0.0.1:{port}");
    wait_ready(&addr, &mut serve).await;
    let idle = memory(pid);

    // A few waits first, so what every wait costs is not mixed with what
    // the first one sets up once.
    let warm: Vec<_> = warmup.iter().map(|&id| open_wait(&addr, id)).collect();
    let warm = futures::future::join_all(warm).await;
    wait_for_gauge(&addr, warmup.len()).await;
    db.execute(
        "UPDATE issue SET processing_status = 'DONE' WHERE id = ANY($1)",
        &[&warmup],
    )
    .await
    .unwrap();
    for w in warm {
        assert_eq!(w.answer().await.0, 200);
    }
    let warmed = memory(pid);

    // The clients run on a thread of their own.
    let (opened_tx, opened_rx) = tokio::sync::oneshot::channel();
    let clients = {
        let (addr, targets) = (addr.clone(), targets.to_vec());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                // Each wait is read from as soon as it is open, so none is
                // late for being unread when the commit comes.
                let mut answers = Vec::with_capacity(targets.len());
                for chunk in targets.chunks(CONNECTING) {
                    let batch: Vec<_> = chunk.iter().map(|&id| open_wait(&addr, id)).collect();
                    for w in futures::future::join_all(batch).await {
                        answers.push(tokio::spawn(w.answer()));
                    }
                }
                opened_tx.send(()).unwrap();
                let mut out = Vec::with_capacity(answers.len());
                for a in answers {
                    out.push(a.await.unwrap());
                }
                out
            })
        })
    };
    opened_rx.await.unwrap();
    let armed_in = wait_for_gauge(&addr, targets.len()).await;
    let open = memory(pid);
    let committed = {
        db.execute(
            "UPDATE issue SET processing_status = 'DONE' WHERE id = ANY($1)",
            &[&targets],
        )
        .await
        .unwrap();
        Instant::now()
    };
    let answers = tokio::task::spawn_blocking(move || clients.join().unwrap())
        .await
        .unwrap();
    let after = memory(pid);
    let mut latencies: Vec<f64> = answers
        .iter()
        .map(|(_, at)| at.saturating_duration_since(committed).as_secs_f64() * 1000.0)
        .collect();
    let not_ok = answers.iter().filter(|(code, _)| *code != 200).count();
    latencies.sort_by(f64::total_cmp);
    stop(&mut serve);

    let added = open.rss_kb as f64 - warmed.rss_kb as f64;
    let per_wait = added * 1024.0 / targets.len() as f64;
    let report = json!({
        "benchmark": "open POST /waits: the service's memory and the answers' latency",
        "waits": targets.len(),
        "token": token().is_some(),
        "rss_kb": {
            "idle": idle.rss_kb,
            "after_warmup": warmed.rss_kb,
            "waits_open": open.rss_kb,
            "after_answers": after.rss_kb,
            "peak": after.hwm_kb,
        },
        "anonymous_kb": {
            "after_warmup": warmed.anonymous_kb,
            "waits_open": open.anonymous_kb,
        },
        "added_mb": round1(added / 1024.0),
        "bytes_per_wait": per_wait.round(),
        "seconds_to_arm_all": round3(armed_in.as_secs_f64()),
        "answers_not_200": not_ok,
        "latency_ms_from_commit": {
            "p50": round3(percentile(&latencies, 50.0)),
            "p99": round3(percentile(&latencies, 99.0)),
            "max": round3(percentile(&latencies, 100.0)),
        },
        "targets": {
            "added_at_most_100_mb": added / 1024.0 <= 100.0,
            "all_answered_within_4_s": not_ok == 0 && percentile(&latencies, 100.0) <= 4000.0,
        },
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    drop(db);
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

/// `BENCH_TOKEN`, when set (see the module docs).
fn token() -> Option<&'static str> {
    static TOKEN: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    TOKEN
        .get_or_init(|| std::env::var("BENCH_TOKEN").ok())
        .as_deref()
}

/// The `Authorization` header line every request carries (none without
/// `BENCH_TOKEN`).
fn authorization() -> String {
    token()
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default()
}

/// One open `POST /waits` for `id`, its request sent.
struct OpenWait {
    stream: TcpStream,
}

async fn open_wait(addr: &str, id: i64) -> OpenWait {
    let body = format!(r#"{{"issue_ids":[{id}],"timeout_s":600}}"#);
    let mut stream = TcpStream::connect(addr).await.expect("connect to serve");
    let request = format!(
        "POST /waits HTTP/1.1\r\nHost: bench\r\n{}Content-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        authorization(),
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    OpenWait { stream }
}

impl OpenWait {
    /// The answer's status code and when its last byte came.
    async fn answer(mut self) -> (u16, Instant) {
        let mut buf = Vec::with_capacity(512);
        let mut chunk = [0u8; 512];
        loop {
            let n = self.stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the connection closed before the answer");
            buf.extend_from_slice(&chunk[..n]);
            if let Some(code) = complete(&buf) {
                return (code, Instant::now());
            }
        }
    }
}

/// The status code once `buf` holds a whole response with its body.
fn complete(buf: &[u8]) -> Option<u16> {
    let text = std::str::from_utf8(buf).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    (body.len() >= length).then(|| head[9..12].parse().unwrap())
}

/// One `GET` on its own connection: the status code and body.
async fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: bench\r\n{}Connection: close\r\n\r\n",
        authorization()
    );
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf).await.ok()?;
    let text = String::from_utf8(buf).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    Some((head.get(9..12)?.parse().ok()?, body.to_string()))
}

/// Polls `/readyz` until it answers 200 (or the process exits).
async fn wait_ready(addr: &str, serve: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = serve.try_wait().unwrap() {
            panic!("newsnack serve exited before it was ready: {status}");
        }
        if let Some((200, _)) = get(addr, "/readyz").await {
            return;
        }
        assert!(Instant::now() < deadline, "serve not ready in 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `/metrics` until `newsnack_waits_open` reaches `n`; how long that took.
async fn wait_for_gauge(addr: &str, n: usize) -> Duration {
    let started = Instant::now();
    loop {
        if let Some((200, body)) = get(addr, "/metrics").await {
            let open = body
                .lines()
                .find_map(|l| l.strip_prefix("newsnack_waits_open "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or(0.0);
            if open as usize >= n {
                return started.elapsed();
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "fewer than {n} waits armed in 300 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A process's resident memory, in kB.
struct Memory {
    rss_kb: u64,
    hwm_kb: u64,
    anonymous_kb: u64,
}

fn memory(pid: u32) -> Memory {
    let field = |file: &str, name: &str| -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/{file}"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    Memory {
        rss_kb: field("status", "VmRSS:"),
        hwm_kb: field("status", "VmHWM:"),
        anonymous_kb: field("smaps_rollup", "Anonymous:"),
    }
}

/// This process needs a descriptor per wait.
fn raise_open_files() {
    // SAFETY: getrlimit/setrlimit on a struct we own.
    unsafe {
        let mut limit: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((p / 100.0) * (sorted.len() - 1) as f64).round() as usize]
}
