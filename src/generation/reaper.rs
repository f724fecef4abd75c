//! The lease reaper: returns the issues of crashed or stuck workers.
//!
//! One instance at a time reaps, the one holding the `lease-reaper`
//! advisory lock on a connection of its own (never a pooled one). Every
//! tick it moves `IN_PROGRESS` issues whose lease expired to `FAILED` with
//! reason `lease expired` (a guarded compare-and-set, see
//! [`crate::db::issue::reap_expired`]), on that same session, so the
//! instance holding the lock can reap however loaded its pool is; the
//! retry scheduler then retries them. The same tick folds the deltas of
//! the counts per status ([`crate::db::issue::fold_status_counts`]) and
//! the articles' tokens ([`crate::db::llm_budget::fold_article_tokens`]). If
//! the holder dies, its session ends, the lock is free, and another
//! instance takes over at its next tick. The lock itself (its session, pings, release, the metrics gauge)
//! is [`AdvisoryLock`]'s; this file decides only when to take it.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::db::advisory::{self, AdvisoryLock};
use crate::db::{issue, llm_budget};
use crate::settings::SettingsCache;

/// The reaper service of one instance.
pub struct LeaseReaper {
    /// The direct endpoint: the lock needs a session of its own.
    pub endpoint: crate::db::Endpoint,
    pub settings: Arc<SettingsCache>,
    pub instance: String,
}

impl LeaseReaper {
    pub async fn run(self, shutdown: CancellationToken) {
        let mut lock: Option<AdvisoryLock> = None;
        loop {
            let tick = self.tick_interval().await;
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(tick) => {}
            }
            lock = self.keep_or_take(lock).await;
            let Some(held) = &lock else { continue };
            match reap(held).await {
                Ok(ids) if !ids.is_empty() => tracing::warn!(?ids, "reaped expired leases"),
                Ok(_) => {}
                // A session that cannot write (a demoted primary after a
                // failover) is let go with its lock; the next tick takes
                // it on a new session, which reaches the new primary.
                Err(e) if e.ends_session() => {
                    tracing::warn!(error = %e, "the reaper's session cannot reap; letting it go");
                    if let Some(held) = lock.take() {
                        held.release().await;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "reaping failed"),
            }
        }
        if let Some(lock) = lock {
            lock.release().await;
        }
    }

    /// The reaper lock for this tick: the one held, if its session still
    /// answers, else a fresh try. A lost lock is not waited for or retried
    /// as a pipeline run's is: any instance may reap, so whichever takes
    /// the lock at its next tick does.
    async fn keep_or_take(&self, held: Option<AdvisoryLock>) -> Option<AdvisoryLock> {
        if let Some(held) = held {
            if held.is_held().await {
                return Some(held);
            }
            tracing::warn!("lost the reaper lock's session");
        }
        match AdvisoryLock::try_acquire(&self.endpoint, advisory::LEASE_REAPER, &self.instance)
            .await
        {
            Ok(Some(taken)) => {
                tracing::info!("this instance is now the lease reaper");
                Some(taken)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(error = %e, "cannot try the reaper lock");
                None
            }
        }
    }

    /// A quarter of the lease, between 200 ms and 5 s: expired leases are
    /// noticed well within one lease length.
    async fn tick_interval(&self) -> Duration {
        let lease = self
            .settings
            .get()
            .await
            .map(|s| s.lease())
            .unwrap_or(Duration::from_secs(60));
        (lease / 4).clamp(Duration::from_millis(200), Duration::from_secs(5))
    }
}

/// How many count deltas (or article token rows) may pile up before a
/// tick folds them.
const FOLD_ABOVE: i32 = 256;

/// Reaps on the lock's own session: only while the lock is held, and
/// whatever the pool's load (a saturated pool must not leave the lock
/// held by an instance that cannot reap).
async fn reap(held: &AdvisoryLock) -> Result<Vec<i64>, crate::db::DbError> {
    // The counts' deltas and the token rows are folded here too: one
    // instance at a time, and often enough that reading them stays a sum
    // over a few rows.
    issue::fold_status_counts(held.client(), FOLD_ABOVE).await?;
    llm_budget::fold_article_tokens(held.client(), FOLD_ABOVE).await?;
    let mut all = Vec::new();
    loop {
        let batch = issue::reap_expired(held.client(), 500).await?;
        let more = batch.len() == 500;
        all.extend(batch);
        if !more {
            return Ok(all);
        }
    }
}
