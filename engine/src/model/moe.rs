//! A mixture-of-experts MLP, forward and backward, as transformers' Qwen3-MoE and Mixtral blocks
//! compute it: the router's logits `norm2 · Wrᵀ`, the routing on the host ([`Routing`]), then for
//! each expert in turn its rows gathered in token order, its SwiGLU MLP as batched products, and
//! its output weighted and added back into its rows. Nothing is atomic and every sum runs in a
//! fixed order, so the pass is deterministic.

use super::ctx::{linear, linear_backward, BlockCtx};
use super::params::{Ffn, Params, Rows};
use crate::device::dropout::Site;
use crate::device::router::{Dispatch, Routing};
use crate::device::{Device, DeviceTensor};
use crate::error::Result;
use crate::memory::Category::Activations;
use crate::tensor::Elem;

/// A MoE layer's weights: the model's tensors, the router's index and the experts.
pub type MoeWeights<'a, D, E> = (&'a Params<<D as Device>::Tensor<E>>, usize, &'a [Ffn]);

/// What one expert's backward pass reads.
pub struct ExpertActs<D: Device, E: Elem> {
    /// The expert's rows of the batch, on the device.
    rows: D::Ids,
    /// How many.
    n: usize,
    /// Each row's weight `[n]`.
    weights: D::Tensor<E>,
    /// Where each row's weight is in the routing's `[rows, top_k]` table.
    slots: Vec<u32>,
    /// The gathered input rows `[n, hidden]`; dropped by selective checkpointing.
    x: Option<D::Tensor<E>>,
    gate: D::Tensor<E>,
    up: D::Tensor<E>,
    /// `silu(gate) · up`; dropped by selective checkpointing.
    act: Option<D::Tensor<E>>,
    /// The expert's output before weighting `[n, hidden]`.
    y: D::Tensor<E>,
}

/// What a MoE layer's backward pass reads: the routing and each expert's activations (`None`
/// for an expert that got no rows).
pub struct MoeActs<D: Device, E: Elem> {
    routing: Routing,
    experts: Vec<Option<ExpertActs<D, E>>>,
}

impl<D: Device, E: Elem> MoeActs<D, E> {
    /// The layer's routing.
    pub fn routing(&self) -> &Routing {
        &self.routing
    }

    /// Drops what is cheap to recompute: each expert's gathered input and activation.
    pub fn keep_products(&mut self) {
        for e in self.experts.iter_mut().flatten() {
            e.x = None;
            e.act = None;
        }
    }

    /// Whether the backward pass will recompute something.
    pub fn is_partial(&self) -> bool {
        self.experts
            .iter()
            .flatten()
            .any(|e| e.x.is_none() || e.act.is_none())
    }
}

/// `src`'s rows `rows` (`n` of them, `[n, width]`).
fn gather<D: Device, E: Elem>(
    dev: &D,
    src: &D::Tensor<E>,
    rows: &D::Ids,
    (n, width): (usize, usize),
) -> Result<D::Tensor<E>> {
    let mut out = dev.zeros::<E>(&[n, width], Activations)?;
    dev.embedding_forward(src, rows, &mut out)?;
    Ok(out)
}

/// `silu(gate) · up`, `[n, ffn]`.
fn swiglu<D: Device, E: Elem>(
    dev: &D,
    gate: &D::Tensor<E>,
    up: &D::Tensor<E>,
) -> Result<D::Tensor<E>> {
    let mut act = dev.zeros::<E>(gate.shape(), Activations)?;
    dev.swiglu_forward(gate, up, &mut act)?;
    Ok(act)
}

/// One expert's MLP on its rows of `n2`.
fn expert_forward<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    w: &Params<D::Tensor<E>>,
    f: &Ffn,
    n2: &D::Tensor<E>,
    d: Dispatch,
) -> Result<ExpertActs<D, E>> {
    let (dev, h) = (ctx.dev, ctx.dims.hidden);
    let (n, ffn) = (d.rows.len(), f.gate_up[0].len);
    let rows = dev.ids(&d.rows)?;
    let weights = dev.upload_f32::<E>(&[n], &d.weights, Activations)?;
    let x = gather(dev, n2, &rows, (n, h))?;
    let mut gate = dev.zeros::<E>(&[n, ffn], Activations)?;
    let mut up = dev.zeros::<E>(&[n, ffn], Activations)?;
    linear(dev, &x, (w, f.gate_up[0]), &mut gate, false)?;
    linear(dev, &x, (w, f.gate_up[1]), &mut up, false)?;
    let act = swiglu(dev, &gate, &up)?;
    let mut y = dev.zeros::<E>(&[n, h], Activations)?;
    linear(dev, &act, (w, f.down), &mut y, false)?;
    Ok(ExpertActs {
        rows,
        n,
        weights,
        slots: d.slots,
        x: Some(x),
        gate,
        up,
        act: Some(act),
        y,
    })
}

