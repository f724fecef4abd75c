//! Least-privilege roles for other systems: `newsnack grant writer ROLE`
//! and `newsnack grant reader ROLE`. A grant first takes away whatever the
//! role held on newsnack's tables, sequences and schema, then gives exactly
//! the kind's privileges, and checks that the role can do no more than
//! that (privileges held through another role, PUBLIC, or granted by
//! someone else survive a revoke); all in one transaction, so a refused
//! grant changes nothing. Names reach the SQL only through `quote_ident` and
//! `format('%I')`, run by the server.
//!
//! newsnack's tables are the relations of the current schema owned by the
//! owner of `issue` (the role that ran the migrations): other tables that
//! share the schema are left alone. Both kinds read every one of them but
//! the owner's own ([`OWNER_ONLY_TABLES`]).

use tokio_postgres::types::Type;
use tokio_postgres::{Client, Transaction};

use super::{advisory, migrate, DbError};

/// Tables no other role may read: `notification_key` signs the log's
/// notifications (migration 18), and whoever reads it can forge them.
pub const OWNER_ONLY_TABLES: &[&str] = &["notification_key"];

/// Which privileges a role gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoleKind {
    /// Reads every table; adds issues and changes their status and content.
    Writer,
    /// Reads every table; nothing else.
    Reader,
}

impl RoleKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RoleKind::Writer => "writer",
            RoleKind::Reader => "reader",
        }
    }
}

/// The columns of `issue` a writer may insert (the rest take their
/// defaults, the id included).
pub const WRITER_INSERT_COLUMNS: &[&str] =
    &["title", "body", "score", "collected_at", "source_key"];

/// The columns of `issue` a writer may update.
pub const WRITER_UPDATE_COLUMNS: &[&str] = &[
    "processing_status",
    "title",
    "body",
    "score",
    "collected_at",
    "source_key",
];

/// What a grant did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantReport {
    /// The role, as named on the command line.
    pub role: String,
    pub kind: RoleKind,
    /// The schema newsnack's tables live in.
    pub schema: String,
    /// Every table the role may now read, schema-qualified and quoted.
    pub tables: Vec<String>,
    /// The statements run, in order.
    pub statements: Vec<String>,
    /// What the grant could not fix but the operator should know.
    pub warnings: Vec<String>,
}

/// Why a grant was refused. Nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    #[error(
        "no schema to grant on: current_schema() is NULL (no schema on the search_path exists)"
    )]
    NoSchema,
    #[error(
        "schema {schema:?} is not at newsnack's schema version {needed} ({found}); run `newsnack migrate` first"
    )]
    NotMigrated {
        schema: String,
        found: String,
        needed: i32,
    },
    #[error(
        "grant must be run by the owner of newsnack's tables ({owner:?}) or a role it is granted to; {caller:?} is neither"
    )]
    NotOwner { caller: String, owner: String },
    #[error("role {0:?} does not exist")]
    NoSuchRole(String),
    #[error(
        "role {role:?} {why}, so privileges cannot restrict it; give the other system a role of its own"
    )]
    Unrestricted { role: String, why: String },
    #[error(
        "role {role:?} has no USAGE on schema {schema:?}, which only the schema's owner ({owner:?}) can grant; run grant as that role"
    )]
    NoSchemaUsage {
        role: String,
        schema: String,
        owner: String,
    },
    #[error(
        "role {role:?} would still hold more than a {kind}'s privileges, through a role it belongs to, PUBLIC, or a grant made by another role: {}; revoke those and run grant again (nothing was changed)",
        .extra.join(", ")
    )]
    Leftover {
        role: String,
        kind: &'static str,
        extra: Vec<String>,
    },
    #[error(transparent)]
    Db(#[from] DbError),
}

impl From<tokio_postgres::Error> for GrantError {
    fn from(e: tokio_postgres::Error) -> Self {
        GrantError::Db(DbError::from(e))
    }
}

/// What the server says about the schema, the caller and the role.
struct Facts {
    schema: String,
    quoted_schema: String,
    owner: u32,
    issue: u32,
    issue_name: String,
    schema_owner_name: String,
    caller_acts_for_schema: bool,
    public_may_create: bool,
    role: u32,
    quoted_role: String,
}

