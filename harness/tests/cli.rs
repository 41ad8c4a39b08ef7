//! The command-line tool: `run` over a suite, its summary, JUnit and exit statuses; `list`,
//! `validate` and `batches`.

use ckpt_harness::checks::Check;
use ckpt_harness::cli::exit_codes;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

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

/// `suites/tiny-fp32.yaml` renamed `name`, with `extra` keys after the name and each `(from, to)`
/// replaced, written into `dir`.
fn tiny_suite(dir: &Path, name: &str, extra: &str, replace: &[(&str, &str)]) -> PathBuf {
    let base = std::fs::read_to_string(root().join("suites/tiny-fp32.yaml")).unwrap();
    // A `memory:` among the extra keys replaces the suite's own.
    let own_memory =
        |l: &&str| extra.lines().any(|e| e.starts_with("memory:")) && l.starts_with("memory:");
    let base: String = base
        .lines()
        .filter(|l| !own_memory(l))
        .map(|l| format!("{l}\n"))
        .collect();
    let mut text = base.replace("name: tiny-fp32", &format!("name: {name}\n{extra}"));
    for (from, to) in replace {
        assert!(text.contains(from), "{from}");
        text = text.replace(from, to);
    }
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// Writes a tiny suite `name` with `extra` keys and `replace`d text into `dir` and runs it, its
/// report in `dir`.
fn run_tiny(dir: &Path, name: &str, extra: &str, replace: &[(&str, &str)]) -> Output {
    let suite = tiny_suite(dir, name, extra, replace);
    harness(&["run", "--report", dir.to_str().unwrap()], &[&suite])
}

/// `run` over `paths` with `summary.json` and `junit.xml` written into `dir`; the JUnit file.
fn run_reporting(dir: &Path, paths: &[&Path]) -> (Output, PathBuf) {
    let junit = dir.join("junit.xml");
    let report = dir.to_str().unwrap();
    let out = harness(
        &[
            "run",
            "--report",
            report,
            "--junit",
            junit.to_str().unwrap(),
        ],
        paths,
    );
    (out, junit)
}

fn summary_json(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn run_writes_the_summary_and_junit() {
    let dir = tempfile::tempdir().unwrap();
    let (out, junit) = run_reporting(dir.path(), &[&root().join("suites/tiny-fp32.yaml")]);
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
    let summary = summary_json(dir.path());
    assert_eq!(summary["passed"], 1, "{summary}");
    let trial = &summary["trials"][0];
    assert_eq!(trial["name"], "cpu::tiny-fp32");
    let checks = trial["checks"].as_array().unwrap();
    assert_eq!(checks.len(), Check::ALL.len());
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
    let out = run_tiny(
        dir.path(),
        "tiny-budget",
        "devices: [cpu]\nmemory: {budget: 4096}\nchecks: {golden: false}",
        &[],
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
    let out = run_tiny(dir.path(), "tiny-over-budget", "devices: [cpu]\nmemory: {budget: 4096}\nchecks: {golden: false}\nexpect_fail: [peak_budget]", &[]);
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
fn a_suite_that_cannot_start_fails_its_trial_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let cpu = "devices: [cpu]\nchecks: {golden: false}";
    let synthetic = "data: {kind: synthetic, seed: 3, samples: 256}";
    let bad = [
        (
            "a-long-rows",
            (
                synthetic,
                "data: {kind: synthetic, seed: 3, samples: 256, min_len: 100}",
            ),
        ),
        ("b-no-samples", ("samples: 256", "samples: 0")),
        ("c-no-rows", ("batch_size: 4", "batch_size: 0")),
        (
            "d-no-weights",
            (
                "init: {kind: random, seed: 1, std: 0.1}",
                "init: {kind: hf_dir, path: nope}",
            ),
        ),
        (
            "e-no-tokens",
            (
                synthetic,
                "data: {kind: token_file, path: nope.bin, dtype: u16}",
            ),
        ),
    ];
    for (name, change) in bad {
        tiny_suite(dir.path(), name, cpu, &[change]);
    }
    tiny_suite(dir.path(), "f-fine", cpu, &[]);
    let (out, junit) = run_reporting(dir.path(), &[dir.path()]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(exit_codes::FAILED.into()), "{all}");
    assert!(all.contains("1 passed, 5 failed"), "{all}");
    let summary = summary_json(dir.path());
    let trials = summary["trials"].as_array().unwrap();
    assert_eq!(trials.len(), 6, "{summary}");
    for t in &trials[..5] {
        assert_eq!(t["passed"], false, "{t}");
        let verdict = t["verdict"].as_str().unwrap();
        assert!(verdict.starts_with("could not run: "), "{t}");
        assert!(all.contains(verdict), "{all}");
    }
    assert_eq!(trials[5]["name"], "cpu::f-fine");
    assert_eq!(trials[5]["passed"], true, "{}", trials[5]);
    let xml = std::fs::read_to_string(&junit).unwrap();
    assert_eq!(
        xml.matches("<failure message=\"could not run: ").count(),
        5,
        "{xml}"
    );
}

#[test]
fn failures_name_the_whole_trial_and_long_lists_are_cut_short() {
    let dir = tempfile::tempdir().unwrap();
    let faults = dir.path().join("faults");
    std::fs::create_dir(&faults).unwrap();
    tiny_suite(
        &faults,
        "over-budget",
        "devices: [cpu]\nmemory: {budget: 4096}\nchecks: {golden: false}\nexpect_fail: [no_leak]",
        &[],
    );
    let (out, junit) = run_reporting(dir.path(), &[dir.path()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(exit_codes::FAILED.into()),
        "{}",
        text(&out)
    );
    let summary = summary_json(dir.path());
    let failures = check_of(&summary["trials"][0], "peak_budget")["failures"]
        .as_array()
        .unwrap();
    let total = failures.len();
    assert!(total > 20, "{total}");
    assert_eq!(failures[0]["trial"], "cpu::faults::over-budget");
    let shown = "    peak_budget: cpu::faults::over-budget ";
    assert_eq!(stdout.matches(shown).count(), 10, "{stdout}");
    let more = format!("… and {} more peak_budget failures", total - 10);
    assert!(stdout.contains(&more), "{stdout}");
    let xml = std::fs::read_to_string(&junit).unwrap();
    assert_eq!(
        xml.matches("peak_budget: cpu::faults::over-budget ")
            .count(),
        10,
        "{xml}"
    );
    assert!(xml.contains(&more), "{xml}");
}

#[test]
fn repeated_runs_report_their_spread_and_a_tolerance() {
    let dir = tempfile::tempdir().unwrap();
    let suite = tiny_suite(
        dir.path(),
        "twice",
        "devices: [cpu]\nchecks: {golden: false}",
        &[],
    );
    let report = dir.path().to_str().unwrap();
    let out = harness(&["run", "--repeat", "2", "--report", report], &[&suite]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("cpu::twice (run 2)"), "{stdout}");
    assert!(
        stdout.contains("    repeated: 2 runs, 21 steps each: loss ±0e0 (relative 0e0), grad_norm ±0e0, peak ±0 B; recommended loss_continuity: bitwise"),
        "{stdout}"
    );
    let summary = summary_json(dir.path());
    let repeat = &summary["trials"][0]["repeat"];
    assert_eq!(
        (&repeat["runs"], &repeat["steps"]),
        (&2.into(), &21.into()),
        "{repeat}"
    );
    let once = harness(&["run", "--report", report], &[&suite]);
    assert!(once.status.success(), "{}", text(&once));
    assert!(summary_json(dir.path())["trials"][0]
        .get("repeat")
        .is_none());
    let zero = harness(&["run", "--repeat", "0"], &[&suite]);
    assert_eq!(zero.status.code(), Some(2), "{}", text(&zero));
    assert!(text(&zero).contains("--repeat"), "{}", text(&zero));
}

/// The outcome of the check named `name` in a trial of `summary.json`.
fn check_of<'a>(trial: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    trial["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == name)
        .unwrap_or_else(|| panic!("no {name} in {trial}"))
}

#[test]
fn checks_an_out_of_memory_left_without_steps_did_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let oom = "devices: [cpu]\nmemory: {capacity: 1000000}\nchecks: {golden: false}\nexpect_fail: [oom_free]";
    tiny_suite(dir.path(), "a-unexpected", oom, &[]);
    let expected = format!("{oom}\nexpect_not_run: [loss_continuity, state_digest, data_ledger, memory_reclaimed, memory_parity, no_leak, memory_model, finite, checkpoint_equivalence]");
    tiny_suite(dir.path(), "b-expected", &expected, &[]);
    let out = harness(
        &["run", "--report", dir.path().to_str().unwrap()],
        &[dir.path()],
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(exit_codes::FAILED.into()), "{all}");
    assert!(all.contains("1 passed, 1 failed"), "{all}");
    assert!(
        all.contains("not run: loss_continuity, state_digest, data_ledger, memory_reclaimed, memory_parity, no_leak, memory_model, finite, checkpoint_equivalence"),
        "{all}"
    );
    let summary = summary_json(dir.path());
    let trials = summary["trials"].as_array().unwrap();
    assert_eq!(trials[0]["passed"], false, "{}", trials[0]);
    assert_eq!(trials[1]["passed"], true, "{}", trials[1]);
    let continuity = &trials[0]["checks"][0];
    assert_eq!(continuity["status"], "not_run", "{continuity}");
    assert_eq!(continuity["compared"], 0, "{continuity}");
}

#[test]
fn the_step_an_allocation_was_refused_in_counts_against_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_tiny(dir.path(), "refused", "devices: [cpu]\nmemory: {capacity: 1000000, budget: 950000}\nchecks: {golden: false}\nexpect_fail: [peak_budget, oom_free]\nexpect_not_run: [loss_continuity, state_digest, data_ledger, memory_reclaimed, memory_parity, no_leak, memory_model, finite, checkpoint_equivalence]", &[]);
    assert!(out.status.success(), "{}", text(&out));
    let summary = summary_json(dir.path());
    let budget = check_of(&summary["trials"][0], "peak_budget");
    assert_eq!(budget["check"], "peak_budget", "{budget}");
    let f = &budget["failures"][0];
    assert_eq!(f["what"], "peak when an allocation was refused", "{f}");
    assert_eq!(
        (&f["phase"], &f["step"]),
        (&"reference".into(), &1.into()),
        "{f}"
    );
    assert_eq!(f["expected"], "at most 927.7 KiB (950000 bytes)", "{f}");
}

#[test]
fn a_run_that_diverges_fails_finite_at_its_first_non_finite_step() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_tiny(
        dir.path(),
        "diverges",
        "devices: [cpu]\nchecks: {golden: false}",
        &[("optimizer: {lr: 0.003,", "optimizer: {lr: 1.0e6,")],
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(exit_codes::FAILED.into()), "{all}");
    assert!(
        all.contains(
            "finite: cpu::diverges reference step 1: grad_norm: expected a finite number, got NaN"
        ),
        "{all}"
    );
}

