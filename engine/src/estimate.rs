//! The memory model: the training step itself, run on the [`CountingDevice`]. The same model,
//! loss and optimizer code that trains on the CPU or a GPU allocates its tensors there, and
//! each operation allocates the scratch of the backend the device imitates, so the tracker's
//! figures are the step's: the measured peak (`StepStats::memory.allocated.peak`) equals the
//! estimate's to the byte. Checkpoint saving and loading stage nothing on the device, so their
//! peak is what a trainer holds between steps. An asynchronous save stages a copy of every
//! checkpoint tensor in host memory ([`Estimate::save_staging`]) until the end of the next
//! step: on the CPU, whose host memory is the device's, that step starts with those bytes held
//! under `io` and its peak is the same step's plus them.
//!
//! The [`Anatomy`] beside it is the same memory as a table of tensor shapes (llm.c's
//! `fill_in_activation_sizes`), for people; a test checks it against the dry run.

use crate::backend::count::{CountingDevice, Like, Routes};
use crate::backend::cpu::attention::{scratch_shape, Pass};
use crate::config::{Precision, TrainConfig};
use crate::device::{AttnShape, Device, StepPhase};
use crate::error::{check_host, try_vec, EngineError, Result};
use crate::memory::{Breakdown, MemoryStats};
use crate::model::params::param_specs;
use crate::model::{Batch, Checkpointing, Dropout};
use crate::parallel::plan;
use crate::parallel::Checkpoints;
use crate::ranks::Ranks;
use crate::state::State;
use serde::{Deserialize, Serialize};

/// A run and the backend whose memory is modelled.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EstimateConfig {
    /// The run (its faults are dropped: the model is of the correct engine).
    pub run: TrainConfig,
    /// The backend the counting device imitates.
    pub like: Like,
    /// How a MoE model's layers route their rows (balanced unless said otherwise).
    #[serde(skip_serializing_if = "Routes::is_balanced")]
    pub routes: Routes,
    /// Each micro-batch's tokens per row, in global order, where a step's micro-batches are
    /// not all as long as the rows asked for (text padded to each one's longest sample);
    /// empty where they are.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub seq_lens: Vec<usize>,
}

impl EstimateConfig {
    /// The configuration of `cfg` trained on the backend `like`.
    pub fn from_train(cfg: &TrainConfig, like: Like) -> Self {
        EstimateConfig {
            run: TrainConfig {
                faults: Default::default(),
                ..cfg.clone()
            },
            like,
            routes: Routes::Balanced,
            seq_lens: Vec::new(),
        }
    }

    /// The same run with its MoE layers routing as `routes` says.
    pub fn with_routes(self, routes: Routes) -> Self {
        EstimateConfig { routes, ..self }
    }

    /// The same run with its micro-batches' rows `seq_lens` tokens long, in global order (one
    /// length a micro-batch, as many as the run's `accumulation`).
    pub fn with_seq_lens(self, seq_lens: Vec<usize>) -> Self {
        EstimateConfig { seq_lens, ..self }
    }

    fn validate(&self) -> Result<()> {
        let r = &self.run;
        r.model.validate().map_err(|e| e.under("model"))?;
        if r.batch_size == 0
            || r.accumulation == 0
            || r.seq_len == 0
            || self.like == (Like::Cpu { threads: 0 })
        {
            return Err(EngineError::Config(
                "batch_size, accumulation, seq_len and threads must be at least 1".into(),
            ));
        }
        r.validate_ranks()?;
        if !self.seq_lens.is_empty() && self.seq_lens.len() != r.accumulation {
            return Err(EngineError::Config(format!(
                "{} micro-batch lengths for a step of {} micro-batches",
                self.seq_lens.len(),
                r.accumulation
            )));
        }
        let lengths = (self.seq_lens.iter().copied()).chain(r.long_batch.map(|l| l.seq_len));
        for seq in std::iter::once(r.seq_len).chain(lengths) {
            if seq == 0 || seq > r.model.max_position_embeddings {
                return Err(EngineError::Config(format!(
                    "sequence length {seq} is 0 or exceeds max_position_embeddings {}",
                    r.model.max_position_embeddings
                )));
            }
        }
        Ok(())
    }
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
    /// What one block holds from its forward to its backward pass, its input included (the
    /// largest block's, where MoE and dense blocks differ).
    pub saved_per_block: u64,
    /// What every block holds from its forward to its backward pass.
    pub saved_activations: u64,
    /// The most bytes a block's backward pass holds of recomputed activations (for a MoE block
    /// at the routing modelled: its busiest expert's rows).
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
    /// Held when the forward pass (the last micro-batch's) has ended: the saved activations, the
    /// last block's output and the final norm's, on top of the start.
    pub after_forward: Breakdown,
    /// The peak of each phase.
    pub phases: PhasePeaks,
}

