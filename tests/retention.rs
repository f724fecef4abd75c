//! Retention: `newsnack prune` removes exactly what the settings no longer
//! keep (rows backdated with SQL), `--dry-run` counts the same and changes
//! nothing; the log goes from its start only and keeps its newest row; a
//! subscriber, a replaying stream and a wait open across a prune miss
//! nothing and repeat nothing; `tail` from a pruned position warns and
//! follows from the oldest kept; `serve` prunes by itself under its lock;
//! and a pruner that deletes by age alone leaves a gap these checks see.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{until_published, until_sql_polled, within, TestDb};
use newsnack::briefing::wait::{ArmedWait, WaitOutcome, WaitRequest};
use newsnack::db::retention::{prune, PruneReport, Retention};
use newsnack::events::hub::EventHub;
use newsnack::events::stream::StreamItem;
use newsnack::writer::{OfflineWriter, SharedWriter};
use serde_json::Value;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

fn newsnack(url: &str, args: &[&str]) -> (Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_newsnack"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run newsnack");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?}: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{args:?} printed no JSON object ({e}): {stdout}"));
    (json, stderr)
}

/// Every row of every table a prune may touch, as text: to show that a
/// dry run changes nothing.
async fn everything(sql: &Client) -> String {
    sql.query_one(
        "SELECT concat_ws(' | ',
             (SELECT string_agg(t::text, ',' ORDER BY id) FROM issue t),
             (SELECT string_agg(t::text, ',' ORDER BY seq) FROM issue_transition t),
             (SELECT string_agg(t::text, ',' ORDER BY id) FROM ai_article t),
             (SELECT string_agg(t::text, ',' ORDER BY id) FROM pipeline_run t),
             (SELECT string_agg(t::text, ',' ORDER BY id) FROM llm_call t),
             (SELECT string_agg(t::text, ',' ORDER BY issue_id) FROM issue_priority t),
             (SELECT string_agg(t::text, ',' ORDER BY id) FROM briefing t))",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

async fn ids(sql: &Client, query: &str) -> Vec<i64> {
    sql.query(query, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Takes issues to DONE with an article each, as the owner.
async fn finish(sql: &Client, ids: &[i64]) {
    for status in ["IN_PROGRESS", "DONE"] {
        sql.execute(
            "UPDATE issue SET processing_status = $2 WHERE id = ANY($1)",
            &[&ids, &status],
        )
        .await
        .unwrap();
    }
    sql.execute(
        "INSERT INTO ai_article (issue_id, headline, body, writer, claim_id)
         SELECT id, 'h' || id, 'article ' || id, 'offline', claim_id FROM issue WHERE id = ANY($1)",
        &[&ids],
    )
    .await
    .unwrap();
}

/// Sets the log's rows up to `seq` (and those in `also`) `days` old.
async fn backdate_log(sql: &Client, through: i64, also: &[i64], days: i32) {
    sql.execute(
        "UPDATE issue_transition SET at = now() - make_interval(days => $3)
          WHERE seq <= $1 OR seq = ANY($2)",
        &[&through, &also, &days],
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn prune_keeps_exactly_what_the_settings_say_and_a_dry_run_changes_nothing() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    let (hub, stop) = db.listener().await;
    let issues = db.add_issues(12).await;
    let old_done = &issues[0..3];
    let new_done = &issues[3..4];
    let (fatal, spent, retryable, old_pending) = (issues[4], issues[5], issues[6], issues[7]);
    finish(&sql, &issues[0..4]).await;
    // FAILED three ways: fatal (no automatic retry), out of attempts (the
    // default max_attempts is 3), and with attempts left.
    for (id, times) in [(fatal, 1), (spent, 3), (retryable, 1)] {
        for _ in 0..times {
            for status in ["IN_PROGRESS", "FAILED"] {
                sql.execute(
                    "UPDATE issue SET processing_status = $2 WHERE id = $1",
                    &[&id, &status],
                )
                .await
                .unwrap();
            }
        }
    }
    sql.execute(
        "UPDATE issue SET retry_not_before = 'infinity' WHERE id = $1",
        &[&fatal],
    )
    .await
    .unwrap();
    // Last updated 10 days ago: all but the new DONE one (a plain update is
    // not a transition, so updated_at stays as set).
    sql.execute(
        "UPDATE issue SET updated_at = now() - interval '10 days' WHERE id <> $1",
        &[&new_done[0]],
    )
    .await
    .unwrap();
    // A briefing of the old articles keeps its own text.
    sql.execute(
        "INSERT INTO briefing (title, briefing_date, issue_ids, body)
         VALUES ('old', now(), $1, 'the whole briefing text')",
        &[&old_done],
    )
    .await
    .unwrap();
    // Pipeline runs, finished LLM calls and remembered classes, old and new.
    sql.batch_execute(&format!(
        "INSERT INTO pipeline_run (trigger, instance, started_at, outcome) VALUES
             ('manual', 'a', now() - interval '10 days', 'skip'),
             ('manual', 'a', now() - interval '10 days', 'running'),
             ('manual', 'a', now() - interval '1 day', 'all_pass');
         INSERT INTO llm_holder (holder, instance, lease_until) VALUES ('h', 'a', now() + interval '1 hour');
         INSERT INTO llm_call (holder, issue_id, claim_id, priority, granted_at, finished_at) VALUES
             ('h', 1, 1, 'feed', now() - interval '10 days', now() - interval '10 days'),
             ('h', 1, 2, 'feed', now(), now());
         INSERT INTO issue_priority (issue_id, priority, requested_at) VALUES
             ({}, 'feed', now() - interval '10 days'),
             ({}, 'feed', now() - interval '10 days'),
             ({retryable}, 'feed', now() - interval '10 days'),
             ({}, 'feed', now());",
        old_done[0], new_done[0], issues[8]
    ))
    .await
    .unwrap();

    // The log: the first 20 rows old, and one row in the middle too. Only
    // the start goes: the middle row is kept, and everything after the
    // first row that is young enough.
    let seqs = ids(&sql, "SELECT seq FROM issue_transition ORDER BY seq").await;
    let middle = seqs[25];
    backdate_log(&sql, seqs[19], &[middle], 10).await;
    let end = *seqs.last().unwrap();
    until_published(&hub, end).await;

    db.set("log_retention_days", "7").await;
    db.set("issue_retention_days", "5").await;
    let before = everything(&sql).await;
    let (dry, _) = newsnack(&db.url, &["prune", "--dry-run"]);
    assert_eq!(everything(&sql).await, before, "a dry run changes nothing");
    let expected = serde_json::json!({
        "dry_run": true,
        // The three old DONE issues, the fatal one and the spent one.
        "issue": 5,
        "ai_article": 3,
        // Of old DONE issues (with them) and the new DONE one (its class
        // asked for long ago); not the retryable one's nor the fresh one.
        "issue_priority": 2,
        "issue_transition": 20,
        "pipeline_run": 1,
        "llm_call": 1,
    });
    assert_eq!(dry, expected);

    let removed_before = *hub.issues_removed().borrow();
    let mut removals = hub.issues_removed();
    let (done, _) = newsnack(&db.url, &["prune"]);
    let mut expected = expected;
    expected["dry_run"] = false.into();
    assert_eq!(done, expected);

    let gone: Vec<i64> = old_done.iter().copied().chain([fatal, spent]).collect();
    assert_eq!(
        ids(&sql, "SELECT id FROM issue ORDER BY id").await,
        issues
            .iter()
            .copied()
            .filter(|id| !gone.contains(id))
            .collect::<Vec<_>>()
    );
    assert!(issues.contains(&old_pending) && issues.contains(&retryable));
    assert_eq!(
        ids(&sql, "SELECT issue_id FROM ai_article").await,
        new_done.to_vec()
    );
    let kept_log = ids(&sql, "SELECT seq FROM issue_transition ORDER BY seq").await;
    assert_eq!(kept_log, seqs[20..].to_vec(), "from the start only");
    assert!(
        kept_log.contains(&middle),
        "the old row in the middle stays"
    );
    let body: String = sql
        .query_one("SELECT body FROM briefing", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(body, "the whole briefing text");
    assert_eq!(
        ids(
            &sql,
            "SELECT issue_id FROM issue_priority ORDER BY issue_id"
        )
        .await,
        [retryable, issues[8]]
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM pipeline_run").await,
        2,
        "the running one and the recent one"
    );
    assert_eq!(db.scalar_i64("SELECT count(*) FROM llm_call").await, 1);
    // The deletion was announced, as any other.
    within(10, "the removal notice", removals.changed())
        .await
        .unwrap();
    assert!(*removals.borrow() >= removed_before);

    // Again: nothing left to remove.
    let (again, _) = newsnack(&db.url, &["prune"]);
    assert_eq!(again["issue"], 0);
    assert_eq!(again["issue_transition"], 0);
    stop.cancel();
}

#[tokio::test]
async fn forever_is_the_default_for_issues_and_zero_keeps_everything() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    let issues = db.add_issues(3).await;
    finish(&sql, &issues).await;
    sql.batch_execute(
        "UPDATE issue SET updated_at = now() - interval '1000 days';
         UPDATE issue_transition SET at = now() - interval '1000 days';",
    )
    .await
    .unwrap();
    // Defaults: issues forever, the log 30 days (its newest row stays).
    let report = prune(
        &db.pool.get().await.unwrap(),
        &Retention {
            log_days: 30,
            issue_days: 0,
            max_attempts: 3,
        },
        false,
    )
    .await
    .unwrap();
    assert_eq!(
        report,
        PruneReport {
            issue_transition: 8,
            ..PruneReport::default()
        }
    );
    assert_eq!(db.scalar_i64("SELECT count(*) FROM issue").await, 3);
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue_transition").await,
        1,
        "the newest row stays, however old"
    );
    db.set("log_retention_days", "0").await;
    let (forever, _) = newsnack(&db.url, &["prune"]);
    assert_eq!(forever["issue_transition"], 0);
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue_transition").await,
        1
    );
}

/// A live subscriber, a stream replaying the log, and a wait, all open
/// while a prune removes the log's old start and transitions keep coming:
/// the live one and the wait get every new transition once; the replaying
/// one is told of the prune and goes on from the oldest kept row with no
/// gap after it and no repeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_subscriber_a_replay_and_a_wait_open_across_a_prune_miss_and_repeat_nothing() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    let (hub, stop) = db.listener().await;
    let issues = db.add_issues(1500).await;
    let start = db.scalar_i64("SELECT max(seq) FROM issue_transition").await;
    until_published(&hub, start).await;
    // The first 1200 rows are old.
    let first = db.scalar_i64("SELECT min(seq) FROM issue_transition").await;
    backdate_log(&sql, first + 1199, &[], 10).await;

    let mut live = hub.stream_after(start, None);
    let mut replay = hub.stream_after(first - 1, None);
    // The replay reads its first page (500 rows) and delivers it before
    // the prune.
    for expected in first..first + 500 {
        match within(10, "the replay's first page", replay.next_item()).await {
            Ok(StreamItem::Transition(t)) => assert_eq!(t.seq, expected),
            other => panic!("{other:?}"),
        }
    }
    let targets = issues[1400..1403].to_vec();
    let wait = ArmedWait::arm(
        &hub,
        WaitRequest {
            issue_ids: targets.clone(),
            timeout: Duration::from_secs(60),
            min_completion: 3,
            max_attempts: 3,
        },
    )
    .await
    .unwrap();
    let cancel = CancellationToken::new();
    let waiting = tokio::spawn(async move { wait.outcome(&cancel).await });

    // The prune and a stream of transitions at once.
    let pool = db.pool.clone();
    let pruning = tokio::spawn(async move {
        let client = pool.get().await.unwrap();
        prune(
            &client,
            &Retention {
                log_days: 7,
                issue_days: 0,
                max_attempts: 3,
            },
            false,
        )
        .await
        .unwrap()
    });
    let moved: Vec<i64> = issues[1300..1450].to_vec();
    for id in &moved {
        for status in ["IN_PROGRESS", "DONE"] {
            sql.execute(
                "UPDATE issue SET processing_status = $2 WHERE id = $1",
                &[id, &status],
            )
            .await
            .unwrap();
        }
    }
    let report = within(30, "the prune", pruning).await.unwrap();
    assert_eq!(report.issue_transition, 1200);
    let end = db.scalar_i64("SELECT max(seq) FROM issue_transition").await;
    assert_eq!(end, start + 300);

    // The live subscriber: every new transition, once, in order.
    let mut seen = Vec::new();
    while seen.len() < 300 {
        seen.push(
            within(10, "a live transition", live.next())
                .await
                .unwrap()
                .seq,
        );
    }
    assert_eq!(seen, (start + 1..=end).collect::<Vec<_>>());
    assert!(live.try_next().is_none(), "nothing twice");

    // The replay: told of the prune, then on from the oldest kept row.
    let oldest = first + 1200;
    match within(10, "the prune notice", replay.next_item()).await {
        Ok(StreamItem::Pruned { oldest: told }) => assert_eq!(told, oldest),
        other => panic!("expected the prune notice, got {other:?}"),
    }
    let mut replayed = Vec::new();
    while replayed.last() != Some(&end) {
        match within(10, "the replay", replay.next_item()).await.unwrap() {
            StreamItem::Transition(t) => replayed.push(t.seq),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(replayed, (oldest..=end).collect::<Vec<_>>());

    // The wait saw its targets finish.
    let report = within(30, "the wait", waiting).await.unwrap().unwrap();
    assert_eq!(report.outcome, WaitOutcome::AllPass);
    assert_eq!(report.completed, targets);
    stop.cancel();
}

/// The replay's check catches the pruner this module exists to rule out:
/// one that deletes every old row wherever it sits. With an old row in the
/// middle of the log, deleting by age alone leaves a gap after the oldest
/// kept row, which a replay shows as a missing `seq`; the service's prune
/// of the same log leaves none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prune_by_age_alone_leaves_a_gap_that_a_replay_shows() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    let (hub, stop) = db.listener().await;
    db.add_issues(40).await;
    let seqs = ids(&sql, "SELECT seq FROM issue_transition ORDER BY seq").await;
    let end = *seqs.last().unwrap();
    until_published(&hub, end).await;
    let middle = seqs[25];
    backdate_log(&sql, seqs[19], &[middle], 10).await;

    /// What a replay from the log's start delivers after the prune notice.
    async fn replay(hub: &EventHub, end: i64) -> Vec<i64> {
        let mut stream = hub.stream_after(0, None);
        let mut seen = Vec::new();
        while seen.last() != Some(&end) {
            match within(10, "the replay", stream.next_item()).await.unwrap() {
                StreamItem::Transition(t) => seen.push(t.seq),
                StreamItem::Pruned { oldest } => assert!(seen.is_empty(), "pruned at {oldest}"),
            }
        }
        seen
    }
    fn gaps(seen: &[i64]) -> Vec<i64> {
        seen.windows(2).flat_map(|w| w[0] + 1..w[1]).collect()
    }

    // The broken variant, by raw SQL, on a copy of the log's rows put back
    // afterwards.
    sql.batch_execute(
        "CREATE TEMP TABLE kept AS SELECT * FROM issue_transition;
         DELETE FROM issue_transition WHERE at < now() - interval '7 days';",
    )
    .await
    .unwrap();
    let broken = replay(&hub, end).await;
    assert_eq!(
        gaps(&broken),
        [middle],
        "deleting by age leaves the middle row's gap"
    );
    sql.batch_execute(
        "INSERT INTO issue_transition OVERRIDING SYSTEM VALUE SELECT * FROM kept
           WHERE seq NOT IN (SELECT seq FROM issue_transition)",
    )
    .await
    .unwrap();
    assert_eq!(
        ids(&sql, "SELECT seq FROM issue_transition ORDER BY seq").await,
        seqs
    );

    let client = db.pool.get().await.unwrap();
    let report = prune(
        &client,
        &Retention {
            log_days: 7,
            issue_days: 0,
            max_attempts: 3,
        },
        false,
    )
    .await
    .unwrap();
    assert_eq!(report.issue_transition, 20);
    let kept = replay(&hub, end).await;
    assert!(gaps(&kept).is_empty(), "{:?}", gaps(&kept));
    assert_eq!(kept, seqs[20..].to_vec());
    stop.cancel();
}

/// A prune that removes every row old enough keeps the newest, so the log's
/// end is never lost: a listener that reconnects afterwards does not take
/// the log for a restored one, and a new one starts where the log ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_keeps_its_end_so_listeners_follow_across_a_prune() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    let (hub, stop) = db.listener().await;
    let issues = db.add_issues(20).await;
    let end = db.scalar_i64("SELECT max(seq) FROM issue_transition").await;
    until_published(&hub, end).await;
    sql.execute(
        "UPDATE issue_transition SET at = now() - interval '100 days'",
        &[],
    )
    .await
    .unwrap();
    let (report, _) = newsnack(&db.url, &["prune"]);
    assert_eq!(report["issue_transition"], 19);
    // Cut the listener's session: it reconnects and reads the log's end.
    let pid = hub.status().borrow().backend_pid.unwrap();
    sql.execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    let mut status = hub.status();
    within(
        30,
        "the listener to reconnect",
        status.wait_for(|s| s.connected && s.backend_pid != Some(pid)),
    )
    .await
    .unwrap();
    assert_eq!(hub.status().borrow().log_ends_before, None);
    sql.execute(
        "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = $1",
        &[&issues[0]],
    )
    .await
    .unwrap();
    until_published(&hub, end + 1).await;
    // A new listener starts at the log's end.
    let (fresh, stop_fresh) = db.listener().await;
    assert_eq!(fresh.status().borrow().last_seq, end + 1);
    stop.cancel();
    stop_fresh.cancel();
}

/// `tail --since` a position that was pruned warns on stderr and follows
/// from the oldest kept transition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_from_a_pruned_position_warns_and_follows_from_the_oldest_kept() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    db.add_issues(10).await;
    let seqs = ids(&sql, "SELECT seq FROM issue_transition ORDER BY seq").await;
    backdate_log(&sql, seqs[5], &[], 100).await;
    newsnack(&db.url, &["prune"]);
    let oldest = seqs[6];
    let mut tail = Command::new(env!("CARGO_BIN_EXE_newsnack"))
        .args(["tail", "--json", "--since", &seqs[1].to_string()])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines_of = |pipe: Box<dyn std::io::Read + Send>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        rx
    };
    let stderr = lines_of(Box::new(tail.stderr.take().unwrap()));
    let stdout = lines_of(Box::new(tail.stdout.take().unwrap()));
    let deadline = Duration::from_secs(30);
    let warning = tokio::task::block_in_place(|| stderr.recv_timeout(deadline));
    let printed: Vec<i64> = (0..4)
        .map(|_| {
            let line = tokio::task::block_in_place(|| stdout.recv_timeout(deadline))
                .expect("a transition");
            serde_json::from_str::<Value>(&line).unwrap()["seq"]
                .as_i64()
                .unwrap()
        })
        .collect();
    unsafe {
        libc::kill(tail.id() as i32, libc::SIGINT);
    }
    let status = tokio::task::block_in_place(|| tail.wait().unwrap());
    let warning = warning.expect("a warning on stderr");
    assert!(
        warning.contains(&format!("before seq {oldest} were pruned")),
        "{warning}"
    );
    assert_eq!(printed, seqs[6..].to_vec());
    assert!(status.success(), "{status:?}");
}

