//! What changed between a baseline run and this one, trial by trial: a check newly failing or
//! newly without a verdict, a trial newly failing, skipped or gone, a step's peak up more than
//! [`PEAK_RISE`], the median step time up more than [`TIME_RISE`], the reference loss trajectory
//! moved; then the benchmarks: one of the engine's figures down more than [`FIGURE_DROP`].
//! Regressions are the changes for the worse; the rest (a trial newly passing, a new trial,
//! figures measured on one side only) are said too.

use crate::checks::Status;
use crate::record::{Phase, RunRecord};
use crate::report::bench::{Bench, Figure};
pub use crate::report::changes::{Change, Kind, Trends};
use crate::report::summary::Summary;
use crate::run::trial::TrialResult;
use ckpt_engine::memory::human_bytes;
use std::collections::BTreeMap;

/// A step peak this much above the baseline's (a fraction) is a regression.
pub const PEAK_RISE: f64 = 0.02;
/// A median step time this much above the baseline's (a fraction) is a regression.
pub const TIME_RISE: f64 = 0.10;
/// A median step time rise below this many seconds is noise, whatever its fraction.
pub const TIME_FLOOR: f64 = 0.001;
/// A benchmark figure this much below the baseline's (a fraction) is a regression.
pub const FIGURE_DROP: f64 = 0.10;
/// What the changes of the benchmarks' figures name in place of a trial (and the id of the
/// report's benchmarks section).
pub const BENCHMARKS: &str = "benchmarks";

/// A status as the reports write it.
pub fn status_name(s: Status) -> &'static str {
    match s {
        Status::Passed => "passed",
        Status::Failed => "failed",
        Status::NotRun => "not run",
        Status::Off => "off",
        Status::NotApplicable => "not applicable",
    }
}

/// Every change of `now` against `baseline`, trial by trial in `now`'s order, then the trials
/// only the baseline has, then the benchmarks' figures.
pub fn compare(baseline: &Summary, now: &Summary) -> Vec<Change> {
    let before: BTreeMap<&str, &TrialResult> = baseline
        .trials
        .iter()
        .map(|t| (t.name.as_str(), t))
        .collect();
    let mut out = Vec::new();
    for t in &now.trials {
        match before.get(t.name.as_str()) {
            Some(b) => out.extend(trial_changes(b, t)),
            None => out.push(change(
                Kind::NewTrial,
                &t.name,
                "trial",
                "absent",
                verdict(t),
            )),
        }
    }
    let ran_now: Vec<&str> = now.trials.iter().map(|t| t.name.as_str()).collect();
    for b in &baseline.trials {
        if ran_now.contains(&b.name.as_str()) {
            continue;
        }
        let after = now
            .skipped
            .iter()
            .find(|s| s.name == b.name)
            .map_or("absent from this run".to_string(), |s| {
                format!("skipped: {}", s.reason)
            });
        out.push(change(
            Kind::NewlySkipped,
            &b.name,
            "trial",
            verdict(b),
            after,
        ));
    }
    out.extend(figure_changes(baseline.bench.as_ref(), now.bench.as_ref()));
    out
}

fn change(
    kind: Kind,
    trial: &str,
    what: impl Into<String>,
    before: impl Into<String>,
    after: impl Into<String>,
) -> Change {
    Change {
        kind,
        trial: trial.into(),
        what: what.into(),
        before: before.into(),
        after: after.into(),
    }
}

fn verdict(t: &TrialResult) -> String {
    if t.passed {
        "passed".into()
    } else {
        format!("failed ({})", t.verdict)
    }
}

