//! The HTTP API (axum): one router per resource, one [`ApiError`], the
//! shared [`AppState`] (the [`Services`] behind one `Arc`). [`router`]
//! builds the whole app, so tests can drive it with or without a socket.
//!
//! Around every route: an `x-request-id` (the client's, or a new UUID) set on
//! the request and echoed on the response, a request span carrying that id,
//! the method and the path (a child of the caller's W3C `traceparent`, which
//! the answer carries back: [`crate::telemetry::TraceContextLayer`]), and
//! the token check ([`auth`]). A handler that panics is answered 500
//! `{"error": ..}` (and
//! logged) rather than with a dropped connection. `GET /metrics` renders
//! [`crate::metrics`].

pub mod articles;
pub mod auth;
pub mod briefings;
pub mod dashboard;
pub mod error;
pub mod events;
pub mod health;
pub mod issues;
pub mod openapi;
pub mod server;
pub mod types;
pub mod waits;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderValue, Request, Response};
use axum::routing::get;
use axum::Router;
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;
use tower_http::validate_request::ValidateRequestHeaderLayer;

pub use error::ApiError;

use crate::claims::claim::Claimer;
use crate::claims::known_done::DoneIssues;
use crate::db::DbPool;
use crate::events::hub::EventHub;
use crate::generation::worker::GeneratorHandle;
use crate::settings::SettingsCache;

/// The largest request body accepted (1 MiB).
pub const BODY_LIMIT: usize = 1024 * 1024;

/// What every handler may use, behind one `Arc`: axum clones the state for
/// every request, and cloning [`Services`] itself (two pools, a
/// cancellation token, the token's text) showed in the claim path's CPU
/// profile.
#[derive(Clone)]
pub struct AppState(Arc<Services>);

impl std::ops::Deref for AppState {
    type Target = Services;

    fn deref(&self) -> &Services {
        &self.0
    }
}

/// The service's parts the handlers use.
pub struct Services {
    pub pool: DbPool,
    pub hub: EventHub,
    pub claimer: Claimer,
    /// Issues known to be `DONE`: claims for nothing else skip the database.
    pub done: DoneIssues,
    pub generator: GeneratorHandle,
    pub settings: Arc<SettingsCache>,
    /// Cancelled on shutdown: long requests (waits) end with 503.
    pub shutdown: tokio_util::sync::CancellationToken,
    /// Cancelled when the instance is asked to drain: `/readyz` answers
    /// 503, everything else goes on.
    pub draining: tokio_util::sync::CancellationToken,
    /// The tokens requests must present ([`auth`]).
    pub tokens: auth::Tokens,
    /// `POST /ai-articles` answers 503 while the generator holds this many
    /// unfinished claims.
    pub max_backlog: usize,
}

/// The whole API.
pub fn router(services: Services) -> Router {
    let state = AppState(Arc::new(services));
    let access = auth::Access::new(&state.tokens);
    let routes = Router::new()
        .merge(issues::router())
        .merge(articles::router())
        .merge(health::router())
        .merge(waits::router())
        .merge(briefings::router())
        .merge(events::router())
        .merge(dashboard::router())
        .merge(openapi::router(state.tokens.guard_the_api()))
        .route("/metrics", get(prometheus_metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state);
    // Around the routed app as one service, outermost first: the id is set,
    // then the span opens, and the id is copied onto every response (401s
    // included). Not `Router::layer`, which wraps every route on its own
    // and boxes each layer's future per request: an open request (a wait)
    // held them all.
    let app = ServiceBuilder::new()
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(request_span)
                .on_response(log_response),
        )
        .layer(crate::telemetry::TraceContextLayer)
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(CatchPanicLayer::custom(panic_response))
        .layer(ValidateRequestHeaderLayer::custom(access))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .service(routes);
    Router::new().fallback_service(app)
}

