//! A file's checksums as its record keeps them: computed while a file is written, and checked
//! while it is read, range by range.
//!
//! From format version 5 a file is recorded by the XXH3-128 of each [`SEGMENT`]-byte segment
//! ([`Segments`]): each segment is checked on its own, so a load checks them on every core at
//! once, each right after reading it, while it is in cache. Older records hold one checksum of
//! the whole file (XXH3-128, or sha256 before that), which must see its bytes in order.

use super::state::{FileRecord, Segments};
use sha2::{Digest, Sha256};
use std::ops::Range;
use twox_hash::XxHash3_128;

/// Bytes of a segment in the files this build writes: enough segments in a checkpoint for every
/// core to take its share, few enough that a 200 GB state lists about 12,000 of them.
pub const SEGMENT: u64 = 16 << 20;

fn xxh3_hex(hasher: &XxHash3_128) -> String {
    format!("{:032x}", hasher.finish_128())
}

/// Hashes a stream of bytes in order, as it is written or read, into the XXH3-128 of each of
/// its fixed-size segments: a file's [`Segments`], or a sharded tensor's hash blocks.
pub struct SegmentHasher {
    size: u64,
    filled: u64,
    current: Box<XxHash3_128>,
    done: Vec<u128>,
}

impl Default for SegmentHasher {
    fn default() -> Self {
        SegmentHasher::new(SEGMENT)
    }
}

impl SegmentHasher {
    /// A hasher cutting segments of `size` bytes (more than zero).
    pub fn new(size: u64) -> Self {
        assert!(size > 0, "a segment holds at least one byte");
        SegmentHasher {
            size,
            filled: 0,
            current: Box::default(),
            done: Vec::new(),
        }
    }

    /// Hashes the next `bytes` of the stream.
    pub fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let room = (self.size - self.filled).min(bytes.len() as u64) as usize;
            let (now, rest) = bytes.split_at(room);
            self.current.write(now);
            self.filled += room as u64;
            if self.filled == self.size {
                self.done.push(self.current.finish_128());
                *self.current = XxHash3_128::new();
                self.filled = 0;
            }
            bytes = rest;
        }
    }

    /// Each segment's digest, in order (none for an empty stream).
    pub fn digests(mut self) -> Vec<u128> {
        if self.filled > 0 {
            self.done.push(self.current.finish_128());
        }
        self.done
    }

    /// The segments' checksums, as a file's record keeps them.
    pub fn finish(self) -> Segments {
        let bytes = self.size;
        let xxh3_128 = self.digests().iter().map(|d| format!("{d:032x}")).collect();
        Segments { bytes, xxh3_128 }
    }
}

/// A file's checksummed ranges, in file order, each with the checksum its bytes must match.
pub(super) type Streams = Vec<(Range<u64>, Verifier)>;

/// The checksum a range of a file's bytes must match, fed those bytes in order.
pub(super) struct Verifier {
    hasher: Hasher,
    want: Option<String>,
}

enum Hasher {
    Xxh3(Box<XxHash3_128>),
    Sha256(Sha256),
}

impl Verifier {
    fn xxh3(want: &str) -> Self {
        Verifier {
            hasher: Hasher::Xxh3(Box::default()),
            want: Some(want.to_owned()),
        }
    }

    /// The ranges of the file `record` describes that its checksums cover, in file order and
    /// together the whole file, each with its checksum: its segments, or the whole file in one
    /// range (its XXH3-128, else its sha256; a record with neither matches nothing). A segment
    /// list that does not fit the file's size is an error saying how.
    pub(super) fn streams(record: &FileRecord) -> std::result::Result<Streams, String> {
        let whole = 0..record.bytes;
        let Some(segments) = &record.segments else {
            let verifier = match (&record.xxh3_128, &record.sha256) {
                (Some(xxh3), _) => Verifier::xxh3(xxh3),
                (None, sha256) => Verifier {
                    hasher: Hasher::Sha256(Sha256::new()),
                    want: sha256.clone(),
                },
            };
            return Ok(vec![(whole, verifier)]);
        };
        let fits = segments.bytes > 0
            && record.bytes.div_ceil(segments.bytes.max(1)) == segments.xxh3_128.len() as u64;
        if !fits {
            return Err(format!(
                "has {} bytes, but its record lists {} segments of {} bytes (the record was edited)",
                record.bytes,
                segments.xxh3_128.len(),
                segments.bytes
            ));
        }
        let starts = (0..record.bytes).step_by(segments.bytes as usize);
        Ok(starts
            .zip(&segments.xxh3_128)
            .map(|(start, want)| {
                let end = (start + segments.bytes).min(record.bytes);
                (start..end, Verifier::xxh3(want))
            })
            .collect())
    }

