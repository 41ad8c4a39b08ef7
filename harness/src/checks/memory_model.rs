//! `memory_model`: every step's own peak (above what the device held before the phase's
//! trainer was built) equals the memory model's prediction (for a MoE step, the prediction at
//! the tokens per expert it recorded), and so does every evaluation's of the validation split
//! (at its micro-batches' shapes): to the byte on the CPU, within 2% on
//! CUDA. The CPU device allocates exactly what the model predicts; any difference is an
//! allocation the model does not know of, or one that did not happen. The CUDA backend's tracker
//! counts the bytes it asks the pool for (the pool's own rounding is not in them), and the model
//! replays its allocations too; the 2% leaves room for an allocation cuBLAS or the driver makes
//! on the tracker's behalf in a later version. A step that began with an asynchronous save in
//! flight holds its staging buffers throughout: its prediction is the same step's with the
//! model's staging bytes added under `io` from start to peak.

use super::{bytes, excess, per_rank, Check, Failure, Input, Outcome};
use crate::record::fields::RecordField;
use crate::record::{Phase, PredictedStep, RunRecord};

/// How far a measured peak may be from the predicted `want` bytes on the run's device.
fn tolerance(r: &RunRecord, want: u64) -> u64 {
    match r.device.as_str() {
        "cuda" => want / 50,
        _ => 0,
    }
}

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[RecordField::MemoryModel];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    per_rank::check(input.record, check)
}

