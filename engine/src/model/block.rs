//! One decoder block, forward and backward written out as llm.c does: the forward pass returns
//! exactly the activations the backward pass consumes, and the backward pass frees each one as
//! soon as it has used it.

use crate::backend::cpu::attention::{attention_backward, attention_forward, AttnShape};
use crate::backend::cpu::kernels::{self, RopeTable};
use crate::backend::cpu::matmul::{matmul, n, t};
use crate::backend::CpuDevice;
use crate::error::Result;
use crate::memory::Category::Activations;
use crate::model::dropout::{Dropout, DropoutMask, Site};
use crate::model::params::LayerParams;
use crate::tensor::{Elem, Tensor};

/// Sizes the block's kernels need.
#[derive(Clone, Copy, Debug)]
pub struct BlockDims {
    /// Tokens in the batch (`batch · seq`).
    pub rows: usize,
    /// Residual width.
    pub hidden: usize,
    /// MLP width.
    pub ffn: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// The attention call's shape.
    pub attn: AttnShape,
}

impl BlockDims {
    fn q_width(&self) -> usize {
        self.attn.heads * self.attn.head_dim
    }
    fn kv_width(&self) -> usize {
        self.attn.kv_heads * self.attn.head_dim
    }
}

/// What a block call needs besides weights and tensors: the device, the sizes, the rotary
/// tables, and the block's index and dropout.
#[derive(Clone, Copy)]
pub struct BlockCtx<'a> {
    /// Where tensors are allocated and kernels run.
    pub dev: &'a CpuDevice,
    /// Sizes.
    pub dims: BlockDims,
    /// Rotary tables.
    pub rope: &'a RopeTable,
    /// The block's index in the model (it keys the dropout masks).
    pub layer: usize,
    /// Residual dropout of a training pass; `None` applies none.
    pub dropout: Option<Dropout>,
}

impl BlockCtx<'_> {
    fn mask(&self, site: Site) -> Option<DropoutMask> {
        self.dropout.map(|d| d.mask(self.layer, site))
    }
}

/// An RMSNorm's output and the per-row `1 / rms` its backward pass reads.
struct Norm<E: Elem> {
    rinv: Tensor<f32>,
    out: Tensor<E>,
}

/// What a block's backward pass reads, besides the block's input.
///
/// The matrix-product outputs are always kept. The cheap tensors (both norms' outputs and the
/// SwiGLU activation) are kept too unless [`BlockActivations::keep_products`] dropped them, in
/// which case the backward pass recomputes each right before its use, with the same kernels on
/// the same inputs, so the numbers are bitwise the same.
pub struct BlockActivations<E: Elem> {
    q: Tensor<E>,
    k: Tensor<E>,
    v: Tensor<E>,
    att: Tensor<E>,
    lse: Tensor<f32>,
    h_mid: Tensor<E>,
    gate: Tensor<E>,
    up: Tensor<E>,
    norm1: Option<Norm<E>>,
    norm2: Option<Norm<E>>,
    act: Option<Tensor<E>>,
}

impl<E: Elem> BlockActivations<E> {
    /// Drops the tensors that are cheap to recompute, keeping the matrix-product outputs.
    pub fn keep_products(mut self) -> Self {
        self.norm1 = None;
        self.norm2 = None;
        self.act = None;
        self
    }

    /// Whether the backward pass will recompute something.
    pub fn is_partial(&self) -> bool {
        self.norm1.is_none() || self.norm2.is_none() || self.act.is_none()
    }
}

/// `y[rows, out] = x[rows, in] · wᵀ` for a weight stored `[out, in]`.
fn linear<E: Elem>(
    dev: &CpuDevice,
    x: &Tensor<E>,
    w: &Tensor<E>,
    y: &mut Tensor<E>,
    accumulate: bool,
) -> Result<()> {
    let (out, inp) = (w.shape()[0], w.shape()[1]);
    let rows = x.numel() / inp;
    matmul(
        dev,
        (rows, out, inp),
        n(x.as_slice()),
        t(w.as_slice()),
        y.as_mut_slice(),
        accumulate,
    )?;
    Ok(())
}

