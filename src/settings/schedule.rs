//! When the scheduler ticks: `off`, a fixed interval (`every 30s`,
//! `every 15m`, `every 6h`), or a cron expression (5 or 6 fields) read on
//! the clock of the readers' time zone (the `timezone` setting).
//!
//! Ticks are pure functions of the clock and the time zone, so every
//! instance computes the same tick instants and can agree on which run
//! belongs to which tick. Interval ticks are aligned to multiples of the
//! interval since the epoch, whatever the time zone. A cron tick follows
//! the local clock across daylight-saving changes: `0 7 * * *` is 07:00
//! local time on both sides of one; a time the clock skips (02:30 on the
//! night it springs forward) ticks when the clock resumes (03:00), and a
//! time it passes twice ticks once, the first time.

use std::str::FromStr;
use std::time::Duration;

use chrono::TimeZone as _;
use croner::parser::{CronParser, Seconds};
use croner::Cron;
use time::OffsetDateTime;

/// The longest `every` interval: a year (longer is a cron expression's job).
const MAX_INTERVAL_SECONDS: u64 = 366 * 24 * 3600;

/// A parsed `schedule` setting.
#[derive(Debug, Clone)]
pub enum Schedule {
    Off,
    Every(Duration),
    Cron(Box<Cron>),
}

/// A schedule that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid schedule {value:?}: {reason} (expected \"off\", \"every <n>s|m|h\" or a cron expression)")]
pub struct InvalidSchedule {
    pub value: String,
    pub reason: String,
}

impl FromStr for Schedule {
    type Err = InvalidSchedule;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let value = s.trim();
        let invalid = |reason: &str| InvalidSchedule {
            value: value.to_string(),
            reason: reason.to_string(),
        };
        if value.eq_ignore_ascii_case("off") {
            return Ok(Schedule::Off);
        }
        if let Some(rest) = value.strip_prefix("every ") {
            let rest = rest.trim();
            let (number, unit_seconds) = [("s", 1), ("m", 60), ("h", 3600)]
                .into_iter()
                .find_map(|(unit, seconds)| Some((rest.strip_suffix(unit)?, seconds)))
                .ok_or_else(|| invalid("the unit must be s, m or h"))?;
            let n: u64 = number
                .parse()
                .map_err(|_| invalid("the interval must be a whole number"))?;
            let seconds = n
                .checked_mul(unit_seconds)
                .filter(|&s| s <= MAX_INTERVAL_SECONDS)
                .ok_or_else(|| invalid("the interval must be at most 366 days"))?;
            if seconds == 0 {
                return Err(invalid("the interval must be positive"));
            }
            return Ok(Schedule::Every(Duration::from_secs(seconds)));
        }
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .build()
            .parse(value)
            .map_err(|e| invalid(&e.to_string()))?;
        Ok(Schedule::Cron(Box::new(cron)))
    }
}

