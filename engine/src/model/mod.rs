//! The Llama-family decoder, written once over [`Device`]: embedding, blocks, final norm and
//! fused LM head + loss, with an explicit backward pass and activation checkpointing.

pub mod block;
pub mod config;
pub mod ctx;
pub mod loss;
pub mod moe;
pub mod params;
pub mod weights;

pub use crate::device::dropout::Dropout;
use crate::device::rope::RopeSpec;
use crate::device::router::LoadBalance;
use crate::device::{AttnShape, Device, StepPhase};
use crate::error::{EngineError, Result};
use crate::fault::{Fault, Faults};
use crate::memory::Category;
use crate::tensor::Elem;
use block::BlockActivations;
pub use config::{Family, LlamaConfig};
use ctx::{BlockCtx, BlockDims};
use loss::{head_gradient, linear_cross_entropy, mean_scale, LossKind, IGNORE_INDEX};
pub use params::{param_specs, Layout, ParamSpec, Params};
use serde::{Deserialize, Serialize};

/// Which activations a block keeps for its backward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Checkpointing {
    /// Keep every activation the backward pass reads.
    #[default]
    None,
    /// Keep only each block's input; recompute the block in the backward pass.
    Full,
    /// Keep each block's input and matrix-product outputs; recompute the norms' outputs and the
    /// SwiGLU activation in the backward pass.
    Selective,
}

impl Checkpointing {
    /// What a block keeps of its activations `acts` until its backward pass.
    fn keep<D: Device, E: Elem>(
        self,
        acts: BlockActivations<D, E>,
    ) -> Option<BlockActivations<D, E>> {
        match self {
            Checkpointing::None => Some(acts),
            Checkpointing::Full => None,
            Checkpointing::Selective => Some(acts.keep_products()),
        }
    }
}

/// A batch of token rows: `input_ids` and next-token `labels` (−100 ignored), `[batch, seq]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Rows.
    pub batch: usize,
    /// Tokens per row.
    pub seq: usize,
    /// Input token ids, row-major.
    pub input_ids: Vec<u32>,
    /// Target ids aligned with `input_ids`; −100 where ignored.
    pub labels: Vec<i64>,
    /// A packed batch's positions, aligned with `input_ids`: each token's place in its document
    /// (0 where one begins, else the previous token's plus 1). They drive the rotary embedding,
    /// and a token attends only to its own document's earlier tokens. `None`: each row is one
    /// sequence, token `i` at position `i`.
    pub positions: Option<Vec<u32>>,
}

impl Batch {
    /// sha256 of the token ids and labels (little-endian u32 and i64), naming the data a step saw.
    pub fn digest(&self) -> String {
        Self::digest_all(std::slice::from_ref(self))
    }

    /// sha256 of the shapes, token ids and labels of `batches` in order (the micro-batches of a
    /// step), and of a packed batch's positions after its labels: for one batch, its
    /// [`Batch::digest`].
    pub fn digest_all(batches: &[Batch]) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for b in batches {
            h.update((b.batch as u64).to_le_bytes());
            h.update((b.seq as u64).to_le_bytes());
            for id in &b.input_ids {
                h.update(id.to_le_bytes());
            }
            for label in &b.labels {
                h.update(label.to_le_bytes());
            }
            for position in b.positions.iter().flatten() {
                h.update(position.to_le_bytes());
            }
        }
        format!("{:x}", h.finalize())
    }
}

