//! Benchmark: `GET /events` fan-out. Prints one JSON object on stdout.
//!
//! A throwaway cluster with default durability; the whole service runs in
//! this process (offline writer). `BENCH_SSE_CLIENTS` (default 200) SSE
//! clients connect, live, from a *separate client process* (this binary
//! re-run with `NEWSNACK_SSE_BENCH_URL` set; each client a bare HTTP/1.1
//! connection with a minimal chunked/SSE parser, to leave the CPU to the
//! service), so this process's `VmRSS` is the service's own: read before the clients connect, once all are open,
//! and after the traffic. Then transitions are committed from a separate
//! connection at `BENCH_SSE_RATE` per second (default 1,000) for
//! `BENCH_SSE_SECONDS` (default 10): raw `UPDATE issue SET
//! processing_status = ..` (`PENDING → IN_PROGRESS`, then `IN_PROGRESS →
//! DONE`), paced on a 1 ms tick, each tick's due transitions in one
//! transaction (one, unless the writer fell behind).
//!
//! Latency, for every (client, event) pair: when the event reached the
//! client minus the transition's `at`, which the database stamps with
//! `clock_timestamp()` in the commit-time trigger (same machine, same
//! clock). It therefore includes the commit itself (WAL flush) on top of
//! NOTIFY → listener → hub → SSE → client; the writer's commit round trips
//! are reported next to it. "Reached the client" is the kernel's stamp of
//! the packet's arrival at the client's socket (`SO_TIMESTAMPNS`):
//! `latency_ms`. The client process serves its 200 sockets one after the
//! other on one thread, so when it gets to read a socket is later, by its
//! own queue: that is `latency_to_read_ms`, reported next to it.
//!
//! `at` is stamped before the commit's WAL flush, so `latency_ms` also
//! counts the flush, which under this load is most of the writer's commit
//! round trip. `latency_from_commit_ack_ms` times the same pairs from when
//! the commit was acknowledged instead: the kernel's arrival stamp of the
//! database's answer to the writer's statement (PostgreSQL signals the
//! listening sessions and answers the committing one at the same point,
//! after the flush). That is the delay a subscriber adds to a committed
//! transition, the figure the target is read on; both are reported.
//! The client process checks that every client received every transition
//! from its start on, exactly once and in order. Per event it only notes
//! the `id:` and when it arrived; the latencies are worked out at the end,
//! from each transition's `at` and commit acknowledgement as the writer's
//! side gives them, so the clients spend as little CPU as possible while
//! the service is measured.
//!
//! Last, `huge_commit`: one commit of `BENCH_SSE_HUGE` (default 60,000)
//! transitions, as a bulk change by another system makes, read by one
//! client that starts reading only once the listener has published all of
//! it: how long the read took and whether the stream dropped the client.
//! A client far behind is dropped only once what it is about to be sent
//! was published more than `MAX_DELAY` (10 s) ago, so the read time is
//! the margin a machine leaves (`tests/events.rs` checks the client is not
//! dropped; the time is measured here).
//!
//! `cargo bench --bench sse`; about 15 s. Clients, service and PostgreSQL
//! share the machine's cores; the report carries the load average at the
//! start, since anything else running skews the latencies.

mod common;

use common::{create_database, knob, round1, round3, serve_options, start_cluster};

use std::collections::HashMap;
use std::io::Write as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use newsnack::embedded::EmbeddedOptions;
use newsnack::writer::{OfflineWriter, SharedWriter};
use serde_json::json;
use std::os::fd::AsRawFd;
use time::OffsetDateTime;

use tokio::io::{
    AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, Interest,
    ReadBuf,
};
use tokio::net::TcpStream;
use tokio::process::Command;
use tokio::sync::watch;

/// Set in the client process: the events URL to open.
const CHILD_URL: &str = "NEWSNACK_SSE_BENCH_URL";
const CHILD_CLIENTS: &str = "NEWSNACK_SSE_BENCH_CLIENTS";
/// The most transitions one paced transaction carries.
const MAX_BATCH: u64 = 50;

