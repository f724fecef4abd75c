//! `POST /waits`: the smart wait as a long request. It answers with the
//! outcome the moment it is decided; a client that disconnects cancels it,
//! and shutdown ends it with 503.
//!
//! The wait ends after `timeout_s` or at `deadline` (RFC 3339), never both:
//! a client that asks again after a restart or a retry sends the deadline it
//! computed the first time, and the wait keeps it. A deadline already past
//! decides at once, by the deadline's rule, on what is done.

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use time::OffsetDateTime;

use super::error::{ApiError, ApiJson};
use super::types::ErrorBody;
use super::AppState;
use crate::briefing::wait::{self, WaitError, WaitReport, WaitRequest};
use crate::input;

/// The longest wait a request may ask for (one day).
pub const MAX_TIMEOUT_S: u64 = 86_400;

pub fn router() -> Router<AppState> {
    Router::new().route("/waits", post(wait_for))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WaitBody {
    #[serde(deserialize_with = "crate::http::types::whole_ids")]
    #[schema(schema_with = super::types::id_list_schema)]
    issue_ids: Vec<i64>,
    /// Seconds (default: the `content_gen_timeout_s` setting). Not with
    /// `deadline`.
    #[schema(exclusive_minimum = 0, maximum = 86400)]
    timeout_s: Option<f64>,
    /// When the wait ends, instead of `timeout_s`: RFC 3339, at most a day
    /// ahead; one already past decides at once.
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[schema(schema_with = super::types::deadline_schema)]
    deadline: Option<OffsetDateTime>,
    /// How many targets must be `DONE` at the deadline for `timeout_pass`
    /// (default: the `content_gen_min_completion` setting).
    #[serde(default, deserialize_with = "crate::http::types::whole_option")]
    #[schema(minimum = 0, maximum = 1000)]
    min_completion: Option<i64>,
}

/// The smart wait: answers the moment the outcome is decided.
#[utoipa::path(post, path = "/waits", request_body = WaitBody, tag = "generation",
    responses((status = 200, body = WaitReport, description = "The outcome"),
              (status = 400, body = ErrorBody, description = "The body is not JSON, or gives both `timeout_s` and `deadline`"),
              (status = 404, body = ErrorBody, description = "Unknown issue ids")))]
pub async fn wait_for(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<WaitBody>,
) -> Result<Json<WaitReport>, ApiError> {
    input::check_ids("issue_ids", &body.issue_ids)?;
    let settings = state.settings.get().await?;
    let timeout = match (body.timeout_s, body.deadline) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "give timeout_s or deadline, not both",
            ))
        }
        (None, Some(deadline)) => {
            if !input::COLLECTED_YEARS.contains(&deadline.year()) {
                return Err(ApiError::unprocessable(format!(
                    "deadline must be in the years {} to {}, got {deadline}",
                    input::COLLECTED_YEARS.start(),
                    input::COLLECTED_YEARS.end()
                )));
            }
            let left = wait::time_until(deadline);
            if left > std::time::Duration::from_secs(MAX_TIMEOUT_S) {
                return Err(ApiError::unprocessable(format!(
                    "deadline must be at most {MAX_TIMEOUT_S} s ahead, got {left:.0?} ahead"
                )));
            }
            left
        }
        (None, None) => settings.wait_timeout(),
        (Some(t), None) if t.is_finite() && t > 0.0 && t <= MAX_TIMEOUT_S as f64 => {
            std::time::Duration::from_secs_f64(t)
        }
        (Some(t), None) => {
            return Err(ApiError::unprocessable(format!(
                "timeout_s must be more than 0 and at most {MAX_TIMEOUT_S}, got {t}"
            )))
        }
    };
    let min_completion = match body.min_completion {
        None => settings.content_gen_min_completion.max(0) as usize,
        Some(n) if (0..=input::MAX_IDS as i64).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::unprocessable(format!(
                "min_completion must be between 0 and {}, got {n}",
                input::MAX_IDS
            )))
        }
    };
    let request = WaitRequest {
        issue_ids: body.issue_ids,
        timeout,
        min_completion,
        max_attempts: settings.max_attempts as i32,
    };
    // If the client goes away, axum drops this future and the wait with it.
    match wait::smart_wait(&state.hub, request, &state.shutdown).await {
        Ok(report) => Ok(Json(report)),
        Err(WaitError::UnknownIds(ids)) => {
            Err(ApiError::NotFound(format!("unknown issue ids: {ids:?}")))
        }
        Err(WaitError::ShuttingDown) => Err(ApiError::ShuttingDown),
        Err(WaitError::Db(e)) => Err(e.into()),
        Err(e) => Err(ApiError::Internal(e.to_string())),
    }
}
