//! The PostgreSQL harness for integration tests.
//!
//! One throwaway cluster per test process (or the server at `DATABASE_URL`),
//! a migrated template database made once, and a fresh database per test
//! cloned from it, so tests run in parallel without seeing each other.
#![allow(dead_code)]

pub mod audit;
pub mod fake_llm;
pub mod gate;
pub mod pgbouncer;
pub mod process;
pub mod python;
pub mod subscribers;
pub mod tls;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use newsnack::db::{self, DbPool, PoolOptions};
use newsnack::embedded::{EmbeddedOptions, EmbeddedPostgres};
use newsnack::events::hub::EventHub;
use newsnack::events::listener::{Listener, ListenerOptions};
use newsnack::serve::{RunningService, ServeOptions};
use newsnack::writer::SharedWriter;
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

    /// Starts a listener; cancel the token to stop it.
    pub async fn listener(&self) -> (EventHub, CancellationToken) {
        self.listener_with(ListenerOptions::default()).await
    }

    pub async fn listener_with(&self, options: ListenerOptions) -> (EventHub, CancellationToken) {
        let token = CancellationToken::new();
        let (hub, _task) = Listener::start(
            self.endpoint.clone(),
            self.pool.clone(),
            options,
            token.clone(),
        )
        .await
        .expect("start listener");
        (hub, token)
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

    /// Starts the whole service in-process on a free port, with `writer`.
    pub async fn serve(&self, instance: &str, writer: SharedWriter) -> RunningService {
        newsnack::serve::start(self.serve_options(instance), writer)
            .await
            .expect("start the service")
    }

    /// What [`TestDb::serve`] starts the service with.
    pub fn serve_options(&self, instance: &str) -> ServeOptions {
        ServeOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            database_url: Some(self.url.clone()),
            direct_database_url: None,
            instance: instance.into(),
            pool_size: 16,
            grace: Duration::from_secs(5),
            api_token: None,
            max_backlog: ServeOptions::DEFAULT_MAX_BACKLOG,
        }
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
        for status in statuses {
            client
                .execute(
                    "UPDATE issue SET processing_status = $2 WHERE id = ANY($1)",
                    &[&ids, status],
                )
                .await
                .unwrap();
        }
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
    /// [`TestDb::count_statements`]), however it was sent: the call of
    /// `newsnack_claim` unnamed (`$1`), or its statement for a scope kept by a
    /// session (`$2`, [`kept_claim_pattern`]).
    pub async fn claim_statements(&self) -> i64 {
        let client = self.pool.get().await.unwrap();
        let row = client
            .query_one(
                "SELECT COALESCE(sum(calls), 0)::bigint FROM pg_stat_statements
                  WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                    AND (query = $1 OR query LIKE $2)",
                &[&newsnack::db::issue::CLAIM_STATEMENT, &kept_claim_pattern()],
            )
            .await
            .unwrap();
        row.get(0)
    }

    /// The first column of every row of a query, as ids.
    pub async fn ids(&self, sql: &str) -> Vec<i64> {
        let client = self.pool.get().await.unwrap();
        let rows = client.query(sql, &[]).await.unwrap();
        rows.iter().map(|r| r.get(0)).collect()
    }

    /// The issues `instance` holds `IN_PROGRESS` now: those it strands when
    /// it is killed.
    pub async fn held_by(&self, instance: &str) -> Vec<i64> {
        let client = self.pool.get().await.unwrap();
        let rows = client
            .query(
                "SELECT id FROM issue WHERE processing_status = 'IN_PROGRESS' AND claimed_by = $1",
                &[&instance],
            )
            .await
            .unwrap();
        rows.iter().map(|r| r.get(0)).collect()
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
        let client = self.pool.get().await.unwrap();
        client
            .query_one("SELECT processing_status FROM issue WHERE id = $1", &[&id])
            .await
            .unwrap()
            .get(0)
    }

    /// One scalar from a query, for assertions.
    pub async fn scalar_i64(&self, sql: &str) -> i64 {
        let client = self.pool.get().await.unwrap();
        client.query_one(sql, &[]).await.unwrap().get(0)
    }
}

/// Waits until `check` (a query returning one boolean) is true, re-checking
/// whenever a transition is announced. Fails after `secs` seconds.
pub async fn until_sql(db: &TestDb, hub: &EventHub, secs: u64, sql: &str) {
    let mut live = hub.subscribe();
    within(secs, sql, async {
        loop {
            let client = db.pool.get().await.unwrap();
            let done: bool = client.query_one(sql, &[]).await.unwrap().get(0);
            drop(client);
            if done {
                return;
            }
            // Re-check on the next transition (or a lag notice).
            let _ = live.recv().await;
        }
    })
    .await
}

/// Waits until `check` (a query returning one boolean) is true, asking
/// every 50 ms: for a state no transition announces (a lock taken, a
/// session opened). Fails after `secs` seconds.
pub async fn until_sql_polled(db: &TestDb, secs: u64, sql: &str) {
    within(secs, sql, async {
        loop {
            let client = db.pool.get().await.unwrap();
            let done: bool = client.query_one(sql, &[]).await.unwrap().get(0);
            drop(client);
            if done {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
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

/// Waits for `fut` at most `secs` seconds, failing the test with `what`.
pub async fn within<T>(secs: u64, what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), fut)
        .await
        .unwrap_or_else(|_| panic!("timed out after {secs}s waiting for {what}"))
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
    client.batch_execute("BEGIN").await.unwrap();
    client.batch_execute(statement).await.unwrap();
    let read: i64 = client
        .query_one(
            "SELECT (pg_stat_get_xact_tuples_returned(to_regclass($1))
                     + (SELECT COALESCE(sum(pg_stat_get_xact_tuples_returned(indexrelid)), 0)
                          FROM pg_index WHERE indrelid = to_regclass($1)))::bigint",
            &[&table],
        )
        .await
        .unwrap()
        .get(0);
    client.batch_execute("ROLLBACK").await.unwrap();
    read
}

/// Rows `statement` read from `table`, by scanning it or as entries of its
/// indexes, every loop counted: from `EXPLAIN (ANALYZE, FORMAT JSON)`, so
/// run for real, inside a transaction that is rolled back.
pub async fn rows_read(client: &Client, table: &str, statement: &str) -> f64 {
    let indexes: Vec<String> = client
        .query(
            "SELECT indexname::text FROM pg_indexes WHERE tablename = $1",
            &[&table],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
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

/// A `LIKE` pattern for the kept claim, of any scope, as
/// `pg_stat_statements` shows it: the first line, which the scopes share,
/// before any constant it numbers as a parameter.
pub fn kept_claim_pattern() -> String {
    use newsnack::db::issue::{kept_claim_statement, ClaimScope};
    let first = kept_claim_statement(ClaimScope::Claimable).lines().next();
    format!("{}%", first.unwrap_or_default())
}
