//! The daily briefing: one pipeline run (select → claim → smart wait →
//! assemble), the lock that keeps it to one run at a time, the scheduler
//! that starts it, and the assembly of the briefing itself.

pub mod assembly;

pub mod lock;

pub mod run;

pub mod scheduler;

pub mod wait;
