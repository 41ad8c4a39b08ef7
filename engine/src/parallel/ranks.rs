//! One training step over `N` data-parallel ranks, with the bits of one rank.
//!
//! A step is a fixed list of `M` micro-batches in global sample order. Rank `r` takes the
//! contiguous run `r·M/N .. (r+1)·M/N` (under `shard: gradients`, every `N`-th one). The gradients are summed along a chain in global
//! micro-batch order: rank 0 adds its micro-batches' gradients to zero, hands the sum to rank 1,
//! which adds its own to it, and so on. One rank adds every micro-batch to the same buffer in
//! the same order, so the last rank ends with the bits of a single device, whatever `N`. The
//! collective only moves those sums; nothing is added by it.
//!
//! The last rank holds the whole gradient, so it takes the norm (the single device's
//! arithmetic) and the ranks get it by broadcast. Then, by [`Shard`]:
//! - `none`: the gradient is broadcast, and every rank clips and updates every weight;
//! - `optimizer`: each rank receives its rows of every gradient ([`plan`]), clips them, updates
//!   its rows of the master weights with its shard of the moments, and the ranks gather the
//!   updated rows. AdamW is element-wise, so a row updated on its rank has the bits it has on
//!   one device.
//! - `gradients`: no rank holds a whole gradient between passes. Rank `r` takes micro-batches
//!   `r, r + N, ...`, and a [`GradRing`] hands each tensor's sum from the rank of one micro-batch
//!   to the rank of the next, tensor by tensor as the backward pass finishes with it; after the
//!   last micro-batch each rank gets its rows, and the update runs as under `optimizer`.

