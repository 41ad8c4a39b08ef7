//! `checkpoint_equivalence`: every checkpoint the reference phase saved holds exactly the state
//! of its step. Once complete, its tensors' digests and its trainer state's step and AdamW
//! update count equal those the live trainer had when the save was asked for; and an
//! asynchronous save's files are byte for byte those of a synchronous save of the same state.
//! It runs for synchronous saves too, so every suite's checkpoints are read back.

use super::{Check, Failure, Input, Outcome};
use crate::record::fields::RecordField;
use crate::record::saves::SaveRecord;
use crate::record::{Phase, RunRecord};

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[RecordField::OnDisk];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    check(input.record)
}

/// Compares every recorded save with the state it was asked to write; `compared` counts the
/// saves read back, `implied` the saves the suite plans.
pub fn check(r: &RunRecord) -> Outcome {
    let mut out = Vec::new();
    let mut compared = 0u64;
    let mut identical = 0u64;
    for p in &r.phases {
        for save in &p.saves {
            compared += compare(r, p.phase, save, &mut out);
            identical += u64::from(save.differing_files.as_ref().is_some_and(Vec::is_empty));
        }
    }
    let missing: Vec<u64> = r
        .planned_saves
        .iter()
        .copied()
        .filter(|s| !r.phases.iter().flat_map(|p| &p.saves).any(|v| v.step == *s))
        .collect();
    if !missing.is_empty() && !r.ended_early() {
        out.push(
            Failure::new(Check::CheckpointEquivalence, r, "saves recorded")
                .phase(Phase::Reference)
                .saw(format!("steps {:?}", r.planned_saves), format!("none at steps {missing:?}"))
                .detail("the reference phase should save where the suite says (resume_from, max_steps, save_every)"),
        );
    }
    let implied = r.planned_saves.len() as u64;
    Outcome::new(Check::CheckpointEquivalence, r, compared, implied, out)
        .with("identical_to_synchronous", identical)
}

