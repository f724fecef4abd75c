//! Transitions routed by issue, for smart waits. A wait follows a few
//! issues; through an [`IssueWatch`] it gets only their transitions,
//! handed over by the publisher as it publishes them. A watch keeps the
//! newest transition of each of its issues not yet taken, so it never falls
//! behind and holds a few hundred bytes however busy the log is.
//!
//! A broadcast subscription instead gets every transition of every issue:
//! N open waits made one commit of N transitions N × N deliveries, and
//! past the broadcast's buffer every wait re-read the log.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::model::transition::Transition;

/// Every open watch of a process, by issue. Shared by the hub (which opens
/// watches) and the publisher (which delivers to them).
#[derive(Default)]
pub(crate) struct IssueWatches {
    registry: Mutex<Registry>,
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    by_issue: HashMap<i64, Vec<(u64, Arc<Inbox>)>>,
    open: usize,
    /// The publisher is gone.
    closed: bool,
}

/// What the publisher leaves for one watch.
#[derive(Default)]
struct Inbox {
    /// The newest transition of each issue since the last take.
    newest: Mutex<HashMap<i64, Transition>>,
    delivered: Notify,
    /// Set when the publisher is gone: nothing more will be delivered.
    closed: AtomicBool,
}

/// The publisher has stopped: nothing more will be delivered.
#[derive(Debug, thiserror::Error)]
#[error("the listener has stopped")]
pub struct ListenerStopped;

impl IssueWatches {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens a watch on `issues`: every transition of them published from
    /// now on is delivered to it.
    pub(crate) fn watch(self: &Arc<Self>, issues: &[i64]) -> IssueWatch {
        let mut issues = issues.to_vec();
        issues.sort_unstable();
        issues.dedup();
        let inbox = Arc::new(Inbox::default());
        let mut registry = self.registry();
        inbox.closed.store(registry.closed, Ordering::Release);
        let id = registry.next_id;
        registry.next_id += 1;
        registry.open += 1;
        for &issue in &issues {
            registry
                .by_issue
                .entry(issue)
                .or_default()
                .push((id, inbox.clone()));
        }
        IssueWatch {
            id,
            issues,
            inbox,
            watches: self.clone(),
        }
    }

    /// Hands `t` to every watch of its issue.
    pub(crate) fn deliver(&self, t: &Transition) {
        let registry = self.registry();
        let Some(watching) = registry.by_issue.get(&t.issue_id) else {
            return;
        };
        for (_, inbox) in watching {
            inbox
                .newest
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(t.issue_id, t.clone());
            inbox.delivered.notify_one();
        }
    }

    /// Tells every watch, open or opened later, that nothing more comes.
    pub(crate) fn close(&self) {
        let mut registry = self.registry();
        registry.closed = true;
        for (_, inbox) in registry.by_issue.values().flatten() {
            inbox.closed.store(true, Ordering::Release);
            inbox.delivered.notify_one();
        }
    }

    /// The number of open watches.
    pub(crate) fn open(&self) -> usize {
        self.registry().open
    }
}

/// One wait's view of the transitions of its issues (see the module docs).
/// Dropping it stops the deliveries.
pub struct IssueWatch {
    id: u64,
    issues: Vec<i64>,
    inbox: Arc<Inbox>,
    watches: Arc<IssueWatches>,
}

impl IssueWatch {
    /// The transitions delivered since the last take: the newest of each
    /// issue, in `seq` order.
    pub fn take(&self) -> Vec<Transition> {
        let mut taken: Vec<Transition> = self
            .inbox
            .newest
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, t)| t)
            .collect();
        taken.sort_unstable_by_key(|t| t.seq);
        taken
    }

    /// Returns once a transition is there to take. Cancel-safe: what was
    /// delivered stays until taken.
    pub async fn delivered(&self) -> Result<(), ListenerStopped> {
        loop {
            if !self
                .inbox
                .newest
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
            {
                return Ok(());
            }
            if self.inbox.closed.load(Ordering::Acquire) {
                return Err(ListenerStopped);
            }
            // A delivery between the check and here leaves a permit: this
            // returns at once.
            self.inbox.delivered.notified().await;
        }
    }
}

impl Drop for IssueWatch {
    fn drop(&mut self) {
        let mut registry = self.watches.registry();
        registry.open -= 1;
        for issue in &self.issues {
            if let Some(watching) = registry.by_issue.get_mut(issue) {
                watching.retain(|(id, _)| *id != self.id);
                if watching.is_empty() {
                    registry.by_issue.remove(issue);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::status::Status;

    fn transition(seq: i64, issue_id: i64, to: Status) -> Transition {
        Transition {
            seq,
            issue_id,
            from: None,
            to,
            at: time::OffsetDateTime::UNIX_EPOCH,
            attempts: 0,
            fatal: false,
        }
    }

    #[tokio::test]
    async fn a_watch_gets_the_newest_transition_of_its_issues_only() {
        let watches = Arc::new(IssueWatches::default());
        let one = watches.watch(&[1, 2, 2]);
        let other = watches.watch(&[3]);
        watches.deliver(&transition(10, 1, Status::InProgress));
        watches.deliver(&transition(11, 3, Status::Done));
        watches.deliver(&transition(12, 2, Status::Done));
        watches.deliver(&transition(13, 1, Status::Failed));
        one.delivered().await.unwrap();
        let taken: Vec<(i64, i64)> = one.take().iter().map(|t| (t.seq, t.issue_id)).collect();
        assert_eq!(taken, [(12, 2), (13, 1)]);
        assert!(one.take().is_empty(), "taken once");
        assert_eq!(other.take().len(), 1);
        assert_eq!(watches.open(), 2);
    }

    #[tokio::test]
    async fn a_dropped_watch_is_no_longer_delivered_to() {
        let watches = Arc::new(IssueWatches::default());
        let first = watches.watch(&[1]);
        let second = watches.watch(&[1]);
        drop(first);
        assert_eq!(watches.open(), 1);
        watches.deliver(&transition(1, 1, Status::Done));
        assert_eq!(second.take().len(), 1);
        drop(second);
        assert_eq!(watches.open(), 0);
        assert!(
            watches.registry().by_issue.is_empty(),
            "nothing left behind"
        );
    }

    #[tokio::test]
    async fn what_was_delivered_is_taken_before_the_close_ends_a_watch() {
        let watches = Arc::new(IssueWatches::default());
        let watch = watches.watch(&[7]);
        let waiting = tokio::spawn(async move {
            watch.delivered().await.unwrap();
            let seen = watch.take();
            (watch.delivered().await, seen)
        });
        // Whichever runs first, the delivery is taken before the close ends
        // the watch.
        watches.deliver(&transition(1, 7, Status::Done));
        watches.close();
        let (after_close, seen) = waiting.await.unwrap();
        assert_eq!(seen.len(), 1);
        assert!(after_close.is_err(), "nothing more comes once closed");
        let late = watches.watch(&[7]);
        assert!(late.delivered().await.is_err(), "opened after the close");
    }
}
