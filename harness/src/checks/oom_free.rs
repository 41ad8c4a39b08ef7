//! `oom_free`: the device refused no allocation in any phase, checkpoint loading included.

use super::{Check, Failure, Input, Outcome};
use crate::record::fields::RecordField;
use crate::record::RunRecord;

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[RecordField::OomCount];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    check(input.record)
}

/// Reads the refusals recorded in every phase; `compared` counts the trainers built and the
/// steps.
pub fn check(r: &RunRecord) -> Outcome {
    let mut out = Vec::new();
    let mut refused = 0u64;
    for p in &r.phases {
        let fail = || Failure::new(Check::OomFree, r, "allocations refused").phase(p.phase);
        if p.setup.oom_count > 0 {
            refused = refused.max(p.setup.oom_count);
            out.push(
                fail()
                    .saw(0, p.setup.oom_count)
                    .detail("while building the trainer"),
            );
        } else if let Some(s) = p.steps.iter().find(|s| s.memory.oom_count > 0) {
            refused = refused.max(s.memory.oom_count);
            out.push(fail().step(s.step).saw(0, s.memory.oom_count));
        }
        if let Some(e) = &p.oom {
            refused = refused.max(1);
            let mut f = Failure::new(Check::OomFree, r, "the phase ran to its end")
                .phase(p.phase)
                .saw("no out-of-memory error", &e.message);
            f.step = e.step;
            out.push(f);
        }
    }
    let compared = r.phases.iter().map(|p| 1 + p.steps.len() as u64).sum();
    let implied = r.planned.len() as u64 + r.planned_steps();
    Outcome::new(Check::OomFree, r, compared, implied, out).with("oom_count", refused)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;

    #[test]
    fn a_refused_allocation_fails() {
        let mut r = fixtures::run();
        r.phases[1].steps[1].memory.oom_count = 1;
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        assert!(
            o.failures[0].to_string().starts_with(
                "oom_free: cpu::s resume-mid step 3: allocations refused: expected 0, got 1"
            ),
            "{}",
            o.failures[0]
        );
    }

    #[test]
    fn an_out_of_memory_error_fails() {
        let mut r = fixtures::run();
        r.phases[2].setup.oom_count = 1;
        r.phases[2].oom = Some(fixtures::oom(None, 1000, 2000));
        assert_eq!(check(&r).failures.len(), 2);
    }
}
