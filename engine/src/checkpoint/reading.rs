//! Reading a checkpoint's files into their tensors on every core, every byte checksummed.
//!
//! Each file is cut into pieces: the bytes of a tensor (or a chunk) in pieces of at most
//! [`PIECE`] bytes, each read straight into its place in the tensor, and the bytes between them
//! (headers, padding) read into a buffer of their own. No piece crosses the end of a range the
//! file's record checksums on its own (a segment; see [`super::checksum`]). Workers, one per
//! core, take work in file order from one queue, so the files' bytes are shared out evenly
//! whatever their sizes: a whole segment at a time, read piece by piece and hashed right after
//! each piece is read, while it is in cache. A file recorded by one checksum of its whole
//! content (format version 4 and older) must be hashed in order: its pieces are taken one at a
//! time, the worker that reads the piece whose turn it is hashes it at once, then every piece
//! after it that other workers have read already; a worker that reads a piece ahead of its turn
//! leaves it for that one and goes on, so no worker waits for another. Nothing is read twice
//! and nothing is kept outside the tensors.
//!
//! A file whose bytes are checked another way (the chunks of a sharded checkpoint, by their
//! tensors' whole hashes) is read without its checksums: only its regions. Their pieces, of
//! every such file together, are taken in the order they lie in memory, a run of them at a time
//! ([`UNIT`]). Either way, a region that is a stretch of a whole tensor has the tensor's hash
//! blocks that lie inside each piece hashed right after the piece is read, and a block across
//! two pieces taken one after the other (a chunk's end and the next chunk's start, from two
//! files) is hashed as the second is read ([`BlockSlots`]).

use super::checksum::{Streams, Verifier};
use super::state::FileRecord;
use super::tensor_hash::{BlockSlots, OpenBlock, HASH_BLOCK};
use crate::error::{EngineError, Result};
use crate::regular_file;
use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

/// What a checkpoint's files must be, for the message refusing a FIFO, a device or a directory.
pub(crate) const CHECKPOINT_FILE: &str =
    "a checkpoint's regular file; restore it or resume from an earlier checkpoint";

/// Bytes read, and checksummed, at a time: large enough for few system calls and for the
/// workers rarely to wait for each other's turn to hash, small enough that a piece is still in
/// cache when it is hashed.
pub(super) const PIECE: usize = 4 << 20;

const _: () = assert!(
    PIECE.is_multiple_of(HASH_BLOCK),
    "pieces cut on a tensor's hash-block grid"
);

/// Bytes of the pieces of files read without their checksums that one worker takes at a time,
/// pieces next to each other in memory: two workers writing next to each other would often
/// fault the same fresh huge page at once, one waiting while the other's fault clears it (a
/// sharded checkpoint's chunks, a quarter of a tensor from each of four files, resumed on one
/// device: its reading took 9% longer in 4 MiB pieces taken one at a time, on two cores).
const UNIT: usize = 16 << 20;

/// One file to read: its path, its record (size and checksums) and where its tensors' bytes go.
pub struct FileRead<'a> {
    /// The file.
    pub path: &'a Path,
    /// Its size and checksums, as written.
    pub record: &'a FileRecord,
    /// Whether its checksums are verified (every byte read); if not, only its regions are read
    /// and their bytes must be checked another way.
    pub checksummed: bool,
    /// Where its bytes go.
    pub regions: Vec<Region<'a>>,
}

/// Bytes of a file read straight into their place.
pub struct Region<'a> {
    /// The file offset of the first byte.
    pub offset: u64,
    /// Where the bytes from `offset` go.
    pub into: &'a mut [u8],
    /// Where `into` lies in a whole tensor whose hash blocks are hashed as it is read, if so.
    pub blocks: Option<BlockSlots<'a>>,
}

impl<'a> Region<'a> {
    /// The file's bytes from `offset` filling `into`, no tensor's blocks hashed.
    pub fn plain(offset: u64, into: &'a mut [u8]) -> Self {
        Region {
            offset,
            into,
            blocks: None,
        }
    }
}

