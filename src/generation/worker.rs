//! Generation workers: turn claimed issues into articles, exactly once each.
//!
//! Every claimed issue gets a task that heartbeats its lease while it waits
//! for an LLM slot and while the writer works. A writer that calls an LLM
//! gets its slots from the budget all instances share
//! ([`crate::generation::budget`]: `llm_max_in_flight` across the cluster,
//! `generation_concurrency` per instance, briefing before feed, a rate
//! limit's pause); any other writer from a semaphore sized by the
//! `generation_concurrency` setting, resized live when it changes. A call
//! the LLM refuses for the account's quota (429 or 503 with `Retry-After`)
//! pauses every instance's calls and fails its attempt with the attempt
//! given back: the retry after the pause does not use up `max_attempts`.
//! The outcome is recorded fenced by the claim
//! ([`crate::generation::completion`]).
//!
//! An issue that leaves `IN_PROGRESS` under its generation (cancelled with
//! `newsnack cancel` or `POST /issues/{id}/cancel`, or failed with plain
//! SQL) is abandoned as soon as the transition arrives from the listener,
//! confirmed by one read of the claim: the writer's future is dropped
//! (reqwest closes the connection, so the LLM's request ends) and with it
//! its LLM slot, given back to the budget at once. An answer that came
//! first is kept out by the claim's fence when it is recorded.
//!
//! On shutdown the generator stops taking work, lets in-flight generations
//! finish within a grace period, and releases the rest as `FAILED` with
//! reason `shutdown` (they are retried by whichever instance remains). Those
//! that never reached the writer (still queued for an LLM slot) get their
//! attempt back, so restarts do not use up issues' `max_attempts`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Notify, Semaphore, SemaphorePermit};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::claims::claim::release_claims;
use crate::db::issue::{self, ClaimedIssue};
use crate::db::{DbError, DbPool};
use crate::events::stream::TransitionStream;
use crate::generation::budget::failure::{self, Next};
use crate::generation::budget::{BudgetAgent, CallSlot, LlmBudget};
use crate::generation::completion::{record_outcome, record_unrecorded, Completer, Generated};
use crate::model::llm::{Priority, Provider};
use crate::model::status::Status;
use crate::settings::{Settings, SettingsCache};
use crate::writer::checks::ArticleChecks;
use crate::writer::{token_bound, Article, IssueText, SharedWriter, WriteError, Writer};

/// A claimed issue for the generator, with the class its LLM call waits in
/// (`None`: the class the issue was last asked for at).
type Submitted = (ClaimedIssue, Option<Priority>);

/// Hands claimed issues to the generator. Cheap to clone.
#[derive(Clone)]
pub struct GeneratorHandle {
    queue: mpsc::UnboundedSender<Submitted>,
    pool: DbPool,
    /// Claims handed in and not finished yet.
    backlog: Arc<AtomicUsize>,
}

impl GeneratorHandle {
    /// Queues claimed issues for generation. Issues handed in after the
    /// generator stopped taking work (a claim that committed while shutdown
    /// began) are released as `FAILED` with reason `shutdown` before this
    /// returns (while the pool is still open), so they do not wait out
    /// their lease. Their LLM calls wait in the class each issue was last
    /// asked for at (briefing, unless asked otherwise): for retries.
    pub async fn submit(&self, issues: Vec<ClaimedIssue>) {
        self.submit_in(issues, None).await
    }

    /// [`GeneratorHandle::submit`], the LLM calls waiting in `priority`
    /// (remembered for the issues' retries).
    pub async fn submit_at(&self, issues: Vec<ClaimedIssue>, priority: Priority) {
        self.submit_in(issues, Some(priority)).await
    }

    async fn submit_in(&self, issues: Vec<ClaimedIssue>, priority: Option<Priority>) {
        let mut refused = Vec::new();
        for issue in issues {
            self.backlog.fetch_add(1, Ordering::SeqCst);
            if let Err(mpsc::error::SendError((issue, _))) = self.queue.send((issue, priority)) {
                self.backlog.fetch_sub(1, Ordering::SeqCst);
                refused.push((issue.id, issue.claim_id));
            }
        }
        release_claims(&self.pool, refused, "shutdown", false).await;
    }

    /// Claims handed in and not finished yet (queued for a slot, being
    /// written, or being recorded).
    pub fn backlog(&self) -> usize {
        self.backlog.load(Ordering::SeqCst)
    }
}

