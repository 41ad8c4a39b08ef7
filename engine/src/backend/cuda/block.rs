//! One decoder block on the GPU, step for step the CPU's `model::block`: the forward pass returns
//! exactly the activations the backward pass consumes, and the backward pass frees each one
//! right after its last use (the free is stream-ordered, so the memory is reused by later work).

use super::device::CudaDevice;
use super::gemm::{matmul, n, t};
use super::kernels::{self, RopeTables};
use super::tensor::CudaTensor;
use crate::error::Result;
use crate::memory::Category::Activations;
use crate::model::block::BlockDims;
use crate::model::LayerParams;
use crate::tensor::Elem;

/// What every block call shares: the device, the sizes and the rotary tables.
#[derive(Clone, Copy)]
pub(crate) struct BlockCtx<'a> {
    pub dev: &'a CudaDevice,
    pub dims: BlockDims,
    pub rope: &'a RopeTables,
}

impl BlockCtx<'_> {
    fn q_width(&self) -> usize {
        self.dims.attn.heads * self.dims.attn.head_dim
    }
    fn kv_width(&self) -> usize {
        self.dims.attn.kv_heads * self.dims.attn.head_dim
    }
}

/// An RMSNorm's output and the per-row `1 / rms` its backward pass reads.
struct Norm<E: Elem> {
    rinv: CudaTensor<f32>,
    out: CudaTensor<E>,
}

/// What a block's backward pass reads besides its input; the cheap tensors (norm outputs, the
/// SwiGLU activation) are `None` under selective checkpointing and recomputed when needed.
pub(crate) struct BlockActivations<E: Elem> {
    q: CudaTensor<E>,
    k: CudaTensor<E>,
    v: CudaTensor<E>,
    att: CudaTensor<E>,
    lse: CudaTensor<f32>,
    h_mid: CudaTensor<E>,
    gate: CudaTensor<E>,
    up: CudaTensor<E>,
    norm1: Option<Norm<E>>,
    norm2: Option<Norm<E>>,
    act: Option<CudaTensor<E>>,
}

impl<E: Elem> BlockActivations<E> {
    /// Drops the tensors that are cheap to recompute, keeping the matrix-product outputs.
    pub(crate) fn keep_products(mut self) -> Self {
        self.norm1 = None;
        self.norm2 = None;
        self.act = None;
        self
    }

    /// Whether the backward pass will recompute something.
    pub(crate) fn is_partial(&self) -> bool {
        self.norm1.is_none() || self.norm2.is_none() || self.act.is_none()
    }
}

/// `y[rows, out] (+)= x[rows, in] · wᵀ` for a weight stored `[out, in]`.
fn linear<E: Elem>(
    dev: &CudaDevice,
    x: &CudaTensor<E>,
    w: &CudaTensor<E>,
    y: &mut CudaTensor<E>,
    accumulate: bool,
) -> Result<()> {
    let (out, inp) = (w.shape()[0], w.shape()[1]);
    let rows = x.numel() / inp;
    matmul(dev, (rows, out, inp), n(x), t(w), n(y), accumulate)
}

/// Backward of [`linear`]: `dx (+)= dy · w` and `dw += dyᵀ · x` (f32).
fn linear_backward<E: Elem>(
    dev: &CudaDevice,
    dy: &CudaTensor<E>,
    x: &CudaTensor<E>,
    w: &CudaTensor<E>,
    dx: &mut CudaTensor<E>,
    dw: &mut CudaTensor<f32>,
    accumulate_dx: bool,
) -> Result<()> {
    let (out, inp) = (w.shape()[0], w.shape()[1]);
    let rows = x.numel() / inp;
    matmul(dev, (rows, inp, out), n(dy), n(w), n(dx), accumulate_dx)?;
    matmul(dev, (out, inp, rows), t(dy), n(x), n(dw), true)
}

