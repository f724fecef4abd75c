//! The HTTP API (axum): one router per resource, one [`ApiError`], the
//! shared [`AppState`]. [`router`] builds the whole app, so tests can drive
//! it with or without a socket.

pub mod articles;
pub mod auth;
pub mod briefings;
pub mod dashboard;
pub mod events;
pub mod error;
pub mod health;
pub mod issues;
pub mod waits;

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::Router;

pub use error::ApiError;

use crate::claim::Claimer;
use crate::db::DbPool;
use crate::listener::TransitionHub;
use crate::settings::SettingsCache;
use crate::worker::GeneratorHandle;

/// The largest request body accepted (1 MiB).
pub const BODY_LIMIT: usize = 1024 * 1024;

/// What every handler may use.
#[derive(Clone)]
pub struct AppState {
    pub pool: DbPool,
    pub hub: TransitionHub,
    pub claimer: Claimer,
    pub generator: GeneratorHandle,
    pub settings: Arc<SettingsCache>,
    /// Cancelled on shutdown: long requests (waits) end with 503.
    pub shutdown: tokio_util::sync::CancellationToken,
}

/// The whole API.
pub fn router(state: AppState) -> Router {
    Router::new()
        .merge(issues::router())
        .merge(articles::router())
        .merge(health::router())
        .merge(waits::router())
        .merge(briefings::router())
        .merge(events::router())
        .merge(dashboard::router())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(state)
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::NotFound(format!("no such endpoint: {}", uri.path()))
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::Client(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {}", uri.path()),
    )
}
