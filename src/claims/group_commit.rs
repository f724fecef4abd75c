//! Application-level group commit.
//!
//! Every transaction that changes a status sends NOTIFY, and PostgreSQL
//! serialises notifying commits: each holds a cluster-wide lock through its
//! WAL flush. One write per transaction would therefore commit one at a
//! time. A [`GroupCommit`] queues concurrent requests and hands whatever has
//! queued up to a batch function, one batch at a time per lane, so a batch
//! pays for one commit. Under light load a batch holds one request and
//! nothing waits; under heavy load batches grow by themselves while the
//! previous commit flushes.
//!
//! Used by [`crate::claims::claim::Claimer`] for claims and by the generator for
//! completions.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{mpsc, Mutex};

use crate::db::DbError;

/// Queues requests of type `R` for a batch function. Cheap to clone; the
/// lanes stop when every clone is dropped.
pub struct GroupCommit<R> {
    queue: mpsc::Sender<R>,
}

impl<R> Clone for GroupCommit<R> {
    fn clone(&self) -> Self {
        GroupCommit {
            queue: self.queue.clone(),
        }
    }
}

/// The lanes have stopped; the request was not taken.
#[derive(Debug)]
pub struct Stopped<R>(pub R);

impl<R: Send + 'static> GroupCommit<R> {
    /// Starts `lanes` tasks (two keep one batch building while the other
    /// commits), each running `run` on up to `max_batch` queued requests at
    /// a time. `run` answers each request itself (e.g. through a oneshot
    /// channel inside it).
    pub fn start<F, Fut>(lanes: usize, max_batch: usize, run: F) -> Self
    where
        F: Fn(Vec<R>) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (queue, inbox) = mpsc::channel::<R>(1024);
        let inbox = Arc::new(Mutex::new(inbox));
        for _ in 0..lanes.max(1) {
            let (inbox, run) = (inbox.clone(), run.clone());
            tokio::spawn(async move {
                loop {
                    let batch = {
                        let mut inbox = inbox.lock().await;
                        let Some(first) = inbox.recv().await else {
                            return;
                        };
                        let mut batch = vec![first];
                        while batch.len() < max_batch.max(1) {
                            match inbox.try_recv() {
                                Ok(next) => batch.push(next),
                                Err(_) => break,
                            }
                        }
                        batch
                    };
                    run(batch).await;
                }
            });
        }
        GroupCommit { queue }
    }

    /// Queues one request for the next batch.
    pub async fn submit(&self, request: R) -> Result<(), Stopped<R>> {
        self.queue
            .send(request)
            .await
            .map_err(|mpsc::error::SendError(r)| Stopped(r))
    }
}

/// What each of a batch's `n` items gets, given what running them together
/// (one statement, one commit) gave. If that failed, each item is tried on
/// its own with `alone(i)`, so one item's error is never another's; except
/// when no connection came in time: then every item gets that answer at
/// once, since one by one each would wait out the pool's timeout again, and
/// the lane, with everything queued behind it, with them.
pub async fn each_or_alone<O, F>(
    together: Result<Vec<O>, DbError>,
    n: usize,
    alone: impl Fn(usize) -> F,
) -> Vec<Result<O, DbError>>
where
    F: Future<Output = Result<O, DbError>>,
{
    let e = match together {
        Ok(outcomes) => return outcomes.into_iter().map(Ok).collect(),
        Err(e) => e,
    };
    if n == 1 {
        return vec![Err(e)];
    }
    if e.is_pool_exhausted() {
        tracing::warn!(error = %e, size = n, "no connection for a batch");
        return (0..n).map(|_| Err(e.again())).collect();
    }
    tracing::debug!(error = %e, size = n, "batch failed; trying each on its own");
    let mut results = Vec::with_capacity(n);
    for i in 0..n {
        results.push(alone(i).await);
    }
    results
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot;

    fn pool_timeout() -> DbError {
        DbError::Pool(deadpool_postgres::PoolError::Timeout(
            deadpool_postgres::TimeoutType::Wait,
        ))
    }

    #[tokio::test]
    async fn a_failed_batch_is_retried_item_by_item() {
        let tried = std::sync::Mutex::new(Vec::new());
        let results = each_or_alone(
            Err::<Vec<i32>, _>(DbError::Invalid("rejected".into())),
            3,
            |i| {
                tried.lock().unwrap().push(i);
                async move {
                    if i == 1 {
                        Err(DbError::Invalid("this one is bad".into()))
                    } else {
                        Ok(i as i32 * 10)
                    }
                }
            },
        )
        .await;
        assert_eq!(*tried.lock().unwrap(), [0, 1, 2]);
        assert_eq!(results[0].as_ref().ok(), Some(&0));
        assert!(results[1].is_err());
        assert_eq!(results[2].as_ref().ok(), Some(&20));
    }

    #[tokio::test]
    async fn a_batch_without_a_connection_is_answered_at_once() {
        let results = each_or_alone(Err::<Vec<i32>, _>(pool_timeout()), 3, |_| async {
            panic!("no item is tried alone")
        })
        .await;
        assert_eq!(results.len(), 3);
        assert!(results
            .iter()
            .all(|r| r.as_ref().is_err_and(DbError::is_pool_exhausted)));
    }

    #[tokio::test]
    async fn requests_queued_while_a_batch_runs_form_the_next_batch() {
        let (sizes_tx, mut sizes) = mpsc::unbounded_channel::<usize>();
        let (release_tx, release) = tokio::sync::watch::channel(false);
        let group = GroupCommit::start(1, 64, move |batch: Vec<oneshot::Sender<usize>>| {
            let (sizes_tx, mut release) = (sizes_tx.clone(), release.clone());
            async move {
                let _ = sizes_tx.send(batch.len());
                // The first batch blocks until the test has queued more.
                let _ = release.wait_for(|r| *r).await;
                let n = batch.len();
                for answer in batch {
                    let _ = answer.send(n);
                }
            }
        });
        let (first_tx, first) = oneshot::channel();
        group.submit(first_tx).await.unwrap();
        assert_eq!(sizes.recv().await, Some(1));
        let mut later = Vec::new();
        for _ in 0..5 {
            let (tx, rx) = oneshot::channel();
            group.submit(tx).await.unwrap();
            later.push(rx);
        }
        release_tx.send(true).unwrap();
        assert_eq!(first.await.unwrap(), 1);
        assert_eq!(sizes.recv().await, Some(5), "the five queued meanwhile");
        for rx in later {
            assert_eq!(rx.await.unwrap(), 5);
        }
    }

    #[tokio::test]
    async fn batches_never_exceed_the_limit() {
        let (sizes_tx, mut sizes) = mpsc::unbounded_channel::<usize>();
        let (release_tx, release) = tokio::sync::watch::channel(false);
        let group = GroupCommit::start(1, 3, move |batch: Vec<u32>| {
            let (sizes_tx, mut release) = (sizes_tx.clone(), release.clone());
            async move {
                let _ = sizes_tx.send(batch.len());
                let _ = release.wait_for(|r| *r).await;
            }
        });
        for i in 0..8 {
            group.submit(i).await.unwrap();
        }
        release_tx.send(true).unwrap();
        let mut total = 0;
        while total < 8 {
            let size = sizes.recv().await.unwrap();
            assert!(size <= 3, "batch of {size}");
            total += size;
        }
        assert_eq!(total, 8);
    }
}
