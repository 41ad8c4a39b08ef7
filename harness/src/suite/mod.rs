//! Suites: one YAML file per model configuration, describing a training run and how the
//! harness exercises it. Every error names `file:line:column` and what to write instead.

use crate::checks::Check;
use crate::devices::DeviceKind;
use anyhow::{bail, Result};
use ckpt_engine::config::{Init, Precision, TrainConfig};
use ckpt_engine::data::{DataConfig, LongBatch};
use ckpt_engine::fault::Fault;
use ckpt_engine::model::loss::LossKind;
use ckpt_engine::optim::{AdamWConfig, Schedule};
use ckpt_engine::parallel::Parallel;
use ckpt_engine::validation::ValidationConfig;
use ckpt_engine::{regular_file, Checkpointing, EngineError, LlamaConfig, Setting};
use engine::CommandEngine;
use places::{place, yaml_error, Places};
use serde::de;
use serde::{Deserialize, Deserializer, Serialize};
use serde_saphyr::{Location, Spanned};
use std::path::{Path, PathBuf};

pub mod engine;
mod expectations;
mod memory;
mod model;
mod parallel;
mod places;
mod size;
mod training;

pub use crate::checks::spec::{ChecksSpec, Continuity, ContinuitySetting, Tolerance};
pub use memory::{Budget, MemorySpec};
pub use model::ModelSpec;
pub use parallel::ParallelSpec;
pub use training::{ResumeFrom, ScheduleSpec, Training};

/// What a suite path must be, for the message refusing a FIFO, a device or a directory.
const SUITE_FILE: &str = "the path of a suite file (YAML)";

/// A suite name, which names trials and golden snapshot files: `[A-Za-z0-9._-]+`.
fn suite_name<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let name = String::deserialize(d)?;
    let allowed = |c: char| c.is_ascii_alphanumeric() || "._-".contains(c);
    if name.is_empty() || !name.chars().all(allowed) {
        return Err(de::Error::custom(format!(
            "name {name:?} may hold only letters, digits, '.', '_' and '-' (it names the trials and the golden snapshot files); write e.g. name: tiny-fp32"
        )));
    }
    Ok(name)
}

/// The most worker threads a suite may ask for: more than the cores of any machine it runs on,
/// far fewer than would take minutes to start.
const MAX_THREADS: usize = 1024;

fn default_threads() -> usize {
    2
}
fn default_devices() -> Spanned<Vec<DeviceKind>> {
    Spanned::new(
        DeviceKind::ALL.to_vec(),
        Location::UNKNOWN,
        Location::UNKNOWN,
    )
}
/// Which runs a suite belongs to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Every test run (`cargo test`, CI).
    #[default]
    Ci,
    /// The nightly run only.
    Nightly,
}

/// A suite file as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SuiteFile {
    /// The suite's name, used in trial names (`cpu::<name>`) and snapshot files:
    /// `[A-Za-z0-9._-]+`, unique among the suites of a run.
    #[serde(deserialize_with = "suite_name")]
    pub name: String,
    /// `ci` (every test run, the default) or `nightly`.
    #[serde(default)]
    pub tier: Tier,
    /// Devices to run on; both `cpu` and `cuda` by default.
    #[serde(default = "default_devices")]
    pub devices: Spanned<Vec<DeviceKind>>,
    /// Model shape.
    pub model: ModelSpec,
    /// Initial weights; seeded random (seed 0) when absent.
    #[serde(default)]
    pub init: Option<Init>,
    /// Step arithmetic.
    #[serde(default)]
    pub precision: Precision,
    /// Samples.
    pub data: DataConfig,
    /// Rows per batch.
    pub batch_size: usize,
    /// Tokens per row.
    pub seq_len: usize,
    /// Seed of the data order.
    #[serde(default)]
    pub shuffle_seed: u64,
    /// Optimizer.
    pub optimizer: AdamWConfig,
    /// Learning-rate schedule; constant when absent.
    #[serde(default)]
    pub schedule: Option<ScheduleSpec>,
    /// Activation checkpointing.
    #[serde(default)]
    pub checkpointing: Checkpointing,
    /// How logits are held.
    #[serde(default)]
    pub loss: Option<LossKind>,
    /// Residual dropout probability (0 turns it off).
    #[serde(default)]
    pub dropout: f32,
    /// Longer rows from a given step on: `{from_step, seq_len}`.
    #[serde(default)]
    pub long_batch: Option<LongBatch>,
    /// A validation split, `{share: F}` or `{path: FILE}`, evaluated after every `every` steps
    /// and after `max_steps`; `batches` caps the micro-batches an evaluation reads.
    #[serde(default)]
    pub validation: Option<ValidationConfig>,
    /// Run length and saves.
    pub training: Training,
    /// CPU worker threads (shared out among the ranks of a data-parallel phase).
    #[serde(default = "default_threads")]
    pub threads: usize,
    /// Data parallelism: the ranks of each phase and what they shard; one rank when absent.
    #[serde(default)]
    pub parallel: Option<ParallelSpec>,
    /// Capacity and budgets.
    #[serde(default)]
    pub memory: MemorySpec,
    /// Which checks run and how.
    #[serde(default)]
    pub checks: ChecksSpec,
    /// Engine faults to inject (negative controls).
    #[serde(default)]
    pub faults: Vec<Fault>,
    /// Another trainer, run as a command for each phase instead of the built-in engine; its
    /// record is judged by the checks.
    #[serde(default)]
    pub engine: Option<CommandEngine>,
    /// The checks that must fail: the trial passes only when exactly these fail.
    #[serde(default)]
    pub expect_fail: Option<Spanned<Vec<Check>>>,
    /// The checks that must have nothing to compare (`not_run`), such as those an
    /// out-of-memory leaves without resumed steps: the trial passes only when exactly these did
    /// not run.
    #[serde(default)]
    pub expect_not_run: Option<Spanned<Vec<Check>>>,
}

/// A parsed, validated suite.
#[derive(Clone, Debug)]
pub struct Suite {
    /// Where it was read from.
    pub path: PathBuf,
    /// The file's content.
    pub file: SuiteFile,
    /// The engine configuration it describes.
    pub train: TrainConfig,
    /// Where each of its keys is written.
    places: Places,
}

/// The checks a list names, in report order.
fn in_report_order(list: &Option<Spanned<Vec<Check>>>) -> Vec<Check> {
    let listed = list.as_ref().map_or(&[][..], |e| &e.value[..]);
    Check::ALL
        .into_iter()
        .filter(|c| listed.contains(c))
        .collect()
}

