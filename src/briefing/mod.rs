//! The daily briefing: one pipeline run (select → claim → smart wait →
//! assemble), the advisory lock that lets one instance run it, the
//! scheduler that starts it, and the assembly of the briefing itself.

pub mod assembly;

pub mod run;

pub mod wait;
