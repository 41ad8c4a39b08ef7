//! Typed launches of the kernels in `kernels.cu`: each wrapper passes exactly the parameter types
//! its kernel declares (`u64` for addresses and sizes, `u32`, `f32`, and the `#[repr(C)]`
//! structs below).

use super::device::CudaDevice;
use super::tensor::{Buffer, CudaTensor};
use crate::backend::cpu::attention::AttnShape;
use crate::backend::cpu::kernels::RopeTable;
use crate::error::{EngineError, Result};
use crate::memory::Category;
use crate::model::dropout::{DropoutMask, DRAW_SHIFT};
use crate::tensor::{DType, Elem};
use cudarc::driver::sys::CUdeviceptr;
use half::bf16;
use std::ffi::c_void;

/// Threads per block (`BLOCK` in kernels.cu).
const BLOCK: u32 = 256;
/// Dynamic shared memory a block may use without opting in, less the kernels' static arrays.
const SHARED_BYTES: usize = 48 * 1024 - 3 * BLOCK as usize * 4;

/// Pointers to each argument, in order, as `cuLaunchKernel` takes them.
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        &mut [$((&$a) as *const _ as *mut c_void),*]
    };
}

fn kernel<E: Elem>(base: &str) -> String {
    let suffix = match E::DTYPE {
        DType::F32 => "f32",
        DType::Bf16 => "bf16",
    };
    format!("{base}_{suffix}")
}

fn blocks(n: usize) -> Result<(u32, u32, u32)> {
    let b = n.div_ceil(BLOCK as usize);
    let b = u32::try_from(b).map_err(|_| {
        EngineError::Config(format!("{n} elements are too many for one kernel launch"))
    })?;
    Ok((b, 1, 1))
}

fn rows_grid(rows: usize) -> Result<(u32, u32, u32)> {
    let r = u32::try_from(rows).map_err(|_| {
        EngineError::Config(format!("{rows} rows are too many for one kernel launch"))
    })?;
    Ok((r, 1, 1))
}

/// The rotary tables of [`RopeTable`] on the device (counted as params).
pub(crate) struct RopeTables {
    cos: Buffer,
    sin: Buffer,
    half: usize,
}

impl RopeTables {
    pub(crate) fn upload(dev: &CudaDevice, t: &RopeTable) -> Result<Self> {
        Ok(RopeTables {
            cos: dev.upload_slice(&t.cos, Category::Params)?,
            sin: dev.upload_slice(&t.sin, Category::Params)?,
            half: t.half,
        })
    }
}

/// Row `i` of `out` is row `ids[i]` of `table`.
pub(crate) fn embedding_forward<E: Elem>(
    dev: &CudaDevice,
    table: &CudaTensor<E>,
    ids: &Buffer,
    out: &mut CudaTensor<E>,
) -> Result<()> {
    let rows = (ids.bytes() / 4) as u64;
    let width = out.numel() as u64 / rows.max(1);
    let (t, i, o) = (table.ptr(), ids.ptr(), out.ptr());
    dev.launch(
        &kernel::<E>("embedding_fwd"),
        blocks(out.numel())?,
        BLOCK,
        0,
        args![t, i, o, rows, width],
    )
}

/// `dtable[ids[p]] += dout[p]`, each id's rows summed in token order by one block. The
/// positions are grouped by id here on the host, where the ids are known; the group starts and
/// ids are padded to the batch's length, so the bytes uploaded do not depend on the data (the
/// memory model counts them).
pub(crate) fn embedding_backward<E: Elem>(
    dev: &CudaDevice,
    dout: &CudaTensor<E>,
    ids: &[u32],
    dtable: &mut CudaTensor<f32>,
) -> Result<()> {
    let mut order: Vec<u32> = (0..ids.len() as u32).collect();
    order.sort_by_key(|&p| (ids[p as usize], p));
    let mut distinct = Vec::new();
    let mut starts = Vec::new();
    for (k, &p) in order.iter().enumerate() {
        let id = ids[p as usize];
        if distinct.last() != Some(&id) {
            distinct.push(id);
            starts.push(k as u32);
        }
    }
    let groups = distinct.len();
    starts.resize(ids.len() + 1, order.len() as u32);
    distinct.resize(ids.len(), 0);
    let positions = dev.upload_slice(&order, Category::Io)?;
    let starts = dev.upload_slice(&starts, Category::Io)?;
    let id_buf = dev.upload_slice(&distinct, Category::Io)?;
    let width = dout.numel() as u64 / ids.len().max(1) as u64;
    let (d, p, s, i, t) = (
        dout.ptr(),
        positions.ptr(),
        starts.ptr(),
        id_buf.ptr(),
        dtable.ptr(),
    );
    dev.launch(
        &kernel::<E>("embedding_bwd"),
        rows_grid(groups)?,
        BLOCK,
        0,
        args![d, p, s, i, t, width],
    )
}

