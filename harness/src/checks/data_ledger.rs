//! `data_ledger`: every phase's samples, joined at its resume point to the reference's samples
//! before it, are the reference's, in order; and every such sequence keeps the epoch rules:
//! within an epoch no sample repeats, and an epoch begins only after the one before it handed
//! out every sample (none skipped). A record that does not say how many samples an epoch
//! holds (another trainer's) has its ledgers compared with the reference's, and a figure says
//! the epoch rules were not checked.

use super::{Check, Failure, Input, Outcome};
use crate::record::fields::RecordField;
use crate::record::{PhaseRecord, RunRecord};
use ckpt_engine::data::SampleId;
use std::collections::BTreeSet;

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[RecordField::Samples];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    check(input.record)
}

/// Compares every phase's ledger with the reference's and checks each joined ledger's epochs;
/// `compared` counts the steps whose samples were checked.
pub fn check(r: &RunRecord) -> Outcome {
    let mut out = Vec::new();
    let mut compared = 0u64;
    let fail =
        |p: &PhaseRecord, what: &str| Failure::new(Check::DataLedger, r, what).phase(p.phase);
    let reference = r.reference();
    for phase in &r.phases {
        let from = phase.steps.first().map_or(0, |s| s.step);
        let before: Vec<(u64, SampleId)> = reference
            .into_iter()
            .flat_map(|p| &p.steps)
            .filter(|s| s.step < from)
            .flat_map(|s| s.samples.iter().map(move |&id| (s.step, id)))
            .collect();
        let mut own = Vec::new();
        for step in &phase.steps {
            if step.samples.is_empty() {
                out.push(
                    fail(phase, "samples")
                        .step(step.step)
                        .saw("the batch's samples recorded", "none")
                        .detail("the record was written by a build that kept no sample ledger"),
                );
                continue;
            }
            compared += 1;
            own.extend(step.samples.iter().map(|&id| (step.step, id)));
        }
        if let Some(reference) = reference.filter(|p| p.phase != phase.phase) {
            if let Some(f) = first_difference(reference, phase) {
                out.push(
                    fail(phase, "sample ledger")
                        .step(f.0)
                        .saw(f.1, f.2)
                        .detail(f.3),
                );
            }
        }
        let joined: Vec<(u64, SampleId)> = before.into_iter().chain(own).collect();
        if r.samples_per_epoch == 0 {
            continue;
        }
        let dataset = r.dataset_samples.unwrap_or(r.samples_per_epoch);
        if let Some((step, what, expected, actual)) =
            epoch_break(&joined, r.samples_per_epoch, dataset)
        {
            out.push(fail(phase, what).step(step).saw(expected, actual));
        }
    }
    let o = Outcome::new(Check::DataLedger, r, compared, r.planned_steps(), out);
    if r.samples_per_epoch == 0 {
        o.with(
            EPOCH_RULES_NOT_CHECKED,
            "the record does not say how many samples an epoch holds (`run.samples_per_epoch`): each phase's samples were compared with the reference's, the epoch rules not checked",
        )
    } else {
        o
    }
}

/// The figure saying the epoch rules were not checked, and why.
pub const EPOCH_RULES_NOT_CHECKED: &str = "epoch_rules_not_checked";

/// The first row whose sample differs from the reference's at the same step and row: its step,
/// the reference's sample, the phase's, and where it sits.
fn first_difference(
    reference: &PhaseRecord,
    phase: &PhaseRecord,
) -> Option<(u64, String, String, String)> {
    for step in &phase.steps {
        let Some(want) = reference.steps.iter().find(|s| s.step == step.step) else {
            continue;
        };
        let rows = want.samples.len().max(step.samples.len());
        for row in 0..rows {
            let (w, g) = (want.samples.get(row), step.samples.get(row));
            if w != g {
                let show = |s: Option<&SampleId>| s.map_or("no sample".into(), |s| s.to_string());
                return Some((
                    step.step,
                    show(w),
                    show(g),
                    format!("row {row} of the step's batch is the first that differs from the reference's"),
                ));
            }
        }
    }
    None
}