    /// Feeds the range's next `bytes`.
    pub(super) fn update(&mut self, bytes: &[u8]) {
        match &mut self.hasher {
            Hasher::Xxh3(h) => h.write(bytes),
            Hasher::Sha256(h) => h.update(bytes),
        }
    }

    /// Whether the bytes fed match the checksum.
    pub(super) fn matches(self) -> bool {
        let found = match self.hasher {
            Hasher::Xxh3(h) => xxh3_hex(&h),
            Hasher::Sha256(h) => format!("{:x}", h.finalize()),
        };
        self.want == Some(found)
    }
}

/// Whether `bytes`, a whole file's content, match `record` (its size and every checksum).
pub(super) fn matches(record: &FileRecord, bytes: &[u8]) -> bool {
    if bytes.len() as u64 != record.bytes {
        return false;
    }
    Verifier::streams(record).is_ok_and(|streams| {
        streams.into_iter().all(|(range, mut verifier)| {
            verifier.update(&bytes[range.start as usize..range.end as usize]);
            verifier.matches()
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 253) as u8).collect()
    }

    #[test]
    fn segments_are_the_same_however_the_bytes_arrive() {
        let content = bytes(10 * 7 + 3);
        let direct: Vec<String> = content
            .chunks(7)
            .map(|s| format!("{:032x}", xxhash_rust::xxh3::xxh3_128(s)))
            .collect();
        for step in [1, 3, 7, 8, 100] {
            let mut h = SegmentHasher::new(7);
            content.chunks(step).for_each(|p| h.update(p));
            let segments = h.finish();
            assert_eq!((segments.bytes, &segments.xxh3_128), (7, &direct), "{step}");
        }
        let mut exact = SegmentHasher::new(7);
        exact.update(&content[..70]);
        assert_eq!(exact.finish().xxh3_128.len(), 10, "no empty last segment");
        assert!(SegmentHasher::new(7).finish().xxh3_128.is_empty());
    }

    #[test]
    fn every_segment_is_checked_and_a_record_that_does_not_fit_is_refused() {
        let content = bytes(50);
        let mut h = SegmentHasher::new(16);
        h.update(&content);
        let record = FileRecord {
            bytes: 50,
            sha256: None,
            xxh3_128: None,
            segments: Some(h.finish()),
        };
        assert!(matches(&record, &content));
        let ranges: Vec<_> = Verifier::streams(&record)
            .unwrap()
            .into_iter()
            .map(|(r, _)| r)
            .collect();
        assert_eq!(ranges, [0..16, 16..32, 32..48, 48..50]);
        for at in [0, 15, 16, 47, 49] {
            let mut damaged = content.clone();
            damaged[at] ^= 1;
            assert!(!matches(&record, &damaged), "byte {at}");
        }
        assert!(!matches(&record, &content[..49]));

        let mut short = record.clone();
        short.segments.as_mut().unwrap().xxh3_128.pop();
        let e = Verifier::streams(&short).err().unwrap();
        assert_eq!(
            e,
            "has 50 bytes, but its record lists 3 segments of 16 bytes (the record was edited)"
        );
        let mut zero = record;
        zero.segments.as_mut().unwrap().bytes = 0;
        assert!(Verifier::streams(&zero).is_err());
        assert!(!matches(&zero, &content));
    }
}
