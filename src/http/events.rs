//! `GET /events`: Server-Sent Events over the gapless transition stream.
//! (Being implemented.)

use axum::Router;

use super::AppState;

pub fn router() -> Router<AppState> {
    Router::new()
}
