//! The writers end to end: the OpenAI-compatible client against a local fake
//! server (answers, headers, every failure mapped onto retryable or fatal),
//! and the offline writer's determinism.

#[path = "common/fake_llm.rs"]
mod fake_llm;

use std::time::Duration;

use fake_llm::{FakeLlm, Reply};
use newsnack::model::llm::TokenUsage;
use newsnack::writer::{
    self, Article, IssueText, Prompts, SharedWriter, WriteError, WriteErrorKind, WriterConfig,
};
use serde_json::json;

const TITLE: &str = "Council approves budget";
const BODY: &str = "The city council approved the 2025 budget on Monday. The vote was 7 to 2.";
const API_KEY: &str = "sk-test-0123456789";

fn issue() -> IssueText<'static> {
    IssueText {
        id: 42,
        title: TITLE,
        body: BODY,
        prompts: Prompts::DEFAULT,
    }
}

fn config(url: &str) -> WriterConfig {
    WriterConfig {
        llm_url: Some(url.to_string()),
        model: "test-model".to_string(),
        api_key: None,
        timeout: Duration::from_secs(10),
        fallback: None,
    }
}

fn client(url: &str) -> SharedWriter {
    writer::build(&config(url)).expect("build the client")
}

/// Waits for `fut` at most `secs` seconds, failing the test with `what`.
async fn within<T>(secs: u64, what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), fut)
        .await
        .unwrap_or_else(|_| panic!("timed out after {secs}s waiting for {what}"))
}

async fn write(writer: &SharedWriter) -> Result<Article, WriteError> {
    within(20, "the writer", writer.write(issue())).await
}

/// The error a write gets when the server answers 200 with `body`.
async fn error_for_answer(body: String) -> WriteError {
    let fake = FakeLlm::start(move |_, _| Reply::Custom {
        status: 200,
        retry_after: None,
        body: body.clone(),
    })
    .await;
    write_error(&client(&fake.url)).await
}

async fn write_error(writer: &SharedWriter) -> WriteError {
    write(writer).await.expect_err("the write should fail")
}

