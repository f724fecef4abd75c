//! Traces over OpenTelemetry: the OTLP export, configured by the standard
//! `OTEL_*` variables, and the W3C trace context a request brings.
//!
//! With neither `OTEL_EXPORTER_OTLP_ENDPOINT` nor
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set, nothing is exported and no
//! OpenTelemetry layer is installed; a caller's `traceparent` is still
//! carried through unchanged (kept with the issues it adds and the claims
//! it makes, returned on the answer). With one set, spans go through a
//! bounded batch queue to the collector over `grpc` or `http/protobuf`
//! (`OTEL_EXPORTER_OTLP_PROTOCOL`); `OTEL_SERVICE_NAME` (default
//! `newsnack`), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` and
//! `OTEL_TRACES_SAMPLER_ARG` are read by the SDK. Ending a span never
//! waits: a full queue drops the span, a collector that is down or slow
//! fails its batch, and both are counted in `newsnack_trace_spans_lost_total`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::Context;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter,
    SpanProcessor,
};
use opentelemetry_sdk::Resource;
use tokio::task::futures::TaskLocalFuture;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Finished spans waiting for export at most; more are dropped.
const QUEUE: usize = 4096;

/// The longest the exit waits for the last spans to leave.
const FLUSH_AT_EXIT: Duration = Duration::from_secs(5);

/// Whether spans are exported (set once, by [`Export::from_env`]).
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Why the export could not be configured.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTEL_EXPORTER_OTLP_PROTOCOL={0:?} is not supported: use grpc or http/protobuf")]
    Protocol(String),
    #[error("cannot build the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// The configured export: the tracer provider, flushed and shut down by
/// [`Export::shutdown`]. Needs a tokio runtime when built (the gRPC
/// channel's worker runs on it).
pub struct Export {
    provider: SdkTracerProvider,
}

impl Export {
    /// The export the environment asks for, or `None` when no endpoint is
    /// set.
    pub fn from_env() -> Result<Option<Export>, TelemetryError> {
        let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
        if !set("OTEL_EXPORTER_OTLP_ENDPOINT") && !set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            return Ok(None);
        }
        let protocol = std::env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL"))
            .unwrap_or_else(|_| "http/protobuf".into());
        let exporter = match protocol.trim() {
            "grpc" => opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .build()?,
            "http/protobuf" => opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(Protocol::HttpBinary)
                .build()?,
            other => return Err(TelemetryError::Protocol(other.into())),
        };
        let pending = Arc::new(AtomicUsize::new(0));
        let batches = BatchSpanProcessor::builder(CountedExporter {
            inner: exporter,
            pending: pending.clone(),
        })
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_max_queue_size(QUEUE)
                .build(),
        )
        .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(BoundedQueue {
                inner: batches,
                pending,
            })
            .with_resource(resource())
            .build();
        EXPORTING.store(true, Ordering::Relaxed);
        Ok(Some(Export { provider }))
    }

    /// The layer that turns `tracing` spans into exported ones.
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        // Only what the spans say: where in the source, on which thread and
        // how long idle cost a dozen attributes on every span and answer
        // no editor's question. Nothing here reads OpenTelemetry's own
        // current context (contexts are taken from `tracing`'s spans), so
        // entering a span, at every poll of its future, attaches none.
        tracing_opentelemetry::layer()
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_context_activation(false)
            .with_tracer(self.provider.tracer("newsnack"))
    }

    /// Exports what is queued (waiting at most [`FLUSH_AT_EXIT`]) and stops.
    pub fn shutdown(self) -> OTelSdkResult {
        self.provider.shutdown_with_timeout(FLUSH_AT_EXIT)
    }
}

/// The resource: the SDK's (`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_SERVICE_NAME`),
/// named `newsnack` unless either names the service.
fn resource() -> Resource {
    let named = std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.is_empty())
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| {
            v.split(',')
                .any(|kv| kv.trim().starts_with("service.name="))
        });
    let builder = Resource::builder();
    if named {
        builder.build()
    } else {
        builder.with_service_name("newsnack").build()
    }
}

/// Hands finished spans to the batch processor while fewer than [`QUEUE`]
/// are waiting; drops (and counts) the rest, so that the batch processor's
/// own queue never overflows uncounted.
#[derive(Debug)]
struct BoundedQueue {
    inner: BatchSpanProcessor,
    pending: Arc<AtomicUsize>,
}

