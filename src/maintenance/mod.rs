//! Upkeep a long-running service does by itself: pruning by the retention
//! settings, on one instance at a time.

pub mod pruner;
