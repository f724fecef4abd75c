//! The dashboard: the shape of `GET /dashboard.json` and its one-snapshot
//! consistency, reads planned without JIT on a fresh database, the
//! embedded assets, and a real headless browser (Debian's
//! `chromium`, driven by `tests/browser/dashboard.mjs` with
//! `playwright-core`) watching a raw SQL status change arrive over
//! `/events` without a reload, and, with tokens configured, refused
//! without credentials and live with the read token given as HTTP Basic
//! at the browser's challenge. The browser tests fail, saying what to
//! install, when chromium, node or playwright-core is missing; `.ci/run`
//! installs them.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;

use common::gate::Relay;
use common::http::post_json;
use common::{offline, until_done_count, within, TestDb};
use newsnack::db;
use newsnack::db::pipeline_run::RunRecord;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// Records a manual run by `instance` that completed every one of
/// `targets` and published `briefing_id`; returns the run's id.
async fn record_passed_run(
    client: &impl db::Sql,
    instance: &str,
    targets: Vec<i64>,
    briefing_id: i64,
) -> i64 {
    let run_id = db::pipeline_run::start(client, "manual", None, instance, &json!({}))
        .await
        .unwrap()
        .unwrap();
    let record = RunRecord {
        outcome: "all_pass".into(),
        completed: targets.clone(),
        targets,
        briefing_id: Some(briefing_id),
        ..Default::default()
    };
    db::pipeline_run::finish(client, run_id, &record)
        .await
        .unwrap();
    run_id
}

async fn get(url: &str) -> (reqwest::StatusCode, String, String) {
    let response = reqwest::get(url)
        .await
        .unwrap_or_else(|e| panic!("GET {url}: no response: {e}"));
    let status = response.status();
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, content_type, response.text().await.unwrap())
}

async fn snapshot(base: &str) -> Value {
    let (status, content_type, body) = get(&format!("{base}/dashboard.json")).await;
    assert_eq!(status, 200, "GET /dashboard.json: {body}");
    assert!(
        content_type.starts_with("application/json"),
        "{content_type}"
    );
    serde_json::from_str(&body).unwrap()
}

