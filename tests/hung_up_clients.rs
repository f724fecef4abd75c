//! Issues claimed for a client that hung up are still generated: a client
//! that sends `POST /ai-articles` and goes away drops its handler, and
//! whatever the handler's claim took reaches the generator anyway, rather
//! than staying `IN_PROGRESS` until its lease runs out.
//!
//! Shown with 200 clients whose claims are held up (another session locks
//! the `issue` table). The test sees the requests through the service's
//! own request spans (a subscriber of its own in this test binary): every
//! client hangs up once all 200 requests have reached the server, every
//! handler is then dropped without an answer, and only then does the lock
//! go. Every one of the 200 claims, sent by a handler that no longer
//! exists, then ends with its issue `DONE` and one article.

mod common;

use std::sync::{Arc, OnceLock};

use common::{until_sql, until_sql_polled, within, TestDb};
use newsnack::writer::{OfflineWriter, SharedWriter};
use tokio::sync::watch;
use tracing::span;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

const CLIENTS: usize = 200;

/// What became of the `POST /ai-articles` requests the service saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Tally {
    /// Requests whose span opened: they reached the server.
    arrived: usize,
    /// Requests answered (the service's `answered` line in their span).
    answered: usize,
    /// Requests whose span closed without an answer: their handler was
    /// dropped.
    dropped: usize,
}

/// Counts the service's request spans for `POST /ai-articles`.
struct Requests(watch::Sender<Tally>);

/// Marks a span as one of the counted requests.
struct Counted {
    answered: bool,
}

/// Reads the `method` and `path` fields of a request span.
#[derive(Default)]
struct Route {
    method: String,
    path: String,
}

impl tracing::field::Visit for Route {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "method" => self.method = value.to_string(),
            "path" => self.path = value.to_string(),
            _ => {}
        }
    }

    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

/// Whether an event is the service's `answered` line.
#[derive(Default)]
struct Answered(bool);

impl tracing::field::Visit for Answered {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" && format!("{value:?}") == "answered" {
            self.0 = true;
        }
    }
}

impl<S> Layer<S> for Requests
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() != "request" {
            return;
        }
        let mut route = Route::default();
        attrs.record(&mut route);
        if route.method != "POST" || route.path != "/ai-articles" {
            return;
        }
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Counted { answered: false });
            self.0.send_modify(|t| t.arrived += 1);
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let mut answered = Answered::default();
        event.record(&mut answered);
        if !answered.0 {
            return;
        }
        let mut extensions = span.extensions_mut();
        if let Some(counted) = extensions.get_mut::<Counted>() {
            counted.answered = true;
            self.0.send_modify(|t| t.answered += 1);
        }
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else {
            return;
        };
        if span
            .extensions()
            .get::<Counted>()
            .is_some_and(|c| !c.answered)
        {
            self.0.send_modify(|t| t.dropped += 1);
        }
    }
}

/// The tally of this process's requests, from a subscriber installed once.
fn requests() -> watch::Receiver<Tally> {
    static TALLY: OnceLock<watch::Sender<Tally>> = OnceLock::new();
    TALLY
        .get_or_init(|| {
            let (tally, _) = watch::channel(Tally::default());
            tracing_subscriber::registry()
                .with(
                    Requests(tally.clone()).with_filter(tracing::level_filters::LevelFilter::INFO),
                )
                .try_init()
                .expect("one subscriber per process");
            tally
        })
        .subscribe()
}

/// Sends `POST /ai-articles` for `id`; returns the connection, whose
/// answer is never read.
async fn post(addr: std::net::SocketAddr, id: i64) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let body = format!(r#"{{"issue_ids":[{id}]}}"#);
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket
        .write_all(
            format!(
                "POST /ai-articles HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    socket
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issues_claimed_for_a_client_that_hung_up_are_still_generated() {
    let mut tally = requests();
    let db = TestDb::new().await;
    let service = db
        .serve("hang-up", Arc::new(OfflineWriter) as SharedWriter)
        .await;
    let ids = db.add_issues(CLIENTS).await;

    // Claims wait: the table is locked against every writer.
    let mut locker = db.raw().await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE issue IN SHARE ROW EXCLUSIVE MODE")
        .await
        .unwrap();

    // Every request reaches the server before its client hangs up (a
    // connection closed before the server read its request is never
    // dispatched at all), then every client hangs up.
    let addr = service.addr;
    let connections = futures::future::join_all(ids.iter().map(|&id| post(addr, id))).await;
    within(
        60,
        "all 200 requests to reach the server",
        tally.wait_for(|t| t.arrived >= CLIENTS),
    )
    .await
    .expect("the tally is kept");
    drop(connections);
    // Every handler is dropped unanswered while no claim can finish.
    let seen = within(
        60,
        "the 200 handlers to be dropped",
        tally.wait_for(|t| t.dropped + t.answered >= CLIENTS),
    )
    .await
    .expect("the tally is kept")
    .to_owned();
    assert_eq!(
        seen,
        Tally {
            arrived: CLIENTS,
            answered: 0,
            dropped: CLIENTS
        },
        "no request could be answered while its claim was held up"
    );
    // The claims the dropped handlers sent are under way, held up by the
    // lock.
    until_sql_polled(
        &db,
        30,
        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                         WHERE datname = current_database() AND wait_event_type = 'Lock')",
    )
    .await;
    lock.commit().await.unwrap();

    // Every claim the dropped handlers sent is generated: all 200 issues
    // end DONE with one article each, none left IN_PROGRESS for a lease.
    until_sql(
        &db,
        &service.hub,
        60,
        "SELECT count(*) FILTER (WHERE processing_status = 'DONE') = 200
            AND (SELECT count(*) FROM ai_article) = 200
           FROM issue",
    )
    .await;
    within(30, "the service to stop", service.stop())
        .await
        .unwrap();
}