/// The memory model of a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
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
    /// The host staging buffers of an asynchronous save (`Trainer::save_async`): a copy of
    /// every tensor of the checkpoint (weights, master weights, AdamW's moments), counted under
    /// `io` and held from the save to the end of the next step.
    pub save_staging: u64,
    /// Each data-parallel rank's first and later step, in rank order (rank 0's are
    /// `first_step` and `later_step`); empty for one rank.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<[StepEstimate; 2]>,
}

/// The memory model of the steps with long rows (`TrainConfig::long_batch`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LongBatchEstimate {
    /// The first step with long rows.
    pub from_step: u64,
    /// The parts at the long length.
    pub anatomy: Anatomy,
    /// A long step that allocates AdamW's moments (when the long rows start at step 0).
    pub first_step: StepEstimate,
    /// A long step once the moments exist.
    pub later_step: StepEstimate,
    /// Each data-parallel rank's first and later long step, in rank order (rank 0's are
    /// `first_step` and `later_step`); empty for one rank.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<[StepEstimate; 2]>,
}

impl Estimate {
    /// The staging bytes of an asynchronous save on the device's own tracker: all of them on
    /// the CPU, whose host memory is the device's; none on CUDA, which stages in host memory
    /// apart from the GPU's.
    pub fn save_staging_on_device(&self) -> u64 {
        match self.config.like {
            Like::Cpu { .. } => self.save_staging,
            Like::Cuda => 0,
        }
    }