fn is_rfc3339(value: &Value) -> bool {
    value.as_str().is_some_and(|s| {
        time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).is_ok()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_json_has_the_documented_shape_as_of_one_log_position() {
    let db = TestDb::new().await;
    let ids = db.add_issues(3).await;
    let service = db.serve("dash-json", offline()).await;
    let base = format!("http://{}", service.addr);

    let snap = snapshot(&base).await;
    let mut keys: Vec<&str> = snap
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "briefing",
            "counts",
            "in_flight",
            "last_seq",
            "llm",
            "now",
            "runs",
            "transitions"
        ]
    );
    // The LLM budget: nothing queued or in flight, no pause, no tokens.
    assert_eq!(
        snap["llm"],
        json!({
            "max_in_flight": 8,
            "requests_per_minute": 0,
            "in_flight": 0,
            "started_last_minute": 0,
            "waiting_briefing": 0,
            "waiting_feed": 0,
            "holders": 0,
            "pause": null,
            "tokens_today": {"prompt": 0, "completion": 0},
            "tokens_latest_briefing": {"prompt": 0, "completion": 0},
            "day": {"tokens": 0, "budget": 0, "briefing_reserve": 0, "timezone": "UTC",
                    "held": null, "state": null},
            "providers": [
                {"provider": "primary", "state": "up", "failures": 0, "down_until": null,
                 "last_error": null, "last_error_at": null, "in_flight": 0},
                {"provider": "fallback", "state": "up", "failures": 0, "down_until": null,
                 "last_error": null, "last_error_at": null, "in_flight": 0},
            ],
        })
    );
    assert_eq!(
        snap["counts"],
        json!({"PENDING": 3, "IN_PROGRESS": 0, "DONE": 0, "FAILED": 0})
    );
    assert_eq!(snap["in_flight"], json!([]));
    assert_eq!(snap["runs"], json!([]));
    assert_eq!(snap["briefing"], Value::Null);
    assert!(is_rfc3339(&snap["now"]), "{}", snap["now"]);
    let last_seq = db
        .scalar_i64("SELECT COALESCE(max(seq), 0) FROM issue_transition")
        .await;
    assert_eq!(snap["last_seq"], json!(last_seq));
    // Newest first, with the issue's title.
    let transitions = snap["transitions"].as_array().unwrap();
    assert_eq!(transitions.len(), 3);
    assert_eq!(transitions[0]["seq"], json!(last_seq));
    assert_eq!(transitions[0]["issue_id"], json!(ids[2]));
    assert_eq!(transitions[0]["title"], json!("issue 2"));
    assert_eq!(transitions[0]["from"], Value::Null);
    assert_eq!(transitions[0]["to"], json!("PENDING"));
    assert!(is_rfc3339(&transitions[0]["at"]));

    // Another system claims an issue with plain SQL.
    db.raw()
        .await
        .execute(
            "UPDATE issue SET processing_status = 'IN_PROGRESS', claimed_by = 'elsewhere' WHERE id = $1",
            &[&ids[0]],
        )
        .await
        .unwrap();
    let snap = snapshot(&base).await;
    assert_eq!(
        snap["counts"],
        json!({"PENDING": 2, "IN_PROGRESS": 1, "DONE": 0, "FAILED": 0})
    );
    assert_eq!(snap["last_seq"], json!(last_seq + 1));
    assert_eq!(snap["transitions"][0]["from"], json!("PENDING"));
    assert_eq!(snap["transitions"][0]["to"], json!("IN_PROGRESS"));
    let in_flight = snap["in_flight"].as_array().unwrap();
    assert_eq!(in_flight.len(), 1);
    let claim = &in_flight[0];
    assert_eq!(claim["id"], json!(ids[0]));
    assert_eq!(claim["title"], json!("issue 0"));
    assert_eq!(claim["claimed_by"], json!("elsewhere"));
    assert_eq!(claim["attempts"], json!(1));
    assert!(is_rfc3339(&claim["lease_until"]), "{claim}");
    assert!(is_rfc3339(&claim["since"]), "{claim}");

    // A finished run and its briefing.
    let client = db.pool.get().await.unwrap();
    let today = time::OffsetDateTime::now_utc().date();
    let briefing_id = db::briefing::insert(&client, "Today", today, &[ids[1]], "# Today\n\nText.")
        .await
        .unwrap();
    let run_id = record_passed_run(&client, "dash-json", vec![ids[1]], briefing_id).await;
    let snap = snapshot(&base).await;
    assert_eq!(snap["runs"][0]["id"], json!(run_id));
    assert_eq!(snap["runs"][0]["outcome"], json!("all_pass"));
    assert_eq!(snap["runs"][0]["completed"], json!([ids[1]]));
    assert_eq!(snap["runs"][0]["briefing_id"], json!(briefing_id));
    assert_eq!(snap["briefing"]["id"], json!(briefing_id));
    assert_eq!(snap["briefing"]["title"], json!("Today"));
    assert_eq!(snap["briefing"]["issue_ids"], json!([ids[1]]));
    assert_eq!(snap["briefing"]["body"], json!("# Today\n\nText."));

    service.stop().await.unwrap();
}

/// The read behind each provider's state on the dashboard and `/metrics`
/// (`db::llm_budget::providers`), as it was when a fresh install's
/// planner, taking the never-analyzed `llm_provider` and `llm_budget` for
/// hundreds of rows each, estimated it past the default `jit_above_cost`.
const PROVIDERS_READ: &str = "SELECT p.provider,
        CASE WHEN p.down_until > now() OR (p.provider = 'primary' AND b.paused_until > now())
             THEN 'down' ELSE 'up' END,
        (SELECT count(*) FROM llm_call c JOIN llm_holder h USING (holder)
          WHERE h.lease_until >= now() AND c.granted_at IS NOT NULL AND c.finished_at IS NULL
            AND COALESCE(c.provider, 'primary') = p.provider)
   FROM llm_provider p, llm_budget b
  ORDER BY p.provider = 'fallback'";

