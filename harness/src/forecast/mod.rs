//! The plan of every step, before anything runs: which samples each step of each phase trains
//! on, in what shapes ([`data`]), and what each rank of the phase's world holds at each step's
//! peak and at each evaluation's, by the memory model (a dry run on the counting device once per
//! distinct step shape and world size, shared by every step of that shape). A step of a longer
//! batch is predicted to peak higher; the step that sets a phase's peak is named with its
//! samples. A MoE model's steps are predicted at balanced routing: the plan cannot know the
//! routes a step will take (the run's own check compares each step at the routes it recorded).

pub mod data;
pub mod ladder;

pub use data::{DataPlan, PlannedMicroBatch, PlannedSample};

use crate::checks::peak_budget::Overrun;
use crate::record::{Phase, PlannedPhase, PredictedStep};
use crate::suite::Suite;
use anyhow::Result;
use ckpt_engine::backend::count::Like;
use ckpt_engine::estimate::{
    estimate, evaluation_peaks, recorded_rank_steps, Estimate, EstimateConfig, StepEstimate,
};
use serde::Serialize;
use std::collections::HashMap;

/// One step of one phase as the memory model predicts it.
#[derive(Clone, Debug, Serialize)]
pub struct StepForecast {
    /// The step (0-based).
    pub step: u64,
    /// Each rank's prediction in rank order (one on one device): what it holds when the step
    /// starts, its peak and the categories at the peak, above what the device held before the
    /// phase (an asynchronous save's staging included where one is in flight).
    pub ranks: Vec<PredictedStep>,
    /// Each rank's step of this shape without and with AdamW's moments, no staging; empty
    /// where every micro-batch's rows are as long as the run asks for (the run's own model).
    #[serde(skip)]
    pub shaped_model: Vec<[PredictedStep; 2]>,
}

impl StepForecast {
    /// The rank with the highest peak and that peak (the lowest such rank).
    pub fn highest(&self) -> (usize, u64) {
        highest(self.ranks.iter().map(|r| r.peak))
    }
}

/// One evaluation of the validation split as the memory model predicts it.
#[derive(Clone, Debug, Serialize)]
pub struct EvalForecast {
    /// Steps completed when it runs.
    pub step: u64,
    /// Each rank's peak in rank order.
    pub rank_peaks: Vec<u64>,
}

/// One phase's steps and evaluations.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseForecast {
    /// The phase as the suite plans it.
    #[serde(flatten)]
    pub planned: PlannedPhase,
    /// Its steps, `from..end`.
    pub steps: Vec<StepForecast>,
    /// Its evaluations, in order.
    pub evaluations: Vec<EvalForecast>,
}

impl PhaseForecast {
    /// The step with the highest peak of any rank (the first such step), if it trains any.
    pub fn highest_step(&self) -> Option<&StepForecast> {
        let mut best: Option<&StepForecast> = None;
        for s in &self.steps {
            if best.is_none_or(|b| s.highest().1 > b.highest().1) {
                best = Some(s);
            }
        }
        best
    }
}

/// Every step of every phase of a suite: its data and its predicted memory.
#[derive(Clone, Debug, Serialize)]
pub struct Forecast {
    /// The batches of every step and of an evaluation.
    pub data: DataPlan,
    /// The phases in run order.
    pub phases: Vec<PhaseForecast>,
    /// Dry runs the memory model ran for the steps: one per distinct step shape and world size.
    pub dry_runs: usize,
}

impl Forecast {
    /// The plan of `suite` on the backend `like` models.
    pub fn of(suite: &Suite, like: Like) -> Result<Forecast> {
        let planned = plan(suite);
        let end = planned.iter().map(|p| p.end).max().unwrap_or(0);
        let data = DataPlan::draw(suite, end)?;
        let mut models = Models::new(suite, like);
        let mut phases = Vec::with_capacity(planned.len());
        for p in planned {
            let world = p.world_size;
            let staging = models.staging(world)?;
            let mut steps = Vec::new();
            for step in p.from..p.end {
                let micro_batches = &data.steps[step as usize];
                let (shaped, pair) =
                    models.step(world, suite.train.seq_len_at(step), micro_batches)?;
                let moments_exist = usize::from(step > 0);
                let in_flight = step > p.from && suite.saves_at(p.from, step);
                let ranks = (pair.iter().zip(&staging))
                    .map(|(pair, &staged)| {
                        let mut s = pair[moments_exist].clone();
                        if in_flight {
                            s.start.io += staged;
                            s.at_peak.io += staged;
                            s.peak += staged;
                        }
                        s
                    })
                    .collect();
                let shaped_model = match shaped {
                    true => pair.to_vec(),
                    false => Vec::new(),
                };
                steps.push(StepForecast {
                    step,
                    ranks,
                    shaped_model,
                });
            }
            let evaluations = (suite.planned_evaluations().into_iter())
                .filter(|&s| s > p.from && s <= p.end)
                .map(|step| {
                    let rank_peaks = models.evaluation(world, &data.evaluation)?;
                    Ok(EvalForecast { step, rank_peaks })
                })
                .collect::<Result<Vec<_>>>()?;
            phases.push(PhaseForecast {
                planned: p,
                steps,
                evaluations,
            });
        }
        Ok(Forecast {
            dry_runs: models.steps.len(),
            data,
            phases,
        })
    }

