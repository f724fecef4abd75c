//! Benchmark: what one claim costs the database, in instructions, by how
//! the statement reaches it. Prints one JSON object. Deterministic: it
//! counts instructions under valgrind (callgrind), so a busy machine slows
//! it down but does not change its figures.
//!
//! A throwaway cluster is created and migrated, given [`ISSUES`] issues,
//! and stopped; then `postgres --single` runs, under callgrind, a script of
//! [`CLAIMS`] one-id claims, each its own transaction, once per way: first
//! each on a fresh issue (with the transition triggers), then each on an
//! issue already claimed, a claim that takes nothing (most claims when
//! every client asks for the same window). The ways:
//!
//! - `prepared_generic`: a named prepared statement with a generic plan,
//!   what the service sent before it had to work through a transaction
//!   pooler (the statement is `newsnack_claim`'s, taken from the catalogue);
//! - `unnamed`: the same statement parsed and planned on every call, as an
//!   unnamed statement is (its values written into it);
//! - `function`: the call of `newsnack_claim` (migration 16), sent unnamed,
//!   whose statement keeps its generic plan in the session: what the
//!   service sends behind a transaction pooler;
//! - `kept`: the call of `newsnack_claim` prepared, the server left to
//!   choose its plans: what the service sends where no pooler stands in
//!   front (migration 22; before it, a copy of the function's statement).
//!
//! Last, fresh issues are claimed (`kept`) and completed (the call of
//! `newsnack_complete`), each statement its own transaction:
//! `instructions_per_issue_claimed_and_completed`, the two writing
//! statements' checks and rules and both transitions' records with them.
//!
//! Each script is also run with only its first [`WARM_UP`] claims; the
//! difference, divided by [`CLAIMS`], is the cost of one claim in a session
//! that has already planned what it keeps. Needs valgrind (`apt-get install
//! valgrind`). `cargo bench --bench claim_cost`; about two minutes.

mod common;

use common::{round3, start_cluster};

use std::process::{Command, Stdio};

use newsnack::embedded::{find_bin_dir, unprivileged_user, EmbeddedOptions};

const ISSUES: i64 = 20_000;
const CLAIMS: i64 = 300;
/// Claims before those counted: a session's first calls of a statement
/// are planned anew (five custom plans, then the generic one).
const WARM_UP: i64 = 10;

