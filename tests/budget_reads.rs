//! The budget figures the dashboard reads from kept rows (migration 36)
//! equal the ones counted from `ai_article` and `briefing`, after a mixed
//! workload through every path that changes them: completions with and
//! without tokens (the service's own write), a TRUNCATE, an article from
//! before the day, raw-SQL updates and deletes of articles, a fold, and
//! briefings written. The day is read as the dashboard reads it, from the
//! midnight of a zone a quarter hour off the hour too. The same workload
//! with any one of the keeping triggers dropped shows a difference.

mod common;

use std::time::Duration;

use common::TestDb;
use newsnack::db::issue::{self, ClaimScope, Completion};
use newsnack::db::llm_budget::{self, Tokens};
use newsnack::model::llm::TokenUsage;
use time::OffsetDateTime;
use tokio_postgres::Client;

/// The triggers that keep the figures (migration 36), each its own path.
const KEEPERS: [(&str, &str); 5] = [
    ("ai_article", "ai_article_tokens_on_insert"),
    ("ai_article", "ai_article_tokens_on_update"),
    ("ai_article", "ai_article_tokens_on_delete"),
    ("ai_article", "ai_article_tokens_on_truncate"),
    ("briefing", "briefing_count_tokens"),
];

/// Claims `ids` and completes them through the service's completion write,
/// each with `usage`.
async fn write_articles(db: &TestDb, ids: &[i64], usage: TokenUsage) {
    let client = db.pool.get().await.unwrap();
    let claimed = issue::claim_issues(
        &client,
        ids,
        "budget-reads",
        Duration::from_secs(60),
        ClaimScope::Claimable,
    )
    .await
    .unwrap()
    .claimed;
    assert_eq!(claimed.len(), ids.len());
    let completions: Vec<Completion> = claimed
        .iter()
        .map(|c| Completion {
            id: c.id,
            claim_id: c.claim_id,
            headline: format!("headline {}", c.id),
            body: format!("body {}", c.id),
            usage,
        })
        .collect();
    issue::complete(&client, &completions, "test")
        .await
        .unwrap();
}

fn usage(prompt: i32, completion: i32) -> TokenUsage {
    TokenUsage {
        prompt_tokens: Some(prompt),
        completion_tokens: Some(completion),
    }
}

/// Writes a briefing of `ids` as the pipeline does.
async fn brief(db: &TestDb, ids: &[i64]) {
    let client = db.pool.get().await.unwrap();
    newsnack::db::briefing::insert(
        &client,
        "briefing",
        OffsetDateTime::now_utc().date(),
        ids,
        "body",
    )
    .await
    .unwrap();
}

/// Every difference between the kept figures and the counted ones, for
/// the day as it began in each zone.
async fn differences(db: &TestDb, raw: &Client) -> Vec<String> {
    let mut found = Vec::new();
    for zone in [chrono_tz::UTC, chrono_tz::Asia::Kathmandu] {
        let began = newsnack::briefing::assembly::day_began(zone, OffsetDateTime::now_utc());
        let client = db.pool.get().await.unwrap();
        let kept = llm_budget::view(&client, began).await.unwrap();
        let row = raw
            .query_one(
                "SELECT COALESCE(sum(prompt_tokens), 0)::bigint, COALESCE(sum(completion_tokens), 0)::bigint
                   FROM ai_article WHERE created_at >= $1",
                &[&began],
            )
            .await
            .unwrap();
        let today = Tokens {
            prompt: row.get(0),
            completion: row.get(1),
        };
        if kept.tokens_today != today {
            found.push(format!(
                "{zone}: today kept {:?}, counted {today:?}",
                kept.tokens_today
            ));
        }
        let row = raw
            .query_one(
                "SELECT COALESCE(sum(a.prompt_tokens), 0)::bigint, COALESCE(sum(a.completion_tokens), 0)::bigint
                   FROM ai_article a, (SELECT issue_ids FROM briefing ORDER BY id DESC LIMIT 1) b
                  WHERE a.issue_id = ANY(b.issue_ids)",
                &[],
            )
            .await
            .unwrap();
        let latest = Tokens {
            prompt: row.get(0),
            completion: row.get(1),
        };
        if kept.tokens_latest_briefing != latest {
            found.push(format!(
                "{zone}: latest briefing kept {:?}, counted {latest:?}",
                kept.tokens_latest_briefing
            ));
        }
    }
    found
}

