//! The writes under a claim, fenced by its token so that a worker whose
//! claim was taken back writes nothing: heartbeats, completions, failures,
//! releases; and the reaper's failing of claims whose lease ran out.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;

use crate::db::{DbError, Sql};

/// A fenced write of issue `$1` under claim `$2` that does not wait for
/// its row: it sets `set` only if the issue is still `IN_PROGRESS` under
/// that claim and no other transaction holds the row. Only a row the write
/// will change is locked: a claim no longer current locks nothing, so a
/// late worker never makes a concurrent claim skip an issue reset or
/// re-queued under it. The statement says whether it wrote and whether the
/// claim was current as of its snapshot; see [`single_row_outcome`].
fn single_row_write(set: &str) -> String {
    format!(
        "WITH free AS MATERIALIZED (
             SELECT id FROM issue
              WHERE id = $1 AND claim_id = $2 AND processing_status = 'IN_PROGRESS'
                FOR NO KEY UPDATE SKIP LOCKED
         ), written AS (
             UPDATE issue SET {set}
              WHERE id = $1 AND id IN (SELECT id FROM free)
          RETURNING id
         )
         SELECT EXISTS (SELECT 1 FROM written),
                EXISTS (SELECT 1 FROM issue
                         WHERE id = $1 AND claim_id = $2 AND processing_status = 'IN_PROGRESS')"
    )
}

/// What a [`single_row_write`] found: written; not written because another
/// transaction holds the row of a claim still current ([`Fenced::Busy`]);
/// or not written because the claim is no longer current or the issue is
/// gone ([`Fenced::Lost`]).
fn single_row_outcome(row: &tokio_postgres::Row) -> Fenced {
    let (written, current): (bool, bool) = (row.get(0), row.get(1));
    match (written, current) {
        (true, _) => Fenced::Written,
        (false, true) => Fenced::Busy,
        (false, false) => Fenced::Lost,
    }
}

/// Extends a live claim's lease. False when the claim is no longer current
/// (completed, reaped, re-claimed by someone else, or the issue deleted);
/// [`DbError::RowLocked`] when another transaction holds the row: a
/// beat does not wait for it (every claim's beats waiting on a long
/// transaction of another system would take every pooled connection), and
/// is tried again soon.
pub async fn heartbeat(
    client: &impl Sql,
    id: i64,
    claim_id: i64,
    lease: Duration,
) -> Result<bool, DbError> {
    let row = crate::db::query_kept_one(
        client,
        &single_row_write("lease_until = now() + make_interval(secs => $3::float8)"),
        &[
            (&id, Type::INT8),
            (&claim_id, Type::INT8),
            (&lease.as_secs_f64(), Type::FLOAT8),
        ],
    )
    .await?;
    match single_row_outcome(&row) {
        Fenced::Written => Ok(true),
        Fenced::Lost => Ok(false),
        Fenced::Busy => Err(DbError::RowLocked(id)),
    }
}

/// Whether issue `id` is still `IN_PROGRESS` under claim `claim_id`.
pub async fn claim_current(client: &impl Sql, id: i64, claim_id: i64) -> Result<bool, DbError> {
    Ok(client
        .sql()
        .query_typed_one(
            "SELECT EXISTS (SELECT 1 FROM issue
                             WHERE id = $1 AND claim_id = $2 AND processing_status = 'IN_PROGRESS')",
            &[(&id, Type::INT8), (&claim_id, Type::INT8)],
        )
        .await?
        .get(0))
}
/// How a fenced write ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// The claim was current and the write happened.
    Written,
    /// The claim was no longer current (reaped, re-claimed, or finished by
    /// someone else), or the issue is gone: nothing was written.
    Lost,
    /// Another transaction held the row (a system editing it with
    /// plain SQL): nothing was written, and nothing waited; try again.
    Busy,
}

/// A finished article for a claim, to be recorded as `DONE`.
#[derive(Debug, Clone)]
pub struct Completion {
    pub id: i64,
    /// The fencing token of the claim that wrote it.
    pub claim_id: i64,
    pub headline: String,
    pub body: String,
    /// What the model said writing it took.
    pub usage: crate::model::llm::TokenUsage,
}

/// The completion of [`complete`]: a call of `newsnack_complete`
/// (migration 22), where its one statement is written, kept as
/// [`super::CLAIM_STATEMENT`] is. Its parameters: ids, claim ids, headlines and
/// bodies (one element per completion), the writer, and the prompt and
/// completion tokens (one element per completion, NULL where not
/// reported), and the issues' trace contexts (`,<id>=<traceparent>,..`,
/// NULL for none; migration 38). The statement looks the ids up by primary key (`= ANY(ids)`),
/// however few issues the statistics say are in flight; only the rows of
/// claims still current are locked, and rows another transaction holds are
/// skipped, not waited for: one issue locked by a system editing it with
/// plain SQL must not hold up every completion queued behind it, and a late
/// worker must not make a concurrent claim skip an issue reset under it.
/// The lock is `FOR UPDATE`, which also conflicts with the `FOR KEY SHARE`
/// that another transaction's insert of an article for the issue holds: the
/// article insert would otherwise wait for that transaction on the unique
/// index. Answers one row per completion whose claim was current as of the
/// statement's snapshot: its id, its claim id, and whether it was written.
pub const COMPLETE_STATEMENT: &str =
    "SELECT id, claim_id, written FROM newsnack_complete($1, $2, $3, $4, $5, $6, $7, $8)";

