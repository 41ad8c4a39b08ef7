//! A simulated memory tracker: the same bookkeeping as [`crate::memory::MemoryTracker`] (current,
//! peak, per-category peaks, the breakdown at the peak, allocation count), driven by a replay of
//! the code's allocations instead of real buffers.

use crate::memory::{Breakdown, Category};

/// The parts of a step whose peaks are reported separately.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Embedding, blocks and the final norm.
    Forward,
    /// The fused LM head and cross-entropy, which also yields the head's gradients.
    Loss,
    /// The final norm's and the blocks' backward passes, recomputation included.
    Backward,
    /// Clipping, AdamW (allocating its moments at the first step) and the bf16 weight refresh.
    Optimizer,
}

const PHASES: usize = 4;

/// Bytes held under one category, as a replayed allocation. Not `Clone`: every allocation is
/// either freed once or kept past the step.
#[must_use = "a replayed allocation must be freed or kept"]
pub(super) struct Buf {
    bytes: u64,
    category: Category,
}

/// Replayed allocations and their peaks, starting from what a step finds allocated.
pub(super) struct Timeline {
    current: [u64; 6],
    peak: u64,
    at_peak: [u64; 6],
    category_peak: [u64; 6],
    allocations: u64,
    phase: Phase,
    phase_peak: [u64; PHASES],
    phase_start: [Breakdown; PHASES],
}

impl Timeline {
    /// A timeline whose peak window starts with `start` held, as after `reset_peak`.
    pub(super) fn new(start: Breakdown) -> Self {
        let current = Category::ALL.map(|c| start.get(c));
        let total = current.iter().sum();
        Timeline {
            current,
            peak: total,
            at_peak: current,
            category_peak: current,
            allocations: 0,
            phase: Phase::Forward,
            phase_peak: [total; PHASES],
            phase_start: [start; PHASES],
        }
    }

    fn total(&self) -> u64 {
        self.current.iter().sum()
    }

    /// Starts `phase`: its peak counts from what is held now.
    pub(super) fn enter(&mut self, phase: Phase) {
        self.phase = phase;
        self.phase_peak[phase as usize] = self.total();
        self.phase_start[phase as usize] = Breakdown::from(self.current);
    }

    /// Takes `bytes` under `category`, updating the peaks as the tracker does.
    pub(super) fn alloc(&mut self, category: Category, bytes: u64) -> Buf {
        let c = category as usize;
        self.allocations += 1;
        self.current[c] += bytes;
        self.category_peak[c] = self.category_peak[c].max(self.current[c]);
        let total = self.total();
        if total >= self.peak {
            self.peak = total;
            self.at_peak = self.current;
        }
        let p = &mut self.phase_peak[self.phase as usize];
        *p = (*p).max(total);
        Buf { bytes, category }
    }

    /// Gives an allocation back.
    pub(super) fn free(&mut self, buf: Buf) {
        self.current[buf.category as usize] -= buf.bytes;
    }

    /// Lets an allocation outlive the step (optimizer moments).
    pub(super) fn keep(&mut self, _outlives_the_step: Buf) {}

    /// The peak window's figures.
    pub(super) fn finish(self) -> Replayed {
        Replayed {
            end: Breakdown::from(self.current),
            peak: self.peak,
            at_peak: Breakdown::from(self.at_peak),
            peak_by_category: Breakdown::from(self.category_peak),
            allocations: self.allocations,
            phase_peak: self.phase_peak,
            phase_start: self.phase_start,
        }
    }
}

/// What a replay ends with.
pub(super) struct Replayed {
    pub(super) end: Breakdown,
    pub(super) peak: u64,
    pub(super) at_peak: Breakdown,
    pub(super) peak_by_category: Breakdown,
    pub(super) allocations: u64,
    pub(super) phase_peak: [u64; PHASES],
    pub(super) phase_start: [Breakdown; PHASES],
}

impl Replayed {
    /// The peak of one phase.
    pub(super) fn phase(&self, phase: Phase) -> u64 {
        self.phase_peak[phase as usize]
    }

    /// What was held when `phase` started.
    pub(super) fn start_of(&self, phase: Phase) -> Breakdown {
        self.phase_start[phase as usize]
    }
}
