//! The dashboard's snapshot: counts per status, the claims in flight, the
//! newest transitions, recent pipeline runs, the latest briefing, the LLM
//! budget (queued calls by class, calls in flight against the limit, the
//! pause, tokens spent) and the log position they all reflect, read in one
//! `REPEATABLE READ` snapshot.
//!
//! Because a transition's log row is written in the transaction that makes
//! the change, and `seq` is allocated in commit order, the rows read here
//! reflect exactly the transitions up to `last_seq`: a page that applies the
//! live stream from `seq > last_seq` on top of these counts neither misses
//! nor double-counts a change.

use std::collections::BTreeMap;

use serde::Serialize;
use time::OffsetDateTime;
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;

use super::briefing::{self, Briefing};
use super::llm_budget::{self, BudgetView};
use super::pipeline_run::{self, RunView};
use super::{DbError, Sql};
use crate::model::status::Status;

/// How many in-flight claims, transitions and runs a snapshot carries.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub in_flight: i64,
    pub transitions: i64,
    pub runs: i64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            in_flight: 50,
            transitions: 50,
            runs: 10,
        }
    }
}

/// An issue currently `IN_PROGRESS`, with its claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InFlight {
    pub id: i64,
    pub title: String,
    pub claimed_by: Option<String>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub lease_until: Option<OffsetDateTime>,
    pub attempts: i32,
    /// When it entered `IN_PROGRESS` (its last update).
    #[serde(with = "time::serde::rfc3339")]
    pub since: OffsetDateTime,
}

/// One row of the transition log, with its issue's title.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RecentTransition {
    pub seq: i64,
    pub issue_id: i64,
    pub title: Option<String>,
    pub from: Option<Status>,
    pub to: Status,
    #[serde(with = "time::serde::rfc3339")]
    pub at: OffsetDateTime,
    pub attempts: i32,
    pub fatal: bool,
    pub reason: Option<String>,
}

/// Everything the dashboard shows, as of one log position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Snapshot {
    /// Every status, zeros included.
    pub counts: BTreeMap<Status, i64>,
    /// Soonest lease deadline first.
    pub in_flight: Vec<InFlight>,
    /// Newest first.
    pub transitions: Vec<RecentTransition>,
    /// Newest first.
    pub runs: Vec<RunView>,
    pub briefing: Option<Briefing>,
    /// The LLM budget every instance shares.
    pub llm: BudgetView,
    /// The newest `seq` reflected in all of the above (0: an empty log).
    pub last_seq: i64,
    /// The server's clock, so a page can count leases down without trusting
    /// its own.
    #[serde(with = "time::serde::rfc3339")]
    pub now: OffsetDateTime,
}

/// Reads the snapshot in one read-only `REPEATABLE READ` transaction;
/// "today" (for the tokens spent) began at `today_began`.
pub async fn snapshot(
    client: &mut deadpool_postgres::Client,
    limits: Limits,
    today_began: OffsetDateTime,
) -> Result<Snapshot, DbError> {
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    // The first statement fixes the snapshot, so it reads the log position
    // that everything after it reflects.
    let (last_seq, now) = log_position_and_clock(&tx).await?;
    let counts = super::issue::count_by_status(&tx)
        .await?
        .into_iter()
        .collect();
    let in_flight = in_flight(&tx, limits.in_flight).await?;
    let transitions = recent_transitions(&tx, limits.transitions).await?;
    let runs = pipeline_run::recent(&tx, limits.runs).await?;
    let briefing = briefing::get(&tx, None).await?;
    let llm = llm_budget::view(&tx, today_began).await?;
    tx.commit().await?;

    Ok(Snapshot {
        counts,
        in_flight,
        transitions,
        runs,
        briefing,
        llm,
        last_seq,
        now,
    })
}

/// The newest `seq` in the log (0 when it is empty) and the server's clock.
async fn log_position_and_clock(client: &impl Sql) -> Result<(i64, OffsetDateTime), DbError> {
    let row = client
        .sql()
        .query_typed_one(
            "SELECT (SELECT COALESCE(max(seq), 0) FROM issue_transition), now()",
            &[],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// The claims in flight, soonest lease deadline first.
async fn in_flight(client: &impl Sql, limit: i64) -> Result<Vec<InFlight>, DbError> {
    client
        .sql()
        .query_typed(
            "SELECT id, title, claimed_by, lease_until, attempts, updated_at
               FROM issue WHERE processing_status = 'IN_PROGRESS' AND lease_until IS NOT NULL
              ORDER BY lease_until, id
              LIMIT $1",
            &[(&limit, Type::INT8)],
        )
        .await?
        .iter()
        .map(|r| {
            let id: i64 = r.get(0);
            Ok(InFlight {
                id,
                title: r.get(1),
                claimed_by: r.get(2),
                lease_until: super::time_column(r, 3, "issue", id)?,
                attempts: r.get(4),
                since: super::time_column(r, 5, "issue", id)?,
            })
        })
        .collect()
}

/// The newest rows of the transition log, newest first, with their issues'
/// titles (none for an issue since deleted).
async fn recent_transitions(
    client: &impl Sql,
    limit: i64,
) -> Result<Vec<RecentTransition>, DbError> {
    client
        .sql()
        .query_typed(
            "SELECT t.seq, t.issue_id, i.title, t.from_status, t.to_status, t.at, t.attempts,
                    t.fatal, t.reason
               FROM issue_transition t LEFT JOIN issue i ON i.id = t.issue_id
              ORDER BY t.seq DESC
              LIMIT $1",
            &[(&limit, Type::INT8)],
        )
        .await?
        .into_iter()
        .map(|r| {
            let seq: i64 = r.get(0);
            Ok(RecentTransition {
                seq,
                issue_id: r.get(1),
                title: r.get(2),
                from: r
                    .get::<_, Option<&str>>(3)
                    .map(super::parse_status)
                    .transpose()?,
                to: super::parse_status(r.get(4))?,
                at: super::time_column(&r, 5, "transition", seq)?,
                attempts: r.get(6),
                fatal: r.get(7),
                reason: r.get(8),
            })
        })
        .collect()
}
