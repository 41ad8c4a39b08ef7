//! A tensor's host storage, zero-filled unless it is an output written before it is read: large
//! buffers are the tracker's mappings ([`crate::memory`]'s spares, reused from freed tensors
//! where one of the size is kept, zeroed again for all but such outputs), mid-sized ones kept
//! for the run are carved from shared huge-page mappings ([`crate::memory`]'s kept chunks),
//! small ones come from the allocator.

use crate::memory::{Chunk, Mapping, MemoryTracker, HUGE_PAGE};
use crate::tensor::Elem;
use std::sync::Arc;

/// The smallest buffer that is mapped rather than allocated: one huge page.
const MAP_FROM: usize = HUGE_PAGE;

/// Storage for `len` elements of `E`.
pub(crate) enum Buffer<E: Elem> {
    /// From the global allocator.
    Heap(Vec<E>),
    /// An anonymous mapping: `len` elements from a huge-page boundary.
    Mapped {
        map: Mapping,
        len: usize,
        _elem: std::marker::PhantomData<E>,
    },
    /// `len` elements from byte `offset` of a kept chunk, which no other buffer overlaps.
    Carved {
        chunk: Arc<Chunk>,
        offset: usize,
        len: usize,
        _elem: std::marker::PhantomData<E>,
    },
}

impl<E: Elem> Buffer<E> {
    /// `len` zeroed elements, reusing one of `tracker`'s spare mappings where one fits; `None`
    /// when the host cannot provide them.
    pub(crate) fn zeroed(len: usize, tracker: &MemoryTracker) -> Option<Self> {
        Self::taken(len, tracker, true)
    }

    /// `len` elements for an output written in full before it is read: as [`Buffer::zeroed`],
    /// except that a reused spare mapping keeps what the freed tensor left in it instead of
    /// being zeroed again (fresh memory is still zero).
    pub(crate) fn unfilled(len: usize, tracker: &MemoryTracker) -> Option<Self> {
        Self::taken(len, tracker, false)
    }

    /// `len` elements from the allocator (small), a spare mapping of `tracker`'s (zeroed again
    /// where `zero_spare`) or a fresh mapping.
    fn taken(len: usize, tracker: &MemoryTracker, zero_spare: bool) -> Option<Self> {
        let bytes = len.checked_mul(size_of::<E>())?;
        if bytes < MAP_FROM {
            return bytemuck::allocation::try_zeroed_vec(len)
                .ok()
                .map(Buffer::Heap);
        }
        let span = bytes.checked_next_multiple_of(HUGE_PAGE)?;
        let map = match tracker.spares().take(span) {
            Some(mut map) => {
                if zero_spare {
                    map.bytes_mut(bytes).fill(0);
                }
                map
            }
            None => Mapping::new(span)?,
        };
        Some(Buffer::Mapped {
            map,
            len,
            _elem: std::marker::PhantomData,
        })
    }

    /// `len` zeroed elements for a tensor kept for the run: carved from `tracker`'s kept
    /// chunks where their size is in the chunks' range, else as [`Buffer::zeroed`] gives them.
    pub(crate) fn zeroed_kept(len: usize, tracker: &MemoryTracker) -> Option<Self> {
        let bytes = len.checked_mul(size_of::<E>())?;
        match tracker.kept().carve(bytes) {
            Some((chunk, offset)) => Some(Buffer::Carved {
                chunk,
                offset,
                len,
                _elem: std::marker::PhantomData,
            }),
            None => Self::zeroed(len, tracker),
        }
    }

    /// Gives a mapped buffer's memory to `tracker`'s spares.
    pub(crate) fn recycle(self, tracker: &MemoryTracker) {
        if let Buffer::Mapped { map, .. } = self {
            tracker.spares().keep(map, tracker);
        }
    }

    /// The elements.
    pub(crate) fn as_slice(&self) -> &[E] {
        match self {
            Buffer::Heap(v) => v,
            Buffer::Mapped { map, len, .. } => {
                bytemuck::cast_slice(map.bytes(len * size_of::<E>()))
            }
            Buffer::Carved {
                chunk, offset, len, ..
            } => {
                // SAFETY: the place was carved for this buffer alone, page-aligned, `len`
                // elements long, inside the chunk, which the buffer keeps alive.
                unsafe { std::slice::from_raw_parts(chunk.at(*offset) as *const E, *len) }
            }
        }
    }

