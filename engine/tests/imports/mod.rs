//! The import reader behind the architecture tests of both crates: every module of a crate's
//! source with what it names through `crate::` and `super::`, the graph of which module imports
//! which, and the cycles in it, between modules and between the parts of a folder.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every module of the crate at `src`, by path (`model::block`; the root is `""`), with its
/// source stripped of comments and unit tests.
pub fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut found = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(src).unwrap().with_extension("");
            let mut segments: Vec<String> = relative
                .iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect();
            if matches!(segments.last().map(String::as_str), Some("mod" | "lib")) {
                segments.pop();
            }
            let text = std::fs::read_to_string(&path).unwrap();
            found.insert(segments.join("::"), code_of(&text));
        }
    }
    found
}

/// `text` without comment lines and without its `#[cfg(test)] mod tests`.
fn code_of(text: &str) -> String {
    let body = text.split("#[cfg(test)]\nmod tests").next().unwrap();
    body.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths `code` names through `crate::` and `super::`, as segments from the crate root,
/// for the module at `module`. Grouped imports (`crate::{a::B, c}`) give one path per item.
pub fn named_paths(module: &[&str], code: &str) -> Vec<Vec<String>> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut paths = Vec::new();
    for (at, _) in code
        .match_indices("crate::")
        .chain(code.match_indices("super::"))
    {
        if at > 0 && code[..at].ends_with(|c: char| ident(c) || c == ':') {
            continue;
        }
        let mut rest = &code[at..];
        let mut base: Vec<String> = Vec::new();
        if rest.starts_with("crate::") {
            rest = &rest["crate::".len()..];
        } else {
            let mut up = 0;
            while let Some(r) = rest.strip_prefix("super::") {
                rest = r;
                up += 1;
            }
            base = module[..module.len().saturating_sub(up)]
                .iter()
                .map(|s| s.to_string())
                .collect();
        }
        let end = rest
            .find(|c: char| !ident(c) && c != ':')
            .unwrap_or(rest.len());
        base.extend(
            rest[..end]
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_string),
        );
        match rest[end..].strip_prefix('{') {
            Some(group) => expand_group(&base, group, &mut paths),
            None => paths.push(base),
        }
    }
    paths
}

/// The paths of the use-tree group that starts after its `{` in `text` (nested groups
/// included), each prefixed with `base`.
fn expand_group(base: &[String], text: &str, paths: &mut Vec<Vec<String>>) {
    let mut depth = 0;
    let mut item = String::new();
    let finish = |item: &str, paths: &mut Vec<Vec<String>>| {
        let item = item.trim();
        let (head, inner) = match item.find("::{") {
            Some(at) => (&item[..at], Some(&item[at + 3..])),
            None => (item, None),
        };
        let mut path = base.to_vec();
        path.extend(
            head.split("::")
                .filter(|s| !s.is_empty() && *s != "self")
                .map(|s| s.split_whitespace().next().unwrap_or(s).to_string()),
        );
        match inner {
            Some(inner) => expand_group(&path, inner, paths),
            None if !item.is_empty() => paths.push(path),
            None => {}
        }
    };
    for c in text.chars() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                finish(&item, paths);
                item.clear();
                continue;
            }
            _ => {}
        }
        item.push(c);
    }
    finish(&item, paths);
}

/// The longest module that is a prefix of `path` (an item's path names its module).
fn module_of(path: &[String], modules: &BTreeMap<String, String>) -> Option<String> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| modules.contains_key(m))
}

pub fn is_within(a: &str, b: &str) -> bool {
    a == b || a.starts_with(&format!("{b}::"))
}

/// Which module imports which, leaving out a module's use of its own ancestors and
/// descendants (a parent declares its children and re-exports their items).
pub fn import_graph(modules: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    modules
        .iter()
        .map(|(module, code)| {
            let segments: Vec<&str> = module.split("::").filter(|s| !s.is_empty()).collect();
            let targets = named_paths(&segments, code)
                .iter()
                .filter_map(|p| module_of(p, modules))
                .filter(|t| !is_within(t, module) && !is_within(module, t))
                .collect();
            (module.clone(), targets)
        })
        .collect()
}

/// Whether `to` can be reached from `from` along the graph's edges.
fn reaches(graph: &BTreeMap<String, BTreeSet<String>>, from: &str, to: &str) -> bool {
    let mut seen = BTreeSet::new();
    let mut todo = vec![from];
    while let Some(m) = todo.pop() {
        if m == to {
            return true;
        }
        if seen.insert(m) {
            todo.extend(graph.get(m).into_iter().flatten().map(String::as_str));
        }
    }
    false
}

