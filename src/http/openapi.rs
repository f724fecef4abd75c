//! `GET /openapi.json`: the JSON API described as OpenAPI 3.1, generated
//! from the handlers' annotations and the limits [`crate::input`] enforces,
//! so it cannot drift from the code.
//!
//! Each handler's annotation gives its answers and the failures particular
//! to it (404, 409, 422 for values it refuses); [`document`] adds those
//! every operation of a kind shares, because shared code answers them:
//!
//! - an operation with a JSON body: 400 (not JSON), 413 (over
//!   [`super::BODY_LIMIT`]), 415 (not `application/json`), 422 (a value of
//!   the wrong type, a missing or unknown field: anything outside the
//!   request's schema);
//! - an operation with a path id: 400 (not a positive integer);
//! - every operation: 500 (a fault, or a stored date the service cannot
//!   represent), and 503 with `Retry-After` for those that use the
//!   database (out of reach, out of connections, read-only, shutting down);
//! - with an API or read token configured, every operation but the probes
//!   (`/healthz`, `/readyz`): the `bearer` and `basic` security schemes
//!   (either one), 401 with `WWW-Authenticate` and 403 (a token that does
//!   not open it: the read token on a write).
//!
//! Every error body is [`ErrorBody`] (a 409 carries more fields). The
//! request schemas state the limits the service checks: 1 to
//! [`input::MAX_IDS`] ids, each a positive `int64`; 1 to
//! [`input::MAX_NEW_ISSUES`] issues; a title of at most
//! [`input::MAX_TITLE_CHARS`] characters that is not blank, a body of at
//! most [`input::MAX_BODY_CHARS`], neither holding a NUL character
//! ([`types::TITLE_PATTERN`], [`types::BODY_PATTERN`]); a `collected_at` whose year is in
//! [`input::COLLECTED_YEARS`] ([`types::COLLECTED_AT_PATTERN`]). Integers follow
//! JSON Schema: `2.0` is the integer 2 ([`crate::http::types::whole_ids`]).
//! A wait takes `timeout_s` or `deadline`, not both ([`document`] says so
//! in `WaitBody`'s schema, which the derive cannot).

use std::sync::Arc;

use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use axum::Router;
use serde_json::{json, Map, Value};
use utoipa::OpenApi;

use super::AppState;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "newsnack",
        description = "The content pipeline of a daily news briefing."
    ),
    servers((url = "/", description = "this instance")),
    paths(
        super::issues::add_issues,
        super::issues::show_issue,
        super::issues::cancel_issue,
        super::articles::request_articles,
        super::waits::wait_for,
        super::briefings::assemble,
        super::briefings::latest,
        super::briefings::by_id,
        super::briefings::recent_runs,
        super::health::healthz,
        super::health::readyz,
    ),
    components(schemas(
        crate::http::types::ErrorBody,
        crate::db::issue::IssueView,
        crate::model::status::Status,
        crate::http::types::NewIssueJson,
        crate::http::types::AddedIssues,
        crate::http::types::ClaimAnswer,
        crate::http::types::ClaimConflict,
        crate::briefing::wait::WaitReport,
        crate::briefing::wait::WaitOutcome,
        crate::db::briefing::Briefing,
        crate::db::pipeline_run::RunView,
        crate::briefing::assembly::Assembled,
        crate::http::types::AssembleConflict,
        super::health::Health,
        super::health::Readiness,
    ))
)]
pub struct ApiDoc;

/// The document as `GET /openapi.json` serves it: [`ApiDoc`] with the
/// failures shared by operations of a kind (see the module docs), and the
/// security schemes on every operation but the probes when `guarded` (an
/// API or read token is configured).
pub fn document(guarded: bool) -> Value {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_else(|_| json!({}));
    if guarded {
        doc["components"]["securitySchemes"] = json!({
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "`Authorization: Bearer <token>`: the read token (`NEWSNACK_READ_TOKEN`) opens `GET` and `HEAD`, the API token (`NEWSNACK_API_TOKEN`) everything"
            },
            "basic": {
                "type": "http",
                "scheme": "basic",
                "description": "HTTP Basic with the token as the password and any user name (what a browser sends after its prompt); the same tokens as `bearer`"
            }
        });
    }
    doc["components"]["schemas"]["WaitBody"]["not"] = json!({
        "description": "`timeout_s` and `deadline` together",
        "required": ["timeout_s", "deadline"],
        "properties": {
            "timeout_s": { "type": "number" },
            "deadline": { "type": "string" }
        }
    });
    for (path, method, status, name, link) in links() {
        doc["paths"][path][method]["responses"][status]["links"][name] = link;
    }
    if let Some(paths) = doc["paths"].as_object_mut() {
        for (path, item) in paths.iter_mut() {
            let Some(operations) = item.as_object_mut() else {
                continue;
            };
            for (method, operation) in operations.iter_mut() {
                shared_failures(path, method, operation, guarded);
            }
        }
    }
    doc
}

