//! Building a rank: its rows of every weight, moment and gradient, on its own device, read from
//! the whole tensors or checkpoint files a [`RowSource`] holds (zeros where there is none).

use super::{shard_rows, Shard};
use crate::config::{Precision, TrainConfig};
use crate::device::Device;
use crate::error::Result;
use crate::memory::Category;
use crate::model::{LlamaConfig, ParamSpec, Params};
use crate::optim::Moments;
use crate::parallel::plan::shard_shape;
use crate::parallel::source::{RowSource, Which};
use crate::state::{State, Weights};
use crate::tensor::Tensor;
use half::bf16;
use std::ops::Range;

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

/// Rank `rank` of `world` of `cfg` on `dev`, built from `source` (see [`super::Ranks::new`]).
pub(super) fn build_rank<D: Device>(
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
