//! `ckpt-harness train`: trains a suite's model, saving checkpoints as the suite says, and prints
//! one JSON line per step.

use crate::devices::{self, DeviceKind, OnDevice};
use crate::suite::Suite;
use anyhow::Result;
use ckpt_engine::{Device, Trainer};
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

/// Trains `suite` on a device of `kind` until `steps` steps are done (default `max_steps`),
/// from scratch or from `resume`, saving under `out`.
pub fn run(
    suite: &Suite,
    kind: DeviceKind,
    out: &Path,
    resume: Option<&Path>,
    steps: Option<u64>,
) -> Result<()> {
    let train = Train {
        suite,
        out,
        resume,
        steps,
    };
    devices::run_on(kind, suite.file.threads, suite.capacity(), train)
}

/// One `train` command's work, for whichever device it names.
struct Train<'a> {
    suite: &'a Suite,
    out: &'a Path,
    resume: Option<&'a Path>,
    steps: Option<u64>,
}

impl OnDevice for Train<'_> {
    type Output = ();

    fn run<D: Device>(self, dev: D) -> Result<()> {
        let Train {
            suite,
            out,
            resume,
            steps,
        } = self;
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
}
