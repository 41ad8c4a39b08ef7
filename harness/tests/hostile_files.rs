//! Paths that are not regular files (a FIFO, a device, a symbolic link to one) where a command
//! reads a file: a suite, a summary, a checkpoint's file, a leftover of an interrupted save. Each
//! is refused by its path and what it is, or set aside, within seconds: never a read that
//! blocks for ever or never ends. Every command runs under a time limit, killed past it, so a
//! regression fails the test instead of hanging it.

use ckpt_engine::checkpoint::{MODEL_FILE, OPTIMIZER_FILE, STATE_FILE};
use ckpt_harness::cli::exit_codes;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ckpt-harness");

/// How long a command may run before it counts as hung.
const LIMIT: Duration = Duration::from_secs(60);

/// What a command did: its exit status and everything it printed.
struct Ran {
    code: Option<i32>,
    text: String,
}

/// Runs `ckpt-harness ARGS` with its output in files under `dir`, killed and failing the test
/// when it is still running after [`LIMIT`].
fn bounded<S: AsRef<OsStr>>(dir: &Path, args: &[S]) -> Ran {
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > LIMIT {
            child.kill().unwrap();
            child.wait().unwrap();
            let shown: Vec<_> = args.iter().map(|a| a.as_ref().to_string_lossy()).collect();
            panic!(
                "`ckpt-harness {}` still ran after {LIMIT:?}: it hangs",
                shown.join(" ")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = format!(
        "{}\n{}",
        std::fs::read_to_string(&out).unwrap(),
        std::fs::read_to_string(&err).unwrap()
    );
    Ran {
        code: status.code(),
        text,
    }
}

fn mkfifo(path: &Path) {
    let made = Command::new("mkfifo").arg(path).status().unwrap();
    assert!(made.success(), "mkfifo {}", path.display());
}

/// A small suite in `dir` that `train` runs in a fraction of a second.
fn small_suite(dir: &Path) -> PathBuf {
    let path = dir.join("small.yaml");
    std::fs::write(
        &path,
        "name: small
model: {vocab_size: 64, hidden_size: 32, intermediate_size: 88, num_hidden_layers: 2,
        num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64}
init: {kind: random, seed: 1, std: 0.1}
precision: fp32
data: {kind: synthetic, seed: 3, samples: 64, min_len: 8}
batch_size: 4
seq_len: 32
optimizer: {lr: 0.003, betas: [0.9, 0.95], weight_decay: 0.1, grad_clip: 1.0}
schedule: {warmup_steps: 2, min_lr_ratio: 0.1}
training: {max_steps: 4}
",
    )
    .unwrap();
    path
}

/// A run directory in `dir` whose `latest` is step 2, trained by `train`.
fn trained_run(dir: &Path) -> (PathBuf, PathBuf) {
    let suite = small_suite(dir);
    let run = dir.join("run");
    let args = [
        OsStr::new("train"),
        suite.as_os_str(),
        OsStr::new("--out"),
        run.as_os_str(),
        OsStr::new("--steps"),
        OsStr::new("2"),
    ];
    let ran = bounded(dir, &args);
    assert_eq!(ran.code, Some(0), "{}", ran.text);
    (suite, run)
}

/// `ran` was refused as bad input, naming `path` and what it is.
fn assert_refused(ran: &Ran, path: &Path, what: &str) {
    assert_eq!(ran.code, Some(exit_codes::INVALID.into()), "{}", ran.text);
    let want = format!("{}: is {what}, not a regular file", path.display());
    assert!(
        ran.text.contains(&want),
        "wanted {want:?} in:\n{}",
        ran.text
    );
}

#[test]
fn a_suite_that_is_a_fifo_or_a_device_is_refused_by_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let fifo = dir.join("suite.yaml");
    mkfifo(&fifo);
    let (fifo_s, out) = (fifo.to_str().unwrap(), dir.join("out"));
    let out = out.to_str().unwrap();
    for args in [
        vec!["validate", fifo_s],
        vec!["list", fifo_s],
        vec!["run", fifo_s, "--report", out],
        vec!["train", fifo_s, "--out", out],
        vec!["estimate", fifo_s],
    ] {
        assert_refused(&bounded(dir, &args), &fifo, "a FIFO");
    }
    assert_refused(
        &bounded(dir, &["validate", "/dev/zero"]),
        Path::new("/dev/zero"),
        "a character device",
    );
    // In a directory of suites, a FIFO named like one is refused too, not skipped.
    let suites = dir.join("suites");
    std::fs::create_dir(&suites).unwrap();
    let inner = suites.join("x.yaml");
    mkfifo(&inner);
    assert_refused(
        &bounded(dir, &["validate", suites.to_str().unwrap()]),
        &inner,
        "a FIFO",
    );
}

#[test]
fn a_summary_that_is_a_fifo_or_a_device_is_refused_by_diff_run_and_merge() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let fifo = dir.join("summary.json");
    mkfifo(&fifo);
    let summary = dir.join("good.json");
    std::fs::write(&summary, r#"{"passed": 0, "failed": 0, "trials": []}"#).unwrap();
    let (fifo_s, good) = (fifo.to_str().unwrap(), summary.to_str().unwrap());
    let zero = Path::new("/dev/zero");
    assert_refused(&bounded(dir, &["diff", fifo_s, good]), &fifo, "a FIFO");
    assert_refused(&bounded(dir, &["diff", good, fifo_s]), &fifo, "a FIFO");
    assert_refused(
        &bounded(dir, &["diff", good, "/dev/zero"]),
        zero,
        "a character device",
    );
    let suite = small_suite(dir);
    let report = dir.join("report");
    let report = report.to_str().unwrap();
    let run = [
        "run",
        suite.to_str().unwrap(),
        "--report",
        report,
        "--baseline",
        fifo_s,
    ];
    assert_refused(&bounded(dir, &run), &fifo, "a FIFO");
    let parts = dir.join("part");
    std::fs::create_dir(&parts).unwrap();
    std::fs::copy(&summary, parts.join("summary.json")).unwrap();
    let merge = [
        "report",
        "merge",
        parts.to_str().unwrap(),
        "--out",
        report,
        "--baseline",
        "/dev/zero",
    ];
    assert_refused(&bounded(dir, &merge), zero, "a character device");
    // A partition's own summary.json that is a FIFO is refused, not skipped.
    std::fs::remove_file(parts.join("summary.json")).unwrap();
    mkfifo(&parts.join("summary.json"));
    let merge = ["report", "merge", parts.to_str().unwrap(), "--out", report];
    assert_refused(&bounded(dir, &merge), &parts.join("summary.json"), "a FIFO");
}

#[test]
fn verify_refuses_a_checkpoint_file_that_is_a_link_to_a_device_or_a_fifo() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (_, run) = trained_run(dir);
    let ckpt = run.join("step-00000002");
    let model = ckpt.join(MODEL_FILE);
    std::fs::remove_file(&model).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &model).unwrap();
    let optimizer = ckpt.join(OPTIMIZER_FILE);
    std::fs::remove_file(&optimizer).unwrap();
    mkfifo(&optimizer);
    let ran = bounded(dir, &[OsStr::new("verify"), run.as_os_str()]);
    assert_eq!(ran.code, Some(exit_codes::FAILED.into()), "{}", ran.text);
    for (path, what) in [
        (&model, "a symbolic link to a character device"),
        (&optimizer, "a FIFO"),
    ] {
        let want = format!("{}: is {what}, not a regular file", path.display());
        assert!(
            ran.text.contains(&want),
            "wanted {want:?} in:\n{}",
            ran.text
        );
    }
    assert!(ran.text.contains("0 intact, 1 damaged"), "{}", ran.text);
    // The state file itself a link to /dev/zero: damage, named, not an endless read.
    let state = ckpt.join(STATE_FILE);
    std::fs::remove_file(&state).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &state).unwrap();
    let ran = bounded(dir, &[OsStr::new("verify"), ckpt.as_os_str()]);
    assert_eq!(ran.code, Some(exit_codes::FAILED.into()), "{}", ran.text);
    assert!(
        ran.text
            .contains("is a symbolic link to a character device, not a regular file"),
        "{}",
        ran.text
    );
}

