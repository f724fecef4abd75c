//! A real OTLP receiver for the trace tests: the `rotel` collector
//! ([`super::python::Rotel`]), bound to loopback, printing
//! every span it receives in full, and the decoding of that print into
//! spans with their attributes, status, events and links; a stalled
//! collector that never answers; and the wait for a service to count its
//! failed exports; a request with a caller's `traceparent`; a traced
//! instance and the LLM it calls.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};

use super::fake_llm::{FakeLlm, Reply};
use super::process::ServeProcess;
use super::{within, TestDb};

/// One span as the receiver printed it.
#[derive(Debug, Clone, Default)]
pub struct Span {
    pub trace_id: String,
    pub parent_id: String,
    pub id: String,
    pub name: String,
    /// `Unset`, `Ok` or `Error`.
    pub status: String,
    pub attributes: BTreeMap<String, String>,
    pub events: Vec<Event>,
    pub links: Vec<Link>,
}

/// One event of a span.
#[derive(Debug, Clone, Default)]
pub struct Event {
    pub name: String,
    pub attributes: BTreeMap<String, String>,
}

/// One link of a span: to span `span_id` of trace `trace_id`.
#[derive(Debug, Clone, Default)]
pub struct Link {
    pub trace_id: String,
    pub span_id: String,
    pub attributes: BTreeMap<String, String>,
}

/// A running `rotel` collector printing every span it receives.
pub struct Receiver {
    rotel: super::python::Rotel,
    /// `http://ADDR` of its OTLP/HTTP endpoint.
    pub http: String,
}

impl Receiver {
    /// Starts the collector on two free loopback ports (OTLP gRPC and
    /// HTTP) and returns once it listens.
    pub async fn start() -> Receiver {
        let rotel = super::python::Rotel::start("detailed").await;
        let http = format!("http://{}", rotel.http);
        Receiver { rotel, http }
    }

