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
use crate::model::dropout::{Dropout, DropoutMask, Site};
use crate::model::LayerParams;
use crate::tensor::Elem;

/// What a block call shares with the others: the device, the sizes and the rotary tables; and
/// its own index and the pass's dropout, which key its masks.
#[derive(Clone, Copy)]
pub(crate) struct BlockCtx<'a> {
    pub dev: &'a CudaDevice,
    pub dims: BlockDims,
    pub rope: &'a RopeTables,
    pub layer: usize,
    pub dropout: Option<Dropout>,
}

impl BlockCtx<'_> {
    fn mask(&self, site: Site) -> Option<DropoutMask> {
        self.dropout.map(|d| d.mask(self.layer, site))
    }

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

/// `res + dropout(input · wᵀ)`: a projection joining the residual stream at `site`, as the
/// CPU's `block::residual_linear` forms it. Without dropout the product accumulates straight
/// into the copy of `res`; with it the product gets a buffer of its own, freed once the masked
/// sum is formed.
fn residual_linear<E: Elem>(
    ctx: BlockCtx<'_>,
    site: Site,
    res: &CudaTensor<E>,
    input: &CudaTensor<E>,
    w: &CudaTensor<E>,
) -> Result<CudaTensor<E>> {
    let (dev, d) = (ctx.dev, &ctx.dims);
    let mut out = dev.zeros::<E>(&[d.rows, d.hidden], Activations)?;
    match ctx.mask(site) {
        None => {
            dev.copy(res.ptr(), out.ptr(), out.bytes() as usize)?;
            linear(dev, input, w, &mut out, true)?;
        }
        Some(mask) => {
            let mut proj = dev.zeros::<E>(&[d.rows, d.hidden], Activations)?;
            linear(dev, input, w, &mut proj, false)?;
            kernels::dropout_add(dev, &mask, res, &proj, &mut out)?;
        }
    }
    Ok(out)
}

/// ∂L/∂(projection) of the residual site `site` from `dh` = ∂L/∂(its sum): `None` without
/// dropout (the gradient is `dh` itself), else `dh` masked and scaled.
fn residual_grad<E: Elem>(
    ctx: BlockCtx<'_>,
    site: Site,
    dh: &CudaTensor<E>,
) -> Result<Option<CudaTensor<E>>> {
    let Some(mask) = ctx.mask(site) else {
        return Ok(None);
    };
    let d = &ctx.dims;
    let mut dproj = ctx.dev.zeros::<E>(&[d.rows, d.hidden], Activations)?;
    kernels::dropout_backward(ctx.dev, &mask, dh, &mut dproj)?;
    Ok(Some(dproj))
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
    let out = residual_linear(ctx, Site::Mlp, &acts.h_mid, act, &w.down)?;
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
    let rows = d.rows;
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
    let h_mid = residual_linear(ctx, Site::Attention, x, &att, &w.o)?;
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

    // MLP: out = h_mid + dropout(act·downᵀ)
    let act = match act {
        Some(act) => act,
        None => swiglu(ctx, &gate, &up)?,
    };
    let dmlp = residual_grad(ctx, Site::Mlp, dh)?;
    let mut dact = dev.zeros::<E>(&[rows, d.ffn], Activations)?;
    let dy = dmlp.as_ref().unwrap_or(dh);
    linear_backward(dev, dy, &act, &w.down, &mut dact, &mut g.down, false)?;
    drop((act, dmlp));
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

    // Attention: h_mid = x + dropout(att·oᵀ)
    let dattn = residual_grad(ctx, Site::Attention, dh)?;
    let mut datt = dev.zeros::<E>(&[rows, qw], Activations)?;
    let dy = dattn.as_ref().unwrap_or(dh);
    linear_backward(dev, dy, &att, &w.o, &mut datt, &mut g.o, false)?;
    drop(dattn);
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
