//! `peak_budget`: every step's peak in every phase, every evaluation's of the validation split,
//! and the peak of building each trainer (checkpoint loading included), at or under
//! `memory.budget`; the resident host memory each
//! phase adds at its peak (above the resident bytes at its start) at or under
//! `memory.rss_budget`. A run the plan stopped before it trained ([`planned`]) fails it at
//! every step the plan put over the budget.

use super::{bytes, memory_detail, per_rank, Check, Failure, Input, Outcome};
use crate::record::fields::RecordField;
use crate::record::{Phase, RunRecord};
use ckpt_engine::memory::{human_bytes, Breakdown};

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[RecordField::StepMemory];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    per_rank::check(input.record, check)
}

/// Compares every peak with the suite's budgets; `compared` counts the peaks compared (each
/// trainer built, each step and each refused step under `memory.budget`, each phase's host peak
/// under `memory.rss_budget`). A refused step's peak is the bytes held plus the refused
/// request. A suite without budgets asks nothing of it.
pub fn check(r: &RunRecord) -> Outcome {
    let mut out = Vec::new();
    let mut compared = 0u64;
    let mut max_peak = 0u64;
    let mut max_rss_added = 0u64;
    for p in &r.phases {
        max_rss_added = max_rss_added.max(p.host.growth().unwrap_or(0));
        let peaks = p.steps.iter().map(|s| s.memory.allocated.peak);
        let eval_peaks = p.evaluations.iter().map(|e| e.memory.allocated.peak);
        max_peak = (peaks.chain(eval_peaks)).fold(max_peak.max(p.setup.peak), u64::max);
        if let Some(budget) = r.budget {
            compared += 1 + p.steps.len() as u64 + p.evaluations.len() as u64;
            for e in p.evaluations.iter().filter(|e| e.memory.allocated.peak > budget) {
                out.push(
                    Failure::new(Check::PeakBudget, r, "evaluation peak")
                        .phase(p.phase)
                        .step(e.step)
                        .saw(
                            format!("at most {}", bytes(budget)),
                            bytes(e.memory.allocated.peak),
                        )
                        .detail(memory_detail(&e.memory.at_peak)),
                );
            }
            if p.setup.peak > budget {
                let what = if p.phase == Phase::Reference {
                    "peak while building the trainer"
                } else {
                    "peak while loading the checkpoint"
                };
                out.push(
                    Failure::new(Check::PeakBudget, r, what)
                        .phase(p.phase)
                        .saw(format!("at most {}", bytes(budget)), bytes(p.setup.peak))
                        .detail(memory_detail(&p.setup.at_peak)),
                );
            }
            if let Some(oom) = &p.oom {
                compared += 1;
                let held = oom.allocated + oom.requested;
                max_peak = max_peak.max(held);
                if held > budget {
                    let mut f =
                        Failure::new(Check::PeakBudget, r, "peak when an allocation was refused")
                            .phase(p.phase)
                            .saw(format!("at most {}", bytes(budget)), bytes(held))
                            .detail(format!(
                                "{} held and {} refused; {}",
                                bytes(oom.allocated),
                                bytes(oom.requested),
                                memory_detail(&oom.by_category)
                            ));
                    f.step = oom.step;
                    out.push(f);
                }
            }
            for s in p.steps.iter().filter(|s| s.memory.allocated.peak > budget) {
                out.push(
                    Failure::new(Check::PeakBudget, r, "step peak")
                        .phase(p.phase)
                        .step(s.step)
                        .saw(
                            format!("at most {}", bytes(budget)),
                            bytes(s.memory.allocated.peak),
                        )
                        .detail(memory_detail(&s.memory.at_peak)),
                );
            }
        }
        if let (Some(limit), Some(rss)) = (r.rss_budget, p.host.growth()) {
            compared += 1;
            if rss > limit {
                let scope = if p.host.reset {
                    "the phase's peak"
                } else {
                    "the process's peak so far (it could not be reset)"
                };
                out.push(
                    Failure::new(Check::PeakBudget, r, "resident host memory added")
                        .phase(p.phase)
                        .saw(format!("at most {}", bytes(limit)), bytes(rss))
                        .detail(format!(
                            "{scope} above the {} resident at its start; on the CPU device the tensors count here, and on every device host copies of checkpoints and batches",
                            bytes(p.host.start_rss.unwrap_or(0))
                        )),
                );
            }
        }
    }
    let outcome = if r.budget.is_none() && r.rss_budget.is_none() {
        Outcome::nothing_asked(Check::PeakBudget)
    } else {
        let phases = r.planned.len() as u64;
        let mut implied = 0;
        if r.budget.is_some() {
            implied += phases + r.planned_steps();
        }
        if r.rss_budget.is_some() {
            implied += phases;
        }
        Outcome::new(Check::PeakBudget, r, compared, implied, out)
    };
    outcome
        .with("budget", r.budget)
        .with("max_peak", max_peak)
        .with("rss_budget", r.rss_budget)
        .with("max_rss_added", max_rss_added)
}

/// A step the plan of every step puts over its rank's budget, before anything runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overrun {
    /// The phase.
    pub phase: Phase,
    /// The step.
    pub step: u64,
    /// The rank whose peak is highest, on more than one rank.
    pub rank: Option<usize>,
    /// Its planned peak.
    pub peak: u64,
    /// Its rank's budget.
    pub budget: u64,
    /// The planned bytes per category at the peak.
    pub at_peak: Breakdown,
    /// The step's micro-batches: shapes and samples.
    pub batches: String,
}

