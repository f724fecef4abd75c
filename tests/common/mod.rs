//! The PostgreSQL harness for integration tests.
//!
//! One throwaway cluster per test process (or the server at `DATABASE_URL`),
//! a migrated template database made once, and a fresh database per test
//! cloned from it, so tests run in parallel without seeing each other.
#![allow(dead_code)]

pub mod audit;
pub mod fake_llm;
pub mod gate;
pub mod http;
pub mod kubernetes;
pub mod otlp;
pub mod pgbouncer;
pub mod process;
pub mod promtool;
pub mod python;
pub mod subscribers;
pub mod tls;
pub mod writers;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use newsnack::db::{self, DbPool, PoolOptions};
use newsnack::embedded::{EmbeddedOptions, EmbeddedPostgres};
use newsnack::events::hub::EventHub;
use newsnack::events::listener::{Listener, ListenerOptions};
use newsnack::generation::retry::RetryScope;
use newsnack::generation::worker::{Generator, GeneratorHandle};
use newsnack::serve::{Core, RunningService, ServeOptions};
use newsnack::settings::SettingsCache;
use newsnack::writer::{OfflineWriter, SharedWriter, Writers};
use tokio_postgres::{Client, NoTls};
use tokio_util::sync::CancellationToken;

/// Where test databases are created.
struct Server {
    /// URL of the maintenance database, used to create test databases.
    admin_url: String,
    /// `{db}` stands for the database name.
    url_template: String,
}

static CLUSTER: OnceLock<Mutex<Option<EmbeddedPostgres>>> = OnceLock::new();
static SERVER: OnceLock<Server> = OnceLock::new();
static TEMPLATE: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();
static COUNTER: AtomicU64 = AtomicU64::new(0);
static CREATE_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

extern "C" fn stop_cluster() {
    if let Some(cluster) = CLUSTER.get() {
        if let Ok(mut guard) = cluster.lock() {
            guard.take();
        }
    }
}

fn server() -> &'static Server {
    SERVER.get_or_init(|| {
        if let Ok(url) = std::env::var("DATABASE_URL") {
            let config: tokio_postgres::Config = url.parse().expect("DATABASE_URL must parse");
            let db = config.get_dbname().unwrap_or("postgres").to_string();
            let template = url.replacen(&format!("/{db}"), "/{db}", 1);
            assert!(
                template.contains("{db}"),
                "DATABASE_URL must name a database"
            );
            return Server {
                admin_url: url,
                url_template: template,
            };
        }
        let options = EmbeddedOptions {
            durable: false,
            settings: vec![
                ("max_connections".into(), "600".into()),
                (
                    "shared_preload_libraries".into(),
                    "pg_stat_statements".into(),
                ),
            ],
            ..EmbeddedOptions::default()
        };
        let cluster = EmbeddedPostgres::start(&options).expect("start the test cluster");
        let server = Server {
            admin_url: cluster.url("postgres"),
            url_template: cluster.url("{db}"),
        };
        CLUSTER.get_or_init(|| Mutex::new(Some(cluster)));
        // SAFETY: registers a plain extern "C" function to run at exit.
        unsafe {
            libc::atexit(stop_cluster);
        }
        server
    })
}

async fn admin() -> Client {
    let (client, connection) = tokio_postgres::connect(&server().admin_url, NoTls)
        .await
        .expect("connect to the test server");
    tokio::spawn(connection);
    client
}

async fn template() -> &'static str {
    TEMPLATE
        .get_or_init(|| async {
            let name = format!("newsnack_template_{}", std::process::id());
            let admin = admin().await;
            for statement in [
                format!("DROP DATABASE IF EXISTS {name}"),
                format!("CREATE DATABASE {name}"),
            ] {
                admin.batch_execute(&statement).await.expect("create the template database");
            }
            let url = server().url_template.replace("{db}", &name);
            let endpoint = db::Endpoint::parse(&url, "newsnack-test").unwrap();
            let mut client = endpoint.connect().await.unwrap();
            db::migrate::migrate(&mut client).await.expect("migrate the template");
            drop(client);
            // Let the migrating session end before the template is copied.
            admin
                .execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                    &[&name],
                )
                .await
                .unwrap();
            name
        })
        .await
}

