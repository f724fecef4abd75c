//! `newsnack demo`: the whole product in one command, with no
//! configuration. Starts a throwaway PostgreSQL, loads a shipped set of
//! sample issues, and runs one pipeline with the built-in writer while the
//! transitions scroll by: claim → generate (two articles fail once, so a
//! retry is visible) → smart wait → briefing. Then it stops everything it
//! started.

use std::collections::HashSet;
use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::api_types::NewIssueJson;
use crate::db::issue::NewIssue;
use crate::db::{self, DbError};
use crate::pipeline::{PipelineError, Trigger};
use crate::serve::{self, Core, ServeError};
use crate::tail::{self, TailStyle};
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

/// Runs the demo; returns when everything it started has stopped.
pub async fn run() -> Result<(), DemoError> {
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
    say(
        out,
        "newsnack demo: starting a throwaway PostgreSQL (nothing to configure)…",
    );
    let (url, cluster) = serve::database(None).await?;
    if shutdown.is_cancelled() {
        remove(cluster).await;
        say(
            out,
            "Interrupted: the throwaway database is stopped and deleted.",
        );
        return Ok(());
    }
    say(out, &format!("  database: {url}"));

    // Load the samples first, so the writer knows which ids to trip up.
    let config = db::pg_config(&url, "newsnack-demo")?;
    let mut setup = db::connect(&config).await?;
    db::migrate::migrate(&mut setup).await?;
    drop(setup);
    let samples: Vec<NewIssueJson> =
        serde_json::from_str(SAMPLE_ISSUES).expect("the shipped samples parse");
    let samples: Vec<NewIssue> = samples.into_iter().map(NewIssue::from).collect();
    let ids = {
        let pool = db::pool(config.clone(), &db::PoolOptions::default())?;
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
        &url,
        "demo",
        8,
        writer,
        Duration::from_secs(5),
        crate::retry::RetryScope::everything(),
        &shutdown,
    )
    .await?;

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

    let result = core.pipeline().run_locked(Trigger::Manual, &shutdown).await;
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
    shutdown.cancel();
    core.stopped().await;
    remove(cluster).await;
    say(
        out,
        "\nDone: the throwaway database is stopped and deleted.",
    );
    Ok(())
}

/// Stops and deletes the throwaway cluster (blocking work, off the runtime).
async fn remove(cluster: Option<crate::embedded::EmbeddedPostgres>) {
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .ok();
}

fn say(out: &mut impl Write, line: &str) {
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}
