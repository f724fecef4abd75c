//! The schema migrations in `sql/`, embedded in the binary and applied in
//! order, once, under an advisory lock so that instances starting together
//! do not race.

use tokio_postgres::types::Type;
use tokio_postgres::Client;

use super::{advisory, DbError};

/// A numbered migration and its SQL.
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
}

/// Every migration this binary knows, in order.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "schema",
        sql: include_str!("../../sql/0001_schema.sql"),
    },
    Migration {
        version: 2,
        name: "transitions",
        sql: include_str!("../../sql/0002_transitions.sql"),
    },
    Migration {
        version: 3,
        name: "settings",
        sql: include_str!("../../sql/0003_settings.sql"),
    },
    Migration {
        version: 4,
        name: "pipeline",
        sql: include_str!("../../sql/0004_pipeline.sql"),
    },
    Migration {
        version: 5,
        name: "claim token",
        sql: include_str!("../../sql/0005_claim_token.sql"),
    },
    Migration {
        version: 6,
        name: "lease index",
        sql: include_str!("../../sql/0006_lease_index.sql"),
    },
    Migration {
        version: 7,
        name: "schedule check",
        sql: include_str!("../../sql/0007_schedule_check.sql"),
    },
    Migration {
        version: 8,
        name: "collected_at range",
        sql: include_str!("../../sql/0008_collected_at_range.sql"),
    },
    Migration {
        version: 9,
        name: "unspent attempts",
        sql: include_str!("../../sql/0009_unspent_attempts.sql"),
    },
    Migration {
        version: 10,
        name: "unspent attempts per transaction",
        sql: include_str!("../../sql/0010_unspent_attempts_per_transaction.sql"),
    },
    Migration {
        version: 11,
        name: "bounded leases and pinned tokens",
        sql: include_str!("../../sql/0011_bounded_leases_and_pinned_tokens.sql"),
    },
    Migration {
        version: 12,
        name: "issue removal notice",
        sql: include_str!("../../sql/0012_issue_removal_notice.sql"),
    },
    Migration {
        version: 13,
        name: "readable timestamps",
        sql: include_str!("../../sql/0013_readable_timestamps.sql"),
    },
    Migration {
        version: 14,
        name: "setting truncate notice",
        sql: include_str!("../../sql/0014_setting_truncate_notice.sql"),
    },
];

/// What a migration run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    pub applied: Vec<i32>,
    pub current: i32,
}

/// Applies every pending migration in one transaction. Concurrent callers
/// wait on the lock and then find nothing left to do.
pub async fn migrate(client: &mut Client) -> Result<MigrationReport, DbError> {
    let tx = client.transaction().await?;
    tx.execute_typed(
        "SELECT pg_advisory_xact_lock($1)",
        &[(&advisory::MIGRATIONS, Type::INT8)],
    )
    .await?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS newsnack_migration (
             version    integer PRIMARY KEY,
             name       text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         )",
    )
    .await?;
    let done: Vec<i32> = tx
        .query_typed(
            "SELECT version FROM newsnack_migration ORDER BY version",
            &[],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    let known = MIGRATIONS.last().map_or(0, |m| m.version);
    if let Some(&newest) = done.iter().max() {
        if newest > known {
            return Err(DbError::Invalid(format!(
                "the database schema is at version {newest}, newer than this binary knows ({known}); upgrade newsnack"
            )));
        }
    }
    let mut applied = Vec::new();
    for migration in MIGRATIONS.iter().filter(|m| !done.contains(&m.version)) {
        tx.batch_execute(migration.sql).await?;
        tx.execute_typed(
            "INSERT INTO newsnack_migration (version, name) VALUES ($1, $2)",
            &[
                (&migration.version, Type::INT4),
                (&migration.name, Type::TEXT),
            ],
        )
        .await?;
        applied.push(migration.version);
    }
    tx.commit().await?;
    Ok(MigrationReport {
        applied,
        current: known,
    })
}
