//! The audit every fault case ends with. Once the system has settled, it
//! checks, from the database alone:
//!
//! * every issue is `DONE` with exactly one `ai_article` (written under its
//!   final claim), or `FAILED` with a non-empty reason and no automatic
//!   retry left;
//! * no issue is `IN_PROGRESS` past its lease;
//! * no issue has two articles, and no article belongs to an issue that is
//!   not `DONE`;
//! * every issue's log is one legal chain from its first `PENDING` to its
//!   current status;
//! * every subscriber saw every logged transition after its start exactly
//!   once, in `seq` order;
//! * every wait was answered, with the outcome the rules give when they are
//!   replayed over the log: `all_pass` at the transition that made every
//!   target `DONE`; the `timeout_pass`/`skip` rule at the transition that
//!   left no target able to change, or else at the deadline.
//!
//! Where a wait's start or deadline falls too close to a transition to say
//! on which side it was, the audit accepts either outcome and counts the
//! wait as not strictly checked.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use newsnack::db::DbPool;
use newsnack::events::hub::EventHub;
use serde_json::Value;
use time::OffsetDateTime;

use super::subscribers::Recording;

/// How close to a wait's start or deadline a transition may be before the
/// side it fell on is taken as unknown; also how long a wait may take to
/// arm after it was sent, or its answer to come back.
const CLOCK_MARGIN: Duration = Duration::from_millis(300);
/// The longest a wait may take to answer after it was decided.
const MAX_ANSWER_DELAY: Duration = Duration::from_secs(10);
/// How long subscribers get to catch up with the log.
const CATCH_UP_SECS: u64 = 30;
/// At most this many ids are named per problem.
const SHOWN_IDS: usize = 10;

/// What a wait asked for, as `POST /waits` takes it.
#[derive(Debug, Clone)]
pub struct WaitSpec {
    pub issue_ids: Vec<i64>,
    pub timeout: Duration,
    pub min_completion: usize,
    /// The `max_attempts` setting while the wait ran.
    pub max_attempts: i32,
}

/// One wait: what was asked, when, and the answer.
#[derive(Debug, Clone)]
pub struct WaitRecord {
    pub spec: WaitSpec,
    pub sent_at: OffsetDateTime,
    pub answered_at: OffsetDateTime,
    /// The 200 answer, or what went wrong instead.
    pub answer: Result<Value, String>,
}

/// Sends `POST {base}/waits` for `spec` and records the exchange.
pub async fn post_wait(http: reqwest::Client, base: String, spec: WaitSpec) -> WaitRecord {
    let sent_at = OffsetDateTime::now_utc();
    let response = http
        .post(format!("{base}/waits"))
        .json(&serde_json::json!({
            "issue_ids": spec.issue_ids,
            "timeout_s": spec.timeout.as_secs_f64(),
            "min_completion": spec.min_completion,
        }))
        .send()
        .await;
    let answer = match response {
        Ok(r) if r.status() == 200 => r.json::<Value>().await.map_err(|e| e.to_string()),
        Ok(r) => Err(format!(
            "HTTP {}: {}",
            r.status(),
            r.text().await.unwrap_or_default()
        )),
        Err(e) => Err(e.to_string()),
    };
    WaitRecord {
        spec,
        sent_at,
        answered_at: OffsetDateTime::now_utc(),
        answer,
    }
}

/// The smart-wait outcomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    AllPass,
    TimeoutPass,
    Skip,
}

impl Outcome {
    fn parse(text: &str) -> Option<Outcome> {
        match text {
            "all_pass" => Some(Outcome::AllPass),
            "timeout_pass" => Some(Outcome::TimeoutPass),
            "skip" => Some(Outcome::Skip),
            _ => None,
        }
    }

    /// The rule at the deadline, or once nothing can change.
    fn by_count(done: usize, min_completion: usize) -> Outcome {
        if done >= min_completion {
            Outcome::TimeoutPass
        } else {
            Outcome::Skip
        }
    }
}

/// The audit's view of one answered wait.
#[derive(Debug, Clone)]
pub struct WaitVerdict {
    pub outcome: Outcome,
    /// From the commit of the deciding transition (or the deadline) to the
    /// answer.
    pub latency: Duration,
    /// True when the log left only one possible outcome.
    pub strict: bool,
}

/// What the audit found.
#[derive(Debug, Default)]
pub struct AuditReport {
    /// Everything wrong, one line each; empty when the run was clean.
    pub problems: Vec<String>,
    pub issues: i64,
    pub done: i64,
    pub failed: i64,
    pub transitions: i64,
    pub waits: Vec<WaitVerdict>,
}

