//! `POST /today-newsnack` (assemble a briefing from exactly the given
//! issues), `GET /briefings/latest`, `GET /briefings/{id}` and
//! `GET /pipeline-runs` (the newest runs).

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;

use super::error::{positive_id, ApiError, ApiJson, ApiPath};
use super::types::{AssembleConflict, ErrorBody};
use super::AppState;
use crate::briefing::assembly::{self, AssembleError, Assembled};
use crate::db::{self, briefing::Briefing, pipeline_run::RunView, DbError};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/today-newsnack", post(assemble))
        .route("/briefings/latest", get(latest))
        .route("/briefings/{id}", get(by_id))
        .route("/pipeline-runs", get(recent_runs))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AssembleBody {
    #[serde(deserialize_with = "crate::http::types::whole_ids")]
    #[schema(schema_with = super::types::id_list_schema)]
    issue_ids: Vec<i64>,
}

/// Assemble a briefing from exactly these issues, in this order.
#[utoipa::path(post, path = "/today-newsnack", request_body = AssembleBody, tag = "briefings",
    responses((status = 201, body = Assembled, description = "The briefing, from exactly these issues (repeats dropped)"),
              (status = 409, body = AssembleConflict, description = "Some issue is not `DONE`, or `DONE` without an article; nothing published")))]
pub async fn assemble(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<AssembleBody>,
) -> Result<(StatusCode, Json<Assembled>), ApiError> {
    let settings = state.settings.get().await?;
    let client = state.pool.get().await.map_err(DbError::from)?;
    match assembly::assemble(&client, &body.issue_ids, &settings).await {
        Ok(assembled) => Ok((StatusCode::CREATED, Json(assembled))),
        Err(AssembleError::Unpublishable {
            not_done,
            without_article,
        }) => Err(ApiError::Conflict(
            assembly::unpublishable(&not_done, &without_article),
            serde_json::json!({ "not_done": not_done, "without_article": without_article }),
        )),
        Err(AssembleError::Input(e)) => Err(e.into()),
        Err(AssembleError::Db(e)) => Err(e.into()),
        Err(AssembleError::Setting(e)) => Err(ApiError::Unreadable(e.to_string())),
    }
}

/// The newest briefing.
#[utoipa::path(get, path = "/briefings/latest", tag = "briefings",
    responses((status = 200, body = Briefing, description = "The newest briefing"),
              (status = 404, body = ErrorBody, description = "None yet")))]
pub async fn latest(State(state): State<AppState>) -> Result<Json<Briefing>, ApiError> {
    find(&state, None).await
}

/// One briefing.
#[utoipa::path(get, path = "/briefings/{id}", tag = "briefings",
    params(("id" = i64, Path, minimum = 1, description = "briefing id")),
    responses((status = 200, body = Briefing, description = "The briefing"),
              (status = 404, body = ErrorBody, description = "No such briefing")))]
pub async fn by_id(
    State(state): State<AppState>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Json<Briefing>, ApiError> {
    let id = positive_id("briefing id", &raw)?;
    find(&state, Some(id)).await
}

async fn find(state: &AppState, id: Option<i64>) -> Result<Json<Briefing>, ApiError> {
    let client = state.pool.get().await.map_err(DbError::from)?;
    db::briefing::get(&client, id)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::NotFound("no such briefing".into()))
}

/// The 20 newest pipeline runs.
#[utoipa::path(get, path = "/pipeline-runs", tag = "briefings",
    responses((status = 200, body = [RunView], description = "The newest runs first")))]
pub async fn recent_runs(State(state): State<AppState>) -> Result<Json<Vec<RunView>>, ApiError> {
    let client = state.pool.get().await.map_err(DbError::from)?;
    Ok(Json(db::pipeline_run::recent(&client, 20).await?))
}
