//! Retries as reactions of the state machine.
//!
//! The scheduler follows every transition (the service's own and other
//! systems'), feeds each into that issue's [`IssueMachine`], and acts on
//! the machine's reactions: when an issue enters `FAILED` with attempts
//! left, it schedules a retry after exponential backoff with jitter (or the
//! LLM's `Retry-After`, stored with the failure), then claims it through the
//! same `SKIP LOCKED` statement as everyone else. With several instances,
//! every one schedules the retry and exactly one wins the claim. Fatal
//! failures and exhausted issues stay `FAILED` until an operator resets them.
//!
//! A [`RetryScope`] says which failed issues are this scheduler's: every one
//! (a `serve` instance), or only those a one-shot run adds (`run-pipeline`:
//! its own targets; it must not spend its LLM slots on unrelated failures,
//! nor claim work it abandons when it exits).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::time::{delay_queue, DelayQueue};

use crate::claims::claim::Claimer;
use crate::db::issue::{self, ClaimScope};
use crate::db::{DbError, DbPool};
use crate::events::hub::EventHub;
use crate::generation::machine::{IssueMachine, Reaction};
use crate::generation::worker::GeneratorHandle;
use crate::model::status::Status;
use crate::model::transition::Transition;
use crate::settings::SettingsCache;

/// How soon an issue whose retry state could not be read is looked at again.
const RECHECK_AFTER_ERROR: Duration = Duration::from_secs(5);
/// The longest pause between searches for failed issues left over from
/// before this instance started, while they fail.
const MAX_LEFTOVERS_BACKOFF: Duration = Duration::from_secs(60);
/// The longest a retry timer is set for at a time.
const MAX_TIMER: Duration = Duration::from_secs(24 * 60 * 60);

/// Which failed issues a [`RetryScheduler`] retries (see the module docs).
/// Cheap to clone; clones share the set.
#[derive(Clone)]
pub struct RetryScope(Arc<watch::Sender<Option<BTreeSet<i64>>>>);

impl RetryScope {
    /// Every failed issue, whoever claimed it before.
    pub fn everything() -> RetryScope {
        RetryScope(Arc::new(watch::channel(None).0))
    }

    /// Only the issues [`RetryScope::add`] names; none to begin with.
    pub fn only_added() -> RetryScope {
        RetryScope(Arc::new(watch::channel(Some(BTreeSet::new())).0))
    }

    /// Brings `ids` into an [`RetryScope::only_added`] scope (no-op for
    /// [`RetryScope::everything`]).
    pub fn add(&self, ids: &[i64]) {
        self.0.send_if_modified(|scope| match scope {
            Some(set) => {
                let before = set.len();
                set.extend(ids);
                set.len() != before
            }
            None => false,
        });
    }

    fn includes(&self, id: i64) -> bool {
        self.0.borrow().as_ref().is_none_or(|set| set.contains(&id))
    }
}

/// The retry service of one instance.
pub struct RetryScheduler {
    pub hub: EventHub,
    pub pool: DbPool,
    pub claimer: Claimer,
    pub generator: GeneratorHandle,
    pub settings: Arc<SettingsCache>,
    pub scope: RetryScope,
}

struct State {
    machines: HashMap<i64, IssueMachine>,
    timers: DelayQueue<(i64, Due)>,
    pending: HashMap<i64, delay_queue::Key>,
}

/// What an issue's timer does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Due {
    /// Its backoff is over: claim the retry.
    Retry,
    /// Its retry state could not be read: read it again (and only then
    /// arm the backoff), rather than claim before the backoff is known.
    Recheck,
}

