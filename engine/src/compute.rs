//! The device half of a trainer. A [`Compute`] owns the weights, gradients and optimizer moments
//! on one device and runs a step's arithmetic there; the [`crate::Trainer`] owns what is the same
//! on every device: the schedule, the data and the checkpoints.

use crate::backend::cpu::kernels;
use crate::backend::CpuDevice;
use crate::checkpoint::Entry;
use crate::error::Result;
use crate::fault::Fault;
use crate::loss::LossKind;
use crate::memory::{Category, MemoryTracker};
use crate::model::{
    param_specs, Batch, Checkpointing, Dropout, Model, Params, PassConfig, PassOutput,
};
use crate::optim::{clip_grad_norm, AdamW, Moments};
use crate::tensor::Tensor;
use crate::trainer::{bf16_copy, Precision, TrainConfig};
use half::bf16;

/// What a device does for a trainer.
pub trait Compute: Send {
    /// Zeroes the gradients, then runs one forward and backward pass over `batch` with
    /// `dropout` (if any), adding every parameter's gradient.
    fn forward_backward(
        &mut self,
        batch: &Batch,
        checkpointing: Checkpointing,
        loss: LossKind,
        dropout: Option<Dropout>,
    ) -> Result<PassOutput>;

    /// The global L2 norm of the gradients before clipping; scales them down to `max_norm` as
    /// `torch.nn.utils.clip_grad_norm_` does.
    fn clip_grad_norm(&mut self, max_norm: Option<f64>) -> Result<f64>;

    /// One AdamW update at learning rate `lr` (the moments are allocated at the first), then the
    /// compute weights refreshed from the master weights.
    fn adamw_step(&mut self, lr: f64) -> Result<()>;

    /// AdamW updates taken so far.
    fn optimizer_steps(&self) -> u64;

    /// What a checkpoint holds: `model.safetensors` entries (the weights the passes read, in
    /// Hugging Face names) and `optimizer.safetensors` entries (`<name>.master` in bf16-mixed,
    /// `<name>.exp_avg` and `<name>.exp_avg_sq` once the moments exist).
    fn checkpoint_entries(&self) -> Result<(Vec<Entry<'_>>, Vec<Entry<'_>>)>;

    /// The tracker counting this device's bytes.
    fn tracker(&self) -> &MemoryTracker;

    /// The concrete state, for tests that read a backend's tensors.
    fn as_any(&self) -> &dyn std::any::Any;
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

/// The CPU's [`Compute`]: tensors on a [`CpuDevice`], the model's explicit passes, and AdamW.
pub struct CpuCompute {
    dev: CpuDevice,
    cfg: TrainConfig,
    model: Model,
    weights: Weights,
    grads: Params<Tensor<f32>>,
    optimizer: AdamW,
    /// Tensors a fault keeps past their pass ([`Fault::RecomputeInputsKept`]), freed on drop.
    kept: Vec<Box<dyn std::any::Any + Send>>,
}

impl CpuCompute {
    /// Builds the state of a run from its f32 `master` weights (allocated on `dev`) and, when
    /// resuming, the saved moments with their step count.
    pub fn new(
        cfg: &TrainConfig,
        dev: CpuDevice,
        master: Params<Tensor<f32>>,
        moments: Option<(Moments, u64)>,
    ) -> Result<Self> {
        let model = Model::new(&dev, cfg.model.clone())?;
        let weights = match cfg.precision {
            Precision::Fp32 => Weights::Fp32(master),
            Precision::Bf16Mixed => {
                let compute = bf16_copy(&dev, &cfg.model, &master)?;
                Weights::Bf16Mixed { master, compute }
            }
        };
        let grads = Params::try_new(&cfg.model, |s| dev.zeros::<f32>(&s.shape, Category::Grads))?;
        let mut optimizer = AdamW::new(cfg.optimizer.clone());
        if let Some((moments, step)) = moments {
            optimizer.set_state(moments, step);
        }
        Ok(CpuCompute {
            dev,
            cfg: cfg.clone(),
            model,
            weights,
            grads,
            optimizer,
            kept: Vec::new(),
        })
    }

    /// The device.
    pub fn device(&self) -> &CpuDevice {
        &self.dev
    }

    /// The weights.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The optimizer and its state.
    pub fn optimizer(&self) -> &AdamW {
        &self.optimizer
    }
}

impl Compute for CpuCompute {
    fn forward_backward(
        &mut self,
        batch: &Batch,
        checkpointing: Checkpointing,
        loss: LossKind,
        dropout: Option<Dropout>,
    ) -> Result<PassOutput> {
        for g in self.grads.tensors_mut() {
            g.fill(0.0);
        }
        let (dev, model, grads) = (&self.dev, &self.model, &mut self.grads);
        let pass = PassConfig {
            checkpointing,
            loss,
            dropout,
            faults: &self.cfg.faults,
        };
        let out = match &self.weights {
            Weights::Fp32(p) => {
                let (out, kept) = model.forward_backward_with(dev, p, grads, batch, &pass)?;
                self.kept.extend(kept.into_iter().map(|t| Box::new(t) as _));
                out
            }
            Weights::Bf16Mixed { compute, .. } => {
                let (out, kept) = model.forward_backward_with(dev, compute, grads, batch, &pass)?;
                self.kept.extend(kept.into_iter().map(|t| Box::new(t) as _));
                out
            }
        };
        Ok(out)
    }

    fn clip_grad_norm(&mut self, max_norm: Option<f64>) -> Result<f64> {
        Ok(clip_grad_norm(&self.dev, &mut self.grads, max_norm))
    }

    fn adamw_step(&mut self, lr: f64) -> Result<()> {
        let (dev, model) = (&self.dev, &self.cfg.model);
        match &mut self.weights {
            Weights::Fp32(p) => self.optimizer.update(dev, model, p, &self.grads, lr),
            Weights::Bf16Mixed { master, compute } => {
                self.optimizer.update(dev, model, master, &self.grads, lr)?;
                for (c, m) in compute.tensors_mut().into_iter().zip(master.tensors()) {
                    kernels::convert(dev, m.as_slice(), c.as_mut_slice());
                }
                Ok(())
            }
        }
    }

    fn optimizer_steps(&self) -> u64 {
        self.optimizer.step_count()
    }

    fn checkpoint_entries(&self) -> Result<(Vec<Entry<'_>>, Vec<Entry<'_>>)> {
        let specs = param_specs(&self.cfg.model);
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
        Ok((model, optimizer))
    }

    fn tracker(&self) -> &MemoryTracker {
        self.dev.tracker()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for CpuCompute {
    /// Frees everything, except that [`Fault::OptimizerStateRetained`] leaks the AdamW moments:
    /// their bytes stay counted on the tracker after the trainer is gone.
    fn drop(&mut self) {
        if self.cfg.faults.has(Fault::OptimizerStateRetained) {
            if let Some(moments) = self.optimizer.take_moments() {
                std::mem::forget(moments);
            }
        }
    }
}
