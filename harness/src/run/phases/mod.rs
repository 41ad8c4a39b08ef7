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

use crate::checks::peak_budget::Overrun;
use crate::checks::Check;
use crate::devices::{self, DeviceKind, OnDevice};
use crate::forecast::ladder::{cheapest, ladder};
use crate::forecast::{plan, predict, staging_by_rank, Forecast};
use crate::record::ranks::{RankModel, RankPhase, RankStep, WorldModel};
use crate::record::{
    EvalRecord, HostMemory, Oom, Phase, PhaseRecord, PlannedPhase, PredictedStep, RunRecord,
    StepRecord, Window,
};
use crate::run::host_memory;
use crate::run::saver::Saver;
use crate::suite::Suite;
use anyhow::Result;
use ckpt_engine::backend::count::{Like, Routes};
use ckpt_engine::checkpoint::step_dir_name;
use ckpt_engine::estimate::{
    estimate, evaluation_peaks, recorded_rank_steps, EstimateConfig, StepEstimate,
};
use ckpt_engine::memory::{Breakdown, MemoryTracker};
use ckpt_engine::{Device, EngineError, MemoryStats, Placing, StateDigest, StepStats, Trainer};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

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

/// A run stopped before it trained: the plan of every step puts steps over the suite's budget,
/// and the suite does not expect `peak_budget` to fail.
#[derive(Debug)]
pub struct PlanOverBudget {
    /// Each step of each phase over its rank's budget, in run order.
    pub overruns: Vec<Overrun>,
    /// The first named with its samples, and the cheapest change that fits.
    pub message: String,
}

