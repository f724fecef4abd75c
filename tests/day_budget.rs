//! The day's token budget (`llm_daily_token_budget`,
//! `llm_briefing_reserve_tokens`): the exchange's rule on its own (feed
//! held at the budget less the reserve, everything at the budget, the next
//! day free again), then `serve` instances against the fake LLM reporting
//! `usage`: held to the token with one call in flight and overshot by no
//! more than the calls in flight otherwise; briefing articles written from
//! the reserve while feed claims wait with their leases renewed, and feed
//! going on when the day turns; an answer without `usage` counted by its
//! bound; `/metrics` and the dashboard. And what the shared count guards
//! against: instances counting only their own tokens spend the budget
//! once each.

mod common;

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::fake_llm::{FakeLlm, Reply};
use common::http::{claim_all, get_json};
use common::{titled, until_sql, until_sql_polled, TestDb};
use futures::future::BoxFuture;
use newsnack::db::llm_budget::{exchange, CallToQueue, Exchange, ExchangeAnswer, Held};
use newsnack::model::llm::Priority;
use newsnack::writer::{Article, IssueText, SharedWriter, WriteError, WriteErrorKind, Writer};
use serde_json::{json, Value};

const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";

/// A time zone twelve hours behind UTC and one fourteen hours ahead: their
/// dates always differ, so moving `timezone` from the first to the second
/// turns the budget's day, whatever the clock says.
const BEHIND: &str = "Etc/GMT+12";
const AHEAD: &str = "Etc/GMT-14";

/// A fake LLM whose every answer reports `prompt` + `completion` tokens.
async fn fake_reporting(prompt: i64, completion: i64) -> FakeLlm {
    FakeLlm::start(move |_, _| Reply::WithUsage {
        content: ARTICLE.into(),
        usage: json!({"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}),
    })
    .await
}

/// The day's count, as the budget keeps it (0 when no row).
const TOKENS_TODAY: &str = "(SELECT COALESCE(sum(tokens), 0)::bigint FROM llm_token_day)";

/// Waits until the budget has nothing in flight, some call waiting, and
/// counted at least `at_least` tokens: what a held budget looks like.
async fn until_held(db: &TestDb, at_least: i64) {
    until_sql_polled(
        db,
        60,
        &format!(
            "SELECT {TOKENS_TODAY} >= {at_least}
                AND NOT EXISTS (SELECT 1 FROM llm_call WHERE granted_at IS NOT NULL AND finished_at IS NULL)
                AND EXISTS (SELECT 1 FROM llm_call WHERE granted_at IS NULL)"
        ),
    )
    .await;
}

async fn exchange_as(
    db: &TestDb,
    queue: &[(i64, Priority)],
    finished: &[i64],
    tokens: i64,
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
            holder: "h",
            instance: "h",
            lease: Duration::from_secs(60),
            has_fallback: false,
            queue: &queue,
            finished,
            tokens,
            reports: &[],
            pause: None,
            leaving: false,
        },
    )
    .await
    .unwrap()
}

/// The claim ids of the calls granted and not finished, in order.
async fn granted_claims(db: &TestDb) -> Vec<i64> {
    db.ids(
        "SELECT claim_id FROM llm_call WHERE granted_at IS NOT NULL AND finished_at IS NULL
          ORDER BY claim_id",
    )
    .await
}