/// The generation service of one instance.
pub struct Generator {
    pool: DbPool,
    completer: Completer,
    writer: SharedWriter,
    settings: Arc<SettingsCache>,
    settings_changed: tokio::sync::watch::Receiver<u64>,
    queue: mpsc::UnboundedReceiver<Submitted>,
    backlog: Arc<AtomicUsize>,
    /// How long in-flight generations may run on after shutdown.
    grace: Duration,
    /// The budget shared with every instance, for a writer that calls an
    /// LLM, and the agent that talks to it.
    shared: Option<(LlmBudget, BudgetAgent)>,
    /// The fallback provider's writer.
    fallback: Option<Arc<Fallback>>,
    /// Every transition, to abandon generations whose issue left
    /// `IN_PROGRESS` under them.
    transitions: Option<TransitionStream>,
}

/// Where a generation gets the right to call its writer.
#[derive(Clone)]
enum Gate {
    /// This instance's slots (`generation_concurrency`).
    Local(Arc<Slots>),
    /// The budget every instance shares.
    Shared(LlmBudget),
}

/// The right to call the writer, held while it works (given back when
/// dropped).
enum Slot<'a> {
    Local { _permit: SemaphorePermit<'a> },
    Shared(CallSlot),
}

impl Slot<'_> {
    /// What the call has spent so far, for the day's token budget (a local
    /// slot, for a writer that asks no model, counts nothing).
    fn spent(&mut self, tokens: i64) {
        if let Slot::Shared(slot) = self {
            slot.spent(tokens);
        }
    }
}

impl Gate {
    /// A slot for `claimed`; `None` once the gate is closed (shutdown).
    async fn slot(
        &self,
        claimed: &ClaimedIssue,
        priority: Option<Priority>,
        fallback_only: bool,
    ) -> Option<Slot<'_>> {
        match self {
            Gate::Local(slots) => slots
                .acquire()
                .await
                .map(|permit| Slot::Local { _permit: permit }),
            Gate::Shared(budget) => budget
                .call_slot(claimed, priority, fallback_only)
                .await
                .map(Slot::Shared),
        }
    }

    /// No slot is handed out any more; waiters get `None`.
    fn close(&self) {
        match self {
            Gate::Local(slots) => slots.close(),
            Gate::Shared(budget) => budget.close(),
        }
    }
}

impl Generator {
    pub fn new(
        pool: DbPool,
        writer: SharedWriter,
        settings: Arc<SettingsCache>,
        settings_changed: tokio::sync::watch::Receiver<u64>,
        grace: Duration,
    ) -> (Generator, GeneratorHandle) {
        let (tx, rx) = mpsc::unbounded_channel();
        let handle_pool = pool.clone();
        let backlog = Arc::new(AtomicUsize::new(0));
        (
            Generator {
                completer: Completer::start(pool.clone(), writer.name()),
                pool,
                writer,
                settings,
                settings_changed,
                queue: rx,
                backlog: backlog.clone(),
                grace,
                shared: None,
                fallback: None,
                transitions: None,
            },
            GeneratorHandle {
                queue: tx,
                pool: handle_pool,
                backlog,
            },
        )
    }

    /// Makes the generator take its writer's slots from the budget every
    /// instance shares (see [`LlmBudget::start`]).
    pub fn sharing(mut self, budget: LlmBudget, agent: BudgetAgent) -> Generator {
        self.shared = Some((budget, agent));
        self
    }

    /// Makes the generator send the calls the primary provider cannot take
    /// (down, paused) to `fallback`, for the classes `llm_fallback_for`
    /// allows. Takes effect with [`Generator::sharing`] only: the providers'
    /// state lives in the shared budget.
    pub fn falling_back_to(mut self, fallback: SharedWriter) -> Generator {
        self.fallback = Some(Arc::new(Fallback {
            completer: Completer::start(self.pool.clone(), fallback.name()),
            writer: fallback,
        }));
        self
    }

    /// Makes the generator abandon a generation whose issue leaves
    /// `IN_PROGRESS` under it, as `transitions` (every issue's, from now
    /// on) tells.
    pub fn abandoning(mut self, transitions: TransitionStream) -> Generator {
        self.transitions = Some(transitions);
        self
    }

