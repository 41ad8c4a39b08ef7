//! The CPU device: a memory tracker with a configurable capacity and a private thread pool.

pub mod attention;
pub mod kernels;
pub(crate) mod math;
pub mod matmul;

use crate::error::{EngineError, Result};
use crate::memory::{Category, MemoryTracker, OutOfMemory};
use crate::tensor::{Elem, Tensor};
use std::sync::Arc;

/// A CPU "device": every tensor it hands out is counted by its tracker, and every kernel runs on
/// its own thread pool so that two devices with different thread counts can live side by side.
#[derive(Clone)]
pub struct CpuDevice {
    tracker: MemoryTracker,
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
}

impl CpuDevice {
    /// A device with `threads` worker threads (0 = one per core) and `capacity` bytes.
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
        })
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
        let numel: usize = shape.iter().product();
        let lease = self
            .tracker
            .allocate((numel * E::DTYPE.size()) as u64, category)?;
        Ok(Tensor::from_parts(
            vec![E::default(); numel],
            shape.to_vec(),
            lease,
        ))
    }

    /// A tensor holding `values` rounded to `E`, counted under `category`.
    pub fn from_f32<E: Elem>(
        &self,
        shape: &[usize],
        values: &[f32],
        category: Category,
    ) -> Result<Tensor<E>, OutOfMemory> {
        let mut t = self.zeros::<E>(shape, category)?;
        debug_assert_eq!(values.len(), t.numel());
        for (d, &v) in t.as_mut_slice().iter_mut().zip(values) {
            *d = E::from_f32(v);
        }
        Ok(t)
    }

    /// A copy of `src` converted to `E`, counted under `category`.
    pub fn convert<S: Elem, E: Elem>(
        &self,
        src: &Tensor<S>,
        category: Category,
    ) -> Result<Tensor<E>, OutOfMemory> {
        let mut t = self.zeros::<E>(src.shape(), category)?;
        kernels::convert(self, src.as_slice(), t.as_mut_slice());
        Ok(t)
    }
}

impl std::fmt::Debug for CpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuDevice({} threads)", self.threads)
    }
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
