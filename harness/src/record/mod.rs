//! The record of a trial: every phase's steps, memory, digests, saves and resumes, and the memory
//! model's predictions. The checks read only this, whoever recorded it: the phases run here, or
//! another trainer's published record ([`crate::record::jsonl`]).

pub mod fields;
pub mod jsonl;
pub mod ranks;
pub mod saves;
pub mod training_state;

use crate::record::fields::RecordField;
use crate::record::saves::SaveRecord;
use crate::record::training_state::State;
use ckpt_engine::data::SampleId;
use ckpt_engine::memory::{Breakdown, OutOfMemory};
use ckpt_engine::{EnvChange, MemoryStats, StateDigest};
use ranks::{RankPhase, RankStep, WorldModel};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeSet;

/// Which phase a record belongs to. Written as `reference`, `resume-mid`, `resume-mid-N` (the
/// `N`th resume of a chain, from 2) and `resume-end`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// The uninterrupted run.
    #[default]
    Reference,
    /// Resumed from the reference's mid-run checkpoint (the first resume point).
    ResumeMid,
    /// The `n`th resume of a chain (`n` from 2): resumed from the checkpoint the phase before it
    /// in the chain saved at resume point `n`.
    ResumeChained(u32),
    /// Resumed from the `max_steps` checkpoint, training past it.
    ResumeEnd,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Phase::Reference => f.write_str("reference"),
            Phase::ResumeMid => f.write_str("resume-mid"),
            Phase::ResumeChained(n) => write!(f, "resume-mid-{n}"),
            Phase::ResumeEnd => f.write_str("resume-end"),
        }
    }
}

impl std::str::FromStr for Phase {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let chained = s
            .strip_prefix("resume-mid-")
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|&n| n >= 2);
        match (s, chained) {
            ("reference", _) => Ok(Phase::Reference),
            ("resume-mid", _) => Ok(Phase::ResumeMid),
            ("resume-end", _) => Ok(Phase::ResumeEnd),
            (_, Some(n)) => Ok(Phase::ResumeChained(n)),
            _ => Err(format!(
                "unknown phase {s:?}: expected reference, resume-mid, resume-mid-N (N from 2) or resume-end"
            )),
        }
    }
}

impl Serialize for Phase {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Phase {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl Phase {
    /// The phase of resume `n` of a chain (1-based): `resume-mid` for the first.
    pub fn chained(n: usize) -> Phase {
        match n {
            0 | 1 => Phase::ResumeMid,
            n => Phase::ResumeChained(u32::try_from(n).unwrap_or(u32::MAX)),
        }
    }
}

/// A float that JSON may hold as `null` (how serde_json writes NaN and infinities): read as NaN.
fn float_or_null<'de, D: Deserializer<'de>, F: From<f32> + Deserialize<'de>>(
    d: D,
) -> Result<F, D::Error> {
    Ok(Option::<F>::deserialize(d)?.unwrap_or_else(|| F::from(f32::NAN)))
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One training step as observed.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct StepRecord {
    /// 0-based step index.
    pub step: u64,
    /// Mean loss (`null` in JSON when not finite).
    #[serde(deserialize_with = "float_or_null")]
    pub loss: f32,
    /// Learning rate applied.
    #[serde(deserialize_with = "float_or_null")]
    pub lr: f64,
    /// Gradient norm before clipping (`null` in JSON when not finite).
    #[serde(deserialize_with = "float_or_null")]
    pub grad_norm: f64,
    /// sha256 of the batch's token ids and labels.
    pub batch_digest: String,
    /// The samples of the batch's rows, in row order.
    pub samples: Vec<SampleId>,
    /// Blocks recomputed in backward.
    pub recomputed_blocks: usize,
    /// Each block's tokens per expert (empty for a dense block); empty for a dense model.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tokens_per_expert: Vec<Vec<u32>>,
    /// A MoE step's own memory model, at the routing it recorded: the prediction for a step
    /// without and with AdamW's moments (a dense step uses the run's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted: Option<[PredictedStep; 2]>,
    /// Bytes held per category when the step began.
    pub start: Breakdown,
    /// Bytes of an asynchronous save's staging buffers held on the device's tracker when the
    /// step began (0 when no save was in flight, and on a GPU, whose staging is host memory).
    #[serde(skip_serializing_if = "is_zero")]
    pub staging: u64,
    /// The step's memory figures: `allocated.peak` is the step peak, `current` the bytes held
    /// at its end, `at_peak` the categories at the peak.
    pub memory: MemoryStats,
    /// Wall-clock seconds of the step.
    pub seconds: f64,
    /// Every rank's figures, in rank order, on more than one rank (the figures above are rank
    /// 0's); empty on one device.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankStep>,
}

/// One evaluation of the validation split as observed.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct EvalRecord {
    /// Steps completed when it ran.
    pub step: u64,
    /// The split's mean token loss (`null` in JSON when not finite).
    #[serde(deserialize_with = "float_or_null")]
    pub loss: f32,
    /// Labels the loss counted.
    pub tokens: u64,
    /// sha256 of its micro-batches' token ids and labels.
    pub batch_digest: String,
    /// Its memory figures: `allocated.peak` is the evaluation's peak.
    pub memory: MemoryStats,
    /// Every rank's peak, in rank order, on more than one rank (`memory` is rank 0's).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rank_peaks: Vec<u64>,
    /// The memory model's peak of each rank, in rank order (one entry on one device); empty
    /// where the trainer has no memory model.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub predicted_peaks: Vec<u64>,
}

/// The device's peak over one call, such as loading a checkpoint.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Window {
    /// Peak allocated bytes over the call.
    pub peak: u64,
    /// Bytes per category at that peak.
    pub at_peak: Breakdown,
    /// Allocations refused during the call.
    pub oom_count: u64,
}

