//! The tiles of the attention kernels: how many query and key rows a block of `kernels.cu`'s
//! tiled `attn_*` kernels and of its tensor-core `attn_tc_*` kernels holds in shared memory for a
//! head width, where the tensor-core kernels run, and the scratch the backward pass takes from
//! the tracker.

use crate::device::{AttnShape, Device};
use crate::error::{EngineError, Result};
use crate::memory::Category;

/// Threads per block of every kernel (`BLOCK` in kernels.cu); a head's columns are spread over
/// a row's share of them.
pub(crate) const BLOCK: u32 = 256;

/// Dynamic shared memory a block may use without opting in, less the kernels' static arrays.
const SHARED_BYTES: usize = 48 * 1024 - 3 * BLOCK as usize * 4;

/// The attention shape as kernels.cu's `Attn`, with the tile of one kernel (`br` query rows
/// and `bc` key rows) and a packed batch's positions (0 for none).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Attn {
    batch: u32,
    seq: u32,
    pub(crate) heads: u32,
    pub(crate) kv_heads: u32,
    d: u32,
    scale: f32,
    pub(crate) br: u32,
    pub(crate) bc: u32,
    positions: u64,
}

/// Most columns of a head one thread of a tiled attention kernel owns (`MAX_COLS` in
/// kernels.cu).
const MAX_COLS: usize = 16;

/// Tile sizes tried, largest first.
const TILE_ROWS: [usize; 6] = [64, 32, 16, 8, 4, 2];

/// The dynamic shared memory, in bytes, of the kernels' tiles for head width `d`.
pub(crate) fn forward_shared(d: usize, br: usize, bc: usize) -> usize {
    (br * (d + 1) + 2 * bc * (d + 1) + br * (bc + 1)) * 4
}

pub(crate) fn dq_shared(d: usize, br: usize, bc: usize) -> usize {
    (2 * br * (d + 1) + 2 * bc * (d + 1) + br * (bc + 1)) * 4
}

pub(crate) fn dkv_shared(d: usize, br: usize, bc: usize) -> usize {
    (2 * bc * (d + 1) + 2 * br * (d + 1) + 2 * br * (bc + 1) + 2 * br) * 4
}

/// Whether `rows` rows of width `d` per block leave each thread at most [`MAX_COLS`] columns.
fn columns_fit(d: usize, rows: usize) -> bool {
    d.div_ceil(BLOCK as usize / rows) <= MAX_COLS
}

/// The forward tile for head width `d`: the most query rows, then the most key rows, that fit.
fn forward_tile(d: usize) -> Option<(usize, usize)> {
    let br = TILE_ROWS.into_iter().find(|&br| columns_fit(d, br))?;
    let bc = TILE_ROWS
        .into_iter()
        .find(|&bc| forward_shared(d, br, bc) <= SHARED_BYTES)?;
    Some((br, bc))
}

/// The backward kernels' square tile for head width `d` (dq owns query rows, dk/dv key rows).
fn backward_tile(d: usize) -> Option<usize> {
    TILE_ROWS.into_iter().skip(1).find(|&t| {
        columns_fit(d, t)
            && dq_shared(d, t, t) <= SHARED_BYTES
            && dkv_shared(d, t, t) <= SHARED_BYTES
    })
}

impl Attn {
    /// `s` with the tile `(br, bc)` and the device address of a packed batch's positions (0 for
    /// none).
    pub(crate) fn new(s: AttnShape, (br, bc): (usize, usize), positions: u64) -> Self {
        Attn {
            batch: s.batch as u32,
            seq: s.seq as u32,
            heads: s.heads as u32,
            kv_heads: s.kv_heads as u32,
            d: s.head_dim as u32,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            br: br as u32,
            bc: bc as u32,
            positions,
        }
    }

    /// One block per tile of `rows` rows of each of `heads` heads of each sequence.
    pub(crate) fn grid(&self, rows: u32, heads: u32) -> (u32, u32, u32) {
        (self.seq.div_ceil(rows), heads, self.batch)
    }
}

