//! The command line: clap definitions (their doc comments are the `--help`
//! text) and the dispatch to the one-shot commands (`commands`), the demo
//! and `serve`. This file only parses and dispatches.

mod commands;
pub mod demo;
pub mod tail;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use time::OffsetDateTime;

use crate::db::role::{self, RoleKind};
use crate::db::{self, DbError};
use crate::embedded::EmbeddedError;
use crate::input::InvalidInput;
use crate::model::status::Status;

/// newsnack: picks the day's hottest news issues, has an LLM write one
/// article per issue, and assembles the top ones into a daily briefing.
#[derive(Debug, Parser)]
#[command(name = "newsnack", version, about, max_term_width = 100)]
pub struct Cli {
    /// PostgreSQL URL, e.g. postgres://user@localhost/newsnack
    /// (libpq's sslmode, sslrootcert, sslcert and sslkey apply; sslmode
    /// defaults to prefer). May point at a transaction pooler.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,

    /// A URL that reaches PostgreSQL directly (not through a transaction
    /// pooler), for the listener and the advisory locks. Default: the
    /// database URL.
    #[arg(
        long,
        env = "NEWSNACK_DIRECT_DATABASE_URL",
        global = true,
        hide_env_values = true
    )]
    pub direct_database_url: Option<String>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// The whole product in one command on a throwaway database and the
    /// built-in writer: sample issues, one pipeline run with live
    /// transitions, the smart-wait outcome and the briefing. With
    /// DATABASE_URL, the throwaway database is created on that server (the
    /// database named there is left untouched) and dropped at the end.
    Demo,
    /// Run the service: HTTP API, listener, generation workers, retries,
    /// lease reaper. Without DATABASE_URL, on a throwaway embedded cluster.
    Serve(ServeArgs),
    /// Apply the schema (idempotent; safe to run from several places at once).
    Migrate,
    /// Follow status transitions live until Ctrl-C.
    Tail(TailArgs),
    /// Claim issues for generation through the SKIP LOCKED claim; prints
    /// what was claimed and what was skipped.
    Claim {
        /// Issue ids (positive integers).
        #[arg(required = true, num_args = 1..)]
        ids: Vec<i64>,
    },
    /// Count issues per status.
    Status,
    /// Add or show issues.
    #[command(subcommand)]
    Issues(IssuesCommand),
    /// Reset FAILED issues to PENDING with a fresh retry budget.
    Retry {
        #[arg(required = true, num_args = 1..)]
        ids: Vec<i64>,
    },
    /// Cancel issues: each ends FAILED with last_error "cancelled" and no
    /// automatic retry (`retry` brings it back); an article being written
    /// is abandoned on whichever instance writes it. Prints
    /// {"cancelled":[..],"done":[..],"unknown":[..]}; exit code 1 when
    /// none was cancelled.
    Cancel {
        #[arg(required = true, num_args = 1..)]
        ids: Vec<i64>,
    },
    /// Read and change runtime settings (take effect without a restart).
    #[command(subcommand)]
    Settings(SettingsCommand),
    /// Stop every instance from starting an LLM call (sets
    /// generation_paused to true): calls in flight finish, claims are
    /// still accepted and queue, waits keep their deadlines.
    Pause,
    /// Let LLM calls start again (sets generation_paused to false): the
    /// queued calls start at once.
    Resume,
    /// Smart-wait for issues: prints the outcome as JSON. Exit code 0 for
    /// all_pass and timeout_pass, 3 for skip.
    Wait {
        #[arg(required = true, num_args = 1..)]
        ids: Vec<i64>,
        /// Seconds to wait (default: the content_gen_timeout_s setting).
        #[arg(long, value_name = "SECS")]
        timeout: Option<f64>,
        /// DONE issues needed to pass at the timeout (default: the
        /// content_gen_min_completion setting).
        #[arg(long, value_name = "N")]
        min: Option<usize>,
    },
    /// Run the pipeline once now (select, claim, generate, wait, assemble),
    /// under the same lock as the scheduler. Exit code 0 when a briefing was
    /// published, 3 for skip, 4 when another run holds the lock.
    RunPipeline,
    /// List the advisory locks held in the database and who holds them.
    Locks,
    /// Remove what the retention settings no longer keep (log_retention_days,
    /// issue_retention_days), in small transactions; prints the rows removed
    /// per table as one JSON object. `serve` does this by itself hourly.
    Prune {
        /// Only count what would be removed; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Give another system's role least privilege: writer or reader.
    ///
    /// Takes away whatever else the role held on newsnack's tables,
    /// sequences and schema first, so it also turns a writer into a reader;
    /// refuses (changing nothing) a role privileges cannot restrict. Run as
    /// the owner of newsnack's tables; prints what the role may now do as
    /// JSON. The SQL it runs is in docs/sql.md ("Roles").
    Grant {
        /// What the role may do.
        #[arg(value_enum)]
        kind: GrantKind,
        /// An existing role (CREATE ROLE ... LOGIN), not a superuser nor
        /// the owner.
        role: String,
    },
}

