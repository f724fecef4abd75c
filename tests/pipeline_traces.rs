//! A scheduled pipeline run is one trace, against a real OTLP receiver
//! (`common::otlp`): the run's root span has its selection, claims, wait
//! and briefing as children, the articles it claimed are generated under
//! its claim, and its wait is linked into each article's generation,
//! where the database last kept its context, including one claimed by
//! another caller, in that caller's trace. A manual run (`newsnack
//! run-pipeline`, a process that ends with it) is one trace too, and its
//! spans leave before the process does.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::fake_llm::{FakeLlm, Reply};
use common::otlp::{Receiver, Span};
use common::process::{self, ServeProcess};
use common::{until_sql, until_sql_polled, TestDb};
use serde_json::{json, Value};

const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";
/// The story another caller claims; its LLM call waits for the test.
const ELSEWHERE: &str = "Claimed elsewhere";
/// That caller's context.
const CALLER: &str = "00-6cf92f3577b34da6a3ce929d0e0e4736-33f067aa0ba902b7-01";

fn trace_of(traceparent: &str) -> &str {
    &traceparent[3..35]
}

async fn post(
    http: &reqwest::Client,
    url: String,
    traceparent: Option<&str>,
    body: Value,
) -> Value {
    let mut request = http.post(url).json(&body);
    if let Some(traceparent) = traceparent {
        request = request.header("traceparent", traceparent);
    }
    let answer = request.send().await.unwrap();
    assert!(answer.status().is_success(), "{}", answer.status());
    answer.json().await.unwrap()
}