/// The tiles of the attention kernels for one head width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionTiles {
    /// Query rows of a forward block.
    pub forward_queries: usize,
    /// Key rows the forward pass streams at a time.
    pub forward_keys: usize,
    /// Query rows of a `dq` block, and key rows of a `dk`/`dv` block (and what each streams).
    pub backward: usize,
}

/// The tiles the attention kernels use for heads `head_dim` wide; `None` where they cannot run.
pub fn attention_tiles(head_dim: usize) -> Option<AttentionTiles> {
    if head_dim == 0 || head_dim > BLOCK as usize {
        return None;
    }
    let (forward_queries, forward_keys) = forward_tile(head_dim)?;
    Some(AttentionTiles {
        forward_queries,
        forward_keys,
        backward: backward_tile(head_dim)?,
    })
}

/// Threads per block of the tensor-core attention kernels (`TC_THREADS` in kernels.cu).
pub(crate) const TC_THREADS: u32 = 128;

/// Rows a block of the tensor-core attention kernels owns (`TC_ROWS` in kernels.cu).
pub const TC_ROWS: usize = 64;

/// The rows the tensor-core attention kernels stream at a time for heads `head_dim` wide
/// (`DEFINE_TC_KERNELS` in kernels.cu); `None` where they have no kernel: a head width that is
/// not a multiple of 16 or exceeds 128.
pub fn tensor_core_keys(head_dim: usize) -> Option<usize> {
    match head_dim {
        16 | 32 | 48 | 64 => Some(64),
        80 | 96 | 112 | 128 => Some(32),
        _ => None,
    }
}

/// The environment variable choosing the bf16 attention kernels on GPUs with tensor cores.
pub(crate) const ATTENTION_KERNELS_VAR: &str = "CKPT_CUDA_ATTENTION";

/// Whether `CKPT_CUDA_ATTENTION` lets bf16 attention run on tensor cores: unset or
/// `tensor-cores` (the default) does, `tiled` keeps the tiled f32-arithmetic kernels (to compare
/// the two on one card).
pub(crate) fn tensor_core_attention_allowed() -> Result<bool> {
    match std::env::var(ATTENTION_KERNELS_VAR).as_deref() {
        Err(std::env::VarError::NotPresent) | Ok("tensor-cores") => Ok(true),
        Ok("tiled") => Ok(false),
        Ok(other) => Err(EngineError::Config(format!(
            "{ATTENTION_KERNELS_VAR} is `{other}`; set it to `tensor-cores` (the default) or `tiled`, or unset it"
        ))),
        Err(e) => Err(EngineError::Config(format!("{ATTENTION_KERNELS_VAR}: {e}"))),
    }
}

/// The dynamic shared memory, in bytes, of the tensor-core kernels: two buffers of two tiles of
/// `keys` rows of `d + 8` bf16 values.
pub(crate) fn tensor_core_shared(d: usize, keys: usize) -> usize {
    4 * keys * (d + 8) * 2
}

/// Checks the attention kernels can run `s`: a head is at most [`BLOCK`] wide, so that its
/// tiles fit in shared memory and its columns among a row's threads.
pub(crate) fn check_attention(s: AttnShape) -> Result<()> {
    if attention_tiles(s.head_dim).is_none() {
        return Err(EngineError::Config(format!(
            "head dimension {} is 0 or exceeds {BLOCK}, the most the CUDA attention kernels support",
            s.head_dim
        )));
    }
    Ok(())
}

/// The backward pass's per-row `delta = rowsum(dout ∘ out)` (`[batch, heads, seq]` f32), as
/// the CUDA backend allocates it (the counting device imitating CUDA calls this too).
pub(crate) fn attention_delta<D: Device>(dev: &D, s: &AttnShape) -> Result<D::Tensor<f32>> {
    dev.zeros::<f32>(&[s.batch, s.heads, s.seq], Category::Workspace)
}
