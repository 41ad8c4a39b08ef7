//! The LM head and cross-entropy on the GPU, as `crate::loss` does them on the CPU: logits are
//! produced a chunk of tokens at a time (all at once for `standard`), turned into their gradient
//! in place, and consumed. Row losses are summed on the host in f64, in row order.

use super::device::CudaDevice;
use super::gemm::{matmul, n, t};
use super::kernels;
use super::tensor::CudaTensor;
use crate::error::Result;
use crate::loss::{LossKind, LossOutput, IGNORE_INDEX};
use crate::memory::Category;
use crate::tensor::Elem;

/// The loss of `hn` (`[rows, hidden]`) through the head `w` (`[vocab, hidden]`) against
/// `labels`; writes `dhn` and adds the head's gradient to `dw`.
pub(crate) fn linear_cross_entropy<E: Elem>(
    dev: &CudaDevice,
    hn: &CudaTensor<E>,
    w: &CudaTensor<E>,
    labels: &[i64],
    kind: LossKind,
    dhn: &mut CudaTensor<E>,
    dw: &mut CudaTensor<f32>,
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
    let row_loss = dev.zeros::<f32>(&[rows], Category::Workspace)?;
    let label_buf = dev.upload_slice(labels, Category::Io)?;
    let scale = 1.0 / tokens.max(1) as f32;
    let logits = dev.zeros::<E>(&[chunk, vocab], category)?;
    for start in (0..rows).step_by(chunk) {
        let len = chunk.min(rows - start);
        let x = n(hn).offset(start * hidden);
        matmul(dev, (len, vocab, hidden), x, t(w), n(&logits), false)?;
        kernels::softmax_xent_grad::<E>(
            dev,
            logits.ptr(),
            label_buf.ptr() + (start * 8) as u64,
            row_loss.ptr() + (start * 4) as u64,
            (len, vocab),
            scale,
        )?;
        let dx = n(dhn).offset(start * hidden);
        matmul(dev, (len, hidden, vocab), n(&logits), n(w), dx, false)?;
        matmul(dev, (vocab, hidden, len), t(&logits), x, n(dw), true)?;
    }
    let total: f64 = dev.download(&row_loss)?.iter().map(|&l| l as f64).sum();
    Ok(LossOutput {
        loss: (total * scale as f64) as f32,
        tokens,
    })
}
