//! Assembling a briefing from exactly the issues it is given: never more,
//! never others. Every given issue must be `DONE` with its article.
//!
//! The briefing is dated with the readers' day (the `timezone` setting)
//! and titled by the `briefing_title` template, in which `{date}` is the
//! date in English (`30 November 2026`) and `{date:FORMAT}` the date in a
//! format of one's own: `%Y` the year, `%m`/`%-m` the month (two digits /
//! as is), `%d`/`%-d` the day, `%B`/`%b` the month's English name (whole /
//! three letters), `%A`/`%a` the weekday's, `%%` a percent sign. The
//! settings trigger accepts no other field.

use chrono::TimeZone as _;
use serde::Serialize;
use time::{Date, OffsetDateTime};

use crate::db::{self, DbError};
use crate::input::{self, InvalidInput};
use crate::model::status::Status;
use crate::settings::{SettingError, Settings};

/// Why a briefing could not be assembled.
#[derive(Debug, thiserror::Error)]
pub enum AssembleError {
    #[error(transparent)]
    Input(#[from] InvalidInput),
    /// Issues that are not `DONE` (or do not exist), and issues `DONE`
    /// without an article (set `DONE` by another system with plain SQL).
    #[error("{}", unpublishable(.not_done, .without_article))]
    Unpublishable {
        not_done: Vec<i64>,
        without_article: Vec<i64>,
    },
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Setting(#[from] SettingError),
}

/// Why issues cannot go into a briefing, in words.
pub(crate) fn unpublishable(not_done: &[i64], without_article: &[i64]) -> String {
    let mut parts = Vec::new();
    if !not_done.is_empty() {
        parts.push(format!("these issues are not DONE: {not_done:?}"));
    }
    if !without_article.is_empty() {
        parts.push(format!(
            "these issues are DONE without an article (set DONE by another system?): {without_article:?}"
        ));
    }
    parts.join("; ")
}

/// What was assembled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Assembled {
    pub briefing_id: i64,
    pub issue_ids: Vec<i64>,
}

/// The day it is at `now` in `zone`.
pub fn day_in(zone: chrono_tz::Tz, now: OffsetDateTime) -> Date {
    let local = zone
        .timestamp_opt(now.unix_timestamp(), 0)
        .single()
        .map(|t| t.date_naive());
    local
        .and_then(|d| {
            use chrono::Datelike as _;
            let month = time::Month::try_from(u8::try_from(d.month()).ok()?).ok()?;
            Date::from_calendar_date(d.year(), month, u8::try_from(d.day()).ok()?).ok()
        })
        .unwrap_or(now.date())
}

/// When the day it is at `now` in `zone` began (its first instant, should
/// midnight be skipped by a daylight-saving change).
pub fn day_began(zone: chrono_tz::Tz, now: OffsetDateTime) -> OffsetDateTime {
    let day = day_in(zone, now);
    let midnight =
        chrono::NaiveDate::from_ymd_opt(day.year(), u8::from(day.month()).into(), day.day().into())
            .and_then(|d| d.and_hms_opt(0, 0, 0));
    // The first hour that exists locally (midnight itself, unless the clock
    // jumps over it).
    (0..24)
        .filter_map(|hour| {
            let local = midnight? + chrono::Duration::hours(hour);
            zone.from_local_datetime(&local).earliest()
        })
        .next()
        .and_then(|began| OffsetDateTime::from_unix_timestamp(began.timestamp()).ok())
        .unwrap_or(now)
}

/// `template` with `{date}` and `{date:FORMAT}` filled in with `date` (see
/// the module docs); everything else as it is.
pub fn title(template: &str, date: Date) -> String {
    let mut title = String::with_capacity(template.len() + 16);
    let mut rest = template;
    while let Some(at) = rest.find("{date") {
        title.push_str(&rest[..at]);
        let tail = &rest[at + "{date".len()..];
        if let Some(after) = tail.strip_prefix('}') {
            title.push_str(&format!("{} {} {}", date.day(), date.month(), date.year()));
            rest = after;
        } else if let Some((format, after)) = tail
            .strip_prefix(':')
            .and_then(|f| f.split_once('}'))
            .filter(|(f, _)| !f.contains('{'))
        {
            title.push_str(&formatted(date, format));
            rest = after;
        } else {
            title.push_str("{date");
            rest = tail;
        }
    }
    title.push_str(rest);
    title
}

/// `date` in `format` (the fields of the module docs).
fn formatted(date: Date, format: &str) -> String {
    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let bare = chars.next_if_eq(&'-').is_some();
        let field = chars.next();
        let month = date.month().to_string();
        let weekday = date.weekday().to_string();
        match (bare, field) {
            (false, Some('Y')) => out.push_str(&date.year().to_string()),
            (false, Some('m')) => out.push_str(&format!("{:02}", u8::from(date.month()))),
            (true, Some('m')) => out.push_str(&u8::from(date.month()).to_string()),
            (false, Some('d')) => out.push_str(&format!("{:02}", date.day())),
            (true, Some('d')) => out.push_str(&date.day().to_string()),
            (false, Some('B')) => out.push_str(&month),
            (false, Some('b')) => out.push_str(&month[..3]),
            (false, Some('A')) => out.push_str(&weekday),
            (false, Some('a')) => out.push_str(&weekday[..3]),
            (false, Some('%')) => out.push('%'),
            // Not a field (the settings trigger refuses these): as written.
            (bare, field) => {
                out.push('%');
                if bare {
                    out.push('-');
                }
                out.extend(field);
            }
        }
    }
    out
}

