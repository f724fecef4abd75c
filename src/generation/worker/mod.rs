//! Generation workers: turn claimed issues into articles, exactly once each.
//!
//! Every claimed issue gets a task that heartbeats its lease while it waits
//! for an LLM slot and while the writer works. A writer that calls an LLM
//! gets its slots from the budget all instances share
//! ([`crate::generation::budget`]: `llm_max_in_flight` across the cluster,
//! `generation_concurrency` per instance, briefing before feed, a rate
//! limit's pause); any other writer from a semaphore sized by the
//! `generation_concurrency` setting, resized live when it changes. A call
//! the LLM refuses for the account's quota (429 or 503 with `Retry-After`)
//! pauses every instance's calls and fails its attempt with the attempt
//! given back: the retry after the pause does not use up `max_attempts`.
//! The outcome is recorded fenced by the claim
//! ([`crate::generation::completion`]).
//!
//! An issue that leaves `IN_PROGRESS` under its generation (cancelled with
//! `newsnack cancel` or `POST /issues/{id}/cancel`, or failed with plain
//! SQL) is abandoned as soon as the transition arrives from the listener,
//! confirmed by one read of the claim: the writer's future is dropped
//! (reqwest closes the connection, so the LLM's request ends) and with it
//! its LLM slot, given back to the budget at once. An answer that came
//! first is kept out by the claim's fence when it is recorded.
//!
//! On shutdown the generator stops taking work, lets in-flight generations
//! finish within a grace period, and releases the rest as `FAILED` with
//! reason `shutdown` (they are retried by whichever instance remains). Those
//! that never reached the writer (still queued for an LLM slot) get their
//! attempt back, so restarts do not use up issues' `max_attempts`.
//!
//! This file is one issue's life, from its slot to its recorded outcome;
//! [`generator`] is the service that runs a task for each, `gate.rs`
//! where a task gets its slot, and `spans.rs` the spans it is traced in.

mod gate;
mod generator;
mod spans;

pub use generator::{Generator, GeneratorHandle};

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::db::issue::{self, ClaimedIssue};
use crate::db::{DbError, DbPool};
use crate::generation::budget::failure::{self, Next};
use crate::generation::budget::WaitDelays;
use crate::generation::completion::{record_outcome, record_unrecorded, Completer, Generated};
use crate::model::llm::{Priority, Provider};
use crate::settings::{Settings, SettingsCache};
use crate::writer::checks::ArticleChecks;
use crate::writer::{token_bound, Article, IssueText, SharedWriter, WriteError, Writer};
use gate::{Gate, Slot};

/// Whether a generation has begun its writer call: decided once, by the
/// task as it begins or by shutdown withdrawing it first, so a claim is
/// never both released unstarted and written.
#[derive(Default)]
struct Start(AtomicU8);

impl Start {
    const WAITING: u8 = 0;
    const BEGUN: u8 = 1;
    const WITHDRAWN: u8 = 2;

