//! A recorded run laid out in time for the report: one slot per trainer built or loaded and per
//! step, phase after phase, each with its peak, the categories at the peak, the memory model's
//! estimate and its wall time; and per phase what it held, reclaimed and took.

use crate::record::{Phase, PhaseRecord, RunRecord};
use crate::report::median::median;
use ckpt_engine::memory::Breakdown;

/// One bar of the timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    /// The phase it belongs to.
    pub phase: Phase,
    /// The step, or `None` for building or loading the trainer.
    pub step: Option<u64>,
    /// The device's peak over it, in bytes.
    pub peak: u64,
    /// Bytes per category at that peak.
    pub at_peak: Breakdown,
    /// The memory model's estimate of the peak, in bytes held (a fresh trainer's build has none).
    pub estimate: Option<u64>,
    /// Wall-clock seconds.
    pub seconds: f64,
}

/// Every slot of `r`, in the order they ran.
pub fn slots(r: &RunRecord) -> Vec<Slot> {
    let mut out = Vec::new();
    for p in &r.phases {
        let base = p.before.total();
        out.push(Slot {
            phase: p.phase,
            step: None,
            peak: p.setup.peak,
            at_peak: p.setup.at_peak,
            estimate: (p.phase != Phase::Reference).then(|| base + r.predicted_load),
            seconds: p.setup_seconds,
        });
        for (i, s) in p.steps.iter().enumerate() {
            let fresh = p.phase == Phase::Reference && i == 0;
            out.push(Slot {
                phase: p.phase,
                step: Some(s.step),
                peak: s.memory.allocated.peak,
                at_peak: s.memory.at_peak,
                estimate: Some(base + r.predicted_for(s.step, fresh).peak + r.staging_for(s)),
                seconds: s.seconds,
            });
        }
    }
    out
}

/// One phase's figures for the report's table.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseSummary {
    /// Which phase.
    pub phase: Phase,
    /// Bytes held before its trainer was built.
    pub before: u64,
    /// Bytes held when its last step ended (without steps: after the drop, nothing reclaimed).
    pub held_at_end: u64,
    /// Bytes held after its trainer was dropped.
    pub after: u64,
    /// Bytes the drop gave back.
    pub reclaimed: u64,
    /// Bytes held after the drop beyond those held before the phase.
    pub left_behind: u64,
    /// Steps run.
    pub steps: usize,
    /// Seconds building or loading the trainer.
    pub setup_seconds: f64,
    /// The median step's seconds.
    pub median_step_seconds: Option<f64>,
    /// The slowest step's seconds.
    pub max_step_seconds: Option<f64>,
    /// Seconds of the whole phase.
    pub seconds: f64,
}

/// The figures of phase `p`.
pub fn phase_summary(p: &PhaseRecord) -> PhaseSummary {
    let after = p.after.total();
    let held_at_end = p.steps.last().map_or(after, |s| s.memory.current.total());
    let times: Vec<f64> = p.steps.iter().map(|s| s.seconds).collect();
    PhaseSummary {
        phase: p.phase,
        before: p.before.total(),
        held_at_end,
        after,
        reclaimed: held_at_end.saturating_sub(after),
        left_behind: after.saturating_sub(p.before.total()),
        steps: p.steps.len(),
        setup_seconds: p.setup_seconds,
        median_step_seconds: median(times.clone()),
        max_step_seconds: times.into_iter().reduce(f64::max),
        seconds: p.seconds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;

    #[test]
    fn slots_are_each_phase_s_setup_then_its_steps_with_the_estimate() {
        let r = fixtures::run();
        let s = slots(&r);
        assert_eq!(s.len(), 3 + 6 + 4 + 2);
        assert_eq!(
            (s[0].phase, s[0].step, s[0].estimate),
            (Phase::Reference, None, None)
        );
        assert_eq!(s[1].step, Some(0));
        assert_eq!(s[1].estimate, Some(r.predicted[0].peak));
        assert_eq!(s[2].estimate, Some(r.predicted[1].peak));
        assert_eq!((s[7].phase, s[7].step), (Phase::ResumeMid, None));
        assert_eq!(s[7].estimate, Some(r.predicted_load));
        assert_eq!(s[8].peak, fixtures::AT_PEAK.total());
    }

    #[test]
    fn a_phase_reclaims_what_its_last_step_held_and_names_what_it_left() {
        let mut p = fixtures::run().phases[1].clone();
        let sum = phase_summary(&p);
        assert_eq!(sum.reclaimed, fixtures::HELD.total());
        assert_eq!(sum.left_behind, 0);
        assert_eq!(sum.median_step_seconds, Some(0.01));
        p.after.optimizer = 2000;
        let sum = phase_summary(&p);
        assert_eq!(sum.left_behind, 2000);
        assert_eq!(sum.reclaimed, fixtures::HELD.total() - 2000);
    }
}