/// The plan `client`'s session runs `sql` with, as `EXPLAIN (ANALYZE,
/// FORMAT JSON)` gives it.
async fn plan_of(client: &tokio_postgres::Client, sql: &str) -> Value {
    let row = client
        .query_one(&format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}"), &[])
        .await
        .unwrap();
    let plans: Value = row.get(0);
    plans[0].clone()
}

/// On a database nothing has analyzed, a read whose estimate crosses
/// `jit_above_cost` is JIT-compiled by a session that may (a quarter of a
/// second, each time), and not by the service's: migrating gave its role
/// `jit = off` in this database, so every session opened for it, by the
/// service or by a pooler on its behalf, plans without JIT. Nothing the
/// service ran for the dashboard or `/metrics` was compiled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_database_is_read_without_jit_by_the_services_sessions() {
    let db = TestDb::new().await;
    let never_analyzed = db
        .scalar_i64(
            "SELECT count(*) FROM pg_stat_user_tables
              WHERE relname IN ('llm_provider', 'llm_budget', 'llm_call', 'llm_holder')
                AND last_analyze IS NULL AND last_autoanalyze IS NULL",
        )
        .await;
    assert_eq!(never_analyzed, 4, "the budget's tables are fresh");

    // Another system's session, JIT allowed: the read is compiled.
    let other = db.raw().await;
    other.batch_execute("SET jit = on").await.unwrap();
    let plan = plan_of(&other, PROVIDERS_READ).await;
    let cost = plan["Plan"]["Total Cost"].as_f64().unwrap();
    assert!(cost > 100_000.0, "estimated past jit_above_cost: {plan}");
    assert!(
        plan.get("JIT").is_some(),
        "compiled where JIT is on: {plan}"
    );

    db.count_statements().await;
    let service = db.serve("fresh", offline()).await;
    let base = format!("http://{}", service.addr);
    for _ in 0..3 {
        snapshot(&base).await;
        let (status, _, body) = get(&format!("{base}/metrics")).await;
        assert_eq!(status, 200, "{body}");
    }
    // A session opened as the service opens its own.
    let session = db.endpoint.connect().await.unwrap();
    let plan = plan_of(&session, PROVIDERS_READ).await;
    assert!(plan.get("JIT").is_none(), "no JIT: {plan}");
    assert!(
        plan["Execution Time"].as_f64().unwrap() < 50.0,
        "runs in milliseconds: {plan}"
    );
    // Every statement the service ran here, none compiled.
    let in_this_database = "dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                            AND query NOT LIKE 'EXPLAIN%'";
    let budget_reads = db
        .scalar_i64(&format!(
            "SELECT COALESCE(sum(calls), 0)::bigint FROM pg_stat_statements
              WHERE {in_this_database} AND query LIKE '%FROM llm_provider p%'"
        ))
        .await;
    assert!(
        budget_reads >= 6,
        "the providers read at every request: {budget_reads}"
    );
    let compiled = db
        .scalar_i64(&format!(
            "SELECT COALESCE(sum(jit_functions), 0)::bigint FROM pg_stat_statements
              WHERE {in_this_database}"
        ))
        .await;
    assert_eq!(
        compiled, 0,
        "functions JIT-compiled by the service's statements"
    );
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_and_its_assets_are_embedded() {
    let db = TestDb::new().await;
    let service = db.serve("dash-assets", offline()).await;
    let base = format!("http://{}", service.addr);
    for (path, content_type, needle) in [
        ("/", "text/html", "/dashboard/app.js"),
        ("/dashboard/app.js", "text/javascript", "new EventSource("),
        ("/dashboard/style.css", "text/css", ".stream"),
    ] {
        let (status, got_type, body) = get(&format!("{base}{path}")).await;
        assert_eq!(status, 200, "GET {path}");
        assert!(got_type.starts_with(content_type), "GET {path}: {got_type}");
        assert!(body.contains(needle), "GET {path} lacks {needle:?}");
        // Nothing from outside: the machine may have no internet.
        assert!(
            !body.contains("https://"),
            "GET {path} loads something external"
        );
    }
    service.stop().await.unwrap();
}

// ---- the headless browser ------------------------------------------------

fn browser_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser")
}

