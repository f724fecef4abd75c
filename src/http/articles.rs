//! `POST /ai-articles`: claim issues for generation. The claimable ones
//! (`PENDING` or `FAILED`, not locked by a concurrent claim) are claimed
//! through `SKIP LOCKED` and handed to this instance's generator; the
//! answer is 202 with what was claimed and skipped, or 409 when nothing was.
//!
//! Two shortcuts keep hopeless requests (most of them, when batches overlap)
//! off the claim path, whose transactions queue behind each other's commits:
//! ids the instance already knows to be `DONE` ([`crate::done_issues`]) are
//! skipped without asking the database, and the rest are first read from a
//! snapshot without locks; if none of them is `PENDING` or `FAILED` there,
//! the answer is 409 without a claim (the answer is true at that snapshot).
//! `DONE` statuses read there are remembered.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;

use super::error::{ApiError, ApiJson};
use super::AppState;
use crate::db::issue::{self, ClaimScope};
use crate::input;
use crate::status::Status;

pub fn router() -> Router<AppState> {
    Router::new().route("/ai-articles", post(request_articles))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ArticleRequest {
    issue_ids: Vec<i64>,
}

/// Whether any of `ids` is `PENDING` or `FAILED` in a snapshot read now;
/// remembers those seen `DONE`.
async fn any_claimable(state: &AppState, ids: &[i64]) -> Result<bool, ApiError> {
    let client = state.pool.get().await.map_err(crate::db::DbError::from)?;
    let statuses = issue::statuses(&client, ids).await?;
    let mut claimable = false;
    for (id, status) in statuses {
        match status {
            Status::Done => state.done.insert(id),
            Status::Pending | Status::Failed => claimable = true,
            Status::InProgress => {}
        }
    }
    Ok(claimable)
}

/// Claim issues for generation (`FOR NO KEY UPDATE SKIP LOCKED`).
#[utoipa::path(post, path = "/ai-articles", request_body = ArticleRequest, tag = "generation",
    responses((status = 202, description = "`{\"claimed\":[..],\"skipped\":[..]}`; generated in the background"),
              (status = 409, description = "nothing was claimable; same fields plus `error`"),
              (status = 422, description = "invalid id list")))]
pub async fn request_articles(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<ArticleRequest>,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    input::check_ids("issue_ids", &request.issue_ids)?;
    let (open, done) = state.done.split(&request.issue_ids);
    if !done.is_empty() {
        crate::metrics::claims_skipped_known_done(done.len());
    }
    let (claimed, mut skipped) = if open.is_empty() || !any_claimable(&state, &open).await? {
        (Vec::new(), [open, done].concat())
    } else {
        let settings = state.settings.get().await?;
        let outcome = state
            .claimer
            .claim(open, settings.lease(), ClaimScope::Claimable)
            .await?;
        let mut skipped = outcome.skipped;
        skipped.extend(done);
        (outcome.claimed, skipped)
    };
    skipped.sort_unstable();
    skipped.dedup();
    let body = serde_json::json!({
        "claimed": claimed.iter().map(|c| c.id).collect::<Vec<_>>(),
        "skipped": skipped,
    });
    if claimed.is_empty() {
        return Err(ApiError::Conflict(
            "none of the requested issues is claimable (each is in progress, done, or unknown)"
                .into(),
            body,
        ));
    }
    state.generator.submit(claimed);
    Ok((StatusCode::ACCEPTED, Json(body)))
}