/// What one forward + backward pass produced, or the passes over the micro-batches of one
/// optimizer step together ([`Model::step_output`]).
#[derive(Clone, Debug, PartialEq)]
pub struct PassOutput {
    /// The loss trained on: the cross-entropy, plus `router_aux_loss_coef × aux` for a MoE model.
    pub loss: f32,
    /// Cross-entropy summed over counted labels and divided by the labels it is averaged over:
    /// the pass's own, or its step's ([`StepShare::tokens`]).
    pub ce: f32,
    /// The token losses summed in f64, in row order (micro-batch by micro-batch for a step).
    pub ce_sum: f64,
    /// The load-balancing loss of a MoE model (before its coefficient); for a step of several
    /// micro-batches, the mean of theirs.
    pub aux: Option<f64>,
    /// Each block's tokens per expert (empty for a dense block); empty for a dense model. For a
    /// step of several micro-batches, each block's list holds the micro-batches' counts one after
    /// the other.
    pub tokens_per_expert: Vec<Vec<u32>>,
    /// Each block's experts chosen for each token (`[rows, top_k]`, highest probability first;
    /// empty for a dense block), as [`PassOutput::tokens_per_expert`] for several micro-batches:
    /// where two routings with the same counts differ.
    pub experts_chosen: Vec<Vec<u32>>,
    /// Labels counted.
    pub tokens: usize,
    /// Blocks that recomputed activations (all of them, or the cheap part) during backward; for
    /// a step of several micro-batches, the most any of their passes recomputed.
    pub recomputed_blocks: usize,
}

/// A pass's place in an optimizer step that accumulates the gradients of several micro-batches.
/// Each micro-batch's token losses are divided by the labels counted over the whole step, and a
/// MoE model's load-balancing loss of each by the number of micro-batches, so the gradients the
/// passes add up are those of the step's loss: its summed token losses over its counted labels,
/// plus the coefficient times the mean of the micro-batches' load-balancing losses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShare {
    /// Labels counted over every micro-batch of the step.
    pub tokens: usize,
    /// Micro-batches in the step.
    pub micro_batches: usize,
}

/// How a training pass runs.
#[derive(Clone, Copy, Debug)]
pub struct PassConfig<'a> {
    /// Which activations blocks keep for their backward pass.
    pub checkpointing: Checkpointing,
    /// How logits are held.
    pub loss: LossKind,
    /// Residual dropout; `None` applies none.
    pub dropout: Option<Dropout>,
    /// Deliberate bugs: [`Fault::CheckpointingSkippedNested`], [`Fault::RecomputeInputsKept`]
    /// and [`Fault::MoeDispatchKept`] act here.
    pub faults: &'a Faults,
    /// The pass's place in an accumulating step; `None`: the pass is its own step.
    pub share: Option<StepShare>,
}

impl PassConfig<'_> {
    /// The checkpointing policy block `layer` applies: the pass's, except that
    /// [`Fault::CheckpointingSkippedNested`] keeps every activation of the blocks after the first.
    pub fn policy(&self, layer: usize) -> Checkpointing {
        if layer > 0 && self.faults.has(Fault::CheckpointingSkippedNested) {
            Checkpointing::None
        } else {
            self.checkpointing
        }
    }
}

/// Parameters a pass writes the gradients of together, in the backward pass's order: the LM
/// head (with the loss), the final norm, each decoder block from the last, the embedding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    /// The LM head (the embedding itself when tied).
    Head,
    /// The final RMSNorm.
    FinalNorm,
    /// Decoder block `l`.
    Layer(usize),
    /// The token embedding.
    Embed,
}

impl Group {
    /// Every group a backward pass over `layers` blocks writes, in the order it writes them.
    pub fn backward_order(layers: usize) -> Vec<Group> {
        [Group::Head, Group::FinalNorm]
            .into_iter()
            .chain((0..layers).rev().map(Group::Layer))
            .chain([Group::Embed])
            .collect()
    }
}

