//! Transitions as events: the one LISTEN connection, the hub that fans its
//! notifications out to subscribers, and gapless, resumable streams over
//! the log for whoever starts late.

pub mod listener;
pub mod stream;
