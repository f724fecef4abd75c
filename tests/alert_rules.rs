//! The Prometheus alert rules in `deploy/prometheus`: `promtool check
//! rules` and `promtool test rules` pass; every alert has a unit test that
//! fires it, which fails with its expectation turned around, and a quiet
//! one that is a near miss: it feeds every series the alert reads, and
//! differs from a firing test of the alert only in one series' values (so
//! that series, not a missing input, keeps it quiet); every alert links a
//! section of docs/runbook.md that exists; and every metric a rule reads
//! is one named in `src/metrics.rs`'s source. promtool comes from Debian's
//! `prometheus` package, unpacked into the test cache.

mod common;

use std::collections::{BTreeMap, BTreeSet};
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

        // Turned around, every firing test fails: each decides something.
        // (A quiet test turned around fails whatever the alert does; the
        // quiet ones are checked as near misses below instead.)
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
                     d['tests'] = [t for t in d['tests'] if all(c.get('exp_alerts') for c in t['alert_rule_test'])]\n\
                     for t in d['tests']:\n\
                     \x20   for c in t['alert_rule_test']:\n\
                     \x20       c['exp_alerts'] = []\n\
                     yaml.safe_dump(d, open(sys.argv[2], 'w'))",
                ])
                .arg(&tests)
                .arg(&inverted)
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let (passed, said) = run_promtool(&["test", "rules"], &inverted);
            assert!(!passed, "the turned-around tests passed:\n{said}");
            let firing: usize = read(&bin, &inverted)["tests"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["alert_rule_test"].as_array().unwrap().len())
                .sum();
            assert!(firing >= fired.len(), "{}", tests.display());
            assert_eq!(
                said.matches("alertname:").count(),
                firing,
                "not every turned-around test failed:\n{said}"
            );
        }
    })
    .await
    .unwrap();
}

/// A label matcher of a series selector: `label="value"`, or
/// `label!="value"` when `negated`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Matcher {
    label: String,
    negated: bool,
    value: String,
}

/// A series selector as a rule's expression or a unit test's
/// `input_series` spells it: a metric name and its label matchers.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Selector {
    name: String,
    matchers: Vec<Matcher>,
}

impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let matchers: Vec<String> = self
            .matchers
            .iter()
            .map(|m| {
                let op = if m.negated { "!=" } else { "=" };
                format!("{}{op}\"{}\"", m.label, m.value)
            })
            .collect();
        if matchers.is_empty() {
            return write!(f, "{}", self.name);
        }
        write!(f, "{}{{{}}}", self.name, matchers.join(","))
    }
}

/// Whether `c` may stand in a metric name.
fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// The selector whose metric name starts at `text[at..]`, and the index
/// after it. Only `=` and `!=` matchers: a regular-expression matcher
/// fails here, as the check would need a regex engine to decide what it
/// reads.
fn selector_at(text: &str, at: usize) -> (Selector, usize) {
    let name: String = text[at..]
        .chars()
        .take_while(|c| is_name_char(*c))
        .collect();
    let mut end = at + name.len();
    let mut matchers = Vec::new();
    if text[end..].starts_with('{') {
        let close = end
            + text[end..]
                .find('}')
                .unwrap_or_else(|| panic!("an unclosed {{ in {text}"));
        for part in text[end + 1..close].split(',').map(str::trim) {
            if part.is_empty() {
                continue;
            }
            let op = part
                .find(['=', '!'])
                .unwrap_or_else(|| panic!("no matcher in {part:?} of {text}"));
            let (negated, quoted) =
                match (part[op..].strip_prefix("!="), part[op..].strip_prefix('=')) {
                    (Some(rest), _) => (true, rest),
                    (None, Some(rest)) if !rest.starts_with('~') => (false, rest),
                    _ => panic!("{part:?} in {text}: this check reads only = and != matchers"),
                };
            let value = quoted
                .trim()
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or_else(|| {
                    panic!("{part:?} in {text}: the value is not one quoted string")
                });
            matchers.push(Matcher {
                label: part[..op].trim().to_string(),
                negated,
                value: value.to_string(),
            });
        }
        end = close + 1;
    }
    matchers.sort();
    (Selector { name, matchers }, end)
}

