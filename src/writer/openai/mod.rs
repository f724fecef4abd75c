//! The OpenAI-compatible chat-completions client: the default prompts and
//! the user prompt's template, the one pooled `reqwest::Client`, the
//! mapping of every failure onto retryable or fatal (a 429 or 503 with
//! `Retry-After` asks every instance to pause); the answer's body is read
//! in `answer.rs` (text and token usage) and the model's text becomes an
//! article in `article.rs`.
//!
//! Works with any server speaking `POST {base}/chat/completions` (OpenAI,
//! Ollama, vLLM, llama.cpp, LiteLLM, ...). The API key only ever travels in
//! the `Authorization` header: it is redacted from every error reason.

use std::time::Duration;

use crate::model::llm::TokenUsage;
use futures::future::BoxFuture;
use reqwest::header::{HeaderMap, HeaderValue, AUTHORIZATION, RETRY_AFTER};
use reqwest::{StatusCode, Url};
use serde::Serialize;
use time::OffsetDateTime;

mod answer;
mod article;

pub use article::parse_article;

use answer::{completion, redact, snippet};

use super::{
    parse_llm_url, Article, IssueText, WriteError, WriteErrorKind, Writer, WriterConfig,
    WriterConfigError,
};

/// What the model is told it is: the default of the `llm_system_prompt`
/// setting (migration 17 holds the same text).
pub const SYSTEM_PROMPT: &str = "You are a news writer for newsnack, a daily news briefing. \
Write in a neutral, factual news tone. Use only the facts in the material you are given: \
never invent names, numbers, quotes or dates. Answer in plain text, without Markdown.";

/// What the model is asked to do, with the issue's title and details: the
/// default of the `llm_user_prompt` setting (migration 17 holds the same
/// text). `{title}` and `{body}` stand for the issue's.
pub const USER_PROMPT_TEMPLATE: &str = "Write a headline and a short news article \
(3 to 5 short paragraphs) about the story below.\n\
Answer with the headline alone on the first line, then a blank line, then the article, \
with a blank line between paragraphs. Do not add labels such as \"Headline:\".\n\n\
Title: {title}\n\nDetails:\n{body}";

/// Stands in for an issue without details.
const NO_DETAILS: &str = "(no further details)";

/// Low enough for sober prose, high enough not to repeat itself.
pub const TEMPERATURE: f64 = 0.4;

/// The longest wait for a TCP (and TLS) connection, within the request timeout.
const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Larger answers are refused rather than buffered.
const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;

/// Writes articles with an OpenAI-compatible chat-completions API.
pub struct OpenAiWriter {
    client: reqwest::Client,
    endpoint: Url,
    model: String,
    name: String,
    authorization: Option<HeaderValue>,
    /// Kept only to redact it from error reasons.
    api_key: Option<String>,
    timeout: Duration,
    connect_timeout: Duration,
}

impl std::fmt::Debug for OpenAiWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiWriter")
            .field("endpoint", &self.endpoint.as_str())
            .field("model", &self.model)
            .field("has_api_key", &self.api_key.is_some())
            .field("timeout", &self.timeout)
            .finish()
    }
}

#[derive(Serialize)]
struct ChatRequest<'a> {
    model: &'a str,
    messages: Vec<ChatMessage<'a>>,
    temperature: f64,
}

#[derive(Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    content: &'a str,
}

