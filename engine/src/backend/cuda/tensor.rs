//! Device memory: a [`Buffer`] is pool memory plus the tracker lease that counts it; a
//! [`CudaTensor`] is a buffer of one element type with a row-major shape.

use super::device::CudaDevice;
use crate::device::DeviceTensor;
use crate::memory::{Category, Lease};
use crate::tensor::Elem;
use cudarc::driver::sys::CUdeviceptr;
use std::marker::PhantomData;

/// Device bytes leased from the device's tracker; dropping it frees them stream-ordered and
/// returns the lease.
pub struct Buffer {
    ptr: CUdeviceptr,
    lease: Lease,
    dev: CudaDevice,
}

impl Buffer {
    pub(crate) fn new(ptr: CUdeviceptr, lease: Lease, dev: CudaDevice) -> Self {
        Buffer { ptr, lease, dev }
    }

    /// The device address (0 for an empty buffer).
    pub(crate) fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.lease.bytes() as usize
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.ptr != 0 {
            self.dev.free(self.ptr);
        }
    }
}

/// A row-major tensor in device memory, counted by its device's tracker.
pub struct CudaTensor<E: Elem> {
    buf: Buffer,
    shape: Vec<usize>,
    _elem: PhantomData<E>,
}

impl<E: Elem> CudaTensor<E> {
    pub(crate) fn from_parts(buf: Buffer, shape: Vec<usize>) -> Self {
        debug_assert_eq!(
            buf.bytes(),
            shape.iter().product::<usize>() * E::DTYPE.size()
        );
        CudaTensor {
            buf,
            shape,
            _elem: PhantomData,
        }
    }

    pub(crate) fn buffer(&self) -> &Buffer {
        &self.buf
    }

    /// The device address of the first element.
    pub(crate) fn ptr(&self) -> CUdeviceptr {
        self.buf.ptr
    }
}

impl<E: Elem> DeviceTensor for CudaTensor<E> {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn bytes(&self) -> u64 {
        self.buf.bytes() as u64
    }
    fn category(&self) -> Category {
        self.buf.lease.category()
    }
}

impl<E: Elem> std::fmt::Debug for CudaTensor<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaTensor<{}>{:?} ({})",
            E::DTYPE,
            self.shape,
            self.category()
        )
    }
}

/// Little-endian bytes read back as values of `T`.
pub(crate) fn from_bytes<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(std::mem::size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}
