//! Plain HTTP calls on a running service, for tests whose point is not the
//! request itself: a JSON body fetched, a JSON body posted, a metric read.

use serde_json::Value;

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
