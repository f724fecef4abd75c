//! One status change of one issue: a row of `issue_transition` and the JSON
//! payload of `NOTIFY issue_transition`.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::status::Status;

/// A committed status change. `seq` is the log position: strictly increasing
/// in commit order, so it doubles as a resume cursor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    pub seq: i64,
    pub issue_id: i64,
    /// `None` for the initial `PENDING` of a new issue.
    pub from: Option<Status>,
    pub to: Status,
    #[serde(with = "time::serde::rfc3339")]
    pub at: OffsetDateTime,
    /// Attempts so far, as of this transition.
    #[serde(default)]
    pub attempts: i32,
    /// A `FAILED` that must not be retried automatically (a fatal error).
    #[serde(default)]
    pub fatal: bool,
}

impl Transition {
    /// Parses a NOTIFY payload.
    pub fn from_payload(payload: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_payload_postgres_sends() {
        let payload = r#"{"seq" : 42, "issue_id" : 7, "from" : null, "to" : "PENDING", "at" : "2026-11-29T20:14:12.123456+00:00"}"#;
        let t = Transition::from_payload(payload).unwrap();
        assert_eq!(
            (t.seq, t.issue_id, t.from, t.to),
            (42, 7, None, Status::Pending)
        );
        assert_eq!(t.at.microsecond(), 123_456);
        let again = Transition::from_payload(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(again, t);
    }
}
