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
//! The set is a compressed bitmap (ids are mostly dense runs), bounded by
//! [`MAX_IDS`]: past it, it starts over. Forgetting costs a database round
//! trip, never a wrong answer. A subscriber that falls behind the hub just
//! learns less.

use std::sync::{Arc, Mutex};

use roaring::RoaringTreemap;
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;

use crate::listener::TransitionHub;
use crate::status::Status;

/// Ids remembered at most (a few MB even when scattered).
pub const MAX_IDS: u64 = 4_000_000;

/// Known-`DONE` issue ids. Cheap to clone.
#[derive(Clone, Default)]
pub struct DoneIssues {
    ids: Arc<Mutex<RoaringTreemap>>,
}

impl DoneIssues {
    /// Follows the hub's live transitions until `stop`.
    pub fn follow(hub: &TransitionHub, stop: CancellationToken) -> DoneIssues {
        let done = DoneIssues::default();
        let mut transitions = hub.subscribe();
        let set = done.clone();
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    _ = stop.cancelled() => return,
                    next = transitions.recv() => next,
                };
                match next {
                    Ok(t) if t.to == Status::Done => set.insert(t.issue_id),
                    Ok(_) | Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => return,
                }
            }
        });
        done
    }

    /// Records an issue seen `DONE` in committed data.
    pub fn insert(&self, id: i64) {
        let Ok(id) = u64::try_from(id) else { return };
        let mut ids = self.ids.lock().expect("never poisoned");
        if ids.len() >= MAX_IDS {
            ids.clear();
        }
        ids.insert(id);
    }

    /// Splits `ids` into those not known to be `DONE` (in order) and those
    /// known to be.
    pub fn split(&self, ids: &[i64]) -> (Vec<i64>, Vec<i64>) {
        let known = self.ids.lock().expect("never poisoned");
        ids.iter().partition(|&&id| {
            !u64::try_from(id)
                .map(|id| known.contains(id))
                .unwrap_or(false)
        })
    }

    /// How many ids are remembered.
    pub fn len(&self) -> u64 {
        self.ids.lock().expect("never poisoned").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_known_done_ids_from_the_rest_keeping_order() {
        let done = DoneIssues::default();
        for id in [3, 5, 8] {
            done.insert(id);
        }
        assert_eq!(done.split(&[9, 5, 1, 3, -4]), (vec![9, 1, -4], vec![5, 3]));
        assert_eq!(done.len(), 3);
    }

    #[test]
    fn starts_over_past_its_bound() {
        let done = DoneIssues::default();
        done.ids.lock().unwrap().insert_range(1..=MAX_IDS);
        assert_eq!(done.len(), MAX_IDS);
        done.insert(MAX_IDS as i64 + 7);
        assert_eq!(done.len(), 1);
        assert_eq!(
            done.split(&[1, MAX_IDS as i64 + 7]),
            (vec![1], vec![MAX_IDS as i64 + 7])
        );
    }
}
