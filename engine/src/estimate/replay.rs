//! The allocations of one training step, replayed on a [`Timeline`] in the order the code makes
//! them. Each function mirrors one function of the engine and names it; a change to an
//! allocation there must be made here too (the `memory_model` tests fail until it is).

use super::timeline::{Buf, Phase, Timeline};
use super::Backend;
use crate::backend::cpu::attention::AttnShape;
use crate::memory::Category::{self, Activations, Io, Optimizer, Workspace};
use crate::model::Checkpointing;
use crate::optim::CHUNK;

/// The sizes a step's allocations depend on.
pub(super) struct Shape {
    /// Tokens in the batch.
    pub(super) rows: u64,
    /// Residual width.
    pub(super) hidden: u64,
    /// MLP width.
    pub(super) ffn: u64,
    /// Query heads × head width.
    pub(super) q_width: u64,
    /// Key/value heads × head width.
    pub(super) kv_width: u64,
    /// Vocabulary.
    pub(super) vocab: u64,
    /// Decoder blocks.
    pub(super) layers: usize,
    /// Bytes per activation and compute-weight element.
    pub(super) elem: u64,
    /// The attention call's shape.
    pub(super) attn: AttnShape,
    /// The backend whose allocations are replayed.
    pub(super) backend: Backend,
    /// Tokens per loss chunk (all of them for the standard loss).
    pub(super) chunk: u64,
    /// The category the logits are counted under.
    pub(super) logits_category: Category,
    /// What blocks keep for their backward pass.
    pub(super) checkpointing: Checkpointing,
    /// Whether residual dropout is on.
    pub(super) dropout: bool,
    /// Elements of every parameter, in `param_specs` order.
    pub(super) param_numels: Vec<u64>,
}

impl Shape {
    fn bf16(&self) -> bool {
        self.elem == 2
    }

    fn cuda(&self) -> bool {
        self.backend == Backend::Cuda
    }
}

/// An RMSNorm's saved buffers (`rinv`, then `out`).
struct Norm {
    rinv: Buf,
    out: Buf,
}

/// The buffers of `block::BlockActivations`.
struct Acts {
    q: Buf,
    k: Buf,
    v: Buf,
    att: Buf,
    lse: Buf,
    h_mid: Buf,
    gate: Buf,
    up: Buf,
    norm1: Option<Norm>,
    norm2: Option<Norm>,
    act: Option<Buf>,
}

/// Replays allocations of one step's shape on a timeline.
pub(super) struct Replay<'a> {
    t: &'a mut Timeline,
    s: &'a Shape,
}

/// Which element type a product's output has.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Out {
    /// The activation type.
    Elem,
    /// f32 (weight gradients).
    F32,
}

impl<'a> Replay<'a> {
    /// A replay of `s` onto `t`.
    pub(super) fn new(t: &'a mut Timeline, s: &'a Shape) -> Self {
        Replay { t, s }
    }

    fn alloc(&mut self, category: Category, bytes: u64) -> Buf {
        self.t.alloc(category, bytes)
    }

    /// A `[rows, width]` activation of the compute element type.
    fn act(&mut self, width: u64) -> Buf {
        let bytes = self.s.rows * width * self.s.elem;
        self.alloc(Activations, bytes)
    }

    fn free(&mut self, bufs: impl IntoIterator<Item = Buf>) {
        for b in bufs {
            self.t.free(b);
        }
    }

    /// `backend::cpu::matmul::matmul`: bf16 operands are widened to f32 workspace, and a bf16
    /// output is produced in an f32 workspace buffer; f32 needs nothing, and neither does
    /// cuBLAS (`backend::cuda::gemm::matmul`).
    fn matmul(&mut self, (m, n, k): (u64, u64, u64), out: Out) {
        if !self.s.bf16() || self.s.cuda() {
            return;
        }
        let a = self.alloc(Workspace, m * k * 4);
        let b = self.alloc(Workspace, k * n * 4);
        if out == Out::Elem {
            let c = self.alloc(Workspace, m * n * 4);
            self.t.free(c);
        }
        self.free([a, b]);
    }

    /// `block::linear` with a weight stored `[out, inp]`.
    fn linear(&mut self, out: u64, inp: u64) {
        self.matmul((self.s.rows, out, inp), Out::Elem);
    }

    /// `block::linear_backward` with a weight stored `[out, inp]`.
    fn linear_backward(&mut self, out: u64, inp: u64) {
        let rows = self.s.rows;
        self.matmul((rows, inp, out), Out::Elem);
        self.matmul((out, inp, rows), Out::F32);
    }

