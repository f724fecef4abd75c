//! PostgreSQL access: the connection pool, migrations, and every query the
//! service runs, one file per table. Nothing outside this module writes SQL.

pub mod advisory;
pub mod briefing;
pub mod dashboard;
pub mod endpoint;
pub mod issue;
pub mod llm_budget;
pub mod migrate;
pub mod pipeline_run;
pub mod retention;
pub mod role;
pub mod setting;
pub mod tls;
pub mod transition;

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use futures::future::BoxFuture;

pub use endpoint::{Database, Endpoint};

/// The pooled connections every request and worker borrows from, with the
/// endpoint they come from. Dereferences to the deadpool pool. Cloned for
/// every request (the claimer and the generator each hold one), so the
/// endpoint is shared rather than copied.
#[derive(Clone)]
pub struct DbPool {
    pool: Pool,
    endpoint: Arc<Endpoint>,
    statements: Statements,
}

impl std::ops::Deref for DbPool {
    type Target = Pool;

    fn deref(&self) -> &Pool {
        &self.pool
    }
}

impl DbPool {
    /// Where the pool's sessions come from.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// `client`, one of this pool's sessions, sent the claim path's
    /// statements the way the pool allows ([`Statements`]).
    pub fn session<'a>(&self, client: &'a deadpool_postgres::Client) -> Session<'a> {
        Session {
            client,
            statements: self.statements,
        }
    }
}

/// How a pool sends the statements of the claim path: the claim, the
/// completion, the heartbeat and the failure, run for every issue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Statements {
    /// Unnamed, parsed and planned on every call: what a transaction
    /// pooler allows, where each transaction may run on another server
    /// session.
    #[default]
    Unnamed,
    /// Named, and kept by each session for its life: parsed once, its
    /// plans cached by the server. Only where every session is the
    /// service's own (no `NEWSNACK_DIRECT_DATABASE_URL`, so no transaction
    /// pooler in front).
    Named,
}

/// One pooled session and its pool's [`Statements`]; see [`DbPool::session`].
pub struct Session<'a> {
    client: &'a deadpool_postgres::Client,
    statements: Statements,
}

impl Sql for Session<'_> {
    type On = tokio_postgres::Client;
    fn sql(&self) -> &tokio_postgres::Client {
        self.client
    }
    fn named(&self) -> Option<&deadpool_postgres::Client> {
        (self.statements == Statements::Named).then_some(self.client)
    }
}

/// A statement's parameters, each with its type, as `query_typed` takes them.
pub type TypedParams<'a> = [(
    &'a (dyn tokio_postgres::types::ToSql + Sync),
    tokio_postgres::types::Type,
)];

/// Runs one of the claim path's statements: named and kept by the session
/// where `client` allows it ([`Sql::named`]), unnamed otherwise. A named
/// statement the server no longer knows (a pooler after all), or whose plan
/// a migration changed under it, is forgotten and the statement sent
/// unnamed.
pub async fn query_kept(
    client: &impl Sql,
    statement: &str,
    params: &TypedParams<'_>,
) -> Result<Vec<tokio_postgres::Row>, DbError> {
    use tokio_postgres::error::SqlState;
    use tokio_postgres::GenericClient as _;
    if let Some(session) = client.named() {
        let types: Vec<_> = params.iter().map(|(_, t)| t.clone()).collect();
        let values: Vec<_> = params.iter().map(|(v, _)| *v).collect();
        let named = async {
            let prepared = session.prepare_typed_cached(statement, &types).await?;
            session.query(&prepared, &values).await
        };
        match named.await {
            Err(e)
                if [
                    SqlState::INVALID_SQL_STATEMENT_NAME,
                    SqlState::DUPLICATE_PSTATEMENT,
                    SqlState::FEATURE_NOT_SUPPORTED,
                ]
                .iter()
                .any(|code| e.code() == Some(code)) =>
            {
                tracing::warn!(error = %e, "a kept statement failed; sending it unnamed");
                session.statement_cache.clear();
            }
            answer => return Ok(answer?),
        }
    }
    Ok(client.sql().query_typed(statement, params).await?)
}

/// [`query_kept`] for a statement that returns exactly one row.
pub async fn query_kept_one(
    client: &impl Sql,
    statement: &str,
    params: &TypedParams<'_>,
) -> Result<tokio_postgres::Row, DbError> {
    let mut rows = query_kept(client, statement, params).await?;
    match (rows.pop(), rows.is_empty()) {
        (Some(row), true) => Ok(row),
        (found, _) => Err(DbError::Invalid(format!(
            "expected one row from the database, got {}",
            rows.len() + usize::from(found.is_some())
        ))),
    }
}

