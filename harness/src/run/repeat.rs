//! `run --repeat N`: how far N runs of one trial spread, step by step (loss, gradient norm and
//! step peak of every phase), and the `loss_continuity` setting that spread calls for: `bitwise`
//! where the runs agree bit for bit, else the tightest named profile, or explicit tolerances,
//! that accept four times the largest difference measured.

use crate::record::{Phase, RunRecord};
use crate::suite::Tolerance;
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// How much larger than the measured spread a recommended tolerance must be.
pub const MARGIN: f64 = 4.0;

/// The largest difference from the first run, absolute and relative to the first run's value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Extent {
    /// Largest `|run k − run 1|`.
    pub abs: f64,
    /// Largest `|run k − run 1| / |run 1|` over values that are not zero.
    pub rel: f64,
}

/// The spread of a trial's repeated runs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// Runs compared.
    pub runs: usize,
    /// Steps (of any phase) every run recorded, each compared across the runs.
    pub steps: u64,
    /// Steps some run recorded and another did not (an out-of-memory error in one run only).
    pub unmatched: u64,
    /// Loss.
    pub loss: Extent,
    /// Gradient norm before clipping.
    pub grad_norm: Extent,
    /// Largest difference of a step's peak allocated bytes between two runs.
    pub peak_bytes: u64,
    /// Where the loss spread most, when it spread at all.
    pub widest: Option<(Phase, u64)>,
    /// The `loss_continuity` setting the spread calls for, as a suite writes it.
    pub recommended: String,
}

impl Spread {
    /// The spread of `records`, runs of one trial, measured against the first.
    pub fn of(records: &[RunRecord]) -> Spread {
        let mut s = Spread {
            runs: records.len(),
            ..Spread::default()
        };
        let Some((first, others)) = records.split_first() else {
            s.recommended = recommend(&[], 0);
            return s;
        };
        let mut pairs = Vec::new();
        for phase in &first.phases {
            for step in &phase.steps {
                let matches: Vec<_> = others
                    .iter()
                    .filter_map(|r| {
                        r.phases
                            .iter()
                            .find(|p| p.phase == phase.phase)?
                            .steps
                            .iter()
                            .find(|x| x.step == step.step)
                    })
                    .collect();
                if matches.len() < others.len() {
                    s.unmatched += 1;
                    continue;
                }
                s.steps += 1;
                let peak = step.memory.allocated.peak;
                for other in matches {
                    let loss = (step.loss as f64, other.loss as f64);
                    if widen(&mut s.loss, loss) {
                        s.widest = Some((phase.phase, step.step));
                    }
                    widen(&mut s.grad_norm, (step.grad_norm, other.grad_norm));
                    s.peak_bytes = s.peak_bytes.max(peak.abs_diff(other.memory.allocated.peak));
                    pairs.extend([loss, (step.grad_norm, other.grad_norm)]);
                }
            }
        }
        s.unmatched += others
            .iter()
            .flat_map(|r| &r.phases)
            .flat_map(|p| p.steps.iter().map(move |x| (p.phase, x.step)))
            .filter(|(phase, step)| {
                !first
                    .phases
                    .iter()
                    .any(|p| p.phase == *phase && p.steps.iter().any(|x| x.step == *step))
            })
            .count() as u64;
        s.recommended = recommend(&pairs, s.unmatched);
        s
    }

    /// One line for people: the runs, the spreads and the recommendation.
    pub fn line(&self) -> String {
        let mut out = format!(
            "{} runs, {} steps each: loss ±{:e} (relative {:e}), grad_norm ±{:e}, peak ±{} B",
            self.runs,
            self.steps,
            self.loss.abs,
            self.loss.rel,
            self.grad_norm.abs,
            self.peak_bytes
        );
        if let Some((phase, step)) = self.widest {
            let _ = write!(out, ", widest at {phase} step {step}");
        }
        if self.unmatched > 0 {
            let _ = write!(out, ", {} steps not in every run", self.unmatched);
        }
        let _ = write!(out, "; recommended loss_continuity: {}", self.recommended);
        out
    }
}

/// Widens `e` by the difference of `(first, other)`; whether it grew.
fn widen(e: &mut Extent, (first, other): (f64, f64)) -> bool {
    let abs = (other - first).abs();
    let grew = abs > e.abs || (abs.is_nan() && !e.abs.is_nan());
    e.abs = if abs.is_nan() {
        f64::NAN
    } else {
        e.abs.max(abs)
    };
    if first != 0.0 {
        e.rel = e.rel.max(abs / first.abs());
    }
    grew
}

/// The `loss_continuity` setting under which every `(first, other)` pair, its difference
/// multiplied by [`MARGIN`], passes: `bitwise` when every pair agrees bit for bit, else `tight`
/// or `loose` when they accept it, else explicit tolerances rounded up to one significant digit.
/// Runs that recorded different steps, or a non-finite value, call for no tolerance at all.
pub fn recommend(pairs: &[(f64, f64)], unmatched: u64) -> String {
    if unmatched > 0 {
        return "none: the runs recorded different steps; find why one ended early".into();
    }
    if pairs.iter().any(|(a, b)| !a.is_finite() || !b.is_finite()) {
        return "none: a run recorded a value that is not finite".into();
    }
    if pairs.iter().all(|(a, b)| a.to_bits() == b.to_bits()) {
        return "bitwise".into();
    }
    let accepts = |t: Tolerance| {
        pairs
            .iter()
            .all(|&(a, b)| MARGIN * (b - a).abs() <= t.limit(a))
    };
    for (name, t) in [("tight", Tolerance::TIGHT), ("loose", Tolerance::LOOSE)] {
        if accepts(t) {
            return name.into();
        }
    }
    let rel = pairs
        .iter()
        .filter(|(a, _)| *a != 0.0)
        .map(|&(a, b)| MARGIN * (b - a).abs() / a.abs())
        .fold(0.0, f64::max);
    let abs = pairs
        .iter()
        .filter(|(a, _)| *a == 0.0)
        .map(|&(_, b)| MARGIN * b.abs())
        .fold(0.0, f64::max);
    format!("{{atol: {:e}, rtol: {:e}}}", round_up(abs), round_up(rel))
}

