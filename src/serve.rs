//! `newsnack serve`: the long-running reactive service. Starts (in order)
//! the database (given, or a throwaway embedded cluster), migrations, the
//! one listener, the claimer, the generator, the retry scheduler, the lease
//! reaper, the hourly prune, the pipeline scheduler and the HTTP API; stops
//! them all on one cancellation token. [`Core`] is the part other long-running commands
//! (`run-pipeline`, `demo`) share.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::briefing::run::Pipeline;
use crate::briefing::scheduler::PipelineScheduler;
use crate::claims::claim::Claimer;
use crate::claims::known_done::DoneIssues;
use crate::db::{self, DbError, PoolOptions};
use crate::embedded::{EmbeddedError, EmbeddedOptions, EmbeddedPostgres};
use crate::events::hub::EventHub;
use crate::events::listener::{Listener, ListenerOptions};
use crate::generation::budget::LlmBudget;
use crate::generation::reaper::LeaseReaper;
use crate::generation::retry::{RetryScheduler, RetryScope};
use crate::generation::worker::{Generator, GeneratorHandle};
use crate::http::{self, Services};
use crate::maintenance::pruner::Pruner;
use crate::settings::SettingsCache;
use crate::writer::Writers;

/// How to run the service.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    /// `None`: start a throwaway embedded cluster.
    pub database_url: Option<String>,
    /// A URL that reaches PostgreSQL directly, for the listener and the
    /// advisory locks, when `database_url` goes through a transaction
    /// pooler. `None`: `database_url` serves both.
    pub direct_database_url: Option<String>,
    /// Who claims: recorded in `issue.claimed_by`.
    pub instance: String,
    pub pool_size: usize,
    /// How long in-flight generations may finish after shutdown begins.
    pub grace: Duration,
    /// The tokens API requests must present ([`http::auth`]).
    pub tokens: http::auth::Tokens,
    /// Claimed issues this instance may hold unfinished before
    /// `POST /ai-articles` turns new requests away with 503.
    pub max_backlog: usize,
}

impl ServeOptions {
    /// Enough to keep the LLM busy for long; few enough that every queued
    /// claim's lease is heartbeated in time.
    pub const DEFAULT_MAX_BACKLOG: usize = 10_000;
}

/// Why the service could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Embedded(#[from] EmbeddedError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("HTTP server failed: {0}")]
    Http(std::io::Error),
    #[error(transparent)]
    Token(#[from] http::auth::BadToken),
}

/// A started service.
pub struct RunningService {
    /// Where the API listens (the real port when asked for port 0).
    pub addr: SocketAddr,
    pub database_url: String,
    pub hub: EventHub,
    shutdown: CancellationToken,
    /// Cancelled to drain: `/readyz` answers 503 from then on.
    draining: CancellationToken,
    core: Core,
    http: tokio::task::JoinHandle<()>,
    /// How long open connections may take to finish after shutdown begins.
    http_drain: Duration,
    embedded: Option<EmbeddedPostgres>,
}

impl RunningService {
    /// The token that stops everything.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// The token that turns `/readyz` to 503 (the service goes on
    /// answering everything else until it is stopped).
    pub fn draining_token(&self) -> CancellationToken {
        self.draining.clone()
    }

    /// Waits until shutdown is requested and everything has stopped.
    pub async fn wait(mut self) -> Result<(), ServeError> {
        self.shutdown.cancelled().await;
        // Streams and waits end themselves on shutdown, but a client that
        // stopped reading keeps its connection's write pending: such
        // connections are cut after the grace period.
        let http = match tokio::time::timeout(self.http_drain, &mut self.http).await {
            Ok(http) => http,
            Err(_) => {
                tracing::warn!(grace = ?self.http_drain, "connections still open after the grace period; closing them");
                self.http.abort();
                Ok(())
            }
        };
        // Close pooled sessions before the embedded server goes away.
        self.core.stopped().await;
        if let Some(cluster) = self.embedded {
            tokio::task::spawn_blocking(move || drop(cluster))
                .await
                .ok();
        }
        http.map_err(|e| ServeError::Http(std::io::Error::other(e)))
    }

