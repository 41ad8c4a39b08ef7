//! AdamW with PyTorch's arithmetic, global-norm gradient clipping, and a warmup + cosine
//! learning-rate schedule whose horizon stays pinned when training runs past it.

use crate::device::{AdamWArgs, Device};
use crate::error::Result;
use crate::memory::Category;
use crate::model::{LlamaConfig, ParamSpec, Params};
use crate::parallel::plan::shard_shape;
use serde::{Deserialize, Serialize};
use std::ops::Range;

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
pub struct Moments<D: Device> {
    /// First moment (PyTorch's `exp_avg`).
    pub exp_avg: Params<D::Tensor<f32>>,
    /// Second moment (PyTorch's `exp_avg_sq`).
    pub exp_avg_sq: Params<D::Tensor<f32>>,
}

impl AdamWConfig {
    /// The scalars of update `t` (1-based) at learning rate `lr`.
    pub fn args(&self, lr: f64, t: u64) -> AdamWArgs {
        let cfg = self;
        let [b1, b2] = cfg.betas;
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        let (b1, b2) = (b1 as f32, b2 as f32);
        AdamWArgs {
            decay: (1.0 - lr * cfg.weight_decay) as f32,
            one_minus_b1: 1.0 - b1,
            b2,
            one_minus_b2: 1.0 - b2,
            eps: cfg.eps as f32,
            step_size: (lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
        }
    }
}

/// AdamW's state: both moments per parameter (allocated at the first update) and the step count.
pub struct AdamW<D: Device> {
    cfg: AdamWConfig,
    moments: Option<Moments<D>>,
    step: u64,
}

/// Elements per task in element-wise updates and per partial sum of the gradient norm (on
/// every backend). Fixed, so that sums do not depend on the thread count.
pub const CHUNK: usize = 4096;

impl<D: Device> AdamW<D> {
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
    pub fn moments(&self) -> Option<&Moments<D>> {
        self.moments.as_ref()
    }

    /// Takes the moments out, leaving none.
    pub(crate) fn take_moments(&mut self) -> Option<Moments<D>> {
        self.moments.take()
    }

    /// Installs saved moments and step count (when resuming).
    pub fn set_state(&mut self, moments: Moments<D>, step: u64) {
        self.moments = Some(moments);
        self.step = step;
    }

    /// One AdamW update of `params` with `grads` at learning rate `lr`, as
    /// `torch.optim.AdamW` computes it; the moments are allocated at the first.
    pub fn update(
        &mut self,
        dev: &D,
        cfg: &LlamaConfig,
        params: &mut Params<D::Tensor<f32>>,
        grads: &Params<D::Tensor<f32>>,
        lr: f64,
    ) -> Result<()> {
        let (
            args,
            Moments {
                exp_avg: m,
                exp_avg_sq: v,
            },
        ) = self.next_update(dev, cfg, lr, |spec| spec.shape.clone())?;
        let tensors = params
            .tensors_mut()
            .into_iter()
            .zip(grads.tensors())
            .zip(m.tensors_mut().into_iter().zip(v.tensors_mut()));
        for ((p, g), (m, v)) in tensors {
            dev.adamw(p, g, (m, v), args)?;
        }
        Ok(())
    }
}

impl<D: Device> AdamW<D> {
    /// Counts an update and returns its scalars at learning rate `lr` and the moments, which
    /// the first update allocates, each of the shape `shape` gives its parameter.
    fn next_update(
        &mut self,
        dev: &D,
        cfg: &LlamaConfig,
        lr: f64,
        mut shape: impl FnMut(&ParamSpec) -> Vec<usize>,
    ) -> Result<(AdamWArgs, &mut Moments<D>)> {
        if self.moments.is_none() {
            let mut zeros =
                |spec: &ParamSpec| dev.zeros_kept::<f32>(&shape(spec), Category::Optimizer);
            self.moments = Some(Moments {
                exp_avg: Params::try_new(cfg, &mut zeros)?,
                exp_avg_sq: Params::try_new(cfg, &mut zeros)?,
            });
        }
        self.step += 1;
        let args = self.cfg.args(lr, self.step);
        Ok((args, self.moments.as_mut().expect("allocated above")))
    }

