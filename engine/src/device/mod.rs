//! The device contract: tensor storage and the operations the model is written against. The
//! model, the loss, the optimizer and the training state are written once over [`Device`]; the
//! CPU, CUDA and counting backends implement it (`crate::backend`).
//!
//! Every tensor a device hands out is leased from its [`MemoryTracker`], and each operation
//! allocates its own scratch there too, so the counting device (which holds sizes only) makes
//! the same allocations as the backend it imitates.
//!
//! Beside the trait, what its operations take besides tensors, each computed on the host the
//! same way for every backend: [`dropout`] (the masks), [`rope`] (the rotary tables) and
//! [`router`] (a mixture of experts' routing).

pub mod dropout;
pub mod rope;
pub mod router;

use crate::environment::ExecutionEnv;
use crate::error::Result;
use crate::memory::{Category, MemoryTracker};
use crate::tensor::{Elem, Tensor};
use dropout::DropoutMask;
use rope::RopeSpec;
use router::{RouteSpec, Routing};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// Which kind of device a run uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum DeviceKind {
    /// The CPU backend.
    Cpu,
    /// The first CUDA device.
    Cuda,
}

impl DeviceKind {
    /// Every kind, in trial order.
    pub const ALL: [DeviceKind; 2] = [DeviceKind::Cpu, DeviceKind::Cuda];

    /// The lower-case name used in trial names, suites and reports.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What every device's tensor type tells about itself.
pub trait DeviceTensor: Send + 'static {
    /// The dimensions, outermost first.
    fn shape(&self) -> &[usize];
    /// Bytes the tensor holds.
    fn bytes(&self) -> u64;
    /// The category its bytes are counted under.
    fn category(&self) -> Category;
    /// Number of elements.
    fn numel(&self) -> usize {
        self.shape().iter().product()
    }
}

/// A matrix operand of a product: a tensor read from an element offset, as stored (row-major)
/// or transposed.
#[derive(Debug)]
pub struct Operand<'a, T> {
    /// The tensor holding the matrix.
    pub tensor: &'a T,
    /// The element the matrix starts at.
    pub offset: usize,
    /// Whether the product uses the stored matrix transposed.
    pub transposed: bool,
}

impl<T> Clone for Operand<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Operand<'_, T> {}

impl<'a, T> Operand<'a, T> {
    /// The same matrix starting `offset` elements further on (a block of rows).
    pub fn at(self, offset: usize) -> Self {
        Operand {
            offset: self.offset + offset,
            ..self
        }
    }
}

/// `tensor` used as stored.
pub fn n<T>(tensor: &T) -> Operand<'_, T> {
    Operand {
        tensor,
        offset: 0,
        transposed: false,
    }
}

/// `tensor` used transposed.
pub fn t<T>(tensor: &T) -> Operand<'_, T> {
    Operand {
        transposed: true,
        ..n(tensor)
    }
}

/// The output of a product: a tensor written from an element offset.
#[derive(Debug)]
pub struct Out<'a, T> {
    /// The tensor written.
    pub tensor: &'a mut T,
    /// The element the output starts at.
    pub offset: usize,
}

/// The whole of `tensor` as a product's output.
pub fn out<T>(tensor: &mut T) -> Out<'_, T> {
    Out { tensor, offset: 0 }
}

/// The shape of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Sequences in the batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl AttnShape {
    /// Query heads × head width.
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Key/value heads × head width.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
    /// The softmax scale `1/√d`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// The parts of a training step a device may report separately (the counting device records
/// each one's peak; the others ignore them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepPhase {
    /// Embedding, blocks and the final norm.
    Forward,
    /// The fused LM head and cross-entropy, which also yields the head's gradients.
    Loss,
    /// The final norm's and the blocks' backward passes, recomputation included.
    Backward,
    /// Clipping, AdamW (allocating its moments at the first step) and the bf16 weight refresh.
    Optimizer,
}