impl RetryScheduler {
    pub async fn run(self, shutdown: CancellationToken) {
        let mut stream = self
            .hub
            .stream_after(self.hub.status().borrow().last_seq, None);
        let mut state = State {
            machines: HashMap::new(),
            timers: DelayQueue::new(),
            pending: HashMap::new(),
        };
        // Failures may have happened while no instance was running. Until
        // that search succeeds, it is tried again with backoff.
        let mut leftovers_backoff = RECHECK_AFTER_ERROR;
        let mut leftovers_again = self
            .look_for_leftovers(&mut state, &mut leftovers_backoff)
            .await;
        // A raised `max_attempts` gives exhausted issues attempts again:
        // every settings change is followed by another search.
        let mut settings_changed = self.hub.settings_changed();
        settings_changed.borrow_and_update();
        // Issues brought into scope may have failed already.
        let mut scope_changed = self.scope.0.subscribe();
        scope_changed.borrow_and_update();
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                _ = async { leftovers_again.as_mut().expect("guarded").await }, if leftovers_again.is_some() => {
                    leftovers_again = self.look_for_leftovers(&mut state, &mut leftovers_backoff).await;
                }
                Ok(()) = settings_changed.changed() => {
                    leftovers_backoff = RECHECK_AFTER_ERROR;
                    leftovers_again = self.look_for_leftovers(&mut state, &mut leftovers_backoff).await;
                }
                Ok(()) = scope_changed.changed() => {
                    leftovers_backoff = RECHECK_AFTER_ERROR;
                    leftovers_again = self.look_for_leftovers(&mut state, &mut leftovers_backoff).await;
                }
                next = stream.next_through_outages() => match next {
                    Ok(t) => self.observe(&mut state, &t).await,
                    Err(e) => {
                        tracing::warn!(error = %e, "retry scheduler lost its transition stream");
                        return;
                    }
                },
                Some(expired) = state.timers.next(), if !state.timers.is_empty() => {
                    let (id, due) = expired.into_inner();
                    state.pending.remove(&id);
                    match due {
                        Due::Retry => self.retry(&mut state, id).await,
                        Due::Recheck => {
                            self.schedule(&mut state, id).await;
                            if !state.pending.contains_key(&id) {
                                state.machines.remove(&id);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Schedules the failed issues with attempts left that no transition
    /// has brought up yet; on an error, returns when to look again.
    async fn look_for_leftovers(
        &self,
        state: &mut State,
        backoff: &mut Duration,
    ) -> Option<std::pin::Pin<Box<tokio::time::Sleep>>> {
        let found = async {
            let max = self.settings.get().await?.max_attempts as i32;
            let client = self.pool.get().await.map_err(DbError::from)?;
            issue::failed_with_attempts_left(&client, max).await
        };
        match found.await {
            Ok(ids) => {
                for id in ids {
                    if self.scope.includes(id) && !state.pending.contains_key(&id) {
                        state.machines.insert(id, IssueMachine::at(Status::Failed));
                        self.schedule(state, id).await;
                    }
                }
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?*backoff, "cannot look for failed issues to retry; will look again");
                let again = Box::pin(tokio::time::sleep(*backoff));
                *backoff = (*backoff * 2).min(MAX_LEFTOVERS_BACKOFF);
                Some(again)
            }
        }
    }

    /// Feeds one transition to its issue's machine and carries out the
    /// reaction. A machine is kept only while a retry of its issue is
    /// pending; otherwise the next transition's `from` rebuilds it, so the
    /// scheduler's memory follows the retries due, not every issue seen.
    async fn observe(&self, state: &mut State, t: &Transition) {
        let id = t.issue_id;
        let mut machine = state
            .machines
            .remove(&id)
            .unwrap_or_else(|| IssueMachine::at(t.from.unwrap_or(Status::Pending)));
        let reaction = match machine.observe(t.to) {
            Ok(reaction) => reaction,
            Err(illegal) => {
                // Only possible if this machine started from a stale view;
                // the log is the truth, so follow it.
                tracing::warn!(issue = id, %illegal, "resynchronising the issue's machine");
                machine = IssueMachine::at(t.to);
                None
            }
        };
        state.machines.insert(id, machine);
        match reaction {
            Some(Reaction::ConsiderRetry) => self.schedule(state, id).await,
            Some(Reaction::WorkStarted | Reaction::BecameClaimable | Reaction::Finished) => {
                // Claimed by someone, reset, or done: no retry is due now.
                if let Some(key) = state.pending.remove(&id) {
                    state.timers.remove(&key);
                }
            }
            None => {}
        }
        if !state.pending.contains_key(&id) {
            state.machines.remove(&id);
        }
    }

    /// Schedules a retry of a `FAILED` issue if it has attempts left. When
    /// the database cannot say, it asks again after [`RECHECK_AFTER_ERROR`]
    /// rather than forget the issue.
    async fn schedule(&self, state: &mut State, id: i64) {
        if !self.scope.includes(id) {
            return;
        }
        let decided = async {
            let settings = self.settings.get().await?;
            let client = self.pool.get().await?;
            let found = issue::retry_state(&client, &[id]).await?;
            Ok::<_, DbError>((settings, found.into_iter().next()))
        };
        let (settings, found) = match decided.await {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(issue = id, error = %e, retry_in = ?RECHECK_AFTER_ERROR, "cannot read the issue's retry state; will look again");
                self.arm(state, id, RECHECK_AFTER_ERROR, Due::Recheck);
                return;
            }
        };
        let Some(issue) = found.filter(|i| i.status == Status::Failed) else {
            return;
        };
        if issue.never || issue.attempts as i64 >= settings.max_attempts {
            tracing::info!(
                issue = id,
                attempts = issue.attempts,
                fatal = issue.never,
                "no retry left; stays FAILED until reset"
            );
            state.machines.remove(&id);
            return;
        }
        // `not_due_for` is measured on the database's clock, which decides
        // whether the retry claim may take the issue.
        let delay = settings
            .retry_delay(issue.attempts)
            .max(issue.not_due_for.unwrap_or_default());
        tracing::debug!(
            issue = id,
            attempts = issue.attempts,
            ?delay,
            "retry scheduled"
        );
        self.arm(state, id, delay, Due::Retry);
    }

    /// (Re)sets the issue's retry timer. A far-off `Retry-After` (or a
    /// `retry_not_before` written by hand) waits at most [`MAX_TIMER`] at a
    /// time: the claim then finds the issue not yet due and it is scheduled
    /// again.
    fn arm(&self, state: &mut State, id: i64, delay: Duration, due: Due) {
        if let Some(key) = state.pending.remove(&id) {
            state.timers.remove(&key);
        }
        let key = state.timers.insert((id, due), delay.min(MAX_TIMER));
        state.pending.insert(id, key);
        state
            .machines
            .entry(id)
            .or_insert_with(|| IssueMachine::at(Status::Failed));
    }

    /// Claims a due retry; whoever wins generates it. A claim that takes
    /// nothing (another instance won it, or the issue is not due yet by the
    /// database's clock, or its row was locked at that moment) or fails
    /// re-reads the issue and schedules it again if it still waits for a
    /// retry.
    async fn retry(&self, state: &mut State, id: i64) {
        let attempt = async {
            let settings = self.settings.get().await?;
            self.claimer
                .claim(
                    vec![id],
                    settings.lease(),
                    ClaimScope::RetryBelow(settings.max_attempts as i32),
                )
                .await
        };
        match attempt.await {
            Ok(outcome) if !outcome.claimed.is_empty() => {
                tracing::info!(
                    issue = id,
                    attempt = outcome.claimed[0].attempts,
                    "retrying"
                );
                self.generator.submit(outcome.claimed).await;
            }
            Ok(_) => {
                tracing::debug!(
                    issue = id,
                    "retry not claimed here (taken elsewhere, not due, or locked)"
                );
                self.schedule(state, id).await;
            }
            Err(e) => {
                tracing::warn!(issue = id, error = %e, "retry claim failed");
                self.schedule(state, id).await;
            }
        }
        if !state.pending.contains_key(&id) {
            state.machines.remove(&id);
        }
    }
}
