//! The layering docs/ARCHITECTURE.md describes, checked on the engine's source: no module imports
//! another that imports it back (a device and its tensor type excepted), and the code written
//! once (model, optimizer, state, checkpoints, data, the trainer) never names a backend.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Cycles the architecture allows, each in sorted order: a device and its tensor type refer to
/// each other.
const ALLOWED_CYCLES: &[&[&str]] = &[&["backend::cuda::device", "backend::cuda::tensor"]];

/// Modules written once over the device trait, which must not reach into a backend.
const WRITTEN_ONCE: &[&str] = &[
    "model",
    "optim",
    "state",
    "checkpoint",
    "data",
    "config",
    "trainer",
];

/// Every module of the crate at `src`, by path (`model::block`; the root is `""`), with its
/// source stripped of comments and unit tests.
fn modules(src: &Path) -> BTreeMap<String, String> {
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
fn named_paths(module: &[&str], code: &str) -> Vec<Vec<String>> {
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

fn is_within(a: &str, b: &str) -> bool {
    a == b || a.starts_with(&format!("{b}::"))
}

/// Which module imports which, leaving out a module's use of its own ancestors and
/// descendants (a parent declares its children and re-exports their items).
fn import_graph(modules: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
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

/// The strongly connected groups of more than one module (Tarjan's algorithm).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct Walk<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        found: Vec<BTreeSet<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            for w in self.graph.get(v).into_iter().flatten() {
                if !self.index.contains_key(w.as_str()) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w.as_str()]);
                    self.low.insert(v, low);
                } else if self.stack.contains(&w.as_str()) {
                    let low = self.low[v].min(self.index[w.as_str()]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let at = self.stack.iter().rposition(|m| *m == v).unwrap();
                let group: BTreeSet<String> = self.stack.drain(at..).map(str::to_string).collect();
                if group.len() > 1 {
                    self.found.push(group);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

fn engine_modules() -> BTreeMap<String, String> {
    modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let modules = engine_modules();
    assert!(modules.contains_key("model::block") && modules.contains_key("device"));
    let graph = import_graph(&modules);
    let unexpected: Vec<_> = cycles(&graph)
        .into_iter()
        .filter(|c| {
            !ALLOWED_CYCLES
                .iter()
                .any(|a| c.iter().map(String::as_str).eq(a.iter().copied()))
        })
        .map(|c| {
            let edges: Vec<String> = c
                .iter()
                .flat_map(|m| {
                    graph[m]
                        .iter()
                        .filter(|t| c.contains(*t))
                        .map(move |t| format!("{m} -> {t}"))
                })
                .collect();
            edges.join(", ")
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "import cycles (docs/ARCHITECTURE.md: imports go one way; move what both sides use \
         into a module of its own): {unexpected:?}"
    );
}

#[test]
fn the_code_written_once_names_no_backend() {
    let modules = engine_modules();
    let graph = import_graph(&modules);
    let offending: Vec<String> = graph
        .iter()
        .filter(|(m, _)| WRITTEN_ONCE.iter().any(|w| is_within(m, w)))
        .flat_map(|(m, targets)| {
            targets
                .iter()
                .filter(|t| is_within(t, "backend"))
                .map(move |t| format!("{m} -> {t}"))
        })
        .collect();
    assert!(
        offending.is_empty(),
        "written-once code imports a backend (it must go through the device trait): {offending:?}"
    );
}

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
    let found = cycles(&graph);
    assert_eq!(found.len(), 1);
    assert!(found[0].iter().eq(["a", "b", "c"].iter()));
}
