//! The training state on one device, written once over [`Device`]: the weights the passes read
//! (and their f32 masters in bf16-mixed), the gradients and AdamW's moments; one step's
//! arithmetic on them; what a checkpoint holds of them; and the faults that act on them.

use crate::checkpoint::Entry;
use crate::config::{Precision, TrainConfig};
use crate::device::{safetensors_dtype, Device, DeviceTensor, StepPhase};
use crate::error::{EngineError, Result};
use crate::fault::Fault;
use crate::memory::Category;
use crate::model::loss::counted;
use crate::model::{
    param_specs, Batch, Dropout, LlamaConfig, Model, Params, PassConfig, PassHooks, PassOutput,
    StepShare,
};
use crate::optim::{clip_grad_norm, AdamW, Moments, ShardedParts};
use crate::parallel::Shard;
use crate::tensor::Elem;
use half::bf16;

/// The weights a step reads and the optimizer writes.
pub enum Weights<D: Device> {
    /// f32 parameters, used directly.
    Fp32(Params<D::Tensor<f32>>),
    /// f32 master weights (optimizer state) and their bf16 copy used by the passes.
    Bf16Mixed {
        /// What AdamW updates.
        master: Params<D::Tensor<f32>>,
        /// What forward and backward read.
        compute: Params<D::Tensor<bf16>>,
    },
}

impl<D: Device> Weights<D> {
    /// The f32 weights the optimizer owns.
    pub fn master(&self) -> &Params<D::Tensor<f32>> {
        match self {
            Weights::Fp32(p) => p,
            Weights::Bf16Mixed { master, .. } => master,
        }
    }

    /// The f32 weights the optimizer owns, to write.
    pub fn master_mut(&mut self) -> &mut Params<D::Tensor<f32>> {
        match self {
            Weights::Fp32(p) => p,
            Weights::Bf16Mixed { master, .. } => master,
        }
    }
}

/// A copy of f32 weights rounded to `E`, counted as params.
pub fn rounded<D: Device, E: Elem>(
    dev: &D,
    cfg: &LlamaConfig,
    master: &Params<D::Tensor<f32>>,
) -> Result<Params<D::Tensor<E>>> {
    let mut src = master.tensors().into_iter();
    Params::try_new(cfg, |spec| {
        let mut t = dev.zeros_kept::<E>(&spec.shape, Category::Params)?;
        dev.round(src.next().expect("same layout"), &mut t)?;
        Ok(t)
    })
}

/// A run's tensors on one device and the step arithmetic over them.
pub struct State<D: Device> {
    dev: D,
    cfg: TrainConfig,
    model: Model<D>,
    weights: Weights<D>,
    grads: Params<D::Tensor<f32>>,
    optimizer: AdamW<D>,
    /// Tensors a fault keeps past their pass ([`Fault::RecomputeInputsKept`]), freed on drop.
    kept: Vec<Box<dyn std::any::Any + Send>>,
}

impl<D: Device> State<D> {
    /// The state of a run from its f32 `master` weights on `dev` and, when resuming, the saved
    /// moments with their step count.
    pub fn new(
        cfg: &TrainConfig,
        dev: D,
        master: Params<D::Tensor<f32>>,
        moments: Option<(Moments<D>, u64)>,
    ) -> Result<Self> {
        let model = Model::new(&dev, cfg.model.clone())?;
        let weights = match cfg.precision {
            Precision::Fp32 => Weights::Fp32(master),
            Precision::Bf16Mixed => Weights::Bf16Mixed {
                compute: rounded(&dev, &cfg.model, &master)?,
                master,
            },
        };
        Self::assemble(cfg, dev, model, weights, None, moments)
    }

    /// The state of a run from weights and gradients built elsewhere (a data-parallel rank's,
    /// whose master weights and gradients may hold its rows only) and, when resuming, the saved
    /// moments with their step count.
    pub fn with_weights(
        cfg: &TrainConfig,
        dev: D,
        weights: Weights<D>,
        grads: Params<D::Tensor<f32>>,
        moments: Option<(Moments<D>, u64)>,
    ) -> Result<Self> {
        let model = Model::new(&dev, cfg.model.clone())?;
        Self::assemble(cfg, dev, model, weights, Some(grads), moments)
    }