/// The changes of one trial.
fn trial_changes(b: &TrialResult, t: &TrialResult) -> Vec<Change> {
    let mut out = Vec::new();
    let was: BTreeMap<_, _> = b.checks.iter().map(|o| (o.check, o.status)).collect();
    for o in &t.checks {
        let Some(&old) = was.get(&o.check) else {
            continue;
        };
        let first = o
            .failures
            .first()
            .map_or(String::new(), |f| format!(": {f}"));
        match o.status {
            Status::Failed if old != Status::Failed && !t.expect_fail.contains(&o.check) => {
                out.push(change(
                    Kind::NewlyFailing,
                    &t.name,
                    o.check.name(),
                    status_name(old),
                    format!("failed{first}"),
                ));
            }
            Status::NotRun | Status::Off
                if matches!(old, Status::Passed | Status::Failed)
                    && !t.expect_not_run.contains(&o.check) =>
            {
                out.push(change(
                    Kind::NewlySkipped,
                    &t.name,
                    o.check.name(),
                    status_name(old),
                    status_name(o.status),
                ));
            }
            _ => {}
        }
    }
    if b.passed && !t.passed && out.iter().all(|c| c.kind != Kind::NewlyFailing) {
        out.push(change(
            Kind::NewlyFailing,
            &t.name,
            "trial",
            "passed",
            verdict(t),
        ));
    }
    if !b.passed && t.passed {
        out.push(change(
            Kind::NewlyPassing,
            &t.name,
            "trial",
            verdict(b),
            "passed",
        ));
    }
    out.extend(peak_rise(&b.record, &t.record, &t.name));
    out.extend(time_rise(&b.record, &t.record, &t.name));
    out.extend(loss_moved(&b.record, &t.record, &t.name));
    out
}

/// Every step's peak by phase and step.
fn peaks(r: &RunRecord) -> BTreeMap<(Phase, u64), u64> {
    r.phases
        .iter()
        .flat_map(|p| {
            p.steps
                .iter()
                .map(move |s| ((p.phase, s.step), s.memory.allocated.peak))
        })
        .collect()
}

/// The step whose peak rose most, when it rose more than [`PEAK_RISE`].
fn peak_rise(b: &RunRecord, t: &RunRecord, trial: &str) -> Option<Change> {
    let old = peaks(b);
    let (at, was, now, rise) = peaks(t)
        .into_iter()
        .filter_map(|(k, now)| {
            let was = *old.get(&k)?;
            let rise = (now as f64 - was as f64) / (was.max(1) as f64);
            Some((k, was, now, rise))
        })
        .max_by(|x, y| x.3.total_cmp(&y.3))?;
    (rise > PEAK_RISE).then(|| {
        change(
            Kind::PeakUp,
            trial,
            format!("{} step {} peak", at.0, at.1),
            human_bytes(was),
            format!("{} (+{:.1}%)", human_bytes(now), rise * 100.0),
        )
    })
}

/// The median of every step's seconds.
fn median_step(r: &RunRecord) -> Option<f64> {
    crate::report::median::median(
        r.phases
            .iter()
            .flat_map(|p| &p.steps)
            .map(|s| s.seconds)
            .collect(),
    )
}

/// The median step time, when it rose more than [`TIME_RISE`] and [`TIME_FLOOR`].
fn time_rise(b: &RunRecord, t: &RunRecord, trial: &str) -> Option<Change> {
    let (was, now) = (median_step(b)?, median_step(t)?);
    let rise = (now - was) / was.max(f64::MIN_POSITIVE);
    (rise > TIME_RISE && now - was > TIME_FLOOR).then(|| {
        change(
            Kind::StepTimeUp,
            trial,
            "median step time",
            format!("{was:.4} s"),
            format!("{now:.4} s (+{:.1}%)", rise * 100.0),
        )
    })
}

/// The first reference step whose loss differs (bit for bit), with the largest difference.
fn loss_moved(b: &RunRecord, t: &RunRecord, trial: &str) -> Option<Change> {
    let (old, now) = (b.reference()?, t.reference()?);
    let was: BTreeMap<u64, f32> = old.steps.iter().map(|s| (s.step, s.loss)).collect();
    let moved: Vec<(u64, f32, f32)> = now
        .steps
        .iter()
        .filter_map(|s| {
            let w = *was.get(&s.step)?;
            (w.to_bits() != s.loss.to_bits()).then_some((s.step, w, s.loss))
        })
        .collect();
    let &(step, w, n) = moved.first()?;
    let largest = moved
        .iter()
        .map(|&(_, w, n)| (f64::from(n) - f64::from(w)).abs())
        .fold(0.0, f64::max);
    Some(change(
        Kind::LossMoved,
        trial,
        format!(
            "reference loss from step {step} ({} steps moved)",
            moved.len()
        ),
        format!("{w:.7}"),
        format!("{n:.7} (largest difference {largest:.3e})"),
    ))
}

