//! The reference phase's checkpoint saves, and what `checkpoint_equivalence` reads of each: the
//! state digest taken in memory at the save, the digest of what the checkpoint holds on disk once
//! it is complete, and, for an asynchronous save, which files differ from a synchronous save of
//! the same state written into a directory of their own.

use crate::devices::DeviceKind;
use crate::suite::Suite;
use crate::training_state::State;
use anyhow::{Context, Result};
use ckpt_engine::checkpoint::{self, state_file, step_dir_name};
use ckpt_engine::{Device, StateDigest, Trainer};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The part of a training state a checkpoint holds that `checkpoint_equivalence` compares.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SavedState {
    /// Steps taken.
    pub step: u64,
    /// AdamW updates taken.
    pub optimizer_steps: u64,
    /// sha256 over the `model.safetensors` tensors.
    pub params: String,
    /// sha256 over the `optimizer.safetensors` tensors.
    pub optimizer: String,
}

impl SavedState {
    /// The live state's, from its digest.
    pub fn in_memory(d: &StateDigest) -> Self {
        SavedState {
            step: d.step,
            optimizer_steps: d.optimizer_steps,
            params: d.params.clone(),
            optimizer: d.optimizer.clone(),
        }
    }

    /// What the checkpoint in `dir` holds: its tensors' digests and its trainer state's steps.
    pub fn on_disk(dir: &Path) -> Result<Self> {
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
}

/// One checkpoint save of the reference phase.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SaveRecord {
    /// The step saved (steps taken).
    pub step: u64,
    /// Whether it was written in the background (`training.async_save`).
    pub asynchronous: bool,
    /// The live state when the save was asked for.
    pub in_memory: SavedState,
    /// What the checkpoint held on disk once complete; `None` if it was never read.
    pub on_disk: Option<SavedState>,
    /// Why the checkpoint could not be read back, where it could not (its digests refused).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unreadable: Option<String>,
    /// For an asynchronous save, the files of the checkpoint that differ from (or are missing
    /// in either of) a synchronous save of the same state; `None` when not compared.
    pub differing_files: Option<Vec<String>>,
    /// The saved state as another trainer's record names it, by name; `None` in the engine's
    /// records, whose digests above say it all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub named: Option<State>,
}

impl SaveRecord {
    /// Reads the complete checkpoint in `dir` back: what it holds, or why it cannot be read.
    fn read_back(&mut self, dir: &Path) {
        match SavedState::on_disk(dir) {
            Ok(disk) => self.on_disk = Some(disk),
            Err(e) => self.unreadable = Some(format!("{e:#}")),
        }
    }
}

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
            record.read_back(&dir);
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
        record.read_back(&dir);
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
