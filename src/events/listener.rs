//! The one LISTEN connection of a process and the hub that fans its
//! transitions out to any number of in-process subscribers.
//!
//! `issue_transition` is the truth. Anyone may send a notification on any
//! channel, so a payload is published only when the log's trigger signed
//! it (a MAC with a key only the owner reads, migrations 18 and 20) and it
//! follows the last published `seq`. Any other notification that names a
//! `seq` not yet published is a doorbell: the listener reads the log after
//! the last published `seq`, and what the log holds is published, strictly
//! in `seq` order, each exactly once. A forged notification thus reaches no
//! subscriber and cannot make a real transition look like a repeat.
//! Notifications already queued (a commit's transitions arrive together)
//! are taken in one go, so one read serves them all.
//!
//! The listener owns a dedicated session outside the pool (a pool drives
//! its connections itself and would drop notifications), on the direct
//! endpoint: through a transaction pooler a LISTEN outlives nothing. Each
//! new session proves that notifications reach it: a NOTIFY sent through
//! the pooled endpoint (the way the service's own transitions are
//! committed) must arrive; until one does, the listener reports the problem
//! and is not ready.
//!
//! A lost connection (network, `pg_terminate_backend`, server restart) is
//! retried with capped exponential backoff, then the log is read from the
//! last published `seq`; TCP keepalive plus a health query every few
//! seconds make sure a half-open connection, or a server that went into
//! recovery (a demoted primary), is noticed.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::{broadcast, mpsc, watch};
use tokio_postgres::{AsyncMessage, Client, Notification};
use tokio_util::sync::CancellationToken;

use crate::db::{self, DbError, DbPool};
use crate::events::stream::TransitionStream;
use crate::model::transition::{NotificationKey, Transition};

/// The channel transitions are announced on (fixed by the contract).
pub const TRANSITION_CHANNEL: &str = "issue_transition";
/// The channel setting changes are announced on.
pub const SETTINGS_CHANNEL: &str = "setting_changed";
/// Notified when issues are deleted or truncated (migration 12).
pub const REMOVAL_CHANNEL: &str = "issue_removed";
/// Rung for the holders of LLM calls the shared budget granted (payload:
/// the holder), and for a pause (payload `*`); see migration 17.
pub const BUDGET_CHANNEL: &str = "llm_budget";
/// The channel a new listening session proves delivery on.
pub const PROBE_CHANNEL: &str = "newsnack_listener_probe";

/// How the listener behaves; the defaults suit production.
#[derive(Debug, Clone)]
pub struct ListenerOptions {
    /// How often the listening session is asked `SELECT 1`.
    pub health_interval: Duration,
    /// How long that query may take before the session is declared dead.
    pub health_timeout: Duration,
    /// First and largest pause between reconnect attempts.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Transitions buffered per subscriber before it lags and must re-read
    /// the log.
    pub capacity: usize,
    /// How long a new session waits for its delivery probe.
    pub probe_timeout: Duration,
    /// Publishes a notification's payload as it comes, without reading the
    /// log: what the listener did before payloads stopped being trusted.
    /// Forgeable; kept only so a benchmark can measure what reading the
    /// log costs against it in one run.
    #[doc(hidden)]
    pub trust_payloads: bool,
    /// Reads the log on every notification, signed or not: what the
    /// listener does when it cannot read the key. Kept so a benchmark can
    /// measure it against the signed payloads in one run.
    #[doc(hidden)]
    pub read_log_always: bool,
}

impl Default for ListenerOptions {
    fn default() -> Self {
        ListenerOptions {
            health_interval: Duration::from_secs(5),
            health_timeout: Duration::from_secs(3),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            capacity: 4096,
            probe_timeout: Duration::from_secs(5),
            trust_payloads: false,
            read_log_always: false,
        }
    }
}

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
/// [`TransitionHub::starting_point`]).
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
pub struct TransitionHub {
    inner: Arc<HubInner>,
}

