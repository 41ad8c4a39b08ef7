//! The hash of a whole tensor of a sharded checkpoint (`TensorIndex::xxh3_128`), which checks
//! that its chunks were put together in their places. Up to format version 4 it is the XXH3-128
//! of the tensor's row-major bytes, which can only be fed in row order. From
//! [`BLOCK_HASHED_FROM`] it is the XXH3-128 of the XXH3-128 digests (16 bytes each, the `u128`
//! little-endian) of the tensor's bytes cut into blocks of [`HASH_BLOCK`] bytes (the last one
//! shorter), in order: the blocks are in the tensor's own coordinates, so the hash is the same
//! at every world size, and each block can be hashed on its own, by whichever rank holds it,
//! while it is in cache. [`TensorHash::of_version`] picks the definition from the checkpoint's
//! format version; everything that computes or checks a whole tensor's hash goes through it.

use super::checksum::SegmentHasher;
use std::ops::Range;
use std::sync::OnceLock;
use twox_hash::XxHash3_128;

/// Bytes of one hash block of a whole tensor (format version [`BLOCK_HASHED_FROM`] on).
pub const HASH_BLOCK: usize = 64 << 10;

/// The first format version whose whole-tensor hashes are over [`HASH_BLOCK`]-byte blocks.
pub const BLOCK_HASHED_FROM: u32 = 5;

/// How a checkpoint's whole-tensor hashes are defined.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TensorHash {
    /// XXH3-128 of the tensor's bytes (format versions up to 4).
    Plain,
    /// XXH3-128 of the digests of its [`HASH_BLOCK`]-byte blocks (format version 5 on).
    #[default]
    Blocks,
}

impl TensorHash {
    /// The definition a checkpoint of format version `format_version` uses.
    pub fn of_version(format_version: u32) -> Self {
        if format_version >= BLOCK_HASHED_FROM {
            TensorHash::Blocks
        } else {
            TensorHash::Plain
        }
    }

    /// The hex hash of the whole tensor `bytes`.
    pub fn hex(self, bytes: &[u8]) -> String {
        match self {
            TensorHash::Plain => hex(XxHash3_128::oneshot(bytes)),
            TensorHash::Blocks => finish(bytes.chunks(HASH_BLOCK).map(XxHash3_128::oneshot)),
        }
    }

    /// A hasher fed the tensor's bytes in order, in pieces of any length.
    pub fn hasher(self) -> TensorHasher {
        match self {
            TensorHash::Plain => TensorHasher::Plain(Box::default()),
            TensorHash::Blocks => TensorHasher::Blocks(SegmentHasher::new(HASH_BLOCK as u64)),
        }
    }
}

/// A whole tensor's hash fed its bytes in order (see [`TensorHash::hasher`]): of the bytes
/// (plain), or of its blocks, whose digests are hashed when it is finished.
pub enum TensorHasher {
    /// [`TensorHash::Plain`].
    Plain(Box<XxHash3_128>),
    /// [`TensorHash::Blocks`].
    Blocks(SegmentHasher),
}

impl TensorHasher {
    /// Feeds the next `bytes` of the tensor.
    pub fn update(&mut self, bytes: &[u8]) {
        match self {
            TensorHasher::Plain(h) => h.write(bytes),
            TensorHasher::Blocks(h) => h.update(bytes),
        }
    }

    /// The hex hash of the bytes fed.
    pub fn hex(self) -> String {
        match self {
            TensorHasher::Plain(h) => hex(h.finish_128()),
            TensorHasher::Blocks(h) => finish(h.digests()),
        }
    }
}

/// The number of hash blocks of a tensor of `bytes` bytes.
pub fn block_count(bytes: usize) -> usize {
    bytes.div_ceil(HASH_BLOCK)
}

/// The bytes of block `block` of a tensor of `bytes` bytes.
pub fn block_bytes(block: usize, bytes: usize) -> Range<usize> {
    block * HASH_BLOCK..((block + 1) * HASH_BLOCK).min(bytes)
}

/// The blocks of a tensor of `bytes` bytes that lie wholly inside its bytes `inside`.
pub fn blocks_within(inside: Range<usize>, bytes: usize) -> Range<usize> {
    let first = inside.start.div_ceil(HASH_BLOCK);
    let end = if inside.end >= bytes {
        block_count(bytes)
    } else {
        inside.end / HASH_BLOCK
    };
    first..end.max(first)
}

