//! The model's text as an article: headline and body, wrappers and
//! labels a model adds taken off.

use crate::model::llm::TokenUsage;
use crate::writer::{checks, Article};

/// A first line longer than this is prose, not a headline.
const MAX_HEADLINE_CHARS: usize = 200;

/// Turns the model's text into an article: the first line is the headline,
/// the rest the body. Strips code fences, Markdown heading and bold marks
/// and `Headline:` labels, and reads a JSON object with `headline` and
/// `body` as those ([`checks::json_article`]); with a single paragraph and
/// no marked headline the issue's title becomes the headline. `None` when
/// there is no text. (`answer` is left empty: the caller keeps the text.)
pub fn parse_article(content: &str, issue_title: &str) -> Option<Article> {
    let content = without_reasoning(content);
    if let Some((headline, body)) = checks::json_article(content) {
        let body = paragraphs(&body)
            .iter()
            .map(|lines| lines.join("\n"))
            .collect::<Vec<_>>()
            .join("\n\n");
        if body.is_empty() {
            return None;
        }
        let headline = clean_headline(&headline);
        return Some(Article {
            headline: if headline.is_empty() {
                fallback_headline(issue_title)
            } else {
                headline
            },
            body,
            usage: TokenUsage::default(),
            answer: String::new(),
        });
    }
    let paragraphs = paragraphs(content);
    let first = paragraphs.first()?;
    let marked = looks_marked(first[0]);
    let (headline, body) = if (paragraphs.len() >= 2 || (marked && first.len() >= 2))
        && (marked || first[0].chars().count() <= MAX_HEADLINE_CHARS)
    {
        let mut lines = first.iter();
        let mut headline = String::new();
        // A label alone on its line ("Headline:") is followed by the headline.
        for line in lines.by_ref() {
            headline = clean_headline(line);
            if !headline.is_empty() {
                break;
            }
        }
        let rest: Vec<&str> = lines.copied().collect();
        let mut body: Vec<Vec<&str>> = Vec::new();
        if !rest.is_empty() {
            body.push(rest);
        }
        body.extend(paragraphs[1..].iter().cloned());
        (headline, body)
    } else {
        (String::new(), paragraphs)
    };
    let body = strip_body_label(body);
    let body = body
        .iter()
        .map(|lines| lines.join("\n"))
        .collect::<Vec<_>>()
        .join("\n\n");
    if body.is_empty() {
        return None;
    }
    let headline = if headline.is_empty() {
        fallback_headline(issue_title)
    } else {
        headline
    };
    Some(Article {
        headline,
        body,
        usage: TokenUsage::default(),
        answer: String::new(),
    })
}

/// The text after a leading `<think>…</think>` block, which reasoning
/// models served without a reasoning parser put before their answer; an
/// unclosed block (the answer never came) leaves nothing.
fn without_reasoning(content: &str) -> &str {
    let trimmed = content.trim_start();
    if !trimmed.starts_with("<think>") {
        return content;
    }
    match trimmed.find("</think>") {
        Some(end) => &trimmed[end + "</think>".len()..],
        None => "",
    }
}

/// Non-blank trimmed lines, grouped by blank lines; code fences dropped.
fn paragraphs(content: &str) -> Vec<Vec<&str>> {
    let mut paragraphs = Vec::new();
    let mut current = Vec::new();
    for line in content.lines() {
        let line = line.trim();
        if line.starts_with("```") {
            continue;
        }
        if line.is_empty() {
            if !current.is_empty() {
                paragraphs.push(std::mem::take(&mut current));
            }
        } else {
            current.push(line);
        }
    }
    if !current.is_empty() {
        paragraphs.push(current);
    }
    paragraphs
}

/// A line dressed as a headline: `# ...`, `**...**` or `Headline: ...`.
fn looks_marked(line: &str) -> bool {
    let line = line.trim();
    line.starts_with('#')
        || line.starts_with("**")
        || line.starts_with("__")
        || starts_with_label(line.trim_start_matches(['*', '_'])).is_some()
}

fn starts_with_label(line: &str) -> Option<&str> {
    ["headline:", "title:"].iter().find_map(|label| {
        let head = line.get(..label.len())?;
        head.eq_ignore_ascii_case(label)
            .then(|| &line[label.len()..])
    })
}