struct HubInner {
    events: broadcast::Sender<Transition>,
    published: Arc<PublishTimes>,
    status: watch::Receiver<ListenerStatus>,
    settings_changed: watch::Receiver<u64>,
    issues_removed: watch::Receiver<i64>,
    budget_doorbells: broadcast::Sender<String>,
    pool: DbPool,
    /// The listener's endpoint, to say how its session is protected.
    direct: db::Endpoint,
    /// Stops the listener when the last hub is dropped.
    _stop_listener: tokio_util::sync::DropGuard,
}

impl TransitionHub {
    /// Live transitions from now on. A receiver that falls more than the
    /// buffer behind gets `Lagged`; use [`TransitionHub::stream_after`] for a
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
    /// the listener was away is covered by [`TransitionHub::settings_changed`],
    /// bumped after every reconnect.
    pub fn budget_doorbells(&self) -> broadcast::Receiver<String> {
        self.inner.budget_doorbells.subscribe()
    }

    /// The number of live subscribers.
    pub fn subscriber_count(&self) -> usize {
        self.inner.events.receiver_count()
    }

    pub fn pool(&self) -> &DbPool {
        &self.inner.pool
    }

    /// The direct endpoint the listener's session comes from.
    pub fn direct(&self) -> &db::Endpoint {
        &self.inner.direct
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

/// The owner of the LISTEN connection.
pub struct Listener {
    /// The direct endpoint: LISTEN needs a session of its own.
    endpoint: db::Endpoint,
    /// The pooled endpoint, which delivery probes are sent through.
    pooled: db::Endpoint,
    options: ListenerOptions,
    events: broadcast::Sender<Transition>,
    published: Arc<PublishTimes>,
    status: watch::Sender<ListenerStatus>,
    settings_changed: watch::Sender<u64>,
    issues_removed: watch::Sender<i64>,
    budget_doorbells: broadcast::Sender<String>,
    last_seq: i64,
    /// Read and in order, not yet sent to subscribers (see
    /// [`Listener::flush`]).
    unsent: Vec<Transition>,
    /// What notifications signed by the log's trigger are checked with,
    /// read on every new session; `None` when it cannot be read.
    key: Option<NotificationKey>,
}

/// A connected, listening session.
struct Session {
    client: Client,
    notifications: mpsc::UnboundedReceiver<Notification>,
    backend_pid: i32,
}

/// Why a session ended.
enum SessionEnd {
    Shutdown,
    Lost(String),
}

impl Listener {
    /// Connects, starts listening, and runs the listener on a thread of its
    /// own until `shutdown` or until the last hub is dropped. Publishing
    /// starts after the newest `seq` in the log at start-up; history is read
    /// through [`TransitionHub::stream_after`]. Fails if the first connection
    /// fails, so a bad URL is reported at start-up rather than retried.
    pub async fn start(
        endpoint: db::Endpoint,
        pool: DbPool,
        options: ListenerOptions,
        shutdown: CancellationToken,
    ) -> Result<(TransitionHub, tokio::task::JoinHandle<()>), DbError> {
        let (events, _) = broadcast::channel(options.capacity);
        let (status_tx, status_rx) = watch::channel(ListenerStatus::default());
        let (settings_tx, settings_rx) = watch::channel(0);
        let (removed_tx, removed_rx) = watch::channel(0);
        let (budget_doorbells, _) = broadcast::channel(256);
        let published = Arc::new(PublishTimes::default());
        let direct = endpoint.clone();
        let mut listener = Listener {
            endpoint,
            pooled: pool.endpoint().clone(),
            options,
            events: events.clone(),
            published: published.clone(),
            status: status_tx,
            settings_changed: settings_tx,
            issues_removed: removed_tx,
            budget_doorbells: budget_doorbells.clone(),
            last_seq: 0,
            unsent: Vec::new(),
            key: None,
        };
        let stop = shutdown.child_token();
        let stop_listener = stop.clone().drop_guard();
        // The listener runs on a thread of its own, so a busy runtime (say,
        // hundreds of SSE streams being written) never queues the intake of
        // notifications behind other tasks.
        let (ready_tx, ready) = tokio::sync::oneshot::channel::<Result<(), DbError>>();
        let (ended_tx, ended) = tokio::sync::oneshot::channel::<()>();
        let spawned = std::thread::Builder::new()
            .name("newsnack-listener".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = ready_tx.send(Err(DbError::Invalid(format!(
                            "cannot start the listener's runtime: {e}"
                        ))));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let first = async {
                        let session = listener.connect().await?;
                        listener.last_seq = db::transition::last_seq(&session.client).await?;
                        Ok::<_, DbError>(session)
                    };
                    match first.await {
                        Ok(mut session) => {
                            // Ready once the first session is proven (or
                            // known not to receive notifications).
                            let delivery = listener.prove_delivery(&mut session).await;
                            match &delivery {
                                Ok(_) => listener.mark_connected(&session),
                                Err(problem) => {
                                    let seq = listener.last_seq;
                                    listener.status.send_modify(|s| {
                                        s.last_seq = seq;
                                        s.problem = Some(problem.clone());
                                    });
                                }
                            }
                            let _ = ready_tx.send(Ok(()));
                            listener.run(session, delivery, stop).await;
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                });
                let _ = ended_tx.send(());
            })
            .map_err(|e| DbError::Invalid(format!("cannot start the listener thread: {e}")))?;
        drop(spawned);
        ready.await.map_err(|_| {
            DbError::Invalid("the listener thread ended before connecting".into())
        })??;
        let hub = TransitionHub {
            inner: Arc::new(HubInner {
                events,
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
        let task = tokio::spawn(async move {
            let _ = ended.await;
        });
        Ok((hub, task))
    }

    /// Serves sessions until shutdown: the first (already proven or not),
    /// then new ones after each loss, each proven before it is served.
    async fn run(
        mut self,
        first: Session,
        first_delivery: Result<Vec<Notification>, String>,
        shutdown: CancellationToken,
    ) {
        let mut next = Some((first, first_delivery));
        // `start` read the log position on the first session after LISTEN,
        // so it has nothing to catch up on.
        let mut resumed = false;
        let mut backoff = self.options.backoff_min;
        loop {
            let (session, delivery) = match next.take() {
                Some(first) => first,
                None => match self.connect().await {
                    Ok(mut s) => {
                        let delivery = self.prove_delivery(&mut s).await;
                        (s, delivery)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, retry_in = ?backoff, "listener cannot reconnect");
                        self.status
                            .send_modify(|s| s.problem = Some(format!("cannot connect: {e}")));
                        if pause(backoff, &shutdown).await {
                            return;
                        }
                        backoff = (backoff * 2).min(self.options.backoff_max);
                        continue;
                    }
                },
            };
            let end = match delivery {
                Ok(early) => {
                    let end = self
                        .serve(session, early, resumed, &shutdown, &mut backoff)
                        .await;
                    resumed = true;
                    end
                }
                Err(problem) => {
                    tracing::error!(%problem, "the listener's session does not receive notifications");
                    self.status.send_modify(|s| {
                        s.connected = false;
                        s.problem = Some(problem);
                    });
                    resumed = true;
                    SessionEnd::Lost("notifications do not arrive".into())
                }
            };
            match end {
                SessionEnd::Shutdown => return,
                SessionEnd::Lost(reason) => {
                    tracing::warn!(%reason, "listener lost its session; reconnecting");
                    crate::metrics::listener_reconnecting();
                    self.status.send_modify(|s| {
                        s.connected = false;
                        s.backend_pid = None;
                        s.reconnects += 1;
                    });
                    if pause(backoff, &shutdown).await {
                        return;
                    }
                    backoff = (backoff * 2).min(self.options.backoff_max);
                }
            }
        }
    }

    /// Catches up from the log, then publishes what notifications ring in
    /// until the session ends. `early` are notifications that arrived
    /// while the session was being proven.
    async fn serve(
        &mut self,
        mut session: Session,
        early: Vec<Notification>,
        resumed: bool,
        shutdown: &CancellationToken,
        backoff: &mut Duration,
    ) -> SessionEnd {
        if let Err(e) = self.read_key(&session.client).await {
            return SessionEnd::Lost(format!("cannot read the notification key: {e}"));
        }
        // LISTEN is already active, so nothing can fall between this read
        // and the first notification.
        if let Err(e) = self.catch_up(&session.client).await {
            return SessionEnd::Lost(format!("catch-up failed: {e}"));
        }
        if resumed {
            match db::transition::last_seq(&session.client).await {
                Ok(end) if end < self.last_seq => {
                    tracing::error!(
                        log_ends_at = end,
                        published = self.last_seq,
                        "the transition log ends before what this instance published (a restored or truncated log): restart this instance to follow it"
                    );
                    self.status.send_modify(|s| s.log_ends_before = Some(end));
                }
                Ok(_) => {}
                Err(e) => return SessionEnd::Lost(format!("cannot read the log's end: {e}")),
            }
        }
        self.mark_connected(&session);
        if resumed {
            // Setting changes and removals may have been missed while
            // disconnected.
            self.settings_changed.send_modify(|v| *v += 1);
            self.announce_removal();
        }
        *backoff = self.options.backoff_min;
        if let Err(e) = self.on_notifications(&session.client, early).await {
            return SessionEnd::Lost(format!("catch-up failed: {e}"));
        }

        let mut health = tokio::time::interval(self.options.health_interval);
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        health.tick().await;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return SessionEnd::Shutdown,
                note = session.notifications.recv() => {
                    let Some(note) = note else {
                        return SessionEnd::Lost("connection closed".into());
                    };
                    // Everything already received (a commit's transitions
                    // arrive together) is taken in one go.
                    let mut batch = vec![note];
                    while let Ok(next) = session.notifications.try_recv() {
                        batch.push(next);
                    }
                    if let Err(e) = self.on_notifications(&session.client, batch).await {
                        return SessionEnd::Lost(format!("catch-up failed: {e}"));
                    }
                }
                _ = health.tick() => {
                    // A server in recovery (a primary demoted by a
                    // failover) no longer sees the transitions committed on
                    // the new one: such a session is dropped.
                    let probe = session.client.simple_query("SELECT pg_is_in_recovery()");
                    match tokio::time::timeout(self.options.health_timeout, probe).await {
                        Ok(Ok(rows)) if in_recovery(&rows) => {
                            return SessionEnd::Lost("the server is in recovery (a standby, or a primary demoted by a failover)".into())
                        }
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => return SessionEnd::Lost(format!("health query failed: {e}")),
                        Err(_) => return SessionEnd::Lost("health query timed out".into()),
                    }
                }
            }
        }
    }

    /// Takes a batch of notifications in order. A transition signed by the
    /// log's trigger that follows the last one published is published as
    /// it comes; any other (unsigned, signed with another key, after a gap)
    /// is a doorbell: the log is read, once for the batch, before anything
    /// that must come after it. Setting changes and removals are announced.
    async fn on_notifications(
        &mut self,
        client: &Client,
        batch: Vec<Notification>,
    ) -> Result<(), DbError> {
        // The highest `seq` a doorbell named that is not yet published.
        let mut rung: Option<i64> = None;
        // The highest `seq` whose MAC did not check out: if the log holds
        // it, the key was rotated.
        let mut unsigned: Option<i64> = None;
        for note in batch {
            match note.channel() {
                TRANSITION_CHANNEL if self.options.trust_payloads => {
                    self.on_trusted_payload(client, &note).await?
                }
                TRANSITION_CHANNEL => {
                    match self.key.as_ref().and_then(|key| key.verify(note.payload())) {
                        Some(t) if t.seq <= self.last_seq => {}
                        Some(t) if t.seq == self.last_seq + 1 => self.publish(t),
                        Some(t) => rung = rung.max(Some(t.seq)),
                        None => match Transition::from_payload(note.payload()) {
                            Ok(t) if t.seq <= self.last_seq => {}
                            Ok(t) => {
                                rung = rung.max(Some(t.seq));
                                unsigned = unsigned.max(Some(t.seq));
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, payload = note.payload(), "unreadable transition payload; reading the log");
                                rung = rung.max(Some(self.last_seq + 1));
                            }
                        },
                    }
                }
                SETTINGS_CHANNEL => self.settings_changed.send_modify(|v| *v += 1),
                BUDGET_CHANNEL => {
                    // Nobody listening is fine: no calls wait here.
                    let _ = self.budget_doorbells.send(note.payload().to_string());
                }
                REMOVAL_CHANNEL => {
                    // The removal comes after every transition rung before
                    // it: those are read first.
                    if rung.take().is_some() {
                        self.catch_up(client).await?;
                    }
                    self.announce_removal();
                }
                other => tracing::debug!(channel = other, "ignoring notification"),
            }
        }
        if let Some(rung) = rung {
            self.catch_up(client).await?;
            if rung > self.last_seq {
                crate::metrics::unverified_notification();
                tracing::warn!(
                    seq = rung,
                    log_ends_at = self.last_seq,
                    "a notification named a transition the log does not hold (sent by hand?); ignored"
                );
            }
        }
        if unsigned.is_some_and(|seq| seq <= self.last_seq) && self.key.is_some() {
            tracing::info!("a transition the log holds came with a MAC this listener's key does not make: reading the key again");
            self.read_key(client).await?;
        }
        self.flush();
        Ok(())
    }