#[tokio::main]
async fn main() {
    assert!(
        Command::new("valgrind").arg("--version").output().is_ok(),
        "valgrind is not installed: apt-get install valgrind"
    );
    let mut cluster = start_cluster(EmbeddedOptions {
        durable: true,
        ..EmbeddedOptions::default()
    })
    .await;
    let endpoint = newsnack::db::Endpoint::parse(&cluster.url("postgres"), "bench").unwrap();
    let mut client = endpoint.connect().await.unwrap();
    newsnack::db::migrate::migrate(&mut client).await.unwrap();
    client
        .batch_execute(&format!(
            "INSERT INTO issue (title, body)
             SELECT 'issue ' || g, repeat('A sentence of the source. ', 20)
               FROM generate_series(1, {ISSUES}) g"
        ))
        .await
        .unwrap();
    client.batch_execute("VACUUM ANALYZE issue").await.unwrap();
    let source: String = client
        .query_one(
            "SELECT prosrc FROM pg_proc WHERE proname = 'newsnack_claim'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    drop(client);
    let statement = claim_statement(&source);
    let dir = cluster
        .dir()
        .expect("the cluster's directory")
        .to_path_buf();
    cluster.shutdown();

    let ways: [(&str, ClaimText); 4] = [
        (
            "prepared_generic",
            Box::new(|id| format!("EXECUTE claim('{{{id}}}', 'bench', 60, NULL)")),
        ),
        (
            "unnamed",
            Box::new(|id| {
                statement
                    .replace("$1::bigint[]", &format!("'{{{id}}}'::bigint[]"))
                    .replace("$2", "'bench'")
                    .replace("$3::float8", "60::float8")
                    .replace("$4::integer", "NULL::integer")
            }),
        ),
        (
            "function",
            Box::new(|id| {
                format!("SELECT * FROM newsnack_claim('{{{id}}}'::bigint[], 'bench', 60, NULL)")
            }),
        ),
        (
            "kept",
            Box::new(|id| format!("EXECUTE kept('{{{id}}}', 'bench', 60, NULL, NULL)")),
        ),
    ];
    // A generic plan for the prepared statement, as the service's sessions
    // were started with; it changes nothing for `unnamed` and `function`
    // (a statement with its values written in is planned once, for them;
    // the function's statement keeps its own). `kept` is left to the
    // server's choice.
    let prelude = |way: &str| {
        let mode = if way == "kept" {
            "auto"
        } else {
            "force_generic_plan"
        };
        format!(
            "SET plan_cache_mode = {mode};\n\n\
             PREPARE claim(bigint[], text, float8, integer) AS {statement};\n\n\
             PREPARE kept(bigint[], text, float8, integer, text) AS {kept};\n\n",
            kept = newsnack::db::issue::CLAIM_STATEMENT
        )
    };
    // Fresh issues for the claims that take one, then the first ones
    // again, all held by then, for the claims that take nothing.
    let mut next_id = 1;
    let mut taking = serde_json::Map::new();
    for (way, claim) in &ways {
        let per_claim = instructions_per_claim(&dir, &prelude(way), claim, &mut next_id);
        taking.insert(way.to_string(), serde_json::json!(per_claim.round()));
    }
    let mut held_id = 1;
    let mut nothing = serde_json::Map::new();
    for (way, claim) in &ways {
        let per_claim = instructions_per_claim(&dir, &prelude(way), claim, &mut held_id);
        nothing.insert(way.to_string(), serde_json::json!(per_claim.round()));
    }
    assert!(
        held_id <= next_id,
        "the claims that take nothing ask for held issues"
    );
    // A whole claimed issue: the prepared claim, then the completion as a
    // pooler's session sends it (the function's call), each its own
    // transaction, with fresh issues: both statements' checks and rules
    // and both transitions' records.
    let claimed_and_completed: ClaimText = Box::new(|id| {
        format!(
            "EXECUTE kept('{{{id}}}', 'bench', 60, NULL, NULL);\n\n\
             SELECT * FROM newsnack_complete('{{{id}}}'::bigint[],
                 ARRAY[(SELECT claim_id FROM issue WHERE id = {id})], '{{headline}}'::text[],
                 '{{body}}'::text[], 'bench', '{{NULL}}'::integer[], '{{NULL}}'::integer[])"
        )
    });
    let per_issue =
        instructions_per_claim(&dir, &prelude("kept"), &claimed_and_completed, &mut next_id);
    let ratios = |report: &serde_json::Map<String, serde_json::Value>| {
        let get = |way: &str| report[way].as_f64().unwrap();
        let prepared = get("prepared_generic");
        serde_json::json!({
            "unnamed_vs_prepared": round3(get("unnamed") / prepared),
            "function_vs_prepared": round3(get("function") / prepared),
            "kept_vs_prepared": round3(get("kept") / prepared),
        })
    };
    let out = serde_json::json!({
        "benchmark": "database instructions per one-id claim, by how the statement is sent",
        "claims": CLAIMS,
        "issues": ISSUES,
        "instructions_per_claim": taking,
        "ratios": ratios(&taking),
        "instructions_per_claim_taking_nothing": nothing,
        "ratios_taking_nothing": ratios(&nothing),
        "instructions_per_issue_claimed_and_completed": per_issue.round(),
    });
    println!("{}", serde_json::to_string_pretty(&out).unwrap());
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

/// Instructions per claim after `prelude` and [`WARM_UP`] claims: the
/// claims of issues from `next_id` on, [`CLAIMS`] of them counted.
fn instructions_per_claim(
    dir: &std::path::Path,
    prelude: &str,
    claim: &ClaimText,
    next_id: &mut i64,
) -> f64 {
    let mut script = prelude.to_string();
    let mut claims = |script: &mut String, n: i64| {
        for _ in 0..n {
            script.push_str(&claim(*next_id));
            script.push_str(";\n\n");
            *next_id += 1;
        }
    };
    claims(&mut script, WARM_UP);
    let warmed = instructions(dir, &script);
    // The same script again from the start, with fresh issues, and the
    // counted claims after it.
    let mut script = prelude.to_string();
    claims(&mut script, WARM_UP + CLAIMS);
    let full = instructions(dir, &script);
    (full - warmed) as f64 / CLAIMS as f64
}

/// The text of one claim of issue `id`, the way it is sent.
type ClaimText<'a> = Box<dyn Fn(i64) -> String + 'a>;

/// The statement of `newsnack_claim`'s body, with its variables as the
/// numbered parameters of a prepared statement.
fn claim_statement(source: &str) -> String {
    let start = source
        .find("RETURN QUERY")
        .expect("RETURN QUERY in newsnack_claim")
        + 12;
    let end = source[start..].rfind(';').expect("the statement's end") + start;
    let mut statement = source[start..end].to_string();
    for (name, parameter) in [
        ("retry_below", "$4::integer"),
        ("lease_s", "$3::float8"),
        ("holder", "$2"),
        ("ids", "$1::bigint[]"),
    ] {
        statement = replace_word(&statement, name, parameter);
    }
    statement.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `text` with every whole-word `word` replaced by `by`.
fn replace_word(text: &str, word: &str, by: &str) -> String {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(word) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + word.len()..].chars().next();
        out.push_str(&rest[..at]);
        if before.is_some_and(is_word) || after.is_some_and(is_word) {
            out.push_str(word);
        } else {
            out.push_str(by);
        }
        rest = &rest[at + word.len()..];
    }
    out.push_str(rest);
    out
}

/// Instructions `postgres --single` executes for `script` on the stopped
/// cluster in `dir`, counted by callgrind.
fn instructions(dir: &std::path::Path, script: &str) -> u64 {
    let bin = find_bin_dir().expect("server binaries");
    let out_file = dir.join("callgrind.out");
    let script_file = dir.join("script.sql");
    std::fs::write(&script_file, script).unwrap();
    let mut command = Command::new("valgrind");
    command
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out_file.display()))
        .arg(bin.join("postgres"))
        .args(["--single", "-j", "-D"])
        .arg(dir.join("data"))
        .arg("postgres")
        .stdin(std::fs::File::open(&script_file).unwrap())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some((uid, gid)) = unprivileged_user().unwrap() {
        use std::os::unix::process::CommandExt;
        std::os::unix::fs::chown(dir, Some(uid), Some(gid)).unwrap();
        command.uid(uid).gid(gid);
    }
    let status = command.status().expect("run valgrind");
    assert!(status.success(), "postgres --single under callgrind failed");
    let profile = std::fs::read_to_string(&out_file).unwrap();
    profile
        .lines()
        .find_map(|l| {
            l.strip_prefix("summary: ")
                .or_else(|| l.strip_prefix("totals: "))
        })
        .and_then(|n| n.split_whitespace().next()?.parse().ok())
        .expect("a summary in callgrind's output")
}
