//! The training loop: one [`Trainer::step`] is load batch → forward/backward → clip → AdamW →
//! refresh the compute weights. Everything a trainer allocates is freed when it is dropped.

use crate::backend::cuda::CudaCompute;
use crate::backend::{CpuDevice, CudaDevice};
use crate::checkpoint::state::{RngState, ScheduleState, TrainerState, FORMAT_VERSION};
use crate::checkpoint::{self, LoadRequest, SaveRequest};
use crate::compute::{Compute, CpuCompute};
use crate::data::{DataConfig, DataLoader, LoaderState, LongBatch};
use crate::error::{EngineError, Result};
use crate::fault::{Fault, Faults};
use crate::loss::LossKind;
use crate::memory::{Category, MemoryStats, MemoryTracker};
use crate::model::{weights, Checkpointing, Dropout, LlamaConfig, Params};
use crate::optim::{AdamWConfig, Moments, Schedule};
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

    fn validate(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(EngineError::Config(format!(
                "dropout is {}; it must be at least 0 and below 1",
                self.dropout
            )));
        }
        if let Some(long) = self.long_batch {
            let max = self.model.max_position_embeddings;
            if long.seq_len == 0 || long.seq_len > max {
                return Err(EngineError::Config(format!(
                    "long_batch.seq_len is {}; it must be between 1 and max_position_embeddings ({max})",
                    long.seq_len
                )));
            }
        }
        Ok(())
    }

    pub(crate) fn master_category(&self) -> Category {
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
    /// sha256 of the batch's token ids and labels: which data the step saw.
    pub batch_digest: String,
    /// Blocks recomputed in the backward pass.
    pub recomputed_blocks: usize,
    /// Memory figures, peaks covering this step only.
    pub memory: MemoryStats,
}

/// Where a trainer computes.
#[derive(Clone, Debug)]
pub enum Device {
    /// The CPU backend.
    Cpu(CpuDevice),
    /// The CUDA backend.
    Cuda(CudaDevice),
}

impl Device {
    /// The tracker counting the device's bytes.
    pub fn tracker(&self) -> &MemoryTracker {
        match self {
            Device::Cpu(d) => d.tracker(),
            Device::Cuda(d) => d.tracker(),
        }
    }

    /// Where tensors read from files are staged before they reach the device: the device itself
    /// on the CPU, a host device of the GPU's on CUDA.
    fn staging(&self) -> CpuDevice {
        match self {
            Device::Cpu(d) => d.clone(),
            Device::Cuda(d) => d.staging().clone(),
        }
    }
}

impl From<CpuDevice> for Device {
    fn from(dev: CpuDevice) -> Self {
        Device::Cpu(dev)
    }
}

impl From<CudaDevice> for Device {
    fn from(dev: CudaDevice) -> Self {
        Device::Cuda(dev)
    }
}

/// Digests of the training state, to compare a resumed run with the run it continues.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateDigest {
    /// Steps taken.
    pub step: u64,
    /// sha256 over every `model.safetensors` tensor (name, dtype, shape, bytes).
    pub params: String,
    /// sha256 over every `optimizer.safetensors` tensor (masters and moments).
    pub optimizer: String,
    /// AdamW updates taken.
    pub optimizer_steps: u64,
    /// The learning rate the next step will use.
    pub next_lr: f64,
    /// The data loader's position.
    pub loader: LoaderState,
    /// The dropout generator's state.
    pub rng: RngState,
}

/// A model in training on one device.
pub struct Trainer {
    cfg: TrainConfig,
    dev: Device,
    compute: Box<dyn Compute>,
    loader: DataLoader,
    step: u64,
    rng: RngState,
    resumed_at: u64,
}

impl Trainer {
    /// Builds a fresh trainer: initial weights, gradients and the data loader.
    pub fn new(cfg: TrainConfig, dev: impl Into<Device>) -> Result<Self> {
        cfg.validate()?;
        let dev = dev.into();
        let staging = dev.staging();
        let category = cfg.master_category();
        let master = match &cfg.init {
            Init::Random { seed, std } => {
                weights::init_params(&staging, &cfg.model, *seed, *std, category)?
            }
            Init::HfDir { path } => {
                let (hf_cfg, params) = weights::load_hf_dir(&staging, path, category)?;
                if hf_cfg != cfg.model {
                    return Err(EngineError::Config(format!(
                        "{}: config.json does not match the run's model configuration",
                        path.display()
                    )));
                }
                params
            }
        };
        let compute = Self::compute(&cfg, &dev, master, None)?;
        Self::assemble(cfg, dev, compute)
    }

    fn compute(
        cfg: &TrainConfig,
        dev: &Device,
        master: Params<Tensor<f32>>,
        moments: Option<(Moments, u64)>,
    ) -> Result<Box<dyn Compute>> {
        Ok(match dev {
            Device::Cpu(d) => Box::new(CpuCompute::new(cfg, d.clone(), master, moments)?),
            Device::Cuda(d) => Box::new(CudaCompute::new(cfg, d.clone(), master, moments)?),
        })
    }

    fn assemble(cfg: TrainConfig, dev: Device, compute: Box<dyn Compute>) -> Result<Self> {
        let loader = DataLoader::new(
            &cfg.data,
            cfg.model.vocab_size,
            cfg.batch_size,
            cfg.seq_len,
            cfg.shuffle_seed,
        )?;
        let rng = RngState {
            seed: cfg.shuffle_seed,
            offset: 0,
        };
        Ok(Trainer {
            cfg,
            dev,
            compute,
            loader,
            step: 0,
            rng,
            resumed_at: 0,
        })
    }

