//! One training step over `N` data-parallel ranks, with the bits of one rank.
//!
//! A step is a fixed list of `M` micro-batches in global sample order. Rank `r` takes the
//! contiguous run `r·M/N .. (r+1)·M/N` (under `shard: gradients`, every `N`-th one). The
//! gradients are summed along a chain in global micro-batch order: rank 0 adds its
//! micro-batches' gradients to zero, hands the sum to rank 1, which adds its own to it, and so
//! on. One rank adds every micro-batch to the same buffer in the same order, so the last rank
//! ends with the bits of a single device, whatever `N`. The collective only moves those sums;
//! nothing is added by it.
//!
//! The last rank holds the whole gradient, so it takes the norm (the single device's
//! arithmetic) and the ranks get it by broadcast. Then, by [`Shard`]:
//! - `none`: the gradient is broadcast, and every rank clips and updates every weight;
//! - `optimizer`: each rank receives its rows of every gradient ([`crate::parallel::plan`]), clips them,
//!   updates its rows of the master weights with its shard of the moments, and the ranks gather
//!   the updated rows. AdamW is element-wise, so a row updated on its rank has the bits it has
//!   on one device.
//! - `gradients`: no rank holds a whole gradient between passes. Rank `r` takes micro-batches
//!   `r, r + N, ...`, and a ring hands each tensor's sum from the rank of one micro-batch to the
//!   rank of the next, tensor by tensor as the backward pass finishes with it; after the last
//!   micro-batch each rank gets its rows, and the update runs as under `optimizer`.
//! - `full`: as `gradients`, and each rank holds its rows of every weight too, a group's
//!   weights gathered whole just before a pass reads them and freed just after.
//!
//! Here: the ranks, in this process or one rank in each process, and how a step is run over
//! them. Apart: `build` (a rank's tensors from its rows of the source), `step` (one rank's part
//! of a step), `exchange` (the chain's and the update's messages), `ring` (the gradients' ring),
//! `gather` (the weight gathers of `full`), `checkpoint` (what a checkpoint of the ranks holds),
//! [`wire`] (a rank's passes of a step as bytes, for ranks in processes of their own),
//! [`experts`] (experts as an expert-parallel layout owns them, for the fault that saves rank
//! 0's experts in every rank's place). Below them, in [`crate::parallel`]: the collectives and
//! transports, the shard plan and the row sources; the model never sees a rank, the trainer
//! drives the ranks of a step.

mod build;
mod checkpoint;
mod evaluate;
mod exchange;
pub mod experts;
mod gather;
mod ring;
mod step;
pub mod wire;

use crate::config::TrainConfig;
use crate::device::{Device, DeviceTensor};
use crate::error::{EngineError, Result};
use crate::fault::{Fault, Faults};
use crate::memory::Category;
use crate::model::{param_specs, Batch, Dropout, ParamSpec, PassOutput};
use crate::parallel::buffered::BufferedRank;
use crate::parallel::collective::{thread_group, Collective};
use crate::parallel::plan::shard_of;
use crate::parallel::sockets::Meeting;
use crate::parallel::source::{Placed, RowSource, Which};
use crate::parallel::{rendezvous, sockets};
use crate::parallel::{Parallel, Shard, Transport};
use crate::state::State;
use build::build_rank;
use std::ops::Range;
use step::StepParts;

/// Bytes of an f32 element: gradients, master weights and moments are f32.
const F32: usize = 4;
/// Bytes of a bf16 element: the compute weights of bf16-mixed.
const BF16: usize = 2;

/// The ranks of a run: one [`State`] per rank, each on its own device.
pub struct Ranks<D: Device> {
    states: Vec<State<D>>,
    /// The parameters' names and whole shapes.
    specs: Vec<ParamSpec>,
    parallel: Parallel,
    faults: Faults,
    /// [`Fault::RngRestoredOnRankZeroOnly`]: the generator offset the resume restored, which
    /// every rank but the first draws its masks without.
    rng_lost_at: Option<u64>,
    /// Where the ranks are processes of their own: this process's rank (its one state) and its
    /// connections to the others.
    process: Option<ProcessRank>,
}

