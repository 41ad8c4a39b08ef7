//! Checks: pure functions over a [`RunRecord`]. Each returns the failures it found, each failure
//! naming suite, device, phase, step, check, and expected vs actual.

use crate::phases::{Phase, RunRecord};
use ckpt_engine::memory::human_bytes;
use serde::Serialize;

/// One failed expectation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Failure {
    /// The check that failed.
    pub check: &'static str,
    /// Where and what.
    pub message: String,
}

/// Every check's name, in report order.
pub const ALL: [&str; 4] = [
    "loss_continuity",
    "memory_reclaimed",
    "ac_coverage",
    "memory_model",
];

/// Runs every check.
pub fn run_all(r: &RunRecord) -> Vec<Failure> {
    let mut out = loss_continuity(r);
    out.extend(memory_reclaimed(r));
    out.extend(ac_coverage(r));
    out.extend(memory_model(r));
    out
}

fn at(r: &RunRecord, phase: Phase, step: Option<u64>) -> String {
    match step {
        Some(s) => format!("{}/{} {phase} step {s}", r.device, r.suite),
        None => format!("{}/{} {phase}", r.device, r.suite),
    }
}

/// Every resumed step equals the reference step of the same index, bit for bit: loss, learning
/// rate and gradient norm.
pub fn loss_continuity(r: &RunRecord) -> Vec<Failure> {
    let Some(reference) = r.phases.iter().find(|p| p.phase == Phase::Reference) else {
        return vec![Failure {
            check: "loss_continuity",
            message: format!("{}/{}: no reference phase was recorded", r.device, r.suite),
        }];
    };
    let mut out = Vec::new();
    for phase in r.phases.iter().filter(|p| p.phase != Phase::Reference) {
        for s in &phase.steps {
            let Some(want) = reference.steps.iter().find(|x| x.step == s.step) else {
                out.push(Failure {
                    check: "loss_continuity",
                    message: format!(
                        "{}: the reference has no step {}",
                        at(r, phase.phase, Some(s.step)),
                        s.step
                    ),
                });
                continue;
            };
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
            for (name, w, g, same) in fields {
                if !same {
                    out.push(Failure {
                        check: "loss_continuity",
                        message: format!(
                            "{}: {name} {g} differs from the reference's {w} (bitwise comparison)",
                            at(r, phase.phase, Some(s.step))
                        ),
                    });
                }
            }
        }
    }
    out
}

/// After each phase's trainer is dropped, allocated bytes return exactly to the pre-phase level.
pub fn memory_reclaimed(r: &RunRecord) -> Vec<Failure> {
    r.phases
        .iter()
        .filter(|p| p.allocated_after != p.allocated_before)
        .map(|p| Failure {
            check: "memory_reclaimed",
            message: format!(
                "{}: {} still allocated after the trainer was dropped ({} before it was built); something outlives the trainer",
                at(r, p.phase, None),
                human_bytes(p.allocated_after),
                human_bytes(p.allocated_before)
            ),
        })
        .collect()
}

/// With activation checkpointing on, every step recomputes every block.
pub fn ac_coverage(r: &RunRecord) -> Vec<Failure> {
    if !r.checkpointing {
        return Vec::new();
    }
    r.phases
        .iter()
        .flat_map(|p| p.steps.iter().map(move |s| (p.phase, s)))
        .filter(|(_, s)| s.recomputed_blocks != r.layers)
        .map(|(phase, s)| Failure {
            check: "ac_coverage",
            message: format!(
                "{}: {} of {} blocks recomputed; checkpointing is configured but not applied to every block",
                at(r, phase, Some(s.step)),
                s.recomputed_blocks,
                r.layers
            ),
        })
        .collect()
}

/// Every step's measured peak equals the memory model's prediction to the byte (the CPU device
/// allocates exactly what the model predicts; any difference is an allocation the model does
/// not know of, or one that did not happen).
pub fn memory_model(r: &RunRecord) -> Vec<Failure> {
    r.phases
        .iter()
        .flat_map(|p| p.steps.iter().map(move |s| (p.phase, s)))
        .filter_map(|(phase, s)| {
            // Step 0 of a run is the only one that starts without AdamW's moments.
            let want = &r.predicted[usize::from(s.step > 0)];
            (s.memory.allocated.peak != want.peak).then(|| Failure {
                check: "memory_model",
                message: format!(
                    "{}: step peak {} ({} bytes), the memory model predicts {} ({} bytes); measured at peak: {}; predicted: {}",
                    at(r, phase, Some(s.step)),
                    human_bytes(s.memory.allocated.peak),
                    s.memory.allocated.peak,
                    human_bytes(want.peak),
                    want.peak,
                    s.memory.at_peak,
                    want.at_peak
                ),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::phases::{PhaseRecord, PredictedStep, StepRecord};

    fn step(step: u64, loss: f32, recomputed: usize) -> StepRecord {
        StepRecord {
            step,
            loss,
            lr: 0.1,
            grad_norm: 1.0,
            recomputed_blocks: recomputed,
            memory: Default::default(),
        }
    }

    fn record(resumed_loss: f32, after: u64, recomputed: usize) -> RunRecord {
        RunRecord {
            suite: "s".into(),
            device: "cpu".into(),
            layers: 2,
            checkpointing: true,
            predicted: [0, 0].map(|peak| PredictedStep {
                peak,
                at_peak: Default::default(),
            }),
            phases: vec![
                PhaseRecord {
                    phase: Phase::Reference,
                    allocated_before: 0,
                    allocated_after: 0,
                    steps: vec![step(0, 3.0, 2), step(1, 2.5, 2)],
                },
                PhaseRecord {
                    phase: Phase::ResumeMid,
                    allocated_before: 0,
                    allocated_after: after,
                    steps: vec![step(1, resumed_loss, recomputed)],
                },
            ],
        }
    }

    #[test]
    fn a_faithful_run_passes_every_check() {
        assert_eq!(run_all(&record(2.5, 0, 2)), vec![]);
    }

    #[test]
    fn one_ulp_of_loss_breaks_continuity() {
        let f = loss_continuity(&record(f32::from_bits(2.5f32.to_bits() + 1), 0, 2));
        assert_eq!(f.len(), 1);
        assert!(
            f[0].message.contains("cpu/s resume-mid step 1: loss"),
            "{}",
            f[0].message
        );
    }

    #[test]
    fn one_leaked_byte_fails_memory_reclaimed() {
        let f = memory_reclaimed(&record(2.5, 1, 2));
        assert_eq!(f.len(), 1);
        assert!(
            f[0].message.contains("1 B still allocated"),
            "{}",
            f[0].message
        );
    }

    #[test]
    fn one_byte_over_the_model_fails_memory_model() {
        let mut r = record(2.5, 0, 2);
        r.phases[1].steps[0].memory.allocated.peak = 1;
        let f = memory_model(&r);
        assert_eq!(f.len(), 1);
        assert!(
            f[0].message
                .contains("resume-mid step 1: step peak 1 B (1 bytes)"),
            "{}",
            f[0].message
        );
    }

    #[test]
    fn a_skipped_block_fails_ac_coverage() {
        let f = ac_coverage(&record(2.5, 0, 1));
        assert_eq!(f.len(), 1);
        assert!(f[0].message.contains("1 of 2 blocks"), "{}", f[0].message);
    }
}
