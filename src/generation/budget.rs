//! The LLM budget all instances share, from one process's side.
//!
//! Every LLM call waits for a grant from the budget in PostgreSQL
//! (migration 17): at most `llm_max_in_flight` calls in flight and
//! `llm_requests_per_minute` starts across the cluster, at most
//! `generation_concurrency` per process, briefing calls before feed calls
//! (while one waits anywhere, no feed call starts), the oldest claim first
//! within a class, none at all while a rate limit's pause is on, and none
//! the day's token budget holds (migration 28): each call's tokens go back
//! with its slot ([`CallSlot::spent`]) and count to the day, every
//! instance's together.
//!
//! One [`BudgetAgent`] per process talks to the budget for all of the
//! process's calls, one exchange (one statement) at a time: what queued up
//! while one exchange ran goes together in the next, so calls that finish
//! together give their slots back, and take the next ones, in one
//! statement. A call of this process granted by another process's exchange
//! is announced on channel `llm_budget`, a doorbell that makes the agent
//! ask; so do a pause, a settings change (a higher limit) and, when calls
//! wait for what time brings, a timer. The agent's exchanges renew the
//! process's lease; while it holds calls and has nothing else to say, it
//! renews it every third of `lease_s`. A process that stops renewing (it
//! was killed) loses its calls when its lease runs out, and their share
//! comes back.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::Instant;

use crate::db::issue::ClaimedIssue;
use crate::db::llm_budget::{
    self, CallToQueue, Exchange, ExchangeAnswer, Held, PauseInForce, ProviderOutcome,
    ProviderReport, Route,
};
use crate::db::{DbError, DbPool};
use crate::events::hub::EventHub;
use crate::model::llm::Priority;
use crate::settings::SettingsCache;

/// The first and the longest pause between exchanges that failed.
const EXCHANGE_RETRY: (Duration, Duration) = (Duration::from_millis(250), Duration::from_secs(5));
/// How long a process that stops waits for its last exchange.
const LEAVING_TIMEOUT: Duration = Duration::from_secs(5);

/// What a claim's generation asks of the agent.
enum Request {
    /// Queue a call; the grant is the call's id and where it goes.
    Queue {
        call: CallToQueue,
        granted: oneshot::Sender<(i64, Route)>,
    },
    /// The call of this claim (issue, claim id) is no longer wanted.
    Withdraw { claim: (i64, i64) },
    /// A granted call ended, having spent `tokens`; with a pause every
    /// instance should keep.
    Finished {
        id: i64,
        tokens: i64,
        pause: Option<(Duration, String)>,
        report: Option<ProviderReport>,
    },
    /// No call is granted here any more; the calls waiting are withdrawn.
    Close,
    /// Leave the budget, with every call, and stop.
    Leave { left: oneshot::Sender<()> },
}

/// The side of the budget generations use. Cheap to clone.
#[derive(Clone)]
pub struct LlmBudget {
    requests: mpsc::UnboundedSender<Request>,
}

/// A granted call: hold it while the LLM answers. Dropping it gives the
/// slot back with the tokens it spent; [`CallSlot::finish_pausing`] also
/// pauses every instance.
pub struct CallSlot {
    id: i64,
    route: Route,
    requests: mpsc::UnboundedSender<Request>,
    tokens: i64,
    pause: Option<(Duration, String)>,
    report: Option<ProviderOutcome>,
}

impl CallSlot {
    /// The provider the call goes to, and its class.
    pub fn route(&self) -> Route {
        self.route
    }

    /// The provider answered: its circuit closes, on every instance.
    pub fn provider_answered(&mut self) {
        self.report = Some(ProviderOutcome::Ok);
    }

    /// The provider failed the call (5xx, timeout, no connection, 429):
    /// counted toward marking it down for every instance, at once when it
    /// asked for a `pause`.
    pub fn provider_failed(&mut self, reason: String, pause: Option<Duration>) {
        self.report = Some(ProviderOutcome::Failed { reason, pause });
    }

    /// What the call has spent so far, in tokens: counted to the day's
    /// budget when the slot goes back (a call dropped midway counts what
    /// was set last).
    pub fn spent(&mut self, tokens: i64) {
        self.tokens = tokens.max(0);
    }

    /// Gives the slot back and pauses every instance's calls for `pause`
    /// (the LLM answered 429 or 503 with `Retry-After`), for `reason`.
    pub fn finish_pausing(mut self, pause: Duration, reason: String) {
        self.pause = Some((pause, reason));
    }
}

