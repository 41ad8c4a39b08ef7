//! What every CI suite of `suites/` must set: `memory.rss_budget`, so that host memory outside
//! the device's tracker (batches, host copies of checkpoints, other buffers) is bounded by a check.

use ckpt_harness::suite::{Suite, Tier};
use std::path::{Path, PathBuf};

/// Every suite file of `suites/` (not the negative controls of `suites/faults/`).
fn suites() -> Vec<Suite> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../suites");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    files.iter().map(|f| Suite::load(f).unwrap()).collect()
}

#[test]
fn every_ci_suite_bounds_the_host_memory_a_phase_adds() {
    let ci: Vec<Suite> = suites()
        .into_iter()
        .filter(|s| s.file.tier == Tier::Ci)
        .collect();
    assert!(ci.len() >= 8, "{} CI suites", ci.len());
    let unbounded: Vec<&str> = ci
        .iter()
        .filter(|s| s.file.memory.rss_budget.is_none() || !s.file.checks.peak_budget)
        .map(|s| s.file.name.as_str())
        .collect();
    assert!(
        unbounded.is_empty(),
        "CI suites without memory.rss_budget (or with peak_budget off): {unbounded:?}"
    );
}
