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
