//! Small real checkpoints for this module's tests: no tensors, every file written by [`save`].

use super::state::{RngState, ScheduleState, TrainerState, FORMAT_VERSION};
use super::{fingerprint, save, Entry, SaveRequest};
use crate::environment::ExecutionEnv;
use crate::error::Result;
use crate::model::LlamaConfig;
use crate::optim::Schedule;
use std::path::{Path, PathBuf};

/// The model of these checkpoints.
pub(crate) fn config() -> LlamaConfig {
    LlamaConfig::from_hf_json(
        r#"{"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 8}"#,
    )
    .unwrap()
}

/// The execution record of these checkpoints.
pub(crate) fn environment() -> ExecutionEnv {
    ExecutionEnv {
        cpu_kernels: Some("x86_64 fma".into()),
        ..ExecutionEnv::new("cpu")
    }
}

/// Saves the checkpoint of `step` into `run` and returns its directory.
pub(crate) fn save_step(run: &Path, step: u64) -> PathBuf {
    save_step_with(run, step, Vec::new()).unwrap()
}

/// Saves the checkpoint of `step` holding the weights `model` into `run`.
pub(crate) fn save_step_with(run: &Path, step: u64, model: Vec<Entry<'_>>) -> Result<PathBuf> {
    let config = config();
    let req = SaveRequest {
        config: &config,
        tensors: super::Tensors::Whole {
            model,
            optimizer: Vec::new(),
        },
        state: state(step),
    };
    save(run, req, None)
}

/// The trainer state of these checkpoints at `step`, without its files.
pub(crate) fn state(step: u64) -> TrainerState {
    let identity = serde_json::json!({"model": config()});
    TrainerState {
        format_version: FORMAT_VERSION,
        global_step: step,
        optimizer_step: step,
        schedule: ScheduleState {
            schedule: Schedule::Constant,
            peak_lr: 1e-3,
            next_lr: 1e-3,
        },
        loader: Default::default(),
        rng: RngState::default(),
        fingerprint: fingerprint(&identity),
        identity,
        environment: Some(environment()),
        files: Default::default(),
    }
}
