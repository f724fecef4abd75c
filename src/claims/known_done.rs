//! The issues this instance knows to be `DONE`, so a claim request for
//! nothing but finished issues is answered without the database.
//!
//! `DONE` is terminal: no legal transition leaves it
//! (`issue_transition_is_legal` in `sql/0002_transitions.sql`), so an id seen
//! entering `DONE` on the committed log can never be claimable again, and
//! answering "not claimable" for it is exact however old the knowledge is.
//! Only committed facts feed the set — transitions announced by the database
//! and the `DONE` statuses a claim statement read from its snapshot — never
//! intentions, so a rolled-back completion is never recorded.
//!
//! One thing ends that knowledge: the issue being removed, since its id
//! may come back as a new issue (`TRUNCATE .. RESTART IDENTITY`, or an
//! insert under an explicit id). Removals are announced (migration 12);
//! the set then starts over and ignores the transitions read before the
//! notice. What a claim statement reports `DONE` is recorded only if no
//! removal was noticed since the request looked at the set (the epoch
//! [`DoneIssues::split`] returns): its snapshot may predate the removal.
//!
//! A removal is announced when its statement runs, but the transitions of
//! its transaction only at commit, so an issue finished, removed and
//! inserted again under its id in one transaction is heard of as removed,
//! then `DONE`, then new. A new issue's first transition (no `from`)
//! therefore also forgets its id.
//!
//! The set is a compressed bitmap (ids are mostly dense runs), bounded by
//! [`MAX_IDS`]: past it, it starts over. Forgetting costs a database round
//! trip, never a wrong answer; so a follower that falls behind the hub,
//! and may have missed a new issue, starts over too.

use std::sync::{Arc, Mutex};

use roaring::RoaringTreemap;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::events::hub::EventHub;
use crate::model::status::Status;

/// Ids remembered at most (a few MB even when scattered).
pub const MAX_IDS: u64 = 4_000_000;

/// Known-`DONE` issue ids. Cheap to clone.
#[derive(Clone)]
pub struct DoneIssues {
    known: Arc<Mutex<Known>>,
}

struct Known {
    ids: RoaringTreemap,
    /// Removal notices; one not yet applied empties `ids` before any use,
    /// so a request that comes after the notice never meets a removed id.
    removed: watch::Receiver<i64>,
    /// Transitions up to this `seq` were read before the last removal.
    stale_up_to: i64,
    /// Removals applied so far.
    epoch: u64,
}

impl Known {
    fn current(&mut self) -> &mut Known {
        // Once the sender is gone, `has_changed` errs even with a notice
        // unseen: then the value itself tells.
        let unseen = self
            .removed
            .has_changed()
            .unwrap_or_else(|_| *self.removed.borrow() != self.stale_up_to);
        if unseen {
            self.stale_up_to = *self.removed.borrow_and_update();
            self.forget_all();
        }
        self
    }

    /// Starts over: nothing known, and what a claim statement read before
    /// now is not recorded either.
    fn forget_all(&mut self) {
        self.ids.clear();
        self.epoch += 1;
    }

    fn remove(&mut self, id: i64) {
        if let Ok(id) = u64::try_from(id) {
            self.ids.remove(id);
        }
    }

    fn insert(&mut self, id: i64) {
        let Ok(id) = u64::try_from(id) else { return };
        if self.ids.len() >= MAX_IDS {
            self.ids.clear();
        }
        self.ids.insert(id);
    }
}

impl DoneIssues {
    /// Knows nothing yet; forgets everything on each notice of `removed`.
    fn new(mut removed: watch::Receiver<i64>) -> DoneIssues {
        let stale_up_to = *removed.borrow_and_update();
        DoneIssues {
            known: Arc::new(Mutex::new(Known {
                ids: RoaringTreemap::new(),
                removed,
                stale_up_to,
                epoch: 0,
            })),
        }
    }

