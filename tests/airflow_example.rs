//! The Airflow example (`examples/airflow/`) end to end against a real
//! `serve`, through the provider (`integrations/airflow`).
//!
//! `run_briefing.py`, the DAG's flow without Airflow: a partial success
//! publishes exactly the ids the wait returned, a skip publishes nothing, a
//! wrong token and an unreachable service fail clearly and change nothing.
//!
//! Then one real Airflow 3 deployment (scheduler, DAG processor, API
//! server and triggerer, each its own process, LocalExecutor on SQLite, all
//! on loopback) runs the example DAG against a service whose LLM (the fake,
//! `common::fake_llm`) takes seconds per article: the wait task is seen
//! `deferred` while they are written and the briefing holds exactly the
//! completed ids; the triggerer is SIGKILLed mid-wait and started again,
//! and the wait still decides `timeout_pass` at its original deadline
//! (within a second); a `skip` skips the briefing task; bad input (an
//! unknown connection, a wrong token, unknown ids, a negative timeout, a
//! service down for the whole wait) fails each task with its message; a
//! wait deferred with a deadline already past (its claim an hour ago) is
//! decided at once, a skip; and none leaves a trigger behind. Last, the
//! same DAG on Airflow 2.10
//! (`airflow dags test`, which runs the trigger in-process).
//!
//! Airflow comes from PyPI into cached venvs (`common::python`).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use common::fake_llm::{FakeLlm, Reply};
use common::python::{provider_venv, AIRFLOW_2, AIRFLOW_3};
use common::{within, Setup, TestDb};
use newsnack::serve::RunningService;
use serde_json::{json, Value};

const TOKEN: &str = "airflow-example-token-93c1";
const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/airflow");
const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";
/// How long the fake LLM takes to write an article: long enough that the
/// wait task has deferred, and its worker has exited, before the outcome
/// is decided (a trigger firing while the deferring worker is still
/// exiting meets a race in Airflow's LocalExecutor on a loaded machine).
const WRITING: Duration = Duration::from_secs(20);

/// The fake LLM: slow articles; none for issues titled `stuck` (it never
/// answers) or `refuse` (400, a failure for good).
async fn slow_llm() -> FakeLlm {
    FakeLlm::start(|_, request| {
        let prompt = request["messages"][1]["content"].as_str().unwrap_or("");
        if prompt.contains("stuck") {
            Reply::Hang
        } else if prompt.contains("refuse") {
            Reply::BadRequest
        } else {
            Reply::Slow {
                delay: WRITING,
                content: ARTICLE.into(),
            }
        }
    })
    .await
}

async fn serve(db: &TestDb, llm: &FakeLlm) -> RunningService {
    let setup = Setup {
        pool_size: Some(8),
        tokens: newsnack::http::auth::Tokens::api(TOKEN),
        ..Setup::default()
    };
    db.serve_with(
        "airflow-example",
        llm.writer(Duration::from_secs(300)),
        setup,
    )
    .await
}

/// Adds issues `(title, score)` with plain SQL, as a collector would.
async fn add(db: &TestDb, titles: &[&str]) -> Vec<i64> {
    let sql = db.raw().await;
    let mut added = Vec::new();
    for (i, title) in titles.iter().enumerate() {
        let id: i64 = sql
            .query_one(
                "INSERT INTO issue (title, body, score) VALUES ($1, 'It happened. Then more happened.', $2) RETURNING id",
                &[title, &(100.0 - i as f64)],
            )
            .await
            .unwrap()
            .get(0);
        added.push(id);
    }
    added
}

async fn briefings(db: &TestDb) -> Vec<Vec<i64>> {
    let sql = db.raw().await;
    sql.query("SELECT issue_ids FROM briefing ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn ids(value: &Value) -> Vec<i64> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not an id list: {value}"))
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect()
}

/// Runs `run_briefing.py` with the venv's Python (which has the provider).
async fn run_briefing(
    bin: &Path,
    base_url: &str,
    token: Option<&str>,
    args: &[String],
) -> (Output, Value) {
    let mut command = tokio::process::Command::new(bin.join("python"));
    command
        .arg(format!("{EXAMPLE}/run_briefing.py"))
        .args(["--base-url", base_url])
        .args(args)
        .env_remove("NEWSNACK_API_TOKEN")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    if let Some(token) = token {
        command.env("NEWSNACK_API_TOKEN", token);
    }
    let out = within(120, "run_briefing.py", command.output())
        .await
        .unwrap();
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "run_briefing.py printed no JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, report)
}

