//! What the record holds of each checkpoint save of the reference phase, which
//! `checkpoint_equivalence` reads: the state digest taken in memory at the save, the digest of
//! what the checkpoint holds on disk once it is complete, and, for an asynchronous save, which
//! files differ from a synchronous save of the same state written into a directory of their own.
//! The saving, and reading a checkpoint back, are the runner's (`run::saver`).

use crate::record::training_state::State;
use ckpt_engine::StateDigest;
use serde::{Deserialize, Serialize};

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
