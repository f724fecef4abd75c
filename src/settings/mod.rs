//! Runtime settings, typed. Values live in the `setting` table (validated
//! there); a running service re-reads them on next use after a
//! `setting_changed` notification, and never polls.
//!
//! The integers are read as they are; the text settings have accessors
//! that give them their types: [`Settings::prompts`] (what the LLM is
//! asked) and [`Settings::time_zone`] (the readers' day and the cron
//! schedule's clock).

pub mod schedule;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::db::{self, DbError, DbPool};
use crate::writer::checks::{self, ArticleChecks, Script};
use crate::writer::Prompts;

/// The default of the `briefing_title` setting (migration 17 holds the
/// same text).
pub const DEFAULT_BRIEFING_TITLE: &str = "newsnack — {date}";

/// A stored setting this binary cannot use. The database validates every
/// value, so this means the database knows more than the binary: a time
/// zone newer than the binary's time zone database.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    #[error(
        "the timezone setting {0:?} is not in this binary's time zone database; set another IANA name (e.g. \"Asia/Seoul\") or upgrade newsnack"
    )]
    UnknownTimeZone(String),
}

/// Which LLM calls may go to the fallback provider while the primary is
/// down (setting `llm_fallback_for`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FallbackFor {
    /// Briefing calls only.
    #[default]
    Briefing,
    /// Every call.
    All,
    /// No call.
    None,
}

impl FallbackFor {
    /// The setting's value; `None` for anything else.
    pub fn parse(value: &str) -> Option<FallbackFor> {
        match value.trim().to_ascii_lowercase().as_str() {
            "briefing" => Some(FallbackFor::Briefing),
            "all" => Some(FallbackFor::All),
            "none" => Some(FallbackFor::None),
            _ => None,
        }
    }
}

/// Every setting the service uses, with the defaults of `setting_spec`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Settings {
    pub content_gen_timeout_s: i64,
    pub content_gen_min_completion: i64,
    pub top_k: i64,
    pub lookback_hours: i64,
    pub max_attempts: i64,
    pub lease_s: i64,
    pub generation_concurrency: i64,
    pub retry_backoff_ms: i64,
    pub retry_backoff_max_ms: i64,
    /// `off`, `every <n>s|m|h`, or a cron expression (see [`crate::settings::schedule`]).
    pub schedule: String,
    /// LLM calls in flight across all instances together.
    pub llm_max_in_flight: i64,
    /// LLM calls started per minute across all instances (0: unlimited).
    pub llm_requests_per_minute: i64,
    pub llm_system_prompt: String,
    /// A template with `{title}` and `{body}`.
    pub llm_user_prompt: String,
    /// An IANA time zone name: the briefing's date and cron schedules.
    pub timezone: String,
    /// A template with `{date}`, filled in when a briefing is assembled.
    pub briefing_title: String,
    pub llm_fallback_for: FallbackFor,
    /// The operator's pause: no instance starts an LLM call while true.
    pub generation_paused: bool,
    /// Prompt plus completion tokens per day in `timezone` (0: unlimited).
    pub llm_daily_token_budget: i64,
    /// The part of the daily budget only briefing calls may use.
    pub llm_briefing_reserve_tokens: i64,
    pub article_headline_max_chars: i64,
    pub article_body_min_chars: i64,
    pub article_body_max_chars: i64,
    /// Phrases separated by `|` (see [`Settings::article_checks`]).
    pub article_reject_phrases: String,
    pub article_script: Script,
    /// Days transitions, pipeline runs and the LLM budget's bookkeeping
    /// are kept (0: forever).
    pub log_retention_days: i64,
    /// Days finished issues are kept after their last update (0: forever).
    pub issue_retention_days: i64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            content_gen_timeout_s: 600,
            content_gen_min_completion: 3,
            top_k: 5,
            lookback_hours: 24,
            max_attempts: 3,
            lease_s: 60,
            generation_concurrency: 8,
            retry_backoff_ms: 2000,
            retry_backoff_max_ms: 300_000,
            schedule: "off".into(),
            llm_max_in_flight: 8,
            llm_requests_per_minute: 0,
            llm_system_prompt: Prompts::DEFAULT.system.into(),
            llm_user_prompt: Prompts::DEFAULT.user_template.into(),
            timezone: "UTC".into(),
            briefing_title: DEFAULT_BRIEFING_TITLE.into(),
            llm_fallback_for: FallbackFor::Briefing,
            generation_paused: false,
            llm_daily_token_budget: 0,
            llm_briefing_reserve_tokens: 0,
            article_headline_max_chars: 120,
            article_body_min_chars: 1,
            article_body_max_chars: 20_000,
            article_reject_phrases: String::new(),
            article_script: Script::Any,
            log_retention_days: 30,
            issue_retention_days: 0,
        }
    }
}

