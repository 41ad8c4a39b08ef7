//! What a comparison of a run against a baseline found, as a summary carries it: each change,
//! its kind, and whether it is a regression. [`crate::report::trends`] makes them; the summary
//! ([`crate::report::summary`]) and the reports hold them. A leaf, so that neither of the two
//! imports the other.

use serde::{Deserialize, Serialize};
use std::fmt;

/// What kind of change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A check, or a trial without checks, fails now and did not.
    NewlyFailing,
    /// A check has no verdict now (not run, off), or a trial did not run, and it had one.
    NewlySkipped,
    /// A step's peak rose more than [`crate::report::trends::PEAK_RISE`].
    PeakUp,
    /// The median step time rose more than [`crate::report::trends::TIME_RISE`].
    StepTimeUp,
    /// The reference trajectory's losses differ.
    LossMoved,
    /// One of the engine's benchmark figures fell more than [`crate::report::trends::FIGURE_DROP`].
    FigureDown,
    /// A trial passes now and failed before.
    NewlyPassing,
    /// A trial the baseline does not have.
    NewTrial,
    /// Benchmark figures measured on one side only (a run with `--no-bench`, a figure renamed),
    /// so not compared.
    FigureNotCompared,
}

impl Kind {
    /// Whether the change is for the worse.
    pub fn regression(self) -> bool {
        !matches!(
            self,
            Kind::NewlyPassing | Kind::NewTrial | Kind::FigureNotCompared
        )
    }

    /// How the report names it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::NewlyFailing => "newly failing",
            Kind::NewlySkipped => "newly skipped",
            Kind::PeakUp => "step peak up",
            Kind::StepTimeUp => "step time up",
            Kind::LossMoved => "loss moved",
            Kind::FigureDown => "figure down",
            Kind::NewlyPassing => "newly passing",
            Kind::NewTrial => "new trial",
            Kind::FigureNotCompared => "figure not compared",
        }
    }
}

/// One change.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Change {
    /// What kind.
    pub kind: Kind,
    /// The trial.
    pub trial: String,
    /// What changed: a check, a phase and step.
    pub what: String,
    /// In the baseline.
    pub before: String,
    /// Now.
    pub after: String,
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mark = if self.kind.regression() {
            "REGRESSION"
        } else {
            "change"
        };
        write!(
            f,
            "{mark}: {} {}: {}: {} -> {}",
            self.trial,
            self.kind.name(),
            self.what,
            self.before,
            self.after
        )
    }
}

/// The changes against one baseline ([`Trends::new`] compares).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Trends {
    /// The baseline's summary file, as given.
    pub baseline: String,
    /// Every change, regressions first.
    pub changes: Vec<Change>,
}

impl Trends {
    /// How many changes are regressions.
    pub fn regressions(&self) -> usize {
        self.changes.iter().filter(|c| c.kind.regression()).count()
    }
}
