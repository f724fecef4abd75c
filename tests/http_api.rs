//! The HTTP API against its contract, over a real socket: a table of bad
//! input for every endpoint (each answered 4xx with `{"error": ".."}`, and
//! the database left exactly as it was); a storm of 32 clients posting
//! overlapping `POST /ai-articles` windows (every issue claimed once,
//! written once, attempted once); fencing of a late worker whose lease was
//! reaped and whose issue was re-claimed (library level, with the reaper's
//! compare-and-set); and the shape of `GET /issues/{id}`, `/healthz` and
//! `/readyz`.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::http::{answer, json_body, request};
use common::{
    claimed_issues, move_on, offline, until_caught_up, until_done_count, until_sql,
    until_sql_polled, until_status, within, LogSink, TestDb,
};
use newsnack::db::issue::{
    claim_issues, fail, heartbeat, reap_expired, ClaimScope, Completion, Fenced, RetryPolicy,
};
use newsnack::db::Sql;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::sync::Barrier;

/// Sends one request; returns the status and the body parsed as JSON. Fails
/// the test if the answer is not JSON (by header and by content), or is a
/// 405 without the `Allow` header HTTP requires.
async fn send(
    http: &reqwest::Client,
    method: Method,
    url: &str,
    content_type: Option<&str>,
    body: Option<Vec<u8>>,
) -> (StatusCode, Value) {
    let content_type = content_type.map(|value| (reqwest::header::CONTENT_TYPE, value));
    let mut request = request(http, &method, url, content_type);
    if let Some(body) = body {
        request = request.body(body);
    }
    let (status, headers, text) = answer(request, &method, url).await;
    let content_type = headers
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    assert!(
        content_type.starts_with("application/json"),
        "{method} {url} answered {status} as {content_type:?}"
    );
    if status == StatusCode::METHOD_NOT_ALLOWED {
        assert!(
            headers.contains_key(reqwest::header::ALLOW),
            "{method} {url}: 405 without Allow"
        );
    }
    (status, json_body(&text, &method, url, status))
}

/// Everything a request could have changed: row counts, the log's end, and
/// every issue's status, attempts, claim and error.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    issues: i64,
    transitions: i64,
    last_seq: i64,
    articles: i64,
    settings: String,
    rows: String,
}

async fn snapshot(db: &TestDb) -> Snapshot {
    let sql = db.raw().await;
    let row = sql
        .query_one(
            "SELECT (SELECT count(*) FROM issue),
                    (SELECT count(*) FROM issue_transition),
                    (SELECT COALESCE(max(seq), 0) FROM issue_transition),
                    (SELECT count(*) FROM ai_article),
                    (SELECT COALESCE(string_agg(key || '=' || value, ',' ORDER BY key), '') FROM setting),
                    (SELECT COALESCE(string_agg(
                        concat_ws(':', id, processing_status, attempts, claim_id, claimed_by,
                                  last_error, updated_at, lease_until, retry_not_before),
                        ',' ORDER BY id), '') FROM issue)",
            &[],
        )
        .await
        .unwrap();
    Snapshot {
        issues: row.get(0),
        transitions: row.get(1),
        last_seq: row.get(2),
        articles: row.get(3),
        settings: row.get(4),
        rows: row.get(5),
    }
}

/// One row of the bad-input table.
struct Bad {
    what: &'static str,
    method: Method,
    path: String,
    content_type: Option<&'static str>,
    body: Option<Vec<u8>>,
    expect: u16,
}

const JSON: Option<&str> = Some("application/json");

fn body(value: Value) -> Option<Vec<u8>> {
    Some(serde_json::to_vec(&value).unwrap())
}

fn raw(text: &str) -> Option<Vec<u8>> {
    Some(text.as_bytes().to_vec())
}

/// A table row: what, method, path, content type, body, expected status.
type Row = (
    &'static str,
    &'static str,
    String,
    Option<&'static str>,
    Option<Vec<u8>>,
    u16,
);

