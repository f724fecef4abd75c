//! The LLM budget all instances share: the dispatcher in the database on
//! its own (grants in class and claim order, the cluster-wide and
//! per-instance limits, starts per minute, a dead holder's share, a pause),
//! then several `serve` instances on one database against the tests' fake
//! OpenAI-compatible server, which counts the calls in flight and records
//! every arrival: briefing articles pass a feed backlog; the in-flight
//! limit holds across instances and follows a live change (and without
//! the shared budget the same instances exceed it); a killed instance's
//! share comes back; no call reaches the LLM during a rate limit's pause,
//! from any instance, and the paused attempt is not counted; tokens are
//! stored as the API reported them; a prompt change reaches the next call;
//! bad settings and an unknown priority are refused with the reason.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::fake_llm::{FakeLlm, Reply};
use common::http::{claim_all, get_json};
use common::process::ServeProcess;
use common::{first_column, titled, until_sql, until_sql_polled, within, TestDb};
use futures::future::BoxFuture;
use newsnack::db::llm_budget::{exchange, CallToQueue, Exchange, ExchangeAnswer};
use newsnack::model::llm::Priority;
use newsnack::writer::{self, Article, IssueText, SharedWriter, WriteError, Writer};
use serde_json::{json, Value};
use tokio::sync::watch;

const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";

fn llm_writer(fake: &FakeLlm) -> SharedWriter {
    fake.writer(Duration::from_secs(30))
}