/// Backward of [`linear`]: `dx (+)= dy · w` and `dw += dyᵀ · x` (f32).
fn linear_backward<E: Elem>(
    dev: &CpuDevice,
    dy: &Tensor<E>,
    x: &Tensor<E>,
    w: &Tensor<E>,
    dx: &mut Tensor<E>,
    dw: &mut Tensor<f32>,
    accumulate_dx: bool,
) -> Result<()> {
    let (out, inp) = (w.shape()[0], w.shape()[1]);
    let rows = x.numel() / inp;
    matmul(
        dev,
        (rows, inp, out),
        n(dy.as_slice()),
        n(w.as_slice()),
        dx.as_mut_slice(),
        accumulate_dx,
    )?;
    matmul(
        dev,
        (out, inp, rows),
        t(dy.as_slice()),
        n(x.as_slice()),
        dw.as_mut_slice(),
        true,
    )?;
    Ok(())
}

/// `res + dropout(input · wᵀ)` (`[rows, hidden]`): a projection joining the residual stream at
/// `site`. Without dropout the product accumulates straight into the copy of `res`; with it the
/// product gets a buffer of its own, freed once the masked sum is formed.
fn residual_linear<E: Elem>(
    ctx: BlockCtx<'_>,
    site: Site,
    res: &Tensor<E>,
    input: &Tensor<E>,
    w: &Tensor<E>,
) -> Result<Tensor<E>> {
    let (dev, d) = (ctx.dev, &ctx.dims);
    let mut out = dev.zeros::<E>(&[d.rows, d.hidden], Activations)?;
    match ctx.mask(site) {
        None => {
            out.as_mut_slice().copy_from_slice(res.as_slice());
            linear(dev, input, w, &mut out, true)?;
        }
        Some(mask) => {
            let mut proj = dev.zeros::<E>(&[d.rows, d.hidden], Activations)?;
            linear(dev, input, w, &mut proj, false)?;
            kernels::dropout_add(
                dev,
                &mask,
                res.as_slice(),
                proj.as_slice(),
                out.as_mut_slice(),
            );
        }
    }
    Ok(out)
}

/// ∂L/∂(projection) of the residual site `site` from `dh` = ∂L/∂(its sum): `None` without
/// dropout (the gradient is `dh` itself), else `dh` masked and scaled.
fn residual_grad<E: Elem>(
    ctx: BlockCtx<'_>,
    site: Site,
    dh: &Tensor<E>,
) -> Result<Option<Tensor<E>>> {
    let Some(mask) = ctx.mask(site) else {
        return Ok(None);
    };
    let d = &ctx.dims;
    let mut dproj = ctx.dev.zeros::<E>(&[d.rows, d.hidden], Activations)?;
    kernels::dropout_backward(ctx.dev, &mask, dh.as_slice(), dproj.as_mut_slice());
    Ok(Some(dproj))
}

/// `rmsnorm(x) · w`, with the per-row `1 / rms`.
fn norm<E: Elem>(ctx: BlockCtx<'_>, x: &Tensor<E>, w: &Tensor<E>) -> Result<Norm<E>> {
    let (dev, d) = (ctx.dev, &ctx.dims);
    let mut rinv = dev.zeros::<f32>(&[d.rows], Activations)?;
    let mut out = dev.zeros::<E>(&[d.rows, d.hidden], Activations)?;
    kernels::rmsnorm_forward(
        dev,
        x.as_slice(),
        w.as_slice(),
        d.eps,
        out.as_mut_slice(),
        rinv.as_mut_slice(),
    );
    Ok(Norm { rinv, out })
}

/// `silu(gate) · up`.
fn swiglu<E: Elem>(ctx: BlockCtx<'_>, gate: &Tensor<E>, up: &Tensor<E>) -> Result<Tensor<E>> {
    let d = &ctx.dims;
    let mut act = ctx.dev.zeros::<E>(&[d.rows, d.ffn], Activations)?;
    kernels::swiglu_forward(ctx.dev, gate.as_slice(), up.as_slice(), act.as_mut_slice());
    Ok(act)
}

/// Runs the block on `x` (`[rows, hidden]`): returns its output and every activation.
pub fn forward<E: Elem>(
    ctx: BlockCtx<'_>,
    w: &LayerParams<Tensor<E>>,
    x: &Tensor<E>,
) -> Result<(Tensor<E>, BlockActivations<E>)> {
    let acts = activations(ctx, w, x)?;
    let act = acts.act.as_ref().expect("activations keeps everything");
    let out = residual_linear(ctx, Site::Mlp, &acts.h_mid, act, &w.down)?;
    Ok((out, acts))
}

