//! The daily pipeline and its scheduler.
//!
//! One run is the original DAG's steps: `select_target_issues` (the `top_k` hottest
//! issues collected within `lookback_hours` that are not `DONE`) →
//! `check_generation_needed` (claim the `PENDING`/`FAILED` ones; those in
//! progress elsewhere are simply waited for) → generate → smart wait →
//! assemble the briefing from exactly the ids the wait returned. Every run
//! is recorded in `pipeline_run`; a `skip` publishes no briefing.
//!
//! Exactly one run at a time, cluster-wide: a run holds the `pipeline`
//! advisory lock on a connection of its own for its whole length, released
//! on every exit path; if that session ends, the run takes the lock again,
//! or stops at once when another session took it ([`keep_lock`]). The
//! scheduler in each `serve` instance wakes at every tick of the `schedule`
//! setting and tries the lock; the one that gets it runs, the others skip,
//! and `pipeline_run`'s one-run-per-tick index makes a late instance skip a
//! tick that already ran.

use std::sync::Arc;
use std::time::Duration;

use time::OffsetDateTime;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::briefing::assembly::{self, AssembleError};
use crate::briefing::wait::{self, WaitError, WaitOutcome, WaitRequest};
use crate::claims::claim::Claimer;
use crate::db::advisory::{self, AdvisoryLock};
use crate::db::issue::ClaimScope;
use crate::db::pipeline_run::{self, RunRecord};
use crate::db::{DbError, DbPool};
use crate::events::hub::EventHub;
use crate::generation::retry::RetryScope;
use crate::generation::worker::GeneratorHandle;
use crate::model::llm::Priority;
use crate::settings::schedule::Schedule;
use crate::settings::{Settings, SettingsCache};

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
    /// The lock is kept for the whole run (see [`keep_lock`]): should its
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
        let Some(lock) =
            AdvisoryLock::try_acquire(&self.direct, advisory::PIPELINE, &self.instance).await?
        else {
            return Err(PipelineError::Busy);
        };
        let _held = crate::metrics::advisory_lock_held(advisory::name_of(lock.key()));
        let (holder_tx, holder) = watch::channel(Some(lock.pid()));
        let stop = cancel.child_token();
        let done = CancellationToken::new();
        // The keeper owns the lock and releases it once `done`, which is
        // cancelled on every exit, this future being dropped mid-run included.
        let _finished = done.clone().drop_guard();
        let keeper = tokio::spawn(keep_lock(
            lock,
            self.direct.clone(),
            self.instance.clone(),
            holder_tx,
            stop.clone(),
            done.clone(),
        ));
        // A scheduled run's tick passes with it, so at a shutdown it
        // decides on what is done rather than being abandoned; a manual
        // run stopped by its operator is abandoned.
        let decide_now = matches!(trigger, Trigger::Schedule(_)).then_some(cancel);
        let result = self.run(trigger, &stop, decide_now, &holder).await;
        done.cancel();
        let _ = keeper.await;
        result
    }

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
        let mut record = RunRecord::default();
        match self
            .carry_out(run_id, &settings, stop, decide_now, &mut record)
            .await
        {
            Ok(publish) => self.finish(run_id, record, publish, lock, &settings).await,
            Err(e) => {
                // A run that started is always finished, so it never stays
                // `running` until another instance calls it abandoned.
                record.outcome = "error".into();
                record.error = Some(e.to_string());
                if let Err(unrecorded) = self.finish(run_id, record, false, lock, &settings).await {
                    tracing::warn!(run_id, error = %unrecorded, "could not record the failed run");
                }
                Err(e)
            }
        }
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
        let client = self.pool.get().await.map_err(DbError::from)?;
        let candidates = pipeline_run::select_targets(
            &client,
            settings.top_k,
            settings.lookback_hours,
            settings.max_attempts,
            settings.wait_timeout().as_secs_f64(),
        )
        .await?;
        drop(client);
        let targets: Vec<i64> = candidates.iter().map(|&(id, _)| id).collect();
        let (mut pending, mut failed) = (Vec::new(), Vec::new());
        for &(id, is_pending) in &candidates {
            if is_pending {
                pending.push(id);
            } else {
                failed.push(id);
            }
        }
        tracing::info!(run_id, ?targets, "pipeline run started");
        record.targets = targets.clone();
        self.retry_scope.add(&targets);
        if targets.is_empty() {
            record.outcome = WaitOutcome::Skip.as_str().into();
            record.error = Some("no candidate issues".into());
            return Ok(false);
        }

        // New issues, and failed ones as an automatic retry would take them
        // (attempts left, any `Retry-After` passed); a failed one not due
        // yet is claimed by a retry scheduler when it is, and the wait
        // covers it all the same.
        let mut stragglers = Vec::new();
        for (ids, scope) in [
            (pending, ClaimScope::Pending),
            (failed, ClaimScope::RetryBelow(settings.max_attempts as i32)),
        ] {
            if ids.is_empty() {
                continue;
            }
            let skipped = self.claim(ids, scope, settings, record).await?;
            if scope == ClaimScope::Pending {
                stragglers = skipped;
            }
        }

        let request = WaitRequest {
            issue_ids: targets.clone(),
            timeout: settings.wait_timeout(),
            min_completion: settings.content_gen_min_completion.max(0) as usize,
            max_attempts: settings.max_attempts as i32,
        };
        let waited = tokio::select! {
            biased;
            waited = wait::smart_wait_deciding_early(&self.hub, request, decide_now, stop) => waited,
            never = self.claim_stragglers(stragglers, settings, record) => match never {},
        };
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
        if lock.borrow().is_none() && record.outcome == "abandoned" {
            record.lock_lost();
        }
        let recorded = match self
            .record(run_id, &mut record, publish.then_some(lock), settings)
            .await
        {
            Err(PipelineError::Db(e)) if publish => {
                self.record_failure(run_id, &mut record, e, settings).await
            }
            recorded => recorded,
        };
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
    /// the lock held by its session ([`still_holds`]), whether or not its
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
            if !still_holds(&transaction, lock).await? {
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
    fn lock_lost(&mut self) {
        self.outcome = "error".into();
        self.error = Some(LOCK_LOST.into());
        self.briefing_id = None;
    }
}

