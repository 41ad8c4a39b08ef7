//! Old checkpoints keep loading: every directory of `golden/checkpoints/` holds a checkpoint
//! frozen when it was written (it stands for one a user has on disk), the suite it was trained
//! with, and the loss, gradient norm and learning rate of the steps that followed it. Each is
//! resumed on the CPU and must continue bit for bit; a format change keeps them loading with a
//! migration, never by regenerating them (see `golden/checkpoints/README.md`).
//!
//! `GOLDEN_FREEZE=<name> cargo test -p ckpt-harness --test golden_checkpoints -- --ignored
//! freeze` freezes a new one from `golden/checkpoints/<name>/suite.yaml`.

#[allow(dead_code)]
mod common;

use ckpt_engine::checkpoint::state::FORMAT_VERSION;
use ckpt_engine::checkpoint::{files, state_file, MODEL_FILE, STATE_FILE};
use ckpt_engine::{CpuDevice, Device, StepStats, TrainConfig, Trainer};
use ckpt_harness::suite::Suite;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The fewest frozen checkpoints `golden/checkpoints/` may hold: deleting one fails the test.
const GOLDEN_COUNT: usize = 8;
/// The suite a frozen checkpoint was trained with.
const SUITE_FILE: &str = "suite.yaml";
/// The steps that followed a frozen checkpoint.
const LOSSES_FILE: &str = "losses.json";

/// `losses.json`: what followed a frozen checkpoint.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Record {
    /// The `format_version` of the checkpoint's `trainer_state.json`.
    format_version: u32,
    /// The checkpoint's directory, beside `losses.json`.
    checkpoint: String,
    /// The CPU matrix kernels the steps were trained with (see [`cpu_kernels`]).
    cpu_kernels: String,
    /// The steps trained after it, in order.
    steps: Vec<StepRecord>,
}

/// One step after a frozen checkpoint: each value exactly, as its IEEE bits in hex, and in
/// decimal for people to read (the bits are what is compared).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StepRecord {
    /// The step's 0-based index.
    step: u64,
    /// Mean loss (f32).
    loss: f32,
    /// `loss`'s bits.
    loss_bits: String,
    /// Gradient norm before clipping (f64).
    grad_norm: f64,
    /// `grad_norm`'s bits.
    grad_norm_bits: String,
    /// Learning rate applied (f64).
    lr: f64,
    /// `lr`'s bits.
    lr_bits: String,
}

/// One value of a step: its name, what the record holds and what was trained now.
struct Value {
    name: &'static str,
    /// The record's bits, in hex.
    recorded_bits: String,
    /// The record's decimal.
    recorded: String,
    /// The bits trained now.
    got_bits: u64,
    /// Hex digits of the value's bits.
    width: usize,
    /// The decimal of a bit pattern of the value's type.
    decimal: fn(u64) -> String,
}

impl Value {
    fn f32(name: &'static str, recorded_bits: &str, recorded: f32, got: f32) -> Self {
        Value {
            name,
            recorded_bits: recorded_bits.to_string(),
            recorded: recorded.to_string(),
            got_bits: got.to_bits().into(),
            width: 8,
            decimal: |b| f32::from_bits(b as u32).to_string(),
        }
    }

    fn f64(name: &'static str, recorded_bits: &str, recorded: f64, got: f64) -> Self {
        Value {
            name,
            recorded_bits: recorded_bits.to_string(),
            recorded: recorded.to_string(),
            got_bits: got.to_bits(),
            width: 16,
            decimal: |b| f64::from_bits(b).to_string(),
        }
    }

    /// `Err` naming the value and both bit patterns and decimals unless they agree; also when
    /// the record's bits are not hex or disagree with the decimal beside them.
    fn check(&self) -> Result<(), String> {
        let Value {
            name,
            recorded_bits,
            recorded,
            got_bits,
            width,
            decimal,
        } = self;
        let want = u64::from_str_radix(recorded_bits, 16)
            .ok()
            .filter(|_| recorded_bits.len() == *width)
            .ok_or_else(|| format!("{name}_bits is {recorded_bits:?}, not {width} hex digits"))?;
        if want != *got_bits {
            return Err(format!(
                "{name} is {} (bits {got_bits:0width$x}) where {LOSSES_FILE} records {} (bits {want:0width$x})",
                decimal(*got_bits),
                decimal(want),
            ));
        }
        if decimal(want) != *recorded {
            return Err(format!(
                "{name}_bits {recorded_bits} is {}, but the decimal beside it is {recorded}: the record was edited",
                decimal(want),
            ));
        }
        Ok(())
    }
}

