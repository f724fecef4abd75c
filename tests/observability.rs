//! Observability and access control over a real socket: the API token
//! guards every endpoint that changes something (tests/access.rs goes
//! through every route with every kind of token), `/metrics`
//! is valid Prometheus text whose figures follow what the service does, and
//! every response carries an `x-request-id` that also tags the request's log
//! lines.
//!
//! The metrics recorder is process-wide, so the tests of this file take
//! turns ([`one_at_a_time`]) and each stops its service before the next
//! starts: the figures then move by exactly what the running test did.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

use common::http::{answer, json_body, request};
use common::writers::FatalFor;
use common::{offline, within, LogSink, Setup, TestDb};
use futures::future::{BoxFuture, FutureExt};
use newsnack::events::hub::EventHub;
use newsnack::model::status::Status;
use newsnack::serve::RunningService;
use newsnack::writer::{Article, IssueText, SharedWriter, WriteError, Writer};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Semaphore};

const TOKEN: &str = "obs-token-4f1c9a7e2b";

/// Serialises the tests of this file (see the module docs).
async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    TURN.lock().await
}

/// Starts the service with `api_token`.
async fn serve_with_token(
    db: &TestDb,
    instance: &str,
    writer: SharedWriter,
    api_token: Option<&str>,
) -> RunningService {
    let setup = Setup {
        tokens: newsnack::http::auth::Tokens {
            api: api_token.map(str::to_string),
            ..Default::default()
        },
        ..Setup::default()
    };
    db.serve_with(instance, writer, setup).await
}