fn main() {
    match std::env::var(CHILD_URL) {
        Ok(url) => {
            let threads = knob("BENCH_SSE_CLIENT_THREADS", 1) as usize;
            let runtime = if threads <= 1 {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
            } else {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(threads)
                    .enable_all()
                    .build()
            };
            runtime
                .unwrap()
                .block_on(clients(url, knob(CHILD_CLIENTS, 200) as usize))
        }
        Err(_) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(bench()),
    }
}

async fn bench() {
    let clients = knob("BENCH_SSE_CLIENTS", 200) as usize;
    let rate = knob("BENCH_SSE_RATE", 1000).max(1);
    let seconds = knob("BENCH_SSE_SECONDS", 10).max(1);
    let started = Instant::now();
    let loadavg = std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();

    let cluster = start_cluster(EmbeddedOptions {
        durable: true,
        settings: vec![("max_connections".into(), "100".into())],
        ..EmbeddedOptions::default()
    })
    .await;
    let url = create_database(&cluster, "sse").await;
    let service = newsnack::serve::start(
        serve_options(&url, "sse-bench", 16),
        Arc::new(OfflineWriter) as SharedWriter,
    )
    .await
    .expect("start the service");

    // The issues the writer will move: each gives two transitions.
    let total = rate * seconds;
    let issue_count = total.div_ceil(2) as i32;
    let (writer, acknowledged) = connect_stamped(&url).await;
    let mut ids: Vec<i64> = Vec::new();
    while (ids.len() as i32) < issue_count {
        let n = (issue_count - ids.len() as i32).min(1000);
        ids.extend(
            writer
                .query(
                    "INSERT INTO issue (title, body, score)
                     SELECT 'sse ' || g, 'body', g FROM generate_series(1, $1::int) g
                     RETURNING id",
                    &[&n],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, i64>(0)),
        );
    }
    let loaded: i64 = writer
        .query_one("SELECT max(seq) FROM issue_transition", &[])
        .await
        .unwrap()
        .get(0);
    until_published(&service.hub, loaded).await;
    let baseline = service.hub.subscriber_count();
    let rss_before = rss_kib(None);

    // The clients, in a process of their own.
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(CHILD_URL, format!("http://{}/events", service.addr))
        .env(CHILD_CLIENTS, clients.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start the client process");
    let child_pid = child.id();
    let mut child_out = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut child_in = child.stdin.take().unwrap();
    let ready = tokio::time::timeout(Duration::from_secs(60), child_out.next_line())
        .await
        .expect("the clients to connect in time")
        .unwrap();
    assert_eq!(ready.as_deref(), Some("ready"), "the client process failed");
    let open = service.hub.subscriber_count() - baseline;
    assert!(
        open >= clients,
        "{open} hub receivers for {clients} clients"
    );
    let rss_open = rss_kib(None);

    // The hub's own view: when each transition reaches the listener's
    // subscribers, before any SSE work (a breakdown of the latency).
    let mut at_hub = service.hub.subscribe();
    let (hub_stop_tx, mut hub_stop) = watch::channel(i64::MAX);
    // On a thread of its own, like the listener, so it times the path to
    // the listener, not the service's busy runtime.
    let hub_probe = spawn_on_own_thread(async move {
        let mut latencies_us: Vec<u64> = Vec::new();
        // (seq, when it reached the probe in ns since the epoch).
        let mut arrivals_ns: Vec<(i64, i64)> = Vec::new();
        let mut last = 0;
        while last < *hub_stop.borrow() {
            tokio::select! {
                received = at_hub.recv() => match received {
                    Ok(t) => {
                        let now = OffsetDateTime::now_utc();
                        latencies_us.push((now - t.at).whole_microseconds().max(0) as u64);
                        arrivals_ns.push((t.seq, now.unix_timestamp_nanos() as i64));
                        last = t.seq;
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(_) => break,
                },
                _ = hub_stop.changed() => {}
            }
        }
        (latencies_us, arrivals_ns)
    });

    // Paced writes: transition k moves issue k mod N to its next status
    // (`PENDING → IN_PROGRESS` on the first pass, `→ DONE` on the second).
    let step = writer
        .prepare(
            "UPDATE issue SET processing_status =
                    CASE processing_status WHEN 'PENDING' THEN 'IN_PROGRESS' ELSE 'DONE' END
              WHERE id = ANY($1)",
        )
        .await
        .unwrap();
    let planned = 2 * ids.len() as u64;
    let mut commit_us: Vec<u64> = Vec::new();
    // (issue, second pass) → when its transaction's commit was acknowledged.
    let mut acked_at_ns: HashMap<(i64, bool), i64> = HashMap::new();
    let mut sent = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let writing = Instant::now();
    let cpu_before = (cpu_seconds(None), cpu_seconds(child_pid));
    let deadline = Duration::from_secs(seconds) + Duration::from_secs(2);
    while sent < planned && writing.elapsed() < deadline {
        tick.tick().await;
        let due = ((writing.elapsed().as_secs_f64() * rate as f64) as u64).min(planned);
        if due <= sent {
            continue;
        }
        // Usually one; more only when the writer fell behind (a batch never
        // holds one issue twice: N is far larger than MAX_BATCH).
        let batch: Vec<i64> = (sent..due.min(sent + MAX_BATCH))
            .map(|k| ids[(k % ids.len() as u64) as usize])
            .collect();
        let t0 = Instant::now();
        let moved = writer.execute(&step, &[&batch]).await.unwrap();
        commit_us.push(t0.elapsed().as_micros() as u64);
        assert_eq!(moved as usize, batch.len());
        let ack = acknowledged.load(Ordering::Acquire);
        for (k, id) in (sent..).zip(&batch) {
            acked_at_ns.insert((*id, k >= ids.len() as u64), ack);
        }
        sent += batch.len() as u64;
    }
    let write_seconds = writing.elapsed().as_secs_f64();
    let service_cpu = cpu_seconds(None) - cpu_before.0;
    let client_cpu = cpu_seconds(child_pid) - cpu_before.1;
    let last: i64 = writer
        .query_one("SELECT max(seq) FROM issue_transition", &[])
        .await
        .unwrap()
        .get(0);
    let committed = (last - loaded) as u64;
    let rss_after = rss_kib(None);
    hub_stop_tx.send_replace(last);
    let (mut hub_us, hub_arrivals) = tokio::time::timeout(Duration::from_secs(30), hub_probe)
        .await
        .expect("the hub probe to see the last transition")
        .expect("the hub probe's thread");
    hub_us.sort_unstable();
    let rss_hwm = hwm_kib();

    // Each transition's `at` and commit acknowledgement (-1 if unknown),
    // by seq, all in ns since the epoch.
    let mut stamps = String::new();
    let mut acked_by_seq: HashMap<i64, i64> = HashMap::new();
    for row in writer
        .query(
            "SELECT seq, issue_id, to_status = 'DONE',
                    floor(extract(epoch FROM at) * 1000000)::bigint * 1000
               FROM issue_transition WHERE seq > $1",
            &[&loaded],
        )
        .await
        .unwrap()
    {
        let seq: i64 = row.get(0);
        let at_ns: i64 = row.get(3);
        let key = (row.get::<_, i64>(1), row.get::<_, bool>(2));
        let ack = acked_at_ns.get(&key).copied();
        if let Some(ack) = ack {
            acked_by_seq.insert(seq, ack);
        }
        stamps.push_str(&format!("{seq} {at_ns} {}\n", ack.unwrap_or(-1)));
    }
    let hub_from_ack_ns: Vec<i64> = hub_arrivals
        .iter()
        .filter_map(|(seq, arrived)| Some(arrived - acked_by_seq.get(seq)?))
        .collect();
    // A transition that reached the probe before its commit's answer reached
    // the writer: the answer was late (its session waited for a core after
    // committing), so timing from it understates the latency.
    let hub_before_ack = hub_from_ack_ns.iter().filter(|&&ns| ns < 0).count();
    let mut hub_from_ack_us: Vec<u64> = hub_from_ack_ns
        .iter()
        .map(|&ns| (ns.max(0) / 1000) as u64)
        .collect();
    hub_from_ack_us.sort_unstable();

    // Tell the clients where the end is and each transition's stamps;
    // collect their report.
    child_in
        .write_all(format!("{last}\n{stamps}end\n").as_bytes())
        .await
        .unwrap();
    child_in.flush().await.unwrap();
    let line = tokio::time::timeout(Duration::from_secs(120), child_out.next_line())
        .await
        .expect("the clients to finish")
        .unwrap()
        .expect("the client report");
    let client_report: serde_json::Value = serde_json::from_str(&line).unwrap();
    let _ = child.wait().await;

    let huge = huge_commit(
        &format!("http://{}/events", service.addr),
        &service.hub,
        &writer,
        knob("BENCH_SSE_HUGE", 60_000) as i32,
    )
    .await;

    commit_us.sort_unstable();
    let p99_ms = |figure: &str| client_report[figure]["p99"].as_f64().unwrap_or(f64::MAX);
    let rate_achieved = committed as f64 / write_seconds;
    let growth_open = rss_open - rss_before;
    let report = json!({
        "benchmark": "GET /events fan-out: commit-to-event latency and memory",
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "loadavg_at_start": loadavg,
        "durable": true,
        "clients": clients,
        "client_process_pid": child_pid,
        "target_transitions_per_s": rate,
        "write_seconds": round3(write_seconds),
        "transitions_committed": committed,
        "transactions": commit_us.len(),
        "transitions_per_s": round1(rate_achieved),
        "commit_round_trip_ms": {
            "p50": percentile_ms(&commit_us, 50.0),
            "p99": percentile_ms(&commit_us, 99.0),
            "max": commit_us.last().map(|&us| us as f64 / 1000.0),
        },
        "deliveries": client_report["pairs"],
        "deliveries_per_s": round1(client_report["pairs"].as_f64().unwrap_or(0.0) / write_seconds),
        "cpu_while_writing_s": {
            "what": "CPU time (user + system) over the write phase: this process (service, writer, probe) and the client process",
            "service_process": round3(service_cpu),
            "client_process": round3(client_cpu),
            "service_us_per_delivery": round3(service_cpu * 1e6 / client_report["pairs"].as_f64().unwrap_or(1.0).max(1.0)),
        },
        "every_client_got_every_transition_once_in_order": client_report["complete"],
        "latency_ms": client_report["latency_ms"],
        "latency_to_read_ms": client_report["latency_to_read_ms"],
        "latency_from_commit_ack_ms": client_report["latency_from_commit_ack_ms"],
        "pairs_arrived_before_the_acknowledgement": client_report["pairs_arrived_before_the_acknowledgement"],
        "latency_to_hub_ms": {
            "what": "commit-time `at` to a subscriber on a thread of its own (commit, NOTIFY, the listener's thread; no SSE work)",
            "p50": percentile_ms(&hub_us, 50.0),
            "p99": percentile_ms(&hub_us, 99.0),
            "max": hub_us.last().map(|&us| us as f64 / 1000.0),
        },
        "latency_to_hub_from_commit_ack_ms": {
            "what": "the same path timed from the commit's acknowledgement: NOTIFY and the listener's thread",
            "p50": percentile_ms(&hub_from_ack_us, 50.0),
            "p99": percentile_ms(&hub_from_ack_us, 99.0),
            "max": hub_from_ack_us.last().map(|&us| us as f64 / 1000.0),
            "arrived_before_the_acknowledgement": hub_before_ack,
        },
        "service_rss_kib": {
            "before_clients": rss_before,
            "with_clients_open": rss_open,
            "after_traffic": rss_after,
            "peak_vm_hwm": rss_hwm,
            "growth_with_clients_open": growth_open,
            "growth_after_traffic": rss_after - rss_before,
            "per_client_open": round1(growth_open as f64 / clients as f64),
        },
        "client_process_rss_kib": client_report["rss_kib"],
        "huge_commit": huge,
        "total_seconds": round1(started.elapsed().as_secs_f64()),
        "targets": {
            "rss_growth_for_200_clients_at_most_20_mb": growth_open <= 20 * 1024,
            "p99_from_commit_ack_at_most_10_ms_at_1000_transitions_per_s": p99_ms("latency_from_commit_ack_ms") <= 10.0 && rate_achieved >= 0.95 * 1000.0,
            "p99_from_in_transaction_stamp_at_most_10_ms": p99_ms("latency_ms") <= 10.0,
        },
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    service.stop().await.unwrap();
    drop(writer);
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

/// The client process: opens `n` streams, says `ready`, reads until the
/// `seq` given on stdin, prints one JSON line. Each client is a bare
/// HTTP/1.1 connection with a minimal chunked/SSE parser, so the clients
/// take as little as possible of the CPU the service is measured on.
async fn clients(url: String, n: usize) {
    let addr = url
        .strip_prefix("http://")
        .and_then(|rest| rest.split_once('/'))
        .map(|(host, _)| host.to_string())
        .expect("an http://host:port/path URL");
    let (final_tx, final_rx) = watch::channel(i64::MAX);
    let streams = futures::future::join_all((0..n).map(|_| open(&addr))).await;
    let mut tasks = Vec::new();
    for (socket, rest) in streams {
        let mut final_rx = final_rx.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = ClientStats::default();
            let mut body = ChunkedBody::new(rest);
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                if client.last.is_some_and(|s| s >= *final_rx.borrow()) {
                    return client;
                }
                tokio::select! {
                    ready = socket.readable() => {
                        ready.expect("wait for the stream");
                        let (read, arrived) = match socket
                            .try_io(Interest::READABLE, || recv_stamped(&socket, &mut buf))
                        {
                            Ok(read) => read,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                            Err(e) => panic!("read the stream: {e}"),
                        };
                        if read == 0 {
                            client.ended_early = true;
                            return client;
                        }
                        let read_at = OffsetDateTime::now_utc();
                        let arrived = arrived.unwrap_or(read_at);
                        body.feed(&buf[..read], |block| client.event(block, arrived, read_at));
                        if body.ended {
                            client.ended_early = true;
                            return client;
                        }
                    }
                    _ = final_rx.changed() => {}
                }
            }
        }));
    }
    println!("ready");
    std::io::stdout().flush().unwrap();

    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    let last: i64 = stdin
        .next_line()
        .await
        .unwrap()
        .expect("the final seq on stdin")
        .trim()
        .parse()
        .unwrap();
    final_tx.send_replace(last);
    // seq → (`at`, commit acknowledged or -1), in ns since the epoch.
    let mut stamps: HashMap<i64, (i64, i64)> = HashMap::new();
    while let Some(line) = stdin.next_line().await.unwrap() {
        let fields: Vec<i64> = line.split(' ').map_while(|f| f.parse().ok()).collect();
        let [seq, at, ack] = fields[..] else {
            break;
        };
        stamps.insert(seq, (at, ack));
    }

    let (mut latencies, mut read_latencies) = (Vec::new(), Vec::new());
    let mut from_ack: Vec<u64> = Vec::new();
    let mut before_ack = 0usize;
    let micros = |from: i64, to: i64| ((to - from).max(0) / 1000) as u64;
    let mut complete = true;
    for task in tasks {
        let client = tokio::time::timeout(Duration::from_secs(90), task)
            .await
            .expect("a client to finish")
            .unwrap();
        complete &= !client.ended_early
            && client.out_of_order == 0
            && client.last == Some(last)
            && client.other_events == 0;
        for (seq, arrived, read) in client.arrivals_ns {
            let Some(&(at, ack)) = stamps.get(&seq) else {
                complete = false;
                continue;
            };
            latencies.push(micros(at, arrived));
            read_latencies.push(micros(at, read));
            if ack >= 0 {
                before_ack += usize::from(arrived < ack);
                from_ack.push(micros(ack, arrived));
            }
        }
    }
    from_ack.sort_unstable();
    latencies.sort_unstable();
    read_latencies.sort_unstable();
    let summary = |sorted: &[u64]| {
        json!({
            "p50": percentile_ms(sorted, 50.0),
            "p99": percentile_ms(sorted, 99.0),
            "p999": percentile_ms(sorted, 99.9),
            "max": sorted.last().map(|&us| us as f64 / 1000.0),
        })
    };
    let report = json!({
        "pairs": latencies.len(),
        "complete": complete,
        "latency_ms": summary(&latencies),
        "latency_to_read_ms": summary(&read_latencies),
        "latency_from_commit_ack_ms": summary(&from_ack),
        "pairs_timed_from_commit_ack": from_ack.len(),
        "pairs_arrived_before_the_acknowledgement": before_ack,
        "rss_kib": rss_kib(None),
    });
    println!("{report}");
    std::io::stdout().flush().unwrap();
}

/// Sends `GET /events`, checks the response head; returns the socket and
/// any body bytes read with the head.
async fn open(addr: &str) -> (TcpStream, Vec<u8>) {
    let mut socket = TcpStream::connect(addr).await.expect("connect");
    socket.set_nodelay(true).unwrap();
    stamp_arrivals(&socket);
    socket
        .write_all(
            format!("GET /events HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let read = socket.read(&mut buf).await.expect("read the response head");
        assert!(read > 0, "the server closed the connection");
        head.extend_from_slice(&buf[..read]);
        if let Some(end) = find(&head, b"\r\n\r\n") {
            let text = String::from_utf8_lossy(&head[..end]).to_ascii_lowercase();
            assert!(text.starts_with("http/1.1 200"), "{text}");
            assert!(text.contains("transfer-encoding: chunked"), "{text}");
            return (socket, head.split_off(end + 4));
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(haystack, needle)
}

/// Undoes chunked transfer encoding and splits the body into SSE blocks.
struct ChunkedBody {
    raw: Vec<u8>,
    /// Bytes of the current chunk still to come, plus its CRLF.
    in_chunk: usize,
    sse: Vec<u8>,
    ended: bool,
}

impl ChunkedBody {
    fn new(initial: Vec<u8>) -> Self {
        ChunkedBody {
            raw: initial,
            in_chunk: 0,
            sse: Vec::new(),
            ended: false,
        }
    }

    fn feed(&mut self, bytes: &[u8], mut on_block: impl FnMut(&[u8])) {
        self.raw.extend_from_slice(bytes);
        let mut at = 0;
        while at < self.raw.len() && !self.ended {
            if self.in_chunk == 0 {
                let Some(eol) = find(&self.raw[at..], b"\r\n") else {
                    break;
                };
                let size = std::str::from_utf8(&self.raw[at..at + eol])
                    .ok()
                    .and_then(|s| usize::from_str_radix(s.split(';').next()?.trim(), 16).ok())
                    .expect("a chunk size");
                at += eol + 2;
                if size == 0 {
                    self.ended = true;
                    break;
                }
                self.in_chunk = size + 2;
            }
            let take = self.in_chunk.min(self.raw.len() - at);
            // The chunk's data, without its trailing CRLF.
            let data_left = self.in_chunk.saturating_sub(2);
            self.sse
                .extend_from_slice(&self.raw[at..at + take.min(data_left)]);
            self.in_chunk -= take;
            at += take;
        }
        self.raw.drain(..at);
        let mut from = 0;
        while let Some(end) = find(&self.sse[from..], b"\n\n") {
            on_block(&self.sse[from..from + end]);
            from += end + 2;
        }
        self.sse.drain(..from);
    }
}

/// What one client saw.
#[derive(Default)]
struct ClientStats {
    last: Option<i64>,
    /// Events whose `seq` was not the previous one plus one.
    out_of_order: u64,
    other_events: u64,
    ended_early: bool,
    /// Each event's seq, its arrival at this client's socket and when this
    /// process read it (ns since the epoch), to be timed at the end.
    arrivals_ns: Vec<(i64, i64, i64)>,
}

impl ClientStats {
    /// One event block (`id:`, `event:`, `data:` lines).
    fn event(&mut self, block: &[u8], arrived: OffsetDateTime, read_at: OffsetDateTime) {
        let text = std::str::from_utf8(block).expect("UTF-8 events");
        let (mut seq, mut data, mut transition) = (None, false, false);
        for line in text.split('\n') {
            if let Some(id) = line.strip_prefix("id: ") {
                seq = id.parse::<i64>().ok();
            } else if line == "event: transition" {
                transition = true;
            } else if line.starts_with("data: {") {
                data = true;
            }
        }
        if !transition {
            // Keep-alive comments have no fields; anything else is wrong.
            if seq.is_some() || data || text.lines().any(|l| !l.starts_with(':')) {
                self.other_events += 1;
            }
            return;
        }
        let (Some(seq), true) = (seq, data) else {
            self.other_events += 1;
            return;
        };
        if self.last.is_some_and(|last| seq != last + 1) {
            self.out_of_order += 1;
        }
        self.last = Some(seq);
        let nanos = |t: OffsetDateTime| t.unix_timestamp_nanos() as i64;
        self.arrivals_ns.push((seq, nanos(arrived), nanos(read_at)));
    }
}

/// The writer's connection, over a socket whose reads keep the kernel's
/// arrival stamp of the newest packet (ns since the epoch) in the returned
/// cell: when a statement returns, that is when its answer, after the
/// commit, reached this process, however busy the runtime then was.
async fn connect_stamped(url: &str) -> (tokio_postgres::Client, Arc<AtomicI64>) {
    let config: tokio_postgres::Config = url.parse().unwrap();
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let socket = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    socket.set_nodelay(true).unwrap();
    stamp_arrivals(&socket);
    let arrival = Arc::new(AtomicI64::new(0));
    let stream = StampedStream {
        socket,
        arrival: arrival.clone(),
    };
    let (client, connection) = config
        .connect_raw(stream, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    (client, arrival)
}

struct StampedStream {
    socket: TcpStream,
    arrival: Arc<AtomicI64>,
}

impl AsyncRead for StampedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        loop {
            ready!(this.socket.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match this
                .socket
                .try_io(Interest::READABLE, || recv_stamped(&this.socket, unfilled))
            {
                Ok((read, arrived)) => {
                    if let Some(arrived) = arrived {
                        this.arrival
                            .store(arrived.unix_timestamp_nanos() as i64, Ordering::Release);
                    }
                    buf.advance(read);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for StampedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().socket).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().socket).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().socket).poll_shutdown(cx)
    }
}

/// Asks the kernel to stamp each packet this socket receives with the
/// (realtime) clock at its arrival (`SO_TIMESTAMPNS`).
fn stamp_arrivals(socket: &TcpStream) {
    let on: libc::c_int = 1;
    // SAFETY: a valid socket descriptor and an int option of the right size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_TIMESTAMPNS,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_TIMESTAMPNS: {}", std::io::Error::last_os_error());
}

/// One non-blocking read, with the arrival time of the newest packet it
/// took (a read that spans several writes gets the latest, so the earlier
/// events' latencies are, if anything, overstated).
fn recv_stamped(
    socket: &TcpStream,
    buf: &mut [u8],
) -> std::io::Result<(usize, Option<OffsetDateTime>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; 8];
    // SAFETY: msghdr is plain data; every pointer set below outlives the
    // call, and the control buffer is aligned for cmsghdr.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: as above.
    let read = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
    if read < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut arrived = None;
    // SAFETY: walks the control messages the kernel wrote into `control`.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_TIMESTAMPNS
            {
                let ts = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::timespec>());
                let nanos = ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128;
                arrived = OffsetDateTime::from_unix_timestamp_nanos(nanos).ok();
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((read as usize, arrived))
}

/// Runs `work` on a new thread with a runtime of its own.
fn spawn_on_own_thread<T: Send + 'static>(
    work: impl std::future::Future<Output = T> + Send + 'static,
) -> tokio::sync::oneshot::Receiver<T> {
    let (done, result) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _ = done.send(runtime.block_on(work));
    });
    result
}

