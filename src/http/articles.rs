//! `POST /ai-articles`: claim issues for generation. The claimable ones
//! (`PENDING` or `FAILED`, not locked by a concurrent claim) are claimed
//! through `SKIP LOCKED` and handed to this instance's generator; the
//! answer is 202 with what was claimed and skipped, or 409 when nothing was.
//!
//! Ids the instance already knows to be `DONE` ([`crate::claims::known_done`]) are
//! skipped without asking the database: when batches overlap, most requested
//! ids are. The rest go to the [`crate::claims::claim::Claimer`], which merges
//! concurrent requests into one statement; the `DONE` ids it reports are
//! remembered. What a claim took reaches the generator even if the client
//! hangs up before the answer.
//!
//! `"priority"` (`briefing`, the default, or `feed`) is the class the
//! claimed issues' LLM calls wait in: while a briefing call waits on any
//! instance, no feed call starts ([`crate::generation::budget`]); it is
//! remembered for the issues' retries.
//!
//! An instance holding `max_backlog` (`NEWSNACK_MAX_BACKLOG`, 10,000)
//! unfinished claims turns new requests away with 503 and `Retry-After`,
//! claiming nothing: every claim it holds is heartbeated until written, so
//! an unbounded backlog would end in leases running out before their turn
//! (each spending an attempt). Another instance, or a later request, takes
//! them. The limit is soft: a request let in may take the backlog past it
//! by its own size (at most 1,000), and so may requests let in together.
//! Retries and pipeline runs are not turned away: a retry re-claims an
//! issue that left the backlog when it failed, and a run claims `top_k`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;

use super::error::{ApiError, ApiJson};
use super::types::{ClaimConflict, ErrorBody};
use super::AppState;
use crate::db::issue::ClaimScope;
use crate::http::types::ClaimAnswer;
use crate::input;
use crate::model::llm::Priority;

pub fn router() -> Router<AppState> {
    Router::new().route("/ai-articles", post(request_articles))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ArticleRequest {
    #[serde(deserialize_with = "crate::http::types::whole_ids")]
    #[schema(schema_with = super::types::id_list_schema)]
    issue_ids: Vec<i64>,
    /// Which LLM calls go first: `briefing` (the default) before `feed`,
    /// across every instance.
    #[serde(default)]
    priority: Option<Priority>,
}

/// Claim issues for generation (`FOR NO KEY UPDATE SKIP LOCKED`).
#[utoipa::path(post, path = "/ai-articles", request_body = ArticleRequest, tag = "generation",
    responses((status = 202, body = ClaimAnswer, description = "Claimed; generated in the background"),
              (status = 409, body = ClaimConflict, description = "Nothing was claimable"),
              (status = 503, body = ErrorBody, description = "The database is out of reach, out of connections or read-only, the server is shutting down, or this instance holds `NEWSNACK_MAX_BACKLOG` unfinished claims; nothing claimed, try again after `Retry-After` seconds",
               headers(("Retry-After" = u64, description = "Seconds to wait before trying again")))))]
pub async fn request_articles(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<ArticleRequest>,
) -> Result<(StatusCode, Json<ClaimAnswer>), ApiError> {
    input::check_ids("issue_ids", &request.issue_ids)?;
    let priority = request.priority.unwrap_or(Priority::Briefing);
    let (open, done, known_since) = state.done.split(&request.issue_ids);
    if !done.is_empty() {
        crate::metrics::claims_skipped_known_done(done.len());
    }
    let (claimed, mut skipped) = if open.is_empty() {
        (Vec::new(), done)
    } else {
        let backlog = state.generator.backlog();
        if backlog >= state.max_backlog {
            return Err(ApiError::Overloaded(format!(
                "this instance has {backlog} claimed issues still to write (limit {}); try again later",
                state.max_backlog
            )));
        }
        let settings = state.settings.get().await?;
        // Claimed issues go to the generator from a task of their own: a
        // client that disconnects mid-claim drops this handler, and the
        // issues its claim took must still be generated.
        let (claimer, generator) = (state.claimer.clone(), state.generator.clone());
        let outcome = tokio::spawn(crate::telemetry::in_current_context(async move {
            let mut outcome = claimer
                .claim(open, settings.lease(), ClaimScope::Claimable)
                .await?;
            let ids = outcome.claimed_ids();
            generator
                .submit_at(std::mem::take(&mut outcome.claimed), priority)
                .await;
            Ok::<_, crate::db::DbError>((ids, outcome))
        }))
        .await
        .map_err(|e| ApiError::Internal(format!("the claim task failed: {e}")))??;
        let (ids, outcome) = outcome;
        for &id in &outcome.done {
            state.done.insert(id, known_since);
        }
        (ids, [outcome.skipped, done].concat())
    };
    skipped.sort_unstable();
    skipped.dedup();
    let answer = ClaimAnswer { claimed, skipped };
    if answer.claimed.is_empty() {
        return Err(ApiError::Conflict(
            "none of the requested issues is claimable (each is in progress, done, or unknown)"
                .into(),
            serde_json::to_value(&answer).unwrap_or_default(),
        ));
    }
    Ok((StatusCode::ACCEPTED, Json(answer)))
}
