//! Checkpoints end to end: resume in a separate process is bitwise identical to never stopping;
//! every kind of damage gives its own clear error; SIGKILL during saves never loses the latest
//! loadable checkpoint.

use ckpt_engine::checkpoint::state::TrainerState;
use ckpt_engine::checkpoint::{self, SaveRequest, Tensors, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE};
use ckpt_engine::{CpuDevice, Trainer};
use ckpt_harness::suite::Suite;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_ckpt-harness");

fn suite_text(precision: &str, hidden: usize, training: &str) -> String {
    format!(
        "name: ckpt-{precision}
model: {{vocab_size: 64, hidden_size: {hidden}, intermediate_size: 88, num_hidden_layers: 2,
        num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64}}
init: {{kind: random, seed: 1, std: 0.1}}
precision: {precision}
data: {{kind: synthetic, seed: 3, samples: 64, min_len: 8}}
batch_size: 4
seq_len: 32
optimizer: {{lr: 0.003, betas: [0.9, 0.95], weight_decay: 0.1, grad_clip: 1.0}}
schedule: {{warmup_steps: 2, min_lr_ratio: 0.1}}
training: {training}
"
    )
}

fn write_suite(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("suite.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `train SUITE --out OUT --steps STEPS [--resume RESUME]`, run to its end.
fn train_output(suite: &Path, out: &Path, resume: Option<&Path>, steps: u64) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("train")
        .arg(suite)
        .arg("--out")
        .arg(out)
        .arg("--steps")
        .arg(steps.to_string());
    if let Some(r) = resume {
        cmd.arg("--resume").arg(r);
    }
    cmd.output().unwrap()
}

/// The instant trial `trial` kills `train` at: a fixed, varied sequence over start-up and the
/// save loop.
fn kill_delay_ms(trial: u64) -> u64 {
    5 + (trial * 37) % 120
}

/// `train SUITE --out RUN --resume RUN`, killed with SIGKILL after [`kill_delay_ms`]; what it
/// printed.
fn kill_train_resuming(suite: &Path, run: &Path, trial: u64) -> Output {
    let mut child = Command::new(BIN)
        .arg("train")
        .arg(suite)
        .arg("--out")
        .arg(run)
        .arg("--resume")
        .arg(run)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(kill_delay_ms(trial)));
    child.kill().unwrap();
    child.wait_with_output().unwrap()
}

fn train(suite: &Path, out: &Path, resume: Option<&Path>, steps: u64) -> Vec<String> {
    let output = train_output(suite, out, resume, steps);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Rewrites the `trainer_state.json` of `ckpt` with `edit` applied, as a hand edit would.
fn hand_edit_state(ckpt: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let path = ckpt.join(STATE_FILE);
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut state);
    std::fs::write(&path, serde_json::to_vec_pretty(&state).unwrap()).unwrap();
}

/// [`hand_edit_state`], then records the new checksum, as a deliberate rewrite would.
fn rewrite_state(ckpt: &Path, edit: impl Fn(&mut serde_json::Value)) {
    hand_edit_state(ckpt, edit);
    checkpoint::state_file::reseal(ckpt).unwrap();
}

fn file_bytes(dir: &Path, name: &str) -> Vec<u8> {
    std::fs::read(dir.join(name)).unwrap()
}

fn resume_matches(precision: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let suite = write_suite(
        tmp.path(),
        &suite_text(precision, 32, "{max_steps: 8, extra_steps: 3}"),
    );
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let straight = train(&suite, &a, None, 11);
    let resumed = train(&suite, &b, Some(&a.join("step-00000004")), 11);
    assert_eq!(straight.len(), 11);
    assert_eq!(resumed.len(), 7);
    // Every field of every step line: loss, lr, grad norm and peak bytes.
    assert_eq!(&straight[4..], &resumed[..]);
    // The checkpoint both runs wrote at step 8 is the same, byte for byte.
    for name in [MODEL_FILE, OPTIMIZER_FILE] {
        assert!(
            file_bytes(&a.join("step-00000008"), name)
                == file_bytes(&b.join("step-00000008"), name),
            "{name} differs"
        );
    }
}

#[test]
fn fp32_resume_in_another_process_is_bitwise_identical() {
    resume_matches("fp32");
}

#[test]
fn bf16_mixed_resume_in_another_process_is_bitwise_identical() {
    resume_matches("bf16-mixed");
}

/// A saved run to damage, and the run configuration that loads it.
struct Saved {
    _tmp: tempfile::TempDir,
    ckpt: PathBuf,
    suite: Suite,
}

fn saved() -> Saved {
    let tmp = tempfile::tempdir().unwrap();
    let text = suite_text("bf16-mixed", 32, "{max_steps: 4, resume_from: 2}");
    let suite = Suite::parse(&tmp.path().join("suite.yaml"), &text).unwrap();
    let mut t = Trainer::new(suite.train.clone(), CpuDevice::new(1, u64::MAX).unwrap()).unwrap();
    t.step().unwrap();
    t.step().unwrap();
    let ckpt = t.save(&tmp.path().join("run"), None).unwrap();
    Saved {
        _tmp: tmp,
        ckpt,
        suite,
    }
}