#[test]
fn resuming_a_checkpoint_whose_file_is_a_fifo_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (suite, run) = trained_run(dir);
    let ckpt = run.join("step-00000002");
    let model = ckpt.join(MODEL_FILE);
    std::fs::remove_file(&model).unwrap();
    mkfifo(&model);
    let args = [
        OsStr::new("train"),
        suite.as_os_str(),
        OsStr::new("--out"),
        run.as_os_str(),
        OsStr::new("--resume"),
        ckpt.as_os_str(),
        OsStr::new("--steps"),
        OsStr::new("4"),
    ];
    let ran = bounded(dir, &args);
    assert_ne!(ran.code, Some(0), "{}", ran.text);
    let want = format!("{}: is a FIFO, not a regular file", model.display());
    assert!(
        ran.text.contains(&want),
        "wanted {want:?} in:\n{}",
        ran.text
    );
}

#[test]
fn a_leftover_save_holding_a_fifo_or_a_device_link_is_removed_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (suite, run) = trained_run(dir);
    let ckpt = run.join("step-00000002");
    let leftover = run.join(".tmp-step-00000002-dead");
    std::fs::create_dir(&leftover).unwrap();
    for entry in std::fs::read_dir(&ckpt).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), leftover.join(entry.file_name())).unwrap();
    }
    std::fs::remove_file(leftover.join(MODEL_FILE)).unwrap();
    std::os::unix::fs::symlink("/dev/zero", leftover.join(MODEL_FILE)).unwrap();
    std::fs::remove_file(leftover.join(OPTIMIZER_FILE)).unwrap();
    mkfifo(&leftover.join(OPTIMIZER_FILE));
    let args = [
        OsStr::new("train"),
        suite.as_os_str(),
        OsStr::new("--out"),
        run.as_os_str(),
        OsStr::new("--resume"),
        run.as_os_str(),
        OsStr::new("--steps"),
        OsStr::new("4"),
    ];
    let ran = bounded(dir, &args);
    assert_eq!(ran.code, Some(0), "{}", ran.text);
    assert!(
        ran.text.contains(&format!(
            "removed {}, an unfinished save",
            leftover.display()
        )),
        "{}",
        ran.text
    );
    assert!(!leftover.exists());
    assert!(run.join("step-00000004").is_dir(), "{}", ran.text);
}
