//! The analytic memory model: from a run's configuration alone, the bytes of every part of the
//! memory and the peak of every phase of a training step, without running a kernel.
//!
//! The step's allocations are replayed on a simulated tracker in the order the code of the
//! chosen [`Backend`] makes them (see `replay`), so the predicted step peak equals the measured
//! one (`StepStats::memory.allocated.peak`) to the byte: on the CPU for every CI suite and
//! random configurations (tests), on CUDA for the golden trajectories measured on an H100.
//! Checkpoint saving and loading stage nothing on the device, so their peak is what a trainer
//! holds between steps.

mod replay;
mod timeline;

use crate::backend::cpu::attention::AttnShape;
use crate::data::LongBatch;
use crate::error::{EngineError, Result};
use crate::loss::LossKind;
use crate::memory::{Breakdown, Category};
use crate::model::{param_specs, Checkpointing, LlamaConfig};
use crate::trainer::{Precision, TrainConfig};
use replay::{Replay, Shape};
use serde::{Deserialize, Serialize};
use timeline::{Phase, Timeline};

/// What the memory of a step depends on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EstimateConfig {
    /// The model's shape.
    pub model: LlamaConfig,
    /// Rows per batch.
    pub batch_size: usize,
    /// Tokens per row.
    pub seq_len: usize,
    /// Step arithmetic.
    pub precision: Precision,
    /// Activation checkpointing policy.
    pub checkpointing: Checkpointing,
    /// How logits are held.
    pub loss: LossKind,
    /// The backend whose allocations are replayed.
    pub backend: Backend,
    /// Residual dropout probability: above 0, each residual projection gets a buffer of its own
    /// and its gradient a masked copy.
    #[serde(default)]
    pub dropout: f32,
    /// Longer rows from a given step on.
    #[serde(default)]
    pub long_batch: Option<LongBatch>,
}

impl EstimateConfig {
    /// The configuration of `cfg` trained on `backend`.
    pub fn from_train(cfg: &TrainConfig, backend: Backend) -> Self {
        EstimateConfig {
            model: cfg.model.clone(),
            batch_size: cfg.batch_size,
            seq_len: cfg.seq_len,
            precision: cfg.precision,
            checkpointing: cfg.checkpointing,
            loss: cfg.loss,
            backend,
            dropout: cfg.dropout,
            long_batch: cfg.long_batch,
        }
    }

    fn validate(&self) -> Result<()> {
        self.model.validate().map_err(EngineError::Config)?;
        if self.batch_size == 0
            || self.seq_len == 0
            || self.backend == (Backend::Cpu { threads: 0 })
        {
            return Err(EngineError::Config(
                "batch_size, seq_len and threads must be at least 1".into(),
            ));
        }
        for seq in std::iter::once(self.seq_len).chain(self.long_batch.map(|l| l.seq_len)) {
            if seq == 0 || seq > self.model.max_position_embeddings {
                return Err(EngineError::Config(format!(
                    "sequence length {seq} is 0 or exceeds max_position_embeddings {}",
                    self.model.max_position_embeddings
                )));
            }
        }
        Ok(())
    }

    fn elem(&self) -> u64 {
        match self.precision {
            Precision::Fp32 => 4,
            Precision::Bf16Mixed => 2,
        }
    }

    fn rows(&self) -> u64 {
        (self.batch_size * self.seq_len) as u64
    }

    /// Tokens per loss chunk, clamped as `linear_cross_entropy` clamps it.
    fn chunk(&self) -> u64 {
        let rows = self.rows();
        match self.loss {
            LossKind::Standard => rows,
            LossKind::Chunked { chunk_tokens } => (chunk_tokens as u64).clamp(1, rows),
        }
    }

    fn attn(&self) -> AttnShape {
        let m = &self.model;
        AttnShape {
            batch: self.batch_size,
            seq: self.seq_len,
            heads: m.num_attention_heads,
            kv_heads: m.num_key_value_heads,
            head_dim: m.head_dim(),
        }
    }

