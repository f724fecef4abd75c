//! newsnack through a real PgBouncer in transaction pooling mode with its
//! default settings (no `ignore_startup_parameters`, no prepared-statement
//! support): `DATABASE_URL` points at PgBouncer and
//! `NEWSNACK_DIRECT_DATABASE_URL` at the server. Concurrent claims, a wait
//! that answers on the event, the tail, `run-pipeline` (twice), a schedule
//! change heard by a running service, no advisory lock on a server
//! connection of PgBouncer's, and no JIT on any of its server sessions.
//! Without the direct URL, the service says it is not ready and why, and
//! the tail refuses to follow in silence.

mod common;

use std::collections::BTreeSet;
use std::process::{Output, Stdio};

use common::http::post_json;
use common::pgbouncer::PgBouncer;
use common::process::{self, text};
use common::{offline, until_sql_polled, within, Setup, TestDb};
use serde_json::{json, Value};

async fn bouncer_for(db: &TestDb) -> PgBouncer {
    let port = db.config.get_ports()[0];
    tokio::task::spawn_blocking(move || PgBouncer::start(port, &["postgres"]))
        .await
        .unwrap()
}

/// `newsnack ARGS` with the given database URLs.
fn newsnack(url: &str, direct: Option<&str>, args: &[&str]) -> Output {
    let mut command = process::command(url, args);
    command
        .env_remove("NEWSNACK_DIRECT_DATABASE_URL")
        .env_remove("NEWSNACK_LLM_URL");
    if let Some(direct) = direct {
        command.env("NEWSNACK_DIRECT_DATABASE_URL", direct);
    }
    command.output().expect("run newsnack")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_and_endpoint_works_through_pgbouncer_in_transaction_mode() {
    let db = TestDb::new().await;
    // The reaper ticks every half second, so its lock is soon held.
    db.set("lease_s", "2").await;
    let bouncer = bouncer_for(&db).await;
    let pooled = bouncer.url("postgres", &db.name);
    let setup = Setup::through_pooler(&pooled, Some(&db.url));
    let service = db.serve_with("bounced", offline(), setup).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    let ready = http.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200, "{}", ready.text().await.unwrap());

    // Every server session PgBouncer gives the service's role plans
    // without JIT: the role's default from migrating, which the server
    // applies itself (PgBouncer refuses a startup `options`).
    let (through, connection) = tokio_postgres::connect(&pooled, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    for _ in 0..4 {
        // One round trip (the simple protocol), as the pooler needs.
        let answer = through.simple_query("SHOW jit").await.unwrap();
        let jit = answer.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_string),
            _ => None,
        });
        assert_eq!(jit.as_deref(), Some("off"));
    }

    // A tail through PgBouncer, with the direct URL for its listener.
    let start = db
        .scalar_i64("SELECT COALESCE(max(seq), 0) FROM issue_transition")
        .await;
    let mut tail = process::command(&pooled, &["tail", "--json", "--since", &start.to_string()])
        .env("NEWSNACK_DIRECT_DATABASE_URL", &db.url)
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let tail_lines = {
        let stdout = tail.stdout.take().unwrap();
        let (lines_tx, lines) = tokio::sync::mpsc::unbounded_channel::<Value>();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if lines_tx.send(serde_json::from_str(&line).unwrap()).is_err() {
                    return;
                }
            }
        });
        lines
    };

    // Issues, then five overlapping claim requests at once.
    let (status, added) = post_json(
        &http,
        &format!("{base}/issues"),
        &json!({"issues": (0..20).map(|i| json!({"title": format!("issue {i}"), "score": i})).collect::<Vec<_>>()}),
    )
    .await;
    assert_eq!(status, 201, "{added}");
    let ids: Vec<i64> = serde_json::from_value(added["ids"].clone()).unwrap();
    let requests: Vec<_> = (0..5)
        .map(|r| {
            let (http, base) = (http.clone(), base.clone());
            let batch: Vec<i64> = ids[r * 3..r * 3 + 8].to_vec();
            tokio::spawn(async move {
                post_json(
                    &http,
                    &format!("{base}/ai-articles"),
                    &json!({"issue_ids": batch}),
                )
                .await
            })
        })
        .collect();
    let mut claimed = Vec::new();
    for request in requests {
        let (status, body) = request.await.unwrap();
        assert!(status == 202 || status == 409, "{status} {body}");
        claimed.extend(serde_json::from_value::<Vec<i64>>(body["claimed"].clone()).unwrap());
    }
    let unique: BTreeSet<i64> = claimed.iter().copied().collect();
    assert_eq!(
        unique.len(),
        claimed.len(),
        "no id claimed twice: {claimed:?}"
    );
    assert_eq!(
        unique,
        ids[..20].iter().copied().collect(),
        "every id claimed once"
    );

    // A wait answers on the event, long before its deadline.
    let (status, waited) = post_json(
        &http,
        &format!("{base}/waits"),
        &json!({"issue_ids": ids, "timeout_s": 300, "min_completion": 20}),
    )
    .await;
    assert_eq!(status, 200, "{waited}");
    assert_eq!(waited["outcome"], "all_pass", "{waited}");
    let written = db.scalar_i64("SELECT count(*) FROM ai_article").await;
    assert_eq!(written, 20);

    // The tail saw every transition of theirs: 20 new, 20 claims, 20 done.
    let mut tail_lines = tail_lines;
    let mut seen = Vec::new();
    within(30, "the tail to print 60 transitions", async {
        while seen.len() < 60 {
            seen.push(tail_lines.recv().await.expect("the tail runs"));
        }
    })
    .await;
    let seqs: Vec<i64> = seen.iter().map(|t| t["seq"].as_i64().unwrap()).collect();
    assert_eq!(
        seqs,
        (start + 1..=start + 60).collect::<Vec<_>>(),
        "gapless, in order"
    );
    let _ = tail.kill();
    let _ = tail.wait();

    // No advisory lock sits on one of PgBouncer's server connections: the
    // reaper's lock is held, on a session of its own.
    until_sql_polled(
        &db,
        30,
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted)",
    )
    .await;
    let holders: Vec<i64> = db
        .ids("SELECT pid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted")
        .await;
    let pooled_pids: Vec<i64> = bouncer
        .server_pids(&db.name)
        .await
        .into_iter()
        .map(i64::from)
        .collect();
    assert!(!pooled_pids.is_empty(), "PgBouncer serves the service");
    assert!(
        holders.iter().all(|pid| !pooled_pids.contains(pid)),
        "advisory locks {holders:?} are held outside PgBouncer's server connections {pooled_pids:?}"
    );

    // `run-pipeline` through PgBouncer, twice: a briefing, then nothing left.
    let fresh: Vec<_> = (0..5)
        .map(|i| json!({"title": format!("fresh {i}"), "score": 100 + i}))
        .collect();
    let (status, _) = post_json(&http, &format!("{base}/issues"), &json!({"issues": fresh})).await;
    assert_eq!(status, 201);
    let run = newsnack(&pooled, Some(&db.url), &["run-pipeline"]);
    assert_eq!(run.status.code(), Some(0), "{}", text(&run.stderr));
    let summary: Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(summary["outcome"], "all_pass", "{summary}");
    let again = newsnack(&pooled, Some(&db.url), &["run-pipeline"]);
    assert_eq!(again.status.code(), Some(3), "{}", text(&again.stderr));

    // A schedule set through PgBouncer is heard by the running service:
    // its scheduler runs the new issue's pipeline.
    let (status, _) = post_json(
        &http,
        &format!("{base}/issues"),
        &json!({"issues": [{"title": "for the schedule", "score": 1000}]}),
    )
    .await;
    assert_eq!(status, 201);
    let set = newsnack(
        &pooled,
        Some(&db.url),
        &["settings", "set", "schedule", "every 1s"],
    );
    assert!(set.status.success(), "{}", text(&set.stderr));
    // A run's outcome is recorded after its last transition: asked for,
    // not announced.
    until_sql_polled(
        &db,
        60,
        "SELECT EXISTS (SELECT 1 FROM pipeline_run WHERE trigger = 'schedule' AND outcome = 'all_pass')",
    )
    .await;
    let off = newsnack(
        &pooled,
        Some(&db.url),
        &["settings", "set", "schedule", "off"],
    );
    assert!(off.status.success());
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_direct_url_the_service_is_not_ready_and_says_why() {
    let db = TestDb::new().await;
    let bouncer = bouncer_for(&db).await;
    let pooled = bouncer.url("postgres", &db.name);
    // Serve starts, and says what is wrong.
    let setup = Setup::through_pooler(&pooled, None);
    let service = db.serve_with("misconfigured", offline(), setup).await;
    let ready = reqwest::get(format!("http://{}/readyz", service.addr))
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    let body: Value = ready.json().await.unwrap();
    assert_eq!(body["listener"], false, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("NEWSNACK_DIRECT_DATABASE_URL")),
        "{body}"
    );
    service.stop().await.unwrap();

    let tail = newsnack(&pooled, None, &["tail", "--since", "0"]);
    assert_eq!(tail.status.code(), Some(1));
    assert!(
        text(&tail.stderr).contains("NEWSNACK_DIRECT_DATABASE_URL"),
        "{}",
        text(&tail.stderr)
    );
}
