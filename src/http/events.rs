//! `GET /events`: Server-Sent Events over the gapless transition stream.
//!
//! Every transition is one event: `id:` is its `seq`, `event: transition`,
//! and `data:` the JSON of [`Transition`] (the NOTIFY payload: `seq`,
//! `issue_id`, `from`, `to`, `at`, `attempts`, `fatal`).
//!
//! Where a stream starts: the `Last-Event-ID` header wins (a reconnecting
//! `EventSource` sends it), else `?since=SEQ` (`since=0` replays the whole
//! log), else live from the listener's newest `seq`. Either way the stream
//! sends every transition after that `seq` exactly once, in order, so a
//! client that reconnects with the last id it saw misses nothing and sees
//! nothing twice. `?issue_id=N` keeps one issue's transitions. A
//! non-numeric or negative `since`/`Last-Event-ID`, or an `issue_id` that is
//! not a positive integer, is answered 400 with `{"error": ".."}`.
//!
//! Cost per client: one receiver on the hub's broadcast channel (the one
//! LISTEN connection is shared by every client; a receiver is a cursor into
//! the hub's fixed ring, which a lagging receiver does not grow), at most one
//! page of log rows, and hyper's bounded write buffer: about 45 KiB per open
//! stream in all (`benches/sse.rs`). Each transition is serialised once per
//! service into the very bytes every stream writes (a small cache the
//! streams share), not once per client. Open
//! streams are counted in the `newsnack_sse_clients` gauge. A client that
//! stops reading stops the polling of its stream through TCP back-pressure,
//! so it holds back nobody: when it reads again, its stream notices it was
//! overtaken and reads what it missed from the log.
//!
//! Slow clients: a stream is ended when the transition it is about to send
//! is more than [`MAX_FALL_BEHIND`] (10,000) transitions further behind the
//! newest published one than the stream has ever been since it started,
//! and was published more than [`MAX_DELAY`] (10 s) ago. A live client may
//! thus fall 10,000 behind; a replay from `since=0` may take as long as it
//! needs, as long as it does not lose more than 10,000 of the ground it has
//! gained; and a single commit of many transitions, which puts every client
//! far behind at once, ends no stream that reads it promptly. It ends with a
//! final event
//!
//! ```text
//! event: dropped
//! data: {"reason":"client too slow","resume_after":SEQ}
//! ```
//!
//! where `SEQ` is the last `seq` sent (or the starting point), so the client
//! can reconnect with `Last-Event-ID: SEQ` and read the rest from the log.
//! Streams filtered by `issue_id` carry one issue's few transitions, read
//! through the `(issue_id, seq)` index, and are never dropped for slowness.
//!
//! The same final `dropped` event (with `reason` `"server shutting down"` or
//! `"transition stream failed"`) ends a stream on shutdown, so graceful
//! shutdown never waits for SSE clients, and when the log cannot be read.
//!
//! A start the log has never reached (a browser that followed a service now
//! restarted on a new throwaway database, so its `Last-Event-ID` is beyond
//! the new log) starts at the log's end instead, announced first by
//!
//! ```text
//! id: END
//! event: reset
//! data: {"reason":"..","requested":SEQ,"resume_after":END}
//! ```
//!
//! so the client knows to reload what it shows rather than wait for a
//! position the log may take days to reach.
//!
//! A start older than the log keeps (transitions after it were pruned, see
//! `log_retention_days`) goes on from the oldest kept transition, with no
//! gap after it, announced first by
//!
//! ```text
//! id: OLDEST-1
//! event: reset
//! data: {"oldest":OLDEST}
//! ```
//!
//! and the same is sent if a prune overtakes a stream that is still
//! reading the log.
//! A comment line is sent every [`KEEP_ALIVE`] (15 s) to keep proxies and
//! idle-timeouts from closing a quiet stream.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;
use axum::routing::get;
use axum::Router;

use serde::Deserialize;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::WaitForCancellationFutureOwned;

use super::error::ApiError;
use super::AppState;
use crate::events::hub::{EventHub, ListenerStatus, StartingPoint};
use crate::events::stream::{StreamItem, TransitionStream};
use crate::model::transition::Transition;

/// How often a keep-alive comment is sent on a quiet stream.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// How many transitions a stream may fall behind beyond the smallest lag it
/// has had before it is dropped (see the module docs).
pub const MAX_FALL_BEHIND: i64 = 10_000;