/// The rule on its own: tokens count to the day they are reported on; at
/// budget − reserve only briefing calls are granted, at the budget none,
/// and the held calls are asked about again at the next midnight; on the
/// next day they are granted.
#[tokio::test]
async fn the_exchange_holds_feed_at_the_reserve_and_everything_at_the_budget() {
    let db = TestDb::new().await;
    db.set("timezone", BEHIND).await;
    db.set("llm_daily_token_budget", "1000").await;
    db.set("llm_briefing_reserve_tokens", "300").await;
    let a = exchange_as(&db, &[(1, Priority::Feed), (2, Priority::Briefing)], &[], 0).await;
    assert_eq!(a.granted.len(), 2);
    assert_eq!((a.tokens_today, a.held), (0, None));

    // 700 spent: feed is held, briefing goes on.
    let b = exchange_as(
        &db,
        &[(3, Priority::Feed), (4, Priority::Briefing)],
        &a.granted,
        700,
    )
    .await;
    assert_eq!((b.tokens_today, b.held), (700, Some(Held::Feed)));
    assert_eq!(granted_claims(&db).await, [4], "only the briefing call");
    let midnight = b
        .ask_again_in
        .expect("the held feed call is asked about again");
    assert!(
        midnight > Duration::ZERO && midnight <= Duration::from_secs(86_400),
        "at the next midnight: {midnight:?}"
    );

    // 1,000 spent: nothing is granted, briefing included.
    let c = exchange_as(&db, &[(5, Priority::Briefing)], &b.granted, 300).await;
    assert_eq!((c.tokens_today, c.held), (1000, Some(Held::All)));
    assert!(c.granted.is_empty(), "{c:?}");
    assert!(c.ask_again_in.is_some());

    // Raising the budget frees briefing, not feed.
    db.set("llm_daily_token_budget", "1200").await;
    let d = exchange_as(&db, &[], &[], 0).await;
    assert_eq!(d.held, Some(Held::Feed));
    assert_eq!(granted_claims(&db).await, [5]);

    // The next day: everything goes.
    db.set("timezone", AHEAD).await;
    let e = exchange_as(&db, &[], &d.granted, 0).await;
    assert_eq!((e.tokens_today, e.held), (0, None));
    assert_eq!(granted_claims(&db).await, [3]);
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM llm_token_day").await,
        1,
        "yesterday's row is kept, today has none yet"
    );
}

/// One call in flight, 100 tokens a call, a budget of 450: exactly five
/// calls (the fifth starts at 400, below the budget; none starts at 500),
/// and the five left wait, claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_call_in_flight_holds_the_budget_to_the_token() {
    let db = TestDb::new().await;
    db.set("llm_max_in_flight", "1").await;
    db.set("llm_daily_token_budget", "450").await;
    let fake = fake_reporting(60, 40).await;
    let service = db.serve("one", fake.writer(Duration::from_secs(30))).await;
    let ids = titled(&db, "story", 10).await;
    claim_all(service.addr, &ids, Some("feed")).await;
    until_held(&db, 450).await;
    until_sql(
        &db,
        &service.hub,
        30,
        "SELECT count(*) = 5 FROM issue WHERE processing_status = 'DONE'",
    )
    .await;
    assert_eq!(fake.requests(), 5);
    assert_eq!(db.scalar_i64(&format!("SELECT {TOKENS_TODAY}")).await, 500);
    assert_eq!(
        db.scalar_i64(
            "SELECT count(*) FROM issue WHERE processing_status = 'IN_PROGRESS' AND attempts = 1"
        )
        .await,
        5,
        "the rest wait, claimed"
    );
    assert_eq!(
        db.scalar_i64("SELECT sum(prompt_tokens + completion_tokens) FROM ai_article")
            .await,
        500,
        "the count is the articles' reported usage"
    );
    service.stop().await.unwrap();
}

