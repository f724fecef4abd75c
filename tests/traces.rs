//! Traces over OTLP, against a real receiver: the `rotel` collector from
//! PyPI (in a cached virtual environment), bound to loopback, printing
//! every span it receives in full; the tests decode that print. A caller's
//! `traceparent` continues through `POST /issues`, the claim over HTTP and
//! the database into the article's generation and its LLM call (with the
//! GenAI attributes); a plain-SQL writer's `newsnack.traceparent` is kept
//! on the issue and its transition; an unsampled caller produces no spans;
//! a receiver that is not there changes no answer and is counted.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::fake_llm::{FakeLlm, Reply};
use common::process::{Output, ServeProcess};
use common::{until_sql_polled, within, TestDb};
use serde_json::{json, Value};

const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";
const MODEL: &str = "trace-model";
/// The LLM call's span: `chat <model>`, as the GenAI conventions name it.
const CHAT: &str = "chat trace-model";

/// One span as the receiver printed it.
#[derive(Debug, Clone, Default)]
struct Span {
    trace_id: String,
    parent_id: String,
    id: String,
    name: String,
    attributes: BTreeMap<String, String>,
}

/// A running `rotel` collector, printing what it receives to a file.
struct Receiver {
    child: Child,
    print: PathBuf,
    http: String,
    _dir: tempfile::TempDir,
}

impl Receiver {
    /// Starts the collector on two free loopback ports (OTLP gRPC and
    /// HTTP) and returns once it listens.
    async fn start() -> Receiver {
        let agent = common::python::rotel_agent().await;
        let dir = tempfile::tempdir().unwrap();
        let print = dir.path().join("received.txt");
        let (grpc, http) = (free_port(), free_port());
        let child = Command::new(&agent)
            .args(["start", "--exporter", "blackhole"])
            .args(["--debug-log", "traces", "--debug-log-verbosity", "detailed"])
            .args(["--otlp-grpc-endpoint", &grpc, "--otlp-http-endpoint", &http])
            .arg("--pid-file")
            .arg(dir.path().join("rotel.pid"))
            .arg("--log-file")
            .arg(dir.path().join("rotel.log"))
            .stdout(std::fs::File::create(&print).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", agent.display()));
        let receiver = Receiver {
            child,
            print,
            http: format!("http://{http}"),
            _dir: dir,
        };
        within(30, "the receiver listens", async {
            while tokio::net::TcpStream::connect(&http).await.is_err() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        receiver
    }

    /// Every span received so far.
    fn spans(&self) -> Vec<Span> {
        let text = String::from_utf8_lossy(&std::fs::read(&self.print).unwrap()).into_owned();
        decode(&text)
    }

    /// Waits until the spans received satisfy `wanted` and returns them.
    /// Judges the whole set: a batch exporter may send a child's span and
    /// its parent's in different batches. Fails after a minute, naming
    /// what was received.
    async fn until(&self, what: &str, wanted: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let spans = self.spans();
            if wanted(&spans) {
                return spans;
            }
            if tokio::time::Instant::now() > deadline {
                let seen: Vec<(&str, &str)> = spans
                    .iter()
                    .map(|s| (s.name.as_str(), s.trace_id.as_str()))
                    .collect();
                panic!("no {what} within 60 s; received {seen:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> String {
    let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    socket.local_addr().unwrap().to_string()
}

/// The spans of the collector's detailed print: `Span #n` opens one, then
/// `Trace ID : ..`, `Parent ID : ..`, `ID : ..`, `Name : ..`, and under
/// `Attributes:` one `-> key: Type(value)` a line, until `Events:` or
/// `Links:`.
fn decode(text: &str) -> Vec<Span> {
    let mut spans = Vec::new();
    let mut current: Option<Span> = None;
    let mut in_attributes = false;
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with("Span #") {
            spans.extend(current.take());
            current = Some(Span::default());
            in_attributes = false;
            continue;
        }
        if trimmed.starts_with("ResourceSpans #") {
            spans.extend(current.take());
            continue;
        }
        let Some(span) = current.as_mut() else {
            continue;
        };
        let field = |prefix: &str| {
            trimmed
                .strip_prefix(prefix)
                .and_then(|rest| rest.trim_start().strip_prefix(':'))
                .map(|v| v.trim().to_string())
        };
        if let Some(v) = field("Trace ID") {
            span.trace_id = v;
        } else if let Some(v) = field("Parent ID") {
            span.parent_id = v;
        } else if let Some(v) = field("ID") {
            span.id = v;
        } else if let Some(v) = field("Name") {
            if !in_attributes {
                span.name = v;
            }
        } else if trimmed == "Attributes:" {
            in_attributes = true;
        } else if trimmed == "Events:" || trimmed == "Links:" {
            in_attributes = false;
        } else if in_attributes {
            if let Some((key, value)) = trimmed
                .strip_prefix("-> ")
                .and_then(|kv| kv.split_once(": "))
            {
                // `Str(x)`, `Int(3)`: the value inside the parentheses.
                let value = value
                    .split_once('(')
                    .map_or(value, |(_, v)| v.strip_suffix(')').unwrap_or(v));
                span.attributes.insert(key.to_string(), value.to_string());
            }
        }
    }
    spans.extend(current);
    spans
}

/// The trace id of a `traceparent`.
fn trace_of(traceparent: &str) -> &str {
    &traceparent[3..35]
}

fn otel_env<'a>(llm: &'a FakeLlm, endpoint: &'a str) -> [(&'a str, &'a str); 7] {
    [
        ("NEWSNACK_LLM_URL", llm.url.as_str()),
        ("NEWSNACK_LLM_MODEL", MODEL),
        ("RUST_LOG", "warn,newsnack=info"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "2000"),
    ]
}

fn serve(db: &TestDb, name: &str, llm: &FakeLlm, endpoint: &str) -> ServeProcess {
    let env = otel_env(llm, endpoint);
    tokio::task::block_in_place(|| ServeProcess::spawn(&db.url, name, &env))
}

async fn post(
    http: &reqwest::Client,
    url: String,
    traceparent: Option<&str>,
    body: Value,
) -> (reqwest::StatusCode, Option<String>, Value) {
    let mut request = http.post(url).json(&body);
    if let Some(traceparent) = traceparent {
        request = request.header("traceparent", traceparent);
    }
    let answer = request.send().await.unwrap();
    let status = answer.status();
    let returned = answer
        .headers()
        .get("traceparent")
        .map(|v| v.to_str().unwrap().to_string());
    (status, returned, answer.json().await.unwrap())
}

async fn usage_llm() -> FakeLlm {
    FakeLlm::start(|_, _| Reply::WithUsage {
        content: ARTICLE.into(),
        usage: json!({"prompt_tokens": 17, "completion_tokens": 29, "total_tokens": 46}),
    })
    .await
}

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
    within(60, "the failed export is counted", async {
        loop {
            let text = http
                .get(format!("{base}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let lost = text
                .lines()
                .find(|l| {
                    l.starts_with("newsnack_trace_spans_lost_total{reason=\"export_failed\"}")
                })
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0);
            if lost > 0.0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;

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
