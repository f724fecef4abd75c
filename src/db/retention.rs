//! Retention: what `newsnack prune` and `serve`'s hourly prune remove, in
//! small transactions (docs/runbook.md, "Pruning").
//!
//! - `issue_transition`, from its start only: every row before the first
//!   one at most `log_retention_days` old goes, and the newest row always
//!   stays, so `seq` has no gap after the oldest kept row and the log's end
//!   (which the listener and waits start from) is never lost. Readers asked
//!   for a position before the oldest kept row learn of it through
//!   [`super::transition::read_page`].
//! - `pipeline_run` rows started longer ago than that (finished ones), and
//!   the LLM budget's bookkeeping: finished calls and the class remembered
//!   for issues that are `DONE` or gone.
//! - With `issue_retention_days` > 0, `DONE` issues with their articles and
//!   `FAILED` issues with no automatic retry (fatal, or out of attempts)
//!   last updated longer ago than that. Briefings are never deleted; each
//!   keeps its own text.
//!
//! Every batch is one statement of its own transaction: a hundred rows,
//! locked briefly, with a rest after it. No batch takes the log's lock:
//! deleting old log rows does not touch the rows the transition trigger appends, so claims and
//! transitions never wait on a prune. Issues are deleted `FOR UPDATE SKIP
//! LOCKED`, rechecked under the lock, so an issue a claim or a status
//! change holds is left for the next prune; their deletion is announced
//! like any other (`issue_removed`).

use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;

use super::{DbError, Sql};

/// Rows per batch: a batch of 100 log rows takes about 2.5 ms, short
/// enough that a claim arriving meanwhile hardly notices it.
pub const BATCH: i64 = 100;

/// After each batch the prune rests this many times as long as the batch
/// took, so it uses at most a quarter of a core: claims running meanwhile
/// keep their latency (docs/performance.md, "prune").
pub const REST_PER_BATCH: u32 = 3;

/// Rests after a batch that took `took` (see [`REST_PER_BATCH`]).
async fn rest_after(took: std::time::Duration) {
    tokio::time::sleep(took * REST_PER_BATCH).await;
}

/// What to keep, from the settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// `log_retention_days`; 0 keeps everything.
    pub log_days: i64,
    /// `issue_retention_days`; 0 keeps everything.
    pub issue_days: i64,
    /// `max_attempts`: a `FAILED` issue with this many attempts is not
    /// retried automatically.
    pub max_attempts: i64,
}

/// Rows removed (or, for a dry run, that would be) per table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PruneReport {
    pub dry_run: bool,
    pub issue_transition: i64,
    pub pipeline_run: i64,
    pub llm_call: i64,
    pub issue_priority: i64,
    pub ai_article: i64,
    pub issue: i64,
}

impl PruneReport {
    /// Rows in all tables.
    pub fn total(&self) -> i64 {
        self.issue_transition
            + self.pipeline_run
            + self.llm_call
            + self.issue_priority
            + self.ai_article
            + self.issue
    }

    /// Rows per table, by the table's name.
    pub fn by_table(&self) -> [(&'static str, i64); 6] {
        [
            ("issue_transition", self.issue_transition),
            ("pipeline_run", self.pipeline_run),
            ("llm_call", self.llm_call),
            ("issue_priority", self.issue_priority),
            ("ai_article", self.ai_article),
            ("issue", self.issue),
        ]
    }
}

/// The issues past `issue_retention_days` (`$1` days, `$2` max attempts).
const OLD_ISSUES: &str = "updated_at < now() - make_interval(days => $1::int)
       AND (processing_status = 'DONE'
            OR (processing_status = 'FAILED'
                AND (retry_not_before = 'infinity' OR attempts >= $2::int)))";

/// The first `seq` the log keeps for `log_retention_days` = `$1`: the
/// first row at most that old, and never beyond the newest row.
const LOG_KEEPS_FROM: &str = "SELECT LEAST(
         (SELECT min(seq) FROM issue_transition
           WHERE at >= now() - make_interval(days => $1::int)),
         (SELECT max(seq) FROM issue_transition))";