    /// Runs until `shutdown`, then drains as described in the module docs.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let initial = self
            .settings
            .get()
            .await
            .map(|s| s.generation_concurrency)
            .unwrap_or(8)
            .max(1) as usize;
        let slots = Arc::new(Slots::new(initial));
        let (gate, agent) = match self.shared.take() {
            Some((budget, agent)) => (Gate::Shared(budget), Some(tokio::spawn(agent.run()))),
            None => (Gate::Local(slots.clone()), None),
        };
        let mut capacity = initial;
        let mut inflight: JoinSet<()> = JoinSet::new();
        let mut claims: HashMap<tokio::task::Id, InFlight> = HashMap::new();
        // The generations of each issue (one, but for a moment after a
        // claim was lost and the issue claimed here again).
        let mut by_issue: HashMap<i64, Vec<tokio::task::Id>> = HashMap::new();
        let mut exits = self
            .transitions
            .take()
            .map(|stream| watch_exits(stream, shutdown.clone()));
        let mut recent_exits = RecentExits::default();
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                Some(done) = inflight.join_next_with_id(), if !inflight.is_empty() => {
                    let id = match &done { Ok((id, _)) => *id, Err(e) => e.id() };
                    if let Some(task) = claims.remove(&id) {
                        forget_task(&mut by_issue, task.claim.0, id);
                    }
                    self.backlog.fetch_sub(1, Ordering::SeqCst);
                }
                Some((claimed, priority)) = self.queue.recv() => {
                    let attempts = claimed.attempts;
                    let in_flight = InFlight {
                        claim: (claimed.id, claimed.claim_id),
                        start: Arc::default(),
                        left_in_progress: Arc::default(),
                    };
                    let span = crate::telemetry::generation_span(
                        claimed.id,
                        attempts,
                        claimed.traceparent.as_deref(),
                    );
                    let task = inflight.spawn(tracing::Instrument::instrument(generate(
                        Generation {
                            pool: self.pool.clone(),
                            completer: self.completer.clone(),
                            writer: self.writer.clone(),
                            fallback: self.fallback.clone(),
                            settings: self.settings.clone(),
                            gate: gate.clone(),
                        },
                        claimed,
                        priority,
                        in_flight.start.clone(),
                        in_flight.left_in_progress.clone(),
                    ), span));
                    by_issue.entry(in_flight.claim.0).or_default().push(task.id());
                    // Left IN_PROGRESS before the claim reached the queue?
                    if recent_exits.seen(in_flight.claim.0, attempts) {
                        in_flight.left_in_progress.notify_one();
                    }
                    claims.insert(task.id(), in_flight);
                }
                exit = async { exits.as_mut().expect("guarded").recv().await }, if exits.is_some() => match exit {
                    Some((issue_id, attempts)) => {
                        recent_exits.remember(issue_id, attempts);
                        for task in by_issue.get(&issue_id).into_iter().flatten() {
                            if let Some(task) = claims.get(task) {
                                task.left_in_progress.notify_one();
                            }
                        }
                    }
                    // The stream ended (shutdown): the heartbeat still finds
                    // lost claims.
                    None => exits = None,
                },
                // The budget reads `generation_concurrency` itself.
                Ok(()) = self.settings_changed.changed(), if agent.is_none() => {
                    if let Ok(settings) = self.settings.get().await {
                        capacity = slots.resize(capacity, settings.generation_concurrency.max(1) as usize);
                    }
                }
            }
        }
        self.drain(&gate, inflight, claims).await;
        if let (Gate::Shared(budget), Some(agent)) = (&gate, agent) {
            budget.leave().await;
            let _ = agent.await;
        }
    }

    async fn drain(
        mut self,
        gate: &Gate,
        mut inflight: JoinSet<()>,
        mut claims: HashMap<tokio::task::Id, InFlight>,
    ) {
        // Generations that have not begun never will: they are released
        // at once, with their attempt, and their tasks end without a slot.
        gate.close();
        self.queue.close();
        let mut unstarted = Vec::new();
        while let Ok((queued, _)) = self.queue.try_recv() {
            unstarted.push((queued.id, queued.claim_id));
        }
        claims.retain(|_, task| {
            let withdrawn = task.start.withdraw();
            if withdrawn {
                unstarted.push(task.claim);
            }
            !withdrawn
        });
        // The others may finish within the grace period, which counts from
        // now.
        let deadline = tokio::time::sleep(self.grace);
        tokio::pin!(deadline);
        release_claims(&self.pool, unstarted, "shutdown", false).await;
        while !inflight.is_empty() {
            tokio::select! {
                _ = &mut deadline => break,
                Some(done) = inflight.join_next_with_id() => {
                    let id = match &done { Ok((id, _)) => *id, Err(e) => e.id() };
                    claims.remove(&id);
                }
            }
        }
        inflight.abort_all();
        while inflight.join_next().await.is_some() {}
        let cut_short = claims.into_values().map(|task| task.claim).collect();
        release_claims(&self.pool, cut_short, "shutdown", true).await;
    }
}

