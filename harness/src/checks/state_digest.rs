//! `state_digest`: at the first step of each resumed phase, the resumed trainer's weights,
//! optimizer state, step, next learning rate and loader position equal the reference trainer's
//! before the same step, and the first resumed batch is the reference's. Another trainer's
//! record names its state by parts (parameters and optimizer state by name, each generator,
//! the data position): its resumed state is compared with the state the reference recorded
//! at the save it resumes from, part by part, each failure naming the first tensor that differs.

use super::{Check, Failure, Input, Outcome};
use crate::record::fields::RecordField;
use crate::record::training_state::State;
use crate::record::{Phase, PhaseRecord, RunRecord};

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    check(input.record)
}

/// Compares the resumed state with the reference's at every resume point; `compared` counts the
/// resume points.
pub fn check(r: &RunRecord) -> Outcome {
    let mut out = Vec::new();
    let mut compared = 0u64;
    for phase in r.phases.iter().filter(|p| p.phase != Phase::Reference) {
        let fail = |what: &str| Failure::new(Check::StateDigest, r, what).phase(phase.phase);
        if let Some(refused) = &phase.refused {
            let at = r.planned.iter().find(|p| p.phase == phase.phase);
            out.push(
                fail("resumed state")
                    .saw(
                        format!("the reference's state at step {}", at.map_or(0, |p| p.from)),
                        "none: the checkpoint was refused at load",
                    )
                    .detail(refused.clone()),
            );
            continue;
        }
        if let (None, Some(got)) = (&phase.resumed_digest, &phase.resumed_state) {
            if by_name(r, phase.phase, got, &mut out).is_some() {
                compared += 1;
            }
            out.extend(batch_differs(r, phase));
            continue;
        }
        let (Some(got), Some(want)) = (&phase.resumed_digest, &phase.reference_digest) else {
            out.push(fail("state digests").saw("both recorded", "missing"));
            continue;
        };
        compared += 1;
        let at = want.step;
        let fields = [
            ("step", want.step.to_string(), got.step.to_string()),
            ("params digest", want.params.clone(), got.params.clone()),
            (
                "optimizer digest (masters and moments)",
                want.optimizer.clone(),
                got.optimizer.clone(),
            ),
            (
                "optimizer steps",
                want.optimizer_steps.to_string(),
                got.optimizer_steps.to_string(),
            ),
            (
                "next lr",
                format!("{:e}", want.next_lr),
                format!("{:e}", got.next_lr),
            ),
            (
                "loader position",
                format!("{:?}", want.loader),
                format!("{:?}", got.loader),
            ),
            (
                "dropout generator state",
                format!("{:?}", want.rng),
                format!("{:?}", got.rng),
            ),
        ];
        for (what, w, g) in fields {
            if w != g {
                out.push(fail(what).step(at).saw(w, g));
            }
        }
        out.extend(batch_differs(r, phase));
    }
    let implied = r.planned_resumes().count() as u64;
    Outcome::new(Check::StateDigest, r, compared, implied, out)
}

/// The first resumed step's batch against the reference's at the same step, when it differs.
fn batch_differs(r: &RunRecord, phase: &PhaseRecord) -> Option<Failure> {
    let first = phase.steps.first()?;
    let want = r.reference()?.steps.iter().find(|s| s.step == first.step)?;
    (first.batch_digest != want.batch_digest).then(|| {
        Failure::new(Check::StateDigest, r, "batch digest")
            .phase(phase.phase)
            .step(first.step)
            .saw(&want.batch_digest, &first.batch_digest)
            .detail("the resumed loader hands out a different batch")
    })
}

