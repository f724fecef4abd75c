//! Queries on `issue`, one file per concern: adding, reading and counting
//! here; taking claims ([`claim`]); the writes under a claim, fenced by its
//! token, and the reaper's ([`fenced`]); an operator's cancel and reset
//! ([`operator`]); what retries and waits read ([`retry_state`]). Each
//! item is also reachable from here, as `db::issue::NAME`.

mod claim;
mod fenced;
mod operator;
mod retry_state;

pub use claim::{
    claim_issues, claim_issues_traced, earlier_traceparent, ClaimOutcome, ClaimScope, ClaimedIssue,
    CLAIM_STATEMENT,
};
pub use fenced::{
    claim_current, complete, complete_in_contexts, fail, fail_traced, fail_unspent, heartbeat,
    reap_expired, release, Completion, Fenced, RetryPolicy, COMPLETE_STATEMENT,
};
pub use operator::{cancel, reset_failed, CancelOutcome, CANCELLED};
pub use retry_state::{failed_with_attempts_left, retry_state, wait_targets, RetryState};

use std::collections::BTreeSet;

use serde::Serialize;
use time::OffsetDateTime;
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;

use super::{DbError, Sql};
use crate::model::status::Status;

/// The issues' trace contexts as the claim and the completion take them
/// (`,<id>=<traceparent>,..`, which `issue_transition_record` reads,
/// migrations 37 and 38), from each issue's id and context; `None` when
/// no issue has one.
fn contexts_setting<'a>(
    contexts: impl IntoIterator<Item = (i64, Option<&'a str>)>,
) -> Option<String> {
    use std::fmt::Write as _;
    let mut named = String::new();
    for (id, traceparent) in contexts {
        if let Some(traceparent) = traceparent {
            let _ = write!(named, ",{id}={traceparent}");
        }
    }
    (!named.is_empty()).then_some(named)
}

/// An issue to add.
#[derive(Debug, Clone)]
pub struct NewIssue {
    pub title: String,
    pub body: String,
    pub score: f64,
    pub collected_at: Option<OffsetDateTime>,
    /// The collector's key for the story: an issue with this key already
    /// there makes adding this one a no-op (see [`add_issues`]).
    pub source_key: Option<String>,
}

/// An issue as the API and CLI show it.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct IssueView {
    pub id: i64,
    pub title: String,
    pub body: String,
    pub score: f64,
    #[serde(with = "time::serde::rfc3339")]
    pub collected_at: OffsetDateTime,
    pub status: Status,
    pub attempts: i32,
    pub last_error: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
    pub claimed_by: Option<String>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub lease_until: Option<OffsetDateTime>,
    /// The collector's key for the story, if it gave one.
    pub source_key: Option<String>,
}
/// What adding issues did: each item's issue in input order, new or, for
/// a `source_key` already there, the existing one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Added {
    /// One id per item, in input order.
    pub ids: Vec<i64>,
    /// The ids answered for items whose key an issue already held before
    /// (not added by this call), in input order, once each.
    pub existing: Vec<i64>,
}

impl Added {
    /// Whether any issue was added.
    pub fn added_any(&self) -> bool {
        self.ids.iter().any(|id| !self.existing.contains(id))
    }
}

/// [`add_issues`], for callers that want the ids only.
pub async fn insert_issues(client: &impl Sql, issues: &[NewIssue]) -> Result<Vec<i64>, DbError> {
    Ok(add_issues(client, issues, None).await?.ids)
}