/// A generation task's claim, whether it has begun, and how it learns that
/// its issue left `IN_PROGRESS`.
struct InFlight {
    claim: (i64, i64),
    start: Arc<Start>,
    left_in_progress: Arc<Notify>,
}

/// Follows `transitions` on a task of its own and passes on only the
/// issues that left `IN_PROGRESS` for `FAILED` (issue, attempts): the
/// generator's loop is not woken for the many transitions that cannot
/// cancel anything, and the stream is read as fast as the listener
/// publishes, so it never falls behind and has to read the log. Ends with
/// `shutdown` or the listener.
fn watch_exits(
    mut transitions: TransitionStream,
    shutdown: CancellationToken,
) -> mpsc::UnboundedReceiver<(i64, i32)> {
    let (exits, exited) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                next = transitions.next_through_outages() => next,
            };
            match next {
                Ok(t) if t.from == Some(Status::InProgress) && t.to == Status::Failed => {
                    if exits.send((t.issue_id, t.attempts)).is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "generator lost its transition stream");
                    return;
                }
            }
        }
    });
    exited
}

/// The last transitions out of `IN_PROGRESS` seen (issue, attempts as of
/// it), for a claim that reaches the generator after its issue left
/// `IN_PROGRESS` again (cancelled at once).
#[derive(Default)]
struct RecentExits(std::collections::VecDeque<(i64, i32)>);

impl RecentExits {
    /// How many are remembered.
    const KEPT: usize = 4096;

    fn remember(&mut self, issue: i64, attempts: i32) {
        if self.0.len() == Self::KEPT {
            self.0.pop_front();
        }
        self.0.push_back((issue, attempts));
    }

    /// Whether the claim of `issue` that made `attempts` may have ended.
    fn seen(&self, issue: i64, attempts: i32) -> bool {
        self.0.contains(&(issue, attempts))
    }
}

/// Takes task `task` of issue `issue` out of the index.
fn forget_task(
    by_issue: &mut HashMap<i64, Vec<tokio::task::Id>>,
    issue: i64,
    task: tokio::task::Id,
) {
    if let Some(tasks) = by_issue.get_mut(&issue) {
        tasks.retain(|t| *t != task);
        if tasks.is_empty() {
            by_issue.remove(&issue);
        }
    }
}

/// Whether a generation has begun its writer call: decided once, by the
/// task as it begins or by shutdown withdrawing it first, so a claim is
/// never both released unstarted and written.
#[derive(Default)]
struct Start(AtomicU8);

impl Start {
    const WAITING: u8 = 0;
    const BEGUN: u8 = 1;
    const WITHDRAWN: u8 = 2;

    /// The task may begin; false once it was withdrawn.
    fn begin(&self) -> bool {
        self.0
            .compare_exchange(
                Self::WAITING,
                Self::BEGUN,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
    }

    /// True if the task had not begun and now never will.
    fn withdraw(&self) -> bool {
        self.0
            .compare_exchange(
                Self::WAITING,
                Self::WITHDRAWN,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
    }
}

/// The LLM call slots, sized by the `generation_concurrency` setting.
///
/// Shrinking takes effect at the next call to start, however many are
/// queued: a waiter handed a permit while the slots are over size retires
/// it and waits again. (Taking the surplus out with one more waiter would
/// not: the semaphore serves waiters in order, so it would get the permits
/// only after every call queued before it.)
struct Slots {
    permits: Semaphore,
    /// Permits still to retire as they are handed out.
    surplus: AtomicUsize,
}

impl Slots {
    fn new(capacity: usize) -> Slots {
        Slots {
            permits: Semaphore::new(capacity),
            surplus: AtomicUsize::new(0),
        }
    }

    /// A slot; `None` once the slots are closed (shutdown).
    async fn acquire(&self) -> Option<SemaphorePermit<'_>> {
        loop {
            let permit = self.permits.acquire().await.ok()?;
            let retired = self
                .surplus
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if !retired {
                return Some(permit);
            }
            permit.forget();
        }
    }

    /// No slot is handed out any more; waiters get `None`.
    fn close(&self) {
        self.permits.close();
    }

    /// Grows or shrinks the slots from `current` to `wanted`; returns the
    /// new capacity.
    fn resize(&self, current: usize, wanted: usize) -> usize {
        if wanted > current {
            // Surplus not yet retired is kept instead of adding permits.
            let grow = wanted - current;
            let mut kept = 0;
            let _ = self
                .surplus
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    kept = n.min(grow);
                    Some(n - kept)
                });
            self.permits.add_permits(grow - kept);
        } else if wanted < current {
            self.surplus.fetch_add(current - wanted, Ordering::SeqCst);
        }
        if wanted != current {
            tracing::info!(
                from = current,
                to = wanted,
                "generation concurrency changed"
            );
        }
        wanted
    }
}

