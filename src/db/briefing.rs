//! Queries on `briefing` and the articles a briefing is built from.

use serde::Serialize;
use time::{Date, OffsetDateTime};
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;

use super::{DbError, Sql};
use crate::model::status::Status;

/// One requested issue with its article, if it has one.
#[derive(Debug, Clone, PartialEq)]
pub struct BriefingSource {
    pub issue_id: i64,
    pub status: Status,
    pub title: String,
    pub score: f64,
    pub headline: Option<String>,
    pub body: Option<String>,
}

/// A stored briefing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Briefing {
    pub id: i64,
    pub title: String,
    pub briefing_date: String,
    pub issue_ids: Vec<i64>,
    pub body: String,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
}

/// The requested issues (unknown ids absent) with their articles.
pub async fn sources(client: &impl Sql, ids: &[i64]) -> Result<Vec<BriefingSource>, DbError> {
    let rows = client
        .sql()
        .query_typed(
            "SELECT i.id, i.processing_status, i.title, i.score, a.headline, a.body
               FROM issue i LEFT JOIN ai_article a ON a.issue_id = i.id
              WHERE i.id = ANY($1)",
            &[(&ids, Type::INT8_ARRAY)],
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok(BriefingSource {
                issue_id: r.get(0),
                status: super::parse_status(r.get(1))?,
                title: r.get(2),
                score: r.get(3),
                headline: r.get(4),
                body: r.get(5),
            })
        })
        .collect()
}

/// Stores a briefing; returns its id.
pub async fn insert(
    client: &impl Sql,
    title: &str,
    date: Date,
    issue_ids: &[i64],
    body: &str,
) -> Result<i64, DbError> {
    let row = client
        .sql()
        .query_typed_one(
            "INSERT INTO briefing (title, briefing_date, issue_ids, body) VALUES ($1, $2, $3, $4) RETURNING id",
            &[
                (&title, Type::TEXT),
                (&date, Type::DATE),
                (&issue_ids, Type::INT8_ARRAY),
                (&body, Type::TEXT),
            ],
        )
        .await?;
    Ok(row.get(0))
}

fn from_row(r: &tokio_postgres::Row) -> Result<Briefing, DbError> {
    let id: i64 = r.get(0);
    let date: Date = super::time_column(r, 2, "briefing", id)?;
    Ok(Briefing {
        id,
        title: r.get(1),
        briefing_date: date.to_string(),
        issue_ids: r.get(3),
        body: r.get(4),
        created_at: super::time_column(r, 5, "briefing", id)?,
    })
}

/// One briefing by id, or the newest when `id` is `None`.
pub async fn get(client: &impl Sql, id: Option<i64>) -> Result<Option<Briefing>, DbError> {
    let row = client
        .sql()
        .query_typed_opt(
            "SELECT id, title, briefing_date, issue_ids, body, created_at FROM briefing
              WHERE $1::bigint IS NULL OR id = $1 ORDER BY id DESC LIMIT 1",
            &[(&id, Type::INT8)],
        )
        .await?;
    row.as_ref().map(from_row).transpose()
}
