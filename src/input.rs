//! Validation of what users hand the service: id lists and new issues. One
//! set of rules for the HTTP API and the CLI, applied before anything is
//! written, so a bad request changes nothing.

use crate::db::issue::NewIssue;

/// The most ids one request may name.
pub const MAX_IDS: usize = 1000;
/// The most issues one request may add.
pub const MAX_NEW_ISSUES: usize = 1000;
/// Longest accepted title and body, in bytes.
pub const MAX_TITLE_BYTES: usize = 1_000;
pub const MAX_BODY_BYTES: usize = 100_000;

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

/// Checks new issues: 1 to [`MAX_NEW_ISSUES`], each with a non-blank title,
/// sizes within bounds and a finite score.
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
        if issue.title.trim().is_empty() {
            return Err(InvalidInput::Bad(format!(
                "issues[{i}].title must not be blank"
            )));
        }
        if issue.title.len() > MAX_TITLE_BYTES {
            return Err(InvalidInput::Bad(format!(
                "issues[{i}].title is longer than {MAX_TITLE_BYTES} bytes"
            )));
        }
        if issue.body.len() > MAX_BODY_BYTES {
            return Err(InvalidInput::Bad(format!(
                "issues[{i}].body is longer than {MAX_BODY_BYTES} bytes"
            )));
        }
        if !issue.score.is_finite() {
            return Err(InvalidInput::Bad(format!(
                "issues[{i}].score must be a finite number"
            )));
        }
        if let Some(at) = issue.collected_at {
            if !collected_at_in_range(at) {
                return Err(InvalidInput::Bad(format!(
                    "issues[{i}].collected_at must fall between the years 1 and 9999 in UTC"
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

/// Whether a `collected_at` can be stored and read back: its UTC date must
/// be a year from 1 to 9999 (`9999-12-31T23:00:00-05:00` is already in the
/// year 10000 in UTC, which the database would store but not hand back).
fn collected_at_in_range(at: time::OffsetDateTime) -> bool {
    at.checked_to_offset(time::UtcOffset::UTC)
        .is_some_and(|utc| (1..=9999).contains(&utc.year()))
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
    fn collected_at_must_read_back() {
        use time::macros::datetime;
        let at = |collected_at| {
            check_new_issues(&[NewIssue {
                collected_at: Some(collected_at),
                ..issue("t", 0.0)
            }])
        };
        assert!(at(datetime!(2026-11-30 08:00 UTC)).is_ok());
        assert!(at(datetime!(9999-12-31 18:00 -05:00)).is_ok());
        assert!(at(datetime!(0001-01-01 00:00 UTC)).is_ok());
        assert!(
            at(datetime!(9999-12-31 23:00 -05:00)).is_err(),
            "year 10000 in UTC"
        );
        assert!(
            at(datetime!(0001-01-01 00:30 +01:00)).is_err(),
            "year 0 in UTC"
        );
        assert!(at(datetime!(0000-06-01 00:00 UTC)).is_err());
    }
}