/// A fresh, migrated database of one's own.
pub struct TestDb {
    pub name: String,
    pub url: String,
    /// How the service reaches this database.
    pub endpoint: db::Endpoint,
    /// Its connection parameters, for tests that need the host or port.
    pub config: tokio_postgres::Config,
    pub pool: DbPool,
}

impl TestDb {
    pub async fn new() -> TestDb {
        TestDb::with_pool_size(16).await
    }

    pub async fn with_pool_size(max_size: usize) -> TestDb {
        let template = template().await;
        TestDb::create(&format!("TEMPLATE {template}"), max_size).await
    }

    /// A database without the schema, for migration tests.
    pub async fn empty() -> TestDb {
        TestDb::create("", 4).await
    }

    async fn create(clause: &str, max_size: usize) -> TestDb {
        let name = format!(
            "t_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        {
            // Copies of one template are made one at a time.
            let _one_at_a_time = CREATE_LOCK.lock().await;
            admin()
                .await
                .batch_execute(&format!("CREATE DATABASE {name} {clause}"))
                .await
                .expect("create test database");
        }
        let url = server().url_template.replace("{db}", &name);
        let endpoint = db::Endpoint::parse(&url, "newsnack-test").unwrap();
        let pool = db::pool(
            &endpoint,
            &PoolOptions {
                max_size,
                wait_timeout: Duration::from_secs(30),
                // As `serve` sends them with no pooler in front.
                statements: db::Statements::Named,
            },
        )
        .unwrap();
        TestDb {
            name,
            url,
            config: endpoint.config().clone(),
            endpoint,
            pool,
        }
    }

    /// A pool of one session to this database, whose borrowers wait at most
    /// `wait_timeout` for it: to hold it busy and see who waits.
    pub fn pool_of_one(&self, wait_timeout: Duration) -> newsnack::db::DbPool {
        newsnack::db::pool(
            &self.endpoint,
            &newsnack::db::PoolOptions {
                max_size: 1,
                wait_timeout,
                statements: newsnack::db::Statements::Named,
            },
        )
        .unwrap()
    }

    /// Both endpoints of the service: this database, reached directly.
    pub fn database(&self) -> db::Database {
        db::Database {
            pooled: self.endpoint.clone(),
            direct: self.endpoint.clone(),
            statements: db::Statements::Named,
        }
    }

    /// A plain connection of its own, outside the pool: "another system".
    pub async fn raw(&self) -> Client {
        let mut config = self.config.clone();
        config.application_name("other-system");
        let (client, connection) = config.connect(NoTls).await.expect("connect");
        tokio::spawn(connection);
        client
    }

    /// A session on the server's maintenance database, for what a
    /// database's own sessions cannot do to it (close it to new sessions,
    /// change its settings, cut its sessions).
    pub async fn maintenance(&self) -> Client {
        let (client, connection) = self
            .config
            .clone()
            .dbname("postgres")
            .connect(NoTls)
            .await
            .expect("connect to the maintenance database");
        tokio::spawn(connection);
        client
    }

    /// Lets new sessions into this database, or turns them away (from the
    /// maintenance database: a database's own sessions cannot close it to
    /// new ones).
    pub async fn admit_sessions(&self, allowed: bool) {
        self.maintenance()
            .await
            .batch_execute(&format!(
                "ALTER DATABASE \"{}\" ALLOW_CONNECTIONS {allowed}",
                self.name
            ))
            .await
            .unwrap();
    }

