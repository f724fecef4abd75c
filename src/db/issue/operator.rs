//! What an operator does to issues: cancel them (no automatic retry) and
//! reset failed ones to `PENDING`.

use std::collections::BTreeSet;

use serde::Serialize;
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;

use crate::db::{DbError, Sql};
use crate::model::status::Status;

/// Operator reset `FAILED -> PENDING` with a fresh retry budget; returns the
/// ids that were reset (those that were `FAILED`).
pub async fn reset_failed(client: &impl Sql, ids: &[i64]) -> Result<Vec<i64>, DbError> {
    let rows = client
        .sql()
        .query_typed(
            "UPDATE issue SET processing_status = 'PENDING'
              WHERE id = ANY($1) AND processing_status = 'FAILED'
          RETURNING id",
            &[(&ids, Type::INT8_ARRAY)],
        )
        .await?;
    let mut reset: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    reset.sort_unstable();
    Ok(reset)
}
pub const CANCELLED: &str = "cancelled";

/// What [`cancel`] did with each id asked for (each list in id order).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CancelOutcome {
    /// Now (or already) `FAILED` with `last_error` `cancelled` and no
    /// automatic retry.
    pub cancelled: Vec<i64>,
    /// `DONE`: its article is written, there is nothing to cancel.
    pub done: Vec<i64>,
    /// No such issue.
    pub unknown: Vec<i64>,
}

/// Cancels issues: each ends `FAILED` with `last_error` `cancelled` and no
/// automatic retry (`retry_not_before = 'infinity'`; an operator's reset
/// brings it back), within the legal transitions, in one transaction:
///
/// - `IN_PROGRESS` goes to `FAILED`; the claim is gone, so the instance
///   writing the article learns it from the transition and a late answer
///   is fenced out. The attempt stays spent.
/// - `PENDING`, and `FAILED` not cancelled yet, go to `IN_PROGRESS` and on
///   to `FAILED` (two logged transitions, `claimed_by` `cancel`), with the
///   attempt given back (migrations 9 and 10).
/// - An issue already cancelled is left as it is; `DONE` is left alone.
///
/// Rows are locked in id order, waiting for a finishing worker's commit:
/// an article recorded first makes the issue `DONE`.
pub async fn cancel(
    client: &mut deadpool_postgres::Client,
    ids: &[i64],
) -> Result<CancelOutcome, DbError> {
    let tx = client.transaction().await?;
    let rows = tx
        .sql()
        .query_typed(
            "SELECT id, processing_status,
                    processing_status = 'FAILED' AND last_error IS NOT DISTINCT FROM $2
                    AND retry_not_before IS NOT DISTINCT FROM 'infinity'
               FROM issue WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE",
            &[(&ids, Type::INT8_ARRAY), (&CANCELLED, Type::TEXT)],
        )
        .await?;
    let mut outcome = CancelOutcome::default();
    let (mut in_progress, mut round_trip) = (Vec::new(), Vec::new());
    let mut known = BTreeSet::new();
    for row in &rows {
        let id: i64 = row.get(0);
        known.insert(id);
        match (crate::db::parse_status(row.get(1))?, row.get::<_, bool>(2)) {
            (Status::Done, _) => outcome.done.push(id),
            (Status::InProgress, _) => in_progress.push(id),
            (Status::Failed, true) => {}
            (Status::Pending | Status::Failed, _) => round_trip.push(id),
        }
        if !outcome.done.contains(&id) {
            outcome.cancelled.push(id);
        }
    }
    outcome.unknown = ids
        .iter()
        .copied()
        .filter(|id| !known.contains(id))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let fail = "UPDATE issue SET processing_status = 'FAILED', last_error = $2,
                       retry_not_before = 'infinity'
                 WHERE id = ANY($1) AND processing_status = 'IN_PROGRESS'";
    if !in_progress.is_empty() {
        tx.sql()
            .execute_typed(
                fail,
                &[(&in_progress, Type::INT8_ARRAY), (&CANCELLED, Type::TEXT)],
            )
            .await?;
    }
    if !round_trip.is_empty() {
        // From here on, a FAILED in this transaction gives its attempt
        // back: the trigger compares the setting with its transaction id.
        tx.sql()
            .execute_typed(
                "SELECT set_config('newsnack.attempt_unspent', txid_current()::text, true)",
                &[],
            )
            .await?;
        tx.sql()
            .execute_typed(
                "UPDATE issue SET processing_status = 'IN_PROGRESS', claimed_by = 'cancel'
                  WHERE id = ANY($1) AND processing_status IN ('PENDING', 'FAILED')",
                &[(&round_trip, Type::INT8_ARRAY)],
            )
            .await?;
        tx.sql()
            .execute_typed(
                fail,
                &[(&round_trip, Type::INT8_ARRAY), (&CANCELLED, Type::TEXT)],
            )
            .await?;
    }
    tx.commit().await?;
    Ok(outcome)
}
