//! The built-in offline writer, the default when no LLM URL is set: a short,
//! readable article made from the issue's own text, with no network and no
//! randomness. The same issue gives the same article, byte for byte.
//!
//! The headline is the title (whitespace tidied, first letter capitalised);
//! the body is a lede of the first sentences, a paragraph of detail from the
//! next ones, and a closing line.

use futures::future::{BoxFuture, FutureExt};

use super::{Article, IssueText, WriteError, Writer};
use crate::model::llm::TokenUsage;

/// The last paragraph of every offline article.
pub const CLOSING_LINE: &str = "newsnack will update this story as it develops.";
/// The lede of an issue without any text of its own.
pub const NO_DETAILS_LEDE: &str = "Few details are available yet about this story.";
/// The headline of an issue without a title or a body.
pub const UNTITLED_HEADLINE: &str = "News update";

/// The lede takes a second sentence only if both fit in this many characters.
const LEDE_CHARS: usize = 240;
/// The most sentences in the detail paragraph.
const DETAIL_SENTENCES: usize = 4;
/// Longer sentences (text without full stops) are cut at a word boundary.
const MAX_SENTENCE_CHARS: usize = 300;
/// Longer titles are cut at a word boundary (with the `…`, within the
/// default `article_headline_max_chars`).
const MAX_HEADLINE_CHARS: usize = 119;

/// Words ending in a full stop that do not end a sentence.
const ABBREVIATIONS: &[&str] = &[
    "mr.", "mrs.", "ms.", "dr.", "prof.", "st.", "jr.", "sr.", "vs.", "e.g.", "i.e.", "no.",
    "gen.", "gov.", "sen.", "rep.", "inc.", "corp.", "co.", "ltd.", "jan.", "feb.", "mar.", "apr.",
    "jun.", "jul.", "aug.", "sep.", "sept.", "oct.", "nov.", "dec.", "approx.",
];

/// Writes articles from the issue's own text; needs nothing else.
#[derive(Debug, Clone, Copy, Default)]
pub struct OfflineWriter;

impl OfflineWriter {
    /// The article for `issue`; the same for the same title and body.
    pub fn compose(&self, issue: IssueText<'_>) -> Article {
        compose(issue.title, issue.body)
    }
}

impl Writer for OfflineWriter {
    fn name(&self) -> &str {
        "offline"
    }

    fn write<'a>(&'a self, issue: IssueText<'a>) -> BoxFuture<'a, Result<Article, WriteError>> {
        futures::future::ready(Ok(self.compose(issue))).boxed()
    }
}

fn compose(title: &str, body: &str) -> Article {
    let title = collapse_whitespace(title);
    let mut sentences = split_sentences(body);
    // A body that opens by repeating the title should not say it twice.
    if sentences
        .first()
        .is_some_and(|first| same_words(first, &title))
    {
        sentences.remove(0);
    }
    let headline = if !title.is_empty() {
        headline_from(&title)
    } else if let Some(first) = sentences.first() {
        headline_from(first.trim_end_matches('.'))
    } else {
        UNTITLED_HEADLINE.to_string()
    };

    let mut paragraphs = Vec::with_capacity(3);
    let mut rest = sentences.iter();
    match rest.next() {
        Some(first) => {
            let mut lede = first.clone();
            if let Some(second) = sentences.get(1) {
                if lede.chars().count() + 1 + second.chars().count() <= LEDE_CHARS {
                    lede.push(' ');
                    lede.push_str(second);
                    rest.next();
                }
            }
            paragraphs.push(lede);
        }
        None => paragraphs.push(NO_DETAILS_LEDE.to_string()),
    }
    let detail: Vec<&str> = rest.take(DETAIL_SENTENCES).map(String::as_str).collect();
    if !detail.is_empty() {
        paragraphs.push(detail.join(" "));
    }
    paragraphs.push(CLOSING_LINE.to_string());

    Article {
        headline,
        body: paragraphs.join("\n\n"),
        // No model, nothing spent.
        usage: TokenUsage::default(),
        answer: String::new(),
    }
}

/// The title, cut to length, with its first letter capitalised.
fn headline_from(text: &str) -> String {
    capitalise_first(&cut_at_word(text, MAX_HEADLINE_CHARS))
}

/// Sentences of `text`, whitespace collapsed, each ending in punctuation.
fn split_sentences(text: &str) -> Vec<String> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut sentences = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for (i, word) in words.iter().enumerate() {
        current.push(word);
        let next_starts_lowercase = words
            .get(i + 1)
            .and_then(|next| next.chars().next())
            .is_some_and(char::is_lowercase);
        if ends_sentence(word) && !next_starts_lowercase {
            sentences.push(finish_sentence(&current.join(" ")));
            current.clear();
        }
    }
    if !current.is_empty() {
        sentences.push(finish_sentence(&current.join(" ")));
    }
    sentences
}

fn ends_sentence(word: &str) -> bool {
    let word = word.trim_end_matches(['"', '\'', '”', '’', ')', ']']);
    if !word.ends_with(['.', '!', '?', '…']) {
        return false;
    }
    let lower = word.to_lowercase();
    let is_initial = word.chars().count() == 2 && word.starts_with(char::is_uppercase);
    !is_initial && !ABBREVIATIONS.contains(&lower.as_str())
}

