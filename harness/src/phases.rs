//! The phases of a trial, sharing one reference trajectory: `reference` trains
//! `max_steps + extra_steps` with the schedule's horizon pinned at `max_steps`, saving at
//! `resume_from` and `max_steps`; `resume-mid` and `resume-end` resume from those checkpoints
//! and train to the same end. With a chain of resume points (`resume_from: [a, b, c]`),
//! `resume-mid` resumes from the reference's checkpoint at `a` and saves at `b` into its own
//! run directory, `resume-mid-2` resumes from that and saves at `c`, and `resume-mid-3` resumes
//! from the checkpoint `resume-mid-2` saved. Every step is recorded; the trainer is dropped
//! between phases and the device's bytes read before and after. A [`Watch`] is told as each
//! phase and step starts and ends (progress, memory traces).

pub mod processes;
pub mod rank_record;

use crate::devices::{self, DeviceKind, OnDevice};
use crate::host_memory;
use crate::record_fields::RecordField;
use crate::saves::{SaveRecord, Saver};
use crate::suite::Suite;
use crate::training_state::State;
use anyhow::Result;
use ckpt_engine::backend::count::{Like, Routes};
use ckpt_engine::checkpoint::step_dir_name;
use ckpt_engine::data::SampleId;
use ckpt_engine::estimate::{estimate, routed_rank_steps, EstimateConfig, StepEstimate};
use ckpt_engine::memory::{Breakdown, MemoryTracker, OutOfMemory};
use ckpt_engine::{
    Device, EngineError, EnvChange, MemoryStats, Placing, StateDigest, StepStats, Trainer,
};
use rank_record::{RankModel, RankPhase, RankStep, WorldModel};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

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
    fn new(step: Option<u64>, e: &OutOfMemory) -> Self {
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
    /// The device's capacity in bytes.
    pub capacity: u64,
    /// The per-step budget in bytes, if the suite sets one.
    pub budget: Option<u64>,
    /// The per-phase host memory budget in bytes, if the suite sets one.
    pub rss_budget: Option<u64>,
    /// Samples in one epoch of the dataset.
    pub samples_per_epoch: u64,
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

/// What a caller is told while the phases run (progress, memory traces); every method does
/// nothing unless implemented.
pub trait Watch {
    /// `phase` begins: its trainer is about to be built (or loaded at step `from`) on the device
    /// whose bytes `tracker` counts, then trained until step `end`.
    fn phase_started(&mut self, _phase: Phase, _from: u64, _end: u64, _tracker: &MemoryTracker) {}
    /// Step `step` of `phase` is about to run.
    fn step_started(&mut self, _phase: Phase, _step: u64) {}
    /// A step of `phase` ran.
    fn step_done(&mut self, _phase: Phase, _step: &StepRecord) {}
    /// The trainer of `phase` is about to be dropped.
    fn releasing(&mut self, _phase: Phase) {}
    /// A phase ended, its trainer dropped.
    fn phase_done(&mut self, _record: &PhaseRecord, _tracker: &MemoryTracker) {}
}

/// Watches nothing.
impl Watch for () {}

/// Tells both, the first first.
impl<A: Watch, B: Watch> Watch for (A, B) {
    fn phase_started(&mut self, phase: Phase, from: u64, end: u64, tracker: &MemoryTracker) {
        self.0.phase_started(phase, from, end, tracker);
        self.1.phase_started(phase, from, end, tracker);
    }
    fn step_started(&mut self, phase: Phase, step: u64) {
        self.0.step_started(phase, step);
        self.1.step_started(phase, step);
    }
    fn step_done(&mut self, phase: Phase, step: &StepRecord) {
        self.0.step_done(phase, step);
        self.1.step_done(phase, step);
    }
    fn releasing(&mut self, phase: Phase) {
        self.0.releasing(phase);
        self.1.releasing(phase);
    }
    fn phase_done(&mut self, record: &PhaseRecord, tracker: &MemoryTracker) {
        self.0.phase_done(record, tracker);
        self.1.phase_done(record, tracker);
    }
}

/// Tells the watch when there is one.
impl<W: Watch> Watch for Option<W> {
    fn phase_started(&mut self, phase: Phase, from: u64, end: u64, tracker: &MemoryTracker) {
        if let Some(w) = self {
            w.phase_started(phase, from, end, tracker);
        }
    }
    fn step_started(&mut self, phase: Phase, step: u64) {
        if let Some(w) = self {
            w.step_started(phase, step);
        }
    }
    fn step_done(&mut self, phase: Phase, step: &StepRecord) {
        if let Some(w) = self {
            w.step_done(phase, step);
        }
    }
    fn releasing(&mut self, phase: Phase) {
        if let Some(w) = self {
            w.releasing(phase);
        }
    }
    fn phase_done(&mut self, record: &PhaseRecord, tracker: &MemoryTracker) {
        if let Some(w) = self {
            w.phase_done(record, tracker);
        }
    }
}

fn window(stats: &MemoryStats, oom_before: u64) -> Window {
    Window {
        peak: stats.allocated.peak,
        at_peak: stats.at_peak,
        oom_count: stats.oom_count - oom_before,
    }
}

/// The phases `suite` implies, in the order they run: the reference; a resume from each of its
/// resume points (`resume-mid`, then `resume-mid-2` ... for a chain); `resume-end` from
/// `max_steps`. Each trains to `max_steps + extra_steps`.
pub fn plan(suite: &Suite) -> Vec<PlannedPhase> {
    let end = suite.max_steps() + suite.file.training.extra_steps;
    let chain = suite.resume_points().into_iter().enumerate();
    std::iter::once((Phase::Reference, 0))
        .chain(chain.map(|(k, from)| (Phase::chained(k + 1), from)))
        .chain([(Phase::ResumeEnd, suite.max_steps())])
        .zip(suite.world_sizes())
        .map(|((phase, from), world_size)| PlannedPhase {
            phase,
            from,
            end,
            world_size,
        })
        .collect()
}

/// How one planned phase runs: the checkpoint it resumes from and where it saves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Leg {
    /// Which phase.
    pub(crate) phase: Phase,
    /// The run directory holding the checkpoint it resumes from, and its step; `None` for the
    /// reference's fresh trainer.
    pub(crate) resumes: Option<(PathBuf, u64)>,
    /// The run directory it saves into, when a later phase resumes from it: the reference's,
    /// and each resume of a chain but the last.
    pub(crate) saves_into: Option<PathBuf>,
}