    /// The phase whose step sets the highest peak of the run, and that step.
    pub fn highest_step(&self) -> Option<(&PhaseForecast, &StepForecast)> {
        let mut best: Option<(&PhaseForecast, &StepForecast)> = None;
        for p in &self.phases {
            if let Some(s) = p.highest_step() {
                if best.is_none_or(|(_, b)| s.highest().1 > b.highest().1) {
                    best = Some((p, s));
                }
            }
        }
        best
    }

    /// A line for each micro-batch of step `step`: its shape and each sample's index (and
    /// epoch, past the first) and tokens.
    pub fn micro_batch_lines(&self, step: u64) -> Vec<String> {
        let planned: &[PlannedMicroBatch] =
            (self.data.steps.get(step as usize)).map_or(&[], |s| &s[..]);
        planned
            .iter()
            .enumerate()
            .map(|(m, mb)| {
                let samples: Vec<String> = (mb.samples.iter())
                    .map(|x| match x.epoch {
                        0 => format!("{} ({} tokens)", x.index, x.tokens),
                        e => format!("{} of epoch {e} ({} tokens)", x.index, x.tokens),
                    })
                    .collect();
                format!(
                    "micro-batch {m} [{} × {}]: samples {}",
                    mb.shape[0],
                    mb.shape[1],
                    samples.join(", ")
                )
            })
            .collect()
    }

    /// Every step of every phase, in run order, whose peak on some rank exceeds `limit` of its
    /// phase's world size.
    pub fn overruns(&self, limit: impl Fn(usize) -> u64) -> Vec<Overrun> {
        let mut out = Vec::new();
        for p in &self.phases {
            let budget = limit(p.planned.world_size);
            for s in p.steps.iter().filter(|s| s.highest().1 > budget) {
                let (rank, peak) = s.highest();
                out.push(Overrun {
                    phase: p.planned.phase,
                    step: s.step,
                    rank: (p.planned.world_size > 1).then_some(rank),
                    peak,
                    budget,
                    at_peak: s.ranks[rank].at_peak,
                    batches: self.micro_batch_lines(s.step).join("; "),
                });
            }
        }
        out
    }

    /// The first of [`Forecast::overruns`] as one line ([`Overrun::sentence`]).
    pub fn first_over_budget(&self, limit: impl Fn(usize) -> u64) -> Option<String> {
        self.overruns(limit).first().map(Overrun::sentence)
    }

    /// The highest peak of any step or evaluation of any rank, and where: the phase, the step
    /// (or the evaluation after it) and the rank, on more than one.
    pub fn highest(&self) -> Option<(u64, String)> {
        let mut best: Option<(u64, String)> = None;
        let mut consider = |peak: u64, at: String| {
            if best.as_ref().is_none_or(|(b, _)| peak > *b) {
                best = Some((peak, at));
            }
        };
        for p in &self.phases {
            let on_rank = |rank: usize| match p.planned.world_size {
                1 => String::new(),
                _ => format!(" on rank {rank}"),
            };
            if let Some(s) = p.highest_step() {
                let (rank, peak) = s.highest();
                consider(
                    peak,
                    format!("{} step {}{}", p.planned.phase, s.step, on_rank(rank)),
                );
            }
            for e in &p.evaluations {
                let (rank, peak) = highest(e.rank_peaks.iter().copied());
                let at = format!(
                    "{} evaluation after step {}{}",
                    p.planned.phase,
                    e.step,
                    on_rank(rank)
                );
                consider(peak, at);
            }
        }
        best
    }

