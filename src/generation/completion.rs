//! Recording what a generation produced, fenced by its claim: `DONE` with
//! the article, or `FAILED` with the reason, written only while the issue
//! is still `IN_PROGRESS` under that claim, so a reaped and re-claimed
//! issue is never overwritten by a late worker.
//!
//! Articles are group-committed ([`crate::claims::group_commit`]): those
//! that finish together are recorded by one statement, so a fast writer is
//! not held back by one notifying commit per article. Every write is tried
//! again through passing database faults for up to a lease: the fence makes
//! a second try safe.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::claims::group_commit::{each_or_alone, GroupCommit};
use crate::db::issue::{self, ClaimedIssue, Completion, Fenced, RetryPolicy};
use crate::db::{DbError, DbPool};
use crate::writer::{Article, WriteError};

/// How a generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Generated {
    Done,
    Failed {
        reason: String,
        retryable: bool,
    },
    /// The claim was lost (reaped or re-claimed) before the outcome was
    /// written; nothing was written.
    ClaimLost,
    /// The issue left `IN_PROGRESS` while the writer worked (cancelled, or
    /// failed with plain SQL): the writer's call was dropped, nothing was
    /// written.
    Abandoned,
    /// Shutdown came before an LLM slot did: nothing was written, and the
    /// generator releases the claim.
    NotStarted,
}

/// Records the writer's `result` for `claimed`, trying again through
/// passing faults for up to `lease`. A failure that paused every instance
/// (`quota_pause`) gives its attempt back and is not retried before the
/// pause ends.
pub(super) async fn record_outcome(
    pool: &DbPool,
    completer: &Completer,
    claimed: &ClaimedIssue,
    lease: Duration,
    result: Result<Article, WriteError>,
    quota_pause: Option<Duration>,
) -> Result<Generated, DbError> {
    patiently(claimed.id, lease, || {
        record_once(pool, completer, claimed, result.clone(), quota_pause)
    })
    .await
}

/// Marks `claimed` `FAILED` (fenced, retryable at once) because its outcome
/// could not be recorded, rather than leave it to its lease. The failed
/// write's own transaction may still hold the row for a moment after its
/// error arrives, so a busy row is tried again.
pub(super) async fn record_unrecorded(
    pool: &DbPool,
    claimed: &ClaimedIssue,
    lease: Duration,
    error: &DbError,
) {
    let reason = format!("could not record the outcome: {error}");
    let traceparent = crate::telemetry::current_traceparent();
    let released = patiently(claimed.id, lease, || async {
        let fenced = fail_in_context(
            pool,
            claimed,
            &reason,
            RetryPolicy::After(None),
            traceparent.as_deref(),
        )
        .await?;
        match fenced {
            Fenced::Busy => Err(DbError::RowLocked(claimed.id)),
            written_or_lost => Ok(written_or_lost),
        }
    });
    if let Err(e) = released.await {
        tracing::warn!(issue = claimed.id, error = %e, "could not record the failure either; the lease will return the issue");
    }
}

/// Pauses between tries of [`patiently`]: from the first, doubling up to
/// the last.
const RECORD_RETRY_PAUSES: (Duration, Duration) =
    (Duration::from_millis(250), Duration::from_secs(5));