    fn shape(&self) -> Shape {
        let m = &self.model;
        Shape {
            rows: self.rows(),
            hidden: m.hidden_size as u64,
            ffn: m.intermediate_size as u64,
            q_width: (m.num_attention_heads * m.head_dim()) as u64,
            kv_width: (m.num_key_value_heads * m.head_dim()) as u64,
            vocab: m.vocab_size as u64,
            layers: m.num_hidden_layers,
            elem: self.elem(),
            attn: self.attn(),
            backend: self.backend,
            chunk: self.chunk(),
            logits_category: match self.loss {
                LossKind::Standard => Category::Activations,
                LossKind::Chunked { .. } => Category::Workspace,
            },
            checkpointing: self.checkpointing,
            dropout: self.dropout > 0.0,
            param_numels: param_specs(m).iter().map(|s| s.numel() as u64).collect(),
        }
    }
}

/// The backend whose allocations an estimate replays: the CPU's bf16 products widen their
/// operands into workspace and its attention keeps scratch per worker thread; the GPU's
/// products (cuBLAS) and attention (shared memory) need neither, but it uploads the batch's
/// token ids and labels, and its attention backward keeps a per-row `delta`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The CPU device with its worker threads (at least 1).
    Cpu {
        /// Worker threads; attention scratch is per thread.
        threads: usize,
    },
    /// A CUDA device.
    Cuda,
}

/// Bytes of each part of a step's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Anatomy {
    /// Compute weights and the rotary tables (category params).
    pub params: u64,
    /// f32 master weights of bf16-mixed runs (category optimizer; 0 in fp32, where the weights
    /// are the master copy).
    pub master_weights: u64,
    /// f32 parameter gradients.
    pub grads: u64,
    /// AdamW's two f32 moments.
    pub optimizer: u64,
    /// What one block holds from its forward to its backward pass, its input included.
    pub saved_per_block: u64,
    /// [`Anatomy::saved_per_block`] over all blocks.
    pub saved_activations: u64,
    /// The most bytes a block's backward pass holds of recomputed activations.
    pub recompute_per_block: u64,
    /// The logits buffer: all tokens', or one chunk's.
    pub logits: u64,
    /// The larger of the forward and backward attention scratch (all CPU threads; the
    /// backward pass's per-row `delta` on CUDA).
    pub attention_scratch: u64,
}

/// The peak of each phase of a step, in bytes held on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhasePeaks {
    /// Embedding, blocks and final norm.
    pub forward: u64,
    /// The fused LM head and cross-entropy.
    pub loss: u64,
    /// The blocks' backward passes, recomputation included.
    pub backward: u64,
    /// Gradient clipping and AdamW, including the moments' allocation at the first step.
    pub optimizer: u64,
}

/// The predicted figures of one `Trainer::step`, in the terms of [`crate::MemoryStats`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepEstimate {
    /// Held when the step starts.
    pub start: Breakdown,
    /// Held when it ends.
    pub end: Breakdown,
    /// The step's peak (`allocated.peak` after the trainer's `reset_peak`).
    pub peak: u64,
    /// Bytes per category at the peak.
    pub at_peak: Breakdown,
    /// Each category's own peak.
    pub peak_by_category: Breakdown,
    /// Allocations the step makes.
    pub allocations: u64,
    /// Held when the forward pass has ended: the saved activations, the last block's output and
    /// the final norm's, on top of the start.
    pub after_forward: Breakdown,
    /// The peak of each phase.
    pub phases: PhasePeaks,
}

/// The memory model of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// What it was computed for.
    pub config: EstimateConfig,
    /// The parts.
    pub anatomy: Anatomy,
    /// The first step of a fresh run, which allocates AdamW's moments.
    pub first_step: StepEstimate,
    /// Every step once the moments exist (after the first, or after resuming).
    pub later_step: StepEstimate,
    /// The steps with long rows, when the run has them.
    pub long_batch: Option<LongBatchEstimate>,
    /// The device's peak while a checkpoint is saved or loaded. A save writes straight from
    /// the tensors and a load reads each tensor into its final place, so neither stages a copy
    /// on the device: this is what a trainer holds between steps once AdamW's moments exist.
    pub checkpoint_io: u64,
}