/// Fails the test with what to install when a piece is missing.
fn require_browser_tools() -> PathBuf {
    const HOW: &str = "install it as .ci/run does: `apt-get install -y chromium nodejs npm` and \
                       `PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --prefix tests/browser`";
    let chromium = std::env::var_os("NEWSNACK_CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    assert!(
        chromium.is_file(),
        "the dashboard browser test needs chromium at {} (set NEWSNACK_CHROMIUM to use another); {HOW}",
        chromium.display()
    );
    let node = std::process::Command::new("node").arg("--version").output();
    assert!(
        node.as_ref().is_ok_and(|o| o.status.success()),
        "the dashboard browser test needs `node` on PATH ({node:?}); {HOW}"
    );
    let playwright = browser_dir().join("node_modules/playwright-core/package.json");
    assert!(
        playwright.is_file(),
        "the dashboard browser test needs playwright-core in {}; {HOW}",
        playwright.display()
    );
    chromium
}

/// The Node driver: one JSON step per line in, one JSON answer per line out.
struct Browser {
    child: tokio::process::Child,
    stdin: Option<tokio::process::ChildStdin>,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    stderr: tokio::task::JoinHandle<String>,
}

impl Browser {
    async fn open(url: &str, chromium: &Path) -> (Browser, Value) {
        Browser::open_as(url, chromium, None).await
    }

    /// Opens `url` answering the server's HTTP authentication challenge
    /// with `credentials` (user name, password), as a person would at the
    /// browser's prompt.
    async fn open_as(
        url: &str,
        chromium: &Path,
        credentials: Option<(&str, &str)>,
    ) -> (Browser, Value) {
        let mut command = tokio::process::Command::new("node");
        if let Some((user, password)) = credentials {
            command
                .env("NEWSNACK_BROWSER_USER", user)
                .env("NEWSNACK_BROWSER_PASSWORD", password);
        }
        let mut child = command
            .arg(browser_dir().join("dashboard.mjs"))
            .arg(url)
            .current_dir(browser_dir())
            .env("NEWSNACK_CHROMIUM", chromium)
            .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start node");
        let mut stderr_pipe = child.stderr.take().unwrap();
        let stderr = tokio::spawn(async move {
            let mut text = String::new();
            let _ = stderr_pipe.read_to_string(&mut text).await;
            text
        });
        let mut browser = Browser {
            stdin: child.stdin.take(),
            lines: BufReader::new(child.stdout.take().unwrap()).lines(),
            child,
            stderr,
        };
        let loaded = browser.answer("the page to load").await;
        (browser, loaded)
    }

    async fn answer(&mut self, what: &str) -> Value {
        let line = within(60, what, self.lines.next_line()).await;
        match line {
            Ok(Some(line)) => {
                let value: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("the browser driver said {line:?} ({e})"));
                assert_eq!(
                    value["ok"],
                    json!(true),
                    "the browser, waiting for {what}: {value:#}"
                );
                assert_eq!(value["errors"], json!([]), "errors on the page: {value:#}");
                value
            }
            _ => {
                let _ = self.child.start_kill();
                let stderr = (&mut self.stderr).await.unwrap_or_default();
                panic!(
                    "the browser driver stopped while waiting for {what}; its stderr:\n{stderr}"
                );
            }
        }
    }

    async fn step(&mut self, what: &str, step: Value) -> Value {
        let stdin = self.stdin.as_mut().unwrap();
        stdin
            .write_all(format!("{step}\n").as_bytes())
            .await
            .unwrap();
        stdin.flush().await.unwrap();
        self.answer(what).await
    }

    async fn close(mut self) {
        drop(self.stdin.take());
        let status = within(30, "the browser to close", self.child.wait())
            .await
            .unwrap();
        let stderr = self.stderr.await.unwrap_or_default();
        assert!(
            status.success(),
            "the browser driver exited with {status}: {stderr}"
        );
    }
}

