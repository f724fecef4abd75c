//! Writers turn an issue's title and body into an article: the [`Writer`]
//! trait, the retryable/fatal split of what can go wrong ([`WriteError`]),
//! the configuration read from `NEWSNACK_LLM_*` ([`WriterConfig`]), and
//! [`build`], which picks the OpenAI-compatible client when a URL is set and
//! the built-in offline writer otherwise.
//!
//! | module | owns |
//! |---|---|
//! | [`openai`] | the chat-completions client, its prompts and reply parsing |
//! | [`offline`] | the deterministic writer that needs no network |
//! | [`checks`] | the checks an answer passes before it is stored, and unwrapping a JSON answer |

pub mod checks;
pub mod offline;
pub mod openai;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::db::issue::ClaimedIssue;
use crate::model::llm::{Provider, TokenUsage};

pub use offline::OfflineWriter;
pub use openai::OpenAiWriter;

/// Where the OpenAI-compatible API lives, e.g. `http://localhost:11434/v1`.
/// Unset or empty: the offline writer.
pub const ENV_LLM_URL: &str = "NEWSNACK_LLM_URL";
/// The model to ask for; [`DEFAULT_MODEL`] when unset or empty.
pub const ENV_LLM_MODEL: &str = "NEWSNACK_LLM_MODEL";
/// Sent as `Authorization: Bearer <key>` when set and not empty.
pub const ENV_LLM_API_KEY: &str = "NEWSNACK_LLM_API_KEY";
/// Whole seconds one request may take; [`DEFAULT_TIMEOUT`] when unset or empty.
pub const ENV_LLM_TIMEOUT_S: &str = "NEWSNACK_LLM_TIMEOUT_S";
/// A second OpenAI-compatible API, called while the first is down; unset
/// or empty: none.
pub const ENV_LLM_FALLBACK_URL: &str = "NEWSNACK_LLM_FALLBACK_URL";
/// The fallback's model; `NEWSNACK_LLM_MODEL`'s when unset or empty.
pub const ENV_LLM_FALLBACK_MODEL: &str = "NEWSNACK_LLM_FALLBACK_MODEL";
/// The fallback's key, sent as `Authorization: Bearer <key>` when set.
pub const ENV_LLM_FALLBACK_API_KEY: &str = "NEWSNACK_LLM_FALLBACK_API_KEY";

pub const DEFAULT_MODEL: &str = "gpt-4o-mini";
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// What a writer that asks a model sends it: the settings
/// `llm_system_prompt` and `llm_user_prompt` (a template in which `{title}`
/// and `{body}` stand for the issue's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prompts<'a> {
    pub system: &'a str,
    pub user_template: &'a str,
}

impl Prompts<'static> {
    /// The prompts the settings start with.
    pub const DEFAULT: Prompts<'static> = Prompts {
        system: openai::SYSTEM_PROMPT,
        user_template: openai::USER_PROMPT_TEMPLATE,
    };
}

/// What a writer is given: the text of one issue, and the prompts to ask
/// for its article with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IssueText<'a> {
    pub id: i64,
    pub title: &'a str,
    pub body: &'a str,
    pub prompts: Prompts<'a>,
}

impl<'a> IssueText<'a> {
    /// The issue, with `prompts`.
    pub fn new(issue: &'a ClaimedIssue, prompts: Prompts<'a>) -> Self {
        IssueText {
            id: issue.id,
            title: &issue.title,
            body: &issue.body,
            prompts,
        }
    }
}

/// Tokens a chat message's framing may add (role, separators), beyond its
/// text: a few in every chat format; counted generously.
const FRAMING_TOKENS: i64 = 8;

/// An upper bound of the tokens `texts`, sent or received as chat
/// messages, cost, for an API that reports no usage: a byte-level BPE
/// token stands for at least one byte of text, so a message costs at most
/// its UTF-8 bytes plus its framing (docs/architecture.md, "The day's
/// tokens").
pub fn token_bound(texts: &[&str]) -> i64 {
    texts
        .iter()
        .map(|text| text.len() as i64 + FRAMING_TOKENS)
        .sum()
}

