//! Reads of the durable transition log `issue_transition`. Rows are only
//! ever appended, by the trigger in `sql/0002_transitions.sql`, and removed
//! from the log's start by a prune ([`super::retention`]).

use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;

use super::{DbError, Sql};
use crate::model::transition::Transition;

/// [`read_after`] over the whole log: a range of the primary key. Public,
/// like the next one, so that tests can check its plan.
pub const READ_AFTER: &str = "SELECT seq, issue_id, from_status, to_status, at, attempts, fatal,
            (SELECT min(seq) FROM issue_transition)
       FROM issue_transition
      WHERE seq > $1
      ORDER BY seq
      LIMIT $2";

/// [`read_after`] for one issue: a range of `(issue_id, seq)`, so a reader
/// of one issue reads its rows only, however long the log.
pub const READ_AFTER_FOR_ISSUE: &str =
    "SELECT seq, issue_id, from_status, to_status, at, attempts, fatal,
            (SELECT min(seq) FROM issue_transition)
       FROM issue_transition
      WHERE issue_id = $2 AND seq > $1
      ORDER BY seq
      LIMIT $3";

/// Up to `limit` transitions after `after_seq`, in `seq` order, optionally
/// for one issue only. Because `seq` is allocated in commit order, a reader
/// that resumes from the last `seq` it saw never skips a row, unless a
/// prune removed it: [`read_page`] tells.
pub async fn read_after(
    client: &impl Sql,
    after_seq: i64,
    issue_id: Option<i64>,
    limit: i64,
) -> Result<Vec<Transition>, DbError> {
    Ok(read_page(client, after_seq, issue_id, limit)
        .await?
        .transitions)
}

/// What [`read_page`] read.
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    pub transitions: Vec<Transition>,
    /// Set when transitions after `after_seq` were pruned: the oldest
    /// `seq` the log keeps, where `transitions` begin (for one issue's
    /// page, its first kept one at or after it).
    pub pruned_to: Option<i64>,
}

/// [`read_after`], and in the same snapshot whether a prune removed rows
/// right after `after_seq`: the log's oldest row is beyond `after_seq + 1`.
/// (A `seq` lost to a rolled-back commit right there looks the same; the
/// reader is then told of a prune that removed nothing.)
pub async fn read_page(
    client: &impl Sql,
    after_seq: i64,
    issue_id: Option<i64>,
    limit: i64,
) -> Result<Page, DbError> {
    let rows = match issue_id {
        None => {
            client
                .sql()
                .query_typed(
                    READ_AFTER,
                    &[(&after_seq, Type::INT8), (&limit, Type::INT8)],
                )
                .await?
        }
        Some(issue_id) => {
            client
                .sql()
                .query_typed(
                    READ_AFTER_FOR_ISSUE,
                    &[
                        (&after_seq, Type::INT8),
                        (&issue_id, Type::INT8),
                        (&limit, Type::INT8),
                    ],
                )
                .await?
        }
    };
    let oldest: Option<i64> = match rows.first() {
        Some(row) => row.get(7),
        // An issue with nothing after `after_seq`: the log may still have
        // lost rows of it there.
        None if issue_id.is_some() => oldest_seq(client).await?,
        None => None,
    };
    let transitions = rows
        .iter()
        .map(|row| {
            let seq: i64 = row.get(0);
            let from: Option<String> = row.get(2);
            let to: String = row.get(3);
            Ok(Transition {
                seq,
                issue_id: row.get(1),
                from: from
                    .map(|s| s.parse())
                    .transpose()
                    .map_err(|e| DbError::Invalid(format!("{e}")))?,
                to: to.parse().map_err(|e| DbError::Invalid(format!("{e}")))?,
                at: super::time_column(row, 4, "transition", seq)?,
                attempts: row.get(5),
                fatal: row.get(6),
            })
        })
        .collect::<Result<Vec<_>, DbError>>()?;
    Ok(Page {
        transitions,
        pruned_to: oldest.filter(|&oldest| oldest > after_seq.saturating_add(1)),
    })
}

/// The trace context each of `ids` was last worked in: that of its newest
/// logged transition that kept one, else the one it was added in
/// (`issue.traceparent`); ids with neither are left out. In id order.
pub async fn trace_contexts(client: &impl Sql, ids: &[i64]) -> Result<Vec<(i64, String)>, DbError> {
    let rows = client
        .sql()
        .query_typed(
            "SELECT id, worked_in FROM (
                SELECT i.id, COALESCE(
                         (SELECT t.traceparent FROM issue_transition t
                           WHERE t.issue_id = i.id AND t.traceparent IS NOT NULL
                           ORDER BY t.seq DESC LIMIT 1),
                         i.traceparent) AS worked_in
                  FROM issue i
                 WHERE i.id = ANY($1)) contexts
              WHERE worked_in IS NOT NULL
              ORDER BY id",
            &[(&ids, Type::INT8_ARRAY)],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// The oldest `seq` the log keeps; `None` when it is empty.
pub async fn oldest_seq(client: &impl Sql) -> Result<Option<i64>, DbError> {
    let row = client
        .sql()
        .query_typed_one("SELECT min(seq) FROM issue_transition", &[])
        .await?;
    Ok(row.get(0))
}

/// The newest `seq` in the log, 0 when it is empty.
pub async fn last_seq(client: &impl Sql) -> Result<i64, DbError> {
    let row = client
        .sql()
        .query_typed_one("SELECT COALESCE(max(seq), 0) FROM issue_transition", &[])
        .await?;
    Ok(row.get(0))
}

/// The key the log's trigger signs notifications with (migration 18), when
/// this session may read it: only the owner may. `None` when it may not, or
/// when the schema predates the key; the listener then reads the log on
/// every notification.
pub async fn notification_key(client: &impl Sql) -> Result<Option<Vec<u8>>, DbError> {
    use tokio_postgres::error::SqlState;
    match client
        .sql()
        .query_typed("SELECT key FROM notification_key", &[])
        .await
    {
        Ok(rows) => Ok(rows.first().map(|row| row.get(0))),
        Err(e)
            if [SqlState::UNDEFINED_TABLE, SqlState::INSUFFICIENT_PRIVILEGE]
                .iter()
                .any(|code| e.code() == Some(code)) =>
        {
            tracing::warn!(error = %e, "cannot read the notification key; every notification is checked against the log");
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}
