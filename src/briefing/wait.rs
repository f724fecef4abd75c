//! The smart wait: resolves the moment the deciding transition commits.
//!
//! ```text
//!                    ┌──────────────────────────────┐
//!   Progress         │           Waiting            │
//!   (every target    └──────────────────────────────┘
//!    DONE)     ──────▶ AllPass       │          │
//!                                    │ Deadline │ Progress, settled
//!                                    │          │ (no target can change)
//!                        done ≥ min  ▼          ▼  done < min
//!                              TimeoutPass     Skip
//! ```
//!
//! `all_pass` as soon as every target is `DONE`; at the deadline
//! `timeout_pass` if at least `min_completion` are `DONE`, else `skip`; and
//! the same rule early once no target can still change (each is `DONE` or
//! `FAILED` with no automatic retry left).
//!
//! It opens a watch on its targets first, then reads their state and the
//! log position in one snapshot, so no transition can fall between; from
//! then on it only takes in what the publisher routes to the watch (the
//! NOTIFY payload carries attempts and whether a failure is fatal), never
//! polling. Only the targets' transitions reach it, the newest of each, so
//! it cannot fall behind however busy the log is; the listener catches up
//! from the log across reconnects, so nothing is missed. Any number of
//! waits share the process's one listener.
//!
//! Each target's state carries the `seq` it is as of (a snapshot's log
//! position, or the transition's own), and newer replaces older, whichever
//! way it came.
//!
//! Two reads are bounded. The first snapshot gives up at the timeout (at
//! least [`LAST_LOOK_LIMIT`]), so a lock held on the table cannot hold a
//! wait past it. And at the deadline, before deciding, the wait reads its
//! targets once more (within [`LAST_LOOK_LIMIT`]): a listener that is behind
//! at that moment (reconnecting, or on a connection that has silently died
//! and is not yet found out) must not turn articles that are `DONE` into a
//! skip. A read that fails or is slow leaves the decision to what is known.
//! A wait that resolves before its deadline issues no query after its
//! first.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;
use statig::prelude::*;
use tokio_util::sync::CancellationToken;

use crate::db::{self, DbError, DbPool};
use crate::events::hub::EventHub;
use crate::events::issue_watch::{IssueWatch, ListenerStopped};
use crate::model::status::Status;
use crate::model::transition::Transition;

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WaitOutcome {
    AllPass,
    TimeoutPass,
    Skip,
}

impl WaitOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            WaitOutcome::AllPass => "all_pass",
            WaitOutcome::TimeoutPass => "timeout_pass",
            WaitOutcome::Skip => "skip",
        }
    }
}

/// What to wait for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitRequest {
    pub issue_ids: Vec<i64>,
    pub timeout: Duration,
    pub min_completion: usize,
    /// Attempts after which a `FAILED` target is final.
    pub max_attempts: i32,
}

/// The answer, as `POST /waits` and `newsnack wait` print it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct WaitReport {
    pub outcome: WaitOutcome,
    pub completed: Vec<i64>,
    pub failed: Vec<i64>,
    pub unfinished: Vec<i64>,
    pub waited_ms: u64,
}

/// Why a wait could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error("unknown issue ids: {0:?}")]
    UnknownIds(Vec<i64>),
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    ListenerStopped(#[from] ListenerStopped),
    #[error("the service is shutting down")]
    ShuttingDown,
}

/// Inputs of the outcome machine.
#[derive(Debug, Clone, Copy)]
pub enum WaitEvent {
    /// The targets' tally changed.
    Progress {
        done: usize,
        total: usize,
        settled: bool,
    },
    /// The timeout passed.
    Deadline { done: usize },
}

/// The outcome machine's storage: the pass threshold.
#[derive(Debug)]
pub struct Decision {
    min_completion: usize,
}

#[state_machine(
    initial = "State::waiting()",
    state(derive(Debug, Clone, Copy, PartialEq, Eq))
)]
impl Decision {
    #[state]
    fn waiting(&self, event: &WaitEvent) -> Outcome<State> {
        match *event {
            WaitEvent::Progress { done, total, .. } if done == total => {
                Transition(State::all_pass())
            }
            WaitEvent::Progress {
                done,
                settled: true,
                ..
            }
            | WaitEvent::Deadline { done } => {
                if done >= self.min_completion {
                    Transition(State::timeout_pass())
                } else {
                    Transition(State::skip())
                }
            }
            WaitEvent::Progress { .. } => Handled,
        }
    }

    #[state]
    fn all_pass(event: &WaitEvent) -> Outcome<State> {
        let _ = event;
        Handled
    }

    #[state]
    fn timeout_pass(event: &WaitEvent) -> Outcome<State> {
        let _ = event;
        Handled
    }

    #[state]
    fn skip(event: &WaitEvent) -> Outcome<State> {
        let _ = event;
        Handled
    }
}

impl State {
    fn outcome(self) -> Option<WaitOutcome> {
        match self {
            State::Waiting {} => None,
            State::AllPass {} => Some(WaitOutcome::AllPass),
            State::TimeoutPass {} => Some(WaitOutcome::TimeoutPass),
            State::Skip {} => Some(WaitOutcome::Skip),
        }
    }
}