/// Whether the run still holds its lock, as the server sees it. When the
/// server no longer sees the lock's session holding it, waits (bounded) for
/// the keeper's verdict: the lock taken again, or lost for good.
async fn still_holds(client: &impl crate::db::Sql, lock: &LockHolder) -> Result<bool, DbError> {
    let mut lock = lock.clone();
    let deadline = tokio::time::Instant::now() + VERDICT_WAIT;
    loop {
        let Some(pid) = *lock.borrow_and_update() else {
            return Ok(false);
        };
        if advisory::held_by(client, advisory::PIPELINE, pid).await? {
            return Ok(true);
        }
        match tokio::time::timeout_at(deadline, lock.changed()).await {
            Ok(Ok(())) => continue,
            _ => return Ok(false),
        }
    }
}

/// The pipeline lock as a run sees it: the backend pid of the session
/// holding it, or `None` once it is lost for good.
type LockHolder = watch::Receiver<Option<i32>>;

/// How often the lock's session is pinged, so that an idle-session timeout
/// or a dead connection is found during a long wait.
const LOCK_PING: Duration = Duration::from_secs(10);
/// How long taking the lock again waits for its holder: the ended session
/// may still be letting go of it. Held longer than this, it is another's.
const RETAKE_WAIT: Duration = Duration::from_secs(2);
/// How many times, a second apart, a lost lock is taken again while the
/// database cannot be reached (e.g. during a failover).
const RETAKE_ATTEMPTS: u32 = 5;
/// How long the last step waits for the keeper's verdict on a lock whose
/// session the server no longer sees (taken again, or lost for good).
const VERDICT_WAIT: Duration = Duration::from_secs(20);