impl std::fmt::Display for PlanOverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PlanOverBudget {}

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
            let staging = staging_by_rank(&model, suite.rank_processes());
            let ranks = (0..world_size)
                .map(|r| {
                    let predicted = pair(&model.ranks, &model.first_step, &model.later_step, r);
                    RankModel {
                        predicted_load: predicted[1].start.total(),
                        predicted,
                        predicted_long: model.long_batch.as_ref().map(|l| {
                            (l.from_step, pair(&l.ranks, &l.first_step, &l.later_step, r))
                        }),
                        predicted_staging: staging.get(r).copied().unwrap_or(0),
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

/// Runs the phases of `suite` (see [`crate::forecast::plan`]) on a device of `kind`, checkpoints under `work`; `watch` is
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

impl<W: Watch> OnDevice for Phases<'_, W> {
    type Output = RunRecord;

    fn run<D: Device>(self, dev: D) -> Result<RunRecord> {
        let Phases {
            suite,
            kind,
            work,
            watch,
        } = self;
        let trial = Trial::new(suite, kind, work, &dev)?;
        if let Some(budget) = suite.budget() {
            if !suite.expect_fail().contains(&Check::PeakBudget) {
                let limit = |world: usize| budget.bytes(dev.rank_capacity(world));
                let overruns = trial.forecast.overruns(limit);
                if let Some(first) = overruns.first() {
                    let rungs = ladder(suite, &trial.forecast, trial.like, &limit)?;
                    let fix = match cheapest(&rungs) {
                        Some(r) => {
                            format!("the cheapest change that fits: {} ({})", r.change, r.cost)
                        }
                        None => "no single change of the fix ladder fits".into(),
                    };
                    let message = format!(
                        "{}: the plan breaks the budget before anything runs: {}{fix}; `ckpt-harness estimate {}` shows every change; add peak_budget to expect_fail to run it anyway",
                        suite.path.display(),
                        first.sentence(),
                        suite.path.display()
                    );
                    return Err(PlanOverBudget { overruns, message }.into());
                }
            }
        }
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
        let mut dataset_samples = None;
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
            dataset_samples = ran.dataset_samples.or(dataset_samples);
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
            planned_evaluations: suite.planned_evaluations(),
            capacity: dev.tracker().capacity(),
            budget: suite.budget().map(|b| b.bytes(dev.tracker().capacity())),
            rss_budget: suite.file.memory.rss_budget,
            samples_per_epoch,
            dataset_samples,
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
    /// Samples in the whole dataset, where an epoch holds fewer.
    pub(crate) dataset_samples: Option<u64>,
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
    /// Every step's batches and predicted memory, planned before any runs.
    pub(crate) forecast: Forecast,
}

impl<'a, D: Device> Trial<'a, D> {
    /// `suite`'s trial on `dev`, a device of `kind`, run directories under `work`, its steps
    /// planned.
    pub(crate) fn new(
        suite: &'a Suite,
        kind: DeviceKind,
        work: &'a Path,
        dev: &'a D,
    ) -> Result<Self> {
        let like = Like::new(kind, suite.file.threads);
        Ok(Trial {
            suite,
            kind,
            work,
            dev,
            like,
            forecast: Forecast::of(suite, like)?,
        })
    }

    /// The step every phase stops before: `max_steps + extra_steps`.
    pub(crate) fn end(&self) -> u64 {
        self.suite.max_steps() + self.suite.file.training.extra_steps
    }

    /// A step's own memory model on each rank of `world`, where the run's cannot hold it: a
    /// MoE step's at the tokens per expert it recorded (each rank's at its own micro-batches'),
    /// a step of text padded to its micro-batches' longest samples the plan's for that step.
    /// Empty for a dense step of the run's shape, whose model is the run's.
    fn own_model(&self, world: usize, s: &StepStats) -> Result<Vec<[PredictedStep; 2]>> {
        if s.tokens_per_expert.is_empty() {
            return Ok(self
                .forecast
                .step(world, s.step)
                .map_or_else(Vec::new, |f| f.shaped_model.clone()));
        }
        let seq = self.suite.train.seq_len_at(s.step);
        let mut cfg = EstimateConfig::from_train(&self.suite.train_at(world), self.like)
            .with_routes(Routes::Recorded(s.tokens_per_expert.clone()));
        if s.seq_lens.iter().any(|&len| len != seq) {
            cfg = cfg.with_seq_lens(s.seq_lens.clone());
        }
        let ranks = recorded_rank_steps(&cfg, seq)?;
        Ok(ranks
            .iter()
            .map(|[a, b]| [predict(a), predict(b)])
            .collect())
    }

    /// The memory model's peak of each rank of `world` over an evaluation of micro-batches of
    /// `shapes` (rows, tokens per row).
    fn evaluation_model(&self, world: usize, shapes: &[(usize, usize)]) -> Result<Vec<u64>> {
        let cfg = EstimateConfig::from_train(&self.suite.train_at(world), self.like);
        Ok(evaluation_peaks(&cfg, shapes)?)
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
                ran.dataset_samples = Some(trainer.loader().dataset_samples())
                    .filter(|&n| n != trainer.loader().samples());
                if let Some(step) = from {
                    record.resumed_digest = Some(trainer.state_digest()?);
                    record.reference_digest = reference_digests.get(&step).cloned();
                    record.env_changes = trainer.env_changes().to_vec();
                }
                // The reference's state is digested where a resume starts and at `max_steps`,
                // once: a save there hands its digest on.
                let digested_here = |step: u64| {
                    phase == Phase::Reference
                        && (digested_at.contains(&step) || step == suite.max_steps())
                };
                while trainer.step_index() < end {
                    let step = trainer.step_index();
                    if digested_here(step) && !ran.digests.contains_key(&step) {
                        ran.digests.insert(step, trainer.state_digest()?);
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
                            let own_model = self.own_model(world, &s)?;
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
                                    predicted: own_model.get(first_rank + r).cloned(),
                                })
                                .collect();
                            let step = StepRecord {
                                ranks,
                                predicted: own_model.into_iter().next(),
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
                            for e in s.evaluations {
                                let predicted = self.evaluation_model(world, &e.shapes)?;
                                record.evaluations.push(EvalRecord {
                                    step: e.step,
                                    loss: e.loss,
                                    tokens: e.tokens as u64,
                                    batch_digest: e.batch_digest,
                                    rank_peaks: (e.rank_memory.iter())
                                        .map(|m| m.allocated.peak)
                                        .collect(),
                                    memory: e.memory,
                                    predicted_peaks: match own_rank {
                                        Some(rank) => vec![predicted[rank]],
                                        None => predicted,
                                    },
                                });
                            }
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
                        let step = trainer.step_index();
                        if suite.saves_at(from.unwrap_or(0), step) {
                            let digest = trainer.state_digest()?;
                            saver.save(&mut trainer, &digest)?;
                            if digested_here(step) {
                                ran.digests.insert(step, digest);
                            }
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
        let here = crate::checks::golden::environment("cpu").unwrap();
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