impl StepRecord {
    /// The record of the step `s`.
    fn of(s: &StepStats) -> Self {
        StepRecord {
            step: s.step,
            loss: s.loss,
            loss_bits: format!("{:08x}", s.loss.to_bits()),
            grad_norm: s.grad_norm,
            grad_norm_bits: format!("{:016x}", s.grad_norm.to_bits()),
            lr: s.lr,
            lr_bits: format!("{:016x}", s.lr.to_bits()),
        }
    }

    /// `Err` naming the first value of `s` that differs from this record.
    fn check(&self, s: &StepStats) -> Result<(), String> {
        if s.step != self.step {
            return Err(format!(
                "trained step {} where step {} is recorded",
                s.step, self.step
            ));
        }
        [
            Value::f32("loss", &self.loss_bits, self.loss, s.loss),
            Value::f64(
                "grad_norm",
                &self.grad_norm_bits,
                self.grad_norm,
                s.grad_norm,
            ),
            Value::f64("lr", &self.lr_bits, self.lr, s.lr),
        ]
        .iter()
        .try_for_each(Value::check)
    }
}

/// A frozen checkpoint, read from its directory.
struct Golden {
    /// Its directory.
    dir: PathBuf,
    /// The suite it was trained with.
    suite: Suite,
    /// What followed it.
    record: Record,
}

/// The record of the steps after a frozen checkpoint made on CPUs whose matrix kernels are
/// `kernels`, beside the one it was frozen with (`losses.json`): `losses.<kernels>.json`, spaces
/// as `-`.
fn kernels_record_file(kernels: &str) -> String {
    format!("losses.{}.json", kernels.replace(' ', "-"))
}

/// Reads the record `file` of the frozen checkpoint in `dir`.
fn read_record(dir: &Path, file: &str) -> Result<Record, String> {
    let at = |e: String| format!("{}: {e}", shown(dir));
    let text = std::fs::read(dir.join(file)).map_err(|e| at(format!("{file}: {e}")))?;
    let record: Record = serde_json::from_slice(&text)
        .map_err(|e| at(format!("{file} is not a record of steps: {e}")))?;
    if record.steps.is_empty() {
        return Err(at(format!("{file} records no steps")));
    }
    Ok(record)
}

impl Golden {
    /// Reads the frozen checkpoint in `dir` with the record of this CPU's matrix kernels where
    /// it has one, else the one it was frozen with; `Err` names the directory and what is
    /// missing or inconsistent.
    fn open(dir: &Path) -> Result<Self, String> {
        let at = |e: String| format!("{}: {e}", shown(dir));
        let suite = Suite::load(&dir.join(SUITE_FILE)).map_err(|e| at(format!("{e:#}")))?;
        let frozen = read_record(dir, LOSSES_FILE)?;
        let here = kernels_record_file(&cpu_kernels());
        let record = if dir.join(&here).exists() {
            let record = read_record(dir, &here)?;
            if record.cpu_kernels != cpu_kernels()
                || record.checkpoint != frozen.checkpoint
                || record.format_version != frozen.format_version
            {
                return Err(at(format!(
                    "{here} records the {} kernels after {} (format {}), not the {} kernels after {} (format {}) that its name and {LOSSES_FILE} say",
                    record.cpu_kernels,
                    record.checkpoint,
                    record.format_version,
                    cpu_kernels(),
                    frozen.checkpoint,
                    frozen.format_version
                )));
            }
            record
        } else {
            frozen
        };
        Ok(Golden {
            dir: dir.to_path_buf(),
            suite,
            record,
        })
    }

