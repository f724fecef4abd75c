//! Validation of what users hand the service: id lists and new issues. One
//! set of rules for the HTTP API and the CLI, applied before anything is
//! written, so a bad request changes nothing.

use crate::db::issue::NewIssue;

/// The most ids one request may name.
pub const MAX_IDS: usize = 1000;
/// The most issues one request may add.
pub const MAX_NEW_ISSUES: usize = 1000;
/// Longest accepted title and body, in characters (Unicode code points,
/// as JSON Schema's `maxLength` counts them).
pub const MAX_TITLE_CHARS: usize = 1_000;
pub const MAX_BODY_CHARS: usize = 100_000;
/// Longest accepted `source_key`, in characters (at least one).
pub const MAX_SOURCE_KEY_CHARS: usize = 1_000;
/// Longest accepted `source_key` in UTF-8 bytes: its `UNIQUE` index holds
/// keys up to about 2,690 bytes, so 1,000 characters of a script written
/// with 3 or 4 bytes each may not fit, and would fail as the index's error.
pub const MAX_SOURCE_KEY_BYTES: usize = 2_048;
/// The years a `collected_at` may name, as written: any offset then keeps
/// it within the years 1 to 9999 in UTC, which the service can store and
/// read back.
pub const COLLECTED_YEARS: std::ops::RangeInclusive<i32> = 2..=9998;