/// Where a pass's weights and gradients are while it runs. On one device every tensor is
/// always whole in place and nothing happens (`()`). A data-parallel rank that shards gradients
/// makes a group's gradients whole (the sum of the micro-batches before) just before the pass
/// first adds to them, and hands them on just after its last addition; one that shards the
/// weights too makes a group's weights whole just before the pass reads them and frees them
/// just after.
pub trait PassHooks<D: Device, E: Elem> {
    /// The pass is about to read `group`'s weights in `w`.
    fn weights_in(&mut self, w: &mut Params<D::Tensor<E>>, group: Group) -> Result<()>;
    /// The pass is done reading `group`'s weights for now.
    fn weights_out(&mut self, w: &mut Params<D::Tensor<E>>, group: Group) -> Result<()>;
    /// The pass is about to add to `group`'s gradients in `grads`.
    fn grads_in(&mut self, grads: &mut Params<D::Tensor<f32>>, group: Group) -> Result<()>;
    /// The pass has added its share to `group`'s gradients in `grads`.
    fn grads_out(&mut self, grads: &mut Params<D::Tensor<f32>>, group: Group) -> Result<()>;
    /// Whether the pass adds a tied head's gradient at the end of the backward pass, just
    /// before the embedding's, instead of with the loss (from logits computed again: the same
    /// additions in the same order, so the same bits). The tied gradient is then written in one
    /// stretch, as a rank that receives each gradient from the rank before, in the order that
    /// rank finishes them, needs.
    fn tied_head_last(&self) -> bool {
        false
    }
}

/// Every tensor always whole in place: nothing to do.
impl<D: Device, E: Elem> PassHooks<D, E> for () {
    fn weights_in(&mut self, _: &mut Params<D::Tensor<E>>, _: Group) -> Result<()> {
        Ok(())
    }
    fn weights_out(&mut self, _: &mut Params<D::Tensor<E>>, _: Group) -> Result<()> {
        Ok(())
    }
    fn grads_in(&mut self, _: &mut Params<D::Tensor<f32>>, _: Group) -> Result<()> {
        Ok(())
    }
    fn grads_out(&mut self, _: &mut Params<D::Tensor<f32>>, _: Group) -> Result<()> {
        Ok(())
    }
}

/// The model's fixed state besides parameters: its shape, where its parameters are, and its
/// rotary tables.
pub struct Model<D: Device> {
    cfg: LlamaConfig,
    layout: Layout,
    rope: D::Rope,
}

