//! The source tree's layout stays readable: a short top level, a `//!`
//! header on every file, a crate map in `lib.rs` that names every module,
//! and no import circles, between files or between folders.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Files directly in `src/` at the most.
const MAX_TOP_LEVEL_FILES: usize = 12;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

/// Every module of the crate by its path (`db::issue`), with its file.
fn modules() -> BTreeMap<String, PathBuf> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    files
        .into_iter()
        .filter_map(|file| {
            let relative = file.strip_prefix(src()).unwrap().with_extension("");
            let mut parts: Vec<String> = relative
                .iter()
                .map(|p| p.to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            let name = parts.join("::");
            (name != "lib" && name != "main").then_some((name, file))
        })
        .collect()
}

/// The code of a file: comment lines and its unit tests left out.
fn code_of(file: &Path) -> String {
    let text = std::fs::read_to_string(file).unwrap();
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => &text[..],
    };
    text.lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .map(|line| line.split(" // ").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules each module names through `crate::` and `super::` paths.
fn imports(modules: &BTreeMap<String, PathBuf>) -> BTreeMap<String, BTreeSet<String>> {
    let resolve = |path: &str| -> Option<String> {
        let segments: Vec<&str> = path.split("::").collect();
        (1..=segments.len())
            .rev()
            .map(|n| segments[..n].join("::"))
            .find(|candidate| modules.contains_key(candidate))
    };
    modules
        .iter()
        .map(|(name, file)| {
            let code = code_of(file);
            let parent = name.rsplit_once("::").map_or("", |(parent, _)| parent);
            let mut named = BTreeSet::new();
            let crate_paths = code.match_indices("crate::").map(|(at, _)| (at + 7, ""));
            let super_paths = code
                .match_indices("super::")
                .map(|(at, _)| (at + 7, parent));
            for (at, base) in crate_paths.chain(super_paths) {
                let rest: String = code[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_' || *c == ':')
                    .collect();
                let rest = rest.trim_end_matches(':');
                let path = match base {
                    "" => rest.to_string(),
                    base => format!("{base}::{rest}"),
                };
                if let Some(target) = resolve(&path) {
                    let inside = name.starts_with(&format!("{target}::"));
                    if &target != name && !inside {
                        named.insert(target);
                    }
                }
            }
            (name.clone(), named)
        })
        .collect()
}

/// A cycle in `graph`, if there is one, as the path that closes it.
fn a_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_top_level_holds_a_dozen_files_at_most() {
    let top: Vec<_> = std::fs::read_dir(src())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    assert!(
        top.len() <= MAX_TOP_LEVEL_FILES,
        "{} files directly in src/: {top:?}",
        top.len()
    );
}

#[test]
fn every_file_says_what_it_owns() {
    let unsaid: Vec<_> = modules()
        .values()
        .chain([&src().join("lib.rs"), &src().join("main.rs")])
        .filter(|file| !std::fs::read_to_string(file).unwrap().starts_with("//!"))
        .cloned()
        .collect();
    assert!(unsaid.is_empty(), "files without a //! header: {unsaid:?}");
}

#[test]
fn the_crate_map_names_every_module() {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let map: String = lib.lines().filter(|l| l.starts_with("//!")).collect();
    let unnamed: Vec<_> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod "))
        .map(|l| l.trim_end_matches(';'))
        .filter(|module| !map.contains(&format!("[`{module}`]")))
        .collect();
    assert!(
        unnamed.is_empty(),
        "modules missing from lib.rs's map: {unnamed:?}"
    );
}

#[test]
fn no_two_files_import_each_other_even_through_others() {
    let graph = imports(&modules());
    assert_eq!(a_cycle(&graph), None, "an import circle between files");
}

#[test]
fn no_two_folders_import_each_other_even_through_others() {
    let top = |module: &str| module.split("::").next().unwrap().to_string();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to) in imports(&modules()) {
        let entry = graph.entry(top(&from)).or_default();
        entry.extend(to.iter().map(|t| top(t)).filter(|t| *t != top(&from)));
    }
    assert_eq!(a_cycle(&graph), None, "an import circle between folders");
}

#[test]
fn the_circle_check_sees_a_circle() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("settings", vec!["db", "briefing"]),
        ("briefing", vec!["settings"]),
        ("db", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(
        a_cycle(&graph),
        Some(vec![
            "briefing".into(),
            "settings".into(),
            "briefing".into()
        ])
    );
}
