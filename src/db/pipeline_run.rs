//! Queries on `pipeline_run`: the record of every pipeline run.

use serde::Serialize;
use time::OffsetDateTime;
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;

use super::{DbError, Sql};

/// What a finished run decided.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunRecord {
    pub outcome: String,
    pub targets: Vec<i64>,
    pub claimed: Vec<i64>,
    pub completed: Vec<i64>,
    pub failed: Vec<i64>,
    pub unfinished: Vec<i64>,
    pub waited_ms: Option<i64>,
    pub briefing_id: Option<i64>,
    pub error: Option<String>,
}

/// A run as listings show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct RunView {
    pub id: i64,
    pub trigger: String,
    #[serde(with = "time::serde::rfc3339::option")]
    pub tick: Option<OffsetDateTime>,
    pub instance: String,
    #[serde(with = "time::serde::rfc3339")]
    pub started_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    pub finished_at: Option<OffsetDateTime>,
    pub outcome: String,
    pub targets: Vec<i64>,
    pub completed: Vec<i64>,
    pub briefing_id: Option<i64>,
    pub error: Option<String>,
}

/// Records the start of a run. For a scheduled run, `None` when its tick
/// already has a run (another instance took it).
pub async fn start(
    client: &impl Sql,
    trigger: &str,
    tick: Option<OffsetDateTime>,
    instance: &str,
    settings: &serde_json::Value,
) -> Result<Option<i64>, DbError> {
    let row = client
        .sql()
        .query_typed_opt(
            "INSERT INTO pipeline_run (trigger, tick, instance, settings) VALUES ($1, $2, $3, $4)
             ON CONFLICT (tick) WHERE trigger = 'schedule' DO NOTHING
             RETURNING id",
            &[
                (&trigger, Type::TEXT),
                (&tick, Type::TIMESTAMPTZ),
                (&instance, Type::TEXT),
                (settings, Type::JSONB),
            ],
        )
        .await?;
    Ok(row.map(|r| r.get(0)))
}

/// Whether a scheduled run of `tick` was recorded, whatever its outcome.
pub async fn tick_has_run(client: &impl Sql, tick: OffsetDateTime) -> Result<bool, DbError> {
    Ok(client
        .sql()
        .query_typed_one(
            "SELECT EXISTS (SELECT 1 FROM pipeline_run WHERE trigger = 'schedule' AND tick = $1)",
            &[(&tick, Type::TIMESTAMPTZ)],
        )
        .await?
        .get(0))
}

/// The tick of the newest scheduled run that published a briefing, if
/// any: the newest ticks first, along the one-run-per-tick index.
pub async fn last_published_tick(client: &impl Sql) -> Result<Option<OffsetDateTime>, DbError> {
    Ok(client
        .sql()
        .query_typed_one(
            "SELECT (SELECT tick FROM pipeline_run
                      WHERE trigger = 'schedule' AND briefing_id IS NOT NULL
                      ORDER BY tick DESC LIMIT 1)",
            &[],
        )
        .await?
        .get(0))
}

/// Marks runs left `running` by an instance that died as `abandoned`.
/// Call only while holding the pipeline lock (so none is really running).
pub async fn abandon_stale(client: &impl Sql) -> Result<u64, DbError> {
    Ok(client
        .sql()
        .execute_typed(
            "UPDATE pipeline_run SET outcome = 'abandoned', finished_at = now(),
                    error = 'its instance stopped, or could not record the outcome, before the run finished'
              WHERE outcome = 'running'",
            &[],
        )
        .await?)
}