    fn assemble(
        cfg: &TrainConfig,
        dev: D,
        model: Model<D>,
        weights: Weights<D>,
        grads: Option<Params<D::Tensor<f32>>>,
        moments: Option<(Moments<D>, u64)>,
    ) -> Result<Self> {
        let grads = match grads {
            Some(grads) => grads,
            None => Params::try_new(&cfg.model, |s| {
                dev.zeros_kept::<f32>(&s.shape, Category::Grads)
            })?,
        };
        let mut optimizer = AdamW::new(cfg.optimizer.clone());
        if let Some((moments, step)) = moments {
            optimizer.set_state(moments, step);
        }
        Ok(State {
            dev,
            cfg: cfg.clone(),
            model,
            weights,
            grads,
            optimizer,
            kept: Vec::new(),
        })
    }

    /// A fresh state whose master weights are zeros (the memory model's; the counting device
    /// holds no values anyway).
    pub fn zeros(cfg: &TrainConfig, dev: D) -> Result<Self> {
        let category = cfg.master_category();
        let master = Params::try_new(&cfg.model, |s| dev.zeros::<f32>(&s.shape, category))?;
        Self::new(cfg, dev, master, None)
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The weights.
    pub fn weights(&self) -> &Weights<D> {
        &self.weights
    }

    /// The gradients of the last step (all its micro-batches').
    pub fn grads(&self) -> &Params<D::Tensor<f32>> {
        &self.grads
    }

    /// The optimizer and its state.
    pub fn optimizer(&self) -> &AdamW<D> {
        &self.optimizer
    }

    /// Zeroes the gradients, then runs one forward and backward pass over `batch` with
    /// `dropout` (if any), adding every parameter's gradient.
    pub fn forward_backward(
        &mut self,
        batch: &Batch,
        dropout: Option<Dropout>,
    ) -> Result<PassOutput> {
        self.accumulate(std::slice::from_ref(batch), dropout)
    }

    /// Zeroes the gradients, then runs a forward and backward pass over each of `batches` (the
    /// micro-batches of one optimizer step) in turn, adding every parameter's gradient: the
    /// gradients are those of the step's loss ([`StepShare`]). Micro-batch `i` draws its dropout
    /// masks at the generator offset `dropout.offset + i`. Each pass frees its activations before
    /// the next starts; only the gradients live across them. Returns the step's output
    /// ([`Model::step_output`]).
    pub fn accumulate(
        &mut self,
        batches: &[Batch],
        dropout: Option<Dropout>,
    ) -> Result<PassOutput> {
        if batches.is_empty() {
            return Err(EngineError::Config(
                "an optimizer step needs at least one micro-batch".into(),
            ));
        }
        self.zero_grads()?;
        let share = StepShare {
            tokens: batches.iter().map(|b| counted(&b.labels)).sum(),
            micro_batches: batches.len(),
        };
        let passes = self.passes(batches, dropout, share, 0)?;
        Ok(self.model.step_output(passes))
    }

    /// Sets every gradient to zero.
    pub fn zero_grads(&mut self) -> Result<()> {
        for g in self.grads.tensors_mut() {
            self.dev.fill_zero(g)?;
        }
        Ok(())
    }

    /// A forward and backward pass over each of `batches` in turn, adding every parameter's
    /// gradient to what the gradients hold: micro-batches `first..` of a step of `share`
    /// (micro-batch `i` draws its dropout masks at the generator offset `dropout.offset + i`).
    /// Returns each pass's output.
    pub fn passes(
        &mut self,
        batches: &[Batch],
        dropout: Option<Dropout>,
        share: StepShare,
        first: u64,
    ) -> Result<Vec<PassOutput>> {
        self.passes_hooked(batches, dropout, share, (first, 1), &mut ())
    }

    /// [`State::passes`] over micro-batches whose global indices are `first`, `first +
    /// stride`, ..., telling `hooks` around every addition to the gradients
    /// ([`Model::forward_backward_hooked`]).
    pub fn passes_hooked(
        &mut self,
        batches: &[Batch],
        dropout: Option<Dropout>,
        share: StepShare,
        (first, stride): (u64, u64),
        hooks: &mut (impl PassHooks<D, f32> + PassHooks<D, bf16>),
    ) -> Result<Vec<PassOutput>> {
        let mut passes = Vec::with_capacity(batches.len());
        let indices = (0..).map(|k| first + k * stride);
        for (i, batch) in indices.zip(batches) {
            let pass = PassConfig {
                checkpointing: self.cfg.checkpointing,
                loss: self.cfg.loss,
                dropout: dropout.map(|d| Dropout {
                    offset: d.offset + i,
                    ..d
                }),
                faults: &self.cfg.faults,
                share: Some(share),
            };
            let (dev, model, grads) = (&self.dev, &self.model, &mut self.grads);
            let out = match &mut self.weights {
                Weights::Fp32(p) => {
                    let (out, kept) =
                        model.forward_backward_hooked(dev, p, grads, batch, &pass, hooks)?;
                    self.kept.extend(kept.into_iter().map(|t| Box::new(t) as _));
                    out
                }
                Weights::Bf16Mixed { compute, .. } => {
                    let (out, kept) =
                        model.forward_backward_hooked(dev, compute, grads, batch, &pass, hooks)?;
                    self.kept.extend(kept.into_iter().map(|t| Box::new(t) as _));
                    out
                }
            };
            passes.push(out);
        }
        Ok(passes)
    }

    /// A forward pass without gradients over each of `batches` in turn (an evaluation's),
    /// telling `hooks` around every read of a group's weights: each pass's output.
    pub fn evaluate_hooked(
        &mut self,
        batches: &[Batch],
        hooks: &mut (impl PassHooks<D, f32> + PassHooks<D, bf16>),
    ) -> Result<Vec<PassOutput>> {
        let mut passes = Vec::with_capacity(batches.len());
        let (dev, model) = (&self.dev, &self.model);
        let how = (self.cfg.loss, &self.cfg.faults);
        for batch in batches {
            passes.push(match &mut self.weights {
                Weights::Fp32(p) => model.evaluate_hooked(dev, p, batch, how, hooks)?,
                Weights::Bf16Mixed { compute, .. } => {
                    model.evaluate_hooked(dev, compute, batch, how, hooks)?
                }
            });
        }
        Ok(passes)
    }

    /// The model the passes run.
    pub fn model(&self) -> &Model<D> {
        &self.model
    }

    /// The gradients, to be filled or read by a rank's exchanges.
    pub fn grads_mut(&mut self) -> &mut Params<D::Tensor<f32>> {
        &mut self.grads
    }

    /// The f32 weights the optimizer owns, to be filled by a rank's exchanges (call
    /// [`State::refresh_compute`] after).
    pub fn master_mut(&mut self) -> &mut Params<D::Tensor<f32>> {
        self.weights.master_mut()
    }

    /// Rounds the compute weights again from the master weights (nothing to do in fp32).
    pub fn refresh_compute(&mut self) -> Result<()> {
        if let Weights::Bf16Mixed { master, compute } = &mut self.weights {
            for (c, m) in compute.tensors_mut().into_iter().zip(master.tensors()) {
                self.dev.round(m, c)?;
            }
        }
        Ok(())
    }

    /// One AdamW update at learning rate `lr` of rows `shards[i].0` (of `shards[i].1` elements)
    /// of each master weight, whose moments hold those rows only ([`AdamW::update_shard`]); in
    /// bf16-mixed, and in every precision under `stage` `full`, the master weights hold those
    /// rows only too, and under `gradients` and `full` so do the gradients. The compute weights
    /// are not refreshed: the other rows arrive from the other ranks first (or, under `full`,
    /// [`State::refresh_compute`] rounds the rank's own).
    pub fn adamw_shard(
        &mut self,
        lr: f64,
        shards: &[(std::ops::Range<usize>, usize)],
        stage: Shard,
    ) -> Result<()> {
        let mixed = matches!(self.weights, Weights::Bf16Mixed { .. });
        let sharded = ShardedParts {
            params: mixed || stage == Shard::Full,
            grads: matches!(stage, Shard::Gradients | Shard::Full),
        };
        let (dev, model, master) = (&self.dev, &self.cfg.model, self.weights.master_mut());
        self.optimizer
            .update_shard(dev, model, master, &self.grads, shards, sharded, lr)
    }

    /// The weights, to be filled by a rank's exchanges.
    pub fn weights_mut(&mut self) -> &mut Weights<D> {
        &mut self.weights
    }

    /// The global L2 norm of the gradients before clipping; scales them down to the run's
    /// `grad_clip` as `torch.nn.utils.clip_grad_norm_` does.
    pub fn clip_grad_norm(&mut self) -> Result<f64> {
        clip_grad_norm(&self.dev, &mut self.grads, self.cfg.optimizer.grad_clip)
    }

    /// One AdamW update at learning rate `lr` (the moments are allocated at the first), then the
    /// compute weights refreshed from the master weights.
    pub fn adamw_step(&mut self, lr: f64) -> Result<()> {
        let (dev, model) = (&self.dev, &self.cfg.model);
        match &mut self.weights {
            Weights::Fp32(p) => self.optimizer.update(dev, model, p, &self.grads, lr),
            Weights::Bf16Mixed { master, compute } => {
                self.optimizer.update(dev, model, master, &self.grads, lr)?;
                for (c, m) in compute.tensors_mut().into_iter().zip(master.tensors()) {
                    dev.round(m, c)?;
                }
                Ok(())
            }
        }
    }

    /// One training step's arithmetic: the passes over its micro-batches `batches` (one for a
    /// step without accumulation, see [`State::accumulate`]), clipping and the update at `lr`;
    /// returns the step's output and the gradient norm before clipping.
    pub fn train_step(
        &mut self,
        batches: &[Batch],
        dropout: Option<Dropout>,
        lr: f64,
    ) -> Result<(PassOutput, f64)> {
        let dev = self.dev.clone();
        dev.run_step(|| {
            let pass = self.accumulate(batches, dropout)?;
            self.dev.enter(StepPhase::Optimizer);
            let grad_norm = self.clip_grad_norm()?;
            self.adamw_step(lr)?;
            Ok((pass, grad_norm))
        })
    }

    /// AdamW updates taken so far.
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer.step_count()
    }

