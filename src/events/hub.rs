//! The subscriber side of the listener: what every task of a process gets
//! from its one LISTEN connection. [`EventHub`] hands out transitions (live,
//! or as gapless streams that recover from the log), where a late reader
//! starts, transitions of a few issues routed to a watch of them, setting
//! changes, issue removals, the LLM budget's doorbells and
//! the listener's status. `Publisher` is the other end, held by
//! [`crate::events::listener::Listener`]: it sends into the hub and never
//! reads from it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, watch};
use tokio_util::sync::DropGuard;

use crate::db::{self, DbPool};
use crate::events::issue_watch::{IssueWatch, IssueWatches};
use crate::events::stream::TransitionStream;
use crate::model::transition::Transition;

/// How many budget doorbells a receiver may fall behind. A doorbell only
/// says "read the budget's tables", which a receiver that lags does anyway.
const BUDGET_DOORBELL_CAPACITY: usize = 256;

/// What the listener is doing, for readiness checks and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListenerStatus {
    /// Listening, on a session that notifications were shown to reach.
    pub connected: bool,
    /// The PostgreSQL backend pid of the listening session.
    pub backend_pid: Option<i32>,
    /// Sessions lost so far.
    pub reconnects: u64,
    /// The last `seq` published to subscribers (watchers are woken when it
    /// moves, after the transitions up to it were sent).
    pub last_seq: i64,
    /// Set when a new session found the log ending at this `seq`, before
    /// `last_seq`: the database was restored from an older backup, or the
    /// log truncated. Transitions numbered again from there look like
    /// repeats and are not published until they pass `last_seq`; the
    /// instance reports not ready until it is restarted.
    pub log_ends_before: Option<i64>,
    /// Why the listener cannot follow the log now, when it cannot: e.g.
    /// notifications sent through the pooled endpoint do not reach its
    /// session (a transaction pooler in the way).
    pub problem: Option<String>,
}

/// Where a reader that asked to start after some `seq` starts (see
/// [`EventHub::starting_point`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartingPoint {
    /// Every transition after this `seq` is delivered.
    pub after: i64,
    /// The `seq` asked for, when the log never reached it and the reader
    /// starts at the log's end (`after`) instead: the reader should say so.
    pub beyond_log: Option<i64>,
}

/// The subscriber side: cheap to clone, shared by every task of a process.
#[derive(Clone)]
pub struct EventHub {
    inner: Arc<HubInner>,
}

struct HubInner {
    events: broadcast::Sender<Transition>,
    watches: Arc<IssueWatches>,
    published: Arc<PublishTimes>,
    status: watch::Receiver<ListenerStatus>,
    settings_changed: watch::Receiver<u64>,
    issues_removed: watch::Receiver<i64>,
    budget_doorbells: broadcast::Sender<String>,
    pool: DbPool,
    /// The listener's endpoint, to say how its session is protected.
    direct: db::Endpoint,
    /// Stops the listener when the last hub is dropped.
    _stop_listener: DropGuard,
}

/// The listener's end of the hub: everything subscribers get goes through
/// it.
pub(crate) struct Publisher {
    events: broadcast::Sender<Transition>,
    watches: Arc<IssueWatches>,
    published: Arc<PublishTimes>,
    status: watch::Sender<ListenerStatus>,
    settings_changed: watch::Sender<u64>,
    issues_removed: watch::Sender<i64>,
    budget_doorbells: broadcast::Sender<String>,
}

impl EventHub {
    /// A hub and the publisher that feeds it. `capacity` transitions are
    /// buffered per subscriber; `stop_listener` is dropped with the last
    /// hub, so a listener nobody hears stops.
    pub(crate) fn new(
        pool: DbPool,
        direct: db::Endpoint,
        capacity: usize,
        stop_listener: DropGuard,
    ) -> (EventHub, Publisher) {
        let (events, _) = broadcast::channel(capacity);
        let (status_tx, status_rx) = watch::channel(ListenerStatus::default());
        let (settings_tx, settings_rx) = watch::channel(0);
        let (removed_tx, removed_rx) = watch::channel(0);
        let (budget_doorbells, _) = broadcast::channel(BUDGET_DOORBELL_CAPACITY);
        let published = Arc::new(PublishTimes::default());
        let watches = Arc::new(IssueWatches::default());
        let publisher = Publisher {
            events: events.clone(),
            watches: watches.clone(),
            published: published.clone(),
            status: status_tx,
            settings_changed: settings_tx,
            issues_removed: removed_tx,
            budget_doorbells: budget_doorbells.clone(),
        };
        let hub = EventHub {
            inner: Arc::new(HubInner {
                events,
                watches,
                published,
                status: status_rx,
                settings_changed: settings_rx,
                issues_removed: removed_rx,
                budget_doorbells,
                pool,
                direct,
                _stop_listener: stop_listener,
            }),
        };
        (hub, publisher)
    }