/// How long ago the transition a stream is about to send may have been
/// published, at most, when the stream is that far behind (see the module
/// docs).
pub const MAX_DELAY: Duration = Duration::from_secs(10);

/// The most bytes of events gathered into one write.
const MAX_CHUNK: usize = 64 * 1024;

/// The SSE event name of a transition.
pub const TRANSITION_EVENT: &str = "transition";
/// The SSE event name of the final event of a stream the server ends.
pub const DROPPED_EVENT: &str = "dropped";
/// The SSE event name of the notice that a stream starts at the end of the
/// log rather than at the position asked for, which the log never reached.
pub const RESET_EVENT: &str = "reset";

pub fn router() -> Router<AppState> {
    let cache = Arc::new(EventCache::new());
    Router::new().route(
        "/events",
        get(
            move |state: State<AppState>,
                  headers: HeaderMap,
                  query: Result<Query<EventsQuery>, QueryRejection>| {
                events(state, headers, query, cache.clone())
            },
        ),
    )
}

/// A request parameter that is not what `GET /events` accepts.
#[derive(Debug, thiserror::Error)]
pub enum BadParameter {
    #[error("{name} must be a non-negative integer (a transition seq), got {value:?}")]
    NotASeq { name: &'static str, value: String },
    #[error("issue_id must be a positive integer, got {0:?}")]
    NotAnId(String),
    #[error("{0}")]
    Malformed(String),
}

impl From<BadParameter> for ApiError {
    fn from(e: BadParameter) -> Self {
        ApiError::bad_request(e.to_string())
    }
}

/// The query string, taken as text so bad values get a precise message.
#[derive(Deserialize)]
struct EventsQuery {
    since: Option<String>,
    issue_id: Option<String>,
}

fn parse_seq(name: &'static str, raw: &str) -> Result<i64, BadParameter> {
    match raw.trim().parse::<i64>() {
        Ok(seq) if seq >= 0 => Ok(seq),
        _ => Err(BadParameter::NotASeq {
            name,
            value: raw.to_string(),
        }),
    }
}

fn parse_issue_id(raw: &str) -> Result<i64, BadParameter> {
    match raw.trim().parse::<i64>() {
        Ok(id) if id > 0 => Ok(id),
        _ => Err(BadParameter::NotAnId(raw.to_string())),
    }
}

/// The starting `seq` asked for, if any: `Last-Event-ID` first, then `since`.
fn requested_start(headers: &HeaderMap, since: Option<&str>) -> Result<Option<i64>, BadParameter> {
    if let Some(value) = headers.get("last-event-id") {
        let text = value.to_str().map_err(|_| BadParameter::NotASeq {
            name: "Last-Event-ID",
            value: String::from_utf8_lossy(value.as_bytes()).into_owned(),
        })?;
        return parse_seq("Last-Event-ID", text).map(Some);
    }
    since.map(|s| parse_seq("since", s)).transpose()
}

async fn events(
    State(state): State<AppState>,
    headers: HeaderMap,
    query: Result<Query<EventsQuery>, QueryRejection>,
    cache: Arc<EventCache>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|e| BadParameter::Malformed(e.body_text()))?;
    let issue_id = query.issue_id.as_deref().map(parse_issue_id).transpose()?;
    let requested = requested_start(&headers, query.since.as_deref())?;
    let head = state.hub.status();
    let newest = head.borrow().last_seq;
    // A start the log never reached begins at its end, announced by a
    // `reset` event whose `id:` is that end (a browser's `EventSource`
    // resumes from it from then on).
    let StartingPoint {
        after: start,
        beyond_log,
    } = state.hub.starting_point(requested).await;
    let feed = Feed {
        preface: beyond_log.map(|requested| reset_event(requested, start)),
        stream: state.hub.stream_after(start, issue_id),
        hub: state.hub.clone(),
        cache,
        head,
        shutdown: Box::pin(state.shutdown.clone().cancelled_owned()),
        keep_alive: KeepAlive::new(KEEP_ALIVE),
        sent: start,
        best_lag: issue_id.is_none().then(|| (newest - start).max(0)),
        done: false,
        _connected: crate::metrics::sse_client_connected(),
    };
    let events = futures::stream::unfold(feed, |mut feed| async move {
        if feed.done {
            return None;
        }
        let event = feed.next_event().await;
        Some((Ok::<_, Infallible>(event), feed))
    });
    let mut response = Response::new(Body::from_stream(events));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Tell buffering reverse proxies (nginx) to pass events through at once.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
}