/// RMSNorm of every row: `y = w · round(x / rms(x))`, `rinv = 1 / rms(x)`.
pub(crate) fn rmsnorm_forward<E: Elem>(
    dev: &CudaDevice,
    x: &CudaTensor<E>,
    w: &CudaTensor<E>,
    eps: f32,
    y: &mut CudaTensor<E>,
    rinv: &mut CudaTensor<f32>,
) -> Result<()> {
    let h = w.numel() as u32;
    let (xp, wp, yp, rp) = (x.ptr(), w.ptr(), y.ptr(), rinv.ptr());
    dev.launch(
        &kernel::<E>("rmsnorm_fwd"),
        rows_grid(rinv.numel())?,
        BLOCK,
        0,
        args![xp, wp, yp, rp, h, eps],
    )
}

/// RMSNorm backward: `dx += ∂L/∂x`, `dw += ∂L/∂w` (rows summed in order per column).
pub(crate) fn rmsnorm_backward<E: Elem>(
    dev: &CudaDevice,
    dy: &CudaTensor<E>,
    x: &CudaTensor<E>,
    w: &CudaTensor<E>,
    rinv: &CudaTensor<f32>,
    dx: &mut CudaTensor<E>,
    dw: &mut CudaTensor<f32>,
) -> Result<()> {
    let h = w.numel() as u32;
    let rows = rinv.numel() as u64;
    let (dyp, xp, wp, rp, dxp, dwp) = (dy.ptr(), x.ptr(), w.ptr(), rinv.ptr(), dx.ptr(), dw.ptr());
    dev.launch(
        &kernel::<E>("rmsnorm_bwd_dx"),
        rows_grid(rinv.numel())?,
        BLOCK,
        0,
        args![dyp, xp, wp, rp, dxp, h],
    )?;
    dev.launch(
        &kernel::<E>("rmsnorm_bwd_dw"),
        blocks(w.numel())?,
        BLOCK,
        0,
        args![dyp, xp, rp, dwp, rows, h],
    )
}

/// Rotates every head of `x` (`[rows, width]`, row `r` at position `r % seq`); `inverse` is the
/// backward pass.
pub(crate) fn rope<E: Elem>(
    dev: &CudaDevice,
    x: &mut CudaTensor<E>,
    width: usize,
    seq: usize,
    tables: &RopeTables,
    inverse: bool,
) -> Result<()> {
    let rows = (x.numel() / width) as u64;
    let (w, s, half) = (width as u32, seq as u32, tables.half as u32);
    let sign: f32 = if inverse { -1.0 } else { 1.0 };
    let (xp, c, sn) = (x.ptr(), tables.cos.ptr(), tables.sin.ptr());
    dev.launch(
        &kernel::<E>("rope"),
        blocks(x.numel() / 2)?,
        BLOCK,
        0,
        args![xp, c, sn, rows, w, s, half, sign],
    )
}

/// A dropout mask as kernels.cu's `DropoutMask`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DeviceMask {
    key: u64,
    threshold: u64,
    shift: u32,
    scale: f32,
}

impl DeviceMask {
    fn new(m: &DropoutMask) -> Self {
        DeviceMask {
            key: m.key(),
            threshold: m.threshold(),
            shift: DRAW_SHIFT,
            scale: m.scale(),
        }
    }
}

/// `out = x + dropout(y)`: `x[i] + y[i] · scale` where `mask` keeps element `i`, else `x[i]`
/// (the CPU's `kernels::dropout_add`, the same masks).
pub(crate) fn dropout_add<E: Elem>(
    dev: &CudaDevice,
    mask: &DropoutMask,
    x: &CudaTensor<E>,
    y: &CudaTensor<E>,
    out: &mut CudaTensor<E>,
) -> Result<()> {
    let (n, m) = (out.numel() as u64, DeviceMask::new(mask));
    let (xp, yp, op) = (x.ptr(), y.ptr(), out.ptr());
    dev.launch(
        &kernel::<E>("dropout_add"),
        blocks(out.numel())?,
        BLOCK,
        0,
        args![xp, yp, op, n, m],
    )
}

/// Backward of [`dropout_add`] for `y`: `dy[i] = dout[i] · scale` where `mask` keeps element
/// `i`, else 0.
pub(crate) fn dropout_backward<E: Elem>(
    dev: &CudaDevice,
    mask: &DropoutMask,
    dout: &CudaTensor<E>,
    dy: &mut CudaTensor<E>,
) -> Result<()> {
    let (n, m) = (dy.numel() as u64, DeviceMask::new(mask));
    let (dp, yp) = (dout.ptr(), dy.ptr());
    dev.launch(
        &kernel::<E>("dropout_bwd"),
        blocks(dy.numel())?,
        BLOCK,
        0,
        args![dp, yp, n, m],
    )
}

