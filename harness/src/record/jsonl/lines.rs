//! The lines of a `ckpt-record/1` record, as docs/RECORD.md documents them: a `phase` line when
//! a phase starts, a `step` line per step, `save` and `resume` lines with a training state, and a
//! `phase_end` line once the trainer is released. Optional fields are left out when absent.

pub use crate::record::training_state::{OptimizerState, Params, Schedule, State};
use crate::record::Phase;
use ckpt_engine::data::SampleId;
use ckpt_engine::memory::Breakdown;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One line of a record, told apart by its `kind`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Line {
    /// A phase starts.
    Phase(Box<PhaseLine>),
    /// One optimizer step.
    Step(Box<StepLine>),
    /// One evaluation of the validation split.
    Eval(Box<EvalLine>),
    /// A checkpoint was saved.
    Save(Box<SaveLine>),
    /// A checkpoint was loaded, before the first resumed step.
    Resume(Box<ResumeLine>),
    /// The phase's trainer was released.
    PhaseEnd(Box<PhaseEndLine>),
}

/// The trainer that wrote a record.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Engine {
    /// Its name.
    pub name: String,
    /// Its version.
    pub version: String,
    /// Other versions that matter (`torch`, `numpy`, `python`), by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub libraries: Option<BTreeMap<String, String>>,
}

/// The step a phase resumed from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResumedFrom {
    /// Steps the checkpoint had taken.
    pub step: u64,
    /// The checkpoint's path or name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
}

/// The steps a phase trains: from `from`, stopping before `end`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Planned {
    /// The first step trained.
    pub from: u64,
    /// The step it stops before.
    pub end: u64,
    /// The schedule's horizon in steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub horizon: Option<u64>,
}

/// Facts of the run the checks need, on the reference's `phase` line.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Run {
    /// Decoder blocks.
    pub layers: u64,
    /// Parameters, tied ones once.
    pub params: u64,
    /// Whether activation checkpointing was on.
    pub checkpointing: bool,
    /// Samples in one epoch of the dataset.
    pub samples_per_epoch: u64,
    /// Samples in the whole dataset, where an epoch holds fewer (a validation share held out
    /// of training).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataset_samples: Option<u64>,
    /// Steps the reference saves after.
    pub planned_saves: Vec<u64>,
    /// Steps (completed) after which a phase evaluates its validation split.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub planned_evaluations: Vec<u64>,
    /// The device's bytes.
    pub capacity: u64,
    /// The per-step memory budget in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<u64>,
    /// The per-phase host memory budget in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_budget: Option<u64>,
}

/// `phase`: a phase starts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhaseLine {
    /// The record's version, [`super::VERSION`].
    pub record: String,
    /// Which phase.
    pub phase: Phase,
    /// The trial's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trial: Option<String>,
    /// The trainer.
    pub engine: Engine,
    /// What trains (`cpu`, `cuda`).
    pub device: String,
    /// The device's model name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_name: Option<String>,
    /// Ranks training together.
    pub world_size: u64,
    /// Every seed, by name.
    pub seeds: BTreeMap<String, u64>,
    /// `None` for a fresh start.
    pub resumed_from: Option<ResumedFrom>,
    /// The steps it trains.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planned: Option<Planned>,
    /// Facts of the run (the reference's line only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<Run>,
    /// Memory held before the trainer was built.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_before: Option<Memory>,
    /// Building the trainer: its peak and refusals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup: Option<Memory>,
    /// The writer's own data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extensions: Option<serde_json::Value>,
}

/// Memory figures in bytes, of one `source`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    /// What the figures measure: `engine` for the built-in engine's count of every allocation.
    pub source: String,
    /// The device measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Whether the peak was reset when the step began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_reset: Option<bool>,
    /// Bytes held at the end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated: Option<u64>,
    /// Bytes set aside at the end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved: Option<u64>,
    /// The peak of bytes held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated_peak: Option<u64>,
    /// The peak of bytes set aside.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_peak: Option<u64>,
    /// Bytes held when the step began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated_at_start: Option<u64>,
    /// Bytes per category at the end.
    #[serde(
        default,
        deserialize_with = "super::by_category::optional",
        skip_serializing_if = "Option::is_none"
    )]
    pub by_category: Option<Breakdown>,
    /// Bytes per category at the peak.
    #[serde(
        default,
        deserialize_with = "super::by_category::optional",
        skip_serializing_if = "Option::is_none"
    )]
    pub by_category_at_peak: Option<Breakdown>,
    /// Bytes per category when the step began.
    #[serde(
        default,
        deserialize_with = "super::by_category::optional",
        skip_serializing_if = "Option::is_none"
    )]
    pub by_category_at_start: Option<Breakdown>,
    /// Allocations refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_count: Option<u64>,
}