    /// Cuts the listener of `hub` off: no new session is let into this
    /// database, and the listener's own session is ended. Returns that
    /// session's pid; [`TestDb::admit_sessions`] lets it back.
    pub async fn cut_off_listener(&self, hub: &EventHub) -> i32 {
        self.admit_sessions(false).await;
        let pid = hub
            .status()
            .borrow()
            .backend_pid
            .expect("the listener is connected");
        self.maintenance()
            .await
            .execute("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .unwrap();
        pid
    }

    /// Starts a listener; cancel the token to stop it.
    pub async fn listener(&self) -> (EventHub, CancellationToken) {
        self.listener_with(ListenerOptions::default()).await
    }

    pub async fn listener_with(&self, options: ListenerOptions) -> (EventHub, CancellationToken) {
        self.listener_on(self.pool.clone(), options).await
    }

    /// Starts a listener whose reads of the log go through `pool` (a pool
    /// the test holds busy, or reaches through a gate); cancel the token to
    /// stop it.
    pub async fn listener_on(
        &self,
        pool: DbPool,
        options: ListenerOptions,
    ) -> (EventHub, CancellationToken) {
        let token = CancellationToken::new();
        let (hub, _task) = Listener::start(self.endpoint.clone(), pool, options, token.clone())
            .await
            .expect("start listener");
        (hub, token)
    }

    /// The service's core on this database (its listener, settings,
    /// claimer, generator and retries, four sessions, the offline writer,
    /// a grace of one second) without the HTTP API, the lease reaper or the
    /// scheduler: for a test that drives those parts itself. It stops when
    /// `shutdown` is cancelled.
    pub async fn core(&self, instance: &str, shutdown: &CancellationToken) -> Core {
        Core::start(
            &self.database(),
            instance,
            4,
            Arc::new(OfflineWriter),
            Duration::from_secs(1),
            RetryScope::everything(),
            shutdown,
        )
        .await
        .expect("start the service's core")
    }

    /// A generator writing with `writer`, with a listener and settings of
    /// its own, started apart from the service for a test that puts
    /// something between it and the database (see [`Apart`]). Its `run` is
    /// the test's to spawn.
    pub async fn generator_apart(&self, writer: SharedWriter, apart: Apart) -> GeneratorApart {
        let pool = apart.pool.unwrap_or_else(|| self.pool.clone());
        let generator_pool = apart.generator_pool.unwrap_or_else(|| pool.clone());
        let (hub, stop) = self
            .listener_on(pool.clone(), ListenerOptions::default())
            .await;
        let settings = Arc::new(SettingsCache::new(pool, hub.settings_changed()));
        let (generator, handle) = Generator::new(
            generator_pool,
            writer,
            settings.clone(),
            hub.settings_changed(),
            apart.grace.unwrap_or(Duration::from_secs(5)),
        );
        GeneratorApart {
            hub,
            stop,
            settings,
            generator,
            handle,
        }
    }

    /// Adds `n` issues titled `issue N` and returns their ids.
    pub async fn add_issues(&self, n: usize) -> Vec<i64> {
        let issues: Vec<_> = (0..n)
            .map(|i| newsnack::db::issue::NewIssue {
                title: format!("issue {i}"),
                body: format!("body of issue {i}"),
                score: i as f64,
                collected_at: None,
                source_key: None,
            })
            .collect();
        let client = self.pool.get().await.unwrap();
        let mut ids = Vec::with_capacity(n);
        for chunk in issues.chunks(1000) {
            ids.extend(
                newsnack::db::issue::insert_issues(&client, chunk)
                    .await
                    .unwrap(),
            );
        }
        ids
    }

    /// Starts the whole service in-process on a free port, with `writer`:
    /// the plain service every test starts unless it says otherwise.
    pub async fn serve(&self, instance: &str, writer: impl Into<Writers>) -> RunningService {
        self.serve_with(instance, writer, Setup::default()).await
    }

    /// Starts the whole service on this database as [`TestDb::serve`] does,
    /// but for what `setup` changes.
    pub async fn serve_with(
        &self,
        instance: &str,
        writer: impl Into<Writers>,
        setup: Setup,
    ) -> RunningService {
        start_service(&self.url, instance, writer, setup).await
    }

    /// Sets a runtime setting through SQL, as an operator would.
    pub async fn set(&self, key: &str, value: &str) {
        let client = self.pool.get().await.unwrap();
        newsnack::db::setting::set(&client, key, value)
            .await
            .unwrap();
    }

    /// Moves issues through `statuses` with raw SQL, one statement per step,
    /// as another system would.
    pub async fn move_with_sql(&self, ids: &[i64], statuses: &[&str]) {
        let client = self.pool.get().await.unwrap();
        move_on(&**client, ids, statuses).await
    }

    /// Another system claims each of `ids` with raw SQL, one transaction
    /// each, in a task of its own that yields between them.
    pub async fn claim_one_by_one(&self, ids: Vec<i64>) -> tokio::task::JoinHandle<()> {
        let writer = self.raw().await;
        tokio::spawn(async move {
            for id in ids {
                writer
                    .execute(
                        "UPDATE issue SET processing_status='IN_PROGRESS' WHERE id=$1",
                        &[&id],
                    )
                    .await
                    .unwrap();
                tokio::task::yield_now().await;
            }
        })
    }

    /// Turns on `pg_stat_statements` in this database (the cluster preloads
    /// it), so a test can count the statements the service runs.
    pub async fn count_statements(&self) {
        let client = self.pool.get().await.unwrap();
        client
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .await
            .unwrap();
    }

    /// Calls of the claim so far in this database (after
    /// [`TestDb::count_statements`]), named or not.
    pub async fn claim_statements(&self) -> i64 {
        let client = self.pool.get().await.unwrap();
        let row = client
            .query_one(
                "SELECT COALESCE(sum(calls), 0)::bigint FROM pg_stat_statements
                  WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                    AND query = $1",
                &[&newsnack::db::issue::CLAIM_STATEMENT],
            )
            .await
            .unwrap();
        row.get(0)
    }

    /// The first column of every row of a query, as ids.
    pub async fn ids(&self, sql: &str) -> Vec<i64> {
        first_column(&self.pool.get().await.unwrap(), sql, &[]).await
    }

    /// The one row `sql` returns, read through the pool.
    pub async fn query_one(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> tokio_postgres::Row {
        let client = self.pool.get().await.unwrap();
        client
            .query_one(sql, params)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// The issues `instance` holds `IN_PROGRESS` now: those it strands when
    /// it is killed.
    pub async fn held_by(&self, instance: &str) -> Vec<i64> {
        first_column(
            &self.pool.get().await.unwrap(),
            "SELECT id FROM issue WHERE processing_status = 'IN_PROGRESS' AND claimed_by = $1",
            &[&instance],
        )
        .await
    }

    /// SIGKILLs `victim` once it has finished `done` issues, while it is
    /// still generating others, and returns the issues it stranded.
    pub async fn kill_mid_generation(
        &self,
        hub: &EventHub,
        victim: &mut process::ServeProcess,
        done: i64,
    ) -> Vec<i64> {
        until_sql(
            self,
            hub,
            60,
            &format!(
                "SELECT count(*) >= {done} FROM issue WHERE processing_status = 'DONE' AND claimed_by = '{}'",
                victim.name
            ),
        )
        .await;
        victim.kill();
        let stranded = self.held_by(&victim.name).await;
        assert!(
            !stranded.is_empty(),
            "the kill must catch the victim mid-generation"
        );
        stranded
    }

    /// Asserts that every issue a killed `instance` held came back: through
    /// the lease reaper ("lease expired"), or finished by its own completion
    /// (a statement already on the server when the process died still
    /// commits); and that the reaper brought back some.
    pub async fn assert_stranded_came_back(&self, stranded: &[i64], instance: &str) {
        let client = self.pool.get().await.unwrap();
        let row = client
            .query_one(
                "SELECT count(*) FILTER (WHERE reaped),
                        count(*) FILTER (WHERE NOT reaped AND processing_status = 'DONE'
                                               AND claimed_by = $2)
                   FROM (SELECT i.processing_status, i.claimed_by,
                                EXISTS (SELECT 1 FROM issue_transition t
                                         WHERE t.issue_id = i.id AND t.reason = 'lease expired') AS reaped
                           FROM issue i WHERE i.id = ANY($1)) s",
                &[&stranded, &instance],
            )
            .await
            .unwrap();
        let (reaped, finished_late): (i64, i64) = (row.get(0), row.get(1));
        assert_eq!(
            reaped + finished_late,
            stranded.len() as i64,
            "{instance}'s issues came back through the reaper ({reaped} reaped, \
             {finished_late} finished by a completion already sent, of {stranded:?})"
        );
        assert!(reaped > 0, "the reaper brought back {instance}'s issues");
    }

    /// An issue's status, for assertions.
    pub async fn status_of(&self, id: i64) -> String {
        self.query_one("SELECT processing_status FROM issue WHERE id = $1", &[&id])
            .await
            .get(0)
    }

    /// One scalar from a query, for assertions.
    pub async fn scalar_i64(&self, sql: &str) -> i64 {
        let client = self.pool.get().await.unwrap();
        client.query_one(sql, &[]).await.unwrap().get(0)
    }
}

/// What a generator started apart ([`TestDb::generator_apart`]) reaches the
/// database through; each field left `None` keeps the test database's own
/// pool and a grace of five seconds.
#[derive(Default)]
pub struct Apart {
    /// Every session of the parts (the listener's reads, the settings, the
    /// generator's writes) goes through this pool.
    pub pool: Option<DbPool>,
    /// Only the generator's sessions go through this pool.
    pub generator_pool: Option<DbPool>,
    /// How long a started generation may finish after `stop`.
    pub grace: Option<Duration>,
}

/// A generator not yet running, its handle, and the listener and settings
/// it was started with; cancel `stop` to end them.
pub struct GeneratorApart {
    pub hub: EventHub,
    pub stop: CancellationToken,
    pub settings: Arc<SettingsCache>,
    pub generator: Generator,
    pub handle: GeneratorHandle,
}

/// What a test's service is started with beyond the plain one
/// ([`TestDb::serve`]); each field left `None` keeps the plain value.
#[derive(Clone, Debug, Default)]
pub struct Setup {
    /// The tokens requests must present (none).
    pub tokens: newsnack::http::auth::Tokens,
    /// The service's sessions go through this URL (a pooler, a gate)
    /// instead of the database's own.
    pub pooled_url: Option<String>,
    /// A URL that reaches the database directly, for the listener and the
    /// advisory locks, when `pooled_url` goes through a transaction pooler.
    pub direct_url: Option<String>,
    /// The size of the service's pool (16).
    pub pool_size: Option<usize>,
    /// How long unfinished generations may finish after shutdown (5 s).
    pub grace: Option<Duration>,
    /// Unfinished claims held before new requests are turned away.
    pub max_backlog: Option<usize>,
}

impl Setup {
    /// The service's sessions go through the pooler at `pooled_url`; the
    /// listener's and the locks' through `direct_url` (`None`: the pooled
    /// URL serves both, as a misconfigured service would have it).
    pub fn through_pooler(pooled_url: &str, direct_url: Option<&str>) -> Setup {
        Setup {
            pooled_url: Some(pooled_url.to_string()),
            direct_url: direct_url.map(str::to_string),
            ..Setup::default()
        }
    }

    /// Every request but the probes and `/metrics` needs the API token
    /// `token`.
    pub fn with_token(token: &str) -> Setup {
        Setup {
            tokens: newsnack::http::auth::Tokens::api(token),
            ..Setup::default()
        }
    }

    /// The options `newsnack serve` gets for instance `instance` on the
    /// database at `database_url`.
    pub fn options(self, database_url: &str, instance: &str) -> ServeOptions {
        ServeOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            database_url: Some(self.pooled_url.unwrap_or_else(|| database_url.to_string())),
            direct_database_url: self.direct_url,
            instance: instance.into(),
            pool_size: self.pool_size.unwrap_or(16),
            grace: self.grace.unwrap_or(Duration::from_secs(5)),
            tokens: self.tokens,
            max_backlog: self
                .max_backlog
                .unwrap_or(ServeOptions::DEFAULT_MAX_BACKLOG),
        }
    }
}

/// Starts the whole service in-process on a free port, on the database at
/// `database_url` (one that is not a [`TestDb`]'s: a TLS server's, one the
/// test restarts), with `writer` and `setup`.
pub async fn start_service(
    database_url: &str,
    instance: &str,
    writer: impl Into<Writers>,
    setup: Setup,
) -> RunningService {
    newsnack::serve::start(setup.options(database_url, instance), writer)
        .await
        .expect("start the service")
}

/// Where a test process's own log lines go when a test captures them: a
/// buffer shared with the test, appended to.
pub struct LogSink(pub Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogSink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The writer that needs no LLM, as the service's.
pub fn offline() -> SharedWriter {
    Arc::new(OfflineWriter) as SharedWriter
}

/// The first column of every row `sql` returns.
pub async fn first_column<T>(
    client: &Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Vec<T>
where
    T: for<'a> tokio_postgres::types::FromSql<'a>,
{
    client
        .query(sql, params)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// Moves issues `ids` through `statuses` with raw SQL on `client` (another
/// system's session, or a transaction the test keeps open), one statement
/// per step.
pub async fn move_on(client: &impl tokio_postgres::GenericClient, ids: &[i64], statuses: &[&str]) {
    for status in statuses {
        client
            .execute(
                "UPDATE issue SET processing_status = $2 WHERE id = ANY($1)",
                &[&ids, status],
            )
            .await
            .unwrap_or_else(|e| panic!("move {ids:?} to {status}: {e}"));
    }
}

/// The message the database refuses `sql` with; fails if it runs.
pub async fn refusal(client: &Client, sql: &str) -> String {
    let err = client
        .execute(sql, &[])
        .await
        .expect_err(&format!("refused: {sql}"));
    err.as_db_error()
        .unwrap_or_else(|| panic!("{sql}: not refused by the database: {err}"))
        .message()
        .to_string()
}

/// Creates the login role `role` unless it exists (roles are the
/// server's, shared by every test database).
pub async fn login_role(client: &Client, role: &str) {
    client
        .batch_execute(&format!(
            "DO $$ BEGIN
                 IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
                     CREATE ROLE {role} LOGIN;
                 END IF;
             END $$"
        ))
        .await
        .unwrap();
}

/// Waits until `check` (a query returning one boolean) is true, re-checking
/// whenever a transition is announced. Fails after `secs` seconds.
pub async fn until_sql(db: &TestDb, hub: &EventHub, secs: u64, sql: &str) {
    until_true(db, secs, sql, Some(hub.subscribe())).await
}

/// Waits until `check` (a query returning one boolean) is true, asking
/// every 50 ms: for a state no transition announces (a lock taken, a
/// session opened). Fails after `secs` seconds.
pub async fn until_sql_polled(db: &TestDb, secs: u64, sql: &str) {
    until_true::<()>(db, secs, sql, None).await
}

/// Asks `sql` (one boolean) until it is true: again on the next message of
/// `live` (or a lag notice), or after 50 ms without one. Fails after
/// `secs` seconds.
async fn until_true<T: Clone>(
    db: &TestDb,
    secs: u64,
    sql: &str,
    mut live: Option<tokio::sync::broadcast::Receiver<T>>,
) {
    within(secs, sql, async {
        loop {
            let done: bool = db.query_one(sql, &[]).await.get(0);
            if done {
                return;
            }
            match live.as_mut() {
                Some(live) => drop(live.recv().await),
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await
}

/// Waits until issue `id` is in `status` (see [`until_sql`]).
pub async fn until_status(db: &TestDb, hub: &EventHub, secs: u64, id: i64, status: &str) {
    until_sql(
        db,
        hub,
        secs,
        &format!("SELECT processing_status = '{status}' FROM issue WHERE id = {id}"),
    )
    .await
}

/// Waits until exactly `n` issues are `DONE` (see [`until_sql`]).
pub async fn until_done_count(db: &TestDb, hub: &EventHub, secs: u64, n: usize) {
    until_sql(
        db,
        hub,
        secs,
        &format!("SELECT count(*) = {n} FROM issue WHERE processing_status = 'DONE'"),
    )
    .await
}

/// Waits for `fut` at most `secs` seconds, failing the test with `what`.
pub async fn within<T>(secs: u64, what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), fut)
        .await
        .unwrap_or_else(|_| panic!("timed out after {secs}s waiting for {what}"))
}

/// `n` new issues claimed by `worker` for `lease`, through the claim
/// statement: each id with its claim's token, in id order, and the pooled
/// connection that claimed them, to go on with.
pub async fn claimed_issues(
    db: &TestDb,
    n: usize,
    worker: &str,
    lease: Duration,
) -> (Vec<(i64, i64)>, deadpool_postgres::Client) {
    let ids = db.add_issues(n).await;
    let client = db.pool.get().await.unwrap();
    let scope = newsnack::db::issue::ClaimScope::Claimable;
    let outcome = newsnack::db::issue::claim_issues(&client, &ids, worker, lease, scope)
        .await
        .unwrap();
    assert_eq!(outcome.claimed_ids(), ids, "every new issue claimed");
    let claims = outcome.claimed.iter().map(|c| (c.id, c.claim_id)).collect();
    (claims, client)
}

/// Waits until the listener of `hub` has published every transition `db`'s
/// log holds now.
pub async fn until_caught_up(db: &TestDb, hub: &EventHub) {
    let newest = db
        .scalar_i64("SELECT COALESCE(max(seq), 0) FROM issue_transition")
        .await;
    until_published(hub, newest).await;
}

/// Waits until the listener has published `seq`.
pub async fn until_published(hub: &EventHub, seq: i64) {
    let mut status = hub.status();
    within(
        60,
        "the listener to publish everything",
        status.wait_for(|s| s.last_seq >= seq),
    )
    .await
    .expect("the listener is running");
}

/// Rows `statement` read from `table`, by scanning it or as entries of its
/// indexes, whatever runs them (a function's own statements included): the
/// server's counters for the transaction, run for real inside one that is
/// rolled back.
pub async fn rows_read_for_real(client: &Client, table: &str, statement: &str) -> i64 {
    // The counters include what earlier transactions of the session read
    // until the session reports it: the statement's rows are the
    // difference.
    let counted = || async {
        client
            .query_one(
                "SELECT (pg_stat_get_xact_tuples_returned(to_regclass($1))
                         + (SELECT COALESCE(sum(pg_stat_get_xact_tuples_returned(indexrelid)), 0)
                              FROM pg_index WHERE indrelid = to_regclass($1)))::bigint",
                &[&table],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    client.batch_execute("BEGIN").await.unwrap();
    let before = counted().await;
    client.batch_execute(statement).await.unwrap();
    let read = counted().await - before;
    client.batch_execute("ROLLBACK").await.unwrap();
    read
}

/// Rows `statement` read from `table`, by scanning it or as entries of its
/// indexes, every loop counted: from `EXPLAIN (ANALYZE, FORMAT JSON)`, so
/// run for real, inside a transaction that is rolled back.
pub async fn rows_read(client: &Client, table: &str, statement: &str) -> f64 {
    let indexes: Vec<String> = first_column(
        client,
        "SELECT indexname::text FROM pg_indexes WHERE tablename = $1",
        &[&table],
    )
    .await;
    client.batch_execute("BEGIN").await.unwrap();
    let plan: serde_json::Value = client
        .query_one(&format!("EXPLAIN (ANALYZE, FORMAT JSON) {statement}"), &[])
        .await
        .unwrap()
        .get(0);
    client.batch_execute("ROLLBACK").await.unwrap();
    plan_rows_read(&plan[0]["Plan"], table, &indexes)
}

fn plan_rows_read(plan: &serde_json::Value, table: &str, indexes: &[String]) -> f64 {
    let reads_table = plan["Index Name"]
        .as_str()
        .is_some_and(|name| indexes.iter().any(|i| i == name))
        || plan["Node Type"] == "Seq Scan" && plan["Relation Name"] == table;
    let own = if reads_table {
        let n = |key: &str| plan[key].as_f64().unwrap_or(0.0);
        (n("Actual Rows") + n("Rows Removed by Filter")) * n("Actual Loops")
    } else {
        0.0
    };
    own + plan["Plans"].as_array().map_or(0.0, |children| {
        children
            .iter()
            .map(|c| plan_rows_read(c, table, indexes))
            .sum()
    })
}

/// Adds `n` issues titled `{prefix} N`, with a body each; their ids.
pub async fn titled(db: &TestDb, prefix: &str, n: usize) -> Vec<i64> {
    let client = db.pool.get().await.unwrap();
    let issues: Vec<_> = (0..n)
        .map(|i| newsnack::db::issue::NewIssue {
            title: format!("{prefix} {i}"),
            body: format!("What happened in {prefix} {i}."),
            score: 1.0,
            collected_at: None,
            source_key: None,
        })
        .collect();
    newsnack::db::issue::insert_issues(&client, &issues)
        .await
        .unwrap()
}