impl AuditReport {
    /// Fails the test with every problem found.
    pub fn assert_clean(&self) {
        assert!(
            self.problems.is_empty(),
            "the audit found {} problem(s):\n  {}",
            self.problems.len(),
            self.problems.join("\n  ")
        );
    }

    /// True when some problem mentions `needle`.
    pub fn found(&self, needle: &str) -> bool {
        self.problems.iter().any(|p| p.contains(needle))
    }

    /// The problems as JSON, for reports.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "clean": self.problems.is_empty(),
            "problems": self.problems,
            "issues": self.issues,
            "done": self.done,
            "failed": self.failed,
            "transitions": self.transitions,
            "waits": self.waits.len(),
            "waits_strictly_checked": self.waits.iter().filter(|w| w.strict).count(),
        })
    }
}

/// The audit of one database.
pub struct Audit {
    pub pool: DbPool,
    /// Any listener on the database: the audit re-checks whether the system
    /// has settled whenever a transition is announced.
    pub hub: EventHub,
    /// How long the system gets to settle before the audit checks anyway.
    pub settle_secs: u64,
}

/// No issue can still change without an operator: nothing `PENDING` or
/// `IN_PROGRESS`, and every `FAILED` one fatal or out of attempts.
const SETTLED: &str = "SELECT NOT EXISTS (
    SELECT 1 FROM issue
     WHERE processing_status IN ('PENDING', 'IN_PROGRESS')
        OR (processing_status = 'FAILED'
            AND attempts < (SELECT value::integer FROM setting WHERE key = 'max_attempts')
            AND retry_not_before IS DISTINCT FROM 'infinity'))";

impl Audit {
    /// Waits for the system to settle, then checks everything listed in
    /// the module docs.
    pub async fn run(&self, subscribers: &[&Recording], waits: &[WaitRecord]) -> AuditReport {
        let mut report = AuditReport::default();
        if !self.settled_within().await {
            report.problems.push(format!(
                "the system did not settle within {}s",
                self.settle_secs
            ));
        }
        self.check_final_states(&mut report).await;
        self.check_log_chains(&mut report).await;
        self.check_subscribers(&mut report, subscribers).await;
        self.check_waits(&mut report, waits).await;
        report
    }

    async fn settled_within(&self) -> bool {
        let mut live = self.hub.subscribe();
        let settled = async {
            loop {
                if self.query_bool(SETTLED).await {
                    return;
                }
                // Re-check on the next transition (or a lag notice).
                let _ = live.recv().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(self.settle_secs), settled)
            .await
            .is_ok()
    }

    async fn query_bool(&self, sql: &str) -> bool {
        match self.pool.get().await {
            Ok(client) => client.query_one(sql, &[]).await.is_ok_and(|row| row.get(0)),
            Err(_) => false,
        }
    }

    /// Ids returned by `sql` (first column), as a problem if there are any.
    async fn expect_none(&self, report: &mut AuditReport, what: &str, sql: &str) {
        let client = self.pool.get().await.expect("a connection for the audit");
        let rows = client
            .query(sql, &[])
            .await
            .unwrap_or_else(|e| panic!("audit query for {what}: {e}"));
        if rows.is_empty() {
            return;
        }
        let shown: Vec<String> = rows
            .iter()
            .take(SHOWN_IDS)
            .map(|r| r.get::<_, String>(0))
            .collect();
        report.problems.push(format!(
            "{} {what}: {}{}",
            rows.len(),
            shown.join(", "),
            if rows.len() > SHOWN_IDS { ", …" } else { "" }
        ));
    }

    async fn check_final_states(&self, report: &mut AuditReport) {
        {
            let client = self.pool.get().await.expect("a connection for the audit");
            let row = client
                .query_one(
                    "SELECT count(*),
                            count(*) FILTER (WHERE processing_status = 'DONE'),
                            count(*) FILTER (WHERE processing_status = 'FAILED'),
                            (SELECT count(*) FROM issue_transition)
                       FROM issue",
                    &[],
                )
                .await
                .expect("count issues");
            report.issues = row.get(0);
            report.done = row.get(1);
            report.failed = row.get(2);
            report.transitions = row.get(3);
        }
        let checks = [
            (
                "issue(s) neither DONE nor FAILED",
                "SELECT format('issue %s is %s (attempts %s)', id, processing_status, attempts)
                   FROM issue WHERE processing_status NOT IN ('DONE', 'FAILED') ORDER BY id",
            ),
            (
                "issue(s) FAILED with a retry still due",
                "SELECT format('issue %s (attempts %s, %s)', id, attempts, last_error)
                   FROM issue
                  WHERE processing_status = 'FAILED'
                    AND attempts < (SELECT value::integer FROM setting WHERE key = 'max_attempts')
                    AND retry_not_before IS DISTINCT FROM 'infinity'
                  ORDER BY id",
            ),
            (
                "issue(s) IN_PROGRESS past their lease",
                "SELECT format('issue %s held by %s, lease ended %s ago', id, claimed_by,
                               date_trunc('second', now() - lease_until))
                   FROM issue WHERE processing_status = 'IN_PROGRESS' AND lease_until < now()
                  ORDER BY id",
            ),
            (
                "DONE issue(s) without an article",
                "SELECT format('issue %s', id) FROM issue i
                  WHERE processing_status = 'DONE'
                    AND NOT EXISTS (SELECT 1 FROM ai_article a WHERE a.issue_id = i.id)
                  ORDER BY id",
            ),
            (
                "issue(s) with more than one article",
                "SELECT format('issue %s has %s', issue_id, count(*)) FROM ai_article
                  GROUP BY issue_id HAVING count(*) > 1 ORDER BY issue_id",
            ),
            (
                "article(s) of issues that are not DONE",
                "SELECT format('issue %s is %s', i.id, i.processing_status)
                   FROM ai_article a JOIN issue i ON i.id = a.issue_id
                  WHERE i.processing_status <> 'DONE' ORDER BY i.id",
            ),
            (
                "article(s) written under a claim that is not the issue's last",
                "SELECT format('issue %s: article claim %s, last claim %s', i.id, a.claim_id, i.claim_id)
                   FROM ai_article a JOIN issue i ON i.id = a.issue_id
                  WHERE a.claim_id IS DISTINCT FROM i.claim_id ORDER BY i.id",
            ),
            (
                "FAILED issue(s) without a reason",
                "SELECT format('issue %s', id) FROM issue
                  WHERE processing_status = 'FAILED' AND coalesce(btrim(last_error), '') = ''
                  ORDER BY id",
            ),
        ];
        for (what, sql) in checks {
            self.expect_none(report, what, sql).await;
        }
    }

