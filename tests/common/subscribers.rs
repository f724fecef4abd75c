//! Transition subscribers that record the `seq` of everything they are
//! handed, for the audit to compare with the log: the crate's own
//! [`newsnack::events::stream::TransitionStream`], an SSE client on `GET /events`
//! that resumes with `Last-Event-ID` (on the same instance or the next one
//! when its instance goes away), and `newsnack tail --json` as a process.
//!
//! Each keeps following until its [`Recording`] is dropped.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use newsnack::events::hub::EventHub;
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

/// How long a subscriber pauses before trying again after an error.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// What one subscriber has seen so far.
pub struct Recording {
    pub name: String,
    /// The subscriber was asked for every transition after this `seq`.
    pub after_seq: i64,
    seen: Arc<Mutex<Vec<i64>>>,
    last: watch::Receiver<i64>,
    reconnects: Arc<AtomicU64>,
    _stop: DropGuard,
    tail: Option<Child>,
}

/// The writing side of a [`Recording`], held by the subscriber.
#[derive(Clone)]
pub struct Recorder {
    seen: Arc<Mutex<Vec<i64>>>,
    last: Arc<watch::Sender<i64>>,
    reconnects: Arc<AtomicU64>,
}

impl Recorder {
    /// Records that the subscriber was handed `seq`.
    pub fn saw(&self, seq: i64) {
        self.seen.lock().unwrap().push(seq);
        self.last.send_modify(|last| *last = (*last).max(seq));
    }

    fn reconnected(&self) {
        self.reconnects.fetch_add(1, Ordering::Relaxed);
    }
}

impl Recording {
    fn new(name: &str, after_seq: i64) -> (Recording, Recorder, CancellationToken) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (last_tx, last) = watch::channel(after_seq);
        let reconnects = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let recording = Recording {
            name: name.to_string(),
            after_seq,
            seen: seen.clone(),
            last,
            reconnects: reconnects.clone(),
            _stop: stop.clone().drop_guard(),
            tail: None,
        };
        let recorder = Recorder {
            seen,
            last: Arc::new(last_tx),
            reconnects,
        };
        (recording, recorder, stop)
    }

    /// A recording filled by the caller, for a subscriber written in a test.
    pub fn fed_by_hand(name: &str, after_seq: i64) -> (Recording, Recorder) {
        let (recording, recorder, _) = Recording::new(name, after_seq);
        (recording, recorder)
    }

    /// Every `seq` seen, in the order seen.
    pub fn seen(&self) -> Vec<i64> {
        self.seen.lock().unwrap().clone()
    }

    /// How often the subscriber had to reconnect (SSE) or resume.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// Waits until the subscriber has seen `seq` (or a later one); false
    /// if that does not happen within `secs` seconds.
    pub async fn reaches(&self, seq: i64, secs: u64) -> bool {
        let mut last = self.last.clone();
        tokio::time::timeout(
            Duration::from_secs(secs),
            last.wait_for(|&last| last >= seq),
        )
        .await
        .is_ok_and(|seen| seen.is_ok())
    }

    /// Follows `hub.stream_after(after_seq)`, the crate's gapless stream,
    /// resuming the same stream after a database error.
    pub fn follow_stream(name: &str, hub: &EventHub, after_seq: i64) -> Recording {
        let (recording, recorder, stop) = Recording::new(name, after_seq);
        let mut stream = hub.stream_after(after_seq, None);
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    _ = stop.cancelled() => return,
                    next = stream.next() => next,
                };
                match next {
                    Ok(t) => recorder.saw(t.seq),
                    Err(_) => {
                        recorder.reconnected();
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = tokio::time::sleep(RETRY_PAUSE) => {}
                        }
                    }
                }
            }
        });
        recording
    }

    /// Follows `GET /events` on the first of `bases` (`http://ADDR`), from
    /// `after_seq`. When the stream ends or breaks, reconnects with
    /// `Last-Event-ID` set to the last `seq` seen, to the next base in turn.
    pub fn follow_sse(name: &str, bases: Vec<String>, after_seq: i64) -> Recording {
        let (recording, recorder, stop) = Recording::new(name, after_seq);
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut last = after_seq;
            for (round, base) in bases.iter().cycle().enumerate() {
                if round > 0 {
                    recorder.reconnected();
                }
                let follow = follow_events(&http, base, &mut last, &recorder);
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = follow => {}
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(RETRY_PAUSE) => {}
                }
            }
        });
        recording
    }

    /// Follows `newsnack tail --json --since AFTER_SEQ` as a child process.
    pub fn follow_tail(name: &str, database_url: &str, after_seq: i64) -> Recording {
        let (mut recording, recorder, _) = Recording::new(name, after_seq);
        let mut child = Command::new(env!("CARGO_BIN_EXE_newsnack"))
            .args(["tail", "--json", "--since", &after_seq.to_string()])
            .env("DATABASE_URL", database_url)
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start newsnack tail");
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                let event: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| {
                    panic!("tail printed a line that is not JSON ({e}): {line}")
                });
                recorder.saw(event["seq"].as_i64().expect("a seq in every tail line"));
            }
        });
        recording.tail = Some(child);
        recording
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if let Some(child) = &mut self.tail {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Reads one `GET /events` response until it ends or breaks, recording
/// transition events and advancing `last`.
async fn follow_events(http: &reqwest::Client, base: &str, last: &mut i64, recorder: &Recorder) {
    let response = http
        .get(format!("{base}/events"))
        .header("Last-Event-ID", last.to_string())
        .send()
        .await;
    let Ok(mut response) = response else { return };
    if !response.status().is_success() {
        return;
    }
    let mut events = SseParser::default();
    while let Ok(Some(chunk)) = response.chunk().await {
        for event in events.feed(&chunk) {
            if event.name != "transition" {
                // `dropped`: the server ends the stream; resume elsewhere.
                return;
            }
            let seq = event.id.expect("a transition event has an id");
            *last = seq;
            recorder.saw(seq);
        }
    }
}

/// One server-sent event, as far as the audit cares.
struct SseEvent {
    id: Option<i64>,
    name: String,
}

/// Splits an event stream into events; comments (keep-alives) are skipped.
#[derive(Default)]
struct SseParser {
    buffer: Vec<u8>,
}

impl SseParser {
    fn feed(&mut self, bytes: &[u8]) -> VecDeque<SseEvent> {
        self.buffer.extend_from_slice(bytes);
        let mut events = VecDeque::new();
        while let Some(end) = self.buffer.windows(2).position(|w| w == b"\n\n") {
            let block: Vec<u8> = self.buffer.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&block[..end]);
            let mut event = SseEvent {
                id: None,
                name: "message".into(),
            };
            let mut fields = 0;
            for line in text.split('\n').filter(|l| !l.starts_with(':')) {
                let (field, value) = line.split_once(':').unwrap_or((line, ""));
                let value = value.strip_prefix(' ').unwrap_or(value);
                match field {
                    "id" => event.id = value.parse().ok(),
                    "event" => event.name = value.to_string(),
                    _ => {}
                }
                fields += 1;
            }
            if fields > 0 {
                events.push_back(event);
            }
        }
        events
    }
}
