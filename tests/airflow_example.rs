//! The Airflow example's HTTP client (`examples/airflow/newsnack_client.py`),
//! end to end against a real `serve`: `examples/airflow/run_briefing.py`
//! claims, sends one smart wait and assembles, exactly as the DAG's tasks
//! do, and prints what happened as JSON. Each test checks that output and
//! the database: a briefing made from exactly the ids the wait returned (in
//! target order), no briefing when the wait skips, and a clear failure that
//! changes nothing when the token is wrong or the service is unreachable.
//!
//! The last two run the DAG itself in Apache Airflow 3 (`airflow dags
//! test`, installed from PyPI into a cached venv): every task succeeds and
//! the briefing holds exactly the completed ids; and the skip path.
//!
//! The tests need `python3` (and `venv` for Airflow); without it they fail
//! and say what to install.

mod common;

use std::process::{Output, Stdio};
use std::sync::Arc;

use common::writers::FatalFor;
use common::{within, Setup, TestDb};
use newsnack::serve::RunningService;
use serde_json::Value;
use tokio::io::AsyncWriteExt;

const TOKEN: &str = "airflow-example-token-93c1";
const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/examples/airflow/run_briefing.py"
);

/// Offline articles, except for issues whose title starts with `refuse`:
/// those fail for good at once.
const REFUSING: FatalFor = FatalFor {
    name: "refusing",
    prefix: "refuse",
    message: "the model refused this issue",
};

async fn serve(db: &TestDb, token: Option<&str>) -> RunningService {
    let setup = Setup {
        pool_size: Some(8),
        tokens: newsnack::http::auth::Tokens {
            api: token.map(str::to_string),
            ..Default::default()
        },
        ..Setup::default()
    };
    db.serve_with("airflow-example", Arc::new(REFUSING), setup)
        .await
}

/// Runs the example script against `base_url` with `token` in its
/// environment; `stdin` is piped to it when given.
async fn run_briefing(
    base_url: &str,
    token: Option<&str>,
    args: &[&str],
    stdin: Option<&str>,
) -> Output {
    let mut command = tokio::process::Command::new(common::python::python3());
    command
        .arg(SCRIPT)
        .arg("--base-url")
        .arg(base_url)
        .args(args)
        .env_remove("NEWSNACK_BASE_URL")
        .env_remove("NEWSNACK_API_TOKEN")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(token) = token {
        command.env("NEWSNACK_API_TOKEN", token);
    }
    let mut child = command.spawn().expect("run python3");
    if let Some(text) = stdin {
        let mut pipe = child.stdin.take().unwrap();
        pipe.write_all(text.as_bytes()).await.unwrap();
        drop(pipe);
    }
    within(60, "run_briefing.py to finish", child.wait_with_output())
        .await
        .expect("collect the script's output")
}

/// The script's JSON report, or a failure that shows what it printed.
fn report(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "run_briefing.py printed no JSON ({e}); exit {:?}\nstdout: {}\nstderr: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn ids(value: &Value) -> Vec<i64> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not an id list: {value}"))
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect()
}

/// Adds issues `(title, score)` with plain SQL, as a collector would.
async fn add(db: &TestDb, issues: &[(&str, f64)]) -> Vec<i64> {
    let sql = db.raw().await;
    let mut added = Vec::new();
    for (title, score) in issues {
        let id: i64 = sql
            .query_one(
                "INSERT INTO issue (title, body, score) VALUES ($1, 'It happened. Then more happened.', $2) RETURNING id",
                &[title, score],
            )
            .await
            .unwrap()
            .get(0);
        added.push(id);
    }
    added
}