/// The folders' graph: for every import `a -> b`, an edge between the two children of their
/// deepest common folder that hold them (`checkpoint::shards -> parallel::plan` is `checkpoint
/// -> parallel`; `backend::cuda::gemm -> backend::cuda::device` is itself), with the imports
/// behind each edge. A cycle in it is a circle between folders (or files) of one folder.
fn folder_graph(
    graph: &BTreeMap<String, BTreeSet<String>>,
) -> BTreeMap<(String, String), Vec<String>> {
    let mut folders: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for (a, targets) in graph {
        let from: Vec<&str> = a.split("::").filter(|s| !s.is_empty()).collect();
        for b in targets {
            let to: Vec<&str> = b.split("::").filter(|s| !s.is_empty()).collect();
            let common = from.iter().zip(&to).take_while(|(x, y)| x == y).count();
            let child = |path: &[&str]| path[..=common.min(path.len() - 1)].join("::");
            folders
                .entry((child(&from), child(&to)))
                .or_default()
                .push(format!("{a} -> {b}"));
        }
    }
    folders
}

/// Every edge of the folders' graph on a cycle, with the imports behind it.
pub fn folder_edges_on_cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let folders = folder_graph(graph);
    let mut lifted: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to) in folders.keys() {
        lifted.entry(from.clone()).or_default().insert(to.clone());
    }
    edges_on_cycles(&lifted)
        .into_iter()
        .map(|edge| {
            let (from, to) = edge.split_once(" -> ").unwrap();
            let behind = &folders[&(from.to_string(), to.to_string())];
            format!("{edge} ({})", behind.join(", "))
        })
        .collect()
}

/// Every import `a -> b` on a cycle: `b` leads back to `a`.
pub fn edges_on_cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    graph
        .iter()
        .flat_map(|(a, targets)| targets.iter().map(move |b| (a, b)))
        .filter(|(a, b)| reaches(graph, b, a))
        .map(|(a, b)| format!("{a} -> {b}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_import_reader_sees_plain_grouped_and_relative_paths() {
        let code =
            "use crate::model::{block::Norm, ctx::{linear, BlockCtx}};\nuse super::ctx::linear;\n\
                    use crate::{memory::Category, tensor};\nlet x = super::super::fault::Fault::None;";
        let paths = named_paths(&["model", "moe"], code);
        let joined: Vec<String> = paths.iter().map(|p| p.join("::")).collect();
        assert_eq!(
            joined,
            [
                "model::block::Norm",
                "model::ctx::linear",
                "model::ctx::BlockCtx",
                "memory::Category",
                "tensor",
                "model::ctx::linear",
                "fault::Fault::None"
            ]
        );
        let graph: BTreeMap<String, BTreeSet<String>> = [
            ("a", vec!["b"]),
            ("b", vec!["c"]),
            ("c", vec!["a"]),
            ("d", vec!["a"]),
        ]
        .into_iter()
        .map(|(m, t)| (m.to_string(), t.into_iter().map(str::to_string).collect()))
        .collect();
        assert_eq!(edges_on_cycles(&graph), ["a -> b", "b -> c", "c -> a"]);
    }

    #[test]
    fn the_folder_check_sees_a_circle_that_no_two_modules_make() {
        let graph: BTreeMap<String, BTreeSet<String>> = [
            ("checkpoint::shards", vec!["ranks::experts"]),
            ("ranks::experts", vec!["checkpoint"]),
            ("ranks::step", vec!["parallel::plan"]),
            ("checkpoint", vec![]),
            ("parallel::plan", vec![]),
        ]
        .into_iter()
        .map(|(m, t)| (m.to_string(), t.into_iter().map(str::to_string).collect()))
        .collect();
        assert!(edges_on_cycles(&graph).is_empty());
        assert_eq!(
            folder_edges_on_cycles(&graph),
            [
                "checkpoint -> ranks (checkpoint::shards -> ranks::experts)",
                "ranks -> checkpoint (ranks::experts -> checkpoint)"
            ]
        );
        let nested: BTreeMap<String, BTreeSet<String>> = [
            ("report::html::plots", vec!["report::trends"]),
            ("report::trends", vec!["report::html::timeline"]),
        ]
        .into_iter()
        .map(|(m, t)| (m.to_string(), t.into_iter().map(str::to_string).collect()))
        .collect();
        assert_eq!(folder_edges_on_cycles(&nested).len(), 2);
    }
}
