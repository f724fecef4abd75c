//! Fault injection: the service keeps every promise while the world around
//! it misbehaves. Each case runs real PostgreSQL and real HTTP, injects one
//! kind of fault in the middle of the work, and ends with the same audit
//! (`tests/common/audit.rs`): every issue `DONE` with exactly one article
//! or `FAILED` with a reason, nothing stuck past its lease, every
//! transition seen once and in order by every subscriber, every wait
//! answered as the rules give.
//!
//! The cases: PostgreSQL restarted under open waits and SSE clients; the
//! listener's backend terminated again and again; one of three `serve`
//! processes SIGKILLed and restarted; the LLM down, then slow, then
//! rate-limiting; the pool exhausted; other systems flipping statuses with
//! raw SQL. The last four tests run the audit against deliberately broken
//! set-ups and show it reports each kind of problem.

mod common;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::audit::{post_wait, Audit, AuditReport, WaitRecord, WaitSpec};
use common::fake_llm::{FakeLlm, Reply};
use common::http::post_json;
use common::process::ServeProcess;
use common::subscribers::Recording;
use common::{until_done_count, until_published, until_sql, within, Setup, TestDb};
use newsnack::db::{self, DbPool, PoolOptions};
use newsnack::embedded::{EmbeddedOptions, EmbeddedPostgres};
use newsnack::events::hub::{EventHub, ListenerStatus};
use newsnack::events::listener::{Listener, ListenerOptions};
use newsnack::serve::RunningService;
use newsnack::writer::{self, OfflineWriter, SharedWriter, WriterConfig};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";
/// Enough attempts to ride out every fault injected here.
const MAX_ATTEMPTS: i32 = 12;

/// Short leases and quick retries, so faults are recovered from in seconds.
async fn fault_settings(pool: &DbPool) {
    let client = pool.get().await.expect("a connection for settings");
    for (key, value) in [
        ("lease_s", "2".to_string()),
        ("retry_backoff_ms", "50".into()),
        ("retry_backoff_max_ms", "500".into()),
        ("max_attempts", MAX_ATTEMPTS.to_string()),
    ] {
        db::setting::set(&client, key, &value)
            .await
            .expect("set a setting");
    }
}

fn llm_writer(url: &str, timeout: Duration) -> SharedWriter {
    writer::build(&WriterConfig {
        llm_url: Some(url.to_string()),
        model: "fake-model".into(),
        api_key: None,
        timeout,
        fallback: None,
    })
    .expect("build the LLM writer")
}

/// The whole service in-process on a free port.
async fn start_service(
    url: &str,
    instance: &str,
    pool_size: usize,
    writer: SharedWriter,
) -> RunningService {
    let setup = Setup {
        pool_size: Some(pool_size),
        grace: Some(Duration::from_secs(2)),
        ..Setup::default()
    };
    common::start_service(url, instance, writer, setup).await
}

/// A listener that reconnects within milliseconds, for the test's own view.
fn quick_reconnects() -> ListenerOptions {
    ListenerOptions {
        backoff_min: Duration::from_millis(10),
        backoff_max: Duration::from_millis(200),
        ..ListenerOptions::default()
    }
}

fn audit(pool: &DbPool, hub: &EventHub) -> Audit {
    Audit {
        pool: pool.clone(),
        hub: hub.clone(),
        settle_secs: 60,
    }
}

/// `POST /ai-articles`, which must claim something.
async fn request_articles(http: &reqwest::Client, base: &str, ids: &[i64]) -> Value {
    let (status, body) = post_json(
        http,
        &format!("{base}/ai-articles"),
        &json!({ "issue_ids": ids }),
    )
    .await;
    assert_eq!(status, 202, "claiming {ids:?}: {body}");
    body
}