/// `POST /ai-articles` with an optional `priority`; the status and body.
async fn post_articles(
    addr: std::net::SocketAddr,
    ids: &[i64],
    priority: Option<&str>,
) -> (u16, Value) {
    let mut body = json!({ "issue_ids": ids });
    if let Some(priority) = priority {
        body["priority"] = json!(priority);
    }
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/ai-articles"))
        .json(&body)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

/// A setting's stored value.
async fn setting(db: &TestDb, key: &str) -> String {
    let client = db.pool.get().await.unwrap();
    client
        .query_one("SELECT value FROM setting WHERE key = $1", &[&key])
        .await
        .unwrap()
        .get(0)
}

async fn until_done(db: &TestDb, hub: &newsnack::events::hub::EventHub, ids: &[i64]) {
    until_sql(
        db,
        hub,
        120,
        &format!(
            "SELECT count(*) = {} FROM issue WHERE processing_status = 'DONE' AND id = ANY(ARRAY{ids:?}::bigint[])",
            ids.len()
        ),
    )
    .await;
}

// ---------------------------------------------------------------------------
// The dispatcher, one exchange at a time
// ---------------------------------------------------------------------------

/// A holder's exchange that queues `queue` and gives back `finished`.
async fn exchange_as(
    db: &TestDb,
    holder: &str,
    queue: &[(i64, Priority)],
    finished: &[i64],
) -> ExchangeAnswer {
    let queue: Vec<CallToQueue> = queue
        .iter()
        .map(|&(claim_id, priority)| CallToQueue {
            issue_id: claim_id,
            claim_id,
            priority: Some(priority),
            fallback_only: false,
        })
        .collect();
    let client = db.pool.get().await.unwrap();
    exchange(
        &client,
        &Exchange {
            holder,
            instance: holder,
            lease: Duration::from_secs(60),
            has_fallback: false,
            queue: &queue,
            finished,
            tokens: 0,
            reports: &[],
            pause: None,
            leaving: false,
        },
    )
    .await
    .unwrap()
}

/// The claim ids of calls granted to `holder`, in grant order.
async fn granted_claims(db: &TestDb, holder: &str) -> Vec<i64> {
    db.ids(&format!(
        "SELECT claim_id FROM llm_call WHERE holder = '{holder}' AND granted_at IS NOT NULL
           AND finished_at IS NULL ORDER BY claim_id"
    ))
    .await
}

/// Briefing calls first, then the oldest claim of each class, whichever
/// holder queued it; never more than `llm_max_in_flight` at once, nor more
/// than `generation_concurrency` for one holder.
#[tokio::test]
async fn the_budget_grants_briefing_first_then_the_oldest_claims_within_the_limits() {
    let db = TestDb::new().await;
    db.set("llm_max_in_flight", "3").await;
    db.set("generation_concurrency", "2").await;
    use Priority::{Briefing, Feed};
    // Holder a queues feed 1, 2, 3; b queues feed 4 and 5.
    let a = exchange_as(&db, "a", &[(1, Feed), (2, Feed), (3, Feed)], &[]).await;
    assert_eq!(a.queued.len(), 3);
    // a may run two of its own at most; the third slot goes to b's oldest.
    assert_eq!(granted_claims(&db, "a").await, [1, 2]);
    let b = exchange_as(&db, "b", &[(4, Feed), (5, Feed)], &[]).await;
    assert_eq!(granted_claims(&db, "b").await, [4]);
    assert_eq!(b.granted.len(), 1);
    // Briefing calls queue behind nothing; feed waits while they do.
    let c = exchange_as(&db, "c", &[(7, Briefing), (6, Briefing)], &[]).await;
    assert!(c.granted.is_empty(), "the limit is reached");
    // a's call with claim 1 ends: the slot goes to briefing 6, not feed 3.
    let call_1 = a.granted[0];
    exchange_as(&db, "a", &[], &[call_1]).await;
    assert_eq!(granted_claims(&db, "c").await, [6]);
    assert_eq!(granted_claims(&db, "a").await, [2]);
    // Briefing 7 still waits: b's call ends, and still no feed call starts.
    exchange_as(&db, "b", &[], &b.granted).await;
    assert_eq!(granted_claims(&db, "c").await, [6, 7]);
    assert!(granted_claims(&db, "b").await.is_empty());
    // With no briefing call waiting, feed goes on in claim order: a's 3
    // (older than b's 5) when a slot frees.
    let c_calls = exchange_as(&db, "c", &[], &[]).await.granted;
    exchange_as(&db, "c", &[], &c_calls[..1]).await;
    assert_eq!(granted_claims(&db, "a").await, [2, 3]);
    assert!(granted_claims(&db, "b").await.is_empty());
    assert_eq!(
        db.scalar_i64(
            "SELECT count(*) FROM llm_call WHERE granted_at IS NOT NULL AND finished_at IS NULL"
        )
        .await,
        3
    );
}

/// A higher `llm_max_in_flight` grants at the next exchange; a lower one
/// grants nothing until the calls in flight are under it.
#[tokio::test]
async fn the_limit_is_read_at_every_exchange() {
    let db = TestDb::new().await;
    db.set("llm_max_in_flight", "1").await;
    let calls: Vec<(i64, Priority)> = (1..=4).map(|c| (c, Priority::Feed)).collect();
    let first = exchange_as(&db, "a", &calls, &[]).await;
    assert_eq!(first.granted.len(), 1);
    db.set("llm_max_in_flight", "3").await;
    assert_eq!(exchange_as(&db, "a", &[], &[]).await.granted.len(), 3);
    db.set("llm_max_in_flight", "1").await;
    let now = exchange_as(&db, "a", &[], &first.granted).await;
    assert_eq!(now.granted.len(), 2, "two still in flight, none granted");
    let now = exchange_as(&db, "a", &[], &now.granted[..1]).await;
    assert_eq!(now.granted.len(), 1, "one in flight: at the limit");
    assert_eq!(now.holding, 2, "and the fourth call waits");
}

/// `llm_requests_per_minute` counts starts, finished or not, over the last
/// minute; a call waiting for the window is told when to ask again.
#[tokio::test]
async fn starts_per_minute_are_counted_across_holders() {
    let db = TestDb::new().await;
    db.set("llm_requests_per_minute", "2").await;
    let a = exchange_as(&db, "a", &[(1, Priority::Feed)], &[]).await;
    let b = exchange_as(&db, "b", &[(2, Priority::Feed), (3, Priority::Feed)], &[]).await;
    assert_eq!((a.granted.len(), b.granted.len()), (1, 1));
    // Both calls end; the window still holds their starts.
    exchange_as(&db, "a", &[], &a.granted).await;
    let b = exchange_as(&db, "b", &[], &b.granted).await;
    assert!(b.granted.is_empty());
    let wait = b.ask_again_in.expect("told when the window moves on");
    assert!(wait <= Duration::from_secs(60), "{wait:?}");
}

/// A holder that stops renewing its lease loses its calls when the lease
/// runs out: their share of the limit comes back.
#[tokio::test]
async fn a_dead_holders_share_comes_back_with_its_lease() {
    let db = TestDb::new().await;
    db.set("llm_max_in_flight", "1").await;
    let queue = [CallToQueue {
        issue_id: 1,
        claim_id: 1,
        priority: Some(Priority::Feed),
        fallback_only: false,
    }];
    let client = db.pool.get().await.unwrap();
    let dead = Exchange {
        holder: "dead",
        instance: "dead",
        lease: Duration::from_millis(200),
        has_fallback: false,
        queue: &queue,
        finished: &[],
        tokens: 0,
        reports: &[],
        pause: None,
        leaving: false,
    };
    assert_eq!(exchange(&client, &dead).await.unwrap().granted.len(), 1);
    let alive = exchange_as(&db, "alive", &[(2, Priority::Feed)], &[]).await;
    assert!(alive.granted.is_empty());
    // Told to ask again when the dead holder's lease runs out.
    let wait = alive.ask_again_in.expect("a time to ask again");
    assert!(wait <= Duration::from_millis(200), "{wait:?}");
    until_sql_polled(
        &db,
        10,
        "SELECT lease_until < clock_timestamp() FROM llm_holder WHERE holder = 'dead'",
    )
    .await;
    let alive = exchange_as(&db, "alive", &[], &[]).await;
    assert_eq!(alive.granted.len(), 1);
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM llm_holder WHERE holder = 'dead'")
            .await,
        0
    );
}

