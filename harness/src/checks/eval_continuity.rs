//! `eval_continuity`: every phase evaluates its validation split exactly after the steps the
//! schedule names (`run.planned_evaluations` within the steps it trains: none again at the step
//! it resumed at, none skipped), and every resumed phase's evaluation equals the reference's
//! after the same step: loss bit for bit, tokens and the digest of the batches evaluated. A
//! record that plans no evaluations (another trainer's) has its evaluations compared all the
//! same, none repeated at a resume or twice after a step; one without any asks nothing of it.

use super::{Check, Failure, Input, Outcome};
use crate::record::fields::RecordField;
use crate::record::{EvalRecord, Phase, PhaseRecord, RunRecord};

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    check(input.record)
}

/// The steps after which `phase`, resumed at `from`, evaluates: the planned ones past `from`,
/// up to the last step it trained; `None` where the record plans none.
fn due(r: &RunRecord, phase: &PhaseRecord, from: u64) -> Option<Vec<u64>> {
    let trained = phase.steps.last().map_or(from, |s| s.step + 1);
    let planned = r.planned_evaluations.iter().copied();
    (!r.planned_evaluations.is_empty())
        .then(|| planned.filter(|&s| s > from && s <= trained).collect())
}

/// Checks every phase's schedule and every resumed evaluation; `compared` counts the resumed
/// evaluations compared with the reference's.
pub fn check(r: &RunRecord) -> Outcome {
    let evaluated = r.phases.iter().any(|p| !p.evaluations.is_empty());
    if r.planned_evaluations.is_empty() && !evaluated {
        return Outcome::nothing_asked(Check::EvalContinuity);
    }
    let Some(reference) = r.reference() else {
        let f = Failure::new(Check::EvalContinuity, r, "the reference phase")
            .saw("recorded", "missing");
        return Outcome::new(Check::EvalContinuity, r, 0, 0, vec![f]);
    };
    let mut out = Vec::new();
    let mut compared = 0u64;
    for phase in &r.phases {
        let from = match phase.phase {
            Phase::Reference => 0,
            _ => (r.planned.iter().find(|p| p.phase == phase.phase)).map_or(0, |p| p.from),
        };
        let fail = |step: u64, what: &str| {
            Failure::new(Check::EvalContinuity, r, what)
                .phase(phase.phase)
                .step(step)
        };
        let due = due(r, phase, from);
        let mut seen: Vec<u64> = Vec::new();
        for e in &phase.evaluations {
            let off_schedule = due.as_ref().is_some_and(|due| !due.contains(&e.step));
            let repeated = e.step <= from && from > 0;
            if off_schedule || repeated || seen.contains(&e.step) {
                let (expected, detail) = match (repeated, &due) {
                    (true, _) => ("none: the run it resumed from evaluated there before its checkpoint", format!("the phase resumed at step {from} and evaluated again before its first step, as a trainer that re-runs evaluation on every resume does")),
                    (false, Some(due)) if off_schedule => ("none", format!("the schedule evaluates after steps {due:?} of this phase")),
                    _ => ("none", "the phase evaluated twice after the same step".to_string()),
                };
                out.push(
                    fail(e.step, "an evaluation")
                        .saw(expected, format!("one, loss {:e}", e.loss))
                        .detail(detail),
                );
                continue;
            }
            seen.push(e.step);
            if phase.phase == Phase::Reference {
                continue;
            }
            let Some(want) = reference.evaluations.iter().find(|x| x.step == e.step) else {
                out.push(fail(e.step, "the reference's evaluation").saw("recorded", "missing"));
                continue;
            };
            compared += 1;
            out.extend(differences(want, e).map(|(what, want, got)| {
                fail(e.step, what).saw(want, got).detail(
                    "the evaluation after the same step must see the same batches and give the same bits; a validation loader that is not reset before each evaluation reads on from where the last one stopped",
                )
            }));
        }
        for &step in due.iter().flatten().filter(|s| !seen.contains(s)) {
            out.push(fail(step, "the evaluation the schedule names").saw("recorded", "missing"));
        }
    }
    let implied = (r.planned_resumes())
        .map(|p| {
            (r.planned_evaluations.iter())
                .filter(|&&s| s > p.from && s <= p.end)
                .count() as u64
        })
        .sum();
    Outcome::new(Check::EvalContinuity, r, compared, implied, out)
        .with("planned_evaluations", r.planned_evaluations.len() as u64)
}