/// The last known state of one target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Target {
    status: Status,
    attempts: i32,
    fatal: bool,
    /// The log position this state is as of.
    seq: i64,
}

impl Target {
    /// True when nothing will move it any more without an operator.
    fn is_final(&self, max_attempts: i32) -> bool {
        match self.status {
            Status::Done => true,
            Status::Failed => self.fatal || self.attempts >= max_attempts,
            Status::Pending | Status::InProgress => false,
        }
    }
}

/// The most the deadline's last look at the targets may take (and the
/// least the first snapshot is given).
pub const LAST_LOOK_LIMIT: Duration = Duration::from_secs(1);

/// A wait that is subscribed and has read its targets: nothing that happens
/// from here on can be missed. Resolve it with [`ArmedWait::outcome`].
pub struct ArmedWait {
    request: WaitRequest,
    targets: BTreeMap<i64, Target>,
    watch: IssueWatch,
    pool: DbPool,
    started: Instant,
    /// Counts the wait in `newsnack_waits_open` while it lives.
    _open: crate::metrics::GaugeGuard,
}

impl ArmedWait {
    /// Watches the targets, then reads them and the log position
    /// together, giving up at the timeout ([`DbError::TimedOut`]).
    pub async fn arm(hub: &EventHub, request: WaitRequest) -> Result<ArmedWait, WaitError> {
        let started = Instant::now();
        let watch = hub.watch_issues(&request.issue_ids);
        let limit = request.timeout.max(LAST_LOOK_LIMIT);
        let targets = read_targets(hub.pool(), &request.issue_ids, limit).await?;
        let mut armed = ArmedWait {
            watch,
            targets,
            pool: hub.pool().clone(),
            request,
            started,
            _open: crate::metrics::wait_open(),
        };
        armed.take_delivered();
        Ok(armed)
    }

    /// Waits for the outcome (or for `cancel`, which abandons the wait).
    pub async fn outcome(self, cancel: &CancellationToken) -> Result<WaitReport, WaitError> {
        self.resolve(None, cancel).await
    }

