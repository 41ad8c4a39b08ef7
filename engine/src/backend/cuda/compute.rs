//! [`CudaCompute`]: the trainer's device half on a GPU. Weights, gradients and AdamW moments
//! live in device memory; checkpoints get host copies in the CPU backend's names and dtypes.

use super::device::CudaDevice;
use super::kernels::{self, AdamWArgs};
use super::model::CudaModel;
use super::tensor::CudaTensor;
use crate::checkpoint::Entry;
use crate::compute::Compute;
use crate::error::Result;
use crate::fault::Fault;
use crate::loss::LossKind;
use crate::memory::{Category, MemoryTracker};
use crate::model::dropout::Dropout;
use crate::model::{param_specs, Batch, Checkpointing, Params, PassConfig, PassOutput};
use crate::optim::{Moments, CHUNK};
use crate::tensor::{Elem, Tensor};
use crate::trainer::{Precision, TrainConfig};
use half::bf16;
use std::borrow::Cow;

/// The weights a step reads and the optimizer writes.
// One long-lived value per trainer: boxing the larger variant would save nothing.
#[allow(clippy::large_enum_variant)]
enum Weights {
    /// f32 parameters, used directly.
    Fp32(Params<CudaTensor<f32>>),
    /// f32 master weights and their bf16 copy used by the passes.
    Bf16Mixed {
        master: Params<CudaTensor<f32>>,
        compute: Params<CudaTensor<bf16>>,
    },
}

impl Weights {
    fn master(&self) -> &Params<CudaTensor<f32>> {
        match self {
            Weights::Fp32(p) => p,
            Weights::Bf16Mixed { master, .. } => master,
        }
    }
}

/// AdamW's moments on the device.
struct DeviceMoments {
    exp_avg: Params<CudaTensor<f32>>,
    exp_avg_sq: Params<CudaTensor<f32>>,
}

/// The GPU's [`Compute`].
pub struct CudaCompute {
    dev: CudaDevice,
    cfg: TrainConfig,
    model: CudaModel,
    weights: Weights,
    grads: Params<CudaTensor<f32>>,
    moments: Option<DeviceMoments>,
    step: u64,
    /// Tensors a fault keeps past their pass ([`Fault::RecomputeInputsKept`]), freed on drop.
    kept: Vec<Box<dyn std::any::Any + Send>>,
}

