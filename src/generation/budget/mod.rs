//! The LLM budget all instances share, from one process's side.
//!
//! Every LLM call waits for a grant from the budget in PostgreSQL
//! (migration 17): at most `llm_max_in_flight` calls in flight and
//! `llm_requests_per_minute` starts across the cluster, at most
//! `generation_concurrency` per process, briefing calls before feed calls
//! (while one waits anywhere, no feed call starts), the oldest claim first
//! within a class, none at all while a rate limit's pause is on, and none
//! the day's token budget holds (migration 28): each call's tokens go back
//! with its slot ([`CallSlot::spent`]) and count to the day, every
//! instance's together.
//!
//! One [`BudgetAgent`] per process talks to the budget for all of the
//! process's calls, one exchange (one statement) at a time: what queued up
//! while one exchange ran goes together in the next, so calls that finish
//! together give their slots back, and take the next ones, in one
//! statement. A call of this process granted by another process's exchange
//! is announced on channel `llm_budget`, a doorbell that makes the agent
//! ask; so do a pause, a settings change (a higher limit) and, when calls
//! wait for what time brings, a timer. The agent's exchanges renew the
//! process's lease; while it holds calls and has nothing else to say, it
//! renews it every third of `lease_s`. A process that stops renewing (it
//! was killed) loses its calls when its lease runs out, and their share
//! comes back.

mod agent;
mod calls;
pub mod failure;
mod slot;

pub use agent::BudgetAgent;
pub use calls::WaitDelays;
pub use slot::{CallSlot, LlmBudget};
