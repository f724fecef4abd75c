//! Queries on the LLM budget all instances share (migrations 17, 28, 29,
//! 30, 31 and 36): the one exchange a holder has with it, typed both ways,
//! and what the dashboard and the metrics show of it, read from kept rows:
//! the day's tokens, the articles' and the latest briefing's tokens and the
//! providers' state included.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tokio_postgres::types::{Json, Type};
use tokio_postgres::GenericClient as _;

use super::{DbError, Sql};
use crate::model::llm::{Priority, Provider};

/// A call to queue: its claim, and its class (`None`: the class the issue
/// was last asked for at, else briefing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallToQueue {
    pub issue_id: i64,
    pub claim_id: i64,
    pub priority: Option<Priority>,
    /// The call goes to the fallback provider only (the primary failed it).
    pub fallback_only: bool,
}

/// How a call ended on its provider, for the providers' circuits.
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderReport {
    pub provider: Provider,
    pub outcome: ProviderOutcome,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ProviderOutcome {
    /// It answered.
    Ok,
    /// It failed (5xx, timeout, no connection, 429), for `reason`; with a
    /// pause it asked for.
    Failed {
        reason: String,
        pause: Option<Duration>,
    },
}

/// Where a granted call goes, its class, and what a failure of it means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub provider: Provider,
    pub priority: Priority,
    pub on_failure: OnFailure,
}

/// What a failure of a granted call means, as the budget decided when it
/// granted it (step 9 of the exchange).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnFailure {
    /// The provider failing it (5xx, timeout, no connection, a rate
    /// limit) sends it to the fallback provider at once, in the same
    /// claim, its attempt unspent: it is on the primary, its holder has a
    /// fallback, and `llm_fallback_for` lets its class go there.
    Fallback,
    /// A failure fails the attempt; the issue is retried later.
    Retry,
}

/// What a holder brings to an exchange.
#[derive(Debug, Clone, Copy)]
pub struct Exchange<'a> {
    /// This process, as the budget knows it.
    pub holder: &'a str,
    /// The instance name, for people.
    pub instance: &'a str,
    /// How long the holder lives without another exchange.
    pub lease: Duration,
    /// The holder can call a fallback provider.
    pub has_fallback: bool,
    pub queue: &'a [CallToQueue],
    /// The holder's calls that ended, or will never run.
    pub finished: &'a [i64],
    /// The tokens those calls spent, counted to today.
    pub tokens: i64,
    /// How those calls went on their providers.
    pub reports: &'a [ProviderReport],
    /// A pause every instance should keep, and why.
    pub pause: Option<(Duration, &'a str)>,
    /// The holder goes away with all its calls.
    pub leaving: bool,
}

/// A pause in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PauseInForce {
    /// How long it still lasts, by the database's clock.
    pub remaining: Duration,
    pub reason: Option<String>,
    /// The instance whose call met the rate limit.
    pub by: Option<String>,
}

/// What the budget answered.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExchangeAnswer {
    /// The ids of the calls queued, in the order given.
    pub queued: Vec<i64>,
    /// Every call of the holder granted and not finished.
    pub granted: Vec<i64>,
    /// Where each of `granted` goes, in the same order.
    pub routes: Vec<Route>,
    /// How many calls the holder has in the budget, waiting or granted.
    pub holding: i64,
    pub pause: Option<PauseInForce>,
    /// When to ask again, if some of the holder's calls wait for what time
    /// brings (a pause ending, the minute's window moving on, another
    /// holder's lease running out, the next day).
    pub ask_again_in: Option<Duration>,
    /// The day's tokens, every instance together, this exchange's included.
    pub tokens_today: i64,
    /// Which calls the day's budget holds until the next day.
    pub held: Option<Held>,
}

/// Which calls the day's token budget holds (`llm_daily_token_budget`,
/// `llm_briefing_reserve_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Held {
    /// The day's tokens reached the budget less the briefing reserve:
    /// feed calls wait for the next day, briefing calls go on.
    Feed,
    /// The day's tokens reached the budget: every call waits.
    All,
}

impl Held {
    /// What is held, for people: `feed` or `all calls`.
    pub fn what(self) -> &'static str {
        match self {
            Held::Feed => "feed",
            Held::All => "all calls",
        }
    }
}

/// One exchange (`newsnack_llm_exchange`, one statement): renews the
/// holder's lease, takes its finished calls back, records a pause, queues
/// its new calls and grants what the budget allows, cluster-wide. The
/// request and the answer go as JSON, field by field.
pub async fn exchange(
    client: &impl Sql,
    exchange: &Exchange<'_>,
) -> Result<ExchangeAnswer, DbError> {
    let row = client
        .sql()
        .query_typed_one(
            "SELECT answer FROM newsnack_llm_exchange($1)",
            &[(&Json(Request::from(exchange)), Type::JSONB)],
        )
        .await?;
    let Json(answer): Json<Answer> = row.get(0);
    Ok(answer.into())
}