impl IssueText<'_> {
    /// [`token_bound`] of the first request's messages: the system prompt
    /// and the user prompt made from the issue.
    pub fn prompt_token_bound(&self) -> i64 {
        let user = openai::user_prompt(self.prompts.user_template, self.title, self.body);
        token_bound(&[self.prompts.system, &user])
    }
}

/// What a writer produces. `body` holds paragraphs separated by a blank line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Article {
    pub headline: String,
    pub body: String,
    pub usage: TokenUsage,
    /// The model's answer as it came, before it was read into headline and
    /// body (empty for a writer that asks no model): what a second request
    /// shows the model of its first answer.
    pub answer: String,
}

/// What went wrong, as a short label for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WriteErrorKind {
    /// HTTP 429.
    RateLimited,
    /// HTTP 5xx, or 425 Too Early (the server asks for the request again).
    ServerError,
    /// The request took longer than the configured timeout (or HTTP 408).
    Timeout,
    /// No connection could be made: refused, unresolvable, connect timeout.
    Connect,
    /// The connection broke after it was made.
    Transport,
    /// HTTP 401 or 403: the key is missing or wrong.
    Unauthorized,
    /// Any other HTTP 4xx (or an unexpected status): the request is wrong.
    BadRequest,
    /// A 2xx answer that is not the expected JSON.
    Malformed,
    /// A 2xx answer without any text to use.
    Empty,
    /// A 2xx answer cut off at the token limit or withheld by a content
    /// filter (`finish_reason` `length` or `content_filter`).
    Incomplete,
    /// An answer that failed a check, asked again, and failed again.
    InvalidArticle,
}

impl WriteErrorKind {
    /// Whether the provider, not the request, failed: 429, 5xx, a timeout,
    /// no connection, a broken one. Such a failure counts toward marking
    /// the provider down, and the call may go to the fallback.
    pub fn provider_down(self) -> bool {
        matches!(
            self,
            WriteErrorKind::RateLimited
                | WriteErrorKind::ServerError
                | WriteErrorKind::Timeout
                | WriteErrorKind::Connect
                | WriteErrorKind::Transport
        )
    }

    /// Whether the model may have read the prompt, and so billed it: the
    /// request was sent and no refusal came back (a timeout, a broken
    /// connection, a 2xx answer that could not be used). A 429, 5xx, 4xx
    /// or a connection never made cost nothing.
    pub fn may_have_billed(self) -> bool {
        matches!(
            self,
            WriteErrorKind::Timeout
                | WriteErrorKind::Transport
                | WriteErrorKind::Malformed
                | WriteErrorKind::Empty
                | WriteErrorKind::Incomplete
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            WriteErrorKind::RateLimited => "rate_limited",
            WriteErrorKind::ServerError => "server_error",
            WriteErrorKind::Timeout => "timeout",
            WriteErrorKind::Connect => "connect",
            WriteErrorKind::Transport => "transport",
            WriteErrorKind::Unauthorized => "unauthorized",
            WriteErrorKind::BadRequest => "bad_request",
            WriteErrorKind::Malformed => "malformed",
            WriteErrorKind::Empty => "empty",
            WriteErrorKind::Incomplete => "incomplete",
            WriteErrorKind::InvalidArticle => "invalid_article",
        }
    }
}

impl fmt::Display for WriteErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a writer produced no article. Reasons never contain the API key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    /// Worth another attempt later: 429 (with the server's Retry-After if
    /// any), 5xx, timeouts, connection errors, malformed bodies.
    /// `pauses_everyone`: the server asked every caller to wait
    /// `retry_after` (a 429 or 503 with Retry-After): the quota failed, not
    /// the article, and every instance pauses its calls.
    #[error("retryable: {reason}")]
    Retryable {
        kind: WriteErrorKind,
        reason: String,
        retry_after: Option<Duration>,
        pauses_everyone: bool,
    },
    /// Will fail again: other 4xx, empty content, an answer cut off or
    /// filtered.
    #[error("fatal: {reason}")]
    Fatal {
        kind: WriteErrorKind,
        reason: String,
    },
    /// An answer that failed a check, asked again with the reason, failed
    /// a check again (see [`checks`]): not retried automatically.
    #[error("invalid article: {0}")]
    InvalidArticle(checks::Rejection),
}