/// `target/dashboard.png`, wherever the target directory is.
fn screenshot_path() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("CARGO_TARGET_TMPDIR is inside the target directory")
        .join("dashboard.png")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_headless_browser_sees_a_raw_sql_change_without_a_reload() {
    let chromium = require_browser_tools();
    let db = TestDb::new().await;
    // A failure stays FAILED (no automatic retry), so the counts hold still.
    db.set("max_attempts", "1").await;
    let titles = [
        "City council approves the new tram line",
        "Heatwave pushes the power grid to record demand",
        "Central bank holds rates as inflation cools",
        "Chip maker unveils a low-power laptop processor",
        "Open-source maintainers push back on AI scrapers",
    ];
    let issues: Vec<_> = titles
        .iter()
        .enumerate()
        .map(|(i, title)| db::issue::NewIssue {
            title: title.to_string(),
            body: format!("{title}. Reporters are following the story through the day."),
            score: i as f64,
            collected_at: None,
            source_key: None,
        })
        .collect();
    let client = db.pool.get().await.unwrap();
    let ids = db::issue::insert_issues(&client, &issues).await.unwrap();
    let service = db.serve("dash-browser", offline()).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();

    // Two articles written by this instance, and a briefing of them.
    let claimed = http
        .post(format!("{base}/ai-articles"))
        .json(&json!({ "issue_ids": [ids[3], ids[4]] }))
        .send()
        .await
        .unwrap();
    assert_eq!(claimed.status(), 202);
    until_done_count(&db, &service.hub, 30, 2).await;
    let (_, assembled) = post_json(
        &http,
        &format!("{base}/today-newsnack"),
        &json!({ "issue_ids": [ids[4], ids[3]] }),
    )
    .await;
    let briefing_id = assembled["briefing_id"].as_i64().expect("a briefing");
    let run_id =
        record_passed_run(&client, "dash-browser", vec![ids[4], ids[3]], briefing_id).await;
    // One failure by another system.
    let sql = db.raw().await;
    sql.batch_execute(&format!(
        "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = {id};
         UPDATE issue SET processing_status = 'FAILED', last_error = 'upstream 500' WHERE id = {id};",
        id = ids[2]
    ))
    .await
    .unwrap();

    let shot = screenshot_path();
    let _ = std::fs::remove_file(&shot);
    let (mut browser, loaded) = Browser::open(&format!("{base}/"), &chromium).await;
    assert_eq!(loaded["loaded"], json!(true));

    let before = json!({"PENDING": 2, "IN_PROGRESS": 0, "DONE": 2, "FAILED": 1, "total": 5});
    let shown = browser
        .step(
            "the initial counts and a live stream",
            json!({ "counts": before, "live": true, "selector": format!("#runs tr[data-run=\"{run_id}\"]") }),
        )
        .await;
    assert_eq!(shown["live"], json!("live"), "{shown:#}");
    assert!(
        shown["stats"]["events"].as_u64() == Some(0),
        "the stream replayed something already in the snapshot: {shown:#}"
    );

    // Another system claims an issue with plain SQL; the open page shows it.
    sql.execute(
        "UPDATE issue SET processing_status = 'IN_PROGRESS', claimed_by = 'airflow-worker-3' WHERE id = $1",
        &[&ids[0]],
    )
    .await
    .unwrap();
    let after = json!({"PENDING": 1, "IN_PROGRESS": 1, "DONE": 2, "FAILED": 1, "total": 5});
    let shown = browser
        .step(
            "the raw SQL change to appear",
            json!({
                "row": { "issue": ids[0], "to": "IN_PROGRESS" },
                "counts": after,
                "claim": ids[0],
                "selector": format!("#briefing[data-briefing=\"{briefing_id}\"] h1"),
                "screenshot": shot,
            }),
        )
        .await;
    assert_eq!(shown["sameDocument"], json!(true), "the page was reloaded");
    assert!(
        shown["stats"]["events"].as_u64() >= Some(1),
        "no event arrived over /events: {shown:#}"
    );
    browser.close().await;

    let png =
        std::fs::read(&shot).unwrap_or_else(|e| panic!("no screenshot at {}: {e}", shot.display()));
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is not a PNG",
        shot.display()
    );
    assert!(png.len() > 10_000, "the screenshot is suspiciously small");
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_page_starts_over_when_the_service_returns_on_a_new_database() {
    let chromium = require_browser_tools();
    // The first database has a longer log than the second will ever reach
    // in this test: 6 issues, 3 of them claimed.
    let first = TestDb::new().await;
    let ids = first.add_issues(6).await;
    first.move_with_sql(&ids[..3], &["IN_PROGRESS"]).await;
    let second = TestDb::new().await;
    let fresh = second.add_issues(2).await;

    // The page reaches the service through a relay, as a browser reaches a
    // restarted service at the same address.
    let old = first.serve("dash-old", offline()).await;
    let relay = Relay::start(Some(old.addr.to_string())).await;
    let (mut browser, _) = Browser::open(&format!("http://{}/", relay.addr), &chromium).await;
    browser
        .step(
            "the first database's counts",
            json!({ "counts": {"PENDING": 3, "IN_PROGRESS": 3, "total": 6}, "live": true }),
        )
        .await;

    // The service comes back on another database.
    let new = second.serve("dash-new", offline()).await;
    relay.route(Some(new.addr.to_string()));
    old.stop().await.unwrap();
    let shown = browser
        .step(
            "the second database's counts",
            json!({ "counts": {"PENDING": 2, "IN_PROGRESS": 0, "DONE": 0, "FAILED": 0, "total": 2}, "live": true }),
        )
        .await;
    assert_eq!(shown["sameDocument"], json!(true), "the page was reloaded");
    assert_eq!(shown["stats"]["resets"], json!(1), "{shown:#}");

    // And follows the new log live.
    second.move_with_sql(&fresh[..1], &["IN_PROGRESS"]).await;
    browser
        .step(
            "a change in the new database",
            json!({
                "row": { "issue": fresh[0], "to": "IN_PROGRESS" },
                "counts": {"PENDING": 1, "IN_PROGRESS": 1, "total": 2},
            }),
        )
        .await;
    browser.close().await;
    new.stop().await.unwrap();
}

