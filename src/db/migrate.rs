//! The schema migrations in `sql/`, embedded in the binary and applied in
//! order, once, under an advisory lock so that instances starting together
//! do not race. Migrations that name their schema write `@extschema@`,
//! which becomes the schema they run in. Migrating also makes the
//! migrating role's sessions plan without JIT ([`plan_without_jit`]).

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
    Migration {
        version: 15,
        name: "owner-run rules",
        sql: include_str!("../../sql/0015_owner_run_rules.sql"),
    },
    Migration {
        version: 16,
        name: "statement plans",
        sql: include_str!("../../sql/0016_statement_plans.sql"),
    },
    Migration {
        version: 17,
        name: "llm budget",
        sql: include_str!("../../sql/0017_llm_budget.sql"),
    },
    Migration {
        version: 18,
        name: "signed notifications",
        sql: include_str!("../../sql/0018_signed_notifications.sql"),
    },
    Migration {
        version: 19,
        name: "leaner transition record",
        sql: include_str!("../../sql/0019_leaner_transition_record.sql"),
    },
    Migration {
        version: 20,
        name: "shorter log lock",
        sql: include_str!("../../sql/0020_shorter_log_lock.sql"),
    },
    Migration {
        version: 21,
        name: "less per write",
        sql: include_str!("../../sql/0021_less_per_write.sql"),
    },
    Migration {
        version: 22,
        name: "claim by key",
        sql: include_str!("../../sql/0022_claim_by_key.sql"),
    },
    Migration {
        version: 23,
        name: "running for years",
        sql: include_str!("../../sql/0023_running_for_years.sql"),
    },
    Migration {
        version: 24,
        name: "answer settings",
        sql: include_str!("../../sql/0024_answer_settings.sql"),
    },
    Migration {
        version: 27,
        name: "flat costs",
        sql: include_str!("../../sql/0027_flat_costs.sql"),
    },
    Migration {
        version: 28,
        name: "day budget",
        sql: include_str!("../../sql/0028_day_budget.sql"),
    },
    Migration {
        version: 29,
        name: "fallback provider",
        sql: include_str!("../../sql/0029_fallback_provider.sql"),
    },
    Migration {
        version: 30,
        name: "budget steps",
        sql: include_str!("../../sql/0030_budget_steps.sql"),
    },
    Migration {
        version: 31,
        name: "cached steps",
        sql: include_str!("../../sql/0031_cached_steps.sql"),
    },
    Migration {
        version: 32,
        name: "scale hint",
        sql: include_str!("../../sql/0032_scale_hint.sql"),
    },
    Migration {
        version: 34,
        name: "trace context",
        sql: include_str!("../../sql/0034_trace_context.sql"),
    },
    Migration {
        version: 36,
        name: "kept budget reads",
        sql: include_str!("../../sql/0036_kept_budget_reads.sql"),
    },
    Migration {
        version: 37,
        name: "claim contexts",
        sql: include_str!("../../sql/0037_claim_contexts.sql"),
    },
    Migration {
        version: 38,
        name: "traced claim inline",
        sql: include_str!("../../sql/0038_traced_claim_inline.sql"),
    },
];

/// What a migration writes for the schema it runs in.
pub const SCHEMA_PLACEHOLDER: &str = "@extschema@";

/// A migration's SQL for the schema `quoted_schema` (already quoted as an
/// identifier, e.g. by `quote_ident`).
pub fn for_schema(sql: &str, quoted_schema: &str) -> String {
    sql.replace(SCHEMA_PLACEHOLDER, quoted_schema)
}

/// What a migration run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    pub applied: Vec<i32>,
    pub current: i32,
}

/// Applies every pending migration in one transaction. Concurrent callers
/// wait on the lock and then find nothing left to do.
pub async fn migrate(client: &mut Client) -> Result<MigrationReport, DbError> {
    migrate_up_to(client, None).await
}

/// [`migrate`], stopping after version `last` when given (to show how a
/// database behaves before a migration, or to upgrade step by step).
pub async fn migrate_up_to(
    client: &mut Client,
    last: Option<i32>,
) -> Result<MigrationReport, DbError> {
    let tx = client.transaction().await?;
    tx.execute_typed(
        "SELECT pg_advisory_xact_lock($1)",
        &[(&advisory::MIGRATIONS, Type::INT8)],
    )
    .await?;
    // The schema every unqualified name below lands in, quoted for the
    // migrations that name it.
    let row = tx
        .query_typed_one(
            "SELECT current_schema(), quote_ident(current_schema())",
            &[],
        )
        .await?;
    let (schema, quoted_schema): (Option<String>, Option<String>) = (row.get(0), row.get(1));
    let (Some(schema), Some(quoted_schema)) = (schema, quoted_schema) else {
        return Err(DbError::Invalid(
            "no schema to migrate into: current_schema() is NULL (no schema on the \
             search_path exists); create one or set search_path"
                .into(),
        ));
    };
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
    let pending: Vec<&Migration> = MIGRATIONS
        .iter()
        .filter(|m| !done.contains(&m.version) && last.is_none_or(|last| m.version <= last))
        .collect();
    // The name goes inside string literals and dollar-quoted function
    // bodies, where a quote or a dollar sign would end them early.
    if schema.contains(['\'', '$']) && pending.iter().any(|m| m.sql.contains(SCHEMA_PLACEHOLDER)) {
        return Err(DbError::Invalid(format!(
            "cannot migrate into schema {schema:?}: newsnack needs a schema name without ' or $"
        )));
    }
    let mut applied = Vec::new();
    for migration in pending {
        tx.batch_execute(&for_schema(migration.sql, &quoted_schema))
            .await?;
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
    plan_without_jit(&tx).await?;
    tx.commit().await?;
    Ok(MigrationReport {
        applied,
        current: last.map_or(known, |last| last.min(known)),
    })
}

/// Makes every later session of this role in this database plan without
/// JIT compilation, unless its sessions already do (`jit` off by the
/// server, the database or the role): the service runs short statements,
/// and a plan estimated over tables never analyzed (a fresh install's)
/// can cross `jit_above_cost` and spend a quarter of a second compiling
/// what then runs in a fraction of a millisecond, on every read.
///
/// A role default (`ALTER ROLE .. IN DATABASE .. SET jit = off`), which
/// any role may set for itself: the server applies it to every session it
/// opens for the role, whoever asks for it, so it holds behind a
/// transaction pooler too. A startup option would not (PgBouncer refuses
/// `options` unless told to ignore it), nor would a `SET` on a pooled
/// connection (a transaction pooler hands each transaction whichever
/// server session is free). The migrating session is set too: behind a
/// transaction pooler, the server session it ran on goes on serving the
/// service, and a role's default reaches only sessions opened after it.
async fn plan_without_jit(tx: &tokio_postgres::Transaction<'_>) -> Result<(), DbError> {
    tx.batch_execute(
        "DO $$
             BEGIN
                 IF current_setting('jit')::boolean THEN
                     EXECUTE format('ALTER ROLE CURRENT_USER IN DATABASE %I SET jit = off',
                                    current_database());
                 END IF;
             END $$;
             SET jit = off",
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_placeholder_becomes_the_quoted_schema_everywhere() {
        let sql = "CREATE FUNCTION @extschema@.f() SET search_path = @extschema@, pg_temp \
                   AS $$ SELECT nextval('@extschema@.s') $$";
        assert_eq!(
            for_schema(sql, "\"My App\""),
            "CREATE FUNCTION \"My App\".f() SET search_path = \"My App\", pg_temp \
             AS $$ SELECT nextval('\"My App\".s') $$"
        );
    }
}
