//! `GET /events` against its contract, over a real socket: the shape of a
//! transition event, `?issue_id=` filtering, `?since=0` replay, 400 for bad
//! parameters; a client that reconnects with `Last-Event-ID` three times in
//! the middle of a 5,000-transition burst and ends up with every transition
//! exactly once, in order; 200 concurrent clients that all receive every
//! transition, with the process's memory growth measured; a slow client
//! dropped with a final `dropped` event it can resume from; and shutdown
//! ending open streams.

mod common;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use common::http::metric;
use common::{first_column, offline, until_published, within, TestDb};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{watch, RwLock};
use tokio_postgres::Client;

/// The 200-client test measures this process's memory, so it runs alone;
/// every other test here shares this lock.
static EXCLUSIVE: RwLock<()> = RwLock::const_new(());

/// One parsed server-sent event.
#[derive(Debug, Clone)]
struct SseEvent {
    id: Option<String>,
    event: String,
    data: String,
}

impl SseEvent {
    fn seq(&self) -> i64 {
        self.id
            .as_deref()
            .and_then(|id| id.parse().ok())
            .unwrap_or_else(|| panic!("an event without a numeric id: {self:?}"))
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.data)
            .unwrap_or_else(|e| panic!("data is not JSON ({e}): {:?}", self.data))
    }
}

/// A minimal SSE client over reqwest: events as they arrive, comments
/// (keep-alives) skipped.
struct SseClient {
    source: Source,
    buf: Vec<u8>,
    ready: VecDeque<SseEvent>,
}

/// Where the bytes of the stream come from.
enum Source {
    Reqwest(reqwest::Response),
    /// A bare HTTP/1.1 connection with a small read buffer, so that a test
    /// measuring memory measures the service rather than its clients.
    Raw(BufReader<TcpStream>),
}

impl Source {
    /// The next piece of the body; `None` at its end.
    async fn chunk(&mut self) -> Option<Vec<u8>> {
        match self {
            Source::Reqwest(response) => response
                .chunk()
                .await
                .expect("read the event stream")
                .map(|b| b.to_vec()),
            Source::Raw(reader) => {
                // Chunked transfer encoding: `SIZE\r\n DATA \r\n`, `0\r\n\r\n` at the end.
                let mut line = String::new();
                reader
                    .read_line(&mut line)
                    .await
                    .expect("read a chunk size");
                let size = line.trim().split(';').next().unwrap_or("");
                let size = usize::from_str_radix(size, 16)
                    .unwrap_or_else(|_| panic!("not a chunk size: {line:?}"));
                if size == 0 {
                    return None;
                }
                let mut data = vec![0; size + 2];
                reader.read_exact(&mut data).await.expect("read a chunk");
                assert_eq!(&data[size..], b"\r\n", "chunk trailer");
                data.truncate(size);
                Some(data)
            }
        }
    }
}

impl SseClient {
    /// Opens `url`, sending `Last-Event-ID` if given; asserts a 200 event
    /// stream.
    async fn open(http: &reqwest::Client, url: &str, last_event_id: Option<i64>) -> SseClient {
        let mut request = http.get(url);
        if let Some(id) = last_event_id {
            request = request.header("Last-Event-ID", id.to_string());
        }
        let response = within(30, "the SSE response headers", request.send())
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        assert_eq!(response.status(), 200, "GET {url}");
        assert_eq!(
            response.headers()["content-type"],
            "text/event-stream",
            "GET {url}"
        );
        SseClient {
            source: Source::Reqwest(response),
            buf: Vec::new(),
            ready: VecDeque::new(),
        }
    }

