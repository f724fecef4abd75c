//! JSON shapes of the HTTP API (new issues are also the CLI's file input):
//! what clients send and the answers they get. Integers in requests
//! follow JSON Schema, which counts `2.0` an integer: a whole number
//! written with a fraction or an exponent is taken as that integer
//! ([`whole_ids`], [`whole_option`]).

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::json;
use time::OffsetDateTime;
use utoipa::openapi::schema::{
    ArrayBuilder, KnownFormat, ObjectBuilder, SchemaFormat, SchemaType, Type,
};
use utoipa::openapi::Ref;

use crate::db::issue::NewIssue;
use crate::input;

/// One issue as clients send it.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewIssueJson {
    #[schema(schema_with = title_schema)]
    pub title: String,
    #[serde(default)]
    #[schema(schema_with = body_schema)]
    pub body: String,
    /// Hotness, for the pipeline's top-K selection.
    #[serde(default)]
    pub score: f64,
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[schema(schema_with = collected_at_schema)]
    pub collected_at: Option<OffsetDateTime>,
    #[serde(default)]
    #[schema(schema_with = source_key_schema)]
    pub source_key: Option<String>,
}

impl From<NewIssueJson> for NewIssue {
    fn from(j: NewIssueJson) -> Self {
        NewIssue {
            title: j.title,
            body: j.body,
            score: j.score,
            collected_at: j.collected_at,
            source_key: j.source_key,
        }
    }
}

/// The issues of the items sent, in the order they were sent: new ones,
/// or for a `source_key` already there, the issue that holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct AddedIssues {
    /// One id per item, in input order.
    pub ids: Vec<i64>,
    /// The ids in `ids` of issues that were there before (their key was),
    /// once each, in input order.
    pub existing: Vec<i64>,
}

/// What a claim did with the ids it was asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct ClaimAnswer {
    /// Claimed now, generated in the background.
    pub claimed: Vec<i64>,
    /// Not claimable: in progress, done, or unknown (sorted, once each).
    pub skipped: Vec<i64>,
}

/// An integer as JSON Schema counts one: `7`, or a number with no
/// fractional part such as `7.0` or `7e0`, within `i64`.
struct Whole(i64);

impl<'de> Deserialize<'de> for Whole {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Whole;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an integer")
            }

            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Whole, E> {
                Ok(Whole(n))
            }

            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Whole, E> {
                i64::try_from(n)
                    .map(Whole)
                    .map_err(|_| E::custom(format!("{n} is beyond the largest integer taken")))
            }

            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Whole, E> {
                // -2^63 <= n < 2^63: exactly the f64 values that fit in i64.
                const BOUND: f64 = 9_223_372_036_854_775_808.0;
                if n.fract() == 0.0 && (-BOUND..BOUND).contains(&n) {
                    Ok(Whole(n as i64))
                } else {
                    Err(E::custom(format!("expected an integer, got {n}")))
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// Deserializes a list of integers, each as JSON Schema counts one.
pub fn whole_ids<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<i64>, D::Error> {
    let ids = Vec::<Whole>::deserialize(deserializer)?;
    Ok(ids.into_iter().map(|Whole(n)| n).collect())
}

/// Deserializes an optional integer (absent or `null`: `None`), as JSON
/// Schema counts one. Use with `#[serde(default)]`.
pub fn whole_option<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<i64>, D::Error> {
    Ok(Option::<Whole>::deserialize(deserializer)?.map(|Whole(n)| n))
}

/// A title: not blank, no NUL character. The class is exactly the
/// characters [`char::is_whitespace`] takes for white space (and NUL).
pub const TITLE_PATTERN: &str = "^[^\\u0000]*[^\\u0000\\t\\n\\u000b\\f\\r \\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000][^\\u0000]*$";
/// A body: no NUL character.
pub const BODY_PATTERN: &str = "^[^\\u0000]*$";
/// A `collected_at` whose year, as written, is from 0002 to 9998
/// ([`input::COLLECTED_YEARS`]).
pub const COLLECTED_AT_PATTERN: &str =
    "^(000[2-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-8][0-9]{3}|9[0-8][0-9]{2}|99[0-8][0-9]|999[0-8])-";

/// An issue's title.
pub fn title_schema() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .min_length(Some(1))
        .max_length(Some(input::MAX_TITLE_CHARS))
        .pattern(Some(TITLE_PATTERN))
        .description(Some(
            "Not blank (a character other than white space) and no NUL character",
        ))
}

/// An issue's body (the source material).
pub fn body_schema() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .max_length(Some(input::MAX_BODY_CHARS))
        .pattern(Some(BODY_PATTERN))
        .default(Some(json!("")))
        .description(Some("No NUL character"))
}