/// What a statement runs on: a session, pooled or not, or a transaction.
///
/// Every statement goes out unnamed, parsed, bound and run in one round
/// trip (`query_typed`, with its parameters' types given): nothing is left
/// on the server's session between transactions, so a transaction pooler
/// (PgBouncer in transaction mode) may run each transaction on another
/// server session. The one exception is [`query_kept`], for a pool whose
/// sessions are known to be its own.
pub trait Sql: Sync {
    type On: tokio_postgres::GenericClient + Sync;
    fn sql(&self) -> &Self::On;
    /// The pooled session to keep named statements on, where its pool
    /// allows them ([`Session`]); none for anything else.
    fn named(&self) -> Option<&deadpool_postgres::Client> {
        None
    }
}

impl Sql for tokio_postgres::Client {
    type On = Self;
    fn sql(&self) -> &Self {
        self
    }
}

impl Sql for tokio_postgres::Transaction<'_> {
    type On = Self;
    fn sql(&self) -> &Self {
        self
    }
}

impl Sql for deadpool_postgres::Client {
    type On = tokio_postgres::Client;
    fn sql(&self) -> &tokio_postgres::Client {
        self
    }
}

impl<'a> Sql for deadpool_postgres::Transaction<'a> {
    type On = tokio_postgres::Transaction<'a>;
    fn sql(&self) -> &tokio_postgres::Transaction<'a> {
        self
    }
}

/// Errors from talking to PostgreSQL.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("invalid database URL: {0}")]
    BadUrl(String),
    #[error("invalid database URL: {0}")]
    Tls(#[from] tls::TlsError),
    #[error("{}", describe_pool(.0))]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("database error: {}", describe(.0))]
    Postgres(tokio_postgres::Error),
    #[error("{0}")]
    Invalid(String),
    /// A write skipped a row another transaction held rather than wait.
    #[error("issue {0} is locked by another transaction")]
    RowLocked(i64),
    /// A bounded read ([`bounded`]) got no answer in time.
    #[error("the database did not answer within {0:?}")]
    TimedOut(Duration),
    /// A stored value the service cannot represent: a date or time that is
    /// infinite or beyond the year 9999, written with plain SQL.
    #[error("{0}")]
    Unreadable(String),
}

impl DbError {
    /// The PostgreSQL error code, when the server sent one.
    pub fn code(&self) -> Option<&tokio_postgres::error::SqlState> {
        match self {
            DbError::Postgres(e) => e.code(),
            DbError::Pool(deadpool_postgres::PoolError::Backend(e)) => e.code(),
            _ => None,
        }
    }

    /// The server's own message (e.g. a trigger's RAISE), when there is one.
    pub fn server_message(&self) -> Option<&str> {
        match self {
            DbError::Postgres(e) => e.as_db_error().map(|d| d.message()),
            _ => None,
        }
    }

    /// True for a fault that may pass by itself: no connection in time, a
    /// connection that could not be made or was lost, a server shutting
    /// down or out of resources, a serialisation failure or deadlock, a row
    /// another transaction held, a read-only session (a failover). Not for
    /// a statement the server refused on its merits.
    pub fn is_transient(&self) -> bool {
        fn server_says_transient(e: &tokio_postgres::Error) -> bool {
            match e.code() {
                // No SQLSTATE: the connection failed or was lost.
                None => true,
                Some(code) => {
                    let code = code.code();
                    ["08", "53", "57P", "40001", "40P01", "25006"]
                        .iter()
                        .any(|prefix| code.starts_with(prefix))
                }
            }
        }
        match self {
            DbError::Pool(deadpool_postgres::PoolError::Timeout(_)) => true,
            DbError::Pool(deadpool_postgres::PoolError::Backend(e)) => server_says_transient(e),
            DbError::Postgres(e) => server_says_transient(e),
            DbError::RowLocked(_) | DbError::TimedOut(_) => true,
            _ => false,
        }
    }

    /// True for a fault that makes the session it happened on useless for
    /// the service: a read-only transaction (a primary demoted by a
    /// failover, while new sessions would reach the new one), an
    /// administrator's or crash shutdown, or a lost connection. Such a
    /// session is dropped, never used again.
    pub fn ends_session(&self) -> bool {
        fn server_says(e: &tokio_postgres::Error) -> bool {
            match e.code() {
                None => e.is_closed() || e.as_db_error().is_none(),
                Some(code) => {
                    let code = code.code();
                    code == "25006" || code.starts_with("57P")
                }
            }
        }
        match self {
            DbError::Postgres(e) | DbError::Pool(deadpool_postgres::PoolError::Backend(e)) => {
                server_says(e)
            }
            _ => false,
        }
    }

