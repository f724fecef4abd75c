//! Schemathesis against a running `serve`: the OpenAPI document at
//! `GET /openapi.json` tells the truth. Every check Schemathesis has
//! (server errors, statuses, content types, headers and bodies against
//! the document, requests the document allows accepted and those it
//! refuses refused, unsupported methods, authentication the document
//! declares enforced, ...), in every phase (the document's examples, its
//! coverage of edges, fuzzing, and stateful sequences of calls), with a
//! fixed seed; any finding fails the test.
//!
//! Schemathesis comes from PyPI, pinned ([`SCHEMATHESIS`]), in a virtual
//! environment cached between runs that the test makes when it is missing
//! (`common::python`); without `python3` or without a way to PyPI it
//! fails, saying what to install. The service
//! runs in-process with an API token, a read token and data in it: a
//! published pipeline run with its briefing, done, failed and pending
//! issues. Schemathesis runs twice, with the API token and with the read
//! token (every write then answers 403, which the document declares).
//!
//! A request over the 1 MiB body limit is refused with 413 before its
//! content is looked at (an array far beyond `maxItems` is one):
//! Schemathesis is told that 413 counts as refusing it ([`CONFIG`]).
//!
//! One concession to time, in the hooks: a wait the fuzzer asks for on an
//! issue nobody claims would last its whole `timeout_s` or until its
//! `deadline` (up to a day), so the hooks shorten a valid `timeout_s` to at
//! most a second, and bring a valid `deadline` more than a second ahead to
//! a second from now, before the request goes out; they stay valid, and
//! invalid ones are left alone. (A deadline more than a day ahead, which
//! the service refuses with 422, is the one limit a schema cannot state;
//! tests/waits.rs covers it.)

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};

use common::{offline, process, until_status, Setup, TestDb};
use serde_json::json;

/// The Schemathesis release the suite is checked against.
const SCHEMATHESIS: &str = "schemathesis==4.32.5";
/// The seed of every run, so a finding can be replayed
/// (`NEWSNACK_SCHEMATHESIS_SEED` runs another).
const SEED: &str = "21";
/// Test cases per operation and phase: enough to cover every operation's
/// edges, few enough for two cores (`NEWSNACK_SCHEMATHESIS_EXAMPLES` asks
/// for more).
const MAX_EXAMPLES: &str = "40";
const API_TOKEN: &str = "schemathesis-api-token";
const READ_TOKEN: &str = "schemathesis-read-token";

/// Schemathesis' configuration: its default statuses for a refused
/// request, and 413.
const CONFIG: &str = r#"
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]
"#;

/// Shortens valid `timeout_s` and `deadline` values of `POST /waits` (see
/// the module docs).
const HOOKS: &str = r#"
import datetime

import schemathesis

MAX_WAIT_S = 1.0


def shortened_deadline(value):
    """A second from now if `value` is a deadline further ahead, else None."""
    if not isinstance(value, str):
        return None
    try:
        deadline = datetime.datetime.fromisoformat(value.replace("z", "Z"))
    except ValueError:
        return None
    if deadline.tzinfo is None:
        return None
    now = datetime.datetime.now(datetime.timezone.utc)
    if deadline - now <= datetime.timedelta(seconds=MAX_WAIT_S):
        return None
    return (now + datetime.timedelta(seconds=MAX_WAIT_S)).isoformat()


@schemathesis.hook
def before_call(context, case, kwargs):
    if case.operation.path != "/waits" or not isinstance(case.body, dict):
        return
    timeout = case.body.get("timeout_s")
    valid = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if valid and MAX_WAIT_S < timeout <= 86400:
        case.body["timeout_s"] = MAX_WAIT_S
    deadline = shortened_deadline(case.body.get("deadline"))
    if deadline is not None:
        case.body["deadline"] = deadline
"#;

/// The `schemathesis` executable, installed into a cached venv first if it
/// is not there yet (see `common::python`).
fn schemathesis() -> PathBuf {
    common::python::venv("schemathesis", &[SCHEMATHESIS]).join("schemathesis")
}