impl CudaCompute {
    /// Uploads a run's f32 `master` weights and, when resuming, its saved moments and step
    /// count; the host tensors can be dropped afterwards.
    pub fn new(
        cfg: &TrainConfig,
        dev: CudaDevice,
        master: Params<Tensor<f32>>,
        moments: Option<(Moments, u64)>,
    ) -> Result<Self> {
        let model = CudaModel::new(&dev, cfg.model.clone())?;
        let master = upload(&dev, &cfg.model, &master, cfg.master_category())?;
        let weights = match cfg.precision {
            Precision::Fp32 => Weights::Fp32(master),
            Precision::Bf16Mixed => {
                let mut compute = Params::try_new(&cfg.model, |s| {
                    dev.zeros::<bf16>(&s.shape, Category::Params)
                })?;
                refresh(&dev, &master, &mut compute)?;
                Weights::Bf16Mixed { master, compute }
            }
        };
        let grads = Params::try_new(&cfg.model, |s| dev.zeros::<f32>(&s.shape, Category::Grads))?;
        let (moments, step) = match moments {
            Some((m, step)) => (
                Some(DeviceMoments {
                    exp_avg: upload(&dev, &cfg.model, &m.exp_avg, Category::Optimizer)?,
                    exp_avg_sq: upload(&dev, &cfg.model, &m.exp_avg_sq, Category::Optimizer)?,
                }),
                step,
            ),
            None => (None, 0),
        };
        Ok(CudaCompute {
            dev,
            cfg: cfg.clone(),
            model,
            weights,
            grads,
            moments,
            step,
            kept: Vec::new(),
        })
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// Every parameter's gradient on the host, in [`param_specs`] order.
    pub fn gradients(&self) -> Result<Vec<Vec<f32>>> {
        self.grads
            .tensors()
            .into_iter()
            .map(|t| self.dev.download(t))
            .collect()
    }

    /// Every parameter's f32 master weights on the host, in [`param_specs`] order.
    pub fn master_weights(&self) -> Result<Vec<Vec<f32>>> {
        self.weights
            .master()
            .tensors()
            .into_iter()
            .map(|t| self.dev.download(t))
            .collect()
    }
}

/// Device copies of host parameters, counted under `category`.
fn upload(
    dev: &CudaDevice,
    cfg: &crate::model::LlamaConfig,
    host: &Params<Tensor<f32>>,
    category: Category,
) -> Result<Params<CudaTensor<f32>>> {
    let mut src = host.tensors().into_iter();
    Params::try_new(cfg, |_| {
        dev.upload(src.next().expect("same layout"), category)
    })
}

/// `compute = master` rounded to bf16.
fn refresh(
    dev: &CudaDevice,
    master: &Params<CudaTensor<f32>>,
    compute: &mut Params<CudaTensor<bf16>>,
) -> Result<()> {
    for (c, m) in compute.tensors_mut().into_iter().zip(master.tensors()) {
        kernels::to_bf16(dev, m, c)?;
    }
    Ok(())
}

/// Tensors of any element type, as [`CudaCompute`] keeps them for a fault.
fn boxed<E: Elem>(kept: Vec<CudaTensor<E>>) -> Vec<Box<dyn std::any::Any + Send>> {
    kept.into_iter().map(|t| Box::new(t) as _).collect()
}

/// A checkpoint entry holding a host copy of `t`.
fn entry<E: Elem>(dev: &CudaDevice, name: String, t: &CudaTensor<E>) -> Result<Entry<'static>> {
    Ok(Entry {
        name,
        dtype: match E::DTYPE {
            crate::tensor::DType::F32 => safetensors::Dtype::F32,
            crate::tensor::DType::Bf16 => safetensors::Dtype::BF16,
        },
        shape: t.shape().to_vec(),
        data: Cow::Owned(dev.download_bytes(t.buffer())?),
    })
}

impl Compute for CudaCompute {
    fn forward_backward(
        &mut self,
        batch: &Batch,
        checkpointing: Checkpointing,
        loss: LossKind,
        dropout: Option<Dropout>,
    ) -> Result<PassOutput> {
        for g in self.grads.tensors() {
            self.dev.memset_zero(g.ptr(), g.bytes() as usize)?;
        }
        let pass = PassConfig {
            checkpointing,
            loss,
            dropout,
            faults: &self.cfg.faults,
        };
        let (dev, model, grads) = (&self.dev, &self.model, &mut self.grads);
        let (out, kept) = match &self.weights {
            Weights::Fp32(p) => {
                let (out, kept) = model.forward_backward(dev, p, grads, batch, &pass)?;
                (out, boxed(kept))
            }
            Weights::Bf16Mixed { compute, .. } => {
                let (out, kept) = model.forward_backward(dev, compute, grads, batch, &pass)?;
                (out, boxed(kept))
            }
        };
        self.kept.extend(kept);
        Ok(out)
    }

    fn clip_grad_norm(&mut self, max_norm: Option<f64>) -> Result<f64> {
        let grads = self.grads.tensors();
        let chunks: Vec<usize> = grads.iter().map(|g| g.numel().div_ceil(CHUNK)).collect();
        let partial = self
            .dev
            .alloc(chunks.iter().sum::<usize>() * 8, Category::Workspace)?;
        let mut offset = 0;
        for (g, &c) in grads.iter().zip(&chunks) {
            kernels::sum_squares(&self.dev, g, partial.ptr() + (offset * 8) as u64, CHUNK)?;
            offset += c;
        }
        let partial: Vec<f64> = super::tensor::from_bytes(&self.dev.download_bytes(&partial)?);
        let mut total = 0.0f64;
        let mut rest = partial.as_slice();
        for &c in &chunks {
            let (mine, tail) = rest.split_at(c);
            total += mine.iter().sum::<f64>();
            rest = tail;
        }
        let norm = total.sqrt();
        if let Some(max) = max_norm {
            let coef = (max / (norm + 1e-6)).min(1.0) as f32;
            if coef < 1.0 {
                for g in self.grads.tensors_mut() {
                    kernels::scale(&self.dev, g, coef)?;
                }
            }
        }
        Ok(norm)
    }