/// The process's resident host memory over one phase.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct HostMemory {
    /// Resident bytes (`VmRSS`) at the phase's start, when the platform reports them.
    pub start_rss: Option<u64>,
    /// Peak resident bytes (`VmHWM`), when the platform reports it.
    pub peak_rss: Option<u64>,
    /// Whether the peak was reset at the phase's start; if not, it covers the process so far.
    pub reset: bool,
}

impl HostMemory {
    /// The resident bytes the phase added at its peak: the peak above the phase's start, when
    /// the platform reports both (the whole peak where the start is unknown).
    pub fn growth(&self) -> Option<u64> {
        let peak = self.peak_rss?;
        Some(peak.saturating_sub(self.start_rss.unwrap_or(0)))
    }
}

/// One phase as observed.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct PhaseRecord {
    /// Which phase.
    pub phase: Phase,
    /// Bytes held per category before the phase's trainer was built.
    pub before: Breakdown,
    /// Bytes held per category after it was dropped.
    pub after: Breakdown,
    /// Building the trainer: fresh weights, or loading the checkpoint.
    pub setup: Window,
    /// The resumed trainer's state before its first step.
    pub resumed_digest: Option<StateDigest>,
    /// The reference trainer's state before the same step.
    pub reference_digest: Option<StateDigest>,
    /// The resumed state as another trainer's record names it (parameters and optimizer state
    /// by name, every generator, the data position), where it is not the engine's digest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resumed_state: Option<State>,
    /// How the execution environment recorded in the checkpoint it resumed from differs from
    /// the device's, field by field: empty for the reference, when nothing differs, and in
    /// summaries written before it was recorded.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub env_changes: Vec<EnvChange>,
    /// Host memory over the phase.
    pub host: HostMemory,
    /// Its steps.
    pub steps: Vec<StepRecord>,
    /// Its evaluations of the validation split, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub evaluations: Vec<EvalRecord>,
    /// The checkpoints it saved.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub saves: Vec<SaveRecord>,
    /// The out-of-memory error that ended the phase early, if one did.
    pub oom: Option<Oom>,
    /// The error refusing the checkpoint the phase resumes from, if its load was refused (a
    /// damaged or incomplete checkpoint): the phase trained no step and the run ended there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// Wall-clock seconds of building or loading the trainer.
    pub setup_seconds: f64,
    /// Wall-clock seconds of the whole phase, the trainer's drop included.
    pub seconds: f64,
    /// Every rank's figures, in rank order, on more than one rank (`before`, `after` and
    /// `setup` above are rank 0's); empty on one device.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankPhase>,
}

/// An allocation the device refused, ending a phase early.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Oom {
    /// The error as the engine words it, with where it happened.
    pub message: String,
    /// The step that was refused; `None` while the trainer was being built.
    pub step: Option<u64>,
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes held when they were asked for.
    pub allocated: u64,
    /// Bytes held per category when they were asked for.
    pub by_category: Breakdown,
}

impl Oom {
    /// The refusal `e`, at `step` (`None`: while building the trainer).
    pub(crate) fn new(step: Option<u64>, e: &OutOfMemory) -> Self {
        let at = step.map_or("building the trainer".into(), |s| format!("step {s}"));
        Oom {
            message: format!("{at}: {e}"),
            step,
            requested: e.requested,
            allocated: e.allocated,
            by_category: e.by_category,
        }
    }
}

/// The memory model's prediction of one step.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct PredictedStep {
    /// Bytes held per category when the step starts.
    pub start: Breakdown,
    /// Step peak in bytes.
    pub peak: u64,
    /// Bytes per category at the peak.
    pub at_peak: Breakdown,
}

/// A phase as the suite plans it: the trainer is built (fresh, or from the checkpoint of step
/// `from`) and trains the steps `from..end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedPhase {
    /// Which phase.
    pub phase: Phase,
    /// The first step it trains (the checkpoint it resumes from, 0 for the reference).
    pub from: u64,
    /// The step it stops before.
    pub end: u64,
    /// The ranks it runs on (the suite's `parallel`); 1 when not written.
    #[serde(default = "one_rank", skip_serializing_if = "is_one_rank")]
    pub world_size: usize,
}

