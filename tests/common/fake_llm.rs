//! A local fake of an OpenAI-compatible chat-completions server, for tests:
//! an axum server on 127.0.0.1 (a free port) that answers every
//! `POST /v1/chat/completions` as a test script says, and records what it
//! was sent (count, last request body, last `Authorization` header, and
//! every arrival with its time and how many calls were in flight, and every
//! request whose client hung up before the answer). It can be stopped (connections refused) and restarted on the same address,
//! to play an LLM that is down for a while.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How the fake answers one request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// 200 with a well-formed completion whose content is this text.
    Ok(String),
    /// Like `Ok`, after simulated model latency.
    Slow {
        delay: std::time::Duration,
        content: String,
    },
    /// 429 with `Retry-After: <retry_after_s>`.
    RateLimited { retry_after_s: u64 },
    /// Like `Ok`, reporting `usage` as the answer's `usage` (`Null`: no
    /// `usage` at all).
    WithUsage { content: String, usage: Value },
    /// 500 with a JSON error body.
    ServerError,
    /// Like `Ok`, once `open` turns true.
    Gated {
        open: tokio::sync::watch::Receiver<bool>,
        content: String,
    },
    /// Never answers, until the fake is stopped (then 503).
    Hang,
    /// 200 with a body that is not JSON.
    Malformed,
    /// 200 with `{"choices":[]}`.
    EmptyChoices,
    /// 400 with an OpenAI-style JSON error body.
    BadRequest,
    /// Anything else: a status, an optional `Retry-After` and a body.
    Custom {
        status: u16,
        retry_after: Option<String>,
        body: String,
    },
}

type Script = dyn Fn(u64, &Value) -> Reply + Send + Sync;

/// One request as it arrived.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub at: std::time::Instant,
    /// How many were being answered when it arrived (itself included).
    pub in_flight: u64,
    pub request: Value,
}

impl Arrival {
    /// The user message of the request.
    pub fn user_prompt(&self) -> &str {
        self.request["messages"][1]["content"]
            .as_str()
            .unwrap_or("")
    }
}

struct Shared {
    script: Box<Script>,
    requests: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    /// For each request, in order, how many were being answered when it
    /// arrived (itself included).
    in_flight_at_arrival: Mutex<Vec<u64>>,
    arrivals: Mutex<Vec<Arrival>>,
    /// How many requests have arrived, to wait on.
    arrived: tokio::sync::watch::Sender<u64>,
    /// Requests whose client hung up before they were answered: the
    /// request's number and when.
    dropped: Mutex<Vec<(u64, std::time::Instant)>>,
    /// How many of those, to wait on.
    dropped_count: tokio::sync::watch::Sender<u64>,
    last_authorization: Mutex<Option<String>>,
    last_request: Mutex<Option<Value>>,
    /// Cancelled when the current run of the server stops.
    stopping: Mutex<CancellationToken>,
}

/// A running fake; stops when dropped.
pub struct FakeLlm {
    /// The base URL to use as `NEWSNACK_LLM_URL`: `http://127.0.0.1:PORT/v1`.
    pub url: String,
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    server: Mutex<Option<JoinHandle<()>>>,
}

impl FakeLlm {
    /// The project's LLM writer, pointed at this fake, with no API key.
    pub fn writer(&self, timeout: std::time::Duration) -> newsnack::writer::SharedWriter {
        newsnack::writer::build(&newsnack::writer::WriterConfig {
            llm_url: Some(self.url.clone()),
            model: "fake-model".into(),
            api_key: None,
            timeout,
            fallback: None,
        })
        .unwrap()
    }

    /// The project's writers: this fake as the primary provider and
    /// `fallback` as the fallback, each with its own model name.
    pub fn writers_with_fallback(
        &self,
        fallback: &FakeLlm,
        timeout: std::time::Duration,
    ) -> newsnack::writer::Writers {
        newsnack::writer::build_all(&newsnack::writer::WriterConfig {
            llm_url: Some(self.url.clone()),
            model: "fake-model".into(),
            api_key: None,
            timeout,
            fallback: Some(newsnack::writer::FallbackConfig {
                llm_url: fallback.url.clone(),
                model: "fallback-model".into(),
                api_key: None,
            }),
        })
        .unwrap()
    }