/// Holds the run's lock until `done`: pings its session, and if that
/// session ends (an idle timeout, `pg_terminate_backend`, a failover),
/// takes the lock again on a new one, so the run and its tick are not lost.
/// If another session took the lock meanwhile, or the database stays
/// unreachable, the lock is lost for good: `holder` says so and `stop` ends
/// the run.
async fn keep_lock(
    mut lock: AdvisoryLock,
    direct: crate::db::Endpoint,
    instance: String,
    holder: watch::Sender<Option<i32>>,
    stop: CancellationToken,
    done: CancellationToken,
) {
    loop {
        let session_ended = lock.lost();
        let alive = tokio::select! {
            _ = done.cancelled() => {
                lock.release().await;
                return;
            }
            _ = session_ended.cancelled() => false,
            _ = tokio::time::sleep(LOCK_PING) => true,
        };
        let alive = alive && {
            tokio::select! {
                _ = done.cancelled() => {
                    lock.release().await;
                    return;
                }
                held = lock.is_held() => held,
            }
        };
        if alive {
            continue;
        }
        drop(lock);
        let retaken = tokio::select! {
            _ = done.cancelled() => return,
            retaken = retake(&direct, &instance) => retaken,
        };
        match retaken {
            Some(again) => {
                tracing::warn!(
                    pid = again.pid(),
                    "the pipeline lock's session ended; took the lock again on a new session"
                );
                holder.send_replace(Some(again.pid()));
                lock = again;
            }
            None => {
                tracing::warn!("the pipeline lock's session ended and the lock could not be taken again; stopping the run");
                holder.send_replace(None);
                stop.cancel();
                return;
            }
        }
    }
}