fn wait_args(min: usize, targets: &[i64]) -> Vec<String> {
    let mut args = vec![
        "--min-completion".into(),
        min.to_string(),
        "--timeout-s".into(),
        "120".into(),
    ];
    args.extend(targets.iter().map(i64::to_string));
    args
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_briefing_publishes_the_completed_ids_skips_and_fails_clearly() {
    let bin = provider_venv("airflow3-provider", AIRFLOW_3).await;
    let db = TestDb::new().await;
    let llm = slow_llm().await;
    let service = serve(&db, &llm).await;
    let base = format!("http://{}", service.addr);

    // A partial success: one target fails for good, three are written.
    let targets = add(&db, &["Hottest", "refuse: not this one", "Third", "Fourth"]).await;
    let (out, report) = run_briefing(&bin, &base, Some(TOKEN), &wait_args(2, &targets)).await;
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert_eq!(ids(&report["claim"]["claimed"]), targets);
    assert_eq!(report["wait"]["outcome"], "timeout_pass", "{report}");
    assert_eq!(ids(&report["wait"]["failed"]), vec![targets[1]]);
    let expected = vec![targets[0], targets[2], targets[3]];
    assert_eq!(ids(&report["briefing"]["issue_ids"]), expected);
    assert_eq!(briefings(&db).await, vec![expected]);

    // A skip publishes nothing (exit 3).
    let skipping = add(&db, &["refuse one", "refuse two", "Fine"]).await;
    let (out, report) = run_briefing(&bin, &base, Some(TOKEN), &wait_args(2, &skipping)).await;
    assert_eq!(out.status.code(), Some(3), "{report}");
    assert_eq!(report["wait"]["outcome"], "skip");
    assert_eq!(report["briefing"], Value::Null);
    assert_eq!(briefings(&db).await.len(), 1);

    // A wrong or missing token: 401 at the claim, nothing changed.
    let untouched = add(&db, &["Untouched"]).await;
    for token in [Some("not-the-token"), None] {
        let (out, report) = run_briefing(&bin, &base, token, &wait_args(1, &untouched)).await;
        assert_eq!(out.status.code(), Some(1), "{report}");
        assert_eq!(
            (report["step"].as_str(), report["status"].as_i64()),
            (Some("claim"), Some(401))
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("POST /ai-articles failed (HTTP 401): missing or wrong bearer token"),
            "{stderr}"
        );
    }
    let status: String = db
        .raw()
        .await
        .query_one(
            "SELECT processing_status FROM issue WHERE id = $1",
            &[&untouched[0]],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(status, "PENDING");

    // An unreachable service.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (out, report) = run_briefing(
        &bin,
        &format!("http://127.0.0.1:{port}"),
        None,
        &["1".into()],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(
        report["error"]
            .as_str()
            .unwrap()
            .contains(&format!("cannot reach http://127.0.0.1:{port}")),
        "{report}"
    );
    service.stop().await.unwrap();
}

/// A DAG of bad inputs, each task on its own: every one must fail with its
/// message and leave no trigger behind; and a wait whose deadline (60 s
/// after a claim an hour ago) is already past when it defers, decided at
/// once by the same rule.
const BAD_INPUT_DAG: &str = r#""""newsnack_bad_input: each wait fails, with a message saying why, but
deadline_past: its claim step says it was answered an hour ago, so its
deadline has passed when it defers, and the service decides at once."""
from datetime import datetime, timedelta, timezone

from airflow.sdk import DAG, task
from newsnack_provider.api import rfc3339
from newsnack_provider.operators.newsnack import CLAIMED_AT_XCOM, NewsnackWaitOperator


@task
def claimed_an_hour_ago(ti=None):
    ti.xcom_push(key=CLAIMED_AT_XCOM, value=rfc3339(datetime.now(timezone.utc) - timedelta(hours=1)))


with DAG(
    dag_id="newsnack_bad_input",
    schedule=None,
    start_date=datetime(2025, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    render_template_as_native_obj=True,
    default_args={"retries": 0},
):
    ids = "{{ params.issue_ids }}"
    NewsnackWaitOperator(task_id="unknown_connection", issue_ids=ids, newsnack_conn_id="no_such_connection")
    NewsnackWaitOperator(task_id="wrong_token", issue_ids=ids, newsnack_conn_id="newsnack_wrong_token")
    NewsnackWaitOperator(task_id="unknown_ids", issue_ids=[987654321], timeout_s=60)
    NewsnackWaitOperator(task_id="timeout_over", issue_ids=ids, timeout_s=-5)
    NewsnackWaitOperator(task_id="service_down", issue_ids=ids, timeout_s=2, newsnack_conn_id="newsnack_down")
    claimed_an_hour_ago() >> NewsnackWaitOperator(task_id="deadline_past", issue_ids=ids, timeout_s=60, min_completion=1)
"#;

/// What each bad-input task's log must say.
const BAD_INPUT_MESSAGES: &[(&str, &str)] = &[
    ("unknown_connection", "no_such_connection"),
    (
        "wrong_token",
        "POST /waits failed (HTTP 401): missing or wrong bearer token",
    ),
    (
        "unknown_ids",
        "POST /waits failed (HTTP 404): unknown issue ids",
    ),
    (
        "timeout_over",
        "timeout_s must be more than 0 and at most 86400, got -5",
    ),
    ("service_down", "giving up"),
];

/// One Airflow 3 deployment: its home (SQLite metadata, logs, the DAGs
/// folder with the example and [`BAD_INPUT_DAG`]) and its processes, each
/// in a process group of its own so that killing one kills its children.
struct Airflow {
    bin: PathBuf,
    home: tempfile::TempDir,
    env: BTreeMap<String, String>,
    processes: BTreeMap<&'static str, tokio::process::Child>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn connection(port: u16, token: &str) -> String {
    json!({"conn_type": "newsnack", "host": "127.0.0.1", "port": port, "schema": "http", "password": token})
        .to_string()
}

impl Airflow {
    async fn start(bin: PathBuf, service: &RunningService) -> Airflow {
        let home = tempfile::tempdir().unwrap();
        let dags = home.path().join("dags");
        std::fs::create_dir(&dags).unwrap();
        std::fs::copy(
            format!("{EXAMPLE}/newsnack_daily.py"),
            dags.join("newsnack_daily.py"),
        )
        .unwrap();
        std::fs::write(dags.join("newsnack_bad_input.py"), BAD_INPUT_DAG).unwrap();
        let api_port = free_port();
        let port = service.addr.port();
        let env: BTreeMap<String, String> = [
            ("AIRFLOW_HOME", home.path().display().to_string()),
            ("AIRFLOW__CORE__DAGS_FOLDER", dags.display().to_string()),
            ("AIRFLOW__CORE__LOAD_EXAMPLES", "False".into()),
            ("AIRFLOW__CORE__EXECUTOR", "LocalExecutor".into()),
            ("AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION", "False".into()),
            (
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
                format!("http://127.0.0.1:{api_port}/execution/"),
            ),
            ("AIRFLOW__API__HOST", "127.0.0.1".into()),
            ("AIRFLOW__API__PORT", api_port.to_string()),
            (
                "AIRFLOW__API_AUTH__JWT_SECRET",
                "newsnack-airflow-example-jwt-secret-0123".into(),
            ),
            // A killed triggerer's triggers move to a live one within seconds.
            ("AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC", "1".into()),
            (
                "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD",
                "4".into(),
            ),
            ("AIRFLOW_CONN_NEWSNACK_DEFAULT", connection(port, TOKEN)),
            (
                "AIRFLOW_CONN_NEWSNACK_WRONG_TOKEN",
                connection(port, "not-the-token"),
            ),
            ("AIRFLOW_CONN_NEWSNACK_DOWN", connection(free_port(), TOKEN)),
            ("PYTHONDONTWRITEBYTECODE", "1".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let mut airflow = Airflow {
            bin,
            home,
            env,
            processes: BTreeMap::new(),
        };
        airflow.cli(&["db", "migrate"]).await;
        for name in ["scheduler", "dag-processor", "api-server", "triggerer"] {
            airflow.spawn(name);
        }
        within(300, "both DAGs parsed", async {
            while airflow
                .sql_i64(
                    "SELECT count(*) FROM dag WHERE dag_id LIKE 'newsnack_%'",
                    &[],
                )
                .await
                < 2
            {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
        .await;
        airflow
    }

    fn command(&self, program: &str) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(self.bin.join(program));
        command
            .envs(&self.env)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }

    fn spawn(&mut self, name: &'static str) {
        let log = std::fs::File::create(self.home.path().join(format!("{name}.log"))).unwrap();
        let child = self
            .command("airflow")
            .arg(name)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("start an Airflow component");
        self.processes.insert(name, child);
    }

    /// SIGKILL to `name`'s whole process group.
    fn kill(&mut self, name: &str) {
        if let Some(child) = self.processes.remove(name) {
            if let Some(pid) = child.id() {
                // SAFETY: a signal to the process group this test started.
                unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
            }
        }
    }

    /// `airflow args`, which must succeed.
    async fn cli(&self, args: &[&str]) -> String {
        let out = within(
            300,
            "airflow CLI",
            self.command("airflow").args(args).output(),
        )
        .await
        .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "airflow {args:?}:\n{text}");
        text
    }

    /// The rows of `query` on the metadata database, as JSON arrays.
    async fn sql(&self, query: &str, params: &[&str]) -> Vec<Value> {
        let script = "import json, sqlite3, sys\nc = sqlite3.connect(sys.argv[1], timeout=30)\nprint(json.dumps(c.execute(sys.argv[2], sys.argv[3:]).fetchall()))";
        let out = self
            .command("python")
            .arg("-c")
            .arg(script)
            .arg(self.home.path().join("airflow.db"))
            .arg(query)
            .args(params)
            .output();
        let out = within(60, "a metadata query", out).await.unwrap();
        let rows: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("{query}: {}", String::from_utf8_lossy(&out.stderr)));
        rows.as_array().unwrap().clone()
    }

    async fn sql_i64(&self, query: &str, params: &[&str]) -> i64 {
        self.sql(query, params)
            .await
            .first()
            .and_then(|r| r[0].as_i64())
            .unwrap_or(0)
    }

    async fn task_state(&self, run_id: &str, task: &str) -> Option<String> {
        let rows = self
            .sql(
                "SELECT state FROM task_instance WHERE run_id = ? AND task_id = ?",
                &[run_id, task],
            )
            .await;
        rows.first().and_then(|r| r[0].as_str()).map(str::to_string)
    }

    /// Triggers `dag` as `run_id` with `conf`.
    async fn trigger(&self, dag: &str, run_id: &str, conf: &Value) {
        self.cli(&[
            "dags",
            "trigger",
            dag,
            "--run-id",
            run_id,
            "--conf",
            &conf.to_string(),
        ])
        .await;
    }

    /// Waits until `task` of `run_id` is in `state`.
    async fn until_task(&self, run_id: &str, task: &str, state: &str, secs: u64) {
        within(secs, &format!("{task} {state}"), async {
            while self.task_state(run_id, task).await.as_deref() != Some(state) {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await;
    }

    /// Waits until `run_id` ends; its state and each task's.
    async fn finished(&self, run_id: &str, secs: u64) -> (String, BTreeMap<String, String>) {
        let state = within(secs, &format!("run {run_id} to end"), async {
            loop {
                let rows = self
                    .sql("SELECT state FROM dag_run WHERE run_id = ?", &[run_id])
                    .await;
                match rows.first().and_then(|r| r[0].as_str()) {
                    Some(s @ ("success" | "failed")) => return s.to_string(),
                    _ => tokio::time::sleep(Duration::from_millis(300)).await,
                }
            }
        })
        .await;
        let tasks = self
            .sql(
                "SELECT task_id, state FROM task_instance WHERE run_id = ?",
                &[run_id],
            )
            .await
            .iter()
            .map(|r| {
                (
                    r[0].as_str().unwrap().to_string(),
                    r[1].as_str().unwrap_or("none").to_string(),
                )
            })
            .collect();
        (state, tasks)
    }

    /// The XCom `key` of `task` in `run_id`.
    async fn xcom(&self, run_id: &str, task: &str, key: &str) -> Value {
        let rows = self
            .sql(
                "SELECT value FROM xcom WHERE run_id = ? AND task_id = ? AND key = ?",
                &[run_id, task, key],
            )
            .await;
        let text = rows
            .first()
            .and_then(|r| r[0].as_str())
            .unwrap_or("null")
            .to_string();
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    }

    /// Everything `task` of `run_id` logged (its attempts and triggers).
    fn task_log(&self, dag: &str, run_id: &str, task: &str) -> String {
        let dir = self
            .home
            .path()
            .join(format!("logs/dag_id={dag}/run_id={run_id}/task_id={task}"));
        let mut text = String::new();
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            text.push_str(&std::fs::read_to_string(entry.unwrap().path()).unwrap_or_default());
        }
        text
    }

    /// Diagnostics for a failed assertion: each component's log tail.
    fn logs(&self) -> String {
        ["scheduler", "triggerer", "api-server", "dag-processor"]
            .iter()
            .map(|name| {
                let text = std::fs::read_to_string(self.home.path().join(format!("{name}.log")))
                    .unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(30).collect();
                format!(
                    "== {name}\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Airflow {
    fn drop(&mut self) {
        let names: Vec<&'static str> = self.processes.keys().copied().collect();
        for name in names {
            self.kill(name);
        }
    }
}

fn parse_time(value: &Value) -> time::OffsetDateTime {
    time::OffsetDateTime::parse(
        value.as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap_or_else(|e| panic!("{value}: {e}"))
}

/// When the first line of `log` (Airflow 3's JSON lines) holding `text`
/// was logged.
fn logged_at(log: &str, text: &str) -> time::OffsetDateTime {
    let line = log
        .lines()
        .find(|l| l.contains(text))
        .unwrap_or_else(|| panic!("no {text:?} in the log:\n{log}"));
    let entry: Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
    parse_time(&entry["timestamp"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dag_defers_survives_a_killed_triggerer_and_fails_bad_input_clearly_in_airflow_3() {
    let bin = provider_venv("airflow3-provider", AIRFLOW_3).await;
    let db = TestDb::new().await;
    let llm = slow_llm().await;
    let service = serve(&db, &llm).await;
    let mut airflow = Airflow::start(bin, &service).await;

    // 1. The wait is deferred while the articles are written; the briefing
    //    holds exactly the completed ids.
    let targets = add(&db, &["Hottest", "refuse: not this one", "Third", "Fourth"]).await;
    let conf = json!({"issue_ids": targets, "min_completion": 2, "timeout_s": 120});
    airflow.trigger("newsnack_daily", "partial", &conf).await;
    airflow
        .until_task("partial", "wait_for_completion", "deferred", 180)
        .await;
    let (state, tasks) = airflow.finished("partial", 180).await;
    assert_eq!(state, "success", "{tasks:?}\n{}", airflow.logs());
    assert!(tasks.values().all(|s| s == "success"), "{tasks:?}");
    let expected = vec![targets[0], targets[2], targets[3]];
    assert_eq!(
        ids(&airflow
            .xcom("partial", "wait_for_completion", "return_value")
            .await["completed"]),
        expected
    );
    assert_eq!(briefings(&db).await, vec![expected.clone()]);

    // 2. The triggerer is killed mid-wait and started again: the wait ends
    //    at its original deadline with timeout_pass (one written, one stuck).
    let pair = add(&db, &["Quick", "stuck: the model never answers"]).await;
    let conf = json!({"issue_ids": pair, "min_completion": 1, "timeout_s": 40});
    airflow.trigger("newsnack_daily", "restarted", &conf).await;
    airflow
        .until_task("restarted", "wait_for_completion", "deferred", 180)
        .await;
    within(60, "the trigger to run", async {
        while airflow
            .sql_i64(
                "SELECT count(*) FROM trigger WHERE triggerer_id IS NOT NULL",
                &[],
            )
            .await
            < 1
        {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    airflow.kill("triggerer");
    airflow.spawn("triggerer");
    let (state, tasks) = airflow.finished("restarted", 180).await;
    assert_eq!(state, "success", "{tasks:?}\n{}", airflow.logs());
    let decision = airflow
        .xcom("restarted", "wait_for_completion", "wait_decision")
        .await;
    let late = parse_time(&decision["answered_at"]) - parse_time(&decision["deadline"]);
    assert!(
        late >= time::Duration::ZERO && late < time::Duration::seconds(1),
        "answered {late} after the original deadline: {decision}"
    );
    let wait = airflow
        .xcom("restarted", "wait_for_completion", "return_value")
        .await;
    assert_eq!(wait["outcome"], "timeout_pass", "{wait}");
    assert_eq!(ids(&wait["completed"]), vec![pair[0]]);
    assert_eq!(briefings(&db).await.last(), Some(&vec![pair[0]]));
    let log = airflow.task_log("newsnack_daily", "restarted", "wait_for_completion");
    assert!(log.contains("deferring the wait"), "{log}");

    // 3. A skip skips the briefing; and bad input, at the same time.
    let skipping = add(&db, &["refuse one", "refuse two", "Fine"]).await;
    airflow
        .trigger(
            "newsnack_daily",
            "skipping",
            &json!({"issue_ids": skipping, "min_completion": 2, "timeout_s": 120}),
        )
        .await;
    let pending = add(&db, &["Never claimed"]).await;
    airflow
        .trigger("newsnack_bad_input", "bad", &json!({"issue_ids": pending}))
        .await;
    let (state, tasks) = airflow.finished("skipping", 180).await;
    assert_eq!(state, "success", "{tasks:?}\n{}", airflow.logs());
    assert_eq!(tasks["wait_for_completion"], "skipped");
    assert_eq!(tasks["assemble_today_newsnack"], "skipped");
    let log = airflow.task_log("newsnack_daily", "skipping", "wait_for_completion");
    assert!(
        log.contains("skip: 1 of 3 DONE, fewer than the minimum"),
        "{log}"
    );
    assert_eq!(briefings(&db).await.len(), 2);

    let (state, tasks) = airflow.finished("bad", 180).await;
    assert_eq!(state, "failed");
    for (task, message) in BAD_INPUT_MESSAGES {
        assert_eq!(tasks[*task], "failed", "{task}: {tasks:?}");
        let log = airflow.task_log("newsnack_bad_input", "bad", task);
        assert!(
            log.contains(message),
            "{task} should say {message:?}:\n{log}"
        );
    }

    // The deadline already past: 60 s after the claim an hour ago. The wait
    // defers with it and the service decides at once: the issue was never
    // claimed, so fewer than min_completion are DONE, a skip.
    assert_eq!(tasks["claimed_an_hour_ago"], "success", "{tasks:?}");
    assert_eq!(tasks["deadline_past"], "skipped", "{tasks:?}");
    let claimed_at = parse_time(
        &airflow
            .xcom("bad", "claimed_an_hour_ago", "claimed_at")
            .await,
    );
    let decision = airflow.xcom("bad", "deadline_past", "wait_decision").await;
    let deadline = parse_time(&decision["deadline"]);
    assert_eq!(
        deadline,
        claimed_at + time::Duration::seconds(60),
        "{decision}"
    );
    let log = airflow.task_log("newsnack_bad_input", "bad", "deadline_past");
    let deferred_at = logged_at(&log, "deferring the wait");
    assert!(
        log.contains(&format!("until {}", decision["deadline"].as_str().unwrap())),
        "{log}"
    );
    assert!(
        deadline < deferred_at - time::Duration::minutes(55),
        "deferred at {deferred_at} with the deadline {deadline}"
    );
    let decided = parse_time(&decision["answered_at"]) - deferred_at;
    assert!(
        decided >= time::Duration::ZERO && decided < time::Duration::seconds(5),
        "decided {decided} after deferring: {decision}"
    );
    assert!(
        log.contains("skip: 0 of 1 DONE, fewer than the minimum"),
        "{log}"
    );
    assert_eq!(
        airflow.sql_i64("SELECT count(*) FROM trigger", &[]).await,
        0,
        "no trigger left"
    );
    drop(airflow);
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_dag_runs_on_airflow_2_10() {
    let bin = provider_venv("airflow2-provider", AIRFLOW_2).await;
    let db = TestDb::new().await;
    let llm = slow_llm().await;
    let service = serve(&db, &llm).await;
    let targets = add(&db, &["Hottest", "refuse: not this one", "Third"]).await;
    let home = tempfile::tempdir().unwrap();
    let run = |args: Vec<String>| {
        let mut command = tokio::process::Command::new(bin.join("airflow"));
        command
            .args(args)
            .env("AIRFLOW_HOME", home.path())
            .env("AIRFLOW__CORE__DAGS_FOLDER", EXAMPLE)
            .env("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
            .env(
                "AIRFLOW_CONN_NEWSNACK_DEFAULT",
                connection(service.addr.port(), TOKEN),
            )
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        async move {
            let out = within(300, "airflow 2.10", command.output()).await.unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success(), "{text}");
            text
        }
    };
    run(vec!["db".into(), "migrate".into()]).await;
    let conf = json!({"issue_ids": targets, "min_completion": 1, "timeout_s": 120});
    let text = run(vec![
        "dags".into(),
        "test".into(),
        "newsnack_daily".into(),
        "--conf".into(),
        conf.to_string(),
    ])
    .await;
    assert!(
        text.contains("state=success") || text.contains("DagRun Finished"),
        "{text}"
    );
    assert_eq!(
        briefings(&db).await,
        vec![vec![targets[0], targets[2]]],
        "{text}"
    );
    service.stop().await.unwrap();
}