#[test]
fn a_name_that_leaves_golden_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let suites = dir.path().join("suites");
    std::fs::create_dir(&suites).unwrap();
    tiny_suite(
        &suites,
        "escape",
        "devices: [cpu]",
        &[("name: escape", "name: ../../escaped")],
    );
    let golden = dir.path().join("golden");
    let report = dir.path().join("report");
    let out = harness(
        &[
            "run",
            "--bless",
            "--golden",
            golden.to_str().unwrap(),
            "--report",
            report.to_str().unwrap(),
        ],
        &[&suites],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(exit_codes::INVALID.into()),
        "{}",
        text(&out)
    );
    assert!(stderr.contains("escape.yaml:2:7: name"), "{stderr}");
    assert!(!dir.path().join("escaped.snap").exists());
    assert!(!golden.exists());
}

#[test]
fn two_suites_of_one_name_are_refused_naming_both_files() {
    let dir = tempfile::tempdir().unwrap();
    let first = tiny_suite(
        dir.path(),
        "a",
        "devices: [cpu]",
        &[("name: a", "name: twin")],
    );
    let second = tiny_suite(
        dir.path(),
        "b",
        "devices: [cpu]",
        &[("name: b", "name: twin")],
    );
    for cmd in ["run", "validate", "list"] {
        let out = harness(&[cmd], &[dir.path()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(exit_codes::INVALID.into()),
            "{cmd}: {stderr}"
        );
        assert!(
            stderr.contains(&format!("{}:2:7: name twin", second.display())),
            "{cmd}: {stderr}"
        );
        assert!(
            stderr.contains(&format!("{}:2:7", first.display())),
            "{cmd}: {stderr}"
        );
    }
    let out = harness(&["validate"], &[&first, dir.path(), &first]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.matches("ok ").count(),
        2,
        "a file named twice is one suite: {stdout}"
    );
}

#[test]
fn the_summary_names_each_trial_s_suite_file() {
    let dir = tempfile::tempdir().unwrap();
    let suite = root().join("suites/tiny-fp32.yaml");
    let out = harness(
        &["run", "--report", dir.path().to_str().unwrap()],
        &[&suite],
    );
    assert!(out.status.success(), "{}", text(&out));
    let summary = summary_json(dir.path());
    assert_eq!(
        summary["trials"][0]["path"],
        suite.to_str().unwrap(),
        "{summary}"
    );
}

#[test]
fn a_suite_file_named_runs_whatever_its_tier() {
    let dir = tempfile::tempdir().unwrap();
    let suite = tiny_suite(
        dir.path(),
        "late",
        "tier: nightly\ndevices: [cpu]\nchecks: {golden: false}",
        &[],
    );
    let report = dir.path().join("report");
    let report = report.to_str().unwrap();
    let out = harness(&["run", "--report", report], &[&suite]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("1 passed, 0 failed, 0 skipped"),
        "{}",
        text(&out)
    );
    let out = harness(&["run", "--report", report], &[dir.path()]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("0 passed, 0 failed, 1 skipped"),
        "{}",
        text(&out)
    );
}

#[test]
fn no_suites_found_is_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    for cmd in ["run", "list", "validate"] {
        let out = harness(&[cmd], &[dir.path()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(exit_codes::INVALID.into()),
            "{cmd}: {}",
            text(&out)
        );
        assert!(stderr.contains("no suite files"), "{cmd}: {stderr}");
    }
}

#[test]
fn the_golden_directory_is_found_from_the_suite_not_the_working_directory() {
    let elsewhere = tempfile::tempdir().unwrap();
    let report = elsewhere.path().join("report");
    let out = Command::new(BIN)
        .args([
            "run",
            "--device",
            "cpu",
            "--report",
            report.to_str().unwrap(),
        ])
        .arg(root().join("suites/tiny-fp32.yaml"))
        .current_dir(elsewhere.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let summary = summary_json(&report);
    let golden = check_of(&summary["trials"][0], "golden");
    assert_eq!(golden["status"], "passed", "{golden}");

    let project = tempfile::tempdir().unwrap();
    let faults = project.path().join("suites/faults");
    std::fs::create_dir_all(&faults).unwrap();
    tiny_suite(&faults, "fresh", "devices: [cpu]", &[]);
    let out = Command::new(BIN)
        .args([
            "run",
            "--bless",
            "--report",
            report.to_str().unwrap(),
            "suites",
        ])
        .current_dir(project.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(project.path().join("golden/cpu/fresh.snap").is_file());
}

#[test]
fn a_keep_last_that_would_prune_a_resume_point_is_refused_by_run_not_by_train() {
    let dir = tempfile::tempdir().unwrap();
    let suite = tiny_suite(
        dir.path(),
        "pruned",
        "devices: [cpu]",
        &[(
            "extra_steps: 3}",
            "extra_steps: 3, save_every: 2, keep_last: 3}",
        )],
    );
    for cmd in ["run", "validate"] {
        let out = harness(&[cmd], &[&suite]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(exit_codes::INVALID.into()),
            "{cmd}: {stderr}"
        );
        assert!(stderr.contains("keep_last: 4 or more"), "{cmd}: {stderr}");
    }
    let run = dir.path().join("run");
    let out = harness(&["train", "--out", run.to_str().unwrap()], &[&suite]);
    assert!(out.status.success(), "{}", text(&out));
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
    let latest = std::fs::read_to_string(run.join("latest")).unwrap();
    for name in ["config.json", "model.safetensors", "optimizer.safetensors"] {
        let bytes = std::fs::read(run.join(latest.trim()).join(name)).unwrap();
        let sha256 = ckpt_engine::checkpoint::files::sha256_hex(&bytes);
        assert!(
            stdout.lines().any(|l| l.trim_start().starts_with("ok")
                && l.contains(name)
                && l.ends_with(&format!("sha256 {sha256}"))),
            "{stdout}"
        );
    }
    assert!(
        stdout.contains("1 intact, 0 damaged, 0 unreadable"),
        "{stdout}"
    );

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
            && l.contains("XXH3-128")),
        "{stdout}"
    );
    assert!(stdout.contains("0 intact, 1 damaged"), "{stdout}");

    let out = harness(&["verify"], &[dir.path()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

/// Runs the tool with `args`, reads `lines` lines of its output, then closes it. The tool starts
/// only once its standard input closes, so that with `lines` 0 no write can come before the close.
fn closing_stdout_after(args: &[&str], lines: usize) -> Output {
    let mut child = Command::new("sh")
        .args(["-c", "read _; exec \"$0\" \"$@\"", BIN])
        .args(args)
        .current_dir(root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let gate = child.stdin.take().unwrap();
    let reader = BufReader::new(child.stdout.take().unwrap());
    if lines == 0 {
        drop(reader);
        drop(gate);
    } else {
        drop(gate);
        for line in reader.lines().take(lines) {
            line.unwrap();
        }
    }
    child.wait_with_output().unwrap()
}

#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let suite = tiny_suite(dir.path(), "t", "", &[("max_steps: 8", "max_steps: 2")]);
    let run = dir.path().join("run");
    let trained = harness(&["train", "--out"], &[&run, &suite]);
    assert!(trained.status.success(), "{}", text(&trained));
    let (report, run) = (dir.path().to_str().unwrap(), run.to_str().unwrap());
    let runs: [(&[&str], usize); 4] = [
        (&["run", "--report", report, "suites/"], 1),
        (&["list", "suites/"], 0),
        (&["validate", "suites/"], 0),
        (&["verify", run], 0),
    ];
    for (args, lines) in runs {
        let out = closing_stdout_after(args, lines);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(exit_codes::BROKEN_PIPE.into()),
            "{args:?}: {stderr}"
        );
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
    }
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

/// `validate` refuses what a trainer would refuse at start, without training: every impossible
/// value by its key and place, and data and weights that are missing.
#[test]
fn validate_refuses_what_the_run_would_refuse_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let synthetic = "data: {kind: synthetic, seed: 3, samples: 256}";
    let optimizer = "optimizer: {lr: 0.003, betas: [0.9, 0.95], weight_decay: 0.1, grad_clip: 1.0}";
    let cases = [
        (
            (
                synthetic,
                "data: {kind: synthetic, seed: 3, samples: 256, min_len: 100}",
            ),
            ":14:48: invalid configuration: data.min_len is 100",
        ),
        (
            ("samples: 256", "samples: 0"),
            ":14:34: invalid configuration: data.samples",
        ),
        (
            ("batch_size: 4", "batch_size: 0"),
            ":15:1: invalid configuration: batch_size is 0",
        ),
        (
            (
                "init: {kind: random, seed: 1, std: 0.1}",
                "init: {kind: hf_dir, path: nope}",
            ),
            ":12:22: invalid configuration: init.path: ",
        ),
        (
            (
                synthetic,
                "data: {kind: token_file, path: nope.bin, dtype: u16}",
            ),
            ":14:26: invalid configuration: data.path: ",
        ),
        (
            ("lr: 0.003", "lr: -0.003"),
            ":17:13: invalid configuration: optimizer.lr is -0.003",
        ),
        (
            ("lr: 0.003", "lr: .nan"),
            ":17:13: invalid configuration: optimizer.lr is NaN",
        ),
        (
            ("betas: [0.9, 0.95]", "betas: [1.5, 2]"),
            ":17:24: invalid configuration: optimizer.betas[0] is 1.5",
        ),
        (
            ("grad_clip: 1.0", "grad_clip: -1.0"),
            ":17:63: invalid configuration: optimizer.grad_clip is -1",
        ),
        (
            ("min_lr_ratio: 0.1", "min_lr_ratio: -0.5"),
            ":18:29: invalid configuration: schedule.min_lr_ratio is -0.5",
        ),
        (
            (
                "batch_size: 4",
                "batch_size: 4\nloss: {kind: chunked, chunk_tokens: 0}",
            ),
            ":16:23: invalid configuration: loss.chunk_tokens is 0",
        ),
        (
            (
                "num_key_value_heads: 4",
                "num_key_value_heads: 4\n  head_dim: 0",
            ),
            ":11:3: model: head_dim is 0",
        ),
    ];
    assert!(
        std::fs::read_to_string(root().join("suites/tiny-fp32.yaml"))
            .unwrap()
            .contains(optimizer)
    );
    for (i, (change, want)) in cases.into_iter().enumerate() {
        let name = format!("bad{i}");
        let suite = tiny_suite(dir.path(), &name, "", &[change]);
        let out = harness(&["validate"], &[&suite]);
        let all = text(&out);
        assert_eq!(out.status.code(), Some(exit_codes::INVALID.into()), "{all}");
        assert!(all.contains(&format!("{name}.yaml{want}")), "{want}: {all}");
    }
}

/// A run too large for the machine ends in a failed trial saying what could not be allocated,
/// with the reports written: never an abort.
#[test]
fn sizes_too_large_for_the_host_are_refused_not_aborted() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "huge-batch",
            ("batch_size: 4", "batch_size: 100000000"),
            "cannot allocate",
        ),
        (
            "huge-samples",
            ("samples: 256", "samples: 1000000000000000"),
            "cannot allocate",
        ),
    ];
    for (name, change, want) in cases {
        let out = run_tiny(dir.path(), name, "devices: [cpu]", &[change]);
        let all = text(&out);
        assert_eq!(out.status.code(), Some(exit_codes::FAILED.into()), "{all}");
        assert!(all.contains(want), "{name}: {all}");
        assert_eq!(summary_json(dir.path())["failed"], 1, "{name}");
    }
}