/// Takes the pipeline lock on a new session; `None` when another session
/// holds it or the database stays unreachable.
async fn retake(direct: &crate::db::Endpoint, instance: &str) -> Option<AdvisoryLock> {
    for attempt in 1..=RETAKE_ATTEMPTS {
        match AdvisoryLock::acquire_within(direct, advisory::PIPELINE, instance, RETAKE_WAIT).await
        {
            Ok(taken) => return taken,
            Err(e) => {
                tracing::debug!(attempt, error = %e, "cannot take the pipeline lock again yet");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    None
}

/// The tick to wait for: the one already armed while the schedule is
/// unchanged, even if it has just passed (a change announced shortly before
/// it, a listener reconnect say, and a slow re-read of the settings must
/// not lose it: it runs at once, and the one-run-per-tick record keeps it to
/// one run) and at most [`ARMED_TICK_GRACE`] ago; otherwise the schedule's
/// first tick after `now`.
fn tick_to_arm(
    armed: Option<&(String, OffsetDateTime)>,
    schedule_text: &str,
    schedule: &Schedule,
    zone: chrono_tz::Tz,
    now: OffsetDateTime,
) -> Option<OffsetDateTime> {
    match armed {
        Some((armed_text, tick))
            if armed_text == schedule_text && now - *tick < ARMED_TICK_GRACE =>
        {
            Some(*tick)
        }
        _ => schedule.next_tick(now, zone),
    }
}

/// How late an armed tick may still run (after a long database outage, the
/// next tick is the one that counts).
const ARMED_TICK_GRACE: time::Duration = time::Duration::minutes(1);

/// How soon the scheduler reads its settings again after a failed read.
const SETTINGS_RETRY: std::time::Duration = std::time::Duration::from_secs(5);

/// How soon a tick with no recorded run is tried again (within
/// [`ARMED_TICK_GRACE`]).
const TICK_RETRY: std::time::Duration = std::time::Duration::from_secs(3);

/// Runs the pipeline at every tick of the `schedule` setting.
pub struct PipelineScheduler {
    pub pipeline: Pipeline,
}

impl PipelineScheduler {
    /// Whether `tick` has a recorded run; a failed read counts as no.
    async fn tick_recorded(&self, tick: OffsetDateTime) -> bool {
        let recorded = async {
            let client = self.pipeline.pool.get().await?;
            pipeline_run::tick_has_run(&client, tick).await
        };
        recorded.await.unwrap_or(false)
    }

    pub async fn run(self, shutdown: CancellationToken) {
        let mut changes = self.pipeline.hub.settings_changed();
        // The tick waited for, with the schedule it came from, until it runs.
        let mut armed: Option<(String, OffsetDateTime)> = None;
        loop {
            changes.borrow_and_update();
            let settings = match self.pipeline.settings.get().await {
                Ok(settings) => settings,
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?SETTINGS_RETRY, "cannot read the schedule; will try again");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(SETTINGS_RETRY) => continue,
                    }
                }
            };
            // The armed tick belongs to the schedule on its clock: a new
            // time zone moves it as a new schedule does.
            let schedule_text = format!("{} ({})", settings.schedule, settings.timezone);
            let next = match (settings.schedule.parse::<Schedule>(), settings.time_zone()) {
                (Ok(schedule), Ok(zone)) => tick_to_arm(
                    armed.as_ref(),
                    &schedule_text,
                    &schedule,
                    zone,
                    OffsetDateTime::now_utc(),
                ),
                (Err(e), _) => {
                    tracing::error!(error = %e, "the schedule setting is invalid; scheduler idle until it changes");
                    None
                }
                (_, Err(e)) => {
                    tracing::error!(error = %e, "scheduler idle until the timezone setting changes");
                    None
                }
            };
            armed = next.map(|tick| (schedule_text.clone(), tick));
            let Some(tick) = next else {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    Ok(()) = changes.changed() => continue,
                }
            };
            let wait = (tick - OffsetDateTime::now_utc()).max(time::Duration::ZERO);
            let sleep = tokio::time::sleep(std::time::Duration::try_from(wait).unwrap_or_default());
            tokio::select! {
                _ = shutdown.cancelled() => return,
                // A new schedule may move the next tick.
                Ok(()) = changes.changed() => continue,
                _ = sleep => {}
            }
            armed = None;
            let unrecorded = match self
                .pipeline
                .run_locked(Trigger::Schedule(tick), &shutdown)
                .await
            {
                Ok(Some(summary)) => {
                    tracing::info!(run_id = summary.run_id, outcome = %summary.outcome, "scheduled run done");
                    false
                }
                Ok(None) => false,
                Err(PipelineError::Busy) => {
                    // Another instance runs this tick, or a run (an earlier
                    // tick's, or a manual one) is still in progress.
                    tracing::info!(%tick, "the pipeline lock is held elsewhere; not running this tick here");
                    !self.tick_recorded(tick).await
                }
                Err(e) => {
                    tracing::warn!(error = %e, "scheduled run failed");
                    !self.tick_recorded(tick).await
                }
            };
            // No run of this tick is recorded: the instance that held the
            // lock may have failed before recording one (a pool timeout,
            // a database blip), or this one did. The tick stays armed and
            // is tried again while it is fresh; whoever records its run
            // first runs it, the others then find it recorded.
            if unrecorded {
                armed = Some((schedule_text, tick));
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    Ok(()) = changes.changed() => {}
                    _ = tokio::time::sleep(TICK_RETRY) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    #[test]
    fn a_tick_armed_before_a_slow_settings_read_is_not_lost() {
        let text = "0 6 * * *";
        let utc = chrono_tz::UTC;
        let schedule: Schedule = text.parse().unwrap();
        let tick = datetime!(2026-11-30 06:00:00 UTC);
        let armed = (text.to_string(), tick);
        // A change was announced at 05:59:59.8; the re-read ends at 06:00:00.1.
        let after = datetime!(2026-11-30 06:00:00.1 UTC);
        assert_eq!(
            tick_to_arm(Some(&armed), text, &schedule, utc, after),
            Some(tick)
        );
        // A new schedule counts from now.
        let hourly: Schedule = "0 * * * *".parse().unwrap();
        assert_eq!(
            tick_to_arm(Some(&armed), "0 * * * *", &hourly, utc, after),
            Some(datetime!(2026-11-30 07:00:00 UTC))
        );
        // Armed long ago (a day-long outage of the settings reads): the
        // next tick counts, not a run many hours late.
        let next_day = datetime!(2026-12-01 05:00:00 UTC);
        assert_eq!(
            tick_to_arm(Some(&armed), text, &schedule, utc, next_day),
            Some(datetime!(2026-12-01 06:00:00 UTC))
        );
        // Nothing armed: the next tick after now.
        assert_eq!(
            tick_to_arm(None, text, &schedule, utc, after),
            Some(datetime!(2026-12-01 06:00:00 UTC))
        );
    }
}
