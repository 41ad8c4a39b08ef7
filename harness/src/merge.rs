//! `report merge`: the summaries of a run split over machines (a `run` per machine, or
//! `cargo nextest run --partition` writing one summary per trial under `trials/`) put back
//! together as the summary of the whole run, its trials in the order one run would list them.

use crate::report::Summary;
use crate::trial::TrialResult;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Where the suites test binary writes each trial's summary under its report directory.
pub const TRIALS_DIR: &str = "trials";

/// Writes the summary of the one trial `t` as `dir/trials/<trial>.json`, for [`merge`] to find:
/// what each test process writes when a run is split by `cargo nextest run --partition`.
pub fn write_trial(dir: &Path, t: &TrialResult) -> Result<()> {
    let file = dir
        .join(TRIALS_DIR)
        .join(format!("{}.json", crate::html::trial_id(&t.name)));
    Summary::new(vec![t.clone()], Vec::new()).write_json_as(&file)
}

/// The summary files under `dir`: its `summary.json`, and every `*.json` in its `trials/`.
fn files_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    let summary = dir.join("summary.json");
    if summary.exists() {
        found.push(summary);
    }
    let trials = dir.join(TRIALS_DIR);
    if trials.is_dir() {
        let entries = std::fs::read_dir(&trials)
            .with_context(|| format!("{}: cannot list", trials.display()))?;
        let mut each: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|f| f.extension().is_some_and(|x| x == "json"))
            .collect();
        each.sort();
        found.extend(each);
    }
    if found.is_empty() {
        bail!(
            "{}: no summary.json and no {TRIALS_DIR}/*.json; give the report directories that `run --report` or the suites test binary (CKPT_HARNESS_REPORT) wrote",
            dir.display()
        );
    }
    Ok(found)
}

/// Where a trial stands in a run: the suites' directory, negative controls after the others,
/// then the suite file, then the device.
fn run_order(t: &TrialResult) -> (PathBuf, bool, PathBuf, usize) {
    let parent = t.path.parent().unwrap_or(Path::new(""));
    let in_faults = parent.file_name().is_some_and(|n| n == "faults");
    let home = if in_faults {
        parent.parent().unwrap_or(parent)
    } else {
        parent
    };
    let device = crate::devices::DeviceKind::ALL
        .iter()
        .position(|&d| d == t.device)
        .unwrap_or(usize::MAX);
    (home.to_path_buf(), in_faults, t.path.clone(), device)
}

/// `t` failed, with the reason, when its checks do not make it a pass though it says it passed.
fn rederived(mut t: TrialResult) -> TrialResult {
    if let Some(why) = t.derived_failure().filter(|_| t.passed) {
        t.passed = false;
        t.verdict = format!("{why} (its summary said it passed)");
    }
    t
}

/// The summary of every trial in the summaries under `dirs`. A trial found twice is an error:
/// each partition runs its own trials. A trial skipped in one partition and run in another is
/// counted as run. A trial's verdict is derived again from its checks
/// ([`TrialResult::derived_failure`]): a summary saying `passed` is not believed.
pub fn merge(dirs: &[PathBuf]) -> Result<Summary> {
    let mut trials = Vec::new();
    let mut skipped = Vec::new();
    let mut seen: Vec<(String, PathBuf)> = Vec::new();
    for dir in dirs {
        for file in files_in(dir)? {
            let part = Summary::read(&file)?;
            for t in part.trials {
                if let Some((_, first)) = seen.iter().find(|(n, _)| *n == t.name) {
                    bail!(
                        "{}: trial {} is also in {}; merge the outputs of distinct partitions, each trial once",
                        file.display(),
                        t.name,
                        first.display()
                    );
                }
                seen.push((t.name.clone(), file.clone()));
                trials.push(rederived(t));
            }
            skipped.extend(part.skipped);
        }
    }
    trials.sort_by_key(run_order);
    skipped.retain(|s| !seen.iter().any(|(n, _)| *n == s.name));
    skipped.sort_by(|a, b| a.name.cmp(&b.name));
    skipped.dedup_by(|a, b| a.name == b.name);
    Ok(Summary::new(trials, skipped))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use crate::devices::DeviceKind;

    fn trial(name: &str, path: &str, device: DeviceKind) -> TrialResult {
        TrialResult {
            name: name.into(),
            suite: "s".into(),
            path: path.into(),
            device,
            passed: true,
            expect_fail: Vec::new(),
            expect_not_run: Vec::new(),
            verdict: String::new(),
            checks: vec![crate::checks::Outcome::nothing_asked(
                crate::checks::Check::PeakBudget,
            )],
            seconds: 1.0,
            record: fixtures::run(),
            repeat: None,
        }
    }

    #[test]
    fn the_trials_each_test_process_wrote_merge_in_run_order() {
        let dir = tempfile::tempdir().unwrap();
        let written = [
            trial("cuda::b", "suites/b.yaml", DeviceKind::Cuda),
            trial("cpu::faults::a", "suites/faults/a.yaml", DeviceKind::Cpu),
            trial("cpu::b", "suites/b.yaml", DeviceKind::Cpu),
            trial("cpu::c", "suites/c.yaml", DeviceKind::Cpu),
        ];
        for t in &written {
            write_trial(dir.path(), t).unwrap();
        }
        let merged = merge(&[dir.path().to_path_buf()]).unwrap();
        let names: Vec<&str> = merged.trials.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["cpu::b", "cuda::b", "cpu::c", "cpu::faults::a"]);
        assert_eq!((merged.passed, merged.failed), (4, 0));
        assert_eq!(merged.trials[0].record.phases.len(), 3);
    }

    #[test]
    fn a_directory_without_summaries_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let e = merge(&[dir.path().to_path_buf()]).unwrap_err().to_string();
        assert!(e.contains("no summary.json and no trials/*.json"), "{e}");
    }
}
