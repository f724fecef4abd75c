//! Anyone who can connect can `NOTIFY` any channel. A notification on
//! `issue_transition` is a doorbell: the listener reads the log, and only
//! what the log holds reaches subscribers. Forged notifications naming the
//! next `seq`, one far ahead, one behind and an unreadable one reach no
//! subscriber (the hub, the gapless stream, `GET /events`, `newsnack tail`,
//! a smart wait), and the real transition that later takes the forged `seq`
//! is published like any other. The same forgery fools a listener that
//! trusts payloads, which shows the test can fail. A payload is trusted
//! only with the MAC the log's trigger signs it with (migration 18): one
//! signed with another key, or with the MAC of another payload, is a
//! doorbell like any other.

mod common;

use std::sync::Arc;

use common::subscribers::Recording;
use common::{login_role, until_published, within, TestDb};
use newsnack::events::listener::ListenerOptions;
use newsnack::model::status::Status;
use newsnack::model::transition::NotificationKey;
use newsnack::writer::OfflineWriter;
use serde_json::json;

/// A session of a role with no privileges at all: NOTIFY needs none.
async fn forger(db: &TestDb) -> tokio_postgres::Client {
    let sql = db.raw().await;
    login_role(&sql, "forger").await;
    let mut config = db.config.clone();
    config.user("forger");
    let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

/// Sends the forgeries: `victim` `IN_PROGRESS -> DONE` under the next
/// `seq`, the same far ahead and behind, each unsigned, signed with a key
/// of the forger's and with a MAC made up, and a payload that is not JSON.
async fn forge(forger: &tokio_postgres::Client, last_seq: i64, victim: i64) {
    let forgers_key = NotificationKey::new(&[0x42; 32]);
    for seq in [last_seq + 1, last_seq + 1_000_000, (last_seq - 1).max(1)] {
        let payload = json!({
            "seq": seq, "issue_id": victim, "from": "IN_PROGRESS", "to": "DONE",
            "at": "2026-12-01T00:00:00Z", "attempts": 1, "fatal": false,
        })
        .to_string();
        let made_up = format!(
            "{}, \"mac\" : \"{}\"}}",
            payload.strip_suffix('}').unwrap(),
            "ab".repeat(32)
        );
        for forged in [payload.clone(), forgers_key.sign(&payload), made_up] {
            forger
                .execute("SELECT pg_notify('issue_transition', $1)", &[&forged])
                .await
                .unwrap();
        }
    }
    forger
        .execute("SELECT pg_notify('issue_transition', 'not json')", &[])
        .await
        .unwrap();
}

/// Forges, then makes two real transitions; returns the log position
/// before, the issues, and the first two transitions a subscriber of a
/// listener started with `options` saw.
async fn what_a_subscriber_sees(
    options: ListenerOptions,
) -> (i64, Vec<i64>, Vec<(i64, i64, Status)>) {
    let db = TestDb::new().await;
    let ids = db.add_issues(2).await;
    db.move_with_sql(&[ids[0]], &["IN_PROGRESS"]).await;
    let (hub, stop) = db.listener_with(options).await;
    let start = hub.status().borrow().last_seq;
    let mut live = hub.subscribe();
    forge(&forger(&db).await, start, ids[0]).await;
    // Notifications are delivered in commit order: these come after the
    // forgeries.
    db.move_with_sql(&[ids[1]], &["IN_PROGRESS", "DONE"]).await;
    let mut seen = Vec::new();
    for _ in 0..2 {
        let t = within(20, "two transitions", live.recv()).await.unwrap();
        seen.push((t.seq, t.issue_id, t.to));
    }
    stop.cancel();
    (start, ids, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_notifications_reach_no_subscriber_and_hide_no_real_transition() {
    let (start, ids, seen) = what_a_subscriber_sees(ListenerOptions::default()).await;
    assert_eq!(
        seen,
        vec![
            (start + 1, ids[1], Status::InProgress),
            (start + 2, ids[1], Status::Done)
        ],
        "exactly the log"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_that_trusts_payloads_is_fooled_by_the_same_forgery() {
    let (start, ids, seen) = what_a_subscriber_sees(ListenerOptions {
        trust_payloads: true,
        ..ListenerOptions::default()
    })
    .await;
    assert_eq!(
        seen,
        vec![
            (start + 1, ids[0], Status::Done),
            (start + 2, ids[1], Status::Done)
        ],
        "the forgery is published under the next seq, and the real transition that takes it is lost"
    );
}

/// The service end to end: the event stream, the tail and a smart wait
/// see only the log. The wait's target gets a forged `DONE` first and then
/// really fails for good: a wait settled by the forgery would answer
/// `all_pass`, the real answer is `skip`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_the_tail_and_a_wait_see_only_the_log() {
    let db = TestDb::new().await;
    let ids = db.add_issues(2).await;
    db.move_with_sql(&[ids[0]], &["IN_PROGRESS"]).await;
    let service = db.serve("doorbell", Arc::new(OfflineWriter)).await;
    let start = db.scalar_i64("SELECT max(seq) FROM issue_transition").await;
    until_published(&service.hub, start).await;
    let base = format!("http://{}", service.addr);
    let subscribers = service.hub.subscriber_count();
    let watches = service.hub.watch_count();
    let sse = Recording::follow_sse("sse", vec![base.clone()], start);
    let tail = Recording::follow_tail("tail", &db.url, start);
    let http = reqwest::Client::new();
    let wait = {
        let (http, base, target) = (http.clone(), base.clone(), ids[0]);
        tokio::spawn(async move {
            http.post(format!("{base}/waits"))
                .json(&json!({"issue_ids": [target], "timeout_s": 120, "min_completion": 1}))
                .send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()
        })
    };
    // The forgeries must come after the stream subscribed and the wait
    // watches its target, and after the tail's listener started
    // (its pool session and its listening session are up).
    let tail_sessions = format!(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = '{}' AND application_name = 'newsnack-cli'",
        db.name
    );
    within(30, "the stream, the wait and the tail to follow", async {
        while service.hub.subscriber_count() < subscribers + 1
            || service.hub.watch_count() < watches + 1
            || db.scalar_i64(&tail_sessions).await < 2
        {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    forge(&forger(&db).await, start, ids[0]).await;
    db.move_with_sql(&[ids[1]], &["IN_PROGRESS"]).await;
    db.raw()
        .await
        .execute(
            "UPDATE issue SET processing_status = 'FAILED', last_error = 'off-topic',
                    retry_not_before = 'infinity' WHERE id = $1",
            &[&ids[0]],
        )
        .await
        .unwrap();
    let answer = within(30, "the wait's answer", wait).await.unwrap();
    assert_eq!(answer["outcome"], "skip", "{answer}");
    assert_eq!(answer["failed"], json!([ids[0]]), "{answer}");
    for recording in [&sse, &tail] {
        assert!(
            recording.reaches(start + 2, 30).await,
            "{} follows the log",
            recording.name
        );
        assert_eq!(
            recording.seen(),
            vec![start + 1, start + 2],
            "{} saw exactly the log",
            recording.name
        );
    }
    service.stop().await.unwrap();
}

/// The key in the database, as the owner reads it.
async fn key_in(db: &TestDb) -> NotificationKey {
    let key: Vec<u8> = db
        .raw()
        .await
        .query_one("SELECT key FROM notification_key", &[])
        .await
        .unwrap()
        .get(0);
    NotificationKey::new(&key)
}

/// A plain session of its own that `LISTEN`s on `issue_transition`, and the
/// payloads it receives, in order.
async fn listening(
    db: &TestDb,
) -> (
    tokio_postgres::Client,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let (client, mut connection) = db.config.connect(tokio_postgres::NoTls).await.unwrap();
    let (tx, notes) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = futures::StreamExt::next(&mut messages).await {
            if let tokio_postgres::AsyncMessage::Notification(n) = message {
                let _ = tx.send(n.payload().to_string());
            }
        }
    });
    client
        .batch_execute("LISTEN issue_transition")
        .await
        .unwrap();
    (client, notes)
}

/// What the trigger signs, the listener verifies: the payload a plain
/// `LISTEN` session receives checks out with the owner's key and says what
/// the log holds; after the key is rotated, the old key no longer verifies
/// and the listener still publishes every transition, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trigger_signs_with_the_owners_key_and_a_rotation_loses_nothing() {
    let db = TestDb::new().await;
    let ids = db.add_issues(2).await;
    let (_session, mut notes) = listening(&db).await;
    let (hub, stop) = db.listener().await;
    let mut live = hub.subscribe();
    let old_key = key_in(&db).await;

    db.move_with_sql(&[ids[0]], &["IN_PROGRESS"]).await;
    let payload = within(10, "a notification", notes.recv()).await.unwrap();
    let signed = old_key.verify(&payload).expect("signed with the key");
    let published = within(10, "published", live.recv()).await.unwrap();
    assert_eq!(signed, published, "the payload says what the log holds");

    db.raw()
        .await
        .batch_execute("SELECT newsnack_rotate_notification_key()")
        .await
        .unwrap();
    let new_key = key_in(&db).await;
    db.move_with_sql(&[ids[0]], &["DONE"]).await;
    db.move_with_sql(&[ids[1]], &["IN_PROGRESS", "DONE"]).await;
    let mut after = Vec::new();
    for _ in 0..3 {
        let payload = within(10, "a notification", notes.recv()).await.unwrap();
        assert_eq!(old_key.verify(&payload), None, "{payload}");
        after.push(new_key.verify(&payload).expect("signed with the new key"));
    }
    let newest = db.scalar_i64("SELECT max(seq) FROM issue_transition").await;
    let mut last = 0;
    for expected in after {
        let published = within(10, "published", live.recv()).await.unwrap();
        assert_eq!(published, expected);
        last = published.seq;
    }
    assert_eq!(last, newest, "every transition of the log was published");
    stop.cancel();
}

/// Migration 19 writes the payload out by hand rather than with
/// `json_build_object`: what it signs must be that function's very text,
/// for a first transition (`from` null) and later ones alike.
#[tokio::test]
async fn the_signed_payload_is_the_text_json_build_object_gave() {
    let db = TestDb::new().await;
    let (client, mut notes) = listening(&db).await;
    let key = key_in(&db).await;
    let id = db.add_issues(1).await[0];
    db.move_with_sql(&[id], &["IN_PROGRESS", "FAILED"]).await;
    for _ in 0..3 {
        let payload = within(10, "a notification", notes.recv()).await.unwrap();
        let seq = key.verify(&payload).expect("signed").seq;
        let mac_at = payload.rfind(", \"mac\" : \"").expect("a MAC");
        let signed = format!("{}}}", &payload[..mac_at]);
        let built: String = client
            .query_one(
                "SELECT json_build_object('seq', seq, 'issue_id', issue_id, 'from', from_status,
                        'to', to_status, 'at', at, 'attempts', attempts, 'fatal', fatal)::text
                   FROM issue_transition WHERE seq = $1",
                &[&seq],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(signed, built);
    }
}