/// Waits until the listener has published `seq`.
/// One commit of `n` new issues (`n` transitions), read through `events`
/// by one client from once all of it is published (see the module docs).
async fn huge_commit(
    events: &str,
    hub: &newsnack::events::hub::EventHub,
    writer: &tokio_postgres::Client,
    n: i32,
) -> serde_json::Value {
    let mut stream = reqwest::Client::new().get(events).send().await.unwrap();
    writer
        .execute(
            "INSERT INTO issue (title) SELECT 'bulk ' || g FROM generate_series(1, $1::int) g",
            &[&n],
        )
        .await
        .unwrap();
    let last: i64 = writer
        .query_one("SELECT max(seq) FROM issue_transition", &[])
        .await
        .unwrap()
        .get(0);
    until_published(hub, last).await;
    let last_id = format!("id: {last}").into_bytes();
    let reading = Instant::now();
    let (mut received, mut dropped, mut in_last, mut done) = (0u64, false, false, false);
    let mut line = Vec::new();
    while !done {
        let Some(chunk) = tokio::time::timeout(Duration::from_secs(120), stream.chunk())
            .await
            .expect("the stream to go on")
            .unwrap()
        else {
            break;
        };
        for &byte in chunk.iter() {
            if byte != b'\n' {
                line.push(byte);
                continue;
            }
            match line.as_slice() {
                b"event: transition" => received += 1,
                b"event: dropped" => dropped = true,
                // The blank line that ends the last event, or the dropped one.
                b"" if in_last || dropped => done = true,
                id if id == last_id.as_slice() => in_last = true,
                _ => {}
            }
            line.clear();
        }
    }
    let seconds = reading.elapsed().as_secs_f64();
    json!({
        "what": "one commit of this many transitions, read by one client from once it was all published",
        "transitions": n,
        "received": received,
        "read_seconds": round3(seconds),
        "events_per_s": round1(received as f64 / seconds),
        "dropped": dropped,
        "max_delay_s": newsnack::http::events::MAX_DELAY.as_secs(),
    })
}