/// `serve` prunes at start-up and then hourly, holding the `prune` lock on
/// a session of its own; a second instance does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_prunes_by_itself_on_one_instance() {
    let db = TestDb::new().await;
    let sql = db.raw().await;
    db.add_issues(10).await;
    sql.execute(
        "UPDATE issue_transition SET at = now() - interval '100 days' WHERE seq < 6",
        &[],
    )
    .await
    .unwrap();
    let writer = Arc::new(OfflineWriter) as SharedWriter;
    let first = db.serve("pruner-a", writer.clone()).await;
    until_sql_polled(&db, 30, "SELECT count(*) = 5 FROM issue_transition").await;
    // The prune shows in the metrics: the rows per table and when it ended.
    let metric = |text: &str, series: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or(0.0)
    };
    within(30, "the prune's metrics", async {
        loop {
            let text = newsnack::metrics::render().unwrap();
            if metric(&text, "newsnack_last_prune_timestamp_seconds ") > 0.0 {
                return text;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let text = newsnack::metrics::render().unwrap();
    assert!(
        metric(
            &text,
            "newsnack_pruned_rows_total{table=\"issue_transition\"} "
        ) >= 5.0,
        "{text}"
    );
    assert!(
        text.contains("newsnack_pruned_rows_total{table=\"issue\"} "),
        "{text}"
    );
    assert!(
        text.contains("newsnack_last_prune_duration_seconds "),
        "{text}"
    );
    let second = db.serve("pruner-b", writer).await;
    let holders = || async {
        let rows = sql
            .query(
                "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                  WHERE l.locktype = 'advisory' AND l.granted
                    AND ((l.classid::bigint << 32) | l.objid::bigint) = $1",
                &[&newsnack::db::advisory::PRUNE],
            )
            .await
            .unwrap();
        rows.iter().map(|r| r.get(0)).collect::<Vec<String>>()
    };
    let held = holders().await;
    assert_eq!(held.len(), 1, "{held:?}");
    assert!(
        held[0].starts_with("newsnack-lock:prune:") && held[0].ends_with(":pruner-a"),
        "{held:?}"
    );
    let locks = Command::new(env!("CARGO_BIN_EXE_newsnack"))
        .arg("locks")
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&locks.stdout);
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with("prune ") && l.contains("pruner-a")),
        "{listed}"
    );
    second.stop().await.unwrap();
    first.stop().await.unwrap();
}
