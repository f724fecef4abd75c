//! Advisory locks: their keys, the guard that holds one, and what the
//! server says about who holds them.
//!
//! The keys live in one place, so `newsnack locks` can name what it sees in
//! `pg_locks` and no two concerns share a key by accident. [`AdvisoryLock`]
//! holds a session-level lock on a connection of its own: it can ping that
//! session, notice its end, take the lock again on a new one, and release
//! it; while it lives, the metrics count the lock as held. The lease reaper
//! and the pipeline run each keep theirs with it, by their own rules
//! (`generation::reaper`, `briefing::lock`).

use std::time::Duration;

use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;
use tokio_util::sync::CancellationToken;

/// Serialises `issue_transition.seq` allocation with commit order; taken by
/// the transition trigger (`sql/0002_transitions.sql`), held to commit.
pub const TRANSITION_LOG: i64 = 7_236_284_560_371_893_001;
/// Held while migrations run, so concurrent start-ups apply them once.
pub const MIGRATIONS: i64 = 7_236_284_560_371_893_002;
/// Held by the one instance running the lease reaper.
pub const LEASE_REAPER: i64 = 7_236_284_560_371_893_003;
/// Held by the one pipeline run in progress, for its whole length.
pub const PIPELINE: i64 = 7_236_284_560_371_893_004;
/// Held by the one instance that prunes by the retention settings.
pub const PRUNE: i64 = 7_236_284_560_371_893_023;

/// A readable name for a key, for listings.
pub fn name_of(key: i64) -> &'static str {
    match key {
        TRANSITION_LOG => "transition-log",
        MIGRATIONS => "migrations",
        LEASE_REAPER => "lease-reaper",
        PIPELINE => "pipeline",
        PRUNE => "prune",
        _ => "other",
    }
}

/// How long taking a lock waits for an orphaned session of this process
/// (see [`end_own_orphan`]) to end once told to.
const ORPHAN_WAIT: Duration = Duration::from_secs(2);

/// How long a lock session may take to answer a ping.
const PING_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an explicit unlock may take before the session is just closed.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long taking a lock again waits for its holder: the ended session
/// may still be letting go of it. Held longer than this, it is another's.
const RETAKE_WAIT: Duration = Duration::from_secs(2);
/// How many times, a second apart, a lost lock is taken again while the
/// database cannot be reached (e.g. during a failover).
const RETAKE_ATTEMPTS: u32 = 5;

/// A session-level advisory lock held on a connection of its own, never a
/// pooled one: the lock lives exactly as long as this value. Dropping it
/// (on any exit path, a panic or a cancelled task included) closes the
/// connection, and PostgreSQL releases the lock with the session; if the
/// process dies, the server notices the closed socket and does the same.
/// While it lives, the `newsnack_advisory_lock_held` gauge counts it.
pub struct AdvisoryLock {
    session: LockSession,
    key: i64,
    /// Where, and as whom, the lock is taken again ([`AdvisoryLock::retake`]).
    endpoint: super::Endpoint,
    holder: String,
    /// Shows the lock as held in the metrics; kept across a retake, so a
    /// lock taken again on a new session does not flicker to 0.
    _shown: crate::metrics::GaugeGuard,
}

impl AdvisoryLock {
    /// Takes `key` without waiting; `Ok(None)` when another session holds it.
    pub async fn try_acquire(
        endpoint: &super::Endpoint,
        key: i64,
        holder: &str,
    ) -> Result<Option<AdvisoryLock>, super::DbError> {
        Self::acquire(endpoint, key, holder, None).await
    }

    /// Takes `key`, waiting up to `wait` for its holder to let go (e.g. a
    /// session of this process that is still ending); `Ok(None)` when it is
    /// still held then.
    pub async fn acquire_within(
        endpoint: &super::Endpoint,
        key: i64,
        holder: &str,
        wait: Duration,
    ) -> Result<Option<AdvisoryLock>, super::DbError> {
        Self::acquire(endpoint, key, holder, Some(wait)).await
    }

    async fn acquire(
        endpoint: &super::Endpoint,
        key: i64,
        holder: &str,
        wait: Option<Duration>,
    ) -> Result<Option<AdvisoryLock>, super::DbError> {
        let Some(session) = LockSession::open_and_take(endpoint, key, holder, wait).await? else {
            return Ok(None);
        };
        Ok(Some(AdvisoryLock {
            session,
            key,
            endpoint: endpoint.clone(),
            holder: holder.to_owned(),
            _shown: crate::metrics::advisory_lock_held(name_of(key)),
        }))
    }

    pub fn key(&self) -> i64 {
        self.key
    }

    /// The holding session's backend pid (see [`held_by`]).
    pub fn pid(&self) -> i32 {
        self.session.pid
    }

