//! `loss_continuity`: every resumed step equals the reference step of the same index: loss,
//! learning rate and gradient norm, bit for bit or within a tolerance. A mismatch in a phase that
//! resumed in another execution environment than its checkpoint's names what differed.

use super::{Check, Failure, Input, Outcome};
use crate::checks::spec::Continuity;
use crate::record::fields::RecordField;
use crate::record::{Phase, PhaseRecord, RunRecord};
use ckpt_engine::environment;

fn same(c: Continuity, want: f64, got: f64, bits_equal: bool) -> bool {
    match c {
        Continuity::Bitwise => bits_equal,
        Continuity::Within(t) => t.accepts(want, got),
    }
}

fn describe(c: Continuity, want: f64) -> String {
    match c {
        Continuity::Bitwise => format!("{want:e} bit for bit"),
        Continuity::Within(t) => format!(
            "{want:e} within {:e} (atol {:e} + rtol {:e} x |reference|)",
            t.limit(want),
            t.atol,
            t.rtol
        ),
    }
}

/// What a mismatch's detail adds when `phase` resumed in another execution environment than
/// its checkpoint's: the fields that differ, saved → now. Empty otherwise.
fn environment_note(phase: &PhaseRecord) -> String {
    if phase.env_changes.is_empty() {
        return String::new();
    }
    format!(
        "; the resume ran in another execution environment than the checkpoint's: {}",
        environment::describe(&phase.env_changes)
    )
}

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    check(input.record, input.spec.loss_continuity.0.unwrap_or(Continuity::Bitwise))
}

