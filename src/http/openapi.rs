//! `GET /openapi.json`: the API described as OpenAPI 3, generated from the
//! handlers' annotations so it cannot drift from the code.

use axum::routing::get;
use axum::{Json, Router};
use utoipa::OpenApi;

use super::AppState;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "newsnack",
        description = "The content pipeline of a daily news briefing."
    ),
    paths(
        super::issues::add_issues,
        super::issues::show_issue,
        super::articles::request_articles,
        super::waits::wait_for,
        super::briefings::assemble,
        super::briefings::latest,
        super::briefings::by_id,
        super::briefings::recent_runs,
        super::health::healthz,
        super::health::readyz,
    ),
    components(schemas(
        crate::db::issue::IssueView,
        crate::status::Status,
        crate::api_types::NewIssueJson,
        crate::wait::WaitReport,
        crate::wait::WaitOutcome,
        crate::db::briefing::Briefing,
        crate::db::pipeline_run::RunView,
        crate::briefing::Assembled,
    ))
)]
pub struct ApiDoc;

pub fn router() -> Router<AppState> {
    Router::new().route("/openapi.json", get(|| async { Json(ApiDoc::openapi()) }))
}