/// How each phase of `planned` runs, its checkpoints under `work`: the reference saves into
/// `checkpoints`, and `resume-end` and the first resume load from there; each later resume of
/// a chain loads from the run directory of the one before, `checkpoints-<phase>`.
pub(crate) fn legs(planned: &[PlannedPhase], work: &Path) -> Vec<Leg> {
    let reference = work.join("checkpoints");
    let last_of_chain = planned
        .iter()
        .rfind(|p| matches!(p.phase, Phase::ResumeMid | Phase::ResumeChained(_)))
        .map(|p| p.phase);
    let mut previous = reference.clone();
    planned
        .iter()
        .map(|p| match p.phase {
            Phase::Reference => Leg {
                phase: p.phase,
                resumes: None,
                saves_into: Some(reference.clone()),
            },
            Phase::ResumeEnd => Leg {
                phase: p.phase,
                resumes: Some((reference.clone(), p.from)),
                saves_into: None,
            },
            phase => {
                let own = work.join(format!("checkpoints-{phase}"));
                let resumes = Some((std::mem::replace(&mut previous, own.clone()), p.from));
                Leg {
                    phase,
                    resumes,
                    saves_into: (Some(phase) != last_of_chain).then_some(own),
                }
            }
        })
        .collect()
}

/// The trackers of `trainer`'s ranks on more than one rank, in rank order; none on one device.
/// A trainer of one rank among processes of their own (`of_process`) has its own rank's.
fn rank_trackers<D: Device>(trainer: &Trainer<D>, of_process: bool) -> Vec<MemoryTracker> {
    match trainer.ranks() {
        [_] if !of_process => Vec::new(),
        ranks => ranks.iter().map(|s| s.device().tracker().clone()).collect(),
    }
}

