//! What the checkpoint fuzz targets share: a tiny run to save, and putting an input in place of
//! one of a checkpoint's files as a consistent writer would have recorded it.

use ckpt_engine::checkpoint::{files::record, state_file, LoadRequest, STATE_FILE, STATE_SUM_FILE};
use ckpt_engine::config::{Init, Precision, TrainConfig};
use ckpt_engine::data::DataConfig;
use ckpt_engine::parallel::Parallel;
use ckpt_engine::{Category, LlamaConfig};
use std::path::Path;

/// A bf16-mixed run of a one-layer Llama of `vocab_size` tokens, `accumulation` micro-batches a
/// step, spread as `parallel` says.
pub fn tiny_run(vocab_size: usize, accumulation: usize, parallel: Parallel) -> TrainConfig {
    let model = LlamaConfig {
        max_position_embeddings: 8,
        ..LlamaConfig::new(vocab_size, 8, 16, 1, 2, 1)
    };
    let mut run = TrainConfig {
        init: Init::Random { seed: 0, std: 0.1 },
        precision: Precision::Bf16Mixed,
        data: DataConfig::Synthetic { seed: 0, samples: 12, branching: 2, min_len: None },
        accumulation,
        parallel,
        ..TrainConfig::new(model, 1, 4)
    };
    run.optimizer.weight_decay = 0.0;
    run.optimizer.grad_clip = None;
    run
}

/// Writes `content` as file `victim` of the checkpoint in `dir`, its size and checksums
/// re-recorded in the state file and the state file's checksum written again (unless `content`
/// replaces one of those two), so that parsing past the checksums is exercised too.
pub fn replace_file(dir: &Path, victim: &str, content: &[u8]) {
    std::fs::write(dir.join(victim), content).unwrap();
    if ![STATE_FILE, STATE_SUM_FILE].contains(&victim) {
        let path = dir.join(STATE_FILE);
        let mut state: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        state["files"][victim] = serde_json::to_value(record(content)).unwrap();
        std::fs::write(&path, serde_json::to_vec(&state).unwrap()).unwrap();
    }
    if victim != STATE_SUM_FILE {
        state_file::reseal(dir).unwrap();
    }
}

/// What loading a checkpoint of `cfg` on one device asks for, as a resume of a bf16-mixed run
/// does.
pub fn load_request(cfg: &TrainConfig) -> LoadRequest<'_> {
    LoadRequest {
        config: &cfg.model,
        identity: cfg.identity().unwrap(),
        master_in_optimizer: true,
        master_category: Category::Optimizer,
        fresh_moments_if_missing: false,
    }
}
