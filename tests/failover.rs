//! A managed failover, simulated: the database turns read-only for new
//! sessions and every session is cut (the old primary, demoted), then it
//! takes writes again for new sessions only (DNS now names the new
//! primary), while the sessions the service opened meanwhile stay
//! read-only. During the read-only spell every write answers 503 with
//! `Retry-After` and says why, and `/readyz` answers 503; afterwards the
//! service recovers by itself, without a restart: the sessions that met a
//! read-only transaction are dropped, never handed out again.
//!
//! In a test binary of its own: a read-only transaction makes the whole
//! process drop its older pooled sessions, which other tests would notice.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{within, TestDb};
use newsnack::writer::OfflineWriter;
use reqwest::StatusCode;
use serde_json::{json, Value};

async fn post(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
) -> (StatusCode, Option<String>, Value) {
    let response = http.post(url).json(body).send().await.unwrap();
    let status = response.status();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    (
        status,
        retry_after,
        response.json().await.unwrap_or(Value::Null),
    )
}

/// Retries `body` on 503, as a client honouring the answer would (a short
/// pause, not the full `Retry-After`, to keep the test quick), until it gets
/// another status; that status and body.
async fn until_not_503(http: &reqwest::Client, url: &str, body: &Value) -> (StatusCode, Value) {
    within(30, "an answer other than 503", async {
        loop {
            let (status, _, answer) = post(http, url, body).await;
            if status != StatusCode::SERVICE_UNAVAILABLE {
                return (status, answer);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_answers_503_while_read_only_and_recovers_without_a_restart() {
    let db = TestDb::new().await;
    let service = db.serve("failover", Arc::new(OfflineWriter)).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    let issues = json!({"issues": [{"title": "before"}, {"title": "also before"}]});
    let (status, _, added) = post(&http, &format!("{base}/issues"), &issues).await;
    assert_eq!(status, StatusCode::CREATED, "{added}");

    // The primary is demoted: new sessions of this database are read-only,
    // and every session of the service is cut.
    let admin = db.maintenance().await;
    let name = &db.name;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{name}\" SET default_transaction_read_only = on"
        ))
        .await
        .unwrap();
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
            &[name],
        )
        .await
        .unwrap();

    // Every write is refused with 503 and Retry-After: first, perhaps, on
    // a session that was cut ("unreachable"), then on the new, read-only
    // ones, saying so.
    for (path, body) in [
        ("issues", json!({"issues": [{"title": "during"}]})),
        ("ai-articles", json!({"issue_ids": added["ids"]})),
    ] {
        let mut answers = Vec::new();
        loop {
            let (status, retry_after, answer) = post(&http, &format!("{base}/{path}"), &body).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{path}: {answer}");
            assert_eq!(retry_after.as_deref(), Some("1"), "{path}");
            let error = answer["error"].as_str().unwrap_or_default().to_string();
            answers.push(error.clone());
            if error.contains("read-only") {
                break;
            }
            assert!(
                error.contains("unreachable") && answers.len() <= 16,
                "{path}: {answers:?}"
            );
        }
    }
    let ready = http.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
    let ready: Value = ready.json().await.unwrap();
    assert_eq!(ready["writable"], false, "{ready}");
    assert!(
        ready["error"]
            .as_str()
            .is_some_and(|e| e.contains("read-only")),
        "{ready}"
    );

    // The new primary takes writes, for new sessions; the service's
    // sessions opened during the spell are still read-only.
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{name}\" RESET default_transaction_read_only"
        ))
        .await
        .unwrap();

    // The service recovers by itself: a client that tries again gets
    // through, and so does everything after it.
    let (status, added) = until_not_503(
        &http,
        &format!("{base}/issues"),
        &json!({"issues": [{"title": "after"}]}),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{added}");
    let mut after: Vec<i64> = serde_json::from_value(added["ids"].clone()).unwrap();
    // No read-only session is left in the pool to fail a later request.
    for i in 0..40 {
        let (status, _, added) = post(
            &http,
            &format!("{base}/issues"),
            &json!({"issues": [{"title": format!("after {i}")}]}),
        )
        .await;
        assert_eq!(
            status,
            StatusCode::CREATED,
            "write {i} after recovery: {added}"
        );
        after.extend(serde_json::from_value::<Vec<i64>>(added["ids"].clone()).unwrap());
    }
    let (status, _, claimed) = post(
        &http,
        &format!("{base}/ai-articles"),
        &json!({"issue_ids": after}),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{claimed}");
    let (status, _, waited) = post(
        &http,
        &format!("{base}/waits"),
        &json!({"issue_ids": after, "timeout_s": 60}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        waited["outcome"], "all_pass",
        "generated after the failover: {waited}"
    );
    within(30, "/readyz to answer 200", async {
        while http
            .get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status()
            != StatusCode::OK
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    service.stop().await.unwrap();
}
