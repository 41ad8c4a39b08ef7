//! Suites: one YAML file per model configuration, describing a training run and how the
//! harness exercises it. Parsing reports file:line:column and what to write instead.

use anyhow::{bail, Context, Result};
use ckpt_engine::data::DataConfig;
use ckpt_engine::loss::LossKind;
use ckpt_engine::optim::{AdamWConfig, Schedule};
use ckpt_engine::trainer::{Init, Precision, TrainConfig};
use ckpt_engine::{Checkpointing, LlamaConfig};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The model: written inline, or a Hugging Face `config.json` path relative to the suite.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum ModelSpec {
    /// A path to a Hugging Face `config.json`.
    Path(PathBuf),
    /// The shape written out.
    Inline(LlamaConfig),
}

/// Learning-rate warmup and decay; the harness pins the decay's horizon at `max_steps`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSpec {
    /// Steps of linear warmup.
    #[serde(default)]
    pub warmup_steps: u64,
    /// Final learning rate as a fraction of the peak.
    #[serde(default)]
    pub min_lr_ratio: f64,
}

/// How long to train and where to save.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Training {
    /// Steps of the nominal run (the schedule's horizon).
    pub max_steps: u64,
    /// Steps trained past `max_steps` after resuming from its checkpoint.
    #[serde(default = "default_extra")]
    pub extra_steps: u64,
    /// The mid-run checkpoint to resume from; `max_steps / 2` when absent.
    #[serde(default)]
    pub resume_from: Option<u64>,
    /// Also save every this many steps.
    #[serde(default)]
    pub save_every: Option<u64>,
    /// Checkpoints to keep.
    #[serde(default)]
    pub keep_last: Option<usize>,
}

fn default_extra() -> u64 {
    3
}
fn default_threads() -> usize {
    2
}

/// A suite file as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SuiteFile {
    /// The suite's name, used in trial names (`cpu::<name>`).
    pub name: String,
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
    /// Run length and saves.
    pub training: Training,
    /// CPU worker threads.
    #[serde(default = "default_threads")]
    pub threads: usize,
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
}

impl Suite {
    /// Reads and validates a suite file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read", path.display()))?;
        Self::parse(path, &text)
    }

    /// Parses suite text read from `path` (used in messages and to resolve relative paths).
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let file: SuiteFile = serde_saphyr::from_str(text).map_err(|e| {
            let place = e
                .location()
                .map(|l| format!("{}:{}:{}", path.display(), l.line(), l.column()))
                .unwrap_or_else(|| path.display().to_string());
            anyhow::anyhow!("{place}: {e}")
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        let model = match &file.model {
            ModelSpec::Inline(cfg) => cfg.clone(),
            ModelSpec::Path(p) => LlamaConfig::from_hf_file(&base.join(p))?,
        };
        model
            .validate()
            .map_err(|m| anyhow::anyhow!("{}: model: {m}", path.display()))?;
        let t = &file.training;
        if t.max_steps == 0 {
            bail!(
                "{}: training.max_steps is 0; write at least 2",
                path.display()
            );
        }
        let resume_from = t.resume_from.unwrap_or(t.max_steps / 2);
        if resume_from >= t.max_steps {
            bail!(
                "{}: training.resume_from ({resume_from}) must be below max_steps ({}); write e.g. resume_from: {}",
                path.display(),
                t.max_steps,
                t.max_steps / 2
            );
        }
        if file.seq_len > model.max_position_embeddings {
            bail!(
                "{}: seq_len ({}) exceeds the model's max_position_embeddings ({})",
                path.display(),
                file.seq_len,
                model.max_position_embeddings
            );
        }
        let schedule = match &file.schedule {
            None => Schedule::Constant,
            Some(s) => Schedule::WarmupCosine {
                warmup_steps: s.warmup_steps,
                horizon: t.max_steps,
                min_lr_ratio: s.min_lr_ratio,
            },
        };
        let data = match &file.data {
            DataConfig::TokenFile { path: p, dtype } => DataConfig::TokenFile {
                path: base.join(p),
                dtype: *dtype,
            },
            other => other.clone(),
        };
        let train = TrainConfig {
            model,
            init: file
                .init
                .clone()
                .unwrap_or(Init::Random { seed: 0, std: 0.02 }),
            precision: file.precision,
            optimizer: file.optimizer.clone(),
            schedule,
            data,
            batch_size: file.batch_size,
            seq_len: file.seq_len,
            shuffle_seed: file.shuffle_seed,
            checkpointing: file.checkpointing,
            loss: file.loss.unwrap_or(LossKind::Standard),
            dropout: 0.0,
            long_batch: None,
            faults: Default::default(),
        };
        Ok(Suite {
            path: path.to_path_buf(),
            file,
            train,
        })
    }

    /// The mid-run checkpoint step.
    pub fn resume_from(&self) -> u64 {
        let t = &self.file.training;
        t.resume_from.unwrap_or(t.max_steps / 2)
    }

    /// Whether the run saves after `steps` completed steps.
    pub fn saves_at(&self, steps: u64) -> bool {
        let t = &self.file.training;
        steps == self.resume_from()
            || steps == t.max_steps
            || t.save_every.is_some_and(|n| n > 0 && steps % n == 0)
    }
}