/// This process's rank of a run whose ranks are processes of their own, and its connections to
/// every other rank, which last the run: one for the chain, ring and collectives, one for the
/// weight gathers of `shard: full` (as a step's two groups in one process), and one for
/// checkpoint saves, which an asynchronous save's writer takes while the steps go on.
struct ProcessRank {
    rank: usize,
    world: usize,
    /// `None` once a failed step has closed them: its peers learn that this rank stopped.
    mesh: Option<(BufferedRank, BufferedRank)>,
    /// `None` while an asynchronous save's writer holds them, or once a failed step has closed
    /// them.
    saves: Option<BufferedRank>,
}

impl<D: Device> Ranks<D> {
    /// The ranks of `cfg` on `devices` (one per rank), each built from its rows of the whole
    /// f32 tensors `source` holds (on the host, or in a sharded checkpoint's files); with
    /// `moments_at`, the AdamW moments too, with their step count. Each rank receives its copy
    /// of the weights and its share of the moments, the ranks' tensors built concurrently.
    /// Without `source` every tensor is zeros (the memory model's: the counting device holds no
    /// values).
    pub fn new(
        cfg: &TrainConfig,
        devices: Vec<D>,
        source: Option<&dyn RowSource>,
        moments_at: Option<u64>,
    ) -> Result<Self> {
        let world = devices.len();
        let built: Vec<Result<State<D>>> = std::thread::scope(|scope| {
            let running: Vec<_> = devices
                .into_iter()
                .enumerate()
                .map(|(rank, dev)| {
                    scope.spawn(move || build_rank(cfg, dev, (rank, world), source, moments_at))
                })
                .collect();
            running
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(EngineError::Config("a rank's thread panicked".into()))
                    })
                })
                .collect()
        });
        Ok(Ranks {
            states: built.into_iter().collect::<Result<_>>()?,
            specs: param_specs(&cfg.model),
            parallel: cfg.parallel,
            faults: cfg.faults.clone(),
            rng_lost_at: None,
            process: None,
        })
    }

    /// Rank `rank` of `cfg`'s ranks, run by this process on its share of `dev` (the run's
    /// device, shared out as [`Device::ranks`] shares it among ranks in one process: its
    /// threads and memory), the others by processes of their own that meet it through
    /// `meeting` (rank 0 listens, the others are given its address; see [`sockets::join`]).
    /// It is built from its rows of the whole f32 tensors `source` holds (with `moments_at`, the
    /// moments too), as [`Ranks::new`] builds each rank. Every rank must be started with the
    /// same `cfg`.
    pub fn of_process(
        cfg: &TrainConfig,
        dev: D,
        rank: usize,
        meeting: Meeting,
        source: Option<&dyn RowSource>,
        moments_at: Option<u64>,
    ) -> Result<Self> {
        let world = cfg.parallel.world_size;
        let again = || {
            meeting.again().map_err(|e| EngineError::Join {
                rank,
                message: e.to_string(),
            })
        };
        let (second, third) = (again()?, again()?);
        let comm = sockets::join(rank, world, meeting, sockets::JOIN_LIMIT)?;
        // Every rank has met every other on one set of connections before any makes the next:
        // no connection of the next set reaches rank 0 while it still takes the last set's.
        comm.barrier()?;
        let gather = sockets::join(rank, world, second, sockets::JOIN_LIMIT)?;
        gather.barrier()?;
        let saves = sockets::join(rank, world, third, sockets::JOIN_LIMIT)?;
        let dev = dev.ranks(world)?.into_iter().nth(rank).ok_or_else(|| {
            EngineError::Config(format!("rank {rank} of {world} ranks: no such rank"))
        })?;
        let state = build_rank(cfg, dev, (rank, world), source, moments_at)?;
        Ok(Ranks {
            states: vec![state],
            specs: param_specs(&cfg.model),
            parallel: cfg.parallel,
            faults: cfg.faults.clone(),
            rng_lost_at: None,
            process: Some(ProcessRank {
                rank,
                world,
                mesh: Some((comm, gather)),
                saves: Some(saves),
            }),
        })
    }

    /// Each rank's rows of parameter `param`'s `which` tensor as it holds them (its weights'
    /// rows in fp32, its master rows in bf16-mixed, its moment rows), in rank order; nothing of
    /// a kind the ranks do not hold (moments before the first update).
    pub fn placed(&self, which: Which, param: usize) -> Result<Placed<'_>> {
        let world = self.world();
        let shape = &self.specs[param].shape;
        let first = self.rank();
        let mut placed = Vec::with_capacity(self.states.len());
        for (rank, state) in (first..).zip(&self.states) {
            let t = match which {
                Which::Master => state.weights().master().tensors()[param],
                Which::ExpAvg | Which::ExpAvgSq => {
                    let Some(m) = state.optimizer().moments() else {
                        return Ok(Vec::new());
                    };
                    match which {
                        Which::ExpAvg => m.exp_avg.tensors()[param],
                        _ => m.exp_avg_sq.tensors()[param],
                    }
                }
            };
            let held = t.shape().first().copied().unwrap_or(1);
            let rows = if held == shape.first().copied().unwrap_or(1) {
                0..held
            } else {
                shard_rows(shape, world, rank, &self.faults).0
            };
            placed.push((rows, state.device().raw_bytes(t)?));
        }
        Ok(placed)
    }

    /// A single rank holding `state`: a run without data parallelism.
    pub fn single(state: State<D>) -> Self {
        Ranks {
            states: vec![state],
            specs: Vec::new(),
            parallel: Parallel::default(),
            faults: Faults::default(),
            rng_lost_at: None,
            process: None,
        }
    }

    /// [`Fault::RngRestoredOnRankZeroOnly`] after a resume that restored the generator at
    /// `offset`: every rank but the first draws its dropout masks as a generator started at the
    /// resume would.
    pub fn lose_rng_but_on_rank_zero(&mut self, offset: u64) {
        self.rng_lost_at = Some(offset);
    }

    /// Every rank's state, in rank order; where the ranks are processes of their own, this
    /// process's rank's alone.
    pub fn states(&self) -> &[State<D>] {
        &self.states
    }

    /// A zeroed copy of every moment every rank holds, on the rank's device under
    /// [`Category::Optimizer`] ([`Fault::OptimizerStateAllocatedAtLoad`]).
    pub fn zeroed_moments_copy(&self) -> Result<Vec<D::Tensor<f32>>> {
        let mut copy = Vec::new();
        for s in &self.states {
            let Some(m) = s.optimizer().moments() else {
                continue;
            };
            for t in m
                .exp_avg
                .tensors()
                .into_iter()
                .chain(m.exp_avg_sq.tensors())
            {
                copy.push(s.device().zeros::<f32>(t.shape(), Category::Optimizer)?);
            }
        }
        Ok(copy)
    }

    /// Rank 0's state.
    pub fn first(&self) -> &State<D> {
        &self.states[0]
    }

    /// One training step over `batches` (every micro-batch of the step, in global order) at
    /// learning rate `lr`: the step's output and the gradient norm before clipping, both with
    /// the bits one rank gives.
    pub fn train_step(
        &mut self,
        batches: &[Batch],
        dropout: Option<Dropout>,
        lr: f64,
    ) -> Result<(PassOutput, f64)> {
        let world = self.world();
        if world == 1 {
            return self.states[0].train_step(batches, dropout, lr);
        }
        if batches.is_empty() || !batches.len().is_multiple_of(world) {
            return Err(EngineError::Config(format!(
                "a step of {} micro-batches cannot be split over {world} ranks; write an accumulation that world_size divides",
                batches.len()
            )));
        }
        let parts = StepParts {
            batches,
            world,
            dropout,
            lr,
            shard: self.parallel.shard,
            faults: &self.faults,
            lost_at: self.rng_lost_at,
        };
        if let Some(process) = &mut self.process {
            return process.train_step(&mut self.states[0], &parts);
        }
        let transport = self.parallel.transport;
        let (comms, gathers) = (group(transport, world)?, group(transport, world)?);
        let results: Vec<Result<(Vec<PassOutput>, f64)>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .states
                .iter_mut()
                .zip(comms.into_iter().zip(gathers))
                .map(|(state, (comm, gather))| {
                    let rank = comm.rank();
                    let (step, mine) = parts.of_rank(rank);
                    // The rank's step runs where its device's kernels run (`run_step`), so
                    // that each kernel's parallel loop starts there instead of waking the
                    // rank's pool from this thread: its connections go with it.
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .spawn_scoped(s, move || {
                            let dev = state.device().clone();
                            dev.run_step(move || step.run(state, (&*comm, &*gather), &mine))
                        })
                })
                .collect();
            handles.into_iter().map(joined).collect()
        });
        first_cause(results).map(|ranks| {
            let norm = ranks.last().map_or(0.0, |r| r.1);
            let by_rank = ranks.into_iter().map(|r| r.0).collect();
            let passes = in_global_order(by_rank, parts.shard);
            (self.states[0].model().step_output(passes), norm)
        })
    }

    /// An evaluation over `batches` (every validation micro-batch, in order): each one's
    /// forward pass without gradients (rank `r` takes micro-batches `r, r + N, ...`), the
    /// passes in global order, with the bits one rank gives.
    pub fn evaluate(&mut self, batches: &[Batch]) -> Result<Vec<PassOutput>> {
        let world = self.world();
        if world == 1 {
            return self.states[0].evaluate_hooked(batches, &mut ());
        }
        let (shard, faults) = (self.parallel.shard, &self.faults);
        if let Some(process) = &mut self.process {
            return process.evaluate(&mut self.states[0], batches, (shard, faults));
        }
        let gathers = group(self.parallel.transport, world)?;
        let results: Vec<Result<Vec<PassOutput>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (self.states.iter_mut().zip(gathers))
                .map(|(state, gather)| {
                    let rank = gather.rank();
                    let mine = evaluate::of_rank(batches, world, rank);
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .spawn_scoped(s, move || {
                            let dev = state.device().clone();
                            dev.run_step(move || {
                                evaluate::run(state, &*gather, &mine, (shard, faults))
                            })
                        })
                })
                .collect();
            handles.into_iter().map(joined).collect()
        });
        first_cause(results).map(|by_rank| evaluate::in_global_order(by_rank, batches.len()))
    }

    /// Where the ranks are processes of their own, this process's connections to the others
    /// that checkpoints are saved and checked over (see [`crate::checkpoint::save_as_rank`],
    /// [`crate::checkpoint::RankReads::check_placed_as_rank`]); `None` where this process holds
    /// every rank.
    pub fn checkpoint_connections(&self) -> Result<Option<&dyn Collective>> {
        match &self.process {
            Some(process) => Ok(Some(process.checkpoint_connections()?)),
            None => Ok(None),
        }
    }

    /// [`Ranks::checkpoint_connections`] taken out, for an asynchronous save's writer to hold until
    /// it is joined and they are given back ([`Ranks::give_back_checkpoint_connections`]).
    pub fn take_checkpoint_connections(&mut self) -> Result<Option<BufferedRank>> {
        match &mut self.process {
            Some(process) => {
                process.checkpoint_connections()?;
                Ok(process.saves.take())
            }
            None => Ok(None),
        }
    }

    /// Puts back the connections [`Ranks::take_checkpoint_connections`] took.
    pub fn give_back_checkpoint_connections(&mut self, saves: BufferedRank) {
        if let Some(process) = &mut self.process {
            process.saves = Some(saves);
        }
    }

    /// The rank of this process's first state: 0, unless the ranks are processes of their own.
    pub fn rank(&self) -> usize {
        self.process.as_ref().map_or(0, |p| p.rank)
    }

    /// Ranks in the run: this process's states, or where the ranks are processes of their own,
    /// every process's.
    pub fn world(&self) -> usize {
        self.process.as_ref().map_or(self.states.len(), |p| p.world)
    }

    /// The name of the first checkpoint entry, in rank order, that a rank holds a NaN or an
    /// infinity in (in its rows of it, where it holds a shard): every rank's checked, and where
    /// the ranks are processes of their own, each process's verdict gathered, so that every
    /// rank gets the same answer (every rank must ask at once).
    pub fn non_finite_entry(&self) -> Result<Option<String>> {
        let mut found = None;
        for state in &self.states {
            found = state.non_finite_entry()?;
            if found.is_some() {
                break;
            }
        }
        let Some(process) = &self.process else {
            return Ok(found);
        };
        let comm = process.connections()?.0;
        let verdicts = comm.all_gather(found.unwrap_or_default().into_bytes())?;
        Ok(verdicts
            .into_iter()
            .find(|name| !name.is_empty())
            .map(|name| String::from_utf8_lossy(&name).into_owned()))
    }
}

