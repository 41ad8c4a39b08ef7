//! The training loop: one [`Trainer::step`] is load batch → forward/backward → clip → AdamW →
//! refresh the compute weights. Everything a trainer allocates is freed when it is dropped.

use crate::backend::CpuDevice;
use crate::checkpoint::state::{RngState, ScheduleState, TrainerState, FORMAT_VERSION};
use crate::checkpoint::{self, Entry, LoadRequest, SaveRequest};
use crate::data::{DataConfig, DataLoader};
use crate::error::{EngineError, Result};
use crate::loss::LossKind;
use crate::memory::{Category, MemoryStats};
use crate::model::{weights, Checkpointing, LlamaConfig, Model, Params, PassOutput};
use crate::optim::{clip_grad_norm, AdamW, AdamWConfig, Schedule};
use crate::tensor::Tensor;
use half::bf16;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The arithmetic of a training step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
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
}

fn default_loss() -> LossKind {
    LossKind::Standard
}

impl TrainConfig {
    /// What a checkpoint must share with a run to resume it: everything that changes the
    /// numbers (model, precision, optimizer, schedule, data, batch shape), not how memory is
    /// managed (checkpointing, loss chunking) nor where the initial weights came from.
    pub fn identity(&self) -> serde_json::Value {
        serde_json::json!({
            "model": self.model,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "schedule": self.schedule,
            "data": self.data,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "shuffle_seed": self.shuffle_seed,
        })
    }

    fn master_category(&self) -> Category {
        match self.precision {
            Precision::Fp32 => Category::Params,
            Precision::Bf16Mixed => Category::Optimizer,
        }
    }
}

/// What one step did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// The step's 0-based index.
    pub step: u64,
    /// Mean loss of the step's batch.
    pub loss: f32,
    /// Learning rate applied.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Labels counted.
    pub tokens: usize,
    /// Blocks recomputed in the backward pass.
    pub recomputed_blocks: usize,
    /// Memory figures, peaks covering this step only.
    pub memory: MemoryStats,
}

/// The weights a step reads and the optimizer writes.
// One long-lived value per trainer: boxing the larger variant would save nothing.
#[allow(clippy::large_enum_variant)]
pub enum Weights {
    /// f32 parameters, used directly.
    Fp32(Params<Tensor<f32>>),
    /// f32 master weights (optimizer state) and their bf16 copy used by the passes.
    Bf16Mixed {
        /// What AdamW updates.
        master: Params<Tensor<f32>>,
        /// What forward and backward read.
        compute: Params<Tensor<bf16>>,
    },
}

impl Weights {
    /// The f32 weights the optimizer owns.
    pub fn master(&self) -> &Params<Tensor<f32>> {
        match self {
            Weights::Fp32(p) => p,
            Weights::Bf16Mixed { master, .. } => master,
        }
    }
}

/// A model in training on one device.
pub struct Trainer {
    cfg: TrainConfig,
    dev: CpuDevice,
    model: Model,
    weights: Weights,
    grads: Params<Tensor<f32>>,
    optimizer: AdamW,
    loader: DataLoader,
    step: u64,
}

impl Trainer {
    /// Builds a fresh trainer: model buffers, initial weights, gradients and the data loader.
    pub fn new(cfg: TrainConfig, dev: CpuDevice) -> Result<Self> {
        let master_category = cfg.master_category();
        let model = Model::new(&dev, cfg.model.clone())?;
        let master = match &cfg.init {
            Init::Random { seed, std } => {
                weights::init_params(&dev, &cfg.model, *seed, *std, master_category)?
            }
            Init::HfDir { path } => {
                let (hf_cfg, params) = weights::load_hf_dir(&dev, path, master_category)?;
                if hf_cfg != cfg.model {
                    return Err(EngineError::Config(format!(
                        "{}: config.json does not match the run's model configuration",
                        path.display()
                    )));
                }
                params
            }
        };
        Self::with_master(cfg, dev, model, master)
    }

    fn with_master(
        cfg: TrainConfig,
        dev: CpuDevice,
        model: Model,
        master: Params<Tensor<f32>>,
    ) -> Result<Self> {
        let weights = match cfg.precision {
            Precision::Fp32 => Weights::Fp32(master),
            Precision::Bf16Mixed => {
                let compute = bf16_copy(&dev, &cfg.model, &master)?;
                Weights::Bf16Mixed { master, compute }
            }
        };
        let grads = Params::try_new(&cfg.model, |s| dev.zeros::<f32>(&s.shape, Category::Grads))?;
        let loader = DataLoader::new(
            &cfg.data,
            cfg.model.vocab_size,
            cfg.batch_size,
            cfg.seq_len,
            cfg.shuffle_seed,
        )?;
        Ok(Trainer {
            optimizer: AdamW::new(cfg.optimizer.clone()),
            cfg,
            dev,
            model,
            weights,
            grads,
            loader,
            step: 0,
        })
    }

    /// Continues the run saved in `checkpoint_dir` (a checkpoint, or a run directory whose
    /// `latest` names one): weights, optimizer state, step, schedule and loader position. The
    /// checkpoint must come from a run with the same [`TrainConfig::identity`].
    pub fn resume(
        cfg: TrainConfig,
        dev: CpuDevice,
        checkpoint_dir: &std::path::Path,
    ) -> Result<Self> {
        let model = Model::new(&dev, cfg.model.clone())?;
        let loaded = checkpoint::load(
            &dev,
            checkpoint_dir,
            &LoadRequest {
                config: &cfg.model,
                identity: cfg.identity(),
                master_in_optimizer: cfg.precision == Precision::Bf16Mixed,
                master_category: cfg.master_category(),
            },
        )?;
        let mut trainer = Self::with_master(cfg, dev, model, loaded.master)?;
        if let Some(moments) = loaded.moments {
            trainer
                .optimizer
                .set_state(moments, loaded.state.optimizer_step);
        }
        trainer.loader.set_state(loaded.state.loader);
        trainer.step = loaded.state.global_step;
        Ok(trainer)
    }