use super::buffered::BufferedRank;
use super::collective::{thread_group, Collective};
use super::experts;
use super::plan::{self, shard_of, shard_shape};
use super::sockets::Meeting;
use super::source::{Placed, RowSource, Which};
use super::{rendezvous, sockets, wire};
use super::{Checkpoints, Parallel, Shard, Transport};
use crate::checkpoint::{Chunk, Entry, RankChunks, Tensors};
use crate::config::{Precision, TrainConfig};
use crate::device::{Device, DeviceTensor, StepPhase};
use crate::error::{EngineError, Result};
use crate::fault::{Fault, Faults};
use crate::memory::Category;
use crate::model::loss::counted;
use crate::model::{param_specs, LlamaConfig, ParamSpec};
use crate::model::{Batch, Dropout, Group, Layout, Params, PassHooks, PassOutput, StepShare};
use crate::optim::{clip_coefficient, grad_norm, Moments};
use crate::state::{State, Weights};
use crate::tensor::{Elem, Tensor};
use half::bf16;
use std::borrow::Cow;
use std::ops::Range;

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
    /// threads and memory), the others by processes of their own that meet it through `meeting` (rank 0 listens, the others are given its
    /// address; see [`sockets::join`]). It is built from its rows of the whole f32 tensors
    /// `source` holds (with `moments_at`, the moments too), as [`Ranks::new`] builds each rank.
    /// Every rank must be started with the same `cfg`.
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
        if batches.is_empty() || batches.len() % world != 0 {
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
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .spawn_scoped(s, move || step.run(state, (&*comm, &*gather), &mine))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.map_err(|e| EngineError::Config(format!("a rank's thread: {e}")))
                        .and_then(|h| {
                            h.join().unwrap_or_else(|_| {
                                Err(EngineError::Config("a rank's thread panicked".into()))
                            })
                        })
                })
                .collect()
        });
        first_cause(results).map(|ranks| {
            let norm = ranks.last().map_or(0.0, |r| r.1);
            let by_rank = ranks.into_iter().map(|r| r.0).collect();
            let passes = in_global_order(by_rank, parts.shard);
            (self.states[0].model().step_output(passes), norm)
        })
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

    /// The bytes of the tensors [`Ranks::checkpoint_entries`] returns, from their sizes alone:
    /// rank 0's, and with sharded optimizer state every other rank's share of it (under
    /// `shard: full`, every other rank's share of everything).
    pub fn checkpoint_bytes(&self) -> u64 {
        let others = self.states[1..].iter();
        let others = match self.parallel.shard {
            Shard::None => 0,
            Shard::Optimizer | Shard::Gradients => others.map(State::optimizer_state_bytes).sum(),
            Shard::Full => others.map(State::checkpoint_bytes).sum(),
        };
        self.states[0].checkpoint_bytes() + others
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

    /// What a checkpoint of the ranks holds: one rank's tensors; with several ranks that save
    /// [`Checkpoints::Sharded`], each rank's chunk of every tensor (see
    /// [`Ranks::checkpoint_chunks`]: where the ranks are processes of their own, this
    /// process's rank's alone); else every tensor gathered whole (see
    /// [`Ranks::checkpoint_entries`]).
    pub fn checkpoint_tensors(&self) -> Result<Tensors<'_>> {
        if self.world() > 1 && self.parallel.checkpoints == Checkpoints::Sharded {
            return self.checkpoint_chunks().map(Tensors::Sharded);
        }
        let (model, optimizer) = self.checkpoint_entries()?;
        Ok(Tensors::Whole { model, optimizer })
    }

    /// Each rank's chunk of every checkpoint tensor: its rows of what it holds sharded (as it
    /// holds them), and its rows by the shard plan of what it holds whole, so that the ranks
    /// write a tensor's rows between them once and nothing is gathered
    /// ([`Fault::OnlyRankZeroExpertsSaved`] writes rank 0's experts in the others' place).
    fn checkpoint_chunks(&self) -> Result<Vec<RankChunks<'_>>> {
        let world = self.world();
        let shard = self.parallel.shard;
        let first = self.rank();
        let mut ranks = Vec::with_capacity(self.states.len());
        for (rank, state) in (first..).zip(&self.states) {
            let (mut model, mut optimizer) = state.checkpoint_entries()?;
            if self.faults.has(Fault::OnlyRankZeroExpertsSaved) {
                model = experts::as_rank_zero_s(model, world);
                optimizer = experts::as_rank_zero_s(optimizer, world);
            }
            ranks.push(RankChunks {
                model: self.chunks(model, rank, shard == Shard::Full)?,
                optimizer: self.chunks(optimizer, rank, shard != Shard::None)?,
            });
        }
        Ok(ranks)
    }

    /// Rank `rank`'s chunks of its checkpoint `entries`: the whole shard where the rank holds
    /// them `sharded`, else its rows by the shard plan ([`Fault::LastUnevenShardDropped`] marks
    /// a tensor's last, short shard skipped).
    fn chunks<'s>(
        &self,
        entries: Vec<Entry<'s>>,
        rank: usize,
        sharded: bool,
    ) -> Result<Vec<Chunk<'s>>> {
        let world = self.world();
        entries
            .into_iter()
            .map(|entry| {
                let spec = self.spec_of(&entry.name)?;
                let mut chunk = if sharded {
                    let rows = shard_rows(&spec.shape, world, rank, &self.faults).0;
                    Chunk::shard(entry, &spec.shape, rows)
                } else {
                    Chunk::rows_of(&entry, shard_of(&spec.shape, world, rank).0)
                };
                let d0 = spec.shape.first().copied().unwrap_or(1);
                let short_last = !chunk.rows.is_empty()
                    && chunk.rows.end == d0
                    && chunk.rows.len() < d0.div_ceil(world);
                chunk.skipped = short_last && self.faults.has(Fault::LastUnevenShardDropped);
                Ok(chunk)
            })
            .collect()
    }

    /// The parameter whose weight, moment or master weight a checkpoint entry named `name` holds.
    fn spec_of(&self, name: &str) -> Result<&ParamSpec> {
        let param = parameter_of(name);
        self.specs.iter().find(|s| s.name == param).ok_or_else(|| {
            EngineError::Config(format!("checkpoint entry {name} names no parameter"))
        })
    }

    /// What a checkpoint of the ranks holds, as one device's checkpoint holds it: with sharded
    /// optimizer state each moment's (and bf16-mixed master weight's) rows gathered from the
    /// ranks that hold them, in rank order; under `shard: full` each weight's rows too; rank 0's
    /// tensors where they are whole. Where the ranks are processes of their own, the rows come
    /// over the connections, and every rank must ask at once.
    pub fn checkpoint_entries(&self) -> Result<(Vec<Entry<'_>>, Vec<Entry<'_>>)> {
        let (mut model, mut optimizer) = self.states[0].checkpoint_entries()?;
        let shard = self.parallel.shard;
        if shard == Shard::None || self.world() == 1 {
            return Ok((model, optimizer));
        }
        // The other ranks' entries, where this process holds them.
        let others = match self.process {
            Some(_) => Vec::new(),
            None => (self.states[1..].iter())
                .map(State::checkpoint_entries)
                .collect::<Result<Vec<_>>>()?,
        };
        let mut sharded = vec![(&mut optimizer, false)];
        if shard == Shard::Full {
            sharded.push((&mut model, true));
        }
        for (entries, of_model) in sharded {
            for (i, entry) in entries.iter_mut().enumerate() {
                *entry = match &self.process {
                    Some(process) => {
                        let comm = process.connections()?.0;
                        let shards = comm.all_gather(entry.data.to_vec())?;
                        self.whole(entry, shards.iter().map(Vec::as_slice))?
                    }
                    None => {
                        let theirs = others.iter().map(|(model, optimizer)| match of_model {
                            true => &*model[i].data,
                            false => &*optimizer[i].data,
                        });
                        self.whole(entry, std::iter::once(&*entry.data).chain(theirs))?
                    }
                };
            }
        }
        Ok((model, optimizer))
    }

    /// `entry` made whole from every rank's rows of it (`shards`, in rank order), each written
    /// at its shard's offset.
    fn whole<'e, 's>(
        &self,
        entry: &Entry<'e>,
        shards: impl Iterator<Item = &'s [u8]>,
    ) -> Result<Entry<'e>> {
        let world = self.world();
        let spec = self.spec_of(&entry.name)?;
        let elem = entry.dtype.bitsize() / 8;
        let mut data = vec![0u8; spec.shape.iter().product::<usize>() * elem];
        for (rank, shard) in shards.enumerate() {
            let (rows, row) = shard_rows(&spec.shape, world, rank, &self.faults);
            let at = rows.start * row * elem;
            let into = data.get_mut(at..at + shard.len()).ok_or_else(|| {
                EngineError::Config(format!(
                    "rank {rank}'s shard of {} ({} bytes from byte {at}) overruns the tensor",
                    entry.name,
                    shard.len()
                ))
            })?;
            into.copy_from_slice(shard);
        }
        Ok(Entry {
            name: entry.name.clone(),
            dtype: entry.dtype,
            shape: spec.shape.clone(),
            data: Cow::Owned(data),
        })
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