/// What every generation of an instance works with.
struct Generation {
    pool: DbPool,
    completer: Completer,
    writer: SharedWriter,
    fallback: Option<Arc<Fallback>>,
    settings: Arc<SettingsCache>,
    gate: Gate,
}

/// The fallback provider's writer, and the completer that records its
/// articles under its name.
struct Fallback {
    writer: SharedWriter,
    completer: Completer,
}

/// One issue, start to finish. Heartbeats the lease until the outcome is
/// written; gives up at once if the claim is lost, found by a heartbeat or
/// announced by a transition out of `IN_PROGRESS` (`left_in_progress`).
async fn generate(
    generation: Generation,
    claimed: ClaimedIssue,
    priority: Option<Priority>,
    start: Arc<Start>,
    left_in_progress: Arc<Notify>,
) {
    let _in_flight = crate::metrics::generation_started();
    let known = generation.settings.get().await.ok();
    let lease = known.as_ref().map_or(claimed.lease, |s| s.lease());
    let answered = AtomicBool::new(false);
    let work = async {
        let mut fallback_only = false;
        let (result, quota_pause, provider) = loop {
            let Some(slot) = generation
                .gate
                .slot(&claimed, priority, fallback_only)
                .await
            else {
                return Ok(Generated::NotStarted);
            };
            if !fallback_only && !start.begin() {
                return Ok(Generated::NotStarted);
            }
            match call_writer(&generation, &claimed, slot, known.clone()).await {
                // The primary failed and the call may go to the fallback:
                // at once, in the same claim, its attempt unspent.
                Called::SwitchToFallback => fallback_only = true,
                Called::Answered {
                    result,
                    quota_pause,
                    provider,
                } => break (result, quota_pause, provider),
            }
        };
        answered.store(true, Ordering::Relaxed);
        let completer = match (&generation.fallback, provider) {
            (Some(fallback), Provider::Fallback) => &fallback.completer,
            _ => &generation.completer,
        };
        record_outcome(
            &generation.pool,
            completer,
            &claimed,
            lease,
            result,
            quota_pause,
        )
        .await
    };
    tokio::pin!(work);
    let heartbeat = heartbeat_until_lost(&generation.pool, &claimed, lease);
    tokio::pin!(heartbeat);
    // The heartbeat keeps the lease until the outcome is recorded. A lost
    // claim stops the writer; but once the writer has answered, the fenced
    // recording says what happened: a heartbeat that ran into that very
    // commit must not report a written article as lost.
    let outcome = loop {
        tokio::select! {
            biased;
            outcome = &mut work => break outcome,
            lost = &mut heartbeat => {
                if answered.load(Ordering::Relaxed) {
                    break work.await;
                }
                break lost;
            }
            () = left_in_progress.notified(), if !answered.load(Ordering::Relaxed) => {
                // A transition out of IN_PROGRESS of this issue: this
                // claim's end, unless it was an earlier claim's, announced
                // late. The claim itself says which.
                if !claim_current(&generation.pool, &claimed).await {
                    crate::metrics::generation_cancelled();
                    break Ok(Generated::Abandoned);
                }
            }
        }
    };
    if let Err(e) = &outcome {
        // Say why at once rather than wait out the lease.
        tracing::error!(issue = claimed.id, error = %e, "could not record the outcome");
        record_unrecorded(&generation.pool, &claimed, lease, e).await;
    }
    log_outcome(&claimed, &outcome);
}

