//! The modules of `passes/src` depend on each other in one direction only: no import
//! cycle, so that the simulator, the cost model and the planner stay separable layers.
//!
//! The graph is read from the source text. A node is a top-level module: `src/x.rs` is
//! `x`, and every file under `src/x/` (`mod.rs` and its submodules) is `x` too, since a
//! module tree is one layer; `lib.rs` only declares the modules and is left out. An edge
//! `a -> b` is any reference from a file of `a` to `crate::b`: a `use` line, a `use
//! crate::{b, c::d}` group, an inline path or a rustdoc link (a link is a dependency of
//! the docs, and a link up the layers is a sign of one in the code). `super::` paths that
//! name a top-level module count as well. A reference to the module itself is no edge.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Where an edge was seen first: a file and line.
type Witness = String;

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = fs::read_dir(&d).unwrap_or_else(|e| panic!("reading {}: {e}", d.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|x| x == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The top-level module a file under `src` belongs to; `None` for `lib.rs`.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).expect("a file under src");
    let first = rel.components().next()?.as_os_str().to_str()?.to_string();
    if rel.components().count() > 1 {
        return Some(first);
    }
    let stem = first.strip_suffix(".rs")?;
    (stem != "lib").then(|| stem.to_string())
}

/// The identifier at the start of `text`.
fn ident(text: &str) -> &str {
    let end = text.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(text.len());
    &text[..end]
}

/// The first identifier of each item of the brace group `text` starts inside (just after
/// its `{`): `a, b::c, d::{e, f}` gives `a`, `b`, `d`.
fn group_heads(text: &str) -> Vec<&str> {
    let mut heads = Vec::new();
    let (mut depth, mut item_start) = (0usize, 0usize);
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                heads.push(ident(text[item_start..i].trim_start()));
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                heads.push(ident(text[item_start..i].trim_start()));
                item_start = i + 1;
            }
            _ => {}
        }
    }
    heads.into_iter().filter(|h| !h.is_empty()).collect()
}

/// A path into this crate's modules found in a file: where it starts, the name it names
/// first, and whether it was `crate::` (else `super::`).
struct Reference<'a> {
    offset: usize,
    name: &'a str,
    from_root: bool,
}

/// Every `crate::` and `super::` path in `text` (a chain `super::super::` counted once, by
/// what follows it), each name of a `{...}` group on its own.
fn references(text: &str) -> Vec<Reference<'_>> {
    let mut found = Vec::new();
    for (prefix, from_root) in [("crate::", true), ("super::", false)] {
        let mut from = 0;
        while let Some(at) = text[from..].find(prefix) {
            let offset = from + at;
            from = offset + prefix.len();
            // Inside a longer path (`a::crate::`, `super::super::`) it is not a start.
            let before = text[..offset].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let mut after = &text[from..];
            while let Some(up) = after.strip_prefix("super::") {
                after = up;
            }
            let names = match after.strip_prefix('{') {
                Some(group) => group_heads(group),
                None => vec![ident(after)],
            };
            found.extend(names.into_iter().filter(|n| !n.is_empty()).map(|name| Reference { offset, name, from_root }));
        }
    }
    found
}

/// The module graph: for each module, the modules it references, each with where first.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeMap<String, Witness>> {
    let files = rust_files(src);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(src, f)).collect();
    let mut graph: BTreeMap<String, BTreeMap<String, Witness>> = modules.iter().map(|m| (m.clone(), BTreeMap::new())).collect();
    for file in &files {
        let Some(from) = module_of(src, file) else { continue };
        let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        let place = |offset: usize| format!("{}:{}", file.strip_prefix(src).unwrap_or(file).display(), text[..offset].matches('\n').count() + 1);
        for r in references(&text) {
            if r.name == "self" || r.name == from {
                continue;
            }
            // After `super::`, a name that is no module is an item of the parent module;
            // after `crate::` it would be an item of the crate root, which has none.
            if !modules.contains(r.name) {
                assert!(!r.from_root, "{}: crate::{} names no module of passes/src", place(r.offset), r.name);
                continue;
            }
            graph.get_mut(&from).expect("every file's module is a node").entry(r.name.to_string()).or_insert_with(|| place(r.offset));
        }
    }
    graph
}