impl Schedule {
    /// The first tick strictly after `now`, a cron expression read in
    /// `zone`; `None` when off.
    pub fn next_tick(&self, now: OffsetDateTime, zone: chrono_tz::Tz) -> Option<OffsetDateTime> {
        match self {
            Schedule::Off => None,
            Schedule::Every(every) => {
                let step = every.as_millis() as i128;
                let now_ms = now.unix_timestamp_nanos() / 1_000_000;
                let next_ms = (now_ms / step + 1) * step;
                OffsetDateTime::from_unix_timestamp_nanos(next_ms * 1_000_000).ok()
            }
            Schedule::Cron(cron) => {
                let now = zone
                    .timestamp_opt(now.unix_timestamp(), now.nanosecond())
                    .single()?;
                let next = cron.find_next_occurrence(&now, false).ok()?;
                OffsetDateTime::from_unix_timestamp(next.timestamp()).ok()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono_tz::{America, Asia, UTC};
    use time::macros::datetime;

    #[test]
    fn intervals_are_aligned_so_instances_agree() {
        let s: Schedule = "every 15m".parse().unwrap();
        let now = datetime!(2026-11-29 20:14:12 UTC);
        assert_eq!(
            s.next_tick(now, UTC),
            Some(datetime!(2026-11-29 20:15:00 UTC))
        );
        assert_eq!(
            s.next_tick(datetime!(2026-11-29 20:15:00 UTC), UTC),
            Some(datetime!(2026-11-29 20:30:00 UTC))
        );
        let s: Schedule = "every 2s".parse().unwrap();
        assert_eq!(
            s.next_tick(now, UTC),
            Some(datetime!(2026-11-29 20:14:14 UTC))
        );
    }

    #[test]
    fn cron_expressions_with_five_or_six_fields() {
        let daily: Schedule = "0 7 * * *".parse().unwrap();
        assert_eq!(
            daily.next_tick(datetime!(2026-11-29 20:14:12 UTC), UTC),
            Some(datetime!(2026-11-30 07:00:00 UTC))
        );
        let every_ten_seconds: Schedule = "*/10 * * * * *".parse().unwrap();
        assert_eq!(
            every_ten_seconds.next_tick(datetime!(2026-11-29 20:14:12 UTC), UTC),
            Some(datetime!(2026-11-29 20:14:20 UTC))
        );
    }

    #[test]
    fn cron_reads_the_readers_clock() {
        // A 07:00 briefing in Seoul is at 22:00 UTC the day before.
        let daily: Schedule = "0 7 * * *".parse().unwrap();
        assert_eq!(
            daily.next_tick(datetime!(2026-11-29 20:14:12 UTC), Asia::Seoul),
            Some(datetime!(2026-11-29 22:00:00 UTC))
        );
        // Intervals stay aligned to the epoch, whatever the zone.
        let s: Schedule = "every 15m".parse().unwrap();
        assert_eq!(
            s.next_tick(datetime!(2026-11-29 20:14:12 UTC), Asia::Kolkata),
            Some(datetime!(2026-11-29 20:15:00 UTC))
        );
    }

    /// Every tick after `from`, `n` of them.
    fn ticks(
        schedule: &Schedule,
        zone: chrono_tz::Tz,
        from: OffsetDateTime,
        n: usize,
    ) -> Vec<OffsetDateTime> {
        std::iter::successors(schedule.next_tick(from, zone), |&t| {
            schedule.next_tick(t, zone)
        })
        .take(n)
        .collect()
    }

    #[test]
    fn times_the_clock_skips_or_repeats() {
        // 02:30 does not exist in New York on 8 March 2026: that day's tick
        // is when the clock resumes, at 03:00 EDT.
        let skipped: Schedule = "30 2 * * *".parse().unwrap();
        assert_eq!(
            ticks(
                &skipped,
                America::New_York,
                datetime!(2026-03-07 12:00 UTC),
                2
            ),
            [
                datetime!(2026-03-08 07:00 UTC),
                datetime!(2026-03-09 06:30 UTC)
            ]
        );
        // 01:30 happens twice in New York on 1 November 2026: one tick, at
        // the first (EDT, 05:30 UTC).
        let repeated: Schedule = "30 1 * * *".parse().unwrap();
        assert_eq!(
            ticks(
                &repeated,
                America::New_York,
                datetime!(2026-10-31 12:00 UTC),
                2
            ),
            [
                datetime!(2026-11-01 05:30 UTC),
                datetime!(2026-11-02 06:30 UTC)
            ]
        );
    }

    #[test]
    fn off_and_garbage() {
        assert!(matches!("off".parse::<Schedule>(), Ok(Schedule::Off)));
        assert_eq!(
            "off"
                .parse::<Schedule>()
                .unwrap()
                .next_tick(OffsetDateTime::now_utc(), UTC),
            None
        );
        assert!("every 0s".parse::<Schedule>().is_err());
        assert!("every 5d".parse::<Schedule>().is_err());
        // A multi-byte last character, and intervals that overflow or are
        // absurdly long, are errors, not panics or wrapped values.
        assert!("every 5é".parse::<Schedule>().is_err());
        assert!("every é".parse::<Schedule>().is_err());
        assert!("every 9999999999999999h".parse::<Schedule>().is_err());
        assert!("every 8785h".parse::<Schedule>().is_err());
        assert!("every 8784h".parse::<Schedule>().is_ok());
        assert!("61 * * * *".parse::<Schedule>().is_err());
        assert!("sometimes".parse::<Schedule>().is_err());
    }
}