/// The scalars of one AdamW update, derived once per step in f64 and rounded to f32 as
/// `torch.optim.AdamW`'s arithmetic uses them (laid out as the CUDA kernels' `AdamWArgs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWArgs {
    /// `1 − lr · weight_decay`.
    pub decay: f32,
    /// `1 − β₁`.
    pub one_minus_b1: f32,
    /// `β₂`.
    pub b2: f32,
    /// `1 − β₂`.
    pub one_minus_b2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// `lr / (1 − β₁ᵗ)`.
    pub step_size: f32,
    /// `√(1 − β₂ᵗ)`.
    pub bc2_sqrt: f32,
}

/// A tensor's element type as safetensors names it.
pub fn safetensors_dtype<E: Elem>() -> safetensors::Dtype {
    match E::DTYPE {
        crate::tensor::DType::F32 => safetensors::Dtype::F32,
        crate::tensor::DType::Bf16 => safetensors::Dtype::BF16,
    }
}

/// Where tensors live and how the model's operations run. Element-wise and row-wise operations
/// are generic over the stored element type and compute in f32; weight gradients are f32.
/// Every operation is deterministic: the same inputs give the same bits.
pub trait Device: Clone + Send + Sync + 'static {
    /// A tensor of elements `E` on this device.
    type Tensor<E: Elem>: DeviceTensor;
    /// The rotary tables as the rotation reads them.
    type Rope: Send + Sync;
    /// A batch's token ids as the embedding reads them, and a packed batch's positions as the
    /// rotary embedding and attention read them.
    type Ids;
    /// A batch's labels as the cross-entropy reads them.
    type Labels;

    /// The tracker counting this device's bytes.
    fn tracker(&self) -> &MemoryTracker;

    /// The tracker of the host tensors that files are read into and initial weights drawn in
    /// before they reach the device ([`Device::upload`]): the device's own on the CPU, a
    /// host tracker of the GPU's on CUDA.
    fn host(&self) -> MemoryTracker;

    /// What this device's results depend on beyond their inputs: the facts a resume compares
    /// with the checkpoint's to know whether it continues bit for bit.
    fn execution_env(&self) -> ExecutionEnv;

    /// Marks the start of a part of the step.
    fn enter(&self, _phase: StepPhase) {}

    /// Runs `f`, a whole training step, where this device's kernels run: on the CPU, on one of
    /// its pool's threads, so that each kernel's parallel loop starts there instead of waking
    /// the pool and putting the caller to sleep; elsewhere, on the calling thread.
    fn run_step<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// A zero-filled tensor of `shape`, counted under `category`.
    fn zeros<E: Elem>(&self, shape: &[usize], category: Category) -> Result<Self::Tensor<E>>;

    /// [`Device::zeros`] for a tensor its rank keeps for the run (weights, gradients, optimizer
    /// state), which a device may place where long-lived tensors cost less to set up: the CPU
    /// carves mid-sized ones from huge-page chunks that the kernel zeroes on first touch,
    /// instead of clearing recycled heap memory.
    fn zeros_kept<E: Elem>(&self, shape: &[usize], category: Category) -> Result<Self::Tensor<E>> {
        self.zeros(shape, category)
    }

    /// A tensor of `shape`, counted under `category`, that its user writes in full before it
    /// reads any of it: a kernel's output, not its accumulator. Its contents are whatever the
    /// device leaves there (the GPU writes nothing; the CPU leaves zeros, or what a freed tensor
    /// left in the memory it reuses, and writes NaN where debug assertions are on, as in tests,
    /// so a read before the write shows in every result).
    fn uninit<E: Elem>(&self, shape: &[usize], category: Category) -> Result<Self::Tensor<E>> {
        self.zeros(shape, category)
    }

    /// The device's copy of a staged tensor (the tensor itself on the CPU), counted under the
    /// staged tensor's category.
    fn upload<E: Elem>(&self, host: Tensor<E>) -> Result<Self::Tensor<E>>;

    /// The elements of a tensor, on the host.
    fn to_host<E: Elem>(&self, t: &Self::Tensor<E>) -> Result<Vec<E>>;

    /// The raw little-endian bytes of a tensor: borrowed where the device is the host.
    fn raw_bytes<'a, E: Elem>(&self, t: &'a Self::Tensor<E>) -> Result<Cow<'a, [u8]>>;

    /// `dst = src`, for two tensors of one size.
    fn copy<E: Elem>(&self, src: &Self::Tensor<E>, dst: &mut Self::Tensor<E>) -> Result<()>;

    /// `len` bytes of `t` from byte `offset`, on the host: what a rank sends of a tensor (the
    /// counting device, which holds no data, gives none).
    fn read_bytes<E: Elem>(
        &self,
        t: &Self::Tensor<E>,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>>;

    /// Writes `bytes` into `t` from byte `offset`: what a rank receives into a tensor.
    fn write_bytes<E: Elem>(
        &self,
        t: &mut Self::Tensor<E>,
        offset: usize,
        bytes: &[u8],
    ) -> Result<()>;

    /// The devices of `world` data-parallel ranks on this machine, each with its own tracker
    /// of [`Device::rank_capacity`] bytes (this device itself for one rank).
    fn ranks(&self, world: usize) -> Result<Vec<Self>>;

    /// The capacity in bytes of each of the devices [`Device::ranks`] makes for `world` ranks,
    /// without making them.
    fn rank_capacity(&self, world: usize) -> u64;

    /// Sets every element of `t` to zero.
    fn fill_zero(&self, t: &mut Self::Tensor<f32>) -> Result<()>;

    /// `dst = src` rounded to `E`.
    fn round<E: Elem>(&self, src: &Self::Tensor<f32>, dst: &mut Self::Tensor<E>) -> Result<()>;

    /// The rotary tables of `spec` on the device, counted as params.
    fn rope_tables(&self, spec: RopeSpec) -> Result<Self::Rope>;

    /// A batch's token ids as the embedding reads them.
    fn ids(&self, ids: &[u32]) -> Result<Self::Ids>;

    /// A batch's labels as the cross-entropy reads them.
    fn labels(&self, labels: &[i64]) -> Result<Self::Labels>;

    /// Refuses an attention shape the device's kernels cannot run.
    fn check_attention(&self, _shape: AttnShape) -> Result<()> {
        Ok(())
    }

    /// `c[m, n] (+)= a[m, k] · b[k, n]` with f32 accumulation; `accumulate` adds to `c`.
    fn matmul<A: Elem, B: Elem, C: Elem>(
        &self,
        dims: (usize, usize, usize),
        a: Operand<'_, Self::Tensor<A>>,
        b: Operand<'_, Self::Tensor<B>>,
        c: Out<'_, Self::Tensor<C>>,
        accumulate: bool,
    ) -> Result<()>;

    /// Row `i` of `out` is row `ids[i]` of `table`.
    fn embedding_forward<E: Elem>(
        &self,
        table: &Self::Tensor<E>,
        ids: &Self::Ids,
        out: &mut Self::Tensor<E>,
    ) -> Result<()>;

    /// `dtable[ids[i]] += dout[i]`, each row's sum in token order.
    fn embedding_backward<E: Elem>(
        &self,
        dout: &Self::Tensor<E>,
        ids: &Self::Ids,
        dtable: &mut Self::Tensor<f32>,
    ) -> Result<()>;

    /// RMSNorm of every row, as Hugging Face computes it: `y = w · round(x / rms(x))`, and
    /// each row's `1 / rms(x)` in `rinv`.
    fn rmsnorm_forward<E: Elem>(
        &self,
        x: &Self::Tensor<E>,
        w: &Self::Tensor<E>,
        eps: f32,
        y: &mut Self::Tensor<E>,
        rinv: &mut Self::Tensor<f32>,
    ) -> Result<()>;

    /// RMSNorm backward: `dx += ∂L/∂x` (the norm reads the residual stream) and `dw += ∂L/∂w`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward<E: Elem>(
        &self,
        dy: &Self::Tensor<E>,
        x: &Self::Tensor<E>,
        w: &Self::Tensor<E>,
        rinv: &Self::Tensor<f32>,
        dx: &mut Self::Tensor<E>,
        dw: &mut Self::Tensor<f32>,
    ) -> Result<()>;

    /// Rotates every head of `x` (`[rows, width]`; `width_seq` is `(width, seq)`) in place, row
    /// `r` at position `positions[r]` (a packed batch's, see [`crate::model::Batch::positions`]),
    /// else `r % seq`; `inverse` applies the transposed rotation, which is the backward pass.
    fn rope<E: Elem>(
        &self,
        x: &mut Self::Tensor<E>,
        width_seq: (usize, usize),
        tables: &Self::Rope,
        positions: Option<&Self::Ids>,
        inverse: bool,
    ) -> Result<()>;

    /// `y[r, :] += b` for every row of `y` (`[rows, b.len()]`).
    fn add_bias<E: Elem>(&self, y: &mut Self::Tensor<E>, b: &Self::Tensor<E>) -> Result<()>;

    /// `db += Σ_r dy[r, :]`, each column's rows summed in order.
    fn bias_grad<E: Elem>(&self, dy: &Self::Tensor<E>, db: &mut Self::Tensor<f32>) -> Result<()>;

    /// `x[r, :] *= w[r]` for every row of `x` (`[rows, width]`, `w`: `[rows]`).
    fn scale_rows<E: Elem>(&self, x: &mut Self::Tensor<E>, w: &Self::Tensor<E>) -> Result<()>;

    /// `dst[rows[i], :] += w[i] · src[i, :]` for every row `i` of `src` (`w[i]` is 1 without
    /// `weights`), the product rounded to `E` before the sum. The rows are distinct.
    fn scatter_add_rows<E: Elem>(
        &self,
        src: &Self::Tensor<E>,
        rows: &Self::Ids,
        weights: Option<&Self::Tensor<E>>,
        dst: &mut Self::Tensor<E>,
    ) -> Result<()>;

    /// `out[r] = Σ_j a[r, j] · b[r, j]` in f32, for every row of `a` and `b` (`[rows, width]`).
    fn row_dots<E: Elem>(
        &self,
        a: &Self::Tensor<E>,
        b: &Self::Tensor<E>,
        out: &mut Self::Tensor<f32>,
    ) -> Result<()>;

    /// The routing of a MoE layer from its router's logits (`[rows, experts]`), computed on the
    /// host from the logits' values.
    fn route<E: Elem>(&self, logits: &Self::Tensor<E>, spec: RouteSpec) -> Result<Routing> {
        let logits: Vec<f32> = self.to_host(logits)?.iter().map(|x| x.to_f32()).collect();
        Ok(Routing::from_logits(&logits, spec))
    }

    /// A tensor of `shape` holding `values` rounded to `E`, staged on the host and uploaded.
    fn upload_f32<E: Elem>(
        &self,
        shape: &[usize],
        values: &[f32],
        category: Category,
    ) -> Result<Self::Tensor<E>> {
        self.upload(Tensor::from_f32(&self.host(), shape, values, category)?)
    }

    /// `act = silu(gate) · up`.
    fn swiglu_forward<E: Elem>(
        &self,
        gate: &Self::Tensor<E>,
        up: &Self::Tensor<E>,
        act: &mut Self::Tensor<E>,
    ) -> Result<()>;

    /// SwiGLU backward: `dgate` and `dup` from `dact`.
    fn swiglu_backward<E: Elem>(
        &self,
        dact: &Self::Tensor<E>,
        gate_up: (&Self::Tensor<E>, &Self::Tensor<E>),
        dgate: &mut Self::Tensor<E>,
        dup: &mut Self::Tensor<E>,
    ) -> Result<()>;

    /// Residual dropout: `out[i] = x[i] + y[i] · scale` where `mask` keeps element `i`, else
    /// `x[i]`.
    fn dropout_add<E: Elem>(
        &self,
        mask: &DropoutMask,
        x: &Self::Tensor<E>,
        y: &Self::Tensor<E>,
        out: &mut Self::Tensor<E>,
    ) -> Result<()>;

    /// Backward of [`Device::dropout_add`] for `y`: `dy[i] = dout[i] · scale` where `mask`
    /// keeps element `i`, else 0.
    fn dropout_backward<E: Elem>(
        &self,
        mask: &DropoutMask,
        dout: &Self::Tensor<E>,
        dy: &mut Self::Tensor<E>,
    ) -> Result<()>;

    /// Causal attention `out = softmax(q·kᵀ/√d + mask)·v` per head (`q`, `out`:
    /// `[rows, heads·d]`; `k`, `v`: `[rows, kv_heads·d]`, rotated); `lse` (`[batch, heads, seq]`)
    /// receives each row's log-sum-exp. With a packed batch's `positions`, query `i` of a
    /// sequence sees keys `i − positions[i] ..= i` only: its own document's (see
    /// [`crate::model::Batch::positions`]).
    #[allow(clippy::too_many_arguments)]
    fn attention_forward<E: Elem>(
        &self,
        shape: AttnShape,
        positions: Option<&Self::Ids>,
        q: &Self::Tensor<E>,
        k: &Self::Tensor<E>,
        v: &Self::Tensor<E>,
        out: &mut Self::Tensor<E>,
        lse: &mut Self::Tensor<f32>,
    ) -> Result<()>;

    /// Backward of [`Device::attention_forward`]: `dq`, `dk`, `dv` from `dout`, the
    /// probabilities recomputed from the saved log-sum-exp, under the same `positions`.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward<E: Elem>(
        &self,
        shape: AttnShape,
        positions: Option<&Self::Ids>,
        q: &Self::Tensor<E>,
        k: &Self::Tensor<E>,
        v: &Self::Tensor<E>,
        out_lse: (&Self::Tensor<E>, &Self::Tensor<f32>),
        dout: &Self::Tensor<E>,
        dq: &mut Self::Tensor<E>,
        dk: &mut Self::Tensor<E>,
        dv: &mut Self::Tensor<E>,
    ) -> Result<()>;

    /// Replaces `len` rows of logits (`[len, vocab]` from the start of `logits`; `rows` is
    /// `(start, len, vocab)`) by `scale · (softmax − onehot(label))` and writes each row's loss;
    /// the rows' labels start at `start` of `labels` and their losses at `start` of `row_loss`.
    /// Ignored rows become zeros with loss 0.
    fn cross_entropy_rows<E: Elem>(
        &self,
        logits: &mut Self::Tensor<E>,
        labels: &Self::Labels,
        row_loss: &mut Self::Tensor<f32>,
        rows: (usize, usize, usize),
        scale: f32,
    ) -> Result<()>;

    /// The global L2 norm of `tensors`: squares summed in f64 over fixed chunks of
    /// [`crate::optim::CHUNK`] elements, then in order.
    fn norm(&self, tensors: &[&Self::Tensor<f32>]) -> Result<f64>;

    /// The squares of `t` summed as [`Device::norm`] sums one tensor's (f64, over fixed chunks,
    /// then in order), so that adding the tensors' sums in order and taking the square root
    /// gives the norm's bits.
    fn sum_squares(&self, t: &Self::Tensor<f32>) -> Result<f64>;

    /// `x *= coef`.
    fn scale(&self, x: &mut Self::Tensor<f32>, coef: f32) -> Result<()>;

    /// One AdamW update of `p` and its `moments` (first, second) with gradient `g`.
    fn adamw(
        &self,
        p: &mut Self::Tensor<f32>,
        g: &Self::Tensor<f32>,
        moments: (&mut Self::Tensor<f32>, &mut Self::Tensor<f32>),
        args: AdamWArgs,
    ) -> Result<()>;

    /// One AdamW update of as many elements as the `moments` hold, of `p` from element
    /// `offsets.0` on with those of `g` from `offsets.1` on: a rank's shard of a tensor whose
    /// optimizer state is sharded. Element-wise, so it gives the bits [`Device::adamw`] gives
    /// those elements.
    fn adamw_range(
        &self,
        p: &mut Self::Tensor<f32>,
        g: &Self::Tensor<f32>,
        moments: (&mut Self::Tensor<f32>, &mut Self::Tensor<f32>),
        args: AdamWArgs,
        offsets: (usize, usize),
    ) -> Result<()>;
}