/// Compares each step with the prediction for a step starting as it did (with or without
/// AdamW's moments), and each checkpoint load's peak; `compared` counts both.
pub fn check(r: &RunRecord) -> Outcome {
    let mut out = Vec::new();
    let mut compared = 0u64;
    let mut max_diff = 0u64;
    for p in &r.phases {
        let base = p.before.total();
        if p.phase != Phase::Reference && p.oom.is_none() && p.refused.is_none() {
            compared += 1;
            let own = p.setup.peak.saturating_sub(base);
            max_diff = max_diff.max(own.abs_diff(r.predicted_load));
            if own.abs_diff(r.predicted_load) > tolerance(r, r.predicted_load) {
                out.push(
                    Failure::new(Check::MemoryModel, r, "checkpoint load peak")
                        .phase(p.phase)
                        .saw(bytes(r.predicted_load), bytes(own))
                        .detail(format!(
                            "measured at peak: {}; a load should read each tensor into its final place, staging no copy on the device",
                            excess(&p.setup.at_peak, &p.before)
                        )),
                );
            }
        }
        for e in &p.evaluations {
            let Some(&want) = e.predicted_peaks.first() else {
                continue;
            };
            compared += 1;
            let own = e.memory.allocated.peak.saturating_sub(base);
            max_diff = max_diff.max(own.abs_diff(want));
            if own.abs_diff(want) > tolerance(r, want) {
                out.push(
                    Failure::new(Check::MemoryModel, r, "evaluation peak")
                        .phase(p.phase)
                        .step(e.step)
                        .saw(bytes(want), bytes(own))
                        .detail(format!(
                            "measured at peak: {}; an evaluation holds the trainer's state and one forward pass without gradients",
                            excess(&e.memory.at_peak, &p.before)
                        )),
                );
            }
        }
        for s in &p.steps {
            let start = excess(&s.start, &p.before);
            let fail = |what: &str| {
                Failure::new(Check::MemoryModel, r, what)
                    .phase(p.phase)
                    .step(s.step)
            };
            let table = match (&s.predicted, &r.predicted_long) {
                (Some(routed), _) => routed,
                (None, Some((from, long))) if s.step >= *from => long,
                _ => &r.predicted,
            };
            compared += 1;
            let staging = r.staging_for(s);
            let shifted = |w: &PredictedStep| {
                let mut w = w.clone();
                w.start.io += staging;
                w.at_peak.io += staging;
                w.peak += staging;
                w
            };
            let table = table.each_ref().map(shifted);
            let Some(want) = table.iter().find(|w| w.start == start) else {
                out.push(
                    fail("bytes held when the step began")
                        .saw(
                            format!(
                                "{} or {}",
                                bytes(table[1].start.total()),
                                bytes(table[0].start.total())
                            ),
                            bytes(start.total()),
                        )
                        .detail(format!(
                            "held: {start}; predicted: {}; something outlived an earlier step",
                            table[1].start
                        )),
                );
                continue;
            };
            let own = s.memory.allocated.peak.saturating_sub(base);
            max_diff = max_diff.max(own.abs_diff(want.peak));
            if own.abs_diff(want.peak) > tolerance(r, want.peak) {
                out.push(
                    fail("step peak")
                        .saw(bytes(want.peak), bytes(own))
                        .detail(format!(
                            "measured at peak: {}; predicted: {}",
                            excess(&s.memory.at_peak, &p.before),
                            want.at_peak
                        )),
                );
            }
        }
    }
    let implied = r.planned_resumes().count() as u64 + r.planned_steps();
    Outcome::new(Check::MemoryModel, r, compared, implied, out).with("max_diff_bytes", max_diff)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use proptest::prelude::*;

    #[test]
    fn activations_kept_by_skipped_checkpointing_fail() {
        let mut r = fixtures::run();
        let s = &mut r.phases[0].steps[3];
        s.memory.allocated.peak += 1024;
        s.memory.at_peak.activations += 1024;
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with("memory_model: cpu::s reference step 3: step peak: expected 7.3 KiB (7500 bytes), got 8.3 KiB (8524 bytes); measured at peak: params"),
            "{m}"
        );
    }

    #[test]
    fn a_load_that_stages_a_copy_on_the_device_fails() {
        let mut r = fixtures::run();
        let setup = &mut r.phases[2].setup;
        setup.peak += 4096;
        setup.at_peak.io += 4096;
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        assert_eq!(o.failures[0].what, "checkpoint load peak");
        assert!(
            o.failures[0].to_string().contains("resume-end"),
            "{}",
            o.failures[0]
        );
    }

    /// From the long batches' first step on, steps are compared with the long rows' predictions.
    #[test]
    fn long_steps_are_compared_with_the_long_predictions() {
        let mut r = fixtures::run();
        let mut long = r.predicted.clone();
        for p in &mut long {
            p.peak += 2048;
            p.at_peak.activations += 2048;
        }
        r.predicted_long = Some((4, long));
        for s in r.phases.iter_mut().flat_map(|p| &mut p.steps) {
            if s.step >= 4 {
                s.memory.allocated.peak += 2048;
                s.memory.at_peak.activations += 2048;
            }
        }
        let o = check(&r);
        assert!(o.failures.is_empty(), "{:?}", o.failures);
        assert_eq!(o.compared, o.implied);
        r.phases[0].steps[3].memory.allocated.peak += 2048;
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        assert_eq!(o.failures[0].step, Some(3));
    }

    #[test]
    fn inputs_kept_past_the_step_fail() {
        let mut r = fixtures::run();
        r.phases[1].steps[1].start.activations = 512;
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        assert_eq!(o.failures[0].what, "bytes held when the step began");
    }

    #[test]
    fn bytes_left_by_an_earlier_phase_are_not_the_model_s() {
        let mut r = fixtures::run();
        let p = &mut r.phases[1];
        p.before.optimizer = 2000;
        p.setup.peak += 2000;
        p.setup.at_peak.optimizer += 2000;
        for s in &mut p.steps {
            s.start.optimizer += 2000;
            s.memory.allocated.peak += 2000;
            s.memory.at_peak.optimizer += 2000;
        }
        assert!(!check(&r).failed());
    }

    #[test]
    fn a_moe_step_is_held_to_the_prediction_at_its_own_routing() {
        let mut r = fixtures::run();
        let mut routed = r.predicted.clone();
        for p in &mut routed {
            p.peak += 4096;
        }
        let s = &mut r.phases[0].steps[3];
        s.predicted = Some(routed);
        // Measured at the run's balanced prediction: 4 KiB short of the step's own.
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        assert_eq!(o.failures[0].what, "step peak");
        let s = &mut r.phases[0].steps[3];
        s.memory.allocated.peak += 4096;
        assert!(!check(&r).failed());
    }

    /// Shifts every step peak of the first phase by `fraction` of its prediction.
    fn cuda_run_off_by(fraction: f64) -> RunRecord {
        let mut r = fixtures::run();
        r.device = "cuda".into();
        r.name = "cuda::s".into();
        let want = r.predicted[1].peak;
        let delta = (want as f64 * fraction) as u64;
        for s in &mut r.phases[0].steps[1..] {
            s.memory.allocated.peak += delta;
        }
        r
    }

    #[test]
    fn cuda_peaks_within_two_percent_pass_and_beyond_fail() {
        let within = check(&cuda_run_off_by(0.019));
        assert!(!within.failed(), "{:?}", within.failures);
        let beyond = check(&cuda_run_off_by(0.021));
        assert_eq!(beyond.failures.len(), 5);
        assert!(beyond.failures[0]
            .to_string()
            .starts_with("memory_model: cuda::s"));
    }

    /// The fixture's step 3 as a step that began with an asynchronous save's staging held.
    fn staged(measured: u64, predicted: u64) -> RunRecord {
        let mut r = fixtures::run();
        r.predicted_staging = predicted;
        let s = &mut r.phases[0].steps[3];
        s.staging = measured;
        s.start.io += measured;
        s.memory.allocated.peak += measured;
        s.memory.at_peak.io += measured;
        r
    }

    #[test]
    fn a_step_holding_an_async_save_s_staging_is_predicted_with_it() {
        let o = check(&staged(640, 640));
        assert!(o.failures.is_empty(), "{:?}", o.failures);
        assert_eq!(o.compared, o.implied);
        // Staging the model does not know of, or more than it predicts.
        let o = check(&staged(640, 512));
        assert_eq!(o.failures.len(), 1);
        assert_eq!(o.failures[0].what, "bytes held when the step began");
        let o = check(&staged(640, 0));
        assert_eq!(o.failures.len(), 1);
        // Staging held but not counted at the step's peak.
        let mut r = staged(640, 640);
        r.phases[0].steps[3].memory.allocated.peak -= 640;
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        assert_eq!(o.failures[0].what, "step peak");
    }

    proptest! {
        /// A peak one byte off the prediction, either way, fails.
        #[test]
        fn one_byte_off_fails(phase in 0usize..3, step in 0usize..2, up in any::<bool>()) {
            let mut r = fixtures::run();
            let s = &mut r.phases[phase].steps[step];
            s.memory.allocated.peak = if up { s.memory.allocated.peak + 1 } else { s.memory.allocated.peak - 1 };
            prop_assert_eq!(check(&r).failures.len(), 1);
        }
    }
}