/// A pause grants nothing until it ends, whoever asks; a longer pause
/// extends it, a shorter one does not shorten it.
#[tokio::test]
async fn a_pause_holds_every_grant() {
    let db = TestDb::new().await;
    let client = db.pool.get().await.unwrap();
    let queue = [CallToQueue {
        issue_id: 1,
        claim_id: 1,
        priority: Some(Priority::Briefing),
        fallback_only: false,
    }];
    let pausing = |pause: Duration| Exchange {
        holder: "a",
        instance: "a",
        lease: Duration::from_secs(60),
        has_fallback: false,
        queue: &[],
        finished: &[],
        tokens: 0,
        reports: &[],
        pause: Some((pause, "rate limited (HTTP 429 Too Many Requests)")),
        leaving: false,
    };
    let paused = exchange(&client, &pausing(Duration::from_secs(30)))
        .await
        .unwrap();
    let pause = paused.pause.expect("paused");
    assert!(pause.remaining > Duration::from_secs(29));
    assert_eq!(pause.by.as_deref(), Some("a"));
    // A shorter pause does not shorten it.
    let shorter = exchange(&client, &pausing(Duration::from_secs(1)))
        .await
        .unwrap();
    assert!(shorter.pause.unwrap().remaining > Duration::from_secs(28));
    let b = exchange(
        &client,
        &Exchange {
            holder: "b",
            instance: "b",
            queue: &queue,
            pause: None,
            ..pausing(Duration::ZERO)
        },
    )
    .await
    .unwrap();
    assert!(b.granted.is_empty(), "nothing is granted during a pause");
    assert!(b.ask_again_in.unwrap() > Duration::from_secs(28));
}

// ---------------------------------------------------------------------------
// Several instances against the fake LLM
// ---------------------------------------------------------------------------