/// Runs the mixed workload on `db`, checking after each step; answers
/// every difference seen.
async fn workload(db: &TestDb) -> Vec<String> {
    let raw = db.raw().await;
    let ids = db.add_issues(24).await;
    let mut found = Vec::new();

    // Articles, all gone at once by a TRUNCATE; then articles with tokens,
    // and the built-in writer's without.
    write_articles(db, &ids[18..20], usage(5, 5)).await;
    raw.batch_execute("TRUNCATE ai_article").await.unwrap();
    found.extend(differences(db, &raw).await);
    write_articles(db, &ids[0..6], usage(100, 40)).await;
    write_articles(db, &ids[6..8], TokenUsage::default()).await;
    brief(db, &ids[0..4]).await;
    found.extend(differences(db, &raw).await);

    // An article written before the day began in any zone counts to no
    // today; an update moves tokens, a delete takes them away (none of the
    // briefing's: a briefing keeps its articles' tokens as they were when
    // it was written).
    write_articles(db, &ids[8..10], usage(7, 3)).await;
    raw.execute(
        "UPDATE ai_article SET created_at = now() - interval '30 hours' WHERE issue_id = $1",
        &[&ids[8]],
    )
    .await
    .unwrap();
    raw.execute(
        "UPDATE ai_article SET prompt_tokens = prompt_tokens + 11 WHERE issue_id = ANY($1)",
        &[&ids[4..6].to_vec()],
    )
    .await
    .unwrap();
    raw.execute("DELETE FROM ai_article WHERE issue_id = $1", &[&ids[5]])
        .await
        .unwrap();
    found.extend(differences(db, &raw).await);

    // A fold leaves the sums as they were.
    let client = db.pool.get().await.unwrap();
    assert!(llm_budget::fold_article_tokens(&client, 0).await.unwrap() > 0);
    found.extend(differences(db, &raw).await);

    // More articles, and a briefing of some of each.
    write_articles(db, &ids[10..16], usage(250, 90)).await;
    write_articles(db, &ids[16..18], TokenUsage::default()).await;
    brief(db, &[ids[10], ids[11], ids[16]]).await;
    found.extend(differences(db, &raw).await);
    found
}

#[tokio::test]
async fn kept_budget_figures_equal_the_counted_ones() {
    let db = TestDb::new().await;
    let found = workload(&db).await;
    assert!(found.is_empty(), "{found:#?}");
    // The workload did move the figures.
    let client = db.pool.get().await.unwrap();
    let began = newsnack::briefing::assembly::day_began(chrono_tz::UTC, OffsetDateTime::now_utc());
    let view = llm_budget::view(&client, began).await.unwrap();
    // Six at 100, two raised by 11, one of those (111) deleted; one at 7
    // today and one moved to yesterday; six at 250.
    assert_eq!(
        view.tokens_today.prompt,
        6 * 100 + 2 * 11 - 111 + 7 + 6 * 250
    );
    assert_eq!(view.tokens_latest_briefing.completion, 2 * 90);
}

#[tokio::test]
async fn each_keeping_trigger_left_out_shows() {
    for (table, trigger) in KEEPERS {
        let db = TestDb::new().await;
        db.raw()
            .await
            .batch_execute(&format!("DROP TRIGGER {trigger} ON {table}"))
            .await
            .unwrap();
        let found = workload(&db).await;
        assert!(!found.is_empty(), "without {trigger}, nothing differed");
    }
}
