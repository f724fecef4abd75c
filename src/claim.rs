//! Claims with application-level group commit ([`crate::group_commit`]).
//!
//! Concurrent claim requests are run as one transaction per batch: each
//! request is still its own `FOR NO KEY UPDATE SKIP LOCKED` statement with
//! its own answer, but a batch pays for one commit. Within a batch, a later
//! statement sees the earlier ones' claims (a transaction never skips its own
//! locks; the status check excludes them), so no issue is handed out twice.

use std::time::Duration;

use futures::future::join_all;
use tokio::sync::oneshot;

use crate::db::issue::{self, ClaimOutcome, ClaimScope};
use crate::db::{DbError, DbPool};
use crate::group_commit::GroupCommit;

/// Requests merged into one transaction at most.
const MAX_BATCH: usize = 64;

struct ClaimRequest {
    ids: Vec<i64>,
    lease: Duration,
    scope: ClaimScope,
    answer: oneshot::Sender<Result<ClaimOutcome, DbError>>,
}

/// Claims issues on behalf of one worker identity. Cheap to clone.
#[derive(Clone)]
pub struct Claimer {
    batches: GroupCommit<ClaimRequest>,
}

impl Claimer {
    /// Starts `lanes` batching tasks. They stop when every `Claimer` clone
    /// is dropped.
    pub fn start(pool: DbPool, worker: String, lanes: usize) -> Claimer {
        let worker: std::sync::Arc<str> = worker.into();
        let batches = GroupCommit::start(lanes, MAX_BATCH, move |batch| {
            let (pool, worker) = (pool.clone(), worker.clone());
            async move { run_batch(&pool, &worker, batch).await }
        });
        Claimer { batches }
    }

    /// Claims the claimable ones among `ids` (see
    /// [`crate::db::issue::claim_issues`]).
    pub async fn claim(
        &self,
        ids: Vec<i64>,
        lease: Duration,
        scope: ClaimScope,
    ) -> Result<ClaimOutcome, DbError> {
        let stopped = || DbError::Invalid("the claimer has stopped".into());
        let (answer, outcome) = oneshot::channel();
        self.batches
            .submit(ClaimRequest {
                ids,
                lease,
                scope,
                answer,
            })
            .await
            .map_err(|_| stopped())?;
        let outcome = outcome.await.map_err(|_| stopped())??;
        crate::metrics::claims_answered(outcome.claimed.len(), outcome.skipped.len());
        Ok(outcome)
    }
}

/// Runs a batch as one transaction, its statements pipelined. If anything
/// fails, the batch is rolled back and each request is retried on its own,
/// so one request's error is never another's.
async fn run_batch(pool: &DbPool, worker: &str, batch: Vec<ClaimRequest>) {
    if batch.len() > 1 {
        match claim_together(pool, worker, &batch).await {
            Ok(outcomes) => {
                for (request, outcome) in batch.into_iter().zip(outcomes) {
                    let _ = request.answer.send(Ok(outcome));
                }
                return;
            }
            Err(e) => {
                tracing::debug!(error = %e, size = batch.len(), "batched claim failed; claiming one by one")
            }
        }
    }
    for request in batch {
        let result = claim_alone(pool, worker, &request).await;
        let _ = request.answer.send(result);
    }
}

async fn claim_together(
    pool: &DbPool,
    worker: &str,
    batch: &[ClaimRequest],
) -> Result<Vec<ClaimOutcome>, DbError> {
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    let outcomes = join_all(
        batch
            .iter()
            .map(|r| issue::claim_issues(&tx, &r.ids, worker, r.lease, r.scope)),
    )
    .await
    .into_iter()
    .collect::<Result<Vec<_>, _>>()?;
    tx.commit().await?;
    Ok(outcomes)
}

async fn claim_alone(
    pool: &DbPool,
    worker: &str,
    r: &ClaimRequest,
) -> Result<ClaimOutcome, DbError> {
    let client = pool.get().await?;
    issue::claim_issues(&client, &r.ids, worker, r.lease, r.scope).await
}