    /// The frozen checkpoint's directory.
    fn checkpoint(&self) -> PathBuf {
        self.dir.join(&self.record.checkpoint)
    }

    /// Resumes the checkpoint with `train` on the CPU and trains the recorded steps: `Err` names
    /// the directory, the step and both values of the first difference, or why it did not load.
    fn replay(&self, train: TrainConfig) -> Result<(), String> {
        let at = |e: String| format!("{}: {e}", shown(&self.dir));
        let ckpt = self.checkpoint();
        let version = recorded_version(&ckpt).map_err(at)?;
        if version != self.record.format_version {
            return Err(at(format!(
                "{}/{STATE_FILE} has format_version {version} where {LOSSES_FILE} records {}",
                self.record.checkpoint, self.record.format_version
            )));
        }
        let dev =
            CpuDevice::new(self.suite.file.threads, u64::MAX).map_err(|e| at(e.to_string()))?;
        let mut trainer = Trainer::resume(train, dev, &ckpt)
            .map_err(|e| at(format!("the frozen checkpoint no longer loads: {e}")))?;
        for want in &self.record.steps {
            let got = trainer
                .step()
                .map_err(|e| at(format!("step {}: {e}", want.step)))?;
            want.check(&got).map_err(|e| {
                let mut e = at(format!("step {}: {e}", want.step));
                let here = cpu_kernels();
                if here != self.record.cpu_kernels {
                    e += &format!(" (recorded with the {} matrix kernels, trained here with the {here} ones: the gemm crate picks them by instruction set, and some small products sum in another order; see golden/checkpoints/README.md)", self.record.cpu_kernels);
                }
                e
            })?;
        }
        Ok(())
    }
}

/// The `format_version` in the `trainer_state.json` of the checkpoint `ckpt`.
fn recorded_version(ckpt: &Path) -> Result<u32, String> {
    let path = ckpt.join(STATE_FILE);
    let text = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let state: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    state["format_version"]
        .as_u64()
        .and_then(|v| u32::try_from(v).ok())
        .ok_or_else(|| format!("{}: no format_version", path.display()))
}

/// The matrix kernels the `gemm` crate picks on this CPU (the CPU device records them in its
/// checkpoints). Products can sum in a different order from one to another, so recorded bits
/// hold for the kernels they were recorded with.
fn cpu_kernels() -> String {
    ckpt_harness::checks::golden::environment("cpu").unwrap()
}

/// `dir` relative to the repository's root where it lies under it.
fn shown(dir: &Path) -> String {
    let root = common::root().canonicalize().unwrap();
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    dir.strip_prefix(&root)
        .unwrap_or(&dir)
        .display()
        .to_string()
}

/// `golden/checkpoints/`.
fn golden_root() -> PathBuf {
    common::root().join("golden/checkpoints")
}

