//! One decoder block, forward and backward written out as llm.c does: the forward pass returns
//! exactly the activations the backward pass consumes, and the backward pass frees each one as
//! soon as it has used it.

use crate::device::dropout::Site;
use crate::device::router::Routing;
use crate::device::{Device, DeviceTensor};
use crate::error::Result;
use crate::memory::Category::Activations;
use crate::model::ctx::{linear, linear_backward, BlockCtx};
use crate::model::moe::{self, MoeActs};
use crate::model::params::{Ffn, LayerLayout, Mlp, Params, Rows};
use crate::tensor::Elem;

/// An RMSNorm's output and the per-row `1 / rms` its backward pass reads.
pub struct Norm<D: Device, E: Elem> {
    /// `1 / rms` of each row.
    pub rinv: D::Tensor<f32>,
    /// The normalised rows.
    pub out: D::Tensor<E>,
}

/// What a dense MLP's backward pass reads: its gate and up projections and their SwiGLU
/// activation (dropped by selective checkpointing).
struct DenseActs<D: Device, E: Elem> {
    gate: D::Tensor<E>,
    up: D::Tensor<E>,
    act: Option<D::Tensor<E>>,
}

/// What an MLP's backward pass reads.
enum MlpActs<D: Device, E: Elem> {
    /// A dense MLP's.
    Dense(DenseActs<D, E>),
    /// A MoE layer's routing and experts.
    Moe(MoeActs<D, E>),
}

/// What a block's backward pass reads, besides the block's input.
///
/// The matrix-product outputs are always kept. The cheap tensors (both norms' outputs, the
/// SwiGLU activations and the experts' gathered inputs) are kept too unless
/// [`BlockActivations::keep_products`] dropped them, in which case the backward pass recomputes
/// each right before its use, with the same kernels on the same inputs, so the numbers are
/// bitwise the same.
pub struct BlockActivations<D: Device, E: Elem> {
    q: D::Tensor<E>,
    k: D::Tensor<E>,
    q_norm: Option<HeadNorm<D, E>>,
    k_norm: Option<HeadNorm<D, E>>,
    v: D::Tensor<E>,
    att: D::Tensor<E>,
    lse: D::Tensor<f32>,
    h_mid: D::Tensor<E>,
    mlp: MlpActs<D, E>,
    norm1: Option<Norm<D, E>>,
    norm2: Option<Norm<D, E>>,
}

impl<D: Device, E: Elem> BlockActivations<D, E> {
    /// Drops the tensors that are cheap to recompute, keeping the matrix-product outputs.
    pub fn keep_products(mut self) -> Self {
        self.norm1 = None;
        self.norm2 = None;
        match &mut self.mlp {
            MlpActs::Dense(d) => d.act = None,
            MlpActs::Moe(m) => m.keep_products(),
        }
        self
    }

    /// Whether the backward pass will recompute something.
    pub fn is_partial(&self) -> bool {
        let mlp = match &self.mlp {
            MlpActs::Dense(d) => d.act.is_none(),
            MlpActs::Moe(m) => m.is_partial(),
        };
        self.norm1.is_none() || self.norm2.is_none() || mlp
    }

    /// The routing of the block's MoE layer; `None` for a dense MLP.
    pub fn routing(&self) -> Option<&Routing> {
        match &self.mlp {
            MlpActs::Dense(_) => None,
            MlpActs::Moe(m) => Some(m.routing()),
        }
    }
}

/// `res + dropout(input · wᵀ)` (`[rows, hidden]`): a projection joining the residual stream at
/// `site`. Without dropout the product accumulates straight into the copy of `res`; with it the
/// product gets a buffer of its own, freed once the masked sum is formed.
fn residual_linear<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    site: Site,
    res: &D::Tensor<E>,
    input: &D::Tensor<E>,
    w: (&Params<D::Tensor<E>>, Rows),
) -> Result<D::Tensor<E>> {
    let (dev, h) = (ctx.dev, ctx.dims.hidden);
    let mut sum = ctx.output(h)?;
    match ctx.mask(site) {
        None => {
            dev.copy(res, &mut sum)?;
            linear(dev, input, w, &mut sum, true)?;
        }
        Some(mask) => {
            let mut proj = ctx.output(h)?;
            linear(dev, input, w, &mut proj, false)?;
            dev.dropout_add(&mask, res, &proj, &mut sum)?;
        }
    }
    Ok(sum)
}