    async fn check_log_chains(&self, report: &mut AuditReport) {
        let checks = [
            (
                "logged transition(s) that do not follow the previous one",
                "SELECT format('seq %s: issue %s %s -> %s after %s', seq, issue_id,
                               coalesce(from_status, 'new'), to_status, coalesce(previous, 'nothing'))
                   FROM (SELECT *, lag(to_status) OVER (PARTITION BY issue_id ORDER BY seq) AS previous
                           FROM issue_transition) t
                  WHERE CASE WHEN previous IS NULL
                             THEN from_status IS NOT NULL OR to_status <> 'PENDING'
                             ELSE from_status IS DISTINCT FROM previous END
                  ORDER BY seq",
            ),
            (
                "issue(s) whose status is not the last one logged",
                "SELECT format('issue %s is %s, last logged %s', i.id, i.processing_status,
                               coalesce(last.to_status, 'nothing'))
                   FROM issue i
                   LEFT JOIN LATERAL (SELECT to_status FROM issue_transition t
                                       WHERE t.issue_id = i.id ORDER BY seq DESC LIMIT 1) last ON true
                  WHERE last.to_status IS DISTINCT FROM i.processing_status ORDER BY i.id",
            ),
            (
                "issue(s) logged DONE more than once",
                "SELECT format('issue %s', issue_id) FROM issue_transition WHERE to_status = 'DONE'
                  GROUP BY issue_id HAVING count(*) > 1 ORDER BY issue_id",
            ),
        ];
        for (what, sql) in checks {
            self.expect_none(report, what, sql).await;
        }
    }

    async fn check_subscribers(&self, report: &mut AuditReport, subscribers: &[&Recording]) {
        let client = self.pool.get().await.expect("a connection for the audit");
        let logged: Vec<i64> = client
            .query("SELECT seq FROM issue_transition ORDER BY seq", &[])
            .await
            .expect("read the log")
            .iter()
            .map(|r| r.get(0))
            .collect();
        drop(client);
        let newest = logged.last().copied().unwrap_or(0);
        for subscriber in subscribers {
            if !subscriber.reaches(newest, CATCH_UP_SECS).await {
                report.problems.push(format!(
                    "subscriber {} did not reach seq {newest} within {CATCH_UP_SECS}s",
                    subscriber.name
                ));
            }
            let expected: Vec<i64> = logged
                .iter()
                .copied()
                .filter(|&seq| seq > subscriber.after_seq)
                .collect();
            report.problems.extend(
                compare_sequences(&expected, &subscriber.seen())
                    .into_iter()
                    .map(|p| format!("subscriber {}: {p}", subscriber.name)),
            );
        }
    }

    async fn check_waits(&self, report: &mut AuditReport, waits: &[WaitRecord]) {
        let targets: Vec<i64> = waits
            .iter()
            .flat_map(|w| w.spec.issue_ids.iter().copied())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let client = self.pool.get().await.expect("a connection for the audit");
        let log: Vec<LoggedTransition> = client
            .query(
                "SELECT issue_id, to_status, at, attempts, fatal FROM issue_transition
                  WHERE issue_id = ANY($1) ORDER BY seq",
                &[&targets],
            )
            .await
            .expect("read the targets' log")
            .iter()
            .map(|r| LoggedTransition {
                issue_id: r.get(0),
                to: r.get(1),
                at: r.get(2),
                attempts: r.get(3),
                fatal: r.get(4),
            })
            .collect();
        let done_now: BTreeSet<i64> = client
            .query(
                "SELECT id FROM issue WHERE id = ANY($1) AND processing_status = 'DONE'",
                &[&targets],
            )
            .await
            .expect("read the targets")
            .iter()
            .map(|r| r.get(0))
            .collect();
        for (n, wait) in waits.iter().enumerate() {
            match judge_wait(wait, &log, &done_now) {
                Ok(verdict) => report.waits.push(verdict),
                Err(problem) => report.problems.push(format!(
                    "wait {n} ({} targets, timeout {:?}, min {}): {problem}",
                    wait.spec.issue_ids.len(),
                    wait.spec.timeout,
                    wait.spec.min_completion
                )),
            }
        }
    }
}

