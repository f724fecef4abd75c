//! The LLM budget's grant policy alone, as a table: one call of a class,
//! queued by a holder with a fallback provider, against each provider's
//! state (up, down, probing, paused), the day's tokens, `llm_fallback_for`
//! and the operator's pause, at a fixed clock. Each row says whether the
//! call is granted on the primary, routed to the fallback, or queued, and
//! what a failure of a granted call means (`fallback`: ask the fallback at
//! once; `retry`: the attempt fails, the issue is retried later). The
//! table is the policy's documentation; the exchange's steps
//! (`newsnack_llm_exchange_at`, sql/schema.sql) are what it runs against.

mod common;

use common::TestDb;
use serde_json::{json, Value};
use tokio_postgres::types::{Json, Type};

/// The exchange's clock in every row.
const T: &str = "2026-12-04T12:00:00Z";
/// `llm_daily_token_budget` and `llm_briefing_reserve_tokens` in every row.
const DAY_BUDGET: i64 = 1000;
const RESERVE: i64 = 200;

#[derive(Debug, Clone, Copy)]
enum Class {
    Briefing,
    Feed,
}

/// A provider's state at `T`.
#[derive(Debug, Clone, Copy)]
enum State {
    /// No failure.
    Up,
    /// Its circuit open: failures at the threshold, down for 30 s more.
    Down,
    /// Past its time down: one call at a time tries it.
    Probing,
    /// It asked for a pause (429 with `Retry-After`), 30 s more: for the
    /// primary every instance keeps it (`llm_budget`), for the fallback its
    /// own time down.
    Paused,
}

/// The day's tokens at `T`.
#[derive(Debug, Clone, Copy)]
enum Day {
    /// Below the budget less the reserve.
    Open,
    /// Into the briefing reserve: feed waits for the next day.
    Reserve,
    /// The budget spent: every call waits.
    Spent,
}