/// Another trainer's resumed state `got` against the state the reference recorded when it saved
/// the checkpoint the phase resumes from, part by part and name by name (each kind's first
/// difference, with how many more of its kind differ). `None` when the reference recorded no
/// such save (a failure says so).
fn by_name(r: &RunRecord, phase: Phase, got: &State, out: &mut Vec<Failure>) -> Option<()> {
    let from = r
        .planned
        .iter()
        .find(|q| q.phase == phase)
        .map_or(got.step, |q| q.from);
    let fail = |what: &str| {
        Failure::new(Check::StateDigest, r, what)
            .phase(phase)
            .step(from)
    };
    let saved = r
        .reference()
        .and_then(|p| p.saves.iter().rev().find(|s| s.step == from))
        .and_then(|s| s.named.as_ref());
    let Some(want) = saved else {
        out.push(
            fail("the reference's state at the save resumed from")
                .saw("recorded on a save line", "none recorded")
                .detail("the reference must write a save line for every checkpoint a phase resumes from"),
        );
        return None;
    };
    let shown = |v: &Option<String>| v.clone().unwrap_or_else(|| "not recorded".into());
    for d in want.differences(got) {
        let mut f = fail(&d.what).saw(shown(&d.expected), shown(&d.actual));
        if d.more > 0 {
            f = f.detail(format!("and {} more of its kind differ", d.more));
        }
        out.push(f);
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;

    #[test]
    fn an_unrestored_dropout_generator_fails() {
        let mut r = fixtures::run();
        r.phases[1].resumed_digest.as_mut().unwrap().rng.offset = 0;
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        assert!(o.failures[0]
            .to_string()
            .contains("dropout generator state"));
    }

    /// A resume whose checkpoint was refused at load fails here, with the refusal, and the run
    /// ends there: the phases after it are not compared.
    #[test]
    fn a_checkpoint_refused_at_load_fails_with_the_refusal() {
        let mut r = fixtures::run();
        r.phases.truncate(2);
        let refused = &mut r.phases[1];
        refused.resumed_digest = None;
        refused.reference_digest = None;
        refused.steps.clear();
        refused.refused = Some("shards.json: rows 30..37 ... are in no rank's file".into());
        let o = check(&r);
        assert_eq!(o.failures.len(), 1, "{:?}", o.failures);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with("state_digest: cpu::s resume-mid: resumed state: expected the reference's state at step 2, got none: the checkpoint was refused at load; shards.json: rows 30..37"),
            "{m}"
        );
        assert!(r.ended_early());
    }

    #[test]
    fn unsaved_moments_fail() {
        let mut r = fixtures::run();
        r.phases[1].resumed_digest.as_mut().unwrap().optimizer = "zeros".into();
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with("state_digest: cpu::s resume-mid step 2: optimizer digest (masters and moments): expected opt2, got zeros"),
            "{m}"
        );
    }

    #[test]
    fn a_restarted_loader_fails_on_position_and_batch() {
        let mut r = fixtures::run();
        r.phases[2].resumed_digest.as_mut().unwrap().loader.position = 0;
        r.phases[2].steps[0].batch_digest = "batch0".into();
        let o = check(&r);
        let what: Vec<&str> = o.failures.iter().map(|f| f.what.as_str()).collect();
        assert_eq!(what, ["loader position", "batch digest"]);
    }

    #[test]
    fn a_reset_schedule_fails_on_the_next_lr() {
        let mut r = fixtures::run();
        r.phases[1].resumed_digest.as_mut().unwrap().next_lr = 0.001;
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        assert_eq!(o.failures[0].what, "next lr");
        assert_eq!(o.failures[0].expected, "3e-3");
    }

    /// Every field of the state is compared on its own: changing one fails on it alone.
    #[test]
    fn every_field_of_the_state_is_compared() {
        type Change = fn(&mut ckpt_engine::StateDigest);
        let changes: [(&str, Change); 7] = [
            ("step", |d| d.step += 1),
            ("params digest", |d| d.params.push('x')),
            ("optimizer digest (masters and moments)", |d| {
                d.optimizer.push('x')
            }),
            ("optimizer steps", |d| d.optimizer_steps -= 1),
            ("next lr", |d| d.next_lr *= 2.0),
            ("loader position", |d| d.loader.epoch += 1),
            ("dropout generator state", |d| d.rng.seed += 1),
        ];
        for (what, change) in changes {
            let mut r = fixtures::run();
            change(r.phases[2].resumed_digest.as_mut().unwrap());
            let o = check(&r);
            let failed: Vec<&str> = o.failures.iter().map(|f| f.what.as_str()).collect();
            assert_eq!(failed, [what]);
            assert_eq!(o.failures[0].step, Some(4), "{what}");
        }
    }

    #[test]
    fn a_batch_that_differs_from_the_reference_s_fails() {
        let mut r = fixtures::run();
        r.phases[1].steps[0].batch_digest = "other".into();
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        let m = o.failures[0].to_string();
        assert_eq!(m, "state_digest: cpu::s resume-mid step 2: batch digest: expected batch2, got other; the resumed loader hands out a different batch");
    }

    #[test]
    fn a_missing_digest_fails() {
        let mut r = fixtures::run();
        r.phases[1].reference_digest = None;
        assert!(check(&r).failed());
    }
}