/// [`Exchange`] as the exchange reads it.
#[derive(Debug, Serialize)]
struct Request<'a> {
    holder: &'a str,
    instance: &'a str,
    lease_s: f64,
    has_fallback: bool,
    queue: Vec<QueuedCall>,
    finished: &'a [i64],
    tokens: i64,
    reports: Vec<Report<'a>>,
    pause: Option<Pause<'a>>,
    leaving: bool,
}

#[derive(Debug, Serialize)]
struct QueuedCall {
    issue_id: i64,
    claim_id: i64,
    priority: Option<Priority>,
    fallback_only: bool,
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    provider: Provider,
    ok: bool,
    pause_s: Option<f64>,
    reason: Option<&'a str>,
}

#[derive(Debug, Serialize)]
struct Pause<'a> {
    s: f64,
    reason: &'a str,
}

impl<'a> From<&Exchange<'a>> for Request<'a> {
    fn from(exchange: &Exchange<'a>) -> Self {
        Request {
            holder: exchange.holder,
            instance: exchange.instance,
            lease_s: exchange.lease.as_secs_f64(),
            has_fallback: exchange.has_fallback,
            queue: exchange
                .queue
                .iter()
                .map(|c| QueuedCall {
                    issue_id: c.issue_id,
                    claim_id: c.claim_id,
                    priority: c.priority,
                    fallback_only: c.fallback_only,
                })
                .collect(),
            finished: exchange.finished,
            tokens: exchange.tokens,
            reports: exchange
                .reports
                .iter()
                .map(|r| match &r.outcome {
                    ProviderOutcome::Ok => Report {
                        provider: r.provider,
                        ok: true,
                        pause_s: None,
                        reason: None,
                    },
                    ProviderOutcome::Failed { reason, pause } => Report {
                        provider: r.provider,
                        ok: false,
                        pause_s: pause.map(|p| p.as_secs_f64()),
                        reason: Some(reason),
                    },
                })
                .collect(),
            pause: exchange.pause.map(|(pause, reason)| Pause {
                s: pause.as_secs_f64(),
                reason,
            }),
            leaving: exchange.leaving,
        }
    }
}

/// The exchange's answer, as it writes it (see [`ExchangeAnswer`]).
#[derive(Deserialize, Default)]
#[serde(default)]
struct Answer {
    queued: Vec<i64>,
    granted: Vec<Granted>,
    holding: i64,
    pause: Option<AnswerPause>,
    ask_again_in_s: Option<f64>,
    tokens_today: i64,
    held: Option<Held>,
}

#[derive(Deserialize)]
struct Granted {
    id: i64,
    provider: Provider,
    priority: Priority,
    on_failure: OnFailure,
}

#[derive(Deserialize)]
struct AnswerPause {
    remaining_s: f64,
    reason: Option<String>,
    by: Option<String>,
}

impl From<Answer> for ExchangeAnswer {
    fn from(answer: Answer) -> Self {
        let seconds = |s: f64| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::ZERO);
        let (granted, routes) = answer
            .granted
            .into_iter()
            .map(|g| {
                let route = Route {
                    provider: g.provider,
                    priority: g.priority,
                    on_failure: g.on_failure,
                };
                (g.id, route)
            })
            .unzip();
        ExchangeAnswer {
            queued: answer.queued,
            granted,
            routes,
            holding: answer.holding,
            pause: answer.pause.map(|p| PauseInForce {
                remaining: seconds(p.remaining_s),
                reason: p.reason,
                by: p.by,
            }),
            ask_again_in: answer.ask_again_in_s.map(seconds),
            tokens_today: answer.tokens_today,
            held: answer.held,
        }
    }
}

/// The pause the dashboard shows: the operator's while it is on (with no
/// end: `until` is `None`, `by` is `operator`), else the last rate
/// limit's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PauseView {
    #[serde(with = "time::serde::rfc3339::option")]
    pub until: Option<OffsetDateTime>,
    /// Still in force.
    pub active: bool,
    pub reason: Option<String>,
    pub by: Option<String>,
}

/// Tokens spent, as the API reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tokens {
    pub prompt: i64,
    pub completion: i64,
}

