//! ckpt-engine: a training engine for Llama-family language models whose every allocated byte is
//! accounted by category.
//!
//! The pieces, in the order a step uses them: [`data`] hands out batches, [`model`] runs the
//! explicit forward and backward passes on a [`backend`] device, [`loss`] fuses the LM head with
//! cross-entropy, [`optim`] applies AdamW, and [`trainer`] ties them into a loop. Every tensor is
//! leased from the device's [`memory::MemoryTracker`].

pub mod backend;
pub mod checkpoint;
pub mod compute;
pub mod data;
pub mod error;
pub mod estimate;
pub mod fault;
pub mod loss;
pub mod memory;
pub mod model;
pub mod optim;
pub mod tensor;
pub mod trainer;

pub use backend::{CpuDevice, CudaDevice};
pub use compute::{Compute, CpuCompute};
pub use error::{EngineError, Result};
pub use fault::{Fault, Faults};
pub use memory::{Category, MemoryStats, MemoryTracker, OutOfMemory};
pub use model::{Batch, Checkpointing, LlamaConfig, Model, Params};
pub use tensor::{DType, Elem, Tensor};
pub use trainer::{Device, Precision, StateDigest, StepStats, TrainConfig, Trainer};