/// How many of the engine's figures `bench` holds, as a change's side says it.
fn measured(bench: &Bench) -> String {
    format!("{} measured", bench.judged().count())
}

/// The changes of the engine's benchmark figures: each down more than [`FIGURE_DROP`]; those
/// measured on one side only (every figure, when one run has none: `--no-bench`). Reference
/// figures (PyTorch's, a plain write's) are not compared: the ratios to them are.
fn figure_changes(b: Option<&Bench>, t: Option<&Bench>) -> Vec<Change> {
    let unmatched = |what: &str, before: String, after: String| {
        change(Kind::FigureNotCompared, BENCHMARKS, what, before, after)
    };
    let (b, t) = match (b, t) {
        (None, None) => return Vec::new(),
        (Some(b), None) => {
            return vec![unmatched("figures", measured(b), "not measured".into())];
        }
        (None, Some(t)) => {
            return vec![unmatched("figures", "not measured".into(), measured(t))];
        }
        (Some(b), Some(t)) => (b, t),
    };
    let same = |f: &Figure, g: &Figure| f.name == g.name && f.unit == g.unit;
    let mut out = Vec::new();
    for now in t.judged() {
        let Some(was) = b.judged().find(|was| same(was, now)) else {
            out.push(unmatched(&now.name, "not measured".into(), now.shown()));
            continue;
        };
        let drop = (was.value - now.value) / was.value;
        if drop > FIGURE_DROP {
            out.push(change(
                Kind::FigureDown,
                BENCHMARKS,
                &now.name,
                was.shown(),
                format!("{} (-{:.1}%)", now.shown(), drop * 100.0),
            ));
        }
    }
    for was in b
        .judged()
        .filter(|was| !t.judged().any(|now| same(was, now)))
    {
        out.push(unmatched(&was.name, was.shown(), "not measured".into()));
    }
    out
}

impl Trends {
    /// The changes of `now` against `baseline`, read from the file named `file`.
    pub fn new(file: &str, baseline: &Summary, now: &Summary) -> Self {
        let mut changes = compare(baseline, now);
        changes.sort_by_key(|c| !c.kind.regression());
        Trends {
            baseline: file.into(),
            changes,
        }
    }

