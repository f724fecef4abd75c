//! The Prometheus alert rules in `deploy/prometheus`: `promtool check
//! rules` and `promtool test rules` pass; every alert has a unit test that
//! fires it and one that shows it quiet, and the same tests with their
//! expectations turned around all fail (so each one decides something);
//! every alert links a section of docs/runbook.md that exists; and every
//! metric a rule reads is one `src/metrics.rs` exports. promtool comes
//! from Debian's `prometheus` package, unpacked into the test cache.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::kubernetes::{objects, root, tools};
use common::promtool::promtool;
use serde_json::Value;

fn prometheus_dir() -> PathBuf {
    root().join("deploy/prometheus")
}

/// The files in deploy/prometheus ending with `suffix`.
fn files(suffix: &str) -> Vec<PathBuf> {
    let mut found: Vec<_> = std::fs::read_dir(prometheus_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    found.sort();
    assert!(!found.is_empty(), "no *{suffix} in deploy/prometheus");
    found
}

/// One YAML file, as JSON.
fn read(bin: &Path, file: &Path) -> Value {
    let mut docs = objects(bin, &std::fs::read_to_string(file).unwrap());
    assert_eq!(docs.len(), 1, "{}", file.display());
    docs.remove(0)
}

/// promtool with `args`, in `dir`: whether it passed, and what it said.
fn run_promtool(args: &[&str], file: &Path) -> (bool, String) {
    let out = Command::new(promtool())
        .args(args)
        .arg(file.file_name().unwrap())
        .current_dir(file.parent().unwrap())
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// Every alert of every rules file: its name, expression and annotations.
fn alerts(bin: &Path) -> Vec<Value> {
    files(".rules.yml")
        .iter()
        .flat_map(|f| {
            read(bin, f)["groups"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|g| g["rules"].as_array().unwrap().clone())
                .collect::<Vec<_>>()
        })
        .filter(|r| r["alert"].is_string())
        .collect()
}

#[tokio::test]
async fn promtool_checks_and_tests_the_rules() {
    tokio::task::spawn_blocking(|| {
        for rules in files(".rules.yml") {
            let (passed, said) = run_promtool(&["check", "rules"], &rules);
            assert!(passed, "{said}");
        }
        for tests in files(".test.yml") {
            let (passed, said) = run_promtool(&["test", "rules"], &tests);
            assert!(passed, "{said}");
        }
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn every_alert_has_a_test_that_fires_it_and_one_that_keeps_it_quiet() {
    tokio::task::spawn_blocking(|| {
        let bin = tools();
        let names: BTreeSet<String> = alerts(&bin)
            .iter()
            .map(|a| a["alert"].as_str().unwrap().to_string())
            .collect();
        let mut fired = BTreeSet::new();
        let mut quiet = BTreeSet::new();
        for file in files(".test.yml") {
            for test in read(&bin, &file)["tests"].as_array().unwrap() {
                for check in test["alert_rule_test"].as_array().unwrap() {
                    let name = check["alertname"].as_str().unwrap().to_string();
                    let expected = check["exp_alerts"].as_array().map_or(0, Vec::len);
                    if expected > 0 {
                        fired.insert(name);
                    } else {
                        quiet.insert(name);
                    }
                }
            }
        }
        assert_eq!(fired, names, "alerts without a test that fires them");
        assert_eq!(quiet, names, "alerts without a test that keeps them quiet");

        // Turned around, every test fails: each decides something.
        let dir = tempfile::tempdir().unwrap();
        for rules in files(".rules.yml") {
            std::fs::copy(&rules, dir.path().join(rules.file_name().unwrap())).unwrap();
        }
        for tests in files(".test.yml") {
            let inverted = dir.path().join(tests.file_name().unwrap());
            let out = Command::new(bin.join("python"))
                .args([
                    "-c",
                    "import sys, yaml\n\
                     d = yaml.safe_load(open(sys.argv[1]))\n\
                     for t in d['tests']:\n\
                     \x20   for c in t['alert_rule_test']:\n\
                     \x20       c['exp_alerts'] = [] if c.get('exp_alerts') else [{'exp_labels': {'severity': 'none'}}]\n\
                     yaml.safe_dump(d, open(sys.argv[2], 'w'))",
                ])
                .arg(&tests)
                .arg(&inverted)
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let (passed, said) = run_promtool(&["test", "rules"], &inverted);
            assert!(!passed, "the turned-around tests passed:\n{said}");
            let tests_count = read(&bin, &tests)["tests"].as_array().unwrap().len();
            assert_eq!(
                said.matches("alertname:").count(),
                tests_count,
                "not every turned-around test failed:\n{said}"
            );
        }
    })
    .await
    .unwrap();
}

/// GitHub's anchor of a Markdown heading.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[tokio::test]
async fn every_alert_links_its_runbook_section() {
    let bin = tokio::task::spawn_blocking(tools).await.unwrap();
    let runbook = std::fs::read_to_string(root().join("docs/runbook.md")).unwrap();
    let anchors: BTreeSet<String> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix("## ").or_else(|| l.strip_prefix("### ")))
        .map(anchor)
        .collect();
    for alert in tokio::task::spawn_blocking(move || alerts(&bin))
        .await
        .unwrap()
    {
        let name = alert["alert"].as_str().unwrap();
        let url = alert["annotations"]["runbook_url"]
            .as_str()
            .unwrap_or_else(|| panic!("{name} has no runbook_url"));
        let section = url
            .strip_prefix("docs/runbook.md#")
            .unwrap_or_else(|| panic!("{name}: {url} is not a section of docs/runbook.md"));
        assert!(
            anchors.contains(section),
            "{name}: docs/runbook.md has no section #{section}"
        );
        assert!(
            alert["annotations"]["summary"].is_string(),
            "{name} has no summary"
        );
        assert!(
            alert["labels"]["severity"].is_string(),
            "{name} has no severity"
        );
    }
}

#[tokio::test]
async fn every_metric_a_rule_reads_is_exported() {
    let bin = tokio::task::spawn_blocking(tools).await.unwrap();
    let source = std::fs::read_to_string(root().join("src/metrics.rs")).unwrap();
    let exported: BTreeSet<String> = source
        .split('"')
        .filter(|s| {
            s.starts_with("newsnack_") && s.chars().all(|c| c.is_ascii_lowercase() || c == '_')
        })
        .map(str::to_string)
        .collect();
    for alert in tokio::task::spawn_blocking(move || alerts(&bin))
        .await
        .unwrap()
    {
        let expr = alert["expr"].as_str().unwrap();
        for (at, _) in expr.match_indices("newsnack_") {
            let name: String = expr[at..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            // A histogram's series carry suffixes of its name.
            let base = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|b| exported.contains(*b)))
                .unwrap_or(&name);
            assert!(
                exported.contains(base),
                "{}: {name} is not a metric src/metrics.rs exports",
                alert["alert"]
            );
        }
    }
}