#[tokio::test]
async fn a_good_answer_becomes_headline_and_body() {
    let fake = FakeLlm::always(
        "**Council passes 2025 budget**\n\nThe council voted 7 to 2.\n\nSpending rises.",
    )
    .await;
    let writer = client(&fake.url);
    assert_eq!(writer.name(), "primary:test-model");

    let article = write(&writer).await.unwrap();
    assert_eq!(
        article,
        Article {
            headline: "Council passes 2025 budget".into(),
            body: "The council voted 7 to 2.\n\nSpending rises.".into(),
            // As the API reported it.
            usage: TokenUsage {
                prompt_tokens: Some(1),
                completion_tokens: Some(1),
            },
            // The answer as it came, for a second request.
            answer:
                "**Council passes 2025 budget**\n\nThe council voted 7 to 2.\n\nSpending rises."
                    .into(),
        }
    );

    assert_eq!(fake.requests(), 1);
    assert_eq!(fake.last_authorization(), None, "no key, no header");
    let request = fake.last_request().unwrap();
    assert_eq!(request["model"], "test-model");
    assert_eq!(request["temperature"], 0.4);
    let messages = request["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0]["role"], "system");
    assert_eq!(messages[0]["content"], writer::openai::SYSTEM_PROMPT);
    assert_eq!(messages[1]["role"], "user");
    let user = messages[1]["content"].as_str().unwrap();
    assert!(user.contains(TITLE) && user.contains(BODY), "{user}");
}

#[tokio::test]
async fn a_single_paragraph_takes_the_issue_title() {
    let fake = FakeLlm::always("The council voted 7 to 2 on Monday.").await;
    let article = write(&client(&fake.url)).await.unwrap();
    assert_eq!(article.headline, TITLE);
    assert_eq!(article.body, "The council voted 7 to 2 on Monday.");
}

#[tokio::test]
async fn the_bearer_header_is_sent_when_a_key_is_set() {
    let fake = FakeLlm::always("Headline\n\nBody.").await;
    let writer = writer::build(&WriterConfig {
        api_key: Some(API_KEY.into()),
        ..config(&fake.url)
    })
    .unwrap();
    write(&writer).await.unwrap();
    assert_eq!(
        fake.last_authorization().as_deref(),
        Some(format!("Bearer {API_KEY}").as_str())
    );
}

#[tokio::test]
async fn a_base_url_with_a_trailing_slash_works() {
    let fake = FakeLlm::always("Headline\n\nBody.").await;
    let writer = client(&format!("{}/", fake.url));
    write(&writer).await.unwrap();
    assert_eq!(fake.requests(), 1);
}

#[tokio::test]
async fn rate_limited_is_retryable_with_the_servers_wait() {
    let fake = FakeLlm::start(|_, _| Reply::RateLimited { retry_after_s: 7 }).await;
    let err = write_error(&client(&fake.url)).await;
    assert!(err.is_retryable(), "{err}");
    assert_eq!(err.kind(), WriteErrorKind::RateLimited);
    assert_eq!(err.kind().as_str(), "rate_limited");
    assert_eq!(err.retry_after(), Some(Duration::from_secs(7)));
    assert!(err.to_string().contains("429"), "{err}");
}

#[tokio::test]
async fn retry_after_may_be_an_http_date() {
    let format = time::macros::format_description!(
        "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
    );
    let at = (time::OffsetDateTime::now_utc() + Duration::from_secs(120))
        .format(&format)
        .unwrap();
    let fake = FakeLlm::start(move |_, _| Reply::Custom {
        status: 503,
        retry_after: Some(at.clone()),
        body: "overloaded".into(),
    })
    .await;
    let err = write_error(&client(&fake.url)).await;
    assert_eq!(err.kind(), WriteErrorKind::ServerError);
    let wait = err.retry_after().expect("a Retry-After");
    assert!(
        wait > Duration::from_secs(100) && wait <= Duration::from_secs(120),
        "{wait:?}"
    );
}

#[tokio::test]
async fn server_errors_are_retryable() {
    let fake = FakeLlm::start(|_, _| Reply::ServerError).await;
    let err = write_error(&client(&fake.url)).await;
    assert!(err.is_retryable(), "{err}");
    assert_eq!(err.kind(), WriteErrorKind::ServerError);
    assert_eq!(err.retry_after(), None);
    assert!(err.to_string().contains("500"), "{err}");
}

#[tokio::test]
async fn a_hanging_server_times_out_retryably() {
    let fake = FakeLlm::start(|_, _| Reply::Hang).await;
    let writer = writer::build(&WriterConfig {
        timeout: Duration::from_secs(1),
        fallback: None,
        ..config(&fake.url)
    })
    .unwrap();
    let started = std::time::Instant::now();
    let err = write_error(&writer).await;
    assert!(err.is_retryable(), "{err}");
    assert_eq!(err.kind(), WriteErrorKind::Timeout);
    assert!(err.to_string().contains("timed out after 1s"), "{err}");
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert_eq!(fake.requests(), 1);
    within(10, "the fake to stop", fake.stopped()).await;
}

#[tokio::test]
async fn a_body_that_is_not_json_fails_the_attempt_and_is_retried() {
    let fake = FakeLlm::start(|_, _| Reply::Malformed).await;
    let err = write_error(&client(&fake.url)).await;
    assert!(err.is_retryable(), "{err}");
    assert_eq!(err.kind(), WriteErrorKind::Malformed);
    assert!(err.to_string().contains("malformed response"), "{err}");
}

#[tokio::test]
async fn a_completion_without_content_is_malformed_and_retried() {
    let fake = FakeLlm::start(|_, _| Reply::Custom {
        status: 200,
        retry_after: None,
        body: r#"{"choices":[{"index":0,"finish_reason":"stop"}]}"#.into(),
    })
    .await;
    let err = write_error(&client(&fake.url)).await;
    assert!(err.is_retryable(), "{err}");
    assert_eq!(err.kind(), WriteErrorKind::Malformed);
    assert!(err.to_string().contains("malformed response"), "{err}");
}

#[tokio::test]
async fn an_answer_cut_off_or_filtered_is_fatal_not_an_article() {
    for finish in ["length", "content_filter"] {
        let body = json!({ "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": "Markets rally\n\nStocks rose and" },
            "finish_reason": finish,
        }]})
        .to_string();
        let err = error_for_answer(body).await;
        assert!(!err.is_retryable(), "{err}");
        assert_eq!(err.kind(), WriteErrorKind::Incomplete);
        assert!(err.to_string().contains(finish), "{err}");
    }
}

#[tokio::test]
async fn an_error_relayed_with_200_is_retryable_when_it_says_so() {
    let cases = [
        (
            json!({ "error": { "code": 429, "message": "slow down" } }),
            Some(WriteErrorKind::RateLimited),
        ),
        (
            json!({ "error": { "code": "503", "message": "upstream down" } }),
            Some(WriteErrorKind::ServerError),
        ),
        (
            json!({ "error": { "type": "rate_limit_exceeded", "message": "quota" } }),
            Some(WriteErrorKind::RateLimited),
        ),
        (
            json!({ "error": { "type": "invalid_request_error", "message": "bad model" } }),
            None,
        ),
    ];
    for (body, retryable_as) in cases {
        let err = error_for_answer(body.to_string()).await;
        match retryable_as {
            Some(kind) => {
                assert!(err.is_retryable(), "{body}: {err}");
                assert_eq!(err.kind(), kind, "{body}");
            }
            None => {
                assert!(!err.is_retryable(), "{body}: {err}");
                assert_eq!(err.kind(), WriteErrorKind::BadRequest, "{body}");
            }
        }
    }
}

#[tokio::test]
async fn json_cut_short_is_a_retryable_transport_error() {
    let cut_short = r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"Markets ra"#;
    let err = error_for_answer(cut_short.into()).await;
    assert!(err.is_retryable(), "{err}");
    assert_eq!(err.kind(), WriteErrorKind::Transport);
    // An empty body is no answer at all, not one cut short: malformed
    // (retried as well, until max_attempts).
    let err = error_for_answer(String::new()).await;
    assert!(err.is_retryable(), "{err}");
    assert_eq!(err.kind(), WriteErrorKind::Malformed);
}