/// A cycle through `start` if there is one, as the modules along it.
fn cycle_through(graph: &BTreeMap<String, BTreeMap<String, Witness>>, start: &str) -> Option<Vec<String>> {
    // Breadth-first from `start`'s successors back to `start`: the shortest cycle.
    let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue: std::collections::VecDeque<&str> = std::collections::VecDeque::new();
    for next in graph[start].keys() {
        if !parent.contains_key(next.as_str()) {
            parent.insert(next, start);
            queue.push_back(next);
        }
    }
    while let Some(at) = queue.pop_front() {
        if at == start {
            let mut path = vec![start.to_string()];
            let mut x = parent[start];
            while x != start {
                path.push(x.to_string());
                x = parent[x];
            }
            path.push(start.to_string());
            path.reverse();
            return Some(path);
        }
        for next in graph.get(at).map(|m| m.keys()).into_iter().flatten() {
            if !parent.contains_key(next.as_str()) {
                parent.insert(next, at);
                queue.push_back(next);
            }
        }
    }
    None
}

/// The cycles of `graph`, the shortest through each module on one (each cycle once),
/// each described with its edges' places.
fn cycles(graph: &BTreeMap<String, BTreeMap<String, Witness>>) -> Vec<String> {
    let mut seen: BTreeSet<Vec<String>> = BTreeSet::new();
    graph
        .keys()
        .filter_map(|m| cycle_through(graph, m))
        .filter(|path| {
            // The same cycle found from another of its modules: rotated to start at its least.
            let ring = &path[..path.len() - 1];
            let least = ring.iter().enumerate().min_by_key(|x| x.1).map_or(0, |x| x.0);
            seen.insert([&ring[least..], &ring[..least]].concat())
        })
        .map(|path| {
            let edges: Vec<String> = path.windows(2).map(|e| format!("{} -> {} ({})", e[0], e[1], graph[&e[0]][&e[1]])).collect();
            edges.join(", ")
        })
        .collect()
}

#[test]
fn the_modules_import_each_other_without_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src);
    for (m, to) in &graph {
        eprintln!("{m}: {}", to.keys().cloned().collect::<Vec<_>>().join(" "));
    }
    let found = cycles(&graph);
    assert!(found.is_empty(), "import cycles among passes/src's modules:\n{}", found.join("\n"));
}

/// The reader finds `use` groups, inline paths, doc links and `super::` paths, and the
/// cycle check finds a cycle it is given.
#[test]
fn the_reader_sees_every_kind_of_reference() {
    assert_eq!(group_heads("a, b::c, d::{e, f}};"), ["a", "b", "d"]);
    let names = |text: &str| references(text).into_iter().map(|r| r.name.to_string()).collect::<Vec<_>>();
    assert_eq!(names("use crate::{a, b::{c, d}};\nx crate::e::f [`crate::g`] y::crate::h"), ["a", "b", "e", "g"]);
    assert_eq!(names("use super::super::cost::X;\nuse super::{item, Other};"), ["cost", "item", "Other"]);
    let graph: BTreeMap<String, BTreeMap<String, Witness>> = [("a", vec!["b"]), ("b", vec!["c"]), ("c", vec!["a"]), ("d", vec!["a"])]
        .into_iter()
        .map(|(m, to)| (m.to_string(), to.into_iter().map(|t| (t.to_string(), format!("{m}.rs:1"))).collect()))
        .collect();
    assert_eq!(cycle_through(&graph, "a"), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
    assert_eq!(cycle_through(&graph, "d"), None);
    // One cycle, found from each of its three modules.
    assert_eq!(cycles(&graph), ["a -> b (a.rs:1), b -> c (b.rs:1), c -> a (c.rs:1)"]);
}