/// Adds issues; an item whose `source_key` an issue already holds (or an
/// earlier item of the same call) adds nothing and answers that issue.
///
/// One `INSERT .. ON CONFLICT (source_key) DO NOTHING`, then one read of
/// the keys it skipped: an insert that meets a key another transaction is
/// adding waits for it to commit, then skips, and the read (a later
/// statement, so a later snapshot) sees that issue. A skipped key whose
/// issue is gone by the read (deleted meanwhile) is inserted again.
///
/// The issues added keep `traceparent`, the W3C trace context they were
/// added in (`issue.traceparent`).
pub async fn add_issues(
    client: &impl Sql,
    issues: &[NewIssue],
    traceparent: Option<&str>,
) -> Result<Added, DbError> {
    use std::collections::HashMap;
    let mut answer: Vec<Option<i64>> = vec![None; issues.len()];
    let mut existing = Vec::new();
    // The first item of each key; later ones answer the same issue.
    let mut first_of: HashMap<&str, usize> = HashMap::new();
    let mut firsts: Vec<usize> = Vec::new();
    for (i, issue) in issues.iter().enumerate() {
        match issue.source_key.as_deref() {
            Some(key) if first_of.contains_key(key) => {}
            Some(key) => {
                first_of.insert(key, i);
                firsts.push(i);
            }
            None => firsts.push(i),
        }
    }
    let mut pending = firsts;
    for _ in 0..3 {
        if pending.is_empty() {
            break;
        }
        let rows: Vec<&NewIssue> = pending.iter().map(|&i| &issues[i]).collect();
        let titles: Vec<&str> = rows.iter().map(|i| i.title.as_str()).collect();
        let bodies: Vec<&str> = rows.iter().map(|i| i.body.as_str()).collect();
        let scores: Vec<f64> = rows.iter().map(|i| i.score).collect();
        let collected: Vec<Option<OffsetDateTime>> = rows.iter().map(|i| i.collected_at).collect();
        let keys: Vec<Option<&str>> = rows.iter().map(|i| i.source_key.as_deref()).collect();
        let inserted = client
            .sql()
            .query_typed(
                "INSERT INTO issue (title, body, score, collected_at, source_key, traceparent)
                 SELECT t, b, s, COALESCE(c, now()), k, $6
                   FROM unnest($1::text[], $2::text[], $3::float8[], $4::timestamptz[], $5::text[])
                        WITH ORDINALITY AS n(t, b, s, c, k, ord)
                  ORDER BY ord
                 ON CONFLICT (source_key) DO NOTHING
                 RETURNING id, source_key",
                &[
                    (&titles, Type::TEXT_ARRAY),
                    (&bodies, Type::TEXT_ARRAY),
                    (&scores, Type::FLOAT8_ARRAY),
                    (&collected, Type::TIMESTAMPTZ_ARRAY),
                    (&keys, Type::TEXT_ARRAY),
                    (&traceparent, Type::TEXT),
                ],
            )
            .await?;
        // Identity values are drawn row by row in `ord` order, so the ids
        // sorted are the inserted rows in input order.
        let added_keys: BTreeSet<String> = inserted
            .iter()
            .filter_map(|r| r.get::<_, Option<String>>(1))
            .collect();
        let mut ids: Vec<i64> = inserted.iter().map(|r| r.get(0)).collect();
        ids.sort_unstable();
        let (added, skipped): (Vec<usize>, Vec<usize>) =
            pending.iter().partition(|&&i| match &issues[i].source_key {
                None => true,
                Some(key) => added_keys.contains(key),
            });
        for (&i, id) in added.iter().zip(ids) {
            answer[i] = Some(id);
        }
        if skipped.is_empty() {
            break;
        }
        let wanted: Vec<&str> = skipped
            .iter()
            .filter_map(|&i| issues[i].source_key.as_deref())
            .collect();
        let found: HashMap<String, i64> = client
            .sql()
            .query_typed(
                "SELECT source_key, id FROM issue WHERE source_key = ANY($1)",
                &[(&wanted, Type::TEXT_ARRAY)],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        pending = Vec::new();
        for i in skipped {
            match issues[i].source_key.as_ref().and_then(|k| found.get(k)) {
                Some(&id) => {
                    answer[i] = Some(id);
                    if !existing.contains(&id) {
                        existing.push(id);
                    }
                }
                None => pending.push(i),
            }
        }
    }
    for (i, issue) in issues.iter().enumerate() {
        if answer[i].is_none() {
            if let Some(&first) = issue.source_key.as_deref().and_then(|k| first_of.get(k)) {
                answer[i] = answer[first];
            }
        }
    }
    let ids: Option<Vec<i64>> = answer.into_iter().collect();
    let ids = ids.ok_or_else(|| {
        DbError::Invalid("an issue's source_key kept being deleted while it was added".into())
    })?;
    // In input order.
    existing.sort_by_key(|id| ids.iter().position(|x| x == id));
    Ok(Added { ids, existing })
}

const VIEW_COLUMNS: &str = "id, title, body, score, collected_at, processing_status, attempts, \
                            last_error, updated_at, claimed_by, lease_until, source_key";

fn view_from_row(row: &tokio_postgres::Row) -> Result<IssueView, DbError> {
    let id: i64 = row.get(0);
    Ok(IssueView {
        id,
        title: row.get(1),
        body: row.get(2),
        score: row.get(3),
        collected_at: super::time_column(row, 4, "issue", id)?,
        status: super::parse_status(row.get(5))?,
        attempts: row.get(6),
        last_error: row.get(7),
        updated_at: super::time_column(row, 8, "issue", id)?,
        claimed_by: row.get(9),
        lease_until: super::time_column(row, 10, "issue", id)?,
        source_key: row.get(11),
    })
}

/// One issue, or `None` if there is no such id.
pub async fn get_issue(client: &impl Sql, id: i64) -> Result<Option<IssueView>, DbError> {
    client
        .sql()
        .query_typed_opt(
            &format!("SELECT {VIEW_COLUMNS} FROM issue WHERE id = $1"),
            &[(&id, Type::INT8)],
        )
        .await?
        .as_ref()
        .map(view_from_row)
        .transpose()
}

/// Several issues by id, in id order; unknown ids are simply absent.
pub async fn get_issues(client: &impl Sql, ids: &[i64]) -> Result<Vec<IssueView>, DbError> {
    client
        .sql()
        .query_typed(
            &format!("SELECT {VIEW_COLUMNS} FROM issue WHERE id = ANY($1) ORDER BY id"),
            &[(&ids, Type::INT8_ARRAY)],
        )
        .await?
        .iter()
        .map(view_from_row)
        .collect()
}

/// Folds the appended count deltas into one row per status once there are
/// more than `above` of them (`newsnack_fold_status_counts`, migration 27);
/// answers how many rows were folded.
pub async fn fold_status_counts(client: &impl Sql, above: i32) -> Result<i64, DbError> {
    let row = client
        .sql()
        .query_typed_one(
            "SELECT newsnack_fold_status_counts($1)",
            &[(&above, Type::INT4)],
        )
        .await?;
    Ok(row.get(0))
}

/// How many issues are in each status (every status listed, zeros included),
/// exact: the sum of the deltas the triggers of migration 27 append at
/// every change, so its cost follows the deltas not yet folded, not the
/// number of issues.
pub async fn count_by_status(client: &impl Sql) -> Result<Vec<(Status, i64)>, DbError> {
    let rows = client
        .sql()
        .query_typed(
            "SELECT status, sum(n)::bigint FROM issue_status_delta GROUP BY status",
            &[],
        )
        .await?;
    let mut counts: Vec<(Status, i64)> = Status::ALL.iter().map(|&s| (s, 0)).collect();
    for row in rows {
        let status = super::parse_status(row.get(0))?;
        if let Some(slot) = counts.iter_mut().find(|(s, _)| *s == status) {
            slot.1 = row.get(1);
        }
    }
    Ok(counts)
}
