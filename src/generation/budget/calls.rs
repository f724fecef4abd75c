//! What generations ask of the agent ([`Request`]), and what the agent
//! knows of its process's calls: those still to queue, waiting, running
//! and ended, and what goes back to the budget in the next exchange; and
//! what held calls back while they waited ([`Delays`]), for their spans.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::db::llm_budget::{CallToQueue, ExchangeAnswer, Held, ProviderReport, Route};
use crate::model::llm::Priority;

/// What a claim's generation asks of the agent.
pub(super) enum Request {
    /// Queue a call; the grant is the call's id and where it goes.
    Queue {
        call: CallToQueue,
        granted: oneshot::Sender<(i64, Route)>,
    },
    /// The call of this claim (issue, claim id) is no longer wanted.
    Withdraw { claim: (i64, i64) },
    /// A granted call ended, having spent `tokens`; with a pause every
    /// instance should keep.
    Finished {
        id: i64,
        tokens: i64,
        pause: Option<(Duration, String)>,
        report: Option<ProviderReport>,
    },
    /// No call is granted here any more; the calls waiting are withdrawn.
    Close,
    /// Leave the budget, with every call, and stop.
    Leave { left: oneshot::Sender<()> },
}

/// A call queued here, waiting for its grant.
pub(super) struct Waiter {
    pub(super) call: CallToQueue,
    pub(super) granted: oneshot::Sender<(i64, Route)>,
}

/// What the agent knows of this process's calls.
#[derive(Default)]
pub(super) struct Calls {
    /// Not sent to the budget yet.
    pub(super) to_queue: Vec<Waiter>,
    /// In the budget, waiting, by call id.
    pub(super) waiting: HashMap<i64, Waiter>,
    /// Claim (issue, claim id) to call id, for the waiting ones.
    pub(super) by_claim: HashMap<(i64, i64), i64>,
    /// Granted and handed to their generation.
    pub(super) running: HashSet<i64>,
    /// Ended, or never to run: to give back.
    pub(super) finished: Vec<i64>,
    /// What the ended calls spent, to count to the day.
    pub(super) tokens: i64,
    /// How the ended calls went on their providers.
    pub(super) reports: Vec<ProviderReport>,
    /// A pause to report, the longest asked for.
    pub(super) pause: Option<(Duration, String)>,
    pub(super) closed: bool,
}

impl Calls {
    pub(super) fn take(&mut self, request: Request) -> Option<oneshot::Sender<()>> {
        match request {
            Request::Queue { call, granted } => {
                if !self.closed {
                    self.to_queue.push(Waiter { call, granted });
                }
            }
            Request::Withdraw { claim } => {
                self.to_queue
                    .retain(|w| (w.call.issue_id, w.call.claim_id) != claim);
                if let Some(id) = self.by_claim.remove(&claim) {
                    self.waiting.remove(&id);
                    self.finished.push(id);
                }
            }
            Request::Finished {
                id,
                tokens,
                pause,
                report,
            } => {
                self.reports.extend(report);
                if self.running.remove(&id) {
                    self.finished.push(id);
                }
                // Spent whether or not the budget still knew the call.
                self.tokens = self.tokens.saturating_add(tokens);
                if let Some((wait, reason)) = pause {
                    if self
                        .pause
                        .as_ref()
                        .is_none_or(|(longest, _)| wait > *longest)
                    {
                        self.pause = Some((wait, reason));
                    }
                }
            }
            Request::Close => {
                self.closed = true;
                self.to_queue.clear();
                self.by_claim.clear();
                self.finished.extend(self.waiting.drain().map(|(id, _)| id));
            }
            Request::Leave { left } => return Some(left),
        }
        None
    }

    /// Something to tell the budget.
    pub(super) fn has_news(&self) -> bool {
        !self.to_queue.is_empty()
            || !self.finished.is_empty()
            || self.tokens > 0
            || !self.reports.is_empty()
            || self.pause.is_some()
    }