/// The parameter whose moment or master weight an optimizer entry holds.
fn parameter_of(name: &str) -> &str {
    [".exp_avg_sq", ".exp_avg", ".master"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .unwrap_or(name)
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

/// `f(i, spec)` for every parameter `i` of `model`, in order.
fn each_param<T>(
    model: &LlamaConfig,
    mut f: impl FnMut(usize, &ParamSpec) -> Result<T>,
) -> Result<Params<T>> {
    let mut i = 0;
    Params::try_new(model, |spec| {
        i += 1;
        f(i - 1, spec)
    })
}

/// Rank `rank` of `world` of `cfg` on `dev`, built from `source` (see [`Ranks::new`]).
fn build_rank<D: Device>(
    cfg: &TrainConfig,
    dev: D,
    (rank, world): (usize, usize),
    source: Option<&dyn RowSource>,
    moments_at: Option<u64>,
) -> Result<State<D>> {
    let category = cfg.master_category();
    let from = |which: Which, i: usize| source.map(|s| (s, which, i));
    let whole = |shape: &[usize]| 0..shape.first().copied().unwrap_or(1);
    let shard = |shape: &[usize]| match cfg.parallel.shard {
        Shard::None => whole(shape),
        _ => shard_rows(shape, world, rank, &cfg.faults).0,
    };
    let grad_rows = |shape: &[usize]| match cfg.parallel.shard {
        Shard::Gradients | Shard::Full => shard(shape),
        Shard::None | Shard::Optimizer => whole(shape),
    };
    let weight_rows = |shape: &[usize]| match cfg.parallel.shard {
        Shard::Full => shard(shape),
        _ => whole(shape),
    };
    let model = &cfg.model;
    let master = |i: usize| from(Which::Master, i);
    let weights = match cfg.precision {
        Precision::Fp32 => Weights::Fp32(each_param(model, |i, s| {
            place(&dev, master(i), &s.shape, weight_rows(&s.shape), category)
        })?),
        // The compute weights hold the master rows: read once, into the master, and rounded.
        Precision::Bf16Mixed if matches!(cfg.parallel.shard, Shard::Full | Shard::None) => {
            let masters = each_param(model, |i, s| {
                place(&dev, master(i), &s.shape, shard(&s.shape), category)
            })?;
            let compute = each_param(model, |i, s| {
                let shape = shard_shape(&s.shape, weight_rows(&s.shape).len());
                let mut compute = dev.zeros_kept::<bf16>(&shape, Category::Params)?;
                dev.round(masters.get(i), &mut compute)?;
                Ok(compute)
            })?;
            Weights::Bf16Mixed {
                master: masters,
                compute,
            }
        }
        // The compute weights hold every row, the master this rank's: the rows are read once,
        // whole, for the compute weights, and this rank's copied out of them for the master.
        Precision::Bf16Mixed => {
            let (compute, master) = each_param(model, |i, s| {
                let rows = weight_rows(&s.shape);
                place_split(&dev, master(i), &s.shape, (rows, shard(&s.shape)), category)
            })?
            .unzip();
            Weights::Bf16Mixed { master, compute }
        }
    };
    let moments = match moments_at {
        Some(step) => {
            let moment = |which: Which| {
                each_param(model, |i, s| {
                    let rows = shard(&s.shape);
                    place(&dev, from(which, i), &s.shape, rows, Category::Optimizer)
                })
            };
            Some((
                Moments {
                    exp_avg: moment(Which::ExpAvg)?,
                    exp_avg_sq: moment(Which::ExpAvgSq)?,
                },
                step,
            ))
        }
        None => None,
    };
    let grads = each_param(model, |_, s| {
        let shape = shard_shape(&s.shape, grad_rows(&s.shape).len());
        dev.zeros_kept::<f32>(&shape, Category::Grads)
    })?;
    State::with_weights(cfg, dev, weights, grads, moments)
}

/// Rows `rows` of a tensor of `shape` on `dev` that the rank keeps for the run, counted under
/// `category`: read from the source's `(which, param)` tensor into a host tensor of the rows
/// (the tensor itself on the CPU) and uploaded, or zeros where there is no source.
fn place<D: Device>(
    dev: &D,
    from: Option<(&dyn RowSource, Which, usize)>,
    shape: &[usize],
    rows: Range<usize>,
    category: Category,
) -> Result<D::Tensor<f32>> {
    let placed = shard_shape(shape, rows.len());
    let Some((source, which, param)) = from else {
        return dev.zeros_kept::<f32>(&placed, category);
    };
    let mut host = Tensor::<f32>::zeros_kept(&dev.host(), &placed, category)?;
    let bytes = bytemuck::cast_slice_mut(host.as_mut_slice());
    source.read_rows(which, param, rows.clone(), rows, bytes)?;
    dev.upload(host)
}

/// A bf16 compute weight of rows `rows` of a master weight of `shape` on `dev`, and the f32
/// master rows `keep` (inside `rows`) that the rank keeps: the rows are read from the source
/// once (zeros where there is none), rounded for the one and copied out for the other.
fn place_split<D: Device>(
    dev: &D,
    from: Option<(&dyn RowSource, Which, usize)>,
    shape: &[usize],
    (rows, keep): (Range<usize>, Range<usize>),
    category: Category,
) -> Result<(D::Tensor<bf16>, D::Tensor<f32>)> {
    let compute_shape = shard_shape(shape, rows.len());
    let Some((source, which, param)) = from else {
        let master = dev.zeros_kept::<f32>(&shard_shape(shape, keep.len()), category)?;
        return Ok((
            dev.zeros_kept::<bf16>(&compute_shape, Category::Params)?,
            master,
        ));
    };
    let mut whole = Tensor::<f32>::zeros(&dev.host(), &compute_shape, category)?;
    let bytes = bytemuck::cast_slice_mut(whole.as_mut_slice());
    source.read_rows(which, param, rows.clone(), keep.clone(), bytes)?;
    let mut master =
        Tensor::<f32>::zeros_kept(&dev.host(), &shard_shape(shape, keep.len()), category)?;
    let row = whole.numel() / rows.len().max(1);
    let from_row = |r: usize| (r - rows.start) * row;
    master
        .as_mut_slice()
        .copy_from_slice(&whole.as_slice()[from_row(keep.start)..from_row(keep.end)]);
    let whole = dev.upload(whole)?;
    let mut compute = dev.zeros_kept::<bf16>(&compute_shape, Category::Params)?;
    dev.round(&whole, &mut compute)?;
    Ok((compute, dev.upload(master)?))
}

/// A step as every rank's part of it is cut from it.
struct StepParts<'a> {
    /// Every micro-batch of the step, in global order.
    batches: &'a [Batch],
    world: usize,
    dropout: Option<Dropout>,
    lr: f64,
    shard: Shard,
    faults: &'a Faults,
    /// [`Fault::RngRestoredOnRankZeroOnly`]'s offset lost by every rank but the first.
    lost_at: Option<u64>,
}

impl<'a> StepParts<'a> {
    /// Rank `rank`'s part of the step, and its micro-batches.
    fn of_rank(&self, rank: usize) -> (RankStep<'a>, Vec<Batch>) {
        let (shard, faults, world) = (self.shard, self.faults, self.world);
        let (m, per_rank) = (self.batches.len(), self.batches.len() / world);
        let (mine, first) = match shard {
            Shard::Gradients | Shard::Full => (plan::micro_batches(shard, world, rank, m), rank),
            _ if faults.has(Fault::MicroBatchesStrided) => {
                (plan::strided(world, rank, m), rank * per_rank)
            }
            _ => (plan::micro_batches(shard, world, rank, m), rank * per_rank),
        };
        let mine = mine.into_iter().map(|i| self.batches[i].clone()).collect();
        let dropout = match (self.dropout, self.lost_at) {
            (Some(d), Some(at)) if rank > 0 => Some(Dropout {
                offset: d.offset - at,
                ..d
            }),
            _ => self.dropout,
        };
        let step = RankStep {
            first: first as u64,
            micro_batches: m,
            dropout,
            lr: self.lr,
            shard,
            faults,
        };
        (step, mine)
    }
}

impl ProcessRank {
    /// The connections to the other ranks: for the step's chain, ring and collectives, and for
    /// the weight gathers.
    fn connections(&self) -> Result<(&BufferedRank, &BufferedRank)> {
        let rank = self.rank;
        self.mesh.as_ref().map(|(c, g)| (c, g)).ok_or_else(|| {
            EngineError::Config(format!(
                "rank {rank}'s connections to the other ranks were closed by an earlier failure; start the run again"
            ))
        })
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
        let (comm, gather) = self.connections()?;
        let (step, mine) = parts.of_rank(self.rank);
        let ran = step
            .run(state, (comm, gather), &mine)
            .and_then(|(passes, norm)| {
                let all = comm.all_gather(wire::encode_passes(&passes))?;
                let by_rank = (all.iter().enumerate())
                    .map(|(from, bytes)| wire::decode_passes(from, bytes))
                    .collect::<Result<Vec<_>>>()?;
                Ok((in_global_order(by_rank, parts.shard), norm))
            });
        match ran {
            Ok((passes, norm)) => Ok((state.model().step_output(passes), norm)),
            Err(e) => {
                self.mesh = None;
                self.saves = None;
                Err(e)
            }
        }
    }
}

/// One rank's part of a step.
struct RankStep<'a> {
    /// The global index of the rank's first micro-batch.
    first: u64,
    /// Micro-batches in the whole step.
    micro_batches: usize,
    dropout: Option<Dropout>,
    lr: f64,
    shard: Shard,
    faults: &'a Faults,
}