/// Reads every file of `reads` once (a checksummed file start to end, up to its recorded size;
/// another, its regions alone) on up to one worker per core, and says for each, in order,
/// whether its content matches its record: `None` when it does (or is not checksummed), else
/// the first range of its bytes whose checksum does not match (the whole file where the record
/// holds one checksum of it). The regions of a file must not overlap and must lie within its
/// recorded size; of a checksummed file, the bytes outside them are checksummed and dropped.
pub fn read_all(reads: Vec<FileRead<'_>>) -> Vec<Result<Option<Range<u64>>>> {
    let mut files = Vec::with_capacity(reads.len());
    let mut work = Vec::new();
    let mut unchecked = Vec::new();
    for (i, read) in reads.into_iter().enumerate() {
        let path = read.path;
        let streams = match read.checksummed {
            true => Verifier::streams(read.record).map_err(|m| {
                EngineError::bad_file(
                    path,
                    format!("{m}; restore the checkpoint or resume from an earlier one"),
                )
            }),
            false => Ok(Vec::new()),
        };
        let planned = streams.and_then(|streams| {
            let (handle, _) = regular_file::open(path, CHECKPOINT_FILE)?;
            let ranges: Vec<Range<u64>> = match read.checksummed {
                true => streams.iter().map(|(r, _)| r.clone()).collect(),
                false => std::iter::once(0..read.record.bytes).collect(),
            };
            let pieces = plan(
                i,
                path,
                read.record.bytes,
                &ranges,
                read.regions,
                read.checksummed,
            )?;
            match read.checksummed {
                true => queue_up(pieces, read.record.segments.is_some(), &mut work),
                false => unchecked.extend(pieces),
            }
            Ok((handle, streams))
        });
        files.push(Reading::new(path, planned));
    }
    queue_by_place(unchecked, &mut work);
    let queue = Mutex::new(work.into_iter());
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(queue.lock().map_or(0, |q| q.len()));
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| work_through(&queue, &files));
        }
    });
    files.into_iter().map(Reading::finish).collect()
}

/// Where one piece's bytes go: into a tensor (with the stretch of the tensor whose hash blocks
/// it fills, if they are hashed), or into a buffer of their own (bytes no tensor holds,
/// checksummed and dropped).
enum Dest<'a> {
    Tensor(&'a mut [u8], Option<BlockSlots<'a>>),
    Scratch(usize),
}

impl<'a> Dest<'a> {
    fn len(&self) -> usize {
        match self {
            Dest::Tensor(dst, _) => dst.len(),
            Dest::Scratch(n) => *n,
        }
    }

    /// The first `at` bytes and the rest.
    fn split(self, at: usize) -> (Self, Self) {
        match self {
            Dest::Tensor(dst, blocks) => {
                let (head, tail) = dst.split_at_mut(at);
                let later = blocks.map(|b| b.after(at));
                (Dest::Tensor(head, blocks), Dest::Tensor(tail, later))
            }
            Dest::Scratch(n) => (Dest::Scratch(at), Dest::Scratch(n - at)),
        }
    }
}

/// A piece of file `file`: the checksummed range (`stream`) it belongs to, its `index` in that
/// range's order, its offset and where it goes.
struct Piece<'a> {
    file: usize,
    stream: usize,
    index: usize,
    offset: u64,
    into: Dest<'a>,
}

/// The pieces of file number `file` (at `path`, `len` bytes, checksummed in `streams`, which
/// cover it in order): its regions cut into pieces, and (where it is `checksummed`) the bytes
/// around them, none crossing the end of a stream.
fn plan<'a>(
    file: usize,
    path: &Path,
    len: u64,
    streams: &[Range<u64>],
    mut regions: Vec<Region<'a>>,
    checksummed: bool,
) -> Result<Vec<Piece<'a>>> {
    regions.sort_by_key(|r| r.offset);
    let mut order: Vec<(u64, Dest<'a>)> = Vec::new();
    let mut pos = 0u64;
    for Region {
        offset,
        into: dst,
        blocks,
    } in regions
    {
        if offset < pos {
            return Err(EngineError::bad_file(
                path,
                format!("has two tensors' bytes at offset {offset} (its header or index is inconsistent); restore it or resume from an earlier checkpoint"),
            ));
        }
        if offset + dst.len() as u64 > len {
            return Err(EngineError::bad_file(
                path,
                format!("has a tensor's bytes at offset {offset} past its recorded size of {len} bytes (its header or index is inconsistent); restore it or resume from an earlier checkpoint"),
            ));
        }
        if checksummed {
            pass(&mut order, pos, offset);
        }
        pos = offset + dst.len() as u64;
        // A stretch of a tensor whose blocks are hashed is cut on the blocks' grid, so that
        // only the blocks at its ends can straddle two pieces.
        let mut first = PIECE - blocks.map_or(0, |b| b.at % HASH_BLOCK);
        let (mut at, mut rest) = (0, dst);
        while !rest.is_empty() {
            let (piece, after) = rest.split_at_mut(first.min(rest.len()));
            let len = piece.len();
            order.push((
                offset + at as u64,
                Dest::Tensor(piece, blocks.map(|b| b.after(at))),
            ));
            (at, rest, first) = (at + len, after, PIECE);
        }
    }
    if checksummed {
        pass(&mut order, pos, len);
    }
    let mut pieces: Vec<Piece<'a>> = Vec::with_capacity(order.len());
    let mut stream = 0;
    for (mut offset, mut into) in order {
        while into.len() > 0 {
            while streams[stream].end <= offset {
                stream += 1;
            }
            let room = (streams[stream].end - offset).min(into.len() as u64) as usize;
            let (head, tail) = into.split(room);
            let index = match pieces.last() {
                Some(last) if last.stream == stream => last.index + 1,
                _ => 0,
            };
            pieces.push(Piece {
                file,
                stream,
                index,
                offset,
                into: head,
            });
            (offset, into) = (offset + room as u64, tail);
        }
    }
    Ok(pieces)
}

