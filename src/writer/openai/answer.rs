//! The chat-completions answer: its first choice's text and the usage it
//! reports, every malformed or refused answer mapped onto a failure, and
//! the short, redacted snippet of a body that goes into a reason.

use serde_json::Value;

use crate::model::llm::TokenUsage;
use crate::writer::{WriteError, WriteErrorKind};

/// How much of an error body goes into a reason.
const SNIPPET_CHARS: usize = 200;

/// The text of the first choice of a chat-completions answer, and the
/// usage it reports.
pub(super) fn completion(
    body: &[u8],
    secret: Option<&str>,
) -> Result<(String, TokenUsage), WriteError> {
    // Malformed answers fail the attempt and are retried until
    // `max_attempts`, as the contract says: a gateway's HTML page or a
    // garbled reply is usually a passing fault, and the retry budget bounds
    // the cost when it is not.
    let malformed = |what: String| {
        WriteError::retryable(
            WriteErrorKind::Malformed,
            format!("malformed response: {what}"),
            None,
        )
    };
    let value: Value = serde_json::from_slice(body).map_err(|err| {
        let started = body.iter().any(|b| !b.is_ascii_whitespace());
        if err.classify() == serde_json::error::Category::Eof && started {
            // JSON cut short: the connection ended early without a framing
            // error. A network fault, not the model's answer (an empty
            // body, though, is what the server meant to send).
            WriteError::retryable(
                WriteErrorKind::Transport,
                format!("the response was cut short ({err})"),
                None,
            )
        } else {
            malformed(format!("not JSON ({err}): {:?}", snippet(body, secret)))
        }
    })?;
    let Some(choices) = value.get("choices") else {
        return Err(
            match value.pointer("/error/message").and_then(Value::as_str) {
                Some(message) => {
                    let what =
                        format!("no choices, error: {}", snippet(message.as_bytes(), secret));
                    // Gateways relay an upstream's rate limit or outage this way,
                    // with HTTP 200.
                    // Any other error (a model that does not exist, a bad
                    // parameter) is the request's fault, as a 4xx would be.
                    match error_in_body_kind(&value) {
                        Some(kind) => WriteError::retryable(kind, what, None),
                        None => WriteError::fatal(WriteErrorKind::BadRequest, what),
                    }
                }
                None => malformed("no choices".to_string()),
            },
        );
    };
    let choices = choices
        .as_array()
        .ok_or_else(|| malformed("choices is not an array".to_string()))?;
    let Some(first) = choices.first() else {
        return Err(WriteError::fatal(
            WriteErrorKind::Empty,
            "empty content: no choices",
        ));
    };
    let content = first
        .pointer("/message/content")
        .ok_or_else(|| malformed("no choices[0].message.content".to_string()))?;
    let text = match content {
        Value::String(text) => text.clone(),
        Value::Null => String::new(),
        // Content given as parts: [{"type":"text","text":"..."}].
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect(),
        _ => {
            return Err(malformed(
                "choices[0].message.content is not text".to_string(),
            ))
        }
    };
    let finish = first.get("finish_reason").and_then(Value::as_str);
    if text.trim().is_empty() {
        let reason = match finish {
            Some(finish) => format!("empty content (finish_reason: {finish})"),
            None => "empty content".to_string(),
        };
        return Err(WriteError::fatal(WriteErrorKind::Empty, reason));
    }
    // A reply cut off at the token limit, or withheld by a filter, is not
    // an article; stored, it could never be replaced (one per issue).
    if let Some(finish) = finish
        .filter(|f| f.eq_ignore_ascii_case("length") || f.eq_ignore_ascii_case("content_filter"))
    {
        return Err(WriteError::fatal(
            WriteErrorKind::Incomplete,
            format!("incomplete answer (finish_reason: {finish})"),
        ));
    }
    Ok((text, reported_usage(&value)))
}

/// `usage.prompt_tokens` and `usage.completion_tokens`, each when it is a
/// whole number an `integer` column holds.
fn reported_usage(value: &Value) -> TokenUsage {
    let tokens = |field: &str| {
        value
            .pointer(&format!("/usage/{field}"))
            .and_then(Value::as_u64)
            .and_then(|n| i32::try_from(n).ok())
    };
    TokenUsage {
        prompt_tokens: tokens("prompt_tokens"),
        completion_tokens: tokens("completion_tokens"),
    }
}

/// For an error object in a 200 answer: the retryable kind its code or type
/// names (a rate limit, a server error, a timeout), if any.
fn error_in_body_kind(value: &Value) -> Option<WriteErrorKind> {
    let code = value.pointer("/error/code");
    let status = code
        .and_then(|c| c.as_u64().or_else(|| c.as_str()?.parse().ok()))
        .unwrap_or(0);
    let named = |word: &str| {
        [code, value.pointer("/error/type")]
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .any(|text| text.to_ascii_lowercase().contains(word))
    };
    if status == 429 || named("rate_limit") {
        Some(WriteErrorKind::RateLimited)
    } else if (500..600).contains(&status) || named("server_error") || named("overloaded") {
        Some(WriteErrorKind::ServerError)
    } else if status == 408 || named("timeout") {
        Some(WriteErrorKind::Timeout)
    } else {
        None
    }
}

