//! `GET /healthz` (the process answers) and `GET /readyz` (the database is
//! reachable and the listener is connected, and the instance is not
//! draining).

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;

use super::AppState;
use crate::db::tls::SessionSecurity;

/// The answer of `GET /healthz`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Health {
    /// Always `ok`.
    pub status: String,
}

/// The answer of `GET /readyz`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Readiness {
    /// A pooled session answered.
    pub database: bool,
    /// The database takes writes (not read-only).
    pub writable: bool,
    /// The listener is connected and receives notifications.
    pub listener: bool,
    /// How the sessions are protected (`null` before the first one).
    pub sessions: Sessions,
    /// Why the instance is not ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How the pooled and the direct database sessions are protected.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Sessions {
    pub pooled: Option<SessionSecurity>,
    pub direct: Option<SessionSecurity>,
}

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
}

/// Liveness.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, body = Health, description = "Alive")))]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
    })
}

/// Readiness: the instance is not draining, the database answers and
/// takes writes, the listener is connected and receives notifications,
/// and the log has not gone back behind what this instance published. Also says how the database
/// sessions are protected.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses((status = 200, body = Readiness, description = "Ready"),
              (status = 503, body = Readiness, description = "Not ready; `error` says why")))]
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Readiness>) {
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
    let draining = state.draining.is_cancelled();
    let ready = database && writable && listener && log_ends_before.is_none() && !draining;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let error = if draining {
        Some("draining: this instance is stopping".to_string())
    } else if let Some(end) = log_ends_before {
        Some(format!(
            "the transition log now ends at seq {end}, before what this instance published (a restored or truncated log): restart it"
        ))
    } else if database && !writable {
        Some(
            "the database accepts no writes (read-only: a failover in progress, or a standby)"
                .to_string(),
        )
    } else if let (false, Some(problem)) = (listener, problem) {
        Some(format!("listener: {problem}"))
    } else if !ready {
        Some("not ready".to_string())
    } else {
        None
    };
    let body = Readiness {
        database,
        writable,
        listener,
        sessions: Sessions {
            pooled: state.pool.endpoint().security(),
            direct: state.hub.direct().security(),
        },
        error,
    };
    (status, Json(body))
}