/// The memory model of every rank at each world size `planned` runs at, in order of first
/// use, when any phase runs on more than one rank; empty otherwise. A rank's capacity is the one
/// [`Device::ranks`] gives it on `dev` ([`Device::rank_capacity`]): an equal share of one
/// device's, or a whole GPU's where each rank has its own.
fn world_models<D: Device>(
    suite: &Suite,
    like: Like,
    planned: &[PlannedPhase],
    dev: &D,
) -> Result<Vec<WorldModel>> {
    if planned.iter().all(|p| p.world_size == 1) {
        return Ok(Vec::new());
    }
    let mut sizes: Vec<usize> = Vec::new();
    for p in planned {
        if !sizes.contains(&p.world_size) {
            sizes.push(p.world_size);
        }
    }
    let pair =
        |ranks: &[[StepEstimate; 2]], first: &StepEstimate, later: &StepEstimate, r: usize| {
            match ranks.get(r) {
                Some([a, b]) => [predict(a), predict(b)],
                None => [predict(first), predict(later)],
            }
        };
    sizes
        .into_iter()
        .map(|world_size| {
            let model = estimate(&EstimateConfig::from_train(
                &suite.train_at(world_size),
                like,
            ))?;
            let capacity = dev.rank_capacity(world_size);
            let process_staging = model.save_staging_on_process_ranks();
            let ranks = (0..world_size)
                .map(|r| {
                    let predicted = pair(&model.ranks, &model.first_step, &model.later_step, r);
                    RankModel {
                        predicted_load: predicted[1].start.total(),
                        predicted,
                        predicted_long: model.long_batch.as_ref().map(|l| {
                            (l.from_step, pair(&l.ranks, &l.first_step, &l.later_step, r))
                        }),
                        predicted_staging: match suite.rank_processes() {
                            true => process_staging.get(r).copied().unwrap_or(0),
                            false if r == 0 => model.save_staging_on_device(),
                            false => 0,
                        },
                        capacity,
                        budget: suite.budget().map(|b| b.bytes(capacity)),
                    }
                })
                .collect();
            Ok(WorldModel { world_size, ranks })
        })
        .collect()
}

/// The steps a throwaway trainer runs before the first phase (see [`warm_up`]): one, where every
/// step multiplies matrices of the same shapes; every step of the reference for a MoE model,
/// whose expert products take their shapes from each step's routing (on an H200 a Qwen3-MoE
/// reference added 9.5 MiB of resident memory after one step of warm-up).
fn warm_up_steps(suite: &Suite, end: u64) -> u64 {
    let model = &suite.train.model;
    let moe = model.moe.as_ref();
    if moe.is_some_and(|m| (0..model.num_hidden_layers).any(|l| m.is_moe_layer(l))) {
        end
    } else {
        1
    }
}

/// Steps of a throwaway trainer of the suite's first phase, without its faults, so that the
/// code the device's libraries load at first use is resident before the first phase's host
/// memory is measured. Its errors are the phases' to meet and report.
fn warm_up<D: Device>(suite: &Suite, world_size: usize, steps: u64, dev: &D) {
    let mut train = suite.train_at(world_size);
    train.faults = Default::default();
    if let Ok(mut trainer) = Trainer::new(train, dev.clone()) {
        while trainer.step_index() < steps && trainer.step().is_ok() {}
    }
}

/// Runs the phases of `suite` (see [`plan`]) on a device of `kind`, checkpoints under `work`; `watch` is
/// told as each phase and step starts and ends. An allocation the device refuses ends the run
/// early and is recorded, not returned as an error. With `parallel.processes`, each phase's
/// ranks run as processes of their own (see [`processes`]).
pub fn run(
    suite: &Suite,
    kind: DeviceKind,
    work: &Path,
    watch: &mut impl Watch,
) -> Result<RunRecord> {
    let phases = Phases {
        suite,
        kind,
        work,
        watch,
    };
    devices::run_on(kind, suite.file.threads, suite.capacity(), phases)
}

/// The phases of one trial, as work for whichever device the trial names.
struct Phases<'a, W> {
    suite: &'a Suite,
    kind: DeviceKind,
    work: &'a Path,
    watch: &'a mut W,
}

/// The memory model's prediction of a step, as a record keeps it.
fn predict(s: &StepEstimate) -> PredictedStep {
    PredictedStep {
        start: s.start,
        peak: s.peak,
        at_peak: s.at_peak,
    }
}