fn norm<E: Elem>(ctx: BlockCtx<'_>, x: &CudaTensor<E>, w: &CudaTensor<E>) -> Result<Norm<E>> {
    let (dev, d) = (ctx.dev, &ctx.dims);
    let mut rinv = dev.zeros::<f32>(&[d.rows], Activations)?;
    let mut out = dev.zeros::<E>(&[d.rows, d.hidden], Activations)?;
    kernels::rmsnorm_forward(dev, x, w, d.eps, &mut out, &mut rinv)?;
    Ok(Norm { rinv, out })
}

fn swiglu<E: Elem>(
    ctx: BlockCtx<'_>,
    gate: &CudaTensor<E>,
    up: &CudaTensor<E>,
) -> Result<CudaTensor<E>> {
    let d = &ctx.dims;
    let mut act = ctx.dev.zeros::<E>(&[d.rows, d.ffn], Activations)?;
    kernels::swiglu_forward(ctx.dev, gate, up, &mut act)?;
    Ok(act)
}

/// Runs the block on `x`: its output and every activation.
pub(crate) fn forward<E: Elem>(
    ctx: BlockCtx<'_>,
    w: &LayerParams<CudaTensor<E>>,
    x: &CudaTensor<E>,
) -> Result<(CudaTensor<E>, BlockActivations<E>)> {
    let acts = activations(ctx, w, x)?;
    let act = acts.act.as_ref().expect("activations keeps everything");
    let mut out = ctx
        .dev
        .zeros::<E>(&[ctx.dims.rows, ctx.dims.hidden], Activations)?;
    ctx.dev
        .copy(acts.h_mid.ptr(), out.ptr(), out.bytes() as usize)?;
    linear(ctx.dev, act, &w.down, &mut out, true)?;
    Ok((out, acts))
}

/// The activations of the block on `x`, without its output: what a fully checkpointed block
/// recomputes for its backward pass.
pub(crate) fn activations<E: Elem>(
    ctx: BlockCtx<'_>,
    w: &LayerParams<CudaTensor<E>>,
    x: &CudaTensor<E>,
) -> Result<BlockActivations<E>> {
    let (dev, d, rope) = (ctx.dev, &ctx.dims, ctx.rope);
    let (rows, h) = (d.rows, d.hidden);
    let (qw, kw) = (ctx.q_width(), ctx.kv_width());
    let norm1 = norm(ctx, x, &w.input_norm)?;
    let mut q = dev.zeros::<E>(&[rows, qw], Activations)?;
    let mut k = dev.zeros::<E>(&[rows, kw], Activations)?;
    let mut v = dev.zeros::<E>(&[rows, kw], Activations)?;
    linear(dev, &norm1.out, &w.q, &mut q, false)?;
    linear(dev, &norm1.out, &w.k, &mut k, false)?;
    linear(dev, &norm1.out, &w.v, &mut v, false)?;
    kernels::rope(dev, &mut q, qw, d.attn.seq, rope, false)?;
    kernels::rope(dev, &mut k, kw, d.attn.seq, rope, false)?;
    let mut att = dev.zeros::<E>(&[rows, qw], Activations)?;
    let mut lse = dev.zeros::<f32>(&[d.attn.batch, d.attn.heads, d.attn.seq], Activations)?;
    kernels::attention_forward(dev, d.attn, &q, &k, &v, &mut att, &mut lse)?;
    let mut h_mid = dev.zeros::<E>(&[rows, h], Activations)?;
    dev.copy(x.ptr(), h_mid.ptr(), h_mid.bytes() as usize)?;
    linear(dev, &att, &w.o, &mut h_mid, true)?;
    let norm2 = norm(ctx, &h_mid, &w.post_norm)?;
    let mut gate = dev.zeros::<E>(&[rows, d.ffn], Activations)?;
    let mut up = dev.zeros::<E>(&[rows, d.ffn], Activations)?;
    linear(dev, &norm2.out, &w.gate, &mut gate, false)?;
    linear(dev, &norm2.out, &w.up, &mut up, false)?;
    let act = swiglu(ctx, &gate, &up)?;
    Ok(BlockActivations {
        q,
        k,
        v,
        att,
        lse,
        h_mid,
        gate,
        up,
        norm1: Some(norm1),
        norm2: Some(norm2),
        act: Some(act),
    })
}