    /// The task may begin; false once it was withdrawn.
    fn begin(&self) -> bool {
        self.0
            .compare_exchange(
                Self::WAITING,
                Self::BEGUN,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
    }

    /// True if the task had not begun and now never will.
    fn withdraw(&self) -> bool {
        self.0
            .compare_exchange(
                Self::WAITING,
                Self::WITHDRAWN,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
    }
}

/// What every generation of an instance works with.
struct Generation {
    pool: DbPool,
    completer: Completer,
    writer: SharedWriter,
    fallback: Option<Arc<Fallback>>,
    settings: Arc<SettingsCache>,
    gate: Gate,
}

/// The fallback provider's writer, and the completer that records its
/// articles under its name.
struct Fallback {
    writer: SharedWriter,
    completer: Completer,
}

/// One issue, start to finish. Heartbeats the lease until the outcome is
/// written; gives up at once if the claim is lost, found by a heartbeat or
/// announced by a transition out of `IN_PROGRESS` (`left_in_progress`).
async fn generate(
    generation: Generation,
    claimed: ClaimedIssue,
    priority: Option<Priority>,
    start: Arc<Start>,
    left_in_progress: Arc<Notify>,
) {
    let _in_flight = crate::metrics::generation_started();
    // The claim that began it, as the span's first event.
    spans::transition(&tracing::Span::current(), None, "IN_PROGRESS", None);
    let known = generation.settings.get().await.ok();
    let lease = known.as_ref().map_or(claimed.lease, |s| s.lease());
    let answered = AtomicBool::new(false);
    let work = async {
        let mut fallback_only = false;
        let (result, quota_pause, provider) = loop {
            let wait = spans::BudgetWait::start(fallback_only);
            let slot = tracing::Instrument::instrument(
                generation.gate.slot(&claimed, priority, fallback_only),
                wait.span.clone(),
            )
            .await;
            match &slot {
                Some(Slot::Shared(slot)) => {
                    let route = slot.route();
                    wait.granted(route.priority, route.provider, slot.delays());
                }
                _ => wait.ended(WaitDelays::default()),
            }
            drop(wait);
            let Some(slot) = slot else {
                return Ok(Generated::NotStarted);
            };
            if !fallback_only && !start.begin() {
                return Ok(Generated::NotStarted);
            }
            match call_writer(&generation, &claimed, slot, known.clone()).await {
                // The primary failed and the call may go to the fallback:
                // at once, in the same claim, its attempt unspent.
                Called::SwitchToFallback => fallback_only = true,
                Called::Answered {
                    result,
                    quota_pause,
                    provider,
                } => break (result, quota_pause, provider),
            }
        };
        answered.store(true, Ordering::Relaxed);
        if let Err(e) = &result {
            spans::record_error(&tracing::Span::current(), e.kind().as_str(), &e.to_string());
        }
        let completer = match (&generation.fallback, provider) {
            (Some(fallback), Provider::Fallback) => &fallback.completer,
            _ => &generation.completer,
        };
        let record = spans::record_span(if result.is_ok() { "done" } else { "failed" });
        let recorded = tracing::Instrument::instrument(
            record_outcome(
                &generation.pool,
                completer,
                &claimed,
                lease,
                result,
                quota_pause,
            ),
            record.clone(),
        )
        .await;
        match &recorded {
            Ok(generated) => spans::recorded(&record, generated),
            Err(e) => spans::record_error(&record, &spans::db_error_type(e), &e.to_string()),
        }
        recorded
    };
    tokio::pin!(work);
    let heartbeat = heartbeat_until_lost(&generation.pool, &claimed, lease);
    tokio::pin!(heartbeat);
    // The heartbeat keeps the lease until the outcome is recorded. A lost
    // claim stops the writer; but once the writer has answered, the fenced
    // recording says what happened: a heartbeat that ran into that very
    // commit must not report a written article as lost.
    let outcome = loop {
        tokio::select! {
            biased;
            outcome = &mut work => break outcome,
            lost = &mut heartbeat => {
                if answered.load(Ordering::Relaxed) {
                    break work.await;
                }
                break lost;
            }
            () = left_in_progress.notified(), if !answered.load(Ordering::Relaxed) => {
                // A transition out of IN_PROGRESS of this issue: this
                // claim's end, unless it was an earlier claim's, announced
                // late, or this generation's own failure, recorded since
                // the branch was armed (the recording says what happened
                // then). The claim itself says which.
                if answered.load(Ordering::Relaxed) {
                    continue;
                }
                if !claim_current(&generation.pool, &claimed).await {
                    crate::metrics::generation_cancelled();
                    break Ok(Generated::Abandoned);
                }
            }
        }
    };
    if let Err(e) = &outcome {
        // Say why at once rather than wait out the lease.
        tracing::error!(issue = claimed.id, error = %e, "could not record the outcome");
        record_unrecorded(&generation.pool, &claimed, lease, e).await;
    }
    transitions_made(&outcome);
    log_outcome(&claimed, &outcome);
}

/// How the issue left `IN_PROGRESS` under this generation, as an event on
/// its span.
fn transitions_made(outcome: &Result<Generated, DbError>) {
    let span = tracing::Span::current();
    match outcome {
        Ok(Generated::Done) => spans::transition(&span, Some("IN_PROGRESS"), "DONE", None),
        Ok(Generated::Failed { reason, .. }) => {
            spans::transition(&span, Some("IN_PROGRESS"), "FAILED", Some(reason))
        }
        // Left IN_PROGRESS under it, as the listener told.
        Ok(Generated::Abandoned) => spans::transition(&span, Some("IN_PROGRESS"), "FAILED", None),
        Ok(Generated::ClaimLost | Generated::NotStarted) => {}
        Err(e) => spans::transition(&span, Some("IN_PROGRESS"), "FAILED", Some(&e.to_string())),
    }
}

/// How a call of the writer ended.
enum Called {
    /// With this result, from this provider; with the pause the LLM asked
    /// every instance to keep.
    Answered {
        result: Result<Article, WriteError>,
        quota_pause: Option<Duration>,
        provider: Provider,
    },
    /// The primary is down for this call, which may go to the fallback.
    SwitchToFallback,
}

/// Calls the writer of the provider `slot` was granted on, for `claimed`,
/// with the prompts as the settings say now (a change reaches the next
/// call; `known`, read before the wait, stands in should the database be
/// out of reach). What follows a failure is what the budget said when it
/// granted the call ([`failure::after_call`]).
async fn call_writer(
    generation: &Generation,
    claimed: &ClaimedIssue,
    mut slot: Slot<'_>,
    known: Option<Arc<Settings>>,
) -> Called {
    let now = generation.settings.get().await.ok().or(known);
    let defaults = Settings::default();
    let settings = now.as_deref().unwrap_or(&defaults);
    let provider = match &slot {
        Slot::Shared(slot) => slot.route().provider,
        Slot::Local { .. } => Provider::Primary,
    };
    let writer = match (&generation.fallback, provider) {
        (Some(fallback), Provider::Fallback) => &fallback.writer,
        _ => &generation.writer,
    };
    let started = std::time::Instant::now();
    let result = write_checked(
        &**writer,
        provider,
        IssueText::new(claimed, settings.prompts()),
        &settings.article_checks(),
        &mut slot,
    )
    .await;
    tracing::debug!(issue = claimed.id, provider = provider.as_str(), elapsed = ?started.elapsed(), ok = result.is_ok(), "writer answered");
    // The slot bounds LLM calls only: it is given back here, before the
    // outcome waits for its batch.
    let Slot::Shared(slot) = slot else {
        return Called::Answered {
            result,
            quota_pause: None,
            provider,
        };
    };
    let after = failure::after_call(slot.route(), generation.fallback.is_some(), &result);
    if let (Some((pause, _)), Err(e)) = (&after.pause_primary, &result) {
        tracing::warn!(issue = claimed.id, pause_s = pause.as_secs_f64(), reason = %e, "the LLM asked every caller to wait: pausing the primary's calls on every instance");
    }
    slot.give_back(after.report, after.pause_primary);
    match after.next {
        Next::AskFallback => {
            if let Err(e) = &result {
                tracing::warn!(issue = claimed.id, reason = %e, "the primary LLM failed the call; asking the fallback");
            }
            Called::SwitchToFallback
        }
        Next::Record { quota_pause } => Called::Answered {
            result,
            quota_pause,
            provider,
        },
    }
}

/// Writes `issue`'s article and checks it (see [`crate::writer::checks`]):
/// an answer that fails a check is asked for again once, with the reason;
/// a second failure is [`WriteError::InvalidArticle`]. The article stored
/// counts the tokens of both calls; `slot` is told what the calls spent as
/// they go, so a call dropped midway still counts its prompt.
async fn write_checked(
    writer: &dyn Writer,
    provider: Provider,
    issue: IssueText<'_>,
    checks: &ArticleChecks,
    slot: &mut Slot<'_>,
) -> Result<Article, WriteError> {
    let prompt = issue.prompt_token_bound();
    slot.spent(prompt);
    let first = timed(provider, writer.write(issue)).await;
    let mut spent = tokens_spent(&first, prompt);
    slot.spent(spent);
    let first = first?;
    let rejection = match spans::checked(1, || checks.check(&first)) {
        Ok(article) => return Ok(article),
        Err(rejection) => rejection,
    };
    crate::metrics::article_rejected(rejection.check.as_str());
    tracing::info!(issue = issue.id, %rejection, "answer rejected; asking again");
    let problem = rejection.request_again();
    let prompt = prompt + token_bound(&[&first.answer, &problem]);
    slot.spent(spent + prompt);
    let second = tracing::Instrument::instrument(
        timed(provider, writer.write_again(issue, &first, &problem)),
        spans::reask_span(rejection.check.as_str()),
    )
    .await;
    spent += tokens_spent(&second, prompt);
    slot.spent(spent);
    let second = second?;
    match spans::checked(2, || checks.check(&second)) {
        Ok(article) => Ok(Article {
            usage: first.usage.plus(second.usage),
            ..article
        }),
        Err(rejection) => {
            crate::metrics::article_rejected(rejection.check.as_str());
            Err(WriteError::InvalidArticle(rejection))
        }
    }
}

/// The tokens one call spent, for the day's budget: what the API reported,
/// and where it reported nothing, the bound of the prompt sent (`prompt`)
/// and of the answer (see [`token_bound`]); a call refused before the model
/// ran costs nothing.
fn tokens_spent(result: &Result<Article, WriteError>, prompt: i64) -> i64 {
    match result {
        Ok(article) => {
            let reported = |count: Option<i32>| count.map(i64::from);
            reported(article.usage.prompt_tokens).unwrap_or(prompt)
                + reported(article.usage.completion_tokens)
                    .unwrap_or_else(|| token_bound(&[&article.answer]))
        }
        Err(e) if e.kind().may_have_billed() => prompt,
        Err(_) => 0,
    }
}

/// One writer call, counted in the LLM metrics, as `provider`'s.
async fn timed(
    provider: Provider,
    call: impl std::future::Future<Output = Result<Article, WriteError>>,
) -> Result<Article, WriteError> {
    let started = std::time::Instant::now();
    let result = call.await;
    crate::metrics::llm_call_finished(
        provider,
        started.elapsed(),
        result.as_ref().err().map(|e| e.kind().as_str()),
    );
    if let Ok(article) = &result {
        crate::metrics::llm_tokens(article.usage);
    }
    result
}

/// One log line for how `claimed`'s generation ended.
fn log_outcome(claimed: &ClaimedIssue, outcome: &Result<Generated, DbError>) {
    match outcome {
        Ok(Generated::Done) => tracing::info!(
            issue = claimed.id,
            attempt = claimed.attempts,
            "article written"
        ),
        Ok(Generated::Failed { reason, retryable }) => {
            tracing::warn!(issue = claimed.id, attempt = claimed.attempts, retryable, %reason, "generation failed")
        }
        Ok(Generated::NotStarted) => {
            tracing::debug!(
                issue = claimed.id,
                "shutting down before the generation began"
            )
        }
        Ok(Generated::Abandoned) => {
            tracing::info!(
                issue = claimed.id,
                claim = claimed.claim_id,
                "the issue left IN_PROGRESS (cancelled?); its LLM call was dropped"
            )
        }
        Ok(Generated::ClaimLost) => {
            tracing::warn!(
                issue = claimed.id,
                claim = claimed.claim_id,
                "claim lost; result discarded"
            )
        }
        Err(_) => {}
    }
}

/// Whether `claimed`'s claim is still current; true when that cannot be
/// read (the heartbeat settles it then).
async fn claim_current(pool: &DbPool, claimed: &ClaimedIssue) -> bool {
    let read = async {
        let client = pool.get().await?;
        issue::claim_current(&pool.session(&client), claimed.id, claimed.claim_id).await
    };
    match read.await {
        Ok(current) => current,
        Err(e) => {
            tracing::warn!(issue = claimed.id, error = %e, "cannot read whether the claim is current; the heartbeat will tell");
            true
        }
    }
}

/// Extends the lease to `lease` every third of its length; returns when
/// the claim is no longer current. The first beat comes within a third of
/// the shorter of `lease` and the lease the claim was taken with: `lease_s`
/// may have grown since the claim, which must not run out before its
/// first beat. A failed beat (a database hiccup) is tried again soon, from
/// a quarter of a second doubling up to the usual interval, so a short
/// outage does not let a healthy generation's lease run out.
async fn heartbeat_until_lost(
    pool: &DbPool,
    claimed: &ClaimedIssue,
    lease: Duration,
) -> Result<Generated, DbError> {
    let third = |lease: Duration| (lease / 3).max(Duration::from_millis(100));
    let every = third(lease);
    let first_retry = Duration::from_millis(250).min(every);
    let (mut next, mut retry) = (third(lease.min(claimed.lease)), first_retry);
    loop {
        tokio::time::sleep(next).await;
        let beat = async {
            let client = pool.get().await?;
            issue::heartbeat(&pool.session(&client), claimed.id, claimed.claim_id, lease).await
        };
        match beat.await {
            Ok(true) => (next, retry) = (every, first_retry),
            Ok(false) => return Ok(Generated::ClaimLost),
            Err(e) => {
                tracing::warn!(issue = claimed.id, error = %e, retry_in = ?retry, "heartbeat failed; will try again");
                next = retry;
                retry = (retry * 2).min(every);
            }
        }
    }
}