    /// Live transitions from now on. A receiver that falls more than the
    /// buffer behind gets `Lagged`; use [`EventHub::stream_after`] for a
    /// stream that recovers from the log instead.
    pub fn subscribe(&self) -> broadcast::Receiver<Transition> {
        self.inner.events.subscribe()
    }

    /// A gapless, duplicate-free stream of every transition after `seq`:
    /// history from the log, then live, recovering from the log whenever it
    /// falls behind.
    pub fn stream_after(&self, seq: i64, issue_id: Option<i64>) -> TransitionStream {
        TransitionStream::new(self.inner.pool.clone(), self.subscribe(), seq, issue_id)
    }

    /// The transitions of `issues` from now on, and only theirs (see
    /// [`crate::events::issue_watch`]).
    pub fn watch_issues(&self, issues: &[i64]) -> IssueWatch {
        self.inner.watches.watch(issues)
    }

    /// Where a reader (an SSE client, `newsnack tail`) asking to start
    /// after `requested` starts; `None`: from the newest transition
    /// published, i.e. live from now on.
    ///
    /// A position beyond the newest published one usually means the
    /// listener is a moment behind the log (the reader had the position
    /// from another instance): the reader starts where asked. But a
    /// position the log itself has not reached means the log is not the
    /// one the reader followed (a new throwaway database, or one restored
    /// from an older backup). Waiting for the log to grow past it would
    /// silently skip every transition until then, so the reader starts at
    /// the log's end instead, with [`StartingPoint::beyond_log`] set. If
    /// the log's end cannot be read, it starts where asked.
    pub async fn starting_point(&self, requested: Option<i64>) -> StartingPoint {
        let newest = self.inner.status.borrow().last_seq;
        let at = |after| StartingPoint {
            after,
            beyond_log: None,
        };
        let requested = match requested {
            None => return at(newest),
            Some(seq) if seq <= newest => return at(seq),
            Some(seq) => seq,
        };
        let end = match self.inner.pool.get().await {
            Ok(client) => db::transition::last_seq(&**client).await,
            Err(e) => Err(e.into()),
        };
        match end {
            Ok(end) if requested > end => {
                tracing::info!(
                    requested,
                    end,
                    "asked to start beyond the log; starting at its end"
                );
                StartingPoint {
                    after: end,
                    beyond_log: Some(requested),
                }
            }
            Ok(_) => at(requested),
            Err(e) => {
                tracing::warn!(error = %e, requested, "cannot read the end of the log; starting where asked");
                at(requested)
            }
        }
    }

    /// How long ago the transition `seq` was published here: zero if it
    /// has not been yet, or only just.
    pub fn published_ago(&self, seq: i64) -> Duration {
        self.inner.published.age(seq, Instant::now())
    }

    /// The listener's state; changes whenever it connects, loses its session
    /// or publishes.
    pub fn status(&self) -> watch::Receiver<ListenerStatus> {
        self.inner.status.clone()
    }

    /// Bumped on every `setting_changed` notification and after every
    /// reconnect (when changes may have been missed).
    pub fn settings_changed(&self) -> watch::Receiver<u64> {
        self.inner.settings_changed.clone()
    }

    /// Notified whenever issues were deleted or truncated (and after every
    /// reconnect, when a removal may have been missed), holding the last
    /// `seq` published before the notice: transitions up to it may be of
    /// issues that are gone, and their ids may come back as new issues.
    pub fn issues_removed(&self) -> watch::Receiver<i64> {
        self.inner.issues_removed.clone()
    }

    /// The payloads of `llm_budget` notifications (a holder's name, or `*`)
    /// from now on. Doorbells only: anyone may send one, so a receiver
    /// reads the budget's tables to learn what changed. One missed while
    /// the listener was away is covered by [`EventHub::settings_changed`],
    /// bumped after every reconnect.
    pub fn budget_doorbells(&self) -> broadcast::Receiver<String> {
        self.inner.budget_doorbells.subscribe()
    }

    /// The number of live subscribers.
    pub fn subscriber_count(&self) -> usize {
        self.inner.events.receiver_count()
    }

    /// The number of open [`EventHub::watch_issues`] watches.
    pub fn watch_count(&self) -> usize {
        self.inner.watches.open()
    }

    /// The pool the log is read through.
    pub fn pool(&self) -> &DbPool {
        &self.inner.pool
    }