/// The kinds of role `grant` makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GrantKind {
    /// Read every table; add issues; change an issue's processing_status,
    /// title, body, score, collected_at and source_key.
    Writer,
    /// Read every table; nothing else.
    Reader,
}

impl From<GrantKind> for RoleKind {
    fn from(kind: GrantKind) -> Self {
        match kind {
            GrantKind::Writer => RoleKind::Writer,
            GrantKind::Reader => RoleKind::Reader,
        }
    }
}

/// Exit code of `wait` and `run-pipeline` when the outcome is skip.
pub const EXIT_SKIP: u8 = 3;
/// Exit code of `run-pipeline` when another run holds the lock.
pub const EXIT_BUSY: u8 = 4;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address of the HTTP API.
    #[arg(long, env = "NEWSNACK_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: std::net::SocketAddr,
    /// This instance's name in claims and logs (default: host:pid).
    #[arg(long, env = "NEWSNACK_INSTANCE")]
    pub instance: Option<String>,
    /// Database connections in the pool.
    #[arg(long, env = "NEWSNACK_DB_POOL", default_value_t = 16, value_parser = clap::value_parser!(u16).range(2..=1000))]
    pub pool_size: u16,
    /// Seconds in-flight generations may finish after SIGTERM or Ctrl-C
    /// before they are released as FAILED (reason `shutdown`).
    #[arg(long, env = "NEWSNACK_SHUTDOWN_GRACE_S", default_value_t = 10)]
    pub grace_s: u64,
    /// Token that opens every API request, as `Authorization: Bearer
    /// <token>` or as the password of HTTP Basic; at least 16 visible
    /// ASCII characters. Unset (and no read token): no token needed.
    #[arg(long, env = "NEWSNACK_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// Token that opens GET and HEAD requests only (the dashboard, the
    /// event stream, reading issues and briefings); must differ from the
    /// API token. With either token set, every route but /healthz, /readyz
    /// and /metrics needs one.
    #[arg(long, env = "NEWSNACK_READ_TOKEN", hide_env_values = true)]
    pub read_token: Option<String>,
    /// Token that opens GET /metrics (the API token opens it too). Unset:
    /// /metrics is open.
    #[arg(long, env = "NEWSNACK_METRICS_TOKEN", hide_env_values = true)]
    pub metrics_token: Option<String>,
    /// Claimed issues this instance may hold unfinished before
    /// `POST /ai-articles` answers 503 (try later, or another instance).
    #[arg(long, env = "NEWSNACK_MAX_BACKLOG", default_value_t = crate::serve::ServeOptions::DEFAULT_MAX_BACKLOG as u32, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_backlog: u32,
}