/// ∂L/∂(projection) of the residual site `site` from `dh` = ∂L/∂(its sum): `None` without
/// dropout (the gradient is `dh` itself), else `dh` masked and scaled.
fn residual_grad<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    site: Site,
    dh: &D::Tensor<E>,
) -> Result<Option<D::Tensor<E>>> {
    let Some(mask) = ctx.mask(site) else {
        return Ok(None);
    };
    let mut dproj = ctx.output(ctx.dims.hidden)?;
    ctx.dev.dropout_backward(&mask, dh, &mut dproj)?;
    Ok(Some(dproj))
}

/// `rmsnorm(x) · w`, with the per-row `1 / rms`.
pub fn norm<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    x: &D::Tensor<E>,
    w: &D::Tensor<E>,
) -> Result<Norm<D, E>> {
    let mut rinv = ctx.dev.uninit::<f32>(&[ctx.dims.rows], Activations)?;
    let mut out = ctx.output(ctx.dims.hidden)?;
    ctx.dev
        .rmsnorm_forward(x, w, ctx.dims.eps, &mut out, &mut rinv)?;
    Ok(Norm { rinv, out })
}

/// What the backward pass of a per-head RMSNorm reads: its input and each head's `1 / rms`.
struct HeadNorm<D: Device, E: Elem> {
    input: D::Tensor<E>,
    rinv: D::Tensor<f32>,
}

/// A tensor after an optional per-head RMSNorm, and what the norm's backward pass reads.
type Normed<D, E> = (<D as Device>::Tensor<E>, Option<HeadNorm<D, E>>);

/// The RMSNorm of each head of `x` (`[rows, heads·d]`, rows of `d` against a weight of `d`), when
/// the layer has one (Qwen3's `q_norm`, `k_norm`): the normed heads, and the input with its
/// `1 / rms` per head for the backward pass. Without one, `x` itself.
fn head_norm<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    x: D::Tensor<E>,
    w: Option<&D::Tensor<E>>,
) -> Result<Normed<D, E>> {
    let Some(w) = w else {
        return Ok((x, None));
    };
    let heads = x.numel() / w.numel();
    let mut rinv = ctx.dev.uninit::<f32>(&[heads], Activations)?;
    let mut out = ctx.output(x.numel() / ctx.dims.rows)?;
    ctx.dev
        .rmsnorm_forward(&x, w, ctx.dims.eps, &mut out, &mut rinv)?;
    Ok((out, Some(HeadNorm { input: x, rinv })))
}

/// Backward of [`head_norm`] with the norm's weight `w` at `index` of the layout: the gradient of
/// its input from `dy`, the gradient of its output; the weight's gradient is added to `g`'s.
fn head_norm_backward<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    dy: D::Tensor<E>,
    saved: Option<HeadNorm<D, E>>,
    w: &Params<D::Tensor<E>>,
    g: &mut Params<D::Tensor<f32>>,
    index: Option<usize>,
) -> Result<D::Tensor<E>> {
    let (Some(HeadNorm { input, rinv }), Some(i)) = (saved, index) else {
        return Ok(dy);
    };
    let mut dx = ctx.act(input.numel() / ctx.dims.rows)?;
    ctx.dev
        .rmsnorm_backward(&dy, &input, w.get(i), &rinv, &mut dx, g.get_mut(i))?;
    Ok(dx)
}

/// A block's parameters: its tensors and where each of its weights is in them.
pub type Weights<'a, D, E> = (&'a Params<<D as Device>::Tensor<E>>, &'a LayerLayout);