impl<D: Device> Model<D> {
    /// Builds the model's buffers on `dev` (the rotary tables count as params).
    pub fn new(dev: &D, cfg: LlamaConfig) -> Result<Self> {
        cfg.validate().map_err(|e| e.under("model"))?;
        let rope = dev.rope_tables(RopeSpec {
            head_dim: cfg.head_dim(),
            theta: cfg.rope_theta,
            positions: cfg.max_position_embeddings,
        })?;
        Ok(Model {
            layout: Layout::of(&cfg),
            cfg,
            rope,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Where its parameters are.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    fn dims(&self, batch: &Batch) -> BlockDims {
        let c = &self.cfg;
        BlockDims {
            rows: batch.batch * batch.seq,
            hidden: c.hidden_size,
            ffn: c.intermediate_size,
            eps: c.rms_norm_eps as f32,
            route: c.moe.as_ref().map(|m| m.route_spec(0)),
            attn: AttnShape {
                batch: batch.batch,
                seq: batch.seq,
                heads: c.num_attention_heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim(),
            },
        }
    }

    /// Checks a batch fits the model: rows as long as its shape says and no longer than the
    /// rotary tables, ids below the vocabulary, labels ids or −100, a packed batch's positions
    /// starting at 0 in each row and counting up by 1 within a document.
    pub fn check_batch(&self, batch: &Batch) -> Result<()> {
        let v = self.cfg.vocab_size;
        let tokens = batch.batch * batch.seq;
        if tokens == 0 || batch.input_ids.len() != tokens || batch.labels.len() != tokens {
            return Err(EngineError::Config(format!(
                "a batch of {} × {} needs that many ids and labels, has {} and {}",
                batch.batch,
                batch.seq,
                batch.input_ids.len(),
                batch.labels.len()
            )));
        }
        if batch.seq > self.cfg.max_position_embeddings {
            return Err(EngineError::Config(format!(
                "sequence length {} exceeds max_position_embeddings {}",
                batch.seq, self.cfg.max_position_embeddings
            )));
        }
        if let Some(id) = batch.input_ids.iter().find(|&&i| i as usize >= v) {
            return Err(EngineError::Config(format!(
                "input id {id} is outside the vocabulary of {v}"
            )));
        }
        if let Some(l) = batch
            .labels
            .iter()
            .find(|&&l| l != IGNORE_INDEX && !(0..v as i64).contains(&l))
        {
            return Err(EngineError::Config(format!(
                "label {l} is neither -100 nor a token id below {v}"
            )));
        }
        if let Some(positions) = &batch.positions {
            if positions.len() != tokens {
                return Err(EngineError::Config(format!(
                    "a batch of {} × {} needs that many positions, has {}",
                    batch.batch,
                    batch.seq,
                    positions.len()
                )));
            }
            let at = |i: usize| (i / batch.seq, i % batch.seq);
            let wrong = positions.iter().enumerate().find(|&(i, &p)| {
                p != 0 && (i % batch.seq == 0 || p != positions[i - 1].wrapping_add(1))
            });
            if let Some((i, p)) = wrong {
                let (row, token) = at(i);
                return Err(EngineError::Config(format!(
                    "position {p} of token {token} of row {row} neither begins a document (0) nor follows the previous token's"
                )));
            }
        }
        Ok(())
    }

    /// The start of a pass over `batch` on `dev`: the batch and its attention shape checked,
    /// the forward phase entered, the blocks' context (the first block's, with `dropout`; its
    /// `positions` for the caller to point at the second value), and a packed batch's positions
    /// on the device.
    fn pass_start<'a>(
        &'a self,
        dev: &'a D,
        batch: &Batch,
        dropout: Option<Dropout>,
    ) -> Result<(BlockCtx<'a, D>, Option<D::Ids>)> {
        self.check_batch(batch)?;
        let dims = self.dims(batch);
        dev.check_attention(dims.attn)?;
        dev.enter(StepPhase::Forward);
        let positions = batch.positions.as_deref().map(|p| dev.ids(p)).transpose()?;
        let ctx = BlockCtx {
            dev,
            dims,
            rope: &self.rope,
            positions: None,
            layer: 0,
            dropout,
            dprob: &[],
        };
        Ok((ctx, positions))
    }

    /// One forward and backward pass without dropout: returns the loss and adds every
    /// parameter's gradient to `grads`. Activations are allocated and freed inside; nothing
    /// outlives the call.
    pub fn forward_backward<E: Elem>(
        &self,
        dev: &D,
        w: &mut Params<D::Tensor<E>>,
        grads: &mut Params<D::Tensor<f32>>,
        batch: &Batch,
        checkpointing: Checkpointing,
        loss: LossKind,
    ) -> Result<PassOutput> {
        let faults = Faults::default();
        let pass = PassConfig {
            checkpointing,
            loss,
            dropout: None,
            faults: &faults,
            share: None,
        };
        let (out, kept) = self.forward_backward_with(dev, w, grads, batch, &pass)?;
        debug_assert!(kept.is_empty(), "no fault keeps inputs here");
        Ok(out)
    }

    /// One forward and backward pass as `pass` describes it: returns the loss and adds every
    /// parameter's gradient to `grads`. Activations are allocated and freed inside; the second
    /// value holds what outlives the call, which is nothing unless
    /// [`Fault::RecomputeInputsKept`] keeps the inputs of the recomputed blocks.
    pub fn forward_backward_with<E: Elem>(
        &self,
        dev: &D,
        w: &mut Params<D::Tensor<E>>,
        grads: &mut Params<D::Tensor<f32>>,
        batch: &Batch,
        pass: &PassConfig<'_>,
    ) -> Result<(PassOutput, Vec<D::Tensor<E>>)> {
        self.forward_backward_hooked(dev, w, grads, batch, pass, &mut ())
    }

    /// [`Model::forward_backward_with`], telling `hooks` before and after each [`Group`]'s
    /// weights are read and its gradients added to.
    pub fn forward_backward_hooked<E: Elem>(
        &self,
        dev: &D,
        w: &mut Params<D::Tensor<E>>,
        grads: &mut Params<D::Tensor<f32>>,
        batch: &Batch,
        pass: &PassConfig<'_>,
        hooks: &mut dyn PassHooks<D, E>,
    ) -> Result<(PassOutput, Vec<D::Tensor<E>>)> {
        let (ctx, positions) = self.pass_start(dev, batch, pass.dropout)?;
        let ctx = BlockCtx {
            positions: positions.as_ref(),
            ..ctx
        };
        let d = ctx.dims;
        let (rows, h, p) = (d.rows, d.hidden, &self.layout);
        let ids = dev.ids(&batch.input_ids)?;
        let mut x = dev.uninit::<E>(&[rows, h], Category::Activations)?;
        hooks.weights_in(w, Group::Embed)?;
        dev.embedding_forward(w.get(p.embed), &ids, &mut x)?;
        hooks.weights_out(w, Group::Embed)?;

        let mut inputs: Vec<D::Tensor<E>> = Vec::with_capacity(p.layers.len());
        let mut saved = Vec::with_capacity(p.layers.len());
        let mut balance = LoadBalance::default();
        let mut tokens_per_expert = Vec::new();
        let mut experts_chosen = Vec::new();
        for (l, layer) in p.layers.iter().enumerate() {
            hooks.weights_in(w, Group::Layer(l))?;
            let (out, acts) = block::forward(BlockCtx { layer: l, ..ctx }, (w, layer), &x)?;
            hooks.weights_out(w, Group::Layer(l))?;
            if let Some(moe) = &self.cfg.moe {
                let routing = acts.routing();
                tokens_per_expert.push(routing.map_or_else(Vec::new, |r| r.tokens_per_expert()));
                experts_chosen.push(routing.map_or_else(Vec::new, |r| r.chosen().to_vec()));
                if let Some(r) = routing {
                    balance.add(r);
                }
                debug_assert_eq!(routing.is_some(), moe.is_moe_layer(l));
            }
            saved.push(pass.policy(l).keep(acts));
            inputs.push(std::mem::replace(&mut x, out));
        }
        hooks.weights_in(w, Group::FinalNorm)?;
        let final_norm = block::norm(ctx, &x, w.get(p.final_norm))?;
        hooks.weights_out(w, Group::FinalNorm)?;

        dev.enter(StepPhase::Loss);
        let mut dhn = dev.zeros::<E>(&[rows, h], Category::Activations)?;
        let head_last = p.head == p.embed && hooks.tied_head_last();
        let mean_over = pass.share.map(|s| s.tokens);
        hooks.weights_in(w, Group::Head)?;
        if !head_last {
            hooks.grads_in(grads, Group::Head)?;
        }
        let loss = linear_cross_entropy(
            dev,
            &final_norm.out,
            w.get(p.head),
            &batch.labels,
            pass.loss,
            mean_over,
            &mut dhn,
            (!head_last).then(|| grads.get_mut(p.head)),
        )?;
        if !head_last {
            hooks.grads_out(grads, Group::Head)?;
        }
        hooks.weights_out(w, Group::Head)?;

        let coef = self
            .cfg
            .moe
            .as_ref()
            .map_or(0.0, |m| m.router_aux_loss_coef);
        let aux = (!balance.is_empty()).then(|| balance.loss());
        let micro_batches = pass.share.map_or(1, |s| s.micro_batches);
        let dprob = balance.prob_grad(coef / micro_batches as f64);

        dev.enter(StepPhase::Backward);
        let ctx = BlockCtx {
            dprob: &dprob,
            ..ctx
        };
        let block::Norm { rinv, out: hn } = final_norm;
        let hn = head_last.then_some(hn);
        let mut dh = dev.zeros::<E>(&[rows, h], Category::Activations)?;
        hooks.weights_in(w, Group::FinalNorm)?;
        hooks.grads_in(grads, Group::FinalNorm)?;
        let final_norm = (w.get(p.final_norm), grads.get_mut(p.final_norm));
        dev.rmsnorm_backward(&dhn, &x, final_norm.0, &rinv, &mut dh, final_norm.1)?;
        hooks.grads_out(grads, Group::FinalNorm)?;
        hooks.weights_out(w, Group::FinalNorm)?;
        drop((dhn, x, rinv));

        let keep_inputs = pass.faults.has(Fault::RecomputeInputsKept);
        let keep_dispatch = pass.faults.has(Fault::MoeDispatchKept);
        let mut kept = Vec::new();
        let mut recomputed_blocks = 0;
        for (l, layer) in p.layers.iter().enumerate().rev() {
            let ctx = BlockCtx { layer: l, ..ctx };
            let input = inputs.pop().expect("one input per block");
            hooks.weights_in(w, Group::Layer(l))?;
            let (acts, recomputes) = match saved.pop().flatten() {
                Some(acts) => {
                    let partial = acts.is_partial();
                    (acts, partial)
                }
                None => (block::activations(ctx, (w, layer), &input)?, true),
            };
            recomputed_blocks += usize::from(recomputes);
            let dispatch = recomputes && keep_dispatch;
            hooks.grads_in(grads, Group::Layer(l))?;
            let leaked = block::backward(ctx, (w, layer), grads, &input, acts, &mut dh, dispatch)?;
            hooks.grads_out(grads, Group::Layer(l))?;
            hooks.weights_out(w, Group::Layer(l))?;
            kept.extend(leaked);
            if recomputes && keep_inputs {
                kept.push(input);
            }
        }
        if let Some(hn) = hn {
            hooks.weights_in(w, Group::Head)?;
            hooks.grads_in(grads, Group::Head)?;
            let (head, dw) = (w.get(p.head), grads.get_mut(p.head));
            head_gradient(dev, (&hn, head), &batch.labels, pass.loss, mean_over, dw)?;
            hooks.grads_out(grads, Group::Head)?;
            hooks.weights_out(w, Group::Head)?;
        }
        hooks.grads_in(grads, Group::Embed)?;
        dev.embedding_backward(&dh, &ids, grads.get_mut(p.embed))?;
        hooks.grads_out(grads, Group::Embed)?;
        let out = PassOutput {
            loss: (loss.loss as f64 + coef * aux.unwrap_or(0.0)) as f32,
            ce: loss.loss,
            ce_sum: loss.sum,
            aux,
            tokens_per_expert,
            experts_chosen,
            tokens: loss.tokens,
            recomputed_blocks,
        };
        Ok((out, kept))
    }

    /// One forward pass without gradients or dropout over `batch`, telling `hooks` before and
    /// after each [`Group`]'s weights are read: the batch's cross-entropy (its token losses
    /// summed in f64 and its counted labels; no load-balancing loss). Each block's activations
    /// are freed as soon as the next block has its input ([`Fault::EvaluationKeepsActivations`]
    /// keeps them until the loss); nothing outlives the call.
    pub fn evaluate_hooked<E: Elem>(
        &self,
        dev: &D,
        w: &mut Params<D::Tensor<E>>,
        batch: &Batch,
        (kind, faults): (LossKind, &Faults),
        hooks: &mut dyn PassHooks<D, E>,
    ) -> Result<PassOutput> {
        let (ctx, positions) = self.pass_start(dev, batch, None)?;
        let ctx = BlockCtx {
            positions: positions.as_ref(),
            ..ctx
        };
        let d = ctx.dims;
        let p = &self.layout;
        let ids = dev.ids(&batch.input_ids)?;
        let mut x = dev.uninit::<E>(&[d.rows, d.hidden], Category::Activations)?;
        hooks.weights_in(w, Group::Embed)?;
        dev.embedding_forward(w.get(p.embed), &ids, &mut x)?;
        hooks.weights_out(w, Group::Embed)?;
        drop(ids);
        let mut kept = Vec::new();
        for (l, layer) in p.layers.iter().enumerate() {
            hooks.weights_in(w, Group::Layer(l))?;
            let (out, acts) = block::forward(BlockCtx { layer: l, ..ctx }, (w, layer), &x)?;
            hooks.weights_out(w, Group::Layer(l))?;
            if faults.has(Fault::EvaluationKeepsActivations) {
                kept.push((acts, std::mem::replace(&mut x, out)));
            } else {
                drop(acts);
                x = out;
            }
        }
        hooks.weights_in(w, Group::FinalNorm)?;
        let final_norm = block::norm(ctx, &x, w.get(p.final_norm))?;
        hooks.weights_out(w, Group::FinalNorm)?;
        drop(x);
        dev.enter(StepPhase::Loss);
        hooks.weights_in(w, Group::Head)?;
        let loss = loss::cross_entropy(dev, &final_norm.out, w.get(p.head), &batch.labels, kind)?;
        hooks.weights_out(w, Group::Head)?;
        drop(kept);
        Ok(PassOutput {
            loss: loss.loss,
            ce: loss.loss,
            ce_sum: loss.sum,
            aux: None,
            tokens_per_expert: Vec::new(),
            experts_chosen: Vec::new(),
            tokens: loss.tokens,
            recomputed_blocks: 0,
        })
    }

    /// The output of an optimizer step from its micro-batches' passes, in order: the summed
    /// token losses over all counted labels, the mean load-balancing loss, the tokens per expert
    /// of each block one micro-batch after the other. For one pass, that pass's output.
    pub fn step_output(&self, passes: Vec<PassOutput>) -> PassOutput {
        let coef = self
            .cfg
            .moe
            .as_ref()
            .map_or(0.0, |m| m.router_aux_loss_coef);
        let tokens = passes.iter().map(|p| p.tokens).sum();
        let ce_sum: f64 = passes.iter().map(|p| p.ce_sum).sum();
        let ce = (ce_sum * mean_scale(tokens) as f64) as f32;
        let auxes: Vec<f64> = passes.iter().filter_map(|p| p.aux).collect();
        let aux = (!auxes.is_empty()).then(|| auxes.iter().sum::<f64>() / auxes.len() as f64);
        let concat = |of: fn(&PassOutput) -> &Vec<Vec<u32>>| {
            let mut blocks: Vec<Vec<u32>> = Vec::new();
            for p in &passes {
                blocks.resize(of(p).len(), Vec::new());
                for (all, values) in blocks.iter_mut().zip(of(p)) {
                    all.extend(values);
                }
            }
            blocks
        };
        let tokens_per_expert = concat(|p| &p.tokens_per_expert);
        let experts_chosen = concat(|p| &p.experts_chosen);
        PassOutput {
            loss: (ce as f64 + coef * aux.unwrap_or(0.0)) as f32,
            ce,
            ce_sum,
            aux,
            tokens_per_expert,
            experts_chosen,
            tokens,
            recomputed_blocks: passes
                .iter()
                .map(|p| p.recomputed_blocks)
                .max()
                .unwrap_or(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuDevice;

    fn packed(positions: Vec<u32>) -> Batch {
        Batch {
            batch: 2,
            seq: 3,
            input_ids: vec![1; 6],
            labels: vec![IGNORE_INDEX; 6],
            positions: Some(positions),
        }
    }

    #[test]
    fn a_packed_batch_s_positions_must_restart_at_each_row_and_count_up_in_a_document() {
        let dev = CpuDevice::new(1, u64::MAX).unwrap();
        let model = Model::new(&dev, LlamaConfig::new(8, 8, 8, 1, 2, 1)).unwrap();
        model.check_batch(&packed(vec![0, 1, 0, 0, 0, 1])).unwrap();
        for (positions, wrong) in [
            (vec![0, 1, 2, 1, 2, 3], "position 1 of token 0 of row 1"),
            (vec![0, 2, 0, 0, 1, 2], "position 2 of token 1 of row 0"),
            (vec![0, 1, 0, 0, 1], "needs that many positions, has 5"),
        ] {
            let err = model.check_batch(&packed(positions)).unwrap_err();
            assert!(err.to_string().contains(wrong), "{err}");
        }
    }
}
