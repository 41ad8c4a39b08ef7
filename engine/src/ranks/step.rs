//! One rank's part of a step: its micro-batches cut from the step's, its passes, the chain or
//! ring its gradients travel, the norm, and the update of what it holds, by [`Shard`].

use super::exchange::{
    add_by_rank, broadcast_grads, gather_updated, receive_whole, scatter_grads, send_whole,
};
use super::gather::WeightGather;
use super::ring::GradRing;
use super::shard_rows;
use crate::device::{Device, DeviceTensor, StepPhase};
use crate::error::{EngineError, Result};
use crate::fault::{Fault, Faults};
use crate::model::loss::counted;
use crate::model::{Batch, Dropout, Group, Params, PassHooks, PassOutput, StepShare};
use crate::optim::{clip_coefficient, grad_norm};
use crate::parallel::collective::Collective;
use crate::parallel::plan;
use crate::parallel::Shard;
use crate::state::State;
use half::bf16;

/// A step as every rank's part of it is cut from it.
pub(super) struct StepParts<'a> {
    /// Every micro-batch of the step, in global order.
    pub(super) batches: &'a [Batch],
    pub(super) world: usize,
    pub(super) dropout: Option<Dropout>,
    pub(super) lr: f64,
    pub(super) shard: Shard,
    pub(super) faults: &'a Faults,
    /// [`Fault::RngRestoredOnRankZeroOnly`]'s offset lost by every rank but the first.
    pub(super) lost_at: Option<u64>,
}

impl<'a> StepParts<'a> {
    /// Rank `rank`'s part of the step, and its micro-batches.
    pub(super) fn of_rank(&self, rank: usize) -> (RankStep<'a>, Vec<Batch>) {
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

/// One rank's part of a step.
pub(super) struct RankStep<'a> {
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
    pub(super) fn run<D: Device>(
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
            ring: Some(GradRing::new(
                dev.clone(),
                comm,
                &layout,
                (self.faults, self.micro_batches),
                rank,
            )),
            f32s: full.then(|| WeightGather::new(dev.clone(), gather, &layout, self.faults)),
            bf16s: full.then(|| WeightGather::new(dev.clone(), gather, &layout, self.faults)),
        };
        let stride = (rank as u64, world as u64);
        let passes = state.passes_hooked(mine, self.dropout, share, stride, &mut hooks)?;
        let ring = hooks.ring.expect("a step's hooks hold its ring");
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

/// What a rank's passes are told under `shard: gradients` (the ring) and `full` (the ring and
/// the weight gathers of the run's precision). A tied head's gradient is added at the end of
/// each backward pass, so every gradient is handed on in the order the next rank first adds to
/// it, and a rank waiting for the tied one has already taken part in every gather of its pass.
/// An evaluation's passes add no gradient: they have no ring.
pub(super) struct RankHooks<'a, D: Device> {
    pub(super) ring: Option<GradRing<'a, D>>,
    pub(super) f32s: Option<WeightGather<'a, D, f32>>,
    pub(super) bf16s: Option<WeightGather<'a, D, bf16>>,
}

/// [`PassHooks`] for the weights of element type `$elem`, gathered by the `$gathers` field.
macro_rules! rank_hooks_for {
    ($elem:ty, $gathers:ident) => {
        impl<D: Device> PassHooks<D, $elem> for RankHooks<'_, D> {
            fn weights_in(&mut self, w: &mut Params<D::Tensor<$elem>>, group: Group) -> Result<()> {
                (self.$gathers.as_mut()).map_or(Ok(()), |g| g.weights_in(w, group))
            }
            fn weights_out(
                &mut self,
                w: &mut Params<D::Tensor<$elem>>,
                group: Group,
            ) -> Result<()> {
                (self.$gathers.as_mut()).map_or(Ok(()), |g| g.weights_out(w, group))
            }
            fn grads_in(&mut self, grads: &mut Params<D::Tensor<f32>>, group: Group) -> Result<()> {
                (self.ring.as_mut()).map_or(Ok(()), |r| r.grads_in(grads, group))
            }
            fn grads_out(
                &mut self,
                grads: &mut Params<D::Tensor<f32>>,
                group: Group,
            ) -> Result<()> {
                (self.ring.as_mut()).map_or(Ok(()), |r| r.grads_out(grads, group))
            }
            fn tied_head_last(&self) -> bool {
                true
            }
        }
    };
}

rank_hooks_for!(f32, f32s);
rank_hooks_for!(bf16, bf16s);