    /// Step `step` on `world` ranks, as any phase at that world size that trains it plans it.
    pub fn step(&self, world: usize, step: u64) -> Option<&StepForecast> {
        (self.phases.iter())
            .filter(|p| p.planned.world_size == world && p.planned.from <= step)
            .find_map(|p| p.steps.get((step - p.planned.from) as usize))
    }
}

/// The index and value of the highest of `peaks` (the first such).
fn highest(peaks: impl Iterator<Item = u64>) -> (usize, u64) {
    peaks.enumerate().fold(
        (0, 0),
        |best, (i, p)| if p > best.1 { (i, p) } else { best },
    )
}

/// Where a step's memory model is looked up: its world size, its rows' length, and each
/// micro-batch's where they differ from it (empty where they do not).
type ShapeKey = (usize, usize, Vec<usize>);

/// The memory models the plan has run, each once.
struct Models<'a> {
    suite: &'a Suite,
    like: Like,
    /// Each rank's step without and with AdamW's moments, by shape.
    steps: HashMap<ShapeKey, Vec<[PredictedStep; 2]>>,
    /// Each rank's evaluation peak, by world size.
    evaluations: HashMap<usize, Vec<u64>>,
}

impl<'a> Models<'a> {
    fn new(suite: &'a Suite, like: Like) -> Self {
        Models {
            suite,
            like,
            steps: HashMap::new(),
            evaluations: HashMap::new(),
        }
    }

    /// The run on `world` ranks, as the memory model takes it.
    fn config(&self, world: usize) -> EstimateConfig {
        EstimateConfig::from_train(&self.suite.train_at(world), self.like)
    }

    /// Each rank's step of `micro_batches` (rows of `seq` tokens as the run asks for them) on
    /// `world` ranks, without and with AdamW's moments; and whether any micro-batch's rows
    /// are of another length than `seq`.
    fn step(
        &mut self,
        world: usize,
        seq: usize,
        micro_batches: &[PlannedMicroBatch],
    ) -> Result<(bool, &[[PredictedStep; 2]])> {
        let lens: Vec<usize> = micro_batches.iter().map(|m| m.shape[1]).collect();
        let lens = match lens.iter().all(|&l| l == seq) {
            true => Vec::new(),
            false => lens,
        };
        let key = (world, seq, lens);
        if !self.steps.contains_key(&key) {
            let cfg = self.config(world).with_seq_lens(key.2.clone());
            let ranks = recorded_rank_steps(&cfg, seq)?;
            let predicted = (ranks.iter())
                .map(|pair| pair.each_ref().map(predict))
                .collect();
            self.steps.insert(key.clone(), predicted);
        }
        Ok((!key.2.is_empty(), &self.steps[&key]))
    }

    /// Each rank's evaluation peak on `world` ranks over micro-batches of `shapes`.
    fn evaluation(&mut self, world: usize, shapes: &[[usize; 2]]) -> Result<Vec<u64>> {
        if let Some(peaks) = self.evaluations.get(&world) {
            return Ok(peaks.clone());
        }
        let shapes: Vec<(usize, usize)> = shapes.iter().map(|&[r, s]| (r, s)).collect();
        let peaks = evaluation_peaks(&self.config(world), &shapes)?;
        self.evaluations.insert(world, peaks.clone());
        Ok(peaks)
    }

    /// The bytes of an asynchronous save's staging each rank of `world` counts on its own
    /// tracker while the save is in flight: none for a synchronous save.
    fn staging(&self, world: usize) -> Result<Vec<u64>> {
        if !self.suite.file.training.async_save {
            return Ok(vec![0; world]);
        }
        let model = estimate(&self.config(world))?;
        Ok(staging_by_rank(&model, self.suite.rank_processes()))
    }
}

/// The bytes of an asynchronous save's staging each rank of `model`'s run counts on its own
/// tracker: each its own chunk where the ranks are `processes` of their own, else rank 0 all
/// of it ([`Estimate::save_staging_on_process_ranks`], [`Estimate::save_staging_on_device`]).
pub(crate) fn staging_by_rank(model: &Estimate, processes: bool) -> Vec<u64> {
    match processes {
        true => model.save_staging_on_process_ranks(),
        false => (0..model.config.run.parallel.world_size.max(1))
            .map(|r| match r {
                0 => model.save_staging_on_device(),
                _ => 0,
            })
            .collect(),
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

/// The memory model's prediction of a step, as a record keeps it.
pub(crate) fn predict(s: &StepEstimate) -> PredictedStep {
    PredictedStep {
        start: s.start,
        peak: s.peak,
        at_peak: s.at_peak,
    }
}