impl WriteError {
    pub fn retryable(
        kind: WriteErrorKind,
        reason: impl Into<String>,
        retry_after: Option<Duration>,
    ) -> Self {
        WriteError::Retryable {
            kind,
            reason: reason.into(),
            retry_after,
            pauses_everyone: false,
        }
    }

    /// A retryable failure that asks every caller to wait `retry_after`.
    pub fn pausing(kind: WriteErrorKind, reason: impl Into<String>, retry_after: Duration) -> Self {
        WriteError::Retryable {
            kind,
            reason: reason.into(),
            retry_after: Some(retry_after),
            pauses_everyone: true,
        }
    }

    pub fn fatal(kind: WriteErrorKind, reason: impl Into<String>) -> Self {
        WriteError::Fatal {
            kind,
            reason: reason.into(),
        }
    }

    pub fn is_retryable(&self) -> bool {
        matches!(self, WriteError::Retryable { .. })
    }

    /// How long the server asked us to wait, if it said.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            WriteError::Retryable { retry_after, .. } => *retry_after,
            WriteError::Fatal { .. } | WriteError::InvalidArticle(_) => None,
        }
    }

    /// How long every instance should pause its LLM calls, when the server
    /// asked every caller to wait (see [`WriteError::pausing`]).
    pub fn pause(&self) -> Option<Duration> {
        match self {
            WriteError::Retryable {
                retry_after,
                pauses_everyone: true,
                ..
            } => *retry_after,
            _ => None,
        }
    }

    /// The short label for metrics; `kind().as_str()` gives the text.
    pub fn kind(&self) -> WriteErrorKind {
        match self {
            WriteError::Retryable { kind, .. } | WriteError::Fatal { kind, .. } => *kind,
            WriteError::InvalidArticle(_) => WriteErrorKind::InvalidArticle,
        }
    }

    pub fn reason(&self) -> &str {
        match self {
            WriteError::Retryable { reason, .. } | WriteError::Fatal { reason, .. } => reason,
            WriteError::InvalidArticle(rejection) => &rejection.detail,
        }
    }
}

/// Something that writes an article about an issue.
pub trait Writer: Send + Sync + 'static {
    /// A short name recorded with each article: `"offline"`, or the
    /// provider and the model (`"primary:<model>"`, `"fallback:<model>"`).
    fn name(&self) -> &str;

    /// Whether each write is a call to a language model, to be made within
    /// the LLM budget all instances share (`llm_max_in_flight`, the
    /// priorities, a rate limit's pause). Writers that need no model (the
    /// offline writer) are bounded by `generation_concurrency` alone.
    fn calls_llm(&self) -> bool {
        false
    }

    fn write<'a>(&'a self, issue: IssueText<'a>) -> BoxFuture<'a, Result<Article, WriteError>>;

    /// Asks again after `first` failed a check: the conversation so far,
    /// `first`'s answer, and `problem` (what to fix). A writer that asks
    /// no model writes as before.
    fn write_again<'a>(
        &'a self,
        issue: IssueText<'a>,
        first: &'a Article,
        problem: &'a str,
    ) -> BoxFuture<'a, Result<Article, WriteError>> {
        let _ = (first, problem);
        self.write(issue)
    }
}

/// A writer shared by every task that generates articles.
pub type SharedWriter = Arc<dyn Writer>;

/// The writers of a service: the primary provider's, and the fallback's
/// when one is configured.
#[derive(Clone)]
pub struct Writers {
    pub primary: SharedWriter,
    pub fallback: Option<SharedWriter>,
}

impl From<SharedWriter> for Writers {
    /// One provider, no fallback.
    fn from(primary: SharedWriter) -> Writers {
        Writers {
            primary,
            fallback: None,
        }
    }
}

impl<W: Writer> From<Arc<W>> for Writers {
    /// One provider, no fallback.
    fn from(primary: Arc<W>) -> Writers {
        Writers {
            primary,
            fallback: None,
        }
    }
}

/// How to reach the language model, if at all.
#[derive(Clone, PartialEq, Eq)]
pub struct WriterConfig {
    /// Base URL of an OpenAI-compatible API; `None` selects the offline writer.
    pub llm_url: Option<String>,
    pub model: String,
    pub api_key: Option<String>,
    /// The most one request may take, connecting and reading included.
    pub timeout: Duration,
    /// A second API, called while the first is down.
    pub fallback: Option<FallbackConfig>,
}

