//! Host memory for large tensors: anonymous mappings at a 2 MiB boundary in 2 MiB pages where
//! Linux gives them, and the tracker's spares, the mappings of freed tensors kept for the next
//! tensors of the same size. A training step's activations so reuse the last step's memory
//! instead of faulting in fresh pages that the kernel must clear.

use super::MemoryTracker;
use memmap2::MmapMut;
use std::collections::HashMap;
use std::sync::Mutex;

/// Bytes of a huge page: the alignment of a mapping and the granule of its size.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// An anonymous mapping with a huge-page-aligned span of `span` bytes from `offset`.
pub(crate) struct Mapping {
    map: MmapMut,
    offset: usize,
    span: usize,
}

impl Mapping {
    /// A fresh, zeroed mapping whose span holds `span` bytes (a multiple of [`HUGE_PAGE`]).
    pub(crate) fn new(span: usize) -> Option<Self> {
        // One huge page more than the span, so that a boundary lies within the first one.
        let map = MmapMut::map_anon(span.checked_add(HUGE_PAGE)?).ok()?;
        let offset = (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize;
        #[cfg(target_os = "linux")]
        {
            // Advice only: where the system has no huge pages to give, small pages serve.
            let _ = map.advise_range(memmap2::Advice::HugePage, offset, span);
        }
        Some(Mapping { map, offset, span })
    }

    pub(crate) fn bytes(&self, len: usize) -> &[u8] {
        &self.map[self.offset..self.offset + len]
    }

    pub(crate) fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        &mut self.map[self.offset..self.offset + len]
    }
}

/// Mappings of freed tensors, by span, kept for the tensors that follow. A tracker holds them
/// while the bytes they hold and the tracker's live bytes stay within the tracker's peak, so the
/// host never holds more than the most the tracker has counted; they are unmapped with the
/// tracker.
#[derive(Default)]
pub struct Spares {
    inner: Mutex<SparesInner>,
}

#[derive(Default)]
struct SparesInner {
    by_span: HashMap<usize, Vec<Mapping>>,
    held: u64,
}

impl std::fmt::Debug for Spares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Spares({} bytes)", self.lock().held)
    }
}

impl Spares {
    fn lock(&self) -> std::sync::MutexGuard<'_, SparesInner> {
        // Every update is a map insertion or removal and one addition: a panic cannot leave it
        // half done, so a poisoned lock is still consistent.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A kept mapping of `span` bytes, if there is one.
    pub(crate) fn take(&self, span: usize) -> Option<Mapping> {
        let mut s = self.lock();
        let map = s.by_span.get_mut(&span)?.pop()?;
        s.held -= span as u64;
        Some(map)
    }

    /// Keeps `map`, or unmaps it when keeping it would take the host past the tracker's peak.
    pub(crate) fn keep(&self, map: Mapping, tracker: &MemoryTracker) {
        let (current, peak) = tracker.current_and_peak();
        let mut s = self.lock();
        // `current` still counts the freed tensor's bytes, which the kept mapping takes over.
        if s.held + current <= peak {
            s.held += map.span as u64;
            s.by_span.entry(map.span).or_default().push(map);
        }
    }

    /// Bytes the kept mappings hold.
    #[cfg(test)]
    pub(crate) fn held(&self) -> u64 {
        self.lock().held
    }
}
