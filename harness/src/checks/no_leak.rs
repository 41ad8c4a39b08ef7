//! `no_leak`: within each phase, the bytes held at step boundaries stay flat once the optimizer
//! state exists (from the end of the first step on).

use super::{bytes, excess, per_rank, Check, Failure, Input, Outcome};
use crate::record::fields::RecordField;
use crate::record::RunRecord;

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[RecordField::DeviceMemory, RecordField::StepByCategory];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    per_rank::check(input.record, check)
}

/// Compares every step's closing bytes with the first step's, phase by phase; `compared` counts
/// the steps after each phase's first.
pub fn check(r: &RunRecord) -> Outcome {
    let mut out = Vec::new();
    let mut growth = 0u64;
    let mut compared = 0u64;
    for p in &r.phases {
        let Some(first) = p.steps.first() else {
            continue;
        };
        compared += p.steps.len() as u64 - 1;
        let base = first.memory.current;
        let last = p.steps.last().map_or(base, |s| s.memory.current);
        growth = growth.max(last.total().saturating_sub(base.total()));
        if let Some(s) = p
            .steps
            .iter()
            .find(|s| s.memory.current.total() != base.total())
        {
            let grew = excess(&s.memory.current, &base);
            out.push(
                Failure::new(Check::NoLeak, r, "allocated at the step's end")
                    .phase(p.phase)
                    .step(s.step)
                    .saw(bytes(base.total()), bytes(s.memory.current.total()))
                    .detail(format!(
                        "grown by category: {grew}; {} bytes outlive the step that made them (by the phase's end: {} above step {})",
                        grew.largest(),
                        bytes(last.total().saturating_sub(base.total())),
                        first.step
                    )),
            );
        }
    }
    let implied = r.planned.iter().map(|p| p.steps().saturating_sub(1)).sum();
    Outcome::new(Check::NoLeak, r, compared, implied, out).with("max_growth", growth)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use proptest::prelude::*;

    #[test]
    fn kept_recompute_inputs_fail() {
        let mut r = fixtures::run();
        for (i, s) in r.phases[0].steps.iter_mut().enumerate() {
            s.memory.current.activations = 256 * i as u64;
        }
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with("no_leak: cpu::s reference step 1: allocated at the step's end: expected 3.9 KiB (4000 bytes), got 4.2 KiB (4256 bytes); grown by category: params 0 B, grads 0 B, optimizer 0 B, activations 256 B"),
            "{m}"
        );
        assert!(m.contains("1.2 KiB (1280 bytes) above step 0"), "{m}");
    }

    proptest! {
        /// Any change of the bytes held at one step boundary fails, up or down.
        #[test]
        fn any_change_fails(phase in 0usize..3, step in 1usize..2, delta in 1u64..1 << 40, up in any::<bool>()) {
            let mut r = fixtures::run();
            let s = &mut r.phases[phase].steps[step];
            if up {
                s.memory.current.workspace += delta;
            } else {
                s.memory.current.params = 0;
                s.memory.current.io = 1000 - delta.min(999);
            }
            prop_assert_eq!(check(&r).failures.len(), 1);
        }
    }
}