fn resume_error(s: &Saved) -> String {
    let dev = CpuDevice::new(1, u64::MAX).unwrap();
    match Trainer::resume(s.suite.train.clone(), dev, &s.ckpt) {
        Ok(_) => panic!("a damaged checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

fn assert_contains(err: &str, parts: &[&str]) {
    for p in parts {
        assert!(err.contains(p), "expected {p:?} in: {err}");
    }
}

#[test]
fn an_intact_checkpoint_loads_and_continues() {
    let s = saved();
    let dev = CpuDevice::new(1, u64::MAX).unwrap();
    let mut t = Trainer::resume(s.suite.train.clone(), dev, &s.ckpt).unwrap();
    assert_eq!(t.step_index(), 2);
    assert_eq!(t.state_digest().unwrap().optimizer_steps, 2);
    assert!(t.step().unwrap().loss.is_finite());
}

#[test]
fn a_resume_in_another_execution_environment_is_noted_with_what_differs() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = write_suite(
        tmp.path(),
        &suite_text("fp32", 32, "{max_steps: 4, resume_from: 2}"),
    );
    let run = tmp.path().join("run");
    train(&suite, &run, None, 2);
    let ckpt = run.join("step-00000002");
    let resumed = |out: &str| {
        let output = train_output(&suite, &tmp.path().join(out), Some(&ckpt), 3);
        assert!(output.status.success(), "{}", stderr(&output));
        stderr(&output)
    };
    let same = resumed("same");
    assert!(!same.contains("execution environment"), "{same}");
    rewrite_state(&ckpt, |s| {
        s["environment"]["cpu_kernels"] = "riscv64 scalar".into();
    });
    let here = ckpt_harness::checks::golden::environment("cpu").unwrap();
    let noted: Vec<String> = resumed("elsewhere")
        .lines()
        .filter(|l| l.contains("execution environment"))
        .map(str::to_string)
        .collect();
    assert_eq!(
        noted,
        [format!(
            "note: {} was saved in another execution environment (cpu_kernels: riscv64 scalar → {here}); training continues, but not necessarily bit for bit",
            ckpt.display()
        )]
    );
}

#[test]
fn truncation_at_any_offset_is_named() {
    for name in [MODEL_FILE, OPTIMIZER_FILE] {
        let len = file_bytes(&saved().ckpt, name).len();
        for cut in [0, 7, 8, 100, len / 2, len - 1] {
            let s = saved();
            let full = file_bytes(&s.ckpt, name);
            std::fs::write(s.ckpt.join(name), &full[..cut]).unwrap();
            assert_contains(
                &resume_error(&s),
                &[name, &format!("is {cut} bytes"), "truncated"],
            );
        }
    }
    let s = saved();
    let full = file_bytes(&s.ckpt, STATE_FILE);
    std::fs::write(s.ckpt.join(STATE_FILE), &full[..full.len() / 2]).unwrap();
    assert_contains(&resume_error(&s), &[STATE_FILE, "damaged"]);
}

#[test]
fn a_flipped_byte_is_a_checksum_error() {
    for name in [MODEL_FILE, OPTIMIZER_FILE, "config.json"] {
        let len = file_bytes(&saved().ckpt, name).len();
        // In the header (where it may also break the parse or a shape), in the data, at the end.
        for at in [20, len / 2, len - 3] {
            let s = saved();
            let mut bytes = file_bytes(&s.ckpt, name);
            bytes[at] ^= 0x10;
            std::fs::write(s.ckpt.join(name), &bytes).unwrap();
            assert_contains(&resume_error(&s), &[name, "checksum mismatch"]);
        }
    }
}

/// Checkpoints written before XXH3 was recorded carry only sha256: they load, verified by it.
#[test]
fn a_checkpoint_with_only_sha256_is_verified_by_it() {
    let strip = |s: &Saved| {
        rewrite_state(&s.ckpt, |state| {
            for (name, record) in state["files"].as_object_mut().unwrap() {
                let record = record.as_object_mut().unwrap();
                record.remove("segments").unwrap();
                let sha256 = checkpoint::files::sha256_hex(&file_bytes(&s.ckpt, name));
                assert_eq!(record.insert("sha256".into(), sha256.into()), None);
            }
        })
    };
    let s = saved();
    strip(&s);
    let dev = CpuDevice::new(1, u64::MAX).unwrap();
    Trainer::resume(s.suite.train.clone(), dev, &s.ckpt).unwrap();

    let s = saved();
    strip(&s);
    let mut bytes = file_bytes(&s.ckpt, OPTIMIZER_FILE);
    let at = bytes.len() / 2;
    bytes[at] ^= 0x01;
    std::fs::write(s.ckpt.join(OPTIMIZER_FILE), &bytes).unwrap();
    assert_contains(&resume_error(&s), &[OPTIMIZER_FILE, "checksum mismatch"]);
}

#[test]
fn a_missing_file_is_named() {
    for name in [MODEL_FILE, OPTIMIZER_FILE, "config.json", STATE_FILE] {
        let s = saved();
        std::fs::remove_file(s.ckpt.join(name)).unwrap();
        assert_contains(&resume_error(&s), &[name]);
    }
}

#[test]
fn a_checkpoint_of_another_model_is_refused_with_the_difference() {
    let s = saved();
    let tmp = tempfile::tempdir().unwrap();
    let other = Suite::parse(
        &tmp.path().join("x.yaml"),
        &suite_text("bf16-mixed", 48, "{max_steps: 4}"),
    )
    .unwrap();
    let dev = CpuDevice::new(1, u64::MAX).unwrap();
    let err = Trainer::resume(other.train, dev, &s.ckpt)
        .err()
        .unwrap()
        .to_string();
    assert_contains(
        &err,
        &["another run configuration", "model.hidden_size: 32 vs 48"],
    );
}

#[test]
fn a_future_format_version_asks_for_an_upgrade() {
    let s = saved();
    rewrite_state(&s.ckpt, |state| {
        state["format_version"] = 99.into();
        state["something_new"] = "field".into();
    });
    assert_contains(
        &resume_error(&s),
        &["format version 99", "newer", "upgrade"],
    );
}

#[test]
fn a_consistent_but_misshapen_tensor_names_the_tensor_and_shapes() {
    // Rewrite the optimizer file with one moment transposed, and record its new checksum, so
    // only the shape check can catch it.
    let s = saved();
    let opt_path = s.ckpt.join(OPTIMIZER_FILE);
    let bytes = std::fs::read(&opt_path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let victim = "model.layers.1.mlp.up_proj.weight.exp_avg";
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            if name == victim {
                let shape = vec![v.shape()[1], v.shape()[0]];
                (
                    name,
                    safetensors::tensor::TensorView::new(v.dtype(), shape, v.data()).unwrap(),
                )
            } else {
                (name, v)
            }
        })
        .collect();
    let rewritten = safetensors::serialize(views, None).unwrap();
    std::fs::write(&opt_path, &rewritten).unwrap();
    rewrite_state(&s.ckpt, |state| {
        state["files"][OPTIMIZER_FILE] =
            serde_json::to_value(checkpoint::files::record(&rewritten)).unwrap();
    });
    assert_contains(
        &resume_error(&s),
        &[
            OPTIMIZER_FILE,
            &format!("{victim} has shape [32, 88], the config needs [88, 32]"),
        ],
    );
}

#[test]
fn sigkill_during_saves_always_leaves_a_loadable_latest() {
    let tmp = tempfile::tempdir().unwrap();
    let text = suite_text(
        "fp32",
        32,
        "{max_steps: 1000000, resume_from: 1, save_every: 1, keep_last: 2}",
    );
    let suite_path = write_suite(tmp.path(), &text);
    let suite = Suite::load(&suite_path).unwrap();
    let run = tmp.path().join("run");
    train(&suite_path, &run, None, 1);
    let mut steps_seen = Vec::new();
    for trial in 0u64..50 {
        kill_train_resuming(&suite_path, &run, trial);
        let dev = CpuDevice::new(1, u64::MAX).unwrap();
        let t = Trainer::resume(suite.train.clone(), dev, &run).unwrap_or_else(|e| {
            panic!(
                "trial {trial} (killed after {} ms): {e}",
                kill_delay_ms(trial)
            )
        });
        steps_seen.push(t.step_index());
    }
    // The runs made progress, so kills landed inside the save loop, not only at start-up.
    assert!(
        steps_seen.last().unwrap() > &10,
        "steps reached: {steps_seen:?}"
    );
}

/// SIGKILL trials against `train` saving every step in the background: every kill leaves a
/// `latest` naming a complete checkpoint that loads and verifies, and loses no checkpoint: a
/// step's line is printed only after the save before it was finished, so `latest` is never
/// behind the last step printed, nor behind the previous trial's. Prints the count and the time.
fn sigkill_during_async_saves(trials: u64) {
    let started = std::time::Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let text = suite_text(
        "fp32",
        32,
        "{max_steps: 1000000, resume_from: 1, save_every: 1, keep_last: 2, async_save: true}",
    );
    let suite_path = write_suite(tmp.path(), &text);
    let suite = Suite::load(&suite_path).unwrap();
    let run = tmp.path().join("run");
    train(&suite_path, &run, None, 1);
    let (mut latest, mut interrupted) = (1u64, 0u64);
    for trial in 0..trials {
        let output = kill_train_resuming(&suite_path, &run, trial);
        let printed = String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["step"].as_u64())
            .max();
        let ctx = format!("trial {trial} (killed after {} ms)", kill_delay_ms(trial));
        // A write the kill interrupted leaves its temporary directory behind.
        interrupted += u64::from(std::fs::read_dir(&run).unwrap().any(|e| {
            e.unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".tmp-")
        }));
        for dir in checkpoint::list(&run).unwrap() {
            let (_, verdicts) = checkpoint::verify(&dir).unwrap();
            let broken: Vec<_> = verdicts.iter().filter(|v| v.problem.is_some()).collect();
            assert!(broken.is_empty(), "{ctx}: {}: {broken:?}", dir.display());
        }
        let dev = CpuDevice::new(1, u64::MAX).unwrap();
        let t = Trainer::resume(suite.train.clone(), dev, &run)
            .unwrap_or_else(|e| panic!("{ctx}: latest does not load: {e}"));
        let now = t.step_index();
        assert!(
            now >= latest,
            "{ctx}: latest went back from step {latest} to {now}"
        );
        if let Some(step) = printed {
            assert!(
                now >= step,
                "{ctx}: step {step} was printed, so the checkpoint of step {step} was complete, but latest is step {now}"
            );
        }
        latest = now;
    }
    println!(
        "{trials} SIGKILL trials during async saves: 0 lost checkpoints, {interrupted} kills interrupted a write, latest reached step {latest}, {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // The runs made progress, so kills landed inside the step loop, not only at start-up.
    assert!(latest > 10, "latest reached step {latest}");
    assert!(interrupted > 0, "no kill landed during a write");
}

