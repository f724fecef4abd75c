//! What the retry scheduler and the smart wait read of issues: their
//! retry state, the failed ones with attempts left, a wait's targets with
//! the log position they reflect.

use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;

use crate::db::{DbError, Sql};
use crate::model::status::Status;

/// What the retry scheduler needs to know about a failed issue.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryState {
    pub id: i64,
    pub status: Status,
    pub attempts: i32,
    /// How long until `retry_not_before` (finite) by the database's clock,
    /// if it is set and still ahead.
    pub not_due_for: Option<std::time::Duration>,
    /// A fatal failure: no automatic retry at all.
    pub never: bool,
}

/// The retry-relevant state of some issues (unknown ids are absent).
pub async fn retry_state(client: &impl Sql, ids: &[i64]) -> Result<Vec<RetryState>, DbError> {
    client
        .sql()
        .query_typed(
            "SELECT id, processing_status, attempts,
                    CASE WHEN isfinite(retry_not_before) AND retry_not_before > now()
                         THEN extract(epoch FROM retry_not_before - now())::float8 END,
                    COALESCE(retry_not_before = 'infinity', false)
               FROM issue WHERE id = ANY($1) ORDER BY id",
            &[(&ids, Type::INT8_ARRAY)],
        )
        .await?
        .iter()
        .map(RetryState::from_row)
        .collect()
}

impl RetryState {
    /// From columns `id, processing_status, attempts, seconds until
    /// retry_not_before (or NULL), retry_not_before = 'infinity'`.
    fn from_row(r: &tokio_postgres::Row) -> Result<RetryState, DbError> {
        Ok(RetryState {
            id: r.get(0),
            status: crate::db::parse_status(r.get(1))?,
            attempts: r.get(2),
            not_due_for: r
                .get::<_, Option<f64>>(3)
                .and_then(|s| std::time::Duration::try_from_secs_f64(s).ok()),
            never: r.get(4),
        })
    }
}

/// `FAILED` issues that still have attempts left, for a retry scheduler
/// starting up (failures may have happened while nothing was running).
pub async fn failed_with_attempts_left(
    client: &impl Sql,
    max_attempts: i32,
) -> Result<Vec<i64>, DbError> {
    Ok(client
        .sql()
        .query_typed(
            "SELECT id FROM issue
              WHERE processing_status = 'FAILED' AND attempts < $1
                AND (retry_not_before IS NULL OR retry_not_before <> 'infinity')
              ORDER BY id",
            &[(&max_attempts, Type::INT4)],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// The targets of a wait and the log position they reflect, read in one
/// snapshot: every transition up to the returned `seq` is reflected in the
/// rows, and (the log being commit-ordered) every later one has a larger
/// `seq`.
pub async fn wait_targets(
    client: &impl Sql,
    ids: &[i64],
) -> Result<(Vec<RetryState>, i64), DbError> {
    let rows = client
        .sql()
        .query_typed(
            "SELECT id, processing_status, attempts,
                    CASE WHEN isfinite(retry_not_before) AND retry_not_before > now()
                         THEN extract(epoch FROM retry_not_before - now())::float8 END,
                    COALESCE(retry_not_before = 'infinity', false),
                    (SELECT COALESCE(max(seq), 0) FROM issue_transition)
               FROM issue WHERE id = ANY($1)
              UNION ALL
             SELECT NULL, NULL, NULL, NULL, NULL, (SELECT COALESCE(max(seq), 0) FROM issue_transition)",
            &[(&ids, Type::INT8_ARRAY)],
        )
        .await?;
    let mut seq = 0;
    let mut targets = Vec::new();
    for r in rows {
        seq = r.get(5);
        if r.get::<_, Option<i64>>(0).is_some() {
            targets.push(RetryState::from_row(&r)?);
        }
    }
    Ok((targets, seq))
}