/// `act = silu(gate) · up`.
pub(crate) fn swiglu_forward<E: Elem>(
    dev: &CudaDevice,
    gate: &CudaTensor<E>,
    up: &CudaTensor<E>,
    act: &mut CudaTensor<E>,
) -> Result<()> {
    let n = act.numel() as u64;
    let (g, u, a) = (gate.ptr(), up.ptr(), act.ptr());
    dev.launch(
        &kernel::<E>("swiglu_fwd"),
        blocks(act.numel())?,
        BLOCK,
        0,
        args![g, u, a, n],
    )
}

/// SwiGLU backward: `dgate` and `dup` from `dact`.
pub(crate) fn swiglu_backward<E: Elem>(
    dev: &CudaDevice,
    dact: &CudaTensor<E>,
    gate: &CudaTensor<E>,
    up: &CudaTensor<E>,
    dgate: &mut CudaTensor<E>,
    dup: &mut CudaTensor<E>,
) -> Result<()> {
    let n = dact.numel() as u64;
    let (da, g, u, dg, du) = (dact.ptr(), gate.ptr(), up.ptr(), dgate.ptr(), dup.ptr());
    dev.launch(
        &kernel::<E>("swiglu_bwd"),
        blocks(dact.numel())?,
        BLOCK,
        0,
        args![da, g, u, dg, du, n],
    )
}

/// The attention shape as kernels.cu's `Attn`, with the tile of one kernel: `br` query rows
/// and `bc` key rows.
#[repr(C)]
#[derive(Clone, Copy)]
struct Attn {
    batch: u32,
    seq: u32,
    heads: u32,
    kv_heads: u32,
    d: u32,
    scale: f32,
    br: u32,
    bc: u32,
}

/// Most columns of a head one thread of a tiled attention kernel owns (`MAX_COLS` in
/// kernels.cu).
const MAX_COLS: usize = 16;

/// Tile sizes tried, largest first.
const TILE_ROWS: [usize; 6] = [64, 32, 16, 8, 4, 2];

/// The dynamic shared memory, in bytes, of the kernels' tiles for head width `d`.
fn forward_shared(d: usize, br: usize, bc: usize) -> usize {
    (br * (d + 1) + 2 * bc * (d + 1) + br * (bc + 1)) * 4
}

fn dq_shared(d: usize, br: usize, bc: usize) -> usize {
    (2 * br * (d + 1) + 2 * bc * (d + 1) + br * (bc + 1)) * 4
}