/// Differences between what a subscriber should have seen and what it saw.
pub fn compare_sequences(expected: &[i64], seen: &[i64]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut counts: BTreeMap<i64, usize> = BTreeMap::new();
    for &seq in seen {
        *counts.entry(seq).or_default() += 1;
    }
    let missing: Vec<i64> = expected
        .iter()
        .copied()
        .filter(|seq| !counts.contains_key(seq))
        .collect();
    if !missing.is_empty() {
        problems.push(format!(
            "missed {} transition(s), first seq {}",
            missing.len(),
            missing[0]
        ));
    }
    let repeated: Vec<i64> = counts
        .iter()
        .filter(|(_, &n)| n > 1)
        .map(|(&seq, _)| seq)
        .collect();
    if !repeated.is_empty() {
        problems.push(format!(
            "saw {} transition(s) more than once, first seq {}",
            repeated.len(),
            repeated[0]
        ));
    }
    let logged: BTreeSet<i64> = expected.iter().copied().collect();
    let unknown: Vec<i64> = counts
        .keys()
        .copied()
        .filter(|seq| !logged.contains(seq))
        .collect();
    if !unknown.is_empty() {
        problems.push(format!(
            "saw {} seq(s) that are not in the log after its start, first {}",
            unknown.len(),
            unknown[0]
        ));
    }
    // (A repeat right after itself is reported as a repeat, not as disorder.)
    if let Some(pair) = seen.windows(2).find(|w| w[1] < w[0]) {
        problems.push(format!("out of order: seq {} after {}", pair[1], pair[0]));
    }
    problems
}

/// One row of the log, as the wait rules need it.
struct LoggedTransition {
    issue_id: i64,
    to: String,
    at: OffsetDateTime,
    attempts: i32,
    fatal: bool,
}

/// A target as of some point in the log.
#[derive(Clone, Copy)]
struct TargetState<'a> {
    status: &'a str,
    attempts: i32,
    fatal: bool,
}

