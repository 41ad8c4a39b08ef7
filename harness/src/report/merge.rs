//! `report merge`: the summaries of a run split over machines (a `run` per machine, or
//! `cargo nextest run --partition` writing one summary per trial under `trials/`) put back
//! together as the summary of the whole run, its trials in the order one run would list them,
//! with the benchmarks' figures the one summary that has them carries.

use crate::checks::{Check, Status};
use crate::report::bench::Bench;
use crate::report::summary::Summary;
use crate::run::trial::TrialResult;
use crate::suite::Suite;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Where the suites test binary writes each trial's summary under its report directory.
pub const TRIALS_DIR: &str = "trials";

/// Writes the summary of the one trial `t` as `dir/trials/<trial>.json`, for [`merge`] to find:
/// what each test process writes when a run is split by `cargo nextest run --partition`.
pub fn write_trial(dir: &Path, t: &TrialResult) -> Result<()> {
    let file = dir
        .join(TRIALS_DIR)
        .join(format!("{}.json", crate::report::html::trial_id(&t.name)));
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

/// `t` failed, with the reason, when its checks do not make it a pass though it says it passed:
/// by their own statuses ([`TrialResult::derived_failure`]), or against its suite file
/// ([`against_suite`]).
fn rederived(mut t: TrialResult) -> TrialResult {
    if !t.passed {
        return t;
    }
    let why: Vec<String> = t
        .derived_failure()
        .into_iter()
        .chain(against_suite(&t))
        .collect();
    if !why.is_empty() {
        t.passed = false;
        t.verdict = format!("{} (its summary said it passed)", why.join("; "));
    }
    t
}

/// What `t`'s summary lacks of what its suite file, read again, requires: an outcome, not
/// `off`, for every check the suite turns on, and the suite's `expect_fail` and
/// `expect_not_run`. A suite file named relatively is read from the current directory, the
/// checkout's root that `run` and the suites test binary name suites from.
fn against_suite(t: &TrialResult) -> Option<String> {
    let suite = match Suite::load(&t.path) {
        Ok(suite) => suite,
        Err(e) => {
            return Some(format!(
                "its suite file cannot be read here ({}), so which checks it must have is unknown; merge in the checkout that ran it",
                crate::error_text::one_line(&e)
            ))
        }
    };
    let mut why = Vec::new();
    for check in Check::ALL {
        if !suite.file.checks.enabled(check) {
            continue;
        }
        match t.checks.iter().find(|o| o.check == check) {
            None => why.push(format!(
                "check {check} is missing from its summary, and {} turns it on",
                t.path.display()
            )),
            Some(o) if o.status == Status::Off => why.push(format!(
                "check {check} is off in its summary, but {} turns it on",
                t.path.display()
            )),
            Some(_) => {}
        }
    }
    for (key, summary, suite) in [
        ("expect_fail", &t.expect_fail, suite.expect_fail()),
        ("expect_not_run", &t.expect_not_run, suite.expect_not_run()),
    ] {
        if *summary != suite {
            let names = |c: &[Check]| c.iter().map(Check::to_string).collect::<Vec<_>>();
            why.push(format!(
                "its {key} [{}] is not its suite's [{}]",
                names(summary).join(", "),
                names(&suite).join(", ")
            ));
        }
    }
    (!why.is_empty()).then(|| why.join("; "))
}

/// The summary of every trial in the summaries under `dirs`. A trial found twice is an error:
/// each partition runs its own trials. A trial skipped in one partition and run in another is
/// counted as run. A trial's verdict is derived again from its checks
/// ([`TrialResult::derived_failure`]): a summary saying `passed` is not believed. The
/// benchmarks' figures are those of the one summary that has them; two that have them are an
/// error.
pub fn merge(dirs: &[PathBuf]) -> Result<Summary> {
    let mut trials = Vec::new();
    let mut skipped = Vec::new();
    let mut seen: Vec<(String, PathBuf)> = Vec::new();
    let mut bench: Option<(Bench, PathBuf)> = None;
    for dir in dirs {
        for file in files_in(dir)? {
            let part = Summary::read(&file)?;
            if let Some(figures) = part.bench {
                if let Some((_, first)) = &bench {
                    bail!(
                        "{}: benchmark figures are also in {}; merge them from one partition, or give them with --bench",
                        file.display(),
                        first.display()
                    );
                }
                bench = Some((figures, file.clone()));
            }
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
    let mut summary = Summary::new(trials, skipped);
    summary.bench = bench.map(|(figures, _)| figures);
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::{fixtures, Failure, Outcome};
    use crate::devices::DeviceKind;

    /// A passing trial of the repository's suite `file` (relative to the root): an outcome for
    /// every check, failed for those its suite expects to fail, and the suite's expectations.
    fn trial(name: &str, file: &str, device: DeviceKind) -> TrialResult {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(file);
        let suite = Suite::load(&path).unwrap();
        let r = fixtures::run();
        let checks = Check::ALL
            .into_iter()
            .map(|c| match suite.expect_fail().contains(&c) {
                true => Outcome::new(c, &r, 1, 1, vec![Failure::new(c, &r, "a fault")]),
                false => Outcome::nothing_asked(c),
            })
            .collect();
        TrialResult {
            name: name.into(),
            suite: suite.file.name.clone(),
            path,
            device,
            passed: true,
            expect_fail: suite.expect_fail(),
            expect_not_run: suite.expect_not_run(),
            verdict: String::new(),
            checks,
            seconds: 1.0,
            record: r,
            repeat: None,
        }
    }

    /// The verdict of `t` written alone into a partition and merged.
    fn merged_alone(t: &TrialResult) -> TrialResult {
        let dir = tempfile::tempdir().unwrap();
        write_trial(dir.path(), t).unwrap();
        merge(&[dir.path().to_path_buf()]).unwrap().trials.remove(0)
    }

    #[test]
    fn a_check_the_suite_turns_on_missing_or_off_in_the_summary_fails_the_trial() {
        let whole = trial("cpu::tiny-fp32", "suites/tiny-fp32.yaml", DeviceKind::Cpu);
        assert!(merged_alone(&whole).passed);
        let mut removed = whole.clone();
        removed.checks.retain(|o| o.check != Check::LossContinuity);
        let t = merged_alone(&removed);
        assert!(!t.passed);
        assert!(
            t.verdict
                .starts_with("check loss_continuity is missing from its summary, and "),
            "{}",
            t.verdict
        );
        assert!(
            t.verdict.contains("suites/tiny-fp32.yaml turns it on"),
            "{}",
            t.verdict
        );
        let mut off = whole.clone();
        off.checks[0] = Outcome::off(off.checks[0].check);
        let t = merged_alone(&off);
        assert!(!t.passed);
        assert!(
            t.verdict.starts_with(&format!(
                "check {} is off in its summary",
                off.checks[0].check
            )),
            "{}",
            t.verdict
        );
    }

    #[test]
    fn expectations_other_than_the_suite_s_fail_the_trial() {
        let control = "suites/faults/moments_not_saved.yaml";
        let mut excused = trial("cpu::faults::moments_not_saved", control, DeviceKind::Cpu);
        assert!(merged_alone(&excused).passed);
        // A failure excused by an expect_fail the suite does not have.
        excused.expect_fail.push(Check::Finite);
        let at = excused
            .checks
            .iter()
            .position(|o| o.check == Check::Finite)
            .unwrap();
        let r = fixtures::run();
        excused.checks[at] = Outcome::new(
            Check::Finite,
            &r,
            1,
            1,
            vec![Failure::new(Check::Finite, &r, "nan")],
        );
        let t = merged_alone(&excused);
        assert!(!t.passed);
        assert!(t.verdict.contains("its expect_fail ["), "{}", t.verdict);
        assert!(
            t.verdict.contains("finite] is not its suite's ["),
            "{}",
            t.verdict
        );
    }

    #[test]
    fn a_suite_file_that_cannot_be_read_fails_the_trial() {
        let mut t = trial("cpu::tiny-fp32", "suites/tiny-fp32.yaml", DeviceKind::Cpu);
        t.path = PathBuf::from("suites/no-such-suite.yaml");
        let t = merged_alone(&t);
        assert!(!t.passed);
        assert!(
            t.verdict
                .starts_with("its suite file cannot be read here ("),
            "{}",
            t.verdict
        );
    }

    #[test]
    fn the_trials_each_test_process_wrote_merge_in_run_order() {
        let dir = tempfile::tempdir().unwrap();
        let written = [
            trial("cuda::b", "suites/async-save.yaml", DeviceKind::Cuda),
            trial(
                "cpu::faults::a",
                "suites/faults/moments_not_saved.yaml",
                DeviceKind::Cpu,
            ),
            trial("cpu::b", "suites/async-save.yaml", DeviceKind::Cpu),
            trial("cpu::c", "suites/tiny-fp32.yaml", DeviceKind::Cpu),
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
    fn the_bench_figures_of_the_one_partition_that_has_them_are_the_merge_s() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let bench = crate::report::bench::Bench {
            command: "scripts/bench.sh".into(),
            machine: "m".into(),
            figures: vec![crate::report::bench::Figure {
                name: "checkpoint load".into(),
                unit: "GB/s".into(),
                value: 1.37,
                reference: false,
            }],
        };
        let mut with = Summary::new(
            vec![trial(
                "cpu::tiny-fp32",
                "suites/tiny-fp32.yaml",
                DeviceKind::Cpu,
            )],
            Vec::new(),
        );
        with.bench = Some(bench.clone());
        with.write_json(&a).unwrap();
        let other = trial("cpu::async-save", "suites/async-save.yaml", DeviceKind::Cpu);
        write_trial(&b, &other).unwrap();
        let merged = merge(&[a.clone(), b.clone()]).unwrap();
        assert_eq!(merged.bench, Some(bench));
        with.trials = vec![other];
        with.write_json(&b).unwrap();
        let e = merge(&[a, b]).unwrap_err().to_string();
        assert!(
            e.contains("b/summary.json: benchmark figures are also in")
                && e.ends_with(
                    "a/summary.json; merge them from one partition, or give them with --bench"
                ),
            "{e}"
        );
    }

    #[test]
    fn a_directory_without_summaries_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let e = merge(&[dir.path().to_path_buf()]).unwrap_err().to_string();
        assert!(e.contains("no summary.json and no trials/*.json"), "{e}");
    }
}