/// Three calls in flight: the count may pass the budget by what the calls
/// in flight at the last grant spent, no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overshoot_is_bounded_by_the_calls_in_flight() {
    let db = TestDb::new().await;
    db.set("llm_max_in_flight", "3").await;
    db.set("llm_daily_token_budget", "450").await;
    let fake = fake_reporting(60, 40).await;
    let service = db
        .serve("three", fake.writer(Duration::from_secs(30)))
        .await;
    let ids = titled(&db, "story", 20).await;
    claim_all(service.addr, &ids, Some("feed")).await;
    until_held(&db, 450).await;
    let tokens = db.scalar_i64(&format!("SELECT {TOKENS_TODAY}")).await;
    // The last grant came at 400 or less, with at most three in flight.
    assert!((500..=700).contains(&tokens), "{tokens}");
    until_sql(
        &db,
        &service.hub,
        30,
        &format!(
            "SELECT count(*) = {} FROM issue WHERE processing_status = 'DONE'",
            tokens / 100
        ),
    )
    .await;
    assert_eq!(fake.requests() as i64 * 100, tokens);
    assert!(
        fake.arrivals().iter().all(|a| a.in_flight <= 3),
        "never more than the limit in flight"
    );
    service.stop().await.unwrap();
}

/// A budget of 500 with 300 kept for the briefing, 100 tokens a call: two
/// feed articles, then feed waits (its claims' leases renewed meanwhile)
/// while three briefing articles are written from the reserve; then every
/// call waits, `/metrics` and the dashboard say so; the next day feed goes
/// on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn briefing_articles_are_written_from_the_reserve_while_feed_waits_for_the_next_day() {
    let db = TestDb::new().await;
    db.set("timezone", BEHIND).await;
    db.set("llm_max_in_flight", "1").await;
    db.set("lease_s", "3").await;
    db.set("llm_daily_token_budget", "500").await;
    db.set("llm_briefing_reserve_tokens", "300").await;
    let fake = fake_reporting(60, 40).await;
    let service = db
        .serve("reserve", fake.writer(Duration::from_secs(30)))
        .await;
    let feed = titled(&db, "feed", 5).await;
    claim_all(service.addr, &feed, Some("feed")).await;
    until_held(&db, 200).await;
    assert_eq!(fake.requests(), 2);

    // Held longer than a lease, the waiting claims are kept alive.
    let leases = "SELECT max(lease_until)::text FROM issue WHERE processing_status = 'IN_PROGRESS'";
    let first_lease: String = db.raw().await.query_one(leases, &[]).await.unwrap().get(0);
    until_sql_polled(
        &db,
        30,
        &format!(
            "SELECT count(*) = 3 FROM issue WHERE processing_status = 'IN_PROGRESS'
                AND lease_until > '{first_lease}'::timestamptz + interval '3 seconds'"
        ),
    )
    .await;

    let briefing = titled(&db, "briefing", 3).await;
    claim_all(service.addr, &briefing, Some("briefing")).await;
    until_sql(
        &db,
        &service.hub,
        30,
        &format!(
            "SELECT count(*) = 3 FROM issue WHERE processing_status = 'DONE' AND id = ANY('{{{}}}')",
            briefing.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
        ),
    )
    .await;
    // The last call's tokens come with its slot, maybe after its article.
    until_sql_polled(&db, 30, &format!("SELECT {TOKENS_TODAY} = 500")).await;
    assert_eq!(fake.requests(), 5, "feed made no call meanwhile");

    let metrics = reqwest::get(format!("http://{}/metrics", service.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("newsnack_llm_tokens_today 500"),
        "{metrics}"
    );
    assert!(
        metrics.contains("newsnack_llm_held{class=\"briefing\"} 1"),
        "{metrics}"
    );
    let dashboard: Value = get_json(
        &reqwest::Client::new(),
        &format!("http://{}/dashboard.json", service.addr),
    )
    .await;
    assert_eq!(
        dashboard["llm"]["day"],
        json!({"tokens": 500, "budget": 500, "briefing_reserve": 300, "timezone": BEHIND,
               "held": "all", "state": format!("all calls held until 00:00 {BEHIND}")})
    );

    // The next day: feed goes on, up to the budget less the reserve again.
    db.set("timezone", AHEAD).await;
    until_sql(
        &db,
        &service.hub,
        30,
        "SELECT count(*) = 7 FROM issue WHERE processing_status = 'DONE'",
    )
    .await;
    until_held(&db, 200).await;
    assert_eq!(fake.requests(), 7);
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue WHERE attempts <> 1")
            .await,
        0,
        "no claim was lost while it waited"
    );
    let dashboard: Value = get_json(
        &reqwest::Client::new(),
        &format!("http://{}/dashboard.json", service.addr),
    )
    .await;
    assert_eq!(
        dashboard["llm"]["day"]["state"],
        json!(format!("feed held until 00:00 {AHEAD}"))
    );
    service.stop().await.unwrap();
}