impl Settings {
    /// Builds settings from `key -> value` text, falling back to defaults
    /// for missing or unreadable entries (the database validates writes).
    pub fn from_values(values: &HashMap<String, String>) -> Self {
        let mut s = Settings::default();
        let take = |key: &str, slot: &mut i64| {
            if let Some(v) = values.get(key).and_then(|v| v.parse().ok()) {
                *slot = v;
            }
        };
        take("content_gen_timeout_s", &mut s.content_gen_timeout_s);
        take(
            "content_gen_min_completion",
            &mut s.content_gen_min_completion,
        );
        take("top_k", &mut s.top_k);
        take("lookback_hours", &mut s.lookback_hours);
        take("max_attempts", &mut s.max_attempts);
        take("lease_s", &mut s.lease_s);
        take("generation_concurrency", &mut s.generation_concurrency);
        take("retry_backoff_ms", &mut s.retry_backoff_ms);
        take("retry_backoff_max_ms", &mut s.retry_backoff_max_ms);
        take("llm_max_in_flight", &mut s.llm_max_in_flight);
        take("llm_requests_per_minute", &mut s.llm_requests_per_minute);
        take("llm_daily_token_budget", &mut s.llm_daily_token_budget);
        take(
            "llm_briefing_reserve_tokens",
            &mut s.llm_briefing_reserve_tokens,
        );
        take(
            "article_headline_max_chars",
            &mut s.article_headline_max_chars,
        );
        take("article_body_min_chars", &mut s.article_body_min_chars);
        take("article_body_max_chars", &mut s.article_body_max_chars);
        if let Some(v) = values
            .get("llm_fallback_for")
            .and_then(|v| FallbackFor::parse(v))
        {
            s.llm_fallback_for = v;
        }
        if let Some(v) = values.get("generation_paused") {
            s.generation_paused = v.trim().eq_ignore_ascii_case("true");
        }
        if let Some(v) = values.get("article_script").and_then(|v| Script::parse(v)) {
            s.article_script = v;
        }
        take("log_retention_days", &mut s.log_retention_days);
        take("issue_retention_days", &mut s.issue_retention_days);
        for (key, slot) in [
            ("schedule", &mut s.schedule),
            ("llm_system_prompt", &mut s.llm_system_prompt),
            ("llm_user_prompt", &mut s.llm_user_prompt),
            ("timezone", &mut s.timezone),
            ("briefing_title", &mut s.briefing_title),
            ("article_reject_phrases", &mut s.article_reject_phrases),
        ] {
            if let Some(value) = values.get(key) {
                *slot = value.clone();
            }
        }
        s
    }

    /// The prompts the next LLM call sends.
    pub fn prompts(&self) -> Prompts<'_> {
        Prompts {
            system: &self.llm_system_prompt,
            user_template: &self.llm_user_prompt,
        }
    }

    /// What an answer is checked against before it is stored.
    pub fn article_checks(&self) -> ArticleChecks {
        let chars = |n: i64| usize::try_from(n.max(0)).unwrap_or(usize::MAX);
        ArticleChecks {
            headline_max_chars: chars(self.article_headline_max_chars),
            body_min_chars: chars(self.article_body_min_chars),
            body_max_chars: chars(self.article_body_max_chars),
            reject_phrases: checks::reject_phrases(&self.article_reject_phrases),
            script: self.article_script,
        }
    }

    /// The readers' time zone.
    pub fn time_zone(&self) -> Result<chrono_tz::Tz, SettingError> {
        self.timezone
            .parse()
            .map_err(|_| SettingError::UnknownTimeZone(self.timezone.clone()))
    }

    /// What a prune keeps.
    pub fn retention(&self) -> db::retention::Retention {
        db::retention::Retention {
            log_days: self.log_retention_days,
            issue_days: self.issue_retention_days,
            max_attempts: self.max_attempts,
        }
    }

    pub fn lease(&self) -> Duration {
        Duration::from_secs(self.lease_s.max(1) as u64)
    }

    /// The delay before retry number `attempts` (1-based attempts so far):
    /// exponential from `retry_backoff_ms` with ±50% jitter, never above
    /// `retry_backoff_max_ms` (at the cap, between half of it and all of it).
    pub fn retry_delay(&self, attempts: i32) -> Duration {
        let base = self.retry_backoff_ms.max(1) as f64;
        let cap = self.retry_backoff_max_ms.max(1) as f64;
        let exponent = (attempts.max(1) - 1).min(30);
        let ms = (base * 2f64.powi(exponent)).min(cap);
        let jittered = rand::random_range(ms * 0.5..=(ms * 1.5).min(cap));
        Duration::from_millis(jittered.round() as u64)
    }

    pub fn wait_timeout(&self) -> Duration {
        Duration::from_secs(self.content_gen_timeout_s.max(1) as u64)
    }

    /// Reads the current values.
    pub async fn load(pool: &DbPool) -> Result<Self, DbError> {
        let client = pool.get().await?;
        let rows = db::setting::list(&client).await?;
        Ok(Settings::from_values(
            &rows.into_iter().map(|r| (r.key, r.value)).collect(),
        ))
    }
}