/// Builds and stores the briefing for `issue_ids`, in that order
/// (duplicates dropped), through `client` (a transaction, when the briefing
/// must be published together with other writes), dated and titled as
/// `settings` say.
pub async fn assemble(
    client: &impl crate::db::Sql,
    issue_ids: &[i64],
    settings: &Settings,
) -> Result<Assembled, AssembleError> {
    input::check_ids("issue_ids", issue_ids)?;
    let mut ordered: Vec<i64> = Vec::with_capacity(issue_ids.len());
    for &id in issue_ids {
        if !ordered.contains(&id) {
            ordered.push(id);
        }
    }
    let sources = db::briefing::sources(client, &ordered).await?;
    let mut articles = Vec::with_capacity(ordered.len());
    let (mut not_done, mut without_article) = (Vec::new(), Vec::new());
    for id in &ordered {
        match sources.iter().find(|s| s.issue_id == *id) {
            Some(s) if s.status == Status::Done && s.headline.is_some() => articles.push(s),
            Some(s) if s.status == Status::Done => without_article.push(*id),
            _ => not_done.push(*id),
        }
    }
    if !not_done.is_empty() || !without_article.is_empty() {
        return Err(AssembleError::Unpublishable {
            not_done,
            without_article,
        });
    }
    let today = day_in(settings.time_zone()?, OffsetDateTime::now_utc());
    let title = title(&settings.briefing_title, today);
    let mut body = format!("# {title}\n\n");
    body.push_str(&format!(
        "Today's {} stor{}.\n\n",
        articles.len(),
        if articles.len() == 1 { "y" } else { "ies" }
    ));
    for (i, a) in articles.iter().enumerate() {
        body.push_str(&format!(
            "## {}. {}\n\n{}\n\n",
            i + 1,
            a.headline.as_deref().unwrap_or(&a.title),
            a.body.as_deref().unwrap_or_default().trim()
        ));
    }
    let briefing_id =
        db::briefing::insert(client, &title, today, &ordered, body.trim_end()).await?;
    Ok(Assembled {
        briefing_id,
        issue_ids: ordered,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::{date, datetime};

    #[test]
    fn the_default_title_is_the_english_one() {
        assert_eq!(
            title(
                crate::settings::DEFAULT_BRIEFING_TITLE,
                date!(2026 - 11 - 30)
            ),
            "newsnack — 30 November 2026"
        );
    }

    #[test]
    fn a_title_in_a_format_of_ones_own() {
        let day = date!(2026 - 03 - 08);
        assert_eq!(
            title("뉴스낵 {date:%Y년 %-m월 %-d일}", day),
            "뉴스낵 2026년 3월 8일"
        );
        assert_eq!(
            title(
                "{date:%a %d/%m/%Y} · {date:%A, %B %-d} · {date:%b} 100%%",
                day
            ),
            "Sun 08/03/2026 · Sunday, March 8 · Mar 100%%"
        );
        assert_eq!(title("{date:100%%}", day), "100%");
        // Not a placeholder: as written.
        assert_eq!(title("{dates} {date:x{y}", day), "{dates} {date:x{y}");
        assert_eq!(title("{date:%Q%-}", day), "%Q%-");
    }

    #[test]
    fn the_day_begins_at_local_midnight() {
        let now = datetime!(2026-11-29 22:00 UTC);
        assert_eq!(
            day_began(chrono_tz::Asia::Seoul, now),
            datetime!(2026-11-29 15:00 UTC)
        );
        assert_eq!(
            day_began(chrono_tz::UTC, now),
            datetime!(2026-11-29 00:00 UTC)
        );
        // Santiago's clock skips midnight on 6 September 2026: the day
        // begins at 01:00 local (04:00 UTC).
        assert_eq!(
            day_began(
                chrono_tz::America::Santiago,
                datetime!(2026-09-06 12:00 UTC)
            ),
            datetime!(2026-09-06 04:00 UTC)
        );
    }

    #[test]
    fn the_day_is_the_readers_day() {
        // 22:00 UTC on 29 November is already 30 November in Seoul.
        let now = datetime!(2026-11-29 22:00 UTC);
        assert_eq!(day_in(chrono_tz::UTC, now), date!(2026 - 11 - 29));
        assert_eq!(day_in(chrono_tz::Asia::Seoul, now), date!(2026 - 11 - 30));
        assert_eq!(
            day_in(
                chrono_tz::America::Los_Angeles,
                datetime!(2026-11-30 03:00 UTC)
            ),
            date!(2026 - 11 - 29)
        );
    }
}
