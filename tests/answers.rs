//! Answers checked before they are stored, through a running service and
//! the tests' fake OpenAI-compatible server: wrappers (code fences, a JSON
//! object) are removed; an answer that fails a check (a long headline, a
//! refusal phrase, English where Hangul is asked for, a body out of bounds)
//! is asked for again once, with the first answer and the reason in the
//! conversation, and is either stored fixed or ends `FAILED` with
//! `invalid article: <check>` and no automatic retry, after exactly two
//! calls; decomposed Hangul is counted and stored after NFC; the rejections
//! are counted in `/metrics` by check; bad settings are refused with the
//! reason.

mod common;

use std::time::Duration;

use common::fake_llm::{FakeLlm, Reply};
use common::{until_sql, TestDb};
use newsnack::writer::SharedWriter;
use serde_json::{json, Value};
use unicode_normalization::UnicodeNormalization;

const GOOD: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";
const KOREAN: &str =
    "시의회 예산안 통과\n\n시의회가 월요일 2025년 예산안을 7대 2로 통과시켰다.\n\n공원 예산은 4% 늘어난다.";

fn llm_writer(fake: &FakeLlm) -> SharedWriter {
    fake.writer(Duration::from_secs(30))
}

/// The issue's title, as the prompt template carries it.
fn title_of(request: &Value) -> String {
    let prompt = request["messages"][1]["content"].as_str().unwrap_or("");
    prompt
        .lines()
        .find_map(|line| line.strip_prefix("Title: "))
        .unwrap_or("")
        .to_string()
}

/// Whether the request asks again (it carries a first answer).
fn asks_again(request: &Value) -> bool {
    request["messages"].as_array().map_or(0, Vec::len) == 4
}

/// A fake that answers each issue, by its title, with `first` and then
/// (asked again) with `second`.
async fn fake(answers: &'static [(&'static str, &'static str, &'static str)]) -> FakeLlm {
    FakeLlm::start(move |_, request| {
        let title = title_of(request);
        let (_, first, second) = answers
            .iter()
            .find(|(t, _, _)| *t == title)
            .unwrap_or_else(|| panic!("no answer for {title:?}"));
        Reply::Ok(if asks_again(request) { second } else { first }.to_string())
    })
    .await
}