/// Appends the scratch pieces that pass over the bytes from `from` to `to` to `order`.
fn pass(order: &mut Vec<(u64, Dest<'_>)>, from: u64, to: u64) {
    let starts = (from..to).step_by(PIECE);
    order.extend(starts.map(|at| (at, Dest::Scratch((to - at).min(PIECE as u64) as usize))));
}

/// Appends a file's `pieces` to `work`, as what one worker takes at a time: a segment's pieces
/// together (`segmented`), or else one piece at a time.
fn queue_up<'a>(pieces: Vec<Piece<'a>>, segmented: bool, work: &mut Vec<Vec<Piece<'a>>>) {
    for piece in pieces {
        match work.last_mut() {
            Some(unit)
                if segmented && unit[0].file == piece.file && unit[0].stream == piece.stream =>
            {
                unit.push(piece)
            }
            _ => work.push(vec![piece]),
        }
    }
}

/// Appends `pieces` (of files read without their checksums, where order does not matter) to
/// `work`, in the order of the memory they fill, in runs of up to [`UNIT`] bytes (or one piece).
fn queue_by_place<'a>(mut pieces: Vec<Piece<'a>>, work: &mut Vec<Vec<Piece<'a>>>) {
    pieces.sort_by_key(|piece| match &piece.into {
        Dest::Tensor(dst, _) => dst.as_ptr() as usize,
        Dest::Scratch(_) => 0,
    });
    let (mut unit, mut bytes) = (Vec::new(), 0);
    for piece in pieces {
        let len = piece.into.len();
        if bytes + len > UNIT && !unit.is_empty() {
            work.push(std::mem::take(&mut unit));
            bytes = 0;
        }
        unit.push(piece);
        bytes += len;
    }
    if !unit.is_empty() {
        work.push(unit);
    }
}

/// Takes work from `queue` until it is empty: reads each piece, then checksums what is in turn.
fn work_through<'a>(queue: &Mutex<std::vec::IntoIter<Vec<Piece<'a>>>>, files: &[Reading<'_, 'a>]) {
    loop {
        let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
        let Some(unit) = next else { return };
        // The hash block the pieces read so far left unfinished, for the next piece to go on.
        let mut open: Option<OpenBlock<'a>> = None;
        for piece in unit {
            let file = &files[piece.file];
            let Some(handle) = file.handle.as_ref() else {
                open = None;
                continue;
            };
            let read = match piece.into {
                Dest::Tensor(dst, blocks) => read_at(handle, dst, piece.offset).map(|()| {
                    match blocks {
                        Some(blocks) => blocks.hash_read(dst, &mut open),
                        None => open = None,
                    }
                    Read::Tensor(dst)
                }),
                Dest::Scratch(n) => {
                    open = None;
                    let mut bytes = vec![0; n];
                    read_at(handle, &mut bytes, piece.offset).map(|()| Read::Owned(bytes))
                }
            };
            if read.is_err() {
                open = None;
            }
            file.checksum_in_turn(piece.stream, piece.index, read);
        }
    }
}

/// A piece's bytes, read and waiting for their turn to be checksummed.
enum Read<'a> {
    Tensor(&'a [u8]),
    Owned(Vec<u8>),
}

