//! The source tree's layout stays readable: a short top level, a `//!`
//! header on every file, a crate map in `lib.rs` that names every module,
//! no import circles, between files or between folders, no source file
//! past 800 lines (its unit tests counted on their own), a
//! `docs/performance.md` of 400 lines at most, and a map in
//! `docs/architecture.md` that names exactly the files there are.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Files directly in `src/` at the most.
const MAX_TOP_LEVEL_FILES: usize = 12;

/// Lines of a source file at the most, and again of its unit tests.
const MAX_FILE_LINES: usize = 800;

/// Lines of `docs/performance.md` at the most: a reference, not a journal.
const MAX_PERFORMANCE_LINES: usize = 400;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn src() -> PathBuf {
    root().join("src")
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

/// A file's text cut in two: what it builds, and its unit tests (the
/// `#[cfg(test)] mod tests` it ends with), if any.
fn split_tests(text: &str) -> (&str, Option<&str>) {
    match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => (&text[..at], Some(&text[at..])),
        None => (text, None),
    }
}

/// The code of a file: comment lines and its unit tests left out.
fn code_of(file: &Path) -> String {
    let text = std::fs::read_to_string(file).unwrap();
    let (text, _) = split_tests(&text);
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

/// Files allowed past [`MAX_FILE_LINES`] until they are split, each held
/// to the lines it has now (none today). An entry whose file is back under
/// the limit must go.
const LONG_FILES_HELD: &[(&str, usize)] = &[];

/// Every part of a source file past `limit` lines, as `file (part): N
/// lines`: what the file builds, and its unit tests, counted on their own.
/// `held` names files allowed past it up to a length of their own.
fn too_long(files: &[(String, String)], limit: usize, held: &[(&str, usize)]) -> Vec<String> {
    let mut found = Vec::new();
    for (name, text) in files {
        let (code, tests) = split_tests(text);
        let limit = held
            .iter()
            .find(|(file, _)| file == name)
            .map_or(limit, |&(_, lines)| lines);
        for (part, lines) in [("code", Some(code)), ("unit tests", tests)] {
            let n = lines.map_or(0, |l| l.lines().count());
            if n > limit {
                found.push(format!("src/{name} ({part}): {n} lines, more than {limit}"));
            }
        }
    }
    for (file, _) in held {
        match files.iter().find(|(name, _)| name == file) {
            Some((_, text)) if split_tests(text).0.lines().count() > MAX_FILE_LINES => {}
            _ => found.push(format!(
                "src/{file} is held in LONG_FILES_HELD but is gone or back under \
                 {MAX_FILE_LINES} lines: take it off the list"
            )),
        }
    }
    found
}

/// Every source file under `src/`, by its path from `src/`, with its text.
fn sources() -> Vec<(String, String)> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    files
        .into_iter()
        .map(|file| {
            let name = file
                .strip_prefix(src())
                .unwrap()
                .to_string_lossy()
                .into_owned();
            (name, std::fs::read_to_string(&file).unwrap())
        })
        .collect()
}

/// What the map of `docs/architecture.md` ("Who owns what") names: the
/// files and folders of its lists, as paths from the root (a folder ends
/// in `/`), and the migrations it names (`sql/NNNN_name.sql`).
///
/// A list belongs to the folder its bold heading names (`**`src/db/`**`,
/// `**Directly in `src/`**`) and runs to the next blank line; in it, every
/// name in backticks that ends in `.rs` or `/` and has no other `/` is a
/// file or folder of that folder.
fn map_entries(doc: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let section = doc
        .split_once("\n## Who owns what\n")
        .expect("docs/architecture.md has a section \"## Who owns what\"")
        .1;
    let section = section.split("\n## ").next().unwrap();
    let section = section.split("\n### ").next().unwrap();
    let quoted = |line: &str| -> Vec<String> {
        line.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    };
    let (mut entries, mut migrations) = (BTreeSet::new(), BTreeSet::new());
    let mut folder: Option<String> = None;
    for line in section.lines() {
        for name in quoted(line) {
            if name.starts_with("sql/") && name.ends_with(".sql") && name != "sql/schema.sql" {
                migrations.insert(name);
            }
        }
        if line.trim().is_empty() {
            folder = None;
        } else if line.starts_with("**") {
            folder = quoted(line)
                .into_iter()
                .next()
                .filter(|f| f.starts_with("src/") && f.ends_with('/'));
        } else if let Some(folder) = &folder {
            for name in quoted(line) {
                let bare = name.trim_end_matches('/');
                let named = (name.ends_with(".rs") || name.ends_with('/'))
                    && !bare.is_empty()
                    && !bare.contains('/')
                    && !bare.contains(' ');
                if named {
                    entries.insert(format!("{folder}{name}"));
                }
            }
        }
    }
    (entries, migrations)
}