/// When an issue was collected (absent or `null`: now).
pub fn collected_at_schema() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime)))
        .pattern(Some(COLLECTED_AT_PATTERN))
        .description(Some(
            "RFC 3339, a year from 0002 to 9998 as written; absent or null: now",
        ))
}

/// A wait's `deadline` (absent or `null`: none).
pub fn deadline_schema() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime)))
        .pattern(Some(COLLECTED_AT_PATTERN))
        .description(Some(
            "RFC 3339, a year from 0002 to 9998 as written (the pattern `collected_at` has), at most a day ahead; not with `timeout_s`",
        ))
}

/// A collector's key for a story (absent or `null`: none).
pub fn source_key_schema() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
        .min_length(Some(1))
        .max_length(Some(input::MAX_SOURCE_KEY_CHARS))
        .pattern(Some(BODY_PATTERN))
        .description(Some(
            "The collector's key for the story, 1 to 1000 characters in at most 2048 bytes \
             of UTF-8, no NUL character: \
             an item whose key an issue already holds adds nothing and answers that issue",
        ))
}

/// The body of every error answer; a 409 adds fields of its own.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong, for a person to read.
    pub error: String,
}

/// The 409 of `POST /ai-articles`: nothing was claimable.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct ClaimConflict {
    pub error: String,
    /// Always empty here.
    pub claimed: Vec<i64>,
    pub skipped: Vec<i64>,
}

/// The 409 of `POST /today-newsnack`: some issues cannot be published.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct AssembleConflict {
    pub error: String,
    /// Requested ids that are not `DONE` (unknown ones included).
    pub not_done: Vec<i64>,
    /// Requested ids `DONE` without an article (set `DONE` with plain SQL).
    pub without_article: Vec<i64>,
}

/// A list of 1 to [`input::MAX_IDS`] positive issue ids (repeats allowed).
pub fn id_list_schema() -> ArrayBuilder {
    ArrayBuilder::new()
        .items(
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
                .minimum(Some(1)),
        )
        .min_items(Some(1))
        .max_items(Some(input::MAX_IDS))
}

/// The issues of one `POST /issues`: 1 to [`input::MAX_NEW_ISSUES`].
pub fn new_issues_schema() -> ArrayBuilder {
    ArrayBuilder::new()
        .items(Ref::from_schema_name("NewIssueJson"))
        .min_items(Some(1))
        .max_items(Some(input::MAX_NEW_ISSUES))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    struct Ids {
        #[serde(deserialize_with = "whole_ids")]
        ids: Vec<i64>,
        #[serde(default, deserialize_with = "whole_option")]
        n: Option<i64>,
    }

    fn parse(json: &str) -> Result<Ids, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn whole_numbers_in_any_spelling_are_integers() {
        let ids = parse(r#"{"ids": [2, 2.0, 3e0, -4.0, 9223372036854775807], "n": 20.0}"#).unwrap();
        assert_eq!(ids.ids, [2, 2, 3, -4, i64::MAX]);
        assert_eq!(ids.n, Some(20));
        assert_eq!(parse(r#"{"ids": [], "n": null}"#).unwrap().n, None);
        assert_eq!(parse(r#"{"ids": []}"#).unwrap().n, None);
    }

    #[test]
    fn fractions_and_out_of_range_numbers_are_refused() {
        for bad in [
            r#"{"ids": [1.5]}"#,
            r#"{"ids": [9223372036854775808]}"#,
            r#"{"ids": [9.3e18]}"#,
            r#"{"ids": ["1"]}"#,
            r#"{"ids": [1], "n": 0.5}"#,
            r#"{"ids": [1], "n": true}"#,
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.is_data(), "{bad}: {e}");
        }
    }
}