/// Adds an issue per title, has the service write them all and waits until
/// each is `DONE` or `FAILED` for good; returns the ids in order.
async fn write_all(db: &TestDb, fake: &FakeLlm, titles: &[&str]) -> Vec<i64> {
    let service = db.serve("answers", llm_writer(fake)).await;
    let client = db.pool.get().await.unwrap();
    let issues: Vec<_> = titles
        .iter()
        .map(|title| newsnack::db::issue::NewIssue {
            title: title.to_string(),
            body: format!("What happened: {title}."),
            score: 1.0,
            collected_at: None,
            source_key: None,
        })
        .collect();
    let ids = newsnack::db::issue::insert_issues(&client, &issues)
        .await
        .unwrap();
    drop(client);
    let response = reqwest::Client::new()
        .post(format!("http://{}/ai-articles", service.addr))
        .json(&json!({ "issue_ids": ids }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    until_sql(
        db,
        &service.hub,
        60,
        &format!(
            "SELECT count(*) = {} FROM issue WHERE id = ANY(ARRAY{ids:?}::bigint[])
                AND (processing_status = 'DONE'
                     OR processing_status = 'FAILED' AND retry_not_before = 'infinity')",
            ids.len()
        ),
    )
    .await;
    let metrics = reqwest::get(format!("http://{}/metrics", service.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for check in ["headline_length", "body_length", "reject_phrase", "script"] {
        assert!(
            metrics.contains(&format!(
                "newsnack_articles_rejected_total{{check=\"{check}\"}}"
            )),
            "{metrics}"
        );
    }
    service.stop().await.unwrap();
    ids
}

/// What became of an issue: status, last_error, attempts, and its article
/// (headline, body) if it has one.
async fn outcome(db: &TestDb, id: i64) -> (String, Option<String>, i32, Option<(String, String)>) {
    let client = db.raw().await;
    let row = client
        .query_one(
            "SELECT i.processing_status, i.last_error, i.attempts, a.headline, a.body
               FROM issue i LEFT JOIN ai_article a ON a.issue_id = i.id WHERE i.id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let article = row
        .get::<_, Option<String>>(3)
        .map(|headline| (headline, row.get(4)));
    (row.get(0), row.get(1), row.get(2), article)
}

/// The requests the fake got for the issue titled `title`.
fn calls_for(fake: &FakeLlm, title: &str) -> Vec<Value> {
    fake.arrivals()
        .into_iter()
        .map(|a| a.request)
        .filter(|r| title_of(r) == title)
        .collect()
}

fn long_headline() -> String {
    "Council ".repeat(20).trim_end().to_string()
}

static LONG_THEN_GOOD: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn long_answer() -> &'static str {
    LONG_THEN_GOOD.get_or_init(|| format!("{}\n\nThe council met.", long_headline()))
}

/// Fences and a JSON object are taken off and the article stored from one
/// call; a long headline and a too-short body are asked for again, with the
/// first answer and the reason, and either fixed or `FAILED` for good after
/// exactly two calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrappers_come_off_and_failed_checks_are_asked_once_more() {
    let db = TestDb::new().await;
    db.set("article_body_min_chars", "10").await;
    let long: &'static str = long_answer();
    let answers: &'static [(&str, &str, &str)] = Box::leak(Box::new([
        ("fenced", "```markdown\n**Fenced headline**\n\nFenced body text.\n```", "unused"),
        (
            "json",
            "```json\n{\"headline\": \"JSON headline\", \"body\": \"JSON body, first.\\n\\nSecond.\"}\n```",
            "unused",
        ),
        ("long fixed", long, GOOD),
        ("long twice", long, long),
        (
            "json long",
            Box::leak(
                json!({"headline": long_headline(), "body": "A body long enough."})
                    .to_string()
                    .into_boxed_str(),
            ),
            GOOD,
        ),
        ("short twice", "Headline\n\nTiny.", "Headline\n\nShort.")
    ]));
    let fake = fake(answers).await;
    let titles: Vec<&str> = answers.iter().map(|(t, _, _)| *t).collect();
    let ids = write_all(&db, &fake, &titles).await;

    let fenced = outcome(&db, ids[0]).await;
    assert_eq!(
        fenced.3,
        Some(("Fenced headline".into(), "Fenced body text.".into()))
    );
    assert_eq!(calls_for(&fake, "fenced").len(), 1);
    let json = outcome(&db, ids[1]).await;
    assert_eq!(
        json.3,
        Some((
            "JSON headline".into(),
            "JSON body, first.\n\nSecond.".into()
        ))
    );
    assert_eq!(calls_for(&fake, "json").len(), 1);

    // Fixed by the second request, which carries the first answer and why.
    let fixed = outcome(&db, ids[2]).await;
    assert_eq!(fixed.0, "DONE");
    assert_eq!(
        fixed.3,
        Some((
            "A headline".into(),
            "First paragraph of the article.\n\nSecond paragraph.".into()
        ))
    );
    let calls = calls_for(&fake, "long fixed");
    assert_eq!(calls.len(), 2);
    let messages = calls[1]["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 4);
    assert_eq!(messages[0], calls[0]["messages"][0]);
    assert_eq!(messages[1], calls[0]["messages"][1]);
    assert_eq!(messages[2]["role"], "assistant");
    assert_eq!(messages[2]["content"], long);
    assert_eq!(messages[3]["role"], "user");
    let fix = messages[3]["content"].as_str().unwrap();
    assert!(
        fix.contains(&format!(
            "the headline has {} characters; at most 120 are allowed",
            long_headline().chars().count()
        )),
        "{fix}"
    );

    // Failed twice: FAILED for good, with the check, after two calls.
    let twice = outcome(&db, ids[3]).await;
    assert_eq!(twice.0, "FAILED");
    let error = twice.1.unwrap();
    assert!(
        error.starts_with("invalid article: headline_length: the headline has 159 characters"),
        "{error}"
    );
    assert_eq!(twice.2, 1, "one attempt, no automatic retry");
    assert_eq!(twice.3, None);
    assert_eq!(calls_for(&fake, "long twice").len(), 2);

    // A JSON answer is unwrapped before its headline is measured.
    let json_long = outcome(&db, ids[4]).await;
    assert_eq!(json_long.0, "DONE");
    assert_eq!(calls_for(&fake, "json long").len(), 2);

    let short = outcome(&db, ids[5]).await;
    assert_eq!(short.0, "FAILED");
    assert!(short
        .1
        .unwrap()
        .starts_with("invalid article: body_length: the article has 6 characters"),);
    assert_eq!(calls_for(&fake, "short twice").len(), 2);
    assert_eq!(fake.requests(), 1 + 1 + 2 + 2 + 2 + 2);
}

/// A refusal phrase (any case) and English where Hangul is asked for:
/// fixed by the second request, or `FAILED` with the check after two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_and_the_wrong_script_are_asked_once_more() {
    let db = TestDb::new().await;
    db.set("article_reject_phrases", "As an AI | 죄송하지만")
        .await;
    db.set("article_script", "hangul").await;
    const REFUSAL: &str = "죄송합니다\n\nas an AI language model, I cannot write this.";
    let answers: &'static [(&str, &str, &str)] = &[
        ("refusal fixed", REFUSAL, KOREAN),
        (
            "refusal twice",
            REFUSAL,
            "제목\n\n죄송하지만 이 기사는 쓸 수 없습니다.",
        ),
        ("english fixed", GOOD, KOREAN),
        ("english twice", GOOD, GOOD),
    ];
    let fake = fake(answers).await;
    let titles: Vec<&str> = answers.iter().map(|(t, _, _)| *t).collect();
    let ids = write_all(&db, &fake, &titles).await;

    let fixed = outcome(&db, ids[0]).await;
    assert_eq!(fixed.0, "DONE");
    assert_eq!(fixed.3.unwrap().0, "시의회 예산안 통과");
    let calls = calls_for(&fake, "refusal fixed");
    assert_eq!(calls.len(), 2);
    let fix = calls[1]["messages"][3]["content"].as_str().unwrap();
    assert!(fix.contains("\"As an AI\""), "{fix}");

    let refused = outcome(&db, ids[1]).await;
    assert_eq!(refused.0, "FAILED");
    assert_eq!(
        refused.1.as_deref(),
        Some(
            "invalid article: reject_phrase: it contains \"죄송하지만\"; write the article itself"
        )
    );
    assert_eq!(calls_for(&fake, "refusal twice").len(), 2);

    let english = outcome(&db, ids[2]).await;
    assert_eq!(english.0, "DONE");
    let calls = calls_for(&fake, "english fixed");
    assert_eq!(calls.len(), 2);
    let fix = calls[1]["messages"][3]["content"].as_str().unwrap();
    assert!(fix.contains("write it in Korean"), "{fix}");

    let english = outcome(&db, ids[3]).await;
    assert_eq!(english.0, "FAILED");
    let error = english.1.unwrap();
    assert!(
        error.starts_with("invalid article: script: only 0 of the article's"),
        "{error}"
    );
    assert_eq!(calls_for(&fake, "english twice").len(), 2);
    assert_eq!(fake.requests(), 8);
}