/// A group of `world` ranks over `transport`, one end per rank in rank order.
fn group(transport: Transport, world: usize) -> Result<Vec<Box<dyn Collective>>> {
    fn boxed<C: Collective + 'static>(ends: Vec<C>) -> Vec<Box<dyn Collective>> {
        ends.into_iter().map(|c| Box::new(c) as _).collect()
    }
    Ok(match transport {
        Transport::Channels => boxed(thread_group(world)),
        Transport::Rendezvous => boxed(rendezvous::group(world)?),
        Transport::Sockets => boxed(sockets::group(world)?),
    })
}

/// What a rank's thread returned, or why it could not be started or did not return.
fn joined<T>(handle: std::io::Result<std::thread::ScopedJoinHandle<'_, Result<T>>>) -> Result<T> {
    let handle = handle.map_err(|e| EngineError::Config(format!("a rank's thread: {e}")))?;
    (handle.join()).unwrap_or_else(|_| Err(EngineError::Config("a rank's thread panicked".into())))
}

/// The ranks' passes (`by_rank[r]` in the order rank `r` ran them) in global micro-batch
/// order: the ranks' runs one after the other, or interleaved under `shard: gradients`.
fn in_global_order(by_rank: Vec<Vec<PassOutput>>, shard: Shard) -> Vec<PassOutput> {
    if matches!(shard, Shard::None | Shard::Optimizer) {
        return by_rank.into_iter().flatten().collect();
    }
    let world = by_rank.len();
    let mut slots: Vec<Option<PassOutput>> = Vec::new();
    for (rank, passes) in by_rank.into_iter().enumerate() {
        for (k, pass) in passes.into_iter().enumerate() {
            let at = rank + k * world;
            if slots.len() <= at {
                slots.resize_with(at + 1, || None);
            }
            slots[at] = Some(pass);
        }
    }
    slots.into_iter().flatten().collect()
}

