//! The CUDA backend: the same explicit forward and backward passes as the CPU backend, with
//! NVRTC-compiled kernels and cuBLAS products, on memory from the device's stream-ordered pool.
//!
//! The CUDA libraries are loaded at run time: the engine builds and its tests pass on machines
//! without them, and every entry point reports a missing library or GPU as
//! [`crate::EngineError::NoGpu`].

mod block;
mod compute;
mod device;
mod gemm;
mod kernels;
mod loss;
mod model;
pub mod nvrtc;
mod tensor;

pub use compute::CudaCompute;
pub use device::{CudaDevice, PoolStats};
pub use kernels::{attention_tiles, AttentionTiles};
pub use tensor::CudaTensor;
