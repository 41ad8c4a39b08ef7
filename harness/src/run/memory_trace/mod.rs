//! `run --memory-trace`: every allocation and free of each phase of a trial, written as the
//! snapshot PyTorch's `torch.cuda.memory._dump_snapshot` writes (`<dir>/<phase>.pickle`), so
//! PyTorch's memory_viz page and `python -m torch.cuda._memory_viz` open it. The engine's tracker
//! tells a [`recorder::Recorder`] of each event while a phase runs; nothing is recorded otherwise.

pub mod pickle;
pub mod recorder;

use crate::record::{Phase, PhaseRecord};
use crate::run::phases::Watch;
use anyhow::Result;
use ckpt_engine::memory::{Breakdown, MemoryTracker};
use pickle::Frame;
use recorder::Recorder;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The directory of the traces under a report directory.
pub const DIR: &str = "memory";

/// The directory of one trial's traces under `root`: `cpu::faults::x` → `root/cpu.faults.x`.
pub fn trial_dir(root: &Path, trial: &str) -> PathBuf {
    root.join(trial.replace("::", "."))
}

/// Records each phase of one trial and writes its snapshot when the phase ends.
pub struct Tracer {
    dir: PathBuf,
    recorder: Option<Arc<Recorder>>,
    markers: Vec<Frame>,
    before: Breakdown,
    phase: Phase,
    error: Option<anyhow::Error>,
}

impl Tracer {
    /// Writes the trial's snapshots into `dir`.
    pub fn new(dir: PathBuf) -> Self {
        Tracer {
            dir,
            recorder: None,
            markers: Vec::new(),
            before: Breakdown::default(),
            phase: Phase::Reference,
            error: None,
        }
    }

    /// The first snapshot that could not be written, if one could not.
    pub fn finish(self) -> Result<()> {
        self.error.map_or(Ok(()), Err)
    }

    fn mark(&mut self, label: String, line: u64) {
        self.markers.push(pickle::marker_frame(&label, line));
        if let Some(r) = &self.recorder {
            r.mark(self.markers.len() - 1);
        }
    }
}

impl Watch for Tracer {
    fn phase_started(&mut self, phase: Phase, from: u64, _end: u64, tracker: &MemoryTracker) {
        self.phase = phase;
        self.before = tracker.stats().current;
        let setup = match phase {
            Phase::Reference => format!("{phase}: building the trainer"),
            _ => format!("{phase}: loading the checkpoint of step {from}"),
        };
        self.markers = vec![pickle::marker_frame(&setup, from)];
        let recorder = Arc::new(Recorder::new(0));
        tracker.observe(Some(recorder.clone()));
        self.recorder = Some(recorder);
    }

    fn step_started(&mut self, phase: Phase, step: u64) {
        self.mark(format!("{phase} step {step}"), step);
    }

    fn releasing(&mut self, phase: Phase) {
        self.mark(format!("{phase}: dropping the trainer"), 0);
    }

    fn phase_done(&mut self, _record: &PhaseRecord, tracker: &MemoryTracker) {
        tracker.observe(None);
        let Some(recorder) = self.recorder.take() else {
            return;
        };
        let file = self.dir.join(format!("{}.pickle", self.phase));
        let written = pickle::write(&file, &recorder.take(), &self.markers, &self.before);
        if let (Err(e), None) = (written, &self.error) {
            self.error = Some(e);
        }
    }
}