    /// Follows the hub's live transitions and removal notices until `stop`.
    pub fn follow(hub: &EventHub, stop: CancellationToken) -> DoneIssues {
        let done = DoneIssues::new(hub.issues_removed());
        let mut transitions = hub.subscribe();
        let set = done.clone();
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    _ = stop.cancelled() => return,
                    next = transitions.recv() => next,
                };
                let mut known = set.known.lock().expect("never poisoned");
                let known = known.current();
                match next {
                    Ok(t) if t.to == Status::Done && t.seq > known.stale_up_to => {
                        known.insert(t.issue_id);
                    }
                    // A new issue under a known id: its removal was
                    // announced before a `DONE` of the same transaction.
                    Ok(t) if t.from.is_none() => known.remove(t.issue_id),
                    Ok(_) => {}
                    // What was skipped may have been such an arrival.
                    Err(RecvError::Lagged(_)) => known.forget_all(),
                    Err(RecvError::Closed) => return,
                }
            }
        });
        done
    }

    /// Records an issue seen `DONE` in committed data read after the
    /// [`DoneIssues::split`] that gave `epoch`, unless issues were removed
    /// since (the data may predate the removal).
    pub fn insert(&self, id: i64, epoch: u64) {
        let mut known = self.known.lock().expect("never poisoned");
        let known = known.current();
        if known.epoch == epoch {
            known.insert(id);
        }
    }

    /// Splits `ids` into those not known to be `DONE` (in order) and those
    /// known to be; also returns the removals noticed so far, the epoch to
    /// hand to [`DoneIssues::insert`] with what the database then reports.
    pub fn split(&self, ids: &[i64]) -> (Vec<i64>, Vec<i64>, u64) {
        let mut known = self.known.lock().expect("never poisoned");
        let known = known.current();
        let (open, done) = ids.iter().partition(|&&id| {
            !u64::try_from(id)
                .map(|id| known.ids.contains(id))
                .unwrap_or(false)
        });
        (open, done, known.epoch)
    }

    /// How many ids are remembered.
    pub fn len(&self) -> u64 {
        self.known
            .lock()
            .expect("never poisoned")
            .current()
            .ids
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The set's current epoch.
    fn epoch(done: &DoneIssues) -> u64 {
        done.split(&[]).2
    }

    /// A set with its removal notices, and their sender.
    fn fresh() -> (DoneIssues, watch::Sender<i64>) {
        let (removed, notices) = watch::channel(0);
        (DoneIssues::new(notices), removed)
    }

    #[test]
    fn splits_known_done_ids_from_the_rest_keeping_order() {
        let (done, _removed) = fresh();
        for id in [3, 5, 8] {
            done.insert(id, epoch(&done));
        }
        assert_eq!(
            done.split(&[9, 5, 1, 3, -4]),
            (vec![9, 1, -4], vec![5, 3], 0)
        );
        assert_eq!(done.len(), 3);
    }

    #[test]
    fn starts_over_past_its_bound() {
        let (done, _removed) = fresh();
        done.known.lock().unwrap().ids.insert_range(1..=MAX_IDS);
        assert_eq!(done.len(), MAX_IDS);
        done.insert(MAX_IDS as i64 + 7, epoch(&done));
        assert_eq!(done.len(), 1);
        assert_eq!(
            done.split(&[1, MAX_IDS as i64 + 7]),
            (vec![1], vec![MAX_IDS as i64 + 7], 0)
        );
    }

    #[test]
    fn forgets_everything_once_issues_were_removed() {
        let (done, removed) = fresh();
        done.insert(4, epoch(&done));
        removed.send_modify(|seq| *seq = 10);
        assert_eq!(done.split(&[4]), (vec![4], vec![], 1));
        done.insert(4, epoch(&done));
        assert_eq!(done.split(&[4]), (vec![], vec![4], 1));
    }

    #[test]
    fn what_was_read_before_a_removal_is_not_recorded_after_it() {
        let (done, removed) = fresh();
        let epoch = epoch(&done);
        removed.send_modify(|seq| *seq = 10);
        done.insert(4, epoch);
        assert_eq!(done.split(&[4]), (vec![4], vec![], 1));
    }

    #[test]
    fn a_last_notice_counts_after_its_sender_is_gone() {
        let (done, removed) = fresh();
        done.insert(4, epoch(&done));
        removed.send_modify(|seq| *seq = 10);
        drop(removed);
        assert_eq!(done.split(&[4]), (vec![4], vec![], 1));
    }
}