/// The settings as last read, re-read on next use after a change. The
/// read runs outside the lock: callers that find the cache out of date
/// each read for themselves, so when no connection is free each waits out
/// the pool's timeout once, side by side, not one after another.
pub struct SettingsCache {
    pool: DbPool,
    changes: watch::Receiver<u64>,
    current: Mutex<Option<(u64, Arc<Settings>)>>,
}

impl SettingsCache {
    /// `changes` is bumped on every `setting_changed` notification (see
    /// [`crate::events::hub::EventHub::settings_changed`]).
    pub fn new(pool: DbPool, changes: watch::Receiver<u64>) -> Self {
        SettingsCache {
            pool,
            changes,
            current: Mutex::new(None),
        }
    }

    /// The current settings: cached, unless a change was announced since
    /// they were read.
    pub async fn get(&self) -> Result<Arc<Settings>, DbError> {
        let version = *self.changes.borrow();
        if let Some((seen, settings)) = self.cached() {
            if seen == version {
                return Ok(settings);
            }
        }
        let settings = Arc::new(Settings::load(&self.pool).await?);
        let mut current = self.current.lock().expect("settings cache lock");
        // A read that began before a later one finished keeps the newer.
        if current.as_ref().is_none_or(|(seen, _)| *seen <= version) {
            *current = Some((version, settings.clone()));
        }
        Ok(settings)
    }

    fn cached(&self) -> Option<(u64, Arc<Settings>)> {
        self.current.lock().expect("settings cache lock").clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_grow_with_jitter_and_never_pass_the_cap() {
        let s = Settings {
            retry_backoff_ms: 1000,
            retry_backoff_max_ms: 5000,
            ..Settings::default()
        };
        for _ in 0..1000 {
            let first = s.retry_delay(1);
            assert!(first >= Duration::from_millis(500) && first <= Duration::from_millis(1500));
            for attempts in [4, 5, 30, i32::MAX] {
                let late = s.retry_delay(attempts);
                assert!(
                    late >= Duration::from_millis(2500) && late <= Duration::from_millis(5000),
                    "{attempts}: {late:?}"
                );
            }
        }
    }

    #[test]
    fn missing_and_unreadable_values_fall_back_to_defaults() {
        let values: HashMap<String, String> = [
            ("top_k".to_string(), "7".to_string()),
            ("lease_s".to_string(), "oops".to_string()),
        ]
        .into();
        let s = Settings::from_values(&values);
        assert_eq!(s.top_k, 7);
        assert_eq!(s.lease_s, 60);
        assert_eq!(s.max_attempts, 3);
        assert_eq!(s.prompts(), Prompts::DEFAULT);
        assert_eq!(s.time_zone(), Ok(chrono_tz::UTC));
        assert_eq!(s.article_checks(), ArticleChecks::default());
        assert_eq!(s.llm_fallback_for, FallbackFor::Briefing);
    }

    #[test]
    fn choices_and_phrases_are_typed() {
        let values: HashMap<String, String> = [
            ("llm_fallback_for".to_string(), "none".to_string()),
            ("article_script".to_string(), "hangul".to_string()),
            (
                "article_reject_phrases".to_string(),
                "As an AI|I can't".to_string(),
            ),
            ("article_headline_max_chars".to_string(), "80".to_string()),
            ("llm_daily_token_budget".to_string(), "100000".to_string()),
        ]
        .into();
        let s = Settings::from_values(&values);
        assert_eq!(s.llm_fallback_for, FallbackFor::None);
        assert_eq!(s.llm_daily_token_budget, 100_000);
        let checks = s.article_checks();
        assert_eq!(checks.script, Script::Hangul);
        assert_eq!(checks.headline_max_chars, 80);
        assert_eq!(checks.reject_phrases, ["As an AI", "I can't"]);
    }

    #[test]
    fn text_settings_are_typed_by_their_accessors() {
        let values: HashMap<String, String> = [
            ("timezone".to_string(), "Asia/Seoul".to_string()),
            ("llm_user_prompt".to_string(), "{title}: {body}".to_string()),
        ]
        .into();
        let s = Settings::from_values(&values);
        assert_eq!(s.time_zone(), Ok(chrono_tz::Asia::Seoul));
        assert_eq!(s.prompts().user_template, "{title}: {body}");
        let unknown = Settings {
            timezone: "Mars/Olympus_Mons".into(),
            ..Settings::default()
        };
        assert_eq!(
            unknown.time_zone(),
            Err(SettingError::UnknownTimeZone("Mars/Olympus_Mons".into()))
        );
    }
}