/// With two calls in flight (held by the fake) and a feed backlog queued
/// on two instances, three briefing articles claimed on a third instance
/// get the next three grants of the budget, and reach the LLM before the
/// backlog; every article gets written, each with one attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn briefing_articles_pass_a_feed_backlog_on_every_instance() {
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
    let a = db.serve("feed-a", llm_writer(&fake)).await;
    let b = db.serve("feed-b", llm_writer(&fake)).await;
    let c = db.serve("briefing-c", llm_writer(&fake)).await;
    let feed_a = titled(&db, "feed a", 10).await;
    let feed_b = titled(&db, "feed b", 10).await;
    claim_all(a.addr, &feed_a, Some("feed")).await;
    claim_all(b.addr, &feed_b, Some("feed")).await;
    fake.until_requests(2).await;
    let briefing = titled(&db, "briefing", 3).await;
    // No priority: briefing, the default.
    claim_all(c.addr, &briefing, None).await;
    until_sql_polled(
        &db,
        30,
        "SELECT count(*) = 3 FROM llm_call WHERE priority = 'briefing' AND granted_at IS NULL",
    )
    .await;
    open.send(true).unwrap();
    let all: Vec<i64> = [feed_a, feed_b, briefing].concat();
    until_done(&db, &a.hub, &all).await;

    let client = db.raw().await;
    let granted: Vec<String> = first_column(
        &client,
        "SELECT priority FROM llm_call ORDER BY granted_at, priority = 'feed', claim_id",
        &[],
    )
    .await;
    assert_eq!(granted.len(), 23, "one call per article: {granted:?}");
    assert_eq!(
        granted[..6],
        ["feed", "feed", "briefing", "briefing", "briefing", "feed"],
        "the briefing articles were granted the next three calls"
    );
    let arrived: Vec<bool> = fake
        .arrivals()
        .iter()
        .map(|a| a.user_prompt().contains("Title: briefing"))
        .collect();
    assert_eq!(arrived.len(), 23);
    // A feed call granted together with the last briefing call may reach
    // the LLM a moment before it, no more.
    assert!(
        arrived[..2].iter().all(|&b| !b) && arrived[2..6].iter().filter(|&&b| b).count() == 3,
        "briefing calls reached the LLM right after the two in flight: {arrived:?}"
    );
    assert!(
        fake.arrivals().iter().all(|a| a.in_flight <= 2),
        "never more than the limit"
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue WHERE attempts <> 1")
            .await,
        0,
        "no lease ran out while the backlog waited"
    );
    for service in [a, b, c] {
        service.stop().await.unwrap();
    }
}

/// A long feed backlog keeps its claims alive: each waits longer than a
/// lease for its call, and none is reaped or tried twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_longer_than_a_lease_keeps_its_claims() {
    let db = TestDb::new().await;
    db.set("lease_s", "1").await;
    db.set("llm_max_in_flight", "1").await;
    let fake = FakeLlm::start(|_, _| Reply::Slow {
        delay: Duration::from_millis(100),
        content: ARTICLE.into(),
    })
    .await;
    let service = db.serve("backlog", llm_writer(&fake)).await;
    // 25 calls one at a time: the last waits well over the 1 s lease.
    let ids = titled(&db, "feed", 25).await;
    claim_all(service.addr, &ids, Some("feed")).await;
    until_done(&db, &service.hub, &ids).await;
    assert_eq!(fake.requests(), 25);
    assert_eq!(fake.max_in_flight(), 1);
    assert_eq!(
        db.scalar_i64(
            "SELECT count(*) FROM issue_transition WHERE to_status = 'FAILED' OR attempts > 1"
        )
        .await,
        0,
        "no claim ran out while it waited"
    );
    service.stop().await.unwrap();
}