impl<W: Watch> OnDevice for Phases<'_, W> {
    type Output = RunRecord;

    fn run<D: Device>(self, dev: D) -> Result<RunRecord> {
        let Phases {
            suite,
            kind,
            work,
            watch,
        } = self;
        let trial = Trial::new(suite, kind, work, &dev);
        let model = estimate(&EstimateConfig::from_train(&suite.train, trial.like))?;
        let predicted = [false, true].map(|moments| predict(model.step(moments)));
        let predicted_long = model.long_batch.as_ref().map(|long| {
            (
                long.from_step,
                [predict(&long.first_step), predict(&long.later_step)],
            )
        });
        let planned = plan(suite);
        let worlds = world_models(suite, trial.like, &planned, &dev)?;
        let in_processes = suite.rank_processes();
        if devices::warms_up(kind) && !in_processes {
            let world_size = planned.first().map_or(1, |p| p.world_size);
            warm_up(suite, world_size, warm_up_steps(suite, trial.end()), &dev);
        }
        let mut reference_digests: BTreeMap<u64, StateDigest> = BTreeMap::new();
        let mut samples_per_epoch = 0;
        let mut phases = Vec::new();
        for leg in legs(&planned, work) {
            let world = planned
                .iter()
                .find(|p| p.phase == leg.phase)
                .map_or(1, |p| p.world_size);
            let ran = if in_processes {
                processes::phase(&trial, &leg, world, &reference_digests, watch)?
            } else {
                trial.phase(&leg, world, Placing::Here, &reference_digests, watch)?
            };
            reference_digests.extend(ran.digests);
            samples_per_epoch = ran.samples_per_epoch.unwrap_or(samples_per_epoch);
            let stop = ran.record.oom.is_some() || ran.record.refused.is_some();
            phases.push(ran.record);
            if stop {
                break;
            }
        }
        Ok(RunRecord {
            name: suite.trial_name(kind),
            suite: suite.file.name.clone(),
            device: kind.name().into(),
            layers: suite.train.model.num_hidden_layers,
            params: suite.train.model.num_params() as u64,
            checkpointing: suite.train.checkpointing != ckpt_engine::Checkpointing::None,
            predicted,
            predicted_long,
            predicted_load: model.checkpoint_io,
            predicted_staging: model.save_staging_on_device(),
            planned_saves: suite.planned_saves(),
            capacity: dev.tracker().capacity(),
            budget: suite.budget().map(|b| b.bytes(dev.tracker().capacity())),
            rss_budget: suite.file.memory.rss_budget,
            samples_per_epoch,
            planned,
            phases,
            worlds,
            lacks: BTreeSet::new(),
            text: None,
        })
    }
}

/// One phase as it ran: its record, the reference's state digests it took (at each resume
/// point and at `max_steps`) for the resumes to be compared with, and the samples in an epoch
/// of its data (`None` where no trainer was built).
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct PhaseRun {
    /// The phase's record.
    pub(crate) record: PhaseRecord,
    /// The reference's state before each step it was digested at.
    pub(crate) digests: BTreeMap<u64, StateDigest>,
    /// Samples in one epoch of the dataset.
    pub(crate) samples_per_epoch: Option<u64>,
}

/// The trial a phase belongs to, on the device it runs on.
pub(crate) struct Trial<'a, D> {
    /// The suite.
    pub(crate) suite: &'a Suite,
    /// The device's kind.
    pub(crate) kind: DeviceKind,
    /// Where the run directories are.
    pub(crate) work: &'a Path,
    /// The device.
    pub(crate) dev: &'a D,
    /// The device as the memory model counts it.
    pub(crate) like: Like,
}

impl<'a, D: Device> Trial<'a, D> {
    /// `suite`'s trial on `dev`, a device of `kind`, run directories under `work`.
    pub(crate) fn new(suite: &'a Suite, kind: DeviceKind, work: &'a Path, dev: &'a D) -> Self {
        Trial {
            suite,
            kind,
            work,
            dev,
            like: Like::new(kind, suite.file.threads),
        }
    }

    /// The step every phase stops before: `max_steps + extra_steps`.
    pub(crate) fn end(&self) -> u64 {
        self.suite.max_steps() + self.suite.file.training.extra_steps
    }

    /// A MoE step's memory model on each rank of `world`, at the tokens per expert it recorded
    /// (each rank's at its own micro-batches'); empty for a dense step, whose model is the run's.
    fn routed(&self, world: usize, s: &StepStats) -> Result<Vec<[PredictedStep; 2]>> {
        if s.tokens_per_expert.is_empty() {
            return Ok(Vec::new());
        }
        let cfg = EstimateConfig::from_train(&self.suite.train_at(world), self.like)
            .with_routes(Routes::Recorded(s.tokens_per_expert.clone()));
        let ranks = routed_rank_steps(&cfg, self.suite.train.seq_len_at(s.step))?;
        Ok(ranks
            .iter()
            .map(|[a, b]| [predict(a), predict(b)])
            .collect())
    }