    /// Opens `GET /events` over a bare TCP connection (live from now).
    async fn open_raw(addr: SocketAddr) -> SseClient {
        let mut socket = TcpStream::connect(addr).await.expect("connect");
        socket
            .write_all(
                b"GET /events HTTP/1.1\r\nHost: localhost\r\nAccept: text/event-stream\r\n\r\n",
            )
            .await
            .unwrap();
        let mut reader = BufReader::with_capacity(4096, socket);
        let mut head = Vec::new();
        loop {
            let mut line = String::new();
            reader
                .read_line(&mut line)
                .await
                .expect("read the response head");
            if line == "\r\n" || line.is_empty() {
                break;
            }
            head.push(line.trim_end().to_ascii_lowercase());
        }
        assert!(head[0].starts_with("http/1.1 200"), "{head:?}");
        assert!(
            head.contains(&"transfer-encoding: chunked".into()),
            "{head:?}"
        );
        assert!(
            head.contains(&"content-type: text/event-stream".into()),
            "{head:?}"
        );
        SseClient {
            source: Source::Raw(reader),
            buf: Vec::new(),
            ready: VecDeque::new(),
        }
    }

    /// The next event; `None` once the server has ended the stream.
    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Some(event);
            }
            let chunk = self.source.chunk().await?;
            self.buf.extend_from_slice(&chunk);
            // Every complete block, then the rest kept for the next chunk.
            let mut start = 0;
            while let Some(end) = self.buf[start..].windows(2).position(|w| w == b"\n\n") {
                if let Some(event) = parse_block(&self.buf[start..start + end]) {
                    self.ready.push_back(event);
                }
                start += end + 2;
            }
            self.buf.drain(..start);
        }
    }

    /// The next event, which must come within `secs` seconds.
    async fn expect(&mut self, secs: u64, what: &str) -> SseEvent {
        within(secs, what, self.next())
            .await
            .unwrap_or_else(|| panic!("the stream ended while waiting for {what}"))
    }
}

/// One event block; `None` for a comment-only block (a keep-alive).
fn parse_block(block: &[u8]) -> Option<SseEvent> {
    let text = std::str::from_utf8(block).expect("UTF-8 events");
    let (mut id, mut event, mut data) = (None, None, Vec::new());
    for line in text.split('\n') {
        if line.is_empty() || line.starts_with(':') {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "id" => id = Some(value.to_string()),
            "event" => event = Some(value.to_string()),
            "data" => data.push(value),
            other => panic!("unexpected SSE field {other:?} in {text:?}"),
        }
    }
    if id.is_none() && event.is_none() && data.is_empty() {
        return None;
    }
    Some(SseEvent {
        id,
        event: event.unwrap_or_else(|| "message".into()),
        data: data.join("\n"),
    })
}

async fn all_seqs(db: &TestDb) -> Vec<i64> {
    let client = db.pool.get().await.unwrap();
    first_column(
        &client,
        "SELECT seq FROM issue_transition ORDER BY seq",
        &[],
    )
    .await
}

/// Inserts `n` issues in one transaction; returns their ids.
async fn insert(sql: &Client, n: i32) -> Vec<i64> {
    first_column(
        sql,
        "INSERT INTO issue (title, body, score)
         SELECT 'issue ' || g, 'body', g FROM generate_series(1, $1::int) g
         RETURNING id",
        &[&n],
    )
    .await
}

/// How many transitions surely overflow what a stalled connection absorbs
/// (the kernel's largest send buffer, the initial receive buffer, hyper's
/// buffers at both ends: about 25,000 events here) by more than the 10,000 a
/// stream may fall behind.
fn flood_size() -> i32 {
    let needed = newsnack::http::events::MAX_FALL_BEHIND + events_socket_buffers_hold();
    let flood = (needed * 3 / 2 + 999) / 1000 * 1000;
    flood.clamp(30_000, 400_000) as i32
}

/// About how many events the socket buffers between a stream and a client
/// that stopped reading hold (see [`flood_size`]).
fn events_socket_buffers_hold() -> i64 {
    let field = |path: &str, index: usize| -> i64 {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.split_whitespace().nth(index)?.parse().ok())
            .unwrap_or(4 << 20)
    };
    let absorbed_bytes = field("/proc/sys/net/ipv4/tcp_wmem", 2)
        + field("/proc/sys/net/ipv4/tcp_rmem", 1)
        + (1 << 20);
    // An event on the wire is about 150 bytes.
    absorbed_bytes / 140
}

