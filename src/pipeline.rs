//! The daily pipeline and its scheduler.
//!
//! One run is the seed's DAG: `select_target_issues` (the `top_k` hottest
//! issues collected within `lookback_hours` that are not `DONE`) →
//! `check_generation_needed` (claim the `PENDING`/`FAILED` ones; those in
//! progress elsewhere are simply waited for) → generate → smart wait →
//! assemble the briefing from exactly the ids the wait returned. Every run
//! is recorded in `pipeline_run`; a `skip` publishes no briefing.
//!
//! Exactly one run at a time, cluster-wide: a run holds the `pipeline`
//! advisory lock on a connection of its own for its whole length, released
//! on every exit path, and stops at once if that session ends. The scheduler in each `serve` instance wakes at every
//! tick of the `schedule` setting and tries the lock; the one that gets it
//! runs, the others skip, and `pipeline_run`'s one-run-per-tick index makes
//! a late instance skip a tick that already ran.

use std::sync::Arc;

use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;

use crate::briefing::{self, AssembleError};
use crate::claim::Claimer;
use crate::db::advisory::{self, AdvisoryLock};
use crate::db::issue::ClaimScope;
use crate::db::pipeline_run::{self, RunRecord};
use crate::db::{DbError, DbPool};
use crate::listener::TransitionHub;
use crate::schedule::Schedule;
use crate::settings::{Settings, SettingsCache};
use crate::wait::{self, WaitError, WaitOutcome, WaitRequest};
use crate::worker::GeneratorHandle;

/// What starts a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// A scheduler tick.
    Schedule(OffsetDateTime),
    /// `newsnack run-pipeline` or the demo.
    Manual,
}

/// How a run went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSummary {
    pub run_id: i64,
    pub outcome: String,
    pub targets: Vec<i64>,
    pub completed: Vec<i64>,
    pub briefing_id: Option<i64>,
}

/// Why a run could not happen.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("another pipeline run holds the lock (see `newsnack locks`)")]
    Busy,
    #[error("the pipeline lock was lost and another instance took over the run")]
    TakenOver,
    #[error(transparent)]
    Db(#[from] DbError),
}

/// Everything a run needs.
#[derive(Clone)]
pub struct Pipeline {
    pub config: tokio_postgres::Config,
    pub pool: DbPool,
    pub hub: TransitionHub,
    pub claimer: Claimer,
    pub generator: GeneratorHandle,
    pub settings: Arc<SettingsCache>,
    pub instance: String,
}

impl Pipeline {
    /// Runs once under the pipeline lock. `Ok(None)` when this tick already
    /// ran elsewhere; `Err(Busy)` when another run holds the lock.
    ///
    /// Should the lock's session end mid-run, the lock is another
    /// instance's to take: the run stops at once and is recorded as an
    /// `error` without a briefing. Its last step, publishing the briefing
    /// and recording the outcome in one transaction, happens only while
    /// the run is still `running`, so a run that another instance has
    /// meanwhile marked `abandoned` publishes nothing.
    pub async fn run_locked(
        &self,
        trigger: Trigger,
        cancel: &CancellationToken,
    ) -> Result<Option<RunSummary>, PipelineError> {
        let Some(lock) =
            AdvisoryLock::try_acquire(&self.config, advisory::PIPELINE, &self.instance).await?
        else {
            return Err(PipelineError::Busy);
        };
        let _held = crate::metrics::advisory_lock_held(advisory::name_of(lock.key()));
        let lost = lock.lost();
        let stop = cancel.child_token();
        let relay = tokio::spawn({
            let (lost, stop) = (lost.clone(), stop.clone());
            async move {
                lost.cancelled().await;
                stop.cancel();
            }
        });
        // The lock is held for the whole run; if this task is cancelled or
        // panics, dropping it closes its session and so releases it.
        let result = self.run(trigger, &stop, &lost).await;
        relay.abort();
        lock.release().await;
        result
    }

    async fn run(
        &self,
        trigger: Trigger,
        stop: &CancellationToken,
        lock_lost: &CancellationToken,
    ) -> Result<Option<RunSummary>, PipelineError> {
        let settings = self.settings.get().await?;
        let client = self.pool.get().await.map_err(DbError::from)?;
        let stale = pipeline_run::abandon_stale(&client).await?;
        if stale > 0 {
            tracing::warn!(stale, "marked runs of a stopped instance as abandoned");
        }
        let (kind, tick) = match trigger {
            Trigger::Schedule(tick) => ("schedule", Some(tick)),
            Trigger::Manual => ("manual", None),
        };
        let used = serde_json::to_value(&*settings).unwrap_or_default();
        let Some(run_id) = pipeline_run::start(&client, kind, tick, &self.instance, &used).await?
        else {
            tracing::debug!(?tick, "this tick already ran");
            return Ok(None);
        };
        drop(client);
        let mut record = RunRecord::default();
        match self.carry_out(run_id, &settings, stop, &mut record).await {
            Ok(publish) => self.finish(run_id, record, publish, lock_lost).await,
            Err(e) => {
                // A run that started is always finished, so it never stays
                // `running` until another instance calls it abandoned.
                record.outcome = "error".into();
                record.error = Some(e.to_string());
                if let Err(unrecorded) = self.finish(run_id, record, false, lock_lost).await {
                    tracing::warn!(run_id, error = %unrecorded, "could not record the failed run");
                }
                Err(e)
            }
        }
    }

