//! `GET /`: the live dashboard page, and `GET /dashboard.json`: its state.
//!
//! The page (plain HTML, CSS and JavaScript under `src/http/dashboard/`) is
//! embedded in the binary with `include_str!`: no build step, no CDN. It
//! loads `/dashboard.json` — counts per status, claims in flight, the newest
//! transitions, recent pipeline runs, the latest briefing and the LLM
//! budget, all as of one log position `last_seq` — then follows `GET /events?since=<last_seq>`,
//! so no transition falls between the snapshot and the stream. Counts move
//! with each event's `from`/`to`; the other panels are re-fetched from
//! `/dashboard.json`, debounced, when events arrive.

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};

use super::error::ApiError;
use super::AppState;
use crate::db::{self, dashboard::Snapshot, DbError};

const INDEX_HTML: &str = include_str!("dashboard/index.html");
const APP_JS: &str = include_str!("dashboard/app.js");
const STYLE_CSS: &str = include_str!("dashboard/style.css");

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/", get(index))
        .route("/dashboard/app.js", get(app_js))
        .route("/dashboard/style.css", get(style_css))
        .route("/dashboard.json", get(snapshot))
}

/// An embedded asset with its content type; revalidated on every load so a
/// new binary's page is picked up at once.
fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
}

async fn index() -> impl IntoResponse {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

async fn app_js() -> impl IntoResponse {
    asset("text/javascript; charset=utf-8", APP_JS)
}

async fn style_css() -> impl IntoResponse {
    asset("text/css; charset=utf-8", STYLE_CSS)
}

async fn snapshot(State(state): State<AppState>) -> Result<impl IntoResponse, ApiError> {
    let settings = state.settings.get().await?;
    // Today in the readers' time zone (UTC if the binary cannot read it).
    let zone = settings.time_zone().unwrap_or(chrono_tz::UTC);
    let today_began = crate::briefing::assembly::day_began(zone, time::OffsetDateTime::now_utc());
    let mut client = state.pool.get().await.map_err(DbError::from)?;
    let snapshot: Snapshot =
        db::dashboard::snapshot(&mut client, Default::default(), today_began).await?;
    Ok(([(header::CACHE_CONTROL, "no-store")], Json(snapshot)))
}
