//! Advisory lock keys, in one place, so `newsnack locks` can name what it
//! sees in `pg_locks` and no two concerns share a key by accident.

/// Serialises `issue_transition.seq` allocation with commit order; taken by
/// the transition trigger (`sql/0002_transitions.sql`), held to commit.
pub const TRANSITION_LOG: i64 = 7_236_284_560_371_893_001;
/// Held while migrations run, so concurrent start-ups apply them once.
pub const MIGRATIONS: i64 = 7_236_284_560_371_893_002;
/// Held by the one instance running the lease reaper.
pub const LEASE_REAPER: i64 = 7_236_284_560_371_893_003;
/// Held by the one instance running a pipeline tick.
pub const PIPELINE: i64 = 7_236_284_560_371_893_004;

/// A readable name for a key, for listings.
pub fn name_of(key: i64) -> &'static str {
    match key {
        TRANSITION_LOG => "transition-log",
        MIGRATIONS => "migrations",
        LEASE_REAPER => "lease-reaper",
        PIPELINE => "pipeline",
        _ => "other",
    }
}

/// How long a lock session may take to answer a ping.
const PING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// How long an explicit unlock may take before the session is just closed.
const RELEASE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A session-level advisory lock held on a connection of its own, never a
/// pooled one: the lock lives exactly as long as this value. Dropping it
/// (on any exit path, a panic or a cancelled task included) closes the
/// connection, and PostgreSQL releases the lock with the session; if the
/// process dies, the server notices the closed socket and does the same.
pub struct AdvisoryLock {
    client: tokio_postgres::Client,
    key: i64,
    /// The holding session's backend pid.
    pid: i32,
    /// Cancelled when the session, and so the lock, is gone.
    session_ended: tokio_util::sync::CancellationToken,
}

impl AdvisoryLock {
    /// Takes `key` without waiting; `Ok(None)` when another session holds it.
    pub async fn try_acquire(
        config: &tokio_postgres::Config,
        key: i64,
        holder: &str,
    ) -> Result<Option<AdvisoryLock>, super::DbError> {
        Self::acquire(config, key, holder, None).await
    }

    /// Takes `key`, waiting up to `wait` for its holder to let go (e.g. a
    /// session of this process that is still ending); `Ok(None)` when it is
    /// still held then.
    pub async fn acquire_within(
        config: &tokio_postgres::Config,
        key: i64,
        holder: &str,
        wait: std::time::Duration,
    ) -> Result<Option<AdvisoryLock>, super::DbError> {
        Self::acquire(config, key, holder, Some(wait)).await
    }

    async fn acquire(
        config: &tokio_postgres::Config,
        key: i64,
        holder: &str,
        wait: Option<std::time::Duration>,
    ) -> Result<Option<AdvisoryLock>, super::DbError> {
        let mut config = config.clone();
        config.application_name(format!("newsnack-lock:{}:{holder}", name_of(key)));
        let (client, session_ended) = super::connect_watched(&config).await?;
        let taken = match wait {
            None => {
                client
                    .query_one("SELECT pg_try_advisory_lock($1), pg_backend_pid()", &[&key])
                    .await?
            }
            Some(wait) => {
                client
                    .batch_execute(&format!("SET lock_timeout = {}", wait.as_millis().max(1)))
                    .await?;
                let waited = client
                    .query_one(
                        "SELECT true, pg_backend_pid() FROM (SELECT pg_advisory_lock($1)) l",
                        &[&key],
                    )
                    .await;
                match waited {
                    Err(e)
                        if e.code()
                            == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
                    {
                        return Ok(None)
                    }
                    waited => {
                        let row = waited?;
                        client.batch_execute("RESET lock_timeout").await?;
                        row
                    }
                }
            }
        };
        Ok(taken.get::<_, bool>(0).then(|| AdvisoryLock {
            client,
            key,
            pid: taken.get(1),
            session_ended,
        }))
    }

    pub fn key(&self) -> i64 {
        self.key
    }

    /// The holding session's backend pid (see [`held_by`]).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// A token cancelled the moment the holding session ends: from then on
    /// another session can take the lock. A server-side termination is seen
    /// at once, a silently broken network within the TCP keepalive timeout.
    pub fn lost(&self) -> tokio_util::sync::CancellationToken {
        self.session_ended.clone()
    }

    /// True while the holding session is alive (and so still holds the lock).
    /// A session that does not answer within [`PING_TIMEOUT`] counts as
    /// gone (a silently broken network would otherwise hold this for the
    /// kernel's retransmission timeout, many minutes).
    pub async fn is_held(&self) -> bool {
        !self.client.is_closed()
            && matches!(
                tokio::time::timeout(PING_TIMEOUT, self.client.simple_query("SELECT 1")).await,
                Ok(Ok(_))
            )
    }

    /// The holding session, for work that must happen under the lock.
    pub fn client(&self) -> &tokio_postgres::Client {
        &self.client
    }

    /// Releases the lock explicitly and closes the session. Bounded: on a
    /// session that stopped answering, closing it is what releases the lock.
    pub async fn release(self) {
        if self.session_ended.is_cancelled() {
            return;
        }
        let unlock = async {
            let _ = self
                .client
                .execute("SELECT pg_advisory_unlock($1)", &[&self.key])
                .await;
        };
        let _ = tokio::time::timeout(RELEASE_TIMEOUT, unlock).await;
    }
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
pub async fn held_by(
    client: &impl deadpool_postgres::GenericClient,
    key: i64,
    pid: i32,
) -> Result<bool, super::DbError> {
    let row = client
        .query_one(
            "SELECT EXISTS (
                 SELECT 1 FROM pg_locks
                  WHERE locktype = 'advisory' AND granted AND pid = $2 AND objsubid = 1
                    AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
                    AND ((classid::bigint << 32) | objid::bigint) = $1)",
            &[&key, &pid],
        )
        .await?;
    Ok(row.get(0))
}

/// Every advisory lock in the current database, with its holder.
pub async fn held_locks(client: &tokio_postgres::Client) -> Result<Vec<HeldLock>, super::DbError> {
    let rows = client
        .query(
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
