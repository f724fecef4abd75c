//! The agent: one per process, it talks to the budget for all of the
//! process's calls, one exchange at a time (see the folder's docs).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;

use super::calls::{Calls, Delays, Request};
use crate::db::llm_budget::{self, CallToQueue, Exchange, ExchangeAnswer, Held, PauseInForce};
use crate::db::{DbError, DbPool};
use crate::events::hub::EventHub;
use crate::settings::SettingsCache;

/// The first and the longest pause between exchanges that failed.
const EXCHANGE_RETRY: (Duration, Duration) = (Duration::from_millis(250), Duration::from_secs(5));
/// How long a process that stops waits for its last exchange.
const LEAVING_TIMEOUT: Duration = Duration::from_secs(5);

/// Talks to the budget for one process (see the module docs).
pub struct BudgetAgent {
    pool: DbPool,
    doorbells: broadcast::Receiver<String>,
    settings_changed: tokio::sync::watch::Receiver<u64>,
    settings: Arc<SettingsCache>,
    instance: String,
    holder: String,
    has_fallback: bool,
    inbox: mpsc::UnboundedReceiver<Request>,
    calls: Calls,
    /// What holds calls back, for their spans.
    delays: Arc<Delays>,
}

impl BudgetAgent {
    /// The agent of process `instance` (see [`super::LlmBudget::start`]),
    /// taking its generations' requests from `inbox`.
    pub(super) fn new(
        pool: DbPool,
        hub: &EventHub,
        settings: Arc<SettingsCache>,
        instance: &str,
        has_fallback: bool,
        inbox: mpsc::UnboundedReceiver<Request>,
        delays: Arc<Delays>,
    ) -> BudgetAgent {
        BudgetAgent {
            pool,
            doorbells: hub.budget_doorbells(),
            settings_changed: hub.settings_changed(),
            settings,
            instance: instance.to_string(),
            holder: format!("{instance}#{:08x}", rand::random::<u32>()),
            has_fallback,
            inbox,
            calls: Calls::default(),
            delays,
        }
    }