    /// The elements, for writing.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [E] {
        match self {
            Buffer::Heap(v) => v,
            Buffer::Mapped { map, len, .. } => {
                bytemuck::cast_slice_mut(map.bytes_mut(*len * size_of::<E>()))
            }
            Buffer::Carved {
                chunk, offset, len, ..
            } => {
                // SAFETY: as in `as_slice`; `&mut self` makes this the only view of the place.
                unsafe { std::slice::from_raw_parts_mut(chunk.at(*offset) as *mut E, *len) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Category;
    use half::bf16;

    #[test]
    fn small_and_large_buffers_start_zeroed_and_hold_what_is_written() {
        let tracker = MemoryTracker::unlimited();
        for len in [
            0,
            1,
            1000,
            MAP_FROM / 4 - 1,
            MAP_FROM / 4,
            3 * MAP_FROM / 4 + 5,
        ] {
            let mut b = Buffer::<f32>::zeroed(len, &tracker).unwrap();
            assert_eq!(b.as_slice().len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0.0));
            assert_eq!(
                matches!(b, Buffer::Mapped { .. }),
                len * 4 >= MAP_FROM,
                "{len}"
            );
            for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
                *x = i as f32;
            }
            assert!(b.as_slice().iter().enumerate().all(|(i, &x)| x == i as f32));
        }
        let b = Buffer::<bf16>::zeroed(MAP_FROM, &tracker).unwrap();
        assert_eq!(b.as_slice().as_ptr() as usize % HUGE_PAGE, 0);
        assert!(b.as_slice().iter().all(|x| x.to_f32() == 0.0));
    }

    #[test]
    fn kept_buffers_of_middle_sizes_are_carved_apart_and_others_are_not() {
        use crate::memory::{KEPT_FROM, KEPT_UP_TO};
        let tracker = MemoryTracker::unlimited();
        let cases = [
            (KEPT_FROM / 4 - 1, false),
            (KEPT_FROM / 4, true),
            (HUGE_PAGE / 4 + 3, true),
            (KEPT_UP_TO / 4, true),
            (KEPT_UP_TO / 4 + 1, false),
        ];
        let mut held = Vec::new();
        for (i, (len, carved)) in cases.into_iter().enumerate() {
            let mut b = Buffer::<f32>::zeroed_kept(len, &tracker).unwrap();
            assert_eq!(matches!(b, Buffer::Carved { .. }), carved, "{len}");
            assert_eq!(b.as_slice().len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0.0), "{len}");
            b.as_mut_slice().fill(i as f32 + 1.0);
            held.push(b);
        }
        for (i, b) in held.iter().enumerate() {
            assert!(b.as_slice().iter().all(|&x| x == i as f32 + 1.0), "{i}");
        }
        assert_eq!(tracker.spares().held(), 0);
    }

    #[test]
    fn a_size_past_the_address_space_is_refused() {
        let tracker = MemoryTracker::unlimited();
        assert!(Buffer::<f32>::zeroed(usize::MAX / 2, &tracker).is_none());
        assert!(Buffer::<f32>::zeroed(usize::MAX / 8, &tracker).is_none());
    }

    #[test]
    fn a_freed_buffer_is_reused_zeroed_and_spares_stay_within_the_peak() {
        let tracker = MemoryTracker::unlimited();
        let len = MAP_FROM / 4 + 3;
        let span = 2 * HUGE_PAGE as u64;
        let lease = tracker
            .allocate(len as u64 * 4, Category::Activations)
            .unwrap();
        let mut b = Buffer::<f32>::zeroed(len, &tracker).unwrap();
        b.as_mut_slice().fill(7.0);
        let ptr = b.as_slice().as_ptr();
        b.recycle(&tracker);
        drop(lease);
        assert_eq!(tracker.spares().held(), span);
        let again = Buffer::<f32>::zeroed(len, &tracker).unwrap();
        assert_eq!(again.as_slice().as_ptr(), ptr, "the spare mapping, reused");
        assert!(again.as_slice().iter().all(|&x| x == 0.0));
        assert_eq!(tracker.spares().held(), 0);
        // With nothing counted now, one spare brings the host to the peak: a second is unmapped.
        let other = Buffer::<f32>::zeroed(len, &tracker).unwrap();
        again.recycle(&tracker);
        other.recycle(&tracker);
        assert_eq!(tracker.spares().held(), span);
    }

    #[test]
    fn an_output_reuses_a_spare_as_the_freed_buffer_left_it_and_fresh_memory_zeroed() {
        let tracker = MemoryTracker::unlimited();
        let len = MAP_FROM / 4 + 3;
        let lease = tracker
            .allocate(len as u64 * 4, Category::Activations)
            .unwrap();
        let fresh = Buffer::<f32>::unfilled(len, &tracker).unwrap();
        assert!(fresh.as_slice().iter().all(|&x| x == 0.0));
        drop(fresh);
        let mut b = Buffer::<f32>::zeroed(len, &tracker).unwrap();
        b.as_mut_slice().fill(7.0);
        let ptr = b.as_slice().as_ptr();
        b.recycle(&tracker);
        drop(lease);
        let out = Buffer::<f32>::unfilled(len, &tracker).unwrap();
        assert_eq!(out.as_slice().as_ptr(), ptr, "the spare mapping, reused");
        assert!(
            out.as_slice().iter().all(|&x| x == 7.0),
            "not zeroed a second time"
        );
        assert!(Buffer::<f32>::unfilled(100, &tracker)
            .unwrap()
            .as_slice()
            .iter()
            .all(|&x| x == 0.0));
    }
}
