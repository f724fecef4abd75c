//! What a failed LLM call means. The budget's grant says where a failure
//! of the call goes next ([`OnFailure`]: the fallback, or a retry later);
//! the failure adds what it asks of every instance (a pause) and what goes
//! back to the providers' circuits. The worker carries out the answer.

use std::time::Duration;

use crate::db::llm_budget::{OnFailure, ProviderOutcome, Route};
use crate::model::llm::Provider;
use crate::writer::{Article, WriteError};

/// What follows a call that went out on `route`.
#[derive(Debug, Clone, PartialEq)]
pub struct AfterCall {
    /// How its provider did, for the circuits every instance shares.
    pub report: Option<ProviderOutcome>,
    /// A pause of the primary's calls every instance keeps, and why.
    pub pause_primary: Option<(Duration, String)>,
    pub next: Next,
}

/// What the generation does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Ask the fallback provider at once, in the same claim, the attempt
    /// unspent.
    AskFallback,
    /// Record the result; with a pause the LLM asked for, the attempt is
    /// given back (the quota failed, not the article).
    Record { quota_pause: Option<Duration> },
}

/// What follows `result`, for a call granted on `route` by a process that
/// has a fallback provider or not (`has_fallback`: only then do the
/// circuits hear how a provider did).
///
/// | call's provider | failure          | report      | pause of the primary | next                  |
/// |-----------------|------------------|-------------|----------------------|-----------------------|
/// | any             | none / not down  | ok (answer) | —                    | record                |
/// | primary         | down, with pause | —           | the pause            | `route.on_failure`    |
/// | primary         | down             | failed      | —                    | `route.on_failure`    |
/// | fallback        | down (± pause)   | failed      | —                    | `route.on_failure`    |
///
/// "Down": 5xx, a timeout, no connection, a rate limit
/// ([`crate::writer::WriteErrorKind::provider_down`]).
pub fn after_call(
    route: Route,
    has_fallback: bool,
    result: &Result<Article, WriteError>,
) -> AfterCall {
    let pause = result
        .as_ref()
        .err()
        .and_then(WriteError::pause)
        .filter(|p| !p.is_zero());
    let record = Next::Record { quota_pause: pause };
    let down = result.as_ref().err().filter(|e| e.kind().provider_down());
    let Some(e) = down else {
        let answered = result.is_ok() && has_fallback;
        return AfterCall {
            report: answered.then_some(ProviderOutcome::Ok),
            pause_primary: None,
            next: record,
        };
    };
    let reason = e.reason().to_string();
    let next = match route.on_failure {
        OnFailure::Fallback => Next::AskFallback,
        OnFailure::Retry => record,
    };
    match (route.provider, pause) {
        (Provider::Primary, Some(pause)) => AfterCall {
            report: None,
            pause_primary: Some((pause, reason)),
            next,
        },
        (Provider::Primary, None) => AfterCall {
            report: has_fallback.then_some(ProviderOutcome::Failed {
                reason,
                pause: None,
            }),
            pause_primary: None,
            next,
        },
        (Provider::Fallback, pause) => AfterCall {
            report: Some(ProviderOutcome::Failed { reason, pause }),
            pause_primary: None,
            next,
        },
    }
}