    /// Selects, claims and waits, filling in `record`; true when a briefing
    /// of `record.completed` is to be published.
    async fn carry_out(
        &self,
        run_id: i64,
        settings: &Settings,
        stop: &CancellationToken,
        record: &mut RunRecord,
    ) -> Result<bool, PipelineError> {
        let client = self.pool.get().await.map_err(DbError::from)?;
        let targets =
            pipeline_run::select_targets(&client, settings.top_k, settings.lookback_hours).await?;
        drop(client);
        tracing::info!(run_id, ?targets, "pipeline run started");
        record.targets = targets.clone();
        if targets.is_empty() {
            record.outcome = WaitOutcome::Skip.as_str().into();
            record.error = Some("no candidate issues".into());
            return Ok(false);
        }

        let claimed = self
            .claimer
            .claim(targets.clone(), settings.lease(), ClaimScope::Claimable)
            .await?;
        record.claimed = claimed.claimed_ids();
        self.generator.submit(claimed.claimed);

        let request = WaitRequest {
            issue_ids: targets.clone(),
            timeout: settings.wait_timeout(),
            min_completion: settings.content_gen_min_completion.max(0) as usize,
            max_attempts: settings.max_attempts as i32,
        };
        let report = match wait::smart_wait(&self.hub, request, stop).await {
            Ok(report) => report,
            Err(e) => {
                record.outcome = if matches!(e, WaitError::ShuttingDown) {
                    "abandoned"
                } else {
                    "error"
                }
                .into();
                record.error = Some(e.to_string());
                return Ok(false);
            }
        };
        record.outcome = report.outcome.as_str().into();
        record.failed = report.failed.clone();
        record.unfinished = report.unfinished.clone();
        record.waited_ms = Some(report.waited_ms as i64);
        // Reading order: hottest first, as selected.
        record.completed = targets
            .iter()
            .copied()
            .filter(|id| report.completed.contains(id))
            .collect();
        if report.outcome == WaitOutcome::Skip {
            return Ok(false);
        }
        if record.completed.is_empty() {
            // Possible when the minimum is set to 0: the run passes with
            // nothing to put in a briefing.
            record.error = Some("no article completed: no briefing".into());
            return Ok(false);
        }
        Ok(true)
    }

    /// Publishes the briefing (when `publish`) and records the outcome, in
    /// one transaction that commits only if the run is still `running`.
    async fn finish(
        &self,
        run_id: i64,
        mut record: RunRecord,
        publish: bool,
        lock_lost: &CancellationToken,
    ) -> Result<Option<RunSummary>, PipelineError> {
        if lock_lost.is_cancelled() {
            record.outcome = "error".into();
            record.error = Some(LOCK_LOST.into());
            record.briefing_id = None;
        }
        let mut client = self.pool.get().await.map_err(DbError::from)?;
        let transaction = client.transaction().await.map_err(DbError::from)?;
        if publish && !lock_lost.is_cancelled() {
            match briefing::assemble(&transaction, &record.completed).await {
                Ok(assembled) => record.briefing_id = Some(assembled.briefing_id),
                Err(AssembleError::Db(e)) => return Err(e.into()),
                Err(e) => {
                    record.outcome = "error".into();
                    record.error = Some(e.to_string());
                }
            }
        }
        if !pipeline_run::finish(&transaction, run_id, &record).await? {
            tracing::warn!(run_id, "another instance took over this run after its pipeline lock was lost; nothing published");
            return Err(PipelineError::TakenOver);
        }
        transaction.commit().await.map_err(DbError::from)?;
        match &record.error {
            Some(error) if record.outcome == "error" => {
                tracing::warn!(run_id, %error, "pipeline run failed")
            }
            _ => {
                tracing::info!(run_id, outcome = %record.outcome, completed = ?record.completed, briefing = ?record.briefing_id, "pipeline run finished")
            }
        }
        Ok(Some(RunSummary {
            run_id,
            outcome: record.outcome,
            targets: record.targets,
            completed: record.completed,
            briefing_id: record.briefing_id,
        }))
    }
}

/// The error recorded for a run whose pipeline lock was lost.
const LOCK_LOST: &str = "the pipeline lock's database session ended mid-run; \
                         stopped without a briefing, so that another instance may run";

/// How soon the scheduler reads its settings again after a failed read.
const SETTINGS_RETRY: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs the pipeline at every tick of the `schedule` setting.
pub struct PipelineScheduler {
    pub pipeline: Pipeline,
}

impl PipelineScheduler {
    pub async fn run(self, shutdown: CancellationToken) {
        let mut changes = self.pipeline.hub.settings_changed();
        loop {
            changes.borrow_and_update();
            let schedule = match self.pipeline.settings.get().await {
                Ok(s) => s.schedule.parse::<Schedule>(),
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?SETTINGS_RETRY, "cannot read the schedule; will try again");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(SETTINGS_RETRY) => continue,
                    }
                }
            };
            let next = match schedule {
                Ok(schedule) => schedule.next_tick(OffsetDateTime::now_utc()),
                Err(e) => {
                    tracing::error!(error = %e, "the schedule setting is invalid; scheduler idle until it changes");
                    None
                }
            };
            let Some(tick) = next else {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = changes.changed() => continue,
                }
            };
            let wait = (tick - OffsetDateTime::now_utc()).max(time::Duration::ZERO);
            let sleep = tokio::time::sleep(std::time::Duration::try_from(wait).unwrap_or_default());
            tokio::select! {
                _ = shutdown.cancelled() => return,
                // A new schedule may move the next tick.
                _ = changes.changed() => continue,
                _ = sleep => {}
            }
            match self
                .pipeline
                .run_locked(Trigger::Schedule(tick), &shutdown)
                .await
            {
                Ok(Some(summary)) => {
                    tracing::info!(run_id = summary.run_id, outcome = %summary.outcome, "scheduled run done")
                }
                Ok(None) => {}
                Err(PipelineError::Busy) => {
                    tracing::debug!(%tick, "another instance is running this tick")
                }
                Err(e) => tracing::warn!(error = %e, "scheduled run failed"),
            }
        }
    }
}
