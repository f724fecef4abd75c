//! `GET /`: the live dashboard page, embedded in the binary.
//! (Being implemented.)

use axum::Router;

use super::AppState;

pub fn router() -> Router<AppState> {
    Router::new()
}
