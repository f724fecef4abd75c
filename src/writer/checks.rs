//! Checks an answer must pass before it is stored: the settings
//! `article_headline_max_chars`, `article_body_min_chars` and
//! `article_body_max_chars` (user-perceived characters, i.e. extended
//! grapheme clusters, after Unicode NFC), `article_reject_phrases` (matched
//! case-insensitively) and `article_script`; and the removal of a JSON
//! wrapper a model may put around its answer (code fences and a
//! `Headline:` label are removed where the answer is read, in
//! [`super::openai::parse_article`]).

use std::fmt;

use serde_json::Value;
use unicode_normalization::UnicodeNormalization;
use unicode_segmentation::UnicodeSegmentation;

use super::Article;

/// The script the body must be written in (setting `article_script`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Script {
    /// Any script.
    #[default]
    Any,
    /// At least half of the body's letters are Hangul.
    Hangul,
}

impl Script {
    /// The setting's value; `None` for anything else.
    pub fn parse(value: &str) -> Option<Script> {
        match value.trim().to_ascii_lowercase().as_str() {
            "any" => Some(Script::Any),
            "hangul" => Some(Script::Hangul),
            _ => None,
        }
    }
}

/// What an answer is checked against (from the settings).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArticleChecks {
    pub headline_max_chars: usize,
    pub body_min_chars: usize,
    pub body_max_chars: usize,
    /// Non-empty phrases, any of which rejects an answer.
    pub reject_phrases: Vec<String>,
    pub script: Script,
}

impl Default for ArticleChecks {
    /// The settings' defaults.
    fn default() -> Self {
        ArticleChecks {
            headline_max_chars: 120,
            body_min_chars: 1,
            body_max_chars: 20_000,
            reject_phrases: Vec::new(),
            script: Script::Any,
        }
    }
}

/// Which check an answer failed: the label of
/// `newsnack_articles_rejected_total{check=...}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Check {
    HeadlineLength,
    BodyLength,
    RejectPhrase,
    Script,
}

impl Check {
    pub const ALL: [Check; 4] = [
        Check::HeadlineLength,
        Check::BodyLength,
        Check::RejectPhrase,
        Check::Script,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Check::HeadlineLength => "headline_length",
            Check::BodyLength => "body_length",
            Check::RejectPhrase => "reject_phrase",
            Check::Script => "script",
        }
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an answer cannot be stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub check: Check,
    /// What is wrong, in words a model (and an operator) can act on.
    pub detail: String,
}

/// `<check>: <detail>`, e.g. `headline_length: the headline has 301
/// characters; at most 120 are allowed`.
impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.check, self.detail)
    }
}

impl Rejection {
    /// The message that asks the model again, after its first answer.
    pub fn request_again(&self) -> String {
        format!(
            "Your answer cannot be used: {}. Write the article again, fixing that: \
             the headline alone on the first line, then a blank line, then the article, \
             in plain text, with no labels, code fences or JSON.",
            self.detail
        )
    }
}

impl ArticleChecks {
    /// The article as it is stored (headline and body in NFC), or the first
    /// check it fails.
    pub fn check(&self, article: &Article) -> Result<Article, Rejection> {
        let headline: String = article.headline.nfc().collect();
        let body: String = article.body.nfc().collect();
        let headline_chars = headline.graphemes(true).count();
        if headline_chars > self.headline_max_chars {
            return Err(Rejection {
                check: Check::HeadlineLength,
                detail: format!(
                    "the headline has {headline_chars} characters; at most {} are allowed",
                    self.headline_max_chars
                ),
            });
        }
        let body_chars = body.graphemes(true).count();
        if body_chars < self.body_min_chars || body_chars > self.body_max_chars {
            return Err(Rejection {
                check: Check::BodyLength,
                detail: format!(
                    "the article has {body_chars} characters; it must have between {} and {}",
                    self.body_min_chars, self.body_max_chars
                ),
            });
        }
        if let Some(phrase) = self.rejected_phrase(&headline, &body) {
            return Err(Rejection {
                check: Check::RejectPhrase,
                detail: format!("it contains \"{phrase}\"; write the article itself"),
            });
        }
        if self.script == Script::Hangul {
            let (hangul, letters) = hangul_letters(&body);
            if hangul * 2 < letters {
                return Err(Rejection {
                    check: Check::Script,
                    detail: format!(
                        "only {hangul} of the article's {letters} letters are Hangul; write it in Korean"
                    ),
                });
            }
        }
        Ok(Article {
            headline,
            body,
            usage: article.usage,
            answer: article.answer.clone(),
        })
    }