/// The memory model of the steps with long rows ([`EstimateConfig::long_batch`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LongBatchEstimate {
    /// The first step with long rows.
    pub from_step: u64,
    /// The parts at the long length.
    pub anatomy: Anatomy,
    /// A long step that allocates AdamW's moments (when the long rows start at step 0).
    pub first_step: StepEstimate,
    /// A long step once the moments exist.
    pub later_step: StepEstimate,
}

impl Estimate {
    /// The estimate of a step at the run's own row length with (`true`) or without AdamW's
    /// moments already allocated.
    pub fn step(&self, moments_exist: bool) -> &StepEstimate {
        if moments_exist {
            &self.later_step
        } else {
            &self.first_step
        }
    }

    /// The estimate of step `step` (0-based) of a run, fresh or resumed: at the row length that
    /// step uses, allocating AdamW's moments only at step 0 (a resumed run from step `k > 0`
    /// finds them loaded).
    pub fn at_step(&self, step: u64) -> &StepEstimate {
        let moments_exist = step > 0;
        match &self.long_batch {
            Some(long) if step >= long.from_step => {
                if moments_exist {
                    &long.later_step
                } else {
                    &long.first_step
                }
            }
            _ => self.step(moments_exist),
        }
    }
}

/// The memory model of `cfg`.
pub fn estimate(cfg: &EstimateConfig) -> Result<Estimate> {
    cfg.validate()?;
    let (anatomy, first_step, later_step) = steps(cfg);
    let long_batch = cfg.long_batch.map(|long| {
        let at_long = EstimateConfig {
            seq_len: long.seq_len,
            ..cfg.clone()
        };
        let (anatomy, first_step, later_step) = steps(&at_long);
        LongBatchEstimate {
            from_step: long.from_step,
            anatomy,
            first_step,
            later_step,
        }
    });
    let checkpoint_io = later_step.start.total();
    Ok(Estimate {
        config: cfg.clone(),
        anatomy,
        first_step,
        later_step,
        long_batch,
        checkpoint_io,
    })
}

/// The parts, and a step without and with AdamW's moments, at `cfg.seq_len`.
fn steps(cfg: &EstimateConfig) -> (Anatomy, StepEstimate, StepEstimate) {
    let anatomy = anatomy(cfg);
    let shape = cfg.shape();
    let held = |moments: bool| Breakdown {
        params: anatomy.params,
        grads: anatomy.grads,
        optimizer: anatomy.master_weights + if moments { anatomy.optimizer } else { 0 },
        ..Breakdown::default()
    };
    let step = |moments_exist: bool| {
        let mut t = Timeline::new(held(moments_exist));
        Replay::new(&mut t, &shape).step(moments_exist);
        let r = t.finish();
        StepEstimate {
            start: held(moments_exist),
            end: r.end,
            peak: r.peak,
            at_peak: r.at_peak,
            peak_by_category: r.peak_by_category,
            allocations: r.allocations,
            after_forward: r.start_of(Phase::Loss),
            phases: PhasePeaks {
                forward: r.phase(Phase::Forward),
                loss: r.phase(Phase::Loss),
                backward: r.phase(Phase::Backward),
                optimizer: r.phase(Phase::Optimizer),
            },
        }
    };
    (anatomy, step(false), step(true))
}

