//! What the integration tests share: the repository's root and its suite files.

use ckpt_harness::suite::Suite;
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
