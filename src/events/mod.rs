//! Transitions as events: the one LISTEN connection (`listener`), the hub
//! that fans what it hears out to subscribers (`hub`), and gapless,
//! resumable streams over the log for whoever starts late (`stream`).

pub mod hub;
pub mod listener;
pub mod stream;