    /// Holding anything in the budget: its lease must be kept.
    pub(super) fn holds_any(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Takes the budget's answer to an exchange that carried `sent`.
    pub(super) fn apply(&mut self, sent: Vec<Waiter>, answer: &ExchangeAnswer) {
        for (waiter, id) in sent.into_iter().zip(&answer.queued) {
            self.by_claim
                .insert((waiter.call.issue_id, waiter.call.claim_id), *id);
            self.waiting.insert(*id, waiter);
        }
        for (&id, &route) in answer.granted.iter().zip(&answer.routes) {
            if self.running.contains(&id) {
                continue;
            }
            match self.waiting.remove(&id) {
                Some(waiter) => {
                    self.by_claim
                        .remove(&(waiter.call.issue_id, waiter.call.claim_id));
                    if waiter.granted.send((id, route)).is_ok() {
                        self.running.insert(id);
                    } else {
                        self.finished.push(id);
                    }
                }
                // Not known here (its generation went away): given back.
                None => self.finished.push(id),
            }
        }
        let known = (self.waiting.len() + self.running.len() + self.finished.len()) as i64;
        if answer.holding < known {
            // This process's lease ran out (it was stalled, or the
            // database unreachable, for longer than a lease) and its calls
            // were taken back. The waiting ones queue again; those in
            // flight end unaccounted.
            tracing::warn!(
                held = answer.holding,
                known,
                "the LLM budget let this process's calls go (its lease ran out); queueing the waiting ones again"
            );
            self.running.clear();
            self.finished.clear();
            self.by_claim.clear();
            let mut requeued: Vec<(i64, Waiter)> = self.waiting.drain().collect();
            requeued.sort_by_key(|(id, _)| *id);
            self.to_queue
                .splice(0..0, requeued.into_iter().map(|(_, waiter)| waiter));
        }
    }
}

/// What holds calls back, as the agent last heard from the budget: a
/// pause of the primary's calls, a day whose tokens are spent. The agent
/// writes it after every exchange; a waiting call compares it at its
/// grant with what it was when it queued ([`WaitDelays`]).
#[derive(Debug, Default)]
pub(super) struct Delays {
    /// Exchanges answered with a pause in force / a held day (either
    /// kind) / every call held.
    paused: AtomicU64,
    held: AtomicU64,
    held_all: AtomicU64,
    /// In force at the last answer: 1 paused, 2 feed held, 4 all held.
    now: AtomicU8,
}

impl Delays {
    /// The budget answered with `paused` in force and `held` the day's
    /// hold.
    pub(super) fn heard(&self, paused: bool, held: Option<Held>) {
        let count = |counter: &AtomicU64, yes: bool| {
            if yes {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        };
        count(&self.paused, paused);
        count(&self.held, held.is_some());
        count(&self.held_all, held == Some(Held::All));
        let now = u8::from(paused)
            | match held {
                None => 0,
                Some(Held::Feed) => 2,
                Some(Held::All) => 4,
            };
        self.now.store(now, Ordering::Relaxed);
    }

    pub(super) fn seen(&self) -> [u64; 4] {
        [
            self.paused.load(Ordering::Relaxed),
            self.held.load(Ordering::Relaxed),
            self.held_all.load(Ordering::Relaxed),
            u64::from(self.now.load(Ordering::Relaxed)),
        ]
    }
}

/// What held one call back while it waited for its grant: a pause of the
/// primary's calls, a day's token budget holding its class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WaitDelays {
    pub paused: bool,
    pub day_held: bool,
}

impl WaitDelays {
    /// From what [`Delays`] said when the call queued (`before`) and at its
    /// grant (`after`), for a call of `class`.
    pub(super) fn between(before: [u64; 4], after: [u64; 4], class: Priority) -> WaitDelays {
        let [paused, held, held_all, now] = before;
        let held_class = match class {
            Priority::Feed => now & 6 != 0 || after[1] > held,
            Priority::Briefing => now & 4 != 0 || after[2] > held_all,
        };
        WaitDelays {
            paused: now & 1 != 0 || after[0] > paused,
            day_held: held_class,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_is_delayed_by_what_was_in_force_when_it_queued_or_heard_since() {
        let delays = Delays::default();
        let before = delays.seen();
        let none = WaitDelays::default();
        assert_eq!(WaitDelays::between(before, before, Priority::Feed), none);
        // A feed hold delays feed calls only.
        delays.heard(false, Some(Held::Feed));
        let after = delays.seen();
        let held = WaitDelays {
            paused: false,
            day_held: true,
        };
        assert_eq!(WaitDelays::between(before, after, Priority::Feed), held);
        assert_eq!(WaitDelays::between(before, after, Priority::Briefing), none);
        // In force when the call queued, though nothing new was heard.
        delays.heard(true, Some(Held::All));
        let now = delays.seen();
        let both = WaitDelays {
            paused: true,
            day_held: true,
        };
        assert_eq!(WaitDelays::between(now, now, Priority::Briefing), both);
    }
}
