//! The soak: three `serve` processes on one database, a fake LLM that
//! fails at random (429, 500, timeouts; now and then a 429 with
//! `Retry-After`, which pauses every instance), issues fed
//! continuously, waits opened all along and the pipeline scheduler running,
//! for `NEWSNACK_SOAK_SECS` seconds (default 600); then the audit of `tests/faults.rs`
//! and a JSON report (throughput, wait latency, memory of each instance at
//! start and end, retries and failures, the audit) on stdout and in
//! `target/soak-report.json`.
//!
//! Ignored unless asked for, as it runs for minutes:
//!
//! ```sh
//! cargo test --release --test soak -- --ignored --nocapture
//! ```
//!
//! `NEWSNACK_SOAK_RATE` sets the issues fed per second (default 100).

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::audit::{post_wait, Audit, WaitSpec};
use common::fake_llm::{FakeLlm, Reply};
use common::process::ServeProcess;
use common::subscribers::Recording;
use common::TestDb;
use rand::seq::IndexedRandom;
use serde_json::{json, Value};

const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";
const MAX_ATTEMPTS: i32 = 8;
/// The LLM client's timeout; a "timeout" reply takes longer than this.
const LLM_TIMEOUT_S: u64 = 2;
/// Issues per `POST /issues` batch.
const BATCH: usize = 10;
/// A wait is opened this often, over the latest batches.
const WAIT_EVERY: Duration = Duration::from_secs(2);
/// Wait timeouts, taken in turn: a short one (often decided at the
/// deadline) and a long one (usually decided by the last transition).
const WAIT_TIMEOUTS_S: [u64; 2] = [1, 10];
const WAIT_MIN_COMPLETION: usize = 3;

/// What the fake LLM answered, by kind.
#[derive(Default)]
struct Replies {
    ok: AtomicU64,
    rate_limited: AtomicU64,
    paused: AtomicU64,
    server_error: AtomicU64,
    timeout: AtomicU64,
}

/// Of the answers, how many are a 429 with `Retry-After: 1`. Each pauses
/// every instance's calls for a second (the account's quota is used up),
/// so they are rare: this LLM fails at random, whatever the load, and a
/// pause for one call in twenty would leave it idle most of the time.
const PAUSING_SHARE: f64 = 0.002;

impl Replies {
    /// One answer: mostly a good article after 30–200 ms, sometimes not.
    fn pick(&self) -> Reply {
        let roll: f64 = rand::random();
        if roll < PAUSING_SHARE {
            self.paused.fetch_add(1, Ordering::Relaxed);
            Reply::RateLimited { retry_after_s: 1 }
        } else if roll < 0.06 {
            // A request throttled on its own: no `Retry-After`.
            self.rate_limited.fetch_add(1, Ordering::Relaxed);
            Reply::Custom {
                status: 429,
                retry_after: None,
                body: r#"{"error":{"message":"Rate limit reached","type":"rate_limit_exceeded"}}"#
                    .into(),
            }
        } else if roll < 0.11 {
            self.server_error.fetch_add(1, Ordering::Relaxed);
            Reply::ServerError
        } else if roll < 0.14 {
            self.timeout.fetch_add(1, Ordering::Relaxed);
            Reply::Slow {
                delay: Duration::from_secs(LLM_TIMEOUT_S) + Duration::from_millis(500),
                content: ARTICLE.into(),
            }
        } else {
            self.ok.fetch_add(1, Ordering::Relaxed);
            Reply::Slow {
                delay: Duration::from_millis(rand::random_range(30..200)),
                content: ARTICLE.into(),
            }
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "ok": self.ok.load(Ordering::Relaxed),
            "rate_limited": self.rate_limited.load(Ordering::Relaxed),
            "rate_limited_pausing": self.paused.load(Ordering::Relaxed),
            "server_error": self.server_error.load(Ordering::Relaxed),
            "timeout": self.timeout.load(Ordering::Relaxed),
        })
    }
}

fn env_number(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name} must be a whole number, got {value:?}")),
    )
}

/// `p` (0–100) percentile of `values`, which must be sorted.
fn percentile(sorted: &[Duration], p: f64) -> Option<u64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = ((p / 100.0) * last as f64).round() as usize;
    Some(sorted[rank.min(last)].as_millis() as u64)
}

