//! ckpt-engine: a training engine for Llama-family language models whose every allocated byte is
//! accounted by category.
//!
//! The layers, from the bottom: [`memory`] and [`tensor`] (accounted bytes), [`device`] (the
//! contract every backend implements), [`model`] and [`optim`] (written once over a device),
//! [`state`] (weights, gradients and moments on one device), [`parallel`] (what data-parallel
//! ranks share: collectives, the shard plan), [`checkpoint`], [`ranks`] (a step over several
//! ranks, and what their checkpoints hold), [`trainer`] (the loop, with [`data`]). The [`backend`]s implement the device: CPU, CUDA, and the
//! counting device that [`estimate`] runs the step on to predict its memory. A device reports
//! what bitwise resume depends on ([`environment`]); a checkpoint keeps it.

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod device;
pub mod environment;
pub mod error;
pub mod estimate;
pub mod fault;
pub mod host_memory;
pub mod memory;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod ranks;
pub mod regular_file;
pub mod state;
pub mod tensor;
pub mod trainer;
pub mod validation;

pub use backend::{CountingDevice, CpuDevice, CudaDevice};
pub use config::{Init, Precision, TrainConfig};
pub use device::{Device, DeviceKind};
pub use environment::{EnvChange, ExecutionEnv};
pub use error::{EngineError, Result, Setting};
pub use fault::{Fault, Faults};
pub use memory::{Category, MemoryStats, MemoryTracker, OutOfMemory};
pub use model::{Batch, Checkpointing, LlamaConfig, Model, Params};
pub use state::State;
pub use tensor::{DType, Elem, Tensor};
pub use trainer::{Placing, StateDigest, StepStats, Trainer};
