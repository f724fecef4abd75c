//! The typed lifecycle of one issue, as a `statig` state machine.
//!
//! ```text
//!                 Claim                    Complete
//!   ┌─────────┐ ───────▶ ┌────────────┐ ──────────▶ ┌──────┐
//!   │ Pending │          │ InProgress │             │ Done │
//!   └─────────┘          └────────────┘             └──────┘
//!        ▲                  │      ▲
//!        │ Reset       Fail │      │ Claim (retry)
//!        │                  ▼      │
//!        │               ┌──────────┐
//!        └────────────── │  Failed  │
//!                        └──────────┘
//! ```
//!
//! The database owns the rules (`issue_transition_is_legal` in
//! `sql/0002_transitions.sql`) and enforces them for every writer; this
//! machine mirrors them so the service can react to what it observes, its own
//! transitions and other systems' alike. Each state handles only the events
//! that leave it legally, so an illegal transition cannot be expressed: the
//! event is ignored and [`IssueMachine::observe`] reports it.
//!
//! Entering a state yields a [`Reaction`] for the service to carry out
//! (schedule a retry, settle a wait, ...). `statig` 0.4 machines are driven
//! here in their blocking form, so they are `Send` and can live in any task.

use statig::prelude::*;

use crate::model::status::Status;

/// What the service should do because an issue entered a state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reaction {
    /// Back to `PENDING` (operator reset): claimable again.
    BecameClaimable,
    /// Claimed: someone is generating; watch its lease.
    WorkStarted,
    /// `DONE`: nothing more will happen to it.
    Finished,
    /// `FAILED`: retry if attempts are left, otherwise it stays failed.
    ConsiderRetry,
}

/// The four ways an issue can move; each maps to exactly one target status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Claim,
    Complete,
    Fail,
    Reset,
}

impl Event {
    /// The event that would move an issue to `to`.
    pub fn toward(to: Status) -> Event {
        match to {
            Status::InProgress => Event::Claim,
            Status::Done => Event::Complete,
            Status::Failed => Event::Fail,
            Status::Pending => Event::Reset,
        }
    }
}

/// The shared storage of the machine: nothing, the lifecycle is all state.
#[derive(Debug, Default, Clone)]
pub struct Lifecycle;

#[state_machine(
    initial = "State::pending()",
    state(derive(Debug, Clone, Copy, PartialEq, Eq))
)]
impl Lifecycle {
    #[state(entry_action = "enter_pending")]
    fn pending(event: &Event) -> Outcome<State> {
        match event {
            Event::Claim => Transition(State::in_progress()),
            _ => Handled,
        }
    }

    #[state(entry_action = "enter_in_progress")]
    fn in_progress(event: &Event) -> Outcome<State> {
        match event {
            Event::Complete => Transition(State::done()),
            Event::Fail => Transition(State::failed()),
            _ => Handled,
        }
    }

    #[state(entry_action = "enter_done")]
    fn done(context: &mut Option<Reaction>, event: &Event) -> Outcome<State> {
        // Terminal: nothing leaves DONE. (The context parameter names the
        // machine's context type for the whole machine.)
        let _ = (context, event);
        Handled
    }

    #[state(entry_action = "enter_failed")]
    fn failed(event: &Event) -> Outcome<State> {
        match event {
            Event::Claim => Transition(State::in_progress()),
            Event::Reset => Transition(State::pending()),
            _ => Handled,
        }
    }

    #[action]
    fn enter_pending(context: &mut Option<Reaction>) {
        *context = Some(Reaction::BecameClaimable);
    }

    #[action]
    fn enter_in_progress(context: &mut Option<Reaction>) {
        *context = Some(Reaction::WorkStarted);
    }

    #[action]
    fn enter_done(context: &mut Option<Reaction>) {
        *context = Some(Reaction::Finished);
    }

    #[action]
    fn enter_failed(context: &mut Option<Reaction>) {
        *context = Some(Reaction::ConsiderRetry);
    }
}

impl From<Status> for State {
    fn from(status: Status) -> Self {
        match status {
            Status::Pending => State::pending(),
            Status::InProgress => State::in_progress(),
            Status::Done => State::done(),
            Status::Failed => State::failed(),
        }
    }
}

impl From<State> for Status {
    fn from(state: State) -> Self {
        match state {
            State::Pending {} => Status::Pending,
            State::InProgress {} => Status::InProgress,
            State::Done {} => Status::Done,
            State::Failed {} => Status::Failed,
        }
    }
}

/// A change the lifecycle does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("illegal status transition: {from} -> {to}")]
pub struct IllegalTransition {
    pub from: Status,
    pub to: Status,
}

/// One issue's machine, started in whatever status it was first seen in.
#[derive(Debug)]
pub struct IssueMachine {
    machine: InitializedStateMachine<Lifecycle>,
}

impl IssueMachine {
    /// A machine that starts in `status` (entry actions are not replayed).
    pub fn at(status: Status) -> Self {
        let mut uninitialized = Lifecycle.uninitialized_state_machine();
        *uninitialized.state_mut() = State::from(status);
        let mut ignored = None;
        IssueMachine {
            machine: uninitialized.init_with_context(&mut ignored),
        }
    }

    pub fn status(&self) -> Status {
        Status::from(*self.machine.state())
    }

    /// Feeds an observed move to `to`. `Ok(None)` when `to` is the current
    /// status (not a transition), `Ok(Some(reaction))` for a legal transition.
    pub fn observe(&mut self, to: Status) -> Result<Option<Reaction>, IllegalTransition> {
        let from = self.status();
        if from == to {
            return Ok(None);
        }
        let mut reaction = None;
        self.machine
            .handle_with_context(&Event::toward(to), &mut reaction);
        if self.status() == to {
            Ok(reaction)
        } else {
            Err(IllegalTransition { from, to })
        }
    }

    /// Whether `from -> to` is a legal transition, according to the machine.
    pub fn is_legal(from: Status, to: Status) -> bool {
        from != to && IssueMachine::at(from).observe(to).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_the_happy_path_and_a_retry() {
        let mut m = IssueMachine::at(Status::Pending);
        assert_eq!(
            m.observe(Status::InProgress),
            Ok(Some(Reaction::WorkStarted))
        );
        assert_eq!(m.observe(Status::Failed), Ok(Some(Reaction::ConsiderRetry)));
        assert_eq!(
            m.observe(Status::InProgress),
            Ok(Some(Reaction::WorkStarted))
        );
        assert_eq!(m.observe(Status::Done), Ok(Some(Reaction::Finished)));
        assert_eq!(m.status(), Status::Done);
    }

    #[test]
    fn rejects_illegal_moves_and_stays_put() {
        let mut m = IssueMachine::at(Status::Pending);
        assert_eq!(
            m.observe(Status::Done),
            Err(IllegalTransition {
                from: Status::Pending,
                to: Status::Done
            })
        );
        assert_eq!(m.status(), Status::Pending);
        assert_eq!(m.observe(Status::Pending), Ok(None));
        let mut done = IssueMachine::at(Status::Done);
        for to in [Status::Pending, Status::InProgress, Status::Failed] {
            assert!(done.observe(to).is_err());
        }
    }

    #[test]
    fn exactly_five_legal_pairs() {
        let legal: Vec<_> = Status::ALL
            .iter()
            .flat_map(|&f| Status::ALL.iter().map(move |&t| (f, t)))
            .filter(|&(f, t)| IssueMachine::is_legal(f, t))
            .collect();
        assert_eq!(legal.len(), 5, "{legal:?}");
    }
}
