//! Cancelling: `POST /issues/{id}/cancel` (200 with the issue, 404, 409
//! for `DONE`, token-protected), `newsnack cancel`, a `PENDING` issue
//! cancelled through the legal transitions with its attempt given back and
//! `newsnack retry` bringing it back; and articles being written when
//! their issue is cancelled, or failed with plain SQL, on three in-process
//! instances against the tests' fake LLM: no article stored, every LLM
//! request dropped within a second (the fake sees the client hang up), and
//! the freed slots taken by queued calls at once.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::fake_llm::{FakeLlm, Reply};
use common::http::{claim_all, completions_deferred, until_recording_meets_a_held_row};
use common::{titled, until_sql, until_sql_polled, TestDb};
use newsnack::writer::{self, SharedWriter};
use serde_json::{json, Value};

const GOOD: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";

fn llm_writer(fake: &FakeLlm) -> SharedWriter {
    fake.writer(Duration::from_secs(60))
}

/// A fake that never answers issues titled `flight N` (until it stops) and
/// answers every other one at once.
async fn hanging_fake() -> FakeLlm {
    FakeLlm::start(|_, request| {
        let prompt = request["messages"][1]["content"].as_str().unwrap_or("");
        if prompt.contains("Title: flight ") {
            Reply::Hang
        } else {
            Reply::Ok(GOOD.into())
        }
    })
    .await
}

/// 100 articles in flight on three instances, cancelled in one command:
/// every request is dropped within a second of the commit, nothing is
/// stored, each issue ends `FAILED` `cancelled` for good, and the 20 calls
/// queued behind the budget's limit start as the slots come free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_hundred_articles_in_flight_drops_every_call() {
    let db = TestDb::with_pool_size(32).await;
    db.set("llm_max_in_flight", "100").await;
    db.set("generation_concurrency", "50").await;
    let fake = hanging_fake().await;
    let services = [
        db.serve("cancel-a", llm_writer(&fake)).await,
        db.serve("cancel-b", llm_writer(&fake)).await,
        db.serve("cancel-c", llm_writer(&fake)).await,
    ];
    let flight = titled(&db, "flight", 100).await;
    for (service, ids) in services.iter().zip(flight.chunks(34)) {
        claim_all(service.addr, ids, None).await;
    }
    fake.until_requests(100).await;
    // Twenty more, queued behind the limit of 100 calls in flight.
    let queued = titled(&db, "queued", 20).await;
    for (service, ids) in services.iter().zip(queued.chunks(7)) {
        claim_all(service.addr, ids, None).await;
    }
    // No transition announces a queued call: asked every 50 ms.
    until_sql_polled(
        &db,
        30,
        "SELECT count(*) = 20 FROM llm_call WHERE granted_at IS NULL AND finished_at IS NULL",
    )
    .await;
    assert_eq!(fake.requests(), 100, "the queued calls wait for a slot");

    let mut client = db.pool.get().await.unwrap();
    let outcome = newsnack::db::issue::cancel(&mut client, &flight)
        .await
        .unwrap();
    let committed = Instant::now();
    drop(client);
    assert_eq!(outcome.cancelled, flight);
    assert!(outcome.done.is_empty() && outcome.unknown.is_empty());

    fake.until_dropped(100, 10).await;
    let dropped = fake.dropped();
    let slowest = dropped
        .iter()
        .map(|(_, at)| at.saturating_duration_since(committed))
        .max()
        .unwrap();
    assert!(
        slowest < Duration::from_secs(1),
        "every request dropped within a second of the cancel: the slowest took {slowest:?}"
    );
    // The freed slots go to the queued calls at once.
    fake.until_requests(120).await;
    let queued_started = fake.arrivals()[100..]
        .iter()
        .map(|a| a.at.saturating_duration_since(committed))
        .max()
        .unwrap();
    assert!(
        queued_started < Duration::from_secs(2),
        "the queued calls started {queued_started:?} after the cancel"
    );
    eprintln!(
        "100 cancelled: slowest drop {slowest:?} after the commit; queued calls all started within {queued_started:?}"
    );
    until_sql(
        &db,
        &services[0].hub,
        30,
        &format!(
            "SELECT count(*) = 20 FROM issue WHERE processing_status = 'DONE'
                AND id = ANY(ARRAY{queued:?}::bigint[])"
        ),
    )
    .await;
    for service in services {
        service.stop().await.unwrap();
    }
    let client = db.raw().await;
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE processing_status = 'FAILED' AND last_error = 'cancelled'
                                       AND retry_not_before = 'infinity' AND attempts = 1),
                    (SELECT count(*) FROM ai_article WHERE issue_id = ANY($1))
               FROM issue WHERE id = ANY($1)",
            &[&flight],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 100, "each cancelled for good");
    assert_eq!(row.get::<_, i64>(1), 0, "no article stored");
    assert_eq!(fake.requests(), 120, "no cancelled article was asked again");
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM llm_call WHERE finished_at IS NULL")
            .await,
        0
    );
}

