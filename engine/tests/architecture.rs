//! The layering docs/ARCHITECTURE.md describes, checked on the engine's source: no module imports
//! another that imports it back (a device and its tensor type excepted), no folder imports
//! another that imports it back (the parts of one folder, files or folders, import one way
//! only), and the code written once (model, optimizer, state, checkpoints, data, the trainer)
//! never names a backend.

mod imports;

use imports::{edges_on_cycles, folder_edges_on_cycles, import_graph, is_within, modules};
use std::collections::BTreeMap;
use std::path::Path;

/// Pairs of modules the architecture allows to import each other: a device and its tensor type.
const ALLOWED_CYCLES: &[[&str; 2]] = &[["backend::cuda::device", "backend::cuda::tensor"]];

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

fn engine_modules() -> BTreeMap<String, String> {
    modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let modules = engine_modules();
    assert!(modules.contains_key("model::block") && modules.contains_key("device"));
    let mut graph = import_graph(&modules);
    for [a, b] in ALLOWED_CYCLES {
        for (from, to) in [(a, b), (b, a)] {
            let imports = graph.get_mut(*from);
            assert!(
                imports.is_some(),
                "ALLOWED_CYCLES names {from}, which no longer exists"
            );
            imports.unwrap().remove(*to);
        }
    }
    let unexpected = edges_on_cycles(&graph);
    assert!(
        unexpected.is_empty(),
        "import cycles (docs/ARCHITECTURE.md: imports go one way; move what both sides use \
         into a module of its own): {unexpected:?}"
    );
}

#[test]
fn no_folder_imports_one_that_imports_it_back() {
    let modules = engine_modules();
    let mut graph = import_graph(&modules);
    for [a, b] in ALLOWED_CYCLES {
        for (from, to) in [(a, b), (b, a)] {
            graph.get_mut(*from).unwrap().remove(*to);
        }
    }
    let circles = folder_edges_on_cycles(&graph);
    assert!(
        circles.is_empty(),
        "circles between folders (docs/ARCHITECTURE.md: a folder's parts import one way; move \
         what both sides use into a folder or module below both): {circles:?}"
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