/// Makes `role` a least-privileged `kind` on newsnack's schema (the current
/// schema of `client`'s session), in one transaction. Idempotent; a grant
/// of another kind replaces the earlier one.
pub async fn grant(
    client: &mut Client,
    kind: RoleKind,
    role: &str,
) -> Result<GrantReport, GrantError> {
    let tx = client.transaction().await?;
    // No migration adds a table halfway through.
    tx.execute_typed(
        "SELECT pg_advisory_xact_lock($1)",
        &[(&advisory::MIGRATIONS, Type::INT8)],
    )
    .await?;
    let facts = facts(&tx, role).await?;
    let relations = tx
        .query_typed(
            "SELECT format('%I.%I', n.nspname, c.relname), c.relkind = 'S', c.relname::text
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND c.relowner = $2::oid
                AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
              ORDER BY c.relname",
            &[(&facts.schema, Type::TEXT), (&facts.owner, Type::OID)],
        )
        .await?;
    let (sequences, tables): (Vec<_>, Vec<_>) = relations
        .iter()
        .map(|r| {
            (
                r.get::<_, String>(0),
                r.get::<_, bool>(1),
                r.get::<_, String>(2),
            )
        })
        .partition(|(_, is_sequence, _)| *is_sequence);
    let readable: Vec<String> = tables
        .iter()
        .filter(|(_, _, name)| !OWNER_ONLY_TABLES.contains(&name.as_str()))
        .map(|(qualified, _, _)| qualified.clone())
        .collect();
    let tables: Vec<String> = tables.into_iter().map(|(name, _, _)| name).collect();
    let sequences: Vec<String> = sequences.into_iter().map(|(name, _, _)| name).collect();

    let statements = statements(kind, &facts, &tables, &readable, &sequences);
    for statement in &statements {
        tx.batch_execute(statement).await?;
    }

    let usage: bool = tx
        .query_typed_one(
            "SELECT has_schema_privilege($1::oid, n.oid, 'USAGE')
               FROM pg_namespace n WHERE n.nspname = $2",
            &[(&facts.role, Type::OID), (&facts.schema, Type::TEXT)],
        )
        .await?
        .get(0);
    if !usage {
        return Err(GrantError::NoSchemaUsage {
            role: role.to_string(),
            schema: facts.schema,
            owner: facts.schema_owner_name,
        });
    }
    let extra = beyond(&tx, kind, &facts).await?;
    if !extra.is_empty() {
        return Err(GrantError::Leftover {
            role: role.to_string(),
            kind: kind.as_str(),
            extra,
        });
    }
    let mut warnings = Vec::new();
    if facts.public_may_create {
        warnings.push(format!(
            "PUBLIC may create objects in schema {:?} (the default for `public` before \
             PostgreSQL 15), so {role:?} can too, and a function it creates there can take \
             the place of a built-in one in other sessions' unqualified SQL; the owner can \
             take that away with REVOKE CREATE ON SCHEMA {} FROM PUBLIC",
            facts.schema, facts.quoted_schema
        ));
    }
    tx.commit().await?;
    Ok(GrantReport {
        role: role.to_string(),
        kind,
        schema: facts.schema,
        tables: readable,
        statements,
        warnings,
    })
}