/// Completes claims in one statement (so one transaction): each issue that
/// is still `IN_PROGRESS` under its very claim is set `DONE` and its article
/// stored; the others are left alone, [`Fenced::Busy`] if another
/// transaction held the row. Answers in the order given.
pub async fn complete(
    client: &impl Sql,
    completions: &[Completion],
    writer: &str,
) -> Result<Vec<Fenced>, DbError> {
    complete_in_contexts(client, completions, &[], writer).await
}

/// [`complete`] of completions each made in its trace context
/// (`contexts[i]` for `completions[i]`, missing ones: none), which each
/// `DONE` transition keeps: still one statement.
pub async fn complete_in_contexts(
    client: &impl Sql,
    completions: &[Completion],
    contexts: &[Option<String>],
    writer: &str,
) -> Result<Vec<Fenced>, DbError> {
    let contexts = super::contexts_setting(
        completions
            .iter()
            .map(|c| c.id)
            .zip(contexts.iter().map(Option::as_deref)),
    );
    let column = |f: fn(&Completion) -> i64| completions.iter().map(f).collect::<Vec<_>>();
    let text = |f: fn(&Completion) -> &str| completions.iter().map(f).collect::<Vec<_>>();
    let tokens = |f: fn(&Completion) -> Option<i32>| completions.iter().map(f).collect::<Vec<_>>();
    let current: BTreeMap<(i64, i64), bool> = crate::db::query_kept(
        client,
        COMPLETE_STATEMENT,
        &[
            (&column(|c| c.id), Type::INT8_ARRAY),
            (&column(|c| c.claim_id), Type::INT8_ARRAY),
            (&text(|c| &c.headline), Type::TEXT_ARRAY),
            (&text(|c| &c.body), Type::TEXT_ARRAY),
            (&writer, Type::TEXT),
            (&tokens(|c| c.usage.prompt_tokens), Type::INT4_ARRAY),
            (&tokens(|c| c.usage.completion_tokens), Type::INT4_ARRAY),
            (&contexts, Type::TEXT),
        ],
    )
    .await?
    .iter()
    .map(|r| ((r.get(0), r.get(1)), r.get(2)))
    .collect();
    Ok(completions
        .iter()
        .map(|c| match current.get(&(c.id, c.claim_id)) {
            Some(true) => Fenced::Written,
            // Current, but another transaction held the row.
            Some(false) => Fenced::Busy,
            // Not current, or the issue is gone.
            None => Fenced::Lost,
        })
        .collect())
}

/// Sets the W3C trace context the rest of transaction `tx` runs in
/// (`SET LOCAL newsnack.traceparent`, migration 34): the transitions it
/// logs keep it. `None` clears it.
async fn in_trace(tx: &impl Sql, traceparent: Option<&str>) -> Result<(), DbError> {
    tx.sql()
        .execute_typed(
            "SELECT set_config('newsnack.traceparent', $1, true)",
            &[(&traceparent.unwrap_or(""), Type::TEXT)],
        )
        .await?;
    Ok(())
}

/// [`fail`] in the trace context `traceparent`, which the `FAILED`
/// transition keeps: one transaction.
pub async fn fail_traced(
    client: &mut deadpool_postgres::Client,
    id: i64,
    claim_id: i64,
    reason: &str,
    retry: RetryPolicy,
    traceparent: &str,
) -> Result<Fenced, DbError> {
    let tx = client.transaction().await?;
    in_trace(&tx, Some(traceparent)).await?;
    let fenced = fail(&tx, id, claim_id, reason, retry).await?;
    tx.commit().await?;
    Ok(fenced)
}

/// Whether and when a failed issue may be retried automatically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryPolicy {
    /// After the usual backoff, but not before this long (e.g. Retry-After).
    After(Option<Duration>),
    /// Never automatically (a fatal error): stored as
    /// `retry_not_before = 'infinity'` until an operator resets the issue.
    Never,
}

/// Fails a claim (`IN_PROGRESS -> FAILED`) with a reason, only if it is
/// still current; [`Fenced::Busy`], without waiting, if another transaction
/// holds the row.
pub async fn fail(
    client: &impl Sql,
    id: i64,
    claim_id: i64,
    reason: &str,
    retry: RetryPolicy,
) -> Result<Fenced, DbError> {
    let (wait, never): (Option<f64>, bool) = match retry {
        RetryPolicy::After(d) => (d.map(|d| d.as_secs_f64()), false),
        RetryPolicy::Never => (None, true),
    };
    let row = crate::db::query_kept_one(
        client,
        &single_row_write(
            "processing_status = 'FAILED', last_error = $3,
             retry_not_before = CASE WHEN $5 THEN 'infinity'::timestamptz
                                     ELSE now() + make_interval(secs => $4::float8) END",
        ),
        &[
            (&id, Type::INT8),
            (&claim_id, Type::INT8),
            (&reason, Type::TEXT),
            (&wait, Type::FLOAT8),
            (&never, Type::BOOL),
        ],
    )
    .await?;
    Ok(single_row_outcome(&row))
}

