//! One pipeline run: select → claim → wait → assemble, recorded in
//! `pipeline_run`.
//!
//! The steps are the original DAG's: `select_target_issues` (the `top_k`
//! hottest issues collected within `lookback_hours` that are not `DONE`) →
//! `check_generation_needed` (claim the `PENDING`/`FAILED` ones; those in
//! progress elsewhere are simply waited for) → generate → smart wait →
//! assemble the briefing from exactly the ids the wait returned. Every run
//! is recorded in `pipeline_run`; a `skip` publishes no briefing.
//!
//! A run holds the pipeline lock from start to end ([`super::lock`]), so
//! only one runs at a time cluster-wide, and it publishes only while the
//! server still sees that lock held. The scheduler that starts runs is
//! [`super::scheduler`].

use std::sync::Arc;
use std::time::Duration;

use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::briefing::assembly::{self, AssembleError};
use crate::briefing::lock::{LockHolder, RunLock};
use crate::briefing::wait::{self, WaitError, WaitOutcome, WaitReport, WaitRequest};
use crate::claims::claim::Claimer;
use crate::db::issue::ClaimScope;
use crate::db::pipeline_run::{self, RunRecord};
use crate::db::transition;
use crate::db::{DbError, DbPool};
use crate::events::hub::EventHub;
use crate::generation::retry::RetryScope;
use crate::generation::worker::GeneratorHandle;
use crate::model::llm::Priority;
use crate::settings::{Settings, SettingsCache};
use crate::telemetry::exported;

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
    /// Why a run ended without a briefing, when it says (e.g. "no candidate
    /// issues", or the error of an `error` run).
    pub error: Option<String>,
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

/// Pauses between claims of the targets a run's first claim skipped: from
/// the first, doubling up to the last.
const STRAGGLER_PAUSES: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(2));

/// Everything a run needs.
#[derive(Clone)]
pub struct Pipeline {
    /// The direct endpoint: the run's lock needs a session of its own.
    pub direct: crate::db::Endpoint,
    pub pool: DbPool,
    pub hub: EventHub,
    pub claimer: Claimer,
    pub generator: GeneratorHandle,
    pub settings: Arc<SettingsCache>,
    pub instance: String,
    /// The retry scheduler's scope: a run's targets are brought into it.
    pub retry_scope: RetryScope,
}

impl Pipeline {
    /// Runs once under the pipeline lock. `Ok(None)` when this tick already
    /// ran elsewhere; `Err(Busy)` when another run holds the lock.
    ///
    /// The lock is kept for the whole run (see [`super::lock`]): should its
    /// session end and another instance take the lock, the run stops at
    /// once and is recorded as an `error` without a briefing. Its last
    /// step, publishing the briefing and recording the outcome in one
    /// transaction, commits only while the server still sees the lock held
    /// and the run still `running`.
    ///
    /// `cancel` (a shutdown) ends a manual run's wait as `abandoned`; a
    /// scheduled run's wait decides at once instead, as at its timeout, so
    /// a restart during the wait does not lose the tick's briefing when
    /// enough articles are done.
    pub async fn run_locked(
        &self,
        trigger: Trigger,
        cancel: &CancellationToken,
    ) -> Result<Option<RunSummary>, PipelineError> {
        let Some(lock) = RunLock::try_take(&self.direct, &self.instance, cancel).await? else {
            return Err(PipelineError::Busy);
        };
        // A scheduled run's tick passes with it, so at a shutdown it
        // decides on what is done rather than being abandoned; a manual
        // run stopped by its operator is abandoned.
        let decide_now = matches!(trigger, Trigger::Schedule(_)).then_some(cancel);
        let result = self
            .run(trigger, lock.stop(), decide_now, lock.holder())
            .await;
        lock.release().await;
        result
    }

