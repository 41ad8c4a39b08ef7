//! The LM head and cross-entropy, fused: logits are produced, turned into their gradient in
//! place, and consumed, either all at once (`standard`) or a chunk of tokens at a time
//! (`chunked`) so the full `[tokens, vocab]` logits never exist.

use crate::backend::cpu::math;
use crate::backend::cpu::matmul::{matmul, n, t};
use crate::backend::CpuDevice;
use crate::error::Result;
use crate::memory::Category;
use crate::tensor::{Elem, Tensor};
use rayon::prelude::*;
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

/// Mean cross-entropy over labels that are not [`IGNORE_INDEX`], and the gradients it implies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossOutput {
    /// The mean loss (0 when every label is ignored).
    pub loss: f32,
    /// Labels counted.
    pub tokens: usize,
}

/// Computes the loss of `hn` (`[rows, hidden]`, the final-norm output) through the head `w`
/// (`[vocab, hidden]`); writes `dhn` and adds the head's gradient to `dw`.
pub fn linear_cross_entropy<E: Elem>(
    dev: &CpuDevice,
    hn: &Tensor<E>,
    w: &Tensor<E>,
    labels: &[i64],
    kind: LossKind,
    dhn: &mut Tensor<E>,
    dw: &mut Tensor<f32>,
) -> Result<LossOutput> {
    let (vocab, hidden) = (w.shape()[0], w.shape()[1]);
    let rows = labels.len();
    let tokens = labels.iter().filter(|&&l| l != IGNORE_INDEX).count();
    let (chunk, category) = match kind {
        LossKind::Standard => (rows.max(1), Category::Activations),
        LossKind::Chunked { chunk_tokens } => {
            (chunk_tokens.clamp(1, rows.max(1)), Category::Workspace)
        }
    };
    let mut row_loss = dev.zeros::<f32>(&[rows], Category::Workspace)?;
    let scale = 1.0 / tokens.max(1) as f32;
    let mut logits = dev.zeros::<E>(&[chunk, vocab], category)?;
    for start in (0..rows).step_by(chunk) {
        let len = chunk.min(rows - start);
        let lg = &mut logits.as_mut_slice()[..len * vocab];
        let x = &hn.as_slice()[start * hidden..(start + len) * hidden];
        matmul(dev, (len, vocab, hidden), n(x), t(w.as_slice()), lg, false)?;
        let lab = &labels[start..start + len];
        let rl = &mut row_loss.as_mut_slice()[start..start + len];
        dev.install(|| {
            lg.par_chunks_mut(vocab)
                .zip(rl.par_iter_mut())
                .zip(lab.par_iter())
                .for_each(|((row, loss), &label)| *loss = softmax_xent_grad(row, label, scale))
        });
        let lg = &logits.as_slice()[..len * vocab];
        let dx = &mut dhn.as_mut_slice()[start * hidden..(start + len) * hidden];
        matmul(dev, (len, hidden, vocab), n(lg), n(w.as_slice()), dx, false)?;
        matmul(
            dev,
            (vocab, hidden, len),
            t(lg),
            n(x),
            dw.as_mut_slice(),
            true,
        )?;
    }
    let total: f64 = row_loss.as_slice().iter().map(|&l| l as f64).sum();
    Ok(LossOutput {
        loss: (total * scale as f64) as f32,
        tokens,
    })
}

/// Replaces a row of logits by `scale · (softmax − onehot(label))` and returns the row's loss
/// (`logsumexp − logit[label]`); an ignored row becomes zeros and loss 0.
fn softmax_xent_grad<E: Elem>(row: &mut [E], label: i64, scale: f32) -> f32 {
    if label == IGNORE_INDEX {
        row.fill(E::default());
        return 0.0;
    }
    let label = label as usize;
    let max = math::max(row);
    let lse = max + math::sum_exp(row, max).ln();
    let logit = row[label].to_f32();
    for x in row.iter_mut() {
        *x = E::from_f32(scale * math::exp(x.to_f32() - lse));
    }
    row[label] = E::from_f32(scale * (math::exp(logit - lse) - 1.0));
    lse - logit
}