/// An answer without `usage` counts the bound of what was sent and
/// received: each message's UTF-8 bytes plus 8 for its framing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_without_usage_counts_its_bound() {
    let db = TestDb::new().await;
    let fake = FakeLlm::start(|_, _| Reply::WithUsage {
        content: ARTICLE.into(),
        usage: Value::Null,
    })
    .await;
    let service = db
        .serve("silent", fake.writer(Duration::from_secs(30)))
        .await;
    let ids = titled(&db, "기사", 1).await;
    claim_all(service.addr, &ids, Some("briefing")).await;
    until_sql_polled(&db, 30, &format!("SELECT {TOKENS_TODAY} > 0")).await;
    let request = fake.last_request().unwrap();
    let sent: i64 = request["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap().len() as i64 + 8)
        .sum();
    let expected = sent + ARTICLE.len() as i64 + 8;
    assert_eq!(
        db.scalar_i64(&format!("SELECT {TOKENS_TODAY}")).await,
        expected
    );
    service.stop().await.unwrap();
}

/// A writer that keeps its own day's count, as an instance without the
/// shared one would: it refuses once its own count reaches the budget, and
/// asks the model otherwise (outside the shared budget).
struct OwnCountOnly {
    inner: SharedWriter,
    spent: AtomicI64,
    budget: i64,
}

impl Writer for OwnCountOnly {
    fn name(&self) -> &str {
        "own-count"
    }

    fn write<'a>(&'a self, issue: IssueText<'a>) -> BoxFuture<'a, Result<Article, WriteError>> {
        Box::pin(async move {
            if self.spent.load(Ordering::SeqCst) >= self.budget {
                return Err(WriteError::fatal(
                    WriteErrorKind::BadRequest,
                    "own budget spent",
                ));
            }
            let article = self.inner.write(issue).await?;
            let used = article.usage.prompt_tokens.unwrap_or(0) as i64
                + article.usage.completion_tokens.unwrap_or(0) as i64;
            self.spent.fetch_add(used, Ordering::SeqCst);
            Ok(article)
        })
    }
}

/// What the shared count guards against: two instances counting only
/// their own tokens each spend the whole budget, twice it together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_counting_only_their_own_tokens_spend_the_budget_twice() {
    let db = TestDb::new().await;
    db.set("generation_concurrency", "1").await;
    let fake = fake_reporting(60, 40).await;
    let own = || -> SharedWriter {
        Arc::new(OwnCountOnly {
            inner: fake.writer(Duration::from_secs(30)),
            spent: AtomicI64::new(0),
            budget: 450,
        })
    };
    let services = [
        db.serve("own-a", own()).await,
        db.serve("own-b", own()).await,
    ];
    let ids = titled(&db, "story", 20).await;
    for (service, ids) in services.iter().zip(ids.chunks(10)) {
        claim_all(service.addr, ids, Some("feed")).await;
    }
    until_sql(
        &db,
        &services[0].hub,
        30,
        "SELECT count(*) = 20 FROM issue WHERE processing_status IN ('DONE', 'FAILED')",
    )
    .await;
    assert_eq!(fake.requests(), 10, "five calls per instance");
    assert_eq!(
        db.scalar_i64("SELECT sum(prompt_tokens + completion_tokens) FROM ai_article")
            .await,
        1000,
        "twice the budget of 450, where the shared count stops at 500"
    );
    for service in services {
        service.stop().await.unwrap();
    }
}
