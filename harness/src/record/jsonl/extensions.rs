//! What the built-in engine writes under `extensions["ckpt-engine"]` of its record's lines: the
//! figures of a [`RunRecord`](crate::record::RunRecord) the contract has no field for (the memory
//! model's predictions, the planned phases, the tracker's counters), so that its record reads
//! back into the same `RunRecord`.

use crate::record::ranks::{RankPhase, RankStep, WorldModel};
use crate::record::{PlannedPhase, PredictedStep};
use ckpt_engine::memory::Breakdown;
use serde::{Deserialize, Serialize};

/// The key the engine's extensions are written under.
pub const KEY: &str = "ckpt-engine";

/// The memory model's prediction for a step without AdamW's moments and one with them.
pub type Predicted = [PredictedStep; 2];

/// On a `phase` line; the run's fields on the reference's only.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PhaseExt {
    /// Wall-clock seconds of building or loading the trainer.
    pub setup_seconds: f64,
    /// The suite's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suite: Option<String>,
    /// Every phase the suite plans, run or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planned: Option<Vec<PlannedPhase>>,
    /// The memory model's step predictions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<Predicted>,
    /// The same for a `long_batch`'s rows, and the step they start at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_long: Option<(u64, Predicted)>,
    /// The memory model's peak while a checkpoint is loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_load: Option<u64>,
    /// The memory model's staging bytes of an asynchronous save on the device's tracker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_staging: Option<u64>,
    /// Each rank's memory model at each world size the phases run at (several ranks only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worlds: Option<Vec<WorldModel>>,
    /// Each rank's figures of this phase, on several ranks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankPhase>,
}

/// On a `step` line.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StepExt {
    /// Each block's tokens per expert (a MoE model's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens_per_expert: Vec<Vec<u32>>,
    /// A MoE step's own prediction at its routing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<Predicted>,
    /// Bytes of an asynchronous save's staging buffers held when the step began.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub staging: u64,
    /// Each category's own peak over the step.
    pub peak_by_category: Breakdown,
    /// The tracker's capacity.
    pub capacity: u64,
    /// Allocations the tracker made so far.
    pub alloc_count: u64,
    /// Each rank's figures of this step, on several ranks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankStep>,
}

/// On an `eval` line.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EvalExt {
    /// The memory model's peak of each rank, in rank order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub predicted_peaks: Vec<u64>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
