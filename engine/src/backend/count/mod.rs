//! The counting device: tensors are sizes only, and every operation allocates what the backend
//! it imitates allocates, through the very functions that backend allocates with (the CPU's
//! product and attention workspace, the CUDA backend's uploads and scratch). Running the
//! model's step on it is the memory model: the tracker's figures are the prediction.

use crate::backend::{cpu, cuda};
use crate::device::dropout::DropoutMask;
use crate::device::rope::RopeSpec;
use crate::device::router::{RouteSpec, Routing};
use crate::device::{
    AdamWArgs, AttnShape, Device, DeviceKind, DeviceTensor, Operand, Out, StepPhase,
};
use crate::environment::ExecutionEnv;
use crate::error::{try_vec, EngineError, Result};
use crate::memory::{Breakdown, Category, Lease, MemoryTracker};
use crate::tensor::{bytes_of, Elem, Tensor};
use std::borrow::Cow;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// The backend a counting device imitates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Like {
    /// The CPU backend with this many worker threads (its attention scratch is per thread).
    Cpu {
        /// Worker threads, at least 1.
        threads: usize,
    },
    /// The CUDA backend.
    Cuda,
}

impl Like {
    /// The backend of `kind`, with `threads` CPU worker threads.
    pub fn new(kind: DeviceKind, threads: usize) -> Self {
        match kind {
            DeviceKind::Cpu => Like::Cpu { threads },
            DeviceKind::Cuda => Like::Cuda,
        }
    }
}

/// The peak of each [`StepPhase`] and what was held when it began. A step that accumulates
/// micro-batches enters its forward, loss and backward phases once per micro-batch: a phase's
/// peak is the highest of all its entries, its start the last entry's.
#[derive(Clone, Copy, Debug, Default)]
pub struct PhaseLog {
    current: Option<usize>,
    /// Forward passes begun: the micro-batch under way is the last of them.
    passes: usize,
    /// Bytes held at each phase's start, in [`StepPhase`] order.
    pub start: [Breakdown; 4],
    /// Each phase's peak, in [`StepPhase`] order.
    pub peak: [u64; 4],
}

impl PhaseLog {
    fn index(phase: StepPhase) -> usize {
        phase as usize
    }

    /// The peak of `phase`.
    pub fn peak_of(&self, phase: StepPhase) -> u64 {
        self.peak[Self::index(phase)]
    }

    /// What was held when `phase` began.
    pub fn start_of(&self, phase: StepPhase) -> Breakdown {
        self.start[Self::index(phase)]
    }
}

/// How the counting device routes a MoE layer's rows: it has no logits to route by, and a
/// step's expert buffers depend only on how many rows each expert gets.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Routes {
    /// As evenly as possible: each expert gets `rows · top_k / experts` rows, the first ones
    /// one more when it does not divide.
    #[default]
    Balanced,
    /// The bound over all routings: the first `top_k` experts get every row, so one expert's
    /// buffers are as large as they can be.
    Concentrated,
    /// Each block's tokens per expert as a real step recorded them (empty for a dense block):
    /// for a step of several micro-batches, each micro-batch's counts one after the other.
    Recorded(Vec<Vec<u32>>),
}

impl Routes {
    /// Whether this is [`Routes::Balanced`].
    pub fn is_balanced(&self) -> bool {
        *self == Routes::Balanced
    }

    /// Whether every micro-batch of a step routes alike (all but [`Routes::Recorded`]).
    pub fn same_in_every_micro_batch(&self) -> bool {
        !matches!(self, Routes::Recorded(_))
    }

    /// How many of a step's `micro_batches` may route differently: each of them for recorded
    /// routes, else one, whose routing stands for all.
    pub fn distinct_micro_batches(&self, micro_batches: usize) -> usize {
        match self.same_in_every_micro_batch() {
            true => micro_batches.min(1),
            false => micro_batches,
        }
    }

    /// How many rows each expert of the layer `spec` gets out of `rows` in micro-batch
    /// `micro_batch` of a step (the same in each unless recorded otherwise).
    pub fn counts(&self, rows: usize, spec: RouteSpec, micro_batch: usize) -> Result<Vec<u32>> {
        let (e, k) = (spec.experts, spec.top_k);
        Ok(match self {
            Routes::Balanced => (0..e)
                .map(|x| ((rows * k) / e + usize::from(x < (rows * k) % e)) as u32)
                .collect(),
            Routes::Concentrated => (0..e)
                .map(|x| if x < k { rows as u32 } else { 0 })
                .collect(),
            Routes::Recorded(layers) => layers
                .get(spec.layer)
                .and_then(|counts| counts.chunks(e.max(1)).nth(micro_batch))
                .map(<[u32]>::to_vec)
                .ok_or_else(|| {
                    EngineError::Config(format!(
                        "no tokens per expert recorded for block {} of micro-batch {micro_batch}",
                        spec.layer
                    ))
                })?,
        })
    }
}

