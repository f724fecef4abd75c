//! Logging never takes the service down: with its stdout and stderr on a
//! pipe whose reader went away (a log shipper restarting) or on a full
//! disk (`/dev/full`), `serve` answers requests that log, counts the lines
//! it lost in `newsnack_log_lines_dropped_total`, and stops on SIGTERM or
//! SIGINT with exit 0; `tail` with its stderr on a full disk still stops
//! on SIGTERM.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;

use common::http::metric_in;
use common::process::{self, Output, ServeProcess};
use common::{within, TestDb};
use reqwest::StatusCode;
use serde_json::json;

/// Requests that log a line each (at `info`), answered as usual; then the
/// lines lost so far are counted.
async fn requests_answered_and_lost_lines_counted(serve: &ServeProcess, ids: &[i64]) {
    let base = serve.base_url();
    let http = reqwest::Client::new();
    let issue = within(
        30,
        "GET /issues/{id}",
        http.get(format!("{base}/issues/{}", ids[0])).send(),
    )
    .await
    .expect("an answer to GET /issues/{id}");
    assert_eq!(issue.status(), StatusCode::OK);
    let body: serde_json::Value = issue.json().await.unwrap();
    assert_eq!(body["id"], ids[0]);

    let claim = within(
        30,
        "POST /ai-articles",
        http.post(format!("{base}/ai-articles"))
            .json(&json!({ "issue_ids": ids }))
            .send(),
    )
    .await
    .expect("an answer to POST /ai-articles");
    assert_eq!(claim.status(), StatusCode::ACCEPTED);
    let body: serde_json::Value = claim.json().await.unwrap();
    assert_eq!(body["claimed"], json!(ids));

    let metrics = within(
        30,
        "GET /metrics",
        http.get(format!("{base}/metrics")).send(),
    )
    .await
    .expect("an answer to GET /metrics")
    .text()
    .await
    .unwrap();
    let dropped = metric_in(&metrics, "newsnack_log_lines_dropped_total");
    assert!(
        dropped >= 2.0,
        "the requests' log lines were lost: {dropped}"
    );
}

/// `serve` as instance `name` on `db`, logging at `info`, its stdout and
/// stderr going to `output`.
fn serve_logging_to(db: &TestDb, name: &str, output: Output<'_>) -> ServeProcess {
    tokio::task::block_in_place(|| {
        ServeProcess::spawn_writing_to(&db.url, name, &[("RUST_LOG", "info")], output)
    })
}

/// Stops `serve` with `signal` and asserts it exits 0 promptly.
async fn stops_cleanly(mut serve: ServeProcess, signal: libc::c_int) {
    let status = within(
        30,
        "serve to exit on the signal",
        tokio::task::spawn_blocking(move || serve.stop_with(signal)),
    )
    .await
    .unwrap();
    assert!(status.success(), "serve exited with {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_its_output_on_a_closed_pipe_answers_and_stops_on_sigterm() {
    let db = TestDb::new().await;
    let ids = db.add_issues(2).await;
    let serve = serve_logging_to(&db, "closed-pipe", Output::ClosedPipe);
    requests_answered_and_lost_lines_counted(&serve, &ids).await;
    stops_cleanly(serve, libc::SIGTERM).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_its_output_on_a_full_disk_answers_and_stops_on_sigint() {
    let db = TestDb::new().await;
    let ids = db.add_issues(2).await;
    let serve = serve_logging_to(&db, "full-disk", Output::File(Path::new("/dev/full")));
    requests_answered_and_lost_lines_counted(&serve, &ids).await;
    stops_cleanly(serve, libc::SIGINT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_with_its_stderr_on_a_full_disk_stops_on_sigterm() {
    let db = TestDb::new().await;
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let mut tail = process::command(&db.url, &["tail", "--json", "--since", "0"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(full)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(tail.stdout.take().unwrap()).lines();
    // Running: the new issue's transition is printed, whether it came
    // before `tail` started (replayed from seq 0) or after (live); `tail`
    // logged its start on the way, and lost those lines.
    let sql = db.raw().await;
    let reading = tokio::task::spawn_blocking(move || {
        let line = lines.next().map(|l| l.unwrap());
        (line, lines)
    });
    let id: i64 = sql
        .query_one(
            "INSERT INTO issue (title) VALUES ('followed') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let (line, _lines) = within(30, "tail to print the new issue", reading)
        .await
        .unwrap();
    let printed: serde_json::Value =
        serde_json::from_str(&line.expect("tail printed a line")).unwrap();
    assert_eq!(printed["issue_id"], id);

    // SAFETY: plain kill(2) on our own child's pid.
    unsafe {
        libc::kill(tail.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = within(
        30,
        "tail to exit on SIGTERM",
        tokio::task::spawn_blocking(move || tail.wait().unwrap()),
    )
    .await
    .unwrap();
    assert!(status.success(), "tail exited with {status}");
}