/// `id: END`, `event: reset`, `data: {"reason":..,"requested":..,"resume_after":END}`.
fn reset_event(requested: i64, end: i64) -> Bytes {
    let data = serde_json::json!({
        "reason": "the log has no transition at the position asked for",
        "requested": requested,
        "resume_after": end,
    });
    Bytes::from(format!("id: {end}\nevent: {RESET_EVENT}\ndata: {data}\n\n"))
}

/// `id: OLDEST-1`, `event: reset`, `data: {"oldest":OLDEST}`: what the
/// stream was asked for is older than the log keeps.
fn pruned_event(oldest: i64) -> Bytes {
    let data = serde_json::json!({ "oldest": oldest });
    Bytes::from(format!(
        "id: {}\nevent: {RESET_EVENT}\ndata: {data}\n\n",
        oldest - 1
    ))
}

/// One client's stream and what the slow-client policy needs.
struct Feed {
    /// Sent before any transition: the `reset` notice, if any.
    preface: Option<Bytes>,
    stream: TransitionStream,
    /// For when transitions were published.
    hub: EventHub,
    cache: Arc<EventCache>,
    /// The listener's state: `last_seq` is the newest published transition.
    head: watch::Receiver<ListenerStatus>,
    shutdown: Pin<Box<WaitForCancellationFutureOwned>>,
    keep_alive: KeepAlive,
    /// The last `seq` sent, or the starting point.
    sent: i64,
    /// The smallest lag behind the newest transition seen so far; `None`
    /// for filtered streams, which are never dropped for slowness.
    best_lag: Option<i64>,
    done: bool,
    /// Counts this client in `newsnack_sse_clients` while the stream lives.
    _connected: crate::metrics::GaugeGuard,
}

impl Feed {
    /// What to write next, as it goes on the wire: the next transition's
    /// event and those of any that follow it at once (one write for a burst,
    /// not one per event), or a keep-alive comment; a `dropped` event ends
    /// the stream.
    async fn next_event(&mut self) -> Bytes {
        if let Some(preface) = self.preface.take() {
            return preface;
        }
        let next = tokio::select! {
            biased;
            _ = &mut self.shutdown => return self.end("server shutting down"),
            next = self.stream.next_item() => next,
            _ = self.keep_alive.due() => return Bytes::from_static(b":\n\n"),
        };
        self.keep_alive.sent();
        let transition = match next {
            Ok(StreamItem::Transition(t)) => t,
            Ok(StreamItem::Pruned { oldest }) => {
                self.sent = self.sent.max(oldest - 1);
                return pruned_event(oldest);
            }
            Err(e) => {
                tracing::warn!(error = %e, resume_after = self.sent, "ending an SSE stream");
                return self.end("transition stream failed");
            }
        };
        let first = match self.event(&transition) {
            Ok(event) => event,
            Err(end) => return end,
        };
        // A lone event goes out as the cached bytes themselves, a burst as
        // one chunk.
        let Some(mut transition) = self.stream.try_next() else {
            return first;
        };
        let mut chunk = first.to_vec();
        loop {
            match self.event(&transition) {
                Ok(event) => chunk.extend_from_slice(&event),
                Err(end) => {
                    chunk.extend_from_slice(&end);
                    break;
                }
            }
            if chunk.len() >= MAX_CHUNK {
                break;
            }
            match self.stream.try_next() {
                Some(t) => transition = t,
                None => break,
            }
        }
        Bytes::from(chunk)
    }

    /// The event of a transition about to be sent, or the final event that
    /// ends the stream instead.
    fn event(&mut self, transition: &Transition) -> Result<Bytes, Bytes> {
        if self.too_slow(transition.seq) {
            tracing::info!(
                resume_after = self.sent,
                newest = self.head.borrow().last_seq,
                "dropping a slow SSE client"
            );
            return Err(self.end("client too slow"));
        }
        match self.cache.event(transition) {
            Ok(event) => {
                self.sent = transition.seq;
                Ok(event)
            }
            Err(e) => {
                tracing::error!(error = %e, seq = transition.seq, "cannot serialise a transition");
                Err(self.end("transition stream failed"))
            }
        }
    }

    /// Applies the slow-client policy to the transition about to be sent.
    fn too_slow(&mut self, seq: i64) -> bool {
        let Some(best) = self.best_lag.as_mut() else {
            return false;
        };
        let lag = (self.head.borrow().last_seq - seq).max(0);
        *best = (*best).min(lag);
        lag - *best > MAX_FALL_BEHIND && self.hub.published_ago(seq) > MAX_DELAY
    }

