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
//! Used by [`crate::claim::Claimer`] for claims and by the generator for
//! completions.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{mpsc, Mutex};

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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot;

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
