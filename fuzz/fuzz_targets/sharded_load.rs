//! Fuzzes the readers of a sharded checkpoint: one file of a valid checkpoint saved by 3 ranks
//! (the index, a rank's file, or the state) is replaced by the input, its size and checksums
//! re-recorded (and the state file's checksum too unless the input replaces that), so that the
//! index's tiling, byte ranges and hashes are reached past the checksums. Loading it on one
//! device, resuming it on 2 ranks (each reading its rows) and verifying it must each return a
//! value or an error, never panic.
//!
//! With `CKPT_FUZZ_SEEDS=DIR`, the checkpoint's own files are written into `DIR` first, each
//! as the input that puts it back in place: a corpus to start from.
//!
//! Run it with `-detect_leaks=0`: each resume on 2 ranks gives every rank a thread pool of its
//! own, whose threads end only after the pool is dropped, so LeakSanitizer now and then reports
//! their thread-local storage as leaked (the single-device loader's leaks are `checkpoint_load`'s
//! to find).
#![no_main]

mod common;

use ckpt_engine::checkpoint;
use ckpt_engine::config::TrainConfig;
use ckpt_engine::parallel::{Parallel, Shard};
use ckpt_engine::{CpuDevice, Trainer};
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

struct Fixture {
    _dir: tempfile::TempDir,
    ckpt: PathBuf,
    /// The checkpoint's files, in name order.
    files: Vec<String>,
    cfg: TrainConfig,
    // One device for all runs: a rayon pool's threads outlive its drop, which LeakSanitizer
    // would report on every input.
    dev: CpuDevice,
}

/// A run of fully sharded ranks, `world_size` of them, whose vocabulary 3 does not divide, so
/// that the last shards are short.
fn config(world_size: usize) -> TrainConfig {
    common::tiny_run(17, 6, Parallel { world_size, shard: Shard::Full, ..Parallel::default() })
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let cfg = config(3);
        let dir = tempfile::tempdir().unwrap();
        let dev = CpuDevice::new(1, u64::MAX).unwrap();
        let mut t = Trainer::new(cfg.clone(), dev.clone()).unwrap();
        t.step().unwrap();
        let ckpt = t.save(&dir.path().join("run"), None).unwrap();
        let mut files: Vec<String> = std::fs::read_dir(&ckpt)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        if let Some(seeds) = std::env::var_os("CKPT_FUZZ_SEEDS") {
            std::fs::create_dir_all(&seeds).unwrap();
            for (which, name) in files.iter().enumerate() {
                let mut input = vec![which as u8];
                input.extend(std::fs::read(ckpt.join(name)).unwrap());
                std::fs::write(std::path::Path::new(&seeds).join(name), input).unwrap();
            }
        }
        Fixture { _dir: dir, ckpt, files, cfg, dev }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, content)) = data.split_first() else { return };
    let f = fixture();
    let work = tempfile::tempdir().unwrap();
    let ckpt = work.path().join("step-00000001");
    std::fs::create_dir(&ckpt).unwrap();
    for name in &f.files {
        std::fs::copy(f.ckpt.join(name), ckpt.join(name)).unwrap();
    }
    let victim = f.files[which as usize % f.files.len()].as_str();
    common::replace_file(&ckpt, victim, content);
    let req = common::load_request(&f.cfg);
    let _ = checkpoint::load(f.dev.tracker(), &ckpt, &req);
    let _ = Trainer::resume(config(2), f.dev.clone(), &ckpt);
    let _ = checkpoint::verify(&ckpt);
});