impl SpanProcessor for BoundedQueue {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.pending.fetch_add(1, Ordering::Relaxed) >= QUEUE {
            self.pending.fetch_sub(1, Ordering::Relaxed);
            crate::metrics::trace_span_queue_full();
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, counting the spans of each batch it could not
/// deliver and giving their places in [`BoundedQueue`] back.
#[derive(Debug)]
struct CountedExporter<E> {
    inner: E,
    pending: Arc<AtomicUsize>,
}

impl<E: SpanExporter> SpanExporter for CountedExporter<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        let result = self.inner.export(batch).await;
        self.pending.fetch_sub(n, Ordering::Relaxed);
        if result.is_err() {
            crate::metrics::trace_spans_export_failed(n);
        }
        result
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Whether spans are exported.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// A caller's W3C trace context, as its headers said it (checked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallerContext {
    pub traceparent: String,
    pub tracestate: Option<String>,
}

tokio::task_local! {
    /// The trace context of the request being answered, for the writes
    /// it makes when nothing is exported.
    static REQUEST_CONTEXT: Option<CallerContext>;
}

/// `work` (a request's handling) run with `caller` as its trace context.
fn with_caller<F: Future>(
    caller: Option<CallerContext>,
    work: F,
) -> TaskLocalFuture<Option<CallerContext>, F> {
    REQUEST_CONTEXT.scope(caller, work)
}

/// Around the routed app, inside the request span: reads the caller's
/// `traceparent` / `tracestate`, runs the request with it
/// ([`current_traceparent`]) and puts the answer's on the response
/// ([`answer_headers`]). The request span itself is made the caller's
/// child where it is made ([`adopt_caller`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceContextLayer;

impl<S> tower::Layer<S> for TraceContextLayer {
    type Service = TraceContextService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TraceContextService { inner }
    }
}

/// See [`TraceContextLayer`].
#[derive(Debug, Clone)]
pub struct TraceContextService<S> {
    inner: S,
}

impl<S, B, R> tower::Service<axum::http::Request<B>> for TraceContextService<S>
where
    S: tower::Service<axum::http::Request<B>, Response = axum::http::Response<R>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Answered<S::Future>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: axum::http::Request<B>) -> Self::Future {
        let caller = caller_context(request.headers());
        // The request span, entered by the layer outside this one.
        let span = exporting().then(tracing::Span::current);
        if caller.is_none() && span.is_none() {
            return Answered::Plain {
                inner: self.inner.call(request),
            };
        }
        Answered::Traced {
            inner: with_caller(caller.clone(), self.inner.call(request)),
            caller,
            span,
        }
    }
}

pin_project_lite::pin_project! {
    /// A request's answer, given the answer's trace headers when it comes.
    #[project = AnsweredProjection]
    pub enum Answered<F> {
        Plain { #[pin] inner: F },
        Traced {
            #[pin]
            inner: TaskLocalFuture<Option<CallerContext>, F>,
            caller: Option<CallerContext>,
            span: Option<tracing::Span>,
        },
    }
}

impl<F, R, E> Future for Answered<F>
where
    F: Future<Output = Result<axum::http::Response<R>, E>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<F::Output> {
        match self.project() {
            AnsweredProjection::Plain { inner } => inner.poll(cx),
            AnsweredProjection::Traced {
                inner,
                caller,
                span,
            } => {
                let mut answer = std::task::ready!(inner.poll(cx));
                if let Ok(response) = &mut answer {
                    answer_headers(span.as_ref(), caller.as_ref(), response);
                }
                Poll::Ready(answer)
            }
        }
    }
}

/// `work` run in the current trace context (span and caller), for a task
/// spawned on a request's behalf.
pub fn in_current_context<F: Future>(
    work: F,
) -> TaskLocalFuture<Option<CallerContext>, tracing::instrument::Instrumented<F>> {
    let caller = REQUEST_CONTEXT.try_with(Clone::clone).ok().flatten();
    let span = if exporting() {
        tracing::Span::current()
    } else {
        tracing::Span::none()
    };
    with_caller(caller, tracing::Instrument::instrument(work, span))
}

