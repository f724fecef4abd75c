//! The gauges an autoscaler and the alert rules read from `/metrics`,
//! over a real socket: issues per status and ready to claim (the kept
//! counts, every instance's work), whether the listener is connected, and
//! the tick of the newest scheduled run that published a briefing.

mod common;

use common::{offline, TestDb};
use reqwest::StatusCode;

/// The value of the one sample `series` (name and labels exactly as
/// rendered) in a scrape.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.parse().unwrap())
}

async fn scrape(base: &str) -> String {
    let response = reqwest::get(format!("{base}/metrics")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    response.text().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauges_follow_the_database() {
    let db = TestDb::new().await;
    let ids = db.add_issues(12).await;
    // Moved by plain SQL, as another system would: the gauges count
    // every writer's issues, not this instance's.
    db.move_with_sql(&ids[..2], &["IN_PROGRESS"]).await;
    db.move_with_sql(&ids[2..5], &["IN_PROGRESS", "DONE"]).await;
    db.move_with_sql(&ids[5..6], &["IN_PROGRESS", "FAILED"])
        .await;
    // The service claims nothing by itself: the schedule is `off` by
    // default, so the counts stay as set.
    let service = db.serve("gauges", offline()).await;
    let base = format!("http://{}", service.addr);

    let text = scrape(&base).await;
    for (status, n) in [
        ("PENDING", 6.0),
        ("IN_PROGRESS", 2.0),
        ("DONE", 3.0),
        ("FAILED", 1.0),
    ] {
        assert_eq!(
            sample(&text, &format!("newsnack_issues{{status=\"{status}\"}}")),
            Some(n),
            "{status}:\n{text}"
        );
    }
    assert_eq!(sample(&text, "newsnack_issues_ready"), Some(6.0), "{text}");
    assert_eq!(
        sample(&text, "newsnack_listener_connected"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "newsnack_pipeline_published_tick_timestamp_seconds"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "newsnack_prune_failures_total"),
        Some(0.0),
        "{text}"
    );
    assert!(
        text.contains("# TYPE newsnack_pipeline_tick_timestamp_seconds gauge"),
        "{text}"
    );

    // A scheduled run that published a briefing, and a newer one that did
    // not: the gauge names the first one's tick.
    let client = db.raw().await;
    client
        .batch_execute(&format!(
            "WITH b AS (INSERT INTO briefing (title, briefing_date, issue_ids, body)
                        VALUES ('t', current_date, '{{{done}}}', 'b') RETURNING id)
             INSERT INTO pipeline_run (trigger, tick, instance, outcome, briefing_id)
             SELECT 'schedule', '2026-12-04 06:00:00+00', 'elsewhere', 'all_pass', id FROM b;
             INSERT INTO pipeline_run (trigger, tick, instance, outcome)
             VALUES ('schedule', '2026-12-04 07:00:00+00', 'elsewhere', 'skip');",
            done = ids[2]
        ))
        .await
        .unwrap();
    db.move_with_sql(&ids[6..8], &["IN_PROGRESS"]).await;

    let text = scrape(&base).await;
    assert_eq!(
        sample(&text, "newsnack_pipeline_published_tick_timestamp_seconds"),
        Some(1_796_364_000.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "newsnack_issues{status=\"PENDING\"}"),
        Some(4.0)
    );
    assert_eq!(
        sample(&text, "newsnack_issues{status=\"IN_PROGRESS\"}"),
        Some(4.0)
    );
    assert_eq!(sample(&text, "newsnack_issues_ready"), Some(4.0));
    service.stop().await.unwrap();
}