    /// Reads the key the log's trigger signs with.
    async fn read_key(&mut self, client: &Client) -> Result<(), DbError> {
        if self.options.read_log_always {
            return Ok(());
        }
        self.key = db::transition::notification_key(client)
            .await?
            .map(|key| NotificationKey::new(&key));
        Ok(())
    }

    /// The old way, for measurement only (see
    /// [`ListenerOptions::trust_payloads`]).
    async fn on_trusted_payload(
        &mut self,
        client: &Client,
        note: &Notification,
    ) -> Result<(), DbError> {
        match Transition::from_payload(note.payload()) {
            Ok(t) if t.seq <= self.last_seq => Ok(()),
            Ok(t) if t.seq == self.last_seq + 1 => {
                self.publish(t);
                self.flush();
                Ok(())
            }
            _ => self.catch_up(client).await,
        }
    }

    /// Publishes everything in the log after the last published `seq`.
    async fn catch_up(&mut self, client: &Client) -> Result<(), DbError> {
        const PAGE: i64 = 1000;
        loop {
            self.flush();
            let page = db::transition::read_page(client, self.last_seq, None, PAGE).await?;
            if let Some(oldest) = page.pruned_to {
                // Away longer than the log is kept: what was pruned in
                // between is gone, and readers of the log learn of it.
                tracing::warn!(
                    published = self.last_seq,
                    oldest,
                    "transitions after the last one published were pruned; going on from the oldest kept"
                );
            }
            let page = page.transitions;
            let full = page.len() as i64 == PAGE;
            for t in page {
                self.publish(t);
            }
            if !full {
                self.flush();
                return Ok(());
            }
        }
    }