/// An engine's configuration key as a suite spells it: the run's shape and data are written at
/// the top, as the engine names them, but `accumulation` under `training`.
fn suite_key(engine_key: &str) -> std::borrow::Cow<'_, str> {
    match engine_key.strip_prefix("accumulation") {
        Some(rest) => format!("training.accumulation{rest}").into(),
        None => engine_key.into(),
    }
}

impl Suite {
    /// Its trial name on `device`: `cpu::tiny-fp32`; suites in a `faults` directory are
    /// `cpu::faults::<name>`.
    pub fn trial_name(&self, device: DeviceKind) -> String {
        let in_faults = self
            .path
            .parent()
            .and_then(|p| p.file_name())
            .is_some_and(|n| n == "faults");
        if in_faults {
            format!("{device}::faults::{}", self.file.name)
        } else {
            format!("{device}::{}", self.file.name)
        }
    }

    /// Reads and validates a suite file (a regular file: a FIFO or a device is refused unread).
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = regular_file::read(path, SUITE_FILE)?;
        let text = places::utf8_text(path, bytes).map_err(anyhow::Error::msg)?;
        Self::parse(path, &text)
    }

    /// Parses suite text read from `path` (used in messages and to resolve relative paths).
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let file: SuiteFile = serde_saphyr::from_str(text)
            .map_err(|e| anyhow::anyhow!(yaml_error(path, text, &e)))?;
        let places = Places::of(path, text);
        let base = path.parent().unwrap_or(Path::new("."));
        let model = match &file.model {
            ModelSpec::Inline(cfg) => cfg.clone(),
            ModelSpec::Path(p) => LlamaConfig::from_hf_file(&base.join(p)).map_err(|e| {
                anyhow::anyhow!(
                    "{}: model: {e}; write the path of a Hugging Face config.json relative to the suite file, or the model's keys inline",
                    places.value("model")
                )
            })?,
        };
        let problem = model.validate().err().or_else(|| {
            let longest = file.long_batch.map_or(0, |l| l.seq_len).max(file.seq_len);
            (model.max_position_embeddings == 0).then(|| {
                Setting::new("max_position_embeddings", format!("max_position_embeddings is 0; write max_position_embeddings: {longest} or more (the longest row the suite trains on)"))
            })
        });
        let problem = problem.or_else(|| {
            let cpu = file.devices.value.contains(&DeviceKind::Cpu);
            let capacity = file.memory.capacity.as_ref().map(|c| c.value);
            let host = ckpt_engine::memory::host_available();
            size::too_large(&model, file.precision, cpu, capacity, host)
        });
        if let Some(m) = problem {
            bail!("{}: model: {m}", places.key(&format!("model.{}", m.key)));
        }
        Self::validate(path, &places, &file, &model)?;
        let t = &file.training;
        let schedule = match &file.schedule {
            None => Schedule::Constant,
            Some(s) => Schedule::WarmupCosine {
                warmup_steps: s.warmup_steps,
                horizon: t.max_steps.value,
                min_lr_ratio: s.min_lr_ratio,
            },
        };
        let data = match &file.data {
            DataConfig::TokenFile { path: p, dtype } => DataConfig::TokenFile {
                path: base.join(p),
                dtype: *dtype,
            },
            DataConfig::Text(text) => DataConfig::Text(text.relative_to(base)),
            other => other.clone(),
        };
        let init = match &file.init {
            Some(Init::HfDir { path: p }) => Init::HfDir { path: base.join(p) },
            Some(other) => other.clone(),
            None => Init::Random { seed: 0, std: 0.02 },
        };
        let train = TrainConfig {
            model,
            init,
            precision: file.precision,
            optimizer: file.optimizer.clone(),
            schedule,
            data,
            batch_size: file.batch_size,
            accumulation: t.accumulation.unwrap_or(1),
            seq_len: file.seq_len,
            shuffle_seed: file.shuffle_seed,
            checkpointing: file.checkpointing,
            loss: file.loss.unwrap_or(LossKind::Standard),
            dropout: file.dropout,
            long_batch: file.long_batch,
            faults: file.faults.iter().copied().collect(),
            parallel: file
                .parallel
                .as_ref()
                .map_or_else(Default::default, |p| Parallel {
                    world_size: p.world_size,
                    shard: p.shard,
                    checkpoints: p.checkpoints,
                    transport: p.transport,
                }),
            validation: file.validation.as_ref().map(|v| ValidationConfig {
                end: Some(t.max_steps.value),
                ..v.relative_to(base)
            }),
        };
        Ok(Suite {
            path: path.to_path_buf(),
            file,
            train,
            places,
        })
    }

    fn validate(path: &Path, places: &Places, file: &SuiteFile, model: &LlamaConfig) -> Result<()> {
        if let Some(engine) = &file.engine {
            Self::validate_engine(places, file, engine)?;
        }
        let t = &file.training;
        let max_steps = t.max_steps.value;
        if max_steps < 2 {
            bail!(
                "{}: training.max_steps is {max_steps}; write at least 2",
                place(path, t.max_steps.referenced)
            );
        }
        if let Some(r) = &t.resume_from {
            Self::validate_resume_from(path, r, max_steps)?;
        }
        if t.extra_steps == 0 {
            bail!(
                "{}: training.extra_steps is 0; the resume-end phase trains past max_steps and needs at least 1, e.g. extra_steps: 3",
                places.value("training.extra_steps")
            );
        }
        let end = max_steps + t.extra_steps;
        if let Some(long) = file.long_batch.filter(|l| l.from_step >= end) {
            bail!(
                "{}: long_batch.from_step is {}, but the run ends after step {} (max_steps + extra_steps), so no long batch would be drawn; write a from_step below {end}",
                places.value("long_batch.from_step"),
                long.from_step,
                end - 1
            );
        }
        if file.threads == 0 {
            bail!(
                "{}: threads is 0; write the worker threads, at least 1",
                places.value("threads")
            );
        }
        if file.threads > MAX_THREADS {
            bail!(
                "{}: threads is {}, more worker threads than any machine runs at once (each costs a stack and a start-up); write at most {MAX_THREADS}, such as the machine's cores",
                places.value("threads"),
                file.threads
            );
        }
        if !(0.0..1.0).contains(&file.dropout) {
            bail!(
                "{}: dropout ({}) must be at least 0 and below 1; write e.g. dropout: 0.1",
                places.value("dropout"),
                file.dropout
            );
        }
        let rows = [
            ("long_batch.seq_len", file.long_batch.map(|l| l.seq_len)),
            ("seq_len", Some(file.seq_len)),
        ];
        let positions = model.max_position_embeddings;
        for (key, len) in rows {
            if let Some(len) = len.filter(|&l| l > positions) {
                bail!(
                    "{}: {key} ({len}) exceeds the model's max_position_embeddings ({positions}); write seq_len: {positions} or less, or max_position_embeddings: {len} or more",
                    places.value(key)
                );
            }
        }
        let devices = &file.devices;
        if devices.value.is_empty() {
            bail!(
                "{}: devices is empty; write e.g. devices: [cpu, cuda]",
                place(path, devices.referenced)
            );
        }
        for (i, d) in devices.value.iter().enumerate() {
            if devices.value[..i].contains(d) {
                bail!(
                    "{}: devices lists {d} twice; list each device once",
                    place(path, devices.referenced)
                );
            }
        }
        let m = &file.memory;
        if let Some(cap) = m.capacity.as_ref().filter(|c| c.value == 0) {
            bail!(
                "{}: memory.capacity is 0; a device holds at least one byte: write the bytes it may hold, such as 1073741824, or remove the key for an unlimited CPU device",
                place(path, cap.referenced)
            );
        }
        if let Some(b) = &m.budget {
            match (b.value, &m.capacity) {
                (Budget::Bytes(bytes), Some(cap)) if bytes > cap.value => bail!(
                    "{}: memory.budget ({bytes} bytes) exceeds memory.capacity ({} bytes); write a budget of at most {} bytes, or a fraction such as \"0.5\"",
                    place(path, b.referenced),
                    cap.value,
                    cap.value
                ),
                (Budget::Fraction(f), None) if devices.value.contains(&DeviceKind::Cpu) => bail!(
                    "{}: memory.budget \"{f}\" is a fraction of the capacity, but the CPU device has no memory.capacity; add capacity: <bytes> under memory, or write the budget in bytes",
                    place(path, b.referenced)
                ),
                _ => {}
            }
        }
        let expect = file.expect_fail.as_ref();
        if !file.faults.is_empty() && expect.is_none_or(|e| e.value.is_empty()) {
            bail!(
                "{}: faults are injected but expect_fail is empty; list the checks the faults must fail, e.g. expect_fail: [loss_continuity]",
                places.value("faults")
            );
        }
        let lists = [
            ("expect_fail", expect),
            ("expect_not_run", file.expect_not_run.as_ref()),
        ];
        for (key, list) in lists {
            for c in list.iter().flat_map(|e| &e.value) {
                if !file.checks.enabled(*c) {
                    bail!(
                        "{}: {key} names {c}, which checks: turns off; enable it or remove it from {key}",
                        place(path, list.map_or(Location::UNKNOWN, |e| e.referenced))
                    );
                }
            }
        }
        if let (Some(fail), Some(not_run)) = (expect, &file.expect_not_run) {
            if let Some(c) = fail.value.iter().find(|c| not_run.value.contains(c)) {
                bail!(
                    "{}: expect_not_run names {c}, which expect_fail names too; a check either fails or does not run: keep it in one of them",
                    place(path, not_run.referenced)
                );
            }
        }
        if let Some(p) = &file.parallel {
            let resumes = match &t.resume_from {
                Some(r) => match &r.value {
                    ResumeFrom::Step(_) => 1,
                    ResumeFrom::Chain(steps) => steps.len(),
                },
                None => 1,
            } + 1;
            let accumulation = t.accumulation.unwrap_or(1);
            p.validate(path, places, accumulation, resumes)?;
        }
        expectations::check(path, places, file)
    }

    /// A suite whose phases another trainer runs: a command that can run, and none of the
    /// built-in engine's own settings that the command would silently ignore.
    fn validate_engine(places: &Places, file: &SuiteFile, engine: &CommandEngine) -> Result<()> {
        if let Some(problem) = engine.problem() {
            bail!("{}: {problem}", places.value("engine"));
        }
        if !file.faults.is_empty() {
            bail!(
                "{}: faults are the built-in engine's, and engine.command runs another trainer; give the command the fault to inject instead (an argument or an environment variable)",
                places.value("faults")
            );
        }
        if file.parallel.is_some() {
            bail!(
                "{}: parallel sets the built-in engine's ranks, and engine.command runs another trainer, one process per phase; remove parallel",
                places.value("engine")
            );
        }
        Ok(())
    }

    /// Checks `training.resume_from`: every step between 1 and `max_steps - 1`, a list not
    /// empty and strictly increasing; the error names the step's place.
    fn validate_resume_from(path: &Path, r: &Spanned<ResumeFrom>, max_steps: u64) -> Result<()> {
        let steps: Vec<(u64, Location)> = match &r.value {
            ResumeFrom::Step(step) => vec![(*step, r.referenced)],
            ResumeFrom::Chain(steps) => steps.iter().map(|s| (s.value, s.referenced)).collect(),
        };
        let in_range = |s: u64| s > 0 && s < max_steps;
        let mut fixed: Vec<u64> = steps.iter().map(|s| s.0).filter(|&s| in_range(s)).collect();
        fixed.sort_unstable();
        fixed.dedup();
        let example = match (&r.value, fixed.is_empty()) {
            (ResumeFrom::Chain(_), false) => format!("{fixed:?}"),
            _ => (max_steps / 2).to_string(),
        };
        if steps.is_empty() {
            bail!(
                "{}: training.resume_from is an empty list; write at least one step, e.g. resume_from: {}",
                place(path, r.referenced),
                max_steps / 2
            );
        }
        for (i, &(step, at)) in steps.iter().enumerate() {
            if !in_range(step) {
                bail!(
                    "{}: training.resume_from ({step}) must be between 1 and max_steps - 1 ({}); write e.g. resume_from: {example}",
                    place(path, at),
                    max_steps - 1,
                );
            }
            if let Some(&(before, _)) = steps[..i].last().filter(|b| b.0 >= step) {
                bail!(
                    "{}: training.resume_from must increase strictly, but {step} follows {before}; write e.g. resume_from: {example}",
                    place(path, at),
                );
            }
        }
        Ok(())
    }

    /// Whether `run` can resume the suite under its `keep_last`: its reference phase saves with
    /// it, pruning as it goes, so `keep_last` must keep the mid-run checkpoint `resume-mid` loads
    /// (and so the later one `resume-end` loads). Each resumed run of a chain saves with it too,
    /// into its own run directory, and must keep the checkpoint the next resume loads; it saves
    /// no more often after that checkpoint than the reference does after the first resume point
    /// (the steps after a later point are fewer, the saves among them the same), so the
    /// reference's count bounds them all. `train` asks nothing of it.
    pub fn check_retention(&self) -> Result<()> {
        let t = &self.file.training;
        let Some(keep) = t.keep_last else {
            return Ok(());
        };
        let from = self.resume_from();
        let end = self.max_steps().saturating_add(t.extra_steps);
        let multiples = t.save_every.map_or(0, |n| end / n - (from - 1) / n);
        let unaligned = [from, self.max_steps()]
            .into_iter()
            .filter(|&s| t.save_every.is_none_or(|n| s % n != 0))
            .count() as u64;
        let saves = multiples + unaligned;
        if (keep as u64) < saves {
            bail!(
                "{}: training.keep_last ({keep}) would delete the checkpoint of step {from}, which resume-mid loads: the reference saves {saves} times from step {from} to step {end}; write keep_last: {saves} or more",
                self.places.value("training.keep_last")
            );
        }
        Ok(())
    }

    /// `file:line:column` of its name.
    pub fn name_place(&self) -> String {
        self.places.value("name")
    }

    /// Checks what the engine would refuse when this suite's trainer starts, without allocating
    /// on a device: every optimizer, schedule, loss and data value, the batch shape, the token
    /// file and the initial weights' directory. The error names the key's place in the file.
    pub fn check_run(&self) -> Result<()> {
        let Err(e) = self.train.validate() else {
            return Ok(());
        };
        let at = match &e {
            EngineError::Setting(s) => self.places.key(&suite_key(&s.key)),
            _ => self.path.display().to_string(),
        };
        bail!("{at}: {e}")
    }

    /// The mid-run checkpoint step: the first resume point.
    pub fn resume_from(&self) -> u64 {
        self.resume_points()[0]
    }

    /// The resume points in order: one, or the chain `training.resume_from` lists (`max_steps /
    /// 2` when absent).
    pub fn resume_points(&self) -> Vec<u64> {
        let t = &self.file.training;
        match t.resume_from.as_ref().map(|r| &r.value) {
            None => vec![t.max_steps.value / 2],
            Some(ResumeFrom::Step(step)) => vec![*step],
            Some(ResumeFrom::Chain(steps)) => steps.iter().map(|s| s.value).collect(),
        }
    }

    /// Steps of the nominal run.
    pub fn max_steps(&self) -> u64 {
        self.file.training.max_steps.value
    }

    /// Whether a run that started at step `from` (0 for a fresh run, else the checkpoint it
    /// resumed) saves after `steps` completed steps: at the first resume point after `from`
    /// (the checkpoint the next resume loads), at `max_steps`, and every `save_every` steps.
    pub fn saves_at(&self, from: u64, steps: u64) -> bool {
        let t = &self.file.training;
        let next = self.resume_points().into_iter().find(|&p| p > from);
        Some(steps) == next
            || steps == self.max_steps()
            || t.save_every
                .is_some_and(|n| n > 0 && steps.is_multiple_of(n))
    }

    /// The steps after which the reference phase saves: every step count up to its end that
    /// [`Suite::saves_at`] names.
    pub fn planned_saves(&self) -> Vec<u64> {
        let end = self.max_steps() + self.file.training.extra_steps;
        (1..=end).filter(|&s| self.saves_at(0, s)).collect()
    }

    /// The steps (completed) after which a phase that trains past them evaluates its
    /// validation split: every `validation.every`-th and `max_steps`; empty without one.
    pub fn planned_evaluations(&self) -> Vec<u64> {
        let end = self.max_steps() + self.file.training.extra_steps;
        let Some(validation) = &self.train.validation else {
            return Vec::new();
        };
        (1..=end).filter(|&s| validation.due(s)).collect()
    }

    /// The devices the suite runs on.
    pub fn devices(&self) -> &[DeviceKind] {
        &self.file.devices.value
    }

    /// The checks that must fail, in report order (empty for an ordinary suite).
    pub fn expect_fail(&self) -> Vec<Check> {
        in_report_order(&self.file.expect_fail)
    }

    /// The checks that must not run, in report order (empty for most suites).
    pub fn expect_not_run(&self) -> Vec<Check> {
        in_report_order(&self.file.expect_not_run)
    }

    /// The world size of each planned phase, in run order (see [`crate::forecast::plan`]): the
    /// reference's, each resume point's, then `resume-end`'s.
    pub fn world_sizes(&self) -> Vec<usize> {
        let resumes = self.resume_points().len() + 1;
        match &self.file.parallel {
            Some(p) => p.world_sizes(resumes),
            None => vec![1; resumes + 1],
        }
    }

    /// Whether each rank of a phase on more than one rank runs as a process of its own
    /// (`parallel.processes`).
    pub fn rank_processes(&self) -> bool {
        self.file.parallel.as_ref().is_some_and(|p| p.processes)
    }

    /// The engine configuration of a phase on `world_size` ranks.
    pub fn train_at(&self, world_size: usize) -> TrainConfig {
        let mut train = self.train.clone();
        train.parallel.world_size = world_size;
        train
    }

    /// The simulated capacity, if the suite sets one.
    pub fn capacity(&self) -> Option<u64> {
        self.file.memory.capacity.as_ref().map(|c| c.value)
    }

    /// The per-step budget, if the suite sets one.
    pub fn budget(&self) -> Option<Budget> {
        self.file.memory.budget.as_ref().map(|b| b.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "name: t
model: {vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 4, max_position_embeddings: 64}
data: {kind: synthetic, seed: 1, samples: 64}
batch_size: 2
seq_len: 16
optimizer: {lr: 0.001}
training:
  max_steps: 8
";

    fn parse(extra: &str) -> Result<Suite> {
        Suite::parse(Path::new("s.yaml"), &format!("{BASE}{extra}"))
    }

    fn error(extra: &str) -> String {
        format!("{:#}", parse(extra).unwrap_err())
    }

    #[test]
    fn defaults() {
        let s = parse("").unwrap();
        assert_eq!(s.file.tier, Tier::Ci);
        assert_eq!(s.devices(), &DeviceKind::ALL);
        assert_eq!(s.resume_from(), 4);
        assert!(Check::ALL.iter().all(|c| s.file.checks.enabled(*c)));
        assert_eq!(s.file.checks.loss_continuity.0, Some(Continuity::Bitwise));
        assert!(s.expect_fail().is_empty());
    }

    #[test]
    fn new_keys_parse() {
        let s = parse(
            "tier: nightly
devices: [cpu]
memory: {capacity: 1000000, budget: \"0.5\", rss_budget: 4000000000}
checks: {loss_continuity: {atol: 1e-6}, golden: false}
faults: [schedule_reset]
expect_fail: [state_digest, loss_continuity]
",
        )
        .unwrap();
        assert_eq!(s.file.tier, Tier::Nightly);
        assert_eq!(s.budget().unwrap().bytes(s.capacity().unwrap()), 500_000);
        assert_eq!(
            s.file.checks.loss_continuity.0,
            Some(Continuity::Within(Tolerance {
                atol: 1e-6,
                rtol: 0.0
            }))
        );
        assert!(!s.file.checks.enabled(Check::Golden));
        assert!(s.train.faults.has(Fault::ScheduleReset));
        assert_eq!(
            s.expect_fail(),
            vec![Check::LossContinuity, Check::StateDigest]
        );
    }

    #[test]
    fn weight_directories_and_token_files_are_relative_to_the_suite() {
        let text = format!("{BASE}init: {{kind: hf_dir, path: ../weights}}\n").replace(
            "data: {kind: synthetic, seed: 1, samples: 64}",
            "data: {kind: token_file, path: tokens.bin, dtype: u16}",
        );
        let s = Suite::parse(Path::new("suites/s.yaml"), &text).unwrap();
        assert_eq!(
            s.train.init,
            Init::HfDir {
                path: PathBuf::from("suites/../weights")
            }
        );
        match &s.train.data {
            DataConfig::TokenFile { path, .. } => {
                assert_eq!(path, &PathBuf::from("suites/tokens.bin"))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn resume_from_at_max_steps_is_located() {
        let e = error("  resume_from: 8\n");
        assert!(
            e.starts_with("s.yaml:9:16: training.resume_from (8)"),
            "{e}"
        );
        assert!(e.contains("resume_from: 4"), "{e}");
    }

    #[test]
    fn resume_from_is_a_step_or_a_chain() {
        let s = parse("  resume_from: 3\n").unwrap();
        assert_eq!((s.resume_from(), s.resume_points()), (3, vec![3]));
        let s = parse("  resume_from: [2, 4, 7]\n").unwrap();
        assert_eq!((s.resume_from(), s.resume_points()), (2, vec![2, 4, 7]));
        let s = parse("  resume_from:\n    - 1\n    - 6\n").unwrap();
        assert_eq!(s.resume_points(), [1, 6]);
        assert_eq!(parse("").unwrap().resume_points(), [4]);
    }

    #[test]
    fn a_chain_out_of_order_or_out_of_range_is_located_at_its_entry() {
        let e = error("  resume_from: [2, 6, 5]\n");
        assert!(
            e.starts_with(
                "s.yaml:9:23: training.resume_from must increase strictly, but 5 follows 6"
            ),
            "{e}"
        );
        assert!(e.ends_with("write e.g. resume_from: [2, 5, 6]"), "{e}");
        let e = error("  resume_from: [2, 2]\n");
        assert!(
            e.starts_with("s.yaml:9:20:") && e.contains("2 follows 2"),
            "{e}"
        );
        let e = error("  resume_from: [3, 8]\n");
        assert!(
            e.starts_with(
                "s.yaml:9:20: training.resume_from (8) must be between 1 and max_steps - 1 (7)"
            ),
            "{e}"
        );
        assert!(e.ends_with("write e.g. resume_from: [3]"), "{e}");
        let e = error("  resume_from:\n    - 0\n    - 4\n");
        assert!(
            e.starts_with("s.yaml:10:7: training.resume_from (0)"),
            "{e}"
        );
        let e = error("  resume_from: []\n");
        assert!(
            e.starts_with("s.yaml:9:16: training.resume_from is an empty list"),
            "{e}"
        );
        let e = error("  resume_from: -1\n");
        assert!(e.starts_with("s.yaml:9:") && e.contains("negative"), "{e}");
        let e = error("  resume_from: {at: 3}\n");
        assert!(e.contains("resume_from: [3, 5, 7]"), "{e}");
    }

    #[test]
    fn each_run_saves_at_the_next_resume_point_max_steps_and_its_interval() {
        let s = parse("  resume_from: [2, 4, 6]\n  save_every: 5\n").unwrap();
        let saves =
            |from: u64| -> Vec<u64> { (from + 1..=11).filter(|&n| s.saves_at(from, n)).collect() };
        assert_eq!(saves(0), [2, 5, 8, 10], "the reference");
        assert_eq!(saves(2), [4, 5, 8, 10], "resume-mid");
        assert_eq!(saves(4), [5, 6, 8, 10], "resume-mid-2");
        assert_eq!(saves(6), [8, 10], "resume-mid-3 saves no resume point");
    }

    /// A chain's later resumed runs save no more often after the checkpoint the next resume loads
    /// than the reference after the first: keeping the reference's is enough for every run.
    #[test]
    fn keep_last_bounded_by_the_reference_keeps_every_checkpoint_of_a_chain() {
        for (chain, every) in [
            ("[1, 5]", 2),
            ("[2, 3, 7]", 3),
            ("[1, 2, 3, 4]", 1),
            ("[5, 6]", 4),
        ] {
            let s = parse(&format!("  resume_from: {chain}\n  save_every: {every}\n")).unwrap();
            let saves_after =
                |from: u64, needed: u64| (needed..=11).filter(|&n| s.saves_at(from, n)).count();
            let points = s.resume_points();
            let reference = saves_after(0, points[0]);
            for pair in points.windows(2) {
                assert!(
                    saves_after(pair[0], pair[1]) <= reference,
                    "{chain} every {every}: {pair:?}"
                );
            }
            let at = |keep: usize| {
                let text = BASE.replace("  max_steps: 8\n", &format!("  max_steps: 8\n  resume_from: {chain}\n  save_every: {every}\n  keep_last: {keep}\n"));
                Suite::parse(Path::new("s.yaml"), &text)
                    .unwrap()
                    .check_retention()
            };
            assert!(at(reference).is_ok(), "{chain} every {every}");
            let e = format!("{:#}", at(reference - 1).unwrap_err());
            assert!(
                e.contains(&format!(
                    "which resume-mid loads: the reference saves {reference} times"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn keep_last_must_keep_the_checkpoints_the_resumes_load() {
        let retained = |extra: &str| parse(extra).unwrap().check_retention();
        let e = format!(
            "{:#}",
            retained("  save_every: 2\n  keep_last: 3\n").unwrap_err()
        );
        assert!(e.starts_with("s.yaml:10:14: training.keep_last (3)"), "{e}");
        assert!(e.contains("saves 4 times from step 4 to step 11"), "{e}");
        assert!(e.contains("keep_last: 4 or more"), "{e}");
        assert!(retained("  save_every: 2\n  keep_last: 4\n").is_ok());
        let e = format!(
            "{:#}",
            retained("  save_every: 3\n  keep_last: 3\n").unwrap_err()
        );
        assert!(e.contains("saves 4 times"), "steps 4, 6, 8, 9: {e}");
        assert!(retained("  keep_last: 2\n").is_ok());
        let e = format!("{:#}", retained("  keep_last: 1\n").unwrap_err());
        assert!(e.contains("saves 2 times"), "steps 4 and 8: {e}");
        let long = "  max_steps: 1000000\n  save_every: 1\n  keep_last: 2\n";
        let text = BASE.replace("  max_steps: 8\n", long);
        let s = Suite::parse(Path::new("s.yaml"), &text).unwrap();
        let e = format!("{:#}", s.check_retention().unwrap_err());
        assert!(e.contains("keep_last: 500004 or more"), "{e}");
    }

    #[test]
    fn names_are_file_names_and_counts_are_positive() {
        for (text, at, says) in [
            ("name: ../../../x\n", "s.yaml:1:7:", "letters, digits"),
            ("name: \"\"\n", "s.yaml:1:7:", "letters, digits"),
            ("name: a/b\n", "s.yaml:1:7:", "name: tiny-fp32"),
        ] {
            let text = BASE.replace("name: t\n", text);
            let e = format!(
                "{:#}",
                Suite::parse(Path::new("s.yaml"), &text).unwrap_err()
            );
            assert!(e.starts_with(at) && e.contains(says), "{e}");
        }
        let e = error("  keep_last: 0\n");
        assert!(
            e.starts_with("s.yaml:9:14:") && e.contains("keep_last: 1"),
            "{e}"
        );
        let e = error("  save_every: 0\n");
        assert!(
            e.starts_with("s.yaml:9:15:") && e.contains("save_every: 1"),
            "{e}"
        );
        assert!(parse("  save_every: 1\n  keep_last: 12\n").is_ok());
        let e = error("  accumulation: 0\n");
        assert!(
            e.starts_with("s.yaml:9:17:") && e.contains("accumulation: 1 or more"),
            "{e}"
        );
        assert_eq!(parse("").unwrap().train.accumulation, 1);
        assert_eq!(parse("  accumulation: 3\n").unwrap().train.accumulation, 3);
    }

    #[test]
    fn budget_above_capacity_is_located() {
        let e = error("memory:\n  capacity: 1000\n  budget: 2000\n");
        assert!(e.starts_with("s.yaml:11:11: memory.budget"), "{e}");
        assert!(e.contains("at most 1000 bytes"), "{e}");
    }

    #[test]
    fn a_capacity_of_0_is_refused_at_its_place() {
        let e = error("memory:\n  capacity: 0\n  budget: \"0.5\"\n");
        assert!(e.starts_with("s.yaml:10:13: memory.capacity is 0;"), "{e}");
        assert!(e.contains("such as 1073741824"), "{e}");
    }

    #[test]
    fn heads_not_dividing_hidden_point_at_the_heads() {
        let text = BASE.replace(
            "num_attention_heads: 4, num_key_value_heads: 4",
            "num_attention_heads: 6, num_key_value_heads: 2",
        );
        let e = format!(
            "{:#}",
            Suite::parse(Path::new("s.yaml"), &text).unwrap_err()
        );
        assert!(e.starts_with("s.yaml:2:"), "{e}");
        assert!(e.contains("does not divide hidden_size"), "{e}");
    }

    #[test]
    fn unknown_keys_wrong_types_and_names_are_located() {
        let e = error("memory: {capacity: 10, budjet: 5}\n");
        assert!(e.starts_with("s.yaml:9:24:"), "{e}");
        assert!(e.contains("budjet"), "{e}");
        let e = error("tier: weekly\n");
        assert!(e.starts_with("s.yaml:9:"), "{e}");
        assert!(e.contains("ci") && e.contains("nightly"), "{e}");
        let e = error("faults: [moments_lost]\n");
        assert!(e.contains("moments_not_saved"), "{e}");
        let e = error("expect_fail: [loss]\n");
        assert!(e.contains("loss_continuity"), "{e}");
        let e = error("checks: {loss_continuity: snug}\n");
        assert!(e.contains("tight") && e.starts_with("s.yaml:9:"), "{e}");
        let e = error("memory: {capacity: 10, budget: \"1.5\"}\n");
        assert!(e.contains("outside (0, 1]"), "{e}");
        let e = error("memory: {budget: \"0.5\"}\n");
        assert!(e.contains("add capacity"), "{e}");
        let e = error("devices: [cpu, tpu]\n");
        assert!(e.contains("cuda"), "{e}");
    }

    #[test]
    fn expected_not_run_checks_are_enabled_and_not_expected_to_fail() {
        let s = parse("expect_not_run: [state_digest, loss_continuity]\n").unwrap();
        assert_eq!(
            s.expect_not_run(),
            vec![Check::LossContinuity, Check::StateDigest]
        );
        let e = error("checks: {no_leak: false}\nexpect_not_run: [no_leak]\n");
        assert!(
            e.starts_with("s.yaml:10:17:") && e.contains("turns off"),
            "{e}"
        );
        let e = error("expect_fail: [oom_free, no_leak]\nexpect_not_run: [no_leak]\n");
        assert!(e.starts_with("s.yaml:10:17:"), "{e}");
        assert!(e.contains("either fails or does not run"), "{e}");
    }

    /// The error of BASE with `from` replaced by `to`.
    fn error_replacing(from: &str, to: &str) -> String {
        assert!(BASE.contains(from), "{from}");
        let text = BASE.replace(from, to);
        format!(
            "{:#}",
            Suite::parse(Path::new("s.yaml"), &text).unwrap_err()
        )
    }

    /// The library's own words, which say nothing to a suite's author.
    fn no_library_words(e: &str) {
        for word in ["untagged", "Policy", "Options", "from_str", " at line "] {
            assert!(!e.contains(word), "{word}: {e}");
        }
    }

    #[test]
    fn a_mistyped_key_inside_an_inline_model_is_named_at_its_place() {
        let e = error_replacing("hidden_size: 32", "hidden_sise: 32");
        assert!(e.starts_with("s.yaml:2:"), "{e}");
        assert!(
            e.contains("hidden_sise") && e.contains("hidden_size"),
            "{e}"
        );
        no_library_words(&e);
        let e = error_replacing("num_hidden_layers: 2", "num_hidden_layers: two");
        assert!(e.starts_with("s.yaml:2:") && e.contains("two"), "{e}");
        no_library_words(&e);
    }

    #[test]
    fn no_positions_says_to_raise_them() {
        let e = error_replacing("max_position_embeddings: 64", "max_position_embeddings: 0");
        assert!(e.starts_with("s.yaml:2:"), "{e}");
        assert!(e.contains("max_position_embeddings: 16 or more"), "{e}");
        assert!(!e.contains("seq_len: 0"), "{e}");
        let e = error_replacing("max_position_embeddings: 64", "max_position_embeddings: 8");
        assert!(e.starts_with("s.yaml:5:10: seq_len (16)"), "{e}");
        assert!(
            e.contains("seq_len: 8 or less, or max_position_embeddings: 16"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_model_file_is_said_once_at_the_model_key() {
        let model = &BASE[BASE.find("model:").unwrap()..BASE.find("data:").unwrap()];
        let e = error_replacing(model, "model: nope/config.json\n");
        assert!(
            e.starts_with("s.yaml:2:8: model: nope/config.json: "),
            "{e}"
        );
        assert_eq!(e.matches("os error").count(), 1, "{e}");
        assert!(e.contains("config.json relative to the suite"), "{e}");
    }

    #[test]
    fn duplicate_keys_and_second_documents_name_the_key_place_and_fix() {
        let e = error("batch_size: 3\n");
        assert!(e.starts_with("s.yaml:9:1:"), "{e}");
        assert!(e.contains("batch_size") && e.contains("keep one"), "{e}");
        no_library_words(&e);
        let e = error("---\nname: u\n");
        assert!(e.starts_with("s.yaml:9:1:"), "{e}");
        assert!(e.contains("one document") && e.contains("remove"), "{e}");
        no_library_words(&e);
    }

    #[test]
    fn values_checked_after_parsing_are_located() {
        let e = error("dropout: 1.5\n");
        assert!(e.starts_with("s.yaml:9:10: dropout"), "{e}");
        let e = error("long_batch: {from_step: 2, seq_len: 128}\n");
        assert!(e.starts_with("s.yaml:9:37: long_batch.seq_len"), "{e}");
        let e = error("faults: [schedule_reset]\n");
        assert!(e.starts_with("s.yaml:9:9: faults"), "{e}");
    }

    proptest::proptest! {
        /// Any damage to a suite's text parses or gives a located error; nothing panics.
        #[test]
        fn damaged_text_never_panics(at in 0usize..400, junk in "[ :,{}\\[\\]\\-#a-z0-9\n]{0,6}") {
            let at = BASE.char_indices().map(|(i, _)| i).nth(at).unwrap_or(BASE.len());
            let text = format!("{}{junk}{}", &BASE[..at], &BASE[at..]);
            if let Err(e) = Suite::parse(Path::new("s.yaml"), &text) {
                proptest::prop_assert!(format!("{e:#}").starts_with("s.yaml"), "{e:#}");
            }
        }
    }

    #[test]
    fn a_suite_that_would_compare_nothing_is_refused_at_its_place() {
        let off = "checks: {loss_continuity: false, state_digest: false, data_ledger: false, memory_reclaimed: false, memory_parity: false, peak_budget: false, no_leak: false, ac_coverage: false, memory_model: false, oom_free: false, golden: false, eval_continuity: false, finite: false, checkpoint_equivalence: false}\n";
        let e = error(off);
        assert!(e.starts_with("s.yaml:9:9:"), "{e}");
        assert!(e.contains("every check is off"), "{e}");
        let every = "memory: {capacity: 1}\nexpect_fail: [oom_free]\nexpect_not_run: [loss_continuity, state_digest, data_ledger, memory_reclaimed, memory_parity, peak_budget, no_leak, ac_coverage, memory_model, golden, eval_continuity, finite, checkpoint_equivalence]\n";
        let e = error(every);
        assert!(e.starts_with("s.yaml:11:17:"), "{e}");
        assert!(e.contains("nothing would be compared"), "{e}");
        let e = error("expect_fail: [state_digest]\n");
        assert!(e.starts_with("s.yaml:9:14:"), "{e}");
        assert!(
            e.contains("expect_fail names state_digest but the suite injects no fault"),
            "{e}"
        );
        for explained in [
            "faults: [schedule_reset]\nexpect_fail: [state_digest]\n",
            "memory: {capacity: 1000000}\nexpect_fail: [oom_free]\n",
            "memory: {budget: 4096}\nexpect_fail: [no_leak]\n",
            "expect_fail: [finite]\n",
            "expect_fail: [golden]\n",
        ] {
            parse(explained).unwrap_or_else(|e| panic!("{explained}: {e:#}"));
        }
    }

    #[test]
    fn values_that_would_fail_later_are_refused_at_their_place() {
        let e = error("threads: 0\n");
        assert!(e.starts_with("s.yaml:9:10: threads is 0"), "{e}");
        let e = error("threads: 100000\n");
        assert!(
            e.starts_with("s.yaml:9:10: threads is 100000, more worker threads than"),
            "{e}"
        );
        assert!(e.contains("write at most 1024"), "{e}");
        parse("threads: 1024\n").unwrap();
        let text = BASE.replace("  max_steps: 8\n", "  max_steps: 8\n  extra_steps: 0\n");
        let e = format!(
            "{:#}",
            Suite::parse(Path::new("s.yaml"), &text).unwrap_err()
        );
        assert!(
            e.starts_with("s.yaml:9:16: training.extra_steps is 0"),
            "{e}"
        );
        let e = error("long_batch: {from_step: 11, seq_len: 32}\n");
        assert!(
            e.starts_with(
                "s.yaml:9:25: long_batch.from_step is 11, but the run ends after step 10"
            ),
            "{e}"
        );
        parse("long_batch: {from_step: 10, seq_len: 32}\n").unwrap();
    }

    #[test]
    fn faults_need_expectations_that_are_enabled() {
        let e = error("faults: [schedule_reset]\n");
        assert!(e.contains("expect_fail is empty"), "{e}");
        let e = error("checks: {golden: false}\nexpect_fail: [golden]\n");
        assert!(e.starts_with("s.yaml:10:14:"), "{e}");
        assert!(e.contains("turns off"), "{e}");
    }

    /// A suite that writes every key the engine validates, each on a line of its own.
    const EVERY_KEY: &str = "name: t
model:
  vocab_size: 64
  hidden_size: 32
  intermediate_size: 64
  num_hidden_layers: 2
  num_attention_heads: 4
  num_key_value_heads: 4
  max_position_embeddings: 64
  sliding_window: 64
init: {kind: random, seed: 1, std: 0.1}
data: {kind: synthetic, seed: 1, samples: 64, min_len: 4}
batch_size: 2
seq_len: 16
dropout: 0.1
long_batch: {from_step: 9, seq_len: 32}
validation: {share: 0.25, every: 2, batches: 3}
optimizer: {lr: 0.001, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1, grad_clip: 1.0}
schedule: {warmup_steps: 1, min_lr_ratio: 0.1}
loss: {kind: chunked, chunk_tokens: 8}
training:
  max_steps: 8
  accumulation: 2
parallel: {world_size: 2}
";

    /// The key written at the `file:line:column` an error starts with, in `text`.
    fn key_at(text: &str, error: &str) -> String {
        let mut parts = error.splitn(4, ':');
        let (_, line, column) = (parts.next(), parts.next(), parts.next());
        let line: usize = line
            .and_then(|l| l.parse().ok())
            .unwrap_or_else(|| panic!("{error}"));
        let column: usize = column
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("{error}"));
        let at: String = text
            .lines()
            .nth(line - 1)
            .unwrap()
            .chars()
            .skip(column - 1)
            .collect();
        at.split(':').next().unwrap().to_string()
    }

    /// Every refusal of the engine's `TrainConfig::validate`, and of the model's shape when the
    /// suite is read, is placed at the key that holds the refused value: looked up by the key
    /// the error carries, whatever its message says.
    #[test]
    fn every_refusal_of_the_engine_is_placed_at_its_key() {
        let suite = Suite::parse(Path::new("s.yaml"), EVERY_KEY).unwrap();
        suite.check_run().unwrap();
        type Breaks = fn(&mut TrainConfig);
        let cases: Vec<(&str, Breaks)> = vec![
            ("lr", |r| r.optimizer.lr = -1.0),
            ("eps", |r| r.optimizer.eps = 0.0),
            ("weight_decay", |r| r.optimizer.weight_decay = f64::NAN),
            ("betas", |r| r.optimizer.betas = [0.9, 1.5]),
            ("grad_clip", |r| r.optimizer.grad_clip = Some(-1.0)),
            ("min_lr_ratio", |r| {
                r.schedule = Schedule::WarmupCosine {
                    warmup_steps: 1,
                    horizon: 8,
                    min_lr_ratio: 2.0,
                }
            }),
            ("chunk_tokens", |r| {
                r.loss = LossKind::Chunked { chunk_tokens: 0 }
            }),
            ("batch_size", |r| r.batch_size = 0),
            ("accumulation", |r| r.accumulation = 0),
            ("world_size", |r| r.parallel.world_size = 0),
            ("world_size", |r| r.parallel.world_size = 3),
            ("seq_len", |r| r.seq_len = 65),
            ("seq_len", |r| {
                r.long_batch = Some(LongBatch {
                    from_step: 9,
                    seq_len: 0,
                })
            }),
            ("sliding_window", |r| r.model.sliding_window = Some(4)),
            ("dropout", |r| r.dropout = 1.0),
            ("std", |r| r.init = Init::Random { seed: 1, std: 0.0 }),
            ("min_len", |r| {
                r.data = DataConfig::Synthetic {
                    seed: 1,
                    samples: 64,
                    branching: 2,
                    min_len: Some(99),
                }
            }),
            ("samples", |r| {
                r.data = DataConfig::Synthetic {
                    seed: 1,
                    samples: 0,
                    branching: 2,
                    min_len: None,
                }
            }),
            ("vocab_size", |r| r.model.vocab_size = 0),
            ("num_key_value_heads", |r| r.model.num_key_value_heads = 3),
            ("model", |r| r.model.rope_theta = -1.0),
            ("every", |r| r.validation.as_mut().unwrap().every = 0),
            ("share", |r| {
                r.validation.as_mut().unwrap().share = Some(1.0)
            }),
            ("batches", |r| {
                r.validation.as_mut().unwrap().batches = Some(0)
            }),
            ("validation", |r| {
                r.validation.as_mut().unwrap().share = None
            }),
        ];
        for (key, break_it) in cases {
            let mut broken = suite.clone();
            break_it(&mut broken.train);
            let e = format!("{:#}", broken.check_run().unwrap_err());
            assert!(
                e.starts_with("s.yaml:") && e.contains("invalid configuration"),
                "{e}"
            );
            assert_eq!(key_at(EVERY_KEY, &e), key, "{e}");
        }
        let written = [
            (
                "init: {kind: random, seed: 1, std: 0.1}",
                "init: {kind: hf_dir, path: nope}",
                "path",
            ),
            (
                "data: {kind: synthetic, seed: 1, samples: 64, min_len: 4}",
                "data: {kind: token_file, path: nope.bin, dtype: u16}",
                "path",
            ),
            ("lr: 0.001", "lr: .nan", "lr"),
            ("weight_decay: 0.1", "weight_decay: -.inf", "weight_decay"),
        ];
        for (from, to, key) in written {
            assert!(EVERY_KEY.contains(from), "{from}");
            let text = EVERY_KEY.replace(from, to);
            let e = format!(
                "{:#}",
                Suite::parse(Path::new("s.yaml"), &text)
                    .unwrap()
                    .check_run()
                    .unwrap_err()
            );
            assert_eq!(key_at(&text, &e), key, "{e}");
        }
        let shapes = [
            (
                "  num_key_value_heads: 4\n",
                "  num_key_value_heads: 3\n",
                "num_key_value_heads",
            ),
            (
                "  sliding_window: 64\n",
                "  sliding_window: 64\n  head_dim: 0\n",
                "head_dim",
            ),
            (
                "  sliding_window: 64\n",
                "  sliding_window: 64\n  rope_theta: -1\n",
                "rope_theta",
            ),
            (
                "  max_position_embeddings: 64\n",
                "  max_position_embeddings: 0\n",
                "max_position_embeddings",
            ),
        ];
        for (from, to, key) in shapes {
            let text = EVERY_KEY.replace(from, to);
            let e = format!(
                "{:#}",
                Suite::parse(Path::new("s.yaml"), &text).unwrap_err()
            );
            assert!(e.contains(": model: "), "{e}");
            assert_eq!(key_at(&text, &e), key, "{e}");
        }
    }
}