    /// Requests shutdown and waits for it.
    pub async fn stop(self) -> Result<(), ServeError> {
        self.shutdown.cancel();
        self.wait().await
    }
}

/// The parts every long-running command shares: pool, listener, settings,
/// claimer, generator and retry scheduler, with their tasks.
pub struct Core {
    pub db: db::Database,
    pub pool: db::DbPool,
    pub hub: EventHub,
    pub settings: Arc<SettingsCache>,
    pub claimer: Claimer,
    pub generator: GeneratorHandle,
    pub instance: String,
    /// Which failed issues this process retries.
    pub retry_scope: RetryScope,
    pub tasks: JoinSet<()>,
}

impl Core {
    /// Migrates the database and starts the shared parts; the retry
    /// scheduler retries the failed issues in `retry_scope`.
    pub async fn start(
        database: &db::Database,
        instance: &str,
        pool_size: usize,
        writers: impl Into<Writers>,
        grace: Duration,
        retry_scope: RetryScope,
        shutdown: &CancellationToken,
    ) -> Result<Core, ServeError> {
        let database = database.with_application_name(&format!("newsnack:{instance}"));
        let mut migrator = database.pooled.connect().await?;
        let report = db::migrate::migrate(&mut migrator).await?;
        if !report.applied.is_empty() {
            tracing::info!(applied = ?report.applied, "schema migrated");
        }
        drop(migrator);
        let pool = db::pool(
            &database.pooled,
            &PoolOptions {
                max_size: pool_size,
                wait_timeout: Duration::from_secs(5),
                statements: database.statements,
            },
        )?;
        let (hub, listener_task) = Listener::start(
            database.direct.clone(),
            pool.clone(),
            ListenerOptions::default(),
            shutdown.clone(),
        )
        .await?;
        let settings = Arc::new(SettingsCache::new(pool.clone(), hub.settings_changed()));
        let claimer = Claimer::start(pool.clone(), instance.to_string(), 2);
        let writers: Writers = writers.into();
        let calls_llm = writers.primary.calls_llm();
        let (mut generator, generator_handle) = Generator::new(
            pool.clone(),
            writers.primary,
            settings.clone(),
            hub.settings_changed(),
            grace,
        );
        if calls_llm {
            let has_fallback = writers.fallback.is_some();
            let (budget, agent) =
                LlmBudget::start(pool.clone(), &hub, settings.clone(), instance, has_fallback);
            generator = generator.sharing(budget, agent);
            if let Some(fallback) = writers.fallback {
                generator = generator.falling_back_to(fallback);
            }
        }
        let generator =
            generator.abandoning(hub.stream_after(hub.status().borrow().last_seq, None));
        let mut tasks = JoinSet::new();
        tasks.spawn(async move {
            let _ = listener_task.await;
        });
        tasks.spawn(generator.run(shutdown.clone()));
        tasks.spawn(
            RetryScheduler {
                hub: hub.clone(),
                pool: pool.clone(),
                claimer: claimer.clone(),
                generator: generator_handle.clone(),
                settings: settings.clone(),
                scope: retry_scope.clone(),
            }
            .run(shutdown.clone()),
        );
        Ok(Core {
            db: database,
            pool,
            hub,
            settings,
            claimer,
            generator: generator_handle,
            instance: instance.to_string(),
            retry_scope,
            tasks,
        })
    }

    /// The pipeline over these parts.
    pub fn pipeline(&self) -> Pipeline {
        Pipeline {
            direct: self.db.direct.clone(),
            pool: self.pool.clone(),
            hub: self.hub.clone(),
            claimer: self.claimer.clone(),
            generator: self.generator.clone(),
            settings: self.settings.clone(),
            instance: self.instance.clone(),
            retry_scope: self.retry_scope.clone(),
        }
    }

    /// Waits for the tasks (after shutdown was requested) and closes the pool.
    pub async fn stopped(mut self) {
        while self.tasks.join_next().await.is_some() {}
        self.pool.close();
    }
}

