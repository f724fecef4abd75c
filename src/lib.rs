//! newsnack: the content pipeline of a daily news briefing, over PostgreSQL.
//!
//! Issues are claimed with `FOR NO KEY UPDATE SKIP LOCKED`, every status
//! change is enforced, logged and announced by the database itself, and the
//! service reacts to those announcements instead of polling.
//!
//! A map of the crate:
//!
//! | module | owns |
//! |---|---|
//! | [`claim`] | claims with application-level group commit |
//! | [`cli`] | the command line: parsing, one-shot commands, dispatch |
//! | [`db`] | connections (TLS, pooled and direct endpoints), the pool, migrations, roles, advisory lock keys, every SQL query |
//! | [`done_issues`] | known-`DONE` ids that answer hopeless claims without SQL |
//! | [`embedded`] | the throwaway PostgreSQL for the zero-config default |
//! | [`group_commit`] | batching concurrent writes into shared transactions |
//! | [`listener`] | the one LISTEN connection and the subscriber hub |
//! | [`llm_budget`] | the LLM budget all instances share, from one process's side |
//! | [`stream`] | gapless, resumable transition streams over the log |
//! | [`machine`] | the typed `statig` lifecycle of an issue |
//! | [`status`], [`transition`] | the domain types the log speaks in |
//! | [`settings`] | typed runtime settings, re-read when announced |
//! | [`input`] | validation of ids and new issues, shared by API and CLI |
//! | [`tail`] | how the live tail prints a transition |
//! | [`writer`] | the LLM client and the offline writer |
//! | [`shutdown`] | the one shutdown signal |
//! | [`logging`] | log output that a failing destination cannot break |

pub mod briefing;
pub mod claims;
pub mod cli;
pub mod db;
pub mod embedded;
pub mod events;
pub mod generation;
pub mod http;
pub mod input;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod serve;
pub mod settings;
pub mod shutdown;
pub mod writer;
