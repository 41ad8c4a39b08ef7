//! The parts of a run record that a trainer may leave out (docs/RECORD.md marks them optional),
//! named so that a check needing one can say it is not applicable, and why, instead of passing
//! on a default. The built-in engine records every one.

use serde::{Deserialize, Serialize};
use std::fmt;

/// An optional part of the record that some check needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordField {
    /// The dataset samples of each step's batch (`samples` on `step` lines).
    Samples,
    /// Each step's memory peak (`memory.allocated_peak` on `step` lines).
    StepMemory,
    /// A device allocator's own count of each step's memory (`memory.source` `engine` or
    /// `cuda`), not the process's resident host memory, which the allocator's caching hides.
    DeviceMemory,
    /// The bytes held per category at each step's end (`memory.by_category` on `step` lines).
    StepByCategory,
    /// The bytes held per category before and after each phase (`memory_before.by_category` on
    /// `phase` lines, `memory_after.by_category` on `phase_end` lines).
    MemoryByCategory,
    /// Blocks recomputed under activation checkpointing (`recomputed_blocks` on `step` lines)
    /// and the model's blocks (`run.layers`).
    RecomputedBlocks,
    /// The trainer's own prediction of each step's memory (the built-in engine's memory model).
    MemoryModel,
    /// Allocations the device refused (`memory.oom_count` on `step` lines).
    OomCount,
    /// What each checkpoint held on disk once complete (`on_disk` on `save` lines).
    OnDisk,
}

impl RecordField {
    /// Where the record keeps it, for a reason given to people.
    pub fn place(self) -> &'static str {
        match self {
            RecordField::Samples => "no step line carries `samples`",
            RecordField::StepMemory => "no step line carries `memory.allocated_peak`",
            RecordField::DeviceMemory => {
                "its step memory is not a device allocator's count (`memory.source` is not `engine` or `cuda`)"
            }
            RecordField::StepByCategory => "no step line carries `memory.by_category`",
            RecordField::MemoryByCategory => {
                "its phase and phase_end lines do not all carry `memory_before.by_category` and `memory_after.by_category`"
            }
            RecordField::RecomputedBlocks => {
                "no step line carries `recomputed_blocks`, or the phase line no `run.layers`"
            }
            RecordField::MemoryModel => {
                "it holds no memory model's prediction (the built-in engine's `extensions`)"
            }
            RecordField::OomCount => "no step line carries `memory.oom_count`",
            RecordField::OnDisk => "no save line carries `on_disk`",
        }
    }
}

impl fmt::Display for RecordField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.place())
    }
}
