//! `memory_reclaimed`: after each phase's trainer is dropped, the device holds exactly what it
//! held before the trainer was built.

use super::{bytes, excess, per_rank, Check, Failure, Input, Outcome};
use crate::record::fields::RecordField;
use crate::record::RunRecord;

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[RecordField::MemoryByCategory];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    per_rank::check(input.record, check)
}

/// Compares the bytes held before each phase with the bytes held after its trainer was dropped;
/// `compared` counts the phases.
pub fn check(r: &RunRecord) -> Outcome {
    let mut worst = 0u64;
    let out = r
        .phases
        .iter()
        .filter(|p| p.after.total() != p.before.total())
        .map(|p| {
            let left = excess(&p.after, &p.before);
            worst = worst.max(left.total());
            Failure::new(Check::MemoryReclaimed, r, "allocated after the trainer was dropped")
                .phase(p.phase)
                .saw(bytes(p.before.total()), bytes(p.after.total()))
                .detail(format!(
                    "left behind by category: {left}; {} outlives the trainer: something still holds its tensors",
                    left.largest()
                ))
        })
        .collect();
    let (compared, implied) = (r.phases.len() as u64, r.planned.len() as u64);
    Outcome::new(Check::MemoryReclaimed, r, compared, implied, out).with("max_bytes_left", worst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;

    #[test]
    fn retained_optimizer_state_fails() {
        let mut r = fixtures::run();
        r.phases[0].after.optimizer = 2000;
        r.phases[1].before.optimizer = 2000;
        r.phases[1].after.optimizer = 4000;
        let o = check(&r);
        assert_eq!(o.failures.len(), 2);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with("memory_reclaimed: cpu::s reference: allocated after the trainer was dropped: expected 0 B, got 2.0 KiB (2000 bytes)"),
            "{m}"
        );
        assert!(m.contains("optimizer outlives the trainer"), "{m}");
    }

    #[test]
    fn one_byte_fails() {
        let mut r = fixtures::run();
        r.phases[2].after.io = 1;
        assert_eq!(check(&r).failures.len(), 1);
    }
}