/// The rows of a tensor of `shape` whose optimizer state `rank` holds, and the elements per row;
/// [`Fault::ShardBoundaryOffByOne`] starts every shard but the first a row late.
fn shard_rows(
    shape: &[usize],
    world: usize,
    rank: usize,
    faults: &Faults,
) -> (Range<usize>, usize) {
    let (rows, row) = shard_of(shape, world, rank);
    if faults.has(Fault::ShardBoundaryOffByOne) && rank > 0 && !rows.is_empty() {
        return ((rows.start + 1)..rows.end, row);
    }
    (rows, row)
}

/// The ranks' results, or the first error that is a cause rather than a report of a peer that
/// stopped (or whose connection broke as it stopped).
fn first_cause<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    let mut errors: Vec<EngineError> = Vec::new();
    let mut oks = Vec::new();
    for r in results {
        match r {
            Ok(v) => oks.push(v),
            Err(e) => errors.push(e),
        }
    }
    match errors.iter().position(|e| {
        !matches!(
            e,
            EngineError::PeerStopped { .. } | EngineError::Link { .. }
        )
    }) {
        Some(i) => Err(errors.swap_remove(i)),
        None => errors.into_iter().next().map_or(Ok(oks), Err),
    }
}

impl ProcessRank {
    /// The connections to the other ranks: for the step's chain, ring and collectives, and for
    /// the weight gathers.
    fn connections(&self) -> Result<(&BufferedRank, &BufferedRank)> {
        let mesh = self.mesh.as_ref().map(|(c, g)| (c, g));
        mesh.ok_or_else(|| self.closed())
    }

