//! The four processing statuses of an issue, exactly as stored in
//! `issue.processing_status` and sent in NOTIFY payloads.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where an issue stands in the generation lifecycle.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Status {
    Pending,
    InProgress,
    Done,
    Failed,
}

impl Status {
    /// Every status, in lifecycle order.
    pub const ALL: [Status; 4] = [
        Status::Pending,
        Status::InProgress,
        Status::Done,
        Status::Failed,
    ];

    /// The database spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "PENDING",
            Status::InProgress => "IN_PROGRESS",
            Status::Done => "DONE",
            Status::Failed => "FAILED",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that is not one of the four statuses.
#[derive(Debug, thiserror::Error)]
#[error("unknown status {0:?} (expected PENDING, IN_PROGRESS, DONE or FAILED)")]
pub struct UnknownStatus(pub String);

impl FromStr for Status {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_uppercase().as_str() {
            "PENDING" => Ok(Status::Pending),
            "IN_PROGRESS" => Ok(Status::InProgress),
            "DONE" => Ok(Status::Done),
            "FAILED" => Ok(Status::Failed),
            _ => Err(UnknownStatus(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_text_and_json() {
        for status in Status::ALL {
            assert_eq!(status.as_str().parse::<Status>().unwrap(), status);
            let json = serde_json::to_string(&status).unwrap();
            assert_eq!(json, format!("\"{}\"", status.as_str()));
        }
        assert!("DONEISH".parse::<Status>().is_err());
    }
}