    /// Saves a checkpoint of the current state under `run_dir` (see [`checkpoint::save`]),
    /// keeping the newest `keep_last`; returns its directory.
    pub fn save(
        &self,
        run_dir: &std::path::Path,
        keep_last: Option<usize>,
    ) -> Result<std::path::PathBuf> {
        let specs = crate::model::param_specs(&self.cfg.model);
        let mut model = Vec::new();
        let mut optimizer = Vec::new();
        match &self.weights {
            Weights::Fp32(p) => {
                for (s, t) in specs.iter().zip(p.tensors()) {
                    model.push(Entry::tensor(s.name.clone(), t));
                }
            }
            Weights::Bf16Mixed { master, compute } => {
                for (s, t) in specs.iter().zip(compute.tensors()) {
                    model.push(Entry::tensor(s.name.clone(), t));
                }
                for (s, t) in specs.iter().zip(master.tensors()) {
                    optimizer.push(Entry::tensor(format!("{}.master", s.name), t));
                }
            }
        }
        if let Some(m) = self.optimizer.moments() {
            for ((s, a), b) in specs
                .iter()
                .zip(m.exp_avg.tensors())
                .zip(m.exp_avg_sq.tensors())
            {
                optimizer.push(Entry::tensor(format!("{}.exp_avg", s.name), a));
                optimizer.push(Entry::tensor(format!("{}.exp_avg_sq", s.name), b));
            }
        }
        let identity = self.cfg.identity();
        let state = TrainerState {
            format_version: FORMAT_VERSION,
            global_step: self.step,
            optimizer_step: self.optimizer.step_count(),
            schedule: ScheduleState {
                schedule: self.cfg.schedule.clone(),
                peak_lr: self.cfg.optimizer.lr,
                next_lr: self.cfg.schedule.lr(self.cfg.optimizer.lr, self.step),
            },
            loader: self.loader.state(),
            rng: RngState {
                seed: self.cfg.shuffle_seed,
                offset: 0,
            },
            fingerprint: checkpoint::fingerprint(&identity),
            identity,
            files: Default::default(),
        };
        let req = SaveRequest {
            config: &self.cfg.model,
            model,
            optimizer,
            state,
        };
        checkpoint::save(run_dir, req, keep_last)
    }

    /// The run's configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// The device the trainer allocates on.
    pub fn device(&self) -> &CpuDevice {
        &self.dev
    }

    /// Steps taken so far (the index of the next step).
    pub fn step_index(&self) -> u64 {
        self.step
    }

    /// The weights.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The optimizer and its state.
    pub fn optimizer(&self) -> &AdamW {
        &self.optimizer
    }

    /// The data loader.
    pub fn loader(&self) -> &DataLoader {
        &self.loader
    }

    /// One training step on the next batch.
    pub fn step(&mut self) -> Result<StepStats> {
        let tracker = self.dev.tracker().clone();
        tracker.reset_peak();
        let batch = self.loader.next_batch();
        for g in self.grads.tensors_mut() {
            g.fill(0.0);
        }
        let pass = self.forward_backward(&batch)?;
        let grad_norm = clip_grad_norm(&self.dev, &mut self.grads, self.cfg.optimizer.grad_clip);
        let lr = self.cfg.schedule.lr(self.cfg.optimizer.lr, self.step);
        match &mut self.weights {
            Weights::Fp32(p) => {
                self.optimizer
                    .update(&self.dev, &self.cfg.model, p, &self.grads, lr)?
            }
            Weights::Bf16Mixed { master, compute } => {
                self.optimizer
                    .update(&self.dev, &self.cfg.model, master, &self.grads, lr)?;
                for (c, m) in compute.tensors_mut().into_iter().zip(master.tensors()) {
                    crate::backend::cpu::kernels::convert(
                        &self.dev,
                        m.as_slice(),
                        c.as_mut_slice(),
                    );
                }
            }
        }
        let stats = StepStats {
            step: self.step,
            loss: pass.loss,
            lr,
            grad_norm,
            tokens: pass.tokens,
            recomputed_blocks: pass.recomputed_blocks,
            memory: tracker.stats(),
        };
        self.step += 1;
        Ok(stats)
    }

    fn forward_backward(&mut self, batch: &crate::model::Batch) -> Result<PassOutput> {
        let (ckpt, loss) = (self.cfg.checkpointing, self.cfg.loss);
        match &self.weights {
            Weights::Fp32(p) => {
                self.model
                    .forward_backward(&self.dev, p, &mut self.grads, batch, ckpt, loss)
            }
            Weights::Bf16Mixed { compute, .. } => {
                self.model
                    .forward_backward(&self.dev, compute, &mut self.grads, batch, ckpt, loss)
            }
        }
    }
}

/// A bf16 copy of f32 weights, counted as params.
pub fn bf16_copy(
    dev: &CpuDevice,
    cfg: &LlamaConfig,
    master: &Params<Tensor<f32>>,
) -> Result<Params<Tensor<bf16>>> {
    let mut src = master.tensors().into_iter();
    Params::try_new(cfg, |_| {
        let m = src.next().expect("same layout");
        Ok(dev.convert::<f32, bf16>(m, Category::Params)?)
    })
}
