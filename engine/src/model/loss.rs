//! The LM head and cross-entropy, fused: logits are produced, turned into their gradient in
//! place, and consumed, either all at once (`standard`) or a chunk of tokens at a time
//! (`chunked`) so the full `[tokens, vocab]` logits never exist. Row losses are summed on the
//! host in f64, in row order.

use crate::device::{n, out, t, Device, DeviceTensor, Out};
use crate::error::Result;
use crate::memory::Category;
use crate::tensor::Elem;
use serde::{Deserialize, Serialize};

/// Labels equal to this are ignored, as in PyTorch.
pub const IGNORE_INDEX: i64 = -100;

/// How the LM head and loss hold their logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LossKind {
    /// Materialise all `[tokens, vocab]` logits (counted as activations).
    Standard,
    /// Process `chunk_tokens` tokens at a time (counted as workspace).
    Chunked {
        /// Tokens per chunk.
        chunk_tokens: usize,
    },
}

impl LossKind {
    /// Tokens per chunk of logits for a batch of `rows` tokens, and the chunk's category.
    pub fn chunk(self, rows: usize) -> (usize, Category) {
        match self {
            LossKind::Standard => (rows.max(1), Category::Activations),
            LossKind::Chunked { chunk_tokens } => {
                (chunk_tokens.clamp(1, rows.max(1)), Category::Workspace)
            }
        }
    }
}

/// Labels that are not [`IGNORE_INDEX`]: the tokens a loss counts.
pub fn counted(labels: &[i64]) -> usize {
    labels.iter().filter(|&&l| l != IGNORE_INDEX).count()
}

/// The factor that turns summed token losses into their mean over `tokens` counted labels (1
/// when there are none), in the f32 the kernels scale gradients by.
pub fn mean_scale(tokens: usize) -> f32 {
    1.0 / tokens.max(1) as f32
}

/// Cross-entropy over labels that are not [`IGNORE_INDEX`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossOutput {
    /// The summed loss divided by the labels it is averaged over (0 when every label is
    /// ignored).
    pub loss: f32,
    /// The token losses summed in f64, in row order.
    pub sum: f64,
    /// Labels counted.
    pub tokens: usize,
}

/// Computes the loss of `hn` (`[rows, hidden]`, the final-norm output) through the head `w`
/// (`[vocab, hidden]`); writes `dhn` and, given `dw`, adds the head's gradient to it (without,
/// [`head_gradient`] adds it later, to the same bits). The loss and its gradients are averaged
/// over `mean_over` labels: these rows' own counted labels when `None`, else the count given
/// (an accumulating step's labels over all its micro-batches).
#[allow(clippy::too_many_arguments)]
pub fn linear_cross_entropy<D: Device, E: Elem>(
    dev: &D,
    hn: &D::Tensor<E>,
    w: &D::Tensor<E>,
    labels: &[i64],
    kind: LossKind,
    mean_over: Option<usize>,
    dhn: &mut D::Tensor<E>,
    mut dw: Option<&mut D::Tensor<f32>>,
) -> Result<LossOutput> {
    let (vocab, hidden) = (w.shape()[0], w.shape()[1]);
    let tokens = counted(labels);
    let scale = mean_scale(mean_over.unwrap_or(tokens));
    let row_loss = logit_grads(dev, (hn, w), labels, kind, scale, |start, len, logits| {
        let dx = Out {
            tensor: &mut *dhn,
            offset: start * hidden,
        };
        dev.matmul((len, hidden, vocab), n(logits), n(w), dx, false)?;
        if let Some(dw) = dw.as_deref_mut() {
            let x = n(hn).at(start * hidden);
            dev.matmul((vocab, hidden, len), t(logits), x, out(dw), true)?;
        }
        Ok(())
    })?;
    let total: f64 = dev.to_host(&row_loss)?.iter().map(|&l| l as f64).sum();
    Ok(LossOutput {
        loss: (total * scale as f64) as f32,
        sum: total,
        tokens,
    })
}

/// The loss of `hn` through the head `w` as [`linear_cross_entropy`] computes it (the same
/// chunks, the same row losses), without any gradient: an evaluation's.
pub fn cross_entropy<D: Device, E: Elem>(
    dev: &D,
    hn: &D::Tensor<E>,
    w: &D::Tensor<E>,
    labels: &[i64],
    kind: LossKind,
) -> Result<LossOutput> {
    let tokens = counted(labels);
    let scale = mean_scale(tokens);
    let row_loss = logit_grads(dev, (hn, w), labels, kind, scale, |_, _, _| Ok(()))?;
    let total: f64 = dev.to_host(&row_loss)?.iter().map(|&l| l as f64).sum();
    Ok(LossOutput {
        loss: (total * scale as f64) as f32,
        sum: total,
        tokens,
    })
}

/// Adds the head's gradient to `dw` as [`linear_cross_entropy`] adds it (the same arguments,
/// the same chunks in the same order, so the same bits), computing the logits and their
/// gradient again: for a pass that adds a tied head's gradient after the blocks' instead of
/// with the loss.
pub fn head_gradient<D: Device, E: Elem>(
    dev: &D,
    (hn, w): (&D::Tensor<E>, &D::Tensor<E>),
    labels: &[i64],
    kind: LossKind,
    mean_over: Option<usize>,
    dw: &mut D::Tensor<f32>,
) -> Result<()> {
    let (vocab, hidden) = (w.shape()[0], w.shape()[1]);
    let scale = mean_scale(mean_over.unwrap_or(counted(labels)));
    logit_grads(dev, (hn, w), labels, kind, scale, |start, len, logits| {
        let x = n(hn).at(start * hidden);
        dev.matmul((vocab, hidden, len), t(logits), x, out(&mut *dw), true)
    })?;
    Ok(())
}

/// The logits of `hn` through the head `w`, a chunk of rows at a time, each turned in place into
/// its gradient (token losses scaled by `scale`) and handed to `each` with the chunk's first row
/// and length; returns every row's loss.
fn logit_grads<D: Device, E: Elem>(
    dev: &D,
    (hn, w): (&D::Tensor<E>, &D::Tensor<E>),
    labels: &[i64],
    kind: LossKind,
    scale: f32,
    mut each: impl FnMut(usize, usize, &D::Tensor<E>) -> Result<()>,
) -> Result<D::Tensor<f32>> {
    let (vocab, hidden) = (w.shape()[0], w.shape()[1]);
    let rows = labels.len();
    let (chunk, category) = kind.chunk(rows);
    let mut row_loss = dev.zeros::<f32>(&[rows], Category::Workspace)?;
    let label_buf = dev.labels(labels)?;
    // Each chunk's rows are written by the product before anything reads them, and only they
    // are read (a shorter last chunk leaves the rows after it alone).
    let mut logits = dev.uninit::<E>(&[chunk, vocab], category)?;
    for start in (0..rows).step_by(chunk) {
        let len = chunk.min(rows - start);
        let x = n(hn).at(start * hidden);
        dev.matmul((len, vocab, hidden), x, t(w), out(&mut logits), false)?;
        let span = (start, len, vocab);
        dev.cross_entropy_rows(&mut logits, &label_buf, &mut row_loss, span, scale)?;
        each(start, len, &logits)?;
    }
    Ok(row_loss)
}