impl Overrun {
    /// One line naming the phase, step, rank, peak, how far over the budget, and the samples.
    pub fn sentence(&self) -> String {
        let on_rank = self.rank.map_or(String::new(), |r| format!(" on rank {r}"));
        format!(
            "{} step {}{on_rank} is predicted to peak at {}, {} over memory.budget's {}; its micro-batches: {}; ",
            self.phase,
            self.step,
            bytes(self.peak),
            human_bytes(self.peak.saturating_sub(self.budget)),
            bytes(self.budget),
            self.batches
        )
    }
}

/// The outcome of a run the plan stopped before it trained: failed at each of `overruns`,
/// having compared each step the plan put over the budget.
pub fn planned(r: &RunRecord, overruns: &[Overrun]) -> Outcome {
    let failures = overruns
        .iter()
        .map(|o| {
            let mut f = Failure::new(Check::PeakBudget, r, "step peak")
                .phase(o.phase)
                .step(o.step)
                .saw(format!("at most {}", bytes(o.budget)), bytes(o.peak))
                .detail(format!(
                    "{}; planned before anything ran, its micro-batches: {}",
                    memory_detail(&o.at_peak),
                    o.batches
                ));
            f.rank = o.rank;
            f
        })
        .collect();
    let n = overruns.len() as u64;
    Outcome::new(Check::PeakBudget, r, n, n, failures)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use crate::record::HostMemory;
    use proptest::prelude::*;

    #[test]
    fn a_long_batch_spike_fails_with_the_fix() {
        let mut r = fixtures::run();
        let peak = fixtures::AT_PEAK.total();
        r.budget = Some(peak);
        r.phases[1].steps[1].memory.allocated.peak = peak + 4096;
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with("peak_budget: cpu::s resume-mid step 3: step peak: expected at most 7.3 KiB (7500 bytes), got 11.3 KiB (11596 bytes); by category: params"),
            "{m}"
        );
        assert!(
            m.contains("activations dominate: enable activation checkpointing"),
            "{m}"
        );
    }

    #[test]
    fn the_refused_step_counts_with_its_request() {
        let mut r = fixtures::run();
        let budget = fixtures::AT_PEAK.total();
        r.budget = Some(budget);
        r.phases.truncate(1);
        r.phases[0].steps.truncate(3);
        r.phases[0].oom = Some(fixtures::oom(Some(3), budget - 100, 101));
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        assert_eq!(o.compared, 5);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with("peak_budget: cpu::s reference step 3: peak when an allocation was refused: expected at most 7.3 KiB (7500 bytes), got 7.3 KiB (7501 bytes); 7.2 KiB (7400 bytes) held and 101 B refused; by category:"),
            "{m}"
        );
        r.phases[0].oom = Some(fixtures::oom(Some(3), budget - 100, 100));
        assert!(!check(&r).failed());
    }

    /// Each trainer built and each step under `budget`, each phase under `rss_budget`.
    #[test]
    fn what_each_budget_implies_is_compared() {
        let mut r = fixtures::run();
        r.budget = Some(u64::MAX);
        let o = check(&r);
        assert_eq!((o.compared, o.implied), (3 + 12, 3 + 12));
        assert_eq!(o.status, crate::checks::Status::Passed);
        r.rss_budget = Some(u64::MAX);
        for p in &mut r.phases {
            p.host.peak_rss = Some(1);
        }
        let o = check(&r);
        assert_eq!((o.compared, o.implied), (3 + 12 + 3, 3 + 12 + 3));
    }

    #[test]
    fn checkpoint_loading_counts() {
        let mut r = fixtures::run();
        r.budget = Some(fixtures::AT_PEAK.total());
        r.phases[2].setup.peak = fixtures::AT_PEAK.total() + 1;
        let o = check(&r);
        assert_eq!(o.failures[0].what, "peak while loading the checkpoint");
    }

    #[test]
    fn host_memory_added_by_a_phase_counts() {
        let mut r = fixtures::run();
        r.rss_budget = Some(1 << 20);
        for p in &mut r.phases {
            p.host = HostMemory {
                start_rss: Some(40 << 20),
                peak_rss: Some(41 << 20),
                reset: true,
            };
        }
        let o = check(&r);
        assert!(!o.failed(), "{:?}", o.failures);
        assert_eq!((o.compared, o.implied), (3, 3));
        assert_eq!(o.figures["max_rss_added"], serde_json::json!(1u64 << 20));
        r.phases[1].host.peak_rss = Some((41 << 20) + 1);
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with("peak_budget: cpu::s resume-mid: resident host memory added: expected at most 1.0 MiB (1048576 bytes), got 1.0 MiB (1048577 bytes); the phase's peak above the 40.0 MiB (41943040 bytes) resident at its start"),
            "{m}"
        );
    }

    #[test]
    fn an_unknown_start_counts_the_whole_peak() {
        let host = HostMemory {
            start_rss: None,
            peak_rss: Some(7),
            reset: false,
        };
        assert_eq!(host.growth(), Some(7));
        assert_eq!(HostMemory::default().growth(), None);
    }

    proptest! {
        /// A peak exactly at the budget passes; one byte above fails.
        #[test]
        fn the_budget_is_inclusive(budget in 1u64..u64::MAX / 2) {
            let mut r = fixtures::run();
            r.budget = Some(budget);
            for p in &mut r.phases {
                p.setup.peak = budget;
                for s in &mut p.steps {
                    s.memory.allocated.peak = budget;
                }
            }
            prop_assert!(!check(&r).failed());
            r.phases[2].steps[1].memory.allocated.peak = budget + 1;
            prop_assert_eq!(check(&r).failures.len(), 1);
            r.phases[2].steps[1].memory.allocated.peak = budget;
            r.phases[1].setup.peak = budget + 1;
            prop_assert_eq!(check(&r).failures.len(), 1);
        }
    }
}
