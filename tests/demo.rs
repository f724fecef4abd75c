//! `newsnack demo` with no configuration at all: no DATABASE_URL, no LLM.
//! It must succeed and its output must show the transitions, the retry,
//! the smart-wait outcome and the briefing. With DATABASE_URL, it runs in a
//! throwaway database on that server and leaves the named one untouched.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use common::{process, TestDb};

#[test]
fn the_demo_runs_with_no_configuration_and_tells_the_whole_story() {
    let out = process::binary(&["demo"])
        .env_remove("DATABASE_URL")
        .env_remove("NEWSNACK_LLM_URL")
        .env_remove("RUST_LOG")
        .output()
        .expect("run the demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for expected in [
        "(new)       -> PENDING",
        "PENDING     -> IN_PROGRESS",
        "IN_PROGRESS -> FAILED",
        "FAILED      -> IN_PROGRESS",
        "IN_PROGRESS -> DONE",
        "Smart wait outcome: all_pass",
        "# newsnack",
        "## 1. Central bank raises its policy rate by half a point",
        "throwaway database is stopped and deleted",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
}

/// A Ctrl-C (here SIGTERM) while the throwaway cluster is still starting
/// must not leave its directory behind: the demo waits for the cluster to
/// be up, then stops and deletes it.
#[test]
fn an_interrupted_demo_leaves_no_cluster_behind() {
    use std::os::unix::fs::PermissionsExt;

    // A temporary directory of its own, so what is left in it is the demo's
    // (open to the unprivileged user the cluster runs as).
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut child = process::binary(&["demo"])
        .env_remove("DATABASE_URL")
        .env_remove("NEWSNACK_LLM_URL")
        .env("TMPDIR", tmp.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the demo");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let starting = lines
        .next()
        .expect("a first line")
        .expect("readable output");
    assert!(
        starting.contains("starting a throwaway PostgreSQL"),
        "{starting}"
    );
    // SAFETY: signalling a child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let rest: Vec<String> = lines.map_while(Result::ok).collect();

    let (done_tx, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || done_tx.send(child.wait()));
    let status = done
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the demo to exit")
        .unwrap();
    assert!(status.success(), "{status:?}: {rest:?}");
    assert!(
        rest.iter().any(|l| l.contains("stopped and deleted")),
        "{rest:?}"
    );
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// Everything of the database DATABASE_URL names that the demo could
/// change: its issues, settings, briefings and runs.
async fn contents(db: &TestDb) -> String {
    db.raw()
        .await
        .query_one(
            "SELECT concat_ws(' | ',
                    (SELECT string_agg(id || ':' || processing_status, ',' ORDER BY id) FROM issue),
                    (SELECT string_agg(key || '=' || value, ',' ORDER BY key) FROM setting),
                    (SELECT count(*) FROM briefing),
                    (SELECT count(*) FROM pipeline_run),
                    (SELECT count(*) FROM issue_transition))",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The name of the throwaway database from the demo's `database:` line.
fn throwaway_name(stdout: &str) -> String {
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("database:"))
        .unwrap_or_else(|| panic!("no database line in:\n{stdout}"));
    let name = line.trim_start()["database:".len()..]
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    assert!(name.starts_with("newsnack_demo_"), "{line}");
    name
}

async fn database_exists(db: &TestDb, name: &str) -> bool {
    db.raw()
        .await
        .query_one(
            "SELECT count(*) > 0 FROM pg_database WHERE datname = $1",
            &[&name],
        )
        .await
        .unwrap()
        .get(0)
}

/// With DATABASE_URL set, the demo runs on that server in a throwaway
/// database of its own, which it drops at the end: the database named in
/// the URL, already in use (an issue, a tuned setting), is left exactly as
/// it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_database_url_the_demo_leaves_the_named_database_untouched() {
    let db = TestDb::new().await;
    db.add_issues(1).await;
    db.set("retry_backoff_ms", "1234").await;
    let before = contents(&db).await;
    let out = tokio::task::block_in_place(|| {
        process::command(&db.url, &["demo"])
            .env_remove("NEWSNACK_LLM_URL")
            .env_remove("RUST_LOG")
            .output()
            .expect("run the demo")
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("creating a throwaway database on DATABASE_URL's server")
            && !stdout.contains("starting a throwaway PostgreSQL"),
        "{stdout}"
    );
    let name = throwaway_name(&stdout);
    for expected in [
        "FAILED      -> IN_PROGRESS",
        "Smart wait outcome: all_pass",
        "## 1. Central bank raises its policy rate by half a point",
        &format!("Done: the throwaway database {name} is dropped."),
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
    assert_eq!(contents(&db).await, before);
    assert!(!database_exists(&db, &name).await, "{name} is left behind");
}

/// A Ctrl-C (here SIGTERM) in the middle of a demo on DATABASE_URL's
/// server still drops its throwaway database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_demo_drops_its_throwaway_database() {
    let db = TestDb::new().await;
    let before = contents(&db).await;
    let mut child = process::command(&db.url, &["demo"])
        .env_remove("NEWSNACK_LLM_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the demo");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // Up to the run's start: the database exists and is in use.
    let seen = tokio::task::block_in_place(|| {
        let mut seen = String::new();
        for line in lines.by_ref().map_while(Result::ok) {
            seen.push_str(&line);
            seen.push('\n');
            if line.contains("Transitions as they commit") {
                break;
            }
        }
        seen
    });
    let name = throwaway_name(&seen);
    assert!(database_exists(&db, &name).await);
    // SAFETY: signalling a child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let rest: Vec<String> = tokio::task::block_in_place(|| lines.map_while(Result::ok).collect());
    let status = tokio::task::block_in_place(|| child.wait()).unwrap();
    assert!(
        !rest.iter().any(|l| l.contains("── briefing #")),
        "the demo finished before the signal, so this shows nothing: {rest:?}"
    );
    assert!(
        rest.iter()
            .any(|l| l.contains(&format!("the throwaway database {name} is dropped"))),
        "{status:?}: {rest:?}"
    );
    assert!(!database_exists(&db, &name).await, "{name} is left behind");
    assert_eq!(contents(&db).await, before);
}
