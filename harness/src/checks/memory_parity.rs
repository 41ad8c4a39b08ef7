//! `memory_parity`: a resumed step holds no more than the reference's same step. For every
//! resumed phase and every step it shares with the reference, the step's peak above what the
//! device held before the phase's trainer was built, less the staging buffers of an
//! asynchronous save it began with, must not exceed the reference's same step's by more than
//! the tolerance: as a whole, and in each category of the bytes held at the peak where both
//! steps record them. The built-in engine allocates the same bytes for the same step whether
//! its trainer was built or loaded, so its tolerance is 0 bytes on every device; another
//! trainer's device allocator (`cuda`) gets 2% of the reference step's peak, for what a fresh
//! process allocates at its first use (a matrix library's workspace) and what its kernels
//! allocate by the batch's content (a resumed step that trains another batch than the
//! reference's can hold a KiB more), whichever device the suite names. With `memory.budget`, a
//! resumed step above the budget whose reference step is within it fails even inside the
//! tolerance: the resume, not the run, breaks the budget. A resume that holds less passes.
//! Phases at another world size than the reference's hold another plan's shards and are not
//! compared.

use super::{bytes, per_rank, Check, Failure, Input, Outcome};
use crate::record::fields::RecordField;
use crate::record::{Phase, PhaseRecord, RunRecord, StepRecord};
use ckpt_engine::memory::{Breakdown, Category};

/// How far a resumed step's bytes, as a whole or in one category, may exceed the reference
/// step's in `r`, whose peak was `want` bytes. A record without the engine's memory model is
/// another trainer's, and as the check asks for device memory its figures are its CUDA
/// allocator's, whatever device the suite names (a suite of `cpu` trials runs a trainer that
/// its command puts on a GPU).
fn tolerance(r: &RunRecord, want: u64) -> u64 {
    if r.lacks.contains(&RecordField::MemoryModel) {
        want / 50
    } else {
        0
    }
}

/// A step's own figures: its peak and the bytes held at it per category, above what the
/// device held before the phase's trainer was built and without an asynchronous save's
/// staging; the breakdown is `None` where the record has none.
fn own(p: &PhaseRecord, s: &StepRecord) -> (u64, Option<Breakdown>) {
    let peak = s
        .memory
        .allocated
        .peak
        .saturating_sub(p.before.total())
        .saturating_sub(s.staging);
    let at_peak = (s.memory.at_peak.total() > 0).then(|| {
        let mut b = super::excess(&s.memory.at_peak, &p.before);
        b.io = b.io.saturating_sub(s.staging);
        b
    });
    (peak, at_peak)
}

/// The steps from `from` to `end` that the reference's `[0, reference_end)` also plans.
fn shared(from: u64, end: u64, reference_end: u64) -> u64 {
    end.min(reference_end).saturating_sub(from)
}

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[RecordField::StepMemory, RecordField::DeviceMemory];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    check_every_rank(input.record)
}

/// [`check`] over every rank's view of `r` ([`per_rank`]: each rank against its own reference
/// rank); not applicable when no resumed phase runs at the reference's world size.
pub fn check_every_rank(r: &RunRecord) -> Outcome {
    let Some(reference) = r.planned.iter().find(|p| p.phase == Phase::Reference) else {
        return check(r);
    };
    if !r
        .planned_resumes()
        .any(|p| p.world_size == reference.world_size)
    {
        return Outcome::not_applicable(
            Check::MemoryParity,
            "no resumed phase runs at the reference's world size: each rank holds another plan's shards",
        );
    }
    per_rank::check(r, check)
}