/// Compares one save; 1 when it was read back, 0 when not.
fn compare(r: &RunRecord, phase: Phase, save: &SaveRecord, out: &mut Vec<Failure>) -> u64 {
    let fail = |what: &str| {
        Failure::new(Check::CheckpointEquivalence, r, what)
            .phase(phase)
            .step(save.step)
    };
    let how = if save.asynchronous {
        "an asynchronous save"
    } else {
        "a synchronous save"
    };
    if let (None, Some(refused)) = (&save.on_disk, &save.unreadable) {
        out.push(
            fail("checkpoint on disk")
                .saw("read back once complete", "refused")
                .detail(refused.clone()),
        );
        return 1;
    }
    let Some(disk) = &save.on_disk else {
        out.push(
            fail("checkpoint on disk")
                .saw("read back once complete", "never read")
                .detail(format!("{how} whose checkpoint was never read back")),
        );
        return 0;
    };
    let want = &save.in_memory;
    let why = if save.asynchronous {
        "the writer wrote other tensors than the state at the save: it must copy them when the save is asked for, not read the live ones later"
    } else {
        "the save wrote other tensors than the trainer held"
    };
    let fields = [
        (
            "step in trainer_state.json",
            want.step.to_string(),
            disk.step.to_string(),
        ),
        (
            "optimizer steps in trainer_state.json",
            want.optimizer_steps.to_string(),
            disk.optimizer_steps.to_string(),
        ),
        ("params digest", want.params.clone(), disk.params.clone()),
        (
            "optimizer digest (masters and moments)",
            want.optimizer.clone(),
            disk.optimizer.clone(),
        ),
    ];
    for (what, w, g) in fields {
        if w != g {
            out.push(fail(what).saw(w, g).detail(why));
        }
    }
    if save.asynchronous {
        match &save.differing_files {
            None => out.push(
                fail("files against a synchronous save of the same state")
                    .saw("compared", "not compared"),
            ),
            Some(files) if !files.is_empty() => out.push(
                fail("files against a synchronous save of the same state")
                    .saw("identical", format!("{} differ", files.join(", ")))
                    .detail(why),
            ),
            Some(_) => {}
        }
    }
    1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use proptest::prelude::*;

    fn saved(r: &RunRecord) -> usize {
        r.phases[0].saves.len()
    }

    #[test]
    fn faithful_saves_pass_and_count_every_planned_save() {
        let r = fixtures::run();
        let o = check(&r);
        assert!(!o.failed(), "{:?}", o.failures);
        assert_eq!((o.compared, o.implied), (3, 3));
        assert_eq!(o.figures["identical_to_synchronous"], 3);
    }

    #[test]
    fn a_checkpoint_holding_the_next_step_s_weights_fails_naming_the_step() {
        let mut r = fixtures::run();
        let s = &mut r.phases[0].saves[0];
        s.on_disk.as_mut().unwrap().params = "params3".into();
        s.differing_files = Some(vec!["model.safetensors".into()]);
        let o = check(&r);
        assert_eq!(o.failures.len(), 2, "{:?}", o.failures);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with("checkpoint_equivalence: cpu::s reference step 2: params digest: expected params2, got params3; the writer wrote other tensors"),
            "{m}"
        );
        assert!(o.failures[1].actual.contains("model.safetensors differ"));
    }

    #[test]
    fn a_synchronous_save_is_compared_with_its_digest_only() {
        let mut r = fixtures::run();
        for s in &mut r.phases[0].saves {
            s.asynchronous = false;
            s.differing_files = None;
        }
        assert!(!check(&r).failed());
        r.phases[0].saves[1].on_disk.as_mut().unwrap().optimizer = "x".into();
        let o = check(&r);
        assert_eq!(o.failures.len(), 1);
        assert_eq!(o.failures[0].what, "optimizer digest (masters and moments)");
        assert_eq!(o.failures[0].step, Some(4));
    }

    #[test]
    fn a_checkpoint_refused_when_read_back_fails_with_the_refusal() {
        let mut r = fixtures::run();
        let s = &mut r.phases[0].saves[1];
        s.on_disk = None;
        s.unreadable = Some("shards.json: rows 30..37 are in no rank's file".into());
        let o = check(&r);
        assert_eq!(o.failures.len(), 1, "{:?}", o.failures);
        assert_eq!(o.compared, 3);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with("checkpoint_equivalence: cpu::s reference step 4: checkpoint on disk: expected read back once complete, got refused; shards.json: rows 30..37"),
            "{m}"
        );
    }

    #[test]
    fn a_save_never_read_back_or_never_made_fails() {
        let mut r = fixtures::run();
        r.phases[0].saves[2].on_disk = None;
        let o = check(&r);
        assert_eq!(o.compared, 2);
        assert!(o.failures.iter().any(|f| f.what == "checkpoint on disk"));
        r.phases[0].saves.pop();
        let o = check(&r);
        assert!(o.failed());
        assert!(
            o.failures[0].actual.contains("none at steps [6]"),
            "{:?}",
            o.failures
        );
    }

    #[test]
    fn saves_missing_after_an_out_of_memory_are_not_run() {
        let mut r = fixtures::run();
        r.phases[0].saves.truncate(1);
        r.phases[0].oom = Some(fixtures::oom(Some(3), 100, 100));
        let o = check(&r);
        assert!(o.not_run(), "{:?}", o);
    }

    proptest! {
        /// Any field of any save read back differing from the live state fails at that save.
        #[test]
        fn any_difference_fails_at_its_save(save in 0usize..3, field in 0usize..4) {
            let mut r = fixtures::run();
            prop_assume!(save < saved(&r));
            let d = r.phases[0].saves[save].on_disk.as_mut().unwrap();
            match field {
                0 => d.step += 1,
                1 => d.optimizer_steps += 1,
                2 => d.params.push('x'),
                _ => d.optimizer.push('x'),
            }
            let o = check(&r);
            prop_assert_eq!(o.failures.len(), 1);
            prop_assert_eq!(o.failures[0].step, Some(r.phases[0].saves[save].step));
        }
    }
}