/// A model whose weights alone, or whose engine tables alone, exceed the host's memory is
/// refused when the suite is read, at the key to change, by `validate` and `run` alike: not
/// validated, then killed or aborted once it runs.
#[test]
fn models_too_large_for_the_host_are_refused_at_validation() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("huge-vocab", ("vocab_size: 64", "vocab_size: 10000000000"), "vocab_size", "vocab_size is 10000000000 and hidden_size 32: its weights alone take at least"),
        ("huge-hidden", ("hidden_size: 32", "hidden_size: 3200000000"), "hidden_size", "hidden_size is 3200000000 and num_hidden_layers 2: its weights alone take at least"),
        ("huge-layers", ("num_hidden_layers: 2", "num_hidden_layers: 100000000"), "num_hidden_layers", "num_hidden_layers is 100000000: the engine's tables of its tensors alone take at least 23.8 GiB"),
    ];
    for (name, change, key, want) in cases {
        let suite = tiny_suite(dir.path(), name, "devices: [cpu]", &[change]);
        let written = std::fs::read_to_string(&suite).unwrap();
        let line = written
            .lines()
            .position(|l| l.trim_start().starts_with(key))
            .unwrap()
            + 1;
        let at = format!("{}:{line}:", suite.display());
        for command in ["validate", "run"] {
            let out = harness(&[command], &[&suite]);
            let all = text(&out);
            assert_eq!(
                out.status.code(),
                Some(exit_codes::INVALID.into()),
                "{name}: {all}"
            );
            assert!(
                all.contains(&at) && all.contains(want),
                "{name}: wanted {at} and {want:?} in {all}"
            );
        }
    }
}

