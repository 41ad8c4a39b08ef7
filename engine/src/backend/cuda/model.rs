//! The decoder's forward and backward pass on the GPU, step for step `crate::model::Model`'s:
//! embedding, blocks (with the same activation checkpointing), final norm, fused LM head + loss,
//! and back.

use super::block::{self, BlockActivations, BlockCtx};
use super::device::CudaDevice;
use super::kernels::{self, RopeTables};
use super::loss::linear_cross_entropy;
use super::tensor::CudaTensor;
use crate::backend::cpu::attention::AttnShape;
use crate::backend::cpu::kernels::RopeTable;
use crate::error::Result;
use crate::fault::Fault;
use crate::memory::Category;
use crate::model::block::BlockDims;
use crate::model::{Batch, Checkpointing, LlamaConfig, Model, Params, PassConfig, PassOutput};
use crate::tensor::Elem;

/// The model's fixed state besides parameters: its shape (with the host model that checks
/// batches) and the rotary tables on the device.
pub(crate) struct CudaModel {
    host: Model,
    rope: RopeTables,
}

impl CudaModel {
    /// Validates `cfg` and uploads its rotary tables (counted as params).
    pub(crate) fn new(dev: &CudaDevice, cfg: LlamaConfig) -> Result<Self> {
        let table = RopeTable::new(cfg.head_dim(), cfg.rope_theta, cfg.max_position_embeddings);
        let host = Model::new(dev.staging(), cfg)?;
        Ok(CudaModel {
            host,
            rope: RopeTables::upload(dev, &table)?,
        })
    }

    fn dims(&self, batch: &Batch) -> BlockDims {
        let c = self.host.config();
        BlockDims {
            rows: batch.batch * batch.seq,
            hidden: c.hidden_size,
            ffn: c.intermediate_size,
            eps: c.rms_norm_eps as f32,
            attn: AttnShape {
                batch: batch.batch,
                seq: batch.seq,
                heads: c.num_attention_heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim(),
            },
        }
    }

    /// One forward and backward pass: the loss, with every parameter's gradient added to
    /// `grads`. Activations are allocated and freed inside; the second value holds what
    /// outlives the call, which is nothing unless [`Fault::RecomputeInputsKept`] keeps the
    /// inputs of the recomputed blocks. [`Fault::CheckpointingSkippedNested`] keeps every
    /// activation of the blocks after the first, as the CPU's model does. Dropout draws the
    /// CPU's masks.
    pub(crate) fn forward_backward<E: Elem>(
        &self,
        dev: &CudaDevice,
        w: &Params<CudaTensor<E>>,
        grads: &mut Params<CudaTensor<f32>>,
        batch: &Batch,
        pass: &PassConfig<'_>,
    ) -> Result<(PassOutput, Vec<CudaTensor<E>>)> {
        self.host.check_batch(batch)?;
        let d = self.dims(batch);
        kernels::check_attention(d.attn)?;
        let ctx = BlockCtx {
            dev,
            dims: d,
            rope: &self.rope,
            layer: 0,
            dropout: pass.dropout,
        };
        let (rows, h) = (d.rows, d.hidden);
        let ids = dev.upload_slice(&batch.input_ids, Category::Io)?;
        let mut x = dev.zeros::<E>(&[rows, h], Category::Activations)?;
        kernels::embedding_forward(dev, &w.embed, &ids, &mut x)?;

        let mut inputs: Vec<CudaTensor<E>> = Vec::with_capacity(w.layers.len());
        let mut saved: Vec<Option<BlockActivations<E>>> = Vec::with_capacity(w.layers.len());
        for (l, layer) in w.layers.iter().enumerate() {
            let (out, acts) = block::forward(BlockCtx { layer: l, ..ctx }, layer, &x)?;
            saved.push(match pass.policy(l) {
                Checkpointing::None => Some(acts),
                Checkpointing::Full => None,
                Checkpointing::Selective => Some(acts.keep_products()),
            });
            inputs.push(std::mem::replace(&mut x, out));
        }

        let mut rinv = dev.zeros::<f32>(&[rows], Category::Activations)?;
        let mut hn = dev.zeros::<E>(&[rows, h], Category::Activations)?;
        kernels::rmsnorm_forward(dev, &x, &w.final_norm, d.eps, &mut hn, &mut rinv)?;
        let mut dhn = dev.zeros::<E>(&[rows, h], Category::Activations)?;
        let head_grad = grads.lm_head.as_mut().unwrap_or(&mut grads.embed);
        let loss = linear_cross_entropy(
            dev,
            &hn,
            w.head(),
            &batch.labels,
            pass.loss,
            &mut dhn,
            head_grad,
        )?;
        drop(hn);
        let mut dh = dev.zeros::<E>(&[rows, h], Category::Activations)?;
        kernels::rmsnorm_backward(
            dev,
            &dhn,
            &x,
            &w.final_norm,
            &rinv,
            &mut dh,
            &mut grads.final_norm,
        )?;
        drop((dhn, x, rinv));

        let keep_inputs = pass.faults.has(Fault::RecomputeInputsKept);
        let mut kept = Vec::new();
        let mut recomputed_blocks = 0;
        for (l, layer) in w.layers.iter().enumerate().rev() {
            let ctx = BlockCtx { layer: l, ..ctx };
            let input = inputs.pop().expect("one input per block");
            let (acts, recomputes) = match saved.pop().flatten() {
                Some(acts) => {
                    let partial = acts.is_partial();
                    (acts, partial)
                }
                None => (block::activations(ctx, layer, &input)?, true),
            };
            recomputed_blocks += usize::from(recomputes);
            block::backward(ctx, layer, &mut grads.layers[l], &input, acts, &mut dh)?;
            if recomputes && keep_inputs {
                kept.push(input);
            }
        }
        kernels::embedding_backward(dev, &dh, &batch.input_ids, &mut grads.embed)?;
        let out = PassOutput {
            loss: loss.loss,
            tokens: loss.tokens,
            recomputed_blocks,
        };
        Ok((out, kept))
    }
}
