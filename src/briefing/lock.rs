//! The pipeline lock, held for the whole length of one run.
//!
//! Exactly one run at a time, cluster-wide: a run holds the `pipeline`
//! advisory lock on a connection of its own until it ends, and releases it
//! on every exit path. A task beside the run keeps the lock: it pings the
//! lock's session, and if that session ends (an idle timeout,
//! `pg_terminate_backend`, a failover) takes the lock again on a new one, so
//! the run and its tick are not lost. If another session took the lock
//! meanwhile, or the database stays unreachable, the lock is lost for good
//! and the run is stopped. The run asks [`LockHolder::still_holds`] before
//! it publishes. The lock itself is [`AdvisoryLock`]; this file owns only
//! the rules a run keeps it by.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::db::advisory::{self, AdvisoryLock};
use crate::db::{DbError, Endpoint, Sql};

/// How often the lock's session is pinged, so that an idle-session timeout
/// or a dead connection is found during a long wait.
const LOCK_PING: Duration = Duration::from_secs(10);
/// How long the last step waits for the keeper's verdict on a lock whose
/// session the server no longer sees (taken again, or lost for good).
const VERDICT_WAIT: Duration = Duration::from_secs(20);

/// The pipeline lock, taken for one run and kept by a task of its own until
/// [`RunLock::release`] or until this is dropped.
pub(super) struct RunLock {
    holder: LockHolder,
    /// Cancelled when the lock is lost for good: the run must stop.
    stop: CancellationToken,
    /// Tells the keeper to release the lock; dropping it does too, so a run
    /// dropped mid-way (its task aborted) still lets the lock go.
    done: DropGuard,
    keeper: JoinHandle<()>,
}

impl RunLock {
    /// Takes the pipeline lock without waiting; `Ok(None)` when another
    /// session holds it. `cancel` (a shutdown) also cancels [`Self::stop`].
    pub(super) async fn try_take(
        direct: &Endpoint,
        instance: &str,
        cancel: &CancellationToken,
    ) -> Result<Option<RunLock>, DbError> {
        let Some(lock) = AdvisoryLock::try_acquire(direct, advisory::PIPELINE, instance).await?
        else {
            return Ok(None);
        };
        let (holder_tx, holder) = watch::channel(Some(lock.pid()));
        let stop = cancel.child_token();
        let done = CancellationToken::new();
        let keeper = tokio::spawn(keep(lock, holder_tx, stop.clone(), done.clone()));
        Ok(Some(RunLock {
            holder: LockHolder(holder),
            stop,
            done: done.drop_guard(),
            keeper,
        }))
    }

    /// Cancelled when the run must stop: a shutdown, or the lock lost for
    /// good.
    pub(super) fn stop(&self) -> &CancellationToken {
        &self.stop
    }

    /// Which session holds the lock, as the run sees it.
    pub(super) fn holder(&self) -> &LockHolder {
        &self.holder
    }

    /// Releases the lock and waits until it is let go.
    pub(super) async fn release(self) {
        drop(self.done);
        let _ = self.keeper.await;
    }
}

/// The pipeline lock as a run sees it: the backend pid of the session
/// holding it, or `None` once it is lost for good.
#[derive(Clone)]
pub(super) struct LockHolder(watch::Receiver<Option<i32>>);

impl LockHolder {
    /// Whether the lock is lost for good.
    pub(super) fn is_lost(&self) -> bool {
        self.0.borrow().is_none()
    }

    /// Whether the run still holds its lock, as the server sees it. When the
    /// server no longer sees the lock's session holding it, waits (bounded)
    /// for the keeper's verdict: the lock taken again, or lost for good.
    pub(super) async fn still_holds(&self, client: &impl Sql) -> Result<bool, DbError> {
        let mut holder = self.0.clone();
        let deadline = tokio::time::Instant::now() + VERDICT_WAIT;
        loop {
            let Some(pid) = *holder.borrow_and_update() else {
                return Ok(false);
            };
            if advisory::held_by(client, advisory::PIPELINE, pid).await? {
                return Ok(true);
            }
            match tokio::time::timeout_at(deadline, holder.changed()).await {
                Ok(Ok(())) => continue,
                _ => return Ok(false),
            }
        }
    }
}

/// Holds the run's lock until `done`, taking it again whenever its session
/// ends. When it cannot be taken again, `holder` says so and `stop` ends
/// the run.
async fn keep(
    mut lock: AdvisoryLock,
    holder: watch::Sender<Option<i32>>,
    stop: CancellationToken,
    done: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = done.cancelled() => {
                lock.release().await;
                return;
            }
            _ = lock.session_ends(LOCK_PING) => {}
        }
        let retaken = tokio::select! {
            _ = done.cancelled() => return,
            retaken = lock.retake() => retaken,
        };
        let Some(again) = retaken else {
            tracing::warn!("the pipeline lock's session ended and the lock could not be taken again; stopping the run");
            holder.send_replace(None);
            stop.cancel();
            return;
        };
        tracing::warn!(
            pid = again.pid(),
            "the pipeline lock's session ended; took the lock again on a new session"
        );
        holder.send_replace(Some(again.pid()));
        lock = again;
    }
}