/// The frozen checkpoint directories, by name.
fn golden_dirs() -> Vec<PathBuf> {
    let root = golden_root();
    let entries = std::fs::read_dir(&root).unwrap_or_else(|e| panic!("{}: {e}", root.display()));
    let mut dirs: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// The frozen checkpoint `golden/checkpoints/<name>`.
fn golden(name: &str) -> Golden {
    Golden::open(&golden_root().join(name)).unwrap()
}

#[test]
fn every_frozen_checkpoint_resumes_bit_for_bit() {
    let dirs = golden_dirs();
    let names: Vec<String> = dirs
        .iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert!(
        dirs.len() >= GOLDEN_COUNT,
        "{} holds {} frozen checkpoints ({}), not the {GOLDEN_COUNT} or more expected: they stand for checkpoints users have on disk, so none may be deleted (see its README.md)",
        shown(&golden_root()),
        dirs.len(),
        names.join(", "),
    );
    let failures: Vec<String> = dirs
        .iter()
        .filter_map(|dir| {
            Golden::open(dir)
                .and_then(|g| g.replay(g.suite.train.clone()))
                .err()
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} frozen checkpoints no longer continue as recorded. Never regenerate them to pass: a format change adds a migration that keeps them loading (see golden/checkpoints/README.md).\n{}",
        failures.len(),
        dirs.len(),
        failures.join("\n"),
    );
}

#[test]
fn the_current_format_version_has_a_frozen_checkpoint() {
    let versions: Vec<u32> = golden_dirs()
        .iter()
        .map(|d| Golden::open(d).unwrap().record.format_version)
        .collect();
    assert!(
        versions.contains(&FORMAT_VERSION),
        "no checkpoint in golden/checkpoints/ has format version {FORMAT_VERSION}, the one this build writes (they have {versions:?}): freeze one (see its README.md)"
    );
}

#[test]
fn a_frozen_execution_record_reads_back_and_a_resume_lists_what_differs_here() {
    let g = golden("llama-fp32-environment");
    let ckpt = g.checkpoint();
    let saved = state_file::read(&ckpt).unwrap().state.environment;
    let saved = saved.expect("the frozen checkpoint records its execution environment");
    assert_eq!(
        (saved.backend.as_str(), saved.cpu_kernels.as_deref()),
        ("cpu", Some(g.record.cpu_kernels.as_str()))
    );
    let dev = CpuDevice::new(g.suite.file.threads, u64::MAX).unwrap();
    let trainer = Trainer::resume(g.suite.train.clone(), dev.clone(), &ckpt).unwrap();
    assert_eq!(trainer.env_changes(), saved.changes(&dev.execution_env()));
    let here = cpu_kernels();
    let kernels_differ = trainer
        .env_changes()
        .iter()
        .any(|c| c.field == "cpu_kernels" && c.now == here);
    assert_eq!(kernels_differ, here != g.record.cpu_kernels);
    let old = golden("llama-fp32");
    let dev = CpuDevice::new(old.suite.file.threads, u64::MAX).unwrap();
    let trainer = Trainer::resume(old.suite.train.clone(), dev, &old.checkpoint()).unwrap();
    assert!(
        trainer.env_changes().is_empty(),
        "a checkpoint written before the record lists nothing"
    );
}

/// The message of a replay expected to fail.
fn replay_error(g: &Golden, train: TrainConfig) -> String {
    match g.replay(train) {
        Ok(()) => panic!("{} replayed as recorded", shown(&g.dir)),
        Err(e) => e,
    }
}

fn assert_contains(err: &str, parts: &[&str]) {
    for p in parts {
        assert!(err.contains(p), "expected {p:?} in: {err}");
    }
}

/// Writes `record` as the record of this CPU's kernels into the frozen checkpoint copy `g`.
fn write_kernels_record(g: &Golden, record: &Record) -> String {
    let file = kernels_record_file(&cpu_kernels());
    std::fs::write(g.dir.join(&file), serde_json::to_string(record).unwrap()).unwrap();
    file
}

#[test]
fn the_record_of_this_cpu_s_kernels_is_the_one_replayed() {
    let (_tmp, g) = copy_of("llama-fp32");
    let mut record = read_record(&g.dir, LOSSES_FILE).unwrap();
    record.cpu_kernels = cpu_kernels();
    let s = &mut record.steps[1];
    let step = s.step;
    let off = f32::from_bits(u32::from_str_radix(&s.loss_bits, 16).unwrap() ^ 1);
    s.loss = off;
    s.loss_bits = format!("{:08x}", off.to_bits());
    let bits = s.loss_bits.clone();
    write_kernels_record(&g, &record);
    let g = Golden::open(&g.dir).unwrap();
    let err = replay_error(&g, g.suite.train.clone());
    assert_contains(&err, &[&format!("step {step}: loss"), &bits]);
}

#[test]
fn a_kernels_record_of_other_kernels_than_its_name_is_refused() {
    let (_tmp, g) = copy_of("llama-fp32");
    let mut record = read_record(&g.dir, LOSSES_FILE).unwrap();
    record.cpu_kernels = "riscv64 scalar".into();
    let file = write_kernels_record(&g, &record);
    let err = Golden::open(&g.dir)
        .err()
        .expect("a mislabelled record is refused");
    assert_contains(&err, &[&file, "riscv64 scalar", &cpu_kernels()]);
}

#[test]
fn a_recorded_loss_one_bit_off_is_named_with_both_values() {
    let mut g = golden("llama-fp32");
    let s = &mut g.record.steps[2];
    let (step, true_bits) = (s.step, s.loss_bits.clone());
    let off = f32::from_bits(u32::from_str_radix(&true_bits, 16).unwrap() ^ 1);
    let off_bits = format!("{:08x}", off.to_bits());
    s.loss = off;
    s.loss_bits = off_bits.clone();
    let err = replay_error(&g, g.suite.train.clone());
    assert_contains(
        &err,
        &[
            "llama-fp32",
            &format!("step {step}: loss"),
            &true_bits,
            &off_bits,
        ],
    );
}

#[test]
fn an_edited_decimal_is_named() {
    let mut g = golden("llama-fp32");
    g.record.steps[0].grad_norm *= 2.0;
    let err = replay_error(&g, g.suite.train.clone());
    assert_contains(
        &err,
        &["llama-fp32", "grad_norm_bits", "the record was edited"],
    );
}

#[test]
fn a_resume_that_restarts_the_dropout_generator_is_caught() {
    let g = golden("llama-dropout-fp32");
    let mut train = g.suite.train.clone();
    train.faults = serde_json::from_value(serde_json::json!(["rng_not_restored"])).unwrap();
    let err = replay_error(&g, train);
    assert_contains(&err, &["llama-dropout-fp32", "step 4: loss"]);
}

#[test]
fn a_run_of_another_configuration_is_refused() {
    let g = golden("llama-fp32");
    let mut train = g.suite.train.clone();
    train.optimizer.lr *= 2.0;
    let err = replay_error(&g, train);
    assert_contains(
        &err,
        &[
            "llama-fp32",
            "no longer loads",
            "another run configuration",
            "optimizer.lr",
        ],
    );
}

/// A copy of the frozen checkpoint `name` in a temporary directory.
fn copy_of(name: &str) -> (tempfile::TempDir, Golden) {
    let tmp = tempfile::tempdir().unwrap();
    let g = golden(name);
    let dir = tmp.path().join(name);
    copy_dir(&g.dir, &dir);
    (tmp, Golden::open(&dir).unwrap())
}

/// Copies the files of `from` and of its subdirectories into `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let dest = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_dir(&path, &dest);
        } else {
            std::fs::copy(&path, &dest).unwrap();
        }
    }
}