/// With tokens configured, the browser is refused (401) without
/// credentials or with a wrong password, and with the read token as the
/// Basic password — what a person types at the browser's prompt — the
/// dashboard loads, its event stream goes live, and a raw SQL change
/// arrives over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_opens_the_dashboard_with_the_read_token_as_basic_password() {
    const READ: &str = "dashboard-read-token-3f9a1c";
    let chromium = require_browser_tools();
    let db = TestDb::new().await;
    let ids = db.add_issues(3).await;
    let setup = common::Setup {
        tokens: newsnack::http::auth::Tokens {
            api: Some("dashboard-api-token-8e2b7d".into()),
            read: Some(READ.into()),
            metrics: None,
        },
        ..common::Setup::default()
    };
    let service = db.serve_with("dash-token", offline(), setup).await;
    let url = format!("http://{}/", service.addr);

    let (browser, loaded) = Browser::open_as(&url, &chromium, None).await;
    assert_eq!(loaded["loaded"], json!(false), "{loaded:#}");
    assert_eq!(loaded["status"], json!(401), "{loaded:#}");
    browser.close().await;
    let wrong = Some(("editor", "not-the-read-token-000"));
    let (browser, loaded) = Browser::open_as(&url, &chromium, wrong).await;
    assert_eq!(loaded["loaded"], json!(false), "{loaded:#}");
    assert_eq!(loaded["status"], json!(401), "{loaded:#}");
    browser.close().await;

    let (mut browser, loaded) = Browser::open_as(&url, &chromium, Some(("editor", READ))).await;
    assert_eq!(loaded["loaded"], json!(true), "{loaded:#}");
    browser
        .step(
            "the counts and a live stream",
            json!({ "counts": {"PENDING": 3, "total": 3}, "live": true }),
        )
        .await;
    db.move_with_sql(&ids[..1], &["IN_PROGRESS"]).await;
    let shown = browser
        .step(
            "the raw SQL change over the stream",
            json!({
                "row": { "issue": ids[0], "to": "IN_PROGRESS" },
                "counts": {"PENDING": 2, "IN_PROGRESS": 1, "total": 3},
            }),
        )
        .await;
    assert_eq!(shown["sameDocument"], json!(true), "the page was reloaded");
    assert!(
        shown["stats"]["events"].as_u64() >= Some(1),
        "no event arrived over /events: {shown:#}"
    );
    browser.close().await;
    service.stop().await.unwrap();
}
