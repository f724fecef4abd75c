//! The claim: the one `FOR NO KEY UPDATE SKIP LOCKED` statement that
//! takes `PENDING` or `FAILED` issues, and what it answers.

use std::collections::BTreeSet;
use std::time::Duration;

use time::OffsetDateTime;
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;

use crate::db::{DbError, Sql};

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
    /// The W3C trace context the claim was made in, if any.
    pub traceparent: Option<String>,
    /// Whether the issue was tried before this claim: a later attempt, or
    /// an automatic retry (whose attempt may have been given back, so its
    /// count says 1 again).
    pub retry: bool,
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
/// The claim of [`claim_issues`]: a call of `newsnack_claim` (migrations
/// 22 and 38), where its one statement is written. Its parameters: the
/// ids, the holder, the lease in seconds, the attempt limit of a retry
/// (NULL for a first claim, -1 for `PENDING` only), and the issues' trace
/// contexts (`,<id>=<traceparent>,..`, NULL for none), which each claimed
/// issue's transition keeps. Where a session may keep statements
/// ([`crate::db::Statements::Named`]) the call is parsed once per session;
/// either way the server session keeps the plan of the function's
/// statement, the generic one from its sixth call on.
pub const CLAIM_STATEMENT: &str = "SELECT id, claim_id, attempts, title, body, lease_until \
     FROM newsnack_claim($1, $2, $3, $4, $5)";

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
    claim_issues_traced(client, ids, &[], worker, lease, scope).await
}

/// [`claim_issues`] with `traceparents[i]` the trace context of `ids[i]`
/// (missing ones: none), which that issue's claim transition keeps
/// (`issue_transition.traceparent`) and its [`ClaimedIssue`] carries: one
/// statement claims for requests in different contexts.
pub async fn claim_issues_traced(
    client: &impl Sql,
    ids: &[i64],
    traceparents: &[Option<&str>],
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
    let lease_s = lease.as_secs_f64();
    let contexts = super::contexts_setting(ids.iter().copied().zip(traceparents.iter().copied()));
    let params: &crate::db::TypedParams<'_> = &[
        (&ids, Type::INT8_ARRAY),
        (&worker, Type::TEXT),
        (&lease_s, Type::FLOAT8),
        (&retry_below, Type::INT4),
        (&contexts, Type::TEXT),
    ];
    let rows = crate::db::query_kept(client, CLAIM_STATEMENT, params).await?;
    let context_of = |id: i64| {
        let at = ids.iter().position(|&i| i == id)?;
        traceparents.get(at).copied().flatten().map(str::to_owned)
    };
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
                traceparent: context_of(r.get(0)),
                retry: r.get::<_, i32>(2) > 1 || matches!(scope, ClaimScope::RetryBelow(_)),
            }),
            None => {
                done.insert(r.get(0));
            }
        }
    }
    Ok(ClaimOutcome::of_request(ids, claimed, &done))
}

/// The trace context of issue `id`'s attempts before claim `claim_id`:
/// the latest logged transition's not made under that claim (the failed
/// attempt's, or the claim whose lease ran out), else the context the
/// issue was added in. Read for a retry's generation, which links to it.
pub async fn earlier_traceparent(
    client: &impl Sql,
    id: i64,
    claim_id: i64,
) -> Result<Option<String>, DbError> {
    let row = client
        .sql()
        .query_typed_one(
            "SELECT COALESCE(
                 (SELECT t.traceparent FROM issue_transition t
                   WHERE t.issue_id = $1 AND t.claim_id IS DISTINCT FROM $2
                     AND t.traceparent IS NOT NULL
                   ORDER BY t.seq DESC LIMIT 1),
                 (SELECT i.traceparent FROM issue i WHERE i.id = $1))",
            &[(&id, Type::INT8), (&claim_id, Type::INT8)],
        )
        .await?;
    Ok(row.get(0))
}