/// Fails a claim like [`fail`] (retryable, not before `retry_after`), in
/// the trace context `traceparent` if there is one, giving its attempt back (migrations 9 and 10): the LLM refused the call
/// for its account's quota (a 429 or 503 with `Retry-After`), not for the
/// article, so the retry after the pause does not use up `max_attempts`.
pub async fn fail_unspent(
    client: &mut deadpool_postgres::Client,
    id: i64,
    claim_id: i64,
    reason: &str,
    retry_after: Duration,
    traceparent: Option<&str>,
) -> Result<Fenced, DbError> {
    let tx = client.transaction().await?;
    if traceparent.is_some() {
        in_trace(&tx, traceparent).await?;
    }
    // Bound to this very transaction: the trigger compares it with its own
    // transaction id.
    tx.sql()
        .execute_typed(
            "SELECT set_config('newsnack.attempt_unspent', txid_current()::text, true)",
            &[],
        )
        .await?;
    let row = tx
        .sql()
        .query_typed_one(
            &single_row_write(
                "processing_status = 'FAILED', last_error = $3,
                 retry_not_before = now() + make_interval(secs => $4::float8)",
            ),
            &[
                (&id, Type::INT8),
                (&claim_id, Type::INT8),
                (&reason, Type::TEXT),
                (&retry_after.as_secs_f64(), Type::FLOAT8),
            ],
        )
        .await?;
    tx.commit().await?;
    Ok(single_row_outcome(&row))
}

/// Releases claims this instance will not finish: each issue still
/// `IN_PROGRESS` under its claim is set `FAILED` with `reason`, to be
/// retried at once by whichever instance remains. `attempt_spent: false`
/// (the generation never began) gives the claim's attempt back (migrations
/// 9 and 10). One statement, one transaction; rows other transactions hold
/// are skipped, not waited for (shutdown must end; they return with their
/// lease). Returns how many were released.
pub async fn release(
    client: &mut deadpool_postgres::Client,
    claims: &[(i64, i64)],
    reason: &str,
    attempt_spent: bool,
) -> Result<u64, DbError> {
    let (ids, claim_ids): (Vec<i64>, Vec<i64>) = claims.iter().copied().unzip();
    let tx = client.transaction().await?;
    if !attempt_spent {
        // Bound to this very transaction: the trigger compares it with
        // its own transaction id.
        tx.sql()
            .execute_typed(
                "SELECT set_config('newsnack.attempt_unspent', txid_current()::text, true)",
                &[],
            )
            .await?;
    }
    let released = tx
        .sql()
        .execute_typed(
            "WITH free AS MATERIALIZED (
                 SELECT i.id FROM issue i
                   JOIN unnest($1::bigint[], $2::bigint[]) AS c(id, claim_id) USING (id, claim_id)
                  WHERE i.id = ANY($1::bigint[]) AND i.processing_status = 'IN_PROGRESS'
                  ORDER BY i.id FOR NO KEY UPDATE OF i SKIP LOCKED
             )
             UPDATE issue i SET processing_status = 'FAILED', last_error = $3, retry_not_before = NULL
              WHERE i.id = ANY($1::bigint[]) AND i.id IN (SELECT id FROM free)",
            &[
                (&ids, Type::INT8_ARRAY),
                (&claim_ids, Type::INT8_ARRAY),
                (&reason, Type::TEXT),
            ],
        )
        .await?;
    tx.commit().await?;
    Ok(released)
}

/// The `last_error` of a cancelled issue./// Moves `IN_PROGRESS` issues whose lease has expired to `FAILED` with
/// reason `lease expired`. A guarded compare-and-set: a row is taken only if,
/// when locked, it is still `IN_PROGRESS` under the same claim with its lease
/// still expired, so an issue completed or heartbeated in between is left
/// alone; rows locked by a finishing worker are skipped, not waited for.
/// Runs on any session: the reaper's is the one holding its lock.
pub async fn reap_expired(client: &impl Sql, limit: i64) -> Result<Vec<i64>, DbError> {
    let mut ids: Vec<i64> = client
        .sql()
        .query_typed(
            "WITH expired AS MATERIALIZED (
                 SELECT id, claim_id FROM issue
                  WHERE processing_status = 'IN_PROGRESS' AND lease_until < now()
                  ORDER BY lease_until
                  LIMIT $1
                    FOR NO KEY UPDATE SKIP LOCKED
             )
             UPDATE issue i
                SET processing_status = 'FAILED', last_error = 'lease expired'
               FROM expired e
              WHERE i.id = e.id AND i.claim_id = e.claim_id
                AND i.processing_status = 'IN_PROGRESS' AND i.lease_until < now()
          RETURNING i.id",
            &[(&limit, Type::INT8)],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    ids.sort_unstable();
    Ok(ids)
}