    /// The bytes of the tensors [`State::checkpoint_entries`] returns, from their sizes alone
    /// (the counting device holds no data): what an asynchronous save stages in host memory.
    pub fn checkpoint_bytes(&self) -> u64 {
        let weights = match &self.weights {
            Weights::Fp32(p) => total(p),
            Weights::Bf16Mixed { master, compute } => total(master) + total(compute),
        };
        let moments = self
            .optimizer
            .moments()
            .map_or(0, |m| total(&m.exp_avg) + total(&m.exp_avg_sq));
        weights + moments
    }

    /// The bytes of the optimizer's own state: the moments, and the master weights in
    /// bf16-mixed (what sharding the optimizer state splits between ranks).
    pub fn optimizer_state_bytes(&self) -> u64 {
        let master = match &self.weights {
            Weights::Fp32(_) => 0,
            Weights::Bf16Mixed { master, .. } => total(master),
        };
        let moments = self
            .optimizer
            .moments()
            .map_or(0, |m| total(&m.exp_avg) + total(&m.exp_avg_sq));
        master + moments
    }

    /// The name of the first checkpoint entry holding a NaN or an infinity (its rows of it,
    /// where it holds a shard), if one does.
    pub fn non_finite_entry(&self) -> Result<Option<String>> {
        let (model, optimizer) = self.checkpoint_entries()?;
        Ok(model
            .iter()
            .chain(&optimizer)
            .find(|e| !e.is_finite())
            .map(|e| e.name.clone()))
    }

