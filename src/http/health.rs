//! `GET /healthz` (the process answers) and `GET /readyz` (the database is
//! reachable and the listener is connected).

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};

use super::AppState;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
}

/// Liveness.
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, description = "alive")))]
pub async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

/// Readiness: the database answers and takes writes, the listener is
/// connected and receives notifications, and the log has not gone back
/// behind what this instance published. Also says how the database
/// sessions are protected.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses((status = 200, description = "ready"), (status = 503, description = "not ready")))]
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<serde_json::Value>) {
    let (database, writable) = match state.pool.get().await {
        Ok(client) => match crate::db::accepts_writes(&client).await {
            Ok(writable) => (true, writable),
            Err(_) => (false, false),
        },
        Err(_) => (false, false),
    };
    let (listener, log_ends_before, problem) = {
        let status = state.hub.status();
        let status = status.borrow();
        (
            status.connected,
            status.log_ends_before,
            status.problem.clone(),
        )
    };
    let ready = database && writable && listener && log_ends_before.is_none();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut body = serde_json::json!({
        "database": database,
        "writable": writable,
        "listener": listener,
        "sessions": {
            "pooled": state.pool.endpoint().security(),
            "direct": state.hub.direct().security(),
        },
    });
    if let Some(end) = log_ends_before {
        body["error"] = serde_json::json!(format!(
            "the transition log now ends at seq {end}, before what this instance published (a restored or truncated log): restart it"
        ));
    } else if database && !writable {
        body["error"] = serde_json::json!(
            "the database accepts no writes (read-only: a failover in progress, or a standby)"
        );
    } else if let (false, Some(problem)) = (listener, problem) {
        body["error"] = serde_json::json!(format!("listener: {problem}"));
    } else if !ready {
        body["error"] = serde_json::json!("not ready");
    }
    (status, Json(body))
}
