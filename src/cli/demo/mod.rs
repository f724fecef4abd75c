//! `newsnack demo`: the whole product in one command, with no
//! configuration. Starts a throwaway PostgreSQL (or, with `DATABASE_URL`,
//! creates a throwaway database on that server, leaving the database named
//! there untouched), loads a shipped set of sample issues, and runs one
//! pipeline with the built-in writer while the transitions scroll by:
//! claim → generate (two articles fail once, so a retry is visible) →
//! smart wait → briefing. Then it stops everything it started and removes
//! the throwaway cluster or database.

use std::collections::HashSet;
use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::briefing::run::{PipelineError, Trigger};
use crate::cli::tail::{self, TailStyle};
use crate::db::issue::NewIssue;
use crate::db::{self, DbError};
use crate::embedded::EmbeddedPostgres;
use crate::http::types::NewIssueJson;
use crate::serve::{self, Core, ServeError};
use crate::writer::{Article, IssueText, OfflineWriter, WriteError, WriteErrorKind, Writer};

const SAMPLE_ISSUES: &str = include_str!("sample_issues.json");

/// Why the demo stopped short.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("the demo's pipeline run could not start: {0}")]
    Pipeline(String),
    #[error(
        "the demo runs in a throwaway database of its own and could not create one on \
         DATABASE_URL's server ({0}); use a role that may create databases, or unset \
         DATABASE_URL for a throwaway cluster"
    )]
    CannotCreate(String),
}

/// The offline writer with model-like latency, failing the first attempt
/// at chosen issues with a rate limit, as a real LLM sometimes does.
struct DemoWriter {
    fail_once: Mutex<HashSet<i64>>,
}

impl Writer for DemoWriter {
    fn name(&self) -> &str {
        "offline"
    }

    fn write<'a>(&'a self, issue: IssueText<'a>) -> BoxFuture<'a, Result<Article, WriteError>> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(400 + (issue.id as u64 % 5) * 150)).await;
            if self
                .fail_once
                .lock()
                .map(|mut s| s.remove(&issue.id))
                .unwrap_or(false)
            {
                return Err(WriteError::retryable(
                    WriteErrorKind::RateLimited,
                    "HTTP 429 Too Many Requests (injected by the demo)",
                    Some(Duration::from_millis(500)),
                ));
            }
            OfflineWriter.write(issue).await
        })
    }
}

/// Runs the demo; returns when everything it started has stopped. Without
/// `database_url`, on a throwaway cluster of its own; with one, in a
/// throwaway database it creates on that server, so that nothing in the
/// database named there (its issues, settings, briefings, runs) is
/// touched. Either is removed when the demo ends, on error and Ctrl-C too.
pub async fn run(
    database_url: Option<&str>,
    direct_database_url: Option<&str>,
) -> Result<(), DemoError> {
    let out = &mut std::io::stdout();
    let style = if out.is_terminal() {
        TailStyle::Color
    } else {
        TailStyle::Plain
    };
    // Watched from the start: a Ctrl-C while the cluster starts must still
    // let it be stopped and deleted.
    let shutdown = CancellationToken::new();
    crate::shutdown::cancel_on_signal(shutdown.clone());
    let (database, place) = match database_url {
        None => {
            say(
                out,
                "newsnack demo: starting a throwaway PostgreSQL (nothing to configure)…",
            );
            let (database, url, cluster) = serve::database(None, None).await?;
            (database, Place::Cluster { cluster, url })
        }
        Some(server) => {
            say(
                out,
                "newsnack demo: creating a throwaway database on DATABASE_URL's server…",
            );
            let server = db::Database::parse(server, direct_database_url, "newsnack-demo")?;
            Place::create_database(server).await?
        }
    };
    if shutdown.is_cancelled() {
        let gone = place.remove().await;
        say(out, &format!("Interrupted: {gone}."));
        return Ok(());
    }
    say(out, &format!("  database: {}", place.describe()));
    let result = show(&database, style, &shutdown).await;
    let gone = place.remove().await;
    let end = if result.is_ok() { "Done" } else { "Stopped" };
    say(out, &format!("\n{end}: {gone}."));
    result
}

/// Where the demo runs; [`Place::remove`] takes it away again.
enum Place {
    /// A throwaway cluster of its own, at `url`.
    Cluster {
        cluster: Option<EmbeddedPostgres>,
        url: String,
    },
    /// A throwaway database `name` it created on DATABASE_URL's server.
    Database { server: db::Database, name: String },
}

impl Place {
    /// Creates a database of the demo's own on `server`; returns the
    /// endpoints of that database.
    async fn create_database(server: db::Database) -> Result<(db::Database, Place), DemoError> {
        let admin = server.pooled.connect().await?;
        let name = format!(
            "newsnack_demo_{}_{:08x}",
            std::process::id(),
            rand::random::<u32>()
        );
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .map_err(|e| DemoError::CannotCreate(DbError::from(e).to_string()))?;
        let database = db::Database {
            pooled: server.pooled.with_dbname(&name),
            direct: server.direct.with_dbname(&name),
            statements: server.statements,
        };
        Ok((database, Place::Database { server, name }))
    }

    /// What to print as "database:" (never a password).
    fn describe(&self) -> String {
        match self {
            Place::Cluster { url, .. } => url.clone(),
            Place::Database { server, name } => format!(
                "{name} on {} (throwaway, from DATABASE_URL; dropped on exit)",
                server.pooled.describe()
            ),
        }
    }

