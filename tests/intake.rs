//! Idempotent intake: `POST /issues` and `issues add` with a `source_key`
//! add a story once and answer the existing issue after that (`existing`,
//! 201 when anything was added, 200 when nothing was); a key repeated in one
//! request counts once; keys out of bounds are refused; and 16 posters of
//! one new key at once make exactly one issue, where without the unique
//! constraint a check-then-insert makes duplicates.

mod common;

use std::process::Command;
use std::sync::Arc;

use common::TestDb;
use newsnack::writer::{OfflineWriter, SharedWriter};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::Barrier;

fn offline() -> SharedWriter {
    Arc::new(OfflineWriter) as SharedWriter
}

async fn post(http: &reqwest::Client, url: &str, body: Value) -> (StatusCode, Value) {
    let response = http.post(url).json(&body).send().await.unwrap();
    let status = response.status();
    (status, response.json().await.unwrap())
}

/// `n` Hangul syllables (three bytes each in UTF-8) in an order that does
/// not compress, so the unique index sees every byte.
fn hangul(n: usize) -> String {
    (0..n)
        .map(|i| char::from_u32(0xAC00 + (i as u32 * 7919) % 11172).unwrap())
        .collect()
}

fn ids(answer: &Value, field: &str) -> Vec<i64> {
    answer[field]
        .as_array()
        .unwrap_or_else(|| panic!("no {field} in {answer}"))
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect()
}

