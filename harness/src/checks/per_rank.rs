//! A memory check over every rank of a data-parallel trial: the check runs on each rank's
//! view of the record ([`RunRecord::views`]) and the verdicts add up, each failure naming its
//! rank.

use super::{Outcome, Status};
use crate::record::RunRecord;

/// `check` over each rank's view of `r`: the things compared and implied summed, the failures
/// of every rank (each with its rank), each figure the largest any rank gave (the first rank's
/// where a figure is not a number). Failed if any rank failed; otherwise not run if any rank's
/// view was not run; passed if any ran.
pub fn check(r: &RunRecord, check: impl Fn(&RunRecord) -> Outcome) -> Outcome {
    let mut views = r.views().into_iter();
    let Some(first) = views.next() else {
        return check(r);
    };
    let mut merged = labelled(check(&first.record), first.rank);
    for view in views {
        let o = labelled(check(&view.record), view.rank);
        merged.compared += o.compared;
        merged.implied += o.implied;
        merged.failures.extend(o.failures);
        for (name, value) in o.figures {
            let kept = merged.figures.entry(name).or_insert(value.clone());
            if let (Some(a), Some(b)) = (kept.as_u64(), value.as_u64()) {
                *kept = a.max(b).into();
            }
        }
        merged.status = match (merged.status, o.status) {
            (Status::Failed, _) | (_, Status::Failed) => Status::Failed,
            (Status::NotRun, _) | (_, Status::NotRun) => Status::NotRun,
            (Status::Off, s) => s,
            (s, _) => s,
        };
    }
    merged
}

/// `o` with every failure placed on `rank`.
fn labelled(mut o: Outcome, rank: Option<usize>) -> Outcome {
    for f in &mut o.failures {
        f.rank = rank;
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::{fixtures, memory_model, memory_reclaimed, no_leak, peak_budget};
    use crate::record::{HostMemory, Phase};

    #[test]
    fn every_rank_of_a_faithful_run_passes_and_is_counted() {
        let one = fixtures::run();
        let ranked = fixtures::ranked(3);
        let checks: [fn(&RunRecord) -> Outcome; 3] =
            [memory_reclaimed::check, no_leak::check, memory_model::check];
        for c in checks {
            let (alone, all) = (c(&one), check(&ranked, c));
            assert_eq!(all.status, Status::Passed, "{all:?}");
            assert_eq!(all.compared, 3 * alone.compared);
            assert_eq!(all.implied, 3 * alone.implied);
        }
    }

    #[test]
    fn a_leak_on_one_rank_fails_on_that_rank_alone() {
        let mut r = fixtures::ranked(3);
        r.phases[1].ranks[2].after.optimizer += 2000;
        let o = check(&r, memory_reclaimed::check);
        assert_eq!(o.status, Status::Failed);
        assert_eq!(o.failures.len(), 1, "{:?}", o.failures);
        let f = &o.failures[0];
        assert_eq!((f.rank, f.phase), (Some(2), Some(Phase::ResumeMid)));
        let m = f.to_string();
        assert!(
            m.starts_with("memory_reclaimed: cpu::s rank 2 resume-mid: allocated after the trainer was dropped"),
            "{m}"
        );
        assert_eq!(o.figures["max_bytes_left"], serde_json::json!(2000));
    }

    #[test]
    fn a_rank_s_step_above_its_own_model_fails_there() {
        let mut r = fixtures::ranked(2);
        let s = &mut r.phases[0].steps[3].ranks[1];
        s.memory.allocated.peak += 512;
        s.memory.at_peak.activations += 512;
        let o = check(&r, memory_model::check);
        let at: Vec<_> = o.failures.iter().map(|f| (f.rank, f.step)).collect();
        assert_eq!(at, [(Some(1), Some(3))]);
    }

    /// A MoE step on two ranks whose rank 1 routed its micro-batches to busier experts: each
    /// rank is held to the prediction at its own routing, not rank 0's.
    #[test]
    fn a_moe_rank_is_held_to_the_prediction_at_its_own_routing() {
        let mut r = fixtures::ranked(2);
        let mut busier = r.predicted.clone();
        for p in &mut busier {
            p.peak += 4096;
        }
        let s = &mut r.phases[0].steps[3];
        s.predicted = Some(r.predicted.clone());
        s.ranks[0].predicted = Some(r.predicted.clone());
        s.ranks[1].predicted = Some(busier);
        s.ranks[1].memory.allocated.peak += 4096;
        let o = check(&r, memory_model::check);
        assert_eq!(o.status, Status::Passed, "{:?}", o.failures);
        let s = &mut r.phases[0].steps[3];
        s.ranks[1].memory.allocated.peak -= 4096;
        let o = check(&r, memory_model::check);
        let at: Vec<_> = o.failures.iter().map(|f| (f.rank, f.step)).collect();
        assert_eq!(at, [(Some(1), Some(3))], "{:?}", o.failures);
    }

    #[test]
    fn each_rank_is_held_to_its_own_budget_and_the_host_once() {
        let mut r = fixtures::ranked(2);
        let peak = r.phases[0].steps[0].memory.allocated.peak;
        r.worlds[0].ranks[1].budget = Some(peak - 1);
        r.rss_budget = Some(1);
        r.phases[0].host.peak_rss = Some(1 << 20);
        let o = check(&r, peak_budget::check);
        let ranks: Vec<_> = o.failures.iter().map(|f| f.rank).collect();
        let steps = r.phases.iter().map(|p| p.steps.len()).sum::<usize>();
        assert_eq!(ranks.iter().filter(|&&r| r == Some(1)).count(), steps);
        let host: Vec<_> = o
            .failures
            .iter()
            .filter(|f| f.what.starts_with("resident host memory"))
            .map(|f| f.rank)
            .collect();
        assert_eq!(host, [Some(0)]);
    }

    /// Ranks in processes of their own: each rank's process is held to the host budget in its
    /// own view, with its own resident memory.
    #[test]
    fn each_rank_process_is_held_to_the_host_budget_with_its_own_memory() {
        let mut r = fixtures::ranked(3);
        r.rss_budget = Some(1 << 20);
        let host = |peak: u64| {
            Some(HostMemory {
                start_rss: Some(8 << 20),
                peak_rss: Some((8 << 20) + peak),
                reset: true,
            })
        };
        for p in &mut r.phases {
            for (rank, mine) in p.ranks.iter_mut().enumerate() {
                mine.host = host(if rank == 2 { (1 << 20) + 1 } else { 1 << 20 });
            }
        }
        let o = check(&r, peak_budget::check);
        let at: Vec<_> = o.failures.iter().map(|f| (f.rank, f.phase)).collect();
        let phases = r.phases.iter().map(|p| (Some(2), Some(p.phase)));
        assert_eq!(at, phases.collect::<Vec<_>>(), "{:?}", o.failures);
        assert!(o.failures[0].what.starts_with("resident host memory"));
    }

    #[test]
    fn phases_at_another_world_size_are_judged_under_its_model() {
        let mut r = fixtures::ranked(2);
        r.planned[2].world_size = 1;
        let end = &mut r.phases[2];
        end.ranks.clear();
        end.steps.iter_mut().for_each(|s| s.ranks.clear());
        let mut one = r.worlds[0].clone();
        one.world_size = 1;
        one.ranks.truncate(1);
        one.ranks[0].predicted_load += 8;
        r.worlds.push(one);
        let o = check(&r, memory_model::check);
        let at: Vec<_> = o.failures.iter().map(|f| (f.rank, f.phase)).collect();
        assert_eq!(at, [(None, Some(Phase::ResumeEnd))], "{:?}", o.failures);
    }
}
