//! Who may do what over HTTP, against `newsnack serve` running as its own
//! process: every route the source declares (found by reading
//! `src/http/`, so a new route cannot be left out) with no token, a wrong
//! or unreadable one, the read token and the API token, each as Bearer and
//! as Basic — 401, 403 or the route's own answer as designed; the same
//! requests against a service with no token, answered as before tokens
//! existed; the metrics token; refusals counted by reason in `/metrics`
//! and logged without the token; bad tokens in the environment stopping
//! `serve` with one line; the warning of a service open beyond loopback.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Stdio;

use common::http::metric_in;
use common::process::{self, Output, ServeProcess};
use common::{offline, Setup, TestDb};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

const API: &str = "api-token-5e0c1b7a93d24f68";
const READ: &str = "read-token-0a9f3c2e71b84d55";
const METRICS: &str = "metrics-token-6b2d8e4f10c3a97e";

/// A route: its method and its path as the router declares it.
type Route = (String, String);

/// Every `.route("PATH", METHOD(..))` in `src/http/`, outside unit tests.
fn declared_routes() -> BTreeSet<Route> {
    let mut routes = BTreeSet::new();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/http");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap();
        for (_, after) in code
            .match_indices(".route(")
            .map(|(at, _)| code.split_at(at + 7))
        {
            let after = after.trim_start();
            let Some(rest) = after.strip_prefix('"') else {
                panic!("{}: a route whose path is not a literal", path.display());
            };
            let (route, rest) = rest.split_once('"').unwrap();
            let method: String = rest
                .trim_start_matches(|c: char| c == ',' || c.is_whitespace())
                .chars()
                .take_while(|c| c.is_ascii_alphabetic())
                .collect();
            assert!(
                ["get", "post"].contains(&method.as_str()),
                "{}: route {route} with method {method:?}: teach tests/access.rs about it",
                path.display()
            );
            routes.insert((method.to_uppercase(), route.to_string()));
        }
    }
    routes
}

/// What the service holds: issues done and published in a briefing by a
/// pipeline run, and issues pending, each pending one used at most once.
struct Data {
    done: Vec<i64>,
    briefing: i64,
    pending: std::cell::RefCell<Vec<i64>>,
}

impl Data {
    async fn make(db: &TestDb) -> Data {
        db.add_issues(40).await;
        let run = tokio::task::block_in_place(|| process::newsnack(&db.url, &["run-pipeline"]));
        assert!(run.status.success(), "{}", process::text(&run.stderr));
        Data {
            done: db
                .ids("SELECT id FROM issue WHERE processing_status = 'DONE' ORDER BY id")
                .await,
            briefing: db.scalar_i64("SELECT max(id) FROM briefing").await,
            pending: db
                .ids("SELECT id FROM issue WHERE processing_status = 'PENDING' ORDER BY id DESC")
                .await
                .into(),
        }
    }

    fn fresh(&self) -> i64 {
        self.pending
            .borrow_mut()
            .pop()
            .expect("enough pending issues")
    }

    /// The request that exercises `route`, and its answer when let through.
    fn request(&self, (method, route): &Route) -> (String, Option<Value>, StatusCode) {
        let done = self.done[0];
        let (path, body, status) = match (method.as_str(), route.as_str()) {
            ("GET", "/issues/{id}") => (format!("/issues/{done}"), None, 200),
            ("GET", "/briefings/{id}") => (format!("/briefings/{}", self.briefing), None, 200),
            ("GET", "/metrics" | "/healthz" | "/readyz" | "/events" | "/openapi.json") => {
                (route.clone(), None, 200)
            }
            ("GET", "/" | "/dashboard/app.js" | "/dashboard/style.css" | "/dashboard.json") => {
                (route.clone(), None, 200)
            }
            ("GET", "/briefings/latest" | "/pipeline-runs") => (route.clone(), None, 200),
            ("POST", "/issues") => (
                route.clone(),
                Some(json!({"issues": [{"title": "t", "body": "b", "score": 1.0}]})),
                201,
            ),
            ("POST", "/issues/{id}/cancel") => {
                (format!("/issues/{}/cancel", self.fresh()), None, 200)
            }
            ("POST", "/ai-articles") => (
                route.clone(),
                Some(json!({"issue_ids": [self.fresh()]})),
                202,
            ),
            ("POST", "/waits") => (
                route.clone(),
                Some(json!({"issue_ids": [done], "timeout_s": 1})),
                200,
            ),
            ("POST", "/today-newsnack") => (route.clone(), Some(json!({"issue_ids": [done]})), 201),
            _ => panic!("{method} {route}: tests/access.rs has no request for this route; add one"),
        };
        (path, body, StatusCode::from_u16(status).unwrap())
    }
}