/// Records how a run ended, if it is still `running`; false when it is not
/// (another instance, holding the pipeline lock after this one lost it,
/// marked it `abandoned`). The update's row lock orders it with that
/// instance's [`abandon_stale`]: exactly one of the two writes the outcome.
pub async fn finish(client: &impl Sql, id: i64, record: &RunRecord) -> Result<bool, DbError> {
    let updated = client
        .sql()
        .execute_typed(
            "UPDATE pipeline_run SET finished_at = now(), outcome = $2, targets = $3, claimed = $4,
                    completed = $5, failed = $6, unfinished = $7, waited_ms = $8, briefing_id = $9, error = $10
              WHERE id = $1 AND outcome = 'running'",
            &[
                (&id, Type::INT8),
                (&record.outcome, Type::TEXT),
                (&record.targets, Type::INT8_ARRAY),
                (&record.claimed, Type::INT8_ARRAY),
                (&record.completed, Type::INT8_ARRAY),
                (&record.failed, Type::INT8_ARRAY),
                (&record.unfinished, Type::INT8_ARRAY),
                (&record.waited_ms, Type::INT8),
                (&record.briefing_id, Type::INT8),
                (&record.error, Type::TEXT),
            ],
        )
        .await?;
    Ok(updated == 1)
}

/// Whether the run's row holds exactly `record`'s outcome, briefing and
/// error: once a commit whose answer was lost (the connection broke while
/// committing) has ended, whether it landed. Another writer's outcome
/// (`abandon_stale`'s) differs in its error.
pub async fn recorded_as(client: &impl Sql, id: i64, record: &RunRecord) -> Result<bool, DbError> {
    let row = client
        .sql()
        .query_typed_opt(
            "SELECT outcome, briefing_id, error FROM pipeline_run WHERE id = $1",
            &[(&id, Type::INT8)],
        )
        .await?;
    Ok(row.is_some_and(|r| {
        r.get::<_, String>(0) == record.outcome
            && r.get::<_, Option<i64>>(1) == record.briefing_id
            && r.get::<_, Option<String>>(2) == record.error
    }))
}

/// The newest runs first.
pub async fn recent(client: &impl Sql, limit: i64) -> Result<Vec<RunView>, DbError> {
    let rows = client
        .sql()
        .query_typed(
            "SELECT id, trigger, tick, instance, started_at, finished_at, outcome, targets, completed,
                    briefing_id, error
               FROM pipeline_run ORDER BY id DESC LIMIT $1",
            &[(&limit, Type::INT8)],
        )
        .await?;
    rows.iter()
        .map(|r| {
            let id: i64 = r.get(0);
            Ok(RunView {
                id,
                trigger: r.get(1),
                tick: super::time_column(r, 2, "pipeline run", id)?,
                instance: r.get(3),
                started_at: super::time_column(r, 4, "pipeline run", id)?,
                finished_at: super::time_column(r, 5, "pipeline run", id)?,
                outcome: r.get(6),
                targets: r.get(7),
                completed: r.get(8),
                briefing_id: r.get(9),
                error: r.get(10),
            })
        })
        .collect()
}

/// The pipeline's candidates: the `top_k` hottest issues collected within
/// `lookback_hours` that are not `DONE`, and not `FAILED` beyond this run's
/// reach: a fatal failure or `max_attempts` used up (those stay `FAILED`
/// until an operator resets them), or a retry not allowed before
/// `within_s` from now (the server's `Retry-After`). Hottest first; for
/// each, whether it is `PENDING`.
pub async fn select_targets(
    client: &impl Sql,
    top_k: i64,
    lookback_hours: i64,
    max_attempts: i64,
    within_s: f64,
) -> Result<Vec<(i64, bool)>, DbError> {
    Ok(client
        .sql()
        .query_typed(
            "SELECT id, processing_status = 'PENDING' FROM issue
              WHERE collected_at >= now() - make_interval(hours => $2::integer)
                AND processing_status <> 'DONE'
                AND NOT (processing_status = 'FAILED'
                         AND (attempts >= $3::integer
                              OR COALESCE(retry_not_before > now() + make_interval(secs => $4::float8), false)))
              ORDER BY score DESC, id
              LIMIT $1",
            &[
                (&top_k, Type::INT8),
                (&(lookback_hours as i32), Type::INT4),
                (&(max_attempts.min(i32::MAX as i64) as i32), Type::INT4),
                (&within_s, Type::FLOAT8),
            ],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}