impl RankStep<'_> {
    /// The rank's part of the step: `comm` carries the chain or ring and the collectives,
    /// `gather` the weight gathers of `shard: full` (apart, so that a rank one micro-batch ahead
    /// on the ring never reads a gather's bytes for the ring's).
    fn run<D: Device>(
        &self,
        state: &mut State<D>,
        (comm, gather): (&dyn Collective, &dyn Collective),
        mine: &[Batch],
    ) -> Result<(Vec<PassOutput>, f64)> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let last = world - 1;
        let counted_here = mine.iter().map(|b| counted(&b.labels) as u64).sum();
        let share = StepShare {
            tokens: comm.sum_u64(counted_here)? as usize,
            micro_batches: self.micro_batches,
        };
        if matches!(self.shard, Shard::Gradients | Shard::Full) {
            return self.run_ring(state, (comm, gather), mine, share);
        }
        let by_rank = self.faults.has(Fault::GradientsSummedByRank);
        if rank == 0 || by_rank {
            state.zero_grads()?;
        } else {
            receive_whole(state, comm, rank - 1)?;
        }
        let passes = state.passes(mine, self.dropout, share, self.first)?;
        if by_rank {
            add_by_rank(state, comm)?;
        } else if rank < last {
            send_whole(state, comm, rank + 1)?;
        }
        state.device().enter(StepPhase::Optimizer);
        let norm = match rank == last {
            true => grad_norm(state.device(), state.grads())?,
            false => 0.0,
        };
        let norm = broadcast_norm(comm, norm)?;
        let coef = clip_coefficient(norm, state.optimizer().config().grad_clip);
        match self.shard {
            Shard::None => {
                broadcast_grads(state, comm, last)?;
                scale(state, coef)?;
                state.adamw_step(self.lr)?;
            }
            Shard::Optimizer => {
                let shards: Vec<_> = state
                    .grads_mut()
                    .tensors()
                    .iter()
                    .map(|g| shard_rows(g.shape(), world, rank, self.faults))
                    .collect();
                scatter_grads(state, comm, last, self.faults)?;
                scale(state, coef)?;
                state.adamw_shard(self.lr, &shards, Shard::Optimizer)?;
                gather_updated(state, comm, self.faults)?;
            }
            Shard::Gradients | Shard::Full => unreachable!("run_ring runs it"),
        }
        Ok((passes, norm))
    }

    /// `shard: gradients` and `full`: the passes run with a [`GradRing`], which passes each
    /// gradient to the rank of the next micro-batch and leaves each rank its rows of the sum
    /// (and under `full` with a [`WeightGather`] for each precision); then the norm from the
    /// last rank's per-tensor sums, and the update of each rank's rows.
    fn run_ring<D: Device>(
        &self,
        state: &mut State<D>,
        (comm, gather): (&dyn Collective, &dyn Collective),
        mine: &[Batch],
        share: StepShare,
    ) -> Result<(Vec<PassOutput>, f64)> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let last = world - 1;
        let layout = state.model().layout().clone();
        let dev = state.device().clone();
        let full = self.shard == Shard::Full;
        let mut hooks = RankHooks {
            ring: GradRing::new(dev.clone(), comm, &layout, self, rank),
            f32s: full.then(|| WeightGather::new(dev.clone(), gather, &layout, self.faults)),
            bf16s: full.then(|| WeightGather::new(dev.clone(), gather, &layout, self.faults)),
        };
        let stride = (rank as u64, world as u64);
        let passes = state.passes_hooked(mine, self.dropout, share, stride, &mut hooks)?;
        let ring = hooks.ring;
        state.device().enter(StepPhase::Optimizer);
        let norm = match rank == last {
            true => ring.sums.iter().sum::<f64>().sqrt(),
            false => {
                ring.receive_rows(state.grads_mut(), last)?;
                0.0
            }
        };
        let norm = broadcast_norm(comm, norm)?;
        let coef = clip_coefficient(norm, state.optimizer().config().grad_clip);
        let shards: Vec<_> = (layout.specs.iter())
            .map(|s| shard_rows(&s.shape, world, rank, self.faults))
            .collect();
        scale(state, coef)?;
        state.adamw_shard(self.lr, &shards, self.shard)?;
        match full {
            true => state.refresh_compute()?,
            false => gather_updated(state, comm, self.faults)?,
        }
        Ok((passes, norm))
    }
}