/// The activations of the block on `x`, without its output: what a fully checkpointed block
/// recomputes for its backward pass.
pub fn activations<E: Elem>(
    ctx: BlockCtx<'_>,
    w: &LayerParams<Tensor<E>>,
    x: &Tensor<E>,
) -> Result<BlockActivations<E>> {
    let (dev, d, rope) = (ctx.dev, &ctx.dims, ctx.rope);
    let rows = d.rows;
    let norm1 = norm(ctx, x, &w.input_norm)?;
    let mut q = dev.zeros::<E>(&[rows, d.q_width()], Activations)?;
    let mut k = dev.zeros::<E>(&[rows, d.kv_width()], Activations)?;
    let mut v = dev.zeros::<E>(&[rows, d.kv_width()], Activations)?;
    linear(dev, &norm1.out, &w.q, &mut q, false)?;
    linear(dev, &norm1.out, &w.k, &mut k, false)?;
    linear(dev, &norm1.out, &w.v, &mut v, false)?;
    kernels::rope(dev, q.as_mut_slice(), d.q_width(), d.attn.seq, rope, false);
    kernels::rope(dev, k.as_mut_slice(), d.kv_width(), d.attn.seq, rope, false);
    let mut att = dev.zeros::<E>(&[rows, d.q_width()], Activations)?;
    let mut lse = dev.zeros::<f32>(&[d.attn.batch, d.attn.heads, d.attn.seq], Activations)?;
    attention_forward(
        dev,
        d.attn,
        q.as_slice(),
        k.as_slice(),
        v.as_slice(),
        att.as_mut_slice(),
        lse.as_mut_slice(),
    )?;
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
/// gradients are added to `g`. Each activation is freed right after its last use, and each
/// dropped cheap one is recomputed right before its first.
pub fn backward<E: Elem>(
    ctx: BlockCtx<'_>,
    w: &LayerParams<Tensor<E>>,
    g: &mut LayerParams<Tensor<f32>>,
    x: &Tensor<E>,
    saved: BlockActivations<E>,
    dh: &mut Tensor<E>,
) -> Result<()> {
    let (dev, d, rope) = (ctx.dev, &ctx.dims, ctx.rope);
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
    kernels::swiglu_backward(
        dev,
        dact.as_slice(),
        gate.as_slice(),
        up.as_slice(),
        dgate.as_mut_slice(),
        dup.as_mut_slice(),
    );
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
        dn2.as_slice(),
        h_mid.as_slice(),
        w.post_norm.as_slice(),
        rinv2.as_slice(),
        dh.as_mut_slice(),
        g.post_norm.as_mut_slice(),
    );
    drop((dn2, h_mid, rinv2));

    // Attention: h_mid = x + dropout(att·oᵀ)
    let dattn = residual_grad(ctx, Site::Attention, dh)?;
    let mut datt = dev.zeros::<E>(&[rows, d.q_width()], Activations)?;
    let dy = dattn.as_ref().unwrap_or(dh);
    linear_backward(dev, dy, &att, &w.o, &mut datt, &mut g.o, false)?;
    drop(dattn);
    let mut dq = dev.zeros::<E>(&[rows, d.q_width()], Activations)?;
    let mut dk = dev.zeros::<E>(&[rows, d.kv_width()], Activations)?;
    let mut dv = dev.zeros::<E>(&[rows, d.kv_width()], Activations)?;
    attention_backward(
        dev,
        d.attn,
        q.as_slice(),
        k.as_slice(),
        v.as_slice(),
        att.as_slice(),
        lse.as_slice(),
        datt.as_slice(),
        dq.as_mut_slice(),
        dk.as_mut_slice(),
        dv.as_mut_slice(),
    )?;
    drop((datt, att, lse, q, k, v));
    kernels::rope(dev, dq.as_mut_slice(), d.q_width(), d.attn.seq, rope, true);
    kernels::rope(dev, dk.as_mut_slice(), d.kv_width(), d.attn.seq, rope, true);
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
    kernels::rmsnorm_backward(
        dev,
        dn1.as_slice(),
        x.as_slice(),
        w.input_norm.as_slice(),
        rinv1.as_slice(),
        dh.as_mut_slice(),
        g.input_norm.as_mut_slice(),
    );
    Ok(())
}
