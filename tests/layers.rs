//! The module graph has no cycle: each layer of `src/` (see ARCHITECTURE.md)
//! knows nothing of the layers above it, and no file of a folder reaches
//! back into one that reaches it.
//!
//! Read from the sources: every `crate::a::b…` path outside comments is an
//! edge from the file it is in to the deepest module it names. A path to a
//! re-export at the crate root (`crate::LockClient`) would hide the real
//! edge, so it is refused outside `lib.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// `src/mutex/lease.rs` → `mutex::lease`; `src/mutex/mod.rs` → `mutex`.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop()?;
    let stem = last.strip_suffix(".rs")?.to_owned();
    if stem != "mod" && stem != "lib" {
        parts.push(stem);
    }
    Some(parts.join("::"))
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "bin") {
                continue; // the CLI is a separate crate, using `redmutex::`
            }
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The `crate::…` paths of one line of code, as lists of segments.
fn crate_paths(line: &str) -> Vec<Vec<String>> {
    let code = line.split("//").next().unwrap_or("");
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let preceded = rest[..at]
            .chars()
            .last()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        let tail = &rest[at + "crate::".len()..];
        let end = tail
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(tail.len());
        if !preceded {
            let segments: Vec<String> = tail[..end]
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            // `use crate::{a, b}` lists several paths; each counts.
            if tail[end..].starts_with('{') {
                let inner = &tail[end + 1..];
                let close = inner.find('}').unwrap_or(inner.len());
                for item in inner[..close].split(',') {
                    let mut path = segments.clone();
                    path.extend(
                        item.trim()
                            .split("::")
                            .filter(|s| !s.is_empty() && *s != "self")
                            .map(|s| s.split_whitespace().next().unwrap_or("").to_owned()),
                    );
                    paths.push(path);
                }
            } else {
                paths.push(segments);
            }
        }
        rest = &tail[end..];
    }
    paths
}

fn graph() -> (BTreeMap<String, BTreeSet<String>>, Vec<String>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let modules: BTreeMap<String, PathBuf> = files
        .iter()
        .filter_map(|f| module_of(&src, f).map(|m| (m, f.clone())))
        .collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut problems = Vec::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for (n, line) in text.lines().enumerate() {
            let trimmed = line.trim_start();
            if trimmed.starts_with("//") {
                continue;
            }
            for path in crate_paths(line) {
                // The deepest module the path names.
                let mut target = None;
                for depth in (1..=path.len()).rev() {
                    let candidate = path[..depth].join("::");
                    if modules.contains_key(&candidate) {
                        target = Some(candidate);
                        break;
                    }
                }
                match target {
                    Some(target) if &target != module => {
                        edges.entry(module.clone()).or_default().insert(target);
                    }
                    Some(_) => {}
                    None if module.is_empty() => {}
                    None => problems.push(format!(
                        "{}:{}: `crate::{}` goes through a re-export at the crate root; \
                         name the module that defines it",
                        file.display(),
                        n + 1,
                        path.join("::")
                    )),
                }
            }
        }
    }
    (edges, problems)
}

fn top(module: &str) -> &str {
    module.split("::").next().unwrap_or(module)
}

/// A cycle in `edges`, if there is one, as the list of its nodes.
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(node) {
            Some(2) => return None,
            Some(1) => {
                let from = stack.iter().position(|n| n == node).unwrap_or(0);
                let mut cycle = stack[from..].to_vec();
                cycle.push(node.to_owned());
                return Some(cycle);
            }
            _ => {}
        }
        state.insert(node.to_owned(), 1);
        stack.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, state, stack) {
                return Some(cycle);
            }
        }
        stack.pop();
        state.insert(node.to_owned(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in edges.keys() {
        let mut stack = Vec::new();
        if let Some(cycle) = visit(node, edges, &mut state, &mut stack) {
            return Some(cycle);
        }
    }
    None
}

#[test]
fn the_parser_sees_every_kind_of_path() {
    let paths =
        crate_paths("use crate::{client::release, script::{self}}; x(crate::lease::drift(t));");
    let joined: Vec<String> = paths.iter().map(|p| p.join("::")).collect();
    assert!(joined.contains(&"client::release".to_owned()), "{joined:?}");
    assert!(joined.contains(&"lease::drift".to_owned()), "{joined:?}");
    assert!(crate_paths("// crate::mutex::x").is_empty());
    assert!(crate_paths("let s = \"notcrate::x\";").is_empty());
}

#[test]
fn no_module_reaches_back_into_one_that_reaches_it() {
    let (edges, problems) = graph();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(
        edges.contains_key("mutex") && edges.contains_key("family::rwlock"),
        "the graph was not read: {edges:?}"
    );
    if let Some(cycle) = find_cycle(&edges) {
        panic!("a cycle between files: {}", cycle.join(" -> "));
    }
}

#[test]
fn no_layer_knows_a_layer_above_it() {
    let (edges, _) = graph();
    let mut layers: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, targets) in &edges {
        for to in targets {
            if !from.is_empty() && top(from) != top(to) {
                layers
                    .entry(top(from).to_owned())
                    .or_default()
                    .insert(top(to).to_owned());
            }
        }
    }
    if let Some(cycle) = find_cycle(&layers) {
        panic!("a cycle between layers: {}", cycle.join(" -> "));
    }
    // The order lib.rs lists them in (`// layers: a b c`) is the order
    // they may depend in.
    let lib = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs"))
        .unwrap_or_default();
    let order: Vec<&str> = lib
        .lines()
        .find_map(|l| l.strip_prefix("// layers:"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    let declared: BTreeSet<&str> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("mod ")?.strip_suffix(';'))
        .collect();
    assert_eq!(
        declared,
        order.iter().copied().collect::<BTreeSet<&str>>(),
        "every module of lib.rs is in its `// layers:` line, and only those"
    );
    assert!(order.len() >= 8, "lib.rs lists its layers: {order:?}");
    for (from, targets) in &layers {
        let at = order.iter().position(|m| m == from);
        for to in targets {
            let below = order.iter().position(|m| m == to);
            assert!(
                matches!((at, below), (Some(a), Some(b)) if b < a),
                "{from} uses {to}, which comes after it in lib.rs's `// layers:` line"
            );
        }
    }
}