async fn briefings(db: &TestDb) -> Vec<(i64, Vec<i64>)> {
    let sql = db.raw().await;
    sql.query("SELECT id, issue_ids FROM briefing ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Three issues; the model refuses to write the first two.
async fn two_of_three_refused(db: &TestDb) -> Vec<i64> {
    add(
        db,
        &[("refuse one", 3.0), ("refuse two", 2.0), ("Fine", 1.0)],
    )
    .await
}

/// The script's arguments for a wait on `targets` of which 2 must
/// complete within 120 s.
fn wait_args(targets: &[i64]) -> Vec<String> {
    let mut args: Vec<String> = ["--min-completion", "2", "--timeout-s", "120"]
        .map(String::from)
        .to_vec();
    args.extend(targets.iter().map(i64::to_string));
    args
}

/// Four issues, hottest first; the model refuses to write the second.
async fn four_stories_one_refused(db: &TestDb) -> Vec<i64> {
    add(
        db,
        &[
            ("Hottest story", 9.0),
            ("refuse: the story the model will not write", 8.0),
            ("Third story", 7.0),
            ("Fourth story", 6.0),
        ],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_success_publishes_exactly_the_ids_the_wait_returned() {
    let db = TestDb::new().await;
    let targets = four_stories_one_refused(&db).await;
    let service = serve(&db, Some(TOKEN)).await;
    let base = format!("http://{}", service.addr);
    let args = wait_args(&targets);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_briefing(&base, Some(TOKEN), &args, None).await;
    let report = report(&out);
    assert_eq!(out.status.code(), Some(0), "{report}");

    assert_eq!(ids(&report["targets"]), targets);
    assert_eq!(ids(&report["claim"]["claimed"]), targets, "{report}");
    assert_eq!(report["claim"]["conflict"], false);
    // One target fails for good, so the wait settles before its deadline:
    // 3 DONE of 4, at least 2 needed.
    let wait = &report["wait"];
    assert_eq!(wait["outcome"], "timeout_pass", "{report}");
    assert_eq!(ids(&wait["failed"]), vec![targets[1]]);
    assert_eq!(ids(&wait["unfinished"]), Vec::<i64>::new());
    let completed = ids(&wait["completed"]);
    assert_eq!(completed, vec![targets[0], targets[2], targets[3]]);
    assert!(
        wait["waited_ms"].as_u64().unwrap() < 120_000,
        "decided before its deadline"
    );

    // The briefing holds exactly the completed ids, in target order.
    let expected = vec![targets[0], targets[2], targets[3]];
    let briefing_id = report["briefing"]["briefing_id"].as_i64().unwrap();
    assert_eq!(ids(&report["briefing"]["issue_ids"]), expected);
    assert_eq!(briefings(&db).await, vec![(briefing_id, expected.clone())]);
    let sql = db.raw().await;
    let row = sql
        .query_one(
            "SELECT (SELECT array_agg(issue_id ORDER BY issue_id) FROM ai_article),
                    (SELECT processing_status || ':' || (retry_not_before = 'infinity')::text
                       FROM issue WHERE id = $1)",
            &[&targets[1]],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Vec<i64>>(0), completed);
    assert_eq!(row.get::<_, String>(1), "FAILED:true");
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issues_added_over_http_are_claimed_waited_for_and_published_hottest_first() {
    let db = TestDb::new().await;
    let service = serve(&db, Some(TOKEN)).await;
    let base = format!("http://{}", service.addr);
    let issues = serde_json::json!([
        {"title": "Cold", "body": "Little happened.", "score": 1.0},
        {"title": "Hot", "body": "A lot happened. Then more.", "score": 9.0},
        {"title": "Warm", "body": "Something happened.", "score": 5.0},
        {"title": "Hotter", "body": "Even more happened.", "score": 9.5},
    ]);
    let out = run_briefing(
        &base,
        Some(TOKEN),
        &["--issues-file", "-", "--top-k", "3"],
        Some(&issues.to_string()),
    )
    .await;
    let report = report(&out);
    assert_eq!(out.status.code(), Some(0), "{report}");

    let sql = db.raw().await;
    let hottest = db
        .ids("SELECT id FROM issue WHERE title IN ('Hotter', 'Hot', 'Warm') ORDER BY score DESC")
        .await;
    assert_eq!(ids(&report["targets"]), hottest, "{report}");
    assert_eq!(report["wait"]["outcome"], "all_pass", "{report}");
    // The wait lists them in id order; the briefing keeps the targets' order.
    let mut in_id_order = hottest.clone();
    in_id_order.sort_unstable();
    assert_eq!(ids(&report["wait"]["completed"]), in_id_order);
    let briefing_id = report["briefing"]["briefing_id"].as_i64().unwrap();
    assert_eq!(briefings(&db).await, vec![(briefing_id, hottest.clone())]);
    // The cold one was added but never claimed.
    let cold: String = sql
        .query_one(
            "SELECT processing_status FROM issue WHERE title = 'Cold'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(cold, "PENDING");
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_skips_publishes_nothing() {
    let db = TestDb::new().await;
    let targets = two_of_three_refused(&db).await;
    let service = serve(&db, None).await;
    let base = format!("http://{}", service.addr);
    let args = wait_args(&targets);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_briefing(&base, None, &args, None).await;
    let report = report(&out);
    assert_eq!(out.status.code(), Some(3), "{report}");
    assert_eq!(report["wait"]["outcome"], "skip", "{report}");
    assert_eq!(ids(&report["wait"]["completed"]), vec![targets[2]]);
    assert_eq!(ids(&report["wait"]["failed"]), vec![targets[0], targets[1]]);
    assert_eq!(report["briefing"], Value::Null);
    assert!(briefings(&db).await.is_empty());
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_fails_clearly_and_changes_nothing() {
    let db = TestDb::new().await;
    let targets = add(&db, &[("One", 2.0), ("Two", 1.0)]).await;
    let service = serve(&db, Some(TOKEN)).await;
    let base = format!("http://{}", service.addr);
    let target_args: Vec<String> = targets.iter().map(i64::to_string).collect();
    let args: Vec<&str> = target_args.iter().map(String::as_str).collect();
    for token in [Some("not-the-token"), None] {
        let out = run_briefing(&base, token, &args, None).await;
        let report = report(&out);
        assert_eq!(out.status.code(), Some(1), "{report}");
        assert_eq!(report["step"], "claim");
        assert_eq!(report["status"], 401);
        assert_eq!(report["kind"], "NewsnackUnauthorized");
        assert_eq!(report["retryable"], false);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("claim failed (HTTP 401): missing or wrong bearer token"),
            "{stderr}"
        );
    }
    // Nothing moved: both issues PENDING, only their initial transitions.
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue WHERE processing_status = 'PENDING'")
            .await,
        2
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue_transition").await,
        2
    );
    assert!(briefings(&db).await.is_empty());
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_service_is_reported_as_such() {
    // A port nobody listens on: bound, then released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = run_briefing(&format!("http://127.0.0.1:{port}"), None, &["1"], None).await;
    let report = report(&out);
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert_eq!(report["kind"], "NewsnackUnreachable");
    assert_eq!(report["retryable"], true);
    assert!(
        report["error"]
            .as_str()
            .unwrap()
            .starts_with(&format!("cannot connect to http://127.0.0.1:{port}")),
        "{report}"
    );
}

/// Apache Airflow, pinned: the DAG is written for Airflow 3 (and 2.7+).
const AIRFLOW: &[&str] = &["apache-airflow==3.1.8"];
const DAGS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/airflow");

/// Airflow's command line with a home of its own (a fresh SQLite metadata
/// database, made by `airflow db migrate`), the example's DAGs folder, and
/// the service's address and token for the DAG's client.
struct Airflow {
    bin: std::path::PathBuf,
    home: tempfile::TempDir,
    base_url: String,
}

impl Airflow {
    async fn for_service(base_url: &str) -> Airflow {
        let bin = tokio::task::spawn_blocking(|| common::python::venv("airflow", AIRFLOW))
            .await
            .unwrap();
        let airflow = Airflow {
            bin,
            home: tempfile::tempdir().unwrap(),
            base_url: base_url.to_string(),
        };
        let migrated = airflow.run(&["db", "migrate"]).await;
        assert!(
            migrated.status.success(),
            "airflow db migrate: {}",
            String::from_utf8_lossy(&migrated.stderr)
        );
        airflow
    }

    async fn run(&self, args: &[&str]) -> Output {
        let mut command = tokio::process::Command::new(self.bin.join("airflow"));
        command
            .args(args)
            .env("AIRFLOW_HOME", self.home.path())
            .env("AIRFLOW__CORE__DAGS_FOLDER", DAGS)
            .env("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
            .env("NEWSNACK_BASE_URL", &self.base_url)
            .env("NEWSNACK_API_TOKEN", TOKEN)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        within(300, "airflow", command.output()).await.unwrap()
    }

    /// `airflow dags test newsnack_daily` with `conf`; its whole output.
    async fn test_dag(&self, conf: &Value) -> String {
        let out = self
            .run(&[
                "dags",
                "test",
                "newsnack_daily",
                "--conf",
                &conf.to_string(),
            ])
            .await;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "airflow dags test failed:\n{text}");
        assert!(
            text.contains("state=success"),
            "the DAG run succeeded:\n{text}"
        );
        text
    }
}

/// Runs the DAG once in Airflow against `service` for `targets` (2 of
/// them to complete within 120 s): its output, the tasks it started, and
/// why it skipped those it skipped.
async fn dag_run(service: &RunningService, targets: &[i64]) -> (String, Vec<String>, Vec<String>) {
    let airflow = Airflow::for_service(&format!("http://{}", service.addr)).await;
    let output = airflow
        .test_dag(&serde_json::json!({
            "issue_ids": targets, "min_completion": 2, "timeout_s": 120,
        }))
        .await;
    let (started, skipped) = tasks_run_and_skipped(&output);
    (output, started, skipped)
}

/// The tasks that `airflow dags test` reports as started, and the reasons
/// of those it skipped.
fn tasks_run_and_skipped(output: &str) -> (Vec<String>, Vec<String>) {
    let started = output
        .lines()
        .filter_map(|l| l.split("[DAG TEST] starting task_id=").nth(1))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(str::to_string)
        .collect();
    let skipped = output
        .lines()
        .filter(|l| l.contains("Skipping task."))
        .filter_map(|l| l.split("reason=").nth(1))
        .map(str::to_string)
        .collect();
    (started, skipped)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dag_runs_in_airflow_and_publishes_exactly_the_completed_ids() {
    let db = TestDb::new().await;
    let targets = four_stories_one_refused(&db).await;
    let service = serve(&db, Some(TOKEN)).await;
    let (output, started, skipped) = dag_run(&service, &targets).await;
    assert_eq!(
        started,
        [
            "select_target_issues",
            "request_articles",
            "wait_for_completion",
            "assemble_today_newsnack"
        ],
        "{output}"
    );
    assert!(skipped.is_empty(), "{skipped:?}");
    // One target failed for good; the briefing holds the other three, in
    // target order, and nothing else was published.
    let expected = vec![targets[0], targets[2], targets[3]];
    let published = briefings(&db).await;
    assert_eq!(published.len(), 1, "{published:?}");
    assert_eq!(published[0].1, expected);
    let done = db
        .ids("SELECT id FROM issue WHERE processing_status = 'DONE' ORDER BY score DESC")
        .await;
    assert_eq!(done, expected, "exactly the completed ids");
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipping_wait_skips_the_briefing_in_airflow() {
    let db = TestDb::new().await;
    let targets = two_of_three_refused(&db).await;
    let service = serve(&db, Some(TOKEN)).await;
    let (output, started, skipped) = dag_run(&service, &targets).await;
    assert_eq!(
        started,
        [
            "select_target_issues",
            "request_articles",
            "wait_for_completion"
        ],
        "the briefing task never starts:\n{output}"
    );
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert!(
        skipped[0].contains("skip: 1 of 3 DONE, fewer than the minimum"),
        "{skipped:?}"
    );
    assert!(briefings(&db).await.is_empty());
    service.stop().await.unwrap();
}
