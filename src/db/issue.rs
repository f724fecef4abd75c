//! Queries on `issue`: adding, reading, counting, claiming (the one
//! `FOR NO KEY UPDATE SKIP LOCKED` statement), heartbeats and resets.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::Serialize;
use time::OffsetDateTime;
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;

use super::{DbError, Sql};
use crate::model::status::Status;

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

/// One issue won by a claim, with what a writer needs to generate it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedIssue {
    pub id: i64,
    /// The fencing token: only this claim may complete or fail the issue.
    pub claim_id: i64,
    pub attempts: i32,
    pub title: String,
    pub body: String,
    pub lease_until: OffsetDateTime,
    /// The lease the claim was taken with (`lease_until` counts from the
    /// claim's commit): the first heartbeat must come well within it,
    /// whatever `lease_s` says by the time the generation starts.
    pub lease: Duration,
}

/// What a claim did with each requested id.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClaimOutcome {
    pub claimed: Vec<ClaimedIssue>,
    /// Requested ids not claimed: locked by another claim, not `PENDING` or
    /// `FAILED`, or unknown. Sorted, without duplicates.
    pub skipped: Vec<i64>,
    /// The skipped ids that were `DONE` (terminal, so they stay skipped).
    /// Sorted.
    pub done: Vec<i64>,
}

impl ClaimOutcome {
    /// The outcome of a request for `ids`: what it won (sorted by id), and
    /// which of the rest were among the `DONE` ids seen.
    pub fn of_request(ids: &[i64], mut claimed: Vec<ClaimedIssue>, done: &BTreeSet<i64>) -> Self {
        claimed.sort_by_key(|c| c.id);
        let won: BTreeSet<i64> = claimed.iter().map(|c| c.id).collect();
        let asked: BTreeSet<i64> = ids.iter().copied().collect();
        ClaimOutcome {
            skipped: asked.difference(&won).copied().collect(),
            done: asked.intersection(done).copied().collect(),
            claimed,
        }
    }

    pub fn claimed_ids(&self) -> Vec<i64> {
        self.claimed.iter().map(|c| c.id).collect()
    }
}

/// Which issues a claim may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimScope {
    /// `PENDING` or `FAILED`, whatever the attempts so far: an explicit request.
    Claimable,
    /// Only `PENDING` issues: a pipeline run's new targets (one that failed
    /// since it was selected is left to the retry rules).
    Pending,
    /// Only `FAILED` issues with fewer than this many attempts whose
    /// `retry_not_before` has passed: an automatic retry.
    RetryBelow(i32),
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
    Ok(add_issues(client, issues).await?.ids)
}

