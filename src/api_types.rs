//! JSON shapes shared by the HTTP API and the CLI's file input.

use serde::Deserialize;
use time::OffsetDateTime;

use crate::db::issue::NewIssue;

/// One issue as clients send it.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewIssueJson {
    pub title: String,
    #[serde(default)]
    pub body: String,
    #[serde(default)]
    pub score: f64,
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub collected_at: Option<OffsetDateTime>,
}

impl From<NewIssueJson> for NewIssue {
    fn from(j: NewIssueJson) -> Self {
        NewIssue {
            title: j.title,
            body: j.body,
            score: j.score,
            collected_at: j.collected_at,
        }
    }
}