#[derive(Debug, Args)]
pub struct TailArgs {
    /// Start after this log position (0 replays the whole history);
    /// default: from now on. A position beyond the log's end starts at its
    /// end, and one older than the log keeps (pruned) at its oldest kept
    /// transition, each with a warning.
    #[arg(long, value_name = "SEQ", value_parser = clap::value_parser!(i64).range(0..))]
    pub since: Option<i64>,
    /// Only this issue's transitions.
    #[arg(long, value_name = "ID", value_parser = clap::value_parser!(i64).range(1..))]
    pub issue: Option<i64>,
    /// Only transitions into this status.
    #[arg(long, value_name = "STATUS")]
    pub status: Option<Status>,
    /// One JSON object per line (seq, issue_id, from, to, at).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum IssuesCommand {
    /// Add one issue from flags, or many from a JSON file
    /// (`[{"title":..,"body":..,"score":..,"source_key":..}]` or
    /// `{"issues":[..]}`). Prints `{"ids":[..],"existing":[..]}`.
    Add {
        #[arg(long, required_unless_present = "file", conflicts_with = "file")]
        title: Option<String>,
        #[arg(long, default_value = "")]
        body: String,
        #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
        score: f64,
        /// RFC 3339 time the issue was collected (default: now).
        #[arg(long, value_parser = parse_rfc3339)]
        collected_at: Option<OffsetDateTime>,
        /// The collector's key for the story (1 to 1000 characters): if an
        /// issue already holds it, nothing is added and that issue's id is
        /// printed (also listed under "existing").
        #[arg(long, value_name = "KEY", conflicts_with = "file")]
        source_key: Option<String>,
        /// A JSON file of issues ("-" for standard input).
        #[arg(long)]
        file: Option<std::path::PathBuf>,
    },
    /// Show one issue as JSON.
    Show { id: i64 },
}

#[derive(Debug, Subcommand)]
pub enum SettingsCommand {
    /// Every setting with its value, default, bounds and meaning.
    List,
    /// One setting's value.
    Get { key: String },
    /// Change a setting; running services pick it up on next use.
    Set { key: String, value: String },
}

fn parse_rfc3339(s: &str) -> Result<OffsetDateTime, String> {
    OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .map_err(|e| format!("not an RFC 3339 time ({e}), e.g. 2026-11-29T08:00:00Z"))
}

/// A command that could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("DATABASE_URL is not set: pass --database-url or set DATABASE_URL")]
    NoDatabase,
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Input(#[from] InvalidInput),
    #[error(transparent)]
    Embedded(#[from] EmbeddedError),
    #[error(transparent)]
    Serve(#[from] crate::serve::ServeError),
    #[error(transparent)]
    Writer(#[from] crate::writer::WriterConfigError),
    #[error(transparent)]
    Grant(#[from] role::GrantError),
    #[error("{0}")]
    Failed(String),
}

/// Runs a parsed command line and returns the process exit code.
pub async fn run(cli: Cli) -> Result<ExitCode, CliError> {
    let url = cli.database_url.clone();
    let direct = cli.direct_database_url.clone();
    let database = |name: &str| -> Result<db::Database, CliError> {
        let url = commands::required(url.clone())?;
        Ok(db::Database::parse(&url, direct.as_deref(), name)?)
    };
    match cli.command {
        Command::Serve(args) => commands::serve(url, direct, args).await,
        Command::Demo => {
            crate::cli::demo::run(
                url.as_deref().filter(|u| !u.trim().is_empty()),
                direct.as_deref(),
            )
            .await
            .map_err(|e| CliError::Failed(e.to_string()))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate => commands::migrate(&database("newsnack-migrate")?).await,
        Command::Tail(args) => commands::tail(&database("newsnack-cli")?, args).await,
        Command::Claim { ids } => commands::claim(&database("newsnack-cli")?, &ids).await,
        Command::Status => commands::status(&database("newsnack-cli")?).await,
        Command::Issues(cmd) => commands::issues(&database("newsnack-cli")?, cmd).await,
        Command::Retry { ids } => commands::retry(&database("newsnack-cli")?, &ids).await,
        Command::Cancel { ids } => commands::cancel(&database("newsnack-cli")?, &ids).await,
        Command::Settings(cmd) => commands::settings(&database("newsnack-cli")?, cmd).await,
        Command::Pause => commands::pause(&database("newsnack-cli")?, true).await,
        Command::Resume => commands::pause(&database("newsnack-cli")?, false).await,
        Command::Wait { ids, timeout, min } => {
            commands::wait(&database("newsnack-cli")?, ids, timeout, min).await
        }
        Command::RunPipeline => commands::run_pipeline(&database("newsnack-cli")?).await,
        Command::Locks => commands::locks(&database("newsnack-cli")?).await,
        Command::Prune { dry_run } => commands::prune(&database("newsnack-cli")?, dry_run).await,
        Command::Grant { kind, role } => {
            commands::grant(&database("newsnack-grant")?, kind.into(), &role).await
        }
    }
}