/// Where the fallback provider lives (`NEWSNACK_LLM_FALLBACK_*`); the
/// timeout is the primary's.
#[derive(Clone, PartialEq, Eq)]
pub struct FallbackConfig {
    pub llm_url: String,
    pub model: String,
    pub api_key: Option<String>,
}

impl Default for WriterConfig {
    /// The offline writer.
    fn default() -> Self {
        WriterConfig {
            llm_url: None,
            model: DEFAULT_MODEL.to_string(),
            api_key: None,
            timeout: DEFAULT_TIMEOUT,
            fallback: None,
        }
    }
}

/// Shows everything but the API key, so a logged config leaks nothing.
impl fmt::Debug for WriterConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriterConfig")
            .field("llm_url", &self.llm_url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("timeout", &self.timeout)
            .field("fallback", &self.fallback)
            .finish()
    }
}

/// Shows everything but the API key.
impl fmt::Debug for FallbackConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FallbackConfig")
            .field("llm_url", &self.llm_url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// A writer configuration that cannot work. Messages are one line and never
/// contain the API key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriterConfigError {
    #[error("{ENV_LLM_URL} {value:?} is not a valid URL: {reason}")]
    InvalidUrl { value: String, reason: String },
    #[error("{ENV_LLM_URL} must be an http:// or https:// URL, got scheme {scheme:?}")]
    UnsupportedScheme { scheme: String },
    #[error("{ENV_LLM_TIMEOUT_S} must be a positive whole number of seconds, got {value:?}")]
    InvalidTimeout { value: String },
    #[error("{ENV_LLM_MODEL} must not be empty")]
    EmptyModel,
    #[error("{ENV_LLM_API_KEY} holds characters an HTTP header cannot carry")]
    InvalidApiKey,
    #[error("{ENV_LLM_FALLBACK_MODEL} must not be empty")]
    EmptyFallbackModel,
    #[error("{ENV_LLM_FALLBACK_API_KEY} holds characters an HTTP header cannot carry")]
    InvalidFallbackApiKey,
    #[error("{ENV_LLM_FALLBACK_URL} is set but {ENV_LLM_URL} is not: a fallback needs a primary provider")]
    FallbackWithoutPrimary,
    #[error("{var} is not valid UTF-8")]
    NotUnicode { var: &'static str },
    #[error("cannot build the HTTP client: {0}")]
    HttpClient(String),
}

impl WriterConfig {
    /// From `NEWSNACK_LLM_URL`, `NEWSNACK_LLM_MODEL` (default
    /// [`DEFAULT_MODEL`]), `NEWSNACK_LLM_API_KEY` and
    /// `NEWSNACK_LLM_TIMEOUT_S` (default 60). Empty values count as unset.
    pub fn from_env() -> Result<Self, WriterConfigError> {
        for var in [
            ENV_LLM_URL,
            ENV_LLM_MODEL,
            ENV_LLM_API_KEY,
            ENV_LLM_TIMEOUT_S,
            ENV_LLM_FALLBACK_URL,
            ENV_LLM_FALLBACK_MODEL,
            ENV_LLM_FALLBACK_API_KEY,
        ] {
            if let Err(std::env::VarError::NotUnicode(_)) = std::env::var(var) {
                return Err(WriterConfigError::NotUnicode { var });
            }
        }
        WriterConfig::from_vars(|name| std::env::var(name).ok())
    }

    /// Like [`WriterConfig::from_env`], reading variables through `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, WriterConfigError> {
        let set = |name: &str| {
            var(name)
                .map(|value| value.trim().to_string())
                .filter(|value| !value.is_empty())
        };
        let llm_url = match set(ENV_LLM_URL) {
            Some(url) => {
                parse_llm_url(&url)?;
                Some(url)
            }
            None => None,
        };
        let model = set(ENV_LLM_MODEL).unwrap_or_else(|| DEFAULT_MODEL.to_string());
        let api_key = set(ENV_LLM_API_KEY);
        let timeout = match set(ENV_LLM_TIMEOUT_S) {
            Some(value) => parse_timeout_s(&value)?,
            None => DEFAULT_TIMEOUT,
        };
        let fallback = match set(ENV_LLM_FALLBACK_URL) {
            Some(_) if llm_url.is_none() => return Err(WriterConfigError::FallbackWithoutPrimary),
            Some(url) => {
                parse_llm_url(&url).map_err(|e| e.for_fallback())?;
                Some(FallbackConfig {
                    llm_url: url,
                    model: set(ENV_LLM_FALLBACK_MODEL).unwrap_or_else(|| model.clone()),
                    api_key: set(ENV_LLM_FALLBACK_API_KEY),
                })
            }
            None => None,
        };
        Ok(WriterConfig {
            llm_url,
            model,
            api_key,
            timeout,
            fallback,
        })
    }
}

