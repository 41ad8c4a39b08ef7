//! The run schema: everything that defines a training run ([`TrainConfig`]), what a checkpoint
//! must share with a run to resume it ([`TrainConfig::identity`]), and the checks that refuse an
//! impossible run before anything is allocated ([`TrainConfig::validate`]).

use crate::data::{DataConfig, DataLoader, LongBatch};
use crate::error::{EngineError, Result};
use crate::fault::Faults;
use crate::memory::Category;
use crate::model::loss::LossKind;
use crate::model::{Checkpointing, LlamaConfig};
use crate::optim::{AdamWConfig, Schedule};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The arithmetic of a training step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Precision {
    /// Everything in f32.
    #[default]
    Fp32,
    /// bf16 weights and activations; f32 master weights, moments and gradients.
    Bf16Mixed,
}

/// Where the initial weights come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum Init {
    /// Seeded N(0, std²) matrices and unit norms.
    Random {
        /// Generator seed.
        seed: u64,
        /// Standard deviation of matrix entries.
        #[serde(default = "default_std")]
        std: f32,
    },
    /// `model.safetensors` of a Hugging Face Llama directory.
    HfDir {
        /// The directory.
        path: PathBuf,
    },
}

fn default_std() -> f32 {
    0.02
}

/// Everything that defines a training run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// The model's shape.
    pub model: LlamaConfig,
    /// Initial weights.
    pub init: Init,
    /// Step arithmetic.
    #[serde(default)]
    pub precision: Precision,
    /// Optimizer.
    pub optimizer: AdamWConfig,
    /// Learning-rate schedule.
    pub schedule: Schedule,
    /// Samples.
    pub data: DataConfig,
    /// Rows per batch.
    pub batch_size: usize,
    /// Tokens per row.
    pub seq_len: usize,
    /// Seed of the data order.
    #[serde(default)]
    pub shuffle_seed: u64,
    /// Activation checkpointing policy.
    #[serde(default)]
    pub checkpointing: Checkpointing,
    /// How logits are held.
    #[serde(default = "default_loss")]
    pub loss: LossKind,
    /// Residual dropout probability on each block's attention and MLP output projections
    /// (training only, kept elements scaled by `1 / (1 − p)`); 0 applies none.
    #[serde(default)]
    pub dropout: f32,
    /// Longer rows from a given step on; none by default.
    #[serde(default)]
    pub long_batch: Option<LongBatch>,
    /// Deliberate bugs to inject (negative controls); none by default.
    #[serde(default, skip_serializing_if = "Faults::is_empty")]
    pub faults: Faults,
}

fn default_loss() -> LossKind {
    LossKind::Standard
}

/// `Err(message)` unless `ok`.
fn require(ok: bool, message: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(EngineError::Config(message()))
    }
}

impl TrainConfig {
    /// What a checkpoint must share with a run to resume it: everything that changes the
    /// numbers (model, precision, optimizer, schedule, data, batch shape, dropout, long
    /// batches), not how memory is managed (checkpointing, loss chunking) nor where the initial
    /// weights came from. Dropout and long batches appear only when set, so runs without them
    /// keep the identity they had before these options existed.
    pub fn identity(&self) -> serde_json::Value {
        let mut identity = serde_json::json!({
            "model": self.model,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "schedule": self.schedule,
            "data": self.data,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "shuffle_seed": self.shuffle_seed,
        });
        if self.dropout != 0.0 {
            identity["dropout"] = serde_json::json!(self.dropout);
        }
        if let Some(long) = self.long_batch {
            identity["long_batch"] = serde_json::json!(long);
        }
        identity
    }

    /// Tokens per row of step `step` (0-based): [`TrainConfig::seq_len`], or the long-batch
    /// length from its first step on.
    pub fn seq_len_at(&self, step: u64) -> usize {
        match self.long_batch {
            Some(long) if step >= long.from_step => long.seq_len,
            _ => self.seq_len,
        }
    }

    /// The category of the f32 master weights: params in fp32, where they are what the passes
    /// read; optimizer state in bf16-mixed.
    pub fn master_category(&self) -> Category {
        match self.precision {
            Precision::Fp32 => Category::Params,
            Precision::Bf16Mixed => Category::Optimizer,
        }
    }

    /// Everything a trainer refuses at start, checked without allocating on a device: the
    /// model's shape, every optimizer, schedule, loss and dropout value, the batch shape, the
    /// data (a token file is read), and the initial weights' directory. The message names the
    /// value and what to write instead.
    pub fn validate(&self) -> Result<()> {
        self.model.validate().map_err(EngineError::Config)?;
        let max = self.model.max_position_embeddings;
        require(self.batch_size >= 1, || {
            "batch_size is 0; it must be at least 1".into()
        })?;
        for (name, seq) in std::iter::once(("seq_len", self.seq_len))
            .chain(self.long_batch.map(|l| ("long_batch.seq_len", l.seq_len)))
        {
            require((1..=max).contains(&seq), || {
                format!("{name} is {seq}; it must be between 1 and max_position_embeddings ({max})")
            })?;
        }
        self.validate_optimizer()?;
        if let LossKind::Chunked { chunk_tokens } = self.loss {
            require(chunk_tokens >= 1, || {
                "loss.chunk_tokens is 0; write the tokens per chunk, e.g. 1024".into()
            })?;
        }
        require((0.0..1.0).contains(&self.dropout), || {
            format!(
                "dropout is {}; it must be at least 0 and below 1",
                self.dropout
            )
        })?;
        match &self.init {
            Init::Random { std, .. } => require(std.is_finite() && *std > 0.0, || {
                format!("init.std is {std}; write a positive standard deviation such as 0.02")
            })?,
            Init::HfDir { path } => {
                let found = LlamaConfig::from_hf_file(&path.join("config.json"))?;
                require(found == self.model, || {
                    format!(
                        "{}: config.json does not match the run's model configuration",
                        path.display()
                    )
                })?;
                let weights = path.join("model.safetensors");
                std::fs::metadata(&weights).map_err(|e| EngineError::io(&weights, e))?;
            }
        }
        DataLoader::new(
            &self.data,
            self.model.vocab_size,
            self.batch_size,
            self.seq_len,
            self.shuffle_seed,
        )
        .map(drop)
    }

    fn validate_optimizer(&self) -> Result<()> {
        let o = &self.optimizer;
        let finite = |name: &str, x: f64, min: f64, example: &str| {
            require(x.is_finite() && x >= min, || {
                format!("optimizer.{name} is {x}; it must be a finite number of at least {min}, e.g. {example}")
            })
        };
        finite("lr", o.lr, 0.0, "0.001")?;
        finite("eps", o.eps, f64::MIN_POSITIVE, "1e-8")?;
        finite("weight_decay", o.weight_decay, 0.0, "0.1")?;
        for (i, b) in o.betas.iter().enumerate() {
            require((0.0..1.0).contains(b), || {
                format!("optimizer.betas[{i}] is {b}; it must be at least 0 and below 1, e.g. betas: [0.9, 0.95]")
            })?;
        }
        if let Some(clip) = o.grad_clip {
            finite("grad_clip", clip, f64::MIN_POSITIVE, "1.0")?;
        }
        if let Schedule::WarmupCosine { min_lr_ratio, .. } = self.schedule {
            require((0.0..=1.0).contains(&min_lr_ratio), || {
                format!(
                    "schedule.min_lr_ratio is {min_lr_ratio}; it must be between 0 and 1, e.g. 0.1"
                )
            })?;
        }
        Ok(())
    }
}