/// Hangul sent decomposed (conjoining jamo, several code points a
/// syllable) is measured and stored after NFC: a headline of 20 syllables
/// fits `article_headline_max_chars = 20` though it is 48 code points long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decomposed_hangul_is_measured_and_stored_after_nfc() {
    let db = TestDb::new().await;
    db.set("article_headline_max_chars", "20").await;
    db.set("article_script", "hangul").await;
    let headline = "서울시의회가 이천이십오년 예산안을 통과시키다";
    assert_eq!(headline.chars().count(), 24);
    let headline: String = headline.chars().filter(|c| *c != ' ').take(20).collect();
    let decomposed: String = headline.nfd().collect();
    assert!(
        decomposed.chars().count() > 40,
        "{}",
        decomposed.chars().count()
    );
    let body: String = "시의회가 예산안을 통과시켰다.".nfd().collect();
    let answer: &'static str = Box::leak(format!("{decomposed}\n\n{body}").into_boxed_str());
    let too_long: String = format!("{headline}다").nfd().collect();
    let too_long: &'static str = Box::leak(format!("{too_long}\n\n{body}").into_boxed_str());
    let answers: &'static [(&str, &str, &str)] = Box::leak(Box::new([
        ("decomposed", answer, "unused"),
        ("decomposed long", too_long, too_long),
    ]));
    let fake = fake(answers).await;
    let ids = write_all(&db, &fake, &["decomposed", "decomposed long"]).await;
    let stored = outcome(&db, ids[0]).await;
    assert_eq!(stored.0, "DONE");
    let (stored_headline, stored_body) = stored.3.unwrap();
    assert_eq!(stored_headline, headline, "stored in NFC");
    assert_eq!(stored_body, "시의회가 예산안을 통과시켰다.");
    assert_eq!(calls_for(&fake, "decomposed").len(), 1);
    let long = outcome(&db, ids[1]).await;
    assert_eq!(
        long.1.as_deref(),
        Some("invalid article: headline_length: the headline has 21 characters; at most 20 are allowed")
    );
    assert_eq!(calls_for(&fake, "decomposed long").len(), 2);
}

