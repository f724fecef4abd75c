//! The generation service of one instance: takes claimed issues, runs a
//! worker task for each ([`super::generate`]), abandons those whose issue
//! leaves `IN_PROGRESS`, and drains on shutdown (see the folder's docs).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::gate::{Gate, Slots};
use super::{generate, Fallback, Generation, Start};
use crate::claims::claim::release_claims;
use crate::db::issue::{self, ClaimedIssue};
use crate::db::DbPool;
use crate::events::stream::TransitionStream;
use crate::generation::budget::{BudgetAgent, LlmBudget};
use crate::generation::completion::Completer;
use crate::model::llm::Priority;
use crate::model::status::Status;
use crate::settings::SettingsCache;
use crate::writer::SharedWriter;

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
                    let generation = Generation {
                        pool: self.pool.clone(),
                        completer: self.completer.clone(),
                        writer: self.writer.clone(),
                        fallback: self.fallback.clone(),
                        settings: self.settings.clone(),
                        gate: gate.clone(),
                    };
                    let (start, left) = (in_flight.start.clone(), in_flight.left_in_progress.clone());
                    let task = inflight.spawn(async move {
                        let span = generation_span(&generation.pool, &claimed).await;
                        let work = generate(generation, claimed, priority, start, left);
                        tracing::Instrument::instrument(work, span).await
                    });
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

/// The span `claimed`'s generation runs in
/// ([`crate::telemetry::generation_span`]); for a retry, linked to the
/// earlier attempt's context, read from the log.
async fn generation_span(pool: &DbPool, claimed: &ClaimedIssue) -> tracing::Span {
    if !crate::telemetry::exporting() {
        return tracing::Span::none();
    }
    let mut earlier = None;
    if claimed.retry {
        let read = async {
            let client = pool.get().await?;
            issue::earlier_traceparent(&pool.session(&client), claimed.id, claimed.claim_id).await
        };
        match read.await {
            Ok(traceparent) => earlier = traceparent,
            Err(e) => {
                tracing::warn!(issue = claimed.id, error = %e, "cannot read the earlier attempt's trace context; the retry's trace is not linked to it")
            }
        }
    }
    crate::telemetry::generation_span(
        claimed.id,
        claimed.attempts,
        claimed.retry,
        claimed.traceparent.as_deref(),
        earlier.as_deref(),
    )
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