/// `x` rounded up to one significant digit (0 stays 0).
fn round_up(x: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    let scale = 10f64.powf(x.log10().floor());
    let up = (x / scale).ceil() * scale;
    // The division and product can land a hair below x.
    if up < x {
        up + scale
    } else {
        up
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use crate::suite::{Continuity, ContinuitySetting};
    use proptest::prelude::*;

    /// `n` runs of the faithful record, the loss of every step of run k scaled by `1 + k × rel`.
    fn runs(n: usize, rel: f32) -> Vec<RunRecord> {
        (0..n)
            .map(|k| {
                let mut r = fixtures::run();
                for p in &mut r.phases {
                    for s in &mut p.steps {
                        s.loss *= 1.0 + k as f32 * rel;
                    }
                }
                r
            })
            .collect()
    }

    #[test]
    fn identical_runs_are_bitwise() {
        let s = Spread::of(&runs(3, 0.0));
        assert_eq!((s.runs, s.steps, s.unmatched), (3, 12, 0));
        assert_eq!(
            (s.loss, s.peak_bytes, s.widest),
            (Extent::default(), 0, None)
        );
        assert_eq!(s.recommended, "bitwise");
        assert_eq!(
            s.line(),
            "3 runs, 12 steps each: loss ±0e0 (relative 0e0), grad_norm ±0e0, peak ±0 B; recommended loss_continuity: bitwise"
        );
    }

    #[test]
    fn the_spread_picks_the_tightest_profile_that_accepts_four_times_it() {
        assert_eq!(recommend(&[(4.0, 4.0 + 2e-7), (1.5, 1.5)], 0), "tight");
        let s = Spread::of(&runs(3, 1e-5));
        assert_eq!(s.recommended, "loose");
        assert!(s.loss.rel > 1e-5, "{:?}", s.loss);
        assert!(s.widest.is_some());
        // Run 3 is 2e-3 off run 1: four times that, rounded up, is explicit.
        let s = Spread::of(&runs(3, 1e-3));
        let Continuity::Within(t) = parse(&s.recommended) else {
            panic!("{}", s.recommended)
        };
        assert_eq!(t.atol, 0.0);
        assert!((8e-3..=9e-3).contains(&t.rtol), "{}", s.recommended);
    }

    #[test]
    fn a_peak_that_moves_between_runs_is_measured() {
        let mut r = runs(2, 0.0);
        r[1].phases[1].steps[2].memory.allocated.peak += 512;
        let s = Spread::of(&r);
        assert_eq!(s.peak_bytes, 512);
        assert_eq!(s.recommended, "bitwise", "the tolerance is about losses");
    }

    #[test]
    fn runs_that_recorded_different_steps_recommend_nothing() {
        let mut r = runs(2, 0.0);
        r[1].phases[2].steps.pop();
        let s = Spread::of(&r);
        assert_eq!((s.steps, s.unmatched), (11, 1));
        assert!(s
            .recommended
            .starts_with("none: the runs recorded different steps"));
        let mut r = runs(2, 0.0);
        r[0].phases[2].steps.pop();
        assert_eq!(Spread::of(&r).unmatched, 1, "a step only a later run has");
        let mut r = runs(2, 0.0);
        r[1].phases[0].steps[3].loss = f32::NAN;
        assert!(Spread::of(&r).recommended.contains("not finite"));
    }

    #[test]
    fn explicit_tolerances_cover_values_at_zero_with_atol() {
        assert_eq!(
            recommend(&[(0.0, 3e-3), (1.0, 1.0)], 0),
            "{atol: 2e-2, rtol: 0e0}"
        );
        assert_eq!(round_up(0.012), 0.02);
        assert_eq!(round_up(0.03), 0.03);
        assert_eq!(round_up(0.0), 0.0);
    }

    /// The recommendation reads back as a `loss_continuity` setting.
    fn parse(setting: &str) -> Continuity {
        let s: ContinuitySetting = serde_saphyr::from_str(setting).unwrap();
        s.0.unwrap()
    }

    proptest! {
        /// Whatever the spread, the recommended setting parses and accepts every measured pair
        /// with the margin to spare.
        #[test]
        fn the_recommendation_accepts_every_pair_with_its_margin(
            pairs in prop::collection::vec((-10.0f64..10.0, -1e-2f64..1e-2), 1..20)
        ) {
            let pairs: Vec<(f64, f64)> = pairs.iter().map(|&(a, d)| (a, a + d * a.abs().max(1e-3))).collect();
            let c = parse(&recommend(&pairs, 0));
            for &(a, b) in &pairs {
                match c {
                    Continuity::Bitwise => prop_assert_eq!(a.to_bits(), b.to_bits()),
                    Continuity::Within(t) => {
                        prop_assert!(MARGIN * (b - a).abs() <= t.limit(a) * (1.0 + 1e-12), "{a} {b} {t:?}")
                    }
                }
            }
        }
    }
}