/// Every series `expr` reads: each token naming a newsnack metric (the
/// names of src/metrics.rs, which `every_metric_a_rule_reads_is_exported`
/// holds them to), with its label matchers.
fn selectors(expr: &str) -> Vec<Selector> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(offset) = expr[from..].find("newsnack_") {
        let at = from + offset;
        let starts_a_token = expr[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !is_name_char(c) && c != '"');
        if starts_a_token {
            let (selector, end) = selector_at(expr, at);
            found.push(selector);
            from = end;
        } else {
            from = at + "newsnack_".len();
        }
    }
    found
}

/// Whether `selector` reads the input series `series`.
fn reads(selector: &Selector, series: &Selector) -> bool {
    selector.name == series.name
        && selector.matchers.iter().all(|m| {
            let value = series
                .matchers
                .iter()
                .find(|s| s.label == m.label)
                .map_or("", |s| s.value.as_str());
            (value == m.value) != m.negated
        })
}

/// A unit test's input series, each with its values as written.
fn input_series(test: &Value) -> BTreeMap<Selector, String> {
    test["input_series"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let spec = s["series"].as_str().unwrap().trim();
            let (series, _) = selector_at(spec, 0);
            let values = s["values"]
                .as_str()
                .map_or_else(|| s["values"].to_string(), str::to_string);
            (series, values)
        })
        .collect()
}

/// The quiet checks of a unit test: (alert name, evaluation time).
fn quiet_checks(test: &Value) -> Vec<(String, Value)> {
    test["alert_rule_test"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["exp_alerts"].as_array().is_none_or(Vec::is_empty))
        .map(|c| {
            (
                c["alertname"].as_str().unwrap().to_string(),
                c["eval_time"].clone(),
            )
        })
        .collect()
}

/// What `expr` reads that no input series of `test` feeds.
fn unfed(expr: &str, test: &Value) -> Vec<Selector> {
    let fed = input_series(test);
    selectors(expr)
        .into_iter()
        .filter(|s| !fed.keys().any(|series| reads(s, series)))
        .collect()
}

/// Whether one of `tests` fires `alert` at `eval_time` from the same input
/// series as `quiet`, at the same interval, with only one series' values
/// different: that series, and nothing missing, keeps `quiet` quiet.
fn has_firing_twin(tests: &[Value], quiet: &Value, alert: &str, eval_time: &Value) -> bool {
    let fed = input_series(quiet);
    tests.iter().any(|other| {
        let fires = other["alert_rule_test"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| {
                c["alertname"] == alert
                    && c["eval_time"] == *eval_time
                    && c["exp_alerts"].as_array().is_some_and(|a| !a.is_empty())
            });
        let theirs = input_series(other);
        fires
            && other["interval"] == quiet["interval"]
            && fed.keys().eq(theirs.keys())
            && fed
                .values()
                .zip(theirs.values())
                .filter(|(a, b)| a != b)
                .count()
                == 1
    })
}

/// Every fault of the quiet tests among `tests`, against the alerts'
/// expressions by name.
fn quiet_test_faults(exprs: &BTreeMap<String, String>, tests: &[Value]) -> Vec<String> {
    let mut faults = Vec::new();
    for test in tests {
        let name = test["name"].as_str().unwrap();
        for (alert, eval_time) in quiet_checks(test) {
            let Some(expr) = exprs.get(&alert) else {
                faults.push(format!("{name}: there is no alert {alert}"));
                continue;
            };
            for selector in unfed(expr, test) {
                faults.push(format!(
                    "{name}: no input series is {selector}, which {alert} reads"
                ));
            }
            if !has_firing_twin(tests, test, &alert, &eval_time) {
                faults.push(format!(
                    "{name}: no test firing {alert} at {eval_time} differs from it in one input series' values only"
                ));
            }
        }
    }
    faults
}

