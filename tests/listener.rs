//! The one listener survives losing its session: killed with
//! `pg_terminate_backend` again and again while transitions keep
//! committing, it reconnects, catches up from the log, and subscribers see
//! every transition exactly once, in order.

mod common;

use std::time::Duration;

use common::{first_column, move_on, refusal, within, TestDb};
use newsnack::events::listener::ListenerOptions;
use newsnack::settings::SettingsCache;

const TRANSITIONS: usize = 400;
const KILLS: u64 = 5;

fn quick_reconnects() -> ListenerOptions {
    ListenerOptions {
        backoff_min: Duration::from_millis(10),
        backoff_max: Duration::from_millis(200),
        ..ListenerOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_miss_nothing_and_see_nothing_twice_across_backend_kills() {
    let db = TestDb::new().await;
    let ids = db.add_issues(TRANSITIONS).await;
    let (hub, stop) = db.listener_with(quick_reconnects()).await;
    let start_seq = hub.status().borrow().last_seq;
    let mut live = hub.subscribe();

    // Another system claims every issue, one transaction each.
    let writing = db.claim_one_by_one(ids).await;

    // Meanwhile the listener's backend is terminated, again and again.
    let killer_db = db.raw().await;
    let mut status = hub.status();
    let killing = tokio::spawn(async move {
        for _ in 0..KILLS {
            let pid = within(20, "the listener to connect", async {
                loop {
                    if let Some(pid) = status.borrow_and_update().backend_pid {
                        return pid;
                    }
                    status.changed().await.unwrap();
                }
            })
            .await;
            let killed: bool = killer_db
                .query_one("SELECT pg_terminate_backend($1)", &[&pid])
                .await
                .unwrap()
                .get(0);
            assert!(killed);
            within(20, "the listener to notice", async {
                loop {
                    if status.borrow_and_update().backend_pid != Some(pid) {
                        return;
                    }
                    status.changed().await.unwrap();
                }
            })
            .await;
        }
    });

    let mut seen = Vec::new();
    within(60, "every transition", async {
        while seen.len() < TRANSITIONS {
            seen.push(live.recv().await.expect("no lag, no close"));
        }
    })
    .await;
    writing.await.unwrap();
    killing.await.unwrap();

    let client = db.pool.get().await.unwrap();
    let logged: Vec<i64> = first_column(
        &client,
        "SELECT seq FROM issue_transition WHERE seq > $1 ORDER BY seq",
        &[&start_seq],
    )
    .await;
    let seqs: Vec<i64> = seen.iter().map(|t| t.seq).collect();
    assert_eq!(seqs, logged, "exactly the log, in order, once each");
    assert!(
        hub.status().borrow().reconnects >= KILLS,
        "{:?}",
        hub.status().borrow()
    );
    stop.cancel();
}

/// When the settings must be re-read and no connection is free, the
/// callers wait for the pool side by side (each at most the pool's
/// timeout), not one after another behind the cache's lock.
#[tokio::test]
async fn settings_reads_wait_for_the_pool_side_by_side() {
    let db = TestDb::new().await;
    let pool = db.pool_of_one(Duration::from_secs(60));
    let (announce, changes) = tokio::sync::watch::channel(0u64);
    let cache = std::sync::Arc::new(SettingsCache::new(pool.clone(), changes));
    cache.get().await.unwrap();
    db.set("top_k", "7").await;
    announce.send_replace(1);
    let busy = pool.get().await.unwrap();
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let cache = cache.clone();
            tokio::spawn(async move { cache.get().await })
        })
        .collect();
    within(10, "three reads waiting for the pool at once", async {
        while pool.status().waiting < 3 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    drop(busy);
    for reader in readers {
        let settings = within(10, "a settings read", reader)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(settings.top_k, 7);
    }
}

/// Emptying the table puts every setting back to its default, and is
/// announced like any change, so the services' caches follow.
#[tokio::test]
async fn emptying_the_settings_is_announced_and_brings_back_the_defaults() {
    let db = TestDb::new().await;
    db.set("top_k", "7").await;
    let (hub, stop) = db.listener().await;
    let cache = newsnack::settings::SettingsCache::new(db.pool.clone(), hub.settings_changed());
    assert_eq!(cache.get().await.unwrap().top_k, 7);
    let mut changes = hub.settings_changed();
    changes.borrow_and_update();
    db.raw()
        .await
        .batch_execute("TRUNCATE setting")
        .await
        .unwrap();
    within(10, "the settings notification", changes.changed())
        .await
        .unwrap();
    assert_eq!(
        cache.get().await.unwrap().top_k,
        newsnack::settings::Settings::default().top_k
    );
    stop.cancel();
}

#[tokio::test]
async fn settings_changes_are_announced_to_the_hub() {
    let db = TestDb::new().await;
    let (hub, stop) = db.listener().await;
    let mut changes = hub.settings_changed();
    changes.borrow_and_update();
    let sql = db.raw().await;
    sql.execute("UPDATE setting SET value='7' WHERE key='top_k'", &[])
        .await
        .unwrap();
    within(10, "the settings notification", changes.changed())
        .await
        .unwrap();
    let bad = refusal(&sql, "UPDATE setting SET value='zero' WHERE key='top_k'").await;
    assert!(bad.contains("whole number"));
    let unknown = refusal(
        &sql,
        "INSERT INTO setting (key, value) VALUES ('nope', '1')",
    )
    .await;
    assert!(unknown.contains("unknown setting"));
    assert_eq!(
        db.scalar_i64("SELECT value::bigint FROM setting WHERE key='top_k'")
            .await,
        7
    );
    stop.cancel();
}

/// Transitions committed while the listener is away, followed by silence,
/// still reach subscribers: a new session reads the log from the last
/// published `seq` before it waits for notifications. (Without that read,
/// nothing would ring until the next transition, and this test times out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transitions_committed_during_an_outage_arrive_without_another_one() {
    let db = TestDb::new().await;
    let ids = db.add_issues(3).await;
    let (hub, stop) = db.listener_with(quick_reconnects()).await;
    let writer = db.raw().await;
    // The listener loses its session and cannot get a new one.
    let mut status = hub.status();
    db.cut_off_listener(&hub).await;
    within(
        20,
        "the listener to notice",
        status.wait_for(|s| !s.connected),
    )
    .await
    .unwrap();
    let before = status.borrow().last_seq;
    move_on(&writer, &ids, &["IN_PROGRESS"]).await;
    // Back, and then nothing more happens.
    db.admit_sessions(true).await;
    let after = within(
        30,
        "the outage's transitions to be published",
        status.wait_for(|s| s.connected && s.last_seq >= before + 3),
    )
    .await
    .unwrap()
    .last_seq;
    assert_eq!(after, before + 3);
    stop.cancel();
}