/// The `traceparent` a write should keep: the current span's when spans
/// are exported (a child of the caller's), else the request's caller's, or
/// `None` without either.
pub fn current_traceparent() -> Option<String> {
    if exporting() {
        let cx = tracing::Span::current().context();
        let span = cx.span();
        let sc = span.span_context();
        if sc.is_valid() {
            return Some(format!(
                "00-{}-{}-{:02x}",
                sc.trace_id(),
                sc.span_id(),
                sc.trace_flags().to_u8()
            ));
        }
    }
    REQUEST_CONTEXT
        .try_with(|c| c.as_ref().map(|c| c.traceparent.clone()))
        .ok()
        .flatten()
}

/// The caller's context from `traceparent` / `tracestate` headers; `None`
/// when there is none or it is malformed (ignored, as W3C asks).
pub fn caller_context(headers: &axum::http::HeaderMap) -> Option<CallerContext> {
    let traceparent = headers.get("traceparent")?.to_str().ok()?;
    if !is_traceparent(traceparent) {
        return None;
    }
    let tracestate = headers
        .get("tracestate")
        .and_then(|v| v.to_str().ok())
        .filter(|v| v.len() <= 512)
        .map(str::to_owned);
    Some(CallerContext {
        traceparent: traceparent.to_ascii_lowercase(),
        tracestate,
    })
}

/// Whether `value` is a version-00 `traceparent` with a non-zero trace id
/// and parent id (the shape the database checks too, migration 34).
pub fn is_traceparent(value: &str) -> bool {
    let b = value.as_bytes();
    let hex = |s: &[u8]| s.iter().all(u8::is_ascii_hexdigit);
    let nonzero = |s: &[u8]| s.iter().any(|&c| c != b'0');
    b.len() == 55
        && &b[..3] == b"00-"
        && b[35] == b'-'
        && b[52] == b'-'
        && hex(&b[3..35])
        && hex(&b[36..52])
        && hex(&b[53..])
        && nonzero(&b[3..35])
        && nonzero(&b[36..52])
}

/// Makes `span` (a request's) a child of the caller's context, when spans
/// are exported.
pub fn adopt_caller(span: &tracing::Span, caller: &CallerContext) {
    if !exporting() {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&CallerHeaders(caller));
    let _ = span.set_parent(parent);
}

/// The `traceparent` / `tracestate` an answer carries: the request span's
/// when spans are exported, else the caller's unchanged. The request span
/// takes the answer's status (`http.response.status_code`, an error from
/// 500 on, as OpenTelemetry's HTTP conventions have it): the log's
/// `answered` line says the same, but is not exported as an event.
fn answer_headers<R>(
    span: Option<&tracing::Span>,
    caller: Option<&CallerContext>,
    response: &mut axum::http::Response<R>,
) {
    let status = response.status();
    let headers = response.headers_mut();
    if let Some(span) = span {
        let cx = span.context();
        if cx.span().span_context().is_valid() {
            span.set_attribute("http.response.status_code", i64::from(status.as_u16()));
            if status.is_server_error() {
                span.set_status(opentelemetry::trace::Status::error(
                    status.canonical_reason().unwrap_or("server error"),
                ));
            }
            TraceContextPropagator::new().inject_context(&cx, &mut AnswerHeaders(headers));
            return;
        }
    }
    if let Some(caller) = caller {
        AnswerHeaders(headers).set("traceparent", caller.traceparent.clone());
        if let Some(state) = &caller.tracestate {
            AnswerHeaders(headers).set("tracestate", state.clone());
        }
    }
}

/// The span of one article's generation, when spans are exported. On the
/// issue's first attempt it is a child of the context it was claimed in
/// (`claimed_in`). A `retry` (a later attempt, or an automatic retry whose
/// attempt was given back, or a claim taken back after its lease ran out)
/// starts a new trace, sampled on its own, linked to
/// the earlier attempt's context (`earlier`, link attribute
/// `newsnack.link` = `previous_attempt`) and to its own claim's
/// (`claim`): a retry hours later neither stretches the first trace nor
/// inherits its sampling.
pub fn generation_span(
    issue: i64,
    attempts: i32,
    retry: bool,
    claimed_in: Option<&str>,
    earlier: Option<&str>,
) -> tracing::Span {
    if !exporting() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "generate",
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        error.r#type = tracing::field::Empty,
        newsnack.issue_id = issue,
        newsnack.attempt = attempts,
    );
    let claimed_in = claimed_in.and_then(remote_context);
    if !retry {
        if let Some(claimed_in) = claimed_in {
            let _ = span.set_parent(claimed_in);
        }
        return span;
    }
    let _ = span.set_parent(Context::new());
    let links = [
        (earlier.and_then(remote_context), "previous_attempt"),
        (claimed_in, "claim"),
    ];
    for (cx, kind) in links {
        if let Some(cx) = cx {
            span.add_link_with_attributes(
                cx.span().span_context().clone(),
                vec![opentelemetry::KeyValue::new("newsnack.link", kind)],
            );
        }
    }
    span
}