/// `GET /metrics`: the Prometheus text format. The issues per status, the
/// newest published scheduled run, the day's tokens and the providers'
/// state are the cluster's, read from the database at each scrape; a
/// database out of reach leaves them as last read rather than failing the
/// scrape.
async fn prometheus_metrics(
    State(state): State<AppState>,
) -> Result<Response<axum::body::Body>, ApiError> {
    crate::metrics::listener_connected(state.hub.status().borrow().connected);
    if let Ok(settings) = state.settings.get().await {
        crate::metrics::generation_paused(settings.generation_paused);
    }
    let day = async {
        let client = state.pool.get().await?;
        let counts = crate::db::issue::count_by_status(&client).await?;
        let published = crate::db::pipeline_run::last_published_tick(&client).await?;
        let day = crate::db::llm_budget::day(&client).await?;
        let providers = crate::db::llm_budget::providers(&client).await?;
        Ok::<_, crate::db::DbError>((counts, published, day, providers))
    };
    match tokio::time::timeout(std::time::Duration::from_secs(2), day).await {
        Ok(Ok((counts, published, day, providers))) => {
            crate::metrics::issues(&counts);
            crate::metrics::pipeline_published(published);
            use crate::db::llm_budget::Held;
            crate::metrics::llm_day(
                day.tokens,
                day.budget,
                day.held.is_some(),
                day.held == Some(Held::All),
            );
            for p in providers {
                let up = match p.state {
                    "up" => 1.0,
                    "probing" => 0.5,
                    _ => 0.0,
                };
                crate::metrics::llm_provider(p.provider, up, p.failures, p.in_flight);
            }
        }
        Ok(Err(e)) => tracing::debug!(error = %e, "/metrics: cannot read the cluster's figures"),
        Err(_) => tracing::debug!("/metrics: the cluster's figures took too long to read"),
    }
    let text = crate::metrics::render().map_err(|e| ApiError::Internal(e.to_string()))?;
    let mut response = Response::new(axum::body::Body::from(text));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
    );
    Ok(response)
}

/// Paths polled by probes and scrapers: logged at debug, not info.
const QUIET_PATHS: &[&str] = &["/healthz", "/readyz", "/metrics"];

/// The span every request runs in: its id, method and path.
fn request_span<B>(request: &Request<B>) -> tracing::Span {
    let request_id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let method = request.method().as_str();
    let path = request.uri().path();
    let span = if QUIET_PATHS.contains(&path) {
        tracing::debug_span!("request", request_id, method, path)
    } else {
        tracing::info_span!("request", request_id, method, path)
    };
    if let Some(caller) = crate::telemetry::caller_context(request.headers()) {
        crate::telemetry::adopt_caller(&span, &caller);
    }
    span
}

/// The target of the `answered` lines: logged, never exported (the
/// request span has the status itself, [`crate::telemetry`]).
pub const ANSWERED: &str = "newsnack::http::answered";

/// One line per answered request, in its span (so with its id).
fn log_response<B>(response: &Response<B>, latency: Duration, span: &tracing::Span) {
    let status = response.status().as_u16();
    let latency_ms = latency.as_secs_f64() * 1000.0;
    let quiet = span
        .metadata()
        .is_none_or(|m| *m.level() > tracing::Level::INFO);
    if quiet {
        tracing::debug!(target: ANSWERED, status, latency_ms, "answered");
    } else {
        tracing::info!(target: ANSWERED, status, latency_ms, "answered");
    }
}

/// The answer to a request whose handler panicked: the API's 500, with the
/// panic's message in the log. The last line of defence: handlers return
/// errors rather than panic.
fn panic_response(panic: Box<dyn std::any::Any + Send + 'static>) -> Response<axum::body::Body> {
    let detail = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    axum::response::IntoResponse::into_response(ApiError::Internal(format!(
        "a handler panicked: {detail}"
    )))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A panicking handler is answered 500 with a JSON error, and the
    /// server goes on answering.
    #[tokio::test]
    async fn a_panicking_handler_gets_a_json_500_not_a_dropped_connection() {
        let app: Router = Router::new()
            .route("/boom", get(|| async { panic!("boom") as &'static str }))
            .route("/fine", get(|| async { "fine" }))
            .layer(CatchPanicLayer::custom(panic_response));
        let socket = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", socket.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(socket, app).await });
        let http = reqwest::Client::new();
        let boom = http.get(format!("{base}/boom")).send().await.unwrap();
        assert_eq!(boom.status(), reqwest::StatusCode::INTERNAL_SERVER_ERROR);
        let body: serde_json::Value = boom.json().await.unwrap();
        assert_eq!(body, serde_json::json!({ "error": "internal error" }));
        let fine = http.get(format!("{base}/fine")).send().await.unwrap();
        assert_eq!(fine.status(), reqwest::StatusCode::OK);
    }
}
