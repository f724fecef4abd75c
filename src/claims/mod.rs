//! Claiming issues for generation: `FOR NO KEY UPDATE SKIP LOCKED` claims
//! batched by group commit, and the known-`DONE` ids that answer hopeless
//! claims without asking the database.

pub mod claim;
pub mod group_commit;
pub mod known_done;
