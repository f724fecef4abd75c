//! The one error type of the HTTP API: every failure becomes a status code
//! and a `{"error": "..."}` body. Internal details are logged, never sent
//! (a stored value the service cannot read is named, so it can be mended).
//! A 503 (no database connection within the pool's wait timeout, the
//! database down or read-only, or shutdown) also says `Retry-After: 1`: the
//! condition is usually over in moments, and the request changed nothing.

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;

use crate::db::DbError;
use crate::input::InvalidInput;

/// The `Retry-After` of a 503, in seconds.
pub const RETRY_AFTER_S: &str = "1";
/// The `Retry-After` of a 503 for an instance with too much work queued:
/// about how long a few generations take.
pub const OVERLOADED_RETRY_AFTER_S: &str = "5";

/// An API failure.
#[derive(Debug)]
pub enum ApiError {
    /// 400/413/415/422 and friends, with a message for the client.
    Client(StatusCode, String),
    /// 409 with extra fields next to `error`.
    Conflict(String, serde_json::Value),
    NotFound(String),
    /// 401: no token, or a wrong one ([`super::auth`]).
    Unauthorized,
    /// 403: a token that does not open the request (a read token on a
    /// write).
    Forbidden,
    /// 503 with `Retry-After`: the database is out of reach or out of
    /// connections.
    Unavailable(String),
    /// 503 with `Retry-After`: the database takes no writes (a failover in
    /// progress, or a primary demoted to a standby).
    ReadOnly(String),
    /// 503 with `Retry-After`: the server is shutting down (another
    /// instance, or this one restarted, can take the request).
    ShuttingDown,
    /// 503 with `Retry-After` and this message: this instance has more
    /// work than it takes on.
    Overloaded(String),
    /// 500 with this message: a stored row the service cannot answer with
    /// (a date written with plain SQL that it cannot represent). The
    /// message names the row and the column, so an operator can mend it.
    Unreadable(String),
    /// 500: logged in full, answered briefly.
    Internal(String),
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::Client(StatusCode::BAD_REQUEST, message.into())
    }

    pub fn unprocessable(message: impl Into<String>) -> ApiError {
        ApiError::Client(StatusCode::UNPROCESSABLE_ENTITY, message.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, body) = match self {
            ApiError::Client(status, message) => (status, serde_json::json!({ "error": message })),
            ApiError::Conflict(message, extra) => {
                let mut body = serde_json::json!({ "error": message });
                if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
                    body.extend(extra.clone());
                }
                (StatusCode::CONFLICT, body)
            }
            ApiError::NotFound(message) => (
                StatusCode::NOT_FOUND,
                serde_json::json!({ "error": message }),
            ),
            ApiError::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                serde_json::json!({ "error": "missing or wrong bearer token" }),
            ),
            ApiError::Forbidden => (
                StatusCode::FORBIDDEN,
                serde_json::json!({ "error": "this token does not allow this request (a read token only reads)" }),
            ),
            ApiError::Unavailable(message) => {
                tracing::warn!(%message, "answering 503");
                return try_again(
                    "the database is busy or unreachable; try again",
                    RETRY_AFTER_S,
                );
            }
            ApiError::ReadOnly(message) => {
                tracing::warn!(%message, "answering 503: the database is read-only");
                return try_again(
                    "the database accepts no writes right now (read-only: a failover in progress?); try again",
                    RETRY_AFTER_S,
                );
            }
            ApiError::ShuttingDown => {
                return try_again("the server is shutting down; try again", RETRY_AFTER_S)
            }
            ApiError::Overloaded(message) => {
                tracing::warn!(%message, "answering 503");
                return try_again(&message, OVERLOADED_RETRY_AFTER_S);
            }
            ApiError::Unreadable(message) => {
                tracing::error!(%message, "answering 500");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    serde_json::json!({ "error": message }),
                )
            }
            ApiError::Internal(message) => {
                tracing::error!(%message, "answering 500");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    serde_json::json!({ "error": "internal error" }),
                )
            }
        };
        (status, Json(body)).into_response()
    }
}

/// A 503 saying `message`, with `Retry-After: seconds`.
fn try_again(message: &str, seconds: &'static str) -> Response {
    let retry_after = [(header::RETRY_AFTER, HeaderValue::from_static(seconds))];
    let body = serde_json::json!({ "error": message });
    (StatusCode::SERVICE_UNAVAILABLE, retry_after, Json(body)).into_response()
}

impl From<InvalidInput> for ApiError {
    fn from(e: InvalidInput) -> Self {
        ApiError::unprocessable(e.to_string())
    }
}

impl From<DbError> for ApiError {
    fn from(e: DbError) -> Self {
        use tokio_postgres::error::SqlState;
        match &e {
            DbError::Pool(_) | DbError::TimedOut(_) => ApiError::Unavailable(e.to_string()),
            _ if e.is_read_only() => ApiError::ReadOnly(e.to_string()),
            // A lost connection, a server shutting down or starting up.
            _ if e.ends_session() => ApiError::Unavailable(e.to_string()),
            DbError::Unreadable(message) => ApiError::Unreadable(message.clone()),
            _ if e.code() == Some(&SqlState::CHECK_VIOLATION) => {
                ApiError::unprocessable(e.server_message().unwrap_or("rejected by a database rule"))
            }
            _ => ApiError::Internal(e.to_string()),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        ApiError::Client(rejection.status(), rejection.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        ApiError::bad_request(rejection.body_text())
    }
}

/// `Json<T>` whose rejections answer in the API's error shape.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let Json(value) = Json::<T>::from_request(req, state).await?;
        Ok(ApiJson(value))
    }
}

/// `Path<T>` whose rejections (e.g. a segment that is not UTF-8) answer in
/// the API's error shape.
pub struct ApiPath<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiPath<T>
where
    S: Send + Sync,
    T: DeserializeOwned + Send,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(value) = Path::<T>::from_request_parts(parts, state).await?;
        Ok(ApiPath(value))
    }
}

/// A path id (`what`, e.g. "issue id") as a positive integer, or the
/// API's 400 saying what was wrong with it.
pub fn positive_id(what: &str, raw: &str) -> Result<i64, ApiError> {
    match raw.parse::<i64>() {
        Ok(id) if id > 0 => Ok(id),
        _ => Err(ApiError::bad_request(format!(
            "{what} must be a positive integer, got {raw:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_exhausted_pool_answers_503_with_retry_after_and_a_json_error() {
        let exhausted = DbError::Pool(deadpool_postgres::PoolError::Timeout(
            deadpool_postgres::TimeoutType::Wait,
        ));
        assert!(exhausted.is_pool_exhausted());
        let response = ApiError::from(exhausted).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], RETRY_AFTER_S);
        let body = axum::body::to_bytes(response.into_body(), 1024)
            .await
            .unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert!(body["error"].as_str().unwrap().contains("try again"));
    }
}
