//! The command-line tool: `run` over a suite, its summary, JUnit and exit statuses; `list` and
//! `validate`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_ckpt-harness");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn harness(args: &[&str], paths: &[&Path]) -> Output {
    Command::new(BIN)
        .args(args)
        .args(paths)
        .current_dir(root())
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn run_writes_the_summary_and_junit() {
    let dir = tempfile::tempdir().unwrap();
    let junit = dir.path().join("junit.xml");
    let suite = root().join("suites/tiny-fp32.yaml");
    let out = harness(
        &[
            "run",
            "--report",
            dir.path().to_str().unwrap(),
            "--junit",
            junit.to_str().unwrap(),
        ],
        &[&suite],
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for phase in ["reference", "resume-mid", "resume-end"] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with("cpu::tiny-fp32 ") && l.contains(phase)),
            "{stdout}"
        );
    }
    assert!(stdout.contains("cuda::tiny-fp32"), "{stdout}");
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["passed"], 1, "{summary}");
    let trial = &summary["trials"][0];
    assert_eq!(trial["name"], "cpu::tiny-fp32");
    let checks = trial["checks"].as_array().unwrap();
    assert_eq!(checks.len(), 9);
    for c in checks {
        assert_eq!(c["status"], "passed", "{c}");
    }
    let xml = std::fs::read_to_string(&junit).unwrap();
    assert!(
        xml.contains("<testcase classname=\"cpu\" name=\"cpu::tiny-fp32\""),
        "{xml}"
    );
}

#[test]
fn a_failed_check_exits_1_and_says_where() {
    let dir = tempfile::tempdir().unwrap();
    let text_in = std::fs::read_to_string(root().join("suites/tiny-fp32.yaml"))
        .unwrap()
        .replace(
            "name: tiny-fp32",
            "name: tiny-budget\ndevices: [cpu]\nmemory: {budget: 4096}\nchecks: {golden: false}",
        );
    let suite = dir.path().join("tiny-budget.yaml");
    std::fs::write(&suite, text_in).unwrap();
    let out = harness(
        &["run", "--report", dir.path().to_str().unwrap()],
        &[&suite],
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        all.contains("peak_budget: cpu::tiny-budget reference step 0: step peak: expected at most 4.0 KiB (4096 bytes), got"),
        "{all}"
    );
    assert!(all.contains("by category: params"), "{all}");
}

#[test]
fn a_negative_control_passes_when_exactly_its_check_fails() {
    let dir = tempfile::tempdir().unwrap();
    let text_in = std::fs::read_to_string(root().join("suites/tiny-fp32.yaml"))
        .unwrap()
        .replace(
            "name: tiny-fp32",
            "name: tiny-over-budget\ndevices: [cpu]\nmemory: {budget: 4096}\nchecks: {golden: false}\nexpect_fail: [peak_budget]",
        );
    let suite = dir.path().join("tiny-over-budget.yaml");
    std::fs::write(&suite, text_in).unwrap();
    let out = harness(
        &["run", "--report", dir.path().to_str().unwrap()],
        &[&suite],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("(negative control)"), "{}", text(&out));
}

#[test]
fn an_invalid_suite_is_an_error_with_its_location() {
    let dir = tempfile::tempdir().unwrap();
    let text_in = std::fs::read_to_string(root().join("suites/tiny-fp32.yaml"))
        .unwrap()
        .replace("batch_size: 4", "batch_size: 4\nbatch_sise: 4");
    let path = dir.path().join("typo.yaml");
    std::fs::write(&path, text_in).unwrap();
    for cmd in [
        &["run", "--report", dir.path().to_str().unwrap()][..],
        &["validate"],
    ] {
        let out = harness(cmd, &[&path]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("typo.yaml:15:1"), "{stderr}");
        assert!(stderr.contains("batch_sise"), "{stderr}");
    }
}

#[test]
fn list_and_validate_cover_every_suite() {
    let suites = root().join("suites");
    let out = harness(&["validate"], &[&suites]);
    assert!(out.status.success(), "{}", text(&out));
    let out = harness(&["list"], &[&suites]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for name in [
        "tiny-fp32",
        "gqa-bf16-ac",
        "tied-embeddings",
        "variable-length",
    ] {
        assert!(stdout.contains(&format!("cpu::{name} ")), "{stdout}");
        assert!(stdout.contains(&format!("cuda::{name} ")), "{stdout}");
    }
    assert!(stdout.contains("skipped: no cuda device"), "{stdout}");
}

#[test]
fn verify_reports_intact_and_damaged_files() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let suite = root().join("suites/tiny-fp32.yaml");
    let out = Command::new(BIN)
        .args([
            "train",
            suite.to_str().unwrap(),
            "--out",
            run.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));

    let out = harness(&["verify"], &[&run]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for name in ["config.json", "model.safetensors", "optimizer.safetensors"] {
        assert!(
            stdout
                .lines()
                .any(|l| l.trim_start().starts_with("ok") && l.contains(name)),
            "{stdout}"
        );
    }
    assert!(
        stdout.contains("1 intact, 0 damaged, 0 unreadable"),
        "{stdout}"
    );

    let latest = std::fs::read_to_string(run.join("latest")).unwrap();
    let model = run.join(latest.trim()).join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x01;
    std::fs::write(&model, bytes).unwrap();
    let out = harness(&["verify"], &[&run]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.lines().any(|l| l.contains("DAMAGED")
            && l.contains("model.safetensors")
            && l.contains("sha256")),
        "{stdout}"
    );
    assert!(stdout.contains("0 intact, 1 damaged"), "{stdout}");

    let out = harness(&["verify"], &[dir.path()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

#[test]
fn verify_exit_statuses_are_documented_and_kept() {
    let out = harness(&["verify", "--help"], &[]);
    let help = String::from_utf8_lossy(&out.stdout);
    for line in ["0  ", "1  ", "2  "] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(line)),
            "{help}"
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let suite = root().join("suites/tiny-fp32.yaml");
    let out = harness(&["train", "--out"], &[&run, &suite]);
    assert!(out.status.success(), "{}", text(&out));
    let state = run.join("step-00000008/trainer_state.json");
    // Unparsable, then missing: the checkpoint is damaged.
    std::fs::write(&state, b"{\"format_version\": 2, \"global").unwrap();
    let out = harness(&["verify"], &[&run]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.contains("DAMAGED") && l.contains("trainer_state.json")),
        "{}",
        text(&out)
    );
    std::fs::remove_file(&state).unwrap();
    let out = harness(&["verify"], &[&run]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    // Nothing to verify.
    let out = harness(&["verify"], &[&dir.path().join("absent")]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}