    /// Continues the run saved in `checkpoint_dir` (a checkpoint, or a run directory whose
    /// `latest` names one): weights, optimizer state, step, schedule, loader position and
    /// dropout generator. The checkpoint must come from a run with the same
    /// [`TrainConfig::identity`].
    pub fn resume(
        cfg: TrainConfig,
        dev: impl Into<Device>,
        checkpoint_dir: &std::path::Path,
    ) -> Result<Self> {
        cfg.validate()?;
        let dev = dev.into();
        let loaded = checkpoint::load(
            &dev.staging(),
            checkpoint_dir,
            &LoadRequest {
                config: &cfg.model,
                identity: cfg.identity(),
                master_in_optimizer: cfg.precision == Precision::Bf16Mixed,
                master_category: cfg.master_category(),
                fresh_moments_if_missing: cfg.faults.has(Fault::MomentsNotSaved),
            },
        )?;
        let moments = loaded.moments.map(|m| (m, loaded.state.optimizer_step));
        let compute = Self::compute(&cfg, &dev, loaded.master, moments)?;
        let mut trainer = Self::assemble(cfg, dev, compute)?;
        let faults = &trainer.cfg.faults;
        if !faults.has(Fault::LoaderPositionNotRestored) {
            trainer.loader.set_state(loaded.state.loader);
        }
        trainer.rng = RngState {
            offset: if faults.has(Fault::RngNotRestored) {
                0
            } else {
                loaded.state.rng.offset
            },
            ..loaded.state.rng
        };
        trainer.step = loaded.state.global_step;
        trainer.resumed_at = loaded.state.global_step;
        Ok(trainer)
    }

    /// Saves a checkpoint of the current state under `run_dir` (see [`checkpoint::save`]),
    /// keeping the newest `keep_last`; returns its directory.
    pub fn save(
        &self,
        run_dir: &std::path::Path,
        keep_last: Option<usize>,
    ) -> Result<std::path::PathBuf> {
        let (model, mut optimizer) = self.compute.checkpoint_entries()?;
        if self.cfg.faults.has(Fault::MomentsNotSaved) {
            optimizer.retain(|e| !e.name.ends_with(".exp_avg") && !e.name.ends_with(".exp_avg_sq"));
        }
        let identity = self.cfg.identity();
        let state = TrainerState {
            format_version: FORMAT_VERSION,
            global_step: self.step,
            optimizer_step: self.compute.optimizer_steps(),
            schedule: ScheduleState {
                schedule: self.cfg.schedule.clone(),
                peak_lr: self.cfg.optimizer.lr,
                next_lr: self.next_lr(),
            },
            loader: self.loader.state(),
            rng: self.rng,
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

    /// Digests of the weights, the optimizer state, the step, the next learning rate, the
    /// loader position and the dropout generator's state.
    pub fn state_digest(&self) -> Result<StateDigest> {
        let (model, optimizer) = self.compute.checkpoint_entries()?;
        Ok(StateDigest {
            step: self.step,
            params: checkpoint::entries_digest(&model),
            optimizer: checkpoint::entries_digest(&optimizer),
            optimizer_steps: self.compute.optimizer_steps(),
            next_lr: self.next_lr(),
            loader: self.loader.state(),
            rng: self.rng,
        })
    }

    fn next_lr(&self) -> f64 {
        let step = if self.cfg.faults.has(Fault::ScheduleReset) {
            self.step - self.resumed_at
        } else {
            self.step
        };
        self.cfg.schedule.lr(self.cfg.optimizer.lr, step)
    }

    /// The run's configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// The device the trainer computes on.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// The tracker counting the device's bytes.
    pub fn tracker(&self) -> &MemoryTracker {
        self.compute.tracker()
    }

    /// The CPU state, when the trainer runs on the CPU (tests read its tensors directly).
    pub fn cpu(&self) -> Option<&CpuCompute> {
        self.compute.as_any().downcast_ref::<CpuCompute>()
    }

    /// Steps taken so far (the index of the next step).
    pub fn step_index(&self) -> u64 {
        self.step
    }

    /// The data loader.
    pub fn loader(&self) -> &DataLoader {
        &self.loader
    }

    /// One training step on the next batch.
    pub fn step(&mut self) -> Result<StepStats> {
        let tracker = self.compute.tracker().clone();
        tracker.reset_peak();
        let batch = self.loader.next_batch_of(self.cfg.seq_len_at(self.step));
        let dropout = (self.cfg.dropout > 0.0).then_some(Dropout {
            p: self.cfg.dropout,
            seed: self.rng.seed,
            offset: self.rng.offset,
        });
        let pass = self.compute.forward_backward(
            &batch,
            self.cfg.checkpointing,
            self.cfg.loss,
            dropout,
        )?;
        let grad_norm = self.compute.clip_grad_norm(self.cfg.optimizer.grad_clip)?;
        let lr = self.next_lr();
        self.compute.adamw_step(lr)?;
        let stats = StepStats {
            step: self.step,
            loss: pass.loss,
            lr,
            grad_norm,
            tokens: pass.tokens,
            batch_digest: batch.digest(),
            recomputed_blocks: pass.recomputed_blocks,
            memory: tracker.stats(),
        };
        self.step += 1;
        self.rng.offset += 1;
        Ok(stats)
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