    /// [`Estimate::save_staging_on_device`] on each rank's own tracker, in rank order, where the
    /// ranks are processes of their own: each stages its own chunk of every tensor of a sharded
    /// checkpoint (its rows by the shard plan, the same share of the bytes as of the elements,
    /// every tensor holding as many bytes per element), or every tensor whole where they save
    /// gathered (each rank gathers them). In one process, rank 0 stages it all.
    pub fn save_staging_on_process_ranks(&self) -> Vec<u64> {
        let whole = self.save_staging_on_device();
        let parallel = &self.config.run.parallel;
        let world = parallel.world_size.max(1);
        if world == 1 || parallel.checkpoints == Checkpoints::Gathered {
            return vec![whole; world];
        }
        let specs = param_specs(&self.config.run.model);
        let elements = |rank: Option<usize>| -> u128 {
            specs
                .iter()
                .map(|s| match rank {
                    None => s.numel() as u128,
                    Some(r) => {
                        let (rows, row) = plan::shard_of(&s.shape, world, r);
                        (rows.len() * row) as u128
                    }
                })
                .sum()
        };
        let total = elements(None).max(1);
        (0..world)
            .map(|r| (u128::from(whole) * elements(Some(r)) / total) as u64)
            .collect()
    }

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

/// The memory model of `cfg`. Its cost does not grow with the run's `accumulation`: the
/// micro-batches of a step repeat, and a few of them give the figures of all (`steps`).
pub fn estimate(cfg: &EstimateConfig) -> Result<Estimate> {
    assemble(cfg, steps)
}

/// The memory model of `cfg` from a dry run of every micro-batch of its steps, however many:
/// what [`estimate`] equals, at a cost that grows with the run's `accumulation`.
pub fn estimate_every_micro_batch(cfg: &EstimateConfig) -> Result<Estimate> {
    assemble(cfg, |cfg, seq| dry_run(cfg, seq, cfg.run.accumulation))
}

/// The parts at rows of some length, each rank's step without and with AdamW's moments, and
/// the bytes of a checkpoint's tensors after them.
type Steps = (Anatomy, Vec<[StepEstimate; 2]>, u64);

/// The memory model of `cfg`, its steps at each row length from `steps`.
fn assemble(
    cfg: &EstimateConfig,
    steps: impl Fn(&EstimateConfig, usize) -> Result<Steps>,
) -> Result<Estimate> {
    cfg.validate()?;
    let (anatomy, mut ranks, save_staging) = steps(cfg, cfg.run.seq_len)?;
    let [first_step, later_step] = ranks[0].clone();
    if ranks.len() == 1 {
        ranks.clear();
    }
    let long_batch = match cfg.run.long_batch {
        Some(long) => {
            let (anatomy, mut ranks, _) = steps(cfg, long.seq_len)?;
            let [first_step, later_step] = ranks[0].clone();
            if ranks.len() == 1 {
                ranks.clear();
            }
            Some(LongBatchEstimate {
                from_step: long.from_step,
                anatomy,
                first_step,
                later_step,
                ranks,
            })
        }
        None => None,
    };
    let checkpoint_io = later_step.start.total();
    Ok(Estimate {
        config: cfg.clone(),
        anatomy,
        first_step,
        later_step,
        long_batch,
        checkpoint_io,
        save_staging,
        ranks,
    })
}

/// A step without and with AdamW's moments at rows of `seq` tokens (each micro-batch's own
/// length where `cfg.seq_lens` gives them) whose MoE layers route as `cfg.routes` says: what a
/// step that recorded its shape and tokens per expert should have held (rank 0's, on several
/// ranks; [`recorded_rank_steps`] gives every rank's).
pub fn recorded_steps(cfg: &EstimateConfig, seq: usize) -> Result<[StepEstimate; 2]> {
    Ok(recorded_rank_steps(cfg, seq)?.swap_remove(0))
}

/// [`recorded_steps`] for every rank, in rank order (one on one device). Recorded routes are a
/// step's in global micro-batch order; each rank routes the micro-batches it trains, by the
/// rule the ranks train by ([`plan::micro_batches`]).
pub fn recorded_rank_steps(cfg: &EstimateConfig, seq: usize) -> Result<Vec<[StepEstimate; 2]>> {
    cfg.validate()?;
    let (_, ranks, _) = steps(cfg, seq)?;
    Ok(ranks)
}

/// The parts, each rank's step without and with AdamW's moments at rows of `seq` tokens, and
/// the bytes of a checkpoint's tensors after them: two steps of a fresh state on the counting
/// device (one per rank, for data parallelism), each over the run's `accumulation`
/// micro-batches, or as [`repeating_steps`] finds them from a few.
fn steps(cfg: &EstimateConfig, seq: usize) -> Result<Steps> {
    match repeating_steps(cfg, seq)? {
        Some(steps) => Ok(steps),
        None => dry_run(cfg, seq, cfg.run.accumulation),
    }
}

/// Micro-batches per rank of the shorter of [`repeating_steps`]' two dry runs: one that starts
/// the step, one in the middle and one that ends it.
const SHORT_RUN: usize = 3;

/// [`steps`] from two dry runs of a few micro-batches per rank, whatever the run's
/// `accumulation`: `None` when that is no cheaper, when the micro-batches can differ (recorded
/// MoE routes, a world size that does not divide them), or when the two runs do not show them
/// repeating.
///
/// A step zeroes the gradients, runs its micro-batches one after the other and then the
/// optimizer. A micro-batch that neither starts nor ends a rank's run (nor, for gradients
/// sharded over a ring, the step's) starts with the bytes the one before it started with and
/// leaves them as it found them, so it adds nothing to a step's figures but its allocations.
/// A run of `SHORT_RUN + 1` micro-batches per rank whose figures are those of a run of
/// `SHORT_RUN` but for its allocations shows that: the step of `accumulation` has the same
/// figures and their difference in allocations once per micro-batch more.
fn repeating_steps(cfg: &EstimateConfig, seq: usize) -> Result<Option<Steps>> {
    let (accumulation, world) = (cfg.run.accumulation, cfg.run.parallel.world_size);
    if !cfg.routes.same_in_every_micro_batch()
        || !cfg.seq_lens.is_empty()
        || world == 0
        || accumulation % world != 0
        || accumulation / world <= SHORT_RUN + 1
    {
        return Ok(None);
    }
    let more = (accumulation / world - (SHORT_RUN + 1)) as u64;
    let (anatomy, short, checkpoint_bytes) = dry_run(cfg, seq, SHORT_RUN * world)?;
    let (_, longer, _) = dry_run(cfg, seq, (SHORT_RUN + 1) * world)?;
    let mut steps = Vec::with_capacity(longer.len());
    for (short, mut pair) in short.iter().zip(longer) {
        for (a, b) in short.iter().zip(pair.iter_mut()) {
            let Some(per_micro_batch) = b.allocations.checked_sub(a.allocations) else {
                return Ok(None);
            };
            let repeats = StepEstimate {
                allocations: a.allocations,
                ..b.clone()
            } == *a;
            if !repeats {
                return Ok(None);
            }
            b.allocations = b
                .allocations
                .saturating_add(per_micro_batch.saturating_mul(more));
        }
        steps.push(pair);
    }
    Ok(Some((anatomy, steps, checkpoint_bytes)))
}

/// Each rank's peak, in rank order, over an evaluation of the validation micro-batches of
/// `shapes` (rows, tokens per row) on a trainer between steps: a step of the run's shape on a
/// fresh state of the counting device (one per rank), then the evaluation
/// ([`Ranks::evaluate`]). A dense model's is the measured peak to the byte; a MoE model's
/// evaluation is modelled with balanced routes.
pub fn evaluation_peaks(cfg: &EstimateConfig, shapes: &[(usize, usize)]) -> Result<Vec<u64>> {
    cfg.validate()?;
    let run = &cfg.run;
    let dev = CountingDevice::new(cfg.like);
    let world = run.parallel.world_size;
    let devices = match world {
        1 => vec![dev.clone()],
        _ => dev.ranks(world)?,
    };
    let mut ranks = match devices.len() {
        1 => Ranks::single(State::zeros(run, dev.clone())?),
        _ => Ranks::new(run, devices.clone(), None, None)?,
    };
    let step = (0..run.accumulation)
        .map(|_| zeros((run.batch_size, run.seq_len), run.data.packs()))
        .collect::<Result<Vec<_>>>()?;
    ranks.train_step(&step, None, 0.0)?;
    drop(step);
    let evaluated = shapes
        .iter()
        .map(|&s| zeros(s, false))
        .collect::<Result<Vec<_>>>()?;
    devices.iter().for_each(|d| d.tracker().reset_peak());
    ranks.evaluate(&evaluated)?;
    Ok(devices
        .iter()
        .map(|d| d.tracker().stats().allocated.peak)
        .collect())
}

/// The parts, each rank's step without and with AdamW's moments at rows of `seq` tokens, and
/// the bytes of a checkpoint's tensors after them: two steps of a fresh state on the counting
/// device (one per rank, for data parallelism), each over `micro_batches` micro-batches.
fn dry_run(cfg: &EstimateConfig, seq: usize, micro_batches: usize) -> Result<Steps> {
    let run = &cfg.run;
    let dev = CountingDevice::new(cfg.like).with_routes(cfg.routes.clone());
    let (world, shard) = (run.parallel.world_size, run.parallel.shard);
    let devices: Vec<_> = match world {
        1 => vec![dev.clone()],
        _ => (dev.ranks(world)?.into_iter().enumerate())
            .map(|(rank, d)| {
                d.with_micro_batches(plan::micro_batches(shard, world, rank, micro_batches))
            })
            .collect(),
    };
    let mut ranks = match devices.len() {
        1 => Ranks::single(State::zeros(run, dev.clone())?),
        _ => Ranks::new(run, devices.clone(), None, None)?,
    };
    let seq_lens = match cfg.seq_lens.len() {
        0 => vec![seq; micro_batches],
        _ => cfg.seq_lens.clone(),
    };
    let tokens = seq_lens.iter().map(|&s| s as u64).sum::<u64>();
    check_host(
        (run.batch_size as u64 * 16).saturating_mul(tokens),
        "the dry run's micro-batches (token ids, labels and positions)",
    )?;
    let batches = (seq_lens.iter())
        .map(|&seq| zeros((run.batch_size, seq), run.data.packs()))
        .collect::<Result<Vec<_>>>()?;
    let dropout = (run.dropout > 0.0).then_some(Dropout {
        p: run.dropout,
        seed: 0,
        offset: 0,
    });
    let mut step = || -> Result<Vec<StepEstimate>> {
        let before: Vec<_> = devices.iter().map(|d| d.tracker().stats()).collect();
        for d in &devices {
            d.tracker().reset_peak();
            d.reset_log();
        }
        ranks.train_step(&batches, dropout, 0.0)?;
        Ok(devices
            .iter()
            .zip(before)
            .map(|(d, before)| measured(d, before))
            .collect())
    };
    let first = step()?;
    let later = step()?;
    let steps = first.into_iter().zip(later).map(|(a, b)| [a, b]).collect();
    Ok((anatomy(cfg, seq), steps, ranks.checkpoint_bytes()))
}

/// A dry run's batch of `rows` rows of `seq` tokens: every id and label 0 (the counting device
/// holds no values, only shapes), and where the data packs samples, positions too (every
/// token a document of its own).
fn zeros((rows, seq): (usize, usize), packed: bool) -> Result<Batch> {
    let tokens = rows.saturating_mul(seq);
    Ok(Batch {
        batch: rows,
        seq,
        input_ids: try_vec(tokens, 0, "the dry run's token ids")?,
        labels: try_vec(tokens, 0, "the dry run's labels")?,
        positions: match packed {
            true => Some(try_vec(tokens, 0, "the dry run's positions")?),
            false => None,
        },
    })
}

/// What the counting device `dev` saw of a step that started with `before`.
fn measured(dev: &CountingDevice, before: MemoryStats) -> StepEstimate {
    let after = dev.tracker().stats();
    let log = dev.log();
    StepEstimate {
        start: before.current,
        end: after.current,
        peak: after.allocated.peak,
        at_peak: after.at_peak,
        peak_by_category: after.peak_by_category,
        allocations: after.alloc_count - before.alloc_count,
        after_forward: log.start_of(StepPhase::Loss),
        phases: PhasePeaks {
            forward: log.peak_of(StepPhase::Forward),
            loss: log.peak_of(StepPhase::Loss),
            backward: log.peak_of(StepPhase::Backward),
            optimizer: log.peak_of(StepPhase::Optimizer),
        },
    }
}

/// The parts, from the shapes of the tensors that hold them.
fn anatomy(cfg: &EstimateConfig, seq: usize) -> Anatomy {
    let (r, m) = (&cfg.run, &cfg.run.model);
    let e: u64 = match r.precision {
        Precision::Fp32 => 4,
        Precision::Bf16Mixed => 2,
    };
    let rows = (r.batch_size * seq) as u64;
    let (hidden, ffn, vocab) = (
        m.hidden_size as u64,
        m.intermediate_size as u64,
        m.vocab_size as u64,
    );
    let a = AttnShape {
        batch: r.batch_size,
        seq,
        heads: m.num_attention_heads,
        kv_heads: m.num_key_value_heads,
        head_dim: m.head_dim(),
    };
    let (qw, kvw) = (a.q_width() as u64, a.kv_width() as u64);
    let n = m.num_params() as u64;
    let rope = (m.max_position_embeddings * (m.head_dim() / 2) * 2 * 4) as u64;
    let lse = (a.batch * a.heads * a.seq * 4) as u64;
    // Qwen3's per-head norms keep the queries and keys before them, and each head's 1 / rms.
    let head_norms = match m.family.qk_norm() {
        true => rows * (qw + kvw) * e + rows * (a.heads + a.kv_heads) as u64 * 4,
        false => 0,
    };
    let attn_products = rows * e * (2 * qw + 2 * kvw + hidden) + lse + head_norms;
    let norm = rows * (hidden * e + 4);
    let input = rows * hidden * e;
    // Each block's matrix-product outputs, its cheap tensors (norms, SwiGLU activations, a MoE
    // layer's gathered inputs) and what selective checkpointing recomputes at most at once.
    let block = |l: usize| -> [u64; 3] {
        match m.moe.as_ref().filter(|moe| moe.is_moe_layer(l)) {
            None => {
                let act = rows * ffn * e;
                [attn_products + 2 * act, 2 * norm + act, norm.max(act)]
            }
            Some(moe) => {
                // Every row goes to `top_k` experts: each expert's weights, gate, up and output
                // rows are kept, whichever experts they are.
                let slots = rows * moe.num_experts_per_tok as u64;
                let f = moe.moe_intermediate_size as u64;
                let busiest = (0..cfg.routes.distinct_micro_batches(r.accumulation))
                    .map(|micro_batch| {
                        cfg.routes
                            .counts(rows as usize, moe.route_spec(l), micro_batch)
                            .map_or(rows, |c| c.into_iter().max().unwrap_or(0) as u64)
                    })
                    .max()
                    .unwrap_or(0);
                [
                    attn_products + slots * e * (1 + hidden + 2 * f),
                    2 * norm + slots * e * (hidden + f),
                    norm + busiest * e * f.max(hidden),
                ]
            }
        }
    };
    let per_block = (0..m.num_hidden_layers).map(|l| {
        let [products, cheap, selective] = block(l);
        match r.checkpointing {
            Checkpointing::None => (input + products + cheap, 0),
            Checkpointing::Full => (input, products + cheap),
            Checkpointing::Selective => (input + products, selective),
        }
    });
    let (mut saved_per_block, mut saved_activations, mut recompute_per_block) = (0, 0, 0);
    for (saved, recompute) in per_block {
        saved_per_block = saved_per_block.max(saved);
        saved_activations += saved;
        recompute_per_block = recompute_per_block.max(recompute);
    }
    let attention_scratch = match cfg.like {
        Like::Cpu { threads } => [Pass::Forward, Pass::Backward]
            .map(|p| scratch_shape(threads, &a, p).iter().product::<usize>() as u64 * 4)
            .into_iter()
            .max()
            .unwrap_or(0),
        Like::Cuda => lse,
    };
    let (chunk, _) = r.loss.chunk(a.batch * seq);
    Anatomy {
        params: n * e + rope,
        master_weights: if e == 2 { n * 4 } else { 0 },
        grads: n * 4,
        optimizer: 2 * n * 4,
        saved_per_block,
        saved_activations,
        recompute_per_block,
        logits: chunk as u64 * vocab * e,
        attention_scratch,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{DataConfig, LongBatch};
    use crate::model::config::MoeConfig;
    use crate::model::loss::LossKind;
    use crate::model::{Family, LlamaConfig};

    use crate::parallel::Shard;

    fn config(checkpointing: Checkpointing, precision: Precision) -> EstimateConfig {
        let model = LlamaConfig {
            max_position_embeddings: 8,
            ..LlamaConfig::new(50, 24, 40, 3, 6, 2)
        };
        let mut run = TrainConfig {
            precision,
            data: DataConfig::Synthetic {
                seed: 0,
                samples: 16,
                branching: 2,
                min_len: None,
            },
            checkpointing,
            loss: LossKind::Chunked { chunk_tokens: 3 },
            ..TrainConfig::new(model, 2, 5)
        };
        run.optimizer.weight_decay = 0.0;
        run.optimizer.grad_clip = None;
        EstimateConfig::from_train(&run, Like::Cpu { threads: 2 })
    }

    /// The anatomy's saved activations are what the dry run's forward pass leaves held, less the
    /// last output and the final norm.
    /// `cfg`'s model as `family`; MoE families get 4 experts, top-2, and Qwen3-MoE a dense
    /// first layer.
    fn set_family(cfg: &mut EstimateConfig, family: Family) {
        let m = &mut cfg.run.model;
        m.family = family;
        m.moe = family.moe().then(|| MoeConfig {
            num_experts: 4,
            num_experts_per_tok: 2,
            moe_intermediate_size: if family == Family::Mixtral { 40 } else { 16 },
            norm_topk_prob: true,
            router_aux_loss_coef: 0.01,
            decoder_sparse_step: 1,
            mlp_only_layers: if family == Family::Mixtral {
                vec![]
            } else {
                vec![0]
            },
        });
    }

    #[test]
    fn moe_memory_depends_on_the_routing_and_concentrated_bounds_it() {
        for policy in [
            Checkpointing::None,
            Checkpointing::Selective,
            Checkpointing::Full,
        ] {
            let mut cfg = config(policy, Precision::Fp32);
            set_family(&mut cfg, Family::Qwen3Moe);
            // Experts wide enough that their buffers make the step's peak.
            if let Some(moe) = &mut cfg.run.model.moe {
                moe.moe_intermediate_size = 400;
            }
            let peak = |routes: Routes| {
                recorded_steps(&cfg.clone().with_routes(routes), 5).unwrap()[1].peak
            };
            let balanced = peak(Routes::Balanced);
            let bound = peak(Routes::Concentrated);
            // 10 rows, top-2 of 4 experts: 20 slots per layer.
            let skewed = peak(Routes::Recorded(vec![
                vec![],
                vec![10, 6, 3, 1],
                vec![10, 9, 1, 0],
            ]));
            assert!(
                balanced < skewed && skewed <= bound,
                "{policy:?}: {balanced} {skewed} {bound}"
            );
        }
    }

    /// Four micro-batches on two ranks, one of them routing every row to experts 0 and 1: the
    /// rank that trains it (rank 1 of the chain, rank 0 of the ring) peaks above the other.
    #[test]
    fn each_rank_routes_the_micro_batches_it_trains() {
        let mut cfg = config(Checkpointing::None, Precision::Fp32);
        set_family(&mut cfg, Family::Qwen3Moe);
        if let Some(moe) = &mut cfg.run.model.moe {
            moe.moe_intermediate_size = 400;
        }
        cfg.run.accumulation = 4;
        cfg.run.parallel.world_size = 2;
        let even = [5, 5, 5, 5];
        let skewed = [10, 10, 0, 0];
        let layer: Vec<u32> = [even, even, skewed, even].concat();
        let cfg = cfg.with_routes(Routes::Recorded(vec![vec![], layer.clone(), layer]));
        for (shard, busy) in [
            (Shard::None, 1),
            (Shard::Optimizer, 1),
            (Shard::Gradients, 0),
            (Shard::Full, 0),
        ] {
            let mut cfg = cfg.clone();
            cfg.run.parallel.shard = shard;
            let peaks: Vec<u64> = (recorded_rank_steps(&cfg, 5).unwrap().iter())
                .map(|r| r[1].peak)
                .collect();
            assert!(peaks[busy] > peaks[1 - busy], "{shard:?}: {peaks:?}");
        }
    }

    #[test]
    fn recorded_routes_that_do_not_fit_the_batch_are_refused() {
        let mut cfg = config(Checkpointing::None, Precision::Fp32);
        set_family(&mut cfg, Family::Qwen3Moe);
        let cfg = cfg.with_routes(Routes::Recorded(vec![
            vec![],
            vec![6, 6, 6, 6],
            vec![5, 5, 5, 5],
        ]));
        let err = recorded_steps(&cfg, 5).unwrap_err().to_string();
        assert!(err.contains("not a top-2 routing of 10 rows"), "{err}");
    }

    #[test]
    fn saved_activations_are_what_the_forward_pass_leaves() {
        for (precision, family) in [
            (Precision::Fp32, Family::Llama),
            (Precision::Bf16Mixed, Family::Llama),
            (Precision::Fp32, Family::Qwen3),
            (Precision::Fp32, Family::Qwen2),
            (Precision::Bf16Mixed, Family::Phi3),
            (Precision::Fp32, Family::Qwen3Moe),
            (Precision::Bf16Mixed, Family::Mixtral),
        ] {
            for policy in [
                Checkpointing::None,
                Checkpointing::Full,
                Checkpointing::Selective,
            ] {
                let mut cfg = config(policy, precision);
                set_family(&mut cfg, family);
                let e = estimate(&cfg).unwrap();
                let elem = if precision == Precision::Fp32 { 4 } else { 2 };
                let (rows, h) = (10, 24);
                let last_and_norm = rows * h * elem * 2 + rows * 4;
                let held = e.later_step.after_forward.activations;
                assert_eq!(
                    held,
                    e.anatomy.saved_activations + last_and_norm,
                    "{policy:?}"
                );
                assert_eq!(e.later_step.start.activations, 0);
                assert_eq!(e.later_step.start.params, e.anatomy.params);
                assert_eq!(e.later_step.start.grads, e.anatomy.grads);
                assert_eq!(
                    e.later_step.start.optimizer,
                    e.anatomy.master_weights + e.anatomy.optimizer
                );
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
        cfg.run.seq_len = 9;
        let err = estimate(&cfg).unwrap_err().to_string();
        assert!(err.contains("exceeds max_position_embeddings"), "{err}");
        cfg.run.seq_len = 5;
        cfg.run.long_batch = Some(LongBatch {
            from_step: 2,
            seq_len: 9,
        });
        let err = estimate(&cfg).unwrap_err().to_string();
        assert!(err.contains("sequence length 9"), "{err}");
        cfg.run.long_batch = None;
        cfg.like = Like::Cpu { threads: 1 };
        cfg.run.parallel.world_size = 0;
        let err = estimate(&cfg).unwrap_err().to_string();
        assert!(err.contains("parallel.world_size is 0"), "{err}");
        cfg.run.parallel.world_size = 2;
        let err = estimate(&cfg).unwrap_err().to_string();
        assert!(err.contains("does not divide the 1 micro-batches"), "{err}");
        cfg.run.parallel.world_size = 1;
        cfg.like = Like::Cpu { threads: 0 };
        assert!(estimate(&cfg).is_err());
    }

    #[test]
    fn ranks_in_processes_stage_their_rows_of_a_sharded_save_and_all_of_a_gathered_one() {
        let mut cfg = config(Checkpointing::None, Precision::Bf16Mixed);
        cfg.run.accumulation = 3;
        cfg.run.parallel.world_size = 3;
        cfg.run.parallel.shard = Shard::Full;
        let e = estimate(&cfg).unwrap();
        let whole = e.save_staging_on_device();
        let ranks = e.save_staging_on_process_ranks();
        assert_eq!(ranks.iter().sum::<u64>(), whole, "{ranks:?}");
        // A vocabulary of 50 on 3 ranks: 17, 17 and 16 rows of the embedding.
        assert!(ranks[0] == ranks[1] && ranks[2] < ranks[1], "{ranks:?}");
        cfg.run.parallel.checkpoints = crate::parallel::Checkpoints::Gathered;
        let gathered = estimate(&cfg).unwrap();
        assert_eq!(
            gathered.save_staging_on_process_ranks(),
            vec![gathered.save_staging_on_device(); 3]
        );
        cfg.run.parallel.world_size = 1;
        cfg.like = Like::Cuda;
        assert_eq!(estimate(&cfg).unwrap().save_staging_on_process_ranks(), [0]);
    }
}