/// Remembered classes whose issue is `DONE` or gone, asked for longer ago
/// than `$1` days.
const OLD_PRIORITIES: &str = "p.requested_at < now() - make_interval(days => $1::int)
       AND NOT EXISTS (SELECT 1 FROM issue i
                        WHERE i.id = p.issue_id AND i.processing_status <> 'DONE')";

/// Prunes by `retention` (or, with `dry_run`, counts what would go). Run it
/// outside a transaction: each batch commits on its own.
pub async fn prune(
    client: &impl Sql,
    retention: &Retention,
    dry_run: bool,
) -> Result<PruneReport, DbError> {
    let mut report = PruneReport {
        dry_run,
        ..PruneReport::default()
    };
    if dry_run {
        count(client, retention, &mut report).await?;
        return Ok(report);
    }
    if retention.issue_days > 0 {
        prune_issues(client, retention, &mut report).await?;
    }
    if retention.log_days > 0 {
        prune_log(client, retention.log_days, &mut report).await?;
    }
    Ok(report)
}

async fn count(
    client: &impl Sql,
    retention: &Retention,
    report: &mut PruneReport,
) -> Result<(), DbError> {
    let (issue_days, log_days) = (days(retention.issue_days), days(retention.log_days));
    let max_attempts = retention.max_attempts.clamp(0, i32::MAX as i64) as i32;
    let row = client
        .sql()
        .query_typed_one(
            &format!(
                "WITH old AS MATERIALIZED (
                     SELECT id FROM issue WHERE $1::int > 0 AND {OLD_ISSUES}
                 ), keeps_from AS MATERIALIZED (
                     SELECT ({}) AS seq
                 )
                 SELECT (SELECT count(*) FROM old),
                        (SELECT count(*) FROM ai_article WHERE issue_id IN (SELECT id FROM old)),
                        (SELECT count(*) FROM issue_priority p
                          WHERE p.issue_id IN (SELECT id FROM old)
                             OR ($3::int > 0 AND {})),
                        (SELECT count(*) FROM issue_transition
                          WHERE $3::int > 0 AND seq < (SELECT seq FROM keeps_from)),
                        (SELECT count(*) FROM pipeline_run
                          WHERE $3::int > 0 AND outcome <> 'running'
                            AND started_at < now() - make_interval(days => $3::int)),
                        (SELECT count(*) FROM llm_call
                          WHERE $3::int > 0
                            AND finished_at < now() - make_interval(days => $3::int))",
                LOG_KEEPS_FROM.replace("$1", "$3"),
                OLD_PRIORITIES.replace("$1", "$3"),
            ),
            &[
                (&issue_days, Type::INT4),
                (&max_attempts, Type::INT4),
                (&log_days, Type::INT4),
            ],
        )
        .await?;
    report.issue = row.get(0);
    report.ai_article = row.get(1);
    report.issue_priority = row.get(2);
    report.issue_transition = row.get(3);
    report.pipeline_run = row.get(4);
    report.llm_call = row.get(5);
    Ok(())
}

/// Days as the statements take them (settings are bounded well within).
fn days(days: i64) -> i32 {
    days.clamp(0, i32::MAX as i64) as i32
}