/// Flips a bit of the first element of `tensor` in the safetensors file at `path`: a mantissa
/// bit worth about 1% of an f32's value.
fn flip_weight_bit(path: &Path, tensor: &str) {
    let mut bytes = std::fs::read(path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    assert_eq!(
        header[tensor]["dtype"],
        "F32",
        "{tensor} in {}",
        path.display()
    );
    let start = header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + header_len + start + 2] ^= 1;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn one_changed_byte_of_the_weights_is_caught() {
    let (_tmp, g) = copy_of("llama-fp32");
    let ckpt = g.checkpoint();
    let weights = ckpt.join(MODEL_FILE);
    flip_weight_bit(&weights, "model.norm.weight");
    // As it stands, the file's checksum refuses it.
    let err = replay_error(&g, g.suite.train.clone());
    assert_contains(&err, &["no longer loads", MODEL_FILE, "checksum mismatch"]);
    // With its checksums rewritten to match, it loads, and the losses show the change.
    let path = ckpt.join(STATE_FILE);
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let record = files::record(&std::fs::read(&weights).unwrap());
    state["files"][MODEL_FILE] = serde_json::to_value(record).unwrap();
    std::fs::write(&path, serde_json::to_vec_pretty(&state).unwrap()).unwrap();
    state_file::reseal(&ckpt).unwrap();
    let err = replay_error(&g, g.suite.train.clone());
    assert_contains(&err, &["llama-fp32", "step 4: loss"]);
}

/// Writes `record` as `file` of the frozen checkpoint in `dir` and checks that the checkpoint
/// replays it here.
fn write_record(dir: &Path, file: &str, record: &Record) {
    let mut json = serde_json::to_string_pretty(record).unwrap();
    json.push('\n');
    std::fs::write(dir.join(file), json).unwrap();
    let g = Golden::open(dir).unwrap();
    g.replay(g.suite.train.clone()).unwrap();
}

/// Records what this build trains after the frozen checkpoint `golden/checkpoints/$GOLDEN_RECORD`
/// on this CPU, whose matrix kernels differ from those it was frozen with, into
/// `losses.<kernels>.json`: from then on the test holds runs on such CPUs to it (README.md, "On
/// another CPU"). It refuses where the frozen record's kernels are this CPU's, or a record of
/// them exists: a record is never regenerated.
#[test]
#[ignore = "writes golden/checkpoints/$GOLDEN_RECORD/losses.<kernels>.json; run only on a CPU of other kernels"]
fn record_here() {
    let Ok(name) = std::env::var("GOLDEN_RECORD") else {
        eprintln!("GOLDEN_RECORD is not set: nothing to record");
        return;
    };
    let dir = golden_root().join(&name);
    let frozen = read_record(&dir, LOSSES_FILE).unwrap();
    let (here, file) = (cpu_kernels(), kernels_record_file(&cpu_kernels()));
    assert_ne!(
        frozen.cpu_kernels,
        here,
        "{} was frozen with this CPU's kernels",
        shown(&dir)
    );
    assert!(
        !dir.join(&file).exists(),
        "{} already holds {file}: a record is never regenerated",
        shown(&dir)
    );
    let suite = Suite::load(&dir.join(SUITE_FILE)).unwrap();
    let dev = CpuDevice::new(suite.file.threads, u64::MAX).unwrap();
    let ckpt = dir.join(&frozen.checkpoint);
    let mut trainer = Trainer::resume(suite.train.clone(), dev, &ckpt).unwrap();
    let steps = frozen
        .steps
        .iter()
        .map(|_| StepRecord::of(&trainer.step().unwrap()))
        .collect();
    let record = Record {
        cpu_kernels: here,
        steps,
        ..frozen
    };
    write_record(&dir, &file, &record);
    eprintln!("recorded {}/{file}", shown(&dir));
}

/// Freezes `golden/checkpoints/$GOLDEN_FREEZE/` from the `suite.yaml` written there: trains
/// `training.resume_from` steps on the CPU, copies the checkpoint saved then, trains on to
/// `training.max_steps` recording each step in `losses.json`, and checks that the frozen copy
/// replays them. It refuses a directory that already holds anything else: a frozen checkpoint
/// is never regenerated.
#[test]
#[ignore = "writes golden/checkpoints/$GOLDEN_FREEZE; run only to add a frozen checkpoint"]
fn freeze() {
    let Ok(name) = std::env::var("GOLDEN_FREEZE") else {
        eprintln!("GOLDEN_FREEZE is not set: nothing to freeze");
        return;
    };
    let dir = golden_root().join(&name);
    let others: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}; write its {SUITE_FILE} first", shown(&dir)))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != SUITE_FILE)
        .collect();
    assert!(
        others.is_empty(),
        "{} already holds {}: a frozen checkpoint is never regenerated (see golden/checkpoints/README.md)",
        shown(&dir),
        others.join(", ")
    );
    let suite = Suite::load(&dir.join(SUITE_FILE)).unwrap();
    let dev = CpuDevice::new(suite.file.threads, u64::MAX).unwrap();
    let mut trainer = Trainer::new(suite.train.clone(), dev).unwrap();
    while trainer.step_index() < suite.resume_from() {
        trainer.step().unwrap();
    }
    let run = tempfile::tempdir().unwrap();
    let saved = trainer.save(run.path(), None).unwrap();
    let checkpoint = saved.file_name().unwrap().to_string_lossy().into_owned();
    copy_dir(&saved, &dir.join(&checkpoint));
    let mut steps = Vec::new();
    while trainer.step_index() < suite.max_steps() {
        steps.push(StepRecord::of(&trainer.step().unwrap()));
    }
    let record = Record {
        format_version: FORMAT_VERSION,
        checkpoint,
        cpu_kernels: cpu_kernels(),
        steps,
    };
    write_record(&dir, LOSSES_FILE, &record);
    eprintln!("froze {}", shown(&dir));
}
