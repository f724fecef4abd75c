//! Traces over OTLP, against a real receiver (the `rotel` collector,
//! tests/common/otlp.rs). A caller's `traceparent` continues through
//! `POST /issues`, the claim over HTTP and the database into the article's
//! generation and its LLM call (with the GenAI attributes); an issue whose
//! first instance died mid-generation is written by another, after the
//! lease, in a new trace linked to the first; an answer rejected twice
//! shows its checks, the re-ask, the error and the transitions, and the
//! outcome's transition keeps the recording's context, which its retry
//! links to; a rate limit's pause shows on the wait it delayed, and the
//! paused attempt's retry is linked too, and a held day on its wait; a
//! plain-SQL writer's
//! `newsnack.traceparent` is kept on the issue and its transition; an
//! unsampled caller produces no spans; a receiver that is not there, or
//! that never answers, changes no answer, holds up no request and is
//! counted.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::fake_llm::{FakeLlm, Reply};
use common::otlp::{
    free_port, otel_env, post, serve, trace_of, until_export_failed, usage_llm, usage_reply,
    Receiver, Span, Stalled, CHAT, MODEL,
};
use common::process::{Output, ServeProcess};
use common::{until_sql_polled, TestDb};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_trace_runs_through_the_database_into_the_generation_and_its_llm_call() {
    let receiver = Receiver::start().await;
    let db = TestDb::new().await;
    let llm = usage_llm().await;
    let service = serve(&db, "traced", &llm, &receiver.http);
    let base = service.base_url();
    let http = reqwest::Client::new();

    // Added with the caller's context: the answer continues its trace,
    // and the issue keeps it.
    let caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let trace = trace_of(caller);
    let (status, returned, added) = post(
        &http,
        format!("{base}/issues"),
        Some(caller),
        json!({"issues": [{"title": "Traced story", "body": "Details."}]}),
    )
    .await;
    assert_eq!(status, reqwest::StatusCode::CREATED);
    let returned = returned.expect("the answer carries a traceparent");
    assert_eq!(trace_of(&returned), trace, "{returned}");
    assert_ne!(returned, caller, "the answer names the service's own span");
    let id = added["ids"][0].as_i64().unwrap();
    let kept: Option<String> = db
        .query_one("SELECT traceparent FROM issue WHERE id = $1", &[&id])
        .await
        .get(0);
    assert_eq!(
        kept.as_deref().map(trace_of),
        Some(trace),
        "issue.traceparent"
    );

    // An unsampled caller: carried, but nothing is recorded for it.
    let unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    let (status, returned, _) = post(
        &http,
        format!("{base}/issues"),
        Some(unsampled),
        json!({"issues": [{"title": "Unsampled story"}]}),
    )
    .await;
    assert_eq!(status, reqwest::StatusCode::CREATED);
    assert_eq!(returned.as_deref().map(trace_of), Some(trace_of(unsampled)));

    // Claimed over HTTP in the same trace, then written.
    let claimant = "00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01";
    let (status, _, claimed) = post(
        &http,
        format!("{base}/ai-articles"),
        Some(claimant),
        json!({"issue_ids": [id]}),
    )
    .await;
    assert_eq!(status, reqwest::StatusCode::ACCEPTED, "{claimed}");
    until_sql_polled(
        &db,
        60,
        &format!("SELECT processing_status = 'DONE' FROM issue WHERE id = {id}"),
    )
    .await;
    let logged: Option<String> = db
        .query_one(
            "SELECT traceparent FROM issue_transition
              WHERE issue_id = $1 AND to_status = 'IN_PROGRESS'",
            &[&id],
        )
        .await
        .get(0);
    assert_eq!(
        logged.as_deref().map(trace_of),
        Some(trace),
        "the claim's transition"
    );

    let spans = receiver
        .until("the claim's, generation's and LLM call's spans", |spans| {
            [CHAT, "generate", "claim"]
                .iter()
                .all(|name| spans.iter().any(|s| s.name == *name && s.trace_id == trace))
        })
        .await;
    let by_id: BTreeMap<&str, &Span> = spans.iter().map(|s| (s.id.as_str(), s)).collect();
    let one = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name && s.trace_id == trace)
            .unwrap_or_else(|| panic!("no {name} span in the caller's trace: {spans:#?}"))
    };
    let (chat, generate, claim) = (one(CHAT), one("generate"), one("claim"));
    assert_eq!(
        chat.parent_id, generate.id,
        "the LLM call is the generation's"
    );
    assert_eq!(
        generate.parent_id, claim.id,
        "the generation continues the claim"
    );
    let request = by_id[claim.parent_id.as_str()];
    assert_eq!(
        request.parent_id, "1111111111111111",
        "the claim's request is the caller's child"
    );
    assert_eq!(request.attributes["http.response.status_code"], "202");
    assert!(
        request.events.is_empty(),
        "the log's `answered` line is no span event: {:?}",
        request.events
    );
    assert_eq!(generate.attributes["newsnack.issue_id"], id.to_string());
    assert_eq!(claim.attributes["newsnack.claimed"], "1");
    assert_eq!(chat.attributes["gen_ai.request.model"], MODEL);
    assert_eq!(chat.attributes["gen_ai.usage.input_tokens"], "17");
    assert_eq!(chat.attributes["gen_ai.usage.output_tokens"], "29");
    assert_eq!(chat.attributes["gen_ai.system"], "openai");
    assert!(
        spans.iter().all(|s| s.trace_id != trace_of(unsampled)),
        "an unsampled caller's request was exported"
    );

    // A plain-SQL writer's context is kept by the issue and its first
    // transition; a malformed one is ignored, not an error.
    let writer = "00-5bf92f3577b34da6a3ce929d0e0e4736-22f067aa0ba902b7-01";
    let mut client = db.raw().await;
    let tx = client.transaction().await.unwrap();
    tx.batch_execute(&format!("SET LOCAL newsnack.traceparent = '{writer}'"))
        .await
        .unwrap();
    let row = tx
        .query_one(
            "INSERT INTO issue (title) VALUES ('by SQL') RETURNING id",
            &[],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let by_sql: i64 = row.get(0);
    let tx = client.transaction().await.unwrap();
    tx.batch_execute("SET LOCAL newsnack.traceparent = 'garbage'")
        .await
        .unwrap();
    let row = tx
        .query_one(
            "INSERT INTO issue (title) VALUES ('by SQL, garbled') RETURNING id",
            &[],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let garbled: i64 = row.get(0);
    let kept = db
        .query_one(
            "SELECT (SELECT traceparent FROM issue WHERE id = $1),
                    (SELECT traceparent FROM issue_transition WHERE issue_id = $1),
                    (SELECT traceparent FROM issue WHERE id = $2),
                    (SELECT traceparent FROM issue_transition WHERE issue_id = $2)",
            &[&by_sql, &garbled],
        )
        .await;
    let kept: [Option<String>; 4] = [kept.get(0), kept.get(1), kept.get(2), kept.get(3)];
    assert_eq!(
        kept,
        [
            Some(writer.to_string()),
            Some(writer.to_string()),
            None,
            None
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_is_not_there_changes_no_answer_and_is_counted() {
    let db = TestDb::new().await;
    let llm = usage_llm().await;
    // A port nothing listens on; JSON log lines into a file.
    let nowhere = format!("http://{}", free_port());
    let logs = tempfile::NamedTempFile::new().unwrap();
    let mut env = otel_env(&llm, &nowhere).to_vec();
    env.push(("NEWSNACK_LOG_FORMAT", "json"));
    let service = tokio::task::block_in_place(|| {
        ServeProcess::spawn_writing_to(&db.url, "untraced", &env, Output::File(logs.path()))
    });
    let base = service.base_url();
    let http = reqwest::Client::new();
    let caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (status, returned, added) = post(
        &http,
        format!("{base}/issues"),
        Some(caller),
        json!({"issues": [{"title": "Story"}]}),
    )
    .await;
    assert_eq!(status, reqwest::StatusCode::CREATED);
    assert_eq!(returned.as_deref().map(trace_of), Some(trace_of(caller)));
    let id = added["ids"][0].as_i64().unwrap();
    let (status, _, _) = post(
        &http,
        format!("{base}/ai-articles"),
        Some(caller),
        json!({"issue_ids": [id]}),
    )
    .await;
    assert_eq!(status, reqwest::StatusCode::ACCEPTED);
    until_sql_polled(
        &db,
        60,
        &format!("SELECT processing_status = 'DONE' FROM issue WHERE id = {id}"),
    )
    .await;
    until_export_failed(&http, &base).await;

    // The request's log line names the caller's trace and the request's span.
    let text = std::fs::read_to_string(logs.path()).unwrap();
    let answered: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["fields"]["message"] == "answered" && l["span"]["path"] == "/issues")
        .collect();
    assert_eq!(answered.len(), 1, "{text}");
    assert_eq!(answered[0]["trace_id"], trace_of(caller), "{}", answered[0]);
    assert_eq!(
        answered[0]["span_id"].as_str().map(str::len),
        Some(16),
        "{}",
        answered[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_taken_back_after_its_lease_is_written_in_a_new_trace_linked_to_the_first() {
    let receiver = Receiver::start().await;
    let db = TestDb::new().await;
    db.set("lease_s", "2").await;
    db.set("retry_backoff_ms", "50").await;
    // The first call never answers (its instance dies in it); the retry's
    // answers.
    let llm = FakeLlm::start(|n, _| match n {
        0 => Reply::Hang,
        _ => usage_reply(),
    })
    .await;
    let mut first = serve(&db, "first", &llm, &receiver.http);
    let second = serve(&db, "second", &llm, &receiver.http);
    let http = reqwest::Client::new();

    let caller = "00-6bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let trace = trace_of(caller);
    let (status, _, added) = post(
        &http,
        format!("{}/issues", first.base_url()),
        Some(caller),
        json!({"issues": [{"title": "Story taken back"}]}),
    )
    .await;
    assert_eq!(status, reqwest::StatusCode::CREATED);
    let id = added["ids"][0].as_i64().unwrap();
    let (status, _, claimed) = post(
        &http,
        format!("{}/ai-articles", first.base_url()),
        Some(caller),
        json!({"issue_ids": [id]}),
    )
    .await;
    assert_eq!(status, reqwest::StatusCode::ACCEPTED, "{claimed}");

    // The first instance is in its LLM call, and its claim's span has left
    // it: it dies there.
    llm.until_requests(1).await;
    let spans = receiver
        .until("the first instance's claim", |spans| {
            spans
                .iter()
                .any(|s| s.name == "claim" && s.trace_id == trace)
        })
        .await;
    let claim = spans
        .iter()
        .find(|s| s.name == "claim" && s.trace_id == trace)
        .unwrap()
        .clone();
    tokio::task::block_in_place(|| first.kill());

    // The lease runs out; the second instance takes the issue back and
    // writes it.
    until_sql_polled(
        &db,
        60,
        &format!("SELECT processing_status = 'DONE' FROM issue WHERE id = {id}"),
    )
    .await;
    let row = db
        .query_one(
            "SELECT claimed_by, attempts FROM issue WHERE id = $1",
            &[&id],
        )
        .await;
    let (by, attempts): (String, i32) = (row.get(0), row.get(1));
    assert_eq!((by.as_str(), attempts), ("second", 2));

    let is_retry = |s: &Span| {
        s.name == "generate"
            && s.attributes.get("newsnack.issue_id") == Some(&id.to_string())
            && s.attributes.get("newsnack.attempt").map(String::as_str) == Some("2")
    };
    let spans = receiver
        .until("the retry's generation and its LLM call", |spans| {
            spans.iter().filter(|s| is_retry(s)).any(|generate| {
                spans
                    .iter()
                    .any(|s| s.name == CHAT && s.parent_id == generate.id)
            })
        })
        .await;
    let generate = spans.iter().find(|s| is_retry(s)).unwrap();
    assert_ne!(
        generate.trace_id, trace,
        "the retry's generation starts a trace of its own: {generate:#?}"
    );
    assert_eq!(generate.parent_id, "", "a root: {generate:#?}");
    let previous: Vec<_> = generate
        .links
        .iter()
        .filter(|l| {
            l.attributes.get("newsnack.link").map(String::as_str) == Some("previous_attempt")
        })
        .collect();
    assert_eq!(previous.len(), 1, "{generate:#?}");
    assert_eq!(
        (previous[0].trace_id.as_str(), previous[0].span_id.as_str()),
        (trace, claim.id.as_str()),
        "linked to the claim the first instance held"
    );
    let chat = spans
        .iter()
        .find(|s| s.name == CHAT && s.parent_id == generate.id)
        .unwrap();
    assert_eq!(chat.trace_id, generate.trace_id);
    assert_eq!(chat.attributes["gen_ai.request.model"], MODEL);
    assert_eq!(chat.attributes["gen_ai.usage.input_tokens"], "17");
    assert_eq!(chat.attributes["gen_ai.usage.output_tokens"], "29");
    assert!(
        !spans.iter().any(|s| is_retry(s) && s.trace_id == trace),
        "the retry's generation stretched the first trace"
    );
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_answer_is_asked_again_in_the_trace_and_its_retry_links_to_the_failure() {
    let receiver = Receiver::start().await;
    let db = TestDb::new().await;
    // Two answers whose headline is too long (the first and the one asked
    // again), then good ones.
    let llm = FakeLlm::start(|n, _| match n {
        0 | 1 => Reply::Ok(format!(
            "{}\n\nThe council met.",
            "Council ".repeat(20).trim_end()
        )),
        _ => usage_reply(),
    })
    .await;
    let service = serve(&db, "checked", &llm, &receiver.http);
    let base = service.base_url();
    let http = reqwest::Client::new();
    let caller = "00-7bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let trace = trace_of(caller);
    let (_, _, added) = post(
        &http,
        format!("{base}/issues"),
        Some(caller),
        json!({"issues": [{"title": "Checked story"}]}),
    )
    .await;
    let id = added["ids"][0].as_i64().unwrap();
    let claim = |traceparent: &'static str| {
        let (http, url) = (http.clone(), format!("{base}/ai-articles"));
        async move {
            let (status, _, body) =
                post(&http, url, Some(traceparent), json!({"issue_ids": [id]})).await;
            assert_eq!(status, reqwest::StatusCode::ACCEPTED, "{body}");
        }
    };
    let logged = |to: &'static str| {
        let db = &db;
        async move {
            let sql = format!(
                "SELECT traceparent FROM issue_transition WHERE issue_id = {id}
                  AND to_status = '{to}' ORDER BY seq DESC LIMIT 1"
            );
            let kept: Option<String> = db.query_one(&sql, &[]).await.get(0);
            kept.expect("the transition keeps a trace context")
        }
    };
    let status_is =
        |status: &str| format!("SELECT processing_status = '{status}' FROM issue WHERE id = {id}");

    claim(caller).await;
    until_sql_polled(&db, 60, &status_is("FAILED")).await;
    let spans = receiver
        .until("the failed generation and its recording", |spans| {
            spans
                .iter()
                .any(|s| s.name == "issue.record" && s.trace_id == trace)
                && spans
                    .iter()
                    .any(|s| s.name == "generate" && s.trace_id == trace)
        })
        .await;
    let in_trace = |name: &str| -> Vec<&Span> {
        spans
            .iter()
            .filter(|s| s.name == name && s.trace_id == trace)
            .collect()
    };
    let generate = in_trace("generate")[0];
    assert_eq!(generate.status, "ERROR", "{generate:#?}");
    assert_eq!(generate.attributes["error.type"], "invalid_article");
    let transitions: Vec<&str> = generate
        .events
        .iter()
        .filter(|e| e.name == "newsnack.issue.transition")
        .map(|e| e.attributes["newsnack.issue.status"].as_str())
        .collect();
    assert_eq!(transitions, ["IN_PROGRESS", "FAILED"], "{generate:#?}");
    let mut checks = in_trace("article.check");
    checks.sort_by_key(|s| s.attributes["newsnack.check.answer"].clone());
    assert_eq!(checks.len(), 2, "{checks:#?}");
    for (check, status) in checks.iter().zip(["UNSET", "ERROR"]) {
        assert_eq!(check.parent_id, generate.id);
        assert_eq!(check.status, status, "{check:#?}");
        assert_eq!(check.attributes["newsnack.check.passed"], "false");
        assert_eq!(
            check.attributes["newsnack.check.rejected"],
            "headline_length"
        );
    }
    assert_eq!(checks[1].attributes["error.type"], "headline_length");
    let reask = in_trace("article.reask")[0];
    assert_eq!(reask.parent_id, generate.id);
    assert!(
        in_trace(CHAT).iter().any(|c| c.parent_id == reask.id),
        "the second call is the re-ask's"
    );
    let wait = in_trace("llm.budget.wait")[0];
    assert_eq!(wait.parent_id, generate.id);
    assert_eq!(wait.attributes["newsnack.llm.provider"], "primary");
    assert!(["briefing", "feed"].contains(&wait.attributes["newsnack.llm.class"].as_str()));
    assert!(
        wait.attributes["newsnack.budget.queued_ms"]
            .parse::<f64>()
            .unwrap()
            >= 0.0
    );
    assert_eq!(wait.attributes["newsnack.budget.paused"], "false");
    assert_eq!(wait.attributes["newsnack.budget.day_held"], "false");
    let failed = in_trace("issue.record")[0];
    assert_eq!(failed.parent_id, generate.id);
    assert_eq!(failed.attributes["newsnack.outcome"], "failed");
    assert_eq!(
        failed.attributes.get("newsnack.fenced").map(String::as_str),
        Some("written"),
        "{failed:#?}"
    );
    // The FAILED transition keeps the recording's context.
    assert_eq!(
        logged("FAILED").await,
        format!("00-{trace}-{}-01", failed.id)
    );

    // Asked for again by another caller: a new trace, linked to the failed
    // attempt and to this claim.
    let again = "00-8bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    claim(again).await;
    until_sql_polled(&db, 60, &status_is("DONE")).await;
    let is_retry = |s: &Span| {
        s.name == "generate"
            && s.attributes.get("newsnack.attempt").map(String::as_str) == Some("2")
    };
    let spans = receiver
        .until("the retry's generation and its recording", |spans| {
            spans.iter().filter(|s| is_retry(s)).any(|generate| {
                spans
                    .iter()
                    .any(|s| s.name == "issue.record" && s.parent_id == generate.id)
            })
        })
        .await;
    let retry = spans.iter().find(|s| is_retry(s)).unwrap();
    assert!(![trace, trace_of(again)].contains(&retry.trace_id.as_str()));
    let links: BTreeMap<&str, (&str, &str)> = retry
        .links
        .iter()
        .map(|l| {
            let kind = l.attributes["newsnack.link"].as_str();
            (kind, (l.trace_id.as_str(), l.span_id.as_str()))
        })
        .collect();
    assert_eq!(links["previous_attempt"], (trace, failed.id.as_str()));
    assert_eq!(links["claim"].0, trace_of(again));
    let done = spans
        .iter()
        .find(|s| s.name == "issue.record" && s.parent_id == retry.id)
        .unwrap();
    assert_eq!(done.attributes["newsnack.outcome"], "done");
    assert_eq!(
        logged("DONE").await,
        format!("00-{}-{}-01", retry.trace_id, done.id)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_answers_slowly_changes_no_answer_and_holds_no_request() {
    let db = TestDb::new().await;
    let llm = usage_llm().await;
    // Each export waits out its timeout (5 s) at a collector that never
    // answers; a request that waited for one would take that long.
    let stalled = Stalled::start().await;
    let mut env = otel_env(&llm, &stalled.url).to_vec();
    env.retain(|(name, _)| *name != "OTEL_EXPORTER_OTLP_TIMEOUT");
    env.push(("OTEL_EXPORTER_OTLP_TIMEOUT", "5000"));
    let service = tokio::task::block_in_place(|| ServeProcess::spawn(&db.url, "stalled", &env));
    let base = service.base_url();
    let http = reqwest::Client::new();
    let caller = "00-9bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut ids = Vec::new();
    let mut slowest = Duration::ZERO;
    for n in 0..12 {
        let started = std::time::Instant::now();
        let (status, returned, added) = post(
            &http,
            format!("{base}/issues"),
            Some(caller),
            json!({"issues": [{"title": format!("Story {n}")}]}),
        )
        .await;
        assert_eq!(status, reqwest::StatusCode::CREATED);
        assert_eq!(returned.as_deref().map(trace_of), Some(trace_of(caller)));
        let id = added["ids"][0].as_i64().unwrap();
        let (status, _, claimed) = post(
            &http,
            format!("{base}/ai-articles"),
            Some(caller),
            json!({"issue_ids": [id]}),
        )
        .await;
        assert_eq!(status, reqwest::StatusCode::ACCEPTED, "{claimed}");
        assert_eq!(claimed["claimed"], json!([id]), "{claimed}");
        slowest = slowest.max(started.elapsed());
        ids.push(id);
    }
    assert!(
        slowest < Duration::from_millis(2500),
        "adding and claiming took {slowest:?} at worst: a request waited for the export"
    );
    until_sql_polled(
        &db,
        60,
        &format!(
            "SELECT count(*) = {} FROM issue WHERE processing_status = 'DONE'",
            ids.len()
        ),
    )
    .await;
    until_export_failed(&http, &base).await;
    assert!(
        stalled.accepted() > 0,
        "the exporter never reached the collector"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_shows_on_the_wait_it_delayed_and_the_paused_attempt_is_retried_linked() {
    let receiver = Receiver::start().await;
    let db = TestDb::new().await;
    db.set("retry_backoff_ms", "50").await;
    // The first call meets a rate limit that pauses every call for 2 s.
    let llm = FakeLlm::start(|n, _| match n {
        0 => Reply::RateLimited { retry_after_s: 2 },
        _ => usage_reply(),
    })
    .await;
    let service = serve(&db, "paused", &llm, &receiver.http);
    let base = service.base_url();
    let http = reqwest::Client::new();
    let (_, _, added) = post(
        &http,
        format!("{base}/issues"),
        None,
        json!({"issues": [{"title": "Limited story"}, {"title": "Delayed story"}]}),
    )
    .await;
    let (limited, delayed) = (
        added["ids"][0].as_i64().unwrap(),
        added["ids"][1].as_i64().unwrap(),
    );
    let first = "00-abf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let second = "00-bbf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (status, _, _) = post(
        &http,
        format!("{base}/ai-articles"),
        Some(first),
        json!({"issue_ids": [limited]}),
    )
    .await;
    assert_eq!(status, reqwest::StatusCode::ACCEPTED);
    until_sql_polled(
        &db,
        30,
        "SELECT COALESCE(paused_until > now(), false) FROM llm_budget",
    )
    .await;
    let (status, _, _) = post(
        &http,
        format!("{base}/ai-articles"),
        Some(second),
        json!({"issue_ids": [delayed]}),
    )
    .await;
    assert_eq!(status, reqwest::StatusCode::ACCEPTED);
    until_sql_polled(
        &db,
        60,
        "SELECT count(*) = 2 FROM issue WHERE processing_status = 'DONE'",
    )
    .await;

    let of = |id: i64| {
        move |s: &&Span| s.name == "generate" && s.attributes["newsnack.issue_id"] == id.to_string()
    };
    let spans = receiver
        .until("both issues' generations, the limited one twice", |spans| {
            spans.iter().filter(of(limited)).count() == 2
                && spans.iter().filter(of(delayed)).count() == 1
                && spans.iter().filter(|s| s.name == "issue.record").count() == 3
        })
        .await;
    let child = |parent: &Span, name: &str| -> Span {
        spans
            .iter()
            .find(|s| s.name == name && s.parent_id == parent.id)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} under {parent:#?}"))
    };
    // The delayed issue's wait says the pause held it.
    let generate = spans.iter().find(of(delayed)).unwrap();
    assert_eq!(generate.trace_id, trace_of(second));
    let wait = child(generate, "llm.budget.wait");
    assert_eq!(
        wait.attributes["newsnack.budget.paused"], "true",
        "{wait:#?}"
    );
    assert_eq!(
        wait.attributes["newsnack.budget.day_held"], "false",
        "{wait:#?}"
    );
    // The limited call failed its generation, in the caller's trace; the
    // retry (its attempt given back, so still attempt 1) is a new trace
    // linked to the failure's recording.
    let limited_spans: Vec<&Span> = spans.iter().filter(of(limited)).collect();
    let failed = limited_spans
        .iter()
        .find(|s| s.trace_id == trace_of(first))
        .expect("the first attempt in the caller's trace");
    assert_eq!(failed.status, "ERROR");
    assert_eq!(failed.attributes["error.type"], "rate_limited");
    let recorded = child(failed, "issue.record");
    let retry = limited_spans
        .iter()
        .find(|s| s.trace_id != trace_of(first))
        .expect("the retry in a trace of its own");
    assert_eq!(retry.attributes["newsnack.attempt"], "1");
    let previous: Vec<(&str, &str)> = retry
        .links
        .iter()
        .filter(|l| {
            l.attributes.get("newsnack.link").map(String::as_str) == Some("previous_attempt")
        })
        .map(|l| (l.trace_id.as_str(), l.span_id.as_str()))
        .collect();
    assert_eq!(
        previous,
        [(trace_of(first), recorded.id.as_str())],
        "{retry:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_day_shows_on_the_wait_it_delayed() {
    let receiver = Receiver::start().await;
    let db = TestDb::new().await;
    // The first article's 46 tokens spend the day's budget.
    db.set("llm_daily_token_budget", "40").await;
    db.set("llm_briefing_reserve_tokens", "0").await;
    let llm = usage_llm().await;
    let service = serve(&db, "held", &llm, &receiver.http);
    let base = service.base_url();
    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for title in ["Spending story", "Held story"] {
        let (_, _, added) = post(
            &http,
            format!("{base}/issues"),
            None,
            json!({"issues": [{"title": title}]}),
        )
        .await;
        let id = added["ids"][0].as_i64().unwrap();
        let (status, _, _) = post(
            &http,
            format!("{base}/ai-articles"),
            None,
            json!({"issue_ids": [id]}),
        )
        .await;
        assert_eq!(status, reqwest::StatusCode::ACCEPTED);
        ids.push(id);
        // The first is written (and its tokens counted) before the second
        // is asked for; the second waits, held, until the budget grows.
        let done = "SELECT count(*) = 1 FROM issue WHERE processing_status = 'DONE'";
        until_sql_polled(&db, 60, done).await;
    }
    until_sql_polled(
        &db,
        60,
        "SELECT EXISTS (SELECT 1 FROM llm_call WHERE granted_at IS NULL)",
    )
    .await;
    db.set("llm_daily_token_budget", "100000").await;
    until_sql_polled(
        &db,
        60,
        "SELECT count(*) = 2 FROM issue WHERE processing_status = 'DONE'",
    )
    .await;
    let held = ids[1].to_string();
    let spans = receiver
        .until("the held issue's wait", |spans| {
            spans.iter().any(|s| {
                s.name == "generate"
                    && s.attributes["newsnack.issue_id"] == held
                    && spans
                        .iter()
                        .any(|w| w.name == "llm.budget.wait" && w.parent_id == s.id)
            })
        })
        .await;
    let generate = spans
        .iter()
        .find(|s| s.name == "generate" && s.attributes["newsnack.issue_id"] == held)
        .unwrap();
    let wait = spans
        .iter()
        .find(|w| w.name == "llm.budget.wait" && w.parent_id == generate.id)
        .unwrap();
    assert_eq!(
        wait.attributes["newsnack.budget.day_held"], "true",
        "{wait:#?}"
    );
    assert_eq!(
        wait.attributes["newsnack.budget.paused"], "false",
        "{wait:#?}"
    );
}
