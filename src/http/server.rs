//! The HTTP server: accepts connections and serves each as HTTP/1.1 with
//! hyper, every connection calling the one router.
//!
//! Not `axum::serve`: it first reads a few bytes of every connection to
//! tell HTTP/2 from HTTP/1.1, and hyper, handed them back, grows the
//! connection's read buffer from 8 to 16 KB, which each open request (a
//! smart wait, an event stream) then holds for as long as it is open.
//! The service speaks HTTP/1.1 only, so here a connection is HTTP/1.1 from
//! its first byte.
//!
//! Once `stop` is cancelled, nothing new is accepted; each open connection
//! finishes the request in hand and closes (hyper's graceful shutdown), and
//! [`serve`] returns when all have. Before that, open connections linger
//! for [`LINGER`]: hyper closes a connection that looks idle at once, and a
//! request its client had just written would be lost unread; in the
//! meantime every answer says `Connection: close`.

use std::io;
use std::time::Duration;

use axum::http::{header, HeaderValue};
use axum::response::Response;
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::Request;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// How long accepting rests after an error that is not one connection's
/// (out of file descriptors, say), so the loop does not spin on it.
const ACCEPT_ERROR_REST: Duration = Duration::from_secs(1);

/// How long open connections may still bring a request after `stop`.
pub const LINGER: Duration = Duration::from_millis(500);

/// Serves `app` on `listener` until `stop`, then drains (see the module
/// docs).
pub async fn serve(listener: TcpListener, app: Router, stop: CancellationToken) {
    let connections = GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) if is_one_connections(&e) => continue,
            Err(e) => {
                tracing::error!(error = %e, "cannot accept connections; trying again in a second");
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(ACCEPT_ERROR_REST) => continue,
                }
            }
        };
        // A small write (an SSE event) goes out at once instead of waiting
        // for the client's delayed ACK (up to 40 ms).
        let _ = tcp.set_nodelay(true);
        // Once stopping, every answer closes its connection. Mapped in
        // place, not by a middleware: nothing boxed per request.
        let closing = stop.clone();
        let service = ServiceExt::<Request<Incoming>>::map_response(
            app.clone(),
            move |mut response: Response| {
                if closing.is_cancelled() {
                    response
                        .headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                response
            },
        );
        let connection = http1::Builder::new()
            .serve_connection(TokioIo::new(tcp), TowerToHyperService::new(service));
        let connection = connections.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    tokio::time::sleep(LINGER).await;
    connections.shutdown().await;
}

/// Errors that end one connection before it was accepted, not the listener.
fn is_one_connections(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use std::sync::Arc;
    use tokio::sync::Notify;

    /// Once stopped: a request in hand is answered, a new connection is
    /// refused, and `serve` returns when the last connection closed.
    #[tokio::test]
    async fn stopping_drains_the_request_in_hand_and_accepts_nothing_new() {
        let release = Arc::new(Notify::new());
        let entered = Arc::new(Notify::new());
        let app = Router::new().route(
            "/slow",
            get({
                let (release, entered) = (release.clone(), entered.clone());
                move || async move {
                    entered.notify_one();
                    release.notified().await;
                    "done"
                }
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve(listener, app, stop.clone()));
        let http = reqwest::Client::new();
        let slow = tokio::spawn(http.get(format!("http://{addr}/slow")).send());
        entered.notified().await;
        stop.cancel();
        // The listener is closed once the loop has seen the stop (a
        // connection made just before is reset, not served).
        loop {
            match tokio::net::TcpStream::connect(addr).await {
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => break,
                _ => tokio::task::yield_now().await,
            }
        }
        assert!(!server.is_finished(), "a request is still in hand");
        release.notify_one();
        let answer = slow.await.unwrap().unwrap();
        assert_eq!(answer.status(), 200);
        assert_eq!(answer.text().await.unwrap(), "done");
        server.await.unwrap();
    }
}