    fn adamw_step(&mut self, lr: f64) -> Result<()> {
        let dev = &self.dev;
        if self.moments.is_none() {
            let zeros =
                |s: &crate::model::ParamSpec| dev.zeros::<f32>(&s.shape, Category::Optimizer);
            self.moments = Some(DeviceMoments {
                exp_avg: Params::try_new(&self.cfg.model, zeros)?,
                exp_avg_sq: Params::try_new(&self.cfg.model, zeros)?,
            });
        }
        self.step += 1;
        let opt = &self.cfg.optimizer;
        let [b1, b2] = opt.betas;
        let t = self.step as i32;
        let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        let (b1, b2) = (b1 as f32, b2 as f32);
        let args = AdamWArgs {
            decay: (1.0 - lr * opt.weight_decay) as f32,
            one_minus_b1: 1.0 - b1,
            b2,
            one_minus_b2: 1.0 - b2,
            eps: opt.eps as f32,
            step_size: (lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
        };
        let DeviceMoments {
            exp_avg,
            exp_avg_sq,
        } = self.moments.as_mut().expect("allocated above");
        let master = match &mut self.weights {
            Weights::Fp32(p) => p,
            Weights::Bf16Mixed { master, .. } => master,
        };
        let tensors = master
            .tensors_mut()
            .into_iter()
            .zip(self.grads.tensors())
            .zip(
                exp_avg
                    .tensors_mut()
                    .into_iter()
                    .zip(exp_avg_sq.tensors_mut()),
            );
        for ((p, g), (m, v)) in tensors {
            kernels::adamw(dev, p, g, m, v, args)?;
        }
        if let Weights::Bf16Mixed { master, compute } = &mut self.weights {
            refresh(dev, master, compute)?;
        }
        Ok(())
    }

    fn optimizer_steps(&self) -> u64 {
        self.step
    }

    fn checkpoint_entries(&self) -> Result<(Vec<Entry<'_>>, Vec<Entry<'_>>)> {
        let specs = param_specs(&self.cfg.model);
        let dev = &self.dev;
        let mut model = Vec::new();
        let mut optimizer = Vec::new();
        match &self.weights {
            Weights::Fp32(p) => {
                for (s, t) in specs.iter().zip(p.tensors()) {
                    model.push(entry(dev, s.name.clone(), t)?);
                }
            }
            Weights::Bf16Mixed { master, compute } => {
                for (s, t) in specs.iter().zip(compute.tensors()) {
                    model.push(entry(dev, s.name.clone(), t)?);
                }
                for (s, t) in specs.iter().zip(master.tensors()) {
                    optimizer.push(entry(dev, format!("{}.master", s.name), t)?);
                }
            }
        }
        if let Some(m) = &self.moments {
            for ((s, a), b) in specs
                .iter()
                .zip(m.exp_avg.tensors())
                .zip(m.exp_avg_sq.tensors())
            {
                optimizer.push(entry(dev, format!("{}.exp_avg", s.name), a)?);
                optimizer.push(entry(dev, format!("{}.exp_avg_sq", s.name), b)?);
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

impl Drop for CudaCompute {
    /// Frees everything, except that [`Fault::OptimizerStateRetained`] leaks the AdamW moments:
    /// their bytes stay counted on the tracker, and held in the pool, after the trainer is gone.
    fn drop(&mut self) {
        if self.cfg.faults.has(Fault::OptimizerStateRetained) {
            if let Some(moments) = self.moments.take() {
                std::mem::forget(moments);
            }
        }
    }
}
