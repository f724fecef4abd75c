//! The one-shot commands: each connects, does its one thing, prints, and
//! returns the process's exit code. `serve` and `demo` hand over to their
//! own modules.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::tail::{self, TailStyle};
use super::{CliError, IssuesCommand, ServeArgs, SettingsCommand, TailArgs, EXIT_BUSY, EXIT_SKIP};
use crate::db::issue::{ClaimScope, NewIssue};
use crate::db::role::{self, RoleKind};
use crate::db::{self, DbError, DbPool, PoolOptions};
use crate::events::listener::{Listener, ListenerOptions};
use crate::events::stream::StreamItem;
use crate::input::{self};
use crate::settings::Settings;

pub(super) fn required(url: Option<String>) -> Result<String, CliError> {
    url.filter(|u| !u.trim().is_empty())
        .ok_or(CliError::NoDatabase)
}

/// A small pool for a one-shot command, checked by taking one connection so
/// a dead URL fails here with the server's reason.
pub(super) async fn open(database: &db::Database) -> Result<DbPool, CliError> {
    let pool = db::pool(
        &database.pooled,
        &PoolOptions {
            max_size: 4,
            wait_timeout: Duration::from_secs(10),
            statements: database.statements,
        },
    )?;
    drop(pool.get().await.map_err(DbError::from)?);
    Ok(pool)
}

/// Starts the listener of a command that follows transitions. Fails, with
/// the reason, when notifications do not reach it (a transaction pooler in
/// the way) rather than waiting in silence.
pub(super) async fn listen(
    database: &db::Database,
    pool: DbPool,
    shutdown: &CancellationToken,
) -> Result<crate::events::hub::EventHub, CliError> {
    let (hub, _task) = Listener::start(
        database.direct.clone(),
        pool,
        ListenerOptions::default(),
        shutdown.clone(),
    )
    .await?;
    let status = hub.status().borrow().clone();
    match status.problem {
        Some(problem) if !status.connected => Err(CliError::Failed(problem)),
        _ => Ok(hub),
    }
}

