//! One trial: a suite on one device through the phases and the checks, and its verdict. A trial
//! passes only when exactly the checks of `expect_fail` fail and exactly those of
//! `expect_not_run` had nothing to compare; a suite that cannot run fails with the reason.

use crate::checks::{self, golden, peak_budget, Check, Outcome, Status};
use crate::devices::DeviceKind;
use crate::error_text;
use crate::record::RunRecord;
use crate::run::command_phases;
use crate::run::phases::{self, PlanOverBudget, Watch};
use crate::run::repeat::Spread;
use crate::suite::engine::CommandEngine;
use crate::suite::Suite;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How a trial handles its golden snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GoldenMode {
    /// Compare with the stored snapshot, never write it.
    Check,
    /// Rewrite the snapshot from this run, then compare.
    Bless,
}

/// A trial's verdict and everything behind it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrialResult {
    /// `device::suite`, or `device::faults::suite` for a negative control.
    pub name: String,
    /// The suite's name.
    pub suite: String,
    /// The suite file.
    pub path: PathBuf,
    /// The device.
    pub device: DeviceKind,
    /// Whether the trial passed.
    pub passed: bool,
    /// The checks that had to fail (empty for an ordinary suite).
    #[serde(default)]
    pub expect_fail: Vec<Check>,
    /// The checks that had to have nothing to compare (usually empty).
    #[serde(default)]
    pub expect_not_run: Vec<Check>,
    /// Why the trial failed, in one line; empty when it passed.
    #[serde(default)]
    pub verdict: String,
    /// Every check's outcome.
    #[serde(default)]
    pub checks: Vec<Outcome>,
    /// Wall-clock seconds.
    #[serde(default)]
    pub seconds: f64,
    /// What was recorded: every phase and step (empty in summaries written before it was kept).
    #[serde(default)]
    pub record: RunRecord,
    /// The spread of the trial's repeated runs, under `run --repeat`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat: Option<Spread>,
}

impl TrialResult {
    /// Its failures as lines, at most `most` per check; the rest of a check's as one line,
    /// `… and K more <check> failures`.
    pub fn failure_lines(&self, most: usize) -> Vec<String> {
        let mut out = Vec::new();
        for o in &self.checks {
            out.extend(o.failures.iter().take(most).map(|f| f.to_string()));
            if o.failures.len() > most {
                out.push(format!(
                    "… and {} more {} failures",
                    o.failures.len() - most,
                    o.check
                ));
            }
        }
        out
    }

    /// The checks that failed, in report order.
    pub fn failed_checks(&self) -> Vec<Check> {
        with_status(&self.checks, Status::Failed)
    }

    /// The checks that had nothing to compare, in report order.
    pub fn not_run_checks(&self) -> Vec<Check> {
        with_status(&self.checks, Status::NotRun)
    }

    /// Why this trial, as read from a summary, has not passed whatever its own `passed` says:
    /// no check outcomes, no recorded run, or check outcomes that the verdict of
    /// [`run`] fails (a check failing that had to pass, or not run without
    /// `expect_not_run`). `None` when its checks make it a pass.
    pub fn derived_failure(&self) -> Option<String> {
        let mut why = Vec::new();
        if self.checks.is_empty() {
            why.push("no check outcomes recorded".to_string());
        }
        if self.record.phases.is_empty() {
            why.push("no run recorded".to_string());
        }
        why.extend(verdict(&self.expect_fail, &self.failed_checks()).err());
        why.extend(not_run_verdict(&self.expect_not_run, &self.not_run_checks()).err());
        (!why.is_empty()).then(|| why.join("; "))
    }
}

/// The checks of `outcomes` with `status`, in their order.
fn with_status(outcomes: &[Outcome], status: Status) -> Vec<Check> {
    outcomes
        .iter()
        .filter(|o| o.status == status)
        .map(|o| o.check)
        .collect()
}