/// What becomes of the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Granted on the primary; a failure of it means this.
    Primary(&'static str),
    /// Granted on the fallback; a failure of it means this.
    Fallback(&'static str),
    /// Not granted: it waits in the queue.
    Queued,
}

use Class::*;
use Day::*;
use Outcome::*;
use State::*;

/// class, primary, fallback, day's tokens, `llm_fallback_for`, operator's
/// pause → outcome.
type Row = (Class, State, State, Day, &'static str, bool, Outcome);

#[rustfmt::skip]
const POLICY: &[Row] = &[
    // The primary up: every call goes there. A failure goes to the
    // fallback when the class may (llm_fallback_for), else it is retried.
    (Briefing, Up,      Up,      Open,    "briefing", false, Primary("fallback")),
    (Feed,     Up,      Up,      Open,    "briefing", false, Primary("retry")),
    (Feed,     Up,      Up,      Open,    "all",      false, Primary("fallback")),
    (Briefing, Up,      Up,      Open,    "none",     false, Primary("retry")),
    (Briefing, Up,      Down,    Open,    "briefing", false, Primary("fallback")),
    // The primary probing: one call tries it, as if it were up.
    (Briefing, Probing, Up,      Open,    "briefing", false, Primary("fallback")),
    (Feed,     Probing, Up,      Open,    "briefing", false, Primary("retry")),
    // The primary down or paused: the classes llm_fallback_for allows go
    // to the fallback while it has room (up, or probing: one call);
    // the others wait.
    (Briefing, Down,    Up,      Open,    "briefing", false, Fallback("retry")),
    (Feed,     Down,    Up,      Open,    "briefing", false, Queued),
    (Feed,     Down,    Up,      Open,    "all",      false, Fallback("retry")),
    (Briefing, Down,    Up,      Open,    "none",     false, Queued),
    (Briefing, Paused,  Up,      Open,    "briefing", false, Fallback("retry")),
    (Feed,     Paused,  Up,      Open,    "briefing", false, Queued),
    (Feed,     Paused,  Up,      Open,    "all",      false, Fallback("retry")),
    (Briefing, Down,    Probing, Open,    "briefing", false, Fallback("retry")),
    (Briefing, Down,    Down,    Open,    "briefing", false, Queued),
    (Briefing, Paused,  Paused,  Open,    "all",      false, Queued),
    (Feed,     Down,    Down,    Open,    "all",      false, Queued),
    // The day's tokens: into the reserve, feed waits and briefing goes on;
    // the budget spent, everything waits, on either provider.
    (Briefing, Up,      Up,      Reserve, "briefing", false, Primary("fallback")),
    (Feed,     Up,      Up,      Reserve, "all",      false, Queued),
    (Briefing, Down,    Up,      Reserve, "briefing", false, Fallback("retry")),
    (Briefing, Up,      Up,      Spent,   "briefing", false, Queued),
    (Briefing, Down,    Up,      Spent,   "all",      false, Queued),
    // The operator's pause: nothing starts, whatever else holds.
    (Briefing, Up,      Up,      Open,    "briefing", true,  Queued),
    (Feed,     Up,      Up,      Open,    "all",      true,  Queued),
    (Briefing, Down,    Up,      Open,    "all",      true,  Queued),
    (Briefing, Probing, Probing, Open,    "briefing", true,  Queued),
];

/// The SQL that puts a provider in `state` at `T`.
fn provider_state(provider: &str, state: State) -> String {
    let (failures, down_until) = match state {
        Up => (0, "NULL".to_string()),
        Down => (3, format!("'{T}'::timestamptz + interval '30 s'")),
        Probing => (3, format!("'{T}'::timestamptz - interval '1 s'")),
        Paused if provider == "primary" => {
            return format!(
                "UPDATE llm_budget SET paused_until = '{T}'::timestamptz + interval '30 s',
                                       pause_reason = 'rate limited', paused_by = 'x'"
            )
        }
        Paused => (1, format!("'{T}'::timestamptz + interval '30 s'")),
    };
    format!(
        "UPDATE llm_provider SET failures = {failures}, down_until = {down_until}
          WHERE provider = '{provider}'"
    )
}

/// The outcome of one row for a holder with a fallback provider or not,
/// in a transaction rolled back after it.
async fn decide(client: &mut tokio_postgres::Client, row: &Row, has_fallback: bool) -> Outcome {
    let &(class, primary, fallback, day, fallback_for, paused, _) = row;
    let tokens = match day {
        Open => 0,
        Reserve => DAY_BUDGET - RESERVE,
        Spent => DAY_BUDGET,
    };
    let tx = client.transaction().await.unwrap();
    tx.batch_execute(&format!(
        "UPDATE setting SET value = '{fallback_for}' WHERE key = 'llm_fallback_for';
         UPDATE setting SET value = '{paused}' WHERE key = 'generation_paused';
         UPDATE setting SET value = '{DAY_BUDGET}' WHERE key = 'llm_daily_token_budget';
         UPDATE setting SET value = '{RESERVE}' WHERE key = 'llm_briefing_reserve_tokens';
         INSERT INTO llm_token_day (day, tokens) VALUES (('{T}'::timestamptz AT TIME ZONE 'UTC')::date, {tokens});
         {};
         {};",
        provider_state("primary", primary),
        provider_state("fallback", fallback),
    ))
    .await
    .unwrap();
    let priority = match class {
        Briefing => "briefing",
        Feed => "feed",
    };
    let request = json!({
        "holder": "h", "instance": "i", "lease_s": 60.0, "has_fallback": has_fallback,
        "queue": [{"issue_id": 1, "claim_id": 1, "priority": priority, "fallback_only": false}],
    });
    let at: time::OffsetDateTime =
        time::OffsetDateTime::parse(T, &time::format_description::well_known::Rfc3339).unwrap();
    let answer: Json<Value> = tx
        .query_typed_one(
            "SELECT answer FROM newsnack_llm_exchange_at($1, $2)",
            &[(&Json(request), Type::JSONB), (&at, Type::TIMESTAMPTZ)],
        )
        .await
        .unwrap()
        .get(0);
    tx.rollback().await.unwrap();
    let granted = answer.0["granted"].as_array().unwrap().clone();
    match granted.as_slice() {
        [] => Queued,
        [call] => {
            let on_failure = match call["on_failure"].as_str().unwrap() {
                "fallback" => "fallback",
                "retry" => "retry",
                other => panic!("on_failure {other:?}"),
            };
            match call["provider"].as_str().unwrap() {
                "primary" => Primary(on_failure),
                "fallback" => Fallback(on_failure),
                other => panic!("provider {other:?}"),
            }
        }
        more => panic!("one call queued, {} granted: {answer:?}", more.len()),
    }
}

/// The rows of `table` the policy decides otherwise, for a holder with a
/// fallback provider or not.
async fn disagreements(table: &[Row], has_fallback: bool) -> Vec<String> {
    let db = TestDb::new().await;
    let mut client = db.raw().await;
    let mut wrong = Vec::new();
    for row in table {
        let outcome = decide(&mut client, row, has_fallback).await;
        if outcome != row.6 {
            wrong.push(format!("{row:?}: got {outcome:?}"));
        }
    }
    wrong
}

#[tokio::test]
async fn the_grant_policy_as_a_table() {
    let wrong = disagreements(POLICY, true).await;
    assert!(
        wrong.is_empty(),
        "rows the policy decides otherwise:\n{}",
        wrong.join("\n")
    );
}

/// A holder without a fallback provider: a call is never routed there,
/// and a failure of it is retried, whatever `llm_fallback_for` says.
#[rustfmt::skip]
const WITHOUT_A_FALLBACK: &[Row] = &[
    (Briefing, Up,      Up, Open, "all",      false, Primary("retry")),
    (Feed,     Up,      Up, Open, "all",      false, Primary("retry")),
    (Briefing, Probing, Up, Open, "briefing", false, Primary("retry")),
    (Briefing, Down,    Up, Open, "all",      false, Queued),
    (Briefing, Paused,  Up, Open, "briefing", false, Queued),
];

#[tokio::test]
async fn without_a_fallback_nothing_is_routed_and_failures_are_retried() {
    let wrong = disagreements(WITHOUT_A_FALLBACK, false).await;
    assert!(
        wrong.is_empty(),
        "rows the policy decides otherwise:\n{}",
        wrong.join("\n")
    );
}
