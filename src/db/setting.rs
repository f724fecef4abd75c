//! Queries on `setting` and `setting_spec`. Validation lives in the
//! database trigger, so SQL writers and `newsnack settings set` get the same
//! answers.

use serde::Serialize;
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient as _;

use super::{DbError, Sql};

/// A setting with its current value and what it may be.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SettingRow {
    pub key: String,
    pub value: String,
    pub default_value: String,
    pub min_value: i64,
    pub max_value: i64,
    pub description: String,
    /// `integer`, or the kind of text it is (`schedule`, `prompt`,
    /// `prompt_template`, `time_zone`, `title_template`).
    pub kind: String,
}

/// Every known setting; a key without a row shows its default.
pub async fn list(client: &impl Sql) -> Result<Vec<SettingRow>, DbError> {
    let rows = client
        .sql()
        .query_typed(
            "SELECT sp.key, COALESCE(s.value, sp.default_value), sp.default_value,
                    sp.min_value, sp.max_value, sp.description, sp.kind
               FROM setting_spec sp LEFT JOIN setting s ON s.key = sp.key
              ORDER BY sp.key",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| SettingRow {
            key: r.get(0),
            value: r.get(1),
            default_value: r.get(2),
            min_value: r.get(3),
            max_value: r.get(4),
            description: r.get(5),
            kind: r.get(6),
        })
        .collect())
}

/// Sets one value; the trigger rejects unknown keys and bad values (a
/// `schedule` field by field) with a message that says why. Returns the
/// value as stored (normalised).
pub async fn set(client: &impl Sql, key: &str, value: &str) -> Result<String, DbError> {
    let row = client
        .sql()
        .query_typed_one(
            "INSERT INTO setting (key, value) VALUES ($1, $2)
             ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value
             RETURNING value",
            &[(&key, Type::TEXT), (&value, Type::TEXT)],
        )
        .await?;
    Ok(row.get(0))
}
