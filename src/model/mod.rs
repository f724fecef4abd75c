//! The vocabulary every layer shares: an issue's status, a logged
//! transition, and what an LLM call is for and what it spent. Imports
//! nothing else from the crate, so any module may use it.

pub mod llm;
pub mod status;
pub mod transition;