    /// The changes as lines for a terminal, after a heading naming the baseline.
    pub fn text(&self) -> String {
        let mut out = format!(
            "against {}: {} regressions, {} changes\n",
            self.baseline,
            self.regressions(),
            self.changes.len()
        );
        for c in &self.changes {
            out.push_str(&format!("  {c}\n"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::{fixtures, Check, Failure, Outcome};
    use crate::devices::DeviceKind;
    use crate::report::summary::Skipped;

    /// A hand-made trial over the fixture's run, every check passed.
    fn trial(name: &str) -> TrialResult {
        let mut record = fixtures::run();
        record.name = name.into();
        TrialResult {
            name: name.into(),
            suite: "s".into(),
            path: "suites/s.yaml".into(),
            device: DeviceKind::Cpu,
            passed: true,
            expect_fail: Vec::new(),
            expect_not_run: Vec::new(),
            verdict: String::new(),
            checks: Check::ALL
                .iter()
                .map(|&c| Outcome::new(c, &record, 1, 1, Vec::new()))
                .collect(),
            seconds: 1.0,
            record,
            repeat: None,
        }
    }

    fn summary(trials: Vec<TrialResult>) -> Summary {
        Summary::new(trials, Vec::new())
    }

    fn kinds(changes: &[Change]) -> Vec<(Kind, &str)> {
        changes.iter().map(|c| (c.kind, c.what.as_str())).collect()
    }

    #[test]
    fn the_same_run_changed_nothing() {
        let s = summary(vec![trial("cpu::a"), trial("cpu::b")]);
        assert_eq!(compare(&s, &s), []);
    }

    #[test]
    fn a_check_newly_failing_is_a_regression_naming_its_first_failure() {
        let old = summary(vec![trial("cpu::a")]);
        let mut t = trial("cpu::a");
        let r = t.record.clone();
        t.checks[4] = Outcome::new(
            Check::NoLeak,
            &r,
            9,
            9,
            vec![Failure::new(Check::NoLeak, &r, "held").saw(1, 2)],
        );
        t.passed = false;
        t.verdict = "failed: no_leak".into();
        let changes = compare(&old, &summary(vec![t]));
        assert_eq!(kinds(&changes), [(Kind::NewlyFailing, "no_leak")]);
        assert!(
            changes[0].after.contains("expected 1, got 2"),
            "{changes:?}"
        );
        assert!(changes[0].kind.regression());
    }

    #[test]
    fn an_expected_failure_of_a_negative_control_is_no_regression() {
        let old = summary(vec![trial("cpu::faults::x")]);
        let mut t = trial("cpu::faults::x");
        t.expect_fail = vec![Check::NoLeak];
        t.checks[4] = Outcome::new(
            Check::NoLeak,
            &t.record,
            9,
            9,
            vec![Failure::new(Check::NoLeak, &t.record, "held")],
        );
        assert_eq!(compare(&old, &summary(vec![t])), []);
    }

    #[test]
    fn checks_and_trials_newly_skipped_are_regressions() {
        let old = summary(vec![trial("cpu::a"), trial("cuda::a")]);
        let mut t = trial("cpu::a");
        t.checks[0] = Outcome::new(Check::LossContinuity, &t.record, 0, 0, Vec::new());
        let mut now = summary(vec![t]);
        now.skipped.push(Skipped {
            name: "cuda::a".into(),
            reason: "no cuda device".into(),
        });
        let changes = compare(&old, &now);
        assert_eq!(
            kinds(&changes),
            [
                (Kind::NewlySkipped, "loss_continuity"),
                (Kind::NewlySkipped, "trial")
            ]
        );
        assert_eq!(changes[1].after, "skipped: no cuda device");
    }

    #[test]
    fn a_step_peak_up_more_than_2_percent_is_flagged_and_2_percent_is_not() {
        let old = summary(vec![trial("cpu::a")]);
        let peak = old.trials[0].record.phases[1].steps[1]
            .memory
            .allocated
            .peak;
        for (now_peak, flagged) in [(peak + peak / 50, false), (peak + peak / 40, true)] {
            let mut t = trial("cpu::a");
            t.record.phases[1].steps[1].memory.allocated.peak = now_peak;
            let changes = compare(&old, &summary(vec![t]));
            let want: &[(Kind, &str)] = if flagged {
                &[(Kind::PeakUp, "resume-mid step 3 peak")]
            } else {
                &[]
            };
            assert_eq!(kinds(&changes), want, "{now_peak} against {peak}");
        }
    }

    #[test]
    fn step_time_up_more_than_10_percent_is_flagged() {
        let old = summary(vec![trial("cpu::a")]);
        let mut t = trial("cpu::a");
        for p in &mut t.record.phases {
            for s in &mut p.steps {
                s.seconds = 0.0125;
            }
        }
        let changes = compare(&old, &summary(vec![t.clone()]));
        assert_eq!(kinds(&changes), [(Kind::StepTimeUp, "median step time")]);
        assert_eq!(changes[0].after, "0.0125 s (+25.0%)");
        for p in &mut t.record.phases {
            for s in &mut p.steps {
                s.seconds = 0.0105;
            }
        }
        assert_eq!(compare(&old, &summary(vec![t])), []);
    }

    #[test]
    fn a_loss_trajectory_that_moved_names_its_first_step() {
        let old = summary(vec![trial("cpu::a")]);
        let mut t = trial("cpu::a");
        t.record.phases[0].steps[3].loss += 1e-6;
        t.record.phases[0].steps[5].loss = f32::NAN;
        let changes = compare(&old, &summary(vec![t]));
        assert_eq!(
            kinds(&changes),
            [(
                Kind::LossMoved,
                "reference loss from step 3 (2 steps moved)"
            )]
        );
    }

    #[test]
    fn new_and_newly_passing_trials_are_changes_not_regressions() {
        let mut failing = trial("cpu::a");
        failing.passed = false;
        failing.verdict = "could not run: x".into();
        let old = summary(vec![failing]);
        let now = summary(vec![trial("cpu::a"), trial("cpu::b")]);
        let t = Trends::new("old/summary.json", &old, &now);
        assert_eq!(
            kinds(&t.changes),
            [(Kind::NewlyPassing, "trial"), (Kind::NewTrial, "trial")]
        );
        assert_eq!(t.regressions(), 0);
        assert!(t
            .text()
            .starts_with("against old/summary.json: 0 regressions, 2 changes\n"));
    }

    /// Figures of the engine in tokens/s, then one reference figure.
    fn bench(engine: &[(&str, f64)], reference: f64) -> Bench {
        let figure = |name: &str, value, reference| Figure {
            name: name.into(),
            unit: "tokens/s".into(),
            value,
            reference,
        };
        let mut figures: Vec<Figure> = engine
            .iter()
            .map(|&(name, value)| figure(name, value, false))
            .collect();
        figures.push(figure("pytorch tokens/s", reference, true));
        Bench {
            command: "scripts/bench.sh".into(),
            machine: "m".into(),
            figures,
        }
    }

    fn with_bench(bench: Option<Bench>) -> Summary {
        let mut s = summary(vec![trial("cpu::a")]);
        s.bench = bench;
        s
    }

    #[test]
    fn a_figure_down_more_than_10_percent_is_a_regression_and_10_percent_is_not() {
        let old = with_bench(Some(bench(&[("engine tokens/s", 1000.0)], 900.0)));
        let cases = [
            (1000.0 / 1.2, true),
            (1000.0 / 1.05, false),
            (900.0, false),
            (899.0, true),
            (1500.0, false),
        ];
        for (now, flagged) in cases {
            let new = with_bench(Some(bench(&[("engine tokens/s", now)], 900.0)));
            let changes = compare(&old, &new);
            let want: &[(Kind, &str)] = if flagged {
                &[(Kind::FigureDown, "engine tokens/s")]
            } else {
                &[]
            };
            assert_eq!(kinds(&changes), want, "{now} against 1000");
        }
        let new = with_bench(Some(bench(&[("engine tokens/s", 800.0)], 900.0)));
        let t = Trends::new("old/summary.json", &old, &new);
        assert_eq!(t.regressions(), 1);
        assert_eq!(
            t.changes[0].to_string(),
            "REGRESSION: benchmarks figure down: engine tokens/s: 1000 tokens/s -> 800 tokens/s (-20.0%)"
        );
    }

    #[test]
    fn a_reference_figure_down_is_not_compared() {
        let old = with_bench(Some(bench(&[("engine tokens/s", 1000.0)], 900.0)));
        let new = with_bench(Some(bench(&[("engine tokens/s", 1000.0)], 500.0)));
        assert_eq!(compare(&old, &new), []);
    }

    #[test]
    fn figures_measured_on_one_side_only_are_said_and_no_regression() {
        let both = bench(&[("engine tokens/s", 1000.0), ("load GB/s", 2.0)], 900.0);
        let cases = [
            (
                Some(both.clone()),
                None,
                "figures",
                "2 measured",
                "not measured",
            ),
            (
                None,
                Some(both.clone()),
                "figures",
                "not measured",
                "2 measured",
            ),
            (
                Some(both.clone()),
                Some(bench(&[("engine tokens/s", 1000.0)], 900.0)),
                "load GB/s",
                "2.00 tokens/s",
                "not measured",
            ),
            (
                Some(bench(&[("engine tokens/s", 1000.0)], 900.0)),
                Some(both),
                "load GB/s",
                "not measured",
                "2.00 tokens/s",
            ),
        ];
        for (old, new, what, before, after) in cases {
            let t = Trends::new("old", &with_bench(old), &with_bench(new));
            assert_eq!(kinds(&t.changes), [(Kind::FigureNotCompared, what)]);
            assert_eq!(
                (t.changes[0].before.as_str(), t.changes[0].after.as_str()),
                (before, after)
            );
            assert_eq!(t.regressions(), 0, "{:?}", t.changes);
        }
    }

    #[test]
    fn a_trial_that_could_not_run_any_more_is_newly_failing() {
        let old = summary(vec![trial("cpu::a")]);
        let mut t = trial("cpu::a");
        t.passed = false;
        t.checks.clear();
        t.record = RunRecord::default();
        t.verdict = "could not run: suites/s.yaml: no such file".into();
        let changes = compare(&old, &summary(vec![t]));
        assert_eq!(kinds(&changes), [(Kind::NewlyFailing, "trial")]);
    }
}