impl Drop for CallSlot {
    fn drop(&mut self) {
        let provider = self.route.provider;
        let _ = self.requests.send(Request::Finished {
            id: self.id,
            tokens: self.tokens,
            pause: self.pause.take(),
            report: self
                .report
                .take()
                .map(|outcome| ProviderReport { provider, outcome }),
        });
    }
}

/// Withdraws a queued call whose generation stopped waiting for it.
struct WithdrawUnlessGranted {
    claim: (i64, i64),
    requests: mpsc::UnboundedSender<Request>,
    granted: bool,
}

impl Drop for WithdrawUnlessGranted {
    fn drop(&mut self) {
        if !self.granted {
            let _ = self.requests.send(Request::Withdraw { claim: self.claim });
        }
    }
}

impl LlmBudget {
    /// The budget of this process and the agent that talks to the
    /// database for it (run it with [`BudgetAgent::run`]). `instance`
    /// names the process; a random suffix tells it from a restarted one.
    pub fn start(
        pool: DbPool,
        hub: &EventHub,
        settings: Arc<SettingsCache>,
        instance: &str,
        has_fallback: bool,
    ) -> (LlmBudget, BudgetAgent) {
        let (requests, inbox) = mpsc::unbounded_channel();
        let agent = BudgetAgent {
            pool,
            doorbells: hub.budget_doorbells(),
            settings_changed: hub.settings_changed(),
            settings,
            instance: instance.to_string(),
            holder: format!("{instance}#{:08x}", rand::random::<u32>()),
            has_fallback,
            inbox,
            calls: Calls::default(),
        };
        (LlmBudget { requests }, agent)
    }

    /// Waits until the budget grants a call for `claimed`, at `priority`
    /// (`None`: the class the issue was last asked for at), on the fallback
    /// provider only if `fallback_only`. `None` once the budget is closed.
    /// Dropping the future withdraws the call.
    pub async fn call_slot(
        &self,
        claimed: &ClaimedIssue,
        priority: Option<Priority>,
        fallback_only: bool,
    ) -> Option<CallSlot> {
        let (granted, grant) = oneshot::channel();
        let call = CallToQueue {
            issue_id: claimed.id,
            claim_id: claimed.claim_id,
            priority,
            fallback_only,
        };
        self.requests.send(Request::Queue { call, granted }).ok()?;
        let _waiting = crate::metrics::llm_call_waiting();
        let mut withdraw = WithdrawUnlessGranted {
            claim: (claimed.id, claimed.claim_id),
            requests: self.requests.clone(),
            granted: false,
        };
        let (id, route) = grant.await.ok()?;
        withdraw.granted = true;
        Some(CallSlot {
            id,
            route,
            requests: self.requests.clone(),
            tokens: 0,
            pause: None,
            report: None,
        })
    }

    /// No more grants: calls still waiting get `None` and are withdrawn;
    /// calls in flight give their slots back as they end.
    pub fn close(&self) {
        let _ = self.requests.send(Request::Close);
    }

    /// Leaves the budget with every call still held (their share comes
    /// back at once, not after the lease) and stops the agent; waits at
    /// most a few seconds for the database.
    pub async fn leave(&self) {
        let (left, done) = oneshot::channel();
        if self.requests.send(Request::Leave { left }).is_ok() {
            let _ = done.await;
        }
    }
}

/// A call queued here, waiting for its grant.
struct Waiter {
    call: CallToQueue,
    granted: oneshot::Sender<(i64, Route)>,
}

/// What the agent knows of this process's calls.
#[derive(Default)]
struct Calls {
    /// Not sent to the budget yet.
    to_queue: Vec<Waiter>,
    /// In the budget, waiting, by call id.
    waiting: HashMap<i64, Waiter>,
    /// Claim (issue, claim id) to call id, for the waiting ones.
    by_claim: HashMap<(i64, i64), i64>,
    /// Granted and handed to their generation.
    running: HashSet<i64>,
    /// Ended, or never to run: to give back.
    finished: Vec<i64>,
    /// What the ended calls spent, to count to the day.
    tokens: i64,
    /// How the ended calls went on their providers.
    reports: Vec<ProviderReport>,
    /// A pause to report, the longest asked for.
    pause: Option<(Duration, String)>,
    closed: bool,
}