async fn prune_issues(
    client: &impl Sql,
    retention: &Retention,
    report: &mut PruneReport,
) -> Result<(), DbError> {
    let issue_days = days(retention.issue_days);
    let max_attempts = retention.max_attempts.clamp(0, i32::MAX as i64) as i32;
    let statement = format!(
        "WITH doomed AS MATERIALIZED (
             SELECT id FROM issue
              WHERE id > $3 AND {OLD_ISSUES}
              ORDER BY id LIMIT $4
                FOR UPDATE SKIP LOCKED
         ), articles AS (
             DELETE FROM ai_article a USING doomed d WHERE a.issue_id = d.id RETURNING a.id
         ), priorities AS (
             DELETE FROM issue_priority p USING doomed d WHERE p.issue_id = d.id RETURNING p.issue_id
         ), issues AS (
             DELETE FROM issue i USING doomed d WHERE i.id = d.id RETURNING i.id
         )
         SELECT (SELECT count(*) FROM doomed), (SELECT max(id) FROM doomed),
                (SELECT count(*) FROM articles), (SELECT count(*) FROM priorities),
                (SELECT count(*) FROM issues)"
    );
    let mut after = 0i64;
    loop {
        let started = std::time::Instant::now();
        let row = client
            .sql()
            .query_typed_one(
                &statement,
                &[
                    (&issue_days, Type::INT4),
                    (&max_attempts, Type::INT4),
                    (&after, Type::INT8),
                    (&BATCH, Type::INT8),
                ],
            )
            .await?;
        let (seen, last): (i64, Option<i64>) = (row.get(0), row.get(1));
        report.ai_article += row.get::<_, i64>(2);
        report.issue_priority += row.get::<_, i64>(3);
        report.issue += row.get::<_, i64>(4);
        match last {
            Some(last) if seen == BATCH => after = last,
            _ => return Ok(()),
        }
        rest_after(started.elapsed()).await;
    }
}

async fn prune_log(
    client: &impl Sql,
    log_days: i64,
    report: &mut PruneReport,
) -> Result<(), DbError> {
    let log_days = days(log_days);
    let keeps_from: Option<i64> = client
        .sql()
        .query_typed_one(LOG_KEEPS_FROM, &[(&log_days, Type::INT4)])
        .await?
        .get(0);
    if let Some(keeps_from) = keeps_from {
        report.issue_transition = batches(
            client,
            "DELETE FROM issue_transition
              WHERE seq IN (SELECT seq FROM issue_transition WHERE seq < $1 ORDER BY seq LIMIT $2)",
            &keeps_from,
            Type::INT8,
        )
        .await?;
    }
    report.pipeline_run = batches(
        client,
        "DELETE FROM pipeline_run
          WHERE id IN (SELECT id FROM pipeline_run
                        WHERE outcome <> 'running'
                          AND started_at < now() - make_interval(days => $1::int)
                        ORDER BY id LIMIT $2)",
        &log_days,
        Type::INT4,
    )
    .await?;
    report.llm_call = batches(
        client,
        "DELETE FROM llm_call
          WHERE id IN (SELECT id FROM llm_call
                        WHERE finished_at < now() - make_interval(days => $1::int)
                        ORDER BY id LIMIT $2)",
        &log_days,
        Type::INT4,
    )
    .await?;
    report.issue_priority += batches(
        client,
        &format!(
            "DELETE FROM issue_priority
              WHERE issue_id IN (SELECT p.issue_id FROM issue_priority p
                                  WHERE {OLD_PRIORITIES}
                                  ORDER BY p.issue_id LIMIT $2)"
        ),
        &log_days,
        Type::INT4,
    )
    .await?;
    Ok(())
}

/// Runs `statement` (`$1`: `param`, `$2`: the batch size) until a batch
/// deletes fewer than [`BATCH`] rows; the rows deleted in all.
async fn batches(
    client: &impl Sql,
    statement: &str,
    param: &(dyn tokio_postgres::types::ToSql + Sync),
    param_type: Type,
) -> Result<i64, DbError> {
    let mut total = 0;
    loop {
        let started = std::time::Instant::now();
        let n = client
            .sql()
            .execute_typed(
                statement,
                &[(param, param_type.clone()), (&BATCH, Type::INT8)],
            )
            .await? as i64;
        total += n;
        if n < BATCH {
            return Ok(total);
        }
        rest_after(started.elapsed()).await;
    }
}
