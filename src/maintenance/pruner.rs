//! The hourly prune of `serve`.
//!
//! One instance at a time prunes, the one holding the `prune` advisory
//! lock on a connection of its own (never a pooled one), as the lease
//! reaper does: it prunes once when it takes the lock, then once an hour,
//! on that same session, by the retention settings as they are then
//! ([`crate::db::retention`]). If it dies, its session ends, the lock is
//! free, and another instance takes over within the hour.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::db::advisory::{self, AdvisoryLock};
use crate::db::retention;
use crate::settings::SettingsCache;

/// How often the holder prunes, and others try to take over.
pub const EVERY: Duration = Duration::from_secs(3600);

/// The pruning service of one instance.
pub struct Pruner {
    /// The direct endpoint: the lock needs a session of its own.
    pub endpoint: crate::db::Endpoint,
    pub settings: Arc<SettingsCache>,
    pub instance: String,
}

impl Pruner {
    pub async fn run(self, shutdown: CancellationToken) {
        // The lock, and the guard that shows it as held in the metrics.
        let mut lock: Option<(AdvisoryLock, crate::metrics::GaugeGuard)> = None;
        loop {
            if let Some((held, _)) = &lock {
                if !held.is_held().await {
                    tracing::warn!("lost the prune lock's session");
                    lock = None;
                }
            }
            if lock.is_none() {
                match AdvisoryLock::try_acquire(&self.endpoint, advisory::PRUNE, &self.instance)
                    .await
                {
                    Ok(Some(taken)) => {
                        tracing::info!("this instance now prunes by the retention settings");
                        let shown =
                            crate::metrics::advisory_lock_held(advisory::name_of(taken.key()));
                        lock = Some((taken, shown));
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!(error = %e, "cannot try the prune lock"),
                }
            }
            if let Some((held, _)) = &lock {
                if let Err(e) = self.prune(held).await {
                    tracing::warn!(error = %e, "pruning failed");
                    crate::metrics::prune_failed();
                    // A session that cannot write (a demoted primary) is
                    // let go with its lock.
                    if e.ends_session() {
                        if let Some((held, _shown)) = lock.take() {
                            held.release().await;
                        }
                    }
                }
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(EVERY) => {}
            }
        }
        if let Some((lock, _shown)) = lock {
            lock.release().await;
        }
    }

    async fn prune(&self, held: &AdvisoryLock) -> Result<(), crate::db::DbError> {
        let retention = self.settings.get().await?.retention();
        let started = std::time::Instant::now();
        let report = retention::prune(held.client(), &retention, false).await?;
        crate::metrics::pruned(&report.by_table(), started.elapsed());
        if report.total() > 0 {
            tracing::info!(?report, "pruned by the retention settings");
        }
        Ok(())
    }
}