/// Reads what a grant needs to know and refuses what it cannot do.
async fn facts(tx: &Transaction<'_>, role: &str) -> Result<Facts, GrantError> {
    let row = tx
        .query_typed_one(
            "SELECT current_schema(), quote_ident(current_schema())",
            &[],
        )
        .await?;
    let (Some(schema), Some(quoted_schema)) = (
        row.get::<_, Option<String>>(0),
        row.get::<_, Option<String>>(1),
    ) else {
        return Err(GrantError::NoSchema);
    };
    let needed = migrate::MIGRATIONS.last().map_or(0, |m| m.version);
    let not_migrated = |found: String| GrantError::NotMigrated {
        schema: schema.clone(),
        found,
        needed,
    };
    let Some(issue) = tx
        .query_typed_opt(
            "SELECT c.oid, c.relowner, pg_get_userbyid(c.relowner)::text,
                    format('%I.%I', n.nspname, c.relname),
                    pg_has_role(current_user, c.relowner, 'USAGE'), current_user::text,
                    pg_get_userbyid(n.nspowner)::text,
                    pg_has_role(current_user, n.nspowner, 'USAGE'),
                    EXISTS (SELECT 1 FROM aclexplode(n.nspacl) a
                             WHERE a.grantee = 0 AND a.privilege_type = 'CREATE'),
                    to_regclass(format('%I.newsnack_migration', n.nspname)) IS NOT NULL
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND c.relname = 'issue' AND c.relkind IN ('r', 'p')",
            &[(&schema, Type::TEXT)],
        )
        .await?
    else {
        return Err(not_migrated("no table issue".into()));
    };
    if !issue.get::<_, bool>(9) {
        return Err(not_migrated("no table newsnack_migration".into()));
    }
    let owner_name: String = issue.get(2);
    if !issue.get::<_, bool>(4) {
        return Err(GrantError::NotOwner {
            caller: issue.get(5),
            owner: owner_name,
        });
    }
    let version: Option<i32> = tx
        .query_typed_one(
            &format!("SELECT max(version) FROM {quoted_schema}.newsnack_migration"),
            &[],
        )
        .await?
        .get(0);
    if version.is_none_or(|v| v < needed) {
        return Err(not_migrated(version.map_or_else(
            || "no migration applied".into(),
            |v| format!("version {v}"),
        )));
    }
    let owner: u32 = issue.get(1);
    let Some(target) = tx
        .query_typed_opt(
            "SELECT r.oid, quote_ident(r.rolname), r.rolsuper, r.rolbypassrls,
                    pg_has_role(r.oid, $2::oid, 'MEMBER'),
                    pg_has_role(r.oid, n.nspowner, 'MEMBER'),
                    r.oid = $2::oid, r.oid = n.nspowner
               FROM pg_roles r, pg_namespace n
              WHERE r.rolname = $1 AND n.nspname = $3",
            &[
                (&role, Type::TEXT),
                (&owner, Type::OID),
                (&schema, Type::TEXT),
            ],
        )
        .await?
    else {
        return Err(GrantError::NoSuchRole(role.to_string()));
    };
    let schema_owner_name: String = issue.get(6);
    let why = if target.get::<_, bool>(2) {
        Some("is a superuser".to_string())
    } else if target.get::<_, bool>(3) {
        Some("has BYPASSRLS".to_string())
    } else if target.get::<_, bool>(6) {
        Some("owns newsnack's tables".to_string())
    } else if target.get::<_, bool>(4) {
        Some(format!(
            "is a member of {owner_name:?}, which owns newsnack's tables"
        ))
    } else if target.get::<_, bool>(7) {
        Some(format!("owns schema {schema:?}"))
    } else if target.get::<_, bool>(5) {
        Some(format!(
            "is a member of {schema_owner_name:?}, which owns schema {schema:?}"
        ))
    } else {
        None
    };
    if let Some(why) = why {
        return Err(GrantError::Unrestricted {
            role: role.to_string(),
            why,
        });
    }
    Ok(Facts {
        schema,
        quoted_schema,
        owner,
        issue: issue.get(0),
        issue_name: issue.get(3),
        schema_owner_name,
        caller_acts_for_schema: issue.get(7),
        public_may_create: issue.get(8),
        role: target.get(0),
        quoted_role: target.get(1),
    })
}

/// The statements of a grant: take everything away, then give the kind's
/// (reading `readable`). The schema's own privileges only when the caller
/// acts for the schema's owner (otherwise a revoke or grant would do
/// nothing but warn).
fn statements(
    kind: RoleKind,
    facts: &Facts,
    tables: &[String],
    readable: &[String],
    sequences: &[String],
) -> Vec<String> {
    let role = &facts.quoted_role;
    let schema = &facts.quoted_schema;
    let mut out = Vec::new();
    if !tables.is_empty() {
        out.push(format!(
            "REVOKE ALL ON TABLE {} FROM {role}",
            tables.join(", ")
        ));
    }
    if !sequences.is_empty() {
        out.push(format!(
            "REVOKE ALL ON SEQUENCE {} FROM {role}",
            sequences.join(", ")
        ));
    }
    if facts.caller_acts_for_schema {
        out.push(format!("REVOKE ALL ON SCHEMA {schema} FROM {role}"));
        out.push(format!("GRANT USAGE ON SCHEMA {schema} TO {role}"));
    }
    if !readable.is_empty() {
        out.push(format!(
            "GRANT SELECT ON TABLE {} TO {role}",
            readable.join(", ")
        ));
    }
    if kind == RoleKind::Writer {
        out.push(format!(
            "GRANT INSERT ({}) ON TABLE {} TO {role}",
            WRITER_INSERT_COLUMNS.join(", "),
            facts.issue_name
        ));
        out.push(format!(
            "GRANT UPDATE ({}) ON TABLE {} TO {role}",
            WRITER_UPDATE_COLUMNS.join(", "),
            facts.issue_name
        ));
    }
    out
}