impl Calls {
    fn take(&mut self, request: Request) -> Option<oneshot::Sender<()>> {
        match request {
            Request::Queue { call, granted } => {
                if !self.closed {
                    self.to_queue.push(Waiter { call, granted });
                }
            }
            Request::Withdraw { claim } => {
                self.to_queue
                    .retain(|w| (w.call.issue_id, w.call.claim_id) != claim);
                if let Some(id) = self.by_claim.remove(&claim) {
                    self.waiting.remove(&id);
                    self.finished.push(id);
                }
            }
            Request::Finished {
                id,
                tokens,
                pause,
                report,
            } => {
                self.reports.extend(report);
                if self.running.remove(&id) {
                    self.finished.push(id);
                }
                // Spent whether or not the budget still knew the call.
                self.tokens = self.tokens.saturating_add(tokens);
                if let Some((wait, reason)) = pause {
                    if self
                        .pause
                        .as_ref()
                        .is_none_or(|(longest, _)| wait > *longest)
                    {
                        self.pause = Some((wait, reason));
                    }
                }
            }
            Request::Close => {
                self.closed = true;
                self.to_queue.clear();
                self.by_claim.clear();
                self.finished.extend(self.waiting.drain().map(|(id, _)| id));
            }
            Request::Leave { left } => return Some(left),
        }
        None
    }

    /// Something to tell the budget.
    fn has_news(&self) -> bool {
        !self.to_queue.is_empty()
            || !self.finished.is_empty()
            || self.tokens > 0
            || !self.reports.is_empty()
            || self.pause.is_some()
    }

    /// Holding anything in the budget: its lease must be kept.
    fn holds_any(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Takes the budget's answer to an exchange that carried `sent`.
    fn apply(&mut self, sent: Vec<Waiter>, answer: &ExchangeAnswer) {
        for (waiter, id) in sent.into_iter().zip(&answer.queued) {
            self.by_claim
                .insert((waiter.call.issue_id, waiter.call.claim_id), *id);
            self.waiting.insert(*id, waiter);
        }
        for (&id, &route) in answer.granted.iter().zip(&answer.routes) {
            if self.running.contains(&id) {
                continue;
            }
            match self.waiting.remove(&id) {
                Some(waiter) => {
                    self.by_claim
                        .remove(&(waiter.call.issue_id, waiter.call.claim_id));
                    if waiter.granted.send((id, route)).is_ok() {
                        self.running.insert(id);
                    } else {
                        self.finished.push(id);
                    }
                }
                // Not known here (its generation went away): given back.
                None => self.finished.push(id),
            }
        }
        let known = (self.waiting.len() + self.running.len() + self.finished.len()) as i64;
        if answer.holding < known {
            // This process's lease ran out (it was stalled, or the
            // database unreachable, for longer than a lease) and its calls
            // were taken back. The waiting ones queue again; those in
            // flight end unaccounted.
            tracing::warn!(
                held = answer.holding,
                known,
                "the LLM budget let this process's calls go (its lease ran out); queueing the waiting ones again"
            );
            self.running.clear();
            self.finished.clear();
            self.by_claim.clear();
            let mut requeued: Vec<(i64, Waiter)> = self.waiting.drain().collect();
            requeued.sort_by_key(|(id, _)| *id);
            self.to_queue
                .splice(0..0, requeued.into_iter().map(|(_, waiter)| waiter));
        }
    }
}

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
}

impl BudgetAgent {
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
        let pause = self.calls.pause.clone();
        let answer = {
            let client = self.pool.get().await?;
            llm_budget::exchange(
                &client,
                &Exchange {
                    holder: &self.holder,
                    instance: &self.instance,
                    lease,
                    has_fallback: self.has_fallback,
                    queue: &queue,
                    finished: &self.calls.finished,
                    tokens: self.calls.tokens,
                    reports: &self.calls.reports,
                    pause: pause
                        .as_ref()
                        .map(|(wait, reason)| (*wait, reason.as_str())),
                    leaving: false,
                },
            )
            .await?
        };
        let sent = std::mem::take(&mut self.calls.to_queue);
        self.calls.finished.clear();
        self.calls.tokens = 0;
        self.calls.reports.clear();
        self.calls.pause = None;
        self.calls.apply(sent, &answer);
        Ok(answer)
    }

    /// The last exchange: every call held here goes, and so does the
    /// holder.
    async fn leave(&mut self) {
        let left = async {
            let client = self.pool.get().await?;
            llm_budget::exchange(
                &client,
                &Exchange {
                    holder: &self.holder,
                    instance: &self.instance,
                    lease: Duration::ZERO,
                    has_fallback: self.has_fallback,
                    queue: &[],
                    finished: &[],
                    tokens: self.calls.tokens,
                    reports: &self.calls.reports,
                    pause: self
                        .calls
                        .pause
                        .as_ref()
                        .map(|(wait, reason)| (*wait, reason.as_str())),
                    leaving: true,
                },
            )
            .await
        };
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