/// `POST /issues` with `n` issues; their ids.
async fn add_issues_over_http(http: &reqwest::Client, base: &str, n: usize) -> Vec<i64> {
    let issues: Vec<Value> = (0..n)
        .map(|i| json!({"title": format!("story {i}"), "body": "Something happened.", "score": i}))
        .collect();
    let (status, body) = post_json(
        http,
        &format!("{base}/issues"),
        &json!({ "issues": issues }),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    serde_json::from_value(body["ids"].clone()).expect("ids")
}

/// Opens a wait over HTTP in the background.
fn open_wait(
    base: &str,
    issue_ids: &[i64],
    timeout_s: u64,
    min_completion: usize,
) -> tokio::task::JoinHandle<WaitRecord> {
    tokio::spawn(post_wait(
        reqwest::Client::new(),
        base.to_string(),
        WaitSpec {
            issue_ids: issue_ids.to_vec(),
            timeout: Duration::from_secs(timeout_s),
            min_completion,
            max_attempts: MAX_ATTEMPTS,
        },
    ))
}

async fn answered(waits: Vec<tokio::task::JoinHandle<WaitRecord>>) -> Vec<WaitRecord> {
    let mut records = Vec::new();
    for wait in waits {
        records.push(
            within(90, "a wait to answer", wait)
                .await
                .expect("wait task"),
        );
    }
    records
}

/// Waits until the listener's state satisfies `condition`.
async fn until_listener(
    hub: &EventHub,
    secs: u64,
    what: &str,
    condition: impl Fn(&ListenerStatus) -> bool,
) -> ListenerStatus {
    let mut status = hub.status();
    let reached = within(secs, what, status.wait_for(|s| condition(s)))
        .await
        .expect("the listener is running")
        .clone();
    reached
}

/// Like `until_sql`, for a database that is not a `TestDb`.
async fn until_true(pool: &DbPool, hub: &EventHub, secs: u64, sql: &str) {
    let mut live = hub.subscribe();
    within(secs, sql, async {
        loop {
            if let Ok(client) = pool.get().await {
                if let Ok(row) = client.query_one(sql, &[]).await {
                    if row.get::<_, bool>(0) {
                        return;
                    }
                }
            }
            let _ = live.recv().await;
        }
    })
    .await
}

fn report_and_assert_clean(case: &str, report: &AuditReport) {
    eprintln!("{case}: {}", report.to_json());
    report.assert_clean();
}

// ---------------------------------------------------------------------------
// PostgreSQL restarted
// ---------------------------------------------------------------------------

/// A cluster of its own: restarting the harness's shared one would disturb
/// every other test in this binary.
async fn own_cluster() -> EmbeddedPostgres {
    tokio::task::spawn_blocking(|| {
        EmbeddedPostgres::start(&EmbeddedOptions {
            durable: false,
            settings: vec![("max_connections".into(), "100".into())],
            ..EmbeddedOptions::default()
        })
    })
    .await
    .expect("the cluster start task")
    .expect("start a cluster of its own")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_mid_run_with_waits_open_and_sse_clients_connected() {
    let mut cluster = own_cluster().await;
    let url = cluster.url("postgres");
    let endpoint = db::Endpoint::parse(&url, "fault-test").unwrap();
    let fake = FakeLlm::start(|_, request| {
        if request.to_string().contains("poison") {
            Reply::BadRequest
        } else {
            Reply::Slow {
                delay: Duration::from_millis(150),
                content: ARTICLE.into(),
            }
        }
    })
    .await;
    let service = start_service(
        &url,
        "restart",
        16,
        llm_writer(&fake.url, Duration::from_secs(5)),
    )
    .await;
    let pool = db::pool(&endpoint, &PoolOptions::default()).unwrap();
    fault_settings(&pool).await;
    db::setting::set(&pool.get().await.unwrap(), "generation_concurrency", "4")
        .await
        .unwrap();
    let stop_listener = CancellationToken::new();
    let (hub, _) = Listener::start(
        endpoint,
        pool.clone(),
        quick_reconnects(),
        stop_listener.clone(),
    )
    .await
    .unwrap();
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    let start = hub.status().borrow().last_seq;
    let sse_a = Recording::follow_sse("sse-a", vec![base.clone()], start);
    let sse_b = Recording::follow_sse("sse-b", vec![base.clone()], start);
    let stream = Recording::follow_stream("stream", &hub, start);

    let ids = add_issues_over_http(&http, &base, 80).await;
    let poison = {
        let (status, body) = post_json(
            &http,
            &format!("{base}/issues"),
            &json!({"issues": [{"title": "poison pill"}]}),
        )
        .await;
        assert_eq!(status, 201);
        body["ids"][0].as_i64().unwrap()
    };
    let (claimed_now, held_back) = ids.split_at(75);
    let mut second_half = claimed_now[20..40].to_vec();
    second_half.push(poison);
    let waits = vec![
        open_wait(&base, &claimed_now[..20], 60, 20),
        // Settles early: one target fails fatally, the rest end DONE.
        open_wait(&base, &second_half, 60, 3),
        // Its targets are claimed only after it answers: skip at the deadline.
        open_wait(&base, held_back, 4, 1),
        open_wait(&base, claimed_now, 60, 70),
    ];
    let mut claim = claimed_now.to_vec();
    claim.push(poison);
    request_articles(&http, &base, &claim).await;
    until_true(
        &pool,
        &hub,
        60,
        "SELECT count(*) >= 15 FROM issue WHERE processing_status = 'DONE'",
    )
    .await;

    let in_flight = pool
        .get()
        .await
        .unwrap()
        .query_one(
            "SELECT count(*) FROM issue WHERE processing_status = 'IN_PROGRESS'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert!(in_flight > 0, "the restart must hit a run in progress");
    let before = hub.status().borrow().reconnects;
    // Requests keep coming through the restart: each is answered 201/200,
    // or 503 with Retry-After while the database is away, never 500.
    let probing = tokio_util::sync::CancellationToken::new();
    let prober = {
        let (http, base, stop) = (http.clone(), base.clone(), probing.clone());
        tokio::spawn(async move {
            // (write answered, readyz answered, the write's Retry-After)
            let mut answers: Vec<(u16, u16, bool)> = Vec::new();
            while !stop.is_cancelled() {
                let write = http
                    .post(format!("{base}/issues"))
                    .json(&json!({"issues": [{"title": "during the restart", "score": -1}]}))
                    .send()
                    .await
                    .unwrap();
                let retry_after = write.headers().contains_key("retry-after");
                let ready = http.get(format!("{base}/readyz")).send().await.unwrap();
                answers.push((
                    write.status().as_u16(),
                    ready.status().as_u16(),
                    retry_after,
                ));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            answers
        })
    };
    cluster = tokio::task::spawn_blocking(move || {
        cluster.restart().expect("pg_ctl restart -m fast");
        cluster
    })
    .await
    .unwrap();
    until_listener(&hub, 30, "the test's listener to come back", |s| {
        s.connected && s.reconnects > before
    })
    .await;
    until_listener(
        &service.hub,
        30,
        "the service's listener to come back",
        |s| s.connected && s.reconnects > 0,
    )
    .await;

    probing.cancel();
    let answers = prober.await.unwrap();
    let unavailable = answers.iter().filter(|(write, ..)| *write == 503).count();
    assert!(
        answers.iter().all(|&(write, ready, retry_after)| {
            (write == 201 || (write == 503 && retry_after)) && matches!(ready, 200 | 503)
        }),
        "writes answered 201, or 503 with Retry-After; readiness 200 or 503: {answers:?}"
    );
    assert!(
        answers.iter().any(|&(_, ready, _)| ready == 503),
        "readiness said the database was away: {answers:?}"
    );
    assert!(unavailable > 0, "the restart was seen: {answers:?}");
    eprintln!(
        "during the restart: {} requests, {unavailable} answered 503",
        answers.len()
    );
    // The issues added meanwhile are left alone (negative score, never
    // claimed): the audit below counts the eighty of the run only.
    pool.get()
        .await
        .unwrap()
        .execute("DELETE FROM issue WHERE title = 'during the restart'", &[])
        .await
        .unwrap();

    let mut records = answered(waits).await;
    request_articles(&http, &base, held_back).await;
    records.push(
        post_wait(
            http.clone(),
            base.clone(),
            WaitSpec {
                issue_ids: ids.clone(),
                timeout: Duration::from_secs(60),
                min_completion: ids.len(),
                max_attempts: MAX_ATTEMPTS,
            },
        )
        .await,
    );
    let report = audit(&pool, &hub)
        .run(&[&sse_a, &sse_b, &stream], &records)
        .await;
    report_and_assert_clean("postgres restart", &report);
    assert_eq!(report.done, 80, "every issue but the poison pill is DONE");
    assert!(
        report.waits.iter().any(|w| w.strict),
        "at least one wait had a single possible outcome"
    );

    service.stop().await.unwrap();
    stop_listener.cancel();
    drop((sse_a, sse_b, stream));
    pool.close();
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

// ---------------------------------------------------------------------------
// The listener's backend terminated, again and again
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_backend_terminated_again_and_again() {
    const KILLS: u64 = 6;
    let db = TestDb::new().await;
    fault_settings(&db.pool).await;
    // Every fourth answer is a server error, so retries (which react to
    // transitions) are needed while the listener keeps losing its session.
    let fake = FakeLlm::start(|n, _| {
        if n % 4 == 3 {
            Reply::ServerError
        } else {
            Reply::Slow {
                delay: Duration::from_millis(20),
                content: ARTICLE.into(),
            }
        }
    })
    .await;
    let service = start_service(
        &db.url,
        "listener-kills",
        16,
        llm_writer(&fake.url, Duration::from_secs(5)),
    )
    .await;
    let (hub, stop_listener) = db.listener_with(quick_reconnects()).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    let start = hub.status().borrow().last_seq;
    let sse = Recording::follow_sse("sse", vec![base.clone()], start);
    let stream = Recording::follow_stream("stream", &hub, start);
    let tail = Recording::follow_tail("tail", &db.url, start);

    let ids = db.add_issues(120).await;
    let waits = vec![
        open_wait(&base, &ids[..30], 60, 30),
        open_wait(&base, &ids[30..60], 60, 1),
        open_wait(&base, &ids, 60, 100),
    ];
    let killer = db.raw().await;
    let hubs = [&service.hub, &hub];
    for (round, chunk) in ids.chunks(ids.len() / KILLS as usize).enumerate() {
        request_articles(&http, &base, chunk).await;
        // Alternate between the service's listener and the test's own.
        let victim = hubs[round % 2];
        let status = until_listener(victim, 20, "the listener to connect", |s| s.connected).await;
        let pid = status.backend_pid.expect("a connected listener has a pid");
        let killed: bool = killer
            .query_one("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .unwrap()
            .get(0);
        assert!(killed, "terminated the listening backend {pid}");
        until_listener(victim, 20, "the listener to reconnect", |s| {
            s.connected && s.backend_pid != Some(pid)
        })
        .await;
    }

    let records = answered(waits).await;
    let report = audit(&db.pool, &hub)
        .run(&[&sse, &stream, &tail], &records)
        .await;
    report_and_assert_clean("listener kills", &report);
    assert_eq!(report.done, 120);
    let reconnects = service.hub.status().borrow().reconnects + hub.status().borrow().reconnects;
    assert!(reconnects >= KILLS, "{reconnects} reconnects");
    assert!(
        db.scalar_i64("SELECT count(*) FROM issue WHERE attempts > 1")
            .await
            > 0,
        "some issues were retried while the listener was being killed"
    );
    service.stop().await.unwrap();
    stop_listener.cancel();
}

// ---------------------------------------------------------------------------
// One of three `serve` processes SIGKILLed, then restarted
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_three_serve_processes_sigkilled_then_restarted() {
    let db = TestDb::new().await;
    fault_settings(&db.pool).await;
    db.set("generation_concurrency", "4").await;
    let fake = FakeLlm::start(|_, _| Reply::Slow {
        delay: Duration::from_millis(150),
        content: ARTICLE.into(),
    })
    .await;
    let env = [
        ("NEWSNACK_LLM_URL", fake.url.as_str()),
        ("NEWSNACK_LLM_TIMEOUT_S", "5"),
        ("NEWSNACK_SHUTDOWN_GRACE_S", "2"),
    ];
    let spawn =
        |name: &str| tokio::task::block_in_place(|| ServeProcess::spawn(&db.url, name, &env));
    let mut alpha = spawn("alpha");
    let mut beta = spawn("beta");
    let mut victim = spawn("victim");
    let (hub, stop_listener) = db.listener().await;
    let start = hub.status().borrow().last_seq;
    // The victim's SSE client moves on to alpha when the victim dies.
    let sse_victim = Recording::follow_sse(
        "sse-on-victim",
        vec![victim.base_url(), alpha.base_url()],
        start,
    );
    let sse_beta = Recording::follow_sse("sse-on-beta", vec![beta.base_url()], start);
    let stream = Recording::follow_stream("stream", &hub, start);
    let tail = Recording::follow_tail("tail", &db.url, start);

    let ids = db.add_issues(120).await;
    let http = reqwest::Client::new();
    let waits = vec![
        open_wait(&alpha.base_url(), &ids, 60, 120),
        open_wait(&beta.base_url(), &ids[..60], 60, 1),
    ];
    request_articles(&http, &victim.base_url(), &ids[..60]).await;
    request_articles(&http, &alpha.base_url(), &ids[60..90]).await;
    request_articles(&http, &beta.base_url(), &ids[90..]).await;
    let stranded = db.kill_mid_generation(&hub, &mut victim, 4).await;

    let mut victim = spawn("victim");
    let late = db.add_issues(20).await;
    request_articles(&http, &victim.base_url(), &late).await;
    let mut records = answered(waits).await;
    records.push(
        post_wait(
            http.clone(),
            victim.base_url(),
            WaitSpec {
                issue_ids: late.clone(),
                timeout: Duration::from_secs(60),
                min_completion: late.len(),
                max_attempts: MAX_ATTEMPTS,
            },
        )
        .await,
    );

    let report = audit(&db.pool, &hub)
        .run(&[&sse_victim, &sse_beta, &stream, &tail], &records)
        .await;
    report_and_assert_clean("sigkill", &report);
    assert_eq!(report.done, 140);
    db.assert_stranded_came_back(&stranded, "victim").await;
    assert!(
        sse_victim.reconnects() > 0,
        "the victim's SSE client resumed elsewhere"
    );
    for process in [&mut alpha, &mut beta, &mut victim] {
        let status = tokio::task::block_in_place(|| process.terminate());
        assert!(status.success(), "{} exited with {status:?}", process.name);
    }
    stop_listener.cancel();
}

// ---------------------------------------------------------------------------
// The LLM down, then slow, then rate-limiting
// ---------------------------------------------------------------------------

/// What the fake LLM does, switched by the test as the run goes on.
const LLM_SLOW: u8 = 0;
const LLM_RATE_LIMITING: u8 = 1;
const LLM_HEALTHY: u8 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_llm_down_then_slow_then_rate_limiting() {
    let db = TestDb::new().await;
    fault_settings(&db.pool).await;
    // Attempts are spent at the pace of time while the LLM is down: a
    // margin for a machine that stalls the test for a while.
    const ATTEMPTS: i32 = 50;
    db.set("max_attempts", &ATTEMPTS.to_string()).await;
    let phase = Arc::new(AtomicU8::new(LLM_SLOW));
    let fake = {
        let phase = phase.clone();
        FakeLlm::start(move |_, _| match phase.load(Ordering::SeqCst) {
            LLM_SLOW => Reply::Slow {
                delay: Duration::from_millis(1500),
                content: ARTICLE.into(),
            },
            LLM_RATE_LIMITING => Reply::RateLimited { retry_after_s: 1 },
            _ => Reply::Ok(ARTICLE.into()),
        })
        .await
    };
    // Down first: nothing listens on its address.
    fake.stopped().await;
    let service = start_service(
        &db.url,
        "llm-faults",
        16,
        llm_writer(&fake.url, Duration::from_secs(1)),
    )
    .await;
    let (hub, stop_listener) = db.listener().await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    let start = hub.status().borrow().last_seq;
    let sse = Recording::follow_sse("sse", vec![base.clone()], start);

    let ids = db.add_issues(20).await;
    let spec = |timeout_s: u64, min_completion: usize| WaitSpec {
        issue_ids: ids.clone(),
        timeout: Duration::from_secs(timeout_s),
        min_completion,
        max_attempts: ATTEMPTS,
    };
    // Answered while the LLM is still down, when nothing can have finished.
    let short = tokio::spawn(post_wait(http.clone(), base.clone(), spec(1, 1)));
    let long = tokio::spawn(post_wait(http.clone(), base.clone(), spec(60, 20)));
    request_articles(&http, &base, &ids).await;
    let failed_with = |pattern: &str, count: i64| {
        format!(
            "SELECT count(*) >= {count} FROM issue_transition
              WHERE to_status = 'FAILED' AND reason LIKE '{pattern}'"
        )
    };
    until_sql(&db, &hub, 30, &failed_with("%could not connect%", 20)).await;
    let short = within(30, "the short wait", short).await.unwrap();
    fake.restarted().await;
    until_sql(&db, &hub, 30, &failed_with("%timed out%", 10)).await;
    phase.store(LLM_RATE_LIMITING, Ordering::SeqCst);
    until_sql(&db, &hub, 30, &failed_with("%429%", 10)).await;
    phase.store(LLM_HEALTHY, Ordering::SeqCst);

    let records = vec![short, within(60, "the long wait", long).await.unwrap()];
    let report = audit(&db.pool, &hub).run(&[&sse], &records).await;
    report_and_assert_clean("llm faults", &report);
    assert_eq!(report.done, 20);
    // Retry-After was honoured: no retry came sooner than it asked.
    let too_soon = db
        .scalar_i64(
            "SELECT count(*) FROM (
                 SELECT reason, at, lead(at) OVER (PARTITION BY issue_id ORDER BY seq) AS next_at
                   FROM issue_transition) t
              WHERE reason LIKE '%429%' AND next_at < at + interval '950 milliseconds'",
        )
        .await;
    assert_eq!(too_soon, 0, "a 429 was retried before its Retry-After");
    service.stop().await.unwrap();
    stop_listener.cancel();
}

// ---------------------------------------------------------------------------
// The pool exhausted
// ---------------------------------------------------------------------------

/// How one request under pressure ended.
struct Answer {
    status: u16,
    body: Value,
    retry_after: Option<String>,
}

async fn answer_to_get(http: reqwest::Client, url: String) -> Answer {
    let response = within(30, "an answer under pool pressure", http.get(&url).send())
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = response.json().await.unwrap_or(Value::Null);
    Answer {
        status,
        body,
        retry_after,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_queues_or_answers_503_and_never_hangs() {
    const POOL: usize = 4;
    let db = TestDb::new().await;
    fault_settings(&db.pool).await;
    let service = start_service(&db.url, "small-pool", POOL, Arc::new(OfflineWriter)).await;
    let (hub, stop_listener) = db.listener().await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    let start = hub.status().borrow().last_seq;
    let sse = Recording::follow_sse("sse", vec![base.clone()], start);
    let ids = db.add_issues(40).await;

    // Fifty times more requests than connections, all at once: they queue.
    let mut burst = tokio::task::JoinSet::new();
    for n in 0..200 {
        let (http, base, id) = (http.clone(), base.clone(), ids[n % ids.len()]);
        burst.spawn(async move {
            let request = match n % 4 {
                0 => http.get(format!("{base}/issues/{id}")),
                1 => http
                    .post(format!("{base}/issues"))
                    .json(&json!({"issues": [{"title": format!("burst {n}")}]})),
                2 => http
                    .post(format!("{base}/ai-articles"))
                    .json(&json!({"issue_ids": [id]})),
                _ => http
                    .post(format!("{base}/waits"))
                    .json(&json!({"issue_ids": [id], "timeout_s": 1, "min_completion": 0})),
            };
            let response = within(30, "an answer in the burst", request.send())
                .await
                .expect("an HTTP answer");
            response.status().as_u16()
        });
    }
    let mut statuses = Vec::new();
    while let Some(status) = burst.join_next().await {
        statuses.push(status.unwrap());
    }
    // Every request was answered (none hung, none failed on the server);
    // how many queued and were served rather than turned away is the
    // machine's to say: `cargo bench --bench http_claims` reports it
    // (`pool_pressure`).
    assert_eq!(statuses.len(), 200);
    assert!(
        statuses
            .iter()
            .all(|s| matches!(s, 200 | 201 | 202 | 409 | 503)),
        "{statuses:?}"
    );
    assert!(
        statuses.iter().any(|&s| s != 503),
        "the burst was served, not only turned away: {statuses:?}"
    );
    until_sql(
        &db,
        &hub,
        30,
        "SELECT count(*) = 0 FROM issue WHERE processing_status = 'IN_PROGRESS'",
    )
    .await;

    // Another system locks the issue table: the requests that got a
    // connection block on the lock, the rest must give up with 503.
    let mut locker = db.raw().await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE issue IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let (answers_tx, mut answers_rx) = tokio::sync::mpsc::unbounded_channel();
    for &id in ids.iter().take(24) {
        let (http, url, answers) = (
            http.clone(),
            format!("{base}/issues/{id}"),
            answers_tx.clone(),
        );
        tokio::spawn(async move {
            let _ = answers.send(answer_to_get(http, url).await);
        });
    }
    drop(answers_tx);
    let mut pressured = Vec::new();
    within(30, "every request beyond the pool to fail fast", async {
        while pressured
            .iter()
            .filter(|a: &&Answer| a.status == 503)
            .count()
            < 24 - POOL
        {
            pressured.push(answers_rx.recv().await.expect("more answers"));
        }
    })
    .await;
    // While the table was locked, nothing but 503s came back: the
    // requests that got a session are still blocked on the lock.
    assert!(
        pressured.iter().all(|a| a.status == 503),
        "answered while the table was locked: {:?}",
        pressured.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    lock.commit().await.unwrap();
    let mut unblocked = Vec::new();
    while let Some(answer) = within(30, "the blocked requests", answers_rx.recv()).await {
        unblocked.push(answer);
    }
    assert_eq!(pressured.len() + unblocked.len(), 24);
    // Those that held a session are served once the lock goes (a last
    // 503 may still have been on its way).
    assert!(
        unblocked.iter().all(|a| matches!(a.status, 200 | 503))
            && unblocked.iter().any(|a| a.status == 200),
        "the blocked requests are served once the lock goes: {:?}",
        unblocked
            .iter()
            .map(|a| (a.status, &a.body))
            .collect::<Vec<_>>()
    );
    pressured.extend(unblocked.into_iter().filter(|a| a.status == 503));
    // How fast a 503 comes (the pool's wait) is the machine's to say:
    // `cargo bench --bench http_claims` reports it (`pool_pressure`).
    for answer in &pressured {
        assert!(answer.body["error"].is_string(), "{}", answer.body);
        assert_eq!(answer.retry_after.as_deref(), Some("1"));
    }

    // The service is whole again: everything is claimed and finished.
    let unclaimed = db
        .ids("SELECT id FROM issue WHERE processing_status = 'PENDING' ORDER BY id")
        .await;
    request_articles(&http, &base, &unclaimed).await;
    let all = db.ids("SELECT id FROM issue ORDER BY id").await;
    let record = post_wait(
        http.clone(),
        base.clone(),
        WaitSpec {
            issue_ids: all.clone(),
            timeout: Duration::from_secs(60),
            min_completion: all.len(),
            max_attempts: MAX_ATTEMPTS,
        },
    )
    .await;
    let report = audit(&db.pool, &hub).run(&[&sse], &[record]).await;
    report_and_assert_clean("pool exhausted", &report);
    assert_eq!(report.done, all.len() as i64);
    service.stop().await.unwrap();
    stop_listener.cancel();
}

// ---------------------------------------------------------------------------
// Other systems flipping statuses with raw SQL
// ---------------------------------------------------------------------------

/// One round of another system's work on the same tables, legal
/// transitions only; returns the ids it left `PENDING` for the service.
async fn other_system_round(sql: &mut tokio_postgres::Client, round: usize) -> Vec<i64> {
    let mut pending = Vec::new();
    // New issues.
    for n in 0..2 {
        let id: i64 = sql
            .query_one(
                "INSERT INTO issue (title, body, score) VALUES ($1, 'Raw SQL.', $2) RETURNING id",
                &[
                    &format!("inserted by another system {round}.{n}"),
                    &(n as f64),
                ],
            )
            .await
            .unwrap()
            .get(0);
        pending.push(id);
    }
    // Gives up on some issue the service is working on.
    sql.execute(
        "UPDATE issue SET processing_status = 'FAILED', last_error = 'failed by another system'
          WHERE id = (SELECT id FROM issue WHERE processing_status = 'IN_PROGRESS'
                       ORDER BY random() LIMIT 1 FOR UPDATE SKIP LOCKED)",
        &[],
    )
    .await
    .unwrap();
    // An operator resets some failed issue.
    if let Some(row) = sql
        .query_opt(
            "UPDATE issue SET processing_status = 'PENDING'
              WHERE id = (SELECT id FROM issue WHERE processing_status = 'FAILED'
                           ORDER BY random() LIMIT 1 FOR UPDATE SKIP LOCKED)
          RETURNING id",
            &[],
        )
        .await
        .unwrap()
    {
        pending.push(row.get(0));
    }
    // Claims an issue of its own and dies: the lease reaper must step in.
    let abandoned: i64 = sql
        .query_one(
            "INSERT INTO issue (title) VALUES ('claimed and abandoned') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    sql.execute(
        "UPDATE issue SET processing_status = 'IN_PROGRESS', claimed_by = 'other-system' WHERE id = $1",
        &[&abandoned],
    )
    .await
    .unwrap();
    // Claims one and finishes it properly, article and all.
    let id: i64 = sql
        .query_one(
            "INSERT INTO issue (title) VALUES ('written by another system') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    sql.execute(
        "UPDATE issue SET processing_status = 'IN_PROGRESS', claimed_by = 'other-system' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    let tx = sql.transaction().await.unwrap();
    tx.execute(
        "UPDATE issue SET processing_status = 'DONE' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    tx.execute(
        "INSERT INTO ai_article (issue_id, headline, body, writer, claim_id)
         SELECT id, 'Their headline', 'Their body.', 'other-system', claim_id FROM issue WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    pending
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_systems_flip_statuses_with_raw_sql_concurrently() {
    const ROUNDS: usize = 30;
    let db = TestDb::new().await;
    fault_settings(&db.pool).await;
    let fake = FakeLlm::start(|_, _| Reply::Slow {
        delay: Duration::from_millis(30),
        content: ARTICLE.into(),
    })
    .await;
    let service = start_service(
        &db.url,
        "shared-tables",
        16,
        llm_writer(&fake.url, Duration::from_secs(5)),
    )
    .await;
    let (hub, stop_listener) = db.listener().await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    let start = hub.status().borrow().last_seq;
    let sse = Recording::follow_sse("sse", vec![base.clone()], start);
    let stream = Recording::follow_stream("stream", &hub, start);

    let ids = db.add_issues(40).await;
    let waits = vec![
        open_wait(&base, &ids, 60, 40),
        open_wait(&base, &ids[..10], 1, 10),
    ];
    request_articles(&http, &base, &ids).await;
    let mut sql = db.raw().await;
    for round in 0..ROUNDS {
        let pending = other_system_round(&mut sql, round).await;
        let claimed = request_articles(&http, &base, &pending).await;
        assert_eq!(
            claimed["skipped"],
            json!([]),
            "every new or reset issue was claimed"
        );
    }

    let records = answered(waits).await;
    let report = audit(&db.pool, &hub).run(&[&sse, &stream], &records).await;
    report_and_assert_clean("raw SQL", &report);
    for (what, sql) in [
        (
            "failures by the other system",
            "SELECT count(*) FROM issue_transition WHERE reason = 'failed by another system'",
        ),
        (
            "resets",
            "SELECT count(*) FROM issue_transition WHERE from_status = 'FAILED' AND to_status = 'PENDING'",
        ),
        (
            "abandoned claims reaped",
            "SELECT count(*) FROM issue_transition WHERE reason = 'lease expired'",
        ),
        (
            "articles by the other system",
            "SELECT count(*) FROM ai_article WHERE writer = 'other-system'",
        ),
    ] {
        assert!(db.scalar_i64(sql).await > 0, "no {what}");
    }
    service.stop().await.unwrap();
    stop_listener.cancel();
}

// ---------------------------------------------------------------------------
// The audit against deliberately broken set-ups
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_finds_claims_stuck_past_their_lease_when_no_reaper_runs() {
    let db = TestDb::new().await;
    fault_settings(&db.pool).await;
    db.set("lease_s", "1").await;
    // Everything of the service but its lease reaper.
    let shutdown = CancellationToken::new();
    let core = db.core("no-reaper", &shutdown).await;
    let ids = db.add_issues(6).await;
    let claimed = core
        .claimer
        .claim(
            ids[..4].to_vec(),
            Duration::from_secs(1),
            newsnack::db::issue::ClaimScope::Claimable,
        )
        .await
        .unwrap();
    core.generator.submit(claimed.claimed).await;
    // Another system claims the other two and dies.
    db.raw()
        .await
        .execute(
            "UPDATE issue SET processing_status = 'IN_PROGRESS', claimed_by = 'crashed'
              WHERE id = ANY($1)",
            &[&ids[4..].to_vec()],
        )
        .await
        .unwrap();
    let broken = Audit {
        pool: db.pool.clone(),
        hub: core.hub.clone(),
        settle_secs: 3,
    }
    .run(&[], &[])
    .await;
    assert!(
        broken.found("2 issue(s) IN_PROGRESS past their lease"),
        "{:?}",
        broken.problems
    );
    assert!(broken.found("did not settle"), "{:?}", broken.problems);

    // The same system with its reaper: the audit passes.
    let reaper = tokio::spawn(
        newsnack::generation::reaper::LeaseReaper {
            endpoint: core.db.direct.clone(),
            settings: core.settings.clone(),
            instance: "reaper".into(),
        }
        .run(shutdown.clone()),
    );
    let healed = audit(&db.pool, &core.hub).run(&[], &[]).await;
    report_and_assert_clean("reaper back", &healed);
    assert_eq!(healed.done, 6);
    shutdown.cancel();
    reaper.await.unwrap();
    core.stopped().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_finds_a_subscriber_that_loses_or_repeats_events() {
    let db = TestDb::new().await;
    let service = start_service(&db.url, "subscribers", 8, Arc::new(OfflineWriter)).await;
    // A hub that buffers only four transitions per subscriber.
    let (hub, stop_listener) = db
        .listener_with(ListenerOptions {
            capacity: 4,
            ..ListenerOptions::default()
        })
        .await;
    let start = hub.status().borrow().last_seq;
    let gapless = Recording::follow_stream("crate-stream", &hub, start);
    let mut naive = hub.subscribe();

    let ids = db.add_issues(30).await;
    request_articles(
        &reqwest::Client::new(),
        &format!("http://{}", service.addr),
        &ids,
    )
    .await;
    until_done_count(&db, &hub, 30, 30).await;
    let newest = db.scalar_i64("SELECT max(seq) FROM issue_transition").await;
    until_published(&hub, newest).await;

    // Broken: reads the live feed and shrugs off the lag notice.
    let (lossy, record_lossy) = Recording::fed_by_hand("ignores-lag", start);
    loop {
        match naive.try_recv() {
            Ok(t) => record_lossy.saw(t.seq),
            Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => continue,
            Err(_) => break,
        }
    }
    // Broken: resumes one transition too early after a reconnect.
    let (repeating, record_repeating) = Recording::fed_by_hand("resumes-too-early", start);
    let mut first = hub.stream_after(start, None);
    let mut last = start;
    for _ in 0..10 {
        last = first.next().await.unwrap().seq;
        record_repeating.saw(last);
    }
    let mut resumed = hub.stream_after(last - 1, None);
    while last < newest {
        last = resumed.next().await.unwrap().seq;
        record_repeating.saw(last);
    }

    let report = audit(&db.pool, &hub)
        .run(&[&gapless, &lossy, &repeating], &[])
        .await;
    assert_eq!(report.problems.len(), 2, "{:?}", report.problems);
    assert!(
        report.found("subscriber ignores-lag: missed"),
        "{:?}",
        report.problems
    );
    assert!(
        report.found("subscriber resumes-too-early: saw 1 transition(s) more than once"),
        "{:?}",
        report.problems
    );
    service.stop().await.unwrap();
    stop_listener.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_finds_a_wait_answered_from_a_single_read() {
    let db = TestDb::new().await;
    let service = start_service(&db.url, "waits", 8, Arc::new(OfflineWriter)).await;
    let (hub, stop_listener) = db.listener().await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    let ids = db.add_issues(5).await;
    let spec = WaitSpec {
        issue_ids: ids.clone(),
        timeout: Duration::from_secs(30),
        min_completion: 3,
        max_attempts: 3,
    };
    let real = tokio::spawn(post_wait(http.clone(), base.clone(), spec.clone()));

    // Broken: decides from one read of the targets instead of waiting for
    // the transitions that decide it.
    let sent_at = time::OffsetDateTime::now_utc();
    let done_at_first_read = db
        .scalar_i64(&format!(
            "SELECT count(*) FROM issue WHERE id IN ({}) AND processing_status = 'DONE'",
            ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
        ))
        .await;
    let single_read = WaitRecord {
        spec,
        sent_at,
        answered_at: time::OffsetDateTime::now_utc(),
        answer: Ok(json!({
            "outcome": if done_at_first_read >= 3 { "timeout_pass" } else { "skip" },
            "completed": [],
            "failed": [],
            "unfinished": ids,
        })),
    };
    request_articles(&http, &base, &ids).await;
    let real = within(60, "the real wait", real).await.unwrap();

    let report = audit(&db.pool, &hub).run(&[], &[real, single_read]).await;
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(
        report.found("wait 1 (5 targets, timeout 30s, min 3): answered Skip, but the rules over the log give [AllPass]"),
        "{:?}",
        report.problems
    );
    assert_eq!(report.waits.len(), 1, "the real wait passed");
    service.stop().await.unwrap();
    stop_listener.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_finds_what_a_careless_system_leaves_behind() {
    let db = TestDb::new().await;
    db.set("max_attempts", "1").await;
    let (hub, stop_listener) = db.listener().await;
    let ids = db.add_issues(4).await;
    let sql = db.raw().await;
    for (statement, id) in [
        // Claims with a lease that is already over, and never comes back.
        (
            "UPDATE issue SET processing_status = 'IN_PROGRESS', lease_until = now() - interval '1 minute' WHERE id = $1",
            ids[0],
        ),
        // Marks one DONE without writing its article.
        (
            "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = $1",
            ids[1],
        ),
        (
            "UPDATE issue SET processing_status = 'DONE' WHERE id = $1",
            ids[1],
        ),
        // Fails one without saying why (and leaves `ids[3]` PENDING).
        (
            "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = $1",
            ids[2],
        ),
        (
            "UPDATE issue SET processing_status = 'FAILED' WHERE id = $1",
            ids[2],
        ),
    ] {
        assert_eq!(sql.execute(statement, &[&id]).await.unwrap(), 1, "{statement}");
    }
    let report = Audit {
        pool: db.pool.clone(),
        hub: hub.clone(),
        settle_secs: 1,
    }
    .run(&[], &[])
    .await;
    for expected in [
        "did not settle",
        "2 issue(s) neither DONE nor FAILED",
        "1 issue(s) IN_PROGRESS past their lease",
        "1 DONE issue(s) without an article",
        "1 FAILED issue(s) without a reason",
    ] {
        assert!(report.found(expected), "{expected}: {:?}", report.problems);
    }
    assert_eq!(report.problems.len(), 5, "{:?}", report.problems);
    stop_listener.cancel();
}