/// How one answer leads to the next request (OpenAPI links, for clients
/// and for stateful testing): path, method and status of the answer, the
/// link's name, and the link.
fn links() -> [(
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    Value,
); 5] {
    [
        (
            "/issues",
            "post",
            "201",
            "FirstIssue",
            json!({
                "operationId": "show_issue",
                "parameters": { "id": "$response.body#/ids/0" },
                "description": "The first issue added"
            }),
        ),
        (
            "/issues",
            "post",
            "201",
            "ClaimThem",
            json!({
                "operationId": "request_articles",
                "requestBody": { "issue_ids": "$response.body#/ids" },
                "description": "Claim the issues added, for generation"
            }),
        ),
        (
            "/ai-articles",
            "post",
            "202",
            "WaitForThem",
            json!({
                "operationId": "wait_for",
                "requestBody": { "issue_ids": "$response.body#/claimed" },
                "description": "Wait for the claimed issues' articles"
            }),
        ),
        (
            "/ai-articles",
            "post",
            "202",
            "FirstClaimed",
            json!({
                "operationId": "show_issue",
                "parameters": { "id": "$response.body#/claimed/0" },
                "description": "The first issue claimed"
            }),
        ),
        (
            "/today-newsnack",
            "post",
            "201",
            "TheBriefing",
            json!({
                "operationId": "by_id",
                "parameters": { "id": "$response.body#/briefing_id" },
                "description": "The briefing assembled"
            }),
        ),
    ]
}

/// Paths that answer without the database (`/readyz` documents its own
/// 503, with its own body) and without a token.
const PROBES: &[&str] = &["/healthz", "/readyz"];

/// Adds to `operation` the failures shared code answers (see the module
/// docs), keeping any its annotation already gives.
fn shared_failures(path: &str, method: &str, operation: &mut Value, guarded: bool) {
    let has_body = operation.get("requestBody").is_some();
    let has_path_id = operation["parameters"]
        .as_array()
        .is_some_and(|ps| ps.iter().any(|p| p["in"] == "path"));
    let mut failures: Vec<(u16, &str, Option<Value>)> = Vec::new();
    if has_body {
        failures.extend([
            (400, "The body is not JSON", None),
            (413, "The body is larger than 1 MiB", None),
            (
                415,
                "The body is not sent as `Content-Type: application/json`",
                None,
            ),
            (
                422,
                "The JSON is not what the request schema says (a value of the wrong type, a missing or unknown field); nothing was done",
                None,
            ),
        ]);
    }
    if has_path_id {
        failures.push((400, "The path id is not a positive integer", None));
    }
    if guarded && !PROBES.contains(&path) {
        operation["security"] = json!([{ "bearer": [] }, { "basic": [] }]);
        let opens = if method == "get" || method == "head" {
            "the read token or the API token"
        } else {
            "the API token"
        };
        if let Some(description) = operation["description"].as_str() {
            operation["description"] = json!(format!("{description}\n\nNeeds {opens}."));
        } else {
            operation["description"] = json!(format!("Needs {opens}."));
        }
        failures.push((
            401,
            "No token (`Authorization: Bearer` or Basic), or one that is none of the configured tokens; nothing was done",
            Some(json!({
                "WWW-Authenticate": {
                    "description": "Two challenges: `Bearer realm=\"newsnack\"` and `Basic realm=\"newsnack\", charset=\"UTF-8\"`",
                    "required": true,
                    "schema": { "type": "string" }
                }
            })),
        ));
        failures.push((
            403,
            "A configured token that does not open this operation (the read token on a write, the metrics token anywhere but `/metrics`); nothing was done",
            None,
        ));
    }
    failures.push((
        500,
        "An internal fault (logged), or a stored date the service cannot represent (written with plain SQL; the message names the row and the column)",
        None,
    ));
    if !PROBES.contains(&path) {
        failures.push((
            503,
            "The database is out of reach, out of connections or read-only, or the server is shutting down; try again after `Retry-After` seconds",
            Some(json!({
                "Retry-After": {
                    "description": "Seconds to wait before trying again",
                    "required": true,
                    "schema": { "type": "integer", "minimum": 0 }
                }
            })),
        ));
    }
    if !operation["responses"].is_object() {
        operation["responses"] = Value::Object(Map::new());
    }
    let responses = &mut operation["responses"];
    for (status, description, headers) in failures {
        let status = status.to_string();
        if responses.get(&status).is_some() {
            continue;
        }
        let mut response = json!({
            "description": description,
            "content": {
                "application/json": {
                    "schema": { "$ref": "#/components/schemas/ErrorBody" }
                }
            }
        });
        if let Some(headers) = headers {
            response["headers"] = headers;
        }
        responses[status] = response;
    }
}

