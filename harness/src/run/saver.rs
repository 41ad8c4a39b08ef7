//! The reference phase's checkpoint saves, made as the suite says and recorded as
//! [`SaveRecord`]s: a synchronous save read back at once, or an asynchronous one read back once
//! the trainer has finished it, beside a synchronous twin of the same state whose files it must
//! equal.

use crate::devices::DeviceKind;
use crate::record::saves::{SaveRecord, SavedState};
use crate::suite::Suite;
use anyhow::{Context, Result};
use ckpt_engine::checkpoint::{self, state_file, step_dir_name};
use ckpt_engine::{Device, StateDigest, Trainer};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Saves the reference phase's checkpoints as the suite says and records each.
pub struct Saver {
    run_dir: PathBuf,
    twin_dir: PathBuf,
    keep_last: Option<usize>,
    asynchronous: bool,
    staging_on_device: bool,
    pending: Option<SaveRecord>,
    records: Vec<SaveRecord>,
}

impl Saver {
    /// Saves into `run_dir` as `suite` says, on a device of `kind`; an asynchronous save's
    /// synchronous twin goes into `twin_dir`.
    pub fn new(suite: &Suite, kind: DeviceKind, run_dir: &Path, twin_dir: &Path) -> Self {
        Saver {
            run_dir: run_dir.to_path_buf(),
            twin_dir: twin_dir.to_path_buf(),
            keep_last: suite.file.training.keep_last,
            asynchronous: suite.file.training.async_save,
            staging_on_device: kind == DeviceKind::Cpu,
            pending: None,
            records: Vec::new(),
        }
    }

    /// Saves `trainer`'s state, whose digest is `digest`: synchronously, reading the checkpoint
    /// back at once; or asynchronously, after a synchronous save of the same state into the twin
    /// directory, the checkpoint read back by [`Saver::collect`] once the trainer has finished
    /// it.
    pub fn save<D: Device>(
        &mut self,
        trainer: &mut Trainer<D>,
        digest: &StateDigest,
    ) -> Result<()> {
        let mut record = SaveRecord {
            step: trainer.step_index(),
            asynchronous: self.asynchronous,
            in_memory: SavedState::in_memory(digest),
            ..SaveRecord::default()
        };
        if self.asynchronous {
            trainer.save(&self.twin_dir, Some(1))?;
            trainer.save_async(&self.run_dir, self.keep_last)?;
            self.pending = Some(record);
        } else {
            let dir = trainer.save(&self.run_dir, self.keep_last)?;
            read_back(&mut record, &dir);
            self.records.push(record);
        }
        Ok(())
    }

    /// Reads back the asynchronous save the trainer has finished (a step finishes the save
    /// before it), if one is waiting.
    pub fn collect(&mut self) -> Result<()> {
        let Some(mut record) = self.pending.take() else {
            return Ok(());
        };
        let name = step_dir_name(record.step);
        let dir = self.run_dir.join(&name);
        read_back(&mut record, &dir);
        record.differing_files = Some(differing_files(&dir, &self.twin_dir.join(&name))?);
        self.records.push(record);
        Ok(())
    }

    /// Finishes `trainer`'s save in flight and reads it back; returns every save recorded.
    pub fn finish<D: Device>(&mut self, trainer: &mut Trainer<D>) -> Result<Vec<SaveRecord>> {
        trainer.finish_saves()?;
        self.collect()?;
        Ok(std::mem::take(&mut self.records))
    }

    /// The bytes of `trainer`'s asynchronous save in flight counted on the device's own tracker
    /// (the CPU's; a GPU's staging is host memory).
    pub fn staging_on_device<D: Device>(&self, trainer: &Trainer<D>) -> u64 {
        if self.staging_on_device {
            trainer.staging_bytes()
        } else {
            0
        }
    }
}

/// Reads the complete checkpoint in `dir` back into `record`: what it holds, or why it cannot
/// be read.
fn read_back(record: &mut SaveRecord, dir: &Path) {
    match on_disk(dir) {
        Ok(disk) => record.on_disk = Some(disk),
        Err(e) => record.unreadable = Some(format!("{e:#}")),
    }
}

/// What the checkpoint in `dir` holds: its tensors' digests and its trainer state's steps.
fn on_disk(dir: &Path) -> Result<SavedState> {
    let [params, optimizer] = checkpoint::tensor_digests(dir)?;
    let state = state_file::read(dir)
        .map_err(ckpt_engine::EngineError::from)?
        .state;
    Ok(SavedState {
        step: state.global_step,
        optimizer_steps: state.optimizer_step,
        params,
        optimizer,
    })
}

/// The names of the files that differ between two checkpoint directories, or that one lacks.
pub fn differing_files(a: &Path, b: &Path) -> Result<Vec<String>> {
    let names = |dir: &Path| -> Result<BTreeSet<String>> {
        let entries =
            std::fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))?;
        entries
            .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
            .collect()
    };
    let (in_a, in_b) = (names(a)?, names(b)?);
    let mut differ = Vec::new();
    for name in in_a.union(&in_b) {
        let read = |dir: &Path| std::fs::read(dir.join(name)).ok();
        let (x, y) = (read(a), read(b));
        if x.is_none() || x != y {
            differ.push(name.clone());
        }
    }
    Ok(differ)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_that_differ_or_are_missing_are_named() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for (dir, same, other) in [(&a, "x", "1"), (&b, "x", "2")] {
            std::fs::write(dir.path().join("same"), same).unwrap();
            std::fs::write(dir.path().join("other"), other).unwrap();
        }
        std::fs::write(a.path().join("only-a"), "").unwrap();
        let differ = differing_files(a.path(), b.path()).unwrap();
        assert_eq!(differ, ["only-a", "other"]);
        assert!(differing_files(a.path(), a.path()).unwrap().is_empty());
    }
}