/// `test` with each input series rewritten by `edit`, or dropped where
/// it answers `None`.
fn rewritten(test: &Value, edit: impl Fn(Selector, &Value) -> Option<(Selector, Value)>) -> Value {
    let mut variant = test.clone();
    variant["input_series"] = test["input_series"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| {
            edit(
                selector_at(s["series"].as_str().unwrap(), 0).0,
                &s["values"],
            )
        })
        .map(|(series, values)| serde_json::json!({"series": series.to_string(), "values": values}))
        .collect();
    variant
}

/// `tests` with the one at `at` replaced by `variant`.
fn replaced(tests: &[Value], at: usize, variant: &Value) -> Vec<Value> {
    let mut all = tests.to_vec();
    all[at] = variant.clone();
    all
}

#[tokio::test]
async fn every_quiet_test_feeds_what_its_alert_reads_and_misses_firing_by_one_series() {
    tokio::task::spawn_blocking(|| {
        let bin = tools();
        let exprs: BTreeMap<String, String> = alerts(&bin)
            .iter()
            .map(|a| {
                let name = a["alert"].as_str().unwrap().to_string();
                (name, a["expr"].as_str().unwrap().to_string())
            })
            .collect();
        // The metric the "another metric" variants feed: one no rule reads.
        let unread = "newsnack_sse_clients";
        assert!(exprs.values().all(|e| !e.contains(unread)));
        for file in files(".test.yml") {
            let tests = read(&bin, &file)["tests"].as_array().unwrap().clone();
            let faults = quiet_test_faults(&exprs, &tests);
            assert!(
                faults.is_empty(),
                "{}:\n{}",
                file.display(),
                faults.join("\n")
            );

            // Broken variants of every quiet test are caught.
            let mut quiet = 0;
            for (i, test) in tests.iter().enumerate() {
                let name = test["name"].as_str().unwrap();
                for (alert, eval_time) in quiet_checks(test) {
                    quiet += 1;
                    let expr = &exprs[&alert];
                    let no_twin = |variant: &Value| {
                        let all = replaced(&tests, i, variant);
                        !has_firing_twin(&all, variant, &alert, &eval_time)
                    };

                    // Emptied: nothing the alert reads is fed, and the
                    // whole check reports the test.
                    let emptied = rewritten(test, |_, _| None);
                    assert_eq!(unfed(expr, &emptied), selectors(expr), "{name} emptied");
                    assert!(no_twin(&emptied), "{name} emptied");
                    let reported = quiet_test_faults(&exprs, &replaced(&tests, i, &emptied));
                    assert!(reported.iter().any(|f| f.starts_with(&format!("{name}:"))));

                    // The same series of another metric.
                    let elsewhere = rewritten(test, |mut series, values| {
                        series.name = unread.to_string();
                        Some((series, values.clone()))
                    });
                    assert!(!unfed(expr, &elsewhere).is_empty(), "{name} fed {unread}");
                    assert!(no_twin(&elsewhere), "{name} fed {unread}");

                    // Other label values, the instance's aside: unfed
                    // where the alert picks its series by label.
                    let relabelled = rewritten(test, |mut series, values| {
                        for m in &mut series.matchers {
                            if m.label != "instance" {
                                m.value.push_str("-other");
                            }
                        }
                        Some((series, values.clone()))
                    });
                    let picks_by_label = selectors(expr).iter().any(|s| !s.matchers.is_empty());
                    assert_eq!(
                        !unfed(expr, &relabelled).is_empty(),
                        picks_by_label,
                        "{name} with other label values"
                    );

                    // Without any one of its series, or with the values of
                    // every series changed, no firing test is its twin.
                    let count = test["input_series"].as_array().unwrap().len();
                    for j in 0..count {
                        let mut dropped = test.clone();
                        dropped["input_series"].as_array_mut().unwrap().remove(j);
                        assert!(no_twin(&dropped), "{name} without series {j}");
                    }
                    if count > 1 {
                        let changed =
                            rewritten(test, |series, _| Some((series, Value::from("7x200"))));
                        assert!(no_twin(&changed), "{name} with every series changed");
                    }
                }
            }
            assert!(quiet > 0, "{} has no quiet test", file.display());
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