fn dkv_shared(d: usize, br: usize, bc: usize) -> usize {
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
    fn new(s: AttnShape, (br, bc): (usize, usize)) -> Self {
        Attn {
            batch: s.batch as u32,
            seq: s.seq as u32,
            heads: s.heads as u32,
            kv_heads: s.kv_heads as u32,
            d: s.head_dim as u32,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            br: br as u32,
            bc: bc as u32,
        }
    }

    /// One block per tile of `rows` rows of each of `heads` heads of each sequence.
    fn grid(&self, rows: u32, heads: u32) -> (u32, u32, u32) {
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

/// Causal attention forward; `lse` receives each row's log-sum-exp.
pub(crate) fn attention_forward<E: Elem>(
    dev: &CudaDevice,
    s: AttnShape,
    q: &CudaTensor<E>,
    k: &CudaTensor<E>,
    v: &CudaTensor<E>,
    out: &mut CudaTensor<E>,
    lse: &mut CudaTensor<f32>,
) -> Result<()> {
    let tiles = attention_tiles(s.head_dim).expect("checked by check_attention");
    let (br, bc) = (tiles.forward_queries, tiles.forward_keys);
    let a = Attn::new(s, (br, bc));
    let shared = forward_shared(s.head_dim, br, bc) as u32;
    let (qp, kp, vp, op, lp) = (q.ptr(), k.ptr(), v.ptr(), out.ptr(), lse.ptr());
    dev.launch(
        &kernel::<E>("attn_fwd"),
        a.grid(a.br, a.heads),
        BLOCK,
        shared,
        args![qp, kp, vp, op, lp, a],
    )
}

/// Backward of [`attention_forward`]: `dq`, `dk`, `dv` from `dout`, the probabilities
/// recomputed from the saved log-sum-exp.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward<E: Elem>(
    dev: &CudaDevice,
    s: AttnShape,
    q: &CudaTensor<E>,
    k: &CudaTensor<E>,
    v: &CudaTensor<E>,
    out: &CudaTensor<E>,
    lse: &CudaTensor<f32>,
    dout: &CudaTensor<E>,
    dq: &mut CudaTensor<E>,
    dk: &mut CudaTensor<E>,
    dv: &mut CudaTensor<E>,
) -> Result<()> {
    let t = attention_tiles(s.head_dim)
        .expect("checked by check_attention")
        .backward;
    let a = Attn::new(s, (t, t));
    let delta = dev.zeros::<f32>(&[s.batch, s.heads, s.seq], Category::Workspace)?;
    let (qp, kp, vp, op, lp, dop, dp) = (
        q.ptr(),
        k.ptr(),
        v.ptr(),
        out.ptr(),
        lse.ptr(),
        dout.ptr(),
        delta.ptr(),
    );
    let (dqp, dkp, dvp) = (dq.ptr(), dk.ptr(), dv.ptr());
    dev.launch(
        &kernel::<E>("attn_delta"),
        blocks(delta.numel())?,
        BLOCK,
        0,
        args![op, dop, dp, a],
    )?;
    dev.launch(
        &kernel::<E>("attn_bwd_dq"),
        a.grid(a.br, a.heads),
        BLOCK,
        dq_shared(s.head_dim, t, t) as u32,
        args![qp, kp, vp, dop, lp, dp, dqp, a],
    )?;
    dev.launch(
        &kernel::<E>("attn_bwd_dkv"),
        a.grid(a.bc, a.kv_heads),
        BLOCK,
        dkv_shared(s.head_dim, t, t) as u32,
        args![qp, kp, vp, dop, lp, dp, dkp, dvp, a],
    )
}

/// Replaces `rows` rows of logits at `logits` by `scale · (softmax − onehot(label))` and writes
/// each row's loss at `row_loss`; ignored rows become zeros.
pub(crate) fn softmax_xent_grad<E: Elem>(
    dev: &CudaDevice,
    logits: CUdeviceptr,
    labels: CUdeviceptr,
    row_loss: CUdeviceptr,
    (rows, vocab): (usize, usize),
    scale: f32,
) -> Result<()> {
    let v = vocab as u32;
    dev.launch(
        &kernel::<E>("xent"),
        rows_grid(rows)?,
        BLOCK,
        0,
        args![logits, labels, row_loss, v, scale],
    )
}

/// `dst = src` rounded to bf16.
pub(crate) fn to_bf16(
    dev: &CudaDevice,
    src: &CudaTensor<f32>,
    dst: &mut CudaTensor<bf16>,
) -> Result<()> {
    let n = src.numel() as u64;
    let (s, d) = (src.ptr(), dst.ptr());
    dev.launch(
        "f32_to_bf16",
        blocks(src.numel())?,
        BLOCK,
        0,
        args![s, d, n],
    )
}

/// AdamW's per-step scalars, as kernels.cu's `AdamWArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct AdamWArgs {
    pub decay: f32,
    pub one_minus_b1: f32,
    pub b2: f32,
    pub one_minus_b2: f32,
    pub eps: f32,
    pub step_size: f32,
    pub bc2_sqrt: f32,
}

/// One AdamW update of `p` and its moments `m`, `v` with gradient `g`.
pub(crate) fn adamw(
    dev: &CudaDevice,
    p: &mut CudaTensor<f32>,
    g: &CudaTensor<f32>,
    m: &mut CudaTensor<f32>,
    v: &mut CudaTensor<f32>,
    a: AdamWArgs,
) -> Result<()> {
    let n = p.numel() as u64;
    let (pp, gp, mp, vp) = (p.ptr(), g.ptr(), m.ptr(), v.ptr());
    dev.launch(
        "adamw",
        blocks(p.numel())?,
        BLOCK,
        0,
        args![pp, gp, mp, vp, n, a],
    )
}

/// Writes at `partial` the f64 sum of squares of each `chunk`-element chunk of `x`, in order.
pub(crate) fn sum_squares(
    dev: &CudaDevice,
    x: &CudaTensor<f32>,
    partial: CUdeviceptr,
    chunk: usize,
) -> Result<()> {
    let (n, c) = (x.numel() as u64, chunk as u64);
    let xp = x.ptr();
    dev.launch(
        "sumsq_chunks",
        blocks(x.numel().div_ceil(chunk))?,
        BLOCK,
        0,
        args![xp, partial, n, c],
    )
}

/// `x *= coef`.
pub(crate) fn scale(dev: &CudaDevice, x: &mut CudaTensor<f32>, coef: f32) -> Result<()> {
    let n = x.numel() as u64;
    let xp = x.ptr();
    dev.launch(
        "scale_f32",
        blocks(x.numel())?,
        BLOCK,
        0,
        args![xp, n, coef],
    )
}