/// The digest of one block's bytes.
pub fn block_digest(bytes: &[u8]) -> u128 {
    XxHash3_128::oneshot(bytes)
}

/// The hex whole-tensor hash ([`TensorHash::Blocks`]) from its blocks' digests, in order.
pub fn finish(digests: impl IntoIterator<Item = u128>) -> String {
    let mut outer = XxHash3_128::new();
    digests
        .into_iter()
        .for_each(|d| outer.write(&d.to_le_bytes()));
    hex(outer.finish_128())
}

/// One holder's stretch of a whole tensor's bytes, as it adds to the tensor's hash
/// ([`TensorHash::Blocks`]) without the rest of the tensor: the digests of the blocks lying
/// whole inside it, and its bytes of the blocks it shares with the stretches before and after
/// it. Ranks that each hold a stretch hash their own blocks, and one puts the hash together
/// from every rank's part ([`finish_parts`]): only the shared blocks' bytes travel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HashPart {
    /// Where the stretch starts in the tensor's bytes.
    pub at: usize,
    /// Its bytes before the first block it holds whole (all of them where it holds none).
    pub head: Vec<u8>,
    /// The digests of the blocks it holds whole, in order.
    pub digests: Vec<u128>,
    /// Its bytes after the last block it holds whole.
    pub tail: Vec<u8>,
}

impl HashPart {
    /// The part of the stretch `data`, which starts at byte `at` of a tensor of `bytes` bytes.
    pub fn of(data: &[u8], at: usize, bytes: usize) -> Self {
        let whole = blocks_within(at..at + data.len(), bytes);
        if whole.is_empty() {
            return HashPart {
                at,
                head: data.to_vec(),
                ..HashPart::default()
            };
        }
        let first = block_bytes(whole.start, bytes).start;
        let last = block_bytes(whole.end - 1, bytes).end;
        HashPart {
            at,
            head: data[..first - at].to_vec(),
            digests: whole
                .map(|b| {
                    let r = block_bytes(b, bytes);
                    block_digest(&data[r.start - at..r.end - at])
                })
                .collect(),
            tail: data[last - at..].to_vec(),
        }
    }

    /// The bytes of the stretch it stands for.
    pub fn stretch_bytes(&self) -> usize {
        self.head.len() + self.tail.len() + self.digests.len() * HASH_BLOCK
    }
}

/// `parts` as bytes, for ranks to send: their count, then each part's place, head, digests and
/// tail, each list after its length (every number 8 bytes, each digest 16, little-endian).
pub fn encode_parts(parts: &[HashPart]) -> Vec<u8> {
    let mut out = Vec::new();
    let number = |out: &mut Vec<u8>, n: usize| out.extend_from_slice(&(n as u64).to_le_bytes());
    number(&mut out, parts.len());
    for p in parts {
        number(&mut out, p.at);
        number(&mut out, p.head.len());
        out.extend_from_slice(&p.head);
        number(&mut out, p.digests.len());
        p.digests
            .iter()
            .for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
        number(&mut out, p.tail.len());
        out.extend_from_slice(&p.tail);
    }
    out
}

/// The parts [`encode_parts`] made `bytes` of; `None` where `bytes` are not such parts, or have
/// bytes after them.
pub fn decode_parts(bytes: &[u8]) -> Option<Vec<HashPart>> {
    let mut rest = Unread(bytes);
    let count = rest.number()?;
    let mut parts = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        let at = rest.number()?;
        let n = rest.number()?;
        let head = rest.take(n)?.to_vec();
        let n = rest.number()?.checked_mul(16)?;
        let digests = (rest.take(n)?.chunks_exact(16))
            .map(|d| u128::from_le_bytes(d.try_into().expect("16 bytes")))
            .collect();
        let n = rest.number()?;
        let tail = rest.take(n)?.to_vec();
        parts.push(HashPart {
            at,
            head,
            digests,
            tail,
        });
    }
    Some(parts).filter(|_| rest.0.is_empty())
}

/// Bytes not yet decoded.
struct Unread<'a>(&'a [u8]);

impl<'a> Unread<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (taken, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(taken)
    }

    fn number(&mut self) -> Option<usize> {
        usize::try_from(u64::from_le_bytes(self.take(8)?.try_into().ok()?)).ok()
    }
}