/// A device that holds no data: each tensor is a lease of its bytes on the tracker.
#[derive(Clone, Debug)]
pub struct CountingDevice {
    tracker: MemoryTracker,
    like: Like,
    log: Arc<Mutex<PhaseLog>>,
    routes: Arc<Routes>,
    /// The global index in the step of the micro-batch each pass trains, in the order the
    /// passes run (a rank's share of the step); empty: pass `i` trains micro-batch `i`.
    micro_batches: Arc<[usize]>,
}

/// A tensor of the counting device: its shape and the lease of its bytes.
#[derive(Debug)]
pub struct CountTensor<E> {
    lease: Lease,
    shape: Vec<usize>,
    _elem: PhantomData<E>,
}

impl<E: Elem> DeviceTensor for CountTensor<E> {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn bytes(&self) -> u64 {
        self.lease.bytes()
    }
    fn category(&self) -> Category {
        self.lease.category()
    }
}

/// Token ids or labels: their count, and the bytes the imitated backend uploads for them.
pub struct CountIndices {
    len: usize,
    _upload: Option<Lease>,
}

impl CountingDevice {
    /// A device imitating `like`, with no capacity limit.
    pub fn new(like: Like) -> Self {
        CountingDevice {
            tracker: MemoryTracker::unlimited(),
            like,
            log: Arc::default(),
            routes: Arc::default(),
            micro_batches: Arc::new([]),
        }
    }

    /// The same device routing MoE layers as `routes` says.
    pub fn with_routes(mut self, routes: Routes) -> Self {
        self.routes = Arc::new(routes);
        self
    }

    /// The same device training micro-batches `global` of each step (their indices in the
    /// step, in the order its passes run them): a rank's share, so that each pass routes as
    /// the micro-batch it stands for recorded.
    pub fn with_micro_batches(mut self, global: Vec<usize>) -> Self {
        self.micro_batches = global.into();
        self
    }

    /// The peaks of the step phases since the last [`CountingDevice::reset_log`].
    pub fn log(&self) -> PhaseLog {
        *self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets the phases recorded so far.
    pub fn reset_log(&self) {
        *self.log.lock().unwrap_or_else(|e| e.into_inner()) = PhaseLog::default();
    }

    /// Takes `bytes` under `category` and counts them in the current phase's peak.
    fn lease(&self, bytes: u64, category: Category) -> Result<Lease> {
        let lease = self.tracker.allocate(bytes, category)?;
        let held = self.tracker.allocated();
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = log.current {
            log.peak[i] = log.peak[i].max(held);
        }
        Ok(lease)
    }

    /// Uploads of `len` elements of `T` on CUDA, nothing on the CPU.
    fn indices<T>(&self, len: usize) -> Result<CountIndices> {
        let upload = match self.like {
            Like::Cpu { .. } => None,
            Like::Cuda => Some(self.lease((len * std::mem::size_of::<T>()) as u64, Category::Io)?),
        };
        Ok(CountIndices {
            len,
            _upload: upload,
        })
    }
}

/// A tensor of the counting device, in the signatures below.
type T<E> = CountTensor<E>;
/// The `(start, len, vocab)` of a block of logits rows.
type Rows = (usize, usize, usize);

/// Operations that only read and write values: the counting device has none to compute and
/// nothing to allocate for them.
macro_rules! values_only {
    ($(fn $name:ident$(<$e:ident>)?(&self $(, $ty:ty)*);)*) => {$(
        fn $name$(<$e: Elem>)?(&self $(, _: $ty)*) -> Result<()> {
            Ok(())
        }
    )*};
}

impl Device for CountingDevice {
    values_only! {
        fn copy<E>(&self, &T<E>, &mut T<E>);
        fn fill_zero(&self, &mut T<f32>);
        fn round<E>(&self, &T<f32>, &mut T<E>);
        fn embedding_forward<E>(&self, &T<E>, &CountIndices, &mut T<E>);
        fn rmsnorm_forward<E>(&self, &T<E>, &T<E>, f32, &mut T<E>, &mut T<f32>);
        fn rmsnorm_backward<E>(&self, &T<E>, &T<E>, &T<E>, &T<f32>, &mut T<E>, &mut T<f32>);
        fn rope<E>(&self, &mut T<E>, (usize, usize), &Vec<Lease>, Option<&CountIndices>, bool);
        fn add_bias<E>(&self, &mut T<E>, &T<E>);
        fn bias_grad<E>(&self, &T<E>, &mut T<f32>);
        fn scale_rows<E>(&self, &mut T<E>, &T<E>);
        fn scatter_add_rows<E>(&self, &T<E>, &CountIndices, Option<&T<E>>, &mut T<E>);
        fn row_dots<E>(&self, &T<E>, &T<E>, &mut T<f32>);
        fn swiglu_forward<E>(&self, &T<E>, &T<E>, &mut T<E>);
        fn swiglu_backward<E>(&self, &T<E>, (&T<E>, &T<E>), &mut T<E>, &mut T<E>);
        fn dropout_add<E>(&self, &DropoutMask, &T<E>, &T<E>, &mut T<E>);
        fn dropout_backward<E>(&self, &DropoutMask, &T<E>, &mut T<E>);
        fn cross_entropy_rows<E>(&self, &mut T<E>, &CountIndices, &mut T<f32>, Rows, f32);
        fn scale(&self, &mut T<f32>, f32);
        fn adamw(&self, &mut T<f32>, &T<f32>, (&mut T<f32>, &mut T<f32>), AdamWArgs);
        fn adamw_range(&self, &mut T<f32>, &T<f32>, (&mut T<f32>, &mut T<f32>), AdamWArgs, (usize, usize));
        fn write_bytes<E>(&self, &mut T<E>, usize, &[u8]);
    }

