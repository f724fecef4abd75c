//! Claims with application-level group commit ([`crate::claims::group_commit`]).
//!
//! Concurrent claim requests are merged: a batch is one `FOR NO KEY UPDATE
//! SKIP LOCKED` statement (one round trip, one commit) over the union of the
//! requests' ids, and each id claimed goes to the first request in the batch
//! that asked for it. That is the answer the requests would get one after
//! another: a later request would find the id `IN_PROGRESS`. A batch that
//! claims nothing writes nothing, so hopeless requests cost one read.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use futures::future::join_all;
use tokio::sync::oneshot;

use crate::claims::group_commit::{each_or_alone, GroupCommit};
use crate::db::issue::{self, ClaimOutcome, ClaimScope, ClaimedIssue};
use crate::db::{DbError, DbPool};

/// Requests merged into one transaction at most.
const MAX_BATCH: usize = 64;

/// The `last_error` of a claim released because its requester went away.
pub const UNWANTED_CLAIM: &str = "claim abandoned by its requester";

struct ClaimRequest {
    ids: Vec<i64>,
    lease: Duration,
    scope: ClaimScope,
    /// The requester's trace context, kept on the claim's transitions.
    traceparent: Option<String>,
    answer: oneshot::Sender<Result<ClaimOutcome, DbError>>,
}

/// Claims issues on behalf of one worker identity. Cheap to clone.
#[derive(Clone)]
pub struct Claimer {
    batches: GroupCommit<ClaimRequest>,
    pool: DbPool,
}

impl Claimer {
    /// Starts `lanes` batching tasks. They stop when every `Claimer` clone
    /// is dropped.
    pub fn start(pool: DbPool, worker: String, lanes: usize) -> Claimer {
        let worker: std::sync::Arc<str> = worker.into();
        let lane_pool = pool.clone();
        let batches = GroupCommit::start(lanes, MAX_BATCH, move |batch| {
            let (pool, worker) = (lane_pool.clone(), worker.clone());
            async move { run_batch(&pool, &worker, batch).await }
        });
        Claimer { batches, pool }
    }