    /// The run under its lock: opens its `pipeline_run` row, carries it
    /// out, and always closes the row, failed runs included.
    async fn run(
        &self,
        trigger: Trigger,
        stop: &CancellationToken,
        decide_now: Option<&CancellationToken>,
        lock: &LockHolder,
    ) -> Result<Option<RunSummary>, PipelineError> {
        let settings = self.settings.get().await?;
        let client = self.pool.get().await.map_err(DbError::from)?;
        let (kind, tick) = match trigger {
            Trigger::Schedule(tick) => ("schedule", Some(tick)),
            Trigger::Manual => ("manual", None),
        };
        // A tick that already has a run is left alone, before anything is
        // marked abandoned: its run may be alive and only between lock
        // sessions, about to take the lock back and finish.
        if let Some(tick) = tick {
            if pipeline_run::tick_has_run(&client, tick).await? {
                tracing::debug!(%tick, "this tick already ran");
                return Ok(None);
            }
        }
        let stale = pipeline_run::abandon_stale(&client).await?;
        if stale > 0 {
            tracing::warn!(stale, "marked runs of a stopped instance as abandoned");
        }
        let used = serde_json::to_value(&*settings).unwrap_or_default();
        let Some(run_id) = pipeline_run::start(&client, kind, tick, &self.instance, &used).await?
        else {
            tracing::debug!(?tick, "this tick already ran");
            return Ok(None);
        };
        drop(client);
        // The run is one trace, whatever started it: a root of its own,
        // its steps (select, claim, wait, briefing) its children.
        let root = exported(|| {
            tracing::info_span!(
                parent: None,
                "pipeline run",
                otel.kind = "internal",
                newsnack.run_id = run_id,
                newsnack.trigger = kind,
                newsnack.outcome = tracing::field::Empty,
            )
        });
        let finished = async {
            let mut record = RunRecord::default();
            match self
                .carry_out(run_id, &settings, stop, decide_now, &mut record)
                .await
            {
                Ok(publish) => self.finish(run_id, record, publish, lock, &settings).await,
                Err(e) => {
                    // A run that started is always finished, so it never
                    // stays `running` until another instance calls it
                    // abandoned.
                    record.outcome = "error".into();
                    record.error = Some(e.to_string());
                    if let Err(unrecorded) =
                        self.finish(run_id, record, false, lock, &settings).await
                    {
                        tracing::warn!(run_id, error = %unrecorded, "could not record the failed run");
                    }
                    Err(e)
                }
            }
        }
        .instrument(root.clone())
        .await;
        let outcome = match &finished {
            Ok(Some(summary)) => summary.outcome.as_str(),
            Ok(None) => "",
            Err(_) => "error",
        };
        root.record("newsnack.outcome", outcome);
        finished
    }

    /// Selects, claims and waits, filling in `record`; true when a briefing
    /// of `record.completed` is to be published. `stop` abandons the wait;
    /// `decide_now` (checked first) makes it decide at once.
    async fn carry_out(
        &self,
        run_id: i64,
        settings: &Settings,
        stop: &CancellationToken,
        decide_now: Option<&CancellationToken>,
        record: &mut RunRecord,
    ) -> Result<bool, PipelineError> {
        let Targets {
            all: targets,
            pending,
            failed,
        } = self.select_targets(settings).await?;
        tracing::info!(run_id, ?targets, "pipeline run started");
        record.targets = targets.clone();
        self.retry_scope.add(&targets);
        if targets.is_empty() {
            record.outcome = WaitOutcome::Skip.as_str().into();
            record.error = Some("no candidate issues".into());
            return Ok(false);
        }
        let stragglers = self
            .claim_targets(pending, failed, settings, record)
            .await?;
        let request = WaitRequest {
            issue_ids: targets.clone(),
            timeout: settings.wait_timeout(),
            min_completion: settings.content_gen_min_completion.max(0) as usize,
            max_attempts: settings.max_attempts as i32,
        };
        let wait_span = exported(|| {
            tracing::info_span!(
                "wait",
                otel.kind = "internal",
                newsnack.targets = targets.len() as i64,
                newsnack.outcome = tracing::field::Empty,
            )
        });
        let waited = tokio::select! {
            biased;
            waited = wait::smart_wait_deciding_early(&self.hub, request, decide_now, stop)
                .instrument(wait_span.clone()) => waited,
            never = self.claim_stragglers(stragglers, settings, record) => match never {},
        };
        if let Ok(report) = &waited {
            wait_span.record("newsnack.outcome", report.outcome.as_str());
        }
        self.link_waited_for(&wait_span, &targets).await;
        Ok(record_wait(record, &targets, waited))
    }