/// A service with a token and data in it: one published pipeline run, an
/// issue failed with its error, issues pending.
async fn service_with_data(db: &TestDb) -> newsnack::serve::RunningService {
    let service = db
        .serve_with(
            "schemathesis",
            offline(),
            Setup {
                tokens: newsnack::http::auth::Tokens {
                    api: Some(API_TOKEN.into()),
                    read: Some(READ_TOKEN.into()),
                    metrics: None,
                },
                ..Setup::default()
            },
        )
        .await;
    // Waits that name no timeout last the setting's, not ten minutes.
    db.set("content_gen_timeout_s", "2").await;
    db.add_issues(8).await;
    let run = tokio::task::block_in_place(|| process::newsnack(&db.url, &["run-pipeline"]));
    assert!(
        run.status.success(),
        "run-pipeline: {}",
        process::text(&run.stderr)
    );
    // `top_k` (5) of the 8 were generated and published; of the rest, one
    // fails for good, two stay pending.
    let failed = db
        .ids("SELECT id FROM issue WHERE processing_status = 'PENDING' ORDER BY id LIMIT 1")
        .await[0];
    db.move_with_sql(&[failed], &["IN_PROGRESS"]).await;
    db.raw()
        .await
        .execute(
            "UPDATE issue SET processing_status = 'FAILED', last_error = 'the writer refused it'
              WHERE id = $1",
            &[&failed],
        )
        .await
        .unwrap();
    until_status(db, &service.hub, 30, failed, "FAILED").await;
    assert_eq!(db.scalar_i64("SELECT count(*) FROM briefing").await, 1);
    service
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_holds_against_schemathesis() {
    let exe = tokio::task::spawn_blocking(schemathesis).await.unwrap();
    let db = TestDb::new().await;
    let service = service_with_data(&db).await;
    let work = tempfile::tempdir().unwrap();
    std::fs::write(work.path().join("newsnack_hooks.py"), HOOKS).unwrap();
    let config = work.path().join("schemathesis.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let url = format!("http://{}/openapi.json", service.addr);

    // A document Schemathesis can read, with the schemes on every
    // operation but the probes.
    let doc: serde_json::Value = reqwest::Client::new()
        .get(&url)
        .bearer_auth(READ_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let either = json!([{ "bearer": [] }, { "basic": [] }]);
    assert_eq!(doc["paths"]["/ai-articles"]["post"]["security"], either);
    assert_eq!(doc["paths"]["/issues/{id}"]["get"]["security"], either);
    let writes = doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|item| item.as_object().unwrap().keys())
        .filter(|method| *method != "get")
        .count();

    for token in [API_TOKEN, READ_TOKEN] {
        let mut command = Command::new(&exe);
        command
            .arg("--config-file")
            .arg(&config)
            .args(["run", &url])
            .args(["--checks", "all"])
            .args(["--phases", "examples,coverage,fuzzing,stateful"])
            .args(["--seed", &knob("NEWSNACK_SCHEMATHESIS_SEED", SEED)])
            .args([
                "--max-examples",
                &knob("NEWSNACK_SCHEMATHESIS_EXAMPLES", MAX_EXAMPLES),
            ])
            .args(["--workers", "1"])
            .args(["--request-timeout", "30"])
            .args(["--generation-database", "none"])
            .args(["--header", &format!("Authorization: Bearer {token}")])
            .arg("--no-color")
            .current_dir(work.path())
            .env("PYTHONPATH", work.path())
            .env("SCHEMATHESIS_HOOKS", "newsnack_hooks")
            .stdin(Stdio::null());
        let out = tokio::task::spawn_blocking(move || command.output().unwrap())
            .await
            .unwrap();
        // Reproductions of huge requests print megabytes on one line.
        let report: String = [out.stdout, out.stderr]
            .iter()
            .flat_map(|text| {
                String::from_utf8_lossy(text)
                    .lines()
                    .map(shortened)
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
            .join("\n");
        eprintln!("{report}");
        assert!(
            out.status.success(),
            "Schemathesis found problems with the token {token}:\n{report}"
        );
        // The read token was what it sent: every write, and only the
        // writes, answered 403 (Schemathesis warns of it).
        let refused = format!("403 Forbidden ({writes} operations)");
        assert_eq!(
            report.contains(&refused),
            token == READ_TOKEN,
            "with {token}, expected {refused:?} only for the read token:\n{report}"
        );
    }
    service.stop().await.unwrap();
}

/// The environment variable `name`, or `default`.
fn knob(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

/// `line`, cut to 500 characters.
fn shortened(line: &str) -> String {
    match line.char_indices().nth(500) {
        Some((end, _)) => format!("{} [..]", &line[..end]),
        None => line.to_string(),
    }
}

/// The limits in the document are the ones the service enforces.
#[test]
fn the_documents_limits_are_the_services() {
    let doc = newsnack::http::openapi::document(false);
    let wait = &doc["components"]["schemas"]["WaitBody"]["properties"];
    assert_eq!(
        wait["timeout_s"]["maximum"],
        json!(newsnack::http::waits::MAX_TIMEOUT_S)
    );
    assert_eq!(
        wait["deadline"]["pattern"],
        json!(newsnack::http::types::COLLECTED_AT_PATTERN)
    );
    assert_eq!(
        doc["components"]["schemas"]["WaitBody"]["not"]["required"],
        json!(["timeout_s", "deadline"])
    );
    assert_eq!(
        wait["min_completion"]["maximum"],
        json!(newsnack::input::MAX_IDS)
    );
    assert_eq!(
        wait["issue_ids"]["maxItems"],
        json!(newsnack::input::MAX_IDS)
    );
}