    /// The error of a step or collective after a failure closed the connections.
    fn closed(&self) -> EngineError {
        EngineError::Config(format!(
            "rank {}'s connections to the other ranks were closed by an earlier failure; start the run again",
            self.rank
        ))
    }

    /// The connections checkpoints are saved over.
    fn checkpoint_connections(&self) -> Result<&BufferedRank> {
        let rank = self.rank;
        self.saves.as_ref().ok_or_else(|| {
            EngineError::Config(format!(
                "rank {rank}'s connections for saves are held by an asynchronous save, or were closed by an earlier failure; finish the save first, or start the run again"
            ))
        })
    }

    /// This rank's part of a step, on `state`; then every rank's passes, gathered, make the
    /// step's output in global micro-batch order. A failure closes the connections, so that
    /// every other rank stops too instead of waiting for this one.
    fn train_step<D: Device>(
        &mut self,
        state: &mut State<D>,
        parts: &StepParts<'_>,
    ) -> Result<(PassOutput, f64)> {
        let (comm, gather) = self.mesh.take().ok_or_else(|| self.closed())?;
        let (step, mine) = parts.of_rank(self.rank);
        // The step runs where the device's kernels run (`run_step`), its connections with it;
        // they come back unless it failed.
        let dev = state.device().clone();
        let (ran, mesh) = dev.run_step(|| {
            let ran = step
                .run(state, (&comm, &gather), &mine)
                .and_then(|(passes, norm)| {
                    let all = comm.all_gather(wire::encode_passes(&passes))?;
                    let by_rank = (all.iter().enumerate())
                        .map(|(from, bytes)| wire::decode_passes(from, bytes))
                        .collect::<Result<Vec<_>>>()?;
                    Ok((in_global_order(by_rank, parts.shard), norm))
                });
            (ran, (comm, gather))
        });
        match ran {
            Ok((passes, norm)) => {
                self.mesh = Some(mesh);
                Ok((state.model().step_output(passes), norm))
            }
            Err(e) => {
                self.saves = None;
                Err(e)
            }
        }
    }
}