/// Parses `database_url` (and the direct URL), or starts a throwaway
/// embedded cluster when it is `None`; returns the endpoints, the URL in
/// use and the cluster to keep alive.
pub async fn database(
    database_url: Option<&str>,
    direct_database_url: Option<&str>,
) -> Result<(db::Database, String, Option<EmbeddedPostgres>), ServeError> {
    if let Some(url) = database_url {
        let database = db::Database::parse(url, direct_database_url, "newsnack")?;
        return Ok((database, url.to_string(), None));
    }
    let cluster =
        tokio::task::spawn_blocking(|| EmbeddedPostgres::start(&EmbeddedOptions::default()))
            .await
            .map_err(|e| EmbeddedError::Io(std::io::Error::other(e)))??;
    let admin = db::Endpoint::parse(&cluster.url("postgres"), "newsnack-setup")?
        .connect()
        .await?;
    admin
        .batch_execute("CREATE DATABASE newsnack")
        .await
        .map_err(DbError::from)?;
    let url = cluster.url("newsnack");
    tracing::info!(%url, "started a throwaway PostgreSQL cluster (deleted on exit)");
    let database = db::Database::parse(&url, None, "newsnack")?;
    Ok((database, url, Some(cluster)))
}

/// Raises this process's soft limit of open files to its hard limit: each
/// open wait or SSE client is a socket, and the usual soft limit (1024)
/// would refuse connections long before memory or the hard limit does.
fn raise_open_files_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on a local struct of the right type.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 || limit.rlim_cur >= limit.rlim_max
        {
            return;
        }
        let soft = limit.rlim_cur;
        limit.rlim_cur = limit.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
            tracing::debug!(
                from = soft,
                to = limit.rlim_max,
                "raised the open files limit"
            );
        }
    }
}

/// Starts every part of the service. Returns once the API is listening.
pub async fn start(
    options: ServeOptions,
    writer: impl Into<Writers>,
) -> Result<RunningService, ServeError> {
    options.tokens.check()?;
    raise_open_files_limit();
    let shutdown = CancellationToken::new();
    let (database, database_url, embedded) = database(
        options.database_url.as_deref(),
        options.direct_database_url.as_deref(),
    )
    .await?;
    let mut core = Core::start(
        &database,
        &options.instance,
        options.pool_size,
        writer,
        options.grace,
        RetryScope::everything(),
        &shutdown,
    )
    .await?;
    core.tasks.spawn(
        LeaseReaper {
            endpoint: core.db.direct.clone(),
            settings: core.settings.clone(),
            instance: options.instance.clone(),
        }
        .run(shutdown.clone()),
    );
    core.tasks.spawn(
        Pruner {
            endpoint: core.db.direct.clone(),
            settings: core.settings.clone(),
            instance: options.instance.clone(),
        }
        .run(shutdown.clone()),
    );
    core.tasks.spawn(
        PipelineScheduler {
            pipeline: core.pipeline(),
        }
        .run(shutdown.clone()),
    );
    let draining = CancellationToken::new();
    let app = http::router(Services {
        pool: core.pool.clone(),
        hub: core.hub.clone(),
        claimer: core.claimer.clone(),
        done: DoneIssues::follow(&core.hub, shutdown.clone()),
        generator: core.generator.clone(),
        settings: core.settings.clone(),
        shutdown: shutdown.clone(),
        draining: draining.clone(),
        tokens: options.tokens.clone(),
        max_backlog: options.max_backlog,
    });
    let socket = tokio::net::TcpListener::bind(options.listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: options.listen,
            source,
        })?;
    let addr = socket.local_addr().map_err(ServeError::Http)?;
    if !addr.ip().is_loopback() && !options.tokens.guard_the_api() {
        tracing::warn!(
            %addr,
            "listening beyond this machine with no token: whoever reaches the port reads and changes everything; \
             set NEWSNACK_API_TOKEN (and NEWSNACK_READ_TOKEN for read-only access)"
        );
    }
    let http = tokio::spawn(http::server::serve(socket, app, shutdown.clone()));
    tracing::info!(%addr, instance = %options.instance, "newsnack is serving");
    Ok(RunningService {
        addr,
        database_url,
        hub: core.hub.clone(),
        shutdown,
        draining,
        core,
        http,
        http_drain: options.grace,
        embedded,
    })
}

/// A default instance name: host and process id.
pub fn default_instance_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    format!("{host}:{}", std::process::id())
}
