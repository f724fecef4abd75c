//! A generation's side of the budget: [`LlmBudget`] queues a call and waits
//! for its grant; the grant is a [`CallSlot`], held while the LLM answers
//! and given back, with what the call spent and how its provider did, when
//! it is dropped.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::agent::BudgetAgent;
use super::calls::{Delays, Request, WaitDelays};
use crate::db::issue::ClaimedIssue;
use crate::db::llm_budget::{CallToQueue, ProviderOutcome, ProviderReport, Route};
use crate::db::DbPool;
use crate::events::hub::EventHub;
use crate::model::llm::Priority;
use crate::settings::SettingsCache;

/// The side of the budget generations use. Cheap to clone.
#[derive(Clone)]
pub struct LlmBudget {
    requests: mpsc::UnboundedSender<Request>,
    delays: Arc<Delays>,
}

/// A granted call: hold it while the LLM answers. Dropping it gives the
/// slot back with the tokens it spent; [`CallSlot::give_back`] also says
/// how the call went.
pub struct CallSlot {
    id: i64,
    route: Route,
    requests: mpsc::UnboundedSender<Request>,
    tokens: i64,
    pause: Option<(Duration, String)>,
    report: Option<ProviderOutcome>,
    delays: WaitDelays,
}

impl CallSlot {
    /// What held the call back while it waited for this grant.
    pub fn delays(&self) -> WaitDelays {
        self.delays
    }

    /// The provider the call goes to, its class, and what a failure of it
    /// means.
    pub fn route(&self) -> Route {
        self.route
    }

    /// What the call has spent so far, in tokens: counted to the day's
    /// budget when the slot goes back (a call dropped midway counts what
    /// was set last).
    pub fn spent(&mut self, tokens: i64) {
        self.tokens = tokens.max(0);
    }

    /// Gives the slot back with what the call's end means for every
    /// instance (see [`super::failure`]): how its provider did, for the
    /// providers' circuits, and a pause of the primary's calls (the LLM
    /// answered 429 or 503 with `Retry-After`), with its reason.
    pub fn give_back(mut self, report: Option<ProviderOutcome>, pause: Option<(Duration, String)>) {
        self.report = report;
        self.pause = pause;
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
        let delays = Arc::new(Delays::default());
        let agent = BudgetAgent::new(
            pool,
            hub,
            settings,
            instance,
            has_fallback,
            inbox,
            delays.clone(),
        );
        (LlmBudget { requests, delays }, agent)
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
        let before = self.delays.seen();
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
            delays: WaitDelays::between(before, self.delays.seen(), route.priority),
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
