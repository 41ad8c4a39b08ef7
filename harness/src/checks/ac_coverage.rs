//! `ac_coverage`: with activation checkpointing on, every step recomputes every block.

use super::{Check, Failure, Input, Outcome};
use crate::record::fields::RecordField;
use crate::record::RunRecord;

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[RecordField::RecomputedBlocks];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    check(input.record)
}

/// Counts the blocks recomputed in every step of every phase; `compared` counts the steps.
/// Without checkpointing it asks nothing.
pub fn check(r: &RunRecord) -> Outcome {
    if !r.checkpointing {
        return Outcome::nothing_asked(Check::AcCoverage).with("checkpointing", false);
    }
    let steps: Vec<_> = r
        .phases
        .iter()
        .flat_map(|p| p.steps.iter().map(move |s| (p.phase, s)))
        .collect();
    let out = steps
        .iter()
        .filter(|(_, s)| s.recomputed_blocks != r.layers)
        .map(|(phase, s)| {
            Failure::new(Check::AcCoverage, r, "blocks recomputed")
                .phase(*phase)
                .step(s.step)
                .saw(r.layers, s.recomputed_blocks)
                .detail("checkpointing is configured but not applied to every block")
        })
        .collect();
    Outcome::new(
        Check::AcCoverage,
        r,
        steps.len() as u64,
        r.planned_steps(),
        out,
    )
    .with("checkpointing", true)
    .with("layers", r.layers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;

    #[test]
    fn a_skipped_nested_block_fails() {
        let mut r = fixtures::run();
        for p in &mut r.phases {
            for s in &mut p.steps {
                s.recomputed_blocks = 1;
            }
        }
        let o = check(&r);
        assert_eq!(o.failures.len(), 12);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with(
                "ac_coverage: cpu::s reference step 0: blocks recomputed: expected 2, got 1"
            ),
            "{m}"
        );
    }

    #[test]
    fn without_checkpointing_nothing_is_expected() {
        let mut r = fixtures::run();
        r.checkpointing = false;
        r.phases[0].steps[0].recomputed_blocks = 0;
        assert!(!check(&r).failed());
    }
}
