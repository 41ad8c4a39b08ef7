//! Matrix products through `cublasGemmEx` with f32 accumulation (`CUBLAS_COMPUTE_32F`, default
//! math mode: no TF32). bf16 operands are read as bf16 and the product accumulates in f32; a bf16
//! output is rounded once, like the CPU backend's widened products.

use super::device::CudaDevice;
use super::tensor::CudaTensor;
use crate::device;
use crate::error::{EngineError, Result};
use crate::tensor::{DType, Elem};
use cudarc::cublas::{result as blas, sys};
use cudarc::driver::sys::CUdeviceptr;
use std::ffi::c_void;

/// A matrix in device memory: its address, element type, and whether it is used as stored
/// (row-major) or transposed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operand {
    ptr: CUdeviceptr,
    dtype: DType,
    transposed: bool,
}

impl<E: Elem> From<device::Operand<'_, CudaTensor<E>>> for Operand {
    fn from(o: device::Operand<'_, CudaTensor<E>>) -> Self {
        Operand {
            ptr: o.tensor.ptr() + (o.offset * E::DTYPE.size()) as u64,
            dtype: E::DTYPE,
            transposed: o.transposed,
        }
    }
}

fn data_type(d: DType) -> sys::cudaDataType {
    match d {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::Bf16 => sys::cudaDataType::CUDA_R_16BF,
    }
}

/// `c[m, n] (+)= a[m, k] · b[k, n]` with row-major `c` (an [`Operand`] used as stored);
/// `accumulate` adds to `c`.
///
/// cuBLAS is column-major, so this computes `cᵀ = bᵀ · aᵀ`: a row-major matrix is its
/// transpose in column-major order.
pub(crate) fn matmul(
    dev: &CudaDevice,
    (m, n, k): (usize, usize, usize),
    a: Operand,
    b: Operand,
    c: Operand,
    accumulate: bool,
) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        return if accumulate {
            Ok(())
        } else {
            dev.memset_zero(c.ptr, m * n * c.dtype.size())
        };
    }
    let op = |tr: bool| {
        if tr {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let lda = if b.transposed { k } else { n };
    let ldb = if a.transposed { m } else { k };
    let dim = |x: usize| {
        i32::try_from(x).map_err(|_| {
            EngineError::Config(format!(
                "matrix dimension {x} exceeds cuBLAS's 32-bit limit; use smaller batches or chunked loss"
            ))
        })
    };
    let (mm, nn, kk, lda, ldb) = (dim(n)?, dim(m)?, dim(k)?, dim(lda)?, dim(ldb)?);
    let alpha = 1.0f32;
    let beta = if accumulate { 1.0f32 } else { 0.0 };
    dev.with_blas(|handle| {
        // SAFETY: the three matrices are live device buffers of the sizes the leading dimensions
        // describe (callers pass tensors of those shapes); alpha and beta are host f32s, as the
        // compute type requires.
        unsafe {
            blas::gemm_ex(
                handle,
                op(b.transposed),
                op(a.transposed),
                mm,
                nn,
                kk,
                (&alpha as *const f32).cast::<c_void>(),
                b.ptr as *const c_void,
                data_type(b.dtype),
                lda,
                a.ptr as *const c_void,
                data_type(a.dtype),
                ldb,
                (&beta as *const f32).cast::<c_void>(),
                c.ptr as *mut c_void,
                data_type(c.dtype),
                mm,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| EngineError::Cuda(format!("cublasGemmEx ({m}x{n}x{k}): {e}")))
    })
}
