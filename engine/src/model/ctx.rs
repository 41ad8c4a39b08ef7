//! What every part of a decoder block (attention, the dense MLP, the mixture of experts) works
//! with: the block's context and the products of a weight's block of rows.

use crate::device::dropout::{Dropout, DropoutMask, Site};
use crate::device::router::RouteSpec;
use crate::device::{n, out, t, AttnShape, Device, DeviceTensor, Out};
use crate::error::Result;
use crate::memory::Category::Activations;
use crate::model::params::{Params, Rows};
use crate::tensor::Elem;

/// Sizes the block's kernels need.
#[derive(Clone, Copy, Debug)]
pub struct BlockDims {
    /// Tokens in the batch (`batch · seq`).
    pub rows: usize,
    /// Residual width.
    pub hidden: usize,
    /// Dense MLP width.
    pub ffn: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// The attention call's shape.
    pub attn: AttnShape,
    /// The routing of the model's MoE layers (`layer` is filled in per block); `None` for a
    /// dense model.
    pub route: Option<RouteSpec>,
}

/// What a block call needs besides weights and tensors: the device, the sizes, the rotary
/// tables, and the block's index and dropout.
pub struct BlockCtx<'a, D: Device> {
    /// Where tensors are allocated and kernels run.
    pub dev: &'a D,
    /// Sizes.
    pub dims: BlockDims,
    /// Rotary tables.
    pub rope: &'a D::Rope,
    /// A packed batch's positions on the device ([`crate::model::Batch::positions`]).
    pub positions: Option<&'a D::Ids>,
    /// The block's index in the model (it keys the dropout masks).
    pub layer: usize,
    /// Residual dropout of a training pass; `None` applies none.
    pub dropout: Option<Dropout>,
    /// The load-balancing loss's gradient per expert probability (empty for a dense model).
    pub dprob: &'a [f64],
}

impl<D: Device> Clone for BlockCtx<'_, D> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<D: Device> Copy for BlockCtx<'_, D> {}

impl<D: Device> BlockCtx<'_, D> {
    /// The dropout mask of `site` in this block, if the pass drops out.
    pub(super) fn mask(&self, site: Site) -> Option<DropoutMask> {
        self.dropout.map(|d| d.mask(self.layer, site))
    }

    /// The routing of this block's MoE layer.
    pub(super) fn route_spec(&self) -> RouteSpec {
        let spec = self.dims.route.expect("a MoE block's model routes");
        RouteSpec {
            layer: self.layer,
            ..spec
        }
    }

    /// A `[rows, width]` activation, zero-filled: for a gradient its producers add to.
    pub(super) fn act<E: Elem>(&self, width: usize) -> Result<D::Tensor<E>> {
        self.dev.zeros::<E>(&[self.dims.rows, width], Activations)
    }

    /// A `[rows, width]` activation its producer writes in full ([`Device::uninit`]).
    pub(super) fn output<E: Elem>(&self, width: usize) -> Result<D::Tensor<E>> {
        self.dev.uninit::<E>(&[self.dims.rows, width], Activations)
    }

    pub(super) fn rotate<E: Elem>(
        &self,
        x: &mut D::Tensor<E>,
        width: usize,
        inverse: bool,
    ) -> Result<()> {
        let seq = self.dims.attn.seq;
        self.dev
            .rope(x, (width, seq), self.rope, self.positions, inverse)
    }
}

/// `y[rows, out] (+)= x[rows, in] · wᵀ` for the block of rows `w` of a weight stored
/// `[rows, in]` (a whole weight, or one projection of a fused one).
pub(super) fn linear<D: Device, E: Elem>(
    dev: &D,
    x: &D::Tensor<E>,
    (p, w): (&Params<D::Tensor<E>>, Rows),
    y: &mut D::Tensor<E>,
    accumulate: bool,
) -> Result<()> {
    let weight = p.get(w.tensor);
    let i = weight.shape()[1];
    let wt = t(weight).at(w.start * i);
    dev.matmul((x.numel() / i, w.len, i), n(x), wt, out(y), accumulate)
}

/// Backward of [`linear`]: `dx (+)= dy · w` and `dw += dyᵀ · x` (f32), into the same block of
/// rows of the gradient.
pub(super) fn linear_backward<D: Device, E: Elem>(
    dev: &D,
    (dy, x): (&D::Tensor<E>, &D::Tensor<E>),
    (p, w): (&Params<D::Tensor<E>>, Rows),
    dx: &mut D::Tensor<E>,
    g: &mut Params<D::Tensor<f32>>,
    accumulate_dx: bool,
) -> Result<()> {
    let weight = p.get(w.tensor);
    let i = weight.shape()[1];
    let rows = x.numel() / i;
    let at = w.start * i;
    dev.matmul(
        (rows, i, w.len),
        n(dy),
        n(weight).at(at),
        out(dx),
        accumulate_dx,
    )?;
    let dw = Out {
        tensor: g.get_mut(w.tensor),
        offset: at,
    };
    dev.matmul((w.len, i, rows), t(dy), n(x), dw, true)
}