/// Backward through the block. `dh` holds ∂L/∂output on entry and ∂L/∂x on return; weight
/// gradients are added to `g`.
pub(crate) fn backward<E: Elem>(
    ctx: BlockCtx<'_>,
    w: &LayerParams<CudaTensor<E>>,
    g: &mut LayerParams<CudaTensor<f32>>,
    x: &CudaTensor<E>,
    saved: BlockActivations<E>,
    dh: &mut CudaTensor<E>,
) -> Result<()> {
    let (dev, d, rope) = (ctx.dev, &ctx.dims, ctx.rope);
    let (qw, kw) = (ctx.q_width(), ctx.kv_width());
    let BlockActivations {
        q,
        k,
        v,
        att,
        lse,
        h_mid,
        gate,
        up,
        norm1,
        norm2,
        act,
    } = saved;
    let (rows, h) = (d.rows, d.hidden);

    // MLP: out = h_mid + act·downᵀ
    let act = match act {
        Some(act) => act,
        None => swiglu(ctx, &gate, &up)?,
    };
    let mut dact = dev.zeros::<E>(&[rows, d.ffn], Activations)?;
    linear_backward(dev, dh, &act, &w.down, &mut dact, &mut g.down, false)?;
    drop(act);
    let mut dgate = dev.zeros::<E>(&[rows, d.ffn], Activations)?;
    let mut dup = dev.zeros::<E>(&[rows, d.ffn], Activations)?;
    kernels::swiglu_backward(dev, &dact, &gate, &up, &mut dgate, &mut dup)?;
    drop((dact, gate, up));
    let Norm {
        rinv: rinv2,
        out: n2,
    } = match norm2 {
        Some(n) => n,
        None => norm(ctx, &h_mid, &w.post_norm)?,
    };
    let mut dn2 = dev.zeros::<E>(&[rows, h], Activations)?;
    linear_backward(dev, &dgate, &n2, &w.gate, &mut dn2, &mut g.gate, false)?;
    linear_backward(dev, &dup, &n2, &w.up, &mut dn2, &mut g.up, true)?;
    drop((dgate, dup, n2));
    kernels::rmsnorm_backward(
        dev,
        &dn2,
        &h_mid,
        &w.post_norm,
        &rinv2,
        dh,
        &mut g.post_norm,
    )?;
    drop((dn2, h_mid, rinv2));

    // Attention: h_mid = x + att·oᵀ
    let mut datt = dev.zeros::<E>(&[rows, qw], Activations)?;
    linear_backward(dev, dh, &att, &w.o, &mut datt, &mut g.o, false)?;
    let mut dq = dev.zeros::<E>(&[rows, qw], Activations)?;
    let mut dk = dev.zeros::<E>(&[rows, kw], Activations)?;
    let mut dv = dev.zeros::<E>(&[rows, kw], Activations)?;
    kernels::attention_backward(
        dev, d.attn, &q, &k, &v, &att, &lse, &datt, &mut dq, &mut dk, &mut dv,
    )?;
    drop((datt, att, lse, q, k, v));
    kernels::rope(dev, &mut dq, qw, d.attn.seq, rope, true)?;
    kernels::rope(dev, &mut dk, kw, d.attn.seq, rope, true)?;
    let Norm {
        rinv: rinv1,
        out: n1,
    } = match norm1 {
        Some(n) => n,
        None => norm(ctx, x, &w.input_norm)?,
    };
    let mut dn1 = dev.zeros::<E>(&[rows, h], Activations)?;
    linear_backward(dev, &dq, &n1, &w.q, &mut dn1, &mut g.q, false)?;
    linear_backward(dev, &dk, &n1, &w.k, &mut dn1, &mut g.k, true)?;
    linear_backward(dev, &dv, &n1, &w.v, &mut dn1, &mut g.v, true)?;
    drop((dq, dk, dv, n1));
    kernels::rmsnorm_backward(dev, &dn1, x, &w.input_norm, &rinv1, dh, &mut g.input_norm)
}