/// The headline without Markdown marks, labels or wrapping quotes.
fn clean_headline(line: &str) -> String {
    let strip_marks = |s: &str| -> String {
        s.trim()
            .trim_start_matches('#')
            .trim()
            .trim_matches(['*', '_'])
            .trim()
            .to_string()
    };
    let mut text = strip_marks(line);
    if let Some(rest) = starts_with_label(&text) {
        text = strip_marks(rest);
    }
    for (open, close) in [('"', '"'), ('“', '”'), ('\'', '\'')] {
        if text.chars().count() >= 2 && text.starts_with(open) && text.ends_with(close) {
            text = text[open.len_utf8()..text.len() - close.len_utf8()]
                .trim()
                .to_string();
        }
    }
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Drops an `Article:` or `Body:` label opening the body.
fn strip_body_label(mut body: Vec<Vec<&str>>) -> Vec<Vec<&str>> {
    let Some(first_line) = body.first_mut().and_then(|lines| lines.first_mut()) else {
        return body;
    };
    let line = *first_line;
    let unmarked = line.trim_start_matches(['*', '_']);
    for label in ["article:", "body:"] {
        if unmarked
            .get(..label.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(label))
        {
            *first_line = unmarked[label.len()..]
                .trim_start_matches(['*', '_'])
                .trim();
            break;
        }
    }
    for lines in &mut body {
        lines.retain(|line| !line.is_empty());
    }
    body.retain(|lines| !lines.is_empty());
    body
}

fn fallback_headline(issue_title: &str) -> String {
    let title = issue_title.split_whitespace().collect::<Vec<_>>().join(" ");
    if title.is_empty() {
        "Untitled".to_string()
    } else {
        title
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(content: &str) -> Article {
        parse_article(content, "Issue title").expect("an article")
    }

    fn article(headline: &str, body: &str) -> Article {
        Article {
            headline: headline.into(),
            body: body.into(),
            usage: TokenUsage::default(),
            answer: String::new(),
        }
    }

    #[test]
    fn headline_then_blank_line_then_paragraphs() {
        assert_eq!(
            parsed("Markets rally\n\nStocks rose.\n\nBonds fell.\n"),
            article("Markets rally", "Stocks rose.\n\nBonds fell.")
        );
        assert_eq!(
            parsed("\r\n  Markets rally  \r\n\r\n\r\nStocks rose.\r\n   \r\nBonds fell."),
            article("Markets rally", "Stocks rose.\n\nBonds fell.")
        );
    }

    #[test]
    fn a_leading_reasoning_block_is_not_the_article() {
        assert_eq!(
            parsed("<think>\nThe user wants a headline.\n\nOk.\n</think>\n\nMarkets rally\n\nStocks rose."),
            article("Markets rally", "Stocks rose.")
        );
        // Reasoning that never ended left no answer.
        assert_eq!(
            parse_article("<think>\nStill thinking\n\nabout it", "t"),
            None
        );
        // Only a leading block is reasoning.
        assert_eq!(
            parsed("Markets rally\n\nA <think> tag in the text.").body,
            "A <think> tag in the text."
        );
    }

    #[test]
    fn headline_marks_and_labels_are_stripped() {
        for content in [
            "# Markets rally\n\nStocks rose.",
            "## **Markets rally**\n\nStocks rose.",
            "**Markets rally**\n\nStocks rose.",
            "Headline: Markets rally\n\nStocks rose.",
            "**Headline:** Markets rally\n\nStocks rose.",
            "HEADLINE: \"Markets rally\"\n\nStocks rose.",
            "Headline:\nMarkets rally\n\nStocks rose.",
            "“Markets rally”\n\nArticle: Stocks rose.",
            "```\nMarkets rally\n\nStocks rose.\n```",
        ] {
            assert_eq!(
                parsed(content),
                article("Markets rally", "Stocks rose."),
                "{content:?}"
            );
        }
    }

    #[test]
    fn marked_headline_without_a_blank_line() {
        assert_eq!(
            parsed("**Markets rally**\nStocks rose.\nBonds fell."),
            article("Markets rally", "Stocks rose.\nBonds fell.")
        );
        assert_eq!(
            parsed("Markets rally\nStocks rose.\n\nBonds fell."),
            article("Markets rally", "Stocks rose.\n\nBonds fell.")
        );
    }

    #[test]
    fn one_paragraph_takes_the_issue_title() {
        assert_eq!(
            parsed("Stocks rose on Monday.\nBonds fell."),
            article("Issue title", "Stocks rose on Monday.\nBonds fell.")
        );
        assert_eq!(
            parsed("# Only a heading"),
            article("Issue title", "# Only a heading")
        );
    }

    #[test]
    fn a_long_first_line_is_prose_not_a_headline() {
        let long = "word ".repeat(60);
        let content = format!("{long}\n\nSecond paragraph.");
        let article = parsed(&content);
        assert_eq!(article.headline, "Issue title");
        assert!(article.body.ends_with("Second paragraph."));
    }

    #[test]
    fn nothing_to_use_is_none() {
        assert_eq!(parse_article("  \n\n ", "t"), None);
        assert_eq!(parse_article("Headline\n\nArticle:", "t"), None);
        assert_eq!(parse_article("```\n```", "t"), None);
    }
}
