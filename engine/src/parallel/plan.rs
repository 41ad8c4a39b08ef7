//! The shard plan: which rows of a tensor each rank holds. Every tensor is split on its first
//! dimension into `ceil(d0 / N)` rows a rank, so the last shards can be short or empty (a
//! vocabulary that no world size divides is the common case). A rank's rows are a contiguous
//! range of the tensor's row-major elements, so a shard is a byte range, and element-wise
//! arithmetic on it (AdamW) gives the bits it gives on the whole tensor.
//!
//! It also says which micro-batches of a step each rank trains ([`micro_batches`]): the rule
//! the ranks train by and the memory model routes each rank's recorded micro-batches by.

use super::Shard;
use std::ops::Range;

/// The rows of a `d0`-row tensor that `rank` of `world` holds.
pub fn rows(d0: usize, world: usize, rank: usize) -> Range<usize> {
    let per_rank = d0.div_ceil(world.max(1));
    let start = (rank * per_rank).min(d0);
    start..(start + per_rank).min(d0)
}

/// The global indices of the micro-batches `rank` of `world` trains out of a step's `total`,
/// in the order it runs them: a contiguous run under `shard: none` and `optimizer` (the chain
/// adds whole runs), every `world`-th one from `rank` under `gradients` and `full` (the ring
/// hands each gradient on after every micro-batch).
pub fn micro_batches(shard: Shard, world: usize, rank: usize, total: usize) -> Vec<usize> {
    match shard {
        Shard::None | Shard::Optimizer => contiguous(world, rank, total),
        Shard::Gradients | Shard::Full => strided(world, rank, total),
    }
}

/// Micro-batches `rank · total / world .. (rank + 1) · total / world` of a step of `total`.
pub fn contiguous(world: usize, rank: usize, total: usize) -> Vec<usize> {
    let per_rank = total / world.max(1);
    (rank * per_rank..(rank + 1) * per_rank).collect()
}

/// Micro-batches `rank`, `rank + world`, ... of a step of `total`.
pub fn strided(world: usize, rank: usize, total: usize) -> Vec<usize> {
    (rank..total).step_by(world.max(1)).collect()
}

/// The rows `rank` holds of a tensor of `shape` (a 1-D tensor's rows are its elements), and the
/// elements per row.
pub fn shard_of(shape: &[usize], world: usize, rank: usize) -> (Range<usize>, usize) {
    let d0 = shape.first().copied().unwrap_or(1);
    let row = shape.iter().skip(1).product::<usize>();
    (rows(d0, world, rank), row)
}

/// `shape` with its first dimension cut to `rows` rows: the shape of a shard.
pub fn shard_shape(shape: &[usize], rows: usize) -> Vec<usize> {
    let mut shard = shape.to_vec();
    match shard.first_mut() {
        Some(d0) => *d0 = rows,
        None => shard.push(rows),
    }
    shard
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn uneven_tensors_leave_the_last_shards_short_or_empty() {
        assert_eq!(
            (0..4).map(|r| rows(10, 4, r)).collect::<Vec<_>>(),
            [0..3, 3..6, 6..9, 9..10]
        );
        assert_eq!(
            (0..4).map(|r| rows(5, 4, r)).collect::<Vec<_>>(),
            [0..2, 2..4, 4..5, 5..5]
        );
        assert_eq!(rows(2, 4, 3), 2..2);
        assert_eq!(shard_shape(&[10, 3], 2), [2, 3]);
    }

    #[test]
    fn the_chain_takes_runs_and_the_ring_takes_every_nth_micro_batch() {
        let of = |shard| {
            (0..3)
                .map(|r| micro_batches(shard, 3, r, 6))
                .collect::<Vec<_>>()
        };
        assert_eq!(of(Shard::None), [[0, 1], [2, 3], [4, 5]]);
        assert_eq!(of(Shard::Optimizer), of(Shard::None));
        assert_eq!(of(Shard::Gradients), [[0, 3], [1, 4], [2, 5]]);
        assert_eq!(of(Shard::Full), of(Shard::Gradients));
        assert_eq!(micro_batches(Shard::Full, 1, 0, 4), [0, 1, 2, 3]);
    }

    proptest! {
        /// The shards of every rank tile the tensor: in order, without gap or overlap.
        #[test]
        fn shards_tile_the_rows(d0 in 0usize..300, world in 1usize..9) {
            let mut next = 0;
            for rank in 0..world {
                let r = rows(d0, world, rank);
                prop_assert_eq!(r.start, next);
                prop_assert!(r.len() <= d0.div_ceil(world));
                next = r.end;
            }
            prop_assert_eq!(next, d0);
        }
    }
}