    /// True when the database refused a write because the session is
    /// read-only: a failover in progress, or a standby.
    pub fn is_read_only(&self) -> bool {
        self.code() == Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION)
    }

    /// True when the pool could not hand out a connection in time.
    pub fn is_pool_exhausted(&self) -> bool {
        matches!(
            self,
            DbError::Pool(deadpool_postgres::PoolError::Timeout(_))
        )
    }

    /// The same error for another request that shared it (a batch): a pool
    /// timeout stays a pool timeout (HTTP 503, worth retrying); anything
    /// else is carried as its message.
    pub fn again(&self) -> DbError {
        match self {
            DbError::Pool(deadpool_postgres::PoolError::Timeout(kind)) => {
                DbError::Pool(deadpool_postgres::PoolError::Timeout(*kind))
            }
            other => DbError::Invalid(other.to_string()),
        }
    }
}

impl From<tokio_postgres::Error> for DbError {
    fn from(e: tokio_postgres::Error) -> Self {
        if e.code() == Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION) {
            read_only_met();
        }
        DbError::Postgres(e)
    }
}

/// When a session last met a read-only transaction (SQLSTATE 25006), as
/// nanoseconds after [`process_start`]; 0 if never.
static READ_ONLY_MET: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn process_start() -> std::time::Instant {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *START.get_or_init(std::time::Instant::now)
}

/// A session of this process met a read-only transaction: after a managed
/// failover, the sessions opened before it sit on the demoted primary,
/// while new ones reach the new primary. Every pooled session opened
/// before now is dropped when it comes back to its pool, never handed out
/// again. (One session's error stands for all: which session met it is not
/// known where errors are made, and a failover moves them all.)
pub fn read_only_met() {
    let since_start = process_start().elapsed().as_nanos().max(1) as u64;
    READ_ONLY_MET.fetch_max(since_start, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a session opened at `opened` was opened before the last
/// read-only transaction was met.
fn opened_before_read_only(opened: std::time::Instant) -> bool {
    let met = READ_ONLY_MET.load(std::sync::atomic::Ordering::Relaxed);
    met != 0 && opened < process_start() + Duration::from_nanos(met)
}

/// Whether `client`'s session can write: not a standby, not a read-only
/// transaction. A session that cannot is reported like one that met a
/// read-only transaction ([`read_only_met`]).
pub async fn accepts_writes(client: &impl Sql) -> Result<bool, DbError> {
    use tokio_postgres::GenericClient as _;
    let row = client
        .sql()
        .query_typed_one(
            "SELECT NOT (pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on')",
            &[],
        )
        .await?;
    let writable: bool = row.get(0);
    if !writable {
        read_only_met();
    }
    Ok(writable)
}

/// Parses a `processing_status` value read from the database; one outside
/// the state machine is an error, not a panic.
pub(crate) fn parse_status(text: &str) -> Result<crate::model::status::Status, DbError> {
    text.parse().map_err(|e| DbError::Invalid(format!("{e}")))
}

/// Reads date or time column `idx` of the row of `what` number `id` (e.g.
/// "issue", 7). PostgreSQL stores values the service cannot represent:
/// `infinity`, `-infinity`, or a year beyond 9999, written with plain SQL.
/// Such a value is a [`DbError::Unreadable`] naming the row and the column,
/// not a panic.
pub(crate) fn time_column<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a tokio_postgres::Row,
    idx: usize,
    what: &str,
    id: i64,
) -> Result<T, DbError> {
    row.try_get(idx).map_err(|_| {
        let column = row.columns().get(idx).map_or("?", |c| c.name());
        DbError::Unreadable(format!(
            "{what} {id}: {column} holds a date or time newsnack cannot read \
             (it must be finite and within the years 1 to 9999)"
        ))
    })
}

/// Renders a tokio-postgres error in one line that names the cause: the
/// server's message when it sent one (its `Display` alone says only "db
/// error"), a refused certificate or a TLS demand the server cannot meet in
/// words, and otherwise the chain of causes.
fn describe(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let message = db.message();
        // pg_hba.conf refused a session without TLS.
        if db.code() == &tokio_postgres::error::SqlState::INVALID_AUTHORIZATION_SPECIFICATION
            && message.ends_with("no encryption")
        {
            return format!(
                "{message} (the server accepts only encrypted sessions here: use sslmode=require or stronger)"
            );
        }
        return message.to_string();
    }
    let mut causes: Vec<String> = Vec::new();
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        // An I/O error that wraps the handshake's error hides it from
        // `source()`: look inside.
        let inner = s
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|inner| inner as &(dyn std::error::Error + 'static));
        for candidate in [Some(s), inner].into_iter().flatten() {
            if let Some(rustls::Error::InvalidCertificate(rustls::CertificateError::Other(other))) =
                candidate.downcast_ref::<rustls::Error>()
            {
                if let Some(refused) = other.0.downcast_ref::<tls::CertificateRefused>() {
                    return format!("TLS handshake failed: {refused}");
                }
            }
            if let Some(tls_error) = candidate.downcast_ref::<rustls::Error>() {
                return format!("TLS handshake failed: {tls_error}");
            }
        }
        let text = s.to_string();
        if text == "server does not support TLS" {
            return "the server does not accept TLS connections (its ssl setting is off), \
                    but the URL's sslmode requires TLS"
                .to_string();
        }
        if causes.last() != Some(&text) {
            causes.push(text);
        }
        source = s.source();
    }
    causes.join(": ")
}

