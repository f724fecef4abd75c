//! Assembling a briefing from exactly the issues it is given: never more,
//! never others. Every given issue must be `DONE` with its article.

use serde::Serialize;
use time::OffsetDateTime;

use crate::db::{self, DbError};
use crate::input::{self, InvalidInput};
use crate::status::Status;

/// Why a briefing could not be assembled.
#[derive(Debug, thiserror::Error)]
pub enum AssembleError {
    #[error(transparent)]
    Input(#[from] InvalidInput),
    /// Issues that are not `DONE` (or do not exist), and issues `DONE`
    /// without an article (set `DONE` by another system with plain SQL).
    #[error("{}", unpublishable(.not_done, .without_article))]
    Unpublishable {
        not_done: Vec<i64>,
        without_article: Vec<i64>,
    },
    #[error(transparent)]
    Db(#[from] DbError),
}

/// Why issues cannot go into a briefing, in words.
pub(crate) fn unpublishable(not_done: &[i64], without_article: &[i64]) -> String {
    let mut parts = Vec::new();
    if !not_done.is_empty() {
        parts.push(format!("these issues are not DONE: {not_done:?}"));
    }
    if !without_article.is_empty() {
        parts.push(format!(
            "these issues are DONE without an article (set DONE by another system?): {without_article:?}"
        ));
    }
    parts.join("; ")
}

/// What was assembled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Assembled {
    pub briefing_id: i64,
    pub issue_ids: Vec<i64>,
}

/// Builds and stores the briefing for `issue_ids`, in that order
/// (duplicates dropped), through `client` (a transaction, when the briefing
/// must be published together with other writes).
pub async fn assemble(
    client: &impl crate::db::Sql,
    issue_ids: &[i64],
) -> Result<Assembled, AssembleError> {
    input::check_ids("issue_ids", issue_ids)?;
    let mut ordered: Vec<i64> = Vec::with_capacity(issue_ids.len());
    for &id in issue_ids {
        if !ordered.contains(&id) {
            ordered.push(id);
        }
    }
    let sources = db::briefing::sources(client, &ordered).await?;
    let mut articles = Vec::with_capacity(ordered.len());
    let (mut not_done, mut without_article) = (Vec::new(), Vec::new());
    for id in &ordered {
        match sources.iter().find(|s| s.issue_id == *id) {
            Some(s) if s.status == Status::Done && s.headline.is_some() => articles.push(s),
            Some(s) if s.status == Status::Done => without_article.push(*id),
            _ => not_done.push(*id),
        }
    }
    if !not_done.is_empty() || !without_article.is_empty() {
        return Err(AssembleError::Unpublishable {
            not_done,
            without_article,
        });
    }
    let today = OffsetDateTime::now_utc().date();
    let title = format!(
        "newsnack — {} {} {}",
        today.day(),
        today.month(),
        today.year()
    );
    let mut body = format!("# {title}\n\n");
    body.push_str(&format!(
        "Today's {} stor{}.\n\n",
        articles.len(),
        if articles.len() == 1 { "y" } else { "ies" }
    ));
    for (i, a) in articles.iter().enumerate() {
        body.push_str(&format!(
            "## {}. {}\n\n{}\n\n",
            i + 1,
            a.headline.as_deref().unwrap_or(&a.title),
            a.body.as_deref().unwrap_or_default().trim()
        ));
    }
    let briefing_id =
        db::briefing::insert(client, &title, today, &ordered, body.trim_end()).await?;
    Ok(Assembled {
        briefing_id,
        issue_ids: ordered,
    })
}
