//! The allocation events of one phase as the engine's tracker reports them, each with the
//! return addresses of the call stack that made it, the time, and the marker (the step) it
//! happened under. Stacks are resolved to frames only when the trace is written.

use ckpt_engine::memory::{AllocationEvent, AllocationObserver};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

/// The deepest call stack kept per event.
const MAX_DEPTH: usize = 64;

/// What an entry of the recording says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum What {
    /// The tracker counted an allocation, a free or a refusal.
    Memory(AllocationEvent),
    /// The phase moved to another marker (a step began).
    Mark,
}

/// One entry of the recording.
#[derive(Clone, Debug)]
pub struct Entry {
    /// What happened.
    pub what: What,
    /// The marker in force, an index into the caller's list.
    pub marker: usize,
    /// Microseconds since the recording began.
    pub micros: u64,
    /// Return addresses of the call stack, innermost first (empty for a marker).
    pub stack: Vec<usize>,
}

/// Records every event a tracker reports while it observes (see
/// [`ckpt_engine::memory::MemoryTracker::observe`]).
#[derive(Debug)]
pub struct Recorder {
    started: Instant,
    marker: AtomicUsize,
    entries: Mutex<Vec<Entry>>,
}

impl Recorder {
    /// An empty recording under marker `marker`.
    pub fn new(marker: usize) -> Self {
        Recorder {
            started: Instant::now(),
            marker: AtomicUsize::new(marker),
            entries: Mutex::new(Vec::new()),
        }
    }

    fn entries(&self) -> MutexGuard<'_, Vec<Entry>> {
        // Entries are pushed whole; a panic elsewhere cannot leave one half-written.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, what: What, stack: Vec<usize>) {
        let micros = self.started.elapsed().as_micros() as u64;
        let marker = self.marker.load(Ordering::Relaxed);
        self.entries().push(Entry {
            what,
            marker,
            micros,
            stack,
        });
    }

    /// Events from now on happen under `marker`.
    pub fn mark(&self, marker: usize) {
        self.marker.store(marker, Ordering::Relaxed);
        self.push(What::Mark, Vec::new());
    }

    /// Everything recorded so far, in order; the recording is left empty.
    pub fn take(&self) -> Vec<Entry> {
        std::mem::take(&mut *self.entries())
    }
}

impl AllocationObserver for Recorder {
    fn event(&self, event: AllocationEvent) {
        let mut stack = Vec::with_capacity(MAX_DEPTH);
        backtrace::trace(|frame| {
            stack.push(frame.ip() as usize);
            stack.len() < MAX_DEPTH
        });
        self.push(What::Memory(event), stack);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_engine::memory::{Category, MemoryTracker};
    use std::sync::Arc;

    #[test]
    fn records_events_in_order_under_their_marker_with_a_stack() {
        let t = MemoryTracker::unlimited();
        let rec = Arc::new(Recorder::new(0));
        t.observe(Some(rec.clone()));
        let a = t.allocate(100, Category::Grads).unwrap();
        rec.mark(1);
        drop(a);
        t.observe(None);
        let got = rec.take();
        let whats: Vec<(What, usize)> = got.iter().map(|e| (e.what, e.marker)).collect();
        assert_eq!(
            whats,
            [
                (
                    What::Memory(AllocationEvent::Alloc {
                        id: 1,
                        bytes: 100,
                        category: Category::Grads
                    }),
                    0
                ),
                (What::Mark, 1),
                (
                    What::Memory(AllocationEvent::Free {
                        id: 1,
                        bytes: 100,
                        category: Category::Grads
                    }),
                    1
                ),
            ]
        );
        assert!(!got[0].stack.is_empty());
        assert!(got[1].stack.is_empty());
        assert!(rec.take().is_empty());
    }
}
