//! AdamW with PyTorch's arithmetic, global-norm gradient clipping, and a warmup + cosine
//! learning-rate schedule whose horizon stays pinned when training runs past it.

use crate::backend::CpuDevice;
use crate::error::Result;
use crate::memory::Category;
use crate::model::{LlamaConfig, Params};
use crate::tensor::Tensor;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// AdamW hyper-parameters (torch.optim.AdamW's, weight decay on every parameter).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamWConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// Moment decay rates (β₁, β₂).
    #[serde(default = "default_betas")]
    pub betas: [f64; 2],
    /// Denominator epsilon.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Decoupled weight decay.
    #[serde(default)]
    pub weight_decay: f64,
    /// Largest global gradient norm; gradients are scaled down above it.
    #[serde(default)]
    pub grad_clip: Option<f64>,
}

fn default_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn default_eps() -> f64 {
    1e-8
}

/// How the learning rate moves with the step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum Schedule {
    /// The peak rate at every step.
    Constant,
    /// Linear warmup to the peak, then cosine decay to `min_lr_ratio · peak` at `horizon`, and
    /// that floor after it.
    WarmupCosine {
        /// Steps of linear warmup.
        warmup_steps: u64,
        /// The step at which the decay ends.
        horizon: u64,
        /// The floor as a fraction of the peak.
        #[serde(default)]
        min_lr_ratio: f64,
    },
}

impl Schedule {
    /// The learning rate of step `step` (0-based) for a peak of `peak`.
    pub fn lr(&self, peak: f64, step: u64) -> f64 {
        match *self {
            Schedule::Constant => peak,
            Schedule::WarmupCosine {
                warmup_steps,
                horizon,
                min_lr_ratio,
            } => {
                if step < warmup_steps {
                    return peak * (step + 1) as f64 / warmup_steps as f64;
                }
                if step >= horizon {
                    return peak * min_lr_ratio;
                }
                let span = (horizon - warmup_steps).max(1) as f64;
                let progress = (step - warmup_steps) as f64 / span;
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                peak * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
            }
        }
    }
}

/// AdamW's two moments, laid out like the parameters.
pub struct Moments {
    /// First moment (PyTorch's `exp_avg`).
    pub exp_avg: Params<Tensor<f32>>,
    /// Second moment (PyTorch's `exp_avg_sq`).
    pub exp_avg_sq: Params<Tensor<f32>>,
}

/// AdamW's state: both moments per parameter (allocated at the first update) and the step count.
pub struct AdamW {
    cfg: AdamWConfig,
    moments: Option<Moments>,
    step: u64,
}

/// Elements per task in element-wise updates and per partial sum of the gradient norm (on
/// every backend). Fixed, so that sums do not depend on the thread count.
pub(crate) const CHUNK: usize = 4096;

impl AdamW {
    /// A fresh optimizer with no state yet.
    pub fn new(cfg: AdamWConfig) -> Self {
        AdamW {
            cfg,
            moments: None,
            step: 0,
        }
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// Updates taken so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// First and second moments, once the first update has allocated them.
    pub fn moments(&self) -> Option<&Moments> {
        self.moments.as_ref()
    }

    /// Takes the moments out, leaving none.
    pub(crate) fn take_moments(&mut self) -> Option<Moments> {
        self.moments.take()
    }

    /// Installs saved moments and step count (when resuming).
    pub fn set_state(&mut self, moments: Moments, step: u64) {
        self.moments = Some(moments);
        self.step = step;
    }

    /// One AdamW update of `params` with `grads` at learning rate `lr`, as
    /// `torch.optim.AdamW` computes it.
    pub fn update(
        &mut self,
        dev: &CpuDevice,
        cfg: &LlamaConfig,
        params: &mut Params<Tensor<f32>>,
        grads: &Params<Tensor<f32>>,
        lr: f64,
    ) -> Result<()> {
        if self.moments.is_none() {
            let zeros =
                |spec: &crate::model::ParamSpec| dev.zeros::<f32>(&spec.shape, Category::Optimizer);
            self.moments = Some(Moments {
                exp_avg: Params::try_new(cfg, zeros)?,
                exp_avg_sq: Params::try_new(cfg, zeros)?,
            });
        }
        self.step += 1;
        let Moments {
            exp_avg: m,
            exp_avg_sq: v,
        } = self.moments.as_mut().expect("allocated above");
        let [b1, b2] = self.cfg.betas;
        let t = self.step as i32;
        let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        let step_size = (lr / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let decay = (1.0 - lr * self.cfg.weight_decay) as f32;
        let (b1, b2, eps) = (b1 as f32, b2 as f32, self.cfg.eps as f32);
        let tensors = params
            .tensors_mut()
            .into_iter()
            .zip(grads.tensors())
            .zip(m.tensors_mut().into_iter().zip(v.tensors_mut()));
        for ((p, g), (m, v)) in tensors {
            dev.install(|| {
                p.as_mut_slice()
                    .par_chunks_mut(CHUNK)
                    .zip(g.as_slice().par_chunks(CHUNK))
                    .zip(
                        m.as_mut_slice()
                            .par_chunks_mut(CHUNK)
                            .zip(v.as_mut_slice().par_chunks_mut(CHUNK)),
                    )
                    .for_each(|((p, g), (m, v))| {
                        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                            *p *= decay;
                            *m += (g - *m) * (1.0 - b1);
                            *v = *v * b2 + (1.0 - b2) * g * g;
                            let denom = v.sqrt() / bc2_sqrt + eps;
                            *p -= step_size * *m / denom;
                        }
                    })
            });
        }
        Ok(())
    }
}

/// The global L2 norm of all gradients, summed in a fixed order (f64).
pub fn grad_norm(dev: &CpuDevice, grads: &Params<Tensor<f32>>) -> f64 {
    let mut total = 0.0f64;
    for g in grads.tensors() {
        let partial: Vec<f64> = dev.install(|| {
            g.as_slice()
                .par_chunks(CHUNK)
                .map(|c| c.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>())
                .collect()
        });
        total += partial.iter().sum::<f64>();
    }
    total.sqrt()
}

/// Scales gradients so their global norm is at most `max_norm`, as
/// `torch.nn.utils.clip_grad_norm_` does; returns the norm before clipping.
pub fn clip_grad_norm(
    dev: &CpuDevice,
    grads: &mut Params<Tensor<f32>>,
    max_norm: Option<f64>,
) -> f64 {
    let norm = grad_norm(dev, grads);
    if let Some(max) = max_norm {
        let coef = (max / (norm + 1e-6)).min(1.0) as f32;
        if coef < 1.0 {
            for g in grads.tensors_mut() {
                g.as_mut_slice().iter_mut().for_each(|x| *x *= coef);
            }
        }
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_decays_and_stays_pinned_past_the_horizon() {
        let s = Schedule::WarmupCosine {
            warmup_steps: 2,
            horizon: 10,
            min_lr_ratio: 0.1,
        };
        assert_eq!(s.lr(1.0, 0), 0.5);
        assert_eq!(s.lr(1.0, 1), 1.0);
        assert_eq!(s.lr(1.0, 2), 1.0);
        assert!((s.lr(1.0, 6) - 0.55).abs() < 1e-12);
        assert!((s.lr(1.0, 10) - 0.1).abs() < 1e-12);
        assert_eq!(s.lr(1.0, 13), s.lr(1.0, 10));
        assert!(s.lr(1.0, 9) > s.lr(1.0, 10));
    }
}