/// `silu(gate) · up`.
fn swiglu<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    gate: &D::Tensor<E>,
    up: &D::Tensor<E>,
) -> Result<D::Tensor<E>> {
    let mut act = ctx.output(ctx.dims.ffn)?;
    ctx.dev.swiglu_forward(gate, up, &mut act)?;
    Ok(act)
}

/// Runs the block on `x` (`[rows, hidden]`): returns its output and every activation.
pub fn forward<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    (w, l): Weights<'_, D, E>,
    x: &D::Tensor<E>,
) -> Result<(D::Tensor<E>, BlockActivations<D, E>)> {
    let acts = activations(ctx, (w, l), x)?;
    let out = match (&acts.mlp, &l.mlp) {
        (MlpActs::Dense(d), Mlp::Dense(f)) => {
            let act = d.act.as_ref().expect("activations keeps everything");
            residual_linear(ctx, Site::Mlp, &acts.h_mid, act, (w, f.down))?
        }
        (MlpActs::Moe(m), _) => moe::combine(ctx, m, &acts.h_mid)?,
        (MlpActs::Dense(_), Mlp::Moe { .. }) => unreachable!("activations follow the layout"),
    };
    Ok((out, acts))
}

/// The activations of the block on `x`, without its output: what a fully checkpointed block
/// recomputes for its backward pass.
pub fn activations<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    (w, l): Weights<'_, D, E>,
    x: &D::Tensor<E>,
) -> Result<BlockActivations<D, E>> {
    let (dev, d) = (ctx.dev, &ctx.dims);
    let (qw, kw) = (d.attn.q_width(), d.attn.kv_width());
    let norm1 = norm(ctx, x, w.get(l.input_norm))?;
    let mut q = ctx.output(qw)?;
    let mut k = ctx.output(kw)?;
    let mut v = ctx.output(kw)?;
    for (y, rows) in [&mut q, &mut k, &mut v].into_iter().zip(l.qkv) {
        linear(dev, &norm1.out, (w, rows), y, false)?;
    }
    if let Some(bias) = l.qkv_bias {
        for (y, b) in [&mut q, &mut k, &mut v].into_iter().zip(bias) {
            dev.add_bias(y, w.get(b))?;
        }
    }
    let [q_norm, k_norm] = l
        .qk_norm
        .map_or([None, None], |n| n.map(|i| Some(w.get(i))));
    let (mut q, q_norm) = head_norm(ctx, q, q_norm)?;
    let (mut k, k_norm) = head_norm(ctx, k, k_norm)?;
    ctx.rotate(&mut q, qw, false)?;
    ctx.rotate(&mut k, kw, false)?;
    let mut att = ctx.output(qw)?;
    let a = d.attn;
    let mut lse = dev.uninit::<f32>(&[a.batch, a.heads, a.seq], Activations)?;
    dev.attention_forward(a, ctx.positions, &q, &k, &v, &mut att, &mut lse)?;
    let h_mid = residual_linear(ctx, Site::Attention, x, &att, (w, l.o))?;
    let norm2 = norm(ctx, &h_mid, w.get(l.post_norm))?;
    let mlp = match &l.mlp {
        Mlp::Dense(f) => {
            let mut gate = ctx.output(d.ffn)?;
            let mut up = ctx.output(d.ffn)?;
            linear(dev, &norm2.out, (w, f.gate_up[0]), &mut gate, false)?;
            linear(dev, &norm2.out, (w, f.gate_up[1]), &mut up, false)?;
            let act = swiglu(ctx, &gate, &up)?;
            MlpActs::Dense(DenseActs {
                gate,
                up,
                act: Some(act),
            })
        }
        Mlp::Moe { router, experts } => {
            MlpActs::Moe(moe::forward(ctx, (w, *router, experts), &norm2.out)?)
        }
    };
    Ok(BlockActivations {
        q,
        k,
        q_norm,
        k_norm,
        v,
        att,
        lse,
        h_mid,
        mlp,
        norm1: Some(norm1),
        norm2: Some(norm2),
    })
}

