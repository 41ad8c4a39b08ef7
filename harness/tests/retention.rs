//! Retention under `run`: the reference phase saves with the suite's `keep_last`, so only the
//! newest checkpoints stay on disk, and the resumed phases still find theirs.

use ckpt_engine::checkpoint;
use ckpt_harness::devices::DeviceKind;
use ckpt_harness::record::Phase;
use ckpt_harness::run::phases;
use ckpt_harness::suite::Suite;
use std::path::Path;

#[test]
fn keep_last_prunes_all_but_the_newest_and_the_resumes_still_load() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("suites/tiny-fp32.yaml"))
        .unwrap()
        .replace(
            "training: {max_steps: 8, extra_steps: 3}",
            "training: {max_steps: 8, extra_steps: 3, save_every: 2, keep_last: 4}",
        );
    let dir = tempfile::tempdir().unwrap();
    let suite = Suite::parse(&dir.path().join("kept.yaml"), &text).unwrap();
    let record = phases::run(&suite, DeviceKind::Cpu, dir.path(), &mut ()).unwrap();
    let phases: Vec<Phase> = record.phases.iter().map(|p| p.phase).collect();
    assert_eq!(
        phases,
        [Phase::Reference, Phase::ResumeMid, Phase::ResumeEnd]
    );
    let kept: Vec<String> = checkpoint::list(&dir.path().join("checkpoints"))
        .unwrap()
        .iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        kept,
        [
            "step-00000004",
            "step-00000006",
            "step-00000008",
            "step-00000010"
        ]
    );
}
