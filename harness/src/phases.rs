//! The phases of a trial, sharing one reference trajectory: `reference` trains
//! `max_steps + extra_steps` with the schedule's horizon pinned at `max_steps`, saving at
//! `resume_from` and `max_steps`; `resume-mid` and `resume-end` resume from those checkpoints
//! and train to the same end. Every step is recorded; the trainer is dropped between phases and
//! the device's allocated bytes read before and after.

use crate::suite::Suite;
use anyhow::Result;
use ckpt_engine::checkpoint::step_dir_name;
use ckpt_engine::estimate::{estimate, EstimateConfig};
use ckpt_engine::memory::Breakdown;
use ckpt_engine::{CpuDevice, MemoryStats, Trainer};
use serde::Serialize;
use std::path::Path;

/// Which phase a record belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// The uninterrupted run.
    Reference,
    /// Resumed from the mid-run checkpoint.
    ResumeMid,
    /// Resumed from the `max_steps` checkpoint, training past it.
    ResumeEnd,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Reference => "reference",
            Phase::ResumeMid => "resume-mid",
            Phase::ResumeEnd => "resume-end",
        })
    }
}

/// One training step as observed.
#[derive(Clone, Debug, Serialize)]
pub struct StepRecord {
    /// 0-based step index.
    pub step: u64,
    /// Mean loss.
    pub loss: f32,
    /// Learning rate applied.
    pub lr: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Blocks recomputed in backward.
    pub recomputed_blocks: usize,
    /// Memory figures of the step.
    pub memory: MemoryStats,
}

/// One phase as observed.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseRecord {
    /// Which phase.
    pub phase: Phase,
    /// Allocated bytes before the phase's trainer was built.
    pub allocated_before: u64,
    /// Allocated bytes after it was dropped.
    pub allocated_after: u64,
    /// Its steps.
    pub steps: Vec<StepRecord>,
}

/// The memory model's prediction of one step.
#[derive(Clone, Debug, Serialize)]
pub struct PredictedStep {
    /// Step peak in bytes.
    pub peak: u64,
    /// Bytes per category at the peak.
    pub at_peak: Breakdown,
}

/// Everything a trial observed; checks read only this.
#[derive(Clone, Debug, Serialize)]
pub struct RunRecord {
    /// Suite name.
    pub suite: String,
    /// Device name (`cpu`).
    pub device: String,
    /// Decoder blocks in the model.
    pub layers: usize,
    /// Whether activation checkpointing was on.
    pub checkpointing: bool,
    /// The memory model's prediction for a step without AdamW moments yet (the first) and with.
    pub predicted: [PredictedStep; 2],
    /// The phases in order.
    pub phases: Vec<PhaseRecord>,
}

/// Runs the three phases of `suite` on the CPU, checkpoints under `work`; `progress` is told
/// when each phase ends.
pub fn run(
    suite: &Suite,
    work: &Path,
    mut progress: impl FnMut(&PhaseRecord),
) -> Result<RunRecord> {
    let t = &suite.file.training;
    let end = t.max_steps + t.extra_steps;
    let run_dir = work.join("checkpoints");
    let dev = CpuDevice::new(suite.file.threads, u64::MAX)?;
    let model = estimate(&EstimateConfig::from_train(
        &suite.train,
        suite.file.threads,
    ))?;
    let predicted = [false, true].map(|moments| {
        let s = model.step(moments);
        PredictedStep {
            peak: s.peak,
            at_peak: s.at_peak,
        }
    });
    let plan = [
        (Phase::Reference, None),
        (Phase::ResumeMid, Some(suite.resume_from())),
        (Phase::ResumeEnd, Some(t.max_steps)),
    ];
    let mut phases = Vec::new();
    for (phase, from) in plan {
        let allocated_before = dev.tracker().allocated();
        let mut trainer = match from {
            None => Trainer::new(suite.train.clone(), dev.clone())?,
            Some(step) => Trainer::resume(
                suite.train.clone(),
                dev.clone(),
                &run_dir.join(step_dir_name(step)),
            )?,
        };
        let mut steps = Vec::new();
        while trainer.step_index() < end {
            let s = trainer.step()?;
            steps.push(StepRecord {
                step: s.step,
                loss: s.loss,
                lr: s.lr,
                grad_norm: s.grad_norm,
                recomputed_blocks: s.recomputed_blocks,
                memory: s.memory,
            });
            if phase == Phase::Reference && suite.saves_at(trainer.step_index()) {
                trainer.save(&run_dir, None)?;
            }
        }
        drop(trainer);
        let record = PhaseRecord {
            phase,
            allocated_before,
            allocated_after: dev.tracker().allocated(),
            steps,
        };
        progress(&record);
        phases.push(record);
    }
    Ok(RunRecord {
        suite: suite.file.name.clone(),
        device: "cpu".into(),
        layers: suite.train.model.num_hidden_layers,
        checkpointing: suite.train.checkpointing != ckpt_engine::Checkpointing::None,
        predicted,
        phases,
    })
}
