//! One contract: a trial's record written as `ckpt-record/1` and read back gives every check the
//! same outcome, figure for figure and failure for failure, as the run that wrote it; over
//! ordinary suites and every negative control, so each check's failures go through the record.

use ckpt_harness::checks::{self, golden, Check, Status};
use ckpt_harness::devices::DeviceKind;
use ckpt_harness::record::jsonl::{from_run, to_run};
use ckpt_harness::run::plan;
use ckpt_harness::run::trial::{self, GoldenMode};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn suites() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../suites");
    let mut files: Vec<PathBuf> = [
        "tiny-fp32.yaml",
        "async-save.yaml",
        "chained-resumes.yaml",
        "parallel-processes.yaml",
    ]
    .iter()
    .map(|f| root.join(f))
    .collect();
    let mut faults: Vec<PathBuf> = std::fs::read_dir(root.join("faults"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    faults.sort();
    files.extend(faults);
    files
}

#[test]
fn a_record_read_back_gives_every_check_the_run_s_outcome() {
    let mut failed_somewhere = BTreeSet::new();
    for file in suites() {
        let suite = plan::load_one(&file).unwrap();
        if !suite.devices().contains(&DeviceKind::Cpu) {
            continue;
        }
        let dir = golden::dir_for(&suite.path);
        let result = trial::run(&suite, DeviceKind::Cpu, &dir, GoldenMode::Check, &mut ());
        assert!(result.passed, "{}: {}", file.display(), result.verdict);
        let text: String = from_run::lines(&result.record)
            .iter()
            .map(|l| serde_json::to_string(l).unwrap() + "\n")
            .collect();
        let back = to_run::run_record(to_run::parse(&text, &result.name).unwrap()).unwrap();
        let stored = golden::load(&dir, &back.device, &back.suite).unwrap();
        let again = checks::run_all(&back, &suite.file.checks, &stored);
        for (want, got) in result.checks.iter().zip(&again) {
            assert_eq!(
                serde_json::to_value(got).unwrap(),
                serde_json::to_value(want).unwrap(),
                "{}: {}",
                result.name,
                want.check
            );
            if want.status == Status::Failed {
                failed_somewhere.insert(want.check);
            }
        }
        assert_eq!(again.len(), result.checks.len(), "{}", result.name);
    }
    let never: Vec<Check> = Check::ALL
        .into_iter()
        .filter(|c| !failed_somewhere.contains(c))
        .collect();
    assert!(
        never.is_empty(),
        "checks no trial failed through the record: {never:?}"
    );
}
