//! Where a generation gets the right to call its writer: the budget every
//! instance shares, for a writer that calls an LLM, or this instance's own
//! slots (`generation_concurrency`, resized live), for any other.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{Semaphore, SemaphorePermit};

use crate::db::issue::ClaimedIssue;
use crate::generation::budget::{CallSlot, LlmBudget};
use crate::model::llm::Priority;

/// Where a generation gets the right to call its writer.
#[derive(Clone)]
pub(super) enum Gate {
    /// This instance's slots (`generation_concurrency`).
    Local(Arc<Slots>),
    /// The budget every instance shares.
    Shared(LlmBudget),
}

/// The right to call the writer, held while it works (given back when
/// dropped).
pub(super) enum Slot<'a> {
    Local { _permit: SemaphorePermit<'a> },
    Shared(CallSlot),
}

impl Slot<'_> {
    /// What the call has spent so far, for the day's token budget (a local
    /// slot, for a writer that asks no model, counts nothing).
    pub(super) fn spent(&mut self, tokens: i64) {
        if let Slot::Shared(slot) = self {
            slot.spent(tokens);
        }
    }
}

impl Gate {
    /// A slot for `claimed`; `None` once the gate is closed (shutdown).
    pub(super) async fn slot(
        &self,
        claimed: &ClaimedIssue,
        priority: Option<Priority>,
        fallback_only: bool,
    ) -> Option<Slot<'_>> {
        match self {
            Gate::Local(slots) => slots
                .acquire()
                .await
                .map(|permit| Slot::Local { _permit: permit }),
            Gate::Shared(budget) => budget
                .call_slot(claimed, priority, fallback_only)
                .await
                .map(Slot::Shared),
        }
    }

    /// No slot is handed out any more; waiters get `None`.
    pub(super) fn close(&self) {
        match self {
            Gate::Local(slots) => slots.close(),
            Gate::Shared(budget) => budget.close(),
        }
    }
}

/// The LLM call slots, sized by the `generation_concurrency` setting.
///
/// Shrinking takes effect at the next call to start, however many are
/// queued: a waiter handed a permit while the slots are over size retires
/// it and waits again. (Taking the surplus out with one more waiter would
/// not: the semaphore serves waiters in order, so it would get the permits
/// only after every call queued before it.)
pub(super) struct Slots {
    permits: Semaphore,
    /// Permits still to retire as they are handed out.
    surplus: AtomicUsize,
}

impl Slots {
    pub(super) fn new(capacity: usize) -> Slots {
        Slots {
            permits: Semaphore::new(capacity),
            surplus: AtomicUsize::new(0),
        }
    }

    /// A slot; `None` once the slots are closed (shutdown).
    pub(super) async fn acquire(&self) -> Option<SemaphorePermit<'_>> {
        loop {
            let permit = self.permits.acquire().await.ok()?;
            let retired = self
                .surplus
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if !retired {
                return Some(permit);
            }
            permit.forget();
        }
    }

    /// No slot is handed out any more; waiters get `None`.
    pub(super) fn close(&self) {
        self.permits.close();
    }

    /// Grows or shrinks the slots from `current` to `wanted`; returns the
    /// new capacity.
    pub(super) fn resize(&self, current: usize, wanted: usize) -> usize {
        if wanted > current {
            // Surplus not yet retired is kept instead of adding permits.
            let grow = wanted - current;
            let mut kept = 0;
            let _ = self
                .surplus
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    kept = n.min(grow);
                    Some(n - kept)
                });
            self.permits.add_permits(grow - kept);
        } else if wanted < current {
            self.surplus.fetch_add(current - wanted, Ordering::SeqCst);
        }
        if wanted != current {
            tracing::info!(
                from = current,
                to = wanted,
                "generation concurrency changed"
            );
        }
        wanted
    }
}