/// Parses and checks the base URL of an OpenAI-compatible API.
pub fn parse_llm_url(value: &str) -> Result<reqwest::Url, WriterConfigError> {
    let url = reqwest::Url::parse(value.trim()).map_err(|err| WriterConfigError::InvalidUrl {
        value: value.to_string(),
        reason: err.to_string(),
    })?;
    match url.scheme() {
        "http" | "https" => Ok(url),
        other => Err(WriterConfigError::UnsupportedScheme {
            scheme: other.to_string(),
        }),
    }
}

fn parse_timeout_s(value: &str) -> Result<Duration, WriterConfigError> {
    match value.parse::<u64>() {
        Ok(seconds) if seconds > 0 => Ok(Duration::from_secs(seconds)),
        _ => Err(WriterConfigError::InvalidTimeout {
            value: value.to_string(),
        }),
    }
}

/// The OpenAI-compatible client when a URL is set, else the offline writer.
pub fn build(config: &WriterConfig) -> Result<SharedWriter, WriterConfigError> {
    match config.llm_url.as_deref() {
        Some(url) => Ok(Arc::new(
            OpenAiWriter::new(url, config)?.for_provider(Provider::Primary),
        )),
        None => Ok(Arc::new(OfflineWriter)),
    }
}

/// The writers `config` describes: [`build`]'s and [`build_fallback`]'s.
pub fn build_all(config: &WriterConfig) -> Result<Writers, WriterConfigError> {
    Ok(Writers {
        primary: build(config)?,
        fallback: build_fallback(config)?,
    })
}

/// The fallback provider's client, when one is configured.
pub fn build_fallback(config: &WriterConfig) -> Result<Option<SharedWriter>, WriterConfigError> {
    let Some(fallback) = &config.fallback else {
        return Ok(None);
    };
    let own = WriterConfig {
        llm_url: Some(fallback.llm_url.clone()),
        model: fallback.model.clone(),
        api_key: fallback.api_key.clone(),
        timeout: config.timeout,
        fallback: None,
    };
    let writer = OpenAiWriter::new(&fallback.llm_url, &own)
        .map_err(WriterConfigError::for_fallback)?
        .for_provider(Provider::Fallback);
    Ok(Some(Arc::new(writer)))
}