    /// Takes the next transition in `seq` order; [`Listener::flush`] sends.
    fn publish(&mut self, t: Transition) {
        self.last_seq = t.seq;
        self.unsent.push(t);
    }

    /// Sends what was published, back to back: subscribers woken by the
    /// first find the rest already there and take them in one go.
    fn flush(&mut self) {
        if self.unsent.is_empty() {
            return;
        }
        for t in self.unsent.drain(..) {
            crate::metrics::transition_published(t.from, t.to);
            // No subscribers is fine: the log keeps everything.
            let _ = self.events.send(t);
        }
        let seq = self.last_seq;
        self.published.record(seq, Instant::now());
        self.status.send_modify(|s| s.last_seq = seq);
    }

    fn mark_connected(&self, session: &Session) {
        let seq = self.last_seq;
        self.status.send_modify(|s| {
            s.connected = true;
            s.backend_pid = Some(session.backend_pid);
            s.last_seq = seq;
            s.problem = None;
        });
    }

    /// Tells watchers that issues were removed, as of the last `seq` read:
    /// notifications arrive in commit order, so every transition committed
    /// before the removal has been read by now.
    fn announce_removal(&mut self) {
        let seq = self.last_seq;
        self.issues_removed.send_modify(|v| *v = seq);
    }

    async fn connect(&self) -> Result<Session, DbError> {
        let (client, mut connection, _) = self.endpoint.connect_raw().await?;
        let (tx, notifications) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(n)) => {
                        if tx.send(n).is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "listening connection ended");
                        return;
                    }
                }
            }
        });
        client
            .batch_execute(&format!(
                "LISTEN {TRANSITION_CHANNEL}; LISTEN {SETTINGS_CHANNEL}; LISTEN {REMOVAL_CHANNEL}; \
                 LISTEN {BUDGET_CHANNEL}; LISTEN {PROBE_CHANNEL}"
            ))
            .await?;
        let backend_pid: i32 = client
            .query_one("SELECT pg_backend_pid()", &[])
            .await?
            .get(0);
        tracing::info!(backend_pid, "listener connected");
        Ok(Session {
            client,
            notifications,
            backend_pid,
        })
    }
}