/// The root span of pipeline run `run_id`, checked to be a root started by
/// `trigger` that ended `all_pass`.
fn run_root<'a>(spans: &'a [Span], run_id: &str, trigger: &str) -> &'a Span {
    let root = spans
        .iter()
        .find(|s| s.name == "pipeline run" && s.attributes["newsnack.run_id"] == run_id)
        .unwrap_or_else(|| panic!("no span of run {run_id}: {spans:#?}"));
    assert_eq!(root.parent_id, "", "the run is a root: {root:?}");
    assert_eq!(root.attributes["newsnack.trigger"], trigger);
    assert_eq!(root.attributes["newsnack.outcome"], "all_pass");
    root
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_run_is_one_trace_linked_to_the_articles_it_waited_for() {
    let receiver = Receiver::start().await;
    let db = TestDb::new().await;
    db.set("content_gen_timeout_s", "120").await;
    let (open, gate) = tokio::sync::watch::channel(false);
    let llm = FakeLlm::start(move |_, request| {
        if request.to_string().contains(ELSEWHERE) {
            Reply::Gated {
                open: gate.clone(),
                content: ARTICLE.into(),
            }
        } else {
            Reply::Ok(ARTICLE.into())
        }
    })
    .await;
    let env = [
        ("NEWSNACK_LLM_URL", llm.url.as_str()),
        ("RUST_LOG", "warn,newsnack=info"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.http.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let service = tokio::task::block_in_place(|| ServeProcess::spawn(&db.url, "scheduler", &env));
    let base = service.base_url();
    let http = reqwest::Client::new();
    let (hub, _stop) = db.listener().await;

    // Three stories; another caller claims one, whose article is held.
    let added = post(
        &http,
        format!("{base}/issues"),
        None,
        json!({"issues": [
            {"title": ELSEWHERE, "body": "Details.", "score": 3.0},
            {"title": "Second story", "body": "Details.", "score": 2.0},
            {"title": "Third story", "body": "Details.", "score": 1.0},
        ]}),
    )
    .await;
    let ids: Vec<i64> = serde_json::from_value(added["ids"].clone()).unwrap();
    let (elsewhere, ours) = (ids[0], [ids[1], ids[2]]);
    let claimed = post(
        &http,
        format!("{base}/ai-articles"),
        Some(CALLER),
        json!({"issue_ids": [elsewhere]}),
    )
    .await;
    assert_eq!(claimed["claimed"], json!([elsewhere]));

    // The scheduler's run claims and writes the other two, then waits for
    // the held one.
    db.set("schedule", "every 1s").await;
    until_sql(
        &db,
        &hub,
        60,
        &format!(
            "SELECT count(*) = 2 FROM issue WHERE processing_status = 'DONE' AND id IN ({}, {})",
            ours[0], ours[1]
        ),
    )
    .await;
    db.set("schedule", "off").await;
    open.send(true).unwrap();
    until_sql_polled(
        &db,
        60,
        "SELECT EXISTS (SELECT FROM pipeline_run WHERE outcome = 'all_pass')",
    )
    .await;
    let run = db
        .query_one(
            "SELECT id, targets FROM pipeline_run WHERE outcome = 'all_pass'",
            &[],
        )
        .await;
    let (run_id, targets): (i64, Vec<i64>) = (run.get(0), run.get(1));
    assert_eq!(targets, ids, "the run selected all three");

    let run_id_text = run_id.to_string();
    let spans = receiver
        .until(
            "the run's trace and the held article's generation",
            |spans| {
                let Some(root) = spans.iter().find(|s| {
                    s.name == "pipeline run"
                        && s.attributes.get("newsnack.run_id") == Some(&run_id_text)
                }) else {
                    return false;
                };
                let in_run = |name: &str| {
                    spans
                        .iter()
                        .filter(|s| s.trace_id == root.trace_id && s.name == name)
                        .count()
                };
                ["select", "wait", "briefing"]
                    .iter()
                    .all(|n| in_run(n) == 1)
                    && in_run("generate") == 2
                    && spans
                        .iter()
                        .any(|s| s.name == "generate" && s.trace_id == trace_of(CALLER))
                    // The spans the wait links to have come too.
                    && spans
                        .iter()
                        .filter(|s| s.trace_id == root.trace_id && s.name == "wait")
                        .flat_map(|w| &w.links)
                        .all(|l| spans.iter().any(|s| s.id == l.span_id))
            },
        )
        .await;

    // One trace, rooted in the run.
    let root = run_root(&spans, &run_id_text, "schedule");
    let trace: Vec<&Span> = spans
        .iter()
        .filter(|s| s.trace_id == root.trace_id)
        .collect();
    let one = |name: &str| {
        let found: Vec<&&Span> = trace.iter().filter(|s| s.name == name).collect();
        assert_eq!(found.len(), 1, "one {name} span in the run: {trace:#?}");
        *found[0]
    };
    let (select, wait, briefing) = (one("select"), one("wait"), one("briefing"));
    for step in [select, wait, briefing] {
        assert_eq!(
            step.parent_id, root.id,
            "{} is the run's: {step:?}",
            step.name
        );
    }
    assert_eq!(select.attributes["newsnack.targets"], "3");
    assert_eq!(wait.attributes["newsnack.outcome"], "all_pass");
    assert_eq!(
        briefing
            .attributes
            .get("newsnack.briefing_id")
            .map(String::as_str),
        Some(
            db.scalar_i64(&format!(
                "SELECT briefing_id FROM pipeline_run WHERE id = {run_id}"
            ))
            .await
            .to_string()
            .as_str()
        )
    );
    let claims: Vec<&&Span> = trace.iter().filter(|s| s.name == "claim").collect();
    assert!(!claims.is_empty(), "no claim span in the run: {trace:#?}");
    for claim in &claims {
        assert_eq!(
            claim.parent_id, root.id,
            "the claim is the run's: {claim:?}"
        );
    }
    let our_claim = claims
        .iter()
        .find(|c| c.attributes["newsnack.claimed"] == "2")
        .unwrap_or_else(|| panic!("no claim of the run's two articles: {claims:#?}"));
    let generated: Vec<&&Span> = trace.iter().filter(|s| s.name == "generate").collect();
    for generate in &generated {
        assert_eq!(generate.parent_id, our_claim.id, "{generate:?}");
    }

    // The wait is linked to each article's generation, where the
    // database last kept its context: in the run's trace for its two, in
    // the other caller's for the held one.
    let by_id: BTreeMap<&str, &Span> = spans.iter().map(|s| (s.id.as_str(), s)).collect();
    let links: BTreeMap<String, &common::otlp::Link> = wait
        .links
        .iter()
        .map(|l| (l.attributes["newsnack.issue_id"].clone(), l))
        .collect();
    for (issue, trace) in [
        (elsewhere, trace_of(CALLER)),
        (ours[0], root.trace_id.as_str()),
        (ours[1], root.trace_id.as_str()),
    ] {
        let link = links
            .get(&issue.to_string())
            .unwrap_or_else(|| panic!("no link for issue {issue}: {:#?}", wait.links));
        assert_eq!(link.trace_id, trace, "issue {issue}'s link: {link:?}");
        let generation = spans
            .iter()
            .find(|s| {
                s.name == "generate"
                    && s.trace_id == trace
                    && s.attributes["newsnack.issue_id"] == issue.to_string()
            })
            .unwrap_or_else(|| panic!("no generation of issue {issue} in trace {trace}"));
        // The linked span is the generation or one of its own.
        let mut at = by_id.get(link.span_id.as_str()).copied();
        while let Some(span) = at.filter(|s| s.id != generation.id) {
            at = by_id.get(span.parent_id.as_str()).copied();
        }
        assert!(
            at.is_some(),
            "issue {issue}'s link {link:?} is not within its generation {generation:?}"
        );
    }
    assert_eq!(wait.links.len(), 3, "{:#?}", wait.links);
    for link in &wait.links {
        assert_eq!(link.attributes["newsnack.link"], "waited_for", "{link:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_run_is_one_trace_exported_before_its_process_ends() {
    let receiver = Receiver::start().await;
    let db = TestDb::new().await;
    db.set("content_gen_timeout_s", "60").await;
    let ids = db.add_issues(3).await;
    // The built-in writer: no LLM to wait for. The batch delay is the
    // SDK's default (5 s), longer than the run: only the exit's flush
    // sends the spans in time.
    let output = tokio::task::block_in_place(|| {
        process::command(&db.url, &["run-pipeline"])
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.http)
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
            .output()
            .expect("run newsnack run-pipeline")
    });
    assert!(output.status.success(), "{}", process::text(&output.stderr));
    let summary: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(summary["outcome"], "all_pass", "{summary}");
    let run_id = summary["run_id"].to_string();

    let spans = receiver
        .until("the manual run's trace", |spans| {
            spans.iter().any(|s| {
                s.name == "pipeline run" && s.attributes.get("newsnack.run_id") == Some(&run_id)
            })
        })
        .await;
    let root = run_root(&spans, &run_id, "manual");
    let in_run = |name: &str| -> Vec<&Span> {
        spans
            .iter()
            .filter(|s| s.trace_id == root.trace_id && s.name == name)
            .collect()
    };
    for step in ["select", "claim", "wait", "briefing"] {
        let found = in_run(step);
        assert!(!found.is_empty(), "no {step} span in the run: {spans:#?}");
        assert!(
            found.iter().all(|s| s.parent_id == root.id),
            "{step} is the run's: {found:#?}"
        );
    }
    let generated: BTreeSet<String> = in_run("generate")
        .iter()
        .map(|s| s.attributes["newsnack.issue_id"].clone())
        .collect();
    assert_eq!(
        generated,
        ids.iter().map(i64::to_string).collect(),
        "each article's generation is in the run's trace"
    );
    assert_eq!(
        in_run("wait")[0].links.len(),
        ids.len(),
        "{:#?}",
        in_run("wait")[0]
    );
}
