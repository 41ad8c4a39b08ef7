//! Host memory for tensors kept for a whole run (weights, master weights, gradients, optimizer
//! moments) that are too small for a mapping of their own, carved one after another from shared
//! huge-page mappings.
//!
//! A tensor under one huge page would come from the allocator, in 4 KiB pages, each faulted in
//! and cleared on its own: several times a huge page's cost per byte, and a checkpoint load
//! writes every byte of them (a model's attention projections, a rank's shard of most tensors);
//! recycled heap memory is cleared with `memset` when it is allocated, even where the first
//! step writes it anyway (a rank's gradient shards).
//! One of a few huge pages would have a mapping of its own whose last huge page the kernel
//! clears whole, mostly for nothing. Kept tensors of [`KEPT_FROM`] to [`KEPT_UP_TO`] bytes
//! instead take consecutive places in a [`CHUNK`]-byte mapping in huge pages; only the huge
//! page a chunk ends in is cleared beyond what its tensors hold (at most 2 MiB a chunk, not
//! counted by the tracker, as the unused end of a tensor's own mapping is not). Space is never
//! reused: a chunk is unmapped when the last tensor in it is freed, and the tracker holds no
//! chunk itself, so nothing outlives the tensors.

use super::{Mapping, HUGE_PAGE};
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// The smallest tensor carved from a chunk: smaller ones cost little to fault in.
pub(crate) const KEPT_FROM: usize = 64 << 10;

/// The largest tensor carved from a chunk. Larger ones have mappings of their own, whose last
/// huge page, cleared whole, is a small part of them.
pub(crate) const KEPT_UP_TO: usize = CHUNK / 4;

/// Bytes of a chunk: 16 huge pages.
pub(crate) const CHUNK: usize = 16 * HUGE_PAGE;

/// Where each tensor starts in a chunk: a page boundary, so that no page holds two tensors.
const ALIGN: usize = 4 << 10;

/// A mapping that kept tensors are carved from, unmapped when dropped.
pub(crate) struct Chunk {
    _map: Mapping,
    base: *mut u8,
}

// SAFETY: `base` points into `map`, which lives as long as the chunk; the places carved from it
// are disjoint, and each is accessed only through the one buffer it was carved for.
unsafe impl Send for Chunk {}
// SAFETY: as for `Send`: no two buffers share a byte of the chunk.
unsafe impl Sync for Chunk {}

impl Chunk {
    /// The address of the chunk's byte `offset`.
    pub(crate) fn at(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= CHUNK);
        // SAFETY: within the mapping's span (checked by the carving).
        unsafe { self.base.add(offset) }
    }
}

/// The chunk being carved and the first free byte in it, for one tracker.
#[derive(Default)]
pub(crate) struct Kept {
    current: Mutex<(Weak<Chunk>, usize)>,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Kept")
    }
}

impl Kept {
    /// A zeroed place for `bytes` bytes in a chunk, as the chunk and the place's offset; `None`
    /// where `bytes` is outside [`KEPT_FROM`]..=[`KEPT_UP_TO`] or the host has no chunk to give.
    pub(crate) fn carve(&self, bytes: usize) -> Option<(Arc<Chunk>, usize)> {
        if !(KEPT_FROM..=KEPT_UP_TO).contains(&bytes) {
            return None;
        }
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        let (chunk, offset) = &mut *current;
        let at = offset.next_multiple_of(ALIGN);
        if let Some(chunk) = chunk.upgrade().filter(|_| at + bytes <= CHUNK) {
            *offset = at + bytes;
            return Some((chunk, at));
        }
        let mut map = Mapping::new(CHUNK)?;
        let base = map.bytes_mut(CHUNK).as_mut_ptr();
        let fresh = Arc::new(Chunk { _map: map, base });
        *current = (Arc::downgrade(&fresh), bytes);
        Some((fresh, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_places_are_disjoint_aligned_zeroed_and_share_a_huge_page_aligned_chunk() {
        let kept = Kept::default();
        assert!(kept.carve(KEPT_FROM - 1).is_none());
        assert!(kept.carve(KEPT_UP_TO + 1).is_none());
        let sizes = [
            KEPT_FROM,
            3 * KEPT_FROM + 5,
            HUGE_PAGE + 1,
            KEPT_UP_TO,
            KEPT_FROM,
        ];
        let places: Vec<_> = sizes.iter().map(|&n| kept.carve(n).unwrap()).collect();
        let first = &places[0].0;
        assert_eq!(first.at(0) as usize % HUGE_PAGE, 0);
        let mut end = 0;
        for ((chunk, offset), &n) in places.iter().zip(&sizes) {
            assert!(Arc::ptr_eq(chunk, first), "one chunk");
            assert_eq!(offset % ALIGN, 0);
            assert!(*offset >= end, "disjoint");
            end = offset + n;
            // SAFETY: the place is `n` bytes of the chunk, carved for this test alone.
            let bytes = unsafe { std::slice::from_raw_parts_mut(chunk.at(*offset), n) };
            assert!(bytes.iter().all(|&b| b == 0));
            bytes.fill(0xab);
        }
    }

    #[test]
    fn a_full_or_freed_chunk_gives_way_to_a_new_one() {
        let kept = Kept::default();
        let n = KEPT_UP_TO;
        let held: Vec<_> = (0..CHUNK / KEPT_UP_TO)
            .map(|_| kept.carve(n).unwrap())
            .collect();
        assert!(held.iter().all(|(c, _)| Arc::ptr_eq(c, &held[0].0)));
        let (next, offset) = kept.carve(n).unwrap();
        assert!(!Arc::ptr_eq(&next, &held[0].0), "the first chunk is full");
        assert_eq!(offset, 0);
        let weak = Arc::downgrade(&held[0].0);
        drop(held);
        assert!(weak.upgrade().is_none(), "unmapped with its last tensor");
        drop(next);
        let (again, offset) = kept.carve(KEPT_FROM).unwrap();
        assert_eq!(
            (Arc::strong_count(&again), offset),
            (1, 0),
            "nothing held it"
        );
    }
}