/// The budget now: what waits, what is in flight against the limit, the
/// pause, and what was spent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BudgetView {
    /// `llm_max_in_flight`.
    pub max_in_flight: i64,
    /// `llm_requests_per_minute` (0: unlimited).
    pub requests_per_minute: i64,
    /// Calls granted and not finished, every instance together.
    pub in_flight: i64,
    /// Calls started within the last minute.
    pub started_last_minute: i64,
    /// Calls waiting for the budget, by class.
    pub waiting_briefing: i64,
    pub waiting_feed: i64,
    /// Processes holding calls.
    pub holders: i64,
    pub pause: Option<PauseView>,
    /// Tokens of the articles written today, in the readers' time zone.
    pub tokens_today: Tokens,
    /// Tokens of the latest briefing's articles.
    pub tokens_latest_briefing: Tokens,
    /// The day's token budget and what it holds.
    pub day: DayView,
    /// Each provider's state, primary first.
    pub providers: Vec<ProviderView>,
}

/// A provider as every instance sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProviderView {
    pub provider: Provider,
    /// `up`; `down` (its circuit open, or the primary paused by a rate
    /// limit); `probing` (past its time down: one call at a time tries it).
    pub state: &'static str,
    /// Failed calls in a row.
    pub failures: i64,
    #[serde(with = "time::serde::rfc3339::option")]
    pub down_until: Option<OffsetDateTime>,
    pub last_error: Option<String>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_error_at: Option<OffsetDateTime>,
    /// Calls granted on it and not finished, every instance together.
    pub in_flight: i64,
}

/// Each provider's state, as of `client`'s snapshot: the exchange's own
/// rule (migration 29), read.
pub async fn providers(client: &impl Sql) -> Result<Vec<ProviderView>, DbError> {
    let rows = client
        .sql()
        .query_typed(
            "SELECT p.provider,
                    CASE WHEN p.down_until > now()
                           OR (p.provider = 'primary' AND b.paused_until > now()) THEN 'down'
                         WHEN p.failures >= (SELECT COALESCE(s.value, sp.default_value)::int
                                               FROM setting_spec sp LEFT JOIN setting s USING (key)
                                              WHERE sp.key = 'llm_circuit_failures') THEN 'probing'
                         ELSE 'up' END,
                    p.failures::bigint,
                    CASE WHEN p.provider = 'primary' AND b.paused_until > now()
                         THEN greatest(p.down_until, b.paused_until) ELSE p.down_until END,
                    p.last_error, p.last_error_at,
                    (SELECT count(*) FROM llm_call c JOIN llm_holder h USING (holder)
                      WHERE h.lease_until >= now() AND c.granted_at IS NOT NULL
                        AND c.finished_at IS NULL
                        AND COALESCE(c.provider, 'primary') = p.provider)
               FROM llm_provider p, llm_budget b
              ORDER BY p.provider = 'fallback'",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| ProviderView {
            provider: Provider::parse(row.get(0)).unwrap_or(Provider::Primary),
            state: match row.get::<_, &str>(1) {
                "down" => "down",
                "probing" => "probing",
                _ => "up",
            },
            failures: row.get(2),
            down_until: row.get(3),
            last_error: row.get(4),
            last_error_at: row.get(5),
            in_flight: row.get(6),
        })
        .collect())
}

/// The day's tokens against the day's budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DayView {
    /// Tokens spent today (the day in `timezone`), every instance and
    /// provider together, as the budget counted them.
    pub tokens: i64,
    /// `llm_daily_token_budget` (0: unlimited).
    pub budget: i64,
    /// `llm_briefing_reserve_tokens`.
    pub briefing_reserve: i64,
    /// `timezone`: where the day begins.
    pub timezone: String,
    pub held: Option<Held>,
    /// What is held and until when, for people ("feed held until 00:00
    /// Asia/Seoul"); `None` when nothing is.
    pub state: Option<String>,
}

/// The day's count and what the budget holds, as of `client`'s snapshot:
/// the exchange's own rule (migration 28), read.
pub async fn day(client: &impl Sql) -> Result<DayView, DbError> {
    let row = client
        .sql()
        .query_typed_one(
            "WITH s AS (
                 SELECT (SELECT COALESCE(s.value, sp.default_value)
                           FROM setting_spec sp LEFT JOIN setting s USING (key)
                          WHERE sp.key = 'llm_daily_token_budget')::bigint AS budget,
                        (SELECT COALESCE(s.value, sp.default_value)
                           FROM setting_spec sp LEFT JOIN setting s USING (key)
                          WHERE sp.key = 'llm_briefing_reserve_tokens')::bigint AS reserve,
                        (SELECT COALESCE(s.value, sp.default_value)
                           FROM setting_spec sp LEFT JOIN setting s USING (key)
                          WHERE sp.key = 'timezone') AS zone
             )
             SELECT COALESCE(d.tokens, 0), s.budget, s.reserve, s.zone
               FROM s LEFT JOIN llm_token_day d ON d.day = (clock_timestamp() AT TIME ZONE s.zone)::date",
            &[],
        )
        .await?;
    let (tokens, budget, reserve, timezone): (i64, i64, i64, String) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    let held = match budget {
        0 => None,
        _ if tokens >= budget => Some(Held::All),
        _ if tokens >= budget - reserve => Some(Held::Feed),
        _ => None,
    };
    Ok(DayView {
        tokens,
        budget,
        briefing_reserve: reserve,
        state: held.map(|h| format!("{} held until 00:00 {timezone}", h.what())),
        timezone,
        held,
    })
}