/// A request that cannot be carried out as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidInput {
    #[error("{field} must not be empty")]
    Empty { field: &'static str },
    #[error("{field} may hold at most {max} entries, got {got}")]
    TooMany {
        field: &'static str,
        max: usize,
        got: usize,
    },
    #[error("{field} must hold positive ids, got {id}")]
    NotPositive { field: &'static str, id: i64 },
    #[error("{0}")]
    Bad(String),
}

/// Checks an id list: 1 to [`MAX_IDS`] positive ids (duplicates allowed).
pub fn check_ids(field: &'static str, ids: &[i64]) -> Result<(), InvalidInput> {
    if ids.is_empty() {
        return Err(InvalidInput::Empty { field });
    }
    if ids.len() > MAX_IDS {
        return Err(InvalidInput::TooMany {
            field,
            max: MAX_IDS,
            got: ids.len(),
        });
    }
    if let Some(&id) = ids.iter().find(|&&id| id <= 0) {
        return Err(InvalidInput::NotPositive { field, id });
    }
    Ok(())
}

/// Checks new issues: 1 to [`MAX_NEW_ISSUES`], each with a title that is
/// not blank (it has a character other than white space, as
/// [`char::is_whitespace`] has it), sizes within bounds, no NUL
/// character, a finite score, a `collected_at` in [`COLLECTED_YEARS`] and
/// a `source_key`, if any, of 1 to [`MAX_SOURCE_KEY_CHARS`] characters.
pub fn check_new_issues(issues: &[NewIssue]) -> Result<(), InvalidInput> {
    if issues.is_empty() {
        return Err(InvalidInput::Empty { field: "issues" });
    }
    if issues.len() > MAX_NEW_ISSUES {
        return Err(InvalidInput::TooMany {
            field: "issues",
            max: MAX_NEW_ISSUES,
            got: issues.len(),
        });
    }
    for (i, issue) in issues.iter().enumerate() {
        if issue.title.chars().all(char::is_whitespace) {
            return Err(InvalidInput::Bad(format!(
                "issues[{i}].title must not be blank"
            )));
        }
        if issue.title.chars().count() > MAX_TITLE_CHARS {
            return Err(InvalidInput::Bad(format!(
                "issues[{i}].title is longer than {MAX_TITLE_CHARS} characters"
            )));
        }
        if issue.body.chars().count() > MAX_BODY_CHARS {
            return Err(InvalidInput::Bad(format!(
                "issues[{i}].body is longer than {MAX_BODY_CHARS} characters"
            )));
        }
        if !issue.score.is_finite() {
            return Err(InvalidInput::Bad(format!(
                "issues[{i}].score must be a finite number"
            )));
        }
        if let Some(at) = issue.collected_at {
            if !COLLECTED_YEARS.contains(&at.year()) {
                return Err(InvalidInput::Bad(format!(
                    "issues[{i}].collected_at must name a year from {} to {}",
                    COLLECTED_YEARS.start(),
                    COLLECTED_YEARS.end()
                )));
            }
        }
        if let Some(key) = &issue.source_key {
            let chars = key.chars().count();
            if chars == 0 || chars > MAX_SOURCE_KEY_CHARS {
                return Err(InvalidInput::Bad(format!(
                    "issues[{i}].source_key must be 1 to {MAX_SOURCE_KEY_CHARS} characters long, got {chars}"
                )));
            }
            if key.len() > MAX_SOURCE_KEY_BYTES {
                return Err(InvalidInput::Bad(format!(
                    "issues[{i}].source_key must be at most {MAX_SOURCE_KEY_BYTES} bytes in UTF-8 \
                     (the unique index's limit), got {}",
                    key.len()
                )));
            }
            if key.contains('\0') {
                return Err(InvalidInput::Bad(format!(
                    "issues[{i}].source_key must not contain NUL characters"
                )));
            }
        }
        if issue.title.contains('\0') || issue.body.contains('\0') {
            return Err(InvalidInput::Bad(format!(
                "issues[{i}] must not contain NUL characters"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issue(title: &str, score: f64) -> NewIssue {
        NewIssue {
            title: title.into(),
            body: String::new(),
            score,
            collected_at: None,
            source_key: None,
        }
    }

    #[test]
    fn id_lists() {
        assert!(check_ids("issue_ids", &[1, 1, 2]).is_ok());
        assert_eq!(
            check_ids("issue_ids", &[]),
            Err(InvalidInput::Empty { field: "issue_ids" })
        );
        assert_eq!(
            check_ids("issue_ids", &[3, 0]),
            Err(InvalidInput::NotPositive {
                field: "issue_ids",
                id: 0
            })
        );
        assert!(matches!(
            check_ids("issue_ids", &vec![1; MAX_IDS + 1]),
            Err(InvalidInput::TooMany { got, .. }) if got == MAX_IDS + 1
        ));
    }

    #[test]
    fn new_issues() {
        assert!(check_new_issues(&[issue("Rates rise", 1.5)]).is_ok());
        assert!(check_new_issues(&[]).is_err());
        assert!(check_new_issues(&[issue("  ", 1.0)]).is_err());
        assert!(check_new_issues(&[issue("t", f64::NAN)]).is_err());
        assert!(check_new_issues(&[issue("a\0b", 1.0)]).is_err());
    }

    #[test]
    fn limits_count_characters_and_blank_is_white_space_only() {
        let long = |c: char, n: usize| check_new_issues(&[issue(&c.to_string().repeat(n), 0.0)]);
        assert!(
            long('é', MAX_TITLE_CHARS).is_ok(),
            "2,000 bytes, 1,000 characters"
        );
        assert!(long('é', MAX_TITLE_CHARS + 1).is_err());
        assert!(check_new_issues(&[issue("\u{3000}\u{a0}\t", 0.0)]).is_err());
        // Not white space, though some regular expression engines say so.
        assert!(check_new_issues(&[issue("\u{1c}", 0.0)]).is_ok());
        assert!(check_new_issues(&[issue("\u{200b}", 0.0)]).is_ok());
    }

    #[test]
    fn a_source_key_holds_1_to_1000_characters_in_at_most_2048_bytes() {
        let keyed = |key: String| {
            check_new_issues(&[NewIssue {
                source_key: Some(key),
                ..issue("t", 0.0)
            }])
        };
        assert!(keyed("https://example.com/story/1".into()).is_ok());
        assert!(keyed("가".repeat(MAX_SOURCE_KEY_BYTES / 3)).is_ok());
        let wide = keyed("가".repeat(MAX_SOURCE_KEY_BYTES / 3 + 1))
            .unwrap_err()
            .to_string();
        assert!(wide.contains("at most 2048 bytes in UTF-8"), "{wide}");
        let empty = keyed(String::new()).unwrap_err().to_string();
        assert!(
            empty.contains("issues[0].source_key must be 1 to 1000"),
            "{empty}"
        );
        assert!(keyed("k".repeat(MAX_SOURCE_KEY_CHARS + 1)).is_err());
        assert!(keyed("a\0b".into()).is_err());
    }

    #[test]
    fn collected_at_names_a_year_that_reads_back() {
        use time::macros::datetime;
        let at = |collected_at| {
            check_new_issues(&[NewIssue {
                collected_at: Some(collected_at),
                ..issue("t", 0.0)
            }])
        };
        assert!(at(datetime!(2026-11-30 08:00 UTC)).is_ok());
        assert!(at(datetime!(9998-12-31 23:59 -23:59)).is_ok());
        assert!(at(datetime!(0002-01-01 00:00 +23:59)).is_ok());
        assert!(at(datetime!(9999-01-01 00:00 UTC)).is_err());
        assert!(at(datetime!(0001-12-31 00:00 UTC)).is_err());
        assert!(at(datetime!(0000-06-01 00:00 UTC)).is_err());
    }
}