    /// Every request answered by `script(n, request_json)`; n counts requests
    /// from 0. A body that is not JSON reaches the script as `Value::Null`.
    pub async fn start(script: impl Fn(u64, &Value) -> Reply + Send + Sync + 'static) -> FakeLlm {
        let shared = Arc::new(Shared {
            script: Box::new(script),
            requests: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            max_in_flight: AtomicU64::new(0),
            in_flight_at_arrival: Mutex::new(Vec::new()),
            arrivals: Mutex::new(Vec::new()),
            arrived: tokio::sync::watch::channel(0).0,
            dropped: Mutex::new(Vec::new()),
            dropped_count: tokio::sync::watch::channel(0).0,
            last_authorization: Mutex::new(None),
            last_request: Mutex::new(None),
            stopping: Mutex::new(CancellationToken::new()),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fake LLM server");
        let addr = listener
            .local_addr()
            .expect("local address of the fake LLM");
        let server = serve(listener, shared.clone());
        FakeLlm {
            url: format!("http://{addr}/v1"),
            addr,
            shared,
            server: Mutex::new(Some(server)),
        }
    }

    /// Listens again on the same address after [`FakeLlm::stopped`], with
    /// the same script and counters.
    pub async fn restarted(&self) {
        *self.shared.stopping.lock().unwrap() = CancellationToken::new();
        let listener = tokio::net::TcpListener::bind(self.addr)
            .await
            .expect("bind the fake LLM server again");
        let server = serve(listener, self.shared.clone());
        *self.server.lock().unwrap() = Some(server);
    }

    /// A fake that answers every request with `content`.
    pub async fn always(content: &str) -> FakeLlm {
        let content = content.to_string();
        FakeLlm::start(move |_, _| Reply::Ok(content.clone())).await
    }

    /// How many requests reached the endpoint so far.
    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// The most requests that were ever being answered at once.
    pub fn max_in_flight(&self) -> u64 {
        self.shared.max_in_flight.load(Ordering::SeqCst)
    }

    /// For each request so far, in arrival order, how many were being
    /// answered when it arrived (itself included).
    pub fn in_flight_at_arrival(&self) -> Vec<u64> {
        self.shared.in_flight_at_arrival.lock().unwrap().clone()
    }

    /// Every request so far, in arrival order.
    pub fn arrivals(&self) -> Vec<Arrival> {
        self.shared.arrivals.lock().unwrap().clone()
    }

    /// Waits until at least `n` requests have arrived (at most 60 s).
    pub async fn until_requests(&self, n: u64) {
        let mut arrived = self.shared.arrived.subscribe();
        tokio::time::timeout(
            std::time::Duration::from_secs(60),
            arrived.wait_for(|count| *count >= n),
        )
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {n} requests at the fake LLM"))
        .unwrap();
    }

    /// The requests whose client hung up before the answer, in order: the
    /// request's number (from 0, as the script sees it) and when.
    pub fn dropped(&self) -> Vec<(u64, std::time::Instant)> {
        self.shared.dropped.lock().unwrap().clone()
    }

    /// Waits until the clients of at least `n` requests have hung up before
    /// the answer (at most `secs` seconds).
    pub async fn until_dropped(&self, n: u64, secs: u64) {
        let mut dropped = self.shared.dropped_count.subscribe();
        tokio::time::timeout(
            std::time::Duration::from_secs(secs),
            dropped.wait_for(|count| *count >= n),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "timed out waiting for {n} dropped requests at the fake LLM (saw {})",
                self.dropped().len()
            )
        })
        .unwrap();
    }

    /// The `Authorization` header of the last request, if it had one.
    pub fn last_authorization(&self) -> Option<String> {
        self.shared.last_authorization.lock().unwrap().clone()
    }

    /// The JSON body of the last request (`Value::Null` if it was not JSON).
    pub fn last_request(&self) -> Option<Value> {
        self.shared.last_request.lock().unwrap().clone()
    }

    /// Stops the server: the port stops listening and hanging requests end.
    /// Returns at once; [`FakeLlm::stopped`] waits until it is done.
    pub fn stop(&self) {
        self.shared.stopping.lock().unwrap().cancel();
    }