/// Reads the budget, as of `client`'s snapshot; "today" starts at
/// `today_began` (on a quarter hour, as midnight is in every time zone).
/// Every figure is read from a kept row: the articles' tokens per quarter
/// hour and the latest briefing's (migration 36), the calls from
/// `llm_call`, which holds only calls waiting, in flight or ended within
/// the minute.
pub async fn view(client: &impl Sql, today_began: OffsetDateTime) -> Result<BudgetView, DbError> {
    let row = client
        .sql()
        .query_typed_one(
            "WITH calls AS (
                 SELECT count(*) FILTER (WHERE c.finished_at IS NULL AND c.granted_at IS NOT NULL
                                           AND h.lease_until >= now()) AS in_flight,
                        count(*) FILTER (WHERE c.granted_at >= now() - interval '1 minute') AS started,
                        count(*) FILTER (WHERE c.finished_at IS NULL AND c.granted_at IS NULL
                                           AND h.lease_until >= now() AND c.priority = 'briefing') AS briefing,
                        count(*) FILTER (WHERE c.finished_at IS NULL AND c.granted_at IS NULL
                                           AND h.lease_until >= now() AND c.priority = 'feed') AS feed
                   FROM llm_call c JOIN llm_holder h USING (holder)
             ), today AS (
                 SELECT COALESCE(sum(prompt_tokens), 0)::bigint AS prompt,
                        COALESCE(sum(completion_tokens), 0)::bigint AS completion
                   FROM ai_article_tokens WHERE quarter >= $1
             ), latest AS (
                 SELECT prompt_tokens, completion_tokens FROM briefing ORDER BY id DESC LIMIT 1
             )
             SELECT (SELECT COALESCE(s.value, sp.default_value)::bigint
                       FROM setting_spec sp LEFT JOIN setting s USING (key)
                      WHERE sp.key = 'llm_max_in_flight'),
                    (SELECT COALESCE(s.value, sp.default_value)::bigint
                       FROM setting_spec sp LEFT JOIN setting s USING (key)
                      WHERE sp.key = 'llm_requests_per_minute'),
                    calls.in_flight, calls.started, calls.briefing, calls.feed,
                    (SELECT count(*) FROM llm_holder WHERE lease_until >= now()),
                    b.paused_until, b.paused_until > now(), b.pause_reason, b.paused_by,
                    today.prompt, today.completion,
                    COALESCE((SELECT prompt_tokens FROM latest), 0),
                    COALESCE((SELECT completion_tokens FROM latest), 0),
                    newsnack_llm_operator_paused()
               FROM llm_budget b, calls, today",
            &[(&today_began, Type::TIMESTAMPTZ)],
        )
        .await?;
    let until: Option<OffsetDateTime> = row.get(7);
    let day = day(client).await?;
    let providers = providers(client).await?;
    Ok(BudgetView {
        max_in_flight: row.get(0),
        requests_per_minute: row.get(1),
        in_flight: row.get(2),
        started_last_minute: row.get(3),
        waiting_briefing: row.get(4),
        waiting_feed: row.get(5),
        holders: row.get(6),
        pause: operator_pause(row.get(15)).or(until.map(|until| PauseView {
            until: Some(until),
            active: row.get::<_, Option<bool>>(8).unwrap_or(false),
            reason: row.get(9),
            by: row.get(10),
        })),
        tokens_today: Tokens {
            prompt: row.get(11),
            completion: row.get(12),
        },
        tokens_latest_briefing: Tokens {
            prompt: row.get(13),
            completion: row.get(14),
        },
        day,
        providers,
    })
}

/// The operator's pause as the dashboard shows it, while it is on.
fn operator_pause(on: Option<bool>) -> Option<PauseView> {
    on.unwrap_or(false).then(|| PauseView {
        until: None,
        active: true,
        reason: Some("generation_paused: `newsnack resume` lets calls start".into()),
        by: Some("operator".into()),
    })
}

/// Folds the articles' token rows (`ai_article_tokens`) into one per
/// quarter hour once there are more than `above` of them, dropping those
/// no day read reaches any more (`newsnack_fold_article_tokens`, migration
/// 36); answers how many rows it folded.
pub async fn fold_article_tokens(client: &impl Sql, above: i32) -> Result<i64, DbError> {
    Ok(client
        .sql()
        .query_typed_one(
            "SELECT newsnack_fold_article_tokens($1)",
            &[(&above, Type::INT4)],
        )
        .await?
        .get(0))
}