    /// The first reject phrase the headline or the body contains, ignoring
    /// case.
    fn rejected_phrase(&self, headline: &str, body: &str) -> Option<&str> {
        if self.reject_phrases.is_empty() {
            return None;
        }
        let headline = headline.to_lowercase();
        let body = body.to_lowercase();
        self.reject_phrases
            .iter()
            .map(String::as_str)
            .find(|phrase| {
                let phrase: String = phrase.nfc().collect::<String>().to_lowercase();
                !phrase.is_empty() && (headline.contains(&phrase) || body.contains(&phrase))
            })
    }
}

/// The phrases of an `article_reject_phrases` value: split at `|`,
/// trimmed, empty ones left out.
pub fn reject_phrases(value: &str) -> Vec<String> {
    value
        .split('|')
        .map(str::trim)
        .filter(|phrase| !phrase.is_empty())
        .map(str::to_string)
        .collect()
}

/// How many of `text`'s letters are Hangul, and how many letters it has.
fn hangul_letters(text: &str) -> (usize, usize) {
    text.chars()
        .filter(|c| c.is_alphabetic())
        .fold((0, 0), |(hangul, letters), c| {
            (hangul + usize::from(is_hangul(c)), letters + 1)
        })
}

/// Whether `c` is of the Hangul script (Unicode's Scripts.txt).
fn is_hangul(c: char) -> bool {
    matches!(c,
        '\u{1100}'..='\u{11FF}'
        | '\u{302E}'..='\u{302F}'
        | '\u{3131}'..='\u{318E}'
        | '\u{3200}'..='\u{321E}'
        | '\u{3260}'..='\u{327E}'
        | '\u{A960}'..='\u{A97C}'
        | '\u{AC00}'..='\u{D7A3}'
        | '\u{D7B0}'..='\u{D7C6}'
        | '\u{D7CB}'..='\u{D7FB}'
        | '\u{FFA0}'..='\u{FFBE}'
        | '\u{FFC2}'..='\u{FFC7}'
        | '\u{FFCA}'..='\u{FFCF}'
        | '\u{FFD2}'..='\u{FFD7}'
        | '\u{FFDA}'..='\u{FFDC}')
}

/// The text inside a code fence that wraps all of `content` (a first line
/// of three backticks, with a language or not, and a last one), else
/// `content` itself.
pub fn without_fence(content: &str) -> &str {
    let trimmed = content.trim();
    let Some(opened) = trimmed.strip_prefix("```") else {
        return content;
    };
    let Some((_, inner)) = opened.split_once('\n') else {
        return content;
    };
    match inner.trim_end().strip_suffix("```") {
        Some(inner) => inner.trim(),
        None => content,
    }
}

