//! Claims with application-level group commit.
//!
//! Every transaction that changes a status sends NOTIFY, and PostgreSQL
//! serialises notifying commits: each holds a cluster-wide lock through its
//! WAL flush. One claim per transaction would therefore commit one at a
//! time. The [`Claimer`] instead queues concurrent claim requests and runs
//! whatever has queued up as one transaction per lane: each request is still
//! its own `FOR NO KEY UPDATE SKIP LOCKED` statement with its own answer,
//! but a batch pays for one commit. Within a batch, a later statement sees
//! the earlier ones' claims (a transaction never skips its own locks; the
//! status check excludes them), so no issue is handed out twice.
//!
//! Under light load a batch holds one request and nothing waits; under heavy
//! load batches grow by themselves while the previous commit flushes.

use std::time::Duration;

use futures::future::join_all;
use tokio::sync::{mpsc, oneshot};

use crate::db::issue::{self, ClaimOutcome, ClaimScope};
use crate::db::{DbError, DbPool};

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
    queue: mpsc::Sender<ClaimRequest>,
}

impl Claimer {
    /// Starts `lanes` batching tasks (two keep one batch building while the
    /// other commits). They stop when every `Claimer` clone is dropped.
    pub fn start(pool: DbPool, worker: String, lanes: usize) -> Claimer {
        let (queue, inbox) = mpsc::channel::<ClaimRequest>(1024);
        let inbox = std::sync::Arc::new(tokio::sync::Mutex::new(inbox));
        for _ in 0..lanes.max(1) {
            let (pool, worker, inbox) = (pool.clone(), worker.clone(), inbox.clone());
            tokio::spawn(async move {
                loop {
                    let batch = {
                        let mut inbox = inbox.lock().await;
                        let Some(first) = inbox.recv().await else {
                            return;
                        };
                        let mut batch = vec![first];
                        while batch.len() < MAX_BATCH {
                            match inbox.try_recv() {
                                Ok(next) => batch.push(next),
                                Err(_) => break,
                            }
                        }
                        batch
                    };
                    run_batch(&pool, &worker, batch).await;
                }
            });
        }
        Claimer { queue }
    }

    /// Claims the claimable ones among `ids` (see
    /// [`crate::db::issue::claim_issues`]).
    pub async fn claim(
        &self,
        ids: Vec<i64>,
        lease: Duration,
        scope: ClaimScope,
    ) -> Result<ClaimOutcome, DbError> {
        let (answer, outcome) = oneshot::channel();
        self.queue
            .send(ClaimRequest {
                ids,
                lease,
                scope,
                answer,
            })
            .await
            .map_err(|_| DbError::Invalid("the claimer has stopped".into()))?;
        let outcome = outcome
            .await
            .map_err(|_| DbError::Invalid("the claimer has stopped".into()))??;
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
