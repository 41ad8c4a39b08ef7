//! The CPU device: a memory tracker with a configurable capacity and a private thread pool; its
//! operations (`kernels`, `attention`, `matmul`) split outputs across threads, never a
//! reduction, so results do not depend on the thread count.

pub mod attention;
pub mod bf16_dot;
#[cfg(target_arch = "x86_64")]
mod fma_gemm;
pub mod kernels;
pub(crate) mod math;
pub mod matmul;
pub mod peak;
mod strided;

use crate::device::rope::RopeTable;
use crate::device::DeviceTensor;
use crate::error::{EngineError, Result};
use crate::memory::{host_available, Category, Lease, MemoryTracker, OutOfMemory};
use crate::tensor::{Elem, Tensor};
use bf16_dot::Bf16Products;
pub use math::VectorIsa;
use std::sync::Arc;

/// A CPU "device": every tensor it hands out is counted by its tracker, and every kernel runs on
/// its own thread pool so that two devices with different thread counts can live side by side.
#[derive(Clone)]
pub struct CpuDevice {
    tracker: MemoryTracker,
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
    bf16_products: Bf16Products,
    vector_isa: VectorIsa,
}

impl CpuDevice {
    /// A device with `threads` worker threads (0 = one per core) and `capacity` bytes that
    /// multiplies bf16 widened to f32, its loops in the widest vector instructions the CPU has.
    pub fn new(threads: usize, capacity: u64) -> Result<Self> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ckpt-cpu-{i}"))
            .build()
            .map_err(|e| EngineError::Threads {
                threads,
                message: e.to_string(),
            })?;
        Ok(CpuDevice {
            tracker: MemoryTracker::new(capacity),
            pool: Arc::new(pool),
            threads,
            bf16_products: Bf16Products::Widened,
            vector_isa: VectorIsa::detect(),
        })
    }

    /// This device multiplying bf16 operands as `products` says; refused where this CPU
    /// cannot ([`Bf16Products::check`]).
    pub fn with_bf16_products(self, products: Bf16Products) -> Result<Self> {
        products.check()?;
        Ok(CpuDevice {
            bf16_products: products,
            ..self
        })
    }

    /// This device running its own loops (not `gemm`'s matrix kernels) in vector instructions
    /// no wider than `widest`. The bits do not change (see [`VectorIsa`]); the speed does.
    pub fn limit_vector_isa(self, widest: VectorIsa) -> Self {
        CpuDevice {
            vector_isa: self.vector_isa.min(widest),
            ..self
        }
    }

    /// The vector instructions this device's own loops run in.
    pub fn vector_isa(&self) -> VectorIsa {
        self.vector_isa
    }

    /// How this device multiplies bf16 operands.
    pub fn bf16_products(&self) -> Bf16Products {
        self.bf16_products
    }

    /// A device whose capacity is `capacity`, or else the host's available memory: a run too
    /// large for the machine is refused with [`OutOfMemory`] before the host runs out. It
    /// multiplies bf16 as `CKPT_CPU_BF16_PRODUCTS` says ([`Bf16Products::from_env`]).
    pub fn with_host_capacity(threads: usize, capacity: Option<u64>) -> Result<Self> {
        Self::new(
            threads,
            capacity.or_else(host_available).unwrap_or(u64::MAX),
        )?
        .with_bf16_products(Bf16Products::from_env()?)
    }

    /// The tracker counting this device's bytes.
    pub fn tracker(&self) -> &MemoryTracker {
        &self.tracker
    }

    /// Worker threads kernels use.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on this device's thread pool.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// A zero-filled tensor of `shape`, counted under `category`.
    pub fn zeros<E: Elem>(
        &self,
        shape: &[usize],
        category: Category,
    ) -> Result<Tensor<E>, OutOfMemory> {
        Tensor::zeros(&self.tracker, shape, category)
    }

    /// A copy of `src` converted to `E`, counted under `category`.
    pub fn convert<S: Elem, E: Elem>(
        &self,
        src: &Tensor<S>,
        category: Category,
    ) -> Result<Tensor<E>, OutOfMemory> {
        let mut t = self.zeros::<E>(src.shape(), category)?;
        math::convert(self, src.as_slice(), t.as_mut_slice());
        Ok(t)
    }
}

impl std::fmt::Debug for CpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CpuDevice({} threads, bf16 {:?}, loops {:?})",
            self.threads, self.bf16_products, self.vector_isa
        )
    }
}

impl<E: Elem> DeviceTensor for Tensor<E> {
    fn shape(&self) -> &[usize] {
        Tensor::shape(self)
    }
    fn bytes(&self) -> u64 {
        Tensor::bytes(self)
    }
    fn category(&self) -> Category {
        Tensor::category(self)
    }
}

/// The rotary tables on the host, their bytes counted as params.
pub struct CpuRope {
    pub(crate) table: RopeTable,
    pub(crate) _lease: Lease,
}

/// A raw pointer that kernels share across threads to write disjoint parts of one output.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub *mut T);

impl<T> SharedMut<T> {
    /// The pointer. A method, so closures capture the `Sync` wrapper rather than the field.
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

// SAFETY: only used by kernels whose threads write disjoint index ranges.
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}