/// Cut to length, capitalised, ending in punctuation.
fn finish_sentence(sentence: &str) -> String {
    let mut sentence = capitalise_first(&cut_at_word(sentence, MAX_SENTENCE_CHARS));
    if !sentence.ends_with(['.', '!', '?', '…', '"', '\'', '”', '’', ')', ']']) {
        sentence.push('.');
    }
    sentence
}

/// At most `max` characters, cut after a whole word and marked with `…`.
fn cut_at_word(text: &str, max: usize) -> String {
    let Some((limit, _)) = text.char_indices().nth(max) else {
        return text.to_string();
    };
    let head = &text[..limit];
    let head = match head.rfind(' ') {
        Some(space) if space > 0 => &head[..space],
        _ => head,
    };
    format!("{}…", head.trim_end_matches([',', ';', ':', ' ']))
}

fn capitalise_first(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}

fn collapse_whitespace(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Equal but for case, whitespace and final punctuation.
fn same_words(sentence: &str, title: &str) -> bool {
    let normalise = |s: &str| {
        collapse_whitespace(s)
            .trim_end_matches(['.', '!', '?', '…'])
            .to_lowercase()
    };
    !title.is_empty() && normalise(sentence) == normalise(title)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn article(title: &str, body: &str) -> Article {
        OfflineWriter.compose(IssueText {
            id: 1,
            title,
            body,
            prompts: crate::writer::Prompts::DEFAULT,
        })
    }

    #[test]
    fn lede_detail_and_closing() {
        let a = article(
            "  council   approves new budget ",
            "The city council approved the 2025 budget on Monday. The vote was 7 to 2. \
             Spending on parks rises by 4%. Dr. Lee, the treasurer, called it prudent. \
             Opponents said taxes would rise. A second reading is due in May. It is final after that.",
        );
        assert_eq!(a.headline, "Council approves new budget");
        let paragraphs: Vec<&str> = a.body.split("\n\n").collect();
        assert_eq!(
            paragraphs,
            [
                "The city council approved the 2025 budget on Monday. The vote was 7 to 2.",
                "Spending on parks rises by 4%. Dr. Lee, the treasurer, called it prudent. \
                 Opponents said taxes would rise. A second reading is due in May.",
                CLOSING_LINE,
            ]
        );
    }

    #[test]
    fn empty_body_still_reads() {
        let a = article("Storm warning", "   \n ");
        assert_eq!(a.headline, "Storm warning");
        assert_eq!(a.body, format!("{NO_DETAILS_LEDE}\n\n{CLOSING_LINE}"));
    }

    #[test]
    fn empty_title_uses_the_first_sentence_or_a_default() {
        let a = article("", "rates held at 4%. More next week.");
        assert_eq!(a.headline, "Rates held at 4%");
        // The lede keeps the whole text: nothing is lost to the headline.
        assert_eq!(
            a.body,
            format!("Rates held at 4%. More next week.\n\n{CLOSING_LINE}")
        );
        assert_eq!(article(" ", "").headline, UNTITLED_HEADLINE);
    }

    #[test]
    fn a_body_repeating_the_title_is_not_said_twice() {
        let a = article("Bridge reopens", "Bridge reopens. Traffic resumed at noon.");
        assert_eq!(
            a.body,
            format!("Traffic resumed at noon.\n\n{CLOSING_LINE}")
        );
    }

    #[test]
    fn text_without_full_stops_is_cut_and_finished() {
        let body = "word ".repeat(500);
        let a = article(&"long title ".repeat(40), &body);
        assert!(a.headline.chars().count() <= MAX_HEADLINE_CHARS + 1);
        assert!(a.headline.ends_with('…'));
        let lede = a.body.split("\n\n").next().unwrap();
        assert!(lede.chars().count() <= MAX_SENTENCE_CHARS + 1, "{lede}");
        assert!(lede.starts_with("Word word"));
    }

    #[test]
    fn sentences_split_on_full_stops_not_abbreviations() {
        assert_eq!(
            split_sentences("Mr. Smith met J. Doe in the U.S. capital. it went well! Why? Because"),
            [
                "Mr. Smith met J. Doe in the U.S. capital. it went well!",
                "Why?",
                "Because.",
            ]
        );
    }

    #[test]
    fn every_article_passes_the_default_checks() {
        let checks = crate::writer::checks::ArticleChecks::default();
        let long = "word ".repeat(5000);
        for (title, body) in [
            ("Storm warning", ""),
            ("", ""),
            ("", long.as_str()),
            (long.as_str(), long.as_str()),
            (
                &"가나다라마바사 ".repeat(100),
                &"한국어 문장입니다. ".repeat(1000),
            ),
            (
                "Council approves budget",
                "The vote was 7 to 2. Spending rises.",
            ),
        ] {
            let a = article(title, body);
            assert_eq!(checks.check(&a), Ok(a.clone()), "{title:?} / {body:?}");
        }
    }

    #[test]
    fn same_input_same_output() {
        let one = article("Title", "One. Two. Three.");
        let two = article("Title", "One. Two. Three.");
        assert_eq!(one, two);
    }
}