/// How a call of the writer ended.
enum Called {
    /// With this result, from this provider; with the pause the LLM asked
    /// every instance to keep.
    Answered {
        result: Result<Article, WriteError>,
        quota_pause: Option<Duration>,
        provider: Provider,
    },
    /// The primary is down for this call, which may go to the fallback.
    SwitchToFallback,
}

/// Calls the writer of the provider `slot` was granted on, for `claimed`,
/// with the prompts as the settings say now (a change reaches the next
/// call; `known`, read before the wait, stands in should the database be
/// out of reach). What follows a failure is what the budget said when it
/// granted the call ([`failure::after_call`]).
async fn call_writer(
    generation: &Generation,
    claimed: &ClaimedIssue,
    mut slot: Slot<'_>,
    known: Option<Arc<Settings>>,
) -> Called {
    let now = generation.settings.get().await.ok().or(known);
    let defaults = Settings::default();
    let settings = now.as_deref().unwrap_or(&defaults);
    let provider = match &slot {
        Slot::Shared(slot) => slot.route().provider,
        Slot::Local { .. } => Provider::Primary,
    };
    let writer = match (&generation.fallback, provider) {
        (Some(fallback), Provider::Fallback) => &fallback.writer,
        _ => &generation.writer,
    };
    let started = std::time::Instant::now();
    let result = write_checked(
        &**writer,
        provider,
        IssueText::new(claimed, settings.prompts()),
        &settings.article_checks(),
        &mut slot,
    )
    .await;
    tracing::debug!(issue = claimed.id, provider = provider.as_str(), elapsed = ?started.elapsed(), ok = result.is_ok(), "writer answered");
    // The slot bounds LLM calls only: it is given back here, before the
    // outcome waits for its batch.
    let Slot::Shared(slot) = slot else {
        return Called::Answered {
            result,
            quota_pause: None,
            provider,
        };
    };
    let after = failure::after_call(slot.route(), generation.fallback.is_some(), &result);
    if let (Some((pause, _)), Err(e)) = (&after.pause_primary, &result) {
        tracing::warn!(issue = claimed.id, pause_s = pause.as_secs_f64(), reason = %e, "the LLM asked every caller to wait: pausing the primary's calls on every instance");
    }
    slot.give_back(after.report, after.pause_primary);
    match after.next {
        Next::AskFallback => {
            if let Err(e) = &result {
                tracing::warn!(issue = claimed.id, reason = %e, "the primary LLM failed the call; asking the fallback");
            }
            Called::SwitchToFallback
        }
        Next::Record { quota_pause } => Called::Answered {
            result,
            quota_pause,
            provider,
        },
    }
}

/// Writes `issue`'s article and checks it (see [`crate::writer::checks`]):
/// an answer that fails a check is asked for again once, with the reason;
/// a second failure is [`WriteError::InvalidArticle`]. The article stored
/// counts the tokens of both calls; `slot` is told what the calls spent as
/// they go, so a call dropped midway still counts its prompt.
async fn write_checked(
    writer: &dyn Writer,
    provider: Provider,
    issue: IssueText<'_>,
    checks: &ArticleChecks,
    slot: &mut Slot<'_>,
) -> Result<Article, WriteError> {
    let prompt = issue.prompt_token_bound();
    slot.spent(prompt);
    let first = timed(provider, writer.write(issue)).await;
    let mut spent = tokens_spent(&first, prompt);
    slot.spent(spent);
    let first = first?;
    let rejection = match checks.check(&first) {
        Ok(article) => return Ok(article),
        Err(rejection) => rejection,
    };
    crate::metrics::article_rejected(rejection.check.as_str());
    tracing::info!(issue = issue.id, %rejection, "answer rejected; asking again");
    let problem = rejection.request_again();
    let prompt = prompt + token_bound(&[&first.answer, &problem]);
    slot.spent(spent + prompt);
    let second = timed(provider, writer.write_again(issue, &first, &problem)).await;
    spent += tokens_spent(&second, prompt);
    slot.spent(spent);
    let second = second?;
    match checks.check(&second) {
        Ok(article) => Ok(Article {
            usage: first.usage.plus(second.usage),
            ..article
        }),
        Err(rejection) => {
            crate::metrics::article_rejected(rejection.check.as_str());
            Err(WriteError::InvalidArticle(rejection))
        }
    }
}

