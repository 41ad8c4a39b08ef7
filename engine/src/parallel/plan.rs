//! The shard plan: which rows of a tensor each rank holds. Every tensor is split on its first
//! dimension into `ceil(d0 / N)` rows a rank, so the last shards can be short or empty (a
//! vocabulary that no world size divides is the common case). A rank's rows are a contiguous
//! range of the tensor's row-major elements, so a shard is a byte range, and element-wise
//! arithmetic on it (AdamW) gives the bits it gives on the whole tensor.

use std::ops::Range;

/// The rows of a `d0`-row tensor that `rank` of `world` holds.
pub fn rows(d0: usize, world: usize, rank: usize) -> Range<usize> {
    let per_rank = d0.div_ceil(world.max(1));
    let start = (rank * per_rank).min(d0);
    start..(start + per_rank).min(d0)
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