    /// The final event of a stream the server ends.
    fn end(&mut self, reason: &str) -> Bytes {
        self.done = true;
        let data = serde_json::json!({ "reason": reason, "resume_after": self.sent });
        Bytes::from(format!("event: {DROPPED_EVENT}\ndata: {data}\n\n"))
    }
}

/// When a quiet stream owes its client a keep-alive comment: `every` after
/// the last write. A write only moves the deadline; the timer itself is
/// re-armed when it fires, not on every event a busy stream sends.
struct KeepAlive {
    every: Duration,
    quiet_until: Instant,
    timer: Pin<Box<Sleep>>,
}

impl KeepAlive {
    fn new(every: Duration) -> Self {
        KeepAlive {
            every,
            quiet_until: Instant::now() + every,
            timer: Box::pin(tokio::time::sleep(every)),
        }
    }

    /// Something was written: the next comment is due `every` from now.
    fn sent(&mut self) {
        self.quiet_until = Instant::now() + self.every;
    }

    /// Resolves when a comment is due (and counts it as written). Cancel
    /// safe: dropping it mid-wait loses nothing.
    async fn due(&mut self) {
        loop {
            (&mut self.timer).await;
            let now = Instant::now();
            if now >= self.quiet_until {
                self.quiet_until = now + self.every;
                self.timer.as_mut().reset(self.quiet_until);
                return;
            }
            self.timer.as_mut().reset(self.quiet_until);
        }
    }
}

/// Transition events built recently, shared by every client of one router:
/// the clients of a live fan-out all send the same transitions at about the
/// same time, so each is serialised once rather than once per client, and
/// every client sends the same bytes. A slot holds one `seq`; a miss (a
/// client far behind) just builds it again.
struct EventCache {
    slots: Box<[Mutex<Option<CachedEvent>>]>,
}

/// A transition and its SSE event as it goes on the wire.
type CachedEvent = (Transition, Bytes);

impl EventCache {
    const SLOTS: usize = 1024;

    fn new() -> Self {
        EventCache {
            slots: (0..Self::SLOTS).map(|_| Mutex::new(None)).collect(),
        }
    }

    fn event(&self, t: &Transition) -> Result<Bytes, serde_json::Error> {
        let slot = &self.slots[t.seq.rem_euclid(Self::SLOTS as i64) as usize];
        if let Some((cached, event)) = &*slot.lock().unwrap_or_else(|e| e.into_inner()) {
            if cached == t {
                return Ok(event.clone());
            }
        }
        let event = transition_event(t)?;
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some((t.clone(), event.clone()));
        Ok(event)
    }
}

/// `id: SEQ`, `event: transition`, `data: {..}`, as sent.
fn transition_event(t: &Transition) -> Result<Bytes, serde_json::Error> {
    let data = serde_json::to_string(t)?;
    Ok(Bytes::from(format!(
        "id: {}\nevent: {TRANSITION_EVENT}\ndata: {data}\n\n",
        t.seq
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVERY: Duration = Duration::from_secs(15);

    #[tokio::test(start_paused = true)]
    async fn a_quiet_stream_is_due_a_comment_every_interval() {
        let start = Instant::now();
        let mut keep_alive = KeepAlive::new(EVERY);
        keep_alive.due().await;
        assert_eq!(start.elapsed(), EVERY);
        keep_alive.due().await;
        assert_eq!(start.elapsed(), 2 * EVERY);
    }

    #[tokio::test(start_paused = true)]
    async fn each_write_puts_the_next_comment_off() {
        let start = Instant::now();
        let mut keep_alive = KeepAlive::new(EVERY);
        // Writes at 10 s and 20 s: the first comment is due at 35 s, and is
        // not sent at 15 s or 25 s.
        for _ in 0..2 {
            tokio::time::sleep(Duration::from_secs(10)).await;
            keep_alive.sent();
        }
        keep_alive.due().await;
        assert_eq!(start.elapsed(), Duration::from_secs(35));
    }

    #[tokio::test(start_paused = true)]
    async fn an_interrupted_wait_loses_nothing() {
        let start = Instant::now();
        let mut keep_alive = KeepAlive::new(EVERY);
        // A wait dropped at 5 s (as `select!` drops it when an event wins).
        let interrupted = tokio::time::timeout(Duration::from_secs(5), keep_alive.due()).await;
        assert!(interrupted.is_err());
        keep_alive.due().await;
        assert_eq!(start.elapsed(), EVERY);
    }
}