/// `estimate` of a suite predicts the run as configured (its checkpointing, loss and long rows)
/// and says whether its budget holds, exiting 1 when it does not.
#[test]
fn estimate_of_a_suite_checks_its_budget() {
    let est = |suite: &str| harness(&["estimate", "--bytes"], &[&root().join(suite)]);
    let out = est("suites/faults/long_batch_spike.yaml");
    let all = text(&out);
    assert_eq!(out.status.code(), Some(exit_codes::FAILED.into()), "{all}");
    assert!(all.contains("| baseline = as configured"), "{all}");
    assert!(all.contains("**step peak, long rows**"), "{all}");
    assert!(
        all.contains("budget 1.3 MiB (1400000 bytes) on cpu: EXCEEDED by 353.3 KiB (361792 bytes) at reference step 8"),
        "{all}"
    );
    for rung in [
        "- checkpointing: full: highest peak 1255936 B, fits",
        "- checkpointing: selective: highest peak 1536512 B, does not fit",
        "The cheapest change that fits: batch_size: 2, training.accumulation: 2",
    ] {
        assert!(all.contains(rung), "the fix ladder: {rung}: {all}");
    }
    let out = est("suites/long-rows-checkpointed.yaml");
    let all = text(&out);
    assert_eq!(out.status.code(), Some(exit_codes::SUCCESS.into()), "{all}");
    assert!(
        all.contains("+checkpointing (full) = as configured"),
        "{all}"
    );
    assert!(all.contains("on cpu: holds"), "{all}");
}

