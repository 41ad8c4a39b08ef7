//! Compute backends. The CPU backend runs everywhere; kernels on it split outputs across
//! threads, never a reduction, so results do not depend on the thread count. The CUDA backend
//! loads its libraries at run time and reports their absence as an error.

pub mod cpu;
pub mod cuda;

pub use cpu::CpuDevice;
pub use cuda::CudaDevice;
