//! Fuzzes the checkpoint loader: one file of a valid checkpoint is replaced by the input (its
//! size and checksums re-recorded, and the state file's checksum too unless the input replaces
//! that, so parsing past the checksums is exercised too). Loading must return a value or an
//! error, never panic.
#![no_main]

mod common;

use ckpt_engine::checkpoint::{self, STATE_FILE, STATE_SUM_FILE};
use ckpt_engine::config::TrainConfig;
use ckpt_engine::{CpuDevice, Trainer};
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
        let cfg = common::tiny_run(16, 1, Default::default());
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
    common::replace_file(work.path(), victim, content);
    let req = common::load_request(&f.cfg);
    let _ = checkpoint::load(f.dev.tracker(), work.path(), &req);
});
