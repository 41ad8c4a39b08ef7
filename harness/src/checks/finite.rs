//! `finite`: every recorded step's loss and gradient norm are finite numbers. A run that
//! diverged (NaN or infinity) can still resume bit for bit and keep its memory in order, so the
//! other checks pass it; this one does not.

use super::{Check, Failure, Input, Outcome};
use crate::record::fields::RecordField;
use crate::record::{RunRecord, StepRecord};

/// The step's values that are not finite, by name.
fn non_finite(s: &StepRecord) -> Vec<(&'static str, f64)> {
    [("loss", s.loss as f64), ("grad_norm", s.grad_norm)]
        .into_iter()
        .filter(|(_, v)| !v.is_finite())
        .collect()
}

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    check(input.record)
}

/// Names the first step of each phase whose loss or gradient norm is not finite; `compared`
/// counts the steps.
pub fn check(r: &RunRecord) -> Outcome {
    let mut out = Vec::new();
    let mut compared = 0u64;
    let mut bad_steps = 0u64;
    for p in &r.phases {
        compared += p.steps.len() as u64;
        let bad: Vec<(&StepRecord, Vec<(&str, f64)>)> = p
            .steps
            .iter()
            .map(|s| (s, non_finite(s)))
            .filter(|(_, v)| !v.is_empty())
            .collect();
        bad_steps += bad.len() as u64;
        if let Some((s, values)) = bad.first() {
            let names: Vec<&str> = values.iter().map(|(n, _)| *n).collect();
            let got: Vec<String> = values.iter().map(|(_, v)| v.to_string()).collect();
            out.push(
                Failure::new(Check::Finite, r, names.join(" and "))
                    .phase(p.phase)
                    .step(s.step)
                    .saw("a finite number", got.join(" and "))
                    .detail(format!(
                        "{} of the phase's {} steps are not finite; the run diverged: lower optimizer.lr, set optimizer.grad_clip, or shrink init.std",
                        bad.len(),
                        p.steps.len()
                    )),
            );
        }
    }
    Outcome::new(Check::Finite, r, compared, r.planned_steps(), out)
        .with("non_finite_steps", bad_steps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use proptest::prelude::*;

    #[test]
    fn a_nan_gradient_norm_fails_at_its_step() {
        let mut r = fixtures::run();
        for s in &mut r.phases[0].steps[3..] {
            s.grad_norm = f64::NAN;
        }
        r.phases[0].steps[4].loss = f32::INFINITY;
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        assert_eq!(o.compared, 12);
        assert_eq!(o.figures["non_finite_steps"], serde_json::json!(3));
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with("finite: cpu::s reference step 3: grad_norm: expected a finite number, got NaN; 3 of the phase's 6 steps"),
            "{m}"
        );
    }

    #[test]
    fn every_phase_names_its_first_non_finite_step() {
        let mut r = fixtures::run();
        for p in &mut r.phases {
            for s in &mut p.steps {
                s.loss = f32::NAN;
                s.grad_norm = f64::NEG_INFINITY;
            }
        }
        let o = check(&r);
        let at: Vec<(String, Option<u64>)> = o
            .failures
            .iter()
            .map(|f| (f.what.clone(), f.step))
            .collect();
        let both = "loss and grad_norm".to_string();
        assert_eq!(
            at,
            [
                (both.clone(), Some(0)),
                (both.clone(), Some(2)),
                (both, Some(4))
            ]
        );
        assert_eq!(o.failures[0].actual, "NaN and -inf");
    }

    proptest! {
        /// Any one non-finite loss, anywhere, fails; finite ones of any size pass.
        #[test]
        fn one_non_finite_loss_fails(phase in 0usize..3, step in 0usize..2, big in -3.0e38f32..3.0e38) {
            let mut r = fixtures::run();
            r.phases[phase].steps[step].loss = big;
            prop_assert!(!check(&r).failed());
            r.phases[phase].steps[step].loss = f32::NAN;
            prop_assert_eq!(check(&r).failures.len(), 1);
        }
    }
}