/// The last rank's gradient norm `norm`, on every rank.
fn broadcast_norm(comm: &dyn Collective, norm: f64) -> Result<f64> {
    let last = comm.world_size() - 1;
    let bytes = comm.broadcast(last, norm.to_le_bytes().to_vec())?;
    let bytes = bytes
        .try_into()
        .map_err(|_| EngineError::Config("the gradient norm's message is not 8 bytes".into()))?;
    Ok(f64::from_le_bytes(bytes))
}

/// A rank's gradients under `shard: gradients`. Between passes a rank holds its rows of each
/// gradient only. Just before a pass first adds to a tensor's gradient the ring makes it whole:
/// zeros for the step's first micro-batch, else the sum so far, received from the rank of the
/// micro-batch before. Just after the pass's last addition it hands the sum on to the rank of
/// the next micro-batch and frees it; after the step's last micro-batch it sends each rank its
/// rows instead, keeping the tensor's sum of squares for the norm. Each tensor is added to in
/// global micro-batch order, on one buffer, as on one device.
struct GradRing<'a, D: Device> {
    dev: D,
    comm: &'a dyn Collective,
    layout: &'a Layout,
    faults: &'a Faults,
    rank: usize,
    /// The global index of the micro-batch the pass running now trains.
    pass: u64,
    /// Micro-batches in the step.
    micro_batches: u64,
    /// How many groups of one backward pass write each tensor (2 for tied embeddings: the
    /// head, added last, then the embedding).
    writes: Vec<usize>,
    /// The writes of the running pass still to come, per tensor.
    remaining: Vec<usize>,
    /// The rank's rows of each tensor whose whole gradient is in place.
    stash: Vec<Option<D::Tensor<f32>>>,
    /// Each tensor's sum of squares, on the last rank after the last micro-batch.
    sums: Vec<f64>,
}