    /// True while the holding session is alive (and so still holds the lock).
    /// A session that does not answer within [`PING_TIMEOUT`] counts as
    /// gone (a silently broken network would otherwise hold this for the
    /// kernel's retransmission timeout, many minutes).
    pub async fn is_held(&self) -> bool {
        let client = &self.session.client;
        !client.is_closed()
            && matches!(
                tokio::time::timeout(PING_TIMEOUT, client.simple_query("SELECT 1")).await,
                Ok(Ok(_))
            )
    }

    /// Returns once the holding session has ended or fails a ping, sent
    /// every `every`. A server-side termination is seen at once; the pings
    /// find what the connection alone would report only after the TCP
    /// keepalive gives up: an idle-session timeout, a dead network.
    pub async fn session_ends(&self, every: Duration) {
        let pings = async {
            loop {
                tokio::time::sleep(every).await;
                if !self.is_held().await {
                    return;
                }
            }
        };
        tokio::select! {
            _ = self.session.ended.cancelled() => {}
            _ = pings => {}
        }
    }

    /// After its session ended (an idle timeout, `pg_terminate_backend`, a
    /// failover), takes the lock again on a new session, so the work it
    /// guards need not stop. `None` when the lock is lost for good: another
    /// session took it, or the database stayed unreachable.
    pub async fn retake(self) -> Option<AdvisoryLock> {
        let AdvisoryLock {
            session,
            key,
            endpoint,
            holder,
            _shown,
        } = self;
        // Closed first: the old session must not hold the lock against the
        // new one (and, once closed, it counts as an orphan if it still does).
        drop(session);
        for attempt in 1..=RETAKE_ATTEMPTS {
            match LockSession::open_and_take(&endpoint, key, &holder, Some(RETAKE_WAIT)).await {
                Ok(taken) => {
                    return taken.map(|session| AdvisoryLock {
                        session,
                        key,
                        endpoint,
                        holder,
                        _shown,
                    })
                }
                Err(e) => {
                    tracing::debug!(attempt, lock = name_of(key), error = %e, "cannot take the lock again yet");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        None
    }

    /// The holding session, for work that must happen under the lock.
    pub fn client(&self) -> &tokio_postgres::Client {
        &self.session.client
    }

    /// Releases the lock explicitly and closes the session. Bounded: on a
    /// session that stopped answering, closing it is what releases the lock.
    pub async fn release(self) {
        if self.session.ended.is_cancelled() {
            return;
        }
        let unlock = async {
            let _ = self
                .session
                .client
                .execute_typed("SELECT pg_advisory_unlock($1)", &[(&self.key, Type::INT8)])
                .await;
        };
        let _ = tokio::time::timeout(RELEASE_TIMEOUT, unlock).await;
    }
}

/// A connection of its own that holds one lock.
struct LockSession {
    client: tokio_postgres::Client,
    /// Its backend pid.
    pid: i32,
    /// Cancelled when the session, and so the lock, is gone.
    ended: CancellationToken,
    /// Keeps the session off [`end_own_orphan`]'s list while this lives.
    _live: LiveSession,
}

impl LockSession {
    /// Opens a session and takes `key` on it (see [`take`]); `Ok(None)`,
    /// the session closed again, when it is held elsewhere.
    async fn open_and_take(
        endpoint: &super::Endpoint,
        key: i64,
        holder: &str,
        wait: Option<Duration>,
    ) -> Result<Option<LockSession>, super::DbError> {
        let endpoint = endpoint.with_application_name(&session_name(key, holder));
        let (client, ended) = endpoint.connect_watched().await?;
        // Registered before it may hold the lock, so that no other task of
        // this process takes it for an orphan meanwhile.
        let pid: i32 = client
            .query_typed_one("SELECT pg_backend_pid()", &[])
            .await?
            .get(0);
        let live = LiveSession::register(pid);
        let mut taken = take(&client, key, wait).await?;
        if !taken {
            match end_own_orphan(&client, key).await {
                Ok(Some(orphan)) => {
                    tracing::warn!(
                        pid = orphan,
                        lock = name_of(key),
                        "a lock session this process let go of still held the lock; ended it"
                    );
                    taken = take(&client, key, Some(ORPHAN_WAIT)).await?;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "cannot look for an orphaned lock session"),
            }
        }
        Ok(taken.then_some(LockSession {
            client,
            pid,
            ended,
            _live: live,
        }))
    }
}

/// Takes `key` on `client`, waiting up to `wait` if given; whether taken.
async fn take(
    client: &tokio_postgres::Client,
    key: i64,
    wait: Option<Duration>,
) -> Result<bool, super::DbError> {
    let Some(wait) = wait else {
        let row = client
            .query_typed_one("SELECT pg_try_advisory_lock($1)", &[(&key, Type::INT8)])
            .await?;
        return Ok(row.get(0));
    };
    client
        .batch_execute(&format!("SET lock_timeout = {}", wait.as_millis().max(1)))
        .await?;
    let waited = client
        .execute_typed("SELECT pg_advisory_lock($1)", &[(&key, Type::INT8)])
        .await;
    let taken = match waited {
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => false,
        waited => waited.map(|_| true)?,
    };
    client.batch_execute("RESET lock_timeout").await?;
    Ok(taken)
}

/// The `application_name` of this process's lock sessions for `key`:
/// `newsnack-lock:<lock>:<process mark>:<holder>`.
pub fn session_name(key: i64, holder: &str) -> String {
    format!("newsnack-lock:{}:{}:{holder}", name_of(key), process_mark())
}

/// Sixteen hex digits drawn once per process, which tell its lock
/// sessions from every other process's, whatever the instances are named.
fn process_mark() -> &'static str {
    static MARK: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    MARK.get_or_init(|| format!("{:016x}", rand::random::<u64>()))
}

/// A lock session of this process that is not an orphan: registered from
/// before it asks for its lock until its [`LockSession`] is dropped.
/// Counted per backend pid, since the server may hand a pid to a new
/// session while an object of an ended one still lives.
struct LiveSession(i32);

impl LiveSession {
    fn live() -> std::sync::MutexGuard<'static, std::collections::BTreeMap<i32, usize>> {
        static LIVE: std::sync::Mutex<std::collections::BTreeMap<i32, usize>> =
            std::sync::Mutex::new(std::collections::BTreeMap::new());
        LIVE.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn register(pid: i32) -> LiveSession {
        *Self::live().entry(pid).or_default() += 1;
        LiveSession(pid)
    }

    fn pids() -> Vec<i32> {
        Self::live().keys().copied().collect()
    }
}

impl Drop for LiveSession {
    fn drop(&mut self) {
        let mut live = Self::live();
        if let Some(count) = live.get_mut(&self.0) {
            *count -= 1;
            if *count == 0 {
                live.remove(&self.0);
            }
        }
    }
}

/// Ends a session of this process (by its `application_name`) that holds
/// `key` though no live [`AdvisoryLock`] of this process owns it: one it
/// let go of (a ping that went unanswered, the connection closed on this
/// side) while the server has not noticed yet. Over a silently broken
/// network the server notices only when its TCP keepalive gives up, by
/// default after two hours, and until then no instance could take the lock.
/// Only this process's own sessions qualify, so another instance's lock is
/// never taken away; found and ended in one statement, so a pid the server
/// reuses meanwhile is not hit. Returns the pid ended, if any.
async fn end_own_orphan(
    client: &tokio_postgres::Client,
    key: i64,
) -> Result<Option<i32>, super::DbError> {
    let prefix = format!("newsnack-lock:{}:{}:", name_of(key), process_mark());
    let row = client
        .query_typed_opt(
            "SELECT l.pid, pg_terminate_backend(l.pid)
               FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
              WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND ((l.classid::bigint << 32) | l.objid::bigint) = $1
                AND starts_with(a.application_name, $2)
                AND l.pid <> pg_backend_pid() AND NOT l.pid = ANY($3)
              LIMIT 1",
            &[
                (&key, Type::INT8),
                (&prefix, Type::TEXT),
                (&LiveSession::pids(), Type::INT4_ARRAY),
            ],
        )
        .await?;
    Ok(row.filter(|r| r.get::<_, bool>(1)).map(|r| r.get(0)))
}

/// An advisory lock someone holds, as `newsnack locks` lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HeldLock {
    pub key: i64,
    pub name: &'static str,
    pub pid: i32,
    pub application_name: String,
    pub client: Option<String>,
    /// When the holding session connected (lock sessions connect to lock).
    #[serde(with = "time::serde::rfc3339::option")]
    pub since: Option<time::OffsetDateTime>,
    pub granted: bool,
}

/// Whether the session with backend `pid` holds `key` (as seen from any
/// session: the answer of the server, which alone decides who holds it).
pub async fn held_by(client: &impl super::Sql, key: i64, pid: i32) -> Result<bool, super::DbError> {
    let row = client
        .sql()
        .query_typed_one(
            "SELECT EXISTS (
                 SELECT 1 FROM pg_locks
                  WHERE locktype = 'advisory' AND granted AND pid = $2 AND objsubid = 1
                    AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
                    AND ((classid::bigint << 32) | objid::bigint) = $1)",
            &[(&key, Type::INT8), (&pid, Type::INT4)],
        )
        .await?;
    Ok(row.get(0))
}

/// Every advisory lock in the current database, with its holder.
pub async fn held_locks(client: &tokio_postgres::Client) -> Result<Vec<HeldLock>, super::DbError> {
    let rows = client
        .query_typed(
            "SELECT ((l.classid::bigint << 32) | l.objid::bigint), l.pid, COALESCE(a.application_name, ''),
                    host(a.client_addr), a.backend_start, l.granted
               FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
              WHERE l.locktype = 'advisory' AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              ORDER BY 1, l.pid",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let key: i64 = r.get(0);
            HeldLock {
                key,
                name: name_of(key),
                pid: r.get(1),
                application_name: r.get(2),
                client: r.get(3),
                since: r.get(4),
                granted: r.get(5),
            }
        })
        .collect())
}