/// Every bad request the table sends. `pending` is a claimable issue (a
/// request that slipped past validation would claim it) and `done` a
/// finished one. Kept as a table on purpose, one row per line.
#[rustfmt::skip]
fn bad_inputs(pending: i64, done: i64) -> Vec<Bad> {
    let over_limit = newsnack::http::BODY_LIMIT + 1024;
    let issue = |title: &str| json!({ "title": title, "body": "b", "score": 1.0 });
    let one = || body(json!({ "issues": [issue("a")] }));
    let claim = || body(json!({ "issue_ids": [pending] }));
    let many_issues: Vec<Value> = (0..1001).map(|i| issue(&format!("bulk {i}"))).collect();
    let many_ids: Vec<i64> = std::iter::once(pending).chain(1..=1000).collect();
    // Valid JSON, a valid issue, but bigger than the body limit.
    let huge_issue = body(json!({ "issues": [{ "title": "huge", "body": "x".repeat(over_limit) }] }));
    // A valid id list padded with whitespace past the limit.
    let mut huge_ids = format!("{{\"issue_ids\": [{pending}]").into_bytes();
    huge_ids.extend(std::iter::repeat_n(b' ', over_limit));
    huge_ids.extend_from_slice(b"}");
    let show = |id: &str| format!("/issues/{id}");

    let rows: Vec<Row> = vec![
        // ---- POST /issues
        ("issues: malformed JSON", "POST", "/issues".into(), JSON, raw("{\"issues\": [{\"title\": \"a\""), 400),
        ("issues: not JSON at all", "POST", "/issues".into(), JSON, raw("title=a"), 400),
        ("issues: no content type", "POST", "/issues".into(), None, one(), 415),
        ("issues: text/plain", "POST", "/issues".into(), Some("text/plain"), one(), 415),
        ("issues: form content type", "POST", "/issues".into(), Some("application/x-www-form-urlencoded"), raw("issues=a"), 415),
        ("issues: no body, no content type", "POST", "/issues".into(), None, None, 415),
        ("issues: JSON content type, empty body", "POST", "/issues".into(), JSON, raw(""), 400),
        ("issues: body is an array", "POST", "/issues".into(), JSON, body(json!([issue("a")])), 422),
        ("issues: body is null", "POST", "/issues".into(), JSON, raw("null"), 422),
        ("issues: issues is not a list", "POST", "/issues".into(), JSON, body(json!({ "issues": issue("a") })), 422),
        ("issues: score is a string", "POST", "/issues".into(), JSON, body(json!({ "issues": [{ "title": "a", "score": "high" }] })), 422),
        ("issues: score is null", "POST", "/issues".into(), JSON, body(json!({ "issues": [{ "title": "a", "score": null }] })), 422),
        ("issues: score NaN (not JSON)", "POST", "/issues".into(), JSON, raw("{\"issues\": [{\"title\": \"a\", \"score\": NaN}]}"), 400),
        ("issues: score Infinity (not JSON)", "POST", "/issues".into(), JSON, raw("{\"issues\": [{\"title\": \"a\", \"score\": Infinity}]}"), 400),
        ("issues: score 1e999 overflows f64", "POST", "/issues".into(), JSON, raw("{\"issues\": [{\"title\": \"a\", \"score\": 1e999}]}"), 400),
        ("issues: title is a number", "POST", "/issues".into(), JSON, body(json!({ "issues": [{ "title": 7 }] })), 422),
        ("issues: missing issues", "POST", "/issues".into(), JSON, body(json!({})), 422),
        ("issues: missing title", "POST", "/issues".into(), JSON, body(json!({ "issues": [issue("ok"), { "body": "no title" }] })), 422),
        ("issues: unknown top-level field", "POST", "/issues".into(), JSON, body(json!({ "issues": [issue("a")], "priority": 1 })), 422),
        ("issues: unknown issue field", "POST", "/issues".into(), JSON, body(json!({ "issues": [{ "title": "a", "status": "DONE" }] })), 422),
        ("issues: duplicate field", "POST", "/issues".into(), JSON, raw("{\"issues\": [], \"issues\": []}"), 422),
        ("issues: empty list", "POST", "/issues".into(), JSON, body(json!({ "issues": [] })), 422),
        ("issues: 1001 issues", "POST", "/issues".into(), JSON, body(json!({ "issues": many_issues })), 422),
        ("issues: blank title after a good one", "POST", "/issues".into(), JSON, body(json!({ "issues": [issue("fine"), issue(" \t\n ")] })), 422),
        ("issues: empty title", "POST", "/issues".into(), JSON, body(json!({ "issues": [issue("")] })), 422),
        ("issues: title over 1000 characters", "POST", "/issues".into(), JSON, body(json!({ "issues": [issue(&"t".repeat(1001))] })), 422),
        ("issues: title over 1000 two-byte characters", "POST", "/issues".into(), JSON, body(json!({ "issues": [issue(&"é".repeat(1001))] })), 422),
        ("issues: title of wide white space", "POST", "/issues".into(), JSON, body(json!({ "issues": [issue("\u{3000}\u{a0}\u{2028}")] })), 422),
        ("issues: body over 100000 characters", "POST", "/issues".into(), JSON, body(json!({ "issues": [{ "title": "a", "body": "b".repeat(100_001) }] })), 422),
        ("issues: NUL in body", "POST", "/issues".into(), JSON, body(json!({ "issues": [{ "title": "a", "body": "x\u{0}" }] })), 422),
        ("issues: NUL in title", "POST", "/issues".into(), JSON, body(json!({ "issues": [issue("a\u{0}b")] })), 422),
        ("issues: lone surrogate in title", "POST", "/issues".into(), JSON, raw("{\"issues\": [{\"title\": \"\\ud800\"}]}"), 400),
        ("issues: collected_at not RFC 3339", "POST", "/issues".into(), JSON, body(json!({ "issues": [{ "title": "a", "collected_at": "yesterday" }] })), 422),
        ("issues: collected_at in the year 10000 in UTC", "POST", "/issues".into(), JSON, body(json!({ "issues": [{ "title": "a", "collected_at": "9999-12-31T23:00:00-05:00" }] })), 422),
        ("issues: collected_at in the year 0", "POST", "/issues".into(), JSON, body(json!({ "issues": [{ "title": "a", "collected_at": "0000-06-01T00:00:00Z" }] })), 422),
        ("issues: collected_at in the year 9999 as written", "POST", "/issues".into(), JSON, body(json!({ "issues": [{ "title": "a", "collected_at": "9999-01-01T00:00:00Z" }] })), 422),
        ("issues: collected_at in the year 1 as written", "POST", "/issues".into(), JSON, body(json!({ "issues": [{ "title": "a", "collected_at": "0001-12-31T00:00:00Z" }] })), 422),
        ("issues: body over the 1 MiB limit", "POST", "/issues".into(), JSON, huge_issue, 413),
        // ---- GET /issues/{id}
        ("show: id abc", "GET", show("abc"), None, None, 400),
        ("show: id 0", "GET", show("0"), None, None, 400),
        ("show: id -1", "GET", show("-1"), None, None, 400),
        ("show: id 1.5", "GET", show("1.5"), None, None, 400),
        ("show: id past i64", "GET", show("9223372036854775808"), None, None, 400),
        ("show: id percent-encoded -1", "GET", show("%2D1"), None, None, 400),
        ("show: id not UTF-8", "GET", show("%FF"), None, None, 400),
        ("show: unknown id", "GET", show("987654321"), None, None, 404),
        ("briefing: id not UTF-8", "GET", "/briefings/%C0%80".into(), None, None, 400),
        ("briefing: id 0", "GET", "/briefings/0".into(), None, None, 400),
        ("show: trailing segment", "GET", format!("/issues/{pending}/article"), None, None, 404),
        // ---- POST /ai-articles
        ("claim: malformed JSON", "POST", "/ai-articles".into(), JSON, raw(&format!("{{\"issue_ids\": [{pending},")), 400),
        ("claim: no content type", "POST", "/ai-articles".into(), None, claim(), 415),
        ("claim: text/plain", "POST", "/ai-articles".into(), Some("text/plain"), claim(), 415),
        ("claim: no body, no content type", "POST", "/ai-articles".into(), None, None, 415),
        ("claim: JSON content type, empty body", "POST", "/ai-articles".into(), JSON, raw(""), 400),
        ("claim: ids are strings", "POST", "/ai-articles".into(), JSON, body(json!({ "issue_ids": ["x"] })), 422),
        ("claim: one id a string", "POST", "/ai-articles".into(), JSON, body(json!({ "issue_ids": [pending, "x"] })), 422),
        ("claim: id is a float", "POST", "/ai-articles".into(), JSON, body(json!({ "issue_ids": [pending, 1.5] })), 422),
        ("claim: id past i64", "POST", "/ai-articles".into(), JSON, raw(&format!("{{\"issue_ids\": [{pending}, 9223372036854775808]}}")), 422),
        ("claim: ids is a number", "POST", "/ai-articles".into(), JSON, body(json!({ "issue_ids": pending })), 422),
        ("claim: ids is null", "POST", "/ai-articles".into(), JSON, body(json!({ "issue_ids": null })), 422),
        ("claim: missing issue_ids", "POST", "/ai-articles".into(), JSON, body(json!({})), 422),
        ("claim: wrong field name", "POST", "/ai-articles".into(), JSON, body(json!({ "ids": [pending] })), 422),
        ("claim: unknown field", "POST", "/ai-articles".into(), JSON, body(json!({ "issue_ids": [pending], "force": true })), 422),
        ("claim: empty list", "POST", "/ai-articles".into(), JSON, body(json!({ "issue_ids": [] })), 422),
        ("claim: 1001 ids", "POST", "/ai-articles".into(), JSON, body(json!({ "issue_ids": many_ids })), 422),
        ("claim: id 0", "POST", "/ai-articles".into(), JSON, body(json!({ "issue_ids": [pending, 0] })), 422),
        ("claim: id -3", "POST", "/ai-articles".into(), JSON, body(json!({ "issue_ids": [-3, pending] })), 422),
        ("claim: body over the 1 MiB limit", "POST", "/ai-articles".into(), JSON, Some(huge_ids), 413),
        ("claim: only unknown ids", "POST", "/ai-articles".into(), JSON, body(json!({ "issue_ids": [987654321] })), 409),
        ("claim: only a finished issue", "POST", "/ai-articles".into(), JSON, body(json!({ "issue_ids": [done, done] })), 409),
        // ---- routes and methods
        ("unknown route", "GET", "/articles".into(), None, None, 404),
        ("unknown route, POST with JSON", "POST", "/issue".into(), JSON, one(), 404),
        ("unknown versioned route", "GET", "/v2/issues/1".into(), None, None, 404),
        ("GET /ai-articles", "GET", "/ai-articles".into(), None, None, 405),
        ("PUT /ai-articles", "PUT", "/ai-articles".into(), JSON, claim(), 405),
        ("GET /issues (no listing)", "GET", "/issues".into(), None, None, 405),
        ("DELETE /issues/{id}", "DELETE", show(&pending.to_string()), None, None, 405),
        ("PATCH /issues/{id}", "PATCH", show(&pending.to_string()), JSON, body(json!({ "status": "DONE" })), 405),
        ("POST /issues/{id}", "POST", show(&pending.to_string()), JSON, claim(), 405),
        ("POST /healthz", "POST", "/healthz".into(), None, None, 405),
    ];
    rows.into_iter()
        .map(|(what, method, path, content_type, body, expect)| Bad {
            what,
            method: Method::from_bytes(method.as_bytes()).unwrap(),
            path,
            content_type,
            body,
            expect,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_bad_request_gets_a_json_4xx_and_changes_nothing() {
    let db = TestDb::new().await;
    let service = db.serve("bad-input", offline()).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    let ids = db.add_issues(3).await;
    let (pending, done) = (ids[0], ids[1]);
    // One finished issue, so a request naming it has something to break.
    let (status, answer) = send(
        &http,
        Method::POST,
        &format!("{base}/ai-articles"),
        JSON,
        body(json!({ "issue_ids": [done] })),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    until_status(&db, &service.hub, 30, done, "DONE").await;

    let before = snapshot(&db).await;
    let mut failures = Vec::new();
    for case in bad_inputs(pending, done) {
        let url = format!("{base}{}", case.path);
        let (status, answer) = within(
            30,
            case.what,
            send(
                &http,
                case.method.clone(),
                &url,
                case.content_type,
                case.body,
            ),
        )
        .await;
        let error_is_text = answer
            .get("error")
            .and_then(Value::as_str)
            .is_some_and(|e| !e.trim().is_empty());
        if !status.is_client_error() || status.as_u16() != case.expect || !error_is_text {
            failures.push(format!(
                "{}: {} {} -> {} (expected {}) {}",
                case.what, case.method, case.path, status, case.expect, answer
            ));
        }
        if snapshot(&db).await != before {
            failures.push(format!("{}: changed the database", case.what));
        }
        if status == StatusCode::CONFLICT {
            // A 409 still says what it did with each id.
            if answer["claimed"] != json!([]) || !answer["skipped"].is_array() {
                failures.push(format!(
                    "{}: 409 without claimed/skipped: {answer}",
                    case.what
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} bad requests were not answered as the contract says:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(
        snapshot(&db).await,
        before,
        "a bad request changed the database"
    );

    // The control: a good request does change the snapshot, so the
    // comparison above could have failed.
    let (status, answer) = send(
        &http,
        Method::POST,
        &format!("{base}/ai-articles"),
        JSON,
        body(json!({ "issue_ids": [pending] })),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    assert_eq!(answer["claimed"], json!([pending]));
    until_status(&db, &service.hub, 30, pending, "DONE").await;
    assert_ne!(snapshot(&db).await, before);
    service.stop().await.unwrap();
}

/// POSTs `chunks` with `Transfer-Encoding: chunked` over a plain socket (no
/// Content-Length for the server to check up front); returns the status
/// code and the JSON body of the answer.
async fn post_chunked(
    addr: std::net::SocketAddr,
    path: &str,
    chunks: Vec<Vec<u8>>,
) -> (u16, Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    // The server may answer (and close) before the upload ends; write
    // errors then are expected, and the answer is what counts.
    let upload = tokio::spawn(async move {
        write.write_all(head.as_bytes()).await?;
        for chunk in chunks {
            write
                .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                .await?;
            write.write_all(&chunk).await?;
            write.write_all(b"\r\n").await?;
        }
        write.write_all(b"0\r\n\r\n").await?;
        Ok::<_, std::io::Error>(write)
    });
    let mut answer = Vec::new();
    let _ = read.read_to_end(&mut answer).await;
    let _ = upload.await;
    let text = String::from_utf8_lossy(&answer).to_string();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {head:?}"));
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    (status, json)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_over_the_limit_sent_chunked_is_refused_too() {
    let db = TestDb::new().await;
    let service = db.serve("chunked", offline()).await;
    let pending = db.add_issues(1).await[0];
    let before = snapshot(&db).await;
    // The limit must hold while streaming, not only against a declared
    // length: a valid claim of a real issue, padded past 1 MiB.
    let mut chunks = vec![format!("{{\"issue_ids\": [{pending}]").into_bytes()];
    chunks.extend((0..20).map(|_| vec![b' '; 64 * 1024]));
    chunks.push(b"}".to_vec());
    let (status, answer) = within(
        30,
        "a chunked upload",
        post_chunked(service.addr, "/ai-articles", chunks),
    )
    .await;
    assert_eq!(status, 413, "{answer}");
    assert!(answer["error"].is_string(), "{answer}");
    // The same, under the limit, is a valid claim: the limit is what refused it.
    let small = vec![
        format!("{{\"issue_ids\": [{pending}]").into_bytes(),
        b" }".to_vec(),
    ];
    assert_eq!(snapshot(&db).await, before);
    let (status, answer) = within(
        30,
        "a small chunked upload",
        post_chunked(service.addr, "/ai-articles", small),
    )
    .await;
    assert_eq!(
        (status, answer["claimed"].clone()),
        (202, json!([pending])),
        "{answer}"
    );
    service.stop().await.unwrap();
}

/// Log lines of this test process (newsnack's, debug and up), captured once
/// for every test in this file.
fn captured_logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let sink = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter("newsnack=debug")
            .with_ansi(false)
            .with_writer(move || LogSink(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one log capture per process");
        buffer
    })
    .clone()
}

/// Transactions rolled back in `db`'s database so far, once the sessions
/// of the services that used it have ended (a session reports its figures
/// when it ends at the latest).
async fn rollbacks(db: &TestDb) -> i64 {
    until_sql_polled(
        db,
        30,
        "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity
                             WHERE datname = current_database()
                               AND (application_name LIKE 'newsnack:%'
                                    OR application_name LIKE 'newsnack-lock:%'))",
    )
    .await;
    db.scalar_i64("SELECT xact_rollback FROM pg_stat_database WHERE datname = current_database()")
        .await
}

const STORM_ISSUES: usize = 300;
const STORM_CLIENTS: usize = 32;
const WINDOW: usize = 5;
const STEP: usize = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_claim_storm_over_http_writes_every_article_exactly_once() {
    let logs = captured_logs();
    let db = TestDb::new().await;
    let service = db.serve("storm", offline()).await;
    let ids = Arc::new(db.add_issues(STORM_ISSUES).await);
    let logs_start = logs.lock().unwrap().len();
    let rollbacks_before = db
        .scalar_i64("SELECT xact_rollback FROM pg_stat_database WHERE datname = current_database()")
        .await;

    // Windows of 5 consecutive ids, advancing by 2 (the last ones shorter),
    // so every id is in two or three windows; every client walks all of
    // them from its own starting point, so 32 clients overlap everywhere.
    let windows: Arc<Vec<Vec<i64>>> = Arc::new(
        (0..STORM_ISSUES)
            .step_by(STEP)
            .map(|s| ids[s..(s + WINDOW).min(STORM_ISSUES)].to_vec())
            .collect(),
    );
    let start = Arc::new(Barrier::new(STORM_CLIENTS));
    let url = format!("http://{}/ai-articles", service.addr);
    let mut clients = Vec::new();
    for c in 0..STORM_CLIENTS {
        let (windows, start, url) = (windows.clone(), start.clone(), url.clone());
        clients.push(tokio::spawn(async move {
            let http = reqwest::Client::new();
            let first = c * windows.len() / STORM_CLIENTS;
            let mut answers = Vec::with_capacity(windows.len());
            start.wait().await;
            for k in 0..windows.len() {
                let window = &windows[(first + k) % windows.len()];
                let response = http
                    .post(&url)
                    .json(&json!({ "issue_ids": window }))
                    .send()
                    .await
                    .unwrap();
                let status = response.status();
                let answer: Value = response.json().await.unwrap();
                answers.push((window.clone(), status, answer));
            }
            answers
        }));
    }
    let mut answers = Vec::new();
    for client in clients {
        answers.extend(within(120, "the HTTP claim storm", client).await.unwrap());
    }

    let as_ids = |v: &Value| -> Vec<i64> {
        v.as_array()
            .unwrap_or_else(|| panic!("not a list: {v}"))
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect()
    };
    let mut claims: HashMap<i64, usize> = HashMap::new();
    let (mut accepted, mut conflicts) = (0, 0);
    for (window, status, answer) in &answers {
        assert!(
            !status.is_server_error(),
            "a request failed on the server: {status} {answer}"
        );
        let claimed = as_ids(&answer["claimed"]);
        let skipped = as_ids(&answer["skipped"]);
        let asked: BTreeSet<i64> = window.iter().copied().collect();
        let claimed_set: BTreeSet<i64> = claimed.iter().copied().collect();
        let skipped_set: BTreeSet<i64> = skipped.iter().copied().collect();
        assert!(claimed_set.is_disjoint(&skipped_set), "{answer}");
        assert_eq!(
            &claimed_set | &skipped_set,
            asked,
            "claimed and skipped account for exactly the asked ids: {answer}"
        );
        match *status {
            StatusCode::ACCEPTED => {
                accepted += 1;
                assert!(!claimed.is_empty(), "202 with nothing claimed: {answer}");
                for id in claimed {
                    *claims.entry(id).or_default() += 1;
                }
            }
            StatusCode::CONFLICT => {
                conflicts += 1;
                assert_eq!(answer["claimed"], json!([]), "{answer}");
                assert!(answer["error"].is_string(), "{answer}");
            }
            other => panic!("unexpected {other}: {answer}"),
        }
    }
    assert_eq!(answers.len(), STORM_CLIENTS * windows.len());
    assert!(
        accepted > 0 && conflicts > 0,
        "{accepted} accepted, {conflicts} conflicts"
    );
    let twice: Vec<_> = claims.iter().filter(|(_, &n)| n > 1).collect();
    assert!(twice.is_empty(), "ids claimed more than once: {twice:?}");
    let claimed_ids: BTreeSet<i64> = claims.keys().copied().collect();
    let all_ids: BTreeSet<i64> = ids.iter().copied().collect();
    assert_eq!(claimed_ids, all_ids, "the union of claims is every issue");

    until_sql(
        &db,
        &service.hub,
        60,
        &format!("SELECT count(*) = {STORM_ISSUES} FROM issue WHERE processing_status = 'DONE'"),
    )
    .await;
    let n = STORM_ISSUES as i64;
    assert_eq!(db.scalar_i64("SELECT count(*) FROM ai_article").await, n);
    assert_eq!(
        db.scalar_i64("SELECT count(DISTINCT issue_id) FROM ai_article")
            .await,
        n
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue WHERE attempts = 1")
            .await,
        n,
        "every issue was attempted exactly once"
    );
    assert_eq!(
        db.scalar_i64(
            "SELECT count(*) FROM ai_article a JOIN issue i ON i.id = a.issue_id
              WHERE a.claim_id = i.claim_id AND a.writer = 'offline'"
        )
        .await,
        n,
        "each article was written under its issue's one claim"
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue_transition").await,
        3 * n,
        "PENDING, IN_PROGRESS, DONE per issue and nothing else"
    );
    // No INSERT into ai_article ever failed: a failed insert (say on the
    // unique index) still burns an identity value.
    assert_eq!(
        db.scalar_i64("SELECT last_value FROM ai_article_id_seq")
            .await,
        n,
        "an ai_article insert was attempted more often than it succeeded"
    );
    service.stop().await.unwrap();

    let ours = String::from_utf8_lossy(&logs.lock().unwrap()[logs_start..]).to_string();
    for bad in [
        "duplicate key",
        "ai_article_issue_id_key",
        "answering 500",
        "answering 503",
        "could not record",
    ] {
        assert!(!ours.contains(bad), "the service logged {bad:?}:\n{ours}");
    }
    assert!(
        ours.contains("article written"),
        "the log capture works (it saw the writes)"
    );
    // No statement failed in the database either (a unique violation, say):
    // one that fails rolls its transaction back, and the service rolls none
    // back on purpose. Counted by the server itself, so checked whether it
    // is the harness's own cluster or the one at DATABASE_URL.
    assert_eq!(
        rollbacks(&db).await - rollbacks_before,
        0,
        "a transaction of the storm was rolled back: a statement failed"
    );
}

/// One issue's fencing-relevant state, for before/after comparisons.
async fn issue_state(
    db: &TestDb,
    id: i64,
) -> (String, Option<i64>, Option<String>, i32, String, i64, i64) {
    let sql = db.raw().await;
    let row = sql
        .query_one(
            "SELECT processing_status, claim_id, claimed_by, attempts,
                    concat_ws('|', last_error, updated_at, lease_until, retry_not_before),
                    (SELECT count(*) FROM ai_article WHERE issue_id = $1),
                    (SELECT count(*) FROM issue_transition WHERE issue_id = $1)
               FROM issue WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    (
        row.get(0),
        row.get(1),
        row.get(2),
        row.get(3),
        row.get(4),
        row.get(5),
        row.get(6),
    )
}

/// The lease of the claims of [`one_claimed_issue`].
const CLAIM_LEASE: Duration = Duration::from_secs(60);

/// A new issue claimed by `worker`: its id, the claim's token, and a
/// pooled connection to go on with.
async fn one_claimed_issue(db: &TestDb, worker: &str) -> (i64, i64, deadpool_postgres::Client) {
    let (claims, client) = claimed_issues(db, 1, worker, CLAIM_LEASE).await;
    (claims[0].0, claims[0].1, client)
}

/// A heartbeat, completion or failure meeting the row of its issue held by
/// another transaction (a system editing it with plain SQL, not committing)
/// does not wait for it: it says so at once, and is tried again once the
/// row is free (a shutdown's release passes it by). Waiting, every claim's
/// beat would hold a pooled connection for as long as the other transaction
/// stays open. An issue deleted under
/// a claim reads as a lost claim, not as a held row.
#[tokio::test]
async fn fenced_writes_do_not_wait_for_a_row_another_transaction_holds() {
    let db = TestDb::new().await;
    let (id, claim, client) = one_claimed_issue(&db, "beating").await;
    let lease = CLAIM_LEASE;
    let mut holder = db.raw().await;
    let held = holder.transaction().await.unwrap();
    held.execute("UPDATE issue SET score = 7 WHERE id = $1", &[&id])
        .await
        .unwrap();
    let beat = within(
        10,
        "a heartbeat on a held row",
        heartbeat(&client, id, claim, lease),
    )
    .await;
    assert!(
        matches!(beat, Err(newsnack::db::DbError::RowLocked(locked)) if locked == id),
        "{beat:?}"
    );
    assert!(
        beat.unwrap_err().is_transient(),
        "tried again, not given up"
    );
    assert_eq!(
        within(
            10,
            "a completion on a held row",
            complete(&client, id, claim, "h", "b", "w")
        )
        .await
        .unwrap(),
        Fenced::Busy
    );
    let failed = fail(&client, id, claim, "x", RetryPolicy::After(None));
    assert_eq!(
        within(10, "a failure on a held row", failed).await.unwrap(),
        Fenced::Busy
    );
    // A shutdown's release passes it by (its lease brings it back).
    let mut releasing = db.pool.get().await.unwrap();
    let claims = [(id, claim)];
    let released = newsnack::db::issue::release(&mut releasing, &claims, "shutdown", false);
    assert_eq!(
        within(10, "a release of a held row", released)
            .await
            .unwrap(),
        0
    );
    held.commit().await.unwrap();
    assert!(heartbeat(&client, id, claim, lease).await.unwrap());
    assert!(!heartbeat(&client, id, claim + 1000, lease).await.unwrap());

    // An issue deleted under a claim is gone, not busy: the claim is lost.
    db.raw()
        .await
        .execute("DELETE FROM issue WHERE id = $1", &[&id])
        .await
        .unwrap();
    assert!(!heartbeat(&client, id, claim, lease).await.unwrap());
    assert_eq!(
        complete(&client, id, claim, "h", "b", "w").await.unwrap(),
        Fenced::Lost
    );
    assert_eq!(
        fail(&client, id, claim, "x", RetryPolicy::After(None))
            .await
            .unwrap(),
        Fenced::Lost
    );
}

/// Another system inserting an article for an issue in flight, in a
/// transaction it keeps open, does not stall the completion (and every
/// completion queued behind it in the lane) on the article's unique index:
/// the issue reads as held, to be tried again, until that transaction ends.
#[tokio::test]
async fn a_completion_does_not_wait_for_an_article_another_transaction_is_inserting() {
    let db = TestDb::new().await;
    let (id, claim, client) = one_claimed_issue(&db, "mine").await;
    let mut other = db.raw().await;
    let inserting = other.transaction().await.unwrap();
    inserting
        .execute(
            "INSERT INTO ai_article (issue_id, headline, body, writer, claim_id)
             VALUES ($1, 'Theirs', 'Their body.', 'other-system', $2)",
            &[&id, &claim],
        )
        .await
        .unwrap();
    let completing = complete(&client, id, claim, "h", "b", "mine");
    assert_eq!(
        within(
            10,
            "a completion beside an article being inserted",
            completing
        )
        .await
        .unwrap(),
        Fenced::Busy
    );
    inserting.rollback().await.unwrap();
    assert_eq!(
        complete(&client, id, claim, "h", "b", "mine")
            .await
            .unwrap(),
        Fenced::Written
    );
}

/// A late worker's heartbeat, completion or failure for a claim that is no
/// longer current locks nothing: the issue, reset by another system in the
/// meantime, stays claimable by the very next request. (Each statement is
/// run inside a transaction kept open, so a row lock it took would still be
/// held when the claim comes.)
#[tokio::test]
async fn writes_of_a_claim_no_longer_current_lock_nothing() {
    let db = TestDb::new().await;
    let (id, stale, client) = one_claimed_issue(&db, "late").await;
    let lease = CLAIM_LEASE;
    let sql = db.raw().await;
    move_on(&sql, &[id], &["FAILED", "PENDING"]).await;
    let mut late = db.pool.get().await.unwrap();
    let open = late.transaction().await.unwrap();
    assert!(!heartbeat(&open, id, stale, lease).await.unwrap());
    assert_eq!(
        complete(&open, id, stale, "h", "b", "late").await.unwrap(),
        Fenced::Lost
    );
    assert_eq!(
        fail(&open, id, stale, "late", RetryPolicy::After(None))
            .await
            .unwrap(),
        Fenced::Lost
    );
    let again = claim_issues(&client, &[id], "next", lease, ClaimScope::Claimable)
        .await
        .unwrap();
    assert_eq!(again.claimed_ids(), vec![id], "the reset issue was skipped");
    open.rollback().await.unwrap();
}

#[tokio::test]
async fn a_late_worker_whose_lease_was_reaped_cannot_write() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    let client = db.pool.get().await.unwrap();
    let sql = db.raw().await;
    let short = Duration::from_secs(1);

    let old = claim_issues(&client, &[id], "late-worker", short, ClaimScope::Claimable)
        .await
        .unwrap();
    assert_eq!(old.claimed_ids(), vec![id]);
    let old_claim = old.claimed[0].claim_id;
    // The lease runs out (without waiting for it).
    sql.execute(
        "UPDATE issue SET lease_until = now() - interval '1 second' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    assert_eq!(reap_expired(&**client, 100).await.unwrap(), vec![id]);
    assert_eq!(issue_state(&db, id).await.0, "FAILED");

    // Reaped but not yet re-claimed: the old claim is already dead.
    let reaped = issue_state(&db, id).await;
    assert!(!heartbeat(&client, id, old_claim, short).await.unwrap());
    assert_eq!(
        complete(&client, id, old_claim, "late", "late body", "late")
            .await
            .unwrap(),
        Fenced::Lost
    );
    assert_eq!(
        issue_state(&db, id).await,
        reaped,
        "a dead claim changed a reaped issue"
    );

    let new = claim_issues(
        &client,
        &[id],
        "new-worker",
        Duration::from_secs(60),
        ClaimScope::Claimable,
    )
    .await
    .unwrap();
    assert_eq!(new.claimed_ids(), vec![id]);
    let new_claim = new.claimed[0].claim_id;
    assert_ne!(new_claim, old_claim, "a re-claim gets a new fencing token");
    let reclaimed = issue_state(&db, id).await;
    assert_eq!(
        (
            reclaimed.0.as_str(),
            reclaimed.1,
            reclaimed.2.as_deref(),
            reclaimed.3,
            reclaimed.5
        ),
        ("IN_PROGRESS", Some(new_claim), Some("new-worker"), 2, 0)
    );

    // The late worker finishes now: neither outcome lands.
    assert_eq!(
        complete(&client, id, old_claim, "late headline", "late body", "late")
            .await
            .unwrap(),
        Fenced::Lost
    );
    assert_eq!(
        fail(&client, id, old_claim, "late failure", RetryPolicy::Never)
            .await
            .unwrap(),
        Fenced::Lost
    );
    assert_eq!(
        fail(
            &client,
            id,
            old_claim,
            "late failure",
            RetryPolicy::After(None)
        )
        .await
        .unwrap(),
        Fenced::Lost
    );
    assert!(!heartbeat(&client, id, old_claim, Duration::from_secs(600))
        .await
        .unwrap());
    assert_eq!(
        issue_state(&db, id).await,
        reclaimed,
        "the late worker changed the re-claimed issue"
    );
    assert_eq!(
        reap_expired(&**client, 100).await.unwrap(),
        Vec::<i64>::new()
    );

    // The current claim still writes, once.
    assert_eq!(
        complete(&client, id, new_claim, "headline", "body", "offline")
            .await
            .unwrap(),
        Fenced::Written
    );
    assert_eq!(
        complete(&client, id, new_claim, "again", "again", "offline")
            .await
            .unwrap(),
        Fenced::Lost,
        "a claim completes once"
    );
    let row = sql
        .query_one(
            "SELECT i.processing_status, a.claim_id, a.headline
               FROM issue i JOIN ai_article a ON a.issue_id = i.id WHERE i.id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, i64>(1),
            row.get::<_, String>(2)
        ),
        ("DONE".to_string(), new_claim, "headline".to_string())
    );
}

#[tokio::test]
async fn the_reaper_leaves_heartbeated_and_completed_issues_alone() {
    let db = TestDb::new().await;
    let short = Duration::from_secs(1);
    let (claimed, client) = claimed_issues(&db, 5, "w", short).await;
    let ids: Vec<i64> = claimed.iter().map(|c| c.0).collect();
    let (beating, completed, expired, beating_now, completing_now) =
        (ids[0], ids[1], ids[2], ids[3], ids[4]);
    let sql = db.raw().await;
    let claims: HashMap<i64, i64> = claimed.into_iter().collect();
    assert_eq!(
        complete(&client, completed, claims[&completed], "h", "b", "offline")
            .await
            .unwrap(),
        Fenced::Written
    );
    // Every live lease has run out...
    sql.execute(
        "UPDATE issue SET lease_until = now() - interval '1 second' WHERE processing_status = 'IN_PROGRESS'",
        &[],
    )
    .await
    .unwrap();
    // ...but one worker heartbeats before the reaper comes.
    assert!(
        heartbeat(&client, beating, claims[&beating], Duration::from_secs(60))
            .await
            .unwrap()
    );

    // Two workers are mid-write when the reaper comes: a heartbeat and a
    // completion, both uncommitted and holding their rows.
    let heart = db.raw().await;
    heart
        .batch_execute(&format!(
            "BEGIN; UPDATE issue SET lease_until = now() + interval '60 seconds'
                     WHERE id = {beating_now} AND claim_id = {} AND processing_status = 'IN_PROGRESS'",
            claims[&beating_now]
        ))
        .await
        .unwrap();
    let finisher = db.raw().await;
    finisher
        .batch_execute(&format!(
            "BEGIN; UPDATE issue SET processing_status = 'DONE'
                     WHERE id = {completing_now} AND claim_id = {} AND processing_status = 'IN_PROGRESS';
             INSERT INTO ai_article (issue_id, headline, body, writer, claim_id)
             VALUES ({completing_now}, 'h', 'b', 'offline', {});",
            claims[&completing_now], claims[&completing_now]
        ))
        .await
        .unwrap();

    let reaped = within(
        10,
        "a reaper that skips locked rows",
        reap_expired(&**client, 100),
    )
    .await
    .unwrap();
    assert_eq!(
        reaped,
        vec![expired],
        "only the truly expired lease is reaped"
    );
    heart.batch_execute("COMMIT").await.unwrap();
    finisher.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        reap_expired(&**client, 100).await.unwrap(),
        Vec::<i64>::new(),
        "after the workers commit there is nothing left to reap"
    );

    let statuses: Vec<(i64, String, Option<String>)> = sql
        .query(
            "SELECT id, processing_status, last_error FROM issue ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        statuses,
        vec![
            (beating, "IN_PROGRESS".into(), None),
            (completed, "DONE".into(), None),
            (expired, "FAILED".into(), Some("lease expired".into())),
            (beating_now, "IN_PROGRESS".into(), None),
            (completing_now, "DONE".into(), None),
        ]
    );
    // The heartbeated claims are still their workers' to finish.
    for id in [beating, beating_now] {
        assert_eq!(
            complete(&client, id, claims[&id], "h", "b", "offline")
                .await
                .unwrap(),
            Fenced::Written
        );
    }
    assert_eq!(db.scalar_i64("SELECT count(*) FROM ai_article").await, 4);
}

/// What the OpenAPI document allows is accepted: integers written as
/// whole floats (JSON Schema counts `2.0` an integer), a title at its
/// limit in characters however many bytes they take, a `collected_at` of
/// `null`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_the_document_allows_are_accepted() {
    let db = TestDb::new().await;
    let service = db.serve("allowed", offline()).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();

    let title = "é".repeat(newsnack::input::MAX_TITLE_CHARS);
    let (status, created) = send(
        &http,
        Method::POST,
        &format!("{base}/issues"),
        JSON,
        body(json!({ "issues": [{ "title": title, "collected_at": null, "score": 2 }] })),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let id = created["ids"][0].as_i64().unwrap();

    let as_float = || format!("{id}.0");
    let (status, claimed) = send(
        &http,
        Method::POST,
        &format!("{base}/ai-articles"),
        JSON,
        raw(&format!("{{\"issue_ids\": [{}]}}", as_float())),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{claimed}");
    assert_eq!(claimed["claimed"], json!([id]));

    let (status, waited) = send(
        &http,
        Method::POST,
        &format!("{base}/waits"),
        JSON,
        raw(&format!(
            "{{\"issue_ids\": [{}], \"min_completion\": 1.0, \"timeout_s\": 60}}",
            as_float()
        )),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{waited}");
    assert_eq!(waited["outcome"], json!("all_pass"));

    let (status, assembled) = send(
        &http,
        Method::POST,
        &format!("{base}/today-newsnack"),
        JSON,
        raw(&format!("{{\"issue_ids\": [{}, {id}e0]}}", as_float())),
    )
    .await;
    // The same id twice, spelled two ways: once in the briefing.
    assert_eq!(status, StatusCode::CREATED, "{assembled}");
    assert_eq!(assembled["issue_ids"], json!([id]));
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_health_and_readiness_answer_in_shape() {
    let db = TestDb::new().await;
    let service = db.serve("shapes", offline()).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();

    let (status, created) = send(
        &http,
        Method::POST,
        &format!("{base}/issues"),
        JSON,
        body(json!({ "issues": [
            { "title": "Rates rise", "body": "The bank raised rates.", "score": 9.5,
              "collected_at": "2025-01-02T03:04:05Z" },
            { "title": "Storm warning" }
        ] })),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let created: Vec<i64> = created["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    assert_eq!(created.len(), 2);
    assert!(
        created[0] > 0 && created[1] > created[0],
        "ids in input order"
    );

    let (status, issue) = send(
        &http,
        Method::GET,
        &format!("{base}/issues/{}", created[0]),
        None,
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{issue}");
    assert_eq!(issue["id"], json!(created[0]));
    assert_eq!(issue["title"], json!("Rates rise"));
    assert_eq!(issue["body"], json!("The bank raised rates."));
    assert_eq!(issue["score"], json!(9.5));
    assert_eq!(issue["status"], json!("PENDING"));
    assert_eq!(issue["attempts"], json!(0));
    assert_eq!(issue["last_error"], Value::Null);
    assert_eq!(issue["claimed_by"], Value::Null);
    assert_eq!(issue["lease_until"], Value::Null);
    let rfc3339 = &time::format_description::well_known::Rfc3339;
    let collected =
        time::OffsetDateTime::parse(issue["collected_at"].as_str().unwrap(), rfc3339).unwrap();
    assert_eq!(collected, time::macros::datetime!(2025-01-02 03:04:05 UTC));
    assert!(
        time::OffsetDateTime::parse(issue["updated_at"].as_str().unwrap(), rfc3339).is_ok(),
        "{issue}"
    );

    let (status, defaults) = send(
        &http,
        Method::GET,
        &format!("{base}/issues/{}", created[1]),
        None,
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (defaults["body"].clone(), defaults["score"].clone()),
        (json!(""), json!(0.0))
    );

    // After generation the same endpoint shows the outcome.
    let (status, answer) = send(
        &http,
        Method::POST,
        &format!("{base}/ai-articles"),
        JSON,
        body(json!({ "issue_ids": [created[0], 987654321] })),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    assert_eq!(
        answer,
        json!({ "claimed": [created[0]], "skipped": [987654321] })
    );
    until_sql(
        &db,
        &service.hub,
        30,
        &format!(
            "SELECT processing_status = 'DONE' FROM issue WHERE id = {}",
            created[0]
        ),
    )
    .await;
    let (_, issue) = send(
        &http,
        Method::GET,
        &format!("{base}/issues/{}", created[0]),
        None,
        None,
    )
    .await;
    assert_eq!(
        (issue["status"].clone(), issue["attempts"].clone()),
        (json!("DONE"), json!(1))
    );
    assert_eq!(issue["claimed_by"], json!("shapes"));

    let (status, missing) = send(
        &http,
        Method::GET,
        &format!("{base}/issues/987654321"),
        None,
        None,
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(
        missing["error"]
            .as_str()
            .is_some_and(|e| e.contains("987654321")),
        "{missing}"
    );

    let (status, health) = send(&http, Method::GET, &format!("{base}/healthz"), None, None).await;
    assert_eq!(
        (status, health),
        (StatusCode::OK, json!({ "status": "ok" }))
    );
    let (status, ready) = send(&http, Method::GET, &format!("{base}/readyz"), None, None).await;
    assert_eq!(status, StatusCode::OK, "{ready}");
    // The test cluster speaks no TLS: `prefer` falls back to plain, and
    // readiness says so.
    let plain = json!({ "encrypted": false, "verified": "none" });
    assert_eq!(
        ready,
        json!({
            "database": true,
            "writable": true,
            "listener": true,
            "sessions": { "pooled": plain, "direct": plain },
        })
    );
    service.stop().await.unwrap();
}

/// Completes one claim through the batched statement.
async fn complete(
    client: &impl Sql,
    id: i64,
    claim_id: i64,
    headline: &str,
    body: &str,
    writer: &str,
) -> Result<Fenced, newsnack::db::DbError> {
    let completion = Completion {
        id,
        claim_id,
        headline: headline.into(),
        body: body.into(),
        usage: Default::default(),
    };
    let fenced = newsnack::db::issue::complete(client, &[completion], writer).await?;
    Ok(fenced[0])
}

#[tokio::test]
async fn a_batch_of_completions_writes_the_current_claims_and_fences_the_rest() {
    let db = TestDb::new().await;
    let (claimed, client) = claimed_issues(&db, 4, "w", Duration::from_secs(60)).await;
    let ids: Vec<i64> = claimed.iter().map(|c| c.0).collect();
    let claims: std::collections::HashMap<i64, i64> = claimed.into_iter().collect();
    let completion = |id: i64, claim_id: i64| Completion {
        id,
        claim_id,
        headline: format!("headline {id}/{claim_id}"),
        body: "body".into(),
        usage: Default::default(),
    };
    // ids[3] was taken away from its worker before the batch commits.
    client
        .execute(
            "UPDATE issue SET processing_status = 'FAILED', last_error = 'by hand' WHERE id = $1",
            &[&ids[3]],
        )
        .await
        .unwrap();
    let batch = [
        completion(ids[0], claims[&ids[0]]),
        completion(ids[1], claims[&ids[1]] + 1000), // a stale fencing token
        completion(ids[2], claims[&ids[2]]),
        completion(ids[3], claims[&ids[3]]),
    ];
    assert_eq!(
        newsnack::db::issue::complete(&client, &batch, "offline")
            .await
            .unwrap(),
        vec![Fenced::Written, Fenced::Lost, Fenced::Written, Fenced::Lost]
    );
    let rows = client
        .query(
            "SELECT i.id, i.processing_status, a.headline
               FROM issue i LEFT JOIN ai_article a ON a.issue_id = i.id
              WHERE i.id = ANY($1) ORDER BY i.id",
            &[&ids],
        )
        .await
        .unwrap();
    let got: Vec<(i64, String, Option<String>)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        got,
        vec![
            (
                ids[0],
                "DONE".into(),
                Some(format!("headline {}/{}", ids[0], claims[&ids[0]]))
            ),
            (ids[1], "IN_PROGRESS".into(), None),
            (
                ids[2],
                "DONE".into(),
                Some(format!("headline {}/{}", ids[2], claims[&ids[2]]))
            ),
            (ids[3], "FAILED".into(), None),
        ]
    );
}

/// `POST {url}` (an `/ai-articles`) with `ids` as its `issue_ids`.
async fn post_issue_ids(http: &reqwest::Client, url: &str, ids: Vec<i64>) -> (StatusCode, Value) {
    send(
        http,
        Method::POST,
        url,
        Some("application/json"),
        body(json!({ "issue_ids": ids })),
    )
    .await
}

/// Calls, in this database, of the claim however it was sent, and
/// transitions logged.
async fn claim_path_statements(db: &TestDb) -> (i64, i64) {
    (
        db.claim_statements().await,
        db.scalar_i64("SELECT count(*) FROM issue_transition").await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hopeless_claims_write_nothing_and_known_done_ids_skip_the_database() {
    let db = TestDb::new().await;
    db.count_statements().await;
    let ids = db.add_issues(6).await;
    // ids[4] is DONE and ids[5] IN_PROGRESS before the service starts, so
    // it has never heard of either.
    db.move_with_sql(&ids[4..], &["IN_PROGRESS"]).await;
    db.move_with_sql(&ids[4..5], &["DONE"]).await;
    let service = db.serve("done-cache", offline()).await;
    let url = format!("http://{}/ai-articles", service.addr);
    let http = reqwest::Client::new();
    let post = |ids: Vec<i64>| post_issue_ids(&http, &url, ids);

    // Nothing claimable: one claim statement, which logs no transition; the
    // DONE one is remembered from its answer, so asking for it alone needs
    // no statement at all.
    let before = claim_path_statements(&db).await;
    let (status, answer) = post(vec![ids[5], ids[4]]).await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    assert_eq!(answer["skipped"], json!([ids[4], ids[5]]));
    assert_eq!(claim_path_statements(&db).await, (before.0 + 1, before.1));
    let (status, _) = post(vec![ids[4]]).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(claim_path_statements(&db).await, (before.0 + 1, before.1));

    // Completions by the service are learnt from the listener, a moment
    // after they commit: ask until an answer needs no statement at all.
    let (status, _) = post(ids[..3].to_vec()).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    until_done_count(&db, &service.hub, 30, 4).await;
    within(30, "a claim answered from what the service knows", async {
        loop {
            let before = claim_path_statements(&db).await.0;
            let (status, answer) = post(ids[..3].to_vec()).await;
            assert_eq!(status, StatusCode::CONFLICT, "{answer}");
            if claim_path_statements(&db).await.0 == before {
                break;
            }
        }
    })
    .await;
    let before = claim_path_statements(&db).await;
    for _ in 0..20 {
        let (status, answer) = post(vec![ids[2], ids[0], ids[4]]).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(answer["claimed"], json!([]));
        assert_eq!(answer["skipped"], json!([ids[0], ids[2], ids[4]]));
        assert!(answer["error"].is_string());
    }
    assert_eq!(
        claim_path_statements(&db).await,
        before,
        "no statement for known-DONE ids"
    );

    // A mixed request claims the open issue through the database and still
    // lists the finished ones as skipped.
    let (status, answer) = post(vec![ids[3], ids[1], ids[0]]).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    assert_eq!(answer["claimed"], json!([ids[3]]));
    assert_eq!(answer["skipped"], json!([ids[0], ids[1]]));
    assert_eq!(claim_path_statements(&db).await.0, before.0 + 1);
    until_sql(&db, &service.hub, 30, "SELECT count(*) = 4 FROM ai_article").await;
    service.stop().await.unwrap();
}

/// Ids the service knows `DONE` are forgotten when issues are removed: a
/// `TRUNCATE .. RESTART IDENTITY`, or a delete and an insert under the same
/// ids, brings the ids back as new issues, which are then claimed, not
/// answered as finished from memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_of_removed_issues_are_claimable_again_when_they_come_back() {
    let db = TestDb::new().await;
    let service = db.serve("removals", offline()).await;
    let url = format!("http://{}/ai-articles", service.addr);
    let http = reqwest::Client::new();
    let post = |ids: Vec<i64>| post_issue_ids(&http, &url, ids);
    let sql = db.raw().await;
    let removals: [(&str, &str); 2] = [
        (
            "TRUNCATE issue RESTART IDENTITY CASCADE",
            "INSERT INTO issue (title) SELECT 'again ' || g FROM generate_series(1, 3) g",
        ),
        (
            "DELETE FROM ai_article; DELETE FROM issue",
            "INSERT INTO issue (id, title) SELECT g, 'once more ' || g FROM generate_series(1, 3) g",
        ),
    ];
    let mut ids = db.add_issues(3).await;
    let (status, answer) = post(ids.clone()).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    for (remove, add_again) in removals {
        until_done_count(&db, &service.hub, 30, 3).await;
        // Known DONE by now, from the listener.
        until_caught_up(&db, &service.hub).await;
        let (status, _) = post(ids.clone()).await;
        assert_eq!(status, StatusCode::CONFLICT);

        let mut removed = service.hub.issues_removed();
        removed.borrow_and_update();
        // A delete that removes nothing is not announced: a transition
        // committed after it arrives, and no notice came before it.
        sql.batch_execute("DELETE FROM issue WHERE false")
            .await
            .unwrap();
        db.add_issues(1).await;
        until_caught_up(&db, &service.hub).await;
        assert!(!removed.has_changed().unwrap(), "an empty delete announced");
        sql.batch_execute(remove).await.unwrap();
        within(10, "the removal notice", removed.changed())
            .await
            .unwrap();
        sql.batch_execute(add_again).await.unwrap();
        let again = db.ids("SELECT id FROM issue ORDER BY id").await;
        assert_eq!(again, ids, "the same ids, for new issues");
        let (status, answer) = post(ids.clone()).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
        assert_eq!(answer["claimed"], json!(ids));
        ids = again;
    }
    service.stop().await.unwrap();
}

/// A transaction that finishes an issue, removes it and inserts a new one
/// under its id: the removal is announced at once, the transitions at
/// commit, so the service hears of the `DONE` after the removal. The new
/// issue's arrival makes it forget the id all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_finished_removed_and_reused_in_one_transaction_is_claimable() {
    let db = TestDb::new().await;
    let service = db.serve("reuse", offline()).await;
    let url = format!("http://{}/ai-articles", service.addr);
    let http = reqwest::Client::new();
    let id = db.add_issues(1).await[0];
    let sql = db.raw().await;
    sql.batch_execute(&format!(
        "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = {id};
         BEGIN;
         UPDATE issue SET processing_status = 'DONE' WHERE id = {id};
         DELETE FROM issue WHERE id = {id};
         INSERT INTO issue (id, title) VALUES ({id}, 'the same id, a new issue');
         COMMIT;"
    ))
    .await
    .unwrap();
    until_caught_up(&db, &service.hub).await;
    let (status, answer) = post_issue_ids(&http, &url, vec![id]).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    assert_eq!(answer["claimed"], json!([id]));
    service.stop().await.unwrap();
}

/// A date or time written with plain SQL that the service cannot represent
/// (`infinity`, `-infinity`, a year beyond 9999) makes the reads that meet
/// it answer 500 with a JSON error naming the row and the column, not drop
/// the connection; the transition log's reader says the same; everything
/// else is served as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dates_the_service_cannot_represent_are_a_json_500_naming_the_row() {
    let db = TestDb::new().await;
    let service = db.serve("dates", offline()).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    let ids = db.add_issues(2).await;
    let (bad, good) = (ids[0], ids[1]);
    let sql = db.raw().await;
    // Migration 13 refuses such values now; rows stored before it can
    // still hold them.
    sql.batch_execute(
        "ALTER TABLE issue DROP CONSTRAINT issue_updated_at_in_range;
         ALTER TABLE briefing DROP CONSTRAINT briefing_created_at_in_range;
         ALTER TABLE pipeline_run DROP CONSTRAINT pipeline_run_times_in_range;",
    )
    .await
    .unwrap();
    sql.execute(
        "UPDATE issue SET updated_at = 'infinity' WHERE id = $1",
        &[&bad],
    )
    .await
    .unwrap();
    let briefing: i64 = sql
        .query_one(
            "INSERT INTO briefing (title, briefing_date, issue_ids, body, created_at)
             VALUES ('t', '2026-01-01', ARRAY[$1::bigint], 'b', '10000-01-01 00:00:00+00')
             RETURNING id",
            &[&good],
        )
        .await
        .unwrap()
        .get(0);
    let run: i64 = sql
        .query_one(
            "INSERT INTO pipeline_run (trigger, instance, started_at)
             VALUES ('manual', 'elsewhere', '-infinity') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    for (path, expected) in [
        (format!("/issues/{bad}"), format!("issue {bad}: updated_at")),
        (
            "/briefings/latest".to_string(),
            format!("briefing {briefing}: created_at"),
        ),
        (
            format!("/briefings/{briefing}"),
            format!("briefing {briefing}: created_at"),
        ),
        (
            "/pipeline-runs".to_string(),
            format!("pipeline run {run}: started_at"),
        ),
        (
            "/dashboard.json".to_string(),
            format!("pipeline run {run}: started_at"),
        ),
    ] {
        let (status, answer) = send(&http, Method::GET, &format!("{base}{path}"), None, None).await;
        assert_eq!(
            status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{path}: {answer}"
        );
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(&expected) && error.contains("cannot read"),
            "{path}: {answer}"
        );
    }

    // The log's reader meets such a value as an error, too.
    let seq: i64 = sql
        .query_one(
            "UPDATE issue_transition SET at = 'infinity'
              WHERE seq = (SELECT max(seq) FROM issue_transition WHERE issue_id = $1)
             RETURNING seq",
            &[&good],
        )
        .await
        .unwrap()
        .get(0);
    let client = db.pool.get().await.unwrap();
    let err = newsnack::db::transition::read_after(&**client, 0, Some(good), 10)
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("transition {seq}: at holds")),
        "{err}"
    );

    let (status, issue) = send(
        &http,
        Method::GET,
        &format!("{base}/issues/{good}"),
        None,
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{issue}");
    service.stop().await.unwrap();
}

/// The transition log going backwards under a running service (a restore
/// from an older backup, the log truncated) is found when the listener
/// next connects: the service says so and reports not ready, instead of
/// waiting in silence for `seq`s it would take for repeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_that_went_backwards_makes_the_service_not_ready() {
    let db = TestDb::new().await;
    db.add_issues(3).await;
    let service = db.serve("rewound", offline()).await;
    let readyz = format!("http://{}/readyz", service.addr);
    assert_eq!(
        reqwest::get(&readyz).await.unwrap().status(),
        StatusCode::OK
    );
    let mut status = service.hub.status();
    let pid = status.borrow().backend_pid.expect("connected");
    let sql = db.raw().await;
    sql.batch_execute("TRUNCATE issue_transition RESTART IDENTITY")
        .await
        .unwrap();
    sql.execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    let rewound = within(
        30,
        "the next session to find the log behind",
        status.wait_for(|s| s.log_ends_before.is_some()),
    )
    .await
    .unwrap()
    .log_ends_before;
    assert_eq!(rewound, Some(0));
    let answer = reqwest::get(&readyz).await.unwrap();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = answer.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("restart"),
        "{body}"
    );
    service.stop().await.unwrap();
}