/// The fields of `got` that differ from `want`: what, expected, seen.
fn differences(
    want: &EvalRecord,
    got: &EvalRecord,
) -> impl Iterator<Item = (&'static str, String, String)> {
    [
        (want.loss.to_bits() != got.loss.to_bits()).then(|| {
            (
                "loss",
                format!("{:e} bit for bit", want.loss),
                format!("{:e}", got.loss),
            )
        }),
        (want.tokens != got.tokens)
            .then(|| ("tokens", want.tokens.to_string(), got.tokens.to_string())),
        (want.batch_digest != got.batch_digest).then(|| {
            (
                "batch_digest",
                want.batch_digest.clone(),
                got.batch_digest.clone(),
            )
        }),
    ]
    .into_iter()
    .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use crate::checks::Status;

    #[test]
    fn a_faithful_run_passes_having_compared_every_resumed_evaluation() {
        let o = check(&fixtures::validated(fixtures::run()));
        assert_eq!(o.status, Status::Passed, "{:?}", o.failures);
        // Planned after steps 3 and 6: resume-mid (from 2) evaluates both, resume-end (from 4) 6.
        assert_eq!((o.compared, o.implied), (3, 3));
    }

    #[test]
    fn an_evaluation_repeated_at_the_resume_step_fails() {
        let mut r = fixtures::validated(fixtures::chained());
        // resume-mid-2 resumed at 3, where resume-mid had evaluated before saving.
        let again = fixtures::evaluation(3);
        r.phases[2].evaluations.insert(0, again);
        let o = check(&r);
        assert!(o.failed());
        let f = &o.failures[0];
        assert_eq!((f.phase, f.step), (Some(Phase::ResumeChained(2)), Some(3)));
        assert!(f.detail.as_ref().unwrap().contains("evaluated again"), "{f}");
    }

    #[test]
    fn a_resumed_evaluation_of_other_batches_or_bits_fails() {
        let mut r = fixtures::validated(fixtures::run());
        r.phases[1].evaluations[0].batch_digest = "other".into();
        r.phases[2].evaluations[0].loss = f32::from_bits(r.phases[2].evaluations[0].loss.to_bits() + 1);
        let o = check(&r);
        let what: Vec<_> = o.failures.iter().map(|f| (f.phase, f.what.as_str())).collect();
        assert_eq!(
            what,
            [
                (Some(Phase::ResumeMid), "batch_digest"),
                (Some(Phase::ResumeEnd), "loss")
            ]
        );
    }

    #[test]
    fn a_skipped_evaluation_fails_and_a_run_without_validation_is_asked_nothing() {
        let mut r = fixtures::validated(fixtures::run());
        r.phases[0].evaluations.remove(1);
        let o = check(&r);
        let f = &o.failures[0];
        assert_eq!((f.phase, f.step), (Some(Phase::Reference), Some(6)));
        assert_eq!(f.what, "the evaluation the schedule names");
        // The resumed phases have nothing to compare theirs with.
        assert!(o.failures[1..].iter().all(|f| f.phase.is_none() || f.what == "the reference's evaluation"));
        assert_eq!(check(&fixtures::run()).status, Status::Passed);
    }

    #[test]
    fn another_trainer_s_evaluations_without_a_plan_are_compared_all_the_same() {
        let mut r = fixtures::validated(fixtures::run());
        r.planned_evaluations.clear();
        let o = check(&r);
        assert_eq!((o.status, o.compared), (Status::Passed, 3));
        r.phases[2].evaluations[0].loss += 1.0;
        r.phases[1].evaluations.insert(0, fixtures::evaluation(2));
        let what: Vec<_> = (check(&r).failures.iter())
            .map(|f| (f.phase, f.step, f.what.clone()))
            .collect();
        assert_eq!(
            what,
            [
                (Some(Phase::ResumeMid), Some(2), "an evaluation".to_string()),
                (Some(Phase::ResumeEnd), Some(6), "loss".to_string())
            ]
        );
    }
}
