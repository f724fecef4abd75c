//! The W3C trace context carried through the database with no collector
//! configured: nothing is exported, yet a caller's context reaches the
//! issue it added, the transition of a claim it made, and the transition
//! of the outcome written for that claim, so a plain-SQL reader can join
//! them to the caller's trace.

mod common;

use common::{offline, until_sql_polled, TestDb};
use serde_json::{json, Value};

const ADDER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const CLAIMANT: &str = "00-5bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01";

async fn post(http: &reqwest::Client, url: String, traceparent: &str, body: Value) -> Value {
    let answer = http
        .post(url)
        .header("traceparent", traceparent)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(answer.status().is_success(), "{}", answer.status());
    let returned = answer.headers().get("traceparent").cloned();
    assert_eq!(
        returned.as_ref().and_then(|v| v.to_str().ok()),
        Some(traceparent),
        "the answer carries the caller's context unchanged"
    );
    answer.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_collector_the_callers_context_reaches_each_transition_of_its_claim() {
    let db = TestDb::new().await;
    let service = db.serve("carried", offline()).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();

    let added = post(
        &http,
        format!("{base}/issues"),
        ADDER,
        json!({"issues": [{"title": "Carried story"}]}),
    )
    .await;
    let id = added["ids"][0].as_i64().unwrap();
    post(
        &http,
        format!("{base}/ai-articles"),
        CLAIMANT,
        json!({"issue_ids": [id]}),
    )
    .await;
    until_sql_polled(
        &db,
        30,
        &format!("SELECT processing_status = 'DONE' FROM issue WHERE id = {id}"),
    )
    .await;

    let sql = db.raw().await;
    let rows = sql
        .query(
            "SELECT to_status, traceparent FROM issue_transition
              WHERE issue_id = $1 ORDER BY seq",
            &[&id],
        )
        .await
        .unwrap();
    let kept: Vec<(String, Option<String>)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let expected = [
        ("PENDING", ADDER),
        ("IN_PROGRESS", CLAIMANT),
        ("DONE", CLAIMANT),
    ]
    .map(|(status, context)| (status.to_string(), Some(context.to_string())));
    assert_eq!(kept, expected);
    let issue: Option<String> = sql
        .query_one("SELECT traceparent FROM issue WHERE id = $1", &[&id])
        .await
        .unwrap()
        .get(0);
    assert_eq!(issue.as_deref(), Some(ADDER));
}

/// An instance of the previous release during a rolling upgrade calls the
/// claim and the completion as it did before migration 38: the claim's
/// traced wrappers (one context, or one per id), the four-argument claim,
/// and the seven-argument completion after setting the transaction's
/// context. Each call still works, and each transition keeps its context.
#[tokio::test]
async fn the_previous_releases_calls_keep_their_contexts() {
    let db = TestDb::new().await;
    let ids = db.add_issues(4).await;
    let mut sql = db.raw().await;
    let claimed = |statement: &str, rows: Vec<tokio_postgres::Row>| {
        assert_eq!(rows.len(), 1, "{statement} claimed one issue");
        rows[0].get::<_, i64>("claim_id")
    };
    let each = "SELECT * FROM newsnack_claim_traced(ARRAY[$1::int8, $2::int8], 'old', 60, NULL, ARRAY[NULL, $3]::text[])";
    let rows = sql.query(each, &[&ids[3], &ids[0], &ADDER]).await.unwrap();
    assert_eq!(rows.len(), 2, "{each}");
    let one = "SELECT * FROM newsnack_claim_traced(ARRAY[$1::int8], 'old', 60, NULL, $2::text)";
    let rows = sql.query(one, &[&ids[1], &CLAIMANT]).await.unwrap();
    let claim_1 = claimed(one, rows);
    let plain = "SELECT * FROM newsnack_claim(ARRAY[$1::int8], 'old', 60, NULL)";
    claimed(plain, sql.query(plain, &[&ids[2]]).await.unwrap());

    let tx = sql.transaction().await.unwrap();
    tx.execute(
        "SELECT set_config('newsnack.traceparent', $1, true)",
        &[&ADDER],
    )
    .await
    .unwrap();
    let written = tx
        .query(
            "SELECT written FROM newsnack_complete(ARRAY[$1::int8], ARRAY[$2::int8],
                 ARRAY['h'], ARRAY['b'], 'old', ARRAY[NULL::int4], ARRAY[NULL::int4])",
            &[&ids[1], &claim_1],
        )
        .await
        .unwrap();
    assert!(written[0].get::<_, bool>(0), "the old completion wrote");
    tx.commit().await.unwrap();

    let kept: Vec<(i64, String, Option<String>)> = sql
        .query(
            "SELECT issue_id, to_status, traceparent FROM issue_transition
              WHERE to_status <> 'PENDING' ORDER BY issue_id, seq",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let context = |t: &str| Some(t.to_owned());
    assert_eq!(
        kept,
        [
            (ids[0], "IN_PROGRESS".into(), context(ADDER)),
            (ids[1], "IN_PROGRESS".into(), context(CLAIMANT)),
            (ids[1], "DONE".into(), context(ADDER)),
            (ids[2], "IN_PROGRESS".into(), None),
            (ids[3], "IN_PROGRESS".into(), None),
        ]
    );
}