/// Three instances, each allowed 8 calls of its own, make at most
/// `llm_max_in_flight` calls together; a higher limit takes effect while
/// calls are held, a lower one at the next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_flight_limit_holds_across_instances_and_follows_a_live_change() {
    let db = TestDb::new().await;
    db.set("llm_max_in_flight", "3").await;
    let (open, gate) = watch::channel(false);
    let fake = FakeLlm::start(move |_, _| Reply::Gated {
        open: gate.clone(),
        content: ARTICLE.into(),
    })
    .await;
    let services = [
        db.serve("limit-a", llm_writer(&fake)).await,
        db.serve("limit-b", llm_writer(&fake)).await,
        db.serve("limit-c", llm_writer(&fake)).await,
    ];
    let ids = titled(&db, "story", 30).await;
    for (service, ids) in services.iter().zip(ids.chunks(10)) {
        claim_all(service.addr, ids, Some("feed")).await;
    }
    fake.until_requests(3).await;
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM llm_call WHERE granted_at IS NOT NULL")
            .await,
        3,
        "three granted, the rest wait"
    );
    // Raised while the three are held: two more start.
    db.set("llm_max_in_flight", "5").await;
    fake.until_requests(5).await;
    // Lowered, then the held calls end: from now on, two at a time.
    db.set("llm_max_in_flight", "2").await;
    open.send(true).unwrap();
    until_done(&db, &services[0].hub, &ids).await;
    let seen: Vec<u64> = fake.arrivals().iter().map(|a| a.in_flight).collect();
    assert_eq!(seen.len(), 30, "{seen:?}");
    assert!(seen[..3].iter().all(|&n| n <= 3), "{seen:?}");
    assert_eq!(fake.max_in_flight(), 5, "{seen:?}");
    assert!(
        seen[5..].iter().all(|&n| n <= 2),
        "at most two once lowered: {seen:?}"
    );
    for service in services {
        service.stop().await.unwrap();
    }
}

/// The OpenAI-compatible client without the shared budget: each instance
/// bounded by its own `generation_concurrency` only, as before.
struct OwnSlotsOnly(SharedWriter);

impl Writer for OwnSlotsOnly {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn write<'a>(&'a self, issue: IssueText<'a>) -> BoxFuture<'a, Result<Article, WriteError>> {
        self.0.write(issue)
    }
}

/// What the test above guards against: instances that count their own
/// calls only make far more than `llm_max_in_flight` together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_counting_only_their_own_calls_exceed_the_limit() {
    let db = TestDb::new().await;
    db.set("llm_max_in_flight", "3").await;
    let (open, gate) = watch::channel(false);
    let fake = FakeLlm::start(move |_, _| Reply::Gated {
        open: gate.clone(),
        content: ARTICLE.into(),
    })
    .await;
    let own = || -> SharedWriter { Arc::new(OwnSlotsOnly(llm_writer(&fake))) };
    let services = [
        db.serve("own-a", own()).await,
        db.serve("own-b", own()).await,
    ];
    let ids = titled(&db, "story", 20).await;
    for (service, ids) in services.iter().zip(ids.chunks(10)) {
        claim_all(service.addr, ids, None).await;
    }
    // Eight per instance, whatever the cluster-wide limit says.
    fake.until_requests(16).await;
    assert_eq!(fake.max_in_flight(), 16);
    open.send(true).unwrap();
    until_done(&db, &services[0].hub, &ids).await;
    for service in services {
        service.stop().await.unwrap();
    }
}

/// A `serve` process killed while it holds both slots of the budget: the
/// calls another instance queued start once the killed one's lease runs
/// out, and every article, the killed instance's included, gets written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instances_share_comes_back() {
    let db = TestDb::new().await;
    db.set("lease_s", "2").await;
    db.set("llm_max_in_flight", "2").await;
    db.set("retry_backoff_ms", "50").await;
    // The victim's calls hang until it is killed.
    let victim_alive = Arc::new(AtomicBool::new(true));
    let fake = {
        let victim_alive = victim_alive.clone();
        FakeLlm::start(move |_, request| {
            let prompt = request["messages"][1]["content"].as_str().unwrap_or("");
            if prompt.contains("Title: victim") && victim_alive.load(Ordering::SeqCst) {
                Reply::Hang
            } else {
                Reply::Ok(ARTICLE.into())
            }
        })
        .await
    };
    let mut victim = tokio::task::block_in_place(|| {
        ServeProcess::spawn(&db.url, "victim", &[("NEWSNACK_LLM_URL", &fake.url)])
    });
    let survivor = db.serve("survivor", llm_writer(&fake)).await;
    let doomed = titled(&db, "victim", 4).await;
    claim_all(victim.addr, &doomed, None).await;
    fake.until_requests(2).await;
    let waiting = titled(&db, "survivor", 3).await;
    claim_all(survivor.addr, &waiting, None).await;
    until_sql_polled(
        &db,
        30,
        "SELECT count(*) = 3 FROM llm_call c JOIN llm_holder h USING (holder)
          WHERE h.instance = 'survivor' AND c.granted_at IS NULL",
    )
    .await;
    assert_eq!(fake.requests(), 2, "the victim holds both slots");
    victim_alive.store(false, Ordering::SeqCst);
    victim.kill();
    until_done(&db, &survivor.hub, &waiting).await;
    until_done(&db, &survivor.hub, &doomed).await;
    survivor.stop().await.unwrap();
}