impl Listener {
    /// Shows that notifications committed through the pooled endpoint reach
    /// `session`: sends one there, from a session of its own, and waits for
    /// it. Returns what else arrived meanwhile, or why it is not so.
    async fn prove_delivery(&self, session: &mut Session) -> Result<Vec<Notification>, String> {
        let token = format!("{}:{:016x}", session.backend_pid, rand::random::<u64>());
        let sent = async {
            let notifier = self.pooled.connect().await?;
            notifier
                .query_typed(
                    "SELECT pg_notify($1, $2)",
                    &[
                        (&PROBE_CHANNEL, tokio_postgres::types::Type::TEXT),
                        (&token, tokio_postgres::types::Type::TEXT),
                    ],
                )
                .await?;
            Ok::<_, DbError>(())
        };
        if let Err(e) = sent.await {
            return Err(format!("cannot send the delivery probe: {e}"));
        }
        let deadline = tokio::time::Instant::now() + self.options.probe_timeout;
        let mut early = Vec::new();
        loop {
            match tokio::time::timeout_at(deadline, session.notifications.recv()).await {
                Ok(Some(note)) if note.channel() == PROBE_CHANNEL && note.payload() == token => {
                    return Ok(early)
                }
                Ok(Some(note)) => early.push(note),
                Ok(None) => {
                    return Err(format!(
                        "the listening session closed before a notification sent through the database URL reached it: {POOLER_HINT}"
                    ))
                }
                Err(_) => {
                    return Err(format!(
                        "a notification sent through the database URL did not reach the listening session within {:?}: {POOLER_HINT}",
                        self.options.probe_timeout
                    ))
                }
            }
        }
    }
}

/// What to do when notifications do not reach the listener.
const POOLER_HINT: &str =
    "if DATABASE_URL goes through a transaction pooler (PgBouncer, RDS Proxy, \
     Supavisor), set NEWSNACK_DIRECT_DATABASE_URL to a URL that reaches PostgreSQL directly";

/// Whether a `SELECT pg_is_in_recovery()` said true.
fn in_recovery(rows: &[tokio_postgres::SimpleQueryMessage]) -> bool {
    rows.iter()
        .any(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("t")))
}

/// Sleeps unless shut down first; true when shut down.
async fn pause(duration: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(duration) => false,
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