/// Renders a pool error with the cause of a failed connection.
fn describe_pool(e: &deadpool_postgres::PoolError) -> String {
    match e {
        deadpool_postgres::PoolError::Backend(e) => {
            format!("cannot connect to the database: {}", describe(e))
        }
        other => format!("no database connection available: {other}"),
    }
}

/// How a pool behaves when it is busy.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub max_size: usize,
    /// How long a caller waits for a free connection before giving up.
    pub wait_timeout: Duration,
    /// How the claim path's statements are sent.
    pub statements: Statements,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            max_size: 16,
            wait_timeout: Duration::from_secs(5),
            statements: Statements::Unnamed,
        }
    }
}

/// Builds a pool of sessions from `endpoint`, opened lazily, on first use.
/// Nothing is set on a session at start-up and nothing assumed of it
/// between transactions, so the endpoint may be a transaction pooler. A
/// session that was lost is dropped when it comes back, and so is every
/// session opened before a read-only transaction was met (see
/// [`read_only_met`]).
pub fn pool(endpoint: &Endpoint, options: &PoolOptions) -> Result<DbPool, DbError> {
    let manager = Manager::from_connect(
        endpoint.config().clone(),
        PoolConnect(endpoint.clone()),
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager)
        .max_size(options.max_size)
        .pre_recycle(deadpool_postgres::Hook::sync_fn(|_, metrics| {
            if opened_before_read_only(metrics.created) {
                return Err(deadpool_postgres::HookError::Message(
                    "opened before the database was found read-only".into(),
                ));
            }
            Ok(())
        }))
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(options.wait_timeout))
        .create_timeout(Some(Duration::from_secs(5)))
        .build()
        .map_err(|e| DbError::Invalid(format!("cannot build the connection pool: {e}")))?;
    Ok(DbPool {
        pool,
        endpoint: Arc::new(endpoint.clone()),
        statements: options.statements,
    })
}

/// How the pool opens a session: through its endpoint, TLS and all.
struct PoolConnect(Endpoint);

impl deadpool_postgres::Connect for PoolConnect {
    fn connect(
        &self,
        _: &tokio_postgres::Config,
    ) -> BoxFuture<
        '_,
        Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>,
    > {
        Box::pin(async move {
            let (client, connection, _) = self.0.connect_raw().await?;
            let driver = tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(error = %e, "pooled connection closed");
                }
            });
            Ok((client, driver))
        })
    }
}

/// Runs `query` on a session from `pool` and gives up after `limit`, the
/// wait for a free session included, with [`DbError::TimedOut`]. For reads
/// that must not outlast a deadline, e.g. behind a lock another session
/// holds on the table. A statement still running at the limit is cancelled
/// on the server, and its session is taken out of the pool for good (it
/// closes once the statement ends), so neither the statement nor a cancel
/// arriving late can reach a later borrower. The work runs as a task of its
/// own: a caller that stops waiting (a client that hangs up) leaves it to
/// finish the same way.
pub async fn bounded<T: Send + 'static>(
    pool: &DbPool,
    limit: Duration,
    query: impl for<'c> FnOnce(&'c deadpool_postgres::Client) -> BoxFuture<'c, Result<T, DbError>>
        + Send
        + 'static,
) -> Result<T, DbError> {
    let pool = pool.clone();
    let work = tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + limit;
        // The pool's own wait for a free session is shorter; this one has
        // all of `limit`.
        let waits = deadpool_postgres::Timeouts {
            wait: Some(limit),
            ..pool.timeouts()
        };
        let client = tokio::time::timeout_at(deadline, pool.timeout_get(&waits))
            .await
            .map_err(|_| DbError::TimedOut(limit))??;
        if let Ok(answer) = tokio::time::timeout_at(deadline, query(&client)).await {
            return answer;
        }
        let cancel = client.cancel_token();
        drop(deadpool_postgres::Object::take(client));
        let endpoint = pool.endpoint().clone();
        tokio::spawn(async move {
            let error = match tokio::time::timeout(limit, endpoint.cancel(&cancel)).await {
                Ok(Ok(())) => return,
                Ok(Err(e)) => e.to_string(),
                Err(_) => "no answer".to_string(),
            };
            tracing::warn!(%error, "could not cancel a statement that ran past its limit");
        });
        Err(DbError::TimedOut(limit))
    });
    match work.await {
        Ok(answer) => answer,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(DbError::TimedOut(limit)),
    }
}
