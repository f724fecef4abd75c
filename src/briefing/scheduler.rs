//! The scheduler: starts a pipeline run at every tick of the `schedule`
//! setting.
//!
//! Every `serve` instance runs one. At a tick each tries the pipeline lock;
//! the one that gets it runs, the others skip, and `pipeline_run`'s
//! one-run-per-tick index makes a late instance skip a tick that already
//! ran. A tick that no instance recorded a run for is tried again while it
//! is fresh. A new schedule or time zone, announced by the settings
//! listener, moves the next tick at once.

use std::time::Duration;

use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;

use crate::briefing::run::{Pipeline, PipelineError, Trigger};
use crate::db::{pipeline_run, DbError};
use crate::settings::schedule::Schedule;

/// How late an armed tick may still run (after a long database outage, the
/// next tick is the one that counts).
const ARMED_TICK_GRACE: time::Duration = time::Duration::minutes(1);

/// How soon the scheduler reads its settings again after a failed read.
const SETTINGS_RETRY: Duration = Duration::from_secs(5);

/// How soon a tick with no recorded run is tried again (within
/// [`ARMED_TICK_GRACE`]).
const TICK_RETRY: Duration = Duration::from_secs(3);

/// A tick waited for, with the schedule it came from (its text and time
/// zone), until it runs.
type Armed = (String, OffsetDateTime);

/// Runs the pipeline at every tick of the `schedule` setting.
pub struct PipelineScheduler {
    pub pipeline: Pipeline,
}

impl PipelineScheduler {
    pub async fn run(self, shutdown: CancellationToken) {
        let mut changes = self.pipeline.hub.settings_changed();
        let mut armed: Option<Armed> = None;
        loop {
            changes.borrow_and_update();
            armed = match self.next_tick(armed.as_ref()).await {
                Ok(next) => next,
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?SETTINGS_RETRY, "cannot read the schedule; will try again");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(SETTINGS_RETRY) => continue,
                    }
                }
            };
            let Some((_, tick)) = armed else {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    Ok(()) = changes.changed() => continue,
                }
            };
            let wait = (tick - OffsetDateTime::now_utc()).max(time::Duration::ZERO);
            let sleep = tokio::time::sleep(Duration::try_from(wait).unwrap_or_default());
            tokio::select! {
                _ = shutdown.cancelled() => return,
                // A new schedule may move the next tick.
                Ok(()) = changes.changed() => continue,
                _ = sleep => {}
            }
            crate::metrics::pipeline_tick(tick);
            if self.run_tick(tick, &shutdown).await {
                armed = None;
                continue;
            }
            // No run of this tick is recorded: the instance that held the
            // lock may have failed before recording one (a pool timeout,
            // a database blip), or this one did. The tick stays armed and
            // is tried again while it is fresh; whoever records its run
            // first runs it, the others then find it recorded.
            tokio::select! {
                _ = shutdown.cancelled() => return,
                Ok(()) = changes.changed() => {}
                _ = tokio::time::sleep(TICK_RETRY) => {}
            }
        }
    }

    /// The tick to wait for next, from the current settings (see
    /// [`tick_to_arm`]); `Ok(None)` while the schedule or time zone is
    /// invalid.
    async fn next_tick(&self, armed: Option<&Armed>) -> Result<Option<Armed>, DbError> {
        let settings = self.pipeline.settings.get().await?;
        // The armed tick belongs to the schedule on its clock: a new
        // time zone moves it as a new schedule does.
        let schedule_text = format!("{} ({})", settings.schedule, settings.timezone);
        let next = match (settings.schedule.parse::<Schedule>(), settings.time_zone()) {
            (Ok(schedule), Ok(zone)) => tick_to_arm(
                armed,
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
        Ok(next.map(|tick| (schedule_text, tick)))
    }

    /// Runs `tick` here if this instance gets the lock; whether a run of
    /// the tick is recorded (here or elsewhere) afterwards.
    async fn run_tick(&self, tick: OffsetDateTime, shutdown: &CancellationToken) -> bool {
        match self
            .pipeline
            .run_locked(Trigger::Schedule(tick), shutdown)
            .await
        {
            Ok(Some(summary)) => {
                tracing::info!(run_id = summary.run_id, outcome = %summary.outcome, "scheduled run done");
                true
            }
            Ok(None) => true,
            Err(PipelineError::Busy) => {
                // Another instance runs this tick, or a run (an earlier
                // tick's, or a manual one) is still in progress.
                tracing::info!(%tick, "the pipeline lock is held elsewhere; not running this tick here");
                self.tick_recorded(tick).await
            }
            Err(e) => {
                tracing::warn!(error = %e, "scheduled run failed");
                self.tick_recorded(tick).await
            }
        }
    }

    /// Whether `tick` has a recorded run; a failed read counts as no.
    async fn tick_recorded(&self, tick: OffsetDateTime) -> bool {
        let recorded = async {
            let client = self.pipeline.pool.get().await?;
            pipeline_run::tick_has_run(&client, tick).await
        };
        recorded.await.unwrap_or(false)
    }
}

/// The tick to wait for: the one already armed while the schedule is
/// unchanged, even if it has just passed (a change announced shortly before
/// it, a listener reconnect say, and a slow re-read of the settings must
/// not lose it: it runs at once, and the one-run-per-tick record keeps it to
/// one run) and at most [`ARMED_TICK_GRACE`] ago; otherwise the schedule's
/// first tick after `now`.
fn tick_to_arm(
    armed: Option<&Armed>,
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