/// A body as one short line for a reason: whitespace collapsed, the secret
/// redacted, cut at [`SNIPPET_CHARS`] characters.
pub(super) fn snippet(body: &[u8], secret: Option<&str>) -> String {
    let text = String::from_utf8_lossy(body);
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let text = redact(&text, secret);
    match text.char_indices().nth(SNIPPET_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

pub(super) fn redact(text: &str, secret: Option<&str>) -> String {
    match secret {
        Some(secret) if !secret.is_empty() => text.replace(secret, "<redacted>"),
        _ => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_finds_the_first_choice() {
        let body = br#"{"choices":[{"message":{"role":"assistant","content":"Hi\n\nThere."}}]}"#;
        assert_eq!(
            completion(body, None).unwrap(),
            ("Hi\n\nThere.".to_string(), TokenUsage::default())
        );
        let parts = br#"{"choices":[{"message":{"content":[{"type":"text","text":"A"},{"type":"text","text":"B"}]}}]}"#;
        assert_eq!(completion(parts, None).unwrap().0, "AB");
    }

    #[test]
    fn usage_is_taken_as_reported() {
        let body = br#"{"choices":[{"message":{"content":"A"}}],"usage":{"prompt_tokens":120,"completion_tokens":45,"total_tokens":165}}"#;
        assert_eq!(
            completion(body, None).unwrap().1,
            TokenUsage {
                prompt_tokens: Some(120),
                completion_tokens: Some(45)
            }
        );
        // Missing, negative, fractional or too large: not known.
        let body = br#"{"choices":[{"message":{"content":"A"}}],"usage":{"prompt_tokens":-1,"completion_tokens":9999999999}}"#;
        assert_eq!(completion(body, None).unwrap().1, TokenUsage::default());
        let body = br#"{"choices":[{"message":{"content":"A"}}],"usage":{"completion_tokens":7}}"#;
        assert_eq!(
            completion(body, None).unwrap().1,
            TokenUsage {
                prompt_tokens: None,
                completion_tokens: Some(7)
            }
        );
    }

    #[test]
    fn completion_failures_are_retried_unless_empty_or_refused() {
        let kind_and_reason = |body: &[u8]| {
            let err = completion(body, Some("sk-secret")).unwrap_err();
            assert_eq!(
                err.is_retryable(),
                err.kind() == WriteErrorKind::Malformed,
                "malformed answers, and only they, are retried: {err}"
            );
            (err.kind(), err.reason().to_string())
        };
        let (kind, reason) = kind_and_reason(b"<html>sk-secret oops</html>");
        assert_eq!(kind, WriteErrorKind::Malformed);
        assert!(
            reason.starts_with("malformed response: not JSON"),
            "{reason}"
        );
        assert!(!reason.contains("sk-secret"), "{reason}");

        for body in [
            &br#"{"id":"x"}"#[..],
            br#"{"choices":{}}"#,
            br#"{"choices":[{"text":"legacy"}]}"#,
            br#"{"choices":[{"message":{"content":42}}]}"#,
        ] {
            let (kind, reason) = kind_and_reason(body);
            assert_eq!(kind, WriteErrorKind::Malformed, "{reason}");
            assert!(reason.starts_with("malformed response: "), "{reason}");
        }
        let (kind, reason) = kind_and_reason(br#"{"error":{"message":"model not found"}}"#);
        assert_eq!(kind, WriteErrorKind::BadRequest, "{reason}");
        assert!(reason.ends_with("error: model not found"), "{reason}");

        for body in [
            &br#"{"choices":[]}"#[..],
            br#"{"choices":[{"message":{"content":"  \n "}}]}"#,
            br#"{"choices":[{"message":{"content":null},"finish_reason":"content_filter"}]}"#,
        ] {
            let (kind, reason) = kind_and_reason(body);
            assert_eq!(kind, WriteErrorKind::Empty, "{reason}");
            assert!(reason.starts_with("empty content"), "{reason}");
        }
    }

    #[test]
    fn snippets_are_short_single_line_and_redacted() {
        let body = format!("bad key sk-secret\n\n{}", "x".repeat(1000));
        let snippet = snippet(body.as_bytes(), Some("sk-secret"));
        assert!(snippet.starts_with("bad key <redacted> xxx"), "{snippet}");
        assert_eq!(snippet.chars().count(), SNIPPET_CHARS + 1);
        assert!(snippet.ends_with('…'));
        assert_eq!(
            super::snippet("é".repeat(300).as_bytes(), None)
                .chars()
                .count(),
            201
        );
    }
}
