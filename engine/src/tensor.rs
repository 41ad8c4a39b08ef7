//! Tensors: a flat, row-major buffer of one element type, leased from a device's tracker.

mod bf16_bits;
mod buffer;

use crate::memory::{Category, Lease, MemoryTracker, OutOfMemory};
use buffer::Buffer;
use half::bf16;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The element types the engine stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// bfloat16: f32's exponent range with an 8-bit mantissa.
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
        })
    }
}

/// An element type: stored as itself, computed with in f32.
pub trait Elem: bytemuck::Pod + Default + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Widens to f32 (exact for both types).
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Elem for bf16 {
    const DTYPE: DType = DType::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_bits::to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_bits(bf16_bits::from_f32(x))
    }
}

/// The bytes of a tensor of `shape` and element `E`; `None` where they overflow.
pub fn bytes_of<E: Elem>(shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(E::DTYPE.size(), |a, &d| a.checked_mul(d))
}

/// A row-major tensor whose bytes are counted by the tracker that leased them.
pub struct Tensor<E: Elem = f32> {
    data: Buffer<E>,
    shape: Vec<usize>,
    lease: Lease,
}

impl<E: Elem> Tensor<E> {
    /// A zero-filled tensor of `shape` leased from `tracker` under `category`. The tracker
    /// refuses a request past its capacity before anything is allocated, and a buffer the host
    /// cannot provide is refused too: either way an [`OutOfMemory`], never an abort.
    pub fn zeros(
        tracker: &MemoryTracker,
        shape: &[usize],
        category: Category,
    ) -> Result<Self, OutOfMemory> {
        Self::leased(tracker, shape, category, Buffer::zeroed)
    }

    /// [`Tensor::zeros`] for a tensor kept for the run (weights, master weights, optimizer
    /// moments): a mid-sized one is carved from the tracker's huge-page chunks instead of coming
    /// from the allocator in small pages (see [`crate::memory`]'s kept chunks), which a load
    /// writing every byte of it pays for several times over.
    pub fn zeros_kept(
        tracker: &MemoryTracker,
        shape: &[usize],
        category: Category,
    ) -> Result<Self, OutOfMemory> {
        Self::leased(tracker, shape, category, Buffer::zeroed_kept)
    }

    /// A tensor of `shape` for an output its user writes in full before reading any of it,
    /// leased as [`Tensor::zeros`] is: its elements are zero, or what a freed tensor of its
    /// size left in the memory it reuses (never uninitialised memory).
    pub(crate) fn unfilled(
        tracker: &MemoryTracker,
        shape: &[usize],
        category: Category,
    ) -> Result<Self, OutOfMemory> {
        Self::leased(tracker, shape, category, Buffer::unfilled)
    }

    /// A tensor of `shape` whose bytes the tracker leases under `category` and `buffer` gives
    /// (for that many elements), or the refusal of either.
    fn leased(
        tracker: &MemoryTracker,
        shape: &[usize],
        category: Category,
        buffer: impl FnOnce(usize, &MemoryTracker) -> Option<Buffer<E>>,
    ) -> Result<Self, OutOfMemory> {
        let Some(bytes) = bytes_of::<E>(shape) else {
            return Err(tracker.refuse(u64::MAX, category));
        };
        let numel = bytes / E::DTYPE.size();
        let lease = tracker.allocate(bytes as u64, category)?;
        let Some(data) = buffer(numel, tracker) else {
            drop(lease);
            return Err(tracker.refuse(bytes as u64, category));
        };
        Ok(Tensor {
            data,
            shape: shape.to_vec(),
            lease,
        })
    }

    /// A tensor holding `values` rounded to `E`, leased from `tracker` under `category`.
    pub fn from_f32(
        tracker: &MemoryTracker,
        shape: &[usize],
        values: &[f32],
        category: Category,
    ) -> Result<Self, OutOfMemory> {
        let mut t = Self::zeros(tracker, shape, category)?;
        debug_assert_eq!(values.len(), t.numel());
        for (d, &v) in t.data.as_mut_slice().iter_mut().zip(values) {
            *d = E::from_f32(v);
        }
        Ok(t)
    }

    /// The dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.as_slice().len()
    }

    /// Bytes the tensor holds.
    pub fn bytes(&self) -> u64 {
        self.lease.bytes()
    }

    /// The category the bytes are counted under.
    pub fn category(&self) -> Category {
        self.lease.category()
    }

    /// The elements, row-major.
    pub fn as_slice(&self) -> &[E] {
        self.data.as_slice()
    }

    /// The elements, row-major, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [E] {
        self.data.as_mut_slice()
    }

    /// The elements widened to f32 (a host copy, for tests, digests and file output).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.data.as_slice().iter().map(|x| x.to_f32()).collect()
    }

    /// Overwrites every element with `value`.
    pub fn fill(&mut self, value: f32) {
        let v = E::from_f32(value);
        self.data.as_mut_slice().fill(v);
    }

    /// The raw bytes, little-endian as stored.
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.data.as_slice())
    }
}

impl<E: Elem> Drop for Tensor<E> {
    fn drop(&mut self) {
        std::mem::replace(&mut self.data, Buffer::Heap(Vec::new())).recycle(self.lease.tracker());
    }
}

impl<E: Elem> fmt::Debug for Tensor<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor<{}>{:?} ({})",
            E::DTYPE,
            self.shape,
            self.category()
        )
    }
}