    /// The trainer of `leg` on `world` ranks, placed as `place` says: fresh, or resumed from
    /// its checkpoint.
    fn build(&self, leg: &Leg, world: usize, place: Placing) -> ckpt_engine::Result<Trainer<D>> {
        let train = self.suite.train_at(world);
        let dev = self.dev.clone();
        match &leg.resumes {
            None => Trainer::new_placed(train, dev, place),
            Some((dir, step)) => {
                Trainer::resume_placed(train, dev, &dir.join(step_dir_name(*step)), place)
            }
        }
    }

    /// Runs `leg` on `world` ranks placed as `place` says, its steps to [`Trial::end`], saving
    /// as the suite says where a later phase resumes from it; a resume's state is compared
    /// with `reference_digests`' at its step. An allocation the device refuses, or a checkpoint
    /// the resume refuses, ends the phase early and is recorded. Where this process trains one
    /// rank of several, the record is that rank's: its figures at the top level and as the
    /// only entry of every `ranks`.
    pub(crate) fn phase(
        &self,
        leg: &Leg,
        world: usize,
        place: Placing,
        reference_digests: &BTreeMap<u64, StateDigest>,
        watch: &mut impl Watch,
    ) -> Result<PhaseRun> {
        let (suite, end) = (self.suite, self.end());
        let tracker = self.dev.tracker().clone();
        let (phase, from) = (leg.phase, leg.resumes.as_ref().map(|(_, step)| *step));
        let own_rank = match place {
            Placing::Here => None,
            Placing::Rank { rank, .. } => Some(rank),
        };
        let digested_at = suite.resume_points();
        let phase_start = Instant::now();
        let mut saver = leg.saves_into.as_ref().map(|dir| {
            let name = dir.file_name().unwrap_or_default().to_string_lossy();
            let twin = self.work.join(format!("sync-{name}"));
            Saver::new(suite, self.kind, dir, &twin)
        });
        watch.phase_started(phase, from.unwrap_or(0), end, &tracker);
        let mut record = PhaseRecord {
            phase,
            before: tracker.stats().current,
            ..PhaseRecord::default()
        };
        let mut ran = PhaseRun::default();
        let host_reset = host_memory::reset_peak();
        let start_rss = host_memory::current();
        let oom_before = tracker.stats().oom_count;
        tracker.reset_peak();
        let built = self.build(leg, world, place);
        record.setup = window(&tracker.stats(), oom_before);
        record.setup_seconds = phase_start.elapsed().as_secs_f64();
        match built {
            Ok(mut trainer) => {
                let ranks = rank_trackers(&trainer, own_rank.is_some());
                record.ranks = ranks
                    .iter()
                    .map(|t| RankPhase {
                        setup: window(&t.stats(), 0),
                        ..RankPhase::default()
                    })
                    .collect();
                if let Some(first) = record.ranks.first() {
                    record.before = first.before;
                    record.setup = first.setup.clone();
                }
                ran.samples_per_epoch = Some(trainer.loader().samples());
                if let Some(step) = from {
                    record.resumed_digest = Some(trainer.state_digest()?);
                    record.reference_digest = reference_digests.get(&step).cloned();
                    record.env_changes = trainer.env_changes().to_vec();
                }
                while trainer.step_index() < end {
                    if phase == Phase::Reference
                        && (digested_at.contains(&trainer.step_index())
                            || trainer.step_index() == suite.max_steps())
                    {
                        ran.digests
                            .insert(trainer.step_index(), trainer.state_digest()?);
                    }
                    let rank_starts: Vec<Breakdown> =
                        ranks.iter().map(|t| t.stats().current).collect();
                    let start = rank_starts
                        .first()
                        .copied()
                        .unwrap_or_else(|| tracker.stats().current);
                    let staging = saver.as_ref().map_or(0, |s| s.staging_on_device(&trainer));
                    watch.step_started(phase, trainer.step_index());
                    let step_start = Instant::now();
                    match trainer.step() {
                        Ok(s) => {
                            let routed = self.routed(world, &s)?;
                            let first_rank = own_rank.unwrap_or(0);
                            // A rank of its own counts only its own bytes.
                            let memories = match s.rank_memory.is_empty() {
                                true => vec![s.memory.clone()],
                                false => s.rank_memory.clone(),
                            };
                            let ranks = rank_starts
                                .iter()
                                .zip(memories)
                                .enumerate()
                                .map(|(r, (start, memory))| RankStep {
                                    start: *start,
                                    staging: if r == 0 { staging } else { 0 },
                                    memory,
                                    predicted: routed.get(first_rank + r).cloned(),
                                })
                                .collect();
                            let step = StepRecord {
                                ranks,
                                predicted: routed.into_iter().next(),
                                tokens_per_expert: s.tokens_per_expert,
                                step: s.step,
                                loss: s.loss,
                                lr: s.lr,
                                grad_norm: s.grad_norm,
                                batch_digest: s.batch_digest,
                                samples: s.samples,
                                recomputed_blocks: s.recomputed_blocks,
                                start,
                                staging,
                                memory: s.memory,
                                seconds: step_start.elapsed().as_secs_f64(),
                            };
                            watch.step_done(phase, &step);
                            record.steps.push(step);
                            if let Some(saver) = &mut saver {
                                saver.collect()?;
                            }
                        }
                        Err(EngineError::OutOfMemory(e)) => {
                            record.oom = Some(Oom::new(Some(trainer.step_index()), &e));
                            break;
                        }
                        Err(e) => return Err(e.into()),
                    }
                    if let Some(saver) = &mut saver {
                        if suite.saves_at(from.unwrap_or(0), trainer.step_index()) {
                            saver.save(&mut trainer)?;
                        }
                    }
                }
                if let Some(saver) = &mut saver {
                    record.saves = saver.finish(&mut trainer)?;
                }
                watch.releasing(phase);
                drop(trainer);
                for (mine, t) in record.ranks.iter_mut().zip(&ranks) {
                    mine.after = t.stats().current;
                }
            }
            Err(EngineError::OutOfMemory(e)) => {
                record.oom = Some(Oom::new(None, &e));
            }
            Err(e @ EngineError::BadFile { .. }) if from.is_some() => {
                record.refused = Some(e.to_string());
            }
            Err(e) => return Err(e.into()),
        }
        record.after = match record.ranks.first() {
            Some(first) => first.after,
            None => tracker.stats().current,
        };
        record.host = HostMemory {
            start_rss,
            peak_rss: host_memory::peak(),
            reset: host_reset,
        };
        record.seconds = phase_start.elapsed().as_secs_f64();
        watch.phase_done(&record, &tracker);
        ran.record = record;
        Ok(ran)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn suite(training: &str) -> Suite {
        let text = format!(
            "name: t
model: {{vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 4, max_position_embeddings: 64}}
data: {{kind: synthetic, seed: 1, samples: 64}}
batch_size: 2
seq_len: 16
optimizer: {{lr: 0.001}}
training: {training}
"
        );
        Suite::parse(Path::new("s.yaml"), &text).unwrap()
    }

    #[test]
    fn a_moe_model_warms_up_over_the_whole_reference_and_a_dense_one_for_a_step() {
        let dense = suite("{max_steps: 6, extra_steps: 2}");
        assert_eq!(warm_up_steps(&dense, 8), 1);
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../suites/family-qwen3-moe.yaml"),
        )
        .unwrap();
        let moe = Suite::parse(Path::new("family-qwen3-moe.yaml"), &text).unwrap();
        assert_eq!(warm_up_steps(&moe, 11), 11);
    }

