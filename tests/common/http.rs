//! Plain HTTP calls on a running service, for tests whose point is not the
//! request itself: a JSON body fetched, a JSON body posted, a metric read,
//! issues claimed, a completion seen meeting a held row.

use reqwest::header::{HeaderMap, HeaderName};
use reqwest::{Method, RequestBuilder, StatusCode};
use serde_json::Value;

/// `method url`, with `header` when there is one.
pub fn request(
    http: &reqwest::Client,
    method: &Method,
    url: &str,
    header: Option<(HeaderName, &str)>,
) -> RequestBuilder {
    let request = http.request(method.clone(), url);
    match header {
        Some((name, value)) => request.header(name, value),
        None => request,
    }
}

/// Sends `request` (`method url`, named for the failure messages) and
/// reads its whole answer: the status, the headers and the body's text.
pub async fn answer(
    request: RequestBuilder,
    method: &Method,
    url: &str,
) -> (StatusCode, HeaderMap, String) {
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("{method} {url}: no response: {e}"));
    let status = response.status();
    let headers = response.headers().clone();
    (status, headers, response.text().await.unwrap())
}

/// The body `text` of an answer to `method url` parsed as JSON; fails the
/// test, saying what answered, if it is not JSON.
pub fn json_body(text: &str, method: &Method, url: &str, status: StatusCode) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| {
        panic!("{method} {url} answered {status} with non-JSON ({e}): {text:?}")
    })
}

/// `GET url`, its body as JSON.
pub async fn get_json(http: &reqwest::Client, url: &str) -> Value {
    http.get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: no response: {e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: no JSON body: {e}"))
}

/// `POST url` with `body` as JSON: the status, and the body as JSON
/// (`Value::Null` when it is none).
pub async fn post_json(http: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let response = http
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The value of the metric `name` (with no labels) in the Prometheus text
/// `metrics`.
pub fn metric_in(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{metrics}"))
}

/// The value of the metric `name` (with no labels) the service at `base`
/// (`http://ADDR`) reports now.
pub async fn metric(http: &reqwest::Client, base: &str, name: &str) -> f64 {
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {base}/metrics: no response: {e}"))
        .text()
        .await
        .unwrap();
    metric_in(&metrics, name)
}

/// Claims `ids` through the service at `addr` (at `priority`, or the
/// default), asserting that it answered 202 with every one claimed.
pub async fn claim_all(addr: std::net::SocketAddr, ids: &[i64], priority: Option<&str>) {
    let mut body = serde_json::json!({ "issue_ids": ids });
    if let Some(priority) = priority {
        body["priority"] = serde_json::json!(priority);
    }
    let (status, answer) = post_json(
        &reqwest::Client::new(),
        &format!("http://{addr}/ai-articles"),
        &body,
    )
    .await;
    assert_eq!(status, 202, "{answer}");
    assert_eq!(
        answer["claimed"].as_array().map(Vec::len),
        Some(ids.len()),
        "{answer}"
    );
}

/// `POST /ai-articles` of `ids` to the service at `addr`: the status and the
/// answer.
pub async fn post_ids(
    http: &reqwest::Client,
    addr: std::net::SocketAddr,
    ids: &[i64],
) -> (u16, Value) {
    post_json(
        http,
        &format!("http://{addr}/ai-articles"),
        &serde_json::json!({ "issue_ids": ids }),
    )
    .await
}

/// The service's `newsnack_completions_deferred_total`.
pub async fn completions_deferred(addr: std::net::SocketAddr) -> f64 {
    metric(
        &reqwest::Client::new(),
        &format!("http://{addr}"),
        "newsnack_completions_deferred_total",
    )
    .await
}

/// Waits until the service at `addr` has met a row another transaction
/// holds while recording an article: a session of `sql`'s database waits
/// on a lock, or the service deferred more completions than
/// `deferred_before`. Asked every 20 ms: nothing announces it.
pub async fn until_recording_meets_a_held_row(
    sql: &tokio_postgres::Client,
    addr: std::net::SocketAddr,
    deferred_before: f64,
) {
    super::within(30, "the article's recording to meet the held row", async {
        loop {
            let waiting: bool = sql
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                                     WHERE datname = current_database() AND wait_event_type = 'Lock')",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if waiting || completions_deferred(addr).await > deferred_before {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
}