    /// `attention::for_each_unit_range`: one f32 scratch slice per thread used. The GPU's
    /// attention kernels work in shared memory.
    fn attention_scratch(&mut self, units: usize, per_thread: usize) {
        let Backend::Cpu { threads } = self.s.backend else {
            return;
        };
        let threads = threads.min(units).max(1) as u64;
        let scratch = self.alloc(Workspace, threads * per_thread as u64 * 4);
        self.t.free(scratch);
    }

    /// `backend::cuda::kernels::attention_backward`: the per-row `delta = rowsum(dout ∘ out)`.
    fn attention_delta(&mut self) {
        if self.s.cuda() {
            let a = self.s.attn;
            let delta = self.alloc(Workspace, (a.batch * a.heads * a.seq * 4) as u64);
            self.t.free(delta);
        }
    }

    /// `backend::cuda::kernels::embedding_backward`: the token positions grouped by id, and
    /// the group starts and ids, padded to the batch's length so that their size does not
    /// depend on the data.
    fn embedding_backward(&mut self) {
        if self.s.cuda() {
            let rows = self.s.rows;
            let positions = self.alloc(Io, rows * 4);
            let starts = self.alloc(Io, (rows + 1) * 4);
            let ids = self.alloc(Io, rows * 4);
            self.free([positions, starts, ids]);
        }
    }

    /// `backend::cuda::compute::clip_grad_norm`: one f64 partial sum per `optim::CHUNK`
    /// elements of every gradient.
    fn grad_norm_partials(&mut self) {
        if self.s.cuda() {
            let chunks: u64 = self
                .s
                .param_numels
                .iter()
                .map(|&n| n.div_ceil(CHUNK as u64))
                .sum();
            let partial = self.alloc(Workspace, chunks * 8);
            self.t.free(partial);
        }
    }

    /// `block::norm`.
    fn norm(&mut self) -> Norm {
        let rinv = self.alloc(Activations, self.s.rows * 4);
        let out = self.act(self.s.hidden);
        Norm { rinv, out }
    }

    /// `block::residual_linear` with an input of width `inp`: the output, and with dropout the
    /// projection's own buffer for the product's duration.
    fn residual_linear(&mut self, inp: u64) -> Buf {
        let h = self.s.hidden;
        let out = self.act(h);
        if self.s.dropout {
            let proj = self.act(h);
            self.linear(h, inp);
            self.t.free(proj);
        } else {
            self.linear(h, inp);
        }
        out
    }

    /// `block::residual_grad`: a masked copy of the gradient with dropout, nothing without.
    fn residual_grad(&mut self) -> Option<Buf> {
        self.s.dropout.then(|| self.act(self.s.hidden))
    }

    /// `block::swiglu`.
    fn swiglu(&mut self) -> Buf {
        self.act(self.s.ffn)
    }

    /// `block::activations`.
    fn block_activations(&mut self) -> Acts {
        let (h, ffn, qw, kvw) = (self.s.hidden, self.s.ffn, self.s.q_width, self.s.kv_width);
        let a = self.s.attn;
        let norm1 = self.norm();
        let q = self.act(qw);
        let k = self.act(kvw);
        let v = self.act(kvw);
        self.linear(qw, h);
        self.linear(kvw, h);
        self.linear(kvw, h);
        let att = self.act(qw);
        let lse = self.alloc(Activations, (a.batch * a.heads * a.seq * 4) as u64);
        self.attention_scratch(a.batch * a.heads, a.forward_scratch());
        let h_mid = self.residual_linear(qw);
        let norm2 = self.norm();
        let gate = self.act(ffn);
        let up = self.act(ffn);
        self.linear(ffn, h);
        self.linear(ffn, h);
        let act = self.swiglu();
        Acts {
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
        }
    }

    /// `block::forward`: the activations, then the output.
    fn block_forward(&mut self) -> (Buf, Acts) {
        let acts = self.block_activations();
        let out = self.residual_linear(self.s.ffn);
        (out, acts)
    }

    /// `Checkpointing::keep`.
    fn keep(&mut self, acts: Acts) -> Option<Acts> {
        match self.s.checkpointing {
            Checkpointing::None => Some(acts),
            Checkpointing::Full => {
                self.free_acts(acts);
                None
            }
            Checkpointing::Selective => {
                let Acts {
                    norm1, norm2, act, ..
                } = acts;
                for n in [norm1, norm2].into_iter().flatten() {
                    self.free([n.rinv, n.out]);
                }
                self.free(act);
                Some(Acts {
                    norm1: None,
                    norm2: None,
                    act: None,
                    ..acts
                })
            }
        }
    }