/// Backward of a dense MLP (`out = h_mid + dropout(act·downᵀ)`): `∂L/∂norm2` and the norm's
/// `1 / rms`, recomputing the norm and the activation when they were dropped.
fn dense_backward<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    (w, f, post_norm): (&Params<D::Tensor<E>>, &Ffn, usize),
    g: &mut Params<D::Tensor<f32>>,
    DenseActs { gate, up, act }: DenseActs<D, E>,
    (h_mid, norm2): (&D::Tensor<E>, Option<Norm<D, E>>),
    dh: &D::Tensor<E>,
) -> Result<(D::Tensor<E>, D::Tensor<f32>)> {
    let (dev, d) = (ctx.dev, &ctx.dims);
    let act = match act {
        Some(act) => act,
        None => swiglu(ctx, &gate, &up)?,
    };
    let dmlp = residual_grad(ctx, Site::Mlp, dh)?;
    let mut dact = ctx.output(d.ffn)?;
    let dy = dmlp.as_ref().unwrap_or(dh);
    linear_backward(dev, (dy, &act), (w, f.down), &mut dact, g, false)?;
    drop((act, dmlp));
    let mut dgate = ctx.output(d.ffn)?;
    let mut dup = ctx.output(d.ffn)?;
    dev.swiglu_backward(&dact, (&gate, &up), &mut dgate, &mut dup)?;
    drop((dact, gate, up));
    let Norm { rinv, out: n2 } = match norm2 {
        Some(n) => n,
        None => norm(ctx, h_mid, w.get(post_norm))?,
    };
    let mut dn2 = ctx.output(d.hidden)?;
    let [gate_rows, up_rows] = f.gate_up;
    linear_backward(dev, (&dgate, &n2), (w, gate_rows), &mut dn2, g, false)?;
    linear_backward(dev, (&dup, &n2), (w, up_rows), &mut dn2, g, true)?;
    Ok((dn2, rinv))
}

/// Backward of a MoE MLP (`out = h_mid + dropout(Σ_e w_e · y_e)`): `∂L/∂norm2`, the norm's
/// `1 / rms`, and what a deliberate leak keeps (see [`moe::backward`]).
#[allow(clippy::type_complexity)]
fn moe_backward<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    (w, layer): (&Params<D::Tensor<E>>, (usize, &[Ffn], usize)),
    g: &mut Params<D::Tensor<f32>>,
    acts: MoeActs<D, E>,
    (h_mid, norm2): (&D::Tensor<E>, Option<Norm<D, E>>),
    dh: &D::Tensor<E>,
    keep_dispatch: bool,
) -> Result<(D::Tensor<E>, D::Tensor<f32>, Vec<D::Tensor<E>>)> {
    let (router, experts, post_norm) = layer;
    let dmlp = residual_grad(ctx, Site::Mlp, dh)?;
    let Norm { rinv, out: n2 } = match norm2 {
        Some(n) => n,
        None => norm(ctx, h_mid, w.get(post_norm))?,
    };
    let mut dn2 = ctx.act(ctx.dims.hidden)?;
    let dy = dmlp.as_ref().unwrap_or(dh);
    let kept = moe::backward(
        ctx,
        (w, router, experts),
        g,
        acts,
        (&n2, dy),
        &mut dn2,
        keep_dispatch,
    )?;
    Ok((dn2, rinv, kept))
}