/// Every privilege the role holds, by any path, on newsnack's tables,
/// columns, sequences and schema beyond what `kind` allows (reading an
/// owner-only table included). CREATE on the
/// schema held by PUBLIC is not counted (the grant warns about it).
async fn beyond(
    tx: &Transaction<'_>,
    kind: RoleKind,
    facts: &Facts,
) -> Result<Vec<String>, GrantError> {
    let (insert, update): (&[&str], &[&str]) = match kind {
        RoleKind::Writer => (WRITER_INSERT_COLUMNS, WRITER_UPDATE_COLUMNS),
        RoleKind::Reader => (&[], &[]),
    };
    let rows = tx
        .query_typed(
            "WITH rel AS (
                 SELECT c.oid, format('%I.%I', n.nspname, c.relname) AS name, c.relkind,
                        c.relname::text AS relname
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $2 AND c.relowner = $3::oid
                    AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
             )
             SELECT format('%s on %s', p, rel.name)
               FROM rel, unnest(ARRAY['INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES',
                                      'TRIGGER']) p
              WHERE rel.relkind <> 'S' AND has_table_privilege($1::oid, rel.oid, p)
             UNION ALL
             SELECT format('SELECT on %s', rel.name)
               FROM rel
              WHERE rel.relname = ANY($7::text[])
                AND has_any_column_privilege($1::oid, rel.oid, 'SELECT')
             UNION ALL
             SELECT format('%s (%I) on %s', p, a.attname, rel.name)
               FROM rel JOIN pg_attribute a ON a.attrelid = rel.oid AND a.attnum > 0
                                           AND NOT a.attisdropped,
                    unnest(ARRAY['INSERT', 'UPDATE', 'REFERENCES']) p
              WHERE rel.relkind <> 'S'
                AND NOT has_table_privilege($1::oid, rel.oid, p)
                AND has_column_privilege($1::oid, rel.oid, a.attnum, p)
                AND NOT (rel.oid = $4::oid AND (p = 'INSERT' AND a.attname = ANY($5::text[])
                                           OR p = 'UPDATE' AND a.attname = ANY($6::text[])))
             UNION ALL
             SELECT format('%s on sequence %s', p, rel.name)
               FROM rel, unnest(ARRAY['USAGE', 'SELECT', 'UPDATE']) p
              WHERE rel.relkind = 'S' AND has_sequence_privilege($1::oid, rel.oid, p)
             UNION ALL
             SELECT format('CREATE on schema %I', n.nspname)
               FROM pg_namespace n
              WHERE n.nspname = $2 AND has_schema_privilege($1::oid, n.oid, 'CREATE')
                AND NOT EXISTS (SELECT 1 FROM aclexplode(n.nspacl) a
                                 WHERE a.grantee = 0 AND a.privilege_type = 'CREATE')",
            &[
                (&facts.role, Type::OID),
                (&facts.schema, Type::TEXT),
                (&facts.owner, Type::OID),
                (&facts.issue, Type::OID),
                (&insert, Type::TEXT_ARRAY),
                (&update, Type::TEXT_ARRAY),
                (&OWNER_ONLY_TABLES, Type::TEXT_ARRAY),
            ],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(acts_for_schema: bool) -> Facts {
        Facts {
            schema: "public".into(),
            quoted_schema: "public".into(),
            owner: 10,
            issue: 20,
            issue_name: "public.issue".into(),
            schema_owner_name: "pg_database_owner".into(),
            caller_acts_for_schema: acts_for_schema,
            public_may_create: false,
            role: 30,
            quoted_role: "\"ETL\"".into(),
        }
    }

    #[test]
    fn a_reader_gets_usage_and_select_after_everything_is_taken_away() {
        let tables =
            ["public.issue", "public.notification_key", "public.setting"].map(String::from);
        let readable = ["public.issue", "public.setting"].map(String::from);
        let sequences = ["public.issue_claim_id_seq".to_string()];
        assert_eq!(
            statements(RoleKind::Reader, &facts(true), &tables, &readable, &sequences),
            [
                "REVOKE ALL ON TABLE public.issue, public.notification_key, public.setting FROM \"ETL\"",
                "REVOKE ALL ON SEQUENCE public.issue_claim_id_seq FROM \"ETL\"",
                "REVOKE ALL ON SCHEMA public FROM \"ETL\"",
                "GRANT USAGE ON SCHEMA public TO \"ETL\"",
                "GRANT SELECT ON TABLE public.issue, public.setting TO \"ETL\"",
            ]
        );
    }

    #[test]
    fn a_writer_also_inserts_and_updates_the_listed_columns_of_issue() {
        let tables = ["public.issue".to_string()];
        let written = statements(RoleKind::Writer, &facts(false), &tables, &tables, &[]);
        assert_eq!(
            written,
            [
                "REVOKE ALL ON TABLE public.issue FROM \"ETL\"",
                "GRANT SELECT ON TABLE public.issue TO \"ETL\"",
                "GRANT INSERT (title, body, score, collected_at, source_key) ON TABLE public.issue TO \"ETL\"",
                "GRANT UPDATE (processing_status, title, body, score, collected_at, source_key) ON TABLE public.issue TO \"ETL\"",
            ]
        );
    }
}