/// What is wrong with a map naming `entries` and `migrations`, for a tree
/// whose files (paths from the root) are `files` and whose newest
/// migration is `newest`: names of files that do not exist, files it
/// leaves out, migrations it names that do not exist, and the newest
/// migration when it does not name it.
fn map_errors(
    entries: &BTreeSet<String>,
    migrations: &BTreeSet<String>,
    files: &BTreeSet<String>,
    newest: &str,
) -> Vec<String> {
    let exists = |entry: &String| match entry.strip_suffix('/') {
        Some(_) => files.iter().any(|f| f.starts_with(entry.as_str())),
        None => files.contains(entry),
    };
    let mut errors: Vec<String> = entries
        .iter()
        .filter(|e| !exists(e))
        .map(|e| format!("the map names {e}, which does not exist"))
        .collect();
    errors.extend(
        files
            .iter()
            .filter(|f| f.starts_with("src/"))
            .filter(|f| {
                !entries.contains(*f)
                    && !entries
                        .iter()
                        .any(|e| e.ends_with('/') && f.starts_with(e.as_str()))
            })
            .map(|f| format!("the map leaves out {f}")),
    );
    errors.extend(
        migrations
            .iter()
            .filter(|m| !files.contains(*m))
            .map(|m| format!("the map names the migration {m}, which does not exist")),
    );
    if !migrations.contains(newest) {
        errors.push(format!(
            "the map does not name the newest migration, {newest}"
        ));
    }
    errors
}

/// Every file under `dir`, as a path from the root.
fn files_under(dir: &Path, found: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, found);
        } else {
            let relative = path.strip_prefix(root()).unwrap();
            found.insert(relative.to_string_lossy().into_owned());
        }
    }
}

#[test]
fn no_source_file_passes_800_lines_nor_do_its_unit_tests() {
    let long = too_long(&sources(), MAX_FILE_LINES, LONG_FILES_HELD);
    assert!(long.is_empty(), "split along their concerns: {long:#?}");
}

#[test]
fn performance_md_stays_a_reference_of_400_lines_at_most() {
    let text = std::fs::read_to_string(root().join("docs/performance.md")).unwrap();
    let lines = text.lines().count();
    assert!(
        lines <= MAX_PERFORMANCE_LINES,
        "docs/performance.md has {lines} lines, more than {MAX_PERFORMANCE_LINES}: \
         per benchmark what it measures, its command, the latest figure and the target; \
         history is in git"
    );
}

#[test]
fn the_architecture_map_names_exactly_the_files_there_are() {
    let doc = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let (entries, migrations) = map_entries(&doc);
    let mut files = BTreeSet::new();
    files_under(&src(), &mut files);
    files_under(&root().join("sql"), &mut files);
    let newest = files
        .iter()
        .filter(|f| f.starts_with("sql/0") && f.ends_with(".sql"))
        .max()
        .expect("numbered migrations in sql/")
        .clone();
    let errors = map_errors(&entries, &migrations, &files, &newest);
    assert!(
        errors.is_empty(),
        "docs/architecture.md, \"Who owns what\": {errors:#?}"
    );
}

#[test]
fn the_length_check_counts_unit_tests_on_their_own() {
    let lines = |n: usize| "let x = 1;\n".repeat(n);
    let files = vec![
        ("a.rs".to_string(), lines(10)),
        ("b.rs".to_string(), lines(11)),
        (
            "c.rs".to_string(),
            format!("{}#[cfg(test)]\nmod tests {{\n{}", lines(9), lines(8)),
        ),
        (
            "d.rs".to_string(),
            format!("{}#[cfg(test)]\nmod tests {{\n{}", lines(5), lines(11)),
        ),
    ];
    assert_eq!(
        too_long(&files, 10, &[]),
        vec![
            "src/b.rs (code): 11 lines, more than 10".to_string(),
            "src/d.rs (unit tests): 13 lines, more than 10".to_string(),
        ]
    );
}

#[test]
fn the_map_check_sees_each_kind_of_drift() {
    let doc = "intro\n\n## Who owns what\n\n\
        The steps `sql/0001_a.sql` … `sql/0002_b.sql`.\n\n\
        **`src/db/`**: queries.\n\
        - `mod.rs`: the pool; see `tests/x.rs` and `Sql`.\n\
        - `gone.rs`: a file since removed.\n\
        \n\
        **`src/briefing/`**: the pipeline.\n\
        - `schedule.rs`: in the wrong folder.\n\
        - `demo/`: a folder.\n\
        \n\
        **Directly in `src/`**:\n\
        - `lib.rs`: the map.\n\
        \n\
        Beside `src/`: `tests/`, `benches/`.\n\
        \n## Next\n- `later.rs`\n";
    let (entries, migrations) = map_entries(doc);
    let files: BTreeSet<String> = [
        "src/db/mod.rs",
        "src/db/issue.rs",
        "src/settings/schedule.rs",
        "src/briefing/demo/data.json",
        "src/lib.rs",
        "sql/0001_a.sql",
        "sql/0002_b.sql",
        "sql/0003_c.sql",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(
        map_errors(&entries, &migrations, &files, "sql/0003_c.sql"),
        vec![
            "the map names src/briefing/schedule.rs, which does not exist".to_string(),
            "the map names src/db/gone.rs, which does not exist".to_string(),
            "the map leaves out src/db/issue.rs".to_string(),
            "the map leaves out src/settings/schedule.rs".to_string(),
            "the map does not name the newest migration, sql/0003_c.sql".to_string(),
        ]
    );
}