/// The new settings are refused with the reason when they cannot be used.
#[tokio::test]
async fn bad_answer_settings_are_refused_with_the_reason() {
    let db = TestDb::new().await;
    let client = db.pool.get().await.unwrap();
    let refused = |key: &'static str, value: &'static str| {
        let client = &client;
        async move {
            newsnack::db::setting::set(client, key, value)
                .await
                .expect_err(&format!("{key} = {value:?} should be refused"))
                .to_string()
        }
    };
    let error = refused("article_script", "latin").await;
    assert!(
        error.contains("setting \"article_script\" must be one of any, hangul, got \"latin\""),
        "{error}"
    );
    let error = refused("llm_fallback_for", "feed").await;
    assert!(
        error.contains("must be one of briefing, all, none"),
        "{error}"
    );
    for value in ["As an AI||I cannot", "As an AI|", "|"] {
        let error = refused("article_reject_phrases", value).await;
        assert!(error.contains("holds an empty phrase"), "{value}: {error}");
    }
    let error = refused("article_headline_max_chars", "0").await;
    assert!(error.contains("must be between 1 and 10000"), "{error}");
    let error = refused("llm_daily_token_budget", "-1").await;
    assert!(error.contains("must be between 0 and"), "{error}");
    // Stored normalised: choices in lower case, phrases trimmed.
    assert_eq!(
        newsnack::db::setting::set(&client, "article_script", " HANGUL ")
            .await
            .unwrap(),
        "hangul"
    );
    assert_eq!(
        newsnack::db::setting::set(&client, "article_reject_phrases", " As an AI |  I cannot ")
            .await
            .unwrap(),
        "As an AI|I cannot"
    );
    assert_eq!(
        newsnack::db::setting::set(&client, "article_reject_phrases", "")
            .await
            .unwrap(),
        ""
    );
    // Every new setting starts at its default, as the binary knows it.
    let settings = newsnack::settings::Settings::load(&db.pool).await.unwrap();
    let defaults = newsnack::settings::Settings::default();
    assert_eq!(settings.llm_fallback_for, defaults.llm_fallback_for);
    assert_eq!(settings.llm_daily_token_budget, 0);
    assert_eq!(settings.llm_briefing_reserve_tokens, 0);
    assert_eq!(
        (
            settings.article_headline_max_chars,
            settings.article_body_min_chars,
            settings.article_body_max_chars
        ),
        (120, 1, 20000)
    );
}