impl OpenAiWriter {
    /// A client for the API at `base_url` (e.g. `https://api.openai.com/v1`),
    /// with the model, key and timeout of `config`.
    pub fn new(base_url: &str, config: &WriterConfig) -> Result<Self, WriterConfigError> {
        let endpoint = chat_completions_url(base_url)?;
        let model = config.model.trim().to_string();
        if model.is_empty() {
            return Err(WriterConfigError::EmptyModel);
        }
        if config.timeout.is_zero() {
            return Err(WriterConfigError::InvalidTimeout {
                value: "0".to_string(),
            });
        }
        let api_key = config
            .api_key
            .as_deref()
            .map(str::trim)
            .filter(|key| !key.is_empty())
            .map(str::to_string);
        let authorization = match &api_key {
            Some(key) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
                    .map_err(|_| WriterConfigError::InvalidApiKey)?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        let connect_timeout = config.timeout.min(MAX_CONNECT_TIMEOUT);
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(connect_timeout)
            .user_agent(concat!("newsnack/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|err| WriterConfigError::HttpClient(err.without_url().to_string()))?;
        Ok(OpenAiWriter {
            client,
            endpoint,
            name: format!("openai:{model}"),
            model,
            authorization,
            api_key,
            timeout: config.timeout,
            connect_timeout,
        })
    }

    /// Names the writer after `provider` and its model, as articles record
    /// it (`primary:<model>`, `fallback:<model>`).
    pub fn for_provider(mut self, provider: crate::model::llm::Provider) -> Self {
        self.name = format!("{}:{}", provider.as_str(), self.model);
        self
    }

    /// Where requests go: `{base_url}/chat/completions`.
    pub fn endpoint(&self) -> &Url {
        &self.endpoint
    }

    /// Asks for `issue`'s article; after a first answer that failed a
    /// check, `again` holds that answer and what to fix, sent as the
    /// assistant's message and a user message after the first two.
    async fn write_issue(
        &self,
        issue: IssueText<'_>,
        again: Option<(&str, &str)>,
    ) -> Result<Article, WriteError> {
        let user_prompt = user_prompt(issue.prompts.user_template, issue.title, issue.body);
        let mut messages = vec![
            ChatMessage {
                role: "system",
                content: issue.prompts.system,
            },
            ChatMessage {
                role: "user",
                content: &user_prompt,
            },
        ];
        if let Some((answer, problem)) = again {
            messages.push(ChatMessage {
                role: "assistant",
                content: answer,
            });
            messages.push(ChatMessage {
                role: "user",
                content: problem,
            });
        }
        let request = ChatRequest {
            model: &self.model,
            messages,
            temperature: TEMPERATURE,
        };
        let mut builder = self.client.post(self.endpoint.clone()).json(&request);
        if let Some(authorization) = &self.authorization {
            builder = builder.header(AUTHORIZATION, authorization.clone());
        }
        let span = crate::telemetry::llm_call_span(&self.model, &self.name);
        let result = tracing::Instrument::instrument(self.send(builder), span.clone()).await;
        match &result {
            Ok((_, usage)) => crate::telemetry::llm_call_ended(
                &span,
                Ok((usage.prompt_tokens, usage.completion_tokens)),
            ),
            Err(err) => crate::telemetry::llm_call_ended(&span, Err(&err.kind())),
        }
        if let Err(err) = &result {
            tracing::debug!(
                issue = issue.id,
                writer = %self.name,
                kind = %err.kind(),
                error = %err,
                "writing failed"
            );
        }
        result.and_then(|(content, usage)| {
            let mut article = parse_article(&content, issue.title).ok_or_else(|| {
                WriteError::fatal(WriteErrorKind::Empty, "empty content: no article text")
            })?;
            article.usage = usage;
            article.answer = content;
            Ok(article)
        })
    }

    /// Sends the request; the text of the first choice and the usage
    /// reported, or why there is no text.
    async fn send(
        &self,
        builder: reqwest::RequestBuilder,
    ) -> Result<(String, TokenUsage), WriteError> {
        let mut response = builder
            .send()
            .await
            .map_err(|err| self.transport_error(err))?;
        let status = response.status();
        let secret = self.api_key.as_deref();
        if status.is_success() {
            let (body, complete) = read_capped(&mut response)
                .await
                .map_err(|err| self.transport_error(err))?;
            if !complete {
                return Err(WriteError::retryable(
                    WriteErrorKind::Malformed,
                    format!(
                        "malformed response: body larger than {} MiB",
                        MAX_RESPONSE_BYTES >> 20
                    ),
                    None,
                ));
            }
            return completion(&body, secret);
        }
        let retry_after = retry_after(response.headers(), OffsetDateTime::now_utc());
        // The status decides; a body that cannot be read only loses the snippet.
        let body = read_capped(&mut response)
            .await
            .map(|(body, _)| body)
            .unwrap_or_default();
        Err(status_error(status, retry_after, &snippet(&body, secret)))
    }

    fn transport_error(&self, err: reqwest::Error) -> WriteError {
        let err = err.without_url();
        let detail = redact(&error_chain(&err), self.api_key.as_deref());
        if err.is_connect() {
            if err.is_timeout() {
                return WriteError::retryable(
                    WriteErrorKind::Connect,
                    format!("could not connect within {}", seconds(self.connect_timeout)),
                    None,
                );
            }
            return WriteError::retryable(
                WriteErrorKind::Connect,
                format!("could not connect: {detail}"),
                None,
            );
        }
        if err.is_timeout() {
            return WriteError::retryable(
                WriteErrorKind::Timeout,
                format!("timed out after {}", seconds(self.timeout)),
                None,
            );
        }
        if err.is_builder() || err.is_redirect() {
            return WriteError::fatal(
                WriteErrorKind::BadRequest,
                format!("request failed: {detail}"),
            );
        }
        WriteError::retryable(
            WriteErrorKind::Transport,
            format!("connection failed: {detail}"),
            None,
        )
    }
}

impl Writer for OpenAiWriter {
    fn name(&self) -> &str {
        &self.name
    }

    fn calls_llm(&self) -> bool {
        true
    }

    fn write<'a>(&'a self, issue: IssueText<'a>) -> BoxFuture<'a, Result<Article, WriteError>> {
        Box::pin(self.write_issue(issue, None))
    }

    fn write_again<'a>(
        &'a self,
        issue: IssueText<'a>,
        first: &'a Article,
        problem: &'a str,
    ) -> BoxFuture<'a, Result<Article, WriteError>> {
        Box::pin(self.write_issue(issue, Some((&first.answer, problem))))
    }
}

/// `{base}/chat/completions`, whether `base` ends with a slash or not; a
/// base that already names the endpoint is kept. The query is kept too.
pub fn chat_completions_url(base: &str) -> Result<Url, WriterConfigError> {
    let mut url = parse_llm_url(base)?;
    url.set_fragment(None);
    if url
        .path()
        .trim_end_matches('/')
        .ends_with("/chat/completions")
    {
        return Ok(url);
    }
    url.path_segments_mut()
        .map_err(|()| WriterConfigError::InvalidUrl {
            value: base.to_string(),
            reason: "it cannot be a base URL".to_string(),
        })?
        .pop_if_empty()
        .extend(["chat", "completions"]);
    Ok(url)
}

/// The user message: `template` with `{title}` and `{body}` replaced by
/// the issue's (trimmed; an empty body reads "(no further details)"), in
/// one pass, so a title that itself says `{body}` stays as it is.
pub fn user_prompt(template: &str, title: &str, body: &str) -> String {
    let body = body.trim();
    let body = if body.is_empty() { NO_DETAILS } else { body };
    let title = title.trim();
    let mut prompt = String::with_capacity(template.len() + title.len() + body.len());
    let mut rest = template;
    while let Some(at) = rest.find('{') {
        prompt.push_str(&rest[..at]);
        let tail = &rest[at..];
        if let Some(after) = tail.strip_prefix("{title}") {
            prompt.push_str(title);
            rest = after;
        } else if let Some(after) = tail.strip_prefix("{body}") {
            prompt.push_str(body);
            rest = after;
        } else {
            prompt.push('{');
            rest = &tail[1..];
        }
    }
    prompt.push_str(rest);
    prompt
}

/// Reads the body, up to [`MAX_RESPONSE_BYTES`]; `false` if there was more.
async fn read_capped(response: &mut reqwest::Response) -> Result<(Vec<u8>, bool), reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
            let room = MAX_RESPONSE_BYTES - body.len();
            body.extend_from_slice(&chunk[..room]);
            return Ok((body, false));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((body, true))
}

