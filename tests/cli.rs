//! The command line against a real database: migrations (twice, and two at
//! once), adding and claiming issues, status, settings, the JSON tail, and
//! a clear one-line error for bad input.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Output, Stdio};

use common::process::{self, newsnack, text};
use common::{move_on, TestDb};

#[tokio::test]
async fn migrate_twice_and_concurrently_leaves_one_correct_schema() {
    let db = TestDb::empty().await;
    let first = newsnack(&db.url, &["migrate"]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let every_version: Vec<i32> = newsnack::db::migrate::MIGRATIONS
        .iter()
        .map(|m| m.version)
        .collect();
    assert!(
        text(&first.stdout).contains(&format!("applied migrations {every_version:?}")),
        "{}",
        text(&first.stdout)
    );
    let second = newsnack(&db.url, &["migrate"]);
    assert!(second.status.success());
    assert!(text(&second.stdout).contains("up to date"));

    let other = TestDb::empty().await;
    let url = other.url.clone();
    let racers: Vec<_> = (0..4)
        .map(|_| {
            process::command(&url, &["migrate"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<Output> = racers
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    assert!(
        outputs.iter().all(|o| o.status.success()),
        "{:?}",
        outputs.iter().map(|o| text(&o.stderr)).collect::<Vec<_>>()
    );
    let applied = outputs
        .iter()
        .filter(|o| text(&o.stdout).contains("applied"))
        .count();
    assert_eq!(applied, 1, "exactly one racer applies the migrations");
    for db in [&db, &other] {
        assert_eq!(
            db.scalar_i64("SELECT count(*) FROM newsnack_migration")
                .await,
            newsnack::db::migrate::MIGRATIONS.len() as i64
        );
        assert_eq!(
            db.scalar_i64("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'issue'::regclass AND NOT tgisinternal").await,
            // Before insert and update, the log's two, the removal
            // notices' two, and the counts per status' four.
            10
        );
        // Every setting, the six of migration 17, the two of
        // migration 23 and the eight of migration 24 included.
        let settings = db.scalar_i64("SELECT count(*) FROM setting").await;
        assert_eq!(
            settings,
            db.scalar_i64("SELECT count(*) FROM setting_spec").await
        );
        assert!(settings >= 26, "{settings}");
    }
}

#[tokio::test]
async fn add_claim_status_and_retry_round_trip() {
    let db = TestDb::new().await;
    let added = newsnack(
        &db.url,
        &[
            "issues",
            "add",
            "--title",
            "Rates rise",
            "--body",
            "The bank raised rates.",
            "--score",
            "9.5",
        ],
    );
    assert!(added.status.success(), "{}", text(&added.stderr));
    let ids: serde_json::Value = serde_json::from_slice(&added.stdout).unwrap();
    let id = ids["ids"][0].as_i64().unwrap();

    let claimed = newsnack(
        &db.url,
        &["claim", &id.to_string(), &id.to_string(), "999999"],
    );
    assert!(claimed.status.success());
    let outcome: serde_json::Value = serde_json::from_slice(&claimed.stdout).unwrap();
    assert_eq!(
        outcome,
        serde_json::json!({"claimed": [id], "skipped": [999999]})
    );

    let again = newsnack(&db.url, &["claim", &id.to_string()]);
    assert_eq!(
        again.status.code(),
        Some(1),
        "nothing claimable is a failure"
    );

    let status = text(&newsnack(&db.url, &["status"]).stdout);
    assert!(
        status
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["IN_PROGRESS", "1"]),
        "{status}"
    );

    let not_failed = newsnack(&db.url, &["retry", &id.to_string()]);
    assert_eq!(not_failed.status.code(), Some(1));
    let sql = db.raw().await;
    move_on(&sql, &[id], &["FAILED"]).await;
    let reset = newsnack(&db.url, &["retry", &id.to_string()]);
    assert!(reset.status.success());
    let shown: serde_json::Value =
        serde_json::from_slice(&newsnack(&db.url, &["issues", "show", &id.to_string()]).stdout)
            .unwrap();
    assert_eq!(
        (shown["status"].as_str(), shown["attempts"].as_i64()),
        (Some("PENDING"), Some(0))
    );
}

#[tokio::test]
async fn issues_from_a_json_file() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("issues.json");
    std::fs::write(
        &path,
        r#"{"issues":[{"title":"A","body":"a","score":1},{"title":"B","score":2.5}]}"#,
    )
    .unwrap();
    let out = newsnack(
        &db.url,
        &["issues", "add", "--file", path.to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(db.scalar_i64("SELECT count(*) FROM issue").await, 2);
    std::fs::write(&path, r#"[{"title":"","score":1}]"#).unwrap();
    let bad = newsnack(
        &db.url,
        &["issues", "add", "--file", path.to_str().unwrap()],
    );
    assert_eq!(bad.status.code(), Some(1));
    assert!(text(&bad.stderr).contains("title must not be blank"));
    // Unknown fields are refused as `POST /issues` refuses them, with
    // serde's own words for what is wrong.
    for (file, expected) in [
        (
            r#"{"issues":[{"title":"C"}],"junk":1}"#,
            "unknown field `junk`",
        ),
        (
            r#"{"issues":[{"title":"C","status":"DONE"}]}"#,
            "unknown field `status`",
        ),
        (
            r#"[{"title":"C","score":"high"}]"#,
            "invalid type: string \"high\"",
        ),
    ] {
        std::fs::write(&path, file).unwrap();
        let bad = newsnack(
            &db.url,
            &["issues", "add", "--file", path.to_str().unwrap()],
        );
        assert_eq!(bad.status.code(), Some(1), "{file}");
        assert!(
            text(&bad.stderr).contains(expected),
            "{file}: {}",
            text(&bad.stderr)
        );
    }
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue").await,
        2,
        "a bad file changes nothing"
    );
}

#[tokio::test]
async fn bad_input_gets_a_clear_one_line_error_and_changes_nothing() {
    let db = TestDb::new().await;
    let before = db.scalar_i64("SELECT count(*) FROM issue_transition").await;
    let cases: &[(&[&str], &str)] = &[
        (&["claim", "abc"], "invalid value 'abc'"),
        (&["claim", "0"], "positive ids"),
        (&["claim"], "required"),
        (&["tail", "--issue", "0"], "0 is not in 1.."),
        (&["tail", "--since=-5"], "-5 is not in 0.."),
        (&["settings", "set", "top_k", "0"], "between 1 and 100"),
        (&["settings", "set", "top_k", "five"], "whole number"),
        (&["settings", "set", "nope", "1"], "unknown setting"),
        // The right shape for the database, but no minute 61.
        (
            &["settings", "set", "schedule", "61 * * * *"],
            "invalid schedule",
        ),
        (&["settings", "get", "nope"], "unknown setting"),
        (&["issues", "show", "424242"], "no issue with id 424242"),
        (
            &[
                "issues",
                "add",
                "--title",
                "x",
                "--collected-at",
                "yesterday",
            ],
            "RFC 3339",
        ),
    ];
    for (args, expected) in cases {
        let out = newsnack(&db.url, args);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(err.contains(expected), "{args:?}: {err}");
    }
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM setting WHERE key = 'schedule' AND value = 'off'")
            .await,
        1,
        "a rejected setting is not stored"
    );
    let dead = newsnack("postgres://nobody@127.0.0.1:1/none", &["status"]);
    let err = text(&dead.stderr);
    assert_eq!(dead.status.code(), Some(1));
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains("newsnack:"), "{err}");
    let unset = process::binary(&["status"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(text(&unset.stderr).contains("DATABASE_URL is not set"));
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue_transition").await,
        before
    );
    assert_eq!(
        db.scalar_i64("SELECT value::bigint FROM setting WHERE key='top_k'")
            .await,
        5
    );
}

/// An issue whose `updated_at` was set to `infinity` with plain SQL (a date
/// the service cannot represent) is a clear one-line error, not a panic.
#[tokio::test]
async fn showing_an_issue_with_an_unreadable_date_is_a_one_line_error() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    let sql = db.raw().await;
    // Migration 13 refuses such values now; rows stored before it can
    // still hold them.
    sql.batch_execute("ALTER TABLE issue DROP CONSTRAINT issue_updated_at_in_range")
        .await
        .unwrap();
    sql.execute(
        "UPDATE issue SET updated_at = 'infinity' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    let out = newsnack(&db.url, &["issues", "show", &id.to_string()]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(
        err.starts_with(&format!("newsnack: issue {id}: updated_at holds")),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_json_replays_history_and_follows_live_one_object_per_line() {
    let db = TestDb::new().await;
    let ids = db.add_issues(2).await;
    let mut tail = process::command(&db.url, &["tail", "--json", "--since", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(tail.stdout.take().unwrap()).lines();
    let mut read = |n: usize| -> Vec<serde_json::Value> {
        (0..n)
            .map(|_| serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap())
            .collect()
    };
    let history = tokio::task::block_in_place(|| read(2));
    assert_eq!(history[0]["to"], "PENDING");
    assert_eq!(history[0]["from"], serde_json::Value::Null);
    let sql = db.raw().await;
    sql.execute(
        "UPDATE issue SET processing_status='IN_PROGRESS' WHERE id=$1",
        &[&ids[1]],
    )
    .await
    .unwrap();
    let live = tokio::task::block_in_place(|| read(1));
    assert_eq!(live[0]["issue_id"], ids[1]);
    assert_eq!(
        (live[0]["from"].as_str(), live[0]["to"].as_str()),
        (Some("PENDING"), Some("IN_PROGRESS"))
    );
    assert!(live[0]["seq"].as_i64().unwrap() > history[1]["seq"].as_i64().unwrap());
    assert!(live[0]["at"].as_str().unwrap().contains('T'));
    // Ctrl-C ends it cleanly.
    unsafe {
        libc::kill(tail.id() as i32, libc::SIGINT);
    }
    let status = tokio::task::block_in_place(|| tail.wait().unwrap());
    assert!(status.success(), "{status:?}");
}

/// Output that cannot be written (a full disk) is a failure, not the
/// normal end that a reader going away is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_that_cannot_write_its_output_fails() {
    let db = TestDb::new().await;
    db.add_issues(1).await;
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let tail = process::command(&db.url, &["tail", "--json", "--since", "0"])
        .env("RUST_LOG", "error")
        .stdout(full)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = tokio::task::block_in_place(|| tail.wait_with_output().unwrap());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("cannot write to standard output"),
        "{stderr}"
    );
}

/// `--since` beyond the log's end (a database restored from an older
/// backup, or a new one) is not waited for in silence: the tail says so on
/// stderr and follows from the log's end, as `GET /events` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_since_beyond_the_log_warns_and_follows_from_its_end() {
    let db = TestDb::new().await;
    let ids = db.add_issues(1).await;
    let end = db.scalar_i64("SELECT max(seq) FROM issue_transition").await;
    let mut tail = process::command(
        &db.url,
        &["tail", "--json", "--since", &(end + 1000).to_string()],
    )
    .env("RUST_LOG", "error")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Each pipe is read on a thread of its own, so a tail that says or
    // prints nothing fails the test at the deadline instead of hanging it.
    let lines_of = |pipe: Box<dyn std::io::Read + Send>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        rx
    };
    let stderr = lines_of(Box::new(tail.stderr.take().unwrap()));
    let stdout = lines_of(Box::new(tail.stdout.take().unwrap()));
    let deadline = std::time::Duration::from_secs(30);
    let warning = tokio::task::block_in_place(|| stderr.recv_timeout(deadline));
    db.raw()
        .await
        .execute(
            "UPDATE issue SET processing_status='IN_PROGRESS' WHERE id=$1",
            &[&ids[0]],
        )
        .await
        .unwrap();
    let next = tokio::task::block_in_place(|| stdout.recv_timeout(deadline));
    unsafe {
        libc::kill(tail.id() as i32, libc::SIGINT);
    }
    let status = tokio::task::block_in_place(|| tail.wait().unwrap());
    let warning = warning.expect("a warning on stderr");
    assert!(
        warning.contains(&format!("no transition at seq {}", end + 1000))
            && warning.contains(&format!("it ends at {end}")),
        "{warning}"
    );
    let next: serde_json::Value =
        serde_json::from_str(&next.expect("the next transition")).unwrap();
    assert_eq!(next["seq"], end + 1);
    assert_eq!(next["to"], "IN_PROGRESS");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn wait_prints_its_json_and_exits_3_on_skip() {
    let db = TestDb::new().await;
    let ids = db.add_issues(2).await;
    let sql = db.raw().await;
    move_on(&sql, &ids, &["IN_PROGRESS"]).await;
    move_on(&sql, &ids[..1], &["DONE"]).await;
    let (a, b) = (ids[0].to_string(), ids[1].to_string());
    let skip = newsnack(&db.url, &["wait", &a, &b, "--timeout", "0.3", "--min", "2"]);
    assert_eq!(skip.status.code(), Some(3), "{}", text(&skip.stderr));
    let report: serde_json::Value = serde_json::from_slice(&skip.stdout).unwrap();
    assert_eq!(report["outcome"], "skip");
    assert_eq!(report["completed"], serde_json::json!([ids[0]]));
    assert_eq!(report["unfinished"], serde_json::json!([ids[1]]));
    let pass = newsnack(&db.url, &["wait", &a, &b, "--timeout", "0.3", "--min", "1"]);
    assert_eq!(pass.status.code(), Some(0));
    let report: serde_json::Value = serde_json::from_slice(&pass.stdout).unwrap();
    assert_eq!(report["outcome"], "timeout_pass");
    let unknown = newsnack(&db.url, &["wait", "999999", "--timeout", "1"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert!(text(&unknown.stderr).contains("unknown issue ids"));
}

#[tokio::test]
async fn run_pipeline_says_so_when_another_run_holds_the_lock_and_locks_lists_it() {
    let db = TestDb::new().await;
    let holder = db.raw().await;
    let taken: bool = holder
        .query_one(
            "SELECT pg_try_advisory_lock($1)",
            &[&newsnack::db::advisory::PIPELINE],
        )
        .await
        .unwrap()
        .get(0);
    assert!(taken);
    let busy = newsnack(&db.url, &["run-pipeline"]);
    assert_eq!(busy.status.code(), Some(4));
    assert!(text(&busy.stderr).contains("another pipeline run holds the lock"));
    assert_eq!(db.scalar_i64("SELECT count(*) FROM pipeline_run").await, 0);
    let listed = text(&newsnack(&db.url, &["locks"]).stdout);
    let line = listed
        .lines()
        .find(|l| l.starts_with("pipeline"))
        .expect("the pipeline lock is listed");
    assert!(
        line.contains("other-system") && line.contains("held"),
        "{line}"
    );
}

/// A schedule written with plain SQL is checked field by field, and the
/// check never lets through what the scheduler cannot run: thousands of
/// generated expressions, common and broken, go through both.
#[tokio::test]
async fn the_database_accepts_only_schedules_the_scheduler_can_run() {
    use newsnack::settings::schedule::Schedule;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    let db = TestDb::new().await;
    let client = db.raw().await;
    let problems = |schedules: Vec<String>| {
        let client = &client;
        async move {
            client
                .query(
                    "SELECT s, newsnack_schedule_problem(s) FROM unnest($1::text[]) s",
                    &[&schedules],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, Option<String>>(1)))
                .collect::<Vec<_>>()
        }
    };

    let common = [
        "off",
        "every 30s",
        "every 15m",
        "every 6h",
        "every 8784h",
        "0 6 * * *",
        "*/5 * * * *",
        "30 0 6 * * *",
        "0 9 * * MON-FRI",
        "0 0 1 JAN,JUL *",
        "0 12 ? * SUN",
        "0 0 L * ?",
        "0 0 15W * *",
        "0 0 * * 5L",
        "0 0 * * 1#2",
        "0 8-18/2 * * 1-5",
        "5/10 * * * *",
        "@daily",
        "@hourly",
        "0 0 * * 7",
        "0 10 * * SAT-SUN",
        "0 10 * * FRI-SUN",
        "0 0 29 2 *",
        "0 0 31 1-3 *",
    ];
    // Accepted means the scheduler parses it and it fires.
    let fires = |schedule: &str| {
        schedule == "off"
            || schedule.parse::<Schedule>().is_ok_and(|s| {
                s.next_tick(time::OffsetDateTime::now_utc(), chrono_tz::UTC)
                    .is_some()
            })
    };
    for (schedule, problem) in problems(common.iter().map(|s| s.to_string()).collect()).await {
        assert_eq!(problem, None, "{schedule:?} is a schedule people write");
        assert!(fires(&schedule), "{schedule:?}");
    }
    let broken = [
        ("99 * * * *", "outside the minute field's range 0-59"),
        ("0 24 * * *", "outside the hour field's range 0-23"),
        ("0 0 0 * *", "outside the day-of-month field's range 1-31"),
        ("0 0 1 13 *", "outside the month field's range 1-12"),
        ("0 0 * * 8", "outside the day-of-week field's range 0-7"),
        ("61 0 0 * * *", "outside the second field's range 0-59"),
        ("*/0 * * * *", "the step"),
        ("0 5-1 * * *", "runs backwards"),
        ("0 0 * * 1#6", "between 1 and 5"),
        ("0 0 * JUL-FOO *", "not something the month field accepts"),
        ("0 0 * *", "5 or 6 fields"),
        ("every 8785h", "at most 366 days"),
        ("0 0 30 2 *", "never fall in the months given"),
        ("0 0 31 4,6,9,11 *", "never fall in the months given"),
        ("0 0 * * L", "not something the day-of-week field accepts"),
        ("0 0 * * 7L", "must be 0-6"),
        ("whenever", "5 or 6 fields"),
    ];
    let found = problems(broken.iter().map(|(s, _)| s.to_string()).collect()).await;
    for ((schedule, problem), (_, expected)) in found.iter().zip(broken) {
        let problem = problem.as_deref().unwrap_or("accepted");
        assert!(problem.contains(expected), "{schedule:?}: {problem}");
    }

    // Generated expressions: any the database accepts must parse. Most
    // fields are fine anywhere, so each odd piece is tried in an otherwise
    // valid expression.
    let fine = ["*", "1", "5", "1-5", "*/2", "3/4", "1,2", "2-6/2"];
    let pieces = [
        "*", "?", "0", "5", "7", "12", "23", "31", "59", "60", "99", "1-5", "5-1", "0-59", "*/15",
        "*/0", "*/61", "3/4", "10-20/5", "L", "5L", "15W", "1#2", "1#6", "MON", "SUN-SAT", "JAN",
        "DEC", "1,2", "1,,2", ",", "-", "/", "#", "a", "L-2",
    ];
    let mut rng = StdRng::seed_from_u64(7);
    let generated: Vec<String> = (0..4000)
        .map(|_| {
            let fields = if rng.random_bool(0.5) { 5 } else { 6 };
            (0..fields)
                .map(|_| {
                    if rng.random_bool(0.85) {
                        fine[rng.random_range(0..fine.len())]
                    } else {
                        pieces[rng.random_range(0..pieces.len())]
                    }
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let mut accepted = 0;
    for (schedule, problem) in problems(generated).await {
        if problem.is_none() {
            accepted += 1;
            assert!(
                fires(&schedule),
                "the database accepts {schedule:?}, the scheduler cannot run it or it never fires"
            );
        }
    }
    assert!(
        (100..3900).contains(&accepted),
        "{accepted} of 4000 accepted: the generator should give both kinds"
    );
}