/// Another system failing articles in flight with plain SQL: the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_articles_in_flight_with_plain_sql_drops_their_calls() {
    let db = TestDb::new().await;
    let fake = hanging_fake().await;
    let service = db.serve("plain-sql", llm_writer(&fake)).await;
    let flight = titled(&db, "flight", 8).await;
    claim_all(service.addr, &flight, None).await;
    fake.until_requests(8).await;
    let client = db.raw().await;
    client
        .execute(
            "UPDATE issue SET processing_status = 'FAILED' WHERE id = ANY($1)",
            &[&flight],
        )
        .await
        .unwrap();
    let committed = Instant::now();
    fake.until_dropped(8, 10).await;
    for (_, at) in fake.dropped() {
        let took = at.saturating_duration_since(committed);
        assert!(took < Duration::from_secs(1), "dropped after {took:?}");
    }
    // The process's count (other tests of this file count into it too).
    let cancelled = common::http::metric(
        &reqwest::Client::new(),
        &format!("http://{}", service.addr),
        "newsnack_generations_cancelled_total",
    )
    .await;
    assert!(cancelled >= 8.0, "{cancelled}");
    service.stop().await.unwrap();
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM ai_article").await,
        0,
        "no article stored"
    );
}

/// The endpoint: 200 with the issue, again 200 with nothing changed, 404
/// for an unknown id, 409 for `DONE`, 401 without the token; a `PENDING`
/// issue goes `PENDING -> IN_PROGRESS -> FAILED` with its attempt given
/// back, and `newsnack retry` brings it back. `newsnack cancel` prints
/// what it did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_and_the_command_cancel_within_the_legal_transitions() {
    let db = TestDb::new().await;
    let setup = common::Setup {
        tokens: newsnack::http::auth::Tokens::api("cancel-test-token-7d2e"),
        ..common::Setup::default()
    };
    let offline: SharedWriter = std::sync::Arc::new(writer::OfflineWriter);
    let service = db.serve_with("cancel-api", offline, setup).await;
    let http = reqwest::Client::new();
    let cancel = |id: i64, token: Option<&'static str>| {
        let mut request = http.post(format!("http://{}/issues/{id}/cancel", service.addr));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap())
        }
    };
    let ids = titled(&db, "pending", 3).await;

    let (status, body) = cancel(ids[0], None).await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(db.status_of(ids[0]).await, "PENDING");

    let (status, body) = cancel(ids[0], Some("cancel-test-token-7d2e")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["id"], ids[0]);
    assert_eq!(body["status"], "FAILED");
    assert_eq!(body["last_error"], "cancelled");
    assert_eq!(body["attempts"], 0, "the attempt is given back");
    let log = |id: i64| {
        let db = &db;
        async move {
            db.raw()
                .await
                .query(
                    "SELECT from_status, to_status, fatal FROM issue_transition
                      WHERE issue_id = $1 ORDER BY seq",
                    &[&id],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| {
                    (
                        r.get::<_, Option<String>>(0),
                        r.get::<_, String>(1),
                        r.get::<_, bool>(2),
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    let expected = vec![
        (None, "PENDING".to_string(), false),
        (Some("PENDING".into()), "IN_PROGRESS".to_string(), false),
        (Some("IN_PROGRESS".into()), "FAILED".to_string(), true),
    ];
    assert_eq!(log(ids[0]).await, expected);
    // Again: the same answer, nothing logged.
    let (status, again) = cancel(ids[0], Some("cancel-test-token-7d2e")).await;
    assert_eq!(status, 200);
    assert_eq!(again["status"], "FAILED");
    assert_eq!(log(ids[0]).await, expected);

    let (status, body) = cancel(999_999, Some("cancel-test-token-7d2e")).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"], "no issue with id 999999");

    // DONE: 409.
    claim_all_with_token(&http, service.addr, &ids[1..2]).await;
    until_sql(
        &db,
        &service.hub,
        30,
        &format!(
            "SELECT processing_status = 'DONE' FROM issue WHERE id = {}",
            ids[1]
        ),
    )
    .await;
    let (status, body) = cancel(ids[1], Some("cancel-test-token-7d2e")).await;
    assert_eq!(status, 409, "{body}");
    assert!(body["error"].as_str().unwrap().contains("DONE"), "{body}");

    // The command: a PENDING, a DONE, an unknown one, a cancelled one.
    let output = Command::new(env!("CARGO_BIN_EXE_newsnack"))
        .args(["cancel", &ids[2].to_string(), &ids[1].to_string(), "999999"])
        .arg(ids[0].to_string())
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let printed: Value = serde_json::from_slice(&output.stdout).unwrap();
    let mut cancelled = vec![ids[0], ids[2]];
    cancelled.sort_unstable();
    assert_eq!(
        printed,
        json!({"cancelled": cancelled, "done": [ids[1]], "unknown": [999999]})
    );
    let nothing = Command::new(env!("CARGO_BIN_EXE_newsnack"))
        .args(["cancel", &ids[1].to_string()])
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert_eq!(nothing.status.code(), Some(1), "nothing cancelled");

    // Retried by hand: PENDING again, then written.
    let retry = Command::new(env!("CARGO_BIN_EXE_newsnack"))
        .args(["retry", &ids[0].to_string()])
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert!(retry.status.success(), "{retry:?}");
    assert_eq!(db.status_of(ids[0]).await, "PENDING");
    service.stop().await.unwrap();
}

async fn claim_all_with_token(http: &reqwest::Client, addr: std::net::SocketAddr, ids: &[i64]) {
    let response = http
        .post(format!("http://{addr}/ai-articles"))
        .bearer_auth("cancel-test-token-7d2e")
        .json(&json!({ "issue_ids": ids }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
}

/// An answer that arrived before the cancel, its recording held up by a
/// transaction that then cancels the issue: the claim's fence keeps it
/// out, and the generation ends by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_came_first_is_kept_out_by_the_fence() {
    let db = TestDb::new().await;
    let (open, gate) = tokio::sync::watch::channel(false);
    let fake = FakeLlm::start(move |_, _| Reply::Gated {
        open: gate.clone(),
        content: GOOD.into(),
    })
    .await;
    let service = db.serve("fenced", llm_writer(&fake)).await;
    let id = titled(&db, "late", 1).await[0];
    let deferred_before = completions_deferred(service.addr).await;
    claim_all(service.addr, &[id], None).await;
    fake.until_requests(1).await;

    let mut holder = db.raw().await;
    let cancel = holder.transaction().await.unwrap();
    cancel
        .execute("UPDATE issue SET score = score + 1 WHERE id = $1", &[&id])
        .await
        .unwrap();
    open.send_replace(true);
    // The answer is in; its recording meets the held row (asked every
    // 20 ms: nothing announces it).
    let sql = db.raw().await;
    until_recording_meets_a_held_row(&sql, service.addr, deferred_before).await;
    cancel
        .execute(
            "UPDATE issue SET processing_status = 'FAILED', last_error = 'cancelled',
                              retry_not_before = 'infinity' WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    cancel.commit().await.unwrap();
    // Stopping waits up to the grace period (5 s) for the generation,
    // which ends by itself as soon as its next try meets the fence.
    let stopping = Instant::now();
    service.stop().await.unwrap();
    assert!(stopping.elapsed() < Duration::from_secs(5));
    assert_eq!(db.status_of(id).await, "FAILED");
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM ai_article").await,
        0,
        "the late answer is not stored"
    );
    assert_eq!(fake.requests(), 1);
}