#[tokio::test]
async fn empty_choices_are_fatal() {
    let fake = FakeLlm::start(|_, _| Reply::EmptyChoices).await;
    let err = write_error(&client(&fake.url)).await;
    assert!(!err.is_retryable(), "{err}");
    assert_eq!(err.kind(), WriteErrorKind::Empty);
    assert!(err.to_string().contains("empty content"), "{err}");
}

#[tokio::test]
async fn whitespace_content_is_fatal() {
    let fake = FakeLlm::always("  \n\n \t ").await;
    let err = write_error(&client(&fake.url)).await;
    assert!(!err.is_retryable(), "{err}");
    assert_eq!(err.kind(), WriteErrorKind::Empty);
    assert!(err.to_string().contains("empty content"), "{err}");
}

#[tokio::test]
async fn a_bad_request_is_fatal_with_status_and_snippet() {
    let fake = FakeLlm::start(|_, _| Reply::BadRequest).await;
    let err = write_error(&client(&fake.url)).await;
    assert!(!err.is_retryable(), "{err}");
    assert_eq!(err.kind(), WriteErrorKind::BadRequest);
    let text = err.to_string();
    assert!(text.contains("400"), "{text}");
    assert!(text.contains("Invalid value for 'temperature'"), "{text}");
}

#[tokio::test]
async fn error_bodies_are_truncated_and_never_show_the_key() {
    let fake = FakeLlm::start(|_, _| Reply::Custom {
        status: 401,
        retry_after: None,
        body: format!(
            "Incorrect API key provided: {API_KEY}. {}",
            "x".repeat(5000)
        ),
    })
    .await;
    let writer = writer::build(&WriterConfig {
        api_key: Some(API_KEY.into()),
        ..config(&fake.url)
    })
    .unwrap();
    let err = write_error(&writer).await;
    assert!(!err.is_retryable(), "{err}");
    assert_eq!(err.kind(), WriteErrorKind::Unauthorized);
    let text = err.to_string();
    assert!(!text.contains(API_KEY), "{text}");
    assert!(
        text.contains("401") && text.contains("<redacted>"),
        "{text}"
    );
    assert!(text.chars().count() < 300, "{text}");
}

#[tokio::test]
async fn a_stopped_server_is_retryable() {
    let fake = FakeLlm::always("Headline\n\nBody.").await;
    let used = client(&fake.url);
    write(&used).await.unwrap();
    within(10, "the fake to stop", fake.stopped()).await;

    // A fresh client must connect, and is refused.
    let err = write_error(&client(&fake.url)).await;
    assert!(err.is_retryable(), "{err}");
    assert_eq!(err.kind(), WriteErrorKind::Connect, "{err}");
    assert!(err.to_string().contains("could not connect"), "{err}");

    // A client that had a pooled connection fails retryably too.
    let err = write_error(&used).await;
    assert!(err.is_retryable(), "{err}");
    assert_eq!(fake.requests(), 1);
}

#[tokio::test]
async fn one_client_serves_concurrent_writes() {
    // Echo the issue's title back as the headline.
    let fake = FakeLlm::start(|_, request| {
        let user = request["messages"][1]["content"].as_str().unwrap_or("");
        let title = user
            .lines()
            .find_map(|line| line.strip_prefix("Title: "))
            .unwrap_or("?");
        Reply::Ok(format!("{title}\n\nStory about {title}."))
    })
    .await;
    let writer = client(&fake.url);
    let titles: Vec<String> = (0..16).map(|i| format!("Story {i}")).collect();
    let writes = titles.iter().enumerate().map(|(i, title)| {
        let writer = writer.clone();
        async move {
            writer
                .write(IssueText {
                    id: i as i64,
                    title,
                    body: "",
                    prompts: Prompts::DEFAULT,
                })
                .await
        }
    });
    let articles = within(30, "concurrent writes", futures::future::join_all(writes)).await;
    for (title, article) in titles.iter().zip(articles) {
        let article = article.unwrap();
        assert_eq!(&article.headline, title);
        assert_eq!(article.body, format!("Story about {title}."));
    }
    assert_eq!(fake.requests(), 16);
}

#[tokio::test]
async fn the_offline_writer_is_deterministic() {
    let writer = writer::build(&WriterConfig::default()).unwrap();
    assert_eq!(writer.name(), "offline");
    let first = write(&writer).await.unwrap();
    let second = write(&writer).await.unwrap();
    assert_eq!(first, second);
    assert_eq!(first.headline, TITLE);
    assert!(first.body.starts_with(BODY), "{}", first.body);
    assert!(first.body.ends_with(writer::offline::CLOSING_LINE));

    let empty = within(
        5,
        "the offline writer",
        writer.write(IssueText {
            id: 1,
            title: "Quiet day",
            body: "",
            prompts: Prompts::DEFAULT,
        }),
    )
    .await
    .unwrap();
    assert_eq!(empty.headline, "Quiet day");
    assert!(!empty.body.trim().is_empty());
}