    /// [`ArmedWait::outcome`]; `decide_now`, once cancelled, brings the
    /// deadline forward: the wait decides at once on what is done by then,
    /// as at its timeout.
    async fn resolve(
        mut self,
        decide_now: Option<&CancellationToken>,
        cancel: &CancellationToken,
    ) -> Result<WaitReport, WaitError> {
        let early = async {
            match decide_now {
                Some(token) => token.cancelled().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(early);
        let mut decided_early = false;
        let mut decision = Decision {
            min_completion: self.request.min_completion,
        }
        .state_machine();
        let deadline = tokio::time::sleep_until((self.started + self.request.timeout).into());
        tokio::pin!(deadline);
        decision.handle(&self.progress());
        while decision.state().outcome().is_none() {
            tokio::select! {
                biased;
                _ = &mut early, if !decided_early => {
                    decided_early = true;
                    tracing::info!("deciding the wait now, before its deadline, on what is done");
                    Box::pin(self.last_look()).await;
                    decision.handle(&self.progress());
                    decision.handle(&WaitEvent::Deadline { done: self.done_count() });
                }
                _ = cancel.cancelled() => return Err(WaitError::ShuttingDown),
                delivered = self.watch.delivered() => {
                    delivered?;
                    if self.take_delivered() {
                        decision.handle(&self.progress());
                    }
                }
                _ = &mut deadline => {
                    Box::pin(self.last_look()).await;
                    decision.handle(&self.progress());
                    decision.handle(&WaitEvent::Deadline { done: self.done_count() });
                }
            }
        }
        let outcome = decision
            .state()
            .outcome()
            .expect("the loop ends on an outcome");
        crate::metrics::wait_decided(outcome.as_str(), self.started.elapsed());
        Ok(self.report(outcome))
    }

    /// Takes in what the watch holds; true if a target changed.
    fn take_delivered(&mut self) -> bool {
        let mut changed = false;
        for t in self.watch.take() {
            changed |= self.take_in(&t);
        }
        changed
    }

    /// Records a transition of one of the targets, unless what is known of
    /// it is as new; true if it was recorded.
    fn take_in(&mut self, t: &Transition) -> bool {
        match self.targets.get_mut(&t.issue_id) {
            Some(target) if t.seq > target.seq => {
                *target = Target {
                    status: t.to,
                    attempts: t.attempts,
                    fatal: t.fatal,
                    seq: t.seq,
                };
                true
            }
            _ => false,
        }
    }

    /// At the deadline: takes in what the watch holds, then reads the
    /// targets once (its future is boxed where it is awaited: inline, the
    /// read would make every open wait that much bigger), within [`LAST_LOOK_LIMIT`]; what the read says of a
    /// target replaces what is known when it is newer.
    async fn last_look(&mut self) {
        self.take_delivered();
        match read_targets(&self.pool, &self.request.issue_ids, LAST_LOOK_LIMIT).await {
            Ok(read) => {
                let mut behind = 0;
                for (id, now) in read {
                    let known = self.targets.get_mut(&id).expect("the same targets");
                    if now.seq > known.seq {
                        behind += usize::from(now.status != known.status);
                        *known = now;
                    }
                }
                if behind > 0 {
                    tracing::info!(
                        targets = behind,
                        "the listener was behind at the wait's deadline; deciding on the database's view"
                    );
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the wait's targets at its deadline; deciding on what the listener said")
            }
        }
    }

    fn done_count(&self) -> usize {
        self.targets
            .values()
            .filter(|t| t.status == Status::Done)
            .count()
    }

    fn progress(&self) -> WaitEvent {
        WaitEvent::Progress {
            done: self.done_count(),
            total: self.targets.len(),
            settled: self
                .targets
                .values()
                .all(|t| t.is_final(self.request.max_attempts)),
        }
    }

    fn report(&self, outcome: WaitOutcome) -> WaitReport {
        let pick = |wanted: &dyn Fn(Status) -> bool| -> Vec<i64> {
            self.targets
                .iter()
                .filter(|(_, t)| wanted(t.status))
                .map(|(&id, _)| id)
                .collect()
        };
        WaitReport {
            outcome,
            completed: pick(&|s| s == Status::Done),
            failed: pick(&|s| s == Status::Failed),
            unfinished: pick(&|s| matches!(s, Status::Pending | Status::InProgress)),
            waited_ms: self.started.elapsed().as_millis() as u64,
        }
    }
}

/// The time left until `deadline`, a wall-clock instant; zero once it has
/// passed, so that a wait given a past deadline decides at once, by the
/// deadline's rule, on what is done.
pub fn time_until(deadline: time::OffsetDateTime) -> Duration {
    Duration::try_from(deadline - time::OffsetDateTime::now_utc()).unwrap_or(Duration::ZERO)
}

/// Waits for `request` (see the module docs). `cancel` ends it at once,
/// also while its first read waits (behind a lock on the table, say).
pub async fn smart_wait(
    hub: &EventHub,
    request: WaitRequest,
    cancel: &CancellationToken,
) -> Result<WaitReport, WaitError> {
    smart_wait_deciding_early(hub, request, None, cancel).await
}

/// [`smart_wait`], except that once `decide_now` is cancelled (checked
/// before `cancel`), a wait that has read its targets decides at once by
/// the deadline's rule instead of being abandoned: a scheduled run stopped
/// by a shutdown still publishes what was done, if that is enough.
pub async fn smart_wait_deciding_early(
    hub: &EventHub,
    request: WaitRequest,
    decide_now: Option<&CancellationToken>,
    cancel: &CancellationToken,
) -> Result<WaitReport, WaitError> {
    let armed = tokio::select! {
        biased;
        _ = cancel.cancelled() => return Err(WaitError::ShuttingDown),
        armed = ArmedWait::arm(hub, request) => armed?,
    };
    armed.resolve(decide_now, cancel).await
}

/// The targets' state as of the log position, in one snapshot, within
/// `limit`.
async fn read_targets(
    pool: &DbPool,
    ids: &[i64],
    limit: Duration,
) -> Result<BTreeMap<i64, Target>, WaitError> {
    let wanted = ids.to_vec();
    let (rows, seq) = db::bounded(pool, limit, move |client| {
        Box::pin(async move { db::issue::wait_targets(client, &wanted).await })
    })
    .await?;
    let targets: BTreeMap<i64, Target> = rows
        .into_iter()
        .map(|r| {
            (
                r.id,
                Target {
                    status: r.status,
                    attempts: r.attempts,
                    fatal: r.never,
                    seq,
                },
            )
        })
        .collect();
    let unknown: Vec<i64> = ids
        .iter()
        .copied()
        .filter(|id| !targets.contains_key(id))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if !unknown.is_empty() {
        return Err(WaitError::UnknownIds(unknown));
    }
    Ok(targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decide(min: usize, events: &[WaitEvent]) -> Option<WaitOutcome> {
        let mut m = Decision {
            min_completion: min,
        }
        .state_machine();
        for e in events {
            m.handle(e);
        }
        m.state().outcome()
    }

    #[test]
    fn the_rules() {
        let p = |done, total, settled| WaitEvent::Progress {
            done,
            total,
            settled,
        };
        assert_eq!(decide(3, &[p(4, 5, false)]), None);
        assert_eq!(
            decide(3, &[p(4, 5, false), p(5, 5, true)]),
            Some(WaitOutcome::AllPass)
        );
        assert_eq!(
            decide(3, &[WaitEvent::Deadline { done: 3 }]),
            Some(WaitOutcome::TimeoutPass)
        );
        assert_eq!(
            decide(3, &[WaitEvent::Deadline { done: 2 }]),
            Some(WaitOutcome::Skip)
        );
        assert_eq!(decide(3, &[p(3, 5, true)]), Some(WaitOutcome::TimeoutPass));
        assert_eq!(decide(3, &[p(1, 5, true)]), Some(WaitOutcome::Skip));
        // Decided is decided: later events change nothing.
        assert_eq!(
            decide(3, &[p(1, 5, true), p(5, 5, true)]),
            Some(WaitOutcome::Skip)
        );
    }
}
