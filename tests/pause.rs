//! The operator's pause (`newsnack pause`, `newsnack resume`: the setting
//! `generation_paused`), on three instances against the tests' fake LLM,
//! which counts every call that reaches it: from the pause's commit no
//! call starts on any instance until resume; the calls in flight finish;
//! claims are still accepted and queue; the briefing's wait decides by its
//! deadline; `/metrics` and the dashboard show the pause; resume starts
//! the queue at once, the briefing's article first.

mod common;

use std::time::{Duration, Instant};

use common::fake_llm::{FakeLlm, Reply};
use common::http::{claim_all, get_json, metric, post_json};
use common::process::{newsnack, text};
use common::{titled, until_sql, until_sql_polled, TestDb};
use serde_json::json;
use tokio::sync::watch;

const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";

/// `newsnack COMMAND` on `db`; its standard output.
fn run(db: &TestDb, command: &str) -> String {
    let out = tokio::task::block_in_place(|| newsnack(&db.url, &[command]));
    assert!(out.status.success(), "{command}: {}", text(&out.stderr));
    text(&out.stdout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_call_starts_while_paused_on_any_instance_and_resume_starts_the_queue() {
    let db = TestDb::new().await;
    db.set("llm_max_in_flight", "2").await;
    // Counting starts per minute keeps every call's row, with its grant
    // time, for a minute: the order of grants can be read back.
    db.set("llm_requests_per_minute", "100000").await;
    let (open, gate) = watch::channel(false);
    let fake = FakeLlm::start(move |_, _| Reply::Gated {
        open: gate.clone(),
        content: ARTICLE.into(),
    })
    .await;
    let writer = || fake.writer(Duration::from_secs(30));
    let services = [
        db.serve("pause-a", writer()).await,
        db.serve("pause-b", writer()).await,
        db.serve("pause-c", writer()).await,
    ];
    let http = reqwest::Client::new();
    let base = |i: usize| format!("http://{}", services[i].addr);

    // A briefing of three articles on c: two reach the LLM and are held
    // there, the third waits; a feed backlog on a and b waits behind it.
    let briefing = titled(&db, "briefing", 3).await;
    claim_all(services[2].addr, &briefing, None).await;
    fake.until_requests(2).await;
    let feed = titled(&db, "feed", 6).await;
    claim_all(services[0].addr, &feed[..3], Some("feed")).await;
    claim_all(services[1].addr, &feed[3..], Some("feed")).await;
    until_sql_polled(
        &db,
        30,
        "SELECT count(*) = 7 FROM llm_call WHERE granted_at IS NULL",
    )
    .await;
    // The briefing's wait: three seconds, two articles needed.
    let wait = {
        let (http, url) = (http.clone(), format!("{}/waits", base(0)));
        let body = json!({"issue_ids": briefing, "timeout_s": 3, "min_completion": 2});
        tokio::spawn(async move { post_json(&http, &url, &body).await })
    };

    assert!(run(&db, "pause").starts_with("generation_paused = true"));
    let before = fake.requests();
    assert_eq!(
        before,
        2,
        "{:?}; dropped {:?}",
        fake.arrivals()
            .iter()
            .map(|a| (
                a.in_flight,
                a.user_prompt()
                    .lines()
                    .find(|l| l.starts_with("Title"))
                    .unwrap_or("")
                    .to_string()
            ))
            .collect::<Vec<_>>(),
        fake.dropped()
    );
    // Claims are still accepted, and queue.
    let late = titled(&db, "late", 2).await;
    claim_all(services[1].addr, &late, Some("feed")).await;
    until_sql_polled(
        &db,
        30,
        "SELECT count(*) = 9 FROM llm_call WHERE granted_at IS NULL",
    )
    .await;
    // The calls in flight finish; their slots start nothing.
    open.send(true).unwrap();
    until_sql(
        &db,
        &services[0].hub,
        30,
        &format!(
            "SELECT count(*) = 2 FROM issue WHERE processing_status = 'DONE' AND id = ANY(ARRAY{briefing:?})"
        ),
    )
    .await;
    // The wait decides by its deadline, on what is done.
    let (status, outcome) = wait.await.unwrap();
    assert_eq!(status, 200, "{outcome}");
    assert_eq!(outcome["outcome"], "timeout_pass", "{outcome}");
    assert_eq!(
        outcome["completed"].as_array().unwrap().len(),
        2,
        "{outcome}"
    );
    assert_eq!(
        outcome["unfinished"].as_array().unwrap().len(),
        1,
        "{outcome}"
    );
    assert!(outcome["waited_ms"].as_u64().unwrap() >= 2900, "{outcome}");
    // Three seconds after the pause, still no call started anywhere.
    assert_eq!(fake.requests(), before, "calls started while paused");
    assert_eq!(
        db.scalar_i64(
            "SELECT count(*) FROM llm_call WHERE granted_at IS NOT NULL AND finished_at IS NULL"
        )
        .await,
        0
    );
    for i in 0..3 {
        assert_eq!(
            metric(&http, &base(i), "newsnack_generation_paused").await,
            1.0
        );
    }
    let dashboard = get_json(&http, &format!("{}/dashboard.json", base(1))).await;
    let pause = &dashboard["llm"]["pause"];
    assert_eq!(
        (&pause["active"], &pause["by"], &pause["until"]),
        (&json!(true), &json!("operator"), &json!(null)),
        "{pause}"
    );

    let resumed_at: time::OffsetDateTime = db
        .raw()
        .await
        .query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0);
    let resumed = Instant::now();
    assert!(run(&db, "resume").starts_with("generation_paused = false"));
    fake.until_requests(before + 1).await;
    let started = fake.arrivals()[before as usize].at.duration_since(resumed);
    assert!(
        started < Duration::from_secs(1),
        "the queue started {started:?} after resume"
    );
    let all: Vec<i64> = [briefing, feed, late].concat();
    until_sql(
        &db,
        &services[0].hub,
        60,
        &format!(
            "SELECT count(*) = {} FROM issue WHERE processing_status = 'DONE' AND id = ANY(ARRAY{all:?})",
            all.len()
        ),
    )
    .await;
    assert_eq!(fake.requests(), all.len() as u64, "one call per article");
    // The first grant after resume went to the briefing's article.
    let first_grant: Vec<String> = common::first_column(
        &db.raw().await,
        "SELECT priority FROM llm_call
          WHERE granted_at = (SELECT min(granted_at) FROM llm_call WHERE granted_at > $1)",
        &[&resumed_at],
    )
    .await;
    assert!(
        first_grant.contains(&"briefing".to_string()),
        "{first_grant:?}"
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue WHERE attempts <> 1")
            .await,
        0,
        "the pause used up no attempt"
    );
    assert_eq!(
        metric(&http, &base(2), "newsnack_generation_paused").await,
        0.0
    );
    for service in services {
        service.stop().await.unwrap();
    }
}

/// `generation_paused` is validated like every setting: `true` or `false`.
#[tokio::test]
async fn a_pause_setting_other_than_true_or_false_is_refused() {
    let db = TestDb::new().await;
    let client = db.raw().await;
    let refused = client
        .execute(
            "UPDATE setting SET value = 'yes' WHERE key = 'generation_paused'",
            &[],
        )
        .await
        .unwrap_err();
    let message = refused.as_db_error().map(|e| e.message().to_string());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("must be one of false, true")),
        "{refused:?}"
    );
    assert_eq!(
        db.scalar_i64(
            "SELECT count(*) FROM setting WHERE key = 'generation_paused' AND value = 'false'"
        )
        .await,
        1
    );
}
