//! Transitions as events: the one LISTEN connection (`listener`), the hub
//! that fans what it hears out to subscribers (`hub`), and gapless,
//! resumable streams over the log for whoever starts late (`stream`), and
//! the transitions of a few issues routed to the wait that follows them
//! (`issue_watch`).

pub mod hub;
pub mod issue_watch;
pub mod listener;
pub mod stream;
