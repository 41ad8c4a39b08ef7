//! `ckpt-harness run` over the CI suites: every trial passes, the summary names each, and the
//! exit status reflects the verdict.

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ckpt-harness");

fn suites_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../suites")
}

#[test]
fn every_ci_suite_passes_and_is_summarised() {
    let report = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .arg("run")
        .arg(suites_dir())
        .arg("--report")
        .arg(report.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(report.path().join("summary.json")).unwrap())
            .unwrap();
    let trials = summary.as_array().unwrap();
    assert!(trials.len() >= 4, "{summary}");
    for t in trials {
        assert_eq!(t["passed"], true, "{t}");
    }
}

#[test]
fn an_invalid_suite_is_an_error_with_its_location() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(suites_dir().join("tiny-fp32.yaml"))
        .unwrap()
        .replace("batch_size: 4", "batch_size: 4\nbatch_sise: 4");
    let path = dir.path().join("typo.yaml");
    std::fs::write(&path, text).unwrap();
    let out = Command::new(BIN)
        .arg("run")
        .arg(&path)
        .arg("--report")
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("typo.yaml:"), "{stderr}");
    assert!(stderr.contains("batch_sise"), "{stderr}");
}
