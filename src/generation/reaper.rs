//! The lease reaper: returns the issues of crashed or stuck workers.
//!
//! One instance at a time reaps, the one holding the `lease-reaper`
//! advisory lock on a connection of its own (never a pooled one). Every
//! tick it moves `IN_PROGRESS` issues whose lease expired to `FAILED` with
//! reason `lease expired` (a guarded compare-and-set, see
//! [`crate::db::issue::reap_expired`]), on that same session, so the
//! instance holding the lock can reap however loaded its pool is; the
//! retry scheduler then retries them. If the holder dies, its session
//! ends, the lock is free, and another instance takes over at its next
//! tick.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::db::advisory::{self, AdvisoryLock};
use crate::db::issue;
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
        // The lock, and the guard that shows it as held in the metrics.
        let mut lock: Option<(AdvisoryLock, crate::metrics::GaugeGuard)> = None;
        loop {
            let tick = self.tick_interval().await;
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(tick) => {}
            }
            if let Some((held, _)) = &lock {
                if !held.is_held().await {
                    tracing::warn!("lost the reaper lock's session");
                    lock = None;
                }
            }
            if lock.is_none() {
                match AdvisoryLock::try_acquire(
                    &self.endpoint,
                    advisory::LEASE_REAPER,
                    &self.instance,
                )
                .await
                {
                    Ok(Some(taken)) => {
                        tracing::info!("this instance is now the lease reaper");
                        let shown =
                            crate::metrics::advisory_lock_held(advisory::name_of(taken.key()));
                        lock = Some((taken, shown));
                    }
                    Ok(None) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot try the reaper lock");
                        continue;
                    }
                }
            }
            let Some((held, _)) = &lock else { continue };
            match reap(held).await {
                Ok(ids) if !ids.is_empty() => tracing::warn!(?ids, "reaped expired leases"),
                Ok(_) => {}
                // A session that cannot write (a demoted primary after a
                // failover) is let go with its lock; the next tick takes
                // it on a new session, which reaches the new primary.
                Err(e) if e.ends_session() => {
                    tracing::warn!(error = %e, "the reaper's session cannot reap; letting it go");
                    if let Some((held, _shown)) = lock.take() {
                        held.release().await;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "reaping failed"),
            }
        }
        if let Some((lock, _shown)) = lock {
            lock.release().await;
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

/// Reaps on the lock's own session: only while the lock is held, and
/// whatever the pool's load (a saturated pool must not leave the lock
/// held by an instance that cannot reap).
async fn reap(held: &AdvisoryLock) -> Result<Vec<i64>, crate::db::DbError> {
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