    /// What a checkpoint holds: `model.safetensors` entries (the weights the passes read, in
    /// Hugging Face names) and `optimizer.safetensors` entries (`<name>.master` in bf16-mixed,
    /// `<name>.exp_avg` and `<name>.exp_avg_sq` once the moments exist).
    pub fn checkpoint_entries(&self) -> Result<(Vec<Entry<'_>>, Vec<Entry<'_>>)> {
        let specs = param_specs(&self.cfg.model);
        let mut model = Vec::new();
        let mut optimizer = Vec::new();
        let (dev, names) = (&self.dev, specs.iter().map(|s| s.name.as_str()));
        match &self.weights {
            Weights::Fp32(p) => entries(dev, names, "", p, &mut model)?,
            Weights::Bf16Mixed { master, compute } => {
                entries(dev, names.clone(), "", compute, &mut model)?;
                entries(dev, names, ".master", master, &mut optimizer)?;
            }
        }
        if let Some(m) = self.optimizer.moments() {
            let names = || specs.iter().map(|s| s.name.as_str());
            let mut avg = Vec::new();
            let mut avg_sq = Vec::new();
            entries(dev, names(), ".exp_avg", &m.exp_avg, &mut avg)?;
            entries(dev, names(), ".exp_avg_sq", &m.exp_avg_sq, &mut avg_sq)?;
            for (a, b) in avg.into_iter().zip(avg_sq) {
                optimizer.extend([a, b]);
            }
        }
        Ok((model, optimizer))
    }
}

/// The bytes of every tensor of `p`.
fn total<T: DeviceTensor>(p: &Params<T>) -> u64 {
    p.tensors().iter().map(|t| t.bytes()).sum()
}

/// Appends an entry `<name><suffix>` for each tensor of `params` to `out`.
fn entries<'a, 'n, D: Device, E: Elem>(
    dev: &D,
    names: impl Iterator<Item = &'n str>,
    suffix: &str,
    params: &'a Params<D::Tensor<E>>,
    out: &mut Vec<Entry<'a>>,
) -> Result<()> {
    for (name, t) in names.zip(params.tensors()) {
        out.push(Entry {
            name: format!("{name}{suffix}"),
            dtype: safetensors_dtype::<E>(),
            shape: t.shape().to_vec(),
            data: dev.raw_bytes(t)?,
        });
    }
    Ok(())
}

impl<D: Device> Drop for State<D> {
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