    fn free_acts(&mut self, acts: Acts) {
        let Acts {
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
        } = acts;
        self.free([q, k, v, att, lse, h_mid, gate, up]);
        for n in [norm1, norm2].into_iter().flatten() {
            self.free([n.rinv, n.out]);
        }
        self.free(act);
    }

    /// `block::backward`.
    fn block_backward(&mut self, acts: Acts) {
        let (h, ffn, qw, kvw) = (self.s.hidden, self.s.ffn, self.s.q_width, self.s.kv_width);
        let a = self.s.attn;
        let Acts {
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
        } = acts;
        let act = act.unwrap_or_else(|| self.swiglu());
        let dmlp = self.residual_grad();
        let dact = self.act(ffn);
        self.linear_backward(h, ffn);
        self.free([act]);
        self.free(dmlp);
        let dgate = self.act(ffn);
        let dup = self.act(ffn);
        self.free([dact, gate, up]);
        let norm2 = norm2.unwrap_or_else(|| self.norm());
        let dn2 = self.act(h);
        self.linear_backward(ffn, h);
        self.linear_backward(ffn, h);
        self.free([dgate, dup, norm2.out]);
        self.free([dn2, h_mid, norm2.rinv]);
        let dattn = self.residual_grad();
        let datt = self.act(qw);
        self.linear_backward(h, qw);
        self.free(dattn);
        let dq = self.act(qw);
        let dk = self.act(kvw);
        let dv = self.act(kvw);
        self.attention_scratch(a.batch * a.kv_heads, a.backward_scratch());
        self.attention_delta();
        self.free([datt, att, lse, q, k, v]);
        let norm1 = norm1.unwrap_or_else(|| self.norm());
        let dn1 = self.act(h);
        self.linear_backward(qw, h);
        self.linear_backward(kvw, h);
        self.linear_backward(kvw, h);
        self.free([dq, dk, dv, norm1.out]);
        self.free([dn1, norm1.rinv]);
    }

    /// `loss::linear_cross_entropy`; on CUDA the labels are uploaded (i64) after the row
    /// losses.
    fn loss(&mut self) {
        let (rows, h, vocab, chunk) = (self.s.rows, self.s.hidden, self.s.vocab, self.s.chunk);
        let row_loss = self.alloc(Workspace, rows * 4);
        let labels = self.s.cuda().then(|| self.alloc(Io, rows * 8));
        let logits = self.alloc(self.s.logits_category, chunk * vocab * self.s.elem);
        let mut start = 0;
        while start < rows {
            let len = chunk.min(rows - start);
            self.matmul((len, vocab, h), Out::Elem);
            self.matmul((len, h, vocab), Out::Elem);
            self.matmul((vocab, h, len), Out::F32);
            start += chunk;
        }
        self.free([logits]);
        self.free(labels);
        self.free([row_loss]);
    }

    /// `Model::forward_backward`; on CUDA (`CudaModel::forward_backward`) the token ids are
    /// uploaded (u32) first and held for the embedding's backward pass.
    fn pass(&mut self) {
        let h = self.s.hidden;
        self.t.enter(Phase::Forward);
        let ids = self.s.cuda().then(|| self.alloc(Io, self.s.rows * 4));
        let mut x = self.act(h);
        let mut inputs = Vec::with_capacity(self.s.layers);
        let mut saved = Vec::with_capacity(self.s.layers);
        for _ in 0..self.s.layers {
            let (out, acts) = self.block_forward();
            let kept = self.keep(acts);
            saved.push(kept);
            inputs.push(std::mem::replace(&mut x, out));
        }
        let final_norm = self.norm();
        self.t.enter(Phase::Loss);
        let dhn = self.act(h);
        self.loss();
        self.t.enter(Phase::Backward);
        self.free([final_norm.out]);
        let dh = self.act(h);
        self.free([dhn, x, final_norm.rinv]);
        while let Some(input) = inputs.pop() {
            let acts = match saved.pop().flatten() {
                Some(acts) => acts,
                None => self.block_activations(),
            };
            self.block_backward(acts);
            self.free([input]);
        }
        self.embedding_backward();
        self.free([dh]);
        self.free(ids);
    }

    /// `Trainer::step` after `reset_peak`: the pass, then the optimizer, which allocates both
    /// AdamW moments of every parameter at its first update (`AdamW::update`).
    pub(super) fn step(&mut self, moments_exist: bool) {
        self.pass();
        self.t.enter(Phase::Optimizer);
        self.grad_norm_partials();
        if !moments_exist {
            for _ in 0..2 {
                for i in 0..self.s.param_numels.len() {
                    let m = self.alloc(Optimizer, self.s.param_numels[i] * 4);
                    self.t.keep(m);
                }
            }
        }
    }
}
