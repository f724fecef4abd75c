//! `newsnack demo` with no configuration at all: no DATABASE_URL, no LLM.
//! It must succeed and its output must show the transitions, the retry,
//! the smart-wait outcome and the briefing.

use std::process::Command;

#[test]
fn the_demo_runs_with_no_configuration_and_tells_the_whole_story() {
    let out = Command::new(env!("CARGO_BIN_EXE_newsnack"))
        .arg("demo")
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
    use std::io::{BufRead, BufReader};
    use std::os::unix::fs::PermissionsExt;
    use std::process::Stdio;

    // A temporary directory of its own, so what is left in it is the demo's
    // (open to the unprivileged user the cluster runs as).
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_newsnack"))
        .arg("demo")
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