/// The error for a status that is not a success.
fn status_error(status: StatusCode, retry_after: Option<Duration>, snippet: &str) -> WriteError {
    let reason = |what: &str| {
        if snippet.is_empty() {
            format!("{what} (HTTP {status})")
        } else {
            format!("{what} (HTTP {status}): {snippet}")
        }
    };
    // The account's quota, not this article: a 429 or 503 that says how
    // long to wait asks every caller to wait.
    let quota = |kind: WriteErrorKind, what: &str| match retry_after {
        Some(wait) => WriteError::pausing(kind, reason(what), wait),
        None => WriteError::retryable(kind, reason(what), None),
    };
    match status {
        StatusCode::TOO_MANY_REQUESTS => quota(WriteErrorKind::RateLimited, "rate limited"),
        StatusCode::SERVICE_UNAVAILABLE => quota(WriteErrorKind::ServerError, "server error"),
        StatusCode::REQUEST_TIMEOUT => WriteError::retryable(
            WriteErrorKind::Timeout,
            reason("server timed out"),
            retry_after,
        ),
        StatusCode::TOO_EARLY => WriteError::retryable(
            WriteErrorKind::ServerError,
            reason("server asked to retry later"),
            retry_after,
        ),
        s if s.is_server_error() => WriteError::retryable(
            WriteErrorKind::ServerError,
            reason("server error"),
            retry_after,
        ),
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
            WriteError::fatal(WriteErrorKind::Unauthorized, reason("not authorized"))
        }
        _ => WriteError::fatal(WriteErrorKind::BadRequest, reason("request refused")),
    }
}