impl<'a, D: Device> GradRing<'a, D> {
    fn new(
        dev: D,
        comm: &'a dyn Collective,
        layout: &'a Layout,
        step: &'a RankStep<'_>,
        rank: usize,
    ) -> Self {
        let n = layout.specs.len();
        let mut writes = vec![0; n];
        for g in Group::backward_order(layout.layers.len()) {
            layout
                .tensors_of(g)
                .into_iter()
                .for_each(|t| writes[t] += 1);
        }
        GradRing {
            dev,
            comm,
            layout,
            faults: step.faults,
            rank,
            pass: rank as u64,
            micro_batches: step.micro_batches as u64,
            remaining: writes.clone(),
            writes,
            stash: (0..n).map(|_| None).collect(),
            sums: vec![0.0; n],
        }
    }

    /// The ranks before and after this one on the ring.
    fn neighbours(&self) -> (usize, usize) {
        let world = self.comm.world_size();
        ((self.rank + world - 1) % world, (self.rank + 1) % world)
    }

    /// The order the tensors' sums are complete in on the last micro-batch: as the backward
    /// pass finishes with each.
    fn completion_order(&self) -> Vec<usize> {
        let mut remaining = self.writes.clone();
        let mut order = Vec::new();
        for g in Group::backward_order(self.layout.layers.len()) {
            for t in self.layout.tensors_of(g) {
                remaining[t] -= 1;
                if remaining[t] == 0 {
                    order.push(t);
                }
            }
        }
        order
    }

    /// Every tensor's rows of the step's sum from rank `from`, into `grads`, in the order the
    /// sums were completed.
    fn receive_rows(&self, grads: &mut Params<D::Tensor<f32>>, from: usize) -> Result<()> {
        for t in self.completion_order() {
            self.dev
                .write_bytes(grads.get_mut(t), 0, &self.comm.recv(from)?)?;
        }
        Ok(())
    }

    /// Sends each rank its rows of `whole`, tensor `t`'s sum over the step (this rank's rows
    /// into `mine`).
    fn scatter(&self, t: usize, whole: &D::Tensor<f32>, mine: &mut D::Tensor<f32>) -> Result<()> {
        let shape = &self.layout.specs[t].shape;
        for to in 0..self.comm.world_size() {
            let (rows, row) = shard_rows(shape, self.comm.world_size(), to, self.faults);
            let bytes =
                self.dev
                    .read_bytes(whole, rows.start * row * F32, rows.len() * row * F32)?;
            match to == self.rank {
                true => self.dev.write_bytes(mine, 0, &bytes)?,
                false => self.comm.send(to, bytes)?,
            }
        }
        Ok(())
    }
}

impl<D: Device> GradRing<'_, D> {
    /// Makes `group`'s gradients whole before a pass first adds to them.
    fn grads_in(&mut self, grads: &mut Params<D::Tensor<f32>>, group: Group) -> Result<()> {
        for t in self.layout.tensors_of(group) {
            if self.remaining[t] != self.writes[t] {
                continue;
            }
            let shape = &self.layout.specs[t].shape;
            let mut whole = self.dev.zeros::<f32>(shape, Category::Grads)?;
            if self.pass > 0 {
                let bytes = self.comm.recv(self.neighbours().0)?;
                self.dev.write_bytes(&mut whole, 0, &bytes)?;
            }
            self.stash[t] = Some(std::mem::replace(grads.get_mut(t), whole));
        }
        Ok(())
    }

    /// Hands `group`'s sums on after a pass has added its last.
    fn grads_out(&mut self, grads: &mut Params<D::Tensor<f32>>, group: Group) -> Result<()> {
        for t in self.layout.tensors_of(group) {
            self.remaining[t] -= 1;
            if self.remaining[t] > 0 {
                continue;
            }
            let mine = self.stash[t].take().ok_or_else(|| {
                EngineError::Config(format!(
                    "gradient {t} was handed on before it was made whole"
                ))
            })?;
            let whole = std::mem::replace(grads.get_mut(t), mine);
            if self.pass + 1 < self.micro_batches {
                let bytes = self.dev.read_bytes(&whole, 0, whole.bytes() as usize)?;
                self.comm.send(self.neighbours().1, bytes)?;
            } else {
                self.sums[t] = self.dev.sum_squares(&whole)?;
                self.scatter(t, &whole, grads.get_mut(t))?;
            }
        }
        if group == Group::Embed {
            self.pass += self.comm.world_size() as u64;
            self.remaining = self.writes.clone();
        }
        Ok(())
    }
}

/// Scales every gradient by the clipping factor, if any.
fn scale<D: Device>(state: &mut State<D>, coef: Option<f32>) -> Result<()> {
    if let Some(coef) = coef {
        let dev = state.device().clone();
        for g in state.grads_mut().tensors_mut() {
            dev.scale(g, coef)?;
        }
    }
    Ok(())
}

/// Sends every gradient, whole, to rank `to`.
fn send_whole<D: Device>(state: &mut State<D>, comm: &dyn Collective, to: usize) -> Result<()> {
    let dev = state.device().clone();
    for g in state.grads_mut().tensors() {
        comm.send(to, dev.read_bytes(g, 0, g.bytes() as usize)?)?;
    }
    Ok(())
}