/// `estimate` of a suite on real data plans every step of every phase: each phase's line names
/// the step that sets its peak, a step holding the data's longest micro-batch (as `batches`
/// draws them), with its samples; `--json` has every step of every phase and each rank's peak.
#[test]
fn estimate_of_real_data_names_the_step_of_the_longest_batch() {
    let suite = root().join("suites/sft-chat.yaml");
    let out = harness(&["estimate"], &[&suite]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(exit_codes::SUCCESS.into()), "{all}");
    let drawn = harness(&["batches", "--json"], &[&suite]);
    let steps: Vec<serde_json::Value> = String::from_utf8_lossy(&drawn.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let longest = |step: &serde_json::Value| -> u64 {
        (step["micro_batches"].as_array().unwrap().iter())
            .map(|m| m["shape"][1].as_u64().unwrap())
            .max()
            .unwrap()
    };
    let most = steps.iter().map(longest).max().unwrap();
    assert!(steps.iter().any(|s| longest(s) < most), "shapes vary");
    let line = all.lines().find(|l| l.starts_with("- reference")).unwrap();
    let named: usize = line["- reference (steps 0..21, 1 rank): step ".len()..]
        .split(',')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(longest(&steps[named]), most, "{line}");
    let first = &steps[named]["micro_batches"][0]["rows"][0];
    let sample = format!(
        "micro-batch 0 [2 × {}]: samples {} ({} tokens)",
        steps[named]["micro_batches"][0]["shape"][1], first["index"], first["length"]
    );
    assert!(all.contains(&sample), "{sample}: {all}");

    let out = harness(&["estimate", "--json"], &[&suite]);
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let phases = plan["phases"].as_array().unwrap();
    let trained: Vec<(u64, u64, usize)> = (phases.iter())
        .map(|p| {
            let steps = p["steps"].as_array().unwrap();
            let ranks = steps[0]["ranks"].as_array().unwrap().len();
            assert!(steps
                .iter()
                .all(|s| s["ranks"][0]["peak"].as_u64().unwrap() > 0));
            (p["from"].as_u64().unwrap(), steps.len() as u64, ranks)
        })
        .collect();
    assert_eq!(trained, [(0, 21, 1), (6, 15, 3), (12, 9, 1), (18, 3, 3)]);
    assert_eq!(plan["highest"]["at"], format!("reference step {named}"));

    let out = harness(&["estimate", "--json", "--world-size", "3"], &[&suite]);
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let phases = plan["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 4);
    for p in phases {
        let step = &p["steps"][0];
        assert_eq!(step["ranks"].as_array().unwrap().len(), 3, "{step}");
    }
}

/// The nightly GPU suites are sized for one 80 GB card: by the memory model, each one's budget,
/// a fraction of the card, holds on 80 GB; the largest would not hold on 40 GB; without a
/// capacity the fraction is not checked.
#[test]
fn the_nightly_gpu_suites_fit_one_80_gb_card() {
    let est = |suite: &str, capacity: &[&str]| {
        let mut args = vec!["estimate", "--device", "cuda"];
        args.extend(capacity);
        harness(&args, &[&root().join(format!("suites/{suite}.yaml"))])
    };
    for suite in [
        "llama-1b-cuda",
        "tied-1b-cuda",
        "long-seq-8k-cuda",
        "long-batch-cuda",
    ] {
        let out = est(suite, &["--capacity", "80000000000"]);
        let all = text(&out);
        assert_eq!(out.status.code(), Some(exit_codes::SUCCESS.into()), "{all}");
        assert!(all.contains("on cuda: holds"), "{suite}: {all}");
    }
    let out = est("llama-1b-cuda", &["--capacity", "40000000000"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(exit_codes::FAILED.into()), "{all}");
    assert!(all.contains("on cuda: EXCEEDED"), "{all}");
    let out = est("llama-1b-cuda", &[]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(exit_codes::SUCCESS.into()), "{all}");
    assert!(
        all.contains("not checked (--capacity BYTES names it)"),
        "{all}"
    );
}

/// `train` runs on the device it is given, and a device that is not here is a clear error.
#[test]
fn train_takes_a_device() {
    let dir = tempfile::tempdir().unwrap();
    let suite = tiny_suite(dir.path(), "t", "", &[("max_steps: 8", "max_steps: 2")]);
    let run = dir.path().join("run");
    let out = harness(&["train", "--device", "cpu", "--out"], &[&run, &suite]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 2);
    if ckpt_engine::backend::probe(ckpt_engine::DeviceKind::Cuda).is_err() {
        let out = harness(
            &["train", "--device", "cuda", "--out"],
            &[&dir.path().join("gpu"), &suite],
        );
        assert_eq!(
            out.status.code(),
            Some(exit_codes::INVALID.into()),
            "{}",
            text(&out)
        );
        assert!(text(&out).contains("no GPU"), "{}", text(&out));
    }
}

#[test]
fn a_run_names_the_place_of_an_impossible_value() {
    let dir = tempfile::tempdir().unwrap();
    let suite = tiny_suite(
        dir.path(),
        "nan-lr",
        "devices: [cpu]\nchecks: {golden: false}",
        &[("lr: 0.003", "lr: .nan")],
    );
    let (out, _) = run_reporting(dir.path(), &[&suite]);
    assert_eq!(
        out.status.code(),
        Some(exit_codes::FAILED.into()),
        "{}",
        text(&out)
    );
    let summary = summary_json(dir.path());
    let verdict = summary["trials"][0]["verdict"].as_str().unwrap();
    let text = std::fs::read_to_string(&suite).unwrap();
    let line = 1 + text.lines().position(|l| l.contains("lr: .nan")).unwrap();
    let place = format!("{}:{line}:", suite.display());
    assert!(
        verdict.contains(&place) && verdict.contains("optimizer.lr is NaN"),
        "{place}: {verdict}"
    );
}

/// A suite file that is not UTF-8 is refused at its first invalid byte's line and column.
#[test]
fn invalid_utf8_in_a_suite_is_placed() {
    let dir = tempfile::tempdir().unwrap();
    let suite = tiny_suite(dir.path(), "latin1", "", &[]);
    let mut bytes = std::fs::read(&suite).unwrap();
    let written = String::from_utf8(bytes.clone()).unwrap();
    let line = written
        .lines()
        .position(|l| l.starts_with("seq_len"))
        .unwrap()
        + 1;
    let at = written.find("seq_len").unwrap() + "seq_".len();
    bytes[at] = 0xe9;
    std::fs::write(&suite, bytes).unwrap();
    for command in ["validate", "run"] {
        let out = harness(&[command], &[&suite]);
        let all = text(&out);
        assert_eq!(out.status.code(), Some(exit_codes::INVALID.into()), "{all}");
        let want = format!(
            "{}:{line}:5: byte 0xe9 (offset {at}) is not UTF-8",
            suite.display()
        );
        assert!(all.contains(&want), "wanted {want:?} in {all}");
    }
}

/// The CPU device's capacity, without `memory.capacity`, is what the process may still allocate:
/// under an address-space limit (`ulimit -v`) the limit bounds it, not the machine's memory.
#[test]
fn the_host_s_capacity_honours_the_address_space_limit() {
    let dir = tempfile::tempdir().unwrap();
    let extra = "devices: [cpu]\nchecks: {golden: false}";
    let suite = tiny_suite(dir.path(), "limited", extra, &[]);
    let limit_kib: u64 = 3 << 20;
    let script = format!("ulimit -v {limit_kib} && exec \"$0\" \"$@\"");
    let out = Command::new("sh")
        .args(["-c", &script, BIN, "run", "--report"])
        .arg(dir.path())
        .arg(&suite)
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let capacity = summary_json(dir.path())["trials"][0]["record"]["capacity"]
        .as_u64()
        .unwrap();
    assert!(capacity > 0, "{capacity}");
    assert!(
        capacity < limit_kib * 1024,
        "{capacity} under a {limit_kib} KiB limit"
    );
}

/// `estimate` refuses sizes the memory model cannot build or count with exit status 2, naming
/// the flag and its limit (a table of 10^8 blocks used to abort the process when its
/// allocation failed), and takes sizes at the limits.
#[test]
fn estimate_refuses_sizes_beyond_its_limits_naming_the_flag() {
    let est = |flags: &[&str]| {
        let mut args = vec!["estimate"];
        args.extend(flags);
        harness(&args, &[])
    };
    for (flags, want) in [
        (
            &["--llama-1b", "--layers", "100000000"][..],
            "--layers is 100000000, more than 100000, the most decoder blocks",
        ),
        (
            &["--llama-1b", "--hidden", "4000000000"][..],
            "--hidden is 4000000000, more than 16777216, the widest",
        ),
        (
            &["--llama-1b", "--vocab", "4000000000000"][..],
            "--vocab is 4000000000000, more than 16777216",
        ),
        (
            &["--llama-1b", "--heads", "16777216"][..],
            "model.num_attention_heads × model.head_dim is 1073741824, more than 16777216",
        ),
    ] {
        let out = est(flags);
        let all = text(&out);
        assert_eq!(out.status.code(), Some(exit_codes::INVALID.into()), "{all}");
        assert!(all.contains(want), "{flags:?}: {all}");
        assert!(all.contains("write at most"), "{flags:?}: {all}");
    }
    let at_limits = [
        "--vocab", "16777216", "--hidden", "16777216", "--ffn", "16777216", "--heads", "1",
        "--layers", "2", "--batch", "1", "--seq", "2", "--bytes",
    ];
    let out = est(&at_limits);
    assert_eq!(
        out.status.code(),
        Some(exit_codes::SUCCESS.into()),
        "{}",
        text(&out)
    );
}

/// `train` on 4 ranks saves sharded checkpoints; `verify` finds them intact, `export` writes the
/// Hugging Face layout (refusing a directory that is not empty), and an index whose chunk is
/// moved off its rows is damage to `verify` (exit 1) and refused by `export` (exit 2).
#[test]
fn a_sharded_checkpoint_verifies_and_exports_and_a_moved_chunk_is_caught() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = root().join("suites/parallel-resharded.yaml");
    let run = tmp.path().join("run");
    let out = harness(&["train", suite.to_str().unwrap(), "--out"], &[&run]);
    assert!(out.status.success(), "{}", text(&out));
    let ckpt = run.join("step-00000006");
    assert!(ckpt.join("rank-00003-of-00004.safetensors").exists());

    let out = harness(&["verify"], &[&run]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("shards.json"), "{}", text(&out));
    let hf = tmp.path().join("hf");
    let out = harness(&["export", ckpt.to_str().unwrap(), "--out"], &[&hf]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(hf.join("model.safetensors").exists() && hf.join("config.json").exists());
    let out = harness(&["export", ckpt.to_str().unwrap(), "--out"], &[&hf]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("is not empty"), "{}", text(&out));

    // Move a chunk one row on, with the index's checksums made to match: only the index's own
    // checks can see it.
    let index_path = ckpt.join("shards.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    let offset = &mut index["model"][0]["chunks"][1]["offsets"][0];
    *offset = (offset.as_u64().unwrap() + 1).into();
    let bytes = serde_json::to_vec(&index).unwrap();
    std::fs::write(&index_path, &bytes).unwrap();
    let state_path = ckpt.join("trainer_state.json");
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state_path).unwrap()).unwrap();
    state["files"]["shards.json"] =
        serde_json::to_value(ckpt_engine::checkpoint::files::record(&bytes)).unwrap();
    let state_bytes = serde_json::to_vec(&state).unwrap();
    std::fs::write(&state_path, &state_bytes).unwrap();
    let sum = ckpt_engine::checkpoint::files::sha256_hex(&state_bytes);
    std::fs::write(
        ckpt.join("trainer_state.json.sha256"),
        format!("{sum}  trainer_state.json\n"),
    )
    .unwrap();
    let out = harness(&["verify"], &[&ckpt]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("does not continue its rows"),
        "{}",
        text(&out)
    );
    let out = harness(
        &["export", ckpt.to_str().unwrap(), "--out"],
        &[&tmp.path().join("hf2")],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

#[test]
fn bless_leaves_the_snapshot_of_a_control_of_golden_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let faults = dir.path().join("suites/faults");
    std::fs::create_dir_all(&faults).unwrap();
    let control = faults.join("golden_snapshot_differs.yaml");
    std::fs::copy(
        root().join("suites/faults/golden_snapshot_differs.yaml"),
        &control,
    )
    .unwrap();
    let golden = dir.path().join("golden");
    std::fs::create_dir_all(golden.join("cpu")).unwrap();
    let snap = golden.join("cpu/golden_snapshot_differs.snap");
    let made = root().join("golden/cpu/golden_snapshot_differs.snap");
    std::fs::copy(&made, &snap).unwrap();
    let report = dir.path().join("report");
    let out = harness(
        &[
            "run",
            "--device",
            "cpu",
            "--bless",
            "--golden",
            golden.to_str().unwrap(),
            "--report",
            report.to_str().unwrap(),
        ],
        &[&control],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        std::fs::read(&snap).unwrap(),
        std::fs::read(&made).unwrap(),
        "--bless rewrote the control's snapshot"
    );
}

/// Every file under `dir` but its lock (which names the process holding it), by path.
fn files_under(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut files = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            for (inner, bytes) in files_under(&path) {
                files.insert(format!("{name}/{inner}"), bytes);
            }
        } else if name != ckpt_engine::checkpoint::LOCK_FILE {
            files.insert(name, std::fs::read(&path).unwrap());
        }
    }
    files
}

/// `train` of `suite` into `out` with `args`, started once per rank of `world` with `--rank`
/// and a `--meet-file` in a directory of its own; each rank's output, in rank order.
fn train_as_ranks(suite: &Path, out: &Path, args: &[&str], world: usize) -> Vec<Output> {
    let meeting = tempfile::tempdir().unwrap();
    let meet = meeting.path().join("meet");
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(BIN)
                .arg("train")
                .arg(suite)
                .arg("--out")
                .arg(out)
                .args(args)
                .args(["--rank", &rank.to_string(), "--meet-file"])
                .arg(&meet)
                .current_dir(root())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    ranks
        .into_iter()
        .map(|r| r.wait_with_output().unwrap())
        .collect()
}

#[test]
fn ranks_started_as_trains_of_their_own_train_save_and_resume_as_one_train() {
    let tmp = tempfile::tempdir().unwrap();
    let at_four = root().join("suites/parallel-resharded.yaml");
    let text4 = std::fs::read_to_string(&at_four).unwrap();
    let at_three = tmp.path().join("parallel-resharded-at-3.yaml");
    let text3 = text4.replace("parallel: {world_size: 4,", "parallel: {world_size: 3,");
    assert_ne!(text3, text4);
    std::fs::write(&at_three, text3).unwrap();
    let (one, ranks) = (tmp.path().join("one"), tmp.path().join("ranks"));
    // Three steps at 4 ranks, then resumed at 3 ranks to step 5 (noted by the leading process
    // alone), and at 3 again to step 6 (nothing to note).
    let notes_world = |out: &Output| {
        let said = text(out).contains("was saved sharded by");
        assert!(!said || text(out).contains("was saved sharded by 4 ranks; resuming on 3 ranks: every tensor's rows are cut anew for them and checked against its whole hash"), "{}", text(out));
        said
    };
    for (suite, steps, world, notes) in [
        (&at_four, "3", 4, false),
        (&at_three, "5", 3, true),
        (&at_three, "6", 3, false),
    ] {
        let args = |dir: &Path| {
            let mut args = vec!["--steps".to_owned(), steps.to_owned()];
            if world == 3 {
                args.extend(["--resume".to_owned(), dir.to_str().unwrap().to_owned()]);
            }
            args
        };
        let alone = args(&one);
        let alone: Vec<&str> = alone.iter().map(String::as_str).collect();
        let out = harness(
            &[&["train", suite.to_str().unwrap()][..], &alone, &["--out"]].concat(),
            &[&one],
        );
        assert!(out.status.success(), "one train: {}", text(&out));
        assert_eq!(notes_world(&out), notes, "one train: {}", text(&out));
        let as_ranks = args(&ranks);
        let as_ranks: Vec<&str> = as_ranks.iter().map(String::as_str).collect();
        let outs = train_as_ranks(suite, &ranks, &as_ranks, world);
        for (rank, o) in outs.iter().enumerate() {
            assert!(o.status.success(), "rank {rank}: {}", text(o));
            let leads = rank == 0;
            assert_eq!(notes_world(o), notes && leads, "rank {rank}: {}", text(o));
        }
        assert_eq!(
            String::from_utf8_lossy(&outs[0].stdout),
            String::from_utf8_lossy(&out.stdout),
            "rank 0 prints the steps of one train"
        );
        assert!(outs[1..].iter().all(|o| o.stdout.is_empty()));
        let (theirs, ours) = (files_under(&ranks), files_under(&one));
        assert_eq!(
            theirs.keys().collect::<Vec<_>>(),
            ours.keys().collect::<Vec<_>>()
        );
        for (file, bytes) in &theirs {
            assert!(bytes == &ours[file], "{file} differs");
        }
    }
}

#[test]
fn bf16_dot_products_are_asked_for_by_name_refused_where_missing_and_named_in_the_golden_note() {
    let suite = root().join("suites/tiny-fp32.yaml");
    let run_with = |value: &str| {
        let report = tempfile::tempdir().unwrap();
        let out = Command::new(BIN)
            .args(["run", "--device", "cpu", "--report"])
            .arg(report.path())
            .arg(&suite)
            .current_dir(root())
            .env("CKPT_CPU_BF16_PRODUCTS", value)
            .output()
            .unwrap();
        (out, report)
    };
    let (bogus, _) = run_with("bogus");
    assert_eq!(bogus.status.code(), Some(1), "{}", text(&bogus));
    assert!(
        text(&bogus).contains(
            "CKPT_CPU_BF16_PRODUCTS is `bogus`; set it to `widened` (the default) or `dot`"
        ),
        "{}",
        text(&bogus)
    );
    let (dot, report) = run_with("dot");
    if ckpt_engine::backend::cpu::bf16_dot::available() {
        assert!(dot.status.success(), "{}", text(&dot));
        let summary = summary_json(report.path());
        let golden = check_of(&summary["trials"][0], "golden");
        assert!(
            golden
                .to_string()
                .contains("this run has x86_64 avx512f avx512_bf16: its losses were not compared"),
            "{golden}"
        );
    } else {
        assert_eq!(dot.status.code(), Some(1), "{}", text(&dot));
        assert!(
            text(&dot).contains("CKPT_CPU_BF16_PRODUCTS=dot needs a CPU with AVX-512 BF16"),
            "{}",
            text(&dot)
        );
    }
}

/// `batches --json`'s lines for `suite` with `args`.
fn batches(suite: &str, args: &[&str]) -> Vec<serde_json::Value> {
    let out = harness(&[&["batches", suite], args].concat(), &[]);
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn batches_shows_what_every_evaluation_reads() {
    let suite = ckpt_harness::run::plan::load_one(&root().join("suites/sft-chat.yaml")).unwrap();
    let shown = batches("suites/sft-chat.yaml", &["--json", "--validation"]);
    assert_eq!(shown.len(), 1);
    assert_eq!(shown[0]["evaluation"], true);
    let dev = ckpt_engine::CpuDevice::new(2, u64::MAX).unwrap();
    let evaluated = (ckpt_engine::Trainer::new(suite.train.clone(), dev).unwrap())
        .evaluate()
        .unwrap();
    let micro_batches = shown[0]["micro_batches"].as_array().unwrap();
    let shapes: Vec<(usize, usize)> = (micro_batches.iter())
        .map(|m| {
            let shape = |i: usize| m["shape"][i].as_u64().unwrap() as usize;
            (shape(0), shape(1))
        })
        .collect();
    assert_eq!(shapes, evaluated.shapes);
    let rows: Vec<(u64, u64)> = (micro_batches.iter())
        .flat_map(|m| m["rows"].as_array().unwrap().iter())
        .map(|r| (r["epoch"].as_u64().unwrap(), r["index"].as_u64().unwrap()))
        .collect();
    let want: Vec<(u64, u64)> = (evaluated.samples.iter())
        .map(|s| (s.epoch, s.index))
        .collect();
    assert_eq!(rows, want);
    assert_eq!(rows.len(), 24, "the whole validation file, in order");
    let refused = harness(&["batches", "suites/tiny-fp32.yaml", "--validation"], &[]);
    assert!(!refused.status.success());
    assert!(
        text(&refused)
            .contains("tiny-fp32.yaml: the suite has no validation split; write validation:"),
        "{}",
        text(&refused)
    );
}

#[test]
fn batches_shows_every_sample_of_a_packed_row_where_it_begins() {
    let suite = ckpt_harness::run::plan::load_one(&root().join("suites/sft-packed.yaml")).unwrap();
    let steps = batches("suites/sft-packed.yaml", &["--json", "--tokens"]);
    let dev = ckpt_engine::CpuDevice::new(2, u64::MAX).unwrap();
    let mut trainer = ckpt_engine::Trainer::new(suite.train.clone(), dev).unwrap();
    for (step, shown) in steps.iter().enumerate().take(4) {
        let trained = trainer.step().unwrap();
        let micro_batches = shown["micro_batches"].as_array().unwrap();
        let rows: Vec<&serde_json::Value> = (micro_batches.iter())
            .flat_map(|m| m["rows"].as_array().unwrap().iter())
            .collect();
        let ids: Vec<(u64, u64)> = (rows.iter())
            .map(|r| (r["epoch"].as_u64().unwrap(), r["index"].as_u64().unwrap()))
            .collect();
        let want: Vec<(u64, u64)> = trained.samples.iter().map(|s| (s.epoch, s.index)).collect();
        assert_eq!(ids, want, "step {step}: samples");
        assert!(rows.len() > 6, "step {step}: several samples a row");
        // Within a row the samples follow one another from token 0, each as long as its ids.
        let mut next = (u64::MAX, 0);
        for r in &rows {
            let (row, offset) = (r["row"].as_u64().unwrap(), r["offset"].as_u64().unwrap());
            let length = r["length"].as_u64().unwrap();
            assert_eq!(r["input_ids"].as_array().unwrap().len() as u64, length);
            match row == next.0 {
                true => assert_eq!(offset, next.1, "step {step}: row {row}"),
                false => assert_eq!(offset, 0, "step {step}: row {row} begins"),
            }
            assert!(offset + length <= 512);
            next = (row, offset + length);
        }
    }
    let shown = harness(
        &[
            "batches",
            "suites/sft-packed.yaml",
            "--step",
            "0",
            "--tokens",
        ],
        &[],
    );
    let shown = text(&shown);
    assert!(shown.contains("  row 0 at 0: sample "), "{shown}");
    assert!(
        shown
            .lines()
            .filter(|l| l.starts_with("  row 0 at "))
            .count()
            > 3,
        "{shown}"
    );
}

#[test]
fn batches_shows_the_samples_and_shapes_the_trainer_trains_on() {
    let suite = ckpt_harness::run::plan::load_one(&root().join("suites/sft-chat.yaml")).unwrap();
    let steps = batches("suites/sft-chat.yaml", &["--json"]);
    assert_eq!(steps.len(), 21, "every step of the run");
    let dev = ckpt_engine::CpuDevice::new(2, u64::MAX).unwrap();
    let mut trainer = ckpt_engine::Trainer::new(suite.train.clone(), dev).unwrap();
    for (step, shown) in steps.iter().enumerate().take(13) {
        let trained = trainer.step().unwrap();
        assert_eq!(shown["step"], step);
        let micro_batches = shown["micro_batches"].as_array().unwrap();
        let seq_lens: Vec<u64> = (micro_batches.iter())
            .map(|m| m["shape"][1].as_u64().unwrap())
            .collect();
        let want: Vec<u64> = trained.seq_lens.iter().map(|&l| l as u64).collect();
        assert_eq!(seq_lens, want, "step {step}: shapes");
        let rows: Vec<(u64, u64)> = (micro_batches.iter())
            .flat_map(|m| m["rows"].as_array().unwrap().iter())
            .map(|r| (r["epoch"].as_u64().unwrap(), r["index"].as_u64().unwrap()))
            .collect();
        let want: Vec<(u64, u64)> = trained.samples.iter().map(|s| (s.epoch, s.index)).collect();
        assert_eq!(rows, want, "step {step}: samples");
        for m in micro_batches {
            let longest = (m["rows"].as_array().unwrap().iter())
                .map(|r| r["length"].as_u64().unwrap())
                .max();
            assert_eq!(longest, m["shape"][1].as_u64(), "padded to the longest row");
        }
    }
    let one = batches(
        "suites/sft-chat.yaml",
        &["--json", "--step", "12", "--tokens"],
    );
    assert_eq!(one.len(), 1);
    assert_eq!(one[0]["step"], 12);
    let row = &one[0]["micro_batches"][0]["rows"][0];
    assert_eq!(row["epoch"], 1, "step 12 begins the second epoch");
    let labels = row["labels"].as_array().unwrap();
    let learned = labels.iter().filter(|l| l.as_i64().unwrap() >= 0).count();
    assert_eq!(row["learned"].as_u64(), Some(learned as u64));
    assert_eq!(labels.len(), row["input_ids"].as_array().unwrap().len());
    let shown = harness(
        &["batches", "suites/sft-chat.yaml", "--step", "0", "--tokens"],
        &[],
    );
    let shown = text(&shown);
    assert!(
        shown.contains("<|im_start|>assistant\\n⟦") && shown.contains("<|im_end|>⟧"),
        "the answer and its <|im_end|> marked learned: {shown}"
    );
}