pub fn router(guarded: bool) -> Router<AppState> {
    let body: Arc<str> = document(guarded).to_string().into();
    Router::new().route(
        "/openapi.json",
        get(move || {
            let body = body.clone();
            async move { ([(CONTENT_TYPE, "application/json")], body.to_string()) }
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every character is white space to [`types::TITLE_PATTERN`]'s class exactly
    /// when it is to [`char::is_whitespace`], the rule
    /// [`input::check_new_issues`] applies.
    #[test]
    fn the_title_pattern_names_exactly_rusts_white_space() {
        let class = crate::http::types::TITLE_PATTERN
            .split_once("*[^\\u0000")
            .and_then(|(_, rest)| rest.split_once(']'))
            .map(|(class, _)| class)
            .unwrap();
        let mut listed: Vec<(char, char)> = Vec::new();
        let mut rest = class;
        let escape = |s: &str| -> (char, usize) {
            match s.as_bytes()[1] {
                b't' => ('\t', 2),
                b'n' => ('\n', 2),
                b'f' => ('\u{c}', 2),
                b'r' => ('\r', 2),
                b'u' => (
                    char::from_u32(u32::from_str_radix(&s[2..6], 16).unwrap()).unwrap(),
                    6,
                ),
                other => panic!("unexpected escape {}", other as char),
            }
        };
        while !rest.is_empty() {
            let (first, used) = if rest.starts_with('\\') {
                escape(rest)
            } else {
                (rest.chars().next().unwrap(), 1)
            };
            rest = &rest[used..];
            if let Some(after) = rest.strip_prefix('-') {
                let (last, used) = escape(after);
                listed.push((first, last));
                rest = &after[used..];
            } else {
                listed.push((first, first));
            }
        }
        for c in (0..=0x10FFFF).filter_map(char::from_u32) {
            let in_class = listed.iter().any(|&(a, b)| (a..=b).contains(&c));
            assert_eq!(in_class, c.is_whitespace(), "{c:?}");
        }
    }

    #[test]
    fn bodies_and_path_ids_share_their_failures_and_guarded_operations_name_their_tokens() {
        let open = document(false);
        let post = &open["paths"]["/ai-articles"]["post"];
        for status in ["400", "413", "415", "422", "500", "503"] {
            assert!(post["responses"][status].is_object(), "{status}");
        }
        assert!(post["responses"]["401"].is_null());
        assert!(post["security"].is_null());
        assert!(open["components"]["securitySchemes"].is_null());

        let guarded = document(true);
        let either = json!([{ "bearer": [] }, { "basic": [] }]);
        let post = &guarded["paths"]["/ai-articles"]["post"];
        assert_eq!(post["security"], either);
        assert!(post["responses"]["401"]["headers"]["WWW-Authenticate"].is_object());
        assert!(post["responses"]["403"].is_object());
        assert!(post["description"]
            .as_str()
            .unwrap()
            .ends_with("Needs the API token."));
        let schemes = &guarded["components"]["securitySchemes"];
        assert_eq!(schemes["bearer"]["scheme"], "bearer");
        assert_eq!(schemes["basic"]["scheme"], "basic");
        let get = &guarded["paths"]["/issues/{id}"]["get"];
        assert_eq!(get["security"], either);
        assert!(get["description"]
            .as_str()
            .unwrap()
            .ends_with("Needs the read token or the API token."));
        for status in ["200", "400", "401", "403", "404", "500", "503"] {
            assert!(get["responses"][status].is_object(), "{status}");
        }
        for probe in ["/healthz", "/readyz"] {
            let get = &guarded["paths"][probe]["get"];
            assert!(get["security"].is_null() && get["responses"]["401"].is_null());
        }
        assert!(guarded["paths"]["/healthz"]["get"]["responses"]["503"].is_null());
    }
}