/// Compares every resumed step with the reference under `c`; `compared` counts the resumed
/// steps.
pub fn check(r: &RunRecord, c: Continuity) -> Outcome {
    let Some(reference) = r.reference() else {
        let f = Failure::new(Check::LossContinuity, r, "the reference phase")
            .saw("recorded", "missing");
        return Outcome::new(Check::LossContinuity, r, 0, 0, vec![f]);
    };
    let mut out = Vec::new();
    let mut compared = 0u64;
    let mut max_loss_diff = 0f64;
    for phase in r.phases.iter().filter(|p| p.phase != Phase::Reference) {
        let note = environment_note(phase);
        for s in &phase.steps {
            let fail = |what: &str| {
                Failure::new(Check::LossContinuity, r, what)
                    .phase(phase.phase)
                    .step(s.step)
            };
            let Some(want) = reference.steps.iter().find(|x| x.step == s.step) else {
                out.push(fail("the reference's step").saw("recorded", "missing"));
                continue;
            };
            compared += 1;
            max_loss_diff = max_loss_diff.max((s.loss as f64 - want.loss as f64).abs());
            let fields = [
                (
                    "loss",
                    want.loss as f64,
                    s.loss as f64,
                    want.loss.to_bits() == s.loss.to_bits(),
                ),
                ("lr", want.lr, s.lr, want.lr.to_bits() == s.lr.to_bits()),
                (
                    "grad_norm",
                    want.grad_norm,
                    s.grad_norm,
                    want.grad_norm.to_bits() == s.grad_norm.to_bits(),
                ),
            ];
            for (name, w, g, bits_equal) in fields {
                if !same(c, w, g, bits_equal) {
                    out.push(
                        fail(name)
                            .saw(describe(c, w), format!("{g:e}"))
                            .detail(format!("off by {:e}{note}", (g - w).abs())),
                    );
                }
            }
        }
    }
    let implied = r.planned_resumes().map(|p| p.steps()).sum();
    Outcome::new(Check::LossContinuity, r, compared, implied, out)
        .with(
            "mode",
            match c {
                Continuity::Bitwise => "bitwise".to_string(),
                Continuity::Within(t) => format!("atol {:e} rtol {:e}", t.atol, t.rtol),
            },
        )
        .with("max_loss_diff", max_loss_diff)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use crate::checks::spec::Tolerance;
    use ckpt_engine::EnvChange;
    use proptest::prelude::*;

    fn with_resumed_loss(loss: f32) -> RunRecord {
        let mut r = fixtures::run();
        r.phases[1].steps[0].loss = loss;
        r
    }

    #[test]
    fn one_ulp_of_loss_breaks_bitwise_continuity() {
        let want = fixtures::step(2).loss;
        let o = check(
            &with_resumed_loss(f32::from_bits(want.to_bits() + 1)),
            Continuity::Bitwise,
        );
        assert_eq!(o.failures.len(), 1);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with("loss_continuity: cpu::s resume-mid step 2: loss: expected 3.75e0 bit for bit, got 3.7500002"),
            "{m}"
        );
    }

    fn resumed_elsewhere(mut r: RunRecord) -> RunRecord {
        r.phases[1].env_changes = vec![EnvChange {
            field: "cpu_kernels".into(),
            saved: "x86_64 avx512f".into(),
            now: "x86_64 fma".into(),
        }];
        r
    }

    #[test]
    fn a_mismatch_after_a_resume_elsewhere_names_what_differed() {
        let want = fixtures::step(2).loss;
        let one_ulp = f32::from_bits(want.to_bits() + 1);
        let o = check(
            &resumed_elsewhere(with_resumed_loss(one_ulp)),
            Continuity::Bitwise,
        );
        assert_eq!(o.failures.len(), 1);
        let m = o.failures[0].to_string();
        assert!(
            m.ends_with("; the resume ran in another execution environment than the checkpoint's: cpu_kernels: x86_64 avx512f → x86_64 fma"),
            "{m}"
        );
        let o = check(&with_resumed_loss(one_ulp), Continuity::Bitwise);
        let m = o.failures[0].to_string();
        assert!(!m.contains("environment"), "{m}");
    }

    #[test]
    fn a_resume_elsewhere_without_a_mismatch_changes_nothing() {
        let faithful = check(&fixtures::run(), Continuity::Bitwise);
        let elsewhere = check(&resumed_elsewhere(fixtures::run()), Continuity::Bitwise);
        assert!(!elsewhere.failed());
        assert_eq!(elsewhere, faithful);
    }

    #[test]
    fn the_largest_loss_difference_is_reported() {
        let want = fixtures::step(2).loss;
        let o = check(&with_resumed_loss(want + 0.25), Continuity::Bitwise);
        assert_eq!(o.figures["max_loss_diff"], serde_json::json!(0.25));
    }

    #[test]
    fn a_restarted_schedule_fails() {
        let mut r = fixtures::run();
        for (i, s) in r.phases[2].steps.iter_mut().enumerate() {
            s.lr = 0.001 * (i + 1) as f64;
        }
        let o = check(&r, Continuity::Bitwise);
        assert!(o.failed());
        assert!(
            o.failures.iter().all(|f| f.what == "lr"),
            "{:?}",
            o.failures
        );
    }

    #[test]
    fn a_changed_gradient_norm_fails_bitwise_and_beyond_a_tolerance() {
        let mut r = fixtures::run();
        let want = r.phases[2].steps[1].grad_norm;
        r.phases[2].steps[1].grad_norm = f64::from_bits(want.to_bits() + 1);
        let o = check(&r, Continuity::Bitwise);
        assert_eq!(o.failures.len(), 1, "{:?}", o.failures);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with(
                "loss_continuity: cpu::s resume-end step 5: grad_norm: expected 1.5e0 bit for bit"
            ),
            "{m}"
        );
        assert!(!check(&r, Continuity::Within(Tolerance::TIGHT)).failed());
        r.phases[2].steps[1].grad_norm = want * (1.0 + 1e-5);
        let o = check(&r, Continuity::Within(Tolerance::TIGHT));
        assert_eq!(o.failures.len(), 1, "{:?}", o.failures);
        assert_eq!(o.failures[0].what, "grad_norm");
    }

    #[test]
    fn a_changed_learning_rate_fails_within_a_tolerance() {
        let mut r = fixtures::run();
        r.phases[1].steps[0].lr *= 1.0 + 1e-4;
        let o = check(&r, Continuity::Within(Tolerance::TIGHT));
        assert_eq!(o.failures.len(), 1, "{:?}", o.failures);
        assert_eq!(o.failures[0].what, "lr");
    }

    #[test]
    fn profiles_accept_what_they_promise() {
        let o = check(
            &with_resumed_loss(3.75 + 3e-6),
            Continuity::Within(Tolerance::TIGHT),
        );
        assert!(!o.failed(), "{:?}", o.failures);
        let o = check(
            &with_resumed_loss(3.75 + 1e-4),
            Continuity::Within(Tolerance::TIGHT),
        );
        assert!(o.failed());
        let o = check(
            &with_resumed_loss(3.75 + 1e-4),
            Continuity::Within(Tolerance::LOOSE),
        );
        assert!(!o.failed(), "{:?}", o.failures);
    }

    fn next_up(x: f64) -> f64 {
        f64::from_bits(x.to_bits() + 1)
    }

    proptest! {
        /// A difference exactly at the absolute tolerance passes; with the tolerance one float
        /// below it, it fails.
        #[test]
        fn the_absolute_limit_is_inclusive(want in -1e3f64..1e3, got in -1e3f64..1e3) {
            let diff = (got - want).abs();
            prop_assume!(diff > 0.0);
            let at = Tolerance { atol: diff, rtol: 0.0 };
            prop_assert!(at.accepts(want, got));
            let below = Tolerance { atol: f64::from_bits(diff.to_bits() - 1), rtol: 0.0 };
            prop_assert!(!below.accepts(want, got));
        }

        /// A loss exactly at `want + atol` passes the check, the next float above fails.
        #[test]
        fn the_next_float_above_the_limit_fails(want in 1.0f32..8.0, ulps in 1u32..1000) {
            let at = f32::from_bits(want.to_bits() + ulps);
            let atol = at as f64 - want as f64;
            let tol = Continuity::Within(Tolerance { atol, rtol: 0.0 });
            let mut r = fixtures::run();
            r.phases[0].steps[2].loss = want;
            r.phases[1].steps[0].loss = at;
            prop_assert!(!check(&r, tol).failed());
            r.phases[1].steps[0].loss = f32::from_bits(at.to_bits() + 1);
            prop_assert!(check(&r, tol).failed());
        }

        /// The relative limit is inclusive too: with a power-of-two reference the difference,
        /// the ratio and the limit are exact.
        #[test]
        fn the_relative_limit_is_inclusive(exp in -8i32..8, frac in 1e-9f64..1.0) {
            let want = 2f64.powi(exp);
            let got = want * (1.0 + frac);
            let diff = got - want;
            let rtol = diff / want;
            let at = Tolerance { atol: 0.0, rtol };
            let below = Tolerance { atol: 0.0, rtol: f64::from_bits(rtol.to_bits() - 1) };
            prop_assert!(at.accepts(want, got));
            prop_assert!(!below.accepts(want, got));
            prop_assert!(!at.accepts(want, next_up(got)));
        }

        /// Bitwise continuity fails on any difference in any field.
        #[test]
        fn bitwise_sees_every_changed_bit(bit in 0u32..32) {
            let want = fixtures::step(2).loss;
            let got = f32::from_bits(want.to_bits() ^ (1 << bit));
            prop_assume!(!got.is_nan());
            prop_assert!(check(&with_resumed_loss(got), Continuity::Bitwise).failed());
        }
    }
}
