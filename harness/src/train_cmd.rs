//! `ckpt-harness train`: trains a suite's model, saving checkpoints as the suite says, and prints
//! one JSON line per step.

use crate::devices::{self, DeviceKind};
use crate::suite::Suite;
use anyhow::Result;
use ckpt_engine::checkpoint::RunLock;
use ckpt_engine::Trainer;
use serde::Serialize;
use std::io::Write;
use std::path::Path;

/// One line of `train`'s output.
#[derive(Serialize)]
struct StepLine {
    step: u64,
    loss: f32,
    lr: f64,
    grad_norm: f64,
    peak_bytes: u64,
}

/// Trains `suite` until `steps` steps are done (default `max_steps`), from scratch or from
/// `resume`, saving under `out`, whose lock it holds throughout.
pub fn run(suite: &Suite, out: &Path, resume: Option<&Path>, steps: Option<u64>) -> Result<()> {
    let _lock = RunLock::acquire(out)?;
    let dev = devices::open(DeviceKind::Cpu, suite.file.threads, suite.capacity())?;
    let mut trainer = match resume {
        Some(dir) => Trainer::resume(suite.train.clone(), dev, dir)?,
        None => Trainer::new(suite.train.clone(), dev)?,
    };
    let target = steps.unwrap_or(suite.max_steps());
    let keep = suite.file.training.keep_last;
    let mut stdout = std::io::stdout().lock();
    while trainer.step_index() < target {
        let s = trainer.step()?;
        let line = StepLine {
            step: s.step,
            loss: s.loss,
            lr: s.lr,
            grad_norm: s.grad_norm,
            peak_bytes: s.memory.allocated.peak,
        };
        writeln!(stdout, "{}", serde_json::to_string(&line)?)?;
        if suite.saves_at(trainer.step_index()) {
            trainer.save(out, keep)?;
        }
    }
    Ok(())
}