pub(super) async fn serve(
    url: Option<String>,
    direct: Option<String>,
    args: ServeArgs,
) -> Result<ExitCode, CliError> {
    let tokens = crate::http::auth::Tokens {
        api: args.api_token,
        read: args.read_token,
        metrics: args.metrics_token,
    };
    // Before anything is logged: a bad token is the one line printed.
    tokens.check().map_err(crate::serve::ServeError::from)?;
    let writer = crate::writer::build_all(&crate::writer::WriterConfig::from_env()?)?;
    tracing::info!(
        writer = writer.primary.name(),
        fallback = writer.fallback.as_ref().map(|w| w.name()),
        "writer ready"
    );
    let options = crate::serve::ServeOptions {
        listen: args.listen,
        database_url: url.filter(|u| !u.trim().is_empty()),
        direct_database_url: direct.filter(|u| !u.trim().is_empty()),
        instance: args
            .instance
            .unwrap_or_else(crate::serve::default_instance_name),
        pool_size: args.pool_size as usize,
        grace: Duration::from_secs(args.grace_s),
        tokens,
        max_backlog: args.max_backlog as usize,
    };
    let embedded = options.database_url.is_none();
    // Watched before start-up (which may start a throwaway cluster): a
    // signal meanwhile stops the service as soon as it is up, so the
    // cluster is still stopped and deleted.
    let signalled = CancellationToken::new();
    crate::shutdown::cancel_on_signal(signalled.clone());
    let service = crate::serve::start(options, writer).await?;
    crate::shutdown::drain_on_signal(service.draining_token());
    // Status lines, like the logs, are lost rather than fatal when stdout
    // fails (a closed pipe, a full disk).
    if embedded {
        crate::logging::print_line(format_args!(
            "database: {} (throwaway, deleted on exit)",
            service.database_url
        ));
    }
    crate::logging::print_line(format_args!("newsnack serving on http://{}", service.addr));
    let stop = service.shutdown_token();
    tokio::spawn(async move {
        signalled.cancelled().await;
        stop.cancel();
    });
    service.wait().await?;
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn migrate(database: &db::Database) -> Result<ExitCode, CliError> {
    let mut client = database.pooled.connect().await?;
    let report = db::migrate::migrate(&mut client).await?;
    if report.applied.is_empty() {
        println!("schema is up to date (version {})", report.current);
    } else {
        println!(
            "applied migrations {:?}; schema is at version {}",
            report.applied, report.current
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn tail(database: &db::Database, args: TailArgs) -> Result<ExitCode, CliError> {
    let pool = open(database).await?;
    let shutdown = CancellationToken::new();
    crate::shutdown::cancel_on_signal(shutdown.clone());
    let hub = listen(database, pool, &shutdown).await?;
    let start = hub.starting_point(args.since).await;
    if let Some(requested) = start.beyond_log {
        crate::logging::eprint_line(format_args!(
            "newsnack: the log has no transition at seq {requested} (it ends at {}); following from its end",
            start.after
        ));
    }
    let mut stream = hub.stream_after(start.after, args.issue);
    let style = if args.json {
        TailStyle::Json
    } else if std::io::stdout().is_terminal() {
        TailStyle::Color
    } else {
        TailStyle::Plain
    };
    let mut out = std::io::stdout().lock();
    loop {
        let next = tokio::select! {
            _ = shutdown.cancelled() => return Ok(ExitCode::SUCCESS),
            next = stream.next_item_through_outages() => next,
        };
        let t = match next.map_err(|e| CliError::Failed(e.to_string()))? {
            StreamItem::Transition(t) => t,
            StreamItem::Pruned { oldest } => {
                crate::logging::eprint_line(format_args!(
                    "newsnack: transitions before seq {oldest} were pruned (log_retention_days); following from the oldest kept, {oldest}"
                ));
                continue;
            }
        };
        if args.status.is_some_and(|s| s != t.to) {
            continue;
        }
        let line = tail::render(&t, style);
        match writeln!(out, "{line}").and_then(|_| out.flush()) {
            Ok(()) => {}
            // The reader went away (e.g. `| head`): that is a normal end.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(ExitCode::SUCCESS),
            Err(e) => {
                return Err(CliError::Failed(format!(
                    "cannot write to standard output: {e}"
                )))
            }
        }
    }
}

pub(super) async fn claim(database: &db::Database, ids: &[i64]) -> Result<ExitCode, CliError> {
    input::check_ids("ids", ids)?;
    let pool = open(database).await?;
    let settings = Settings::load(&pool).await?;
    let client = pool.get().await.map_err(DbError::from)?;
    let worker = format!("cli:{}", std::process::id());
    let outcome = db::issue::claim_issues(
        &client,
        ids,
        &worker,
        settings.lease(),
        ClaimScope::Claimable,
    )
    .await?;
    println!(
        "{}",
        serde_json::json!({"claimed": outcome.claimed_ids(), "skipped": outcome.skipped})
    );
    Ok(if outcome.claimed.is_empty() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

pub(super) async fn status(database: &db::Database) -> Result<ExitCode, CliError> {
    let pool = open(database).await?;
    let client = pool.get().await.map_err(DbError::from)?;
    let counts = db::issue::count_by_status(&client).await?;
    let total: i64 = counts.iter().map(|(_, n)| n).sum();
    for (status, n) in counts {
        println!("{:<12} {n:>8}", status.as_str());
    }
    println!("{:<12} {total:>8}", "total");
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn issues(
    database: &db::Database,
    cmd: IssuesCommand,
) -> Result<ExitCode, CliError> {
    match cmd {
        IssuesCommand::Add {
            title,
            body,
            score,
            collected_at,
            source_key,
            file,
        } => {
            let new = match (title, file) {
                (Some(title), None) => vec![NewIssue {
                    title,
                    body,
                    score,
                    collected_at,
                    source_key,
                }],
                (None, Some(path)) => read_issue_file(&path)?,
                _ => return Err(CliError::Failed("give either --title or --file".into())),
            };
            input::check_new_issues(&new)?;
            let pool = open(database).await?;
            let client = pool.get().await.map_err(DbError::from)?;
            let added = db::issue::add_issues(&client, &new, None).await?;
            println!(
                "{}",
                serde_json::json!({ "ids": added.ids, "existing": added.existing })
            );
            Ok(ExitCode::SUCCESS)
        }
        IssuesCommand::Show { id } => {
            let pool = open(database).await?;
            let client = pool.get().await.map_err(DbError::from)?;
            match db::issue::get_issue(&client, id).await? {
                Some(issue) => {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&issue).unwrap_or_default()
                    );
                    Ok(ExitCode::SUCCESS)
                }
                None => Err(CliError::Failed(format!("no issue with id {id}"))),
            }
        }
    }
}

/// `{"issues": [..]}`, the body `POST /issues` takes (the other accepted
/// shape is the bare list).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct WrappedIssues {
    issues: Vec<crate::http::types::NewIssueJson>,
}

pub(super) fn read_issue_file(path: &std::path::Path) -> Result<Vec<NewIssue>, CliError> {
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(path)
    }
    .map_err(|e| CliError::Failed(format!("cannot read {}: {e}", path.display())))?;
    // Told apart by the first character, so a bad field gets serde's own
    // message (with its line and column) rather than "matches no shape".
    let parsed = if text.trim_start().starts_with('[') {
        serde_json::from_str::<Vec<crate::http::types::NewIssueJson>>(&text)
    } else {
        serde_json::from_str::<WrappedIssues>(&text).map(|w| w.issues)
    };
    let list = parsed.map_err(|e| {
        CliError::Failed(format!(
            "{} is not a JSON list of issues ({e}); expected [{{\"title\":..,\"body\":..,\"score\":..}}] or {{\"issues\":[..]}}",
            path.display()
        ))
    })?;
    Ok(list.into_iter().map(NewIssue::from).collect())
}

pub(super) async fn retry(database: &db::Database, ids: &[i64]) -> Result<ExitCode, CliError> {
    input::check_ids("ids", ids)?;
    let pool = open(database).await?;
    let client = pool.get().await.map_err(DbError::from)?;
    let reset = db::issue::reset_failed(&client, ids).await?;
    let not_failed: Vec<i64> = ids
        .iter()
        .copied()
        .filter(|id| !reset.contains(id))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    println!(
        "{}",
        serde_json::json!({"reset": reset, "not_failed": not_failed})
    );
    Ok(if reset.is_empty() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

pub(super) async fn cancel(database: &db::Database, ids: &[i64]) -> Result<ExitCode, CliError> {
    input::check_ids("ids", ids)?;
    let pool = open(database).await?;
    let mut client = pool.get().await.map_err(DbError::from)?;
    let outcome = db::issue::cancel(&mut client, ids).await?;
    println!(
        "{}",
        serde_json::to_string(&outcome).expect("a cancel outcome is JSON")
    );
    Ok(if outcome.cancelled.is_empty() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

pub(super) async fn settings(
    database: &db::Database,
    cmd: SettingsCommand,
) -> Result<ExitCode, CliError> {
    let pool = open(database).await?;
    let client = pool.get().await.map_err(DbError::from)?;
    match cmd {
        SettingsCommand::List => {
            for s in db::setting::list(&client).await? {
                let bounds = match s.kind.as_str() {
                    "integer" => format!(", {}..{}", s.min_value, s.max_value),
                    _ => String::new(),
                };
                println!(
                    "{:<28} {:>8}  (default {}{bounds})  {}",
                    s.key,
                    one_line(&s.value),
                    one_line(&s.default_value),
                    s.description
                );
            }
        }
        SettingsCommand::Get { key } => {
            let all = db::setting::list(&client).await?;
            match all.iter().find(|s| s.key == key) {
                Some(s) => println!("{}", s.value),
                None => {
                    let known: Vec<&str> = all.iter().map(|s| s.key.as_str()).collect();
                    return Err(CliError::Failed(format!(
                        "unknown setting {key:?} (known: {})",
                        known.join(", ")
                    )));
                }
            }
        }
        SettingsCommand::Set { key, value } => {
            let stored = db::setting::set(&client, &key, &value).await?;
            println!("{key} = {stored}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `pause` (`paused`) and `resume`: the operator's pause, the setting
/// `generation_paused`, which every instance's budget reads at its next
/// exchange (announced at once on `setting_changed`).
pub(super) async fn pause(database: &db::Database, paused: bool) -> Result<ExitCode, CliError> {
    let pool = open(database).await?;
    let client = pool.get().await.map_err(DbError::from)?;
    let stored = db::setting::set(&client, "generation_paused", &paused.to_string()).await?;
    println!(
        "generation_paused = {stored}: {}",
        if paused {
            "no instance starts an LLM call until `newsnack resume`"
        } else {
            "LLM calls start again"
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// A setting's value on one line of a listing: line breaks shown as `⏎`,
/// and a long text (a prompt) cut short; `settings get` shows it whole.
pub(super) fn one_line(value: &str) -> String {
    const LONGEST: usize = 48;
    let flat = value.replace('\n', "⏎");
    match flat.char_indices().nth(LONGEST) {
        Some((cut, _)) => format!("{}…", &flat[..cut]),
        None => flat,
    }
}

pub(super) async fn wait(
    database: &db::Database,
    ids: Vec<i64>,
    timeout: Option<f64>,
    min: Option<usize>,
) -> Result<ExitCode, CliError> {
    input::check_ids("ids", &ids)?;
    if let Some(t) = timeout {
        if !(t.is_finite() && t > 0.0 && t <= 86_400.0) {
            return Err(CliError::Failed(format!(
                "--timeout must be more than 0 and at most 86400, got {t}"
            )));
        }
    }
    let pool = open(database).await?;
    let settings = Settings::load(&pool).await?;
    let shutdown = CancellationToken::new();
    crate::shutdown::cancel_on_signal(shutdown.clone());
    let hub = listen(database, pool, &shutdown).await?;
    let request = crate::briefing::wait::WaitRequest {
        issue_ids: ids,
        timeout: timeout
            .map(Duration::from_secs_f64)
            .unwrap_or_else(|| settings.wait_timeout()),
        min_completion: min.unwrap_or(settings.content_gen_min_completion.max(0) as usize),
        max_attempts: settings.max_attempts as i32,
    };
    let report = crate::briefing::wait::smart_wait(&hub, request, &shutdown)
        .await
        .map_err(|e| CliError::Failed(e.to_string()))?;
    shutdown.cancel();
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    Ok(match report.outcome {
        crate::briefing::wait::WaitOutcome::Skip => ExitCode::from(EXIT_SKIP),
        _ => ExitCode::SUCCESS,
    })
}

pub(super) async fn run_pipeline(database: &db::Database) -> Result<ExitCode, CliError> {
    let writer = crate::writer::build_all(&crate::writer::WriterConfig::from_env()?)?;
    let shutdown = CancellationToken::new();
    crate::shutdown::cancel_on_signal(shutdown.clone());
    let instance = format!("cli:{}", crate::serve::default_instance_name());
    let core = crate::serve::Core::start(
        database,
        &instance,
        8,
        writer,
        Duration::from_secs(10),
        // A one-shot run retries its own targets only.
        crate::generation::retry::RetryScope::only_added(),
        &shutdown,
    )
    .await?;
    let result = core
        .pipeline()
        .run_locked(crate::briefing::run::Trigger::Manual, &shutdown)
        .await;
    shutdown.cancel();
    core.stopped().await;
    match result {
        Ok(Some(summary)) => {
            println!(
                "{}",
                serde_json::json!({
                    "run_id": summary.run_id,
                    "outcome": summary.outcome,
                    "targets": summary.targets,
                    "completed": summary.completed,
                    "briefing_id": summary.briefing_id,
                    "error": summary.error,
                })
            );
            if matches!(summary.outcome.as_str(), "error" | "abandoned") {
                eprintln!(
                    "newsnack: the run ended as {}: {}",
                    summary.outcome,
                    summary.error.as_deref().unwrap_or("no reason recorded")
                );
                return Ok(ExitCode::FAILURE);
            }
            Ok(if summary.briefing_id.is_some() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_SKIP)
            })
        }
        Ok(None) => Ok(ExitCode::from(EXIT_SKIP)),
        Err(crate::briefing::run::PipelineError::Busy) => {
            eprintln!("newsnack: another pipeline run holds the lock (see `newsnack locks`)");
            Ok(ExitCode::from(EXIT_BUSY))
        }
        Err(e @ crate::briefing::run::PipelineError::TakenOver) => {
            eprintln!("newsnack: {e}");
            Ok(ExitCode::FAILURE)
        }
        Err(crate::briefing::run::PipelineError::Db(e)) => Err(e.into()),
    }
}

pub(super) async fn prune(database: &db::Database, dry_run: bool) -> Result<ExitCode, CliError> {
    let pool = open(database).await?;
    let retention = Settings::load(&pool).await?.retention();
    let client = pool.get().await.map_err(DbError::from)?;
    let report = db::retention::prune(&client, &retention, dry_run).await?;
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn locks(database: &db::Database) -> Result<ExitCode, CliError> {
    let client = database.pooled.connect().await?;
    let held = db::advisory::held_locks(&client).await?;
    if held.is_empty() {
        println!("no advisory locks are held");
    }
    for lock in held {
        let since = lock
            .since
            .and_then(|t| {
                t.format(&time::format_description::well_known::Rfc3339)
                    .ok()
            })
            .unwrap_or_default();
        println!(
            "{:<15} key {:<20} pid {:<7} {:<8} {:<40} client {:<15} since {since}",
            lock.name,
            lock.key,
            lock.pid,
            if lock.granted { "held" } else { "waiting" },
            lock.application_name,
            lock.client.unwrap_or_else(|| "local".into()),
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn grant(
    database: &db::Database,
    kind: RoleKind,
    name: &str,
) -> Result<ExitCode, CliError> {
    // One transaction, like a migration: a transaction pooler may carry it.
    let mut client = database.pooled.connect().await?;
    let report = role::grant(&mut client, kind, name).await?;
    for warning in &report.warnings {
        eprintln!("newsnack: warning: {warning}");
    }
    let (insert, update): (&[&str], &[&str]) = match kind {
        RoleKind::Writer => (role::WRITER_INSERT_COLUMNS, role::WRITER_UPDATE_COLUMNS),
        RoleKind::Reader => (&[], &[]),
    };
    println!(
        "{}",
        serde_json::json!({
            "role": report.role,
            "kind": kind.as_str(),
            "schema": report.schema,
            "select": report.tables,
            "insert_issue": insert,
            "update_issue": update,
            "sql": report.statements,
        })
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listed_value_takes_one_short_line() {
        assert_eq!(one_line("8"), "8");
        assert_eq!(one_line("a\nb"), "a⏎b");
        let prompt = "제목: {title}\n".repeat(10);
        let listed = one_line(&prompt);
        assert_eq!(listed.chars().count(), 49);
        assert!(listed.ends_with('…') && !listed.contains('\n'), "{listed}");
    }
}
