//! PostgreSQL access: the connection pool, migrations, and every query the
//! service runs, one file per table. Nothing outside this module writes SQL.

pub mod advisory;
pub mod briefing;
pub mod dashboard;
pub mod issue;
pub mod migrate;
pub mod pipeline_run;
pub mod role;
pub mod setting;
pub mod transition;

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use futures::future::BoxFuture;
use tokio_postgres::NoTls;

/// The pooled connections every request and worker borrows from.
pub type DbPool = Pool;

/// Errors from talking to PostgreSQL.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("invalid database URL: {0}")]
    BadUrl(String),
    #[error("no database connection available: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("database error: {}", describe(.0))]
    Postgres(#[from] tokio_postgres::Error),
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
    /// another transaction held. Not for a statement the server refused on
    /// its merits.
    pub fn is_transient(&self) -> bool {
        fn server_says_transient(e: &tokio_postgres::Error) -> bool {
            match e.code() {
                // No SQLSTATE: the connection failed or was lost.
                None => true,
                Some(code) => {
                    let code = code.code();
                    ["08", "53", "57P", "40001", "40P01"]
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

/// Parses a `processing_status` value read from the database; one outside
/// the state machine is an error, not a panic.
pub(crate) fn parse_status(text: &str) -> Result<crate::status::Status, DbError> {
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

/// Renders a tokio-postgres error with the server's message when it has one
/// (its `Display` alone says only "db error").
fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => db.message().to_string(),
        None => {
            let mut text = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(s) = source {
                text.push_str(": ");
                text.push_str(&s.to_string());
                source = s.source();
            }
            text
        }
    }
}

/// Parses a URL into a connection config tagged with `application_name`
/// (so `pg_stat_activity` and `newsnack locks` say who is who) and TCP
/// keepalives (so a half-open connection is noticed).
pub fn pg_config(url: &str, application_name: &str) -> Result<tokio_postgres::Config, DbError> {
    let mut config: tokio_postgres::Config = url
        .parse()
        .map_err(|e: tokio_postgres::Error| DbError::BadUrl(describe(&e)))?;
    if config.get_application_name().is_none() {
        config.application_name(application_name);
    }
    config
        .connect_timeout(Duration::from_secs(5))
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        .keepalives_interval(Duration::from_secs(5))
        .keepalives_retries(3);
    Ok(config)
}

/// How a pool behaves when it is busy.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub max_size: usize,
    /// How long a caller waits for a free connection before giving up.
    pub wait_timeout: Duration,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            max_size: 16,
            wait_timeout: Duration::from_secs(5),
        }
    }
}

/// Builds a pool. Connections are opened lazily, on first use.
///
/// Its sessions plan prepared statements once (`plan_cache_mode =
/// force_generic_plan`): the service's statements look rows up by id, so
/// their best plan does not depend on the values bound, and re-planning the
/// claim statement for every call (PostgreSQL's default for its first runs,
/// and for good whenever a custom plan looks cheaper) was a third of the
/// database's CPU time under a claim storm (`benches/http_claims.rs`).
pub fn pool(mut config: tokio_postgres::Config, options: &PoolOptions) -> Result<DbPool, DbError> {
    let options_given = config.get_options().unwrap_or_default();
    config.options(format!("{options_given} -c plan_cache_mode=force_generic_plan").trim());
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(options.max_size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(options.wait_timeout))
        .create_timeout(Some(Duration::from_secs(5)))
        .build()
        .map_err(|e| DbError::Invalid(format!("cannot build the connection pool: {e}")))
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
        tokio::spawn(async move {
            let error = match tokio::time::timeout(limit, cancel.cancel_query(NoTls)).await {
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

/// Opens one connection outside any pool and drives it in the background.
/// For sessions that must not go back to a pool: advisory-lock holders and
/// one-shot commands.
pub async fn connect(config: &tokio_postgres::Config) -> Result<tokio_postgres::Client, DbError> {
    Ok(connect_watched(config).await?.0)
}

/// [`connect`], with a token cancelled as soon as the session ends (closed
/// by the server, e.g. `pg_terminate_backend`, or by a broken connection).
pub async fn connect_watched(
    config: &tokio_postgres::Config,
) -> Result<(tokio_postgres::Client, tokio_util::sync::CancellationToken), DbError> {
    let (client, connection) = config.connect(NoTls).await?;
    let ended = tokio_util::sync::CancellationToken::new();
    let signal = ended.clone();
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "dedicated connection closed");
        }
        signal.cancel();
    });
    Ok((client, ended))
}