#[tokio::test]
async fn events_carry_seq_as_id_and_the_transition_as_json_filter_replay_and_reject_bad_input() {
    let _shared = EXCLUSIVE.read().await;
    let db = TestDb::new().await;
    let service = db.serve("events-basic", offline()).await;
    let base = format!("http://{}/events", service.addr);
    let http = reqwest::Client::new();
    let sql = db.raw().await;

    // Live from now: a raw-SQL insert and claim, as another system would.
    let mut live = SseClient::open(&http, &base, None).await;
    let a = insert(&sql, 1).await[0];
    sql.execute(
        "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = $1",
        &[&a],
    )
    .await
    .unwrap();
    let logged: Vec<(i64, i32)> = sql
        .query(
            "SELECT seq, attempts FROM issue_transition WHERE issue_id = $1 ORDER BY seq",
            &[&a],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(logged.len(), 2);
    let created = live.expect(10, "the insert's transition").await;
    assert_eq!(created.event, "transition");
    assert_eq!(created.id, Some(logged[0].0.to_string()));
    let data = created.json();
    assert_eq!(data["seq"], logged[0].0);
    assert_eq!(data["issue_id"], a);
    assert_eq!(data["from"], Value::Null);
    assert_eq!(data["to"], "PENDING");
    assert_eq!(data["attempts"], 0);
    assert_eq!(data["fatal"], false);
    assert!(
        time::OffsetDateTime::parse(
            data["at"].as_str().unwrap(),
            &time::format_description::well_known::Rfc3339
        )
        .is_ok(),
        "at is RFC 3339: {data}"
    );
    let claimed = live.expect(10, "the claim's transition").await;
    assert_eq!(claimed.seq(), logged[1].0);
    let data = claimed.json();
    assert_eq!(
        (&data["from"], &data["to"]),
        (&"PENDING".into(), &"IN_PROGRESS".into())
    );
    assert_eq!(data["attempts"], logged[1].1);
    // The same as the library's own type says, field for field.
    let typed: newsnack::model::transition::Transition =
        serde_json::from_str(&claimed.data).expect("data parses as a Transition");
    assert_eq!((typed.seq, typed.issue_id), (logged[1].0, a));

    // More history: three more issues, one of them claimed.
    let more = insert(&sql, 3).await;
    sql.execute(
        "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = $1",
        &[&more[1]],
    )
    .await
    .unwrap();
    let history = all_seqs(&db).await;
    assert_eq!(history.len(), 6);

    // The live client saw them too, in log order.
    for &seq in &history[2..] {
        assert_eq!(live.expect(10, "the new history, live").await.seq(), seq);
    }

    // ?since=0 replays the whole log, in order.
    let mut replay = SseClient::open(&http, &format!("{base}?since=0"), None).await;
    let mut replayed = Vec::new();
    while replayed.len() < history.len() {
        replayed.push(replay.expect(10, "the replay").await.seq());
    }
    assert_eq!(replayed, history);

    // ?since=N resumes after N.
    let mut resumed = SseClient::open(&http, &format!("{base}?since={}", history[3]), None).await;
    assert_eq!(resumed.expect(10, "after since").await.seq(), history[4]);
    assert_eq!(resumed.expect(10, "after since").await.seq(), history[5]);

    // ?issue_id= keeps one issue's transitions, history and live.
    let one = more[1];
    let mut filtered =
        SseClient::open(&http, &format!("{base}?since=0&issue_id={one}"), None).await;
    let first = filtered.expect(10, "the filtered insert").await.json();
    let second = filtered.expect(10, "the filtered claim").await.json();
    assert_eq!(
        (&first["issue_id"], &first["to"]),
        (&one.into(), &"PENDING".into())
    );
    assert_eq!(
        (&second["issue_id"], &second["to"]),
        (&one.into(), &"IN_PROGRESS".into())
    );
    // Other issues' transitions pass it by; its own arrives live.
    sql.execute(
        "UPDATE issue SET processing_status = 'DONE' WHERE id = $1",
        &[&a],
    )
    .await
    .unwrap();
    sql.execute(
        "UPDATE issue SET processing_status = 'FAILED', last_error = 'x' WHERE id = $1",
        &[&one],
    )
    .await
    .unwrap();
    let third = filtered.expect(10, "the filtered failure").await.json();
    assert_eq!(
        (&third["issue_id"], &third["to"]),
        (&one.into(), &"FAILED".into())
    );
    // The unfiltered live client saw both, in order.
    let done = live.expect(10, "a's DONE").await.json();
    let failed = live.expect(10, "the failure").await.json();
    assert_eq!(
        (&done["issue_id"], &done["to"]),
        (&a.into(), &"DONE".into())
    );
    assert_eq!(failed["seq"], third["seq"]);
    assert!(done["seq"].as_i64() < failed["seq"].as_i64());

    // Bad parameters: 400 with the API's error shape.
    let bad: [(&str, Option<&str>); 10] = [
        ("?since=abc", None),
        ("?since=-1", None),
        ("?since=1.5", None),
        ("?since=", None),
        ("?since=1&since=2", None),
        ("?issue_id=abc", None),
        ("?issue_id=-3", None),
        ("?issue_id=0", None),
        ("", Some("abc")),
        ("?since=0", Some("-7")),
    ];
    for (query, last_event_id) in bad {
        let mut request = http.get(format!("{base}{query}"));
        if let Some(id) = last_event_id {
            request = request.header("Last-Event-ID", id);
        }
        let response = request.send().await.unwrap();
        assert_eq!(
            response.status(),
            400,
            "{query} with Last-Event-ID {last_event_id:?}"
        );
        let body: Value = response.json().await.expect("a JSON error body");
        assert!(
            body["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{query}: {body}"
        );
    }
    service.stop().await.unwrap();
}

#[tokio::test]
async fn a_position_beyond_the_log_starts_at_its_end_with_a_reset_event() {
    let _shared = EXCLUSIVE.read().await;
    let db = TestDb::new().await;
    let sql = db.raw().await;
    insert(&sql, 3).await;
    let service = db.serve("events-reset", offline()).await;
    let end = *all_seqs(&db).await.last().unwrap();
    until_published(&service.hub, end).await;
    let base = format!("http://{}/events", service.addr);
    let http = reqwest::Client::new();

    // A browser that followed a service now running on a new database comes
    // back with a Last-Event-ID the log never reached; so may `?since=`.
    let mut from_header = SseClient::open(&http, &base, Some(end + 1000)).await;
    let mut from_query = SseClient::open(&http, &format!("{base}?since={}", end + 7), None).await;
    for (client, requested) in [(&mut from_header, end + 1000), (&mut from_query, end + 7)] {
        let reset = client.expect(10, "the reset notice").await;
        assert_eq!(reset.event, "reset", "{reset:?}");
        assert_eq!(
            reset.seq(),
            end,
            "the notice moves the client's id to the log's end"
        );
        let data = reset.json();
        assert_eq!(data["requested"], requested, "{data}");
        assert_eq!(data["resume_after"], end, "{data}");
        assert!(data["reason"].as_str().is_some_and(|r| !r.is_empty()));
    }
    // The log's very end is a position like any other: no notice.
    let mut at_end = SseClient::open(&http, &base, Some(end)).await;

    // What the log gets next reaches all three.
    let next = insert(&sql, 1).await;
    for client in [&mut from_header, &mut from_query, &mut at_end] {
        let event = client.expect(10, "the next transition").await;
        assert_eq!(event.event, "transition", "{event:?}");
        assert_eq!(event.seq(), end + 1);
        assert_eq!(event.json()["issue_id"], next[0]);
    }
    service.stop().await.unwrap();
}

/// A position older than the log keeps (its transitions were pruned)
/// starts with a `reset` event naming the oldest kept `seq`, whose `id:` is
/// just before it, then every kept transition from there with no gap; the
/// position just before the oldest kept row is an ordinary one.
#[tokio::test]
async fn a_pruned_position_starts_at_the_oldest_kept_with_a_reset_event() {
    let _shared = EXCLUSIVE.read().await;
    let db = TestDb::new().await;
    let sql = db.raw().await;
    insert(&sql, 10).await;
    let seqs = all_seqs(&db).await;
    sql.execute(
        "UPDATE issue_transition SET at = now() - interval '100 days' WHERE seq <= $1",
        &[&seqs[5]],
    )
    .await
    .unwrap();
    db.set("log_retention_days", "30").await;
    let pruned = newsnack::db::retention::prune(
        &db.pool.get().await.unwrap(),
        &newsnack::db::retention::Retention {
            log_days: 30,
            issue_days: 0,
            max_attempts: 3,
        },
        false,
    )
    .await
    .unwrap();
    assert_eq!(pruned.issue_transition, 6);
    let oldest = seqs[6];
    let service = db.serve("events-pruned", offline()).await;
    until_published(&service.hub, *seqs.last().unwrap()).await;
    let base = format!("http://{}/events", service.addr);
    let http = reqwest::Client::new();

    let mut from_zero = SseClient::open(&http, &format!("{base}?since=0"), None).await;
    let mut from_header = SseClient::open(&http, &base, Some(seqs[2])).await;
    let mut one_issue =
        SseClient::open(&http, &format!("{base}?since={}&issue_id=1", seqs[0]), None).await;
    for client in [&mut from_zero, &mut from_header, &mut one_issue] {
        let reset = client.expect(10, "the reset notice").await;
        assert_eq!(reset.event, "reset", "{reset:?}");
        assert_eq!(reset.json(), serde_json::json!({ "oldest": oldest }));
        assert_eq!(reset.seq(), oldest - 1, "a reconnect resumes after it");
    }
    let mut just_before = SseClient::open(&http, &base, Some(oldest - 1)).await;
    for client in [&mut from_zero, &mut from_header, &mut just_before] {
        let mut got = Vec::new();
        for _ in &seqs[6..] {
            let event = client.expect(10, "a kept transition").await;
            assert_eq!(event.event, "transition", "{event:?}");
            got.push(event.seq());
        }
        assert_eq!(got, seqs[6..].to_vec(), "no gap after the oldest kept");
    }
    // Live from there on, for all of them.
    let next = insert(&sql, 1).await;
    for client in [&mut from_zero, &mut from_header, &mut just_before] {
        let event = client.expect(10, "the next transition").await;
        assert_eq!(event.json()["issue_id"], next[0]);
    }
    service.stop().await.unwrap();
}

#[tokio::test]
async fn reconnecting_with_last_event_id_during_a_burst_loses_and_repeats_nothing() {
    let _shared = EXCLUSIVE.read().await;
    let db = TestDb::new().await;
    let service = db.serve("events-burst", offline()).await;
    // `since=0` stays in the URL: the Last-Event-ID header must win over it.
    let url = format!("http://{}/events?since=0", service.addr);
    let http = reqwest::Client::new();

    // 4 writers x 125 rounds x (5 inserted + 5 claimed) = 5,000 transitions,
    // in 1,000 small transactions. The writers hold their last 1,000 until
    // the client has reconnected three times, so the burst surely spans the
    // reconnections.
    const WRITERS: usize = 4;
    const ROUNDS: usize = 125;
    const GATE_ROUND: usize = 100;
    const TOTAL: usize = WRITERS * ROUNDS * 10;
    const RECONNECT_AFTER: [usize; 3] = [1000, 2200, 3500];
    let (reconnects_tx, reconnects_rx) = watch::channel(0usize);
    let mut writers = Vec::new();
    for _ in 0..WRITERS {
        let sql = db.raw().await;
        let mut gate = reconnects_rx.clone();
        writers.push(tokio::spawn(async move {
            for round in 0..ROUNDS {
                if round == GATE_ROUND {
                    gate.wait_for(|n| *n >= RECONNECT_AFTER.len())
                        .await
                        .unwrap();
                }
                let ids = insert(&sql, 5).await;
                sql.execute(
                    "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = ANY($1)",
                    &[&ids],
                )
                .await
                .unwrap();
            }
        }));
    }

    let (final_tx, final_rx) = watch::channel(i64::MAX);
    let hub = service.hub.clone();
    let reader = tokio::spawn(async move {
        let mut final_rx = final_rx;
        let mut seen: Vec<i64> = Vec::new();
        let mut committed_at_reconnect = Vec::new();
        let mut client = SseClient::open(&http, &url, None).await;
        let mut connections = 1;
        loop {
            if seen.last().is_some_and(|&s| s >= *final_rx.borrow()) {
                return (seen, connections, committed_at_reconnect);
            }
            if RECONNECT_AFTER.get(connections - 1) == Some(&seen.len()) {
                // Drop the connection, with whatever it had buffered, and
                // come back with the last id this client processed.
                drop(client);
                committed_at_reconnect.push(hub.status().borrow().last_seq);
                client = SseClient::open(&http, &url, seen.last().copied()).await;
                connections += 1;
                reconnects_tx.send_replace(connections - 1);
                continue;
            }
            tokio::select! {
                event = client.next() => {
                    let event = event.expect("the stream ended during the burst");
                    assert_eq!(event.event, "transition", "{event:?}");
                    seen.push(event.seq());
                }
                _ = final_rx.changed() => {}
            }
        }
    });

    within(120, "the burst", async {
        for writer in writers {
            writer.await.unwrap();
        }
    })
    .await;
    let log = all_seqs(&db).await;
    assert_eq!(log.len(), TOTAL);
    final_tx.send_replace(*log.last().unwrap());
    let (seen, connections, committed_at_reconnect) =
        within(120, "the client to see the whole burst", reader)
            .await
            .unwrap();
    eprintln!(
        "burst: {} transitions; reconnected after {RECONNECT_AFTER:?} events, when the \
         listener had published up to seq {committed_at_reconnect:?}",
        log.len()
    );
    assert_eq!(connections, RECONNECT_AFTER.len() + 1);
    assert_eq!(seen.len(), log.len(), "every transition exactly once");
    assert_eq!(seen, log, "in log order");
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_all_receive_every_transition() {
    let _alone = EXCLUSIVE.write().await;
    const CLIENTS: usize = 200;
    const TRANSACTIONS: i32 = 100;
    const PER_TRANSACTION: i32 = 10;
    let db = TestDb::new().await;
    let service = db.serve("events-fanout", offline()).await;
    let url = format!("http://{}/events", service.addr);
    let http = reqwest::Client::new();
    let sql = db.raw().await;

    // Warm up the server, the client and the allocator with one stream.
    {
        let mut warm = SseClient::open(&http, &url, None).await;
        insert(&sql, 1).await;
        warm.expect(10, "the warm-up transition").await;
    }
    let after = *all_seqs(&db).await.last().unwrap();
    let baseline = service.hub.subscriber_count();

    let clients = within(
        60,
        "200 SSE clients to connect",
        futures::future::join_all((0..CLIENTS).map(|_| SseClient::open_raw(service.addr))),
    )
    .await;
    assert!(
        service.hub.subscriber_count() >= baseline + CLIENTS,
        "one hub receiver per client"
    );
    // The metrics count them too.
    let base = format!("http://{}", service.addr);
    let gauge = metric(&http, &base, "newsnack_sse_clients").await;
    assert!(gauge >= CLIENTS as f64, "newsnack_sse_clients = {gauge}");

    let (final_tx, final_rx) = watch::channel(i64::MAX);
    let readers: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            let mut final_rx = final_rx.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                loop {
                    if seen.last().is_some_and(|&s| s >= *final_rx.borrow()) {
                        return (seen, client);
                    }
                    tokio::select! {
                        event = client.next() => {
                            let event = event.expect("the stream ended early");
                            assert_eq!(event.event, "transition");
                            seen.push(event.seq());
                        }
                        _ = final_rx.changed() => {}
                    }
                }
            })
        })
        .collect();
    for _ in 0..TRANSACTIONS {
        insert(&sql, PER_TRANSACTION).await;
    }
    let log = all_seqs(&db).await;
    let expected: Vec<i64> = log.into_iter().filter(|&s| s > after).collect();
    assert_eq!(expected.len(), (TRANSACTIONS * PER_TRANSACTION) as usize);
    final_tx.send_replace(*expected.last().unwrap());
    let received = within(
        120,
        "every client to receive every transition",
        futures::future::join_all(readers),
    )
    .await;
    let mut open = Vec::new();
    for (i, received) in received.into_iter().enumerate() {
        let (seen, client) = received.unwrap();
        assert_eq!(seen, expected, "client {i}");
        open.push(client);
    }
    // What they cost in memory is measured by `cargo bench --bench sse`,
    // in a process of its own: here the clients share the process.
    drop(open);
    service.stop().await.unwrap();
}