/// The tokens one call spent, for the day's budget: what the API reported,
/// and where it reported nothing, the bound of the prompt sent (`prompt`)
/// and of the answer (see [`token_bound`]); a call refused before the model
/// ran costs nothing.
fn tokens_spent(result: &Result<Article, WriteError>, prompt: i64) -> i64 {
    match result {
        Ok(article) => {
            let reported = |count: Option<i32>| count.map(i64::from);
            reported(article.usage.prompt_tokens).unwrap_or(prompt)
                + reported(article.usage.completion_tokens)
                    .unwrap_or_else(|| token_bound(&[&article.answer]))
        }
        Err(e) if e.kind().may_have_billed() => prompt,
        Err(_) => 0,
    }
}

/// One writer call, counted in the LLM metrics, as `provider`'s.
async fn timed(
    provider: Provider,
    call: impl std::future::Future<Output = Result<Article, WriteError>>,
) -> Result<Article, WriteError> {
    let started = std::time::Instant::now();
    let result = call.await;
    crate::metrics::llm_call_finished(
        provider,
        started.elapsed(),
        result.as_ref().err().map(|e| e.kind().as_str()),
    );
    if let Ok(article) = &result {
        crate::metrics::llm_tokens(article.usage);
    }
    result
}

/// One log line for how `claimed`'s generation ended.
fn log_outcome(claimed: &ClaimedIssue, outcome: &Result<Generated, DbError>) {
    match outcome {
        Ok(Generated::Done) => tracing::info!(
            issue = claimed.id,
            attempt = claimed.attempts,
            "article written"
        ),
        Ok(Generated::Failed { reason, retryable }) => {
            tracing::warn!(issue = claimed.id, attempt = claimed.attempts, retryable, %reason, "generation failed")
        }
        Ok(Generated::NotStarted) => {
            tracing::debug!(
                issue = claimed.id,
                "shutting down before the generation began"
            )
        }
        Ok(Generated::Abandoned) => {
            tracing::info!(
                issue = claimed.id,
                claim = claimed.claim_id,
                "the issue left IN_PROGRESS (cancelled?); its LLM call was dropped"
            )
        }
        Ok(Generated::ClaimLost) => {
            tracing::warn!(
                issue = claimed.id,
                claim = claimed.claim_id,
                "claim lost; result discarded"
            )
        }
        Err(_) => {}
    }
}

/// Whether `claimed`'s claim is still current; true when that cannot be
/// read (the heartbeat settles it then).
async fn claim_current(pool: &DbPool, claimed: &ClaimedIssue) -> bool {
    let read = async {
        let client = pool.get().await?;
        issue::claim_current(&pool.session(&client), claimed.id, claimed.claim_id).await
    };
    match read.await {
        Ok(current) => current,
        Err(e) => {
            tracing::warn!(issue = claimed.id, error = %e, "cannot read whether the claim is current; the heartbeat will tell");
            true
        }
    }
}

/// Extends the lease to `lease` every third of its length; returns when
/// the claim is no longer current. The first beat comes within a third of
/// the shorter of `lease` and the lease the claim was taken with: `lease_s`
/// may have grown since the claim, which must not run out before its
/// first beat. A failed beat (a database hiccup) is tried again soon, from
/// a quarter of a second doubling up to the usual interval, so a short
/// outage does not let a healthy generation's lease run out.
async fn heartbeat_until_lost(
    pool: &DbPool,
    claimed: &ClaimedIssue,
    lease: Duration,
) -> Result<Generated, DbError> {
    let third = |lease: Duration| (lease / 3).max(Duration::from_millis(100));
    let every = third(lease);
    let first_retry = Duration::from_millis(250).min(every);
    let (mut next, mut retry) = (third(lease.min(claimed.lease)), first_retry);
    loop {
        tokio::time::sleep(next).await;
        let beat = async {
            let client = pool.get().await?;
            issue::heartbeat(&pool.session(&client), claimed.id, claimed.claim_id, lease).await
        };
        match beat.await {
            Ok(true) => (next, retry) = (every, first_retry),
            Ok(false) => return Ok(Generated::ClaimLost),
            Err(e) => {
                tracing::warn!(issue = claimed.id, error = %e, retry_in = ?retry, "heartbeat failed; will try again");
                next = retry;
                retry = (retry * 2).min(every);
            }
        }
    }
}