    /// Links the run's `wait` span to the trace context each of `ids` was
    /// worked in, as the database keeps it (the claim's, or a later
    /// writer's), when spans are exported: an article generated in another
    /// trace (claimed by Airflow, say) is one click away. A failed read
    /// costs the links only.
    async fn link_waited_for(&self, wait: &tracing::Span, ids: &[i64]) {
        if wait.is_none() {
            return;
        }
        let read = async {
            let client = self.pool.get().await.map_err(DbError::from)?;
            transition::trace_contexts(&client, ids).await
        };
        match read.instrument(wait.clone()).await {
            Ok(contexts) => crate::telemetry::link_articles(wait, &contexts),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the articles' trace contexts; the run's wait is not linked to them")
            }
        }
    }

    /// The run's targets, as `select_target_issues` picks them.
    async fn select_targets(&self, settings: &Settings) -> Result<Targets, PipelineError> {
        let span = exported(|| {
            tracing::info_span!(
                "select",
                otel.kind = "internal",
                newsnack.targets = tracing::field::Empty,
            )
        });
        let candidates = async {
            let client = self.pool.get().await.map_err(DbError::from)?;
            pipeline_run::select_targets(
                &client,
                settings.top_k,
                settings.lookback_hours,
                settings.max_attempts,
                settings.wait_timeout().as_secs_f64(),
            )
            .await
        }
        .instrument(span.clone())
        .await?;
        span.record("newsnack.targets", candidates.len() as i64);
        let mut targets = Targets::default();
        for (id, is_pending) in candidates {
            targets.all.push(id);
            if is_pending {
                targets.pending.push(id);
            } else {
                targets.failed.push(id);
            }
        }
        Ok(targets)
    }

    /// Claims the new targets, and the failed ones as an automatic retry
    /// would take them (attempts left, any `Retry-After` passed); returns
    /// the new ones it skipped. A failed one not due yet is claimed by a
    /// retry scheduler when it is, and the wait covers it all the same.
    async fn claim_targets(
        &self,
        pending: Vec<i64>,
        failed: Vec<i64>,
        settings: &Settings,
        record: &mut RunRecord,
    ) -> Result<Vec<i64>, PipelineError> {
        let mut stragglers = Vec::new();
        if !pending.is_empty() {
            stragglers = self
                .claim(pending, ClaimScope::Pending, settings, record)
                .await?;
        }
        if !failed.is_empty() {
            let retry = ClaimScope::RetryBelow(settings.max_attempts as i32);
            self.claim(failed, retry, settings, record).await?;
        }
        Ok(stragglers)
    }

    /// Claims `ids` and hands what it got to the generator; the ids it
    /// skipped, neither claimed nor `DONE`.
    async fn claim(
        &self,
        ids: Vec<i64>,
        scope: ClaimScope,
        settings: &Settings,
        record: &mut RunRecord,
    ) -> Result<Vec<i64>, PipelineError> {
        let mut outcome = self.claimer.claim(ids, settings.lease(), scope).await?;
        record.claimed.extend(outcome.claimed_ids());
        // The briefing's articles go first.
        self.generator
            .submit_at(std::mem::take(&mut outcome.claimed), Priority::Briefing)
            .await;
        let done = std::mem::take(&mut outcome.done);
        Ok(outcome
            .skipped
            .into_iter()
            .filter(|id| done.binary_search(id).is_err())
            .collect())
    }

    /// Claims again, with backoff, the new targets the first claim skipped
    /// (until the wait ends, which drops this future). A `PENDING` issue is
    /// skipped when another session holds its row lock: another system's
    /// UPDATE, say. Nothing else claims a new issue, so without this the
    /// wait would sit out its timeout on it. One claimed by someone else
    /// meanwhile is no longer `PENDING`: claiming it again takes nothing.
    async fn claim_stragglers(
        &self,
        mut ids: Vec<i64>,
        settings: &Settings,
        record: &mut RunRecord,
    ) -> std::convert::Infallible {
        let mut pause = STRAGGLER_PAUSES.0;
        loop {
            if ids.is_empty() {
                return std::future::pending().await;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(STRAGGLER_PAUSES.1);
            match self
                .claim(ids.clone(), ClaimScope::Pending, settings, record)
                .await
            {
                Ok(skipped) => {
                    if skipped.len() < ids.len() {
                        tracing::info!(
                            claimed = ids.len() - skipped.len(),
                            "claimed targets a first claim skipped"
                        );
                    }
                    ids = skipped;
                }
                Err(e) => tracing::warn!(error = %e, "cannot claim skipped targets yet"),
            }
        }
    }

    /// Publishes the briefing (when `publish`) and records the outcome (see
    /// [`Pipeline::record`]). A run cut short by the loss of its lock, or
    /// that would publish after it, is recorded as an `error` instead.
    async fn finish(
        &self,
        run_id: i64,
        mut record: RunRecord,
        publish: bool,
        lock: &LockHolder,
        settings: &Settings,
    ) -> Result<Option<RunSummary>, PipelineError> {
        if lock.is_lost() && record.outcome == "abandoned" {
            record.lock_lost();
        }
        let span = exported(|| {
            tracing::info_span!(
                "briefing",
                otel.kind = "internal",
                newsnack.publish = publish,
                newsnack.briefing_id = tracing::field::Empty,
            )
        });
        let recorded = async {
            match self
                .record(run_id, &mut record, publish.then_some(lock), settings)
                .await
            {
                Err(PipelineError::Db(e)) if publish => {
                    self.record_failure(run_id, &mut record, e, settings).await
                }
                recorded => recorded,
            }
        }
        .instrument(span.clone())
        .await;
        if let Some(briefing_id) = record.briefing_id {
            span.record("newsnack.briefing_id", briefing_id);
        }
        drop(span);
        if let Err(PipelineError::TakenOver) = recorded {
            tracing::warn!(run_id, "another instance took over this run after its pipeline lock was lost; nothing published");
        }
        recorded?;
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
            error: record.error,
        }))
    }

    /// After the last step failed with `error`: records the run as an
    /// `error` without the briefing, unless the step's commit landed after
    /// all and only its answer was lost (the connection broke while
    /// committing), in which case `record` is what was recorded. The
    /// failure's own write tells the two apart: it waits on the run's row
    /// for the step's transaction to end, and finds the run `running` only
    /// if that transaction did not commit.
    async fn record_failure(
        &self,
        run_id: i64,
        record: &mut RunRecord,
        error: DbError,
        settings: &Settings,
    ) -> Result<(), PipelineError> {
        let attempted = record.clone();
        record.outcome = "error".into();
        record.error = Some(error.to_string());
        record.briefing_id = None;
        match self.record(run_id, record, None, settings).await {
            Ok(()) => Err(error.into()),
            Err(PipelineError::TakenOver) if self.recorded_as(run_id, &attempted).await => {
                tracing::warn!(run_id, %error, "the run's last commit reported an error but was recorded");
                *record = attempted;
                Ok(())
            }
            Err(other) => Err(other),
        }
    }

    /// Whether the run's row holds `record`; false when that cannot be read.
    async fn recorded_as(&self, run_id: i64, record: &RunRecord) -> bool {
        match self.pool.get().await {
            Ok(client) => pipeline_run::recorded_as(&client, run_id, record)
                .await
                .unwrap_or(false),
            Err(_) => false,
        }
    }

    /// One transaction: the briefing of `record.completed` (when publishing
    /// under `lock`) and the run's outcome, committed only if the run is
    /// still `running`. The briefing goes in only if the server still sees
    /// the lock held by its session ([`LockHolder::still_holds`]), whether or not its
    /// loss was noticed here yet; a later holder's `abandon_stale` then waits for this
    /// transaction on the run's row, so the two runs never overlap in what
    /// they publish.
    async fn record(
        &self,
        run_id: i64,
        record: &mut RunRecord,
        publish_under: Option<&LockHolder>,
        settings: &Settings,
    ) -> Result<(), PipelineError> {
        let mut client = self.pool.get().await.map_err(DbError::from)?;
        let transaction = client.transaction().await.map_err(DbError::from)?;
        let mut publish = publish_under.is_some();
        if let Some(lock) = publish_under {
            if !lock.still_holds(&transaction).await? {
                record.lock_lost();
                publish = false;
            }
        }
        if publish {
            // Dated and titled as the settings the run started with (and
            // recorded) say.
            match assembly::assemble(&transaction, &record.completed, settings).await {
                Ok(assembled) => record.briefing_id = Some(assembled.briefing_id),
                Err(AssembleError::Db(e)) => return Err(e.into()),
                Err(e) => {
                    record.outcome = "error".into();
                    record.error = Some(e.to_string());
                }
            }
        }
        if !pipeline_run::finish(&transaction, run_id, record).await? {
            return Err(PipelineError::TakenOver);
        }
        transaction.commit().await.map_err(DbError::from)?;
        Ok(())
    }
}

