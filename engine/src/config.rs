//! The run schema: everything that defines a training run ([`TrainConfig`]), what a checkpoint
//! must share with a run to resume it ([`TrainConfig::identity`]), and the checks that refuse an
//! impossible run before anything is allocated ([`TrainConfig::validate`]).

use crate::data::text::TextData;
use crate::data::{DataConfig, DataLoader, LongBatch};
use crate::error::{EngineError, Result, Setting};
use crate::fault::Faults;
use crate::memory::Category;
use crate::model::loss::LossKind;
use crate::model::{Checkpointing, LlamaConfig};
use crate::optim::{AdamWConfig, Schedule};
use crate::parallel::Parallel;
use crate::validation::ValidationConfig;
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
    /// Rows per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimizer step (gradient accumulation): each step draws this many
    /// batches of `batch_size` rows and weights every token's loss by the step's total counted
    /// labels; 1 (the default) is a step of one batch.
    #[serde(
        default = "default_accumulation",
        skip_serializing_if = "accumulates_nothing"
    )]
    pub accumulation: usize,
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
    /// Data parallelism: ranks and what they shard; one rank by default. Not part of the
    /// identity: the bits do not depend on it.
    #[serde(default, skip_serializing_if = "Parallel::is_single")]
    pub parallel: Parallel,
    /// A validation split and when it is evaluated; none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<ValidationConfig>,
}

fn default_loss() -> LossKind {
    LossKind::Standard
}

fn default_accumulation() -> usize {
    1
}

fn accumulates_nothing(accumulation: &usize) -> bool {
    *accumulation == 1
}

/// `Err` unless `ok`: the value at `key` is wrong as `message` says.
fn require(ok: bool, key: &str, message: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Setting::new(key, message()).into())
    }
}

impl TrainConfig {
    /// A run of `model` on `batch_size` rows of `seq_len` tokens: seeded random weights (seed 0,
    /// std 0.02) in fp32, AdamW (lr 1e-3, betas 0.9 and 0.95, ε 1e-8, weight decay 0.1, the
    /// gradient norm clipped at 1) at a constant learning rate, the synthetic data (seed 0, 4096
    /// samples of 4 likely successors a token, full rows, shuffled with seed 0), one
    /// micro-batch a step, no activation checkpointing, the standard loss, no dropout, long
    /// batches or faults, one rank. Every run built in code (tests, benches, fuzz targets,
    /// `estimate`'s flags) starts here and changes what it needs, so that a new setting is
    /// added in one place.
    pub fn new(model: LlamaConfig, batch_size: usize, seq_len: usize) -> Self {
        TrainConfig {
            model,
            init: Init::Random { seed: 0, std: 0.02 },
            precision: Precision::Fp32,
            optimizer: AdamWConfig {
                lr: 1e-3,
                betas: [0.9, 0.95],
                eps: 1e-8,
                weight_decay: 0.1,
                grad_clip: Some(1.0),
            },
            schedule: Schedule::Constant,
            data: DataConfig::Synthetic {
                seed: 0,
                samples: 4096,
                branching: 4,
                min_len: None,
            },
            batch_size,
            accumulation: 1,
            seq_len,
            shuffle_seed: 0,
            checkpointing: Checkpointing::None,
            loss: LossKind::Standard,
            dropout: 0.0,
            long_batch: None,
            faults: Faults::default(),
            parallel: Parallel::default(),
            validation: None,
        }
    }

