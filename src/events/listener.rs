//! The one LISTEN connection of a process: it connects, listens, proves
//! that notifications reach it, catches up from the log, reconnects, and
//! publishes into the [`EventHub`] that subscribers read (see
//! [`crate::events::hub`]).
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

use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio_postgres::{AsyncMessage, Client, Notification};
use tokio_util::sync::CancellationToken;

use crate::db::{self, DbError, DbPool};
use crate::events::hub::{EventHub, Publisher};
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

/// The owner of the LISTEN connection.
pub struct Listener {
    /// The direct endpoint: LISTEN needs a session of its own.
    endpoint: db::Endpoint,
    /// The pooled endpoint, which delivery probes are sent through.
    pooled: db::Endpoint,
    options: ListenerOptions,
    /// Where everything read is published for subscribers.
    hub: Publisher,
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

/// What proving delivery on a new session found: the notifications that
/// arrived meanwhile, or why notifications do not arrive.
type Delivery = Result<Vec<Notification>, String>;

/// Why a session ended.
enum SessionEnd {
    Shutdown,
    Lost(String),
}

/// The `seq`s a batch of transition notifications named that the listener
/// cannot publish as they come.
#[derive(Default)]
struct Doorbells {
    /// The highest `seq` not yet published: the log is read up to it.
    rung: Option<i64>,
    /// The highest `seq` whose MAC did not check out: if the log holds it,
    /// the key was rotated.
    unsigned: Option<i64>,
}

impl Listener {
    /// Connects, starts listening, and runs the listener on a thread of its
    /// own until `shutdown` or until the last hub is dropped. Publishing
    /// starts after the newest `seq` in the log at start-up; history is read
    /// through [`EventHub::stream_after`]. Fails if the first connection
    /// fails, so a bad URL is reported at start-up rather than retried.
    pub async fn start(
        endpoint: db::Endpoint,
        pool: DbPool,
        options: ListenerOptions,
        shutdown: CancellationToken,
    ) -> Result<(EventHub, tokio::task::JoinHandle<()>), DbError> {
        let stop = shutdown.child_token();
        let (hub, publisher) = EventHub::new(
            pool.clone(),
            endpoint.clone(),
            options.capacity,
            stop.clone().drop_guard(),
        );
        let listener = Listener {
            endpoint,
            pooled: pool.endpoint().clone(),
            options,
            hub: publisher,
            last_seq: 0,
            unsent: Vec::new(),
            key: None,
        };
        let (connected_tx, connected) = oneshot::channel();
        let ended = listener.spawn_thread(connected_tx, stop)?;
        connected.await.map_err(|_| {
            DbError::Invalid("the listener thread ended before connecting".into())
        })??;
        let task = tokio::spawn(async move {
            let _ = ended.await;
        });
        Ok((hub, task))
    }

    /// Runs the listener on a thread of its own, so a busy runtime (say,
    /// hundreds of SSE streams being written) never queues the intake of
    /// notifications behind other tasks. `connected` hears what the first
    /// connection came to; the receiver returned hears when the thread ends.
    fn spawn_thread(
        self,
        connected: oneshot::Sender<Result<(), DbError>>,
        stop: CancellationToken,
    ) -> Result<oneshot::Receiver<()>, DbError> {
        let (ended_tx, ended) = oneshot::channel();
        std::thread::Builder::new()
            .name("newsnack-listener".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                match runtime {
                    Ok(runtime) => runtime.block_on(self.open_and_run(connected, stop)),
                    Err(e) => {
                        let _ = connected.send(Err(DbError::Invalid(format!(
                            "cannot start the listener's runtime: {e}"
                        ))));
                    }
                }
                let _ = ended_tx.send(());
            })
            .map_err(|e| DbError::Invalid(format!("cannot start the listener thread: {e}")))?;
        Ok(ended)
    }

    /// Opens the first session, tells `connected` how that went, and on
    /// success serves until shutdown.
    async fn open_and_run(
        mut self,
        connected: oneshot::Sender<Result<(), DbError>>,
        stop: CancellationToken,
    ) {
        match self.open_first_session().await {
            Ok((session, delivery)) => {
                let _ = connected.send(Ok(()));
                self.run(session, delivery, stop).await;
            }
            Err(e) => {
                let _ = connected.send(Err(e));
            }
        }
    }