    /// Stops the server and waits until it no longer accepts connections
    /// and every connection is closed.
    pub async fn stopped(&self) {
        self.stop();
        let server = self.server.lock().unwrap().take();
        if let Some(server) = server {
            server.await.expect("the fake LLM server task");
        }
    }
}

impl Drop for FakeLlm {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs the server on `listener` until the current stopping token fires.
fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>) -> JoinHandle<()> {
    let stopping = shared.stopping.lock().unwrap().clone();
    let router = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .with_state(shared);
    tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(stopping.cancelled_owned())
            .await
            .expect("run the fake LLM server");
    })
}

async fn chat_completions(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (n, now) = {
        // One lock around both counts, so arrivals are recorded in order.
        let mut arrivals = shared.in_flight_at_arrival.lock().unwrap();
        let n = shared.requests.fetch_add(1, Ordering::SeqCst);
        let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        arrivals.push(now);
        (n, now)
    };
    shared.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let mut leaving = InFlight {
        shared: shared.clone(),
        n,
        answered: false,
    };
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    shared.arrivals.lock().unwrap().push(Arrival {
        at: std::time::Instant::now(),
        in_flight: now,
        request: request.clone(),
    });
    shared.arrived.send_modify(|count| *count += 1);
    let authorization = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .map(str::to_string);
    *shared.last_authorization.lock().unwrap() = authorization;
    *shared.last_request.lock().unwrap() = Some(request.clone());

    let stopping = shared.stopping.lock().unwrap().clone();
    let mut reply = (shared.script)(n, &request);
    if let Reply::Gated { mut open, content } = reply {
        tokio::select! {
            _ = open.wait_for(|open| *open) => {}
            _ = stopping.cancelled() => {}
        }
        reply = Reply::Ok(content);
    }
    if let Reply::Slow { delay, content } = reply {
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stopping.cancelled() => {}
        }
        reply = Reply::Ok(content);
    }
    if let Reply::Ok(content) = reply {
        let usage = json!({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2});
        reply = Reply::WithUsage { content, usage };
    }
    let response = match reply {
        Reply::Slow { .. } | Reply::Gated { .. } | Reply::Ok(_) => {
            unreachable!("turned into WithUsage above")
        }
        Reply::WithUsage { content, usage } => {
            let model = request.get("model").cloned().unwrap_or(Value::Null);
            let mut completion = json!({
                "id": format!("chatcmpl-fake-{n}"),
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }],
            });
            if !usage.is_null() {
                completion["usage"] = usage;
            }
            (StatusCode::OK, axum::Json(completion)).into_response()
        }
        Reply::RateLimited { retry_after_s } => (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, retry_after_s.to_string())],
            axum::Json(error_body("Rate limit reached", "rate_limit_exceeded")),
        )
            .into_response(),
        Reply::ServerError => (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(error_body("The server had an error", "server_error")),
        )
            .into_response(),
        Reply::Hang => {
            stopping.cancelled().await;
            (StatusCode::SERVICE_UNAVAILABLE, "fake LLM stopped").into_response()
        }
        Reply::Malformed => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/html")],
            "<html><body>not a completion</body></html>",
        )
            .into_response(),
        Reply::EmptyChoices => (StatusCode::OK, axum::Json(json!({"choices": []}))).into_response(),
        Reply::BadRequest => (
            StatusCode::BAD_REQUEST,
            axum::Json(error_body(
                "Invalid value for 'temperature'",
                "invalid_request_error",
            )),
        )
            .into_response(),
        Reply::Custom {
            status,
            retry_after,
            body,
        } => {
            let status = StatusCode::from_u16(status).expect("a valid status");
            let mut response = (status, body).into_response();
            if let Some(retry_after) = retry_after {
                response.headers_mut().insert(
                    header::RETRY_AFTER,
                    retry_after.parse().expect("a valid Retry-After"),
                );
            }
            response
        }
    };
    leaving.answered = true;
    response
}

/// Counts a request as answered when dropped, and as dropped if the client
/// left first (the server then drops the handler before it answers).
struct InFlight {
    shared: Arc<Shared>,
    n: u64,
    answered: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        if !self.answered {
            self.shared
                .dropped
                .lock()
                .unwrap()
                .push((self.n, std::time::Instant::now()));
            self.shared.dropped_count.send_modify(|count| *count += 1);
        }
    }
}

fn error_body(message: &str, kind: &str) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": null}})
}