async fn until_published(hub: &newsnack::events::hub::EventHub, seq: i64) {
    let mut status = hub.status();
    tokio::time::timeout(
        Duration::from_secs(60),
        status.wait_for(|s| s.last_seq >= seq),
    )
    .await
    .expect("the listener to publish the setup")
    .expect("the listener is running");
}

/// `VmRSS` of this process, in KiB.
fn rss_kib(pid: Option<u32>) -> i64 {
    status_field(pid, "VmRSS:")
}

/// User plus system CPU time of a process (this one by default), from
/// `/proc/PID/stat` (in USER_HZ ticks, 100 per second on Linux).
fn cpu_seconds(pid: Option<u32>) -> f64 {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/stat"),
        None => "/proc/self/stat".into(),
    };
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Fields 14 and 15 (utime, stime), counted from the state as field 3.
    (ticks(11) + ticks(12)) / 100.0
}

fn hwm_kib() -> i64 {
    status_field(None, "VmHWM:")
}

fn status_field(pid: Option<u32>, field: &str) -> i64 {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/status"),
        None => "/proc/self/status".into(),
    };
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(-1)
}

/// The `p`th percentile of sorted microseconds, in milliseconds.
fn percentile_ms(sorted_us: &[u64], p: f64) -> Option<f64> {
    if sorted_us.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted_us.len() as f64).ceil() as usize;
    let us = sorted_us[rank.clamp(1, sorted_us.len()) - 1];
    Some(round3(us as f64 / 1000.0))
}