    type Tensor<E: Elem> = CountTensor<E>;
    type Rope = Vec<Lease>;
    type Ids = CountIndices;
    type Labels = CountIndices;

    fn tracker(&self) -> &MemoryTracker {
        &self.tracker
    }

    fn host(&self) -> MemoryTracker {
        MemoryTracker::new(0)
    }

    /// The counting device computes nothing: no fact of a machine bears on its figures.
    fn execution_env(&self) -> ExecutionEnv {
        ExecutionEnv::new("count")
    }

    fn enter(&self, phase: StepPhase) {
        let stats = self.tracker.stats();
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let i = PhaseLog::index(phase);
        log.current = Some(i);
        log.start[i] = stats.current;
        log.peak[i] = log.peak[i].max(stats.allocated.current);
        log.passes += usize::from(phase == StepPhase::Forward);
    }

    fn zeros<E: Elem>(&self, shape: &[usize], category: Category) -> Result<T<E>> {
        let Some(bytes) = bytes_of::<E>(shape) else {
            return Err(self.tracker.refuse(u64::MAX, category).into());
        };
        Ok(CountTensor {
            lease: self.lease(bytes as u64, category)?,
            shape: shape.to_vec(),
            _elem: PhantomData,
        })
    }

    fn upload<E: Elem>(&self, host: Tensor<E>) -> Result<T<E>> {
        self.zeros(host.shape(), host.category())
    }

    fn upload_f32<E: Elem>(&self, shape: &[usize], _: &[f32], category: Category) -> Result<T<E>> {
        self.zeros(shape, category)
    }

    fn route<E: Elem>(&self, logits: &T<E>, spec: RouteSpec) -> Result<Routing> {
        let rows = logits.numel() / spec.experts;
        let pass = self.log().passes.saturating_sub(1);
        let micro_batch = match self.micro_batches.is_empty() {
            true => pass,
            false => self.micro_batches.get(pass).copied().ok_or_else(|| {
                EngineError::Config(format!(
                    "pass {pass} of a step on a device that trains {} micro-batches",
                    self.micro_batches.len()
                ))
            })?,
        };
        Routing::from_counts(rows, &self.routes.counts(rows, spec, micro_batch)?, spec)
    }

    fn to_host<E: Elem>(&self, t: &T<E>) -> Result<Vec<E>> {
        try_vec(t.numel(), E::default(), "a tensor's values on the host")
    }

    fn read_bytes<E: Elem>(&self, _: &T<E>, _: usize, _: usize) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }

    /// This device's for one rank; a rank's counting device has no limit.
    fn rank_capacity(&self, world: usize) -> u64 {
        match world {
            1 => self.tracker.stats().capacity,
            _ => MemoryTracker::unlimited().stats().capacity,
        }
    }

    fn ranks(&self, world: usize) -> Result<Vec<Self>> {
        if world == 1 {
            return Ok(vec![self.clone()]);
        }
        let like = match self.like {
            Like::Cpu { threads } => Like::Cpu {
                threads: (threads / world.max(1)).max(1),
            },
            Like::Cuda => Like::Cuda,
        };
        Ok((0..world)
            .map(|_| CountingDevice {
                routes: self.routes.clone(),
                ..CountingDevice::new(like)
            })
            .collect())
    }

    fn raw_bytes<'a, E: Elem>(&self, _: &'a T<E>) -> Result<Cow<'a, [u8]>> {
        Err(EngineError::Config(
            "the counting device holds no tensor data to save".into(),
        ))
    }

    fn rope_tables(&self, spec: RopeSpec) -> Result<Vec<Lease>> {
        let table = spec.elements() as u64 * 4;
        match self.like {
            Like::Cpu { .. } => Ok(vec![self.lease(2 * table, Category::Params)?]),
            Like::Cuda => (0..2)
                .map(|_| self.lease(table, Category::Params))
                .collect(),
        }
    }

    fn ids(&self, ids: &[u32]) -> Result<CountIndices> {
        self.indices::<u32>(ids.len())
    }

    fn labels(&self, labels: &[i64]) -> Result<CountIndices> {
        self.indices::<i64>(labels.len())
    }

    fn check_attention(&self, shape: AttnShape) -> Result<()> {
        match self.like {
            Like::Cpu { .. } => Ok(()),
            Like::Cuda => cuda::check_attention(shape),
        }
    }

    fn matmul<A: Elem, B: Elem, C: Elem>(
        &self,
        dims: (usize, usize, usize),
        _: Operand<'_, T<A>>,
        _: Operand<'_, T<B>>,
        _: Out<'_, T<C>>,
        _: bool,
    ) -> Result<()> {
        if let Like::Cpu { .. } = self.like {
            cpu::matmul::workspace(self, [A::DTYPE, B::DTYPE, C::DTYPE], dims)?;
        }
        Ok(())
    }

    fn embedding_backward<E: Elem>(
        &self,
        _: &T<E>,
        ids: &CountIndices,
        _: &mut T<f32>,
    ) -> Result<()> {
        if self.like == Like::Cuda {
            let uploads = cuda::grouped_lengths(ids.len)
                .map(|len| self.lease(len as u64 * 4, Category::Io))
                .into_iter()
                .collect::<Result<Vec<_>>>()?;
            drop(uploads);
        }
        Ok(())
    }

    fn attention_forward<E: Elem>(
        &self,
        s: AttnShape,
        _: Option<&CountIndices>,
        _: &T<E>,
        _: &T<E>,
        _: &T<E>,
        _: &mut T<E>,
        _: &mut T<f32>,
    ) -> Result<()> {
        if let Like::Cpu { threads } = self.like {
            cpu::attention::scratch(self, threads, &s, cpu::attention::Pass::Forward)?;
        }
        Ok(())
    }

    fn attention_backward<E: Elem>(
        &self,
        s: AttnShape,
        _: Option<&CountIndices>,
        _: &T<E>,
        _: &T<E>,
        _: &T<E>,
        _: (&T<E>, &T<f32>),
        _: &T<E>,
        _: &mut T<E>,
        _: &mut T<E>,
        _: &mut T<E>,
    ) -> Result<()> {
        match self.like {
            Like::Cpu { threads } => {
                cpu::attention::scratch(self, threads, &s, cpu::attention::Pass::Backward)?;
            }
            Like::Cuda => {
                cuda::attention_delta(self, &s)?;
            }
        }
        Ok(())
    }

    fn sum_squares(&self, t: &T<f32>) -> Result<f64> {
        if self.like == Like::Cuda {
            let numel = std::iter::once(t.numel());
            self.lease(cuda::norm_partials_bytes(numel), Category::Workspace)?;
        }
        Ok(0.0)
    }

    fn norm(&self, tensors: &[&T<f32>]) -> Result<f64> {
        if self.like == Like::Cuda {
            let numels = tensors.iter().map(|t| t.numel());
            self.lease(cuda::norm_partials_bytes(numels), Category::Workspace)?;
        }
        Ok(0.0)
    }
}
