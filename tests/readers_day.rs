//! The readers' day: with `timezone` set where the local date is not
//! UTC's, a pipeline run dates its briefing with the local date and titles
//! it with the `briefing_title` template, whose bad forms the settings
//! trigger refuses; a `schedule` written as cron is read on the local
//! clock, daylight-saving changes included.

mod common;

use common::{process, TestDb};
use newsnack::settings::schedule::Schedule;
use time::OffsetDateTime;

/// A zone whose date differs from UTC's now: 14 hours ahead once it is
/// 10:00 UTC, 12 hours behind until 12:00 UTC.
fn zone_on_another_day(now: OffsetDateTime) -> &'static str {
    if now.hour() >= 12 {
        "Pacific/Kiritimati"
    } else {
        "Etc/GMT+12"
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_run_dates_and_titles_its_briefing_in_the_readers_zone() {
    let db = TestDb::new().await;
    let before = OffsetDateTime::now_utc();
    let zone = zone_on_another_day(before);
    db.set("timezone", zone).await;
    db.set("briefing_title", "뉴스낵 {date:%Y년 %-m월 %-d일} ({date})")
        .await;
    db.set("content_gen_min_completion", "1").await;
    db.add_issues(2).await;

    let out = tokio::task::block_in_place(|| process::newsnack(&db.url, &["run-pipeline"]));
    assert!(out.status.success(), "{}", process::text(&out.stderr));
    let after = OffsetDateTime::now_utc();

    let client = db.raw().await;
    let row = client
        .query_one(
            "SELECT briefing_date, title, body FROM briefing ORDER BY id DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap();
    let (date, title, body): (time::Date, String, String) = (row.get(0), row.get(1), row.get(2));
    let local: chrono_tz::Tz = zone.parse().unwrap();
    let local_days = [
        newsnack::briefing::assembly::day_in(local, before),
        newsnack::briefing::assembly::day_in(local, after),
    ];
    assert!(local_days.contains(&date), "{date} is {zone}'s date");
    assert_ne!(date, before.date(), "not UTC's date");
    let expected = format!(
        "뉴스낵 {}년 {}월 {}일 ({} {} {})",
        date.year(),
        u8::from(date.month()),
        date.day(),
        date.day(),
        date.month(),
        date.year()
    );
    assert_eq!(title, expected);
    assert!(body.starts_with(&format!("# {expected}")), "{body}");
}

/// The title by default is today's English one.
#[tokio::test]
async fn the_default_title_is_the_english_one() {
    let db = TestDb::new().await;
    let client = db.raw().await;
    let (default, value): (String, String) = {
        let row = client
            .query_one(
                "SELECT sp.default_value, s.value FROM setting_spec sp JOIN setting s USING (key)
                  WHERE key = 'briefing_title'",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(default, newsnack::settings::DEFAULT_BRIEFING_TITLE);
    assert_eq!(value, default);
    assert_eq!(
        newsnack::briefing::assembly::title(&value, time::macros::date!(2026 - 11 - 30)),
        "newsnack — 30 November 2026"
    );
    // The prompts' defaults are the ones compiled in.
    let prompts: Vec<(String, String)> = client
        .query(
            "SELECT key, default_value FROM setting_spec
              WHERE key IN ('llm_system_prompt', 'llm_user_prompt') ORDER BY key",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        prompts,
        [
            (
                "llm_system_prompt".to_string(),
                newsnack::writer::Prompts::DEFAULT.system.to_string()
            ),
            (
                "llm_user_prompt".to_string(),
                newsnack::writer::Prompts::DEFAULT.user_template.to_string()
            ),
        ]
    );
}

/// A 07:00 schedule in New York: 12:00 UTC before the clocks spring
/// forward, 11:00 UTC after; in Berlin, 05:00 UTC before they fall back,
/// 06:00 UTC after: the ticks the scheduler waits for.
#[test]
fn a_cron_schedule_ticks_at_local_time_across_daylight_saving_changes() {
    let daily: Schedule = "0 7 * * *".parse().unwrap();
    let ticks = |zone: chrono_tz::Tz, from: OffsetDateTime| -> Vec<OffsetDateTime> {
        std::iter::successors(daily.next_tick(from, zone), |&t| daily.next_tick(t, zone))
            .take(3)
            .collect()
    };
    use time::macros::datetime;
    assert_eq!(
        ticks(
            chrono_tz::America::New_York,
            datetime!(2026-03-07 00:00 UTC)
        ),
        [
            datetime!(2026-03-07 12:00 UTC),
            datetime!(2026-03-08 11:00 UTC),
            datetime!(2026-03-09 11:00 UTC),
        ]
    );
    assert_eq!(
        ticks(chrono_tz::Europe::Berlin, datetime!(2026-10-24 00:00 UTC)),
        [
            datetime!(2026-10-24 05:00 UTC),
            datetime!(2026-10-25 06:00 UTC),
            datetime!(2026-10-26 06:00 UTC),
        ]
    );
}