    /// Claims the claimable ones among `ids` (see
    /// [`crate::db::issue::claim_issues`]). Dropping the future before it
    /// returns gives back whatever it claimed (see [`UNWANTED_CLAIM`]).
    pub async fn claim(
        &self,
        ids: Vec<i64>,
        lease: Duration,
        scope: ClaimScope,
    ) -> Result<ClaimOutcome, DbError> {
        let span = if crate::telemetry::exporting() {
            tracing::info_span!(
                "claim",
                otel.kind = "internal",
                newsnack.ids_asked = ids.len() as i64,
                newsnack.claimed = tracing::field::Empty,
                newsnack.skipped = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        let outcome =
            tracing::Instrument::instrument(self.claim_in_span(ids, lease, scope), span.clone())
                .await?;
        span.record("newsnack.claimed", outcome.claimed.len() as i64);
        span.record("newsnack.skipped", outcome.skipped.len() as i64);
        Ok(outcome)
    }

    async fn claim_in_span(
        &self,
        ids: Vec<i64>,
        lease: Duration,
        scope: ClaimScope,
    ) -> Result<ClaimOutcome, DbError> {
        let traceparent = crate::telemetry::current_traceparent();
        let stopped = || DbError::Invalid("the claimer has stopped".into());
        let (answer, outcome) = oneshot::channel();
        let mut outcome = Unread {
            answer: outcome,
            pool: self.pool.clone(),
        };
        self.batches
            .submit(ClaimRequest {
                ids,
                lease,
                scope,
                traceparent,
                answer,
            })
            .await
            .map_err(|_| stopped())?;
        let outcome = (&mut outcome.answer).await.map_err(|_| stopped())??;
        crate::metrics::claims_answered(outcome.claimed.len(), outcome.skipped.len());
        Ok(outcome)
    }
}

/// Runs a batch: one claim statement (its own transaction) per kind of
/// request (lease and scope), over the union of their ids, each id in the
/// trace context of the request that asked first, split back by first
/// requester (see [`each_or_alone`] for when a statement fails). Traced
/// requests each have a context of their own: they still share one
/// statement.
async fn run_batch(pool: &DbPool, worker: &str, batch: Vec<ClaimRequest>) {
    let mut kinds: Vec<Vec<ClaimRequest>> = Vec::new();
    for request in batch {
        match kinds
            .iter_mut()
            .find(|k| k[0].lease == request.lease && k[0].scope == request.scope)
        {
            Some(kind) => kind.push(request),
            None => kinds.push(vec![request]),
        }
    }
    join_all(kinds.into_iter().map(|kind| run_kind(pool, worker, kind))).await;
}

/// Claims for the requests whose requester still waits, and releases at
/// once what was claimed for one that went away meanwhile (a pipeline run
/// whose wait decided while it claimed stragglers, say): nothing would
/// generate it, and it would sit `IN_PROGRESS` until its lease ran out.
async fn run_kind(pool: &DbPool, worker: &str, mut requests: Vec<ClaimRequest>) {
    requests.retain(|r| !r.answer.is_closed());
    if requests.is_empty() {
        return;
    }
    let together = claim_together(pool, worker, &requests).await;
    let results = each_or_alone(together, requests.len(), |i| {
        claim_alone(pool, worker, &requests[i])
    })
    .await;
    let mut unwanted = Vec::new();
    for (request, result) in requests.into_iter().zip(results) {
        if let Err(Ok(outcome)) = request.answer.send(result) {
            unwanted.extend(outcome.claimed);
        }
    }
    release_unwanted(pool, unwanted);
}

/// The requester's end of a claim's answer. Dropped unread (the requester
/// went away after the answer was sent), it releases what was claimed;
/// closed first, so an answer not sent yet is refused and released by the
/// lane instead.
struct Unread {
    answer: oneshot::Receiver<Result<ClaimOutcome, DbError>>,
    pool: DbPool,
}

impl Drop for Unread {
    fn drop(&mut self) {
        self.answer.close();
        if let Ok(Ok(outcome)) = self.answer.try_recv() {
            release_unwanted(&self.pool, outcome.claimed);
        }
    }
}

/// Releases, from a task of its own (so no lane waits for it), claims that
/// nobody will generate, with the attempt given back: nothing was tried.
fn release_unwanted(pool: &DbPool, claimed: Vec<ClaimedIssue>) {
    if claimed.is_empty() {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let claims = claimed.iter().map(|c| (c.id, c.claim_id)).collect();
    let pool = pool.clone();
    runtime.spawn(async move {
        release_claims(&pool, claims, UNWANTED_CLAIM, false).await;
    });
}

/// One statement for all of `requests` (same lease and scope). Each id goes
/// to the first request that asked for it; the later ones see it skipped,
/// exactly as if the requests had run one after another.
async fn claim_together(
    pool: &DbPool,
    worker: &str,
    requests: &[ClaimRequest],
) -> Result<Vec<ClaimOutcome>, DbError> {
    let mut first_asker: HashMap<i64, usize> = HashMap::new();
    for (n, request) in requests.iter().enumerate() {
        for &id in &request.ids {
            first_asker.entry(id).or_insert(n);
        }
    }
    let all: Vec<i64> = first_asker.keys().copied().collect();
    let first = &requests[0];
    let client = pool.get().await?;
    let contexts: Vec<Option<&str>> = all
        .iter()
        .map(|id| requests[first_asker[id]].traceparent.as_deref())
        .collect();
    let together = issue::claim_issues_traced(
        &pool.session(&client),
        &all,
        &contexts,
        worker,
        first.lease,
        first.scope,
    )
    .await?;
    drop(client);
    let done: BTreeSet<i64> = together.done.into_iter().collect();
    let mut won: Vec<Vec<ClaimedIssue>> = vec![Vec::new(); requests.len()];
    for claimed in together.claimed {
        won[first_asker[&claimed.id]].push(claimed);
    }
    let outcomes = requests
        .iter()
        .zip(won)
        .map(|(request, won)| ClaimOutcome::of_request(&request.ids, won, &done))
        .collect();
    Ok(outcomes)
}

async fn claim_alone(
    pool: &DbPool,
    worker: &str,
    r: &ClaimRequest,
) -> Result<ClaimOutcome, DbError> {
    let client = pool.get().await?;
    let contexts = vec![r.traceparent.as_deref(); r.ids.len()];
    issue::claim_issues_traced(
        &pool.session(&client),
        &r.ids,
        &contexts,
        worker,
        r.lease,
        r.scope,
    )
    .await
}

/// Marks claims (`(id, claim_id)`) this instance will not finish `FAILED`
/// with `reason` (fenced by their claim), to be retried at once by
/// whichever instance takes them; with `attempt_spent: false` (their
/// generation never began) their attempt is given back. Best effort: what
/// cannot be written returns with its lease.
pub async fn release_claims(
    pool: &DbPool,
    claims: Vec<(i64, i64)>,
    reason: &str,
    attempt_spent: bool,
) {
    if claims.is_empty() {
        return;
    }
    let released = async {
        let mut client = pool.get().await?;
        issue::release(&mut client, &claims, reason, attempt_spent).await
    };
    match released.await {
        Ok(n) => tracing::info!(
            released = n,
            of = claims.len(),
            attempt_spent,
            reason,
            "released claims this instance will not finish as FAILED"
        ),
        Err(e) => tracing::warn!(
            count = claims.len(),
            error = %e,
            reason,
            "could not release claims; their lease will"
        ),
    }
}