/// `{label: count}` from a query returning (text, bigint) rows.
async fn counts(db: &TestDb, sql: &str) -> Value {
    let rows = db.raw().await.query(sql, &[]).await.expect(sql);
    let map: BTreeMap<String, i64> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    json!(map)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs for ten minutes: cargo test --release --test soak -- --ignored --nocapture"]
async fn soak() {
    let secs = env_number("NEWSNACK_SOAK_SECS").unwrap_or(600);
    let rate = env_number("NEWSNACK_SOAK_RATE").unwrap_or(100).max(1);
    let db = TestDb::new().await;
    for (key, value) in [
        ("lease_s", "10".to_string()),
        ("retry_backoff_ms", "200".into()),
        ("retry_backoff_max_ms", "5000".into()),
        ("max_attempts", MAX_ATTEMPTS.to_string()),
        ("content_gen_timeout_s", "10".into()),
        ("content_gen_min_completion", "3".into()),
        ("schedule", "every 15s".into()),
        // As many calls at once as three instances made before the budget
        // was shared.
        ("llm_max_in_flight", "24".into()),
    ] {
        db.set(key, &value).await;
    }
    let replies = Arc::new(Replies::default());
    let fake = {
        let replies = replies.clone();
        FakeLlm::start(move |_, _| replies.pick()).await
    };
    let timeout_s = LLM_TIMEOUT_S.to_string();
    let env = [
        ("NEWSNACK_LLM_URL", fake.url.as_str()),
        ("NEWSNACK_LLM_TIMEOUT_S", timeout_s.as_str()),
        ("NEWSNACK_SHUTDOWN_GRACE_S", "5"),
    ];
    let mut instances: Vec<ServeProcess> = ["soak-a", "soak-b", "soak-c"]
        .iter()
        .map(|name| tokio::task::block_in_place(|| ServeProcess::spawn(&db.url, name, &env)))
        .collect();
    let rss_start: Vec<Option<u64>> = instances.iter().map(ServeProcess::rss_kib).collect();
    let bases: Vec<String> = instances.iter().map(ServeProcess::base_url).collect();
    let (hub, stop_listener) = db.listener().await;
    let start_seq = hub.status().borrow().last_seq;
    let mut subscribers: Vec<Recording> = (0..bases.len())
        .map(|n| {
            // Each SSE client falls back to the other instances.
            let mut order = bases.clone();
            order.rotate_left(n);
            Recording::follow_sse(&format!("sse-{n}"), order, start_seq)
        })
        .collect();
    subscribers.push(Recording::follow_tail("tail", &db.url, start_seq));
    subscribers.push(Recording::follow_stream("stream", &hub, start_seq));

    // Feed issues at `rate` per second, claim each batch on some instance,
    // and open a wait over recent batches every few seconds.
    let http = reqwest::Client::new();
    let started = Instant::now();
    let mut feed = tokio::time::interval(Duration::from_secs_f64(BATCH as f64 / rate as f64));
    let mut next_wait = Instant::now() + WAIT_EVERY;
    let mut recent: Vec<i64> = Vec::new();
    let mut waits = Vec::new();
    let mut fed = 0usize;
    let mut refused = 0usize;
    while started.elapsed() < Duration::from_secs(secs) {
        feed.tick().await;
        let issues: Vec<Value> = (0..BATCH)
            .map(|i| {
                json!({"title": format!("soak story {fed}.{i}"), "body": "Something happened.",
                       "score": rand::random_range(0.0..100.0)})
            })
            .collect();
        let base = bases.choose(&mut rand::rng()).unwrap();
        let created = http
            .post(format!("{base}/issues"))
            .json(&json!({ "issues": issues }))
            .send()
            .await
            .expect("POST /issues");
        assert_eq!(created.status(), 201);
        let ids: Vec<i64> =
            serde_json::from_value(created.json::<Value>().await.unwrap()["ids"].clone()).unwrap();
        fed += ids.len();
        let base = bases.choose(&mut rand::rng()).unwrap();
        let claimed = http
            .post(format!("{base}/ai-articles"))
            .json(&json!({ "issue_ids": ids }))
            .send()
            .await
            .expect("POST /ai-articles");
        // 409 when the scheduler's run claimed the whole batch first.
        assert!(
            matches!(claimed.status().as_u16(), 202 | 409),
            "{claimed:?}"
        );
        if claimed.status() == 409 {
            refused += 1;
        }
        recent.extend(ids);
        if Instant::now() >= next_wait {
            next_wait += WAIT_EVERY;
            let targets = recent.split_off(recent.len().saturating_sub(3 * BATCH));
            recent.clear();
            waits.push(tokio::spawn(post_wait(
                http.clone(),
                bases.choose(&mut rand::rng()).unwrap().clone(),
                WaitSpec {
                    issue_ids: targets,
                    timeout: Duration::from_secs(WAIT_TIMEOUTS_S[waits.len() % 2]),
                    min_completion: WAIT_MIN_COMPLETION,
                    max_attempts: MAX_ATTEMPTS,
                },
            )));
        }
    }
    let feeding = started.elapsed();
    let done_while_feeding = db
        .scalar_i64("SELECT count(*) FROM issue WHERE processing_status = 'DONE'")
        .await;
    db.set("schedule", "off").await;

    let mut records = Vec::new();
    for wait in waits {
        records.push(wait.await.expect("a wait task"));
    }
    let subscribed: Vec<&Recording> = subscribers.iter().collect();
    let report = Audit {
        pool: db.pool.clone(),
        hub: hub.clone(),
        settle_secs: 180,
    }
    .run(&subscribed, &records)
    .await;
    let settled = started.elapsed();
    let rss_end: Vec<Option<u64>> = instances.iter().map(ServeProcess::rss_kib).collect();

    let mut latencies: Vec<Duration> = report.waits.iter().map(|w| w.latency).collect();
    latencies.sort();
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for verdict in &report.waits {
        *outcomes
            .entry(format!("{:?}", verdict.outcome))
            .or_default() += 1;
    }
    let summary = json!({
        "duration_s": secs,
        "feed_rate_per_s": rate,
        "issues_fed": fed,
        "claims_refused_409": refused,
        "issues_done": report.done,
        "issues_failed": report.failed,
        "throughput_done_per_s_while_feeding": done_while_feeding as f64 / feeding.as_secs_f64(),
        "throughput_done_per_s_overall": report.done as f64 / settled.as_secs_f64(),
        "settled_after_feed_s": (settled - feeding).as_secs_f64(),
        "waits": {
            "answered": report.waits.len(),
            "outcomes": outcomes,
            "latency_ms_p50": percentile(&latencies, 50.0),
            "latency_ms_p99": percentile(&latencies, 99.0),
            "latency_ms_max": latencies.last().map(|d| d.as_millis() as u64),
        },
        "instances": instances.iter().zip(rss_start.iter().zip(&rss_end)).map(|(p, (start, end))| json!({
            "name": p.name, "pid": p.pid(), "rss_kib_start": start, "rss_kib_end": end,
        })).collect::<Vec<_>>(),
        "retries": db.scalar_i64("SELECT coalesce(sum(attempts - 1), 0) FROM issue WHERE attempts > 0").await,
        "failures_by_reason": counts(&db,
            "SELECT CASE WHEN reason LIKE '%429%' THEN 'rate_limited'
                         WHEN reason LIKE '%server error%' THEN 'server_error'
                         WHEN reason LIKE '%timed out%' THEN 'timeout'
                         ELSE reason END, count(*)
               FROM issue_transition WHERE to_status = 'FAILED' GROUP BY 1 ORDER BY 1").await,
        "claims_by_instance": counts(&db,
            "SELECT coalesce(claimed_by, 'none'), count(*) FROM issue GROUP BY 1 ORDER BY 1").await,
        "pipeline_runs": counts(&db,
            "SELECT outcome, count(*) FROM pipeline_run GROUP BY 1 ORDER BY 1").await,
        "llm_replies": replies.to_json(),
        "subscriber_reconnects": subscribers.iter().map(|s| (s.name.clone(), s.reconnects())).collect::<BTreeMap<_, _>>(),
        "audit": report.to_json(),
    });
    let text = serde_json::to_string_pretty(&summary).unwrap();
    println!("{text}");
    let target = std::env::var("CARGO_TARGET_DIR")
        .unwrap_or_else(|_| format!("{}/target", env!("CARGO_MANIFEST_DIR")));
    std::fs::create_dir_all(&target).unwrap();
    std::fs::write(format!("{target}/soak-report.json"), &text).unwrap();

    report.assert_clean();
    for process in &mut instances {
        let status = tokio::task::block_in_place(|| process.terminate());
        assert!(status.success(), "{} exited with {status:?}", process.name);
    }
    stop_listener.cancel();
}