/// Adds issues; an item whose `source_key` an issue already holds (or an
/// earlier item of the same call) adds nothing and answers that issue.
///
/// One `INSERT .. ON CONFLICT (source_key) DO NOTHING`, then one read of
/// the keys it skipped: an insert that meets a key another transaction is
/// adding waits for it to commit, then skips, and the read (a later
/// statement, so a later snapshot) sees that issue. A skipped key whose
/// issue is gone by the read (deleted meanwhile) is inserted again.
pub async fn add_issues(client: &impl Sql, issues: &[NewIssue]) -> Result<Added, DbError> {
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
                "INSERT INTO issue (title, body, score, collected_at, source_key)
                 SELECT t, b, s, COALESCE(c, now()), k
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

/// The claim of [`claim_issues`]: a call of `newsnack_claim` (migration
/// 22), where its one statement is written. Its parameters: the ids, the
/// holder, the lease in seconds, and the attempt limit of a retry (NULL
/// for a first claim, -1 for `PENDING` only). Where a session may keep
/// statements ([`super::Statements::Named`]) the call is parsed once per
/// session; either way the server session keeps the plan of the
/// function's statement, the generic one from its sixth call on.
pub const CLAIM_STATEMENT: &str =
    "SELECT id, claim_id, attempts, title, body, lease_until FROM newsnack_claim($1, $2, $3, $4)";

/// Claims, in one statement, every requested issue that is claimable and not
/// locked by a concurrent claim: sets it `IN_PROGRESS` under a new fencing
/// token, counts the attempt, records the holder and the lease deadline.
/// (The transition trigger enforces the same bookkeeping for raw-SQL
/// claims.)
///
/// `FOR NO KEY UPDATE` rather than `FOR UPDATE`: inserting an `ai_article`
/// takes `FOR KEY SHARE` on its issue, which `FOR UPDATE SKIP LOCKED` would
/// treat as a conflict and skip. The locked set is a materialised CTE so it
/// is computed exactly once. The same statement reports which requested ids
/// it saw `DONE` (read from its snapshot, so only committed, final states).
pub async fn claim_issues(
    client: &impl Sql,
    ids: &[i64],
    worker: &str,
    lease: Duration,
    scope: ClaimScope,
) -> Result<ClaimOutcome, DbError> {
    // The scope as the statement's $4: NULL, -1 (pending only) or the
    // attempts bound of a retry.
    let retry_below: Option<i32> = match scope {
        ClaimScope::Claimable => None,
        ClaimScope::Pending => Some(-1),
        ClaimScope::RetryBelow(max) => Some(max),
    };
    let rows = super::query_kept(
        client,
        CLAIM_STATEMENT,
        &[
            (&ids, Type::INT8_ARRAY),
            (&worker, Type::TEXT),
            (&lease.as_secs_f64(), Type::FLOAT8),
            (&retry_below, Type::INT4),
        ],
    )
    .await?;
    let mut claimed = Vec::new();
    let mut done = BTreeSet::new();
    for r in &rows {
        match r.get::<_, Option<i64>>(1) {
            Some(claim_id) => claimed.push(ClaimedIssue {
                id: r.get(0),
                claim_id,
                attempts: r.get(2),
                title: r.get(3),
                body: r.get(4),
                lease_until: r.get(5),
                lease,
            }),
            None => {
                done.insert(r.get(0));
            }
        }
    }
    Ok(ClaimOutcome::of_request(ids, claimed, &done))
}

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
/// [`DbError::RowLocked`] when another transaction holds the issue's row: a
/// beat does not wait for it (every claim's beats waiting on a long
/// transaction of another system would take every pooled connection), and
/// is tried again soon.
pub async fn heartbeat(
    client: &impl Sql,
    id: i64,
    claim_id: i64,
    lease: Duration,
) -> Result<bool, DbError> {
    let row = super::query_kept_one(
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

/// How a fenced write ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// The claim was current and the write happened.
    Written,
    /// The claim was no longer current (reaped, re-claimed, or finished by
    /// someone else), or the issue is gone: nothing was written.
    Lost,
    /// Another transaction held the issue's row (a system editing it with
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
/// [`CLAIM_STATEMENT`] is. Its parameters: ids, claim ids, headlines and
/// bodies (one element per completion), the writer, and the prompt and
/// completion tokens (one element per completion, NULL where not
/// reported). The statement looks the ids up by primary key (`= ANY(ids)`),
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
    "SELECT id, claim_id, written FROM newsnack_complete($1, $2, $3, $4, $5, $6, $7)";

/// Completes claims in one statement (so one transaction): each issue that
/// is still `IN_PROGRESS` under its very claim is set `DONE` and its article
/// stored; the others are left alone, [`Fenced::Busy`] if another
/// transaction held the row. Answers in the order given.
pub async fn complete(
    client: &impl Sql,
    completions: &[Completion],
    writer: &str,
) -> Result<Vec<Fenced>, DbError> {
    let column = |f: fn(&Completion) -> i64| completions.iter().map(f).collect::<Vec<_>>();
    let text = |f: fn(&Completion) -> &str| completions.iter().map(f).collect::<Vec<_>>();
    let tokens = |f: fn(&Completion) -> Option<i32>| completions.iter().map(f).collect::<Vec<_>>();
    let current: BTreeMap<(i64, i64), bool> = super::query_kept(
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
    let row = super::query_kept_one(
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

/// Fails a claim like [`fail`] (retryable, not before `retry_after`),
/// giving its attempt back (migrations 9 and 10): the LLM refused the call
/// for its account's quota (a 429 or 503 with `Retry-After`), not for the
/// article, so the retry after the pause does not use up `max_attempts`.
pub async fn fail_unspent(
    client: &mut deadpool_postgres::Client,
    id: i64,
    claim_id: i64,
    reason: &str,
    retry_after: Duration,
) -> Result<Fenced, DbError> {
    let tx = client.transaction().await?;
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

/// The `last_error` of a cancelled issue.
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
        match (super::parse_status(row.get(1))?, row.get::<_, bool>(2)) {
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

/// Moves `IN_PROGRESS` issues whose lease has expired to `FAILED` with
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
            status: super::parse_status(r.get(1))?,
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