    /// Runs until [`LlmBudget::leave`] (or until every [`LlmBudget`] and
    /// [`CallSlot`] is gone).
    pub async fn run(mut self) {
        self.settings_changed.borrow_and_update();
        // Something time-driven to ask about: a doorbell, a timer.
        let mut ask = false;
        let mut ask_again: Option<Instant> = None;
        let mut retry: Option<Instant> = None;
        let mut retry_pause = EXCHANGE_RETRY.0;
        let mut lease = self.lease().await;
        let mut renew_at = Instant::now() + lease / 3;
        let mut pause_seen: Option<Instant> = None;
        let mut held_seen: Option<Held> = None;
        let mut doorbells_open = true;
        loop {
            if retry.is_none() && (self.calls.has_news() || ask) {
                lease = self.lease().await;
                match self.exchange(lease).await {
                    Ok(answer) => {
                        ask = false;
                        retry_pause = EXCHANGE_RETRY.0;
                        renew_at = Instant::now() + (lease / 3).max(Duration::from_millis(100));
                        // Also at a pause's end, to see it end.
                        let pause_ends = answer.pause.as_ref().map(|p| p.remaining);
                        ask_again = [answer.ask_again_in, pause_ends]
                            .into_iter()
                            .flatten()
                            .min()
                            .map(|d| Instant::now() + d);
                        self.delays.heard(answer.pause.is_some(), answer.held);
                        pause_seen = self.note_pause(answer.pause.as_ref(), pause_seen);
                        held_seen = note_held(&answer, held_seen);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, retry_in = ?retry_pause, "cannot reach the LLM budget; will try again");
                        retry = Some(Instant::now() + retry_pause);
                        retry_pause = (retry_pause * 2).min(EXCHANGE_RETRY.1);
                    }
                }
                continue;
            }
            tokio::select! {
                request = self.inbox.recv() => {
                    let Some(request) = request else { return };
                    let mut leaving = self.calls.take(request);
                    while leaving.is_none() {
                        match self.inbox.try_recv() {
                            Ok(more) => leaving = self.calls.take(more),
                            Err(_) => break,
                        }
                    }
                    if let Some(left) = leaving {
                        self.leave().await;
                        let _ = left.send(());
                        return;
                    }
                }
                rung = self.doorbells.recv(), if doorbells_open => match rung {
                    Ok(holder) => ask |= holder == self.holder || holder == "*",
                    Err(broadcast::error::RecvError::Lagged(_)) => ask = true,
                    Err(broadcast::error::RecvError::Closed) => doorbells_open = false,
                },
                Ok(()) = self.settings_changed.changed() => ask |= !self.calls.waiting.is_empty(),
                _ = sleep_until(ask_again), if ask_again.is_some() => {
                    ask_again = None;
                    ask = true;
                }
                _ = sleep_until(retry), if retry.is_some() => retry = None,
                _ = tokio::time::sleep_until(renew_at), if self.calls.holds_any() => ask = true,
            }
        }
    }

    /// The holder's lease: `lease_s`.
    async fn lease(&self) -> Duration {
        match self.settings.get().await {
            Ok(settings) => settings.lease(),
            Err(_) => crate::settings::Settings::default().lease(),
        }
    }

    /// One exchange with what has queued up here.
    async fn exchange(&mut self, lease: Duration) -> Result<ExchangeAnswer, DbError> {
        let queue: Vec<CallToQueue> = self.calls.to_queue.iter().map(|w| w.call).collect();
        let answer = self.send(lease, &queue, false).await?;
        let sent = std::mem::take(&mut self.calls.to_queue);
        self.calls.finished.clear();
        self.calls.tokens = 0;
        self.calls.reports.clear();
        self.calls.pause = None;
        self.calls.apply(sent, &answer);
        Ok(answer)
    }

    /// Tells the budget what ended here (and, unless `leaving`, queues
    /// `queue` and renews the lease for `lease`), in one statement.
    async fn send(
        &self,
        lease: Duration,
        queue: &[CallToQueue],
        leaving: bool,
    ) -> Result<ExchangeAnswer, DbError> {
        let client = self.pool.get().await?;
        let calls = &self.calls;
        let exchange = Exchange {
            holder: &self.holder,
            instance: &self.instance,
            lease,
            has_fallback: self.has_fallback,
            queue,
            finished: if leaving { &[] } else { &calls.finished },
            tokens: calls.tokens,
            reports: &calls.reports,
            pause: calls
                .pause
                .as_ref()
                .map(|(wait, why)| (*wait, why.as_str())),
            leaving,
        };
        llm_budget::exchange(&client, &exchange).await
    }

    /// The last exchange: every call held here goes, and so does the
    /// holder.
    async fn leave(&mut self) {
        let left = self.send(Duration::ZERO, &[], true);
        match tokio::time::timeout(LEAVING_TIMEOUT, left).await {
            Ok(Ok(_)) => tracing::debug!(holder = %self.holder, "left the LLM budget"),
            Ok(Err(e)) => tracing::warn!(error = %e, "could not leave the LLM budget; this process's share comes back with its lease"),
            Err(_) => tracing::warn!("the LLM budget did not answer in time; this process's share comes back with its lease"),
        }
    }

    /// Logs a pause the first time it is seen, and its end, and shows it
    /// in the metrics; returns when the pause seen ends.
    fn note_pause(&self, pause: Option<&PauseInForce>, seen: Option<Instant>) -> Option<Instant> {
        match (pause, seen) {
            (Some(pause), seen) => {
                let until = Instant::now() + pause.remaining;
                // A pause is new unless it ends within a second of the one seen.
                let new = seen.is_none_or(|seen| until > seen + Duration::from_secs(1));
                if new {
                    crate::metrics::llm_paused(pause.remaining);
                    tracing::warn!(
                        for_s = pause.remaining.as_secs_f64(),
                        by = pause.by.as_deref().unwrap_or("?"),
                        reason = pause.reason.as_deref().unwrap_or(""),
                        "LLM calls paused on every instance"
                    );
                }
                Some(until)
            }
            (None, Some(_)) => {
                crate::metrics::llm_resumed();
                tracing::info!("LLM calls resumed");
                None
            }
            (None, None) => None,
        }
    }
}

/// Logs what the day's token budget holds when that changes; returns what
/// it holds now.
fn note_held(answer: &ExchangeAnswer, seen: Option<Held>) -> Option<Held> {
    if answer.held != seen {
        match answer.held {
            Some(held) => tracing::warn!(
                tokens_today = answer.tokens_today,
                "the day's token budget holds {} until the next day",
                held.what()
            ),
            None => tracing::info!(
                tokens_today = answer.tokens_today,
                "the day's token budget holds no LLM calls any more"
            ),
        }
    }
    answer.held
}

/// Sleeps until `at`; `None` never comes.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
