//! Where log lines and status lines go, and what happens when they cannot
//! go there.
//!
//! Logs go to stderr (`RUST_LOG` picks levels, `NEWSNACK_LOG_FORMAT=json`
//! switches to JSON lines, which carry `trace_id` and `span_id` when
//! traces are exported); the few status lines the long-running commands
//! print (where `serve` listens, a warning of `tail`) go to stdout or
//! stderr. A destination that fails — a pipe whose reader went away (a log
//! shipper restarting), a full disk — loses those lines, counted in
//! `newsnack_log_lines_dropped_total`, and nothing else: no write error is
//! raised, retried or turned into a panic, so requests, signals and
//! shutdown go on as usual. (`tracing-subscriber`'s own writer reports a
//! failed write with `eprintln!`, which panics when stderr is what failed:
//! the panic took down whichever task was logging, a request's or the
//! signal handler's.)

use std::io::Write;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::telemetry::Export;

/// Starts logging to stderr through [`LossyStderr`]; `RUST_LOG` picks
/// levels (otherwise `default`), `NEWSNACK_LOG_FORMAT=json` switches to
/// JSON lines. With `export`, newsnack's spans at `info` and above go to
/// it ([`crate::telemetry`]) whatever `RUST_LOG` says: quiet logs must not
/// empty the traces.
pub fn init(default: &str, export: Option<&Export>) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(LossyStderr)
        .log_internal_errors(false);
    let lines =
        if std::env::var("NEWSNACK_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json")) {
            lines
                .fmt_fields(JsonFields::new())
                .event_format(WithTraceIds(tracing_subscriber::fmt::format().json()))
                .boxed()
        } else {
            lines.boxed()
        };
    // A request's `answered` line is the log's: its span says the status.
    let exported = Targets::new()
        .with_target("newsnack", Level::INFO)
        .with_target(crate::http::ANSWERED, LevelFilter::OFF);
    tracing_subscriber::registry()
        .with(export.map(|e| e.layer().with_filter(exported)))
        .with(lines.with_filter(filter))
        .init();
}

/// A JSON line format that adds the current span's `trace_id` and
/// `span_id` (when spans are exported, [`crate::telemetry`]) to the
/// object `F` writes.
struct WithTraceIds<F>(F);

impl<S, N, F> FormatEvent<S, N> for WithTraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let ids = ctx.lookup_current().and_then(|span| {
            let extensions = span.extensions();
            let data = extensions.get::<tracing_opentelemetry::OtelData>()?;
            Some((data.trace_id()?, data.span_id()?))
        });
        let Some((trace_id, span_id)) = ids else {
            return self.0.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.0.format_event(ctx, Writer::new(&mut line), event)?;
        match line.rfind('}') {
            Some(end) => {
                writer.write_str(&line[..end])?;
                write!(
                    writer,
                    ",\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\""
                )?;
                writer.write_str(&line[end..])
            }
            None => writer.write_str(&line),
        }
    }
}

/// Makes one [`LossyLine`] per log event: stderr, whose failures are
/// counted, never reported.
#[derive(Debug, Clone, Copy, Default)]
pub struct LossyStderr;

impl<'a> MakeWriter<'a> for LossyStderr {
    type Writer = LossyLine;

    fn make_writer(&'a self) -> LossyLine {
        LossyLine {
            to: Stream::Stderr,
            failed: false,
        }
    }
}

/// The two standard streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    Stdout,
    Stderr,
}

/// One line on its way to a standard stream. Every write succeeds as far
/// as the caller can tell; if any part of the line could not be written,
/// the line counts as dropped (once) when the writer is dropped.
#[derive(Debug)]
pub struct LossyLine {
    to: Stream,
    failed: bool,
}

impl Write for LossyLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.failed {
            let written = match self.to {
                Stream::Stdout => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(buf).and_then(|()| out.flush())
                }
                Stream::Stderr => std::io::stderr().lock().write_all(buf),
            };
            self.failed = written.is_err();
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LossyLine {
    fn drop(&mut self) {
        if self.failed {
            crate::metrics::log_line_dropped();
        }
    }
}

/// Prints one line on stdout; a line that cannot be written is counted as
/// dropped, never a panic (as `println!` would).
pub fn print_line(line: std::fmt::Arguments<'_>) {
    write_line(Stream::Stdout, line);
}

/// Prints one line on stderr; a line that cannot be written is counted as
/// dropped, never a panic (as `eprintln!` would).
pub fn eprint_line(line: std::fmt::Arguments<'_>) {
    write_line(Stream::Stderr, line);
}

fn write_line(to: Stream, line: std::fmt::Arguments<'_>) {
    let mut writer = LossyLine { to, failed: false };
    let _ = writer.write_all(format!("{line}\n").as_bytes());
}