/// The remote context a well-formed `traceparent` names.
fn remote_context(traceparent: &str) -> Option<Context> {
    if !is_traceparent(traceparent) {
        return None;
    }
    Some(
        TraceContextPropagator::new().extract(&CallerHeaders(&CallerContext {
            traceparent: traceparent.to_owned(),
            tracestate: None,
        })),
    )
}

/// The span of one LLM call (OpenTelemetry's GenAI conventions), when
/// spans are exported; `writer` names the provider and model
/// (`primary:<model>`).
pub fn llm_call_span(model: &str, writer: &str) -> tracing::Span {
    if !exporting() {
        return tracing::Span::none();
    }
    tracing::info_span!(
        "chat",
        otel.name = %format_args!("chat {model}"),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        gen_ai.operation.name = "chat",
        gen_ai.system = "openai",
        gen_ai.request.model = model,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        error.r#type = tracing::field::Empty,
        newsnack.writer = writer,
    )
}

/// Records an LLM call's outcome on its [`llm_call_span`]: the tokens it
/// reported, or the kind of error it met.
pub fn llm_call_ended(
    span: &tracing::Span,
    outcome: Result<(Option<i32>, Option<i32>), &dyn std::fmt::Display>,
) {
    if span.is_none() {
        return;
    }
    match outcome {
        Ok((input, output)) => {
            if let Some(n) = input {
                span.record("gen_ai.usage.input_tokens", n);
            }
            if let Some(n) = output {
                span.record("gen_ai.usage.output_tokens", n);
            }
        }
        Err(kind) => {
            span.record("error.type", tracing::field::display(kind));
            span.record("otel.status_code", "ERROR");
        }
    }
}

/// The span `make` builds when spans are exported, else none (nothing is
/// recorded and nothing costs).
pub fn exported(make: impl FnOnce() -> tracing::Span) -> tracing::Span {
    if exporting() {
        make()
    } else {
        tracing::Span::none()
    }
}

/// Links `span` (a pipeline run's wait) to the trace context each article
/// it waited for was worked in: `(issue id, traceparent)`, as the database
/// keeps them. The link names the issue (`newsnack.issue_id`); a malformed
/// context is passed over.
pub fn link_articles(span: &tracing::Span, contexts: &[(i64, String)]) {
    if span.is_none() {
        return;
    }
    for (issue, traceparent) in contexts {
        if !is_traceparent(traceparent) {
            continue;
        }
        let worked_in = TraceContextPropagator::new().extract(&CallerHeaders(&CallerContext {
            traceparent: traceparent.clone(),
            tracestate: None,
        }));
        span.add_link_with_attributes(
            worked_in.span().span_context().clone(),
            vec![
                opentelemetry::KeyValue::new("newsnack.link", "waited_for"),
                opentelemetry::KeyValue::new("newsnack.issue_id", *issue),
            ],
        );
    }
}

struct CallerHeaders<'a>(&'a CallerContext);

impl Extractor for CallerHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => Some(&self.0.traceparent),
            "tracestate" => self.0.tracestate.as_deref(),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

struct AnswerHeaders<'a>(&'a mut axum::http::HeaderMap);

impl Injector for AnswerHeaders<'_> {
    fn set(&mut self, key: &str, value: String) {
        if value.is_empty() {
            return;
        }
        if let (Ok(name), Ok(value)) = (
            axum::http::HeaderName::from_bytes(key.as_bytes()),
            axum::http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_has_the_w3c_shape_with_non_zero_ids() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(is_traceparent(good));
        assert!(!is_traceparent(&good.replace("00-4b", "01-4b")));
        assert!(!is_traceparent(
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
        ));
        assert!(!is_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"
        ));
        assert!(!is_traceparent(&good[..54]));
        assert!(!is_traceparent("garbage"));
    }
}