    /// Connects, starts publishing after the newest `seq` in the log, and
    /// proves delivery. The listener is ready once the first session is
    /// proven, or known not to receive notifications: the status says which.
    async fn open_first_session(&mut self) -> Result<(Session, Delivery), DbError> {
        let mut session = self.connect().await?;
        self.last_seq = db::transition::last_seq(&session.client).await?;
        let delivery = self.prove_delivery(&mut session).await;
        match &delivery {
            Ok(_) => self.mark_connected(&session),
            Err(problem) => {
                let seq = self.last_seq;
                self.hub.update_status(|s| {
                    s.last_seq = seq;
                    s.problem = Some(problem.clone());
                });
            }
        }
        Ok((session, delivery))
    }

    /// Serves sessions until shutdown: the first (already proven or not),
    /// then new ones after each loss, each proven before it is served.
    async fn run(mut self, first: Session, first_delivery: Delivery, shutdown: CancellationToken) {
        let mut next = Some((first, first_delivery));
        // `start` read the log position on the first session after LISTEN,
        // so it has nothing to catch up on.
        let mut resumed = false;
        let mut backoff = self.options.backoff_min;
        loop {
            let (session, delivery) = match next.take() {
                Some(first) => first,
                None => match self.reconnect(&mut backoff, &shutdown).await {
                    Some(proven) => proven,
                    None => return,
                },
            };
            let end = match delivery {
                Ok(early) => {
                    self.serve(session, early, resumed, &shutdown, &mut backoff)
                        .await
                }
                Err(problem) => {
                    tracing::error!(%problem, "the listener's session does not receive notifications");
                    self.hub.update_status(|s| {
                        s.connected = false;
                        s.problem = Some(problem);
                    });
                    SessionEnd::Lost("notifications do not arrive".into())
                }
            };
            resumed = true;
            match end {
                SessionEnd::Shutdown => return,
                SessionEnd::Lost(reason) => {
                    tracing::warn!(%reason, "listener lost its session; reconnecting");
                    crate::metrics::listener_reconnecting();
                    self.hub.update_status(|s| {
                        s.connected = false;
                        s.backend_pid = None;
                        s.reconnects += 1;
                    });
                    if self.pause(&mut backoff, &shutdown).await {
                        return;
                    }
                }
            }
        }
    }