/// The first place where `ledger` breaks the epoch rules, given `samples` per epoch of a dataset
/// of `dataset` samples: its step, what broke, the expected and the actual.
fn epoch_break(
    ledger: &[(u64, SampleId)],
    samples: u64,
    dataset: u64,
) -> Option<(u64, &'static str, String, String)> {
    let mut epoch = 0u64;
    let mut seen = BTreeSet::new();
    for &(step, id) in ledger {
        if id.epoch == epoch + 1 && seen.len() as u64 == samples {
            epoch = id.epoch;
            seen.clear();
        }
        if id.epoch != epoch {
            let expected = if seen.len() as u64 == samples {
                format!("epoch {} to begin", epoch + 1)
            } else {
                format!(
                    "epoch {epoch} to go on ({} of its {samples} samples handed out)",
                    seen.len()
                )
            };
            return Some((step, "epoch order", expected, id.to_string()));
        }
        if id.index >= dataset {
            return Some((
                step,
                "sample index",
                format!("below the dataset's {dataset} samples"),
                id.to_string(),
            ));
        }
        if !seen.insert(id.index) {
            return Some((
                step,
                "repeated sample",
                "each sample once per epoch".into(),
                format!("{id} handed out again"),
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use crate::record::StepRecord;

    fn id(epoch: u64, index: u64) -> SampleId {
        SampleId { epoch, index }
    }

    /// The faithful run reading 4 samples a step from a dataset of 10.
    fn run() -> RunRecord {
        let mut r = fixtures::run();
        r.samples_per_epoch = 10;
        for phase in &mut r.phases {
            for step in &mut phase.steps {
                step.samples = (step.step * 4..step.step * 4 + 4)
                    .map(|n| id(n / 10, (n % 10 * 7) % 10))
                    .collect();
            }
        }
        r
    }

    fn steps(r: &mut RunRecord, phase: usize) -> &mut Vec<StepRecord> {
        &mut r.phases[phase].steps
    }

    #[test]
    fn a_faithful_ledger_passes_counting_every_step() {
        let o = check(&run());
        assert!(o.failures.is_empty(), "{:?}", o.failures);
        assert_eq!((o.compared, o.implied), (12, 12));
    }

    #[test]
    fn a_resume_that_skips_an_epoch_fails_at_its_first_sample() {
        let mut r = run();
        // Resumed at step 4 (sample 16, epoch 1): the loader jumps to epoch 3.
        for (k, s) in steps(&mut r, 2).iter_mut().enumerate() {
            s.samples = (0..4).map(|j| id(3, (k * 4 + j) as u64)).collect();
        }
        let o = check(&r);
        let shown: Vec<String> = o.failures.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "data_ledger: cpu::s resume-end step 4: sample ledger: expected sample 2 of epoch 1, got sample 0 of epoch 3; row 0 of the step's batch is the first that differs from the reference's",
                "data_ledger: cpu::s resume-end step 4: epoch order: expected epoch 1 to go on (6 of its 10 samples handed out), got sample 0 of epoch 3",
            ]
        );
    }

    #[test]
    fn a_restarted_loader_repeats_samples() {
        let mut r = run();
        let first = r.phases[0].steps[0].samples.clone();
        steps(&mut r, 1)[0].samples = first;
        let o = check(&r);
        let what: Vec<&str> = o.failures.iter().map(|f| f.what.as_str()).collect();
        assert_eq!(what, ["sample ledger", "repeated sample"]);
        assert_eq!(o.failures[1].step, Some(2));
        assert_eq!(o.failures[1].actual, "sample 0 of epoch 0 handed out again");
    }

    #[test]
    fn a_reference_that_skips_samples_fails_even_when_every_resume_agrees() {
        // Every phase begins a new epoch after 10 samples of a dataset of 12.
        let mut r = fixtures::run();
        r.samples_per_epoch = 12;
        let o = check(&r);
        assert_eq!(o.failures.len(), 3, "one per phase: {:?}", o.failures);
        assert!(o.failures.iter().all(|f| f.what == "epoch order"));
        assert_eq!(
            o.failures[0].to_string(),
            "data_ledger: cpu::s reference step 2: epoch order: expected epoch 0 to go on (10 of its 12 samples handed out), got sample 0 of epoch 1"
        );
    }

    #[test]
    fn a_lost_row_and_an_index_outside_the_dataset_fail() {
        let mut r = run();
        steps(&mut r, 1)[1].samples.pop();
        let o = check(&r);
        let what: Vec<&str> = o.failures.iter().map(|f| f.what.as_str()).collect();
        assert_eq!(
            what,
            ["sample ledger", "epoch order"],
            "the lost sample is skipped"
        );
        assert_eq!(o.failures[0].actual, "no sample");
        assert_eq!(
            o.failures[1].expected,
            "epoch 1 to go on (9 of its 10 samples handed out)"
        );
        let mut r = run();
        r.samples_per_epoch = 5;
        assert!(check(&r).failures.iter().any(|f| f.what == "sample index"));
    }

    #[test]
    fn steps_without_a_ledger_fail_and_are_not_counted() {
        let mut r = run();
        steps(&mut r, 2)[1].samples.clear();
        let o = check(&r);
        assert_eq!(o.compared, 11);
        assert!(o.failed());
        assert_eq!(o.failures[0].what, "samples");
    }
}