/// The error recorded for a run whose pipeline lock was lost.
const LOCK_LOST: &str = "the pipeline lock was lost mid-run (its database session ended and \
                         it could not be taken again: another session held it, or the \
                         database stayed unreachable); stopped without a briefing";

impl RunRecord {
    /// Records the run as stopped by the loss of its lock: an error, and
    /// no briefing.
    fn lock_lost(&mut self) {
        self.outcome = "error".into();
        self.error = Some(LOCK_LOST.into());
        self.briefing_id = None;
    }
}

/// The issues a run selected.
#[derive(Default)]
struct Targets {
    /// All of them, hottest first: the briefing's reading order.
    all: Vec<i64>,
    /// The new ones (`PENDING`).
    pending: Vec<i64>,
    /// The ones to retry (`FAILED`).
    failed: Vec<i64>,
}

/// Fills in `record` from how the wait over `targets` ended; true when a
/// briefing of `record.completed` is to be published.
fn record_wait(
    record: &mut RunRecord,
    targets: &[i64],
    waited: Result<WaitReport, WaitError>,
) -> bool {
    // In target order (hottest first).
    record
        .claimed
        .sort_by_key(|id| targets.iter().position(|t| t == id));
    let report = match waited {
        Ok(report) => report,
        Err(e) => {
            record.outcome = if matches!(e, WaitError::ShuttingDown) {
                "abandoned"
            } else {
                "error"
            }
            .into();
            record.error = Some(e.to_string());
            return false;
        }
    };
    record.outcome = report.outcome.as_str().into();
    record.failed = report.failed;
    record.unfinished = report.unfinished;
    record.waited_ms = Some(report.waited_ms as i64);
    // Reading order: hottest first, as selected.
    record.completed = targets
        .iter()
        .copied()
        .filter(|id| report.completed.contains(id))
        .collect();
    if report.outcome == WaitOutcome::Skip {
        return false;
    }
    if record.completed.is_empty() {
        // Possible when the minimum is set to 0: the run passes with
        // nothing to put in a briefing.
        record.error = Some("no article completed: no briefing".into());
        return false;
    }
    true
}