/// The parts, from the shapes of the tensors that hold them.
fn anatomy(cfg: &EstimateConfig) -> Anatomy {
    let m = &cfg.model;
    let (e, rows) = (cfg.elem(), cfg.rows());
    let s = cfg.shape();
    let n = m.num_params() as u64;
    let rope = (m.max_position_embeddings * (m.head_dim() / 2) * 2 * 4) as u64;
    let lse = (cfg.batch_size * m.num_attention_heads * cfg.seq_len * 4) as u64;
    let products = rows * e * (2 * s.q_width + 2 * s.kv_width + s.hidden + 2 * s.ffn) + lse;
    let norm = rows * (s.hidden * e + 4);
    let act = rows * s.ffn * e;
    let input = rows * s.hidden * e;
    let (saved_per_block, recompute_per_block) = match cfg.checkpointing {
        Checkpointing::None => (input + products + 2 * norm + act, 0),
        Checkpointing::Full => (input, products + 2 * norm + act),
        Checkpointing::Selective => (input + products, norm.max(act)),
    };
    let a = cfg.attn();
    let attention_scratch = match cfg.backend {
        Backend::Cpu { threads } => {
            let scratch = |units: usize, per_thread: usize| {
                (threads.min(units).max(1) * per_thread * 4) as u64
            };
            scratch(a.batch * a.heads, a.forward_scratch())
                .max(scratch(a.batch * a.kv_heads, a.backward_scratch()))
        }
        Backend::Cuda => lse,
    };
    Anatomy {
        params: n * e + rope,
        master_weights: if e == 2 { n * 4 } else { 0 },
        grads: n * 4,
        optimizer: 2 * n * 4,
        saved_per_block,
        saved_activations: saved_per_block * m.num_hidden_layers as u64,
        recompute_per_block,
        logits: cfg.chunk() * s.vocab * e,
        attention_scratch,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(checkpointing: Checkpointing, precision: Precision) -> EstimateConfig {
        EstimateConfig {
            model: LlamaConfig {
                vocab_size: 50,
                hidden_size: 24,
                intermediate_size: 40,
                num_hidden_layers: 3,
                num_attention_heads: 6,
                num_key_value_heads: 2,
                head_dim: None,
                rms_norm_eps: 1e-5,
                rope_theta: 10000.0,
                tie_word_embeddings: false,
                max_position_embeddings: 8,
            },
            batch_size: 2,
            seq_len: 5,
            precision,
            checkpointing,
            loss: LossKind::Chunked { chunk_tokens: 3 },
            backend: Backend::Cpu { threads: 2 },
            dropout: 0.0,
            long_batch: None,
        }
    }

    /// The anatomy's saved activations are what the replayed forward pass leaves held, less the
    /// last output and the final norm.
    #[test]
    fn saved_activations_are_what_the_forward_pass_leaves() {
        for precision in [Precision::Fp32, Precision::Bf16Mixed] {
            for policy in [
                Checkpointing::None,
                Checkpointing::Full,
                Checkpointing::Selective,
            ] {
                let cfg = config(policy, precision);
                let e = estimate(&cfg).unwrap();
                let (rows, h, elem) = (cfg.rows(), 24, cfg.elem());
                let last_and_norm = rows * h * elem * 2 + rows * 4;
                let held = e.later_step.after_forward.activations;
                assert_eq!(
                    held,
                    e.anatomy.saved_activations + last_and_norm,
                    "{policy:?}"
                );
                assert_eq!(e.later_step.start.activations, 0);
            }
        }
    }

    #[test]
    fn policies_order_saved_and_recomputed_bytes() {
        let a = |p| estimate(&config(p, Precision::Bf16Mixed)).unwrap().anatomy;
        let (none, full, sel) = (
            a(Checkpointing::None),
            a(Checkpointing::Full),
            a(Checkpointing::Selective),
        );
        assert!(full.saved_per_block < sel.saved_per_block);
        assert!(sel.saved_per_block < none.saved_per_block);
        assert_eq!(none.recompute_per_block, 0);
        assert!(sel.recompute_per_block < full.recompute_per_block);
        assert_eq!(
            full.saved_per_block + full.recompute_per_block,
            none.saved_per_block
        );
    }

    #[test]
    fn impossible_configurations_are_refused() {
        let mut cfg = config(Checkpointing::None, Precision::Fp32);
        cfg.seq_len = 9;
        let err = estimate(&cfg).unwrap_err().to_string();
        assert!(err.contains("exceeds max_position_embeddings"), "{err}");
        cfg.seq_len = 5;
        cfg.long_batch = Some(LongBatch {
            from_step: 2,
            seq_len: 9,
        });
        let err = estimate(&cfg).unwrap_err().to_string();
        assert!(err.contains("sequence length 9"), "{err}");
        cfg.long_batch = None;
        cfg.backend = Backend::Cpu { threads: 0 };
        assert!(estimate(&cfg).is_err());
    }
}
