//! The CUDA backend: the model's operations as NVRTC-compiled kernels and cuBLAS products, on
//! memory from the device's stream-ordered pool.
//!
//! The CUDA libraries are loaded at run time: the engine builds and its tests pass on machines
//! without them, and every entry point reports a missing library or GPU as
//! [`crate::EngineError::NoGpu`].

mod attention;
mod device;
mod env;
mod gemm;
mod kernels;
pub mod nccl;
pub mod nvrtc;
mod tensor;

pub(crate) use attention::{attention_delta, check_attention};
pub use attention::{attention_tiles, tensor_core_keys, AttentionTiles, TC_ROWS};
pub use device::{CudaDevice, PoolStats};
pub(crate) use kernels::{grouped_lengths, norm_partials_bytes};
pub use kernels::{DeviceIds, RopeTables};
pub use tensor::{Buffer, CudaTensor};