/// `a, b, c`.
fn list(checks: &[Check]) -> String {
    checks
        .iter()
        .map(|c| c.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The checks of `a` that `b` lacks.
fn missing(a: &[Check], b: &[Check]) -> Vec<Check> {
    a.iter().copied().filter(|c| !b.contains(c)).collect()
}

/// The verdict given the checks that had to have nothing to compare and those that had: `Ok`
/// or why not.
pub fn not_run_verdict(expected: &[Check], not_run: &[Check]) -> Result<(), String> {
    if expected == not_run {
        return Ok(());
    }
    if expected.is_empty() {
        return Err(format!(
            "not run: {} (nothing recorded to compare; list them in expect_not_run if the suite means it)",
            list(not_run)
        ));
    }
    let mut why = format!(
        "expected exactly [{}] not to run, got [{}]",
        list(expected),
        list(not_run)
    );
    let ran = missing(expected, not_run);
    if !ran.is_empty() {
        why.push_str(&format!("; ran though expected not to: {}", list(&ran)));
    }
    let extra = missing(not_run, expected);
    if !extra.is_empty() {
        why.push_str(&format!("; also not run: {}", list(&extra)));
    }
    Err(why)
}

/// The verdict given the checks that had to fail and those that did: `Ok` or why not.
pub fn verdict(expect_fail: &[Check], failed: &[Check]) -> Result<(), String> {
    if expect_fail == failed {
        return Ok(());
    }
    if expect_fail.is_empty() {
        return Err(format!("failed: {}", list(failed)));
    }
    let missed = missing(expect_fail, failed);
    let extra = missing(failed, expect_fail);
    let mut why = format!(
        "negative control: expected exactly [{}] to fail, got [{}]",
        list(expect_fail),
        list(failed)
    );
    if !missed.is_empty() {
        why.push_str(&format!(
            "; passed though they should fail: {}",
            list(&missed)
        ));
    }
    if !extra.is_empty() {
        why.push_str(&format!("; also failed: {}", list(&extra)));
    }
    Err(why)
}

/// What a trial that ran to its checks observed and concluded.
struct Observed {
    record: RunRecord,
    checks: Vec<Outcome>,
}

/// The phases of `suite` on `device`, then the checks, with checkpoints in a temporary
/// directory.
fn observe(
    suite: &Suite,
    device: DeviceKind,
    golden_dir: &Path,
    mode: GoldenMode,
    watch: &mut impl Watch,
) -> Result<Observed> {
    suite.check_run()?;
    let work = tempfile::tempdir().context("cannot create a temporary directory")?;
    let record = phases::run(suite, device, work.path(), watch)?;
    // A negative control of `golden` keeps its snapshot: it differs from the run on purpose.
    let control_of_golden = suite.expect_fail().contains(&Check::Golden);
    if mode == GoldenMode::Bless && suite.file.checks.enabled(Check::Golden) && !control_of_golden {
        golden::bless(golden_dir, &record)?;
    }
    let stored = golden::load(golden_dir, &record.device, &record.suite)?;
    let checks = checks::run_all(&record, &suite.file.checks, &stored);
    Ok(Observed { record, checks })
}

/// Runs `suite` on `device` with checkpoints in a temporary directory; `golden_dir` holds the
/// snapshots; `watch` is told as each phase and step starts and ends. A trial that cannot run (the engine
/// refuses its configuration, a file is missing, a phase fails other than by running out of
/// memory) fails with the reason as its verdict; it never stops the caller's other trials.
pub fn run(
    suite: &Suite,
    device: DeviceKind,
    golden_dir: &Path,
    mode: GoldenMode,
    watch: &mut impl Watch,
) -> TrialResult {
    if let Some(engine) = &suite.file.engine {
        return run_command(suite, engine, device, golden_dir);
    }
    let started = Instant::now();
    let (verdict, checks, record) = match observe(suite, device, golden_dir, mode, watch) {
        Ok(Observed { record, checks }) => (conclude(suite, &checks), checks, record),
        Err(e) => match e.downcast::<PlanOverBudget>() {
            Ok(over) => stopped_by_the_plan(suite, device, over),
            Err(e) => (
                Err(could_not("run", &suite.path, &e)),
                Vec::new(),
                RunRecord::default(),
            ),
        },
    };
    result(suite, device, verdict, checks, record, started)
}

/// The verdict, outcomes and record of a run the plan stopped before it trained: `peak_budget`
/// failed at every step the plan put over the budget, nothing else run.
fn stopped_by_the_plan(
    suite: &Suite,
    device: DeviceKind,
    over: PlanOverBudget,
) -> (Result<(), String>, Vec<Outcome>, RunRecord) {
    let record = RunRecord {
        name: suite.trial_name(device),
        suite: suite.file.name.clone(),
        device: device.name().into(),
        planned: crate::forecast::plan(suite),
        ..RunRecord::default()
    };
    let checks = vec![peak_budget::planned(&record, &over.overruns)];
    (Err(over.message), checks, record)
}

/// A trial of a suite whose phases another trainer runs (`engine: {command}`): every phase as
/// the command, with run directories in a temporary directory, then its record judged.
fn run_command(
    suite: &Suite,
    engine: &CommandEngine,
    device: DeviceKind,
    golden_dir: &Path,
) -> TrialResult {
    let started = Instant::now();
    let recorded = suite.check_run().and_then(|()| {
        let work = tempfile::tempdir().context("cannot create a temporary directory")?;
        command_phases::run(suite, engine, device, work.path())
    });
    let mut result = match recorded {
        Ok(record) => judge(suite, device, record, golden_dir),
        Err(e) => failed(suite, device, could_not("run", &suite.path, &e)),
    };
    result.seconds = started.elapsed().as_secs_f64();
    result
}

/// Why a trial of the suite in `file` could not `what` (run, judge): the suite file and the
/// error `e` (which names the file itself when the fault is in it, with its place).
fn could_not(what: &str, file: &Path, e: &anyhow::Error) -> String {
    let (file, why) = (file.display().to_string(), error_text::one_line(e));
    match why.starts_with(&format!("{file}:")) {
        true => format!("could not {what}: {why}"),
        false => format!("could not {what}: {file}: {why}"),
    }
}

/// The verdict on the checks' outcomes of a trial of `suite`: exactly the checks of its
/// `expect_fail` failed and exactly those of its `expect_not_run` had nothing to compare;
/// `Ok` or why not. A check not applicable to the record is neither.
fn conclude(suite: &Suite, checks: &[Outcome]) -> Result<(), String> {
    let failed = verdict(&suite.expect_fail(), &with_status(checks, Status::Failed));
    let not_run = not_run_verdict(
        &suite.expect_not_run(),
        &with_status(checks, Status::NotRun),
    );
    let why: Vec<String> = [failed, not_run]
        .into_iter()
        .filter_map(Result::err)
        .collect();
    if why.is_empty() {
        Ok(())
    } else {
        Err(why.join("; "))
    }
}

/// The trial's result from its verdict, outcomes and record.
fn result(
    suite: &Suite,
    device: DeviceKind,
    verdict: Result<(), String>,
    checks: Vec<Outcome>,
    record: RunRecord,
    started: Instant,
) -> TrialResult {
    TrialResult {
        name: suite.trial_name(device),
        suite: suite.file.name.clone(),
        path: suite.path.clone(),
        device,
        passed: verdict.is_ok(),
        expect_fail: suite.expect_fail(),
        expect_not_run: suite.expect_not_run(),
        verdict: verdict.err().unwrap_or_default(),
        checks,
        seconds: started.elapsed().as_secs_f64(),
        record,
        repeat: None,
    }
}

/// A trial that could not be judged (its record missing or unreadable): failed, with `why` as
/// its verdict.
pub fn failed(suite: &Suite, device: DeviceKind, why: String) -> TrialResult {
    let started = Instant::now();
    result(
        suite,
        device,
        Err(why),
        Vec::new(),
        RunRecord::default(),
        started,
    )
}

/// Judges a run recorded elsewhere (the record of `suite` on `device`, read from a
/// `ckpt-record/1` file) by the suite's checks and expectations, as [`run`] judges its own:
/// the phases the suite plans are what a complete record holds; a check whose inputs the
/// record lacks is not applicable, never passed.
pub fn judge(
    suite: &Suite,
    device: DeviceKind,
    mut record: RunRecord,
    golden_dir: &Path,
) -> TrialResult {
    let started = Instant::now();
    record.name = suite.trial_name(device);
    record.suite.clone_from(&suite.file.name);
    record.device = device.to_string();
    record.planned = crate::forecast::plan(suite);
    let outcome = suite.check_run().and_then(|()| {
        let stored = golden::load(golden_dir, &record.device, &record.suite)?;
        Ok(checks::run_all(&record, &suite.file.checks, &stored))
    });
    let (verdict, checks) = match outcome {
        Ok(checks) => (conclude(suite, &checks), checks),
        Err(e) => (Err(could_not("judge", &suite.path, &e)), Vec::new()),
    };
    result(suite, device, verdict, checks, record, started)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Check::*;

    #[test]
    fn a_suite_file_is_named_once_before_why_its_trial_could_not_run() {
        let file = Path::new("suites/s.yaml");
        let located = anyhow::anyhow!("suites/s.yaml:17:26: invalid configuration: data.path");
        assert_eq!(
            could_not("run", file, &located),
            "could not run: suites/s.yaml:17:26: invalid configuration: data.path"
        );
        let elsewhere = anyhow::anyhow!("tokens.bin: entity not found");
        assert_eq!(
            could_not("judge", file, &elsewhere),
            "could not judge: suites/s.yaml: tokens.bin: entity not found"
        );
    }

    #[test]
    fn ordinary_suites_pass_only_without_failures() {
        assert_eq!(verdict(&[], &[]), Ok(()));
        assert_eq!(
            verdict(&[], &[NoLeak, Golden]),
            Err("failed: no_leak, golden".into())
        );
    }

    #[test]
    fn negative_controls_pass_only_on_exactly_their_checks() {
        assert_eq!(
            verdict(
                &[LossContinuity, StateDigest],
                &[LossContinuity, StateDigest]
            ),
            Ok(())
        );
        let e = verdict(&[LossContinuity, StateDigest], &[LossContinuity]).unwrap_err();
        assert!(
            e.contains("passed though they should fail: state_digest"),
            "{e}"
        );
        let e = verdict(&[MemoryReclaimed], &[MemoryReclaimed, MemoryModel]).unwrap_err();
        assert!(e.contains("also failed: memory_model"), "{e}");
        assert!(verdict(&[PeakBudget], &[]).is_err());
    }

    #[test]
    fn checks_that_did_not_run_fail_the_trial_unless_expected() {
        assert_eq!(not_run_verdict(&[], &[]), Ok(()));
        let e = not_run_verdict(&[], &[LossContinuity, StateDigest]).unwrap_err();
        assert!(
            e.starts_with("not run: loss_continuity, state_digest"),
            "{e}"
        );
        assert!(e.contains("expect_not_run"), "{e}");
        assert_eq!(not_run_verdict(&[StateDigest], &[StateDigest]), Ok(()));
        let e = not_run_verdict(&[StateDigest, NoLeak], &[StateDigest]).unwrap_err();
        assert!(e.contains("ran though expected not to: no_leak"), "{e}");
    }
}