    /// What the collector printed so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.rotel.print).unwrap()).into_owned()
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        decode(&self.text())
    }

    /// Waits until the spans received satisfy `wanted` and returns them.
    /// Judges the whole set: a batch exporter may send a child's span and
    /// its parent's in different batches. Only a print that stayed the
    /// same from one look to the next is judged: the collector writes a
    /// span a line at a time, and a span read halfway lacks its last
    /// attributes. Fails after a minute, naming what was received.
    pub async fn until(&self, what: &str, wanted: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut last = String::new();
        loop {
            let text = self.text();
            let spans = decode(&text);
            if text == last && wanted(&spans) {
                return spans;
            }
            last = text;
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

/// A loopback address nothing listens on (yet).
pub fn free_port() -> String {
    let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    socket.local_addr().unwrap().to_string()
}

/// Where in a span's print a line falls.
#[derive(PartialEq)]
enum Section {
    Head,
    Attributes,
    Events,
    Links,
}

/// The spans of the collector's detailed print: `Span #n` opens one, then
/// `Trace ID : ..`, `Parent ID : ..`, `ID : ..`, `Name : ..`,
/// `Status code : ..`; under `Attributes:` one `-> key: Type(value)` a
/// line; under `Events:` a `SpanEvent #n` each, with `-> Name: ..` and its
/// attributes; under `Links:` a `SpanLink #n` each, with `-> Trace ID: ..`,
/// `-> ID: ..` and its attributes.
pub fn decode(text: &str) -> Vec<Span> {
    let mut spans = Vec::new();
    let mut current: Option<Span> = None;
    let mut section = Section::Head;
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with("Span #") {
            spans.extend(current.take());
            current = Some(Span::default());
            section = Section::Head;
            continue;
        }
        if trimmed.starts_with("ResourceSpans #") || trimmed.starts_with("ScopeSpans #") {
            spans.extend(current.take());
            continue;
        }
        let Some(span) = current.as_mut() else {
            continue;
        };
        match trimmed {
            "Attributes:" => section = Section::Attributes,
            "Events:" => section = Section::Events,
            "Links:" => section = Section::Links,
            _ if trimmed.starts_with("SpanEvent #") => span.events.push(Event::default()),
            _ if trimmed.starts_with("SpanLink #") => span.links.push(Link::default()),
            _ => read_line(span, &section, trimmed),
        }
    }
    spans.extend(current);
    spans
}

/// One line of `span`'s print, in `section`.
fn read_line(span: &mut Span, section: &Section, line: &str) {
    let field = |prefix: &str| {
        line.strip_prefix(prefix)
            .and_then(|rest| rest.trim_start().strip_prefix(':'))
            .map(|v| v.trim().to_string())
    };
    let arrowed = line.strip_prefix("-> ");
    match section {
        Section::Head => {
            if let Some(v) = field("Trace ID") {
                span.trace_id = v;
            } else if let Some(v) = field("Parent ID") {
                span.parent_id = v;
            } else if let Some(v) = field("ID") {
                span.id = v;
            } else if let Some(v) = field("Name") {
                span.name = v;
            } else if let Some(v) = field("Status code") {
                span.status = v.trim_start_matches("STATUS_CODE_").to_string();
            }
        }
        Section::Attributes => attribute(&mut span.attributes, arrowed),
        Section::Events => {
            let Some(event) = span.events.last_mut() else {
                return;
            };
            match arrowed.and_then(|kv| kv.split_once(": ")) {
                Some(("Name", name)) => event.name = name.trim().to_string(),
                _ => attribute(&mut event.attributes, arrowed),
            }
        }
        Section::Links => {
            let Some(link) = span.links.last_mut() else {
                return;
            };
            match arrowed.and_then(|kv| kv.split_once(": ")) {
                Some(("Trace ID", id)) => link.trace_id = id.trim().to_string(),
                Some(("ID", id)) => link.span_id = id.trim().to_string(),
                _ => attribute(&mut link.attributes, arrowed),
            }
        }
    }
}

/// `key: Type(value)` (after its `-> `) into `attributes`, the value
/// taken from inside the parentheses.
fn attribute(attributes: &mut BTreeMap<String, String>, arrowed: Option<&str>) {
    let Some((key, value)) = arrowed.and_then(|kv| kv.split_once(": ")) else {
        return;
    };
    let Some((_, inner)) = value.split_once('(') else {
        return;
    };
    let value = inner.strip_suffix(')').unwrap_or(inner);
    attributes.insert(key.to_string(), value.to_string());
}

/// A collector that takes connections and never answers (a stalled
/// one): every export to it waits out the exporter's timeout.
pub struct Stalled {
    /// `http://ADDR`.
    pub url: String,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Stalled {
    pub async fn start() -> Stalled {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = accepted.clone();
        let task = tokio::spawn(async move {
            // Held open, never read from nor answered.
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                held.push(socket);
            }
        });
        Stalled {
            url,
            accepted,
            task,
        }
    }

    /// How many connections exporters opened to it.
    pub fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for Stalled {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Waits (at most a minute) until the service at `base` counts spans lost
/// to a failed export.
pub async fn until_export_failed(http: &reqwest::Client, base: &str) {
    within(60, "the failed export is counted", async {
        loop {
            let lost = super::http::metric(
                http,
                base,
                "newsnack_trace_spans_lost_total{reason=\"export_failed\"}",
            )
            .await;
            if lost > 0.0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
}

/// The trace id of a `traceparent`.
pub fn trace_of(traceparent: &str) -> &str {
    &traceparent[3..35]
}

/// POSTs `body` (JSON) to `url` with `traceparent`: the answer's status,
/// its `traceparent` and its body.
pub async fn post(
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

pub const ARTICLE: &str = "A headline\n\nFirst paragraph of the article.\n\nSecond paragraph.";
pub const MODEL: &str = "trace-model";
/// The LLM call's span: `chat <model>`, as the GenAI conventions name it.
pub const CHAT: &str = "chat trace-model";

/// The environment of an instance exporting to `endpoint` quickly, its
/// LLM `llm`.
pub fn otel_env<'a>(llm: &'a FakeLlm, endpoint: &'a str) -> [(&'a str, &'a str); 7] {
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

/// A traced instance whose logs are quiet: `RUST_LOG` picks what the log
/// lines show, never what the traces hold.
pub fn serve(db: &TestDb, name: &str, llm: &FakeLlm, endpoint: &str) -> ServeProcess {
    let mut env = otel_env(llm, endpoint).to_vec();
    env.push(("RUST_LOG", "error"));
    tokio::task::block_in_place(|| ServeProcess::spawn(&db.url, name, &env))
}

/// An article reporting 17 prompt and 29 completion tokens.
pub fn usage_reply() -> Reply {
    Reply::WithUsage {
        content: ARTICLE.into(),
        usage: json!({"prompt_tokens": 17, "completion_tokens": 29, "total_tokens": 46}),
    }
}

/// A fake LLM answering every call with [`usage_reply`].
pub async fn usage_llm() -> FakeLlm {
    FakeLlm::start(|_, _| usage_reply()).await
}