/// Fills `buf` from `file` at `offset`.
pub(super) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
    }
    #[cfg(windows)]
    {
        let mut done = 0;
        while done < buf.len() {
            match std::os::windows::fs::FileExt::seek_read(
                file,
                &mut buf[done..],
                offset + done as u64,
            ) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// One file being read: its handle and its checksummed ranges, each taking its pieces in order
/// (none where it is not checksummed), the first error reading a piece of it that is not, or
/// why it cannot be read.
struct Reading<'f, 'a> {
    path: &'f Path,
    handle: Option<File>,
    streams: Vec<(Range<u64>, Mutex<Turn<'a>>)>,
    unchecked_error: Mutex<Option<EngineError>>,
    refused: Option<EngineError>,
}

/// A range's checksum so far: the index of the piece it takes next, the pieces read ahead of
/// their turn, and the first error.
struct Turn<'a> {
    next: usize,
    ahead: BTreeMap<usize, Read<'a>>,
    verifier: Verifier,
    error: Option<EngineError>,
}

impl<'f, 'a> Reading<'f, 'a> {
    fn new(path: &'f Path, planned: Result<(File, Streams)>) -> Self {
        let (handle, streams, refused) = match planned {
            Ok((handle, streams)) => (Some(handle), streams, None),
            Err(e) => (None, Vec::new(), Some(e)),
        };
        let streams = streams
            .into_iter()
            .map(|(range, verifier)| {
                let turn = Turn {
                    next: 0,
                    ahead: BTreeMap::new(),
                    verifier,
                    error: None,
                };
                (range, Mutex::new(turn))
            })
            .collect();
        Reading {
            path,
            handle,
            streams,
            unchecked_error: Mutex::new(None),
            refused,
        }
    }

    /// Hands piece `index` of range `stream` (its bytes, or its error) to that range's
    /// checksum: when it is the piece's turn, they are hashed at once, and so is every piece
    /// after it already read; otherwise they wait for the worker whose piece is in turn. A file
    /// that is not checksummed keeps only the first error.
    fn checksum_in_turn(&self, stream: usize, index: usize, read: std::io::Result<Read<'a>>) {
        let Some((_, turn)) = self.streams.get(stream) else {
            if let Err(e) = read {
                let mut error = self
                    .unchecked_error
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                error.get_or_insert(EngineError::io(self.path, e));
            }
            return;
        };
        let mut turn = turn.lock().unwrap_or_else(PoisonError::into_inner);
        let read = read.unwrap_or_else(|e| {
            turn.error.get_or_insert(EngineError::io(self.path, e));
            Read::Owned(Vec::new())
        });
        turn.ahead.insert(index, read);
        let turn = &mut *turn;
        while let Some(read) = turn.ahead.remove(&turn.next) {
            if turn.error.is_none() {
                turn.verifier.update(match &read {
                    Read::Tensor(bytes) => bytes,
                    Read::Owned(bytes) => bytes,
                });
            }
            turn.next += 1;
        }
    }

    /// The first range of the file that did not match its checksum (`None`: all did), or the
    /// first error reading it.
    fn finish(self) -> Result<Option<Range<u64>>> {
        if let Some(e) = self.refused {
            return Err(e);
        }
        let unchecked_error = self.unchecked_error.into_inner();
        if let Some(e) = unchecked_error.unwrap_or_else(PoisonError::into_inner) {
            return Err(e);
        }
        let mut damaged = None;
        for (range, turn) in self.streams {
            let turn = turn.into_inner().unwrap_or_else(PoisonError::into_inner);
            if let Some(e) = turn.error {
                return Err(e);
            }
            if !turn.verifier.matches() {
                damaged = damaged.or(Some(range));
            }
        }
        Ok(damaged)
    }
}

#[cfg(test)]
mod tests {
    use super::super::checksum::SegmentHasher;
    use super::*;
    use std::path::PathBuf;

    /// The record of a file holding `bytes` by segments of `segment` bytes, as a save writes
    /// it, or (`None`) by one XXH3-128 of the whole, as format version 4 did.
    fn record(bytes: &[u8], segment: Option<u64>) -> FileRecord {
        let (xxh3_128, segments) = match segment {
            Some(size) => {
                let mut h = SegmentHasher::new(size);
                h.update(bytes);
                (None, Some(h.finish()))
            }
            None => {
                let xxh3 = twox_hash::XxHash3_128::oneshot(bytes);
                (Some(format!("{xxh3:032x}")), None)
            }
        };
        FileRecord {
            bytes: bytes.len() as u64,
            sha256: None,
            xxh3_128,
            segments,
        }
    }

    /// `len` bytes that differ from piece to piece, written to `dir/name`.
    fn written(dir: &Path, name: &str, len: usize, seed: usize) -> (PathBuf, Vec<u8>) {
        let bytes: Vec<u8> = (0..len).map(|i| ((i + seed) * 7 % 251) as u8).collect();
        let path = dir.join(name);
        std::fs::write(&path, &bytes).unwrap();
        (path, bytes)
    }

    #[test]
    fn a_files_pieces_cover_it_once_in_order_none_larger_than_a_piece_or_across_a_segment() {
        let mut a = vec![0u8; 2 * PIECE + 3];
        let mut b = [0u8; 5];
        let len = 4 * PIECE as u64;
        let (a_at, b_at) = (PIECE as u64 / 2, 3 * PIECE as u64);
        let segment = PIECE as u64 + 1000;
        let streams: Vec<Range<u64>> = (0..len)
            .step_by(segment as usize)
            .map(|s| s..(s + segment).min(len))
            .collect();
        let regions = vec![
            Region::plain(b_at, &mut b[..]),
            Region::plain(a_at, &mut a[..]),
        ];
        let pieces = plan(7, Path::new("f"), len, &streams, regions, true).unwrap();
        let mut pos = 0;
        let mut index = [0; 4];
        for p in &pieces {
            assert_eq!((p.file, p.index, p.offset), (7, index[p.stream], pos));
            index[p.stream] += 1;
            let n = p.into.len();
            if let Dest::Tensor(..) = &p.into {
                let at = p.offset;
                let in_a = at >= a_at && at + n as u64 <= a_at + 2 * PIECE as u64 + 3;
                let in_b = at == b_at && n == 5;
                assert!(in_a || in_b, "a tensor piece at {at} of {n}");
            }
            assert!(n > 0 && n <= PIECE);
            let stream = &streams[p.stream];
            assert!(
                stream.start <= pos && pos + n as u64 <= stream.end,
                "{pos}+{n}"
            );
            pos += n as u64;
        }
        assert_eq!(pos, len);
        assert!(index.iter().all(|&n| n > 0), "{index:?}");

        let mut late = [0u8; 8];
        let e = plan(
            7,
            Path::new("f"),
            len,
            &streams,
            vec![Region::plain(len - 4, &mut late[..])],
            true,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("past its recorded size"), "{e}");
    }

    #[test]
    fn several_files_are_read_into_place_each_verified_on_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let (big_path, big) = written(dir.path(), "big", 5 * PIECE + 17, 0);
        let (small_path, small) = written(dir.path(), "small", PIECE / 3, 1);
        let (legacy_path, legacy) = written(dir.path(), "legacy", 3 * PIECE + 5, 2);
        let big_record = record(&big, Some(PIECE as u64 + 999));
        let mut small_record = record(&small, Some(4096));
        let legacy_record = record(&legacy, None);
        let (mut x, mut y, mut z) = (vec![0u8; 3 * PIECE + 1], vec![0u8; 100], vec![0u8; 9]);
        let reads = vec![
            FileRead {
                path: &big_path,
                record: &big_record,
                checksummed: true,
                regions: vec![Region::plain(PIECE as u64 + 9, &mut x[..])],
            },
            FileRead {
                path: &small_path,
                record: &small_record,
                checksummed: true,
                regions: vec![Region::plain(50, &mut y[..])],
            },
            FileRead {
                path: &legacy_path,
                record: &legacy_record,
                checksummed: true,
                regions: vec![Region::plain(2 * PIECE as u64 - 3, &mut z[..])],
            },
        ];
        let results: Vec<_> = read_all(reads).into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(results, [None, None, None]);
        assert_eq!(x, big[PIECE + 9..4 * PIECE + 10]);
        assert_eq!(y, small[50..150]);
        assert_eq!(z, legacy[2 * PIECE - 3..2 * PIECE + 6]);

        let other = record(b"other", Some(4096)).segments.unwrap().xxh3_128[0].clone();
        small_record.segments.as_mut().unwrap().xxh3_128[0] = other;
        let files = [
            (&big_path, &big_record, &big),
            (&small_path, &small_record, &small),
            (&legacy_path, &legacy_record, &legacy),
        ];
        for at in [0, PIECE + 998, PIECE + 999, 5 * PIECE + 16] {
            let mut damaged = big.clone();
            damaged[at] ^= 0x10;
            std::fs::write(&big_path, &damaged).unwrap();
            let mut damaged = legacy.clone();
            damaged[at.min(legacy.len() - 1)] ^= 0x10;
            std::fs::write(&legacy_path, &damaged).unwrap();
            let reads = files
                .map(|(path, record, _)| FileRead {
                    path,
                    record,
                    checksummed: true,
                    regions: Vec::new(),
                })
                .into();
            let results: Vec<_> = read_all(reads).into_iter().map(|r| r.unwrap()).collect();
            let segment = (at as u64 / (PIECE as u64 + 999)) * (PIECE as u64 + 999);
            let big_damage = segment..(segment + PIECE as u64 + 999).min(big.len() as u64);
            let expected = [
                Some(big_damage),
                Some(0..4096),
                Some(0..legacy.len() as u64),
            ];
            assert_eq!(results, expected, "byte {at}");
        }
        for (path, record, bytes) in files {
            std::fs::write(path, bytes).unwrap();
            let reads = vec![FileRead {
                path,
                record,
                checksummed: true,
                regions: Vec::new(),
            }];
            let damaged = read_all(reads).pop().unwrap().unwrap();
            assert_eq!(damaged.is_none(), path != &small_path, "restored {path:?}");
        }
    }

    #[test]
    fn a_segment_list_that_does_not_fit_the_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let (path, bytes) = written(dir.path(), "f", 100, 0);
        let mut edited = record(&bytes, Some(30));
        edited.segments.as_mut().unwrap().xxh3_128.pop();
        let reads = vec![FileRead {
            path: &path,
            record: &edited,
            checksummed: true,
            regions: Vec::new(),
        }];
        let e = read_all(reads).pop().unwrap().unwrap_err().to_string();
        assert!(e.contains(&*path.to_string_lossy()), "{e}");
        assert!(e.contains("lists 3 segments of 30 bytes"), "{e}");
    }

    #[test]
    fn a_file_read_without_its_checksums_fills_its_regions_and_hashes_their_tensors_blocks() {
        use super::super::tensor_hash::{self, TensorHash, HASH_BLOCK};
        let dir = tempfile::tempdir().unwrap();
        let len = 2 * PIECE + 3 * HASH_BLOCK;
        let (path, bytes) = written(dir.path(), "rank", len + 100, 3);
        // The record no longer matches: bytes outside the regions are not read, and nothing is
        // checksummed.
        let stale = record(b"another file's bytes", Some(4096));
        let stale = FileRecord {
            bytes: bytes.len() as u64,
            ..stale
        };
        // One tensor, its two halves at two places of the file, the second half first.
        let (cut, from) = (PIECE + 77, 40u64);
        let mut tensor = vec![0u8; len];
        let slots = tensor_hash::empty_slots(len);
        let (first, second) = tensor.split_at_mut(cut);
        let region = |offset, into, at| Region {
            offset,
            into,
            blocks: Some(BlockSlots {
                at,
                bytes: len,
                digests: &slots,
            }),
        };
        let second_at = from + cut as u64 + 30;
        let reads = vec![FileRead {
            path: &path,
            record: &stale,
            checksummed: false,
            regions: vec![region(second_at, second, cut), region(from, first, 0)],
        }];
        assert_eq!(read_all(reads).pop().unwrap().unwrap(), None);
        let mut want = bytes[from as usize..from as usize + cut].to_vec();
        want.extend_from_slice(&bytes[second_at as usize..second_at as usize + len - cut]);
        assert_eq!(tensor, want);
        let hashed = slots.iter().filter(|s| s.get().is_some()).count();
        // Pieces are cut on the blocks' grid and taken in the order of the memory they fill,
        // so the block across the two halves is carried from the first to the second.
        assert_eq!(hashed, slots.len(), "{hashed} of {} blocks", slots.len());
        assert_eq!(
            tensor_hash::finish_slots(&slots, &tensor),
            TensorHash::Blocks.hex(&tensor)
        );

        // A file shorter than its record fails the read, naming it.
        std::fs::write(&path, &bytes[..PIECE]).unwrap();
        let mut into = vec![0u8; 10];
        let reads = vec![FileRead {
            path: &path,
            record: &stale,
            checksummed: false,
            regions: vec![Region::plain(PIECE as u64 + 5, &mut into)],
        }];
        let e = read_all(reads).pop().unwrap().unwrap_err().to_string();
        assert!(e.contains(&*path.to_string_lossy()), "{e}");
    }
}