#[tokio::test]
async fn a_known_key_answers_the_existing_issue_and_adds_nothing() {
    let db = TestDb::new().await;
    let service = db.serve("intake", offline()).await;
    let url = format!("http://{}/issues", service.addr);
    let http = reqwest::Client::new();

    let (status, first) = post(
        &http,
        &url,
        json!({"issues": [
            {"title": "Rates rise", "source_key": "wire:1"},
            {"title": "No key"},
            {"title": "Rates rise, again in the same request", "source_key": "wire:1"},
            {"title": "Storm", "source_key": "wire:2"},
        ]}),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    let added = ids(&first, "ids");
    assert_eq!(added.len(), 4);
    assert_eq!(
        added[0], added[2],
        "a key repeated in one request counts once"
    );
    assert!(added[0] < added[1] && added[1] < added[3], "{added:?}");
    assert_eq!(ids(&first, "existing"), Vec::<i64>::new());

    // Mixed: something new, so 201; the known keys answer their issues.
    let (status, mixed) = post(
        &http,
        &url,
        json!({"issues": [
            {"title": "Storm, resent", "source_key": "wire:2"},
            {"title": "Quake", "source_key": "wire:3"},
            {"title": "Rates rise, resent", "source_key": "wire:1"},
        ]}),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{mixed}");
    let answered = ids(&mixed, "ids");
    assert_eq!((answered[0], answered[2]), (added[3], added[0]));
    assert!(answered[1] > added[3]);
    assert_eq!(ids(&mixed, "existing"), [added[3], added[0]]);

    // Nothing new: 200.
    let (status, again) = post(
        &http,
        &url,
        json!({"issues": [{"title": "Quake, resent", "source_key": "wire:3"}]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(ids(&again, "ids"), [answered[1]]);
    assert_eq!(ids(&again, "existing"), [answered[1]]);

    // One issue per key and one without, their first titles kept, each
    // logged once.
    let rows: Vec<(String, Option<String>)> = db
        .raw()
        .await
        .query("SELECT title, source_key FROM issue ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let key = |k: &str| Some(k.to_string());
    assert_eq!(
        rows,
        [
            ("Rates rise".to_string(), key("wire:1")),
            ("No key".to_string(), None),
            ("Storm".to_string(), key("wire:2")),
            ("Quake".to_string(), key("wire:3")),
        ]
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue_transition").await,
        4
    );
    let shown: Value = http
        .get(format!("http://{}/issues/{}", service.addr, added[0]))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(shown["source_key"], "wire:1");
    service.stop().await.unwrap();
}

#[tokio::test]
async fn keys_out_of_bounds_are_refused_and_nothing_is_added() {
    let db = TestDb::new().await;
    let service = db.serve("intake-bounds", offline()).await;
    let url = format!("http://{}/issues", service.addr);
    let http = reqwest::Client::new();
    for (key, says) in [
        (
            json!(""),
            "issues[1].source_key must be 1 to 1000 characters long, got 0",
        ),
        (
            json!("k".repeat(1001)),
            "issues[1].source_key must be 1 to 1000 characters long, got 1001",
        ),
        (
            json!(hangul(683)),
            "issues[1].source_key must be at most 2048 bytes in UTF-8 (the unique index's limit), got 2049",
        ),
        (json!(7), "source_key"),
        (json!("a\u{0}b"), "NUL"),
    ] {
        let (status, answer) = post(
            &http,
            &url,
            json!({"issues": [{"title": "fine", "source_key": "ok"}, {"title": "t", "source_key": key}]}),
        )
        .await;
        assert!(status.is_client_error(), "{key}: {status} {answer}");
        let error = answer["error"].as_str().unwrap();
        assert!(error.contains(says), "{key}: {error}");
    }
    // The longest key, of syllables that do not compress, fits the unique
    // index; null is no key.
    let (status, answer) = post(
        &http,
        &url,
        json!({"issues": [{"title": "long", "source_key": hangul(682)},
                          {"title": "null", "source_key": null}]}),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{answer}");
    assert_eq!(db.scalar_i64("SELECT count(*) FROM issue").await, 2);
    service.stop().await.unwrap();
}

/// Sixteen collectors post the same new story at the same moment, twenty
/// times over: each time exactly one issue is made, one poster gets 201
/// and the others 200 with that issue's id in `ids` and in `existing`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_posters_of_one_new_key_make_exactly_one_issue() {
    const POSTERS: usize = 16;
    const ROUNDS: usize = 20;
    let db = TestDb::new().await;
    let service = db.serve("intake-race", offline()).await;
    let url = format!("http://{}/issues", service.addr);
    for round in 0..ROUNDS {
        let key = format!("race:{round}");
        let start = Arc::new(Barrier::new(POSTERS));
        let posters: Vec<_> = (0..POSTERS)
            .map(|poster| {
                let (url, key, start) = (url.clone(), key.clone(), start.clone());
                tokio::spawn(async move {
                    // A client (connection) of its own per poster.
                    let http = reqwest::Client::new();
                    let body = json!({"issues": [{"title": format!("story by {poster}"), "source_key": key}]});
                    start.wait().await;
                    post(&http, &url, body).await
                })
            })
            .collect();
        let mut created = Vec::new();
        let mut answered = Vec::new();
        for poster in posters {
            let (status, answer) = poster.await.unwrap();
            match status {
                StatusCode::CREATED => {
                    assert_eq!(ids(&answer, "existing"), Vec::<i64>::new());
                    created.push(ids(&answer, "ids")[0]);
                }
                StatusCode::OK => assert_eq!(ids(&answer, "existing"), ids(&answer, "ids")),
                other => panic!("round {round}: {other} {answer}"),
            }
            answered.push(ids(&answer, "ids")[0]);
        }
        assert_eq!(created.len(), 1, "round {round}: {created:?}");
        assert!(
            answered.iter().all(|&id| id == created[0]),
            "round {round}: {answered:?}"
        );
        let made = db
            .scalar_i64(&format!(
                "SELECT count(*) FROM issue WHERE source_key = '{key}'"
            ))
            .await;
        assert_eq!(made, 1, "round {round}");
    }
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue").await,
        ROUNDS as i64
    );
    service.stop().await.unwrap();
}

/// The race the constraint rules out, shown by the same count: without
/// it, sixteen posters that each check for the key and insert when it is
/// missing (one statement each, as a careful collector might write it)
/// make the story more than once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn check_then_insert_without_the_constraint_makes_duplicates() {
    const POSTERS: usize = 16;
    const ROUNDS: usize = 20;
    let db = TestDb::new().await;
    db.raw()
        .await
        .batch_execute("ALTER TABLE issue DROP CONSTRAINT issue_source_key_key")
        .await
        .unwrap();
    let mut clients = Vec::new();
    for _ in 0..POSTERS {
        clients.push(Arc::new(db.raw().await));
    }
    let mut duplicated = 0;
    for round in 0..ROUNDS {
        let key = format!("race:{round}");
        let start = Arc::new(Barrier::new(POSTERS));
        let posters: Vec<_> = clients
            .iter()
            .map(|client| {
                let (client, key, start) = (client.clone(), key.clone(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    client
                        .execute(
                            "INSERT INTO issue (title, source_key)
                             SELECT 'story', $1::text
                              WHERE NOT EXISTS (SELECT 1 FROM issue WHERE source_key = $1)",
                            &[&key],
                        )
                        .await
                        .unwrap()
                })
            })
            .collect();
        for poster in posters {
            poster.await.unwrap();
        }
        let made = db
            .scalar_i64(&format!(
                "SELECT count(*) FROM issue WHERE source_key = '{key}'"
            ))
            .await;
        assert!(made >= 1);
        if made > 1 {
            duplicated += 1;
        }
    }
    assert!(
        duplicated > 0,
        "check-then-insert should make some story twice in {ROUNDS} rounds"
    );
}

#[tokio::test]
async fn issues_add_takes_a_source_key_on_the_command_line_and_in_a_file() {
    let db = TestDb::new().await;
    let add = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_newsnack"))
            .args(["issues", "add"])
            .args(args)
            .env("DATABASE_URL", &db.url)
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let first = add(&["--title", "Rates rise", "--source-key", "wire:1"]);
    let id = ids(&first, "ids")[0];
    assert_eq!(ids(&first, "existing"), Vec::<i64>::new());
    let again = add(&["--title", "Rates rise", "--source-key", "wire:1"]);
    assert_eq!(
        (ids(&again, "ids"), ids(&again, "existing")),
        (vec![id], vec![id])
    );

    let file = std::env::temp_dir().join(format!("newsnack-intake-{}.json", db.name));
    std::fs::write(
        &file,
        json!([{"title": "resent", "source_key": "wire:1"}, {"title": "new", "source_key": "wire:2"}])
            .to_string(),
    )
    .unwrap();
    let from_file = add(&["--file", file.to_str().unwrap()]);
    std::fs::remove_file(&file).unwrap();
    let both = ids(&from_file, "ids");
    assert_eq!(both[0], id);
    assert!(both[1] > id);
    assert_eq!(ids(&from_file, "existing"), [id]);

    let bad = Command::new(env!("CARGO_BIN_EXE_newsnack"))
        .args(["issues", "add", "--title", "t", "--source-key", ""])
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("source_key must be 1 to 1000"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    assert_eq!(db.scalar_i64("SELECT count(*) FROM issue").await, 2);
}
