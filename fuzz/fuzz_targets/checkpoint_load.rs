//! Fuzzes the checkpoint loader: one file of a valid checkpoint is replaced by the input (its
//! size and checksums re-recorded, and the state file's checksum too unless the input replaces
//! that, so parsing past the checksums is exercised too). Loading must return a value or an
//! error, never panic.
#![no_main]

use ckpt_engine::checkpoint::{self, files::record, state_file, LoadRequest, STATE_FILE, STATE_SUM_FILE};
use ckpt_engine::data::DataConfig;
use ckpt_engine::optim::{AdamWConfig, Schedule};
use ckpt_engine::config::{Init, Precision, TrainConfig};
use ckpt_engine::{Category, Checkpointing, CpuDevice, LlamaConfig, Trainer};
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

const FILES: [&str; 5] =
    ["model.safetensors", "optimizer.safetensors", "config.json", STATE_FILE, STATE_SUM_FILE];

struct Fixture {
    _dir: tempfile::TempDir,
    ckpt: PathBuf,
    cfg: TrainConfig,
    // One device for all runs: a rayon pool's threads outlive its drop, which LeakSanitizer
    // would report on every input.
    dev: CpuDevice,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let cfg = TrainConfig {
            model: LlamaConfig {
                vocab_size: 16,
                hidden_size: 8,
                intermediate_size: 16,
                num_hidden_layers: 1,
                num_attention_heads: 2,
                num_key_value_heads: 1,
                head_dim: None,
                rms_norm_eps: 1e-5,
                rope_theta: 10000.0,
                tie_word_embeddings: false,
                max_position_embeddings: 8,
                family: Default::default(),
                sliding_window: None,
                moe: None,
            },
            init: Init::Random { seed: 0, std: 0.1 },
            precision: Precision::Bf16Mixed,
            optimizer: AdamWConfig { lr: 1e-3, betas: [0.9, 0.95], eps: 1e-8, weight_decay: 0.0, grad_clip: None },
            schedule: Schedule::Constant,
            data: DataConfig::Synthetic { seed: 0, samples: 4, branching: 2, min_len: None },
            batch_size: 1,
            accumulation: 1,
            seq_len: 4,
            shuffle_seed: 0,
            checkpointing: Checkpointing::None,
            loss: ckpt_engine::model::loss::LossKind::Standard,
            dropout: 0.0,
            long_batch: None,
            faults: Default::default(),
            parallel: Default::default(),
        };
        let dir = tempfile::tempdir().unwrap();
        let dev = CpuDevice::new(1, u64::MAX).unwrap();
        let mut t = Trainer::new(cfg.clone(), dev.clone()).unwrap();
        t.step().unwrap();
        let ckpt = t.save(&dir.path().join("run"), None).unwrap();
        Fixture { _dir: dir, ckpt, cfg, dev }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, content)) = data.split_first() else { return };
    let f = fixture();
    let work = tempfile::tempdir().unwrap();
    for name in FILES {
        std::fs::copy(f.ckpt.join(name), work.path().join(name)).unwrap();
    }
    let victim = FILES[which as usize % FILES.len()];
    std::fs::write(work.path().join(victim), content).unwrap();
    if ![STATE_FILE, STATE_SUM_FILE].contains(&victim) {
        let path = work.path().join(STATE_FILE);
        let mut state: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        state["files"][victim] = serde_json::to_value(record(content)).unwrap();
        std::fs::write(&path, serde_json::to_vec(&state).unwrap()).unwrap();
    }
    if victim != STATE_SUM_FILE {
        state_file::reseal(work.path()).unwrap();
    }
    let req = LoadRequest {
        config: &f.cfg.model,
        identity: f.cfg.identity().unwrap(),
        master_in_optimizer: true,
        master_category: Category::Optimizer,
        fresh_moments_if_missing: false,
    };
    let _ = checkpoint::load(f.dev.tracker(), work.path(), &req);
});