/// A fenced write of issue `id`'s outcome, tried again on a passing
/// database fault (no connection, a connection lost, the issue's row held
/// by another transaction) for up to a lease. The write is fenced by the
/// claim, so trying again is safe; giving up at the first fault threw a
/// written article away and left the issue to its lease.
async fn patiently<T, Write, Written>(
    id: i64,
    lease: Duration,
    mut write: Write,
) -> Result<T, DbError>
where
    Write: FnMut() -> Written,
    Written: std::future::Future<Output = Result<T, DbError>>,
{
    let give_up_at = tokio::time::Instant::now() + lease;
    let (mut pause, longest) = RECORD_RETRY_PAUSES;
    loop {
        match write().await {
            Err(e) if e.is_transient() && tokio::time::Instant::now() + pause < give_up_at => {
                tracing::warn!(issue = id, error = %e, retry_in = ?pause, "cannot record the outcome yet; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(longest);
            }
            outcome => return outcome,
        }
    }
}

/// Writes the outcome once, fenced by the claim. A failure that paused every
/// instance (`quota_pause`) gives its attempt back and is not retried
/// before the pause ends.
async fn record_once(
    pool: &DbPool,
    completer: &Completer,
    claimed: &ClaimedIssue,
    result: Result<Article, WriteError>,
    quota_pause: Option<Duration>,
) -> Result<Generated, DbError> {
    // The span recording it (a child of the generation's), which the
    // transition keeps; with nothing exported, the claim's context, so the
    // outcome still leads to the trace that asked for it.
    let traceparent =
        crate::telemetry::current_traceparent().or_else(|| claimed.traceparent.clone());
    match result {
        Ok(article) => {
            let fenced = completer
                .complete(
                    Completion {
                        id: claimed.id,
                        claim_id: claimed.claim_id,
                        headline: article.headline,
                        body: article.body,
                        usage: article.usage,
                    },
                    traceparent,
                )
                .await?;
            match fenced {
                Fenced::Written => Ok(Generated::Done),
                Fenced::Lost => Ok(Generated::ClaimLost),
                Fenced::Busy => {
                    crate::metrics::completion_deferred();
                    Err(DbError::RowLocked(claimed.id))
                }
            }
        }
        Err(e) => {
            let reason = e.to_string();
            let retry = if e.is_retryable() {
                RetryPolicy::After(e.retry_after())
            } else {
                RetryPolicy::Never
            };
            let fenced = match quota_pause {
                Some(pause) => {
                    let mut client = pool.get().await?;
                    issue::fail_unspent(
                        &mut client,
                        claimed.id,
                        claimed.claim_id,
                        &reason,
                        pause,
                        traceparent.as_deref(),
                    )
                    .await?
                }
                None => {
                    fail_in_context(pool, claimed, &reason, retry, traceparent.as_deref()).await?
                }
            };
            match fenced {
                Fenced::Written => Ok(Generated::Failed {
                    reason,
                    retryable: e.is_retryable(),
                }),
                Fenced::Lost => Ok(Generated::ClaimLost),
                Fenced::Busy => Err(DbError::RowLocked(claimed.id)),
            }
        }
    }
}

/// Fails `claimed` (fenced), in the trace context `traceparent` when there
/// is one: then in a transaction of its own that sets it, else in one
/// statement.
async fn fail_in_context(
    pool: &DbPool,
    claimed: &ClaimedIssue,
    reason: &str,
    retry: RetryPolicy,
    traceparent: Option<&str>,
) -> Result<Fenced, DbError> {
    let mut client = pool.get().await?;
    match traceparent {
        None => {
            issue::fail(
                &pool.session(&client),
                claimed.id,
                claimed.claim_id,
                reason,
                retry,
            )
            .await
        }
        Some(traceparent) => {
            let (id, claim_id) = (claimed.id, claimed.claim_id);
            issue::fail_traced(&mut client, id, claim_id, reason, retry, traceparent).await
        }
    }
}

/// Completion batches committing at once. One: every notifying commit
/// queues behind the others, and claims should not wait behind several.
const COMPLETION_LANES: usize = 1;
/// Articles recorded together at most.
const MAX_COMPLETIONS_PER_BATCH: usize = 128;

/// A completion waiting for its batch.
struct PendingCompletion {
    completion: Completion,
    /// The trace context its `DONE` transition keeps.
    traceparent: Option<String>,
    answer: oneshot::Sender<Result<Fenced, DbError>>,
}

/// Records finished articles, group-committed. Cheap to clone.
#[derive(Clone)]
pub(super) struct Completer {
    batches: GroupCommit<PendingCompletion>,
}

impl Completer {
    pub(super) fn start(pool: DbPool, writer: &str) -> Completer {
        let writer: Arc<str> = writer.into();
        let batches =
            GroupCommit::start(COMPLETION_LANES, MAX_COMPLETIONS_PER_BATCH, move |batch| {
                let (pool, writer) = (pool.clone(), writer.clone());
                async move { record_batch(&pool, &writer, batch).await }
            });
        Completer { batches }
    }

    async fn complete(
        &self,
        completion: Completion,
        traceparent: Option<String>,
    ) -> Result<Fenced, DbError> {
        let stopped = || DbError::Invalid("the completer has stopped".into());
        let (answer, fenced) = oneshot::channel();
        self.batches
            .submit(PendingCompletion {
                completion,
                traceparent,
                answer,
            })
            .await
            .map_err(|_| stopped())?;
        fenced.await.map_err(|_| stopped())?
    }
}

/// Records a batch in one statement (see [`each_or_alone`] for when it
/// fails).
async fn record_batch(pool: &DbPool, writer: &str, batch: Vec<PendingCompletion>) {
    let mut completions = Vec::with_capacity(batch.len());
    let mut contexts = Vec::with_capacity(batch.len());
    let mut answers = Vec::with_capacity(batch.len());
    for pending in batch {
        completions.push(pending.completion);
        contexts.push(pending.traceparent);
        answers.push(pending.answer);
    }
    let together = record_together(pool, writer, &completions, &contexts).await;
    let results = each_or_alone(together, completions.len(), |i| {
        let one = std::slice::from_ref(&completions[i]);
        let context = std::slice::from_ref(&contexts[i]);
        async move {
            record_together(pool, writer, one, context)
                .await
                .map(|f| f[0])
        }
    })
    .await;
    for (answer, result) in answers.into_iter().zip(results) {
        let _ = answer.send(result);
    }
}

/// One statement for `completions`, each `DONE` transition in its own
/// trace context (`contexts`).
async fn record_together(
    pool: &DbPool,
    writer: &str,
    completions: &[Completion],
    contexts: &[Option<String>],
) -> Result<Vec<Fenced>, DbError> {
    let client = pool.get().await?;
    issue::complete_in_contexts(&pool.session(&client), completions, contexts, writer).await
}