/// One answer: status, headers and the body as JSON (`Value::Null` when the
/// body is empty).
struct Answer {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

async fn send(
    http: &reqwest::Client,
    method: Method,
    url: &str,
    authorization: Option<&str>,
    body: Option<&Value>,
) -> Answer {
    let authorization = authorization.map(|value| (reqwest::header::AUTHORIZATION, value));
    let mut request = request(http, &method, url, authorization);
    if let Some(body) = body {
        request = request.json(body);
    }
    let (status, headers, text) = answer(request, &method, url).await;
    let body = if text.is_empty() {
        Value::Null
    } else {
        json_body(&text, &method, url, status)
    };
    Answer {
        status,
        headers,
        body,
    }
}

/// What a refused request must not change.
#[derive(Debug, PartialEq, Eq)]
struct Counts {
    issues: i64,
    transitions: i64,
    articles: i64,
    briefings: i64,
    statuses: String,
}

async fn counts(db: &TestDb) -> Counts {
    let row = db
        .raw()
        .await
        .query_one(
            "SELECT (SELECT count(*) FROM issue),
                    (SELECT count(*) FROM issue_transition),
                    (SELECT count(*) FROM ai_article),
                    (SELECT count(*) FROM briefing),
                    (SELECT COALESCE(string_agg(id || ':' || processing_status || ':' || attempts, ',' ORDER BY id), '') FROM issue)",
            &[],
        )
        .await
        .unwrap();
    Counts {
        issues: row.get(0),
        transitions: row.get(1),
        articles: row.get(2),
        briefings: row.get(3),
        statuses: row.get(4),
    }
}

/// Waits until the listener has published `n` transitions into `to`
/// (subscribe before causing them).
async fn transitions_into(
    live: &mut tokio::sync::broadcast::Receiver<newsnack::model::transition::Transition>,
    to: Status,
    n: usize,
) -> Vec<i64> {
    within(20, &format!("{n} transitions into {to:?}"), async {
        let mut ids = Vec::new();
        while ids.len() < n {
            let t = live.recv().await.expect("the listener is running");
            if t.to == to {
                ids.push(t.issue_id);
            }
        }
        ids
    })
    .await
}

fn request_id(answer: &Answer) -> String {
    answer
        .headers
        .get("x-request-id")
        .expect("every response has an x-request-id")
        .to_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_change_needs_the_token() {
    let _turn = one_at_a_time().await;
    let db = TestDb::new().await;
    let ids = db.add_issues(2).await;
    let service = serve_with_token(&db, "auth", offline(), Some(TOKEN)).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    let bearer = format!("Bearer {TOKEN}");

    // One issue DONE, so an unauthorised briefing request would succeed if
    // it were let through.
    let mut live = service.hub.subscribe();
    let answer = send(
        &http,
        Method::POST,
        &format!("{base}/ai-articles"),
        Some(&bearer),
        Some(&json!({"issue_ids": [ids[0]]})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::ACCEPTED, "{}", answer.body);
    transitions_into(&mut live, Status::Done, 1).await;

    // Each request below would change something (or, for the wait, answer)
    // if it got through.
    let changes: Vec<(&str, Value)> = vec![
        (
            "/issues",
            json!({"issues": [{"title": "sneaky", "body": "b", "score": 1.0}]}),
        ),
        ("/ai-articles", json!({"issue_ids": [ids[1]]})),
        ("/waits", json!({"issue_ids": [ids[0]], "timeout_s": 5})),
        ("/today-newsnack", json!({"issue_ids": [ids[0]]})),
    ];
    let wrong_credentials = [
        None,
        Some("Bearer wrong".to_string()),
        Some(format!("Bearer {TOKEN}x")),
        Some(format!("Bearer {}", &TOKEN[..TOKEN.len() - 1])),
        Some(format!("Basic {TOKEN}")),
        Some(TOKEN.to_string()),
        Some("Bearer ".to_string()),
    ];
    let before = counts(&db).await;
    for (path, body) in &changes {
        for credentials in &wrong_credentials {
            let answer = send(
                &http,
                Method::POST,
                &format!("{base}{path}"),
                credentials.as_deref(),
                Some(body),
            )
            .await;
            let what = format!("POST {path} with {credentials:?}");
            assert_eq!(
                answer.status,
                StatusCode::UNAUTHORIZED,
                "{what}: {}",
                answer.body
            );
            assert!(
                answer.body["error"].as_str().is_some_and(|e| !e.is_empty()),
                "{what}: {}",
                answer.body
            );
            assert!(
                answer
                    .headers
                    .get_all(reqwest::header::WWW_AUTHENTICATE)
                    .iter()
                    .any(|v| v.to_str().is_ok_and(|v| v.starts_with("Bearer "))),
                "{what}"
            );
            assert!(!request_id(&answer).is_empty(), "{what}");
        }
    }
    // Other methods and unknown paths are refused before anything else.
    for (method, path) in [
        (Method::DELETE, format!("/issues/{}", ids[0])),
        (Method::PUT, "/issues".to_string()),
        (Method::POST, "/no-such-endpoint".to_string()),
    ] {
        let answer = send(&http, method.clone(), &format!("{base}{path}"), None, None).await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED, "{method} {path}");
    }
    assert_eq!(
        counts(&db).await,
        before,
        "a refused request changed the database"
    );

    // The probes and /metrics need no token; reads need it too
    // (tests/access.rs goes through every route).
    for path in ["/healthz", "/readyz", "/metrics"] {
        let response = http.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "GET {path}");
    }
    let head = http.head(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(head.status(), StatusCode::OK, "HEAD /healthz");
    for path in [format!("/issues/{}", ids[0]), "/pipeline-runs".to_string()] {
        let url = format!("{base}{path}");
        let without = http.get(&url).send().await.unwrap();
        assert_eq!(without.status(), StatusCode::UNAUTHORIZED, "GET {path}");
        let with = http.get(&url).bearer_auth(TOKEN).send().await.unwrap();
        assert_eq!(with.status(), StatusCode::OK, "GET {path}");
    }
    let unknown = send(
        &http,
        Method::GET,
        &format!("{base}/no-such-endpoint"),
        Some(&bearer),
        None,
    )
    .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);

    // The right token gets the normal answers (the scheme is
    // case-insensitive).
    let mut answers = Vec::new();
    for (i, (path, body)) in changes.iter().enumerate() {
        let authorization = if i % 2 == 0 {
            bearer.clone()
        } else {
            format!("bearer {TOKEN}")
        };
        let mut live = service.hub.subscribe();
        let answer = send(
            &http,
            Method::POST,
            &format!("{base}{path}"),
            Some(&authorization),
            Some(body),
        )
        .await;
        if *path == "/ai-articles" {
            transitions_into(&mut live, Status::Done, 1).await;
        }
        answers.push((path, answer));
    }
    let statuses: Vec<(&str, StatusCode)> = answers.iter().map(|(p, a)| (**p, a.status)).collect();
    assert_eq!(
        statuses,
        vec![
            ("/issues", StatusCode::CREATED),
            ("/ai-articles", StatusCode::ACCEPTED),
            ("/waits", StatusCode::OK),
            ("/today-newsnack", StatusCode::CREATED),
        ],
        "{:?}",
        answers.iter().map(|(_, a)| &a.body).collect::<Vec<_>>()
    );
    assert_eq!(answers[1].1.body["claimed"], json!([ids[1]]));
    assert_eq!(answers[2].1.body["outcome"], json!("all_pass"));
    assert!(answers[3].1.body["briefing_id"].is_i64());
    let after = counts(&db).await;
    assert_eq!(after.issues, before.issues + 1);
    assert_eq!(after.articles, before.articles + 1);
    assert_eq!(after.briefings, before.briefings + 1);

    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_nothing_is_asked_for() {
    let _turn = one_at_a_time().await;
    let db = TestDb::new().await;
    let service = serve_with_token(&db, "open", offline(), None).await;
    let base = format!("http://{}", service.addr);
    let answer = send(
        &reqwest::Client::new(),
        Method::POST,
        &format!("{base}/issues"),
        None,
        Some(&json!({"issues": [{"title": "t", "body": "b", "score": 1.0}]})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);
    assert_eq!(db.scalar_i64("SELECT count(*) FROM issue").await, 1);
    service.stop().await.unwrap();
}

// ---------------------------------------------------------------- metrics

/// One sample line of the Prometheus text format.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

fn is_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn is_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn parse_value(text: &str) -> Result<f64, String> {
    match text {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => text
            .parse::<f64>()
            .map_err(|e| format!("value {text:?}: {e}")),
    }
}

/// `{a="x",b="y\"z"}` → labels, and what follows the closing brace.
fn parse_labels(text: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches(' ');
        if let Some(after) = rest.strip_prefix('}') {
            return Ok((labels, after));
        }
        let (name, after) = rest.split_once("=\"").ok_or("label without =\"")?;
        if !is_label_name(name) {
            return Err(format!("bad label name {name:?}"));
        }
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err("unterminated label value".into()),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    other => return Err(format!("bad escape {other:?}")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        if labels.insert(name.to_string(), value).is_some() {
            return Err(format!("label {name} twice"));
        }
        rest = &after[end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

/// Parses the text format strictly: `# TYPE` and `# HELP` lines are well
/// formed, every sample is `name{labels} value [timestamp]` with a float
/// value, and belongs to a family whose type was declared before it.
fn parse_prometheus(text: &str) -> Result<Vec<Sample>, String> {
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let at = |e: String| format!("line {}: {e}: {line:?}", n + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            let words: Vec<&str> = comment.trim_start().splitn(3, ' ').collect();
            match words.as_slice() {
                ["TYPE", name, kind] => {
                    if !is_metric_name(name) {
                        return Err(at(format!("bad metric name {name:?}")));
                    }
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(kind) {
                        return Err(at(format!("unknown type {kind:?}")));
                    }
                    if types.insert(name.to_string(), kind.to_string()).is_some() {
                        return Err(at(format!("second TYPE for {name}")));
                    }
                }
                ["TYPE", ..] => return Err(at("malformed TYPE line".into())),
                ["HELP", name, ..] if is_metric_name(name) => {}
                ["HELP", ..] => return Err(at("malformed HELP line".into())),
                _ => {}
            }
            continue;
        }
        let name_end = line.find(['{', ' ']).ok_or_else(|| at("no value".into()))?;
        let name = &line[..name_end];
        if !is_metric_name(name) {
            return Err(at(format!("bad metric name {name:?}")));
        }
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end + 1..]).map_err(at)?
        } else {
            (BTreeMap::new(), &line[name_end..])
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let value = match fields.as_slice() {
            [value] => parse_value(value).map_err(at)?,
            [value, timestamp] => {
                timestamp
                    .parse::<i64>()
                    .map_err(|e| at(format!("timestamp: {e}")))?;
                parse_value(value).map_err(at)?
            }
            _ => return Err(at("expected `value [timestamp]`".into())),
        };
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                let base = name.strip_suffix(suffix)?;
                matches!(
                    types.get(base).map(String::as_str),
                    Some("histogram" | "summary")
                )
                .then_some(base)
            })
            .unwrap_or(name);
        if !types.contains_key(family) {
            return Err(at(format!("sample of {family} before its TYPE line")));
        }
        samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    Ok(samples)
}

/// The parsed metrics, with lookups that read an absent series as 0.
struct Scrape {
    text: String,
    samples: Vec<Sample>,
}

impl Scrape {
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .sum()
    }

    fn has_type(&self, name: &str, kind: &str) -> bool {
        self.text
            .lines()
            .any(|l| l == format!("# TYPE {name} {kind}"))
    }
}

async fn scrape(http: &reqwest::Client, base: &str) -> Scrape {
    let response = http.get(format!("{base}/metrics")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert_eq!(content_type, "text/plain; version=0.0.4");
    assert!(response.headers().contains_key("x-request-id"));
    let text = response.text().await.unwrap();
    let samples = parse_prometheus(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    Scrape { text, samples }
}

#[test]
fn the_parser_rejects_what_prometheus_would() {
    let good = "# HELP a_total things\n# TYPE a_total counter\na_total{x=\"1\",y=\"q\\\"\"} 3\n\
                # TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 0.5\nh_count 2\n";
    let samples = parse_prometheus(good).unwrap();
    assert_eq!(samples.len(), 4);
    assert_eq!(samples[0].labels["y"], "q\"");
    assert_eq!(samples[0].value, 3.0);
    for bad in [
        "a_total 1\n",                                 // no TYPE
        "# TYPE a_total countr\na_total 1\n",          // unknown type
        "# TYPE a_total counter\na_total one\n",       // not a float
        "# TYPE a_total counter\na_total{x=1} 1\n",    // unquoted label
        "# TYPE a_total counter\na_total{x=\"1\" 1\n", // unterminated
        "# TYPE 1a counter\n",                         // bad name
        "# TYPE a_total counter\na_total 1 2 3\n",     // too many fields
    ] {
        assert!(parse_prometheus(bad).is_err(), "accepted {bad:?}");
    }
}

/// Writes offline articles, except: titles starting `fatal` fail with a
/// fatal bad-request error, titles starting `hold` announce themselves on
/// `entered` and wait for a permit of `release`.
struct ScriptedWriter {
    entered: mpsc::UnboundedSender<i64>,
    release: Arc<Semaphore>,
}

impl Writer for ScriptedWriter {
    fn name(&self) -> &str {
        "scripted"
    }

    fn write<'a>(&'a self, issue: IssueText<'a>) -> BoxFuture<'a, Result<Article, WriteError>> {
        async move {
            if issue.title.starts_with("hold") {
                let _ = self.entered.send(issue.id);
                self.release.acquire().await.unwrap().forget();
            }
            FatalFor {
                name: "scripted",
                prefix: "fatal",
                message: "scripted failure",
            }
            .write(issue)
            .await
        }
        .boxed()
    }
}

/// The listener's reconnect count, once it differs from `seen`.
async fn reconnected(hub: &EventHub, seen: u64) -> u64 {
    let mut status = hub.status();
    within(20, "the listener to reconnect", async {
        loop {
            let (reconnects, connected) = {
                let s = status.borrow_and_update();
                (s.reconnects, s.connected)
            };
            if reconnects > seen && connected {
                return reconnects;
            }
            status.changed().await.expect("the listener is running");
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_prometheus_text_and_follow_the_work() {
    let _turn = one_at_a_time().await;
    let db = TestDb::new().await;
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let release = Arc::new(Semaphore::new(0));
    let writer = Arc::new(ScriptedWriter {
        entered: entered_tx,
        release: release.clone(),
    }) as SharedWriter;
    let service = serve_with_token(&db, "metrics", writer, None).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();

    let before = scrape(&http, &base).await;
    for (name, kind) in [
        ("newsnack_claims_total", "counter"),
        ("newsnack_listener_reconnects_total", "counter"),
        ("newsnack_generations_in_flight", "gauge"),
        ("newsnack_sse_clients", "gauge"),
        ("newsnack_advisory_lock_held", "gauge"),
    ] {
        assert!(
            before.has_type(name, kind),
            "no `# TYPE {name} {kind}`:\n{}",
            before.text
        );
    }
    // The gauge follows the locks: 1 for the reaper's once it is taken (as
    // the database sees it), 0 for the pipeline's, which only a run holds.
    let lock_gauge = |scrape: &Scrape, lock: &str| {
        scrape.value("newsnack_advisory_lock_held", &[("lock", lock)])
    };
    let reaping = within(30, "the reaper to take its lock", async {
        loop {
            let now = scrape(&http, &base).await;
            if lock_gauge(&now, "lease-reaper") >= 1.0 {
                return now;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(lock_gauge(&reaping, "lease-reaper"), 1.0);
    assert_eq!(lock_gauge(&reaping, "pipeline"), 0.0);
    assert_eq!(
        db.scalar_i64(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
              WHERE l.locktype = 'advisory' AND l.granted
                AND a.application_name LIKE 'newsnack-lock:lease-reaper:%'"
        )
        .await,
        1,
        "the database sees the reaper's lock held"
    );

    // Four issues: two plain, one whose generation fails fatally, one held.
    let mut live = service.hub.subscribe();
    let created = send(
        &http,
        Method::POST,
        &format!("{base}/issues"),
        None,
        Some(&json!({"issues": [
            {"title": "plain a", "body": "A.", "score": 4.0},
            {"title": "plain b", "body": "B.", "score": 3.0},
            {"title": "fatal c", "body": "C.", "score": 2.0},
            {"title": "hold d", "body": "D.", "score": 1.0},
        ]})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let ids: Vec<i64> = serde_json::from_value(created.body["ids"].clone()).unwrap();
    let claim = send(
        &http,
        Method::POST,
        &format!("{base}/ai-articles"),
        None,
        Some(&json!({"issue_ids": ids})),
    )
    .await;
    assert_eq!(claim.status, StatusCode::ACCEPTED, "{}", claim.body);
    let held = within(20, "the held generation to start", entered.recv())
        .await
        .unwrap();
    assert_eq!(held, ids[3]);
    // The failure is published after the two articles or before them; wait
    // for all three outcomes.
    let mut outcomes = HashSet::new();
    within(20, "three generation outcomes", async {
        while outcomes.len() < 3 {
            let t = live.recv().await.unwrap();
            if matches!(t.to, Status::Done | Status::Failed) {
                outcomes.insert((t.issue_id, t.to));
            }
        }
    })
    .await;
    assert_eq!(
        outcomes,
        HashSet::from([
            (ids[0], Status::Done),
            (ids[1], Status::Done),
            (ids[2], Status::Failed)
        ])
    );

    let during = scrape(&http, &base).await;
    let moved = |name: &str, labels: &[(&str, &str)]| {
        during.value(name, labels) - before.value(name, labels)
    };
    let transitions = "newsnack_transitions_total";
    assert_eq!(
        moved(transitions, &[("from", "none"), ("to", "PENDING")]),
        4.0
    );
    assert_eq!(
        moved(transitions, &[("from", "PENDING"), ("to", "IN_PROGRESS")]),
        4.0
    );
    assert_eq!(
        moved(transitions, &[("from", "IN_PROGRESS"), ("to", "DONE")]),
        2.0
    );
    assert_eq!(
        moved(transitions, &[("from", "IN_PROGRESS"), ("to", "FAILED")]),
        1.0
    );
    assert!(during.has_type(transitions, "counter"));
    assert_eq!(
        moved("newsnack_claims_total", &[("result", "claimed")]),
        4.0
    );
    assert_eq!(
        moved("newsnack_claims_total", &[("result", "skipped")]),
        0.0
    );
    assert!(during.has_type("newsnack_llm_seconds", "histogram"));
    assert_eq!(moved("newsnack_llm_seconds_count", &[]), 3.0);
    assert_eq!(moved("newsnack_llm_seconds_bucket", &[("le", "+Inf")]), 3.0);
    assert_eq!(
        moved("newsnack_llm_errors_total", &[("kind", "bad_request")]),
        1.0
    );
    // The held one is certainly in flight; the others may still be
    // finishing their bookkeeping.
    let in_flight = during.value("newsnack_generations_in_flight", &[]);
    assert!((1.0..=4.0).contains(&in_flight), "{in_flight} in flight");

    // A claim of what is no longer claimable counts as skipped.
    let again = send(
        &http,
        Method::POST,
        &format!("{base}/ai-articles"),
        None,
        Some(&json!({"issue_ids": [ids[0], ids[1]]})),
    )
    .await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.body);

    // Two waits: everything DONE passes; the fatal one alone is settled
    // short of one completion, so it is a skip.
    let passed = send(
        &http,
        Method::POST,
        &format!("{base}/waits"),
        None,
        Some(&json!({"issue_ids": [ids[0], ids[1]], "timeout_s": 30})),
    )
    .await;
    assert_eq!(passed.body["outcome"], json!("all_pass"), "{}", passed.body);
    let skipped = send(
        &http,
        Method::POST,
        &format!("{base}/waits"),
        None,
        Some(&json!({"issue_ids": [ids[2]], "timeout_s": 30, "min_completion": 1})),
    )
    .await;
    assert_eq!(skipped.body["outcome"], json!("skip"), "{}", skipped.body);

    // The listener loses its session and comes back.
    let pid = service.hub.status().borrow().backend_pid.unwrap();
    let seen = service.hub.status().borrow().reconnects;
    db.raw()
        .await
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    reconnected(&service.hub, seen).await;

    let after = scrape(&http, &base).await;
    let moved = |name: &str, labels: &[(&str, &str)]| {
        after.value(name, labels) - during.value(name, labels)
    };
    // Skipped by the database, or without it when the service already
    // knew both issues DONE.
    assert_eq!(
        moved("newsnack_claims_total", &[("result", "skipped")])
            + moved("newsnack_claims_total", &[("result", "skipped_known_done")]),
        2.0
    );
    assert_eq!(
        moved("newsnack_claims_total", &[("result", "claimed")]),
        0.0
    );
    assert!(after.has_type("newsnack_waits_total", "counter"));
    assert_eq!(
        moved("newsnack_waits_total", &[("outcome", "all_pass")]),
        1.0
    );
    assert_eq!(moved("newsnack_waits_total", &[("outcome", "skip")]), 1.0);
    assert_eq!(
        moved("newsnack_waits_total", &[("outcome", "timeout_pass")]),
        0.0
    );
    assert!(after.has_type("newsnack_wait_seconds", "histogram"));
    assert_eq!(
        moved("newsnack_wait_seconds_count", &[("outcome", "all_pass")]),
        1.0
    );
    assert_eq!(moved("newsnack_listener_reconnects_total", &[]), 1.0);

    // Let the held generation finish, stop, and nothing is in flight.
    let mut live = service.hub.subscribe();
    release.add_permits(1);
    assert_eq!(
        transitions_into(&mut live, Status::Done, 1).await,
        vec![ids[3]]
    );
    service.stop().await.unwrap();
    let stopped = newsnack::metrics::render().unwrap();
    let stopped = Scrape {
        samples: parse_prometheus(&stopped).unwrap(),
        text: stopped,
    };
    assert_eq!(stopped.value("newsnack_generations_in_flight", &[]), 0.0);
    assert_eq!(lock_gauge(&stopped, "lease-reaper"), 0.0, "let go on stop");
    assert_eq!(lock_gauge(&stopped, "pipeline"), 0.0);
    assert_eq!(
        stopped.value(transitions, &[("from", "IN_PROGRESS"), ("to", "DONE")])
            - before.value(transitions, &[("from", "IN_PROGRESS"), ("to", "DONE")]),
        3.0
    );
}

// ---------------------------------------------------------- request ids

/// Log lines written by this test process, as JSON (the
/// `NEWSNACK_LOG_FORMAT=json` shape), captured once for the whole process.
fn captured_logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = logs.clone();
        tracing_subscriber::fmt()
            .json()
            .with_env_filter("newsnack=info")
            .with_writer(move || LogSink(sink.clone()))
            .try_init()
            .expect("no other subscriber in this test process");
        logs
    })
    .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_has_a_request_id_that_tags_its_logs() {
    let _turn = one_at_a_time().await;
    let logs = captured_logs();
    let db = TestDb::new().await;
    let service = serve_with_token(&db, "ids", offline(), Some(TOKEN)).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();

    // Made up when not given, different every time, on every kind of answer.
    let mut seen = HashSet::new();
    for (method, path, body) in [
        (Method::GET, "/healthz", None),
        (Method::GET, "/healthz", None),
        (Method::GET, "/no-such-endpoint", None),
        (Method::GET, "/issues/999999", None),
        (Method::POST, "/issues", Some(json!({"issues": []}))),
    ] {
        let answer = send(
            &http,
            method.clone(),
            &format!("{base}{path}"),
            None,
            body.as_ref(),
        )
        .await;
        let id = request_id(&answer);
        assert!(!id.is_empty(), "{method} {path}");
        assert!(seen.insert(id.clone()), "{method} {path} reused {id}");
    }

    // A given one is kept and echoed, on success and on refusal alike.
    for (authorization, given, expected) in [
        (
            Some(format!("Bearer {TOKEN}")),
            "trace-me-201",
            StatusCode::CREATED,
        ),
        (None, "trace-me-401", StatusCode::UNAUTHORIZED),
    ] {
        let mut request = http
            .post(format!("{base}/issues"))
            .header("x-request-id", given)
            .json(&json!({"issues": [{"title": "t", "body": "b", "score": 1.0}]}));
        if let Some(authorization) = &authorization {
            request = request.header(reqwest::header::AUTHORIZATION, authorization);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), expected);
        assert_eq!(
            response
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok()),
            Some(given)
        );
    }

    // The request's log line carries its id, method, path and status.
    let lines: Vec<Value> = String::from_utf8(logs.lock().unwrap().clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("log line not JSON ({e}): {l}")))
        .collect();
    for (given, status) in [("trace-me-201", 201), ("trace-me-401", 401)] {
        let line = lines
            .iter()
            .find(|l| {
                l["span"]["request_id"] == json!(given)
                    && l["fields"]["message"] == json!("answered")
            })
            .unwrap_or_else(|| panic!("no `answered` line for {given} in {lines:#?}"));
        assert_eq!(line["span"]["method"], json!("POST"), "{line}");
        assert_eq!(line["span"]["path"], json!("/issues"), "{line}");
        assert_eq!(line["fields"]["status"], json!(status), "{line}");
    }
    service.stop().await.unwrap();
}