/// Compares every resumed step with the reference's same step; `compared` counts the resumed
/// steps compared, `implied` those the suite's resumed phases share with its reference. A
/// record without a planned reference (a rank's view at another world size) asks nothing.
pub fn check(r: &RunRecord) -> Outcome {
    let Some(planned_ref) = r.planned.iter().find(|p| p.phase == Phase::Reference) else {
        return Outcome::nothing_asked(Check::MemoryParity);
    };
    let implied: u64 = r
        .planned_resumes()
        .map(|p| shared(p.from, p.end, planned_ref.end))
        .sum();
    let mut out = Vec::new();
    let mut compared = 0u64;
    let mut max_excess = 0u64;
    let reference = r.reference();
    for p in r.phases.iter().filter(|p| p.phase != Phase::Reference) {
        for s in &p.steps {
            let Some((rp, rs)) = reference
                .and_then(|rp| rp.steps.iter().find(|x| x.step == s.step).map(|x| (rp, x)))
            else {
                continue;
            };
            compared += 1;
            let (peak, at_peak) = own(p, s);
            let (want, want_at_peak) = own(rp, rs);
            let allow = tolerance(r, want);
            max_excess = max_excess.max(peak.saturating_sub(want));
            let fail = |what: String| {
                Failure::new(Check::MemoryParity, r, what)
                    .phase(p.phase)
                    .step(s.step)
            };
            let held = match (&at_peak, &want_at_peak) {
                (Some(a), Some(b)) => format!("held at the peak: {a}; the reference's: {b}"),
                _ => "the record holds no bytes by category at the peak".into(),
            };
            let fix = "a resume should hold what a fresh run holds at the same step: optimizer state allocated (or copied) at load, a loaded checkpoint kept alive, or the reference's own allocations made twice";
            if peak > want + allow {
                out.push(
                    fail("step peak".into())
                        .saw(
                            format!("at most {} (the reference's step {})", bytes(want), s.step),
                            bytes(peak),
                        )
                        .detail(format!("{held}; {fix}")),
                );
            }
            if let (Some(a), Some(b)) = (at_peak, want_at_peak) {
                for c in Category::ALL {
                    let (got, ref_bytes) = (a.get(c), b.get(c));
                    if got > ref_bytes + allow {
                        out.push(
                            fail(format!("{c} bytes at the step's peak"))
                                .saw(
                                    format!(
                                        "at most {} (the reference's step {})",
                                        bytes(ref_bytes),
                                        s.step
                                    ),
                                    bytes(got),
                                )
                                .detail(format!("{held}; {fix}")),
                        );
                    }
                }
            }
            if let Some(budget) = r.budget {
                let (got, reference_peak) = (s.memory.allocated.peak, rs.memory.allocated.peak);
                if got > budget && reference_peak <= budget {
                    out.push(
                        fail("step peak above the budget".into())
                            .saw(
                                format!(
                                    "at most {}, as the reference's step {} held {}",
                                    bytes(budget),
                                    s.step,
                                    bytes(reference_peak)
                                ),
                                bytes(got),
                            )
                            .detail(held),
                    );
                }
            }
        }
    }
    Outcome::new(Check::MemoryParity, r, compared, implied, out)
        .with("max_excess_bytes", max_excess)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::{fixtures, Status};
    use proptest::prelude::*;

    /// The first step of `r`'s phase `phase` holding `extra` more optimizer bytes than the
    /// reference's from its start to its peak, as a second copy of the moments made at load
    /// and freed at that step's end would.
    fn with_optimizer_copy(mut r: RunRecord, phase: usize, extra: u64) -> RunRecord {
        let s = &mut r.phases[phase].steps[0];
        s.start.optimizer += extra;
        s.memory.allocated.peak += extra;
        s.memory.at_peak.optimizer += extra;
        r
    }

    #[test]
    fn a_faithful_run_passes_comparing_every_resumed_step() {
        let o = check(&fixtures::run());
        assert_eq!(o.status, Status::Passed, "{:?}", o.failures);
        assert_eq!((o.compared, o.implied), (4 + 2, 4 + 2));
        assert_eq!(o.figures["max_excess_bytes"], serde_json::json!(0));
    }

    #[test]
    fn moments_allocated_twice_at_load_fail_naming_step_phase_category_and_bytes() {
        let o = check(&with_optimizer_copy(fixtures::run(), 1, 2000));
        let m: Vec<String> = o.failures.iter().map(|f| f.to_string()).collect();
        assert_eq!(m.len(), 2, "{m:?}");
        assert!(
            m[0].starts_with("memory_parity: cpu::s resume-mid step 2: step peak: expected at most 7.3 KiB (7500 bytes) (the reference's step 2), got 9.3 KiB (9500 bytes); held at the peak: params 1000 B, grads 1000 B, optimizer 3.9 KiB, activations 2.9 KiB"),
            "{}", m[0]
        );
        assert!(
            m[1].starts_with("memory_parity: cpu::s resume-mid step 2: optimizer bytes at the step's peak: expected at most 2.0 KiB (2000 bytes) (the reference's step 2), got 3.9 KiB (4000 bytes)"),
            "{}", m[1]
        );
        assert_eq!(o.figures["max_excess_bytes"], serde_json::json!(2000));
    }

    #[test]
    fn a_resume_that_holds_less_passes() {
        let mut r = fixtures::run();
        let s = &mut r.phases[2].steps[1];
        s.memory.allocated.peak -= 500;
        s.memory.at_peak.workspace -= 500;
        assert!(!check(&r).failed());
    }

    /// One category above the reference's fails even when the peak as a whole is not.
    #[test]
    fn a_category_above_the_reference_s_fails_alone() {
        let mut r = fixtures::run();
        let s = &mut r.phases[1].steps[2];
        s.memory.at_peak.io += 256;
        s.memory.at_peak.activations -= 256;
        let o = check(&r);
        let what: Vec<&str> = o.failures.iter().map(|f| f.what.as_str()).collect();
        assert_eq!(what, ["io bytes at the step's peak"]);
    }

    /// Without bytes by category at the peak only the whole peak is compared.
    #[test]
    fn a_record_without_bytes_at_the_peak_compares_the_peak_alone() {
        let mut r = with_optimizer_copy(fixtures::run(), 2, 100);
        for s in r.phases.iter_mut().flat_map(|p| &mut p.steps) {
            s.memory.at_peak = Breakdown::default();
        }
        let o = check(&r);
        let what: Vec<&str> = o.failures.iter().map(|f| f.what.as_str()).collect();
        assert_eq!(what, ["step peak"]);
        assert!(o.failures[0]
            .to_string()
            .contains("the record holds no bytes by category at the peak"));
    }

    /// Bytes an earlier trainer left on the device (`memory_reclaimed`'s) and an asynchronous
    /// save's staging are not the resumed step's own.
    #[test]
    fn bytes_held_before_the_phase_and_staging_are_not_the_step_s() {
        let mut r = fixtures::run();
        let p = &mut r.phases[1];
        p.before.optimizer = 2000;
        for s in &mut p.steps {
            s.memory.allocated.peak += 2000 + 640;
            s.memory.at_peak.optimizer += 2000;
            s.memory.at_peak.io += 640;
            s.staging = 640;
        }
        assert!(!check(&r).failed(), "{:?}", check(&r).failures);
    }

    #[test]
    fn another_trainer_s_cuda_steps_get_two_percent_the_engine_none() {
        let mut r = fixtures::run();
        r.device = "cpu".into();
        let within = fixtures::AT_PEAK.total() / 50;
        let s = &mut r.phases[1].steps[0];
        s.memory.allocated.peak += within;
        s.memory.at_peak.activations += within;
        assert_eq!(check(&r).failures.len(), 2, "the engine's count is exact");
        r.lacks.insert(RecordField::MemoryModel);
        assert!(!check(&r).failed(), "{:?}", check(&r).failures);
        r.phases[1].steps[0].memory.allocated.peak += 1;
        assert_eq!(check(&r).failures.len(), 1);
    }

    /// Within the tolerance, a resumed step above the budget the reference's step kept fails.
    #[test]
    fn a_resume_that_breaks_the_budget_the_reference_kept_fails() {
        let mut r = fixtures::run();
        r.device = "cuda".into();
        r.name = "cuda::s".into();
        r.lacks.insert(RecordField::MemoryModel);
        let peak = fixtures::AT_PEAK.total();
        r.budget = Some(peak);
        r.phases[2].steps[0].memory.allocated.peak = peak + 10;
        let o = check(&r);
        let m: Vec<String> = o.failures.iter().map(|f| f.to_string()).collect();
        assert_eq!(m.len(), 1, "{m:?}");
        assert!(
            m[0].starts_with("memory_parity: cuda::s resume-end step 4: step peak above the budget: expected at most 7.3 KiB (7500 bytes), as the reference's step 4 held 7.3 KiB (7500 bytes), got 7.3 KiB (7510 bytes)"),
            "{}", m[0]
        );
        r.phases[0].steps[4].memory.allocated.peak = peak + 10;
        assert!(
            !check(&r).failed(),
            "the reference's own excess is peak_budget's"
        );
    }

    #[test]
    fn steps_the_reference_never_reached_are_not_compared_and_counted_short() {
        let mut r = fixtures::run();
        r.phases[0].steps.truncate(5);
        let o = check(&r);
        assert_eq!((o.compared, o.implied, o.status), (4, 6, Status::Failed));
    }

    #[test]
    fn without_a_resume_at_the_reference_s_world_size_it_is_not_applicable() {
        let mut r = fixtures::ranked(2);
        for p in &mut r.planned[1..] {
            p.world_size = 3;
        }
        let o = check_every_rank(&r);
        assert_eq!(o.status, Status::NotApplicable);
        assert!(o.reason.unwrap().contains("another plan's shards"));
    }

    /// Each rank against its own reference rank: one rank's excess fails there alone.
    #[test]
    fn one_rank_s_excess_fails_on_that_rank() {
        let mut r = fixtures::ranked(2);
        r.phases[1].steps[1].ranks[1].memory.allocated.peak += 1;
        let o = check_every_rank(&r);
        assert_eq!((o.compared, o.implied), (12, 12));
        let at: Vec<_> = o
            .failures
            .iter()
            .map(|f| (f.rank, f.phase, f.step))
            .collect();
        assert_eq!(at, [(Some(1), Some(Phase::ResumeMid), Some(3))]);
    }

    proptest! {
        /// One byte above the reference's step anywhere fails; any amount below passes.
        #[test]
        fn one_byte_above_fails_and_less_passes(phase in 1usize..3, step in 0usize..2, less in 1u64..1000) {
            let mut r = fixtures::run();
            let s = &mut r.phases[phase].steps[step];
            s.memory.allocated.peak -= less;
            s.memory.at_peak.activations -= less;
            prop_assert!(!check(&r).failed());
            let s = &mut r.phases[phase].steps[step];
            s.memory.allocated.peak += less + 1;
            prop_assert_eq!(check(&r).failures.len(), 1);
        }
    }
}