impl ProcessRank {
    /// This rank's part of an evaluation over `batches`, on `state`; then every rank's passes,
    /// gathered, in global order. A failure closes the connections, as a step's does.
    fn evaluate<D: Device>(
        &mut self,
        state: &mut State<D>,
        batches: &[Batch],
        shard_faults: (Shard, &Faults),
    ) -> Result<Vec<PassOutput>> {
        let (comm, gather) = self.mesh.take().ok_or_else(|| self.closed())?;
        let mine = evaluate::of_rank(batches, self.world, self.rank);
        let dev = state.device().clone();
        let (ran, mesh) = dev.run_step(|| {
            let ran = evaluate::run(state, &gather, &mine, shard_faults).and_then(|passes| {
                let all = comm.all_gather(wire::encode_passes(&passes))?;
                let by_rank = (all.iter().enumerate())
                    .map(|(from, bytes)| wire::decode_passes(from, bytes))
                    .collect::<Result<Vec<_>>>()?;
                Ok(evaluate::in_global_order(by_rank, batches.len()))
            });
            (ran, (comm, gather))
        });
        match ran {
            Ok(passes) => {
                self.mesh = Some(mesh);
                Ok(passes)
            }
            Err(e) => {
                self.saves = None;
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuDevice;
    use crate::state::Weights;

    /// A tiny dense run on 3 ranks at full sharding: each holds its rows of every tensor.
    fn three_ranks_config() -> TrainConfig {
        serde_json::from_value(serde_json::json!({
            "model": {"vocab_size": 37, "hidden_size": 8, "intermediate_size": 16,
                      "num_hidden_layers": 1, "num_attention_heads": 2,
                      "num_key_value_heads": 1, "max_position_embeddings": 16},
            "init": {"kind": "random", "seed": 3, "std": 0.1},
            "optimizer": {"lr": 0.001},
            "schedule": {"kind": "constant"},
            "data": {"kind": "synthetic", "seed": 1, "samples": 8},
            "batch_size": 1,
            "accumulation": 3,
            "seq_len": 8,
            "parallel": {"world_size": 3, "shard": "full"}
        }))
        .unwrap()
    }

    /// Writes an infinity into the second number of `state`'s rows of the embedding.
    fn poison(state: &mut State<CpuDevice>) {
        let dev = state.device().clone();
        let Weights::Fp32(params) = state.weights_mut() else {
            panic!("an fp32 run holds fp32 weights");
        };
        dev.write_bytes(params.get_mut(0), 4, &f32::INFINITY.to_le_bytes())
            .unwrap();
    }

    #[test]
    fn a_non_finite_number_in_any_rank_s_rows_is_found_and_named() {
        let dev = CpuDevice::new(3, 1 << 30).unwrap();
        let mut ranks =
            Ranks::new(&three_ranks_config(), dev.ranks(3).unwrap(), None, None).unwrap();
        assert_eq!(ranks.non_finite_entry().unwrap(), None);
        poison(&mut ranks.states[2]);
        assert_eq!(ranks.states[0].non_finite_entry().unwrap(), None);
        assert_eq!(
            ranks.non_finite_entry().unwrap().as_deref(),
            Some("model.embed_tokens.weight")
        );
    }

    #[test]
    fn every_rank_of_its_own_hears_of_a_non_finite_number_in_one_rank_s_rows() {
        let cfg = three_ranks_config();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = listener.local_addr().unwrap();
        let mut listener = Some(listener);
        let ranks: Vec<_> = (0..3)
            .map(|rank| {
                let cfg = cfg.clone();
                let meeting = match listener.take() {
                    Some(l) => Meeting::Host(l),
                    None => Meeting::At(at),
                };
                std::thread::spawn(move || {
                    let dev = CpuDevice::new(3, 1 << 30).unwrap();
                    let mut mine = Ranks::of_process(&cfg, dev, rank, meeting, None, None)?;
                    let before = mine.non_finite_entry()?;
                    if rank == 2 {
                        poison(&mut mine.states[0]);
                    }
                    Ok::<_, EngineError>((before, mine.non_finite_entry()?))
                })
            })
            .collect();
        for (rank, handle) in ranks.into_iter().enumerate() {
            let (before, after) = handle.join().unwrap().unwrap();
            assert_eq!(before, None, "rank {rank}");
            assert_eq!(
                after.as_deref(),
                Some("model.embed_tokens.weight"),
                "rank {rank}"
            );
        }
    }

    #[test]
    fn a_step_fails_with_the_rank_that_caused_it_not_the_peers_that_reported_it() {
        let stopped = || EngineError::PeerStopped { rank: 0, peer: 1 };
        let broken = || EngineError::Link {
            rank: 2,
            peer: 1,
            message: "reset".into(),
        };
        let cause = || EngineError::Config("rank 1 broke".into());
        let e = first_cause::<()>(vec![Err(stopped()), Err(broken()), Err(cause())]).unwrap_err();
        assert!(matches!(e, EngineError::Config(_)), "{e}");
        let e = first_cause::<()>(vec![Ok(()), Err(broken()), Err(stopped())]).unwrap_err();
        assert!(matches!(e, EngineError::Link { .. }), "{e}");
        assert_eq!(first_cause(vec![Ok(1), Ok(2)]).unwrap(), vec![1, 2]);
    }
}
