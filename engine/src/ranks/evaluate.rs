//! An evaluation over the ranks: rank `r` takes the validation micro-batches `r, r + N, ...`,
//! each a forward pass without gradients, and the passes come back in global order, so that the
//! evaluation's loss (its token losses summed in f64 in that order) has the bits of one rank.
//! Under `shard: full` a pass gathers each group's weights from every rank, so every rank runs
//! as many passes: the ranks short of one in the last round run a pass over a one-token row
//! whose label is ignored, which adds nothing to the sums.

use super::gather::WeightGather;
use super::step::RankHooks;
use crate::device::Device;
use crate::error::Result;
use crate::fault::Faults;
use crate::model::loss::IGNORE_INDEX;
use crate::model::{Batch, PassOutput};
use crate::parallel::collective::Collective;
use crate::parallel::Shard;
use crate::state::State;

/// Rank `rank`'s micro-batches of an evaluation over `world` ranks: every `world`-th from its
/// own, as many for every rank (the last round filled with a one-token row, all ignored).
pub(super) fn of_rank(batches: &[Batch], world: usize, rank: usize) -> Vec<Batch> {
    let rounds = batches.len().div_ceil(world);
    (0..rounds)
        .map(|k| {
            batches.get(rank + k * world).cloned().unwrap_or(Batch {
                batch: 1,
                seq: 1,
                input_ids: vec![0],
                labels: vec![IGNORE_INDEX],
                positions: None,
            })
        })
        .collect()
}

/// Every rank's passes (`by_rank[r]` in the order rank `r` ran them) as the evaluation's, in
/// global order, without the filling passes.
pub(super) fn in_global_order(by_rank: Vec<Vec<PassOutput>>, batches: usize) -> Vec<PassOutput> {
    let mut passes = super::in_global_order(by_rank, Shard::Gradients);
    passes.truncate(batches);
    passes
}

/// Rank `gather.rank()`'s passes over `mine`: under `shard: full` with each group's weights
/// gathered over `gather` around its use.
pub(super) fn run<D: Device>(
    state: &mut State<D>,
    gather: &dyn Collective,
    mine: &[Batch],
    (shard, faults): (Shard, &Faults),
) -> Result<Vec<PassOutput>> {
    if shard != Shard::Full {
        return state.evaluate_hooked(mine, &mut ());
    }
    let layout = state.model().layout().clone();
    let dev = state.device().clone();
    let mut hooks = RankHooks {
        ring: None,
        f32s: Some(WeightGather::new(dev.clone(), gather, &layout, faults)),
        bf16s: Some(WeightGather::new(dev, gather, &layout, faults)),
    };
    state.evaluate_hooked(mine, &mut hooks)
}