    /// What a checkpoint must share with a run to resume it: everything that changes the
    /// numbers (model, precision, optimizer, schedule, data, batch shape, accumulation, dropout,
    /// long batches), not how memory is managed (checkpointing, loss chunking) nor where the
    /// initial weights came from. A token file is recorded by its content, not its path
    /// ([`DataConfig::identity`]), so it is read here. Accumulation, dropout and long batches
    /// appear only when set (accumulation other than 1), so runs without them keep the identity
    /// they had before these options existed.
    pub fn identity(&self) -> Result<serde_json::Value> {
        let mut identity = serde_json::json!({
            "model": self.model,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "schedule": self.schedule,
            "data": self.data.identity()?,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "shuffle_seed": self.shuffle_seed,
        });
        if self.accumulation != 1 {
            identity["accumulation"] = serde_json::json!(self.accumulation);
        }
        if self.dropout != 0.0 {
            identity["dropout"] = serde_json::json!(self.dropout);
        }
        if let Some(long) = self.long_batch {
            identity["long_batch"] = serde_json::json!(long);
        }
        if let Some(validation) = &self.validation {
            identity["validation"] = validation.identity(&self.data)?;
        }
        Ok(identity)
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

    /// Refuses ranks that cannot share a step: a world size of 0, or one that does not divide
    /// the step's micro-batches (each rank takes an equal run of them).
    pub fn validate_ranks(&self) -> Result<()> {
        let world = self.parallel.world_size;
        require(world >= 1, "parallel.world_size", || {
            "parallel.world_size is 0; write the number of ranks, at least 1".into()
        })?;
        require(
            self.accumulation.is_multiple_of(world),
            "parallel.world_size",
            || {
                format!(
                "parallel.world_size is {world}, which does not divide the {} micro-batches of a step (accumulation); each rank takes an equal run of them, so write an accumulation that is a multiple of {world} or a world_size that divides {}",
                self.accumulation, self.accumulation
            )
            },
        )
    }
    /// The run's data loader at its start: its data in rows of `batch_size` × `seq_len`, in the
    /// order of `shuffle_seed`.
    pub fn loader(&self) -> Result<DataLoader> {
        Ok(self.loaders()?.0)
    }

    /// The run's training loader at its start ([`TrainConfig::loader`], without a held-out
    /// validation share) and its validation split's loader, if it has one.
    pub fn loaders(&self) -> Result<(DataLoader, Option<DataLoader>)> {
        let loader = |data: &DataConfig| {
            DataLoader::new(
                data,
                self.model.vocab_size,
                self.batch_size,
                self.seq_len,
                self.shuffle_seed,
            )
        };
        let train = loader(&self.data)?;
        let Some(validation) = &self.validation else {
            return Ok((train, None));
        };
        validation.check(&self.data)?;
        let (train, split) =
            validation.split(train, self.shuffle_seed, |path| match &self.data {
                DataConfig::Text(text) => loader(&DataConfig::Text(TextData {
                    path: path.to_path_buf(),
                    ..text.clone()
                })),
                _ => unreachable!("checked: a validation file needs text data"),
            })?;
        Ok((train, Some(split)))
    }

    /// Everything a trainer refuses at start, checked without allocating on a device: the
    /// model's shape, every optimizer, schedule, loss and dropout value, the batch shape and
    /// accumulation, the
    /// data (a token file is read), and the initial weights' directory. The message names the
    /// value and what to write instead.
    pub fn validate(&self) -> Result<()> {
        self.model.validate().map_err(|e| e.under("model"))?;
        let max = self.model.max_position_embeddings;
        require(self.batch_size >= 1, "batch_size", || {
            "batch_size is 0; it must be at least 1".into()
        })?;
        require(self.accumulation >= 1, "accumulation", || {
            "accumulation is 0; write the micro-batches per optimizer step, at least 1 (1 accumulates nothing)".into()
        })?;
        self.validate_ranks()?;
        for (name, seq) in std::iter::once(("seq_len", self.seq_len))
            .chain(self.long_batch.map(|l| ("long_batch.seq_len", l.seq_len)))
        {
            require((1..=max).contains(&seq), name, || {
                format!("{name} is {seq}; it must be between 1 and max_position_embeddings ({max})")
            })?;
        }
        require(
            self.long_batch.is_none() || !matches!(self.data, DataConfig::Text(_)),
            "long_batch",
            || {
                "long_batch lengthens synthetic and token-file rows; text data's rows are as long as its samples, so leave long_batch out".into()
            },
        )?;
        if let Some(window) = self.model.sliding_window {
            let longest = self.long_batch.map_or(0, |l| l.seq_len).max(self.seq_len);
            require(window >= longest, "model.sliding_window", || {
                format!("model.sliding_window is {window}, shorter than the rows of {longest} tokens; the engine's attention sees every earlier token, so write rows of at most {window} tokens")
            })?;
        }
        self.validate_optimizer()?;
        if let LossKind::Chunked { chunk_tokens } = self.loss {
            require(chunk_tokens >= 1, "loss.chunk_tokens", || {
                "loss.chunk_tokens is 0; write the tokens per chunk, e.g. 1024".into()
            })?;
        }
        require((0.0..1.0).contains(&self.dropout), "dropout", || {
            format!(
                "dropout is {}; it must be at least 0 and below 1",
                self.dropout
            )
        })?;
        match &self.init {
            Init::Random { std, .. } => require(std.is_finite() && *std > 0.0, "init.std", || {
                format!("init.std is {std}; write a positive standard deviation such as 0.02")
            })?,
            Init::HfDir { path } => {
                let found = LlamaConfig::from_hf_file(&path.join("config.json")).map_err(|e| {
                    Setting::new(
                        "init.path",
                        format!("init.path: {e}; write the directory of a Hugging Face checkpoint (config.json and model.safetensors)"),
                    )
                })?;
                require(found == self.model, "init.path", || {
                    format!(
                        "{}: config.json does not match the run's model configuration",
                        path.display()
                    )
                })?;
                let weights = path.join("model.safetensors");
                std::fs::metadata(&weights).map_err(|e| EngineError::io(&weights, e))?;
            }
        }
        match (self.loader(), &self.data) {
            (Ok(_), _) => Ok(()),
            (
                Err(e @ (EngineError::Io { .. } | EngineError::BadFile { .. })),
                DataConfig::TokenFile { .. },
            ) => Err(Setting::new(
                "data.path",
                format!("data.path: {e}; write the path of a file of token ids"),
            )
            .into()),
            (Err(e), _) => Err(e),
        }
    }

    fn validate_optimizer(&self) -> Result<()> {
        let o = &self.optimizer;
        let finite = |name: &str, x: f64, zero_allowed: bool, example: &str| {
            let bound = if zero_allowed {
                "at least 0"
            } else {
                "above 0"
            };
            let ok = x.is_finite() && (x > 0.0 || (zero_allowed && x == 0.0));
            require(ok, &format!("optimizer.{name}"), || {
                format!(
                    "optimizer.{name} is {x}; it must be a finite number {bound}, e.g. {example}"
                )
            })
        };
        finite("lr", o.lr, true, "0.001")?;
        finite("eps", o.eps, false, "1e-8")?;
        finite("weight_decay", o.weight_decay, true, "0.1")?;
        for (i, b) in o.betas.iter().enumerate() {
            require(
                (0.0..1.0).contains(b),
                &format!("optimizer.betas[{i}]"),
                || {
                    format!("optimizer.betas[{i}] is {b}; it must be at least 0 and below 1, e.g. betas: [0.9, 0.95]")
                },
            )?;
        }
        if let Some(clip) = o.grad_clip {
            finite("grad_clip", clip, false, "1.0")?;
        }
        if let Schedule::WarmupCosine { min_lr_ratio, .. } = self.schedule {
            require(
                (0.0..=1.0).contains(&min_lr_ratio),
                "schedule.min_lr_ratio",
                || {
                    format!(
                    "schedule.min_lr_ratio is {min_lr_ratio}; it must be between 0 and 1, e.g. 0.1"
                )
                },
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> TrainConfig {
        TrainConfig {
            schedule: Schedule::WarmupCosine {
                warmup_steps: 1,
                horizon: 4,
                min_lr_ratio: 0.1,
            },
            data: DataConfig::Synthetic {
                seed: 0,
                samples: 8,
                branching: 2,
                min_len: None,
            },
            ..TrainConfig::new(
                LlamaConfig {
                    max_position_embeddings: 16,
                    ..LlamaConfig::new(32, 8, 16, 1, 2, 1)
                },
                2,
                8,
            )
        }
    }

    /// Every value a trainer would refuse at start is refused here, by name and with its key,
    /// before anything is allocated; the run it starts from is accepted.
    #[test]
    fn impossible_values_are_refused_by_name() {
        run().validate().unwrap();
        type Breaks = fn(&mut TrainConfig);
        let cases: Vec<(&str, &str, Breaks)> = vec![
            ("optimizer.lr", "optimizer.lr is -0.001", |r| {
                r.optimizer.lr = -1e-3
            }),
            ("optimizer.lr", "optimizer.lr is NaN", |r| {
                r.optimizer.lr = f64::NAN
            }),
            ("optimizer.betas[0]", "optimizer.betas[0] is 1.5", |r| {
                r.optimizer.betas = [1.5, 2.0]
            }),
            ("optimizer.eps", "optimizer.eps is 0", |r| {
                r.optimizer.eps = 0.0
            }),
            ("optimizer.grad_clip", "optimizer.grad_clip is -1", |r| {
                r.optimizer.grad_clip = Some(-1.0)
            }),
            (
                "schedule.min_lr_ratio",
                "schedule.min_lr_ratio is -0.5",
                |r| {
                    r.schedule = Schedule::WarmupCosine {
                        warmup_steps: 0,
                        horizon: 4,
                        min_lr_ratio: -0.5,
                    }
                },
            ),
            ("loss.chunk_tokens", "loss.chunk_tokens is 0", |r| {
                r.loss = LossKind::Chunked { chunk_tokens: 0 }
            }),
            ("batch_size", "batch_size is 0", |r| r.batch_size = 0),
            ("accumulation", "accumulation is 0", |r| r.accumulation = 0),
            ("parallel.world_size", "parallel.world_size is 0", |r| {
                r.parallel.world_size = 0
            }),
            ("seq_len", "seq_len is 17", |r| r.seq_len = 17),
            ("dropout", "dropout is 1", |r| r.dropout = 1.0),
            ("init.std", "init.std is -1", |r| {
                r.init = Init::Random { seed: 0, std: -1.0 }
            }),
            ("model.head_dim", "head_dim is 0", |r| {
                r.model.head_dim = Some(0)
            }),
            (
                "model.sliding_window",
                "model.sliding_window is 4, shorter than the rows of 8 tokens",
                |r| r.model.sliding_window = Some(4),
            ),
            ("data.min_len", "data.min_len is 9", |r| {
                r.data = DataConfig::Synthetic {
                    seed: 0,
                    samples: 8,
                    branching: 2,
                    min_len: Some(9),
                }
            }),
            ("data.samples", "data.samples must be at least 1", |r| {
                r.data = DataConfig::Synthetic {
                    seed: 0,
                    samples: 0,
                    branching: 2,
                    min_len: None,
                }
            }),
            ("init.path", "init.path", |r| {
                r.init = Init::HfDir {
                    path: "no/such/dir".into(),
                }
            }),
            ("data.path", "data.path", |r| {
                r.data = DataConfig::TokenFile {
                    path: "no/such/tokens.bin".into(),
                    dtype: crate::data::TokenDtype::U16,
                }
            }),
        ];
        for (key, want, break_it) in cases {
            let mut r = run();
            break_it(&mut r);
            let err = r.validate().expect_err(want);
            assert!(err.to_string().contains(want), "{want}: {err}");
            match err {
                EngineError::Setting(s) => assert_eq!(s.key, key, "{want}"),
                other => panic!("{want}: not a setting's error: {other:?}"),
            }
        }
    }
}
