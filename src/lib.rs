//! newsnack: the content pipeline of a daily news briefing, over PostgreSQL.
//!
//! Issues are claimed with `FOR NO KEY UPDATE SKIP LOCKED`, every status
//! change is enforced, logged and announced by the database itself, and the
//! service reacts to those announcements instead of polling. Lower modules
//! come first; a module uses only those above it in this map, and no two
//! import each other (`tests/layout.rs` checks).
//!
//! | module | owns |
//! |---|---|
//! | [`model`] | the shared vocabulary: `Status`, a logged `Transition`, an LLM call's `Priority` and `TokenUsage` |
//! | [`metrics`] | the Prometheus metrics every module records into |
//! | [`telemetry`] | traces over OpenTelemetry: the OTLP export, a request's W3C trace context |
//! | [`logging`] | log output that a failing destination cannot break |
//! | [`shutdown`] | the one shutdown signal every task selects on |
//! | [`db`] | connections (TLS, pooled and direct endpoints), the pool, migrations, roles, advisory locks, every SQL query (one file per table) |
//! | [`input`] | validation of ids and new issues, shared by the API and the CLI |
//! | [`writer`] | the OpenAI-compatible LLM client, the built-in offline writer, the checks an answer passes before it is stored |
//! | [`settings`] | typed runtime settings re-read when announced, and the `schedule` setting's grammar |
//! | [`events`] | the one LISTEN connection (`listener`), the hub that fans out what it hears, gapless resumable streams over the log |
//! | [`claims`] | `SKIP LOCKED` claims batched by group commit, releasing claims, known-`DONE` ids |
//! | [`generation`] | workers, recording outcomes, the shared LLM budget, retries, the lease reaper, the `statig` issue machine |
//! | [`briefing`] | a pipeline run, its lock, its scheduler, the smart wait, the briefing's assembly |
//! | [`maintenance`] | upkeep on one instance at a time: the hourly prune by the retention settings |
//! | [`http`] | the axum API: one router per resource, the JSON types, OpenAPI, SSE, auth, one error type |
//! | [`serve`] | wiring the long-running service together and stopping it cleanly |
//! | [`embedded`] | the throwaway PostgreSQL of the zero-configuration default |
//! | [`cli`] | the command line: parsing, one-shot commands, `tail`'s output, the demo |

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
pub mod maintenance;
pub mod metrics;
pub mod model;
pub mod serve;
pub mod settings;
pub mod shutdown;
pub mod telemetry;
pub mod writer;
