//! One decoder block, forward and backward written out as llm.c does: the forward pass returns
//! exactly the activations the backward pass consumes, and the backward pass frees each one as
//! soon as it has used it.

use crate::backend::cpu::attention::{attention_backward, attention_forward, AttnShape};
use crate::backend::cpu::kernels::{self, RopeTable};
use crate::backend::cpu::matmul::{matmul, n, t};
use crate::backend::CpuDevice;
use crate::error::Result;
use crate::memory::Category::Activations;
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

/// What every block call shares: the device, the sizes and the rotary tables.
#[derive(Clone, Copy)]
pub struct BlockCtx<'a> {
    /// Where tensors are allocated and kernels run.
    pub dev: &'a CpuDevice,
    /// Sizes.
    pub dims: BlockDims,
    /// Rotary tables.
    pub rope: &'a RopeTable,
}

/// What a block's backward pass reads, besides the block's input.
pub struct BlockActivations<E: Elem> {
    rinv1: Tensor<f32>,
    n1: Tensor<E>,
    q: Tensor<E>,
    k: Tensor<E>,
    v: Tensor<E>,
    att: Tensor<E>,
    lse: Tensor<f32>,
    h_mid: Tensor<E>,
    rinv2: Tensor<f32>,
    n2: Tensor<E>,
    gate: Tensor<E>,
    up: Tensor<E>,
    act: Tensor<E>,
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

/// Runs the block on `x` (`[rows, hidden]`): returns its output and the saved activations.
pub fn forward<E: Elem>(
    ctx: BlockCtx<'_>,
    w: &LayerParams<Tensor<E>>,
    x: &Tensor<E>,
) -> Result<(Tensor<E>, BlockActivations<E>)> {
    let (dev, d, rope) = (ctx.dev, &ctx.dims, ctx.rope);
    let (rows, h) = (d.rows, d.hidden);
    let mut rinv1 = dev.zeros::<f32>(&[rows], Activations)?;
    let mut n1 = dev.zeros::<E>(&[rows, h], Activations)?;
    kernels::rmsnorm_forward(
        dev,
        x.as_slice(),
        w.input_norm.as_slice(),
        d.eps,
        n1.as_mut_slice(),
        rinv1.as_mut_slice(),
    );
    let mut q = dev.zeros::<E>(&[rows, d.q_width()], Activations)?;
    let mut k = dev.zeros::<E>(&[rows, d.kv_width()], Activations)?;
    let mut v = dev.zeros::<E>(&[rows, d.kv_width()], Activations)?;
    linear(dev, &n1, &w.q, &mut q, false)?;
    linear(dev, &n1, &w.k, &mut k, false)?;
    linear(dev, &n1, &w.v, &mut v, false)?;
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
    let mut h_mid = dev.zeros::<E>(&[rows, h], Activations)?;
    h_mid.as_mut_slice().copy_from_slice(x.as_slice());
    linear(dev, &att, &w.o, &mut h_mid, true)?;
    let mut rinv2 = dev.zeros::<f32>(&[rows], Activations)?;
    let mut n2 = dev.zeros::<E>(&[rows, h], Activations)?;
    kernels::rmsnorm_forward(
        dev,
        h_mid.as_slice(),
        w.post_norm.as_slice(),
        d.eps,
        n2.as_mut_slice(),
        rinv2.as_mut_slice(),
    );
    let mut gate = dev.zeros::<E>(&[rows, d.ffn], Activations)?;
    let mut up = dev.zeros::<E>(&[rows, d.ffn], Activations)?;
    linear(dev, &n2, &w.gate, &mut gate, false)?;
    linear(dev, &n2, &w.up, &mut up, false)?;
    let mut act = dev.zeros::<E>(&[rows, d.ffn], Activations)?;
    kernels::swiglu_forward(dev, gate.as_slice(), up.as_slice(), act.as_mut_slice());
    let mut out = dev.zeros::<E>(&[rows, h], Activations)?;
    out.as_mut_slice().copy_from_slice(h_mid.as_slice());
    linear(dev, &act, &w.down, &mut out, true)?;
    let saved = BlockActivations {
        rinv1,
        n1,
        q,
        k,
        v,
        att,
        lse,
        h_mid,
        rinv2,
        n2,
        gate,
        up,
        act,
    };
    Ok((out, saved))
}

/// Backward through the block. `dh` holds ∂L/∂output on entry and ∂L/∂x on return; weight
/// gradients are added to `g`. Each saved activation is freed right after its last use.
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
        rinv1,
        n1,
        q,
        k,
        v,
        att,
        lse,
        h_mid,
        rinv2,
        n2,
        gate,
        up,
        act,
    } = saved;
    let (rows, h) = (d.rows, d.hidden);

    // MLP: out = h_mid + act·downᵀ
    let mut dact = dev.zeros::<E>(&[rows, d.ffn], Activations)?;
    linear_backward(dev, dh, &act, &w.down, &mut dact, &mut g.down, false)?;
    drop(act);
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

    // Attention: h_mid = x + att·oᵀ
    let mut datt = dev.zeros::<E>(&[rows, d.q_width()], Activations)?;
    linear_backward(dev, dh, &att, &w.o, &mut datt, &mut g.o, false)?;
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