/// The hex whole-tensor hash ([`TensorHash::Blocks`]) of a tensor of `bytes` bytes from the
/// parts ([`HashPart`]) of stretches that tile it, in order; `None` where they do not: a gap, an
/// overlap, a stretch that ends short of the tensor or runs past it.
pub fn finish_parts<'p>(
    parts: impl IntoIterator<Item = &'p HashPart>,
    bytes: usize,
) -> Option<String> {
    let mut digests = Vec::with_capacity(block_count(bytes));
    // The block holding byte `next`, begun by the parts so far and not finished.
    let mut open: Option<XxHash3_128> = None;
    let mut next = 0;
    let mut shared = |mut data: &[u8], next: &mut usize, digests: &mut Vec<u128>| {
        while !data.is_empty() {
            if *next >= bytes {
                return None;
            }
            let end = block_bytes(*next / HASH_BLOCK, bytes).end;
            let take = data.len().min(end - *next);
            open.get_or_insert_with(XxHash3_128::new)
                .write(&data[..take]);
            (*next, data) = (*next + take, &data[take..]);
            if *next == end {
                digests.push(open.take()?.finish_128());
            }
        }
        Some(())
    };
    for part in parts {
        if part.at != next && part.stretch_bytes() > 0 {
            return None;
        }
        shared(&part.head, &mut next, &mut digests)?;
        if !part.digests.is_empty() {
            if next % HASH_BLOCK != 0 || next + (part.digests.len() - 1) * HASH_BLOCK >= bytes {
                return None;
            }
            digests.extend(&part.digests);
            next = block_bytes(next / HASH_BLOCK + part.digests.len() - 1, bytes).end;
        }
        shared(&part.tail, &mut next, &mut digests)?;
    }
    (next == bytes && digests.len() == block_count(bytes)).then(|| finish(digests))
}

/// A stretch of a whole tensor's bytes on its way in from a file, whose hash blocks
/// ([`TensorHash::Blocks`]) are hashed as it is read, while in cache: each block lying whole
/// inside what is read gets its digest in its slot, and a block across its ends is carried on
/// to the stretch read next ([`OpenBlock`]).
#[derive(Clone, Copy)]
pub struct BlockSlots<'a> {
    /// Where the stretch starts in the tensor's bytes.
    pub at: usize,
    /// The tensor's length in bytes.
    pub bytes: usize,
    /// One slot per hash block of the tensor, holding its digest once hashed.
    pub digests: &'a [OnceLock<u128>],
}

/// A hash block that the stretches read so far began and did not finish: its tensor's slots,
/// its number, where in the tensor the next byte of it starts, and its digest so far.
pub struct OpenBlock<'a> {
    digests: &'a [OnceLock<u128>],
    block: usize,
    next: usize,
    hasher: XxHash3_128,
}

impl<'a> BlockSlots<'a> {
    /// The same tensor's stretch `n` bytes further on.
    pub fn after(self, n: usize) -> Self {
        BlockSlots {
            at: self.at + n,
            ..self
        }
    }

    /// Hashes the blocks lying whole inside `read`, the tensor's bytes from `at` on, into their
    /// slots. `open` is the block the stretch read just before left unfinished: where `read`
    /// goes on with it (the same tensor, from the byte it stopped at), `read` finishes it, or
    /// carries it on if it ends first; otherwise it is dropped, and that block is left to
    /// [`finish_slots`]. On return, `open` holds the block `read` ends inside of, if `read` began
    /// it or carried it.
    pub fn hash_read(&self, read: &[u8], open: &mut Option<OpenBlock<'a>>) {
        let (start, end) = (self.at, self.at + read.len());
        if let Some(mut carried) = open.take() {
            if std::ptr::eq(carried.digests, self.digests) && carried.next == start {
                let block_end = block_bytes(carried.block, self.bytes).end;
                let upto = block_end.min(end);
                carried.hasher.write(&read[..upto - start]);
                carried.next = upto;
                if upto < block_end {
                    *open = Some(carried);
                    return;
                }
                // Blocks are hashed by one stretch each: a set slot is never set again.
                let _ = self.digests[carried.block].set(carried.hasher.finish_128());
            }
        }
        for b in blocks_within(start..end, self.bytes) {
            let bytes = block_bytes(b, self.bytes);
            let digest = block_digest(&read[bytes.start - start..bytes.end - start]);
            let _ = self.digests[b].set(digest);
        }
        let block = end / HASH_BLOCK;
        if end < self.bytes && end % HASH_BLOCK != 0 && block * HASH_BLOCK >= start {
            let mut hasher = XxHash3_128::new();
            hasher.write(&read[block * HASH_BLOCK - start..]);
            *open = Some(OpenBlock {
                digests: self.digests,
                block,
                next: end,
                hasher,
            });
        }
    }
}