/// A 429 with `Retry-After: 2`: no call reaches the LLM for two seconds,
/// from any of three instances with work queued; the call that met it is
/// tried again afterwards without using up an attempt; the pause shows in
/// `/metrics` and on the dashboard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_call_reaches_the_llm_during_a_pause_and_the_paused_attempt_is_not_counted() {
    const RETRY_AFTER: Duration = Duration::from_secs(2);
    let db = TestDb::new().await;
    db.set("llm_max_in_flight", "2").await;
    db.set("retry_backoff_ms", "50").await;
    db.set("max_attempts", "1").await;
    let (open, gate) = watch::channel(false);
    // The first call meets the rate limit; the other one in flight is held
    // until the pause is recorded, so no grant can come between.
    let fake = FakeLlm::start(move |n, _| match n {
        0 => Reply::RateLimited {
            retry_after_s: RETRY_AFTER.as_secs(),
        },
        _ => Reply::Gated {
            open: gate.clone(),
            content: ARTICLE.into(),
        },
    })
    .await;
    let services = [
        db.serve("pause-a", llm_writer(&fake)).await,
        db.serve("pause-b", llm_writer(&fake)).await,
        db.serve("pause-c", llm_writer(&fake)).await,
    ];
    let ids = titled(&db, "story", 12).await;
    for (service, ids) in services.iter().zip(ids.chunks(4)) {
        claim_all(service.addr, ids, None).await;
    }
    until_sql_polled(
        &db,
        30,
        "SELECT COALESCE(paused_until > now(), false) FROM llm_budget",
    )
    .await;
    open.send(true).unwrap();
    until_done(&db, &services[0].hub, &ids).await;

    let arrivals = fake.arrivals();
    let met = arrivals[0].at;
    let during: Vec<Duration> = arrivals[2..]
        .iter()
        .map(|a| a.at.duration_since(met))
        .filter(|&after| after < RETRY_AFTER)
        .collect();
    assert_eq!(during, Vec::<Duration>::new(), "calls during the pause");
    // The call that met the limit failed visibly, with its attempt given
    // back: with max_attempts 1 it was still retried, and took one attempt.
    let paused: Vec<i64> = db
        .ids("SELECT issue_id FROM issue_transition WHERE reason LIKE '%429%'")
        .await;
    assert_eq!(paused.len(), 1, "{paused:?}");
    assert_eq!(db.status_of(paused[0]).await, "DONE");
    assert_eq!(
        db.scalar_i64(&format!(
            "SELECT attempts::bigint FROM issue WHERE id = {}",
            paused[0]
        ))
        .await,
        1
    );
    let metrics = reqwest::get(format!("http://{}/metrics", services[1].addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {metrics}"))
    };
    assert!(value("newsnack_llm_pauses_total") >= 1.0, "{metrics}");
    assert!(
        value("newsnack_llm_paused_until_seconds") > 0.0,
        "{metrics}"
    );
    let dashboard: Value = get_json(
        &reqwest::Client::new(),
        &format!("http://{}/dashboard.json", services[2].addr),
    )
    .await;
    let pause = &dashboard["llm"]["pause"];
    assert!(pause["reason"].as_str().unwrap().contains("429"), "{pause}");
    assert_eq!(pause["active"], false, "over by now: {pause}");
    for service in services {
        service.stop().await.unwrap();
    }
}