/// The `Retry-After` header: delta-seconds or an HTTP-date.
fn retry_after(headers: &HeaderMap, now: OffsetDateTime) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?;
    parse_retry_after(value, now)
}

/// The longest `Retry-After` honoured: a server asking for more is retried
/// after a day (and may say so again).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 60 * 60);

/// `"120"` or an HTTP-date in any of its three forms (`"Sun, 06 Nov 1994
/// 08:49:37 GMT"`, the obsolete `"Sunday, 06-Nov-94 08:49:37 GMT"` and
/// `"Sun Nov  6 08:49:37 1994"`); a date in the past means now; at most
/// [`MAX_RETRY_AFTER`].
pub fn parse_retry_after(value: &str, now: OffsetDateTime) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Too many digits for a u64 is still "a very long time".
        let seconds = value.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(seconds).min(MAX_RETRY_AFTER));
    }
    let at = OffsetDateTime::from(httpdate::parse_http_date(value).ok()?);
    Some(
        Duration::try_from(at - now)
            .unwrap_or(Duration::ZERO)
            .min(MAX_RETRY_AFTER),
    )
}

/// An error and its causes, without repeating a cause its parent already says.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// `60s`, or `1500ms` when not whole seconds.
fn seconds(duration: Duration) -> String {
    if duration.subsec_nanos() == 0 {
        format!("{}s", duration.as_secs())
    } else {
        format!("{}ms", duration.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_onto_retryable_or_fatal() {
        let wait = Some(Duration::from_secs(5));
        let cases = [
            (429, true, WriteErrorKind::RateLimited),
            (408, true, WriteErrorKind::Timeout),
            (425, true, WriteErrorKind::ServerError),
            (500, true, WriteErrorKind::ServerError),
            (503, true, WriteErrorKind::ServerError),
            (400, false, WriteErrorKind::BadRequest),
            (404, false, WriteErrorKind::BadRequest),
            (422, false, WriteErrorKind::BadRequest),
            (401, false, WriteErrorKind::Unauthorized),
            (403, false, WriteErrorKind::Unauthorized),
            (302, false, WriteErrorKind::BadRequest),
        ];
        for (code, retryable, kind) in cases {
            let status = StatusCode::from_u16(code).unwrap();
            let err = status_error(status, wait, "details");
            assert_eq!(err.is_retryable(), retryable, "{code}");
            assert_eq!(err.kind(), kind, "{code}");
            assert_eq!(err.retry_after(), if retryable { wait } else { None });
            assert!(err.reason().contains(&code.to_string()), "{err}");
            assert!(err.reason().ends_with(": details"), "{err}");
            // Only a 429 or a 503 that says how long asks everyone to wait.
            let pauses = [429, 503].contains(&code);
            assert_eq!(err.pause(), if pauses { wait } else { None }, "{code}");
            assert_eq!(status_error(status, None, "details").pause(), None);
        }
    }

    #[test]
    fn retry_after_seconds_or_date() {
        let now = time::macros::datetime!(2015-10-21 07:28:00 UTC);
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        // Far-off answers wait a day at most.
        assert_eq!(parse_retry_after("100000000", now), Some(MAX_RETRY_AFTER));
        assert_eq!(
            parse_retry_after("99999999999999999999999", now),
            Some(MAX_RETRY_AFTER),
            "too many digits for a u64 is still a long time"
        );
        assert_eq!(
            parse_retry_after("Fri, 01 Jan 2100 00:00:00 GMT", now),
            Some(MAX_RETRY_AFTER)
        );
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:30:00 GMT", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        // The obsolete forms a server may still send (RFC 9110, 5.6.7).
        assert_eq!(
            parse_retry_after("Wednesday, 21-Oct-15 07:30:00 GMT", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after("Wed Oct 21 07:30:00 2015", now),
            Some(Duration::from_secs(120))
        );
        for junk in ["-1", "1.5", "soon", "", "Wed, 21 Oct 2015 07:30:00 CET"] {
            assert_eq!(parse_retry_after(junk, now), None, "{junk:?}");
        }
    }

    #[test]
    fn endpoint_joins_with_or_without_a_slash() {
        for (base, endpoint) in [
            (
                "http://localhost:11434/v1",
                "http://localhost:11434/v1/chat/completions",
            ),
            (
                "http://localhost:11434/v1/",
                "http://localhost:11434/v1/chat/completions",
            ),
            (
                "https://api.openai.com/v1",
                "https://api.openai.com/v1/chat/completions",
            ),
            (
                "http://127.0.0.1:8080",
                "http://127.0.0.1:8080/chat/completions",
            ),
            (
                "http://127.0.0.1:8080/",
                "http://127.0.0.1:8080/chat/completions",
            ),
            (
                "https://x.example/openai/v1/chat/completions",
                "https://x.example/openai/v1/chat/completions",
            ),
            (
                "https://x.example/v1?api-version=2024-01#frag",
                "https://x.example/v1/chat/completions?api-version=2024-01",
            ),
        ] {
            assert_eq!(
                chat_completions_url(base).unwrap().as_str(),
                endpoint,
                "{base}"
            );
        }
        assert!(chat_completions_url("mailto:x@example.com").is_err());
    }

    #[test]
    fn writer_name_and_checks() {
        let config = WriterConfig {
            model: "llama3.2".into(),
            api_key: Some("sk-secret".into()),
            ..WriterConfig::default()
        };
        let writer = OpenAiWriter::new("http://localhost:11434/v1", &config).unwrap();
        assert_eq!(writer.name(), "openai:llama3.2");
        assert!(!format!("{writer:?}").contains("sk-secret"));

        let no_model = WriterConfig {
            model: " ".into(),
            ..WriterConfig::default()
        };
        assert_eq!(
            OpenAiWriter::new("http://x/v1", &no_model).unwrap_err(),
            WriterConfigError::EmptyModel
        );
        let bad_key = WriterConfig {
            api_key: Some("line\nbreak".into()),
            ..WriterConfig::default()
        };
        assert_eq!(
            OpenAiWriter::new("http://x/v1", &bad_key).unwrap_err(),
            WriterConfigError::InvalidApiKey
        );
        let no_time = WriterConfig {
            timeout: Duration::ZERO,
            ..WriterConfig::default()
        };
        assert!(matches!(
            OpenAiWriter::new("http://x/v1", &no_time).unwrap_err(),
            WriterConfigError::InvalidTimeout { .. }
        ));
    }

    #[test]
    fn the_prompt_carries_title_and_body() {
        let prompt = user_prompt(USER_PROMPT_TEMPLATE, "  A title ", "\nThe body.\n");
        assert!(prompt.starts_with("Write a headline and a short news article"));
        assert!(prompt.ends_with("Title: A title\n\nDetails:\nThe body."));
        assert!(user_prompt(USER_PROMPT_TEMPLATE, "t", "  ").ends_with(NO_DETAILS));
    }

    #[test]
    fn the_template_is_filled_in_one_pass() {
        assert_eq!(
            user_prompt(
                "다음 기사를 한국어로: {title} / {body} {x} {",
                "T {body}",
                "B"
            ),
            "다음 기사를 한국어로: T {body} / B {x} {"
        );
        assert_eq!(user_prompt("{body}{title}{body}", "t", "b"), "btb");
    }
}
