//! What every CI suite of `suites/` must set: `memory.rss_budget`, so that host memory outside
//! the device's tracker (batches, host copies of checkpoints, other buffers) is bounded by a check.

use ckpt_harness::checks::Check;
use ckpt_harness::suite::{Suite, Tier};
use common::suites_in;

// Each test binary uses part of what the tests share.
#[allow(dead_code)]
mod common;

#[test]
fn every_ci_suite_bounds_the_host_memory_a_phase_adds() {
    let ci: Vec<Suite> = suites_in("suites")
        .into_iter()
        .filter(|s| s.file.tier == Tier::Ci)
        .collect();
    assert!(ci.len() >= 8, "{} CI suites", ci.len());
    let unbounded: Vec<&str> = ci
        .iter()
        .filter(|s| s.file.memory.rss_budget.is_none() || !s.file.checks.enabled(Check::PeakBudget))
        .map(|s| s.file.name.as_str())
        .collect();
    assert!(
        unbounded.is_empty(),
        "CI suites without memory.rss_budget (or with peak_budget off): {unbounded:?}"
    );
}