    /// Connects again until it succeeds, pausing with capped backoff after
    /// each failure, and proves the new session; `None` on shutdown.
    async fn reconnect(
        &mut self,
        backoff: &mut Duration,
        shutdown: &CancellationToken,
    ) -> Option<(Session, Delivery)> {
        loop {
            match self.connect().await {
                Ok(mut session) => {
                    let delivery = self.prove_delivery(&mut session).await;
                    return Some((session, delivery));
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?*backoff, "listener cannot reconnect");
                    self.hub
                        .update_status(|s| s.problem = Some(format!("cannot connect: {e}")));
                    if self.pause(backoff, shutdown).await {
                        return None;
                    }
                }
            }
        }
    }

    /// Sleeps for `backoff` unless shut down first (then true), and doubles
    /// it up to the largest pause.
    async fn pause(&self, backoff: &mut Duration, shutdown: &CancellationToken) -> bool {
        let shut_down = tokio::select! {
            _ = shutdown.cancelled() => true,
            _ = tokio::time::sleep(*backoff) => false,
        };
        *backoff = (*backoff * 2).min(self.options.backoff_max);
        shut_down
    }

    /// Catches up, then publishes what notifications ring in until the
    /// session ends. `early` are notifications that arrived while the
    /// session was being proven.
    async fn serve(
        &mut self,
        session: Session,
        early: Vec<Notification>,
        resumed: bool,
        shutdown: &CancellationToken,
        backoff: &mut Duration,
    ) -> SessionEnd {
        if let Err(end) = self.begin_session(&session, resumed).await {
            return end;
        }
        *backoff = self.options.backoff_min;
        if let Err(e) = self.on_notifications(&session.client, early).await {
            return SessionEnd::Lost(format!("catch-up failed: {e}"));
        }
        self.follow(session, shutdown).await
    }

    /// Reads the key and catches up from the log on a new session; on a
    /// resumed one, also checks that the log did not go back, and tells
    /// watchers that setting changes and removals may have been missed.
    async fn begin_session(&mut self, session: &Session, resumed: bool) -> Result<(), SessionEnd> {
        if let Err(e) = self.read_key(&session.client).await {
            return Err(SessionEnd::Lost(format!(
                "cannot read the notification key: {e}"
            )));
        }
        // LISTEN is already active, so nothing can fall between this read
        // and the first notification.
        if let Err(e) = self.catch_up(&session.client).await {
            return Err(SessionEnd::Lost(format!("catch-up failed: {e}")));
        }
        if resumed {
            match db::transition::last_seq(&session.client).await {
                Ok(end) if end < self.last_seq => {
                    tracing::error!(
                        log_ends_at = end,
                        published = self.last_seq,
                        "the transition log ends before what this instance published (a restored or truncated log): restart this instance to follow it"
                    );
                    self.hub.update_status(|s| s.log_ends_before = Some(end));
                }
                Ok(_) => {}
                Err(e) => return Err(SessionEnd::Lost(format!("cannot read the log's end: {e}"))),
            }
        }
        self.mark_connected(session);
        if resumed {
            // Setting changes and removals may have been missed while
            // disconnected.
            self.hub.announce_settings_changed();
            self.announce_removal();
        }
        Ok(())
    }

    /// Publishes what notifications ring in, and asks the session's health
    /// every few seconds, until shutdown or until the session is lost.
    async fn follow(&mut self, mut session: Session, shutdown: &CancellationToken) -> SessionEnd {
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
        let mut doorbells = Doorbells::default();
        for note in batch {
            match note.channel() {
                TRANSITION_CHANNEL if self.options.trust_payloads => {
                    self.on_trusted_payload(client, &note).await?
                }
                TRANSITION_CHANNEL => self.on_transition(note.payload(), &mut doorbells),
                SETTINGS_CHANNEL => self.hub.announce_settings_changed(),
                BUDGET_CHANNEL => self.hub.ring_budget_doorbell(note.payload()),
                REMOVAL_CHANNEL => {
                    // The removal comes after every transition rung before
                    // it: those are read first.
                    if doorbells.rung.take().is_some() {
                        self.catch_up(client).await?;
                    }
                    self.announce_removal();
                }
                other => tracing::debug!(channel = other, "ignoring notification"),
            }
        }
        if let Some(rung) = doorbells.rung {
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
        if doorbells.unsigned.is_some_and(|seq| seq <= self.last_seq) && self.key.is_some() {
            tracing::info!("a transition the log holds came with a MAC this listener's key does not make: reading the key again");
            self.read_key(client).await?;
        }
        self.flush();
        Ok(())
    }

    /// Publishes a transition notification's payload when the log's trigger
    /// signed it and it follows the last one published; otherwise notes it
    /// in `doorbells`, unless it names a `seq` already published.
    fn on_transition(&mut self, payload: &str, doorbells: &mut Doorbells) {
        match self.key.as_ref().and_then(|key| key.verify(payload)) {
            Some(t) if t.seq <= self.last_seq => {}
            Some(t) if t.seq == self.last_seq + 1 => self.publish(t),
            Some(t) => doorbells.rung = doorbells.rung.max(Some(t.seq)),
            None => match Transition::from_payload(payload) {
                Ok(t) if t.seq <= self.last_seq => {}
                Ok(t) => {
                    doorbells.rung = doorbells.rung.max(Some(t.seq));
                    doorbells.unsigned = doorbells.unsigned.max(Some(t.seq));
                }
                Err(e) => {
                    tracing::warn!(error = %e, payload, "unreadable transition payload; reading the log");
                    doorbells.rung = doorbells.rung.max(Some(self.last_seq + 1));
                }
            },
        }
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

    /// Sends what was published to subscribers, all in one go.
    fn flush(&mut self) {
        if !self.unsent.is_empty() {
            self.hub.send_transitions(self.unsent.drain(..));
        }
    }

    /// Reports the session as listening, with the problem gone.
    fn mark_connected(&self, session: &Session) {
        let seq = self.last_seq;
        self.hub.update_status(|s| {
            s.connected = true;
            s.backend_pid = Some(session.backend_pid);
            s.last_seq = seq;
            s.problem = None;
        });
    }

    /// Tells watchers that issues were removed, as of the last `seq` read:
    /// notifications arrive in commit order, so every transition committed
    /// before the removal has been read by now.
    fn announce_removal(&self) {
        self.hub.announce_removal(self.last_seq);
    }

    /// Opens a session on the direct endpoint and LISTENs on every channel.
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

    /// Shows that notifications committed through the pooled endpoint reach
    /// `session`: sends one there, from a session of its own, and waits for
    /// it. Returns what else arrived meanwhile, or why it is not so.
    async fn prove_delivery(&self, session: &mut Session) -> Delivery {
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