/// The outcome the rules give for a wait armed at `start` with its
/// deadline at `deadline`, and when it was decided.
fn replay(
    spec: &WaitSpec,
    log: &[LoggedTransition],
    start: OffsetDateTime,
    deadline: OffsetDateTime,
) -> (Outcome, OffsetDateTime) {
    let mut targets: BTreeMap<i64, TargetState> = BTreeMap::new();
    let wanted: BTreeSet<i64> = spec.issue_ids.iter().copied().collect();
    let decide = |targets: &BTreeMap<i64, TargetState>| -> Option<Outcome> {
        let done = targets.values().filter(|t| t.status == "DONE").count();
        if done == wanted.len() {
            return Some(Outcome::AllPass);
        }
        let settled = targets.len() == wanted.len()
            && targets.values().all(|t| match t.status {
                "DONE" => true,
                "FAILED" => t.fatal || t.attempts >= spec.max_attempts,
                _ => false,
            });
        settled.then(|| Outcome::by_count(done, spec.min_completion))
    };
    let mut armed = false;
    for t in log.iter().filter(|t| wanted.contains(&t.issue_id)) {
        if !armed && t.at > start {
            armed = true;
            if let Some(outcome) = decide(&targets) {
                return (outcome, start);
            }
        }
        if t.at > deadline {
            break;
        }
        targets.insert(
            t.issue_id,
            TargetState {
                status: &t.to,
                attempts: t.attempts,
                fatal: t.fatal,
            },
        );
        if armed {
            if let Some(outcome) = decide(&targets) {
                return (outcome, t.at);
            }
        }
    }
    if !armed {
        if let Some(outcome) = decide(&targets) {
            return (outcome, start);
        }
    }
    let done = targets.values().filter(|t| t.status == "DONE").count();
    (Outcome::by_count(done, spec.min_completion), deadline)
}

/// Checks one wait's answer against the rules replayed over the log.
fn judge_wait(
    wait: &WaitRecord,
    log: &[LoggedTransition],
    done_now: &BTreeSet<i64>,
) -> Result<WaitVerdict, String> {
    let answer = wait
        .answer
        .as_ref()
        .map_err(|e| format!("not answered: {e}"))?;
    let outcome = answer["outcome"]
        .as_str()
        .and_then(Outcome::parse)
        .ok_or_else(|| format!("no outcome in {answer}"))?;
    let ids = |field: &str| -> BTreeSet<i64> {
        answer[field]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_i64).collect())
            .unwrap_or_default()
    };
    let completed = ids("completed");
    let wanted: BTreeSet<i64> = wait.spec.issue_ids.iter().copied().collect();
    if let Some(id) = completed.iter().find(|id| !done_now.contains(id)) {
        return Err(format!("reported issue {id} completed, but it is not DONE"));
    }
    let consistent = match outcome {
        Outcome::AllPass => completed == wanted,
        Outcome::TimeoutPass => completed.len() >= wait.spec.min_completion,
        Outcome::Skip => completed.len() < wait.spec.min_completion,
    };
    if !consistent {
        return Err(format!(
            "{outcome:?} contradicts its own completed list {completed:?}"
        ));
    }

    // When the wait armed: it says how long it waited, so it armed that
    // long before its answer arrived (a little earlier still, for the
    // answer's way back); a wait that does not say armed in the first
    // moments after it was sent. Its deadline is that moment plus the
    // timeout. The best estimate comes first (it dates the decision), then
    // the edges of both.
    let margin = time::Duration::try_from(CLOCK_MARGIN).expect("a small margin");
    let timeout = time::Duration::try_from(wait.spec.timeout).expect("a sane timeout");
    let (arm_from, arm_to) = match answer["waited_ms"].as_u64() {
        Some(waited_ms) => {
            let armed = wait.answered_at - time::Duration::milliseconds(waited_ms as i64);
            if armed < wait.sent_at - margin {
                return Err(format!(
                    "says it waited {waited_ms} ms, longer than it was open"
                ));
            }
            (wait.sent_at.max(armed - margin), armed)
        }
        None => (wait.sent_at, wait.answered_at.min(wait.sent_at + margin)),
    };
    let mut possible: BTreeMap<Outcome, OffsetDateTime> = BTreeMap::new();
    let nominal = [(arm_to, arm_to + timeout)];
    let edges = [arm_from, arm_to].into_iter().flat_map(|start| {
        [
            (start, start + timeout - margin),
            (start, start + timeout + margin),
        ]
    });
    for (start, deadline) in nominal.into_iter().chain(edges) {
        let (expected, decided_at) = replay(&wait.spec, log, start, deadline);
        possible.entry(expected).or_insert(decided_at);
    }
    let Some(&decided_at) = possible.get(&outcome) else {
        return Err(format!(
            "answered {outcome:?}, but the rules over the log give {:?}",
            possible.keys().collect::<Vec<_>>()
        ));
    };
    let latency = (wait.answered_at - decided_at).max(time::Duration::ZERO);
    let latency = Duration::try_from(latency).expect("a non-negative latency");
    if latency > MAX_ANSWER_DELAY {
        return Err(format!("answered {latency:?} after it was decided"));
    }
    Ok(WaitVerdict {
        outcome,
        latency,
        strict: possible.len() == 1,
    })
}