/// The router's logits of `n2`, the routing, and every expert's activations.
pub fn forward<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    (w, router, experts): MoeWeights<'_, D, E>,
    n2: &D::Tensor<E>,
) -> Result<MoeActs<D, E>> {
    let dev = ctx.dev;
    let spec = ctx.route_spec();
    let mut logits = dev.zeros::<E>(&[ctx.dims.rows, experts.len()], Activations)?;
    linear(
        dev,
        n2,
        (w, Rows::whole(router, experts.len())),
        &mut logits,
        false,
    )?;
    let routing = dev.route(&logits, spec)?;
    drop(logits);
    let acts = routing
        .dispatch()
        .into_iter()
        .zip(experts)
        .map(|(d, f)| match d.rows.is_empty() {
            true => Ok(None),
            false => expert_forward(ctx, w, f, n2, d).map(Some),
        })
        .collect::<Result<_>>()?;
    Ok(MoeActs {
        routing,
        experts: acts,
    })
}

/// `h_mid + dropout(Σ_e w_e · y_e)`: each expert's weighted output added into its rows. Without
/// dropout the outputs go straight into the copy of `h_mid`; with it they are summed in a buffer
/// of their own first.
pub fn combine<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    acts: &MoeActs<D, E>,
    h_mid: &D::Tensor<E>,
) -> Result<D::Tensor<E>> {
    let dev = ctx.dev;
    let shape = [ctx.dims.rows, ctx.dims.hidden];
    let add_experts = |out: &mut D::Tensor<E>| -> Result<()> {
        for e in acts.experts.iter().flatten() {
            dev.scatter_add_rows(&e.y, &e.rows, Some(&e.weights), out)?;
        }
        Ok(())
    };
    let mut sum = dev.zeros::<E>(&shape, Activations)?;
    match ctx.mask(Site::Mlp) {
        None => {
            dev.copy(h_mid, &mut sum)?;
            add_experts(&mut sum)?;
        }
        Some(mask) => {
            let mut moe = dev.zeros::<E>(&shape, Activations)?;
            add_experts(&mut moe)?;
            dev.dropout_add(&mask, h_mid, &moe, &mut sum)?;
        }
    }
    Ok(sum)
}

/// Backward of the MoE MLP: from `dy` (∂L/∂ its weighted output) adds ∂L/∂`n2` to `dn2` and the
/// weights' gradients to `g`; `dprob` is the load-balancing loss's gradient per expert
/// probability. With `keep_dispatch` (a deliberate leak) each expert's gathered input and its
/// gradient are returned instead of freed.
#[allow(clippy::too_many_arguments)]
pub fn backward<D: Device, E: Elem>(
    ctx: BlockCtx<'_, D>,
    (w, router, experts): MoeWeights<'_, D, E>,
    g: &mut Params<D::Tensor<f32>>,
    acts: MoeActs<D, E>,
    (n2, dy): (&D::Tensor<E>, &D::Tensor<E>),
    dn2: &mut D::Tensor<E>,
    keep_dispatch: bool,
) -> Result<Vec<D::Tensor<E>>> {
    let (dev, h) = (ctx.dev, ctx.dims.hidden);
    let MoeActs {
        routing,
        experts: saved,
    } = acts;
    let mut dweights = vec![0.0f32; routing.rows() * routing.spec().top_k];
    let mut kept = Vec::new();
    for (acts, f) in saved.into_iter().zip(experts) {
        let Some(a) = acts else { continue };
        let ExpertActs {
            rows,
            n,
            weights,
            slots,
            x,
            gate,
            up,
            act,
            y,
        } = a;
        let mut dy_rows = gather(dev, dy, &rows, (n, h))?;
        let mut dots = dev.zeros::<f32>(&[n], Activations)?;
        dev.row_dots(&dy_rows, &y, &mut dots)?;
        drop(y);
        for (&s, d) in slots.iter().zip(dev.to_host(&dots)?) {
            dweights[s as usize] = d;
        }
        drop(dots);
        dev.scale_rows(&mut dy_rows, &weights)?;
        drop(weights);
        let act = match act {
            Some(act) => act,
            None => swiglu(dev, &gate, &up)?,
        };
        let mut dact = dev.zeros::<E>(gate.shape(), Activations)?;
        linear_backward(dev, (&dy_rows, &act), (w, f.down), &mut dact, g, false)?;
        drop((act, dy_rows));
        let mut dgate = dev.zeros::<E>(gate.shape(), Activations)?;
        let mut dup = dev.zeros::<E>(gate.shape(), Activations)?;
        dev.swiglu_backward(&dact, (&gate, &up), &mut dgate, &mut dup)?;
        drop((dact, gate, up));
        let x = match x {
            Some(x) => x,
            None => gather(dev, n2, &rows, (n, h))?,
        };
        let mut dx = dev.zeros::<E>(&[n, h], Activations)?;
        linear_backward(dev, (&dgate, &x), (w, f.gate_up[0]), &mut dx, g, false)?;
        linear_backward(dev, (&dup, &x), (w, f.gate_up[1]), &mut dx, g, true)?;
        drop((dgate, dup));
        dev.scatter_add_rows(&dx, &rows, None, dn2)?;
        if keep_dispatch {
            kept.extend([x, dx]);
        }
    }
    let e = experts.len();
    let dlogits = routing.logits_grad(&dweights, ctx.dprob);
    let dlogits = dev.upload_f32::<E>(&[ctx.dims.rows, e], &dlogits, Activations)?;
    linear_backward(
        dev,
        (&dlogits, n2),
        (w, Rows::whole(router, e)),
        dn2,
        g,
        true,
    )?;
    Ok(kept)
}
