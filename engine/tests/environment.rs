//! A checkpoint records what bitwise resume depends on, and a resume lists what differs: the
//! record reads back as the device reported it, a resume on the same machine lists nothing
//! (whatever its thread count), and a record edited to another machine's is listed field by
//! field.

mod common;

use ckpt_engine::backend::cpu::{bf16_dot::Bf16Products, matmul};
use ckpt_engine::checkpoint::{state_file, STATE_FILE};
use ckpt_engine::config::{Precision, TrainConfig};
use ckpt_engine::{CpuDevice, Device, Trainer};
use std::path::{Path, PathBuf};

fn config() -> TrainConfig {
    common::train_config(common::llama(64, 32, 2), Precision::Fp32, 4, 16, 4)
}

fn device(threads: usize) -> CpuDevice {
    CpuDevice::new(threads, u64::MAX).unwrap()
}

/// The checkpoint after one step on a device of `threads` threads, saved into `run`.
fn checkpoint(run: &Path, threads: usize) -> PathBuf {
    let mut trainer = Trainer::new(config(), device(threads)).unwrap();
    trainer.step().unwrap();
    trainer.save(run, None).unwrap()
}

/// Rewrites the `trainer_state.json` of `ckpt` with `edit` applied and records its new checksum,
/// as a deliberate rewrite would.
fn rewrite_state(ckpt: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let path = ckpt.join(STATE_FILE);
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut state);
    std::fs::write(&path, serde_json::to_vec_pretty(&state).unwrap()).unwrap();
    state_file::reseal(ckpt).unwrap();
}

#[test]
fn the_record_reads_back_as_the_device_reported_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = checkpoint(tmp.path(), 1);
    let saved = state_file::read(&ckpt).unwrap().state.environment;
    let env = device(1).execution_env();
    assert_eq!(saved.as_ref(), Some(&env));
    assert_eq!(env.backend, "cpu");
    assert_eq!(env.engine_version, env!("CARGO_PKG_VERSION"));
    assert_eq!(
        env.cpu_kernels,
        Some(matmul::kernels(Bf16Products::Widened))
    );
    assert!(env.gpu.is_none());
}

#[test]
fn a_resume_on_the_same_machine_lists_nothing_whatever_its_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = checkpoint(tmp.path(), 1);
    for threads in [1, 3] {
        let trainer = Trainer::resume(config(), device(threads), &ckpt).unwrap();
        let changes = trainer.env_changes();
        assert!(changes.is_empty(), "{threads} threads: {changes:?}");
    }
    let fresh = Trainer::new(config(), device(1)).unwrap();
    assert!(fresh.env_changes().is_empty(), "a fresh run");
}

#[test]
fn a_resume_from_an_edited_record_lists_exactly_the_edited_fields() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = checkpoint(tmp.path(), 1);
    rewrite_state(&ckpt, |s| {
        s["environment"]["cpu_kernels"] = "riscv64 scalar".into();
        s["environment"]["engine_version"] = "0.0.1".into();
    });
    let trainer = Trainer::resume(config(), device(1), &ckpt).unwrap();
    let changes: Vec<String> = trainer
        .env_changes()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        changes,
        [
            format!("engine_version: 0.0.1 → {}", env!("CARGO_PKG_VERSION")),
            format!(
                "cpu_kernels: riscv64 scalar → {}",
                matmul::kernels(Bf16Products::Widened)
            ),
        ]
    );
}

#[test]
fn a_checkpoint_without_a_record_resumes_listing_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = checkpoint(tmp.path(), 1);
    rewrite_state(&ckpt, |s| {
        s.as_object_mut().unwrap().remove("environment");
    });
    assert!(state_file::read(&ckpt).unwrap().state.environment.is_none());
    let trainer = Trainer::resume(config(), device(1), &ckpt).unwrap();
    assert!(
        trainer.env_changes().is_empty(),
        "{:?}",
        trainer.env_changes()
    );
}

#[test]
fn a_record_that_is_not_one_is_damage_named_by_the_state_file() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = checkpoint(tmp.path(), 1);
    rewrite_state(&ckpt, |s| s["environment"]["gpu"] = 5.into());
    let err = Trainer::resume(config(), device(1), &ckpt)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains(STATE_FILE) && err.contains("damaged"), "{err}");
}