    /// One AdamW update of a shard of every tensor: rows `shards[i].0` (of `shards[i].1`
    /// elements each) of parameter `i`. The moments hold those rows only (allocated at the
    /// first update), and so do the parameters and the gradients where `sharded` says so (else
    /// they are whole); each element gets the bits [`AdamW::update`] gives it.
    #[allow(clippy::too_many_arguments)]
    pub fn update_shard(
        &mut self,
        dev: &D,
        cfg: &LlamaConfig,
        params: &mut Params<D::Tensor<f32>>,
        grads: &Params<D::Tensor<f32>>,
        shards: &[(Range<usize>, usize)],
        sharded: ShardedParts,
        lr: f64,
    ) -> Result<()> {
        // The shapes are asked for once per moment, each time parameter by parameter.
        let mut i = 0;
        let (
            args,
            Moments {
                exp_avg: m,
                exp_avg_sq: v,
            },
        ) = self.next_update(dev, cfg, lr, |spec| {
            i += 1;
            shard_shape(&spec.shape, shards[(i - 1) % shards.len()].0.len())
        })?;
        let tensors = params
            .tensors_mut()
            .into_iter()
            .zip(grads.tensors())
            .zip(m.tensors_mut().into_iter().zip(v.tensors_mut()))
            .zip(shards);
        for (((p, g), (m, v)), (rows, row)) in tensors {
            let offset = rows.start * row;
            let at = |sharded: bool| if sharded { 0 } else { offset };
            dev.adamw_range(p, g, (m, v), args, (at(sharded.params), at(sharded.grads)))?;
        }
        Ok(())
    }
}

/// Which tensors [`AdamW::update_shard`] gets as a rank's rows only (the others whole).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardedParts {
    /// The f32 weights it updates.
    pub params: bool,
    /// The gradients it reads.
    pub grads: bool,
}

/// The factor `torch.nn.utils.clip_grad_norm_` scales gradients of norm `norm` by to bring
/// them to `max_norm`; `None` where they are within it.
pub fn clip_coefficient(norm: f64, max_norm: Option<f64>) -> Option<f32> {
    let coef = (max_norm? / (norm + 1e-6)).min(1.0) as f32;
    (coef < 1.0).then_some(coef)
}

/// The global L2 norm of all gradients, summed in a fixed order (f64).
pub fn grad_norm<D: Device>(dev: &D, grads: &Params<D::Tensor<f32>>) -> Result<f64> {
    dev.norm(&grads.tensors())
}