    /// Stops and deletes the cluster, or drops the database; says what
    /// became of it.
    async fn remove(self) -> String {
        match self {
            Place::Cluster { cluster, .. } => {
                tokio::task::spawn_blocking(move || drop(cluster))
                    .await
                    .ok();
                "the throwaway database is stopped and deleted".into()
            }
            Place::Database { server, name } => {
                let dropped = async {
                    let admin = server.pooled.connect().await?;
                    // FORCE: a session the demo left behind (an error
                    // path) must not keep the database alive.
                    admin
                        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .await
                        .map_err(DbError::from)
                };
                match dropped.await {
                    Ok(()) => format!("the throwaway database {name} is dropped"),
                    Err(e) => format!(
                        "the throwaway database {name} could not be dropped ({e}); drop it with `DROP DATABASE {name}`"
                    ),
                }
            }
        }
    }
}

/// The demo itself, on `database`: sample issues, one pipeline run with its
/// transitions printed as they commit, the outcome and the briefing.
async fn show(
    database: &db::Database,
    style: TailStyle,
    shutdown: &CancellationToken,
) -> Result<(), DemoError> {
    let out = &mut std::io::stdout();
    // Load the samples first, so the writer knows which ids to trip up.
    let database = database.with_application_name("newsnack-demo");
    let mut setup = database.pooled.connect().await?;
    db::migrate::migrate(&mut setup).await?;
    drop(setup);
    let samples: Vec<NewIssueJson> =
        serde_json::from_str(SAMPLE_ISSUES).expect("the shipped samples parse");
    let samples: Vec<NewIssue> = samples.into_iter().map(NewIssue::from).collect();
    let ids = {
        let pool = db::pool(&database.pooled, &db::PoolOptions::default())?;
        let client = pool.get().await.map_err(DbError::from)?;
        let ids = db::issue::insert_issues(&client, &samples).await?;
        for (key, value) in [("retry_backoff_ms", "300"), ("content_gen_timeout_s", "60")] {
            db::setting::set(&client, key, value).await?;
        }
        drop(client);
        pool.close();
        ids
    };
    say(
        out,
        &format!(
            "  loaded {} sample issues; top_k = 5, min_completion = 3",
            ids.len()
        ),
    );
    let writer = Arc::new(DemoWriter {
        fail_once: Mutex::new([ids[1], ids[3]].into_iter().collect()),
    });
    let core = Core::start(
        &database,
        "demo",
        8,
        writer,
        Duration::from_secs(5),
        crate::generation::retry::RetryScope::everything(),
        shutdown,
    )
    .await?;
    let result = narrate(&core, style, shutdown).await;
    shutdown.cancel();
    core.stopped().await;
    result
}

/// Runs the pipeline once while printing the transitions, then the outcome
/// and the briefing.
async fn narrate(
    core: &Core,
    style: TailStyle,
    shutdown: &CancellationToken,
) -> Result<(), DemoError> {
    let out = &mut std::io::stdout();
    say(
        out,
        "\nTransitions as they commit (from the database's NOTIFY):",
    );
    let mut stream = core.hub.stream_after(0, None);
    let printer_stop = CancellationToken::new();
    // The last `seq` the printer has shown.
    let (printed_tx, mut printed) = tokio::sync::watch::channel(0i64);
    let printer = {
        let stop = printer_stop.clone();
        tokio::spawn(async move {
            let mut out = std::io::stdout();
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    next = stream.next() => match next {
                        Ok(t) => {
                            say(&mut out, &format!("  {}", tail::render(&t, style)));
                            printed_tx.send_replace(t.seq);
                        }
                        Err(_) => return,
                    },
                }
            }
        })
    };
    // The printer stops on every way out of here.
    let _stop_printer = printer_stop.clone().drop_guard();

    let result = core.pipeline().run_locked(Trigger::Manual, shutdown).await;
    // Let the printer catch up with the log before summarising.
    let last = db::transition::last_seq(&**core.pool.get().await.map_err(DbError::from)?).await?;
    let _ = tokio::time::timeout(Duration::from_secs(2), printed.wait_for(|&p| p >= last)).await;
    printer_stop.cancel();
    let _ = printer.await;

    let summary = match result {
        Ok(Some(summary)) => summary,
        Ok(None) | Err(PipelineError::Busy) => {
            return Err(DemoError::Pipeline("the pipeline lock was busy".into()))
        }
        Err(e @ PipelineError::TakenOver) => return Err(DemoError::Pipeline(e.to_string())),
        Err(PipelineError::Db(e)) => return Err(e.into()),
    };
    say(
        out,
        &format!(
            "\nSmart wait outcome: {} ({} of {} targets DONE; two articles needed a retry)",
            summary.outcome,
            summary.completed.len(),
            summary.targets.len()
        ),
    );
    if let Some(id) = summary.briefing_id {
        let client = core.pool.get().await.map_err(DbError::from)?;
        if let Some(briefing) = db::briefing::get(&client, Some(id)).await? {
            say(
                out,
                &format!(
                    "\n────────── briefing #{id} ──────────\n{}\n──────────────────────────────",
                    briefing.body
                ),
            );
        }
    } else {
        say(out, "No briefing was published (skip).");
    }
    Ok(())
}

fn say(out: &mut impl Write, line: &str) {
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}
