//! `POST /issues` (add issues), `GET /issues/{id}` (one issue) and
//! `POST /issues/{id}/cancel`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;

use super::error::{positive_id, ApiError, ApiJson, ApiPath};
use super::types::ErrorBody;
use super::AppState;
use crate::db::issue::{self, IssueView, NewIssue};
use crate::http::types::{AddedIssues, NewIssueJson};
use crate::input;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/issues", post(add_issues))
        .route("/issues/{id}", get(show_issue))
        .route("/issues/{id}/cancel", post(cancel_issue))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddIssues {
    #[schema(schema_with = super::types::new_issues_schema)]
    issues: Vec<NewIssueJson>,
}

/// Add issues (1 to 1000); an item whose `source_key` is already there
/// adds nothing and answers the issue that holds it.
#[utoipa::path(post, path = "/issues", request_body = AddIssues, tag = "issues",
    responses((status = 201, body = AddedIssues, description = "Something was added: one id per item, in input order"),
              (status = 200, body = AddedIssues, description = "Nothing was added: every item's key was already there"),
              (status = 422, body = ErrorBody, description = "Invalid issues (outside the schema, or a blank title); nothing added")))]
pub async fn add_issues(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<AddIssues>,
) -> Result<(StatusCode, Json<AddedIssues>), ApiError> {
    let new: Vec<NewIssue> = request.issues.into_iter().map(NewIssue::from).collect();
    input::check_new_issues(&new)?;
    let client = state.pool.get().await.map_err(crate::db::DbError::from)?;
    let traceparent = crate::telemetry::current_traceparent();
    let added = issue::add_issues(&client, &new, traceparent.as_deref()).await?;
    let status = if added.added_any() {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(AddedIssues {
            ids: added.ids,
            existing: added.existing,
        }),
    ))
}

/// One issue.
#[utoipa::path(get, path = "/issues/{id}", tag = "issues",
    params(("id" = i64, Path, minimum = 1, description = "issue id")),
    responses((status = 200, body = IssueView, description = "The issue"),
              (status = 404, body = ErrorBody, description = "No such issue")))]
pub async fn show_issue(
    State(state): State<AppState>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Json<IssueView>, ApiError> {
    let id = positive_id("issue id", &raw)?;
    let client = state.pool.get().await.map_err(crate::db::DbError::from)?;
    issue::get_issue(&client, id)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no issue with id {id}")))
}

/// Cancel an issue: it ends `FAILED` with `last_error` `cancelled` and no
/// automatic retry; an article being written is abandoned.
#[utoipa::path(post, path = "/issues/{id}/cancel", tag = "issues",
    params(("id" = i64, Path, minimum = 1, description = "issue id")),
    responses((status = 200, body = IssueView, description = "The cancelled issue (also when it was cancelled already)"),
              (status = 404, body = ErrorBody, description = "No such issue"),
              (status = 409, body = ErrorBody, description = "The issue is DONE: its article is written")))]
pub async fn cancel_issue(
    State(state): State<AppState>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Json<IssueView>, ApiError> {
    let id = positive_id("issue id", &raw)?;
    let mut client = state.pool.get().await.map_err(crate::db::DbError::from)?;
    let outcome = issue::cancel(&mut client, &[id]).await?;
    if !outcome.done.is_empty() {
        return Err(ApiError::Conflict(
            format!("issue {id} is DONE: its article is written"),
            serde_json::json!({ "status": "DONE" }),
        ));
    }
    issue::get_issue(&client, id)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no issue with id {id}")))
}