/// Scales gradients so their global norm is at most `max_norm`, as
/// `torch.nn.utils.clip_grad_norm_` does; returns the norm before clipping.
pub fn clip_grad_norm<D: Device>(
    dev: &D,
    grads: &mut Params<D::Tensor<f32>>,
    max_norm: Option<f64>,
) -> Result<f64> {
    let norm = grad_norm(dev, grads)?;
    if let Some(coef) = clip_coefficient(norm, max_norm) {
        for g in grads.tensors_mut() {
            dev.scale(g, coef)?;
        }
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpuDevice, Tensor};

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
        // A horizon at the warmup's end: the floor right after the peak.
        let abrupt = Schedule::WarmupCosine {
            warmup_steps: 3,
            horizon: 3,
            min_lr_ratio: 0.5,
        };
        assert_eq!((abrupt.lr(1.0, 2), abrupt.lr(1.0, 3)), (1.0, 0.5));
    }

    #[test]
    fn a_constant_schedule_is_the_peak_and_a_warmup_ends_at_it() {
        assert_eq!(Schedule::Constant.lr(0.25, 0), 0.25);
        assert_eq!(Schedule::Constant.lr(0.25, 1000), 0.25);
        let s = Schedule::WarmupCosine {
            warmup_steps: 4,
            horizon: 8,
            min_lr_ratio: 0.0,
        };
        let lrs: Vec<f64> = (0..10).map(|step| s.lr(2.0, step)).collect();
        let cosine = |x: f64| 1.0 + (std::f64::consts::PI * x).cos();
        let want = [
            0.5,
            1.0,
            1.5,
            2.0,
            cosine(0.0),
            cosine(0.25),
            cosine(0.5),
            cosine(0.75),
            0.0,
            0.0,
        ];
        for (step, (got, want)) in lrs.iter().zip(want).enumerate() {
            assert!((got - want).abs() < 1e-12, "step {step}: {got} vs {want}");
        }
    }

    #[test]
    fn adamw_defaults_to_torch_s() {
        let cfg: AdamWConfig = serde_json::from_str(r#"{"lr": 0.5}"#).unwrap();
        assert_eq!(
            cfg,
            AdamWConfig {
                lr: 0.5,
                betas: [0.9, 0.999],
                eps: 1e-8,
                weight_decay: 0.0,
                grad_clip: None,
            }
        );
    }

    fn config() -> AdamWConfig {
        AdamWConfig {
            lr: 1e-2,
            betas: [0.9, 0.95],
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: None,
        }
    }

    /// The scalars of the third update: bias corrections 1 − 0.9³ = 0.271 and 1 − 0.95³ =
    /// 0.142625.
    #[test]
    fn the_update_s_scalars_are_torch_s() {
        let a = config().args(1e-2, 3);
        let close = |got: f32, want: f64| ((got as f64 - want) / want).abs() < 1e-6;
        assert!(close(a.decay, 0.999), "{a:?}");
        assert!(close(a.one_minus_b1, 0.1), "{a:?}");
        assert!(close(a.b2, 0.95), "{a:?}");
        assert!(close(a.one_minus_b2, 0.05), "{a:?}");
        assert!(close(a.eps, 1e-8), "{a:?}");
        assert!(close(a.step_size, 1e-2 / 0.271), "{a:?}");
        assert!(close(a.bc2_sqrt, 0.142625f64.sqrt()), "{a:?}");
    }

    /// A model of one layer, small enough to check every element.
    fn tiny() -> LlamaConfig {
        serde_json::from_str(
            r#"{"vocab_size": 4, "hidden_size": 4, "intermediate_size": 4,
                "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1}"#,
        )
        .unwrap()
    }

    /// Parameters or gradients of `cfg`, element `i` of every tensor `f(i)`.
    fn filled(dev: &CpuDevice, cfg: &LlamaConfig, f: impl Fn(usize) -> f32) -> Params<Tensor<f32>> {
        let mut p = Params::try_new(cfg, |s| dev.zeros::<f32>(&s.shape, Category::Params)).unwrap();
        for t in p.tensors_mut() {
            for (i, x) in t.as_mut_slice().iter_mut().enumerate() {
                *x = f(i);
            }
        }
        p
    }

    /// Elements over every tensor of `p`.
    fn elements(p: &Params<Tensor<f32>>) -> usize {
        p.tensors().iter().map(|t| t.as_slice().len()).sum()
    }

    #[test]
    fn two_updates_follow_torch_s_adamw_and_count_themselves() {
        let dev = CpuDevice::new(1, u64::MAX).unwrap();
        let cfg = tiny();
        let start = |i: usize| 0.5 - 0.125 * (i % 8) as f32;
        let grad = |i: usize| 0.25 * (i % 5) as f32 - 0.5;
        let mut p = filled(&dev, &cfg, start);
        let g = filled(&dev, &cfg, grad);
        let mut opt = AdamW::<CpuDevice>::new(config());
        assert!(opt.moments().is_none());
        for lr in [1e-2, 5e-3] {
            opt.update(&dev, &cfg, &mut p, &g, lr).unwrap();
        }
        assert_eq!(opt.step_count(), 2);
        let (b1, b2, eps, wd) = (0.9f64, 0.95f64, 1e-8, 0.1);
        for t in p.tensors() {
            for (i, &got) in t.as_slice().iter().enumerate() {
                let (gi, mut x, mut m, mut v) = (grad(i) as f64, start(i) as f64, 0.0, 0.0);
                for (step, lr) in [(1, 1e-2), (2, 5e-3)] {
                    x *= 1.0 - lr * wd;
                    m = b1 * m + (1.0 - b1) * gi;
                    v = b2 * v + (1.0 - b2) * gi * gi;
                    let (bc1, bc2) = (1.0 - b1.powi(step), 1.0 - b2.powi(step));
                    x -= lr / bc1 * m / ((v / bc2).sqrt() + eps);
                }
                assert!((got as f64 - x).abs() < 1e-6, "[{i}]: {got} vs {x}");
            }
        }
        let m = opt.moments().unwrap();
        let m0 = m.exp_avg.tensors()[0].as_slice()[1] as f64;
        let want = (0.1 * 0.9 + 0.1) * grad(1) as f64;
        assert!((m0 - want).abs() < 1e-7, "{m0} vs {want}");
    }

    #[test]
    fn clipping_scales_down_to_the_limit_only_above_it() {
        let dev = CpuDevice::new(1, u64::MAX).unwrap();
        let cfg = tiny();
        let mut g = filled(&dev, &cfg, |_| 1.0);
        let norm = (elements(&g) as f64).sqrt();
        assert_eq!(
            clip_grad_norm(&dev, &mut g, Some(norm + 1.0)).unwrap(),
            norm
        );
        assert!(g
            .tensors()
            .iter()
            .all(|t| t.as_slice().iter().all(|&x| x == 1.0)));
        assert_eq!(clip_grad_norm(&dev, &mut g, None).unwrap(), norm);
        assert_eq!(clip_grad_norm(&dev, &mut g, Some(2.0)).unwrap(), norm);
        let clipped = grad_norm(&dev, &g).unwrap();
        assert!((clipped - 2.0).abs() < 1e-5, "{clipped}");
    }

    /// torch's coefficient is `max / (norm + 1e-6)`: at a norm of 2e-6 and a limit of 1e-6 it
    /// is a third.
    #[test]
    fn the_clipping_coefficient_adds_a_millionth_to_the_norm() {
        let dev = CpuDevice::new(1, u64::MAX).unwrap();
        let cfg = tiny();
        let x = (2e-6 / (elements(&filled(&dev, &cfg, |_| 0.0)) as f64).sqrt()) as f32;
        let mut g = filled(&dev, &cfg, |_| x);
        let norm = clip_grad_norm(&dev, &mut g, Some(1e-6)).unwrap();
        let clipped = grad_norm(&dev, &g).unwrap();
        let want = norm / 3.0;
        assert!((clipped - want).abs() < 1e-3 * want, "{clipped} vs {want}");
    }
}