    fn planned(p: &[PlannedPhase]) -> Vec<(String, u64, u64)> {
        p.iter()
            .map(|p| (p.phase.to_string(), p.from, p.end))
            .collect()
    }

    /// Rewrites the execution record of the checkpoint `resume-mid` loads, as another machine
    /// would have written it, just before it is loaded.
    struct SavedElsewhere<'a>(&'a Path);

    impl Watch for SavedElsewhere<'_> {
        fn phase_started(&mut self, phase: Phase, from: u64, _end: u64, _: &MemoryTracker) {
            if phase != Phase::ResumeMid {
                return;
            }
            let ckpt = self.0.join("checkpoints").join(step_dir_name(from));
            let path = ckpt.join(ckpt_engine::checkpoint::STATE_FILE);
            let mut state: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            state["environment"]["cpu_kernels"] = "riscv64 scalar".into();
            std::fs::write(&path, serde_json::to_vec(&state).unwrap()).unwrap();
            ckpt_engine::checkpoint::state_file::reseal(&ckpt).unwrap();
        }
    }

    #[test]
    fn a_resume_records_how_its_environment_differs_from_its_checkpoints() {
        let s = suite("{max_steps: 4, resume_from: 2}");
        let work = tempfile::tempdir().unwrap();
        let mut watch = SavedElsewhere(work.path());
        let r = run(&s, DeviceKind::Cpu, work.path(), &mut watch).unwrap();
        let changes = |r: &RunRecord| -> Vec<Vec<String>> {
            r.phases
                .iter()
                .map(|p| p.env_changes.iter().map(ToString::to_string).collect())
                .collect()
        };
        let here = ckpt_engine::backend::cpu::matmul::kernels();
        let want = [
            vec![],
            vec![format!("cpu_kernels: riscv64 scalar → {here}")],
            vec![],
        ];
        assert_eq!(changes(&r), want);
        let json = serde_json::to_value(&r).unwrap();
        assert!(json["phases"][0].get("env_changes").is_none());
        let back: RunRecord = serde_json::from_value(json).unwrap();
        assert_eq!(changes(&back), want);
    }

    #[test]
    fn one_resume_point_plans_the_three_phases() {
        let p = plan(&suite("{max_steps: 8, extra_steps: 2, resume_from: 3}"));
        let want = [
            ("reference", 0, 10),
            ("resume-mid", 3, 10),
            ("resume-end", 8, 10),
        ];
        assert_eq!(planned(&p), want.map(|(p, f, e)| (p.to_string(), f, e)));
    }

    #[test]
    fn a_chain_plans_a_resume_from_each_point_and_each_resumes_the_one_before() {
        let p = plan(&suite("{max_steps: 9, resume_from: [3, 5, 7]}"));
        let want = [
            ("reference", 0),
            ("resume-mid", 3),
            ("resume-mid-2", 5),
            ("resume-mid-3", 7),
            ("resume-end", 9),
        ];
        assert_eq!(planned(&p), want.map(|(p, f)| (p.to_string(), f, 12)));
        let work = Path::new("w");
        let dir = |d: &str| Some(work.join(d));
        let leg = |phase, resumes: Option<(&str, u64)>, saves_into| Leg {
            phase,
            resumes: resumes.map(|(d, step)| (work.join(d), step)),
            saves_into,
        };
        assert_eq!(
            legs(&p, work),
            [
                leg(Phase::Reference, None, dir("checkpoints")),
                leg(
                    Phase::ResumeMid,
                    Some(("checkpoints", 3)),
                    dir("checkpoints-resume-mid")
                ),
                leg(
                    Phase::ResumeChained(2),
                    Some(("checkpoints-resume-mid", 5)),
                    dir("checkpoints-resume-mid-2")
                ),
                leg(
                    Phase::ResumeChained(3),
                    Some(("checkpoints-resume-mid-2", 7)),
                    None
                ),
                leg(Phase::ResumeEnd, Some(("checkpoints", 9)), None),
            ]
        );
    }

    #[test]
    fn phases_read_and_write_as_their_names_in_run_order() {
        let phases = [
            Phase::Reference,
            Phase::ResumeMid,
            Phase::ResumeChained(2),
            Phase::ResumeChained(10),
            Phase::ResumeEnd,
        ];
        let json = serde_json::to_string(&phases).unwrap();
        assert_eq!(
            json,
            r#"["reference","resume-mid","resume-mid-2","resume-mid-10","resume-end"]"#
        );
        assert_eq!(serde_json::from_str::<Vec<Phase>>(&json).unwrap(), phases);
        assert!(phases.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(Phase::chained(1), Phase::ResumeMid);
        assert_eq!(Phase::chained(3), Phase::ResumeChained(3));
        for bad in ["resume-mid-1", "resume-mid-x", "resume", "resume-mid-"] {
            assert!(
                serde_json::from_str::<Phase>(&format!("\"{bad}\"")).is_err(),
                "{bad}"
            );
        }
    }
}