/// `step`: one optimizer step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepLine {
    /// Which phase.
    pub phase: Phase,
    /// The step's 0-based index.
    pub step: u64,
    /// The loss, exactly; `None` when not finite.
    pub loss: Option<f64>,
    /// The dtype the loss was computed in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_dtype: Option<String>,
    /// The learning rate applied; `None` when not finite.
    pub lr: Option<f64>,
    /// The gradient norm before clipping; `None` when not finite.
    pub grad_norm: Option<f64>,
    /// Tokens the loss counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// A digest of the batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_digest: Option<String>,
    /// The batch's samples, in row order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<Vec<SampleId>>,
    /// Blocks recomputed in backward.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recomputed_blocks: Option<u64>,
    /// The step's memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Memory>,
    /// Wall-clock seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
    /// The writer's own data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extensions: Option<serde_json::Value>,
}

/// `eval`: one evaluation of the validation split.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalLine {
    /// Which phase.
    pub phase: Phase,
    /// Steps completed when it ran.
    pub step: u64,
    /// The split's mean token loss, exactly; `None` when not finite.
    pub loss: Option<f64>,
    /// Tokens the loss counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// A digest of its batches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_digest: Option<String>,
    /// Its memory: `allocated_peak` the evaluation's peak.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Memory>,
    /// Every rank's peak, in rank order, on more than one rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_peaks: Option<Vec<u64>>,
    /// The writer's own data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extensions: Option<serde_json::Value>,
}

/// `save`: a checkpoint was saved.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SaveLine {
    /// Which phase.
    pub phase: Phase,
    /// Steps taken at the save.
    pub step: u64,
    /// The checkpoint's path or name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    /// Whether it was written in the background.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asynchronous: Option<bool>,
    /// The live state when the save was asked for.
    pub state: State,
    /// What the checkpoint held on disk once complete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_disk: Option<State>,
    /// Why the checkpoint could not be read back once complete, where it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreadable: Option<String>,
    /// An asynchronous save's files that differ from a synchronous save's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub differing_files: Option<Vec<String>>,
}

/// `resume`: a checkpoint was loaded.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResumeLine {
    /// Which phase.
    pub phase: Phase,
    /// Steps the checkpoint had taken.
    pub step: u64,
    /// The checkpoint's path or name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    /// The state loaded.
    pub state: State,
    /// The reference's state before the same step, as the reference run recorded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference_state: Option<State>,
    /// How the execution environment differs from the checkpoint's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub environment_changes: Vec<String>,
}

/// The out-of-memory error that ended a phase early.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Oom {
    /// The error, with where it happened.
    pub message: String,
    /// The step refused; absent while the trainer was being built.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// Bytes asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested: Option<u64>,
    /// Bytes held then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated: Option<u64>,
    /// Bytes held per category then.
    #[serde(
        default,
        deserialize_with = "super::by_category::optional",
        skip_serializing_if = "Option::is_none"
    )]
    pub by_category: Option<Breakdown>,
}

/// `phase_end`: the trainer was released.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhaseEndLine {
    /// Which phase.
    pub phase: Phase,
    /// Memory held after the trainer was released.
    pub memory_after: Memory,
    /// Resident host memory over the phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<Host>,
    /// The out-of-memory error that ended the phase early.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom: Option<Oom>,
    /// The error refusing the checkpoint the phase was to resume from, which ended it before
    /// its first step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// Wall-clock seconds of the phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
}

/// Resident host memory over a phase, where the platform reports it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Host {
    /// Resident bytes at the phase's start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_rss: Option<u64>,
    /// Peak resident bytes over the phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_rss: Option<u64>,
    /// Whether the peak was reset at the phase's start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset: Option<bool>,
}