/// How a request presents (or fails to present) a token.
#[derive(Debug, Clone, Copy)]
enum Credential {
    None,
    Bearer(&'static str),
    Basic(&'static str),
    Unreadable,
}

impl Credential {
    fn apply(self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match self {
            Credential::None => request,
            Credential::Bearer(token) => request.bearer_auth(token),
            Credential::Basic(token) => request.basic_auth("editor", Some(token)),
            Credential::Unreadable => request.header("authorization", "Basic not*base64"),
        }
    }
}

/// Sends `method path` with `body` and `credential`; the status and the
/// `WWW-Authenticate` challenges.
async fn send(
    http: &reqwest::Client,
    base: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    credential: Credential,
) -> (StatusCode, Vec<String>) {
    let method = Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = credential.apply(http.request(method.clone(), format!("{base}{path}")));
    if let Some(body) = body {
        request = request.json(body);
    }
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let challenges = response
        .headers()
        .get_all("www-authenticate")
        .iter()
        .map(|v| v.to_str().unwrap().to_string())
        .collect();
    // An event stream is not read to its end.
    (response.status(), challenges)
}

/// The refusal reasons the service should have counted.
#[derive(Default)]
struct Tally(BTreeMap<&'static str, u64>);

impl Tally {
    fn add(&mut self, reason: &'static str) {
        *self.0.entry(reason).or_default() += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_answers_each_kind_of_token_as_designed() {
    let routes = declared_routes();
    assert!(routes.len() >= 18, "too few routes found: {routes:?}");
    let db = TestDb::new().await;
    let data = Data::make(&db).await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut serve = tokio::task::block_in_place(|| {
        ServeProcess::spawn_writing_to(
            &db.url,
            "access",
            &[
                ("NEWSNACK_API_TOKEN", API),
                ("NEWSNACK_READ_TOKEN", READ),
                ("RUST_LOG", "debug"),
            ],
            Output::File(log.path()),
        )
    });
    let base = serve.base_url();
    let http = reqwest::Client::new();

    // The document names every route it describes, and declares how to
    // authenticate on all but the probes.
    let doc: Value = http
        .get(format!("{base}/openapi.json"))
        .bearer_auth(READ)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            let route = (method.to_uppercase(), path.clone());
            assert!(
                routes.contains(&route),
                "{route:?} is documented but not declared"
            );
            let security = &item[method]["security"];
            let probe = path == "/healthz" || path == "/readyz";
            assert_eq!(security.is_null(), probe, "{route:?}: {security}");
        }
    }

    let mut tally = Tally::default();
    let refusals = [
        (Credential::None, "missing"),
        (Credential::Bearer("wrong-token-00000000000"), "wrong"),
        (Credential::Basic("wrong-token-00000000000"), "wrong"),
        (Credential::Unreadable, "malformed"),
    ];
    for route in &routes {
        let (method, declared) = route;
        let open = ["/healthz", "/readyz", "/metrics"].contains(&declared.as_str());
        for (credential, reason) in refusals {
            let (path, body, let_through) = data.request(route);
            let (status, challenges) =
                send(&http, &base, method, &path, body.as_ref(), credential).await;
            let what = format!("{method} {path} with {credential:?}");
            if open {
                assert_eq!(status, let_through, "{what}");
                continue;
            }
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{what}");
            assert_eq!(
                challenges,
                [
                    "Bearer realm=\"newsnack\"",
                    "Basic realm=\"newsnack\", charset=\"UTF-8\""
                ],
                "{what}"
            );
            tally.add(reason);
        }
        for token in [READ, API] {
            for credential in [Credential::Bearer(token), Credential::Basic(token)] {
                let (path, body, let_through) = data.request(route);
                let (status, _) =
                    send(&http, &base, method, &path, body.as_ref(), credential).await;
                let what = format!("{method} {path} with {credential:?}");
                if method == "POST" && token == READ {
                    assert_eq!(status, StatusCode::FORBIDDEN, "{what}");
                    tally.add("forbidden");
                } else {
                    assert_eq!(status, let_through, "{what}");
                }
            }
        }
        // HEAD is a read; other methods need the API token before the
        // router says they are not allowed.
        if method == "GET" {
            let (path, _, let_through) = data.request(route);
            for (credential, expected) in [
                (Credential::Bearer(READ), let_through),
                (Credential::Basic(API), let_through),
            ] {
                let (status, _) = send(&http, &base, "HEAD", &path, None, credential).await;
                assert_eq!(status, expected, "HEAD {path} with {credential:?}");
            }
            if !open {
                let (status, _) = send(&http, &base, "HEAD", &path, None, Credential::None).await;
                assert_eq!(status, StatusCode::UNAUTHORIZED, "HEAD {path}");
                tally.add("missing");
            }
        }
        let (path, _, _) = data.request(route);
        let read_deleting = if open {
            (StatusCode::METHOD_NOT_ALLOWED, None)
        } else {
            (StatusCode::FORBIDDEN, Some("forbidden"))
        };
        for (credential, expected, reason) in [
            (Credential::Bearer(READ), read_deleting.0, read_deleting.1),
            (
                Credential::Bearer(API),
                StatusCode::METHOD_NOT_ALLOWED,
                None,
            ),
        ] {
            let (status, _) = send(&http, &base, "DELETE", &path, None, credential).await;
            assert_eq!(status, expected, "DELETE {path} with {credential:?}");
            if let Some(reason) = reason {
                tally.add(reason);
            }
        }
    }
    // An unknown path says nothing before a token is shown.
    for (credential, expected) in [
        (Credential::None, StatusCode::UNAUTHORIZED),
        (Credential::Bearer(READ), StatusCode::NOT_FOUND),
    ] {
        let (status, _) = send(&http, &base, "GET", "/no-such-route", None, credential).await;
        assert_eq!(status, expected, "GET /no-such-route with {credential:?}");
    }
    tally.add("missing");

    // Every refusal counted, by reason.
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for reason in ["missing", "malformed", "wrong", "forbidden"] {
        let counted = metric_in(
            &metrics,
            &format!("newsnack_auth_rejections_total{{reason=\"{reason}\"}}"),
        );
        let expected = tally.0.get(reason).copied().unwrap_or(0);
        assert!(expected > 0, "the test refused nothing for {reason}");
        assert_eq!(counted, expected as f64, "refusals for {reason}");
    }

    // The refusals are in the log, the tokens are not.
    let status = tokio::task::block_in_place(|| serve.terminate());
    assert!(status.success(), "{status}");
    let logged = std::fs::read_to_string(log.path()).unwrap();
    assert!(logged.contains("refused"), "no refusal logged:\n{logged}");
    let encoded = |token: &str| {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(format!("editor:{token}"))
    };
    for secret in [API, READ, "wrong-token-00000000000"] {
        assert!(!logged.contains(secret), "{secret} logged");
        assert!(
            !logged.contains(&encoded(secret)),
            "{secret} logged in Basic"
        );
    }
}

/// With no token configured, every route answers as it did before tokens
/// existed, whatever `Authorization` a request carries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tokens_every_route_stays_open() {
    let routes = declared_routes();
    let db = TestDb::new().await;
    let data = Data::make(&db).await;
    let service = db.serve("open", offline()).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    for route in &routes {
        let (method, _) = route;
        for credential in [
            Credential::None,
            Credential::Bearer("anything-at-all-0000"),
            Credential::Basic(API),
            Credential::Unreadable,
        ] {
            let (path, body, let_through) = data.request(route);
            let (status, challenges) =
                send(&http, &base, method, &path, body.as_ref(), credential).await;
            assert_eq!(status, let_through, "{method} {path} with {credential:?}");
            assert!(challenges.is_empty(), "{method} {path}: {challenges:?}");
        }
    }
    let doc: Value = http
        .get(format!("{base}/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(doc["components"]["securitySchemes"].is_null(), "{doc}");
    service.stop().await.unwrap();
}

/// The metrics token opens `/metrics` (so does the API token) and nothing
/// else; alone, it guards `/metrics` only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_token_opens_metrics_only() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    let issue = format!("/issues/{id}");
    let http = reqwest::Client::new();

    let all = Setup {
        tokens: newsnack::http::auth::Tokens {
            api: Some(API.into()),
            read: Some(READ.into()),
            metrics: Some(METRICS.into()),
        },
        ..Setup::default()
    };
    let service = db.serve_with("metrics-all", offline(), all).await;
    let base = format!("http://{}", service.addr);
    for (path, credential, expected) in [
        ("/metrics", Credential::None, 401),
        (
            "/metrics",
            Credential::Bearer("wrong-token-00000000000"),
            401,
        ),
        ("/metrics", Credential::Bearer(METRICS), 200),
        ("/metrics", Credential::Basic(METRICS), 200),
        ("/metrics", Credential::Bearer(API), 200),
        ("/metrics", Credential::Bearer(READ), 403),
        (issue.as_str(), Credential::Bearer(METRICS), 403),
        (issue.as_str(), Credential::Bearer(READ), 200),
        ("/healthz", Credential::None, 200),
    ] {
        let (status, _) = send(&http, &base, "GET", path, None, credential).await;
        assert_eq!(status.as_u16(), expected, "GET {path} with {credential:?}");
    }
    service.stop().await.unwrap();

    let alone = Setup {
        tokens: newsnack::http::auth::Tokens {
            metrics: Some(METRICS.into()),
            ..Default::default()
        },
        ..Setup::default()
    };
    let service = db.serve_with("metrics-alone", offline(), alone).await;
    let base = format!("http://{}", service.addr);
    for (method, path, credential, expected) in [
        ("GET", "/metrics", Credential::None, 401),
        ("GET", "/metrics", Credential::Basic(METRICS), 200),
        ("GET", issue.as_str(), Credential::None, 200),
        ("GET", "/", Credential::None, 200),
    ] {
        let (status, _) = send(&http, &base, method, path, None, credential).await;
        assert_eq!(
            status.as_u16(),
            expected,
            "{method} {path} with {credential:?}"
        );
    }
    let body = json!({"issues": [{"title": "t", "body": "b", "score": 1.0}]});
    let (status, _) = send(
        &http,
        &base,
        "POST",
        "/issues",
        Some(&body),
        Credential::None,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    service.stop().await.unwrap();
}

/// Runs `newsnack serve` with `env` until it exits (or kills it after a
/// minute, failing: it should have refused to start); its exit code and
/// stderr.
fn serve_refusing(db: &TestDb, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let child = process::command(&db.url, &["serve", "--listen", "127.0.0.1:0"])
        .env_remove("NEWSNACK_API_TOKEN")
        .env_remove("NEWSNACK_READ_TOKEN")
        .env_remove("NEWSNACK_METRICS_TOKEN")
        .envs(env.iter().copied())
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    match rx.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(out) => {
            let out = out.unwrap();
            (out.status.code(), process::text(&out.stderr))
        }
        Err(_) => {
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("serve started with {env:?}");
        }
    }
}

/// A token no request could present, or not worth guarding with, stops
/// `serve` before anything else, with one line naming the variable and
/// never showing the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tokens_in_the_environment_stop_serve_with_one_line() {
    let db = TestDb::new().await;
    // The environment, the variable the line names, and what it says.
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: &[Case] = &[
        (&[("NEWSNACK_API_TOKEN", "")], "NEWSNACK_API_TOKEN", "blank"),
        (
            &[("NEWSNACK_READ_TOKEN", " \t ")],
            "NEWSNACK_READ_TOKEN",
            "blank",
        ),
        (
            &[("NEWSNACK_API_TOKEN", "s3cret-short")],
            "NEWSNACK_API_TOKEN",
            "at least 16",
        ),
        (
            &[("NEWSNACK_METRICS_TOKEN", "m3tr1cs")],
            "NEWSNACK_METRICS_TOKEN",
            "at least 16",
        ),
        (
            &[("NEWSNACK_API_TOKEN", "geheimnis-schlüssel-2026")],
            "NEWSNACK_API_TOKEN",
            "visible ASCII",
        ),
        (
            &[("NEWSNACK_READ_TOKEN", "read token with spaces")],
            "NEWSNACK_READ_TOKEN",
            "visible ASCII",
        ),
        (
            &[("NEWSNACK_API_TOKEN", API), ("NEWSNACK_READ_TOKEN", API)],
            "NEWSNACK_READ_TOKEN",
            "equals NEWSNACK_API_TOKEN",
        ),
    ];
    for (env, names, says) in cases {
        let (code, err) = tokio::task::block_in_place(|| serve_refusing(&db, env));
        let what = format!("{env:?}");
        assert_eq!(code, Some(1), "{what}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{what}: one line: {err}");
        assert!(err.starts_with("newsnack: "), "{what}: {err}");
        assert!(err.contains(names) && err.contains(says), "{what}: {err}");
        for (_, token) in *env {
            let token = token.trim();
            if !token.is_empty() {
                assert!(!err.contains(token), "{what}: the token is shown: {err}");
            }
        }
    }
}

/// `serve` beyond loopback with no token warns once at start-up; with a
/// token, or on loopback, it does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_beyond_loopback_without_a_token_warns() {
    let db = TestDb::new().await;
    let warning = "listening beyond this machine with no token";
    for (listen, token, warns) in [
        ("0.0.0.0:0", None, true),
        ("0.0.0.0:0", Some(API), false),
        ("127.0.0.1:0", None, false),
    ] {
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut env = vec![("NEWSNACK_LISTEN", listen)];
        if let Some(token) = token {
            env.push(("NEWSNACK_API_TOKEN", token));
        }
        let mut serve = tokio::task::block_in_place(|| {
            let mut command = process::command(&db.url, &["serve"]);
            command
                .env_remove("NEWSNACK_API_TOKEN")
                .env_remove("NEWSNACK_READ_TOKEN")
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(log.path()).unwrap());
            let mut child = command.spawn().unwrap();
            let mut lines =
                std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
            let serving = lines
                .find(|l| {
                    l.as_ref()
                        .is_ok_and(|l| l.starts_with("newsnack serving on"))
                })
                .is_some();
            assert!(serving, "serve on {listen} did not start");
            std::thread::spawn(move || lines.for_each(drop));
            child
        });
        unsafe { libc::kill(serve.id() as i32, libc::SIGTERM) };
        let status = tokio::task::block_in_place(|| serve.wait().unwrap());
        assert!(status.success(), "{status}");
        let logged = std::fs::read_to_string(log.path()).unwrap();
        assert_eq!(
            logged.matches(warning).count(),
            usize::from(warns),
            "{listen} with {token:?}:\n{logged}"
        );
    }
}
