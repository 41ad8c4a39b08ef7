//! The negative controls of `suites/faults/` as a whole: every check must fail in at least one of
//! them, and the controls that need no fault are what they say they are (the golden control's
//! snapshot differs from its twin's in the one deliberate loss only).

use ckpt_harness::checks::golden_file::Snapshot;
use ckpt_harness::checks::{Check, Status};
use ckpt_harness::devices::DeviceKind;
use ckpt_harness::run::trial::{self, GoldenMode};
use ckpt_harness::suite::Suite;
use common::{root, suites_in};
use std::collections::BTreeSet;

// Each test binary uses part of what the tests share.
#[allow(dead_code)]
mod common;

fn suite(path: &str) -> Suite {
    Suite::load(&root().join(path)).unwrap()
}

#[test]
fn every_check_is_named_in_the_expect_fail_of_a_negative_control() {
    let named: BTreeSet<Check> = suites_in("suites/faults")
        .iter()
        .flat_map(|s| s.expect_fail())
        .collect();
    let missing: Vec<Check> = Check::ALL
        .into_iter()
        .filter(|c| !named.contains(c))
        .collect();
    assert!(
        missing.is_empty(),
        "no control in suites/faults/ expects these to fail: {missing:?}"
    );
}

/// The snapshot text of `suite` on `device`.
fn snapshot(device: &str, suite: &str) -> String {
    let file = root().join(format!("golden/{device}/{suite}.snap"));
    let content = std::fs::read_to_string(&file).unwrap();
    Snapshot::parse(&content).unwrap().text
}

const CONTROL: &str = "golden_snapshot_differs";

#[test]
fn the_golden_control_is_tiny_fp32_with_one_loss_changed() {
    let (control, twin) = (
        suite(&format!("suites/faults/{CONTROL}.yaml")),
        suite("suites/tiny-fp32.yaml"),
    );
    assert_eq!(control.train, twin.train);
    for device in ["cpu", "cuda"] {
        let renamed = snapshot(device, "tiny-fp32").replace(
            &format!("{device}::tiny-fp32"),
            &format!("{device}::faults::{CONTROL}"),
        );
        let deliberate = renamed.replace("\n6 | 4.14119e0 |", "\n6 | 4.14120e0 |");
        assert_ne!(deliberate, renamed, "{device}: step 6's loss moved");
        assert_eq!(snapshot(device, CONTROL), deliberate, "{device}");
    }
}

#[test]
fn the_golden_control_fails_at_the_changed_step_only() {
    let control = suite(&format!("suites/faults/{CONTROL}.yaml"));
    let t = trial::run(
        &control,
        DeviceKind::Cpu,
        &root().join("golden"),
        GoldenMode::Check,
        &mut (),
    );
    assert!(t.passed, "{}", t.verdict);
    let golden = t.checks.iter().find(|o| o.check == Check::Golden).unwrap();
    assert_eq!(golden.status, Status::Failed);
    let f = &golden.failures[..];
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0].step, Some(6));
    assert!(f[0].expected.starts_with("6 | 4.14120e0 |"), "{}", f[0]);
    assert!(f[0].actual.starts_with("6 | 4.14119e0 |"), "{}", f[0]);
}

/// `loader_offset_lost_on_resave` shows only in a chain of resumes: the same run resumed only
/// from the reference's checkpoints fails no check.
#[test]
fn the_lost_resume_offset_needs_a_chain_to_show() {
    let path = root().join("suites/faults/loader_offset_lost_on_resave.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let chain = "resume_from: [3, 5, 7]";
    assert!(text.contains(chain));
    let single = Suite::parse(&path, &text.replace(chain, "resume_from: 3")).unwrap();
    let t = trial::run(
        &single,
        DeviceKind::Cpu,
        &root().join("golden"),
        GoldenMode::Check,
        &mut (),
    );
    let failed: Vec<Check> = t
        .checks
        .iter()
        .filter(|o| o.failed())
        .map(|o| o.check)
        .collect();
    assert!(failed.is_empty(), "{failed:?}");
    assert!(!t.passed, "the control expects failures: {}", t.verdict);
}

/// `optimizer_state_allocated_at_load` fails `memory_parity` at each resumed phase's first step
/// only, by the moments' bytes, and its twin without the fault passes every check.
#[test]
fn the_moments_allocated_at_load_fail_parity_at_each_first_resumed_step() {
    let path = root().join("suites/faults/optimizer_state_allocated_at_load.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let run = |text: &str| {
        let s = Suite::parse(&path, text).unwrap();
        trial::run(
            &s,
            DeviceKind::Cpu,
            &root().join("golden"),
            GoldenMode::Check,
            &mut (),
        )
    };
    let faulty = run(&text);
    assert!(faulty.passed, "{}", faulty.verdict);
    let parity = faulty
        .checks
        .iter()
        .find(|o| o.check == Check::MemoryParity)
        .unwrap();
    assert_eq!(parity.status, Status::Failed);
    let first_steps: BTreeSet<u64> = faulty
        .record
        .phases
        .iter()
        .skip(1)
        .map(|p| p.steps[0].step)
        .collect();
    let at: BTreeSet<u64> = parity.failures.iter().filter_map(|f| f.step).collect();
    assert_eq!(at, first_steps);
    let what: BTreeSet<&str> = parity.failures.iter().map(|f| f.what.as_str()).collect();
    assert_eq!(
        what,
        ["optimizer bytes at the step's peak", "step peak"].into()
    );
    let clean = text
        .replace("faults: [optimizer_state_allocated_at_load]\n", "")
        .replace("expect_fail: [memory_parity, memory_model]\n", "");
    let clean = run(&clean);
    let failed: Vec<(Check, Status)> = clean
        .checks
        .iter()
        .filter(|o| ![Status::Passed, Status::Off].contains(&o.status))
        .map(|o| (o.check, o.status))
        .collect();
    assert!(failed.is_empty(), "{failed:?}: {}", clean.verdict);
    assert!(clean.passed, "{}", clean.verdict);
}
