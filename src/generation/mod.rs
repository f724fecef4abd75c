//! Writing articles for claimed issues: the workers and their leases, the
//! batched completion writer, the LLM budget every instance shares, retries
//! of failed issues, the reaper of expired leases, and the typed lifecycle
//! of an issue that drives them.

pub mod budget;
pub mod completion;

pub mod machine;
pub mod reaper;
pub mod retry;
pub mod worker;
