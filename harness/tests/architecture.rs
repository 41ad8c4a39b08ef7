//! The harness's layering, as docs/ARCHITECTURE.md draws it, checked on its source: the stages
//! import one way, down [`STAGES`] (the record knows nothing of the checks, the checks nothing
//! of the runner, the runner nothing of the reports, and only the command line knows them
//! all); no module imports one that imports it back, and no folder one that imports it back.
//! The import reader is the engine's architecture test's.

#[allow(dead_code)] // each crate's test uses its own part of the reader
#[path = "../../engine/tests/imports/mod.rs"]
mod imports;

use imports::{edges_on_cycles, folder_edges_on_cycles, import_graph, modules};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The harness's top-level modules from the bottom up: each imports only those before it.
/// The leaves first, then the stages in the order a run's data flows through them.
const STAGES: &[&str] = &[
    "devices",
    "error_text",
    "atomic_file",
    "record",
    "checks",
    "suite",
    "forecast",
    "run",
    "report",
    "cli",
];

fn harness_graph() -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(modules.contains_key("run::phases") && modules.contains_key("checks::golden"));
    import_graph(&modules)
}

/// The stage `module` belongs to: its first segment.
fn stage(module: &str) -> &str {
    module.split("::").next().unwrap_or(module)
}

/// The imports of `graph` that go up or across [`STAGES`], or leave a module out of them.
fn upward_imports(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let rank = |m: &str| STAGES.iter().position(|s| *s == stage(m));
    let mut wrong = Vec::new();
    for (a, targets) in graph {
        for b in targets.iter().filter(|b| stage(b) != stage(a)) {
            match (rank(a), rank(b)) {
                (Some(from), Some(to)) if to < from => {}
                (None, _) => wrong.push(format!("{a} is in no stage of STAGES")),
                (_, None) => wrong.push(format!("{b} is in no stage of STAGES")),
                _ => wrong.push(format!("{a} -> {b}")),
            }
        }
    }
    wrong
}

#[test]
fn the_stages_import_one_way() {
    let wrong = upward_imports(&harness_graph());
    assert!(
        wrong.is_empty(),
        "imports against the harness's stages (docs/ARCHITECTURE.md, harness: record, checks, \
         suite, forecast, run, report, cli, each importing only those before it; move what both use into \
         the lower one or a leaf): {wrong:?}"
    );
}

#[test]
fn a_check_that_reads_the_runner_breaks_the_stages() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("checks::golden", vec!["record", "run::trial"]),
        ("run::trial", vec!["checks"]),
        ("reporting::x", vec!["record"]),
    ]
    .into_iter()
    .map(|(m, t)| (m.to_string(), t.into_iter().map(str::to_string).collect()))
    .collect();
    assert_eq!(
        upward_imports(&graph),
        [
            "checks::golden -> run::trial",
            "reporting::x is in no stage of STAGES"
        ]
    );
}

/// The modules docs/ARCHITECTURE.md's table of the harness's modules names in its first
/// column: the rows after the line that opens it, up to the first line that is not a row.
fn documented_modules(doc: &str) -> BTreeSet<String> {
    doc.lines()
        .skip_while(|l| !l.starts_with("Every module, by stage"))
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|row| row.split('|').nth(1))
        .filter_map(|cell| cell.trim().strip_prefix('`')?.strip_suffix('`'))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_architecture_doc_names_every_module_and_nothing_else() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("../docs/ARCHITECTURE.md")).unwrap();
    let documented = documented_modules(&doc);
    let modules: BTreeSet<String> = modules(&root.join("src"))
        .into_keys()
        .filter(|m| !m.is_empty() && m != "main")
        .collect();
    let unnamed: Vec<&String> = modules.difference(&documented).collect();
    let gone: Vec<&String> = documented.difference(&modules).collect();
    assert!(
        unnamed.is_empty() && gone.is_empty(),
        "docs/ARCHITECTURE.md's table of the harness's modules (\"Every module, by stage\") \
         lacks {unnamed:?} and names {gone:?}, which do not exist: a row for each module, \
         none for a module gone"
    );
}

#[test]
fn the_module_table_is_read_from_its_first_column_only() {
    let doc = "| `a` | x |\nEvery module, by stage:\n\n| module | job |\n| --- | --- |\n\
               | `run::x` | calls `y` |\n| `z` | z |\n\nafter\n| `w` | w |";
    let names: Vec<String> = documented_modules(doc).into_iter().collect();
    assert_eq!(names, ["run::x", "z"]);
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let cycles = edges_on_cycles(&harness_graph());
    assert!(
        cycles.is_empty(),
        "import cycles in the harness (docs/ARCHITECTURE.md: move what both sides use into a \
         leaf module, as report::changes and report::median are): {cycles:?}"
    );
}

#[test]
fn no_folder_imports_one_that_imports_it_back() {
    let circles = folder_edges_on_cycles(&harness_graph());
    assert!(
        circles.is_empty(),
        "circles between the harness's folders (docs/ARCHITECTURE.md: a folder's parts import \
         one way; move what both sides use into a module below both): {circles:?}"
    );
}