impl WriterConfigError {
    /// The same problem, said of the fallback's variables.
    fn for_fallback(self) -> WriterConfigError {
        match self {
            WriterConfigError::InvalidUrl { value, reason } => WriterConfigError::InvalidUrl {
                value,
                reason: format!("{reason} (in {ENV_LLM_FALLBACK_URL})"),
            },
            WriterConfigError::UnsupportedScheme { scheme } => {
                WriterConfigError::UnsupportedScheme {
                    scheme: format!("{scheme} (in {ENV_LLM_FALLBACK_URL})"),
                }
            }
            WriterConfigError::EmptyModel => WriterConfigError::EmptyFallbackModel,
            WriterConfigError::InvalidApiKey => WriterConfigError::InvalidFallbackApiKey,
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn config(vars: &[(&str, &str)]) -> Result<WriterConfig, WriterConfigError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        WriterConfig::from_vars(|name| vars.get(name).cloned())
    }

    #[test]
    fn nothing_set_means_offline_with_defaults() {
        let config = config(&[]).unwrap();
        assert_eq!(config, WriterConfig::default());
        assert_eq!(config.model, "gpt-4o-mini");
        assert_eq!(config.timeout, Duration::from_secs(60));
        assert_eq!(build(&config).unwrap().name(), "offline");
    }

    #[test]
    fn empty_values_count_as_unset() {
        let config = config(&[
            (ENV_LLM_URL, ""),
            (ENV_LLM_MODEL, "  "),
            (ENV_LLM_API_KEY, ""),
            (ENV_LLM_TIMEOUT_S, ""),
        ])
        .unwrap();
        assert_eq!(config, WriterConfig::default());
    }

    #[test]
    fn everything_set() {
        let config = config(&[
            (ENV_LLM_URL, "http://localhost:11434/v1"),
            (ENV_LLM_MODEL, "llama3.2"),
            (ENV_LLM_API_KEY, "sk-secret\n"),
            (ENV_LLM_TIMEOUT_S, "5"),
        ])
        .unwrap();
        assert_eq!(config.llm_url.as_deref(), Some("http://localhost:11434/v1"));
        assert_eq!(config.model, "llama3.2");
        assert_eq!(config.api_key.as_deref(), Some("sk-secret"));
        assert_eq!(config.timeout, Duration::from_secs(5));
        assert_eq!(build(&config).unwrap().name(), "primary:llama3.2");
    }

    #[test]
    fn bad_urls_are_refused_with_a_clear_message() {
        let err = config(&[(ENV_LLM_URL, "not a url")]).unwrap_err();
        assert!(matches!(err, WriterConfigError::InvalidUrl { .. }), "{err}");
        assert!(
            err.to_string()
                .starts_with("NEWSNACK_LLM_URL \"not a url\""),
            "{err}"
        );

        let err = config(&[(ENV_LLM_URL, "ftp://example.com/v1")]).unwrap_err();
        assert_eq!(
            err,
            WriterConfigError::UnsupportedScheme {
                scheme: "ftp".into()
            }
        );
        // A forgotten scheme parses as a strange one.
        let err = config(&[(ENV_LLM_URL, "localhost:11434/v1")]).unwrap_err();
        assert!(
            matches!(err, WriterConfigError::UnsupportedScheme { .. }),
            "{err}"
        );
    }

    #[test]
    fn bad_timeouts_are_refused() {
        for value in ["0", "-3", "1.5", "soon", "99999999999999999999999"] {
            let err = config(&[(ENV_LLM_TIMEOUT_S, value)]).unwrap_err();
            assert_eq!(
                err,
                WriterConfigError::InvalidTimeout {
                    value: value.into()
                }
            );
            assert!(!err.to_string().contains('\n'));
        }
    }

    #[test]
    fn debug_output_hides_the_api_key() {
        let config = WriterConfig {
            api_key: Some("sk-very-secret".into()),
            ..WriterConfig::default()
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("sk-very-secret"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn error_accessors() {
        let err = WriteError::retryable(
            WriteErrorKind::RateLimited,
            "slow down",
            Some(Duration::from_secs(3)),
        );
        assert!(err.is_retryable());
        assert_eq!(err.retry_after(), Some(Duration::from_secs(3)));
        assert_eq!(err.kind().as_str(), "rate_limited");
        assert_eq!(err.to_string(), "retryable: slow down");

        let err = WriteError::fatal(WriteErrorKind::Empty, "empty content");
        assert!(!err.is_retryable());
        assert_eq!(err.retry_after(), None);
        assert_eq!(err.kind().to_string(), "empty");
        assert_eq!(err.to_string(), "fatal: empty content");
        assert_eq!(err.pause(), None);

        let err = WriteError::pausing(
            WriteErrorKind::RateLimited,
            "slow down",
            Duration::from_secs(3),
        );
        assert!(err.is_retryable());
        assert_eq!(err.pause(), Some(Duration::from_secs(3)));
        assert_eq!(err.retry_after(), Some(Duration::from_secs(3)));
    }

    #[test]
    fn issue_text_from_a_claimed_issue() {
        let claimed = ClaimedIssue {
            id: 7,
            claim_id: 1,
            attempts: 0,
            title: "Title".into(),
            body: "Body.".into(),
            lease_until: time::OffsetDateTime::UNIX_EPOCH,
            lease: std::time::Duration::from_secs(60),
            traceparent: None,
            retry: false,
        };
        let text = IssueText::new(&claimed, Prompts::DEFAULT);
        assert_eq!((text.id, text.title, text.body), (7, "Title", "Body."));
        assert_eq!(text.prompts, Prompts::DEFAULT);
    }
}