/// The headline and body of an answer given as a JSON object with
/// `headline` and `body` (the body a string or a list of paragraphs),
/// fenced or not; `None` for any other answer.
pub fn json_article(content: &str) -> Option<(String, String)> {
    let inner = without_fence(content).trim();
    if !inner.starts_with('{') {
        return None;
    }
    let value: Value = serde_json::from_str(inner).ok()?;
    let headline = value.get("headline")?.as_str()?.trim().to_string();
    let body = match value.get("body")? {
        Value::String(body) => body.trim().to_string(),
        Value::Array(paragraphs) => paragraphs
            .iter()
            .map(|p| p.as_str().map(str::trim))
            .collect::<Option<Vec<&str>>>()?
            .join("\n\n"),
        _ => return None,
    };
    Some((headline, body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::llm::TokenUsage;

    fn article(headline: &str, body: &str) -> Article {
        Article {
            headline: headline.into(),
            body: body.into(),
            usage: TokenUsage::default(),
            answer: String::new(),
        }
    }

    #[test]
    fn lengths_count_user_perceived_characters_after_nfc() {
        let checks = ArticleChecks {
            headline_max_chars: 3,
            body_max_chars: 5,
            ..ArticleChecks::default()
        };
        // "한국어" written as conjoining jamo: 8 code points, 3 syllables.
        let decomposed: String = "한국어".nfd().collect();
        assert_eq!(decomposed.chars().count(), 8);
        let stored = checks
            .check(&article(&decomposed, "e\u{301}e\u{301}"))
            .unwrap();
        assert_eq!(stored.headline, "한국어", "stored in NFC");
        assert_eq!(stored.body, "éé");
        // An emoji with a skin tone is one character.
        assert!(checks.check(&article("👍🏽👍🏽👍🏽", "ok")).is_ok());
        let long = checks.check(&article("four", "ok")).unwrap_err();
        assert_eq!(long.check, Check::HeadlineLength);
        assert_eq!(
            long.to_string(),
            "headline_length: the headline has 4 characters; at most 3 are allowed"
        );
        assert_eq!(
            checks.check(&article("ok", "sixsix")).unwrap_err().check,
            Check::BodyLength
        );
        let short = ArticleChecks {
            body_min_chars: 10,
            ..ArticleChecks::default()
        };
        assert_eq!(
            short.check(&article("ok", "too short")).unwrap_err().check,
            Check::BodyLength
        );
    }

    #[test]
    fn reject_phrases_match_ignoring_case() {
        let checks = ArticleChecks {
            reject_phrases: reject_phrases(" As an AI | I cannot |"),
            ..ArticleChecks::default()
        };
        assert_eq!(checks.reject_phrases, ["As an AI", "I cannot"]);
        let refused = checks
            .check(&article("Sorry", "as an ai language model, I won't."))
            .unwrap_err();
        assert_eq!(refused.check, Check::RejectPhrase);
        assert!(
            refused.detail.contains("\"As an AI\""),
            "{}",
            refused.detail
        );
        assert!(checks
            .check(&article("Budget passes", "It passed."))
            .is_ok());
        assert!(reject_phrases("").is_empty());
    }

    #[test]
    fn hangul_needs_half_of_the_letters() {
        let checks = ArticleChecks {
            script: Script::Hangul,
            ..ArticleChecks::default()
        };
        assert!(checks
            .check(&article(
                "예산 통과",
                "시의회가 2025년 예산을 통과시켰다. GDP."
            ))
            .is_ok());
        let english = checks
            .check(&article("Budget", "The council passed the budget."))
            .unwrap_err();
        assert_eq!(english.check, Check::Script);
        // Decomposed Hangul counts once per syllable after NFC.
        let decomposed: String = "예산안 통과 OK".nfd().collect();
        assert!(checks.check(&article("예산", &decomposed)).is_ok());
        assert!(ArticleChecks::default()
            .check(&article("Budget", "The council passed the budget."))
            .is_ok());
        assert_eq!(Script::parse(" Hangul "), Some(Script::Hangul));
        assert_eq!(Script::parse("latin"), None);
    }

    #[test]
    fn the_metric_labels_are_the_checks() {
        assert_eq!(
            Check::ALL.map(Check::as_str),
            crate::metrics::ARTICLE_CHECKS
        );
    }

    #[test]
    fn json_answers_are_unwrapped() {
        assert_eq!(
            json_article("{\"headline\": \" Budget \", \"body\": \"One.\\n\\nTwo.\"}"),
            Some(("Budget".into(), "One.\n\nTwo.".into()))
        );
        assert_eq!(
            json_article("```json\n{\"headline\": \"B\", \"body\": [\"One.\", \"Two.\"]}\n```\n"),
            Some(("B".into(), "One.\n\nTwo.".into()))
        );
        assert_eq!(json_article("{\"title\": \"B\", \"body\": \"x\"}"), None);
        assert_eq!(json_article("Budget\n\n{not json}"), None);
        assert_eq!(without_fence("```\nA\n\nB\n```"), "A\n\nB");
        assert_eq!(without_fence("```A```"), "```A```");
    }
}
