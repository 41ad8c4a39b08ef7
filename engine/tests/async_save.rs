//! Asynchronous checkpoint saves: the checkpoint is byte for byte the synchronous save's, its
//! staging buffers are counted and predicted to the byte and freed at the end of the next step,
//! a failed write surfaces as the synchronous save's error, and the fault that reads the live
//! weights writes the next step's tensors.

mod common;

use ckpt_engine::backend::count::Like;
use ckpt_engine::checkpoint::{self, step_dir_name};
use ckpt_engine::estimate::{estimate, EstimateConfig};
use ckpt_engine::{Category, CpuDevice, Fault, Precision, TrainConfig, Trainer};
use std::path::Path;

fn config(precision: Precision, faults: &[Fault]) -> TrainConfig {
    TrainConfig {
        faults: faults.iter().copied().collect(),
        ..common::train_config(common::llama(64, 32, 2), precision, 4, 16, 8)
    }
}

/// Every file of the checkpoint directory `dir`, by name.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn an_async_checkpoint_is_byte_identical_to_a_synchronous_one() {
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        let cfg = config(precision, &[]);
        let (sync_dir, async_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let mut t = Trainer::new(cfg, CpuDevice::new(1, u64::MAX).unwrap()).unwrap();
        for _ in 0..3 {
            t.step().unwrap();
            let want = t.state_digest().unwrap();
            let sync = t.save(sync_dir.path(), None).unwrap();
            t.save_async(async_dir.path(), None).unwrap();
            // The next step runs while the writer writes, and finishes it.
            t.step().unwrap();
            let written = async_dir.path().join(step_dir_name(want.step));
            assert_eq!(
                files(&written),
                files(&sync),
                "{precision:?} step {}",
                want.step
            );
            let [params, optimizer] = checkpoint::tensor_digests(&written).unwrap();
            assert_eq!((params, optimizer), (want.params, want.optimizer));
            assert_eq!(
                checkpoint::resolve(async_dir.path()).unwrap(),
                written,
                "latest"
            );
        }
    }
}

#[test]
fn staging_is_counted_predicted_to_the_byte_and_freed_at_the_next_step_s_end() {
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        let cfg = config(precision, &[]);
        let model = estimate(&EstimateConfig::from_train(&cfg, Like::Cpu { threads: 1 })).unwrap();
        let dev = CpuDevice::new(1, u64::MAX).unwrap();
        let tracker = dev.tracker().clone();
        let dir = tempfile::tempdir().unwrap();
        let mut t = Trainer::new(cfg, dev).unwrap();
        t.step().unwrap();
        let plain = t.step().unwrap();
        let held = tracker.stats().current;
        t.save_async(dir.path(), None).unwrap();
        let staging = t.staging_bytes();
        assert_eq!(staging, t.state().checkpoint_bytes(), "{precision:?}");
        assert_eq!(staging, model.save_staging, "{precision:?}");
        assert_eq!(model.save_staging_on_device(), staging);
        let start = tracker.stats().current;
        assert_eq!(start.io, held.io + staging, "counted under io");
        assert_eq!(start.total(), held.total() + staging);
        let during = t.step().unwrap();
        assert_eq!(
            during.memory.allocated.peak,
            plain.memory.allocated.peak + staging
        );
        assert_eq!(during.memory.at_peak.io, plain.memory.at_peak.io + staging);
        assert_eq!(
            during.memory.allocated.peak,
            model.later_step.peak + staging,
            "the model's step plus the staging"
        );
        assert_eq!(
            during.memory.current, plain.memory.current,
            "freed by the step's end"
        );
        assert_eq!(t.staging_bytes(), 0);
        assert_eq!(tracker.stats().current.get(Category::Io), 0);
        drop(t);
        assert_eq!(tracker.allocated(), 0);
    }
}

#[test]
fn a_save_in_flight_is_finished_by_finish_saves_or_the_drop() {
    let cfg = config(Precision::Fp32, &[]);
    let dev = CpuDevice::new(1, u64::MAX).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(cfg.clone(), dev.clone()).unwrap();
    t.step().unwrap();
    t.save_async(dir.path(), None).unwrap();
    let written = t.finish_saves().unwrap();
    assert_eq!(written, Some(dir.path().join(step_dir_name(1))));
    assert_eq!(t.finish_saves().unwrap(), None);
    t.step().unwrap();
    t.save_async(dir.path(), None).unwrap();
    drop(t);
    assert_eq!(dev.tracker().allocated(), 0);
    let resumed = Trainer::resume(cfg, dev, dir.path()).unwrap();
    assert_eq!(resumed.step_index(), 2);
}

#[test]
fn a_failed_write_surfaces_at_the_join_as_the_synchronous_save_s_error() {
    let cfg = config(Precision::Fp32, &[]);
    let dev = CpuDevice::new(1, u64::MAX).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // A run directory that is a file cannot be written.
    let run = tmp.path().join("run");
    std::fs::write(&run, b"not a directory").unwrap();
    let mut t = Trainer::new(cfg, dev.clone()).unwrap();
    t.step().unwrap();
    let sync = t.save(&run, None).unwrap_err().to_string();
    t.save_async(&run, None).unwrap();
    let err = t.step().unwrap_err().to_string();
    assert_eq!(err, sync);
    assert!(err.contains("run"), "{err}");
    assert_eq!(dev.tracker().stats().current.io, 0, "staging freed");
}

#[test]
fn the_live_weights_fault_writes_the_next_step_s_tensors() {
    let cfg = config(Precision::Fp32, &[Fault::AsyncSaveReadsLiveWeights]);
    let dev = CpuDevice::new(1, u64::MAX).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(cfg, dev.clone()).unwrap();
    t.step().unwrap();
    let at_save = t.state_digest().unwrap();
    t.save_async(dir.path(), None).unwrap();
    assert_eq!(t.staging_bytes(), 0, "nothing copied");
    t.step().unwrap();
    let next = t.state_digest().unwrap();
    let [params, optimizer] =
        checkpoint::tensor_digests(&dir.path().join(step_dir_name(1))).unwrap();
    assert_ne!(params, at_save.params);
    assert_eq!((params, optimizer), (next.params, next.optimizer));
}