/// Receives every gradient, whole, from rank `from`, in place of what the gradients hold.
fn receive_whole<D: Device>(
    state: &mut State<D>,
    comm: &dyn Collective,
    from: usize,
) -> Result<()> {
    let dev = state.device().clone();
    for g in state.grads_mut().tensors_mut() {
        dev.write_bytes(g, 0, &comm.recv(from)?)?;
    }
    Ok(())
}

/// Every rank gets rank `root`'s gradients.
fn broadcast_grads<D: Device>(
    state: &mut State<D>,
    comm: &dyn Collective,
    root: usize,
) -> Result<()> {
    let dev = state.device().clone();
    let rank = comm.rank();
    for g in state.grads_mut().tensors_mut() {
        let bytes = match rank == root {
            true => dev.read_bytes(g, 0, g.bytes() as usize)?,
            false => Vec::new(),
        };
        let got = comm.broadcast(root, bytes)?;
        if rank != root {
            dev.write_bytes(g, 0, &got)?;
        }
    }
    Ok(())
}

/// Rank `root` sends each rank its rows of every gradient.
fn scatter_grads<D: Device>(
    state: &mut State<D>,
    comm: &dyn Collective,
    root: usize,
    faults: &Faults,
) -> Result<()> {
    let dev = state.device().clone();
    let (rank, world) = (comm.rank(), comm.world_size());
    for g in state.grads_mut().tensors_mut() {
        if rank == root {
            for to in (0..world).filter(|&r| r != root) {
                let (rows, row) = shard_rows(g.shape(), world, to, faults);
                let bytes = dev.read_bytes(g, rows.start * row * F32, rows.len() * row * F32)?;
                comm.send(to, bytes)?;
            }
        } else {
            let (rows, row) = shard_rows(g.shape(), world, rank, faults);
            dev.write_bytes(g, rows.start * row * F32, &comm.recv(root)?)?;
        }
    }
    Ok(())
}

/// Every rank gets every rank's updated rows: of the f32 weights in fp32, of the bf16 compute
/// weights (each rank rounding its master rows) in bf16-mixed.
fn gather_updated<D: Device>(
    state: &mut State<D>,
    comm: &dyn Collective,
    faults: &Faults,
) -> Result<()> {
    let dev = state.device().clone();
    let (rank, world) = (comm.rank(), comm.world_size());
    let at = |shape: &[usize], from: usize, elem: usize| {
        let (rows, row) = shard_rows(shape, world, from, faults);
        (rows.start * row * elem, rows.len() * row * elem)
    };
    match state.weights_mut() {
        Weights::Fp32(params) => {
            for p in params.tensors_mut() {
                let shape = p.shape().to_vec();
                let (offset, len) = at(&shape, rank, F32);
                let mine = dev.read_bytes(p, offset, len)?;
                exchange_rows(&dev, comm, p, mine, |from| at(&shape, from, F32).0)?;
            }
        }
        Weights::Bf16Mixed { master, compute } => {
            for (m, c) in master.tensors().into_iter().zip(compute.tensors_mut()) {
                let mut rounded = dev.zeros::<bf16>(m.shape(), Category::Workspace)?;
                dev.round(m, &mut rounded)?;
                let mine = dev.read_bytes(&rounded, 0, rounded.bytes() as usize)?;
                drop(rounded);
                let shape = c.shape().to_vec();
                dev.write_bytes(c, at(&shape, rank, BF16).0, &mine)?;
                exchange_rows(&dev, comm, c, mine, |from| at(&shape, from, BF16).0)?;
            }
        }
    }
    Ok(())
}

/// Sends this rank's `mine` to every rank and writes every other rank's into `t` at the byte
/// offset `at(rank)`.
fn exchange_rows<D: Device, E: Elem>(
    dev: &D,
    comm: &dyn Collective,
    t: &mut D::Tensor<E>,
    mine: Vec<u8>,
    at: impl Fn(usize) -> usize,
) -> Result<()> {
    for (from, bytes) in comm.all_gather(mine)?.into_iter().enumerate() {
        if from != comm.rank() {
            dev.write_bytes(t, at(from), &bytes)?;
        }
    }
    Ok(())
}

/// [`Fault::GradientsSummedByRank`]: every rank sends its own sum to the last, which adds them
/// in rank order.
fn add_by_rank<D: Device>(state: &mut State<D>, comm: &dyn Collective) -> Result<()> {
    let (rank, last) = (comm.rank(), comm.world_size() - 1);
    if rank < last {
        return send_whole(state, comm, last);
    }
    let dev = state.device().clone();
    let mut partials: Vec<Vec<Vec<u8>>> = Vec::new();
    for from in 0..last {
        let grads = state.grads_mut().tensors().len();
        partials.push((0..grads).map(|_| comm.recv(from)).collect::<Result<_>>()?);
    }
    for (i, g) in state.grads_mut().tensors_mut().into_iter().enumerate() {
        let own: Vec<f32> = bytes_to_f32(&dev.read_bytes(g, 0, g.bytes() as usize)?);
        let mut sum = vec![0.0f32; own.len()];
        for part in partials.iter().map(|p| bytes_to_f32(&p[i])).chain([own]) {
            for (s, x) in sum.iter_mut().zip(part) {
                *s += x;
            }
        }
        dev.write_bytes(g, 0, bytemuck::cast_slice(&sum))?;
    }
    Ok(())
}