/// Empty digest slots, one per hash block of a tensor of `bytes` bytes (see [`BlockSlots`]).
pub fn empty_slots(bytes: usize) -> Vec<OnceLock<u128>> {
    (0..block_count(bytes)).map(|_| OnceLock::new()).collect()
}

/// The hex whole-tensor hash ([`TensorHash::Blocks`]) of the tensor `whole`, each block's digest
/// taken from its slot in `digests` (see [`BlockSlots`]), or hashed from `whole` where it has
/// none.
pub fn finish_slots(digests: &[OnceLock<u128>], whole: &[u8]) -> String {
    finish(digests.iter().enumerate().map(|(b, slot)| {
        slot.get()
            .copied()
            .unwrap_or_else(|| block_digest(&whole[block_bytes(b, whole.len())]))
    }))
}

/// The bytes of a tensor of `bytes` bytes whose blocks have no digest in `digests` yet: what
/// [`finish_slots`] hashes from the whole.
pub fn unhashed_bytes(digests: &[OnceLock<u128>], bytes: usize) -> usize {
    digests
        .iter()
        .enumerate()
        .filter(|(_, slot)| slot.get().is_none())
        .map(|(b, _)| block_bytes(b, bytes).len())
        .sum()
}

fn hex(digest: u128) -> String {
    format!("{digest:032x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect()
    }

    /// The definition written out, through a second XXH3 implementation: XXH3-128 over the
    /// blocks' 16-byte little-endian digests.
    fn by_definition(data: &[u8]) -> String {
        let mut digests = Vec::new();
        for block in data.chunks(HASH_BLOCK) {
            digests.extend_from_slice(&xxhash_rust::xxh3::xxh3_128(block).to_le_bytes());
        }
        format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&digests))
    }

    #[test]
    fn the_version_picks_the_definition() {
        assert_eq!(TensorHash::of_version(3), TensorHash::Plain);
        assert_eq!(TensorHash::of_version(4), TensorHash::Plain);
        assert_eq!(TensorHash::of_version(5), TensorHash::Blocks);
        let data = bytes(3 * HASH_BLOCK + 100);
        assert_eq!(
            TensorHash::Plain.hex(&data),
            format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&data))
        );
        assert_eq!(TensorHash::Blocks.hex(&data), by_definition(&data));
        assert_ne!(TensorHash::Blocks.hex(&data), TensorHash::Plain.hex(&data));
    }

    #[test]
    fn fed_in_any_pieces_the_hash_is_the_whole_bytes_one() {
        for len in [
            0,
            1,
            HASH_BLOCK - 1,
            HASH_BLOCK,
            HASH_BLOCK + 1,
            5 * HASH_BLOCK + 333,
        ] {
            let data = bytes(len);
            for hash in [TensorHash::Plain, TensorHash::Blocks] {
                let want = hash.hex(&data);
                for piece in [1, 7, 4096, HASH_BLOCK - 3, HASH_BLOCK, 3 * HASH_BLOCK + 5] {
                    let mut h = hash.hasher();
                    data.chunks(piece).for_each(|p| h.update(p));
                    assert_eq!(h.hex(), want, "{hash:?}, {len} bytes fed {piece} at a time");
                }
            }
        }
    }

    #[test]
    fn blocks_within_a_range_are_those_it_holds_whole() {
        let b = HASH_BLOCK;
        let total = 4 * b + 10;
        assert_eq!(blocks_within(0..total, total), 0..5);
        assert_eq!(blocks_within(1..total, total), 1..5);
        assert_eq!(blocks_within(b..3 * b, total), 1..3);
        assert_eq!(blocks_within(b + 1..3 * b - 1, total), 2..2);
        assert_eq!(blocks_within(10..20, total), 1..1);
        assert_eq!(blocks_within(4 * b..total, total), 4..5);
        assert_eq!(block_bytes(4, total), 4 * b..total);
        // Every block lies inside exactly one of ranges that tile the tensor, or straddles.
        let cuts = [0, 3, b + 7, 2 * b, 2 * b + 1, total];
        let inside: usize = cuts
            .windows(2)
            .map(|w| blocks_within(w[0]..w[1], total).len())
            .sum();
        assert_eq!(
            inside, 2,
            "blocks 3 and 4 lie inside the last range; 0, 1 and 2 straddle two"
        );
        assert_eq!(
            finish(
                (0..block_count(total)).map(|i| block_digest(&bytes(total)[block_bytes(i, total)]))
            ),
            TensorHash::Blocks.hex(&bytes(total))
        );
    }

    #[test]
    fn slots_filled_by_stretches_in_any_order_give_the_whole_hash_or_a_wrong_place_fails_it() {
        let total = 6 * HASH_BLOCK + 123;
        let data = bytes(total);
        let want = TensorHash::Blocks.hex(&data);
        // Stretches that tile the tensor, cut off the blocks' grid, hashed last first.
        let cuts = [
            0,
            5,
            HASH_BLOCK + 9,
            3 * HASH_BLOCK,
            5 * HASH_BLOCK - 1,
            total,
        ];
        let slots = empty_slots(total);
        let mut open = None;
        for w in cuts.windows(2).rev() {
            let stretch = BlockSlots {
                at: w[0],
                bytes: total,
                digests: &slots,
            };
            stretch.hash_read(&data[w[0]..w[1]], &mut open);
        }
        let hashed = slots.iter().filter(|s| s.get().is_some()).count();
        assert_eq!(hashed, 4, "blocks 2, 3, 5 and 6 lie whole inside a stretch");
        assert_eq!(finish_slots(&slots, &data), want);
        assert_eq!(finish_slots(&empty_slots(total), &data), want);

        // A stretch hashed as if it sat one block further on: its bytes are hashed into
        // another block's slot, and the whole hash no longer matches.
        let slots = empty_slots(total);
        let stretch = BlockSlots {
            at: HASH_BLOCK,
            bytes: total,
            digests: &slots,
        };
        stretch.hash_read(&data[0..2 * HASH_BLOCK], &mut None);
        assert_ne!(finish_slots(&slots, &data), want);
        let later = stretch.after(HASH_BLOCK);
        assert_eq!(later.at, 2 * HASH_BLOCK);
    }

    /// Hashes `stretches` (the tensor's bytes from each offset to the next) in the order given,
    /// each carrying on the block the one before left open; the blocks hashed, and the hash
    /// with the others hashed from `data`.
    fn carried(data: &[u8], stretches: &[(usize, usize)]) -> (usize, String) {
        let slots = empty_slots(data.len());
        let mut open = None;
        for &(from, to) in stretches {
            let stretch = BlockSlots {
                at: from,
                bytes: data.len(),
                digests: &slots,
            };
            stretch.hash_read(&data[from..to], &mut open);
        }
        let hashed = slots.iter().filter(|s| s.get().is_some()).count();
        (hashed, finish_slots(&slots, data))
    }

    #[test]
    fn a_block_across_stretches_read_one_after_another_is_carried_from_one_to_the_next() {
        let total = 4 * HASH_BLOCK + 123;
        let data = bytes(total);
        let want = TensorHash::Blocks.hex(&data);
        let blocks = block_count(total);
        // Off the grid, a block across three stretches (two of a few bytes), and the short
        // last block across two.
        let cuts = [
            0,
            HASH_BLOCK + 9,
            HASH_BLOCK + 20,
            HASH_BLOCK + 21,
            3 * HASH_BLOCK,
            4 * HASH_BLOCK + 5,
            total,
        ];
        let in_order: Vec<(usize, usize)> = cuts.windows(2).map(|w| (w[0], w[1])).collect();
        assert_eq!(carried(&data, &in_order), (blocks, want.clone()));

        // Out of order, nothing follows on from what was read before it: the blocks across
        // two stretches are left to be hashed from the whole.
        let reversed: Vec<(usize, usize)> = in_order.iter().rev().copied().collect();
        let (hashed, found) = carried(&data, &reversed);
        assert_eq!((hashed, found), (3, want.clone()), "blocks 0, 2 and 3 only");

        // A stretch that does not start where the open block stopped does not go on with it,
        // even one of the same tensor: a gap of one byte leaves block 1 to the whole.
        let gapped = [(0, HASH_BLOCK + 9), (HASH_BLOCK + 10, total)];
        assert_eq!(carried(&data, &gapped).0, blocks - 1);

        // Another tensor's stretch at the offset the open block stopped at drops it.
        let other = bytes(total);
        let (slots, other_slots) = (empty_slots(total), empty_slots(total));
        let mut open = None;
        let first = BlockSlots {
            at: 0,
            bytes: total,
            digests: &slots,
        };
        first.hash_read(&data[..HASH_BLOCK + 9], &mut open);
        let elsewhere = BlockSlots {
            at: HASH_BLOCK + 9,
            bytes: total,
            digests: &other_slots,
        };
        elsewhere.hash_read(&other[HASH_BLOCK + 9..], &mut open);
        assert!(slots[1].get().is_none() && other_slots[1].get().is_none());

        // Bytes carried into the wrong place of a block fail the whole hash.
        let mut swapped = data.clone();
        swapped.swap(HASH_BLOCK + 9, HASH_BLOCK + 20);
        let slots = empty_slots(total);
        let mut open = None;
        for &(from, to) in &in_order {
            let stretch = BlockSlots {
                at: from,
                bytes: total,
                digests: &slots,
            };
            stretch.hash_read(&swapped[from..to], &mut open);
        }
        assert_ne!(finish_slots(&slots, &data), want);
    }

    /// The parts of `data` cut at `cuts` (increasing, inside it).
    fn parts(data: &[u8], cuts: &[usize]) -> Vec<HashPart> {
        let ends: Vec<usize> = cuts.iter().copied().chain([data.len()]).collect();
        let mut from = 0;
        ends.iter()
            .map(|&to| {
                let part = HashPart::of(&data[from..to], from, data.len());
                from = to;
                part
            })
            .collect()
    }

    #[test]
    fn parts_of_stretches_cut_anywhere_give_the_whole_hash() {
        let b = HASH_BLOCK;
        let cases: [(usize, &[usize]); 7] = [
            (3 * b + 100, &[]),
            (3 * b + 100, &[b]),
            (3 * b + 100, &[10, 20, b - 1, b + 1, 2 * b]),
            (3 * b + 100, &[5, 5, 3 * b + 50]),
            (b - 7, &[3, b - 8]),
            (2 * b, &[b / 2, b + b / 2]),
            (0, &[]),
        ];
        for (len, cuts) in cases {
            let data = bytes(len);
            let parts = parts(&data, cuts);
            assert_eq!(
                finish_parts(&parts, len).as_deref(),
                Some(by_definition(&data).as_str()),
                "{len} bytes cut at {cuts:?}"
            );
            let shared: usize = parts.iter().map(|p| p.head.len() + p.tail.len()).sum();
            assert!(shared <= 2 * b * parts.len(), "only shared blocks travel");
        }
    }

    #[test]
    fn parts_that_do_not_tile_the_tensor_give_no_hash() {
        let b = HASH_BLOCK;
        let len = 3 * b + 100;
        let data = bytes(len);
        let good = parts(&data, &[10, b + 5, 2 * b]);
        let mut swapped = good.clone();
        swapped.swap(1, 2);
        let mut gap = good.clone();
        gap.remove(1);
        let mut twice = good.clone();
        twice.insert(1, good[1].clone());
        let short = &good[..3];
        let mut past = good.clone();
        past.push(HashPart::of(&[1, 2, 3], len, len));
        let mut misplaced = good.clone();
        misplaced[2].at += 1;
        for (what, parts) in [
            ("swapped", &swapped[..]),
            ("a gap", &gap),
            ("a stretch twice", &twice),
            ("short of the end", short),
            ("past the end", &past),
            ("misplaced", &misplaced),
        ] {
            assert_eq!(finish_parts(parts, len), None, "{what}");
        }
        assert!(finish_parts(&good, len).is_some());
    }

    #[test]
    fn parts_arrive_as_they_were_sent_and_other_bytes_are_refused() {
        let data = bytes(2 * HASH_BLOCK + 77);
        let sent = parts(&data, &[5, HASH_BLOCK + 3]);
        let bytes = encode_parts(&sent);
        assert_eq!(decode_parts(&bytes), Some(sent));
        assert_eq!(decode_parts(&bytes[..bytes.len() - 1]), None, "cut short");
        assert_eq!(
            decode_parts(&[bytes.as_slice(), &[0]].concat()),
            None,
            "a byte past them"
        );
        let mut huge = bytes.clone();
        huge[8 + 8..8 + 16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(decode_parts(&huge), None, "a length past the bytes");
    }
}