/// Backward through the block. `dh` holds ∂L/∂output on entry and ∂L/∂x on return; weight
/// gradients are added to `g`. Each activation is freed right after its last use, and each
/// dropped cheap one is recomputed right before its first. With `keep_dispatch` (a deliberate
/// leak) a MoE layer's gathered expert inputs and their gradients are returned, not freed.
#[allow(clippy::too_many_arguments)]
pub fn backward<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    (w, l): Weights<'_, D, E>,
    g: &mut Params<D::Tensor<f32>>,
    x: &D::Tensor<E>,
    saved: BlockActivations<D, E>,
    dh: &mut D::Tensor<E>,
    keep_dispatch: bool,
) -> Result<Vec<D::Tensor<E>>> {
    let (dev, d) = (ctx.dev, &ctx.dims);
    let (qw, kw, h) = (d.attn.q_width(), d.attn.kv_width(), d.hidden);
    let BlockActivations {
        q,
        k,
        q_norm,
        k_norm,
        v,
        att,
        lse,
        h_mid,
        mlp,
        norm1,
        norm2,
    } = saved;

    let (dn2, rinv2, kept) = match (mlp, &l.mlp) {
        (MlpActs::Dense(acts), Mlp::Dense(f)) => {
            let (dn2, rinv) =
                dense_backward(ctx, (w, f, l.post_norm), g, acts, (&h_mid, norm2), dh)?;
            (dn2, rinv, Vec::new())
        }
        (MlpActs::Moe(acts), Mlp::Moe { router, experts }) => moe_backward(
            ctx,
            (w, (*router, experts.as_slice(), l.post_norm)),
            g,
            acts,
            (&h_mid, norm2),
            dh,
            keep_dispatch,
        )?,
        _ => unreachable!("activations follow the layout"),
    };
    let post_norm = (w.get(l.post_norm), g.get_mut(l.post_norm));
    dev.rmsnorm_backward(&dn2, &h_mid, post_norm.0, &rinv2, dh, post_norm.1)?;
    drop((dn2, h_mid, rinv2));

    // Attention: h_mid = x + dropout(att·oᵀ)
    let dattn = residual_grad(ctx, Site::Attention, dh)?;
    let mut datt = ctx.output(qw)?;
    let dy = dattn.as_ref().unwrap_or(dh);
    linear_backward(dev, (dy, &att), (w, l.o), &mut datt, g, false)?;
    drop(dattn);
    let mut dq = ctx.output(qw)?;
    let mut dk = ctx.output(kw)?;
    let mut dv = ctx.output(kw)?;
    dev.attention_backward(
        d.attn,
        ctx.positions,
        &q,
        &k,
        &v,
        (&att, &lse),
        &datt,
        &mut dq,
        &mut dk,
        &mut dv,
    )?;
    drop((datt, att, lse, q, k, v));
    ctx.rotate(&mut dq, qw, true)?;
    ctx.rotate(&mut dk, kw, true)?;
    let [q_norm_at, k_norm_at] = l.qk_norm.map_or([None, None], |n| n.map(Some));
    let dq = head_norm_backward(ctx, dq, q_norm, w, g, q_norm_at)?;
    let dk = head_norm_backward(ctx, dk, k_norm, w, g, k_norm_at)?;
    if let Some(bias) = l.qkv_bias {
        for (dy, b) in [&dq, &dk, &dv].into_iter().zip(bias) {
            dev.bias_grad(dy, g.get_mut(b))?;
        }
    }
    let Norm {
        rinv: rinv1,
        out: n1,
    } = match norm1 {
        Some(n) => n,
        None => norm(ctx, x, w.get(l.input_norm))?,
    };
    let mut dn1 = ctx.output(h)?;
    let [q_rows, k_rows, v_rows] = l.qkv;
    linear_backward(dev, (&dq, &n1), (w, q_rows), &mut dn1, g, false)?;
    linear_backward(dev, (&dk, &n1), (w, k_rows), &mut dn1, g, true)?;
    linear_backward(dev, (&dv, &n1), (w, v_rows), &mut dn1, g, true)?;
    drop((dq, dk, dv, n1));
    let input_norm = (w.get(l.input_norm), g.get_mut(l.input_norm));
    dev.rmsnorm_backward(&dn1, x, input_norm.0, &rinv1, dh, input_norm.1)?;
    Ok(kept)
}
