//! The spans of one issue's generation, under its `generate` span
//! ([`crate::telemetry::generation_span`]): the wait for the shared LLM
//! budget, the answer's checks and a re-ask, the recording of the outcome;
//! the transitions as events on the generation span; errors on the
//! span that met them. Names and attributes are in docs/tracing.md. With
//! nothing exported, every span here is a disabled one and costs nothing.

use std::time::Instant;

use opentelemetry::trace::Status;
use opentelemetry::KeyValue;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::db::DbError;
use crate::generation::budget::WaitDelays;
use crate::generation::completion::Generated;
use crate::model::llm::{Priority, Provider};
use crate::writer::checks::Rejection;

/// A span when spans are exported, else a disabled one.
macro_rules! exported_span {
    ($($span:tt)*) => {
        if crate::telemetry::exporting() {
            tracing::info_span!($($span)*)
        } else {
            tracing::Span::none()
        }
    };
}

/// The wait for an LLM call's slot, from the queue to the grant.
pub(super) struct BudgetWait {
    pub(super) span: tracing::Span,
    queued: Instant,
}

impl BudgetWait {
    /// Starts timing a wait for a slot (on the fallback only if
    /// `fallback_only`).
    pub(super) fn start(fallback_only: bool) -> BudgetWait {
        BudgetWait {
            span: exported_span!(
                "llm.budget.wait",
                otel.kind = "internal",
                newsnack.llm.fallback_only = fallback_only,
                newsnack.llm.class = Empty,
                newsnack.llm.provider = Empty,
                newsnack.budget.queued_ms = Empty,
                newsnack.budget.paused = Empty,
                newsnack.budget.day_held = Empty,
            ),
            queued: Instant::now(),
        }
    }

    /// The wait ended with a grant for `class` on `provider`; `delays` is
    /// what held calls back while it waited.
    pub(super) fn granted(&self, class: Priority, provider: Provider, delays: WaitDelays) {
        self.ended(delays);
        self.span.record("newsnack.llm.class", class.as_str());
        self.span.record("newsnack.llm.provider", provider.as_str());
    }

    /// The wait ended without a grant (a local slot, or shutdown).
    pub(super) fn ended(&self, delays: WaitDelays) {
        let queued = self.queued.elapsed().as_secs_f64() * 1000.0;
        self.span.record("newsnack.budget.queued_ms", queued);
        self.span.record("newsnack.budget.paused", delays.paused);
        self.span
            .record("newsnack.budget.day_held", delays.day_held);
    }
}

/// Runs `check` (the checks of one answer: `answer` 1 for the first, 2
/// for the re-asked one) in a span of its own, recording whether it passed
/// or which check rejected the answer; a rejection of the re-asked answer
/// is the span's error (`error.type` = the check).
pub(super) fn checked<T>(
    answer: i64,
    check: impl FnOnce() -> Result<T, Rejection>,
) -> Result<T, Rejection> {
    let span = exported_span!(
        "article.check",
        otel.kind = "internal",
        newsnack.check.answer = answer,
        newsnack.check.passed = Empty,
        newsnack.check.rejected = Empty,
    );
    let checked = span.in_scope(check);
    span.record("newsnack.check.passed", checked.is_ok());
    if let Err(rejection) = &checked {
        span.record("newsnack.check.rejected", rejection.check.as_str());
        if answer > 1 {
            record_error(&span, rejection.check.as_str(), &rejection.to_string());
        }
    }
    checked
}

/// The second call of a rejected answer, asking again with the reason.
pub(super) fn reask_span(rejected: &str) -> tracing::Span {
    exported_span!(
        "article.reask",
        otel.kind = "internal",
        newsnack.check.rejected = rejected,
    )
}

/// The fenced write of the outcome (`done` or `failed`).
pub(super) fn record_span(outcome: &'static str) -> tracing::Span {
    exported_span!(
        "issue.record",
        otel.kind = "client",
        db.system.name = "postgresql",
        db.operation.name = if outcome == "done" {
            "newsnack_complete"
        } else {
            "UPDATE"
        },
        newsnack.outcome = outcome,
        newsnack.fenced = Empty,
    )
}

/// Records on a [`record_span`] what the write found: `written`, or the
/// claim `lost`, or (not written yet) `busy`.
pub(super) fn recorded(span: &tracing::Span, generated: &Generated) {
    let fenced = match generated {
        Generated::Done | Generated::Failed { .. } => "written",
        Generated::ClaimLost | Generated::Abandoned => "lost",
        Generated::NotStarted => "not_started",
    };
    span.record("newsnack.fenced", fenced);
}

/// OpenTelemetry's `error.type` of a database error: its SQLSTATE when
/// the server sent one, else what kind of failure it was.
pub(super) fn db_error_type(e: &DbError) -> String {
    if let Some(code) = e.code() {
        return code.code().to_owned();
    }
    match e {
        DbError::Pool(_) => "pool",
        DbError::Postgres(_) => "connection",
        DbError::RowLocked(_) => "row_locked",
        DbError::TimedOut(_) => "timeout",
        DbError::BadUrl(_) | DbError::Tls(_) | DbError::Invalid(_) | DbError::Unreadable(_) => {
            "invalid"
        }
    }
    .to_owned()
}

/// Records `error_type` on `span` (OpenTelemetry's `error.type`), its
/// status Error with `message`.
pub(super) fn record_error(span: &tracing::Span, error_type: &str, message: &str) {
    if span.is_none() {
        return;
    }
    span.set_attribute("error.type", error_type.to_owned());
    span.set_status(Status::error(message.to_owned()));
}

/// One of the transitions, as an event on `span` (its generation
/// span): to `to`, from `from` if known, with the failure's `reason`.
pub(super) fn transition(span: &tracing::Span, from: Option<&str>, to: &str, reason: Option<&str>) {
    if span.is_none() {
        return;
    }
    let mut attributes = vec![KeyValue::new("newsnack.issue.status", to.to_owned())];
    if let Some(from) = from {
        attributes.push(KeyValue::new("newsnack.issue.status_from", from.to_owned()));
    }
    if let Some(reason) = reason {
        attributes.push(KeyValue::new("newsnack.issue.reason", reason.to_owned()));
    }
    span.add_event("newsnack.issue.transition", attributes);
}
