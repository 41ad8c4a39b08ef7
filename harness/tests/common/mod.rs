//! What the integration tests share: the repository's root and its suite files, and two
//! summaries compared but for what differs between two runs of the same trials.

use ckpt_harness::suite::Suite;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The repository's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The suites whose files lie directly in `dir` (relative to the root), by file name.
pub fn suites_in(dir: &str) -> Vec<Suite> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    files.iter().map(|f| Suite::load(f).unwrap()).collect()
}

/// `v` without what differs between two runs of the same trials: times, and the host's memory
/// (the CPU device's capacity is the memory available when it opens).
pub fn without_timings(v: &mut Value) {
    match v {
        Value::Object(map) => {
            map.retain(|k, _| {
                !matches!(
                    k.as_str(),
                    "seconds" | "setup_seconds" | "host" | "capacity" | "max_rss" | "max_rss_added"
                )
            });
            map.values_mut().for_each(without_timings);
        }
        Value::Array(items) => items.iter_mut().for_each(without_timings),
        _ => {}
    }
}

/// Where `a` and `b` first differ, as a JSON path.
pub fn first_difference(a: &Value, b: &Value, at: String) -> String {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => x
            .iter()
            .find(|(k, v)| y.get(*k) != Some(v))
            .map_or(format!("{at}: keys differ"), |(k, v)| {
                first_difference(v, y.get(k).unwrap_or(&Value::Null), format!("{at}.{k}"))
            }),
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find(|(_, (v, w))| v != w)
            .map_or(at.clone(), |(i, (v, w))| {
                first_difference(v, w, format!("{at}[{i}]"))
            }),
        _ => format!("{at}: {a} against {b}"),
    }
}