#[tokio::test]
async fn slow_clients_are_dropped_resumably_and_never_hold_up_shutdown() {
    let _shared = EXCLUSIVE.read().await;
    let flood = flood_size();
    let db = TestDb::new().await;
    let service = db.serve("events-slow", offline()).await;
    let url = format!("http://{}/events", service.addr);
    let http = reqwest::Client::new();
    let sql = db.raw().await;

    // One client never reads a byte: its stream ends up blocked on a full
    // socket, where it cannot see shutdown coming.
    let _stalled = SseClient::open(&http, &url, None).await;
    let mut slow = SseClient::open(&http, &url, None).await;
    insert(&sql, 1).await;
    let mut seen = vec![slow.expect(10, "the first transition").await.seq()];
    // The client stops reading; meanwhile far more transitions flow than
    // socket buffers hold plus the 10,000 a stream may fall behind.
    for _ in 0..flood / 1000 {
        insert(&sql, 1000).await;
    }
    let log = all_seqs(&db).await;
    let last = *log.last().unwrap();
    until_published(&service.hub, last).await;
    // Slowness is also a matter of time: the client is dropped once what it
    // has yet to read was published more than MAX_DELAY ago.
    within(30, "the flood to be MAX_DELAY old", async {
        while service.hub.published_ago(last) <= newsnack::http::events::MAX_DELAY {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;

    // Reading again, it gets what was already on its way, then `dropped`.
    let dropped = within(60, "the dropped event", async {
        loop {
            let event = slow
                .next()
                .await
                .expect("the stream ended without `dropped`");
            match event.event.as_str() {
                "transition" => seen.push(event.seq()),
                "dropped" => return event.json(),
                other => panic!("unexpected event {other}"),
            }
        }
    })
    .await;
    eprintln!(
        "slow client: {} of {} transitions delivered before it was dropped: {dropped}",
        seen.len(),
        log.len()
    );
    assert_eq!(dropped["reason"], "client too slow");
    assert_eq!(dropped["resume_after"], *seen.last().unwrap());
    assert!(
        within(10, "the end of the stream", slow.next())
            .await
            .is_none(),
        "nothing after `dropped`"
    );
    assert!(
        *seen.last().unwrap() < last - newsnack::http::events::MAX_FALL_BEHIND,
        "dropped only when more than 10,000 behind"
    );
    assert!(seen.len() > 1, "it got what had already been sent");
    assert_eq!(seen[..], log[..seen.len()], "no gap before the drop");

    // Reconnecting with Last-Event-ID replays the rest from the log (a
    // replay that gains ground is never dropped).
    let mut again = SseClient::open(&http, &url, seen.last().copied()).await;
    within(60, "the rest of the log", async {
        while *seen.last().unwrap() < last {
            let event = again.next().await.expect("the resumed stream ended");
            assert_eq!(event.event, "transition", "{event:?}");
            seen.push(event.seq());
        }
    })
    .await;
    assert_eq!(seen, log, "everything exactly once, in order");
    // The stalled client's connection is cut after the grace period (5 s).
    within(
        30,
        "shutdown despite a client that stopped reading",
        service.stop(),
    )
    .await
    .unwrap();
}

/// One commit of more transitions than a stream may fall behind (a bulk
/// reset by another system, say) puts every client that far behind at once;
/// a client that reads on promptly is not dropped for it, and gets every
/// one.
#[tokio::test]
async fn a_client_reading_through_one_huge_commit_is_not_dropped() {
    // Alone: the client must read promptly, within MAX_DELAY.
    let _alone = EXCLUSIVE.write().await;
    let db = TestDb::new().await;
    let service = db.serve("events-huge-commit", offline()).await;
    let url = format!("http://{}/events", service.addr);
    let http = reqwest::Client::new();
    let sql = db.raw().await;
    let mut client = SseClient::open(&http, &url, None).await;
    let first = insert(&sql, 1).await;
    assert_eq!(
        client.expect(10, "the first transition").await.json()["issue_id"],
        first[0]
    );

    // The client reads nothing until the whole commit is published: every
    // transition of it is far behind by then (more than the socket buffers
    // hold plus the 10,000), but only just published.
    let huge =
        (newsnack::http::events::MAX_FALL_BEHIND + events_socket_buffers_hold() + 5_000) as i32;
    insert(&sql, huge).await;
    let log = all_seqs(&db).await;
    until_published(&service.hub, *log.last().unwrap()).await;
    // The read must be prompt: a stream this far behind may be dropped once
    // what it is about to send was published more than MAX_DELAY ago. How
    // long such a read takes is measured by `cargo bench --bench sse`
    // (`huge_commit`); here only its outcome counts.
    let reading = std::time::Instant::now();
    let mut seen = Vec::new();
    within(60, "every transition of the commit", async {
        while seen.len() < huge as usize {
            let event = client.next().await.expect("the stream ended");
            assert_eq!(
                event.event,
                "transition",
                "{event:?} after {} of {huge} transitions, {:?} into the read (MAX_DELAY is {:?})",
                seen.len(),
                reading.elapsed(),
                newsnack::http::events::MAX_DELAY
            );
            seen.push(event.seq());
        }
    })
    .await;
    assert_eq!(seen[..], log[1..], "all of them, once, in order");
    service.stop().await.unwrap();
}

#[tokio::test]
async fn shutdown_ends_open_streams_with_a_final_event() {
    let _shared = EXCLUSIVE.read().await;
    let db = TestDb::new().await;
    let service = db.serve("events-shutdown", offline()).await;
    let url = format!("http://{}/events", service.addr);
    let http = reqwest::Client::new();
    let sql = db.raw().await;

    let mut reading = SseClient::open(&http, &url, None).await;
    insert(&sql, 1).await;
    let seen = reading.expect(10, "a transition").await.seq();
    // A second client, caught up and never reading.
    let mut idle = SseClient::open(&http, &format!("{url}?since={seen}"), None).await;

    within(15, "stop() with two SSE streams open", service.stop())
        .await
        .unwrap();

    let last = reading.expect(10, "the final event").await;
    assert_eq!(last.event, "dropped");
    let data = last.json();
    assert_eq!(data["reason"], "server shutting down");
    assert_eq!(data["resume_after"], seen);
    assert!(within(10, "the end", reading.next()).await.is_none());

    // The client that never read gets the same end.
    let last = idle.expect(10, "the final event").await;
    assert_eq!(last.event, "dropped");
    assert_eq!(last.json()["resume_after"], seen);
    assert!(within(10, "the end", idle.next()).await.is_none());
}