fn one_rank() -> usize {
    1
}

fn is_one_rank(n: &usize) -> bool {
    *n == 1
}

impl PlannedPhase {
    /// The steps it trains.
    pub fn steps(&self) -> u64 {
        self.end.saturating_sub(self.from)
    }
}

/// Everything a trial observed; checks read only this.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RunRecord {
    /// The trial's name: `device::suite`, or `device::faults::suite` for a negative control.
    pub name: String,
    /// Suite name.
    pub suite: String,
    /// Device name (`cpu`, `cuda`).
    pub device: String,
    /// Decoder blocks in the model.
    pub layers: usize,
    /// Parameters in the model (tied embeddings counted once).
    pub params: u64,
    /// Whether activation checkpointing was on.
    pub checkpointing: bool,
    /// The memory model's prediction for a step without AdamW moments yet and one with them.
    pub predicted: [PredictedStep; 2],
    /// The same for the long rows of a suite's `long_batch`, and the step they start at.
    pub predicted_long: Option<(u64, [PredictedStep; 2])>,
    /// The memory model's peak while a checkpoint is loaded (a resumed trainer is built).
    pub predicted_load: u64,
    /// The memory model's staging bytes of an asynchronous save on the device's tracker, held by
    /// the step after the save (0 on a GPU, whose staging is host memory).
    pub predicted_staging: u64,
    /// The steps after which the reference phase saves a checkpoint.
    pub planned_saves: Vec<u64>,
    /// Steps (completed) after which a phase that trains past them evaluates its validation
    /// split; empty without one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub planned_evaluations: Vec<u64>,
    /// The device's capacity in bytes.
    pub capacity: u64,
    /// The per-step budget in bytes, if the suite sets one.
    pub budget: Option<u64>,
    /// The per-phase host memory budget in bytes, if the suite sets one.
    pub rss_budget: Option<u64>,
    /// Samples in one epoch of the dataset.
    pub samples_per_epoch: u64,
    /// Samples in the whole dataset, where an epoch holds fewer (a validation share held out
    /// of training); `None` where it is the epoch's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataset_samples: Option<u64>,
    /// The phases the suite implies, in order: what a complete record holds.
    pub planned: Vec<PlannedPhase>,
    /// The phases in order.
    pub phases: Vec<PhaseRecord>,
    /// The memory model of every rank at each world size the phases run at, when any runs on
    /// more than one rank (the predictions above are then rank 0's at the reference's world
    /// size); empty on one device.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub worlds: Vec<WorldModel>,
    /// The optional parts of the record its trainer did not record (another trainer's record
    /// read back); the checks that need one are not applicable. Empty for the built-in engine,
    /// which records every one.
    #[serde(skip_serializing_if = "BTreeSet::is_empty")]
    pub lacks: BTreeSet<RecordField>,
    /// The record's own text, for a run read from a `ckpt-record/1` record written elsewhere:
    /// what the report's `records/` keeps, in place of the engine's lines. Not in summaries.
    #[serde(skip)]
    pub text: Option<String>,
}

impl RunRecord {
    /// The reference phase, if it was recorded.
    pub fn reference(&self) -> Option<&PhaseRecord> {
        self.phases.iter().find(|p| p.phase == Phase::Reference)
    }

    /// The trial's name, as failures and reports write it.
    pub fn trial(&self) -> String {
        self.name.clone()
    }

    /// The memory model's prediction for step `step`: long rows from their first step, and the
    /// step that allocates AdamW's moments (a fresh run's first) apart from the others.
    pub fn predicted_for(&self, step: u64, first_of_fresh_run: bool) -> &PredictedStep {
        let moments = usize::from(!first_of_fresh_run);
        match &self.predicted_long {
            Some((from, long)) if step >= *from => &long[moments],
            _ => &self.predicted[moments],
        }
    }

    /// The memory model's staging bytes held on the device's tracker when step `s` began: the
    /// model's for a step that began with an asynchronous save in flight, else 0.
    pub fn staging_for(&self, s: &StepRecord) -> u64 {
        if s.staging > 0 {
            self.predicted_staging
        } else {
            0
        }
    }

    /// Whether an out-of-memory error, or a refused checkpoint, ended a phase early (and the
    /// later phases never ran).
    pub fn ended_early(&self) -> bool {
        self.phases
            .iter()
            .any(|p| p.oom.is_some() || p.refused.is_some())
    }

    /// The planned phases that resume from a checkpoint.
    pub fn planned_resumes(&self) -> impl Iterator<Item = &PlannedPhase> {
        self.planned.iter().filter(|p| p.phase != Phase::Reference)
    }

    /// The steps every planned phase trains, added up.
    pub fn planned_steps(&self) -> u64 {
        self.planned.iter().map(PlannedPhase::steps).sum()
    }
}