    /// The direct endpoint the listener's session comes from.
    pub fn direct(&self) -> &db::Endpoint {
        &self.inner.direct
    }
}

impl Publisher {
    /// Sends transitions, in `seq` order, back to back: subscribers woken
    /// by the first find the rest already there and take them in one go.
    /// Then the status's `last_seq` moves, so its watchers wake only once
    /// the transitions up to it were sent.
    pub(crate) fn send_transitions(&self, transitions: impl IntoIterator<Item = Transition>) {
        let mut last = None;
        for t in transitions {
            crate::metrics::transition_published(t.from, t.to);
            last = Some(t.seq);
            self.watches.deliver(&t);
            // No subscribers is fine: the log keeps everything.
            let _ = self.events.send(t);
        }
        if let Some(seq) = last {
            self.published.record(seq, Instant::now());
            self.status.send_modify(|s| s.last_seq = seq);
        }
    }

    /// Changes what [`EventHub::status`] watchers see.
    pub(crate) fn update_status(&self, change: impl FnOnce(&mut ListenerStatus)) {
        self.status.send_modify(change);
    }

    /// Wakes [`EventHub::settings_changed`] watchers.
    pub(crate) fn announce_settings_changed(&self) {
        self.settings_changed.send_modify(|v| *v += 1);
    }

    /// Wakes [`EventHub::issues_removed`] watchers; `seq` is the last one
    /// published before the removal.
    pub(crate) fn announce_removal(&self, seq: i64) {
        self.issues_removed.send_modify(|v| *v = seq);
    }

    /// Passes an `llm_budget` notification's payload on.
    pub(crate) fn ring_budget_doorbell(&self, payload: &str) {
        // Nobody listening is fine: no calls wait here.
        let _ = self.budget_doorbells.send(payload.to_string());
    }
}

impl Drop for Publisher {
    /// Waits on a watch learn that the listener is gone.
    fn drop(&mut self) {
        self.watches.close();
    }
}

/// When transitions were published, coarsely: marks of the newest `seq`
/// published and the instant, at most one per [`PublishTimes::RESOLUTION`]
/// (a later publication within it moves the mark's `seq`, so a `seq` may
/// look up to that much older than it is), the last [`PublishTimes::KEEP`]
/// marks kept (over 13 minutes of continuous publishing; anything older
/// reads as the oldest mark's age).
#[derive(Default)]
struct PublishTimes {
    marks: std::sync::Mutex<VecDeque<(i64, Instant)>>,
}

impl PublishTimes {
    const RESOLUTION: Duration = Duration::from_millis(50);
    const KEEP: usize = 16 * 1024;

    fn record(&self, seq: i64, now: Instant) {
        let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        match marks.back_mut() {
            Some((last, at)) if now.duration_since(*at) < Self::RESOLUTION => *last = seq,
            _ => marks.push_back((seq, now)),
        }
        if marks.len() > Self::KEEP {
            marks.pop_front();
        }
    }

    /// How long before `now` `seq` was published; zero if it was not.
    fn age(&self, seq: i64, now: Instant) -> Duration {
        let marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        let first_reaching = marks.partition_point(|&(published, _)| published < seq);
        marks
            .get(first_reaching)
            .map_or(Duration::ZERO, |&(_, at)| now.saturating_duration_since(at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seq_is_as_old_as_the_first_mark_that_reached_it() {
        let times = PublishTimes::default();
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        times.record(10, at(0));
        times.record(20, at(1000));
        // Within the resolution: moves the last mark's seq, not its time.
        times.record(25, at(1010));
        times.record(30, at(2000));
        let now = at(5000);
        assert_eq!(times.age(5, now), Duration::from_millis(5000));
        assert_eq!(times.age(10, now), Duration::from_millis(5000));
        assert_eq!(times.age(11, now), Duration::from_millis(4000));
        assert_eq!(times.age(25, now), Duration::from_millis(4000));
        assert_eq!(times.age(26, now), Duration::from_millis(3000));
        assert_eq!(times.age(31, now), Duration::ZERO, "not published yet");
    }

    #[test]
    fn only_the_newest_marks_are_kept() {
        let times = PublishTimes::default();
        let start = Instant::now();
        let n = PublishTimes::KEEP as u64 + 10;
        for i in 0..n {
            times.record(i as i64, start + PublishTimes::RESOLUTION * i as u32);
        }
        assert_eq!(times.marks.lock().unwrap().len(), PublishTimes::KEEP);
        let now = start + PublishTimes::RESOLUTION * n as u32;
        // Older than every mark kept: as old as the oldest.
        assert_eq!(
            times.age(0, now),
            PublishTimes::RESOLUTION * PublishTimes::KEEP as u32
        );
    }
}