#[test]
fn sigkill_during_async_saves_loses_no_checkpoint() {
    sigkill_during_async_saves(60);
}

#[test]
fn loading_adds_no_device_memory_over_the_steady_state() {
    let s = saved();
    let dev = CpuDevice::new(1, u64::MAX).unwrap();
    let t = Trainer::resume(s.suite.train.clone(), dev.clone(), &s.ckpt).unwrap();
    let stats = dev.tracker().stats();
    // Every tensor is read straight into its final allocation: nothing is staged on the device.
    assert_eq!(stats.allocated.peak, stats.allocated.current, "{stats:?}");
    assert!(stats.current.optimizer > 0 && stats.current.params > 0);
    drop(t);
    assert_eq!(dev.tracker().allocated(), 0);
}

/// Runs the command-line tool with `args`.
fn cli(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `path` as a command-line argument.
fn arg(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Asserts that `verify PATH` exits with `status` and prints a line holding every one of `words`.
fn verify_says(path: &Path, status: i32, words: &[&str]) {
    let out = cli(&["verify", arg(path)]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(status), "{stdout}");
    assert!(
        stdout.lines().any(|l| words.iter().all(|w| l.contains(w))),
        "expected a line with {words:?}: {stdout}"
    );
}

#[test]
fn an_edited_trainer_state_is_damage_for_verify_and_load() {
    type Edit = fn(&mut serde_json::Value);
    let edits: [(&str, Edit); 3] = [
        ("global_step", |s| s["global_step"] = 5.into()),
        ("loader position", |s| {
            s["loader"]["position"] = (s["loader"]["position"].as_u64().unwrap() + 4).into()
        }),
        ("optimizer step", |s| s["optimizer_step"] = 1.into()),
    ];
    for (what, edit) in edits {
        eprintln!("editing the {what}");
        let s = saved();
        hand_edit_state(&s.ckpt, edit);
        verify_says(&s.ckpt, 1, &["DAMAGED", STATE_FILE]);
        assert_contains(&resume_error(&s), &[STATE_FILE, "sha256"]);
    }
}

#[test]
fn a_state_file_written_without_its_checksum_loads_and_is_reported_unprotected() {
    let s = saved();
    // What a checkpoint written before the state file had a checksum looks like.
    let _ = std::fs::remove_file(s.ckpt.join(format!("{STATE_FILE}.sha256")));
    hand_edit_state(&s.ckpt, |s| {
        s["format_version"] = 1.into();
        s.as_object_mut().unwrap().remove("environment");
    });
    verify_says(&s.ckpt, 0, &[STATE_FILE, "unprotected"]);
    let dev = CpuDevice::new(1, u64::MAX).unwrap();
    let t = Trainer::resume(s.suite.train.clone(), dev, &s.ckpt).unwrap();
    assert_eq!(t.step_index(), 2);
}

#[test]
fn a_state_holding_a_non_finite_number_is_refused_at_save() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = Suite::parse(
        &tmp.path().join("suite.yaml"),
        &suite_text("fp32", 32, "{max_steps: 4}"),
    )
    .unwrap();
    let run = tmp.path().join("run");
    let dev = CpuDevice::new(1, u64::MAX).unwrap();
    let mut t = Trainer::new(suite.train.clone(), dev.clone()).unwrap();
    t.step().unwrap();
    t.save(&run, None).unwrap();
    let saved = std::fs::read_to_string(run.join("step-00000001").join(STATE_FILE)).unwrap();
    t.step().unwrap();
    for lr in [f64::NAN, f64::INFINITY] {
        // A run that asks for a non-finite rate is refused before it starts...
        let mut cfg = suite.train.clone();
        cfg.optimizer.lr = lr;
        let err = Trainer::new(cfg, dev.clone())
            .err()
            .expect("refused")
            .to_string();
        assert_contains(&err, &["optimizer.lr", "finite"]);
        // ...and a state that holds one anyway is refused at save, before anything is written.
        let mut state: TrainerState = serde_json::from_str(&saved).unwrap();
        (state.global_step, state.schedule.peak_lr) = (2, lr);
        state.files.clear();
        let (model, optimizer) = t.state().checkpoint_entries().unwrap();
        let req = SaveRequest {
            config: &suite.train.model,
            tensors: Tensors::Whole { model, optimizer },
            state,
        };
        let err = checkpoint::save(&run, req, None).unwrap_err().to_string();
        assert_contains(&err, &["schedule.peak_lr", "finite"]);
        assert!(!run.join("step-00000002").exists(), "lr {lr}");
        // The previous checkpoint is still the run's latest, and loads.
        let t = Trainer::resume(suite.train.clone(), dev.clone(), &run).unwrap();
        assert_eq!(t.step_index(), 1);
    }
}

#[test]
fn a_second_writer_of_a_run_is_refused_with_the_holder() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = write_suite(
        tmp.path(),
        &suite_text("fp32", 32, "{max_steps: 1000000, save_every: 1}"),
    );
    let run = tmp.path().join("run");
    let mut first = Command::new(BIN)
        .args(["train", arg(&suite), "--out", arg(&run)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while !run.join("latest").exists() {
        assert!(
            started.elapsed().as_secs() < 120,
            "the first train never saved"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let second = train_output(&suite, &run, None, 2);
    first.kill().unwrap();
    first.wait().unwrap();
    assert_eq!(second.status.code(), Some(2), "{}", stderr(&second));
    assert_contains(
        &stderr(&second),
        &[arg(&run), &format!("process {}", first.id()), "train"],
    );
}

/// A suite saving after every step, trained for `steps` steps into `run`.
fn run_saving_every_step(steps: u64) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let suite = write_suite(
        tmp.path(),
        &suite_text("fp32", 32, "{max_steps: 8, save_every: 1}"),
    );
    let run = tmp.path().join("run");
    train(&suite, &run, None, steps);
    (tmp, suite, run)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// The names of a run directory's entries that a save leaves behind only when interrupted.
fn leftovers(run: &Path) -> Vec<String> {
    std::fs::read_dir(run)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp-") || n.starts_with(".old-"))
        .collect()
}

fn verify_status(path: &Path) -> Option<i32> {
    cli(&["verify", arg(path)]).status.code()
}

/// `verify`, `export` and `train --resume` given a path that is not a directory say so, and
/// what to name, and exit 2 (bad input) before reading anything.
#[test]
fn a_named_checkpoint_that_is_not_a_directory_is_refused_with_what_to_name() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = write_suite(
        tmp.path(),
        &suite_text("fp32", 32, "{max_steps: 8, save_every: 1}"),
    );
    let file = tmp.path().join("file");
    std::fs::write(&file, "").unwrap();
    let out_dir = tmp.path().join("out");
    for (path, what) in [
        (tmp.path().join("gone"), "does not exist"),
        (file, "is not a directory"),
    ] {
        let p = arg(&path);
        for args in [
            vec!["verify", p],
            vec!["export", p, "--out", arg(&out_dir)],
            vec!["train", arg(&suite), "--out", arg(&out_dir), "--resume", p],
        ] {
            let out = cli(&args);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
            assert!(
                stderr(&out).contains(&format!("error: {p}: {what}; name a checkpoint directory (one holding trainer_state.json) or a run directory (one holding latest)")),
                "{args:?}: {}",
                stderr(&out)
            );
        }
    }
    assert!(!out_dir.exists(), "nothing written");
}

#[test]
fn an_interrupted_resave_is_restored_by_the_next_train_not_deleted() {
    // What a kill between moving step 8 aside and renaming its new copy into place left: both
    // copies complete, no step-00000008, `latest` naming it.
    let (_tmp, suite, run) = run_saving_every_step(8);
    let step8 = run.join("step-00000008");
    let old = run.join(".old-step-00000008-4242");
    std::fs::rename(&step8, &old).unwrap();
    copy_dir(&old, &run.join(".tmp-step-00000008-4242"));

    let out = train_output(&suite, &run, Some(&run.join("step-00000003")), 4);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("step-00000008"),
        "the restore is reported: {}",
        stderr(&out)
    );
    assert_eq!(verify_status(&step8), Some(0), "step 8 was lost");
    assert_eq!(leftovers(&run), Vec::<String>::new());
    assert_eq!(verify_status(&run), Some(0));
}

/// `train --resume RUN --steps 9` after `latest`'s checkpoint was broken by `damage`: it resumes
/// from step 7 and says that it skipped step 8, and why.
fn resumes_past_a_broken_latest(damage: impl Fn(&Path), why: &str) {
    let (_tmp, suite, run) = run_saving_every_step(8);
    damage(&run.join("step-00000008"));
    assert_eq!(verify_status(&run), Some(1), "a broken latest is damage");
    let out = train_output(&suite, &run, Some(&run), 9);
    assert!(out.status.success(), "{}", stderr(&out));
    let warning = stderr(&out);
    let line = warning
        .lines()
        .find(|l| l.starts_with("warning:"))
        .unwrap_or_else(|| panic!("no warning: {warning}"));
    assert_contains(line, &["step-00000008", why, "step-00000007"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.lines().next().unwrap().starts_with("{\"step\":7,"),
        "{stdout}"
    );
    assert_eq!(verify_status(&run), Some(0));
}

#[test]
fn resume_falls_back_past_a_missing_latest_checkpoint() {
    resumes_past_a_broken_latest(
        |dir| std::fs::remove_dir_all(dir).unwrap(),
        "not a checkpoint directory",
    );
}

#[test]
fn resume_falls_back_past_a_damaged_latest_checkpoint() {
    resumes_past_a_broken_latest(
        |dir| {
            let mut bytes = file_bytes(dir, MODEL_FILE);
            let at = bytes.len() / 2;
            bytes[at] ^= 0x01;
            std::fs::write(dir.join(MODEL_FILE), bytes).unwrap();
        },
        "checksum mismatch",
    );
    resumes_past_a_broken_latest(
        |dir| std::fs::write(dir.join(STATE_FILE), b"{\"format_version\": 1, ").unwrap(),
        STATE_FILE,
    );
}

#[test]
fn an_explicit_damaged_checkpoint_is_an_error_not_a_fallback() {
    let (_tmp, suite, run) = run_saving_every_step(8);
    let step8 = run.join("step-00000008");
    std::fs::remove_file(step8.join(MODEL_FILE)).unwrap();
    let out = train_output(&suite, &run, Some(&step8), 9);
    assert_eq!(out.status.code(), Some(2));
    assert_contains(&stderr(&out), &[MODEL_FILE]);
}

/// A kill at each rename of a re-save (strace stops the process as it enters the call) leaves
/// `latest` naming a complete checkpoint, and the next save leaves no copies behind.
#[test]
fn a_kill_at_any_rename_of_a_resave_keeps_latest_complete() {
    assert!(
        Command::new("strace").arg("-V").output().is_ok(),
        "this test needs strace (apt-get install strace)"
    );
    for when in 1..=3 {
        let (_tmp, suite, run) = run_saving_every_step(8);
        let inject =
            format!("inject=rename,renameat,renameat2:error=EIO:signal=SIGKILL:when={when}");
        let status = Command::new("strace")
            .args(["-f", "-o", "/dev/null", "-e", &inject, BIN, "train"])
            .args([arg(&suite), "--out", arg(&run), "--resume"])
            .args([arg(&run.join("step-00000007")), "--steps", "8"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        let ctx = format!("kill at rename {when} ({status})");
        assert_eq!(verify_status(&run), Some(0), "{ctx}");
        train(&suite, &run, Some(&run), 9);
        assert_eq!(leftovers(&run), Vec::<String>::new(), "{ctx}");
        assert_eq!(verify_status(&run.join("step-00000008")), Some(0), "{ctx}");
    }
}

/// The suite of a fully sharded run of `world` ranks saving every step, in the background
/// where `async_save`, written into `dir`; and its `training` line.
fn sharded_suite(dir: &Path, world: usize, async_save: bool) -> (PathBuf, String) {
    let training =
        format!("{{max_steps: 8, save_every: 1, accumulation: {world}, async_save: {async_save}}}");
    let text = suite_text("fp32", 32, &training)
        + &format!("parallel: {{world_size: {world}, shard: full}}\ndevices: [cpu]\n");
    (write_suite(dir, &text), training)
}

/// Asserts what a kill during step 8's save of `run` (`ctx` says which) leaves: every checkpoint
/// verifies, `latest` names step 7's or step 8's, and the run resumes from it to step 9 with no
/// copy left behind. Returns the name `latest` had.
fn survived_a_kill(suite: &Path, run: &Path, ctx: &str) -> String {
    for dir in checkpoint::list(run).unwrap() {
        assert_eq!(verify_status(&dir), Some(0), "{ctx}: {}", dir.display());
    }
    let latest = checkpoint::resolve(run).unwrap();
    let name = latest.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        ["step-00000007", "step-00000008"].contains(&name.as_str()),
        "{ctx}: {name}"
    );
    train(suite, run, Some(run), 9);
    assert_eq!(leftovers(run), Vec::<String>::new(), "{ctx}");
    assert_eq!(verify_status(&run.join("step-00000009")), Some(0), "{ctx}");
    name
}

/// A SIGKILL at every fsync, and at every rename, of a 4-rank sharded save (strace kills the
/// process as it enters the call; every rank's file and the index are fsynced before the one
/// rename), synchronous and asynchronous: every checkpoint left verifies, `latest` names step 7's
/// or step 8's, the run resumes from it, and the next save leaves no copy behind.
#[test]
fn a_kill_at_any_stage_of_a_sharded_save_keeps_latest_complete() {
    assert!(
        Command::new("strace").arg("-V").output().is_ok(),
        "this test needs strace (apt-get install strace)"
    );
    for async_save in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let (suite, training) = sharded_suite(tmp.path(), 4, async_save);
        let mut kills = 0;
        for calls in ["fsync,fdatasync", "rename,renameat,renameat2"] {
            for when in 1..=40 {
                let run = tmp.path().join(format!("run-{kills}"));
                train(&suite, &run, None, 7);
                assert!(run.join("step-00000007").join("shards.json").exists());
                let inject = format!("inject={calls}:signal=SIGKILL:when={when}");
                let status = Command::new("strace")
                    .args(["-f", "-o", "/dev/null", "-e", &inject, BIN, "train"])
                    .args([arg(&suite), "--out", arg(&run), "--resume", arg(&run)])
                    .args(["--steps", "8"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .unwrap();
                let ctx = format!("{training}: kill at {calls} call {when} ({status})");
                survived_a_kill(&suite, &run, &ctx);
                if status.success() {
                    break;
                }
                kills += 1;
            }
        }
        println!(
            "{training}: {kills} kills at a sharded save's fsyncs and renames, 0 checkpoints lost"
        );
        assert!(
            kills >= 8,
            "{training}: only {kills} kills landed in the save"
        );
    }
}

/// A SIGKILL at every fsync and rename of each rank's part of a save, where the ranks are
/// `train`s of their own (`--rank R --meet-file FILE`, 3 ranks, the killed one under strace),
/// synchronous and asynchronous: the other ranks stop instead of waiting, every checkpoint left
/// verifies, `latest` names step 7's or step 8's, the run resumes from it, and the next save
/// leaves no copy behind.
#[test]
fn a_kill_of_any_rank_at_any_stage_of_its_save_keeps_latest_complete() {
    assert!(
        Command::new("strace").arg("-V").output().is_ok(),
        "this test needs strace (apt-get install strace)"
    );
    let world = 3;
    for async_save in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let (suite, training) = sharded_suite(tmp.path(), world, async_save);
        let mut kills = [0; 3];
        for (killed, kills) in kills.iter_mut().enumerate() {
            for calls in ["fsync,fdatasync", "rename,renameat,renameat2"] {
                for when in 1..=20 {
                    let run = tmp.path().join(format!("run-{killed}-{calls}-{when}"));
                    train(&suite, &run, None, 7);
                    let meet = tmp.path().join(format!("meet-{killed}-{calls}-{when}"));
                    let inject = format!("inject={calls}:signal=SIGKILL:when={when}");
                    let ranks: Vec<_> = (0..world)
                        .map(|rank| {
                            let mut cmd = match rank == killed {
                                true => {
                                    let mut c = Command::new("strace");
                                    c.args(["-f", "-o", "/dev/null", "-e", &inject, BIN]);
                                    c
                                }
                                false => Command::new(BIN),
                            };
                            cmd.args(["train", arg(&suite), "--out", arg(&run), "--resume"])
                                .args([arg(&run), "--steps", "8", "--rank", &rank.to_string()])
                                .args(["--meet-file", arg(&meet)])
                                .stdout(Stdio::null())
                                .stderr(Stdio::null())
                                .spawn()
                                .unwrap()
                        })
                        .collect();
                    let statuses: Vec<_> =
                        ranks.into_iter().map(|mut r| r.wait().unwrap()).collect();
                    let ctx = format!(
                        "{training}: rank {killed} killed at {calls} call {when} ({statuses:?})"
                    );
                    let latest = survived_a_kill(&suite, &run, &ctx);
                    let all_done = statuses.iter().all(|s| s.success());
                    assert!(
                        !all_done || latest == "step-00000008",
                        "{ctx}: a save every rank finished is latest"
                    );
                    if all_done {
                        break;
                    }
                    *kills += 1;
                }
            }
        }
        println!(
            "{training}: kills at each rank's fsyncs and renames {kills:?}, 0 checkpoints lost"
        );
        assert!(
            kills.iter().all(|&k| k >= 1) && kills[0] >= 6,
            "{training}: too few kills landed in the save: {kills:?}"
        );
    }
}

/// A save that fails (the first fsync of step 3's save returns ENOSPC, injected by strace) stops
/// `train` with exit 1, naming the step and the checkpoint `latest` still names, not the
/// temporary copy it removed; synchronous and asynchronous saves alike. The run still verifies
/// and resumes.
#[test]
fn a_failed_save_names_its_step_and_the_checkpoint_latest_still_names() {
    assert!(
        Command::new("strace").arg("-V").output().is_ok(),
        "this test needs strace (apt-get install strace)"
    );
    for training in ["{max_steps: 8}", "{max_steps: 8, async_save: true}"] {
        let tmp = tempfile::tempdir().unwrap();
        let suite = write_suite(tmp.path(), &suite_text("fp32", 32, training));
        let run = tmp.path().join("run");
        train(&suite, &run, None, 2);
        let out = Command::new("strace")
            .args([
                "-f",
                "-o",
                "/dev/null",
                "-e",
                "inject=fsync:error=ENOSPC:when=1",
            ])
            .args([BIN, "train", arg(&suite), "--out", arg(&run), "--resume"])
            .args([arg(&run), "--steps", "3"])
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{training}: {err}");
        assert_contains(
            &err,
            &[
                &format!("saving step 3 into {} failed: writing its ", run.display()),
                "No space left on device",
                &format!(
                    "{} still names step-00000002, the previous checkpoint",
                    run.join("latest").display()
                ),
            ],
        );
        assert!(!err.contains(".tmp-step"), "{training}: {err}");
        assert_eq!(leftovers(&run), Vec::<String>::new(), "{training}");
        assert_eq!(verify_status(&run), Some(0), "{training}");
        train(&suite, &run, Some(&run), 3);
    }
}

/// The hidden size every checkpoint of `run` was saved with.
fn hidden_sizes(run: &Path) -> Vec<u64> {
    checkpoint::list(run)
        .unwrap()
        .iter()
        .map(|dir| {
            let state: serde_json::Value =
                serde_json::from_slice(&file_bytes(dir, STATE_FILE)).unwrap();
            state["identity"]["model"]["hidden_size"].as_u64().unwrap()
        })
        .collect()
}

#[test]
fn training_into_a_run_of_another_configuration_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let training = "{max_steps: 8, save_every: 1}";
    let suite_a = write_suite(&a, &suite_text("fp32", 32, training));
    let suite_b = write_suite(&b, &suite_text("fp32", 48, training));
    let run = tmp.path().join("run");
    train(&suite_a, &run, None, 3);
    // The same configuration again rewrites the same checkpoints: allowed.
    train(&suite_a, &run, None, 3);

    let out = train_output(&suite_b, &run, None, 4);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_contains(
        &stderr(&out),
        &[arg(&run), "model.hidden_size: 32 vs 48", "--overwrite"],
    );
    assert_eq!(hidden_sizes(&run), [32, 32, 32]);

    let out = cli(&[
        "train",
        arg(&suite_b),
        "--out",
        arg(&run),
        "--steps",
        "2",
        "--overwrite",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(hidden_sizes(&run), [48, 48]);
    assert_eq!(verify_status(&run), Some(0));
}

#[test]
fn the_last_trained_step_is_always_saved() {
    for (training, steps, saved) in [
        ("{max_steps: 8}", 3, &["step-00000003"][..]),
        (
            "{max_steps: 8, save_every: 5}",
            7,
            &["step-00000004", "step-00000005", "step-00000007"][..],
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let suite = write_suite(tmp.path(), &suite_text("fp32", 32, training));
        let run = tmp.path().join("run");
        train(&suite, &run, None, steps);
        let names: Vec<String> = checkpoint::list(&run)
            .unwrap()
            .iter()
            .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, saved, "{training} --steps {steps}");
        let latest = std::fs::read_to_string(run.join("latest")).unwrap();
        assert_eq!(latest.trim(), *saved.last().unwrap());
    }
}

/// A suite training on `tok.bin` beside it, saving after every step.
fn token_suite(dir: &Path) -> PathBuf {
    let text = suite_text("fp32", 32, "{max_steps: 8, save_every: 1}").replace(
        "{kind: synthetic, seed: 3, samples: 64, min_len: 8}",
        "{kind: token_file, path: tok.bin, dtype: u16}",
    );
    write_suite(dir, &text)
}

/// Writes 400 u16 token ids, `i * mul + add` modulo the vocabulary of 64, to `path`.
fn write_tokens(path: &Path, mul: u16, add: u16) {
    let bytes: Vec<u8> = (0..400u16)
        .flat_map(|i| ((i * mul + add) % 64).to_le_bytes())
        .collect();
    std::fs::write(path, bytes).unwrap();
}

/// `train` with `args`, run in `dir`.
fn train_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .current_dir(dir)
        .arg("train")
        .args(args)
        .output()
        .unwrap()
}

/// The `sha256 HEX` values `text` names, in order.
fn sha256s(text: &str) -> Vec<&str> {
    text.match_indices("sha256 ")
        .map(|(at, _)| &text[at + 7..(at + 71).min(text.len())])
        .filter(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
        .collect()
}

#[test]
fn a_resume_on_a_changed_token_file_is_refused_with_both_contents() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = token_suite(tmp.path());
    let tokens = tmp.path().join("tok.bin");
    write_tokens(&tokens, 7, 0);
    let run = tmp.path().join("tt");
    train(&suite, &run, None, 4);
    write_tokens(&tokens, 11, 3);

    for out in [run.clone(), tmp.path().join("elsewhere")] {
        let refused = train_output(&suite, &out, Some(&run), 8);
        let err = stderr(&refused);
        assert_eq!(refused.status.code(), Some(2), "{err}");
        assert_contains(&err, &["data.content", "800 bytes"]);
        let named = sha256s(&err);
        assert!(
            named.len() == 2 && named[0] != named[1],
            "both contents are named: {err}"
        );
        assert!(!err.contains("--overwrite"), "{err}");
    }
    assert_eq!(checkpoint::list(&run).unwrap().len(), 4);

    write_tokens(&tokens, 7, 0);
    let resumed = train(&suite, &run, Some(&run), 8);
    let whole = train(&suite, &tmp.path().join("whole"), None, 8);
    assert_eq!(
        resumed[..],
        whole[4..],
        "the original file resumes bit for bit"
    );
}

#[test]
fn a_run_resumed_from_another_directory_is_the_same_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a");
    std::fs::create_dir(&dir).unwrap();
    token_suite(&dir);
    write_tokens(&dir.join("tok.bin"), 7, 0);
    let first = train_in(
        tmp.path(),
        &["a/suite.yaml", "--out", "run", "--steps", "2"],
    );
    assert!(first.status.success(), "{}", stderr(&first));
    let args = ["suite.yaml", "--out", "../run", "--resume", "../run"];
    let resumed = train_in(&dir, &[&args[..], &["--steps", "4"]].concat());
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let whole = train_in(&dir, &["suite.yaml", "--out", "../whole", "--steps", "4"]);
    assert!(whole.status.success(), "{}", stderr(&whole));
    let lines = |o: &Output| -> Vec<String> {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    };
    assert_eq!(lines(&resumed)[..], lines(&whole)[2..]);
}

#[test]
fn a_latest_leading_out_of_its_run_is_refused() {
    let (_tmp, suite, run) = run_saving_every_step(4);
    // A run directory inside a checkpoint, whose `latest` leads up to that checkpoint.
    let inner = run.join("step-00000002").join("inner");
    std::fs::create_dir(&inner).unwrap();
    std::fs::write(inner.join("latest"), "..\n").unwrap();
    let out = train_output(&suite, &inner, Some(&inner), 6);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_contains(
        &err,
        &["latest", "names \"..\", not a checkpoint directory"],
    );
    assert!(out.stdout.is_empty(), "nothing trained");
}

#[test]
fn a_checkpoint_named_for_another_step_is_refused() {
    let (_tmp, suite, run) = run_saving_every_step(8);
    let renamed = run.join("step-00000009");
    copy_dir(&run.join("step-00000004"), &renamed);
    std::fs::write(run.join("latest"), "step-00000009\n").unwrap();

    let out = train_output(&suite, &run.join("resumed"), Some(&renamed), 10);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_contains(
        &err,
        &["step-00000009", "after 4 steps", "named for step 9"],
    );

    let out = train_output(&suite, &run, Some(&run), 10);
    let warning = stderr(&out);
    assert!(out.status.success(), "{warning}");
    assert_contains(&warning, &["skipped", "step-00000009", "named for step 9"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.starts_with("{\"step\":8,"), "{stdout}");
}

/// `train --steps 8` of a suite with learning rate `lr`, saving after every step and keeping
/// two checkpoints: its output, its run directory (and the directory holding both).
fn train_diverging(lr: &str) -> (Output, PathBuf, tempfile::TempDir) {
    let tmp = tempfile::tempdir().unwrap();
    let text = suite_text("fp32", 32, "{max_steps: 8, save_every: 1, keep_last: 2}")
        .replace("lr: 0.003", &format!("lr: {lr}"));
    let suite = write_suite(tmp.path(), &text);
    let run = tmp.path().join("run");
    (train_output(&suite, &run, None, 8), run, tmp)
}

#[test]
fn a_diverging_run_stops_before_saving_non_finite_numbers() {
    // Step 0 is finite and saved; its update makes step 1's loss non-finite.
    let (out, run, _tmp) = train_diverging("1.0e30");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_contains(
        &err,
        &["step 1's loss is", "training diverged", "step-00000001"],
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 2);
    assert_eq!(checkpoint::list(&run).unwrap(), [run.join("step-00000001")]);
    assert_eq!(verify_status(&run), Some(0));

    // An update past f32's range: step 0's loss is finite, the weights it leaves are not.
    let (out, run, _tmp) = train_diverging("1.0e39");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_contains(
        &err,
        &[
            "the weights step 0 left hold a non-finite number",
            "holds no checkpoint",
        ],
    );
    assert_eq!(checkpoint::list(&run).unwrap(), Vec::<PathBuf>::new());
}

#[test]
fn resuming_nothing_or_training_nothing_is_refused_with_what_to_do() {
    let (tmp, suite, run) = run_saving_every_step(4);
    let empty = tmp.path().join("nock");
    std::fs::create_dir(&empty).unwrap();
    let out = train_output(&suite, &tmp.path().join("new"), Some(&empty), 4);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_contains(&stderr(&out), &[arg(&empty), "holds no checkpoint"]);

    for (resume, steps, at) in [
        (Some(&run), 3, "step 4"),
        (Some(&run), 4, "step 4"),
        (None, 0, "step 0"),
    ] {
        let out = train_output(
            &suite,
            &tmp.path().join("more"),
            resume.map(|r| r.as_path()),
            steps,
        );
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert_contains(
            &stderr(&out),
            &[
                &format!("--steps is {steps}"),
                at,
                "nothing would be trained",
            ],
        );
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn a_format_version_edited_down_is_damage_and_an_unprotected_resume_warns() {
    let (_tmp, suite, run) = run_saving_every_step(4);
    let sidecar = |step: &Path| step.join(format!("{STATE_FILE}.sha256"));
    // The version edited down to bypass the sidecar, and the loader's position edited.
    let step4 = run.join("step-00000004");
    std::fs::remove_file(sidecar(&step4)).unwrap();
    hand_edit_state(&step4, |s| {
        s["format_version"] = 1.into();
        s["loader"]["position"] = 1.into();
    });
    verify_says(&step4, 1, &["DAMAGED", STATE_FILE, "environment"]);
    let out = train_output(&suite, &run.join("more"), Some(&step4), 6);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_contains(&stderr(&out), &["format version 1", "environment"]);

    // A state file as version 1 wrote it: no sidecar, no execution record. It resumes, warned.
    let step3 = run.join("step-00000003");
    std::fs::remove_file(sidecar(&step3)).unwrap();
    hand_edit_state(&step3, |s| {
        s["format_version"] = 1.into();
        s.as_object_mut().unwrap().remove("environment");
    });
    let out = train_output(&suite, &run.join("again"), Some(&step3), 5);
    assert!(out.status.success(), "{}", stderr(&out));
    let warning = stderr(&out);
    assert!(
        warning
            .lines()
            .any(|l| l.starts_with("warning:") && l.contains("unprotected")),
        "{warning}"
    );
}

#[test]
fn train_names_the_place_of_an_impossible_value() {
    let tmp = tempfile::tempdir().unwrap();
    let text = suite_text("fp32", 32, "{max_steps: 4}").replace("lr: 0.003", "lr: .nan");
    let suite = write_suite(tmp.path(), &text);
    let out = train_output(&suite, &tmp.path().join("run"), None, 2);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let place = format!(
        "{}:9:13: invalid configuration: optimizer.lr is NaN",
        arg(&suite)
    );
    assert_contains(&stderr(&out), &[&place]);
}

#[test]
fn an_out_that_is_not_a_directory_is_refused_with_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = write_suite(tmp.path(), &suite_text("fp32", 32, "{max_steps: 4}"));
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let dangling = tmp.path().join("dangling");
    std::os::unix::fs::symlink(tmp.path().join("nowhere"), &dangling).unwrap();
    for out in [file, dangling] {
        let refused = train_output(&suite, &out, None, 2);
        assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
        assert_contains(&stderr(&refused), &[arg(&out), "--out is not a directory"]);
    }
}