/// `prompt_tokens` and `completion_tokens` as the API reported them, NULL
/// when it reported none; the dashboard sums today's and the latest
/// briefing's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_stored_as_the_api_reported_them() {
    let db = TestDb::new().await;
    let fake = FakeLlm::start(|_, request| {
        let prompt = request["messages"][1]["content"].as_str().unwrap_or("");
        let usage = if prompt.contains("Title: silent") {
            Value::Null
        } else if prompt.contains("Title: short") {
            json!({"prompt_tokens": 120, "completion_tokens": 45, "total_tokens": 165})
        } else {
            json!({"prompt_tokens": 300, "completion_tokens": 80, "total_tokens": 380})
        };
        Reply::WithUsage {
            content: ARTICLE.into(),
            usage,
        }
    })
    .await;
    let service = db.serve("tokens", llm_writer(&fake)).await;
    let short = titled(&db, "short", 1).await;
    let long = titled(&db, "long", 1).await;
    let silent = titled(&db, "silent", 1).await;
    let all = [short.clone(), long.clone(), silent.clone()].concat();
    claim_all(service.addr, &all, None).await;
    until_done(&db, &service.hub, &all).await;
    let client = db.raw().await;
    let tokens = |id: i64| {
        let client = &client;
        async move {
            let row = client
                .query_one(
                    "SELECT prompt_tokens, completion_tokens FROM ai_article WHERE issue_id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            (row.get::<_, Option<i32>>(0), row.get::<_, Option<i32>>(1))
        }
    };
    assert_eq!(tokens(short[0]).await, (Some(120), Some(45)));
    assert_eq!(tokens(long[0]).await, (Some(300), Some(80)));
    assert_eq!(tokens(silent[0]).await, (None, None));

    let briefing = reqwest::Client::new()
        .post(format!("http://{}/today-newsnack", service.addr))
        .json(&json!({ "issue_ids": [short[0], silent[0]] }))
        .send()
        .await
        .unwrap();
    assert_eq!(briefing.status(), 201);
    let dashboard: Value = get_json(
        &reqwest::Client::new(),
        &format!("http://{}/dashboard.json", service.addr),
    )
    .await;
    let llm = &dashboard["llm"];
    assert_eq!(
        llm["tokens_today"],
        json!({"prompt": 420, "completion": 125}),
        "{llm}"
    );
    assert_eq!(
        llm["tokens_latest_briefing"],
        json!({"prompt": 120, "completion": 45}),
        "{llm}"
    );
    let metrics = reqwest::get(format!("http://{}/metrics", service.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for kind in ["prompt", "completion"] {
        assert!(
            metrics.contains(&format!("newsnack_llm_tokens_total{{kind=\"{kind}\"}}")),
            "{metrics}"
        );
    }
    service.stop().await.unwrap();
}

const KOREAN_SYSTEM: &str =
    "당신은 뉴스낵의 기자입니다. 주어진 사실만으로 중립적인 한국어 기사를 씁니다.";
const KOREAN_USER: &str =
    "다음 이슈로 제목과 짧은 기사를 한국어로 써 주세요.\n\n제목: {title}\n\n내용:\n{body}";

/// The prompts are settings: a change by SQL reaches the next call; an
/// invalid template is refused with the reason and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_change_reaches_the_next_call() {
    let db = TestDb::new().await;
    let fake = FakeLlm::always(ARTICLE).await;
    let service = db.serve("prompts", llm_writer(&fake)).await;
    let first = titled(&db, "first", 1).await;
    claim_all(service.addr, &first, None).await;
    until_done(&db, &service.hub, &first).await;
    let request = fake.last_request().unwrap();
    assert_eq!(
        request["messages"][0]["content"],
        writer::openai::SYSTEM_PROMPT
    );

    let mut changed = service.hub.settings_changed();
    changed.borrow_and_update();
    db.set("llm_system_prompt", KOREAN_SYSTEM).await;
    db.set("llm_user_prompt", KOREAN_USER).await;
    within(10, "the settings change to arrive", changed.changed())
        .await
        .unwrap();
    let second = titled(&db, "second", 1).await;
    claim_all(service.addr, &second, None).await;
    until_done(&db, &service.hub, &second).await;
    let request = fake.last_request().unwrap();
    assert_eq!(request["messages"][0]["content"], KOREAN_SYSTEM);
    assert_eq!(
        request["messages"][1]["content"],
        "다음 이슈로 제목과 짧은 기사를 한국어로 써 주세요.\n\n제목: second 0\n\n내용:\nWhat happened in second 0."
    );

    let client = db.pool.get().await.unwrap();
    let refused = newsnack::db::setting::set(&client, "llm_user_prompt", "제목: {title}")
        .await
        .unwrap_err();
    let message = refused.to_string();
    assert!(
        message.contains("must contain {title} and {body}"),
        "{message}"
    );
    assert!(message.contains("missing: {body}"), "{message}");
    assert_eq!(
        setting(&db, "llm_user_prompt").await,
        KOREAN_USER,
        "nothing changed"
    );
    service.stop().await.unwrap();
}

/// Out-of-range limits, an unknown time zone, bad templates and prompts
/// are refused by the settings trigger with the reason; a time zone in
/// another case is stored as the IANA database spells it.
#[tokio::test]
async fn bad_budget_and_locale_settings_are_refused_with_the_reason() {
    let db = TestDb::new().await;
    let client = db.pool.get().await.unwrap();
    let long = "x".repeat(16_001);
    for (key, value, reason) in [
        (
            "llm_max_in_flight",
            "0",
            "must be between 1 and 10000, got 0",
        ),
        ("llm_max_in_flight", "many", "must be a whole number"),
        (
            "llm_requests_per_minute",
            "-1",
            "must be between 0 and 1000000",
        ),
        (
            "timezone",
            "Mars/Olympus_Mons",
            "unknown time zone \"Mars/Olympus_Mons\"",
        ),
        ("timezone", "posix/Asia/Seoul", "unknown time zone"),
        ("briefing_title", "Today's news", "it must contain {date}"),
        ("briefing_title", "{date:%Q}", "{date:%Q} uses %Q"),
        ("llm_user_prompt", "{body} only", "missing: {title}"),
        ("llm_system_prompt", "  ", "must not be empty"),
        (
            "llm_system_prompt",
            long.as_str(),
            "at most 16000 characters long, got 16001",
        ),
    ] {
        let before = setting(&db, key).await;
        let err = newsnack::db::setting::set(&client, key, value)
            .await
            .unwrap_err();
        let message = err.to_string();
        assert!(message.contains(reason), "{key}={value:.40}: {message}");
        assert_eq!(setting(&db, key).await, before, "{key} unchanged");
    }
    assert_eq!(
        newsnack::db::setting::set(&client, "timezone", "asia/seoul")
            .await
            .unwrap(),
        "Asia/Seoul"
    );
}

/// Every time zone the settings trigger accepts is one the service can use.
#[tokio::test]
async fn every_time_zone_the_database_accepts_the_service_knows() {
    let db = TestDb::new().await;
    let client = db.raw().await;
    let names: Vec<String> = first_column(
        &client,
        "SELECT name FROM pg_timezone_names
          WHERE name !~ '^(posix|right)/' AND name NOT IN ('localtime', 'posixrules', 'Factory')",
        &[],
    )
    .await;
    assert!(names.len() > 300, "{}", names.len());
    let unknown: Vec<&String> = names
        .iter()
        .filter(|name| name.parse::<chrono_tz::Tz>().is_err())
        .collect();
    assert_eq!(unknown, Vec::<&String>::new());
}

/// An unknown priority is a 422 that names the allowed values, and claims
/// nothing.
#[tokio::test]
async fn an_unknown_priority_is_refused_naming_the_allowed_values() {
    let db = TestDb::new().await;
    let service = db.serve("priority", Arc::new(writer::OfflineWriter)).await;
    let ids = db.add_issues(1).await;
    let (status, body) = post_articles(service.addr, &ids, Some("urgent")).await;
    assert_eq!(status, 422, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("urgent") && error.contains("briefing") && error.contains("feed"),
        "{error}"
    );
    assert_eq!(db.status_of(ids[0]).await, "PENDING");
    let (status, body) = post_articles(service.addr, &ids, Some("feed")).await;
    assert_eq!(status, 202, "{body}");
    service.stop().await.unwrap();
}