/// Little-endian f32 bytes as values (empty from the counting device).
fn bytes_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A rank's weights under `shard: full`: between uses a rank holds its rows of each weight; a
/// group's weights are gathered whole from every rank's rows just before a pass reads them and
/// freed just after.
struct WeightGather<'a, D: Device, E: Elem> {
    dev: D,
    comm: &'a dyn Collective,
    layout: &'a Layout,
    faults: &'a Faults,
    /// The rank's rows of each weight whose whole tensor is in place.
    stash: Vec<Option<D::Tensor<E>>>,
    /// Whole weights [`Fault::GatheredWeightsKept`] keeps until the step's passes end.
    kept: Vec<D::Tensor<E>>,
}

impl<'a, D: Device, E: Elem> WeightGather<'a, D, E> {
    fn new(dev: D, comm: &'a dyn Collective, layout: &'a Layout, faults: &'a Faults) -> Self {
        WeightGather {
            dev,
            comm,
            layout,
            faults,
            stash: (0..layout.specs.len()).map(|_| None).collect(),
            kept: Vec::new(),
        }
    }

    /// Gathers `group`'s weights whole into `w`, keeping the rank's rows aside.
    fn weights_in(&mut self, w: &mut Params<D::Tensor<E>>, group: Group) -> Result<()> {
        let (world, elem) = (self.comm.world_size(), std::mem::size_of::<E>());
        for t in self.layout.tensors_of(group) {
            if self.stash[t].is_some() {
                return Err(EngineError::Config(format!(
                    "weight {t} was gathered twice without being freed"
                )));
            }
            let mine = w.get(t);
            let bytes = self.dev.read_bytes(mine, 0, mine.bytes() as usize)?;
            let shape = &self.layout.specs[t].shape;
            let mut whole = self.dev.zeros::<E>(shape, Category::Params)?;
            for (from, rows_bytes) in self.comm.all_gather(bytes)?.into_iter().enumerate() {
                let (rows, row) = shard_rows(shape, world, from, self.faults);
                self.dev
                    .write_bytes(&mut whole, rows.start * row * elem, &rows_bytes)?;
            }
            self.stash[t] = Some(std::mem::replace(w.get_mut(t), whole));
        }
        Ok(())
    }

    /// Frees `group`'s whole weights, putting the rank's rows back (or, with
    /// [`Fault::GatheredWeightsKept`], keeps them until the step's passes end).
    fn weights_out(&mut self, w: &mut Params<D::Tensor<E>>, group: Group) -> Result<()> {
        for t in self.layout.tensors_of(group) {
            let mine = self.stash[t].take().ok_or_else(|| {
                EngineError::Config(format!("weight {t} was freed without being gathered"))
            })?;
            let whole = std::mem::replace(w.get_mut(t), mine);
            if self.faults.has(Fault::GatheredWeightsKept) {
                self.kept.push(whole);
            }
        }
        Ok(())
    }
}

/// What a rank's passes are told under `shard: gradients` (the ring) and `full` (the ring and
/// the weight gathers of the run's precision). A tied head's gradient is added at the end of
/// each backward pass, so every gradient is handed on in the order the next rank first adds to
/// it, and a rank waiting for the tied one has already taken part in every gather of its pass.
struct RankHooks<'a, D: Device> {
    ring: GradRing<'a, D>,
    f32s: Option<WeightGather<'a, D, f32>>,
    bf16s: Option<WeightGather<'a, D, bf16>>,
}

impl<D: Device> PassHooks<D, f32> for RankHooks<'_, D> {
    fn weights_in(&mut self, w: &mut Params<D::Tensor<f32>>, group: Group) -> Result<()> {
        self.f32s
            .as_mut()
            .map_or(Ok(()), |g| g.weights_in(w, group))
    }
    fn weights_out(&mut self, w: &mut Params<D::Tensor<f32>>, group: Group) -> Result<()> {
        self.f32s
            .as_mut()
            .map_or(Ok(()), |g| g.weights_out(w, group))
    }
    fn grads_in(&mut self, grads: &mut Params<D::Tensor<f32>>, group: Group) -> Result<()> {
        self.ring.grads_in(grads, group)
    }
    fn grads_out(&mut self, grads: &mut Params<D::Tensor<f32>>, group: Group) -> Result<()> {
        self.ring.grads_out(grads, group)
    }
    fn tied_head_last(&self) -> bool {
        true
    }
}

impl<D: Device> PassHooks<D, bf16> for RankHooks<'_, D> {
    fn weights_in(&mut self, w: &mut Params<D::Tensor<bf16>>, group: Group) -> Result<()> {
        self.bf16s
            .as_mut()
            .map_or(Ok(()), |g| g.weights_in(w, group))
    }
    fn weights_out(&mut self, w: &mut Params<D::Tensor<bf16>>, group: Group) -> Result<()> {
        self.bf16s
            .as_mut()
            .map_or(Ok(()), |g| g.weights_out(w, group))
    }
    fn grads_in(&mut self, grads: &mut Params<D::Tensor<f32>>, group: Group) -> Result<()> {
        self.ring.grads_in(grads, group)
    }
    fn grads_out(&mut self, grads: &mut Params<D::Tensor<f32>>, group: Group) -> Result<()> {
        self.ring.grads_out(grads, group)
    }
    fn tied_head_last(&self) -> bool {
        true
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
