//! Reading a checkpoint's files into their tensors on every core, every byte checksummed.
//!
//! Each file is cut into pieces: the bytes of a tensor (or a chunk) in pieces of at most
//! [`PIECE`] bytes, each read straight into its place in the tensor, and the bytes between them
//! (headers, padding) read into a buffer of their own. Workers, one per core, take pieces in
//! file order from one queue, so the files' bytes are shared out evenly whatever their sizes.
//! A file's checksum must see its bytes in order: the worker that reads the piece whose turn it
//! is hashes it at once, while it is in cache, then every piece after it that other workers
//! have read already; a worker that reads a piece ahead of its turn leaves it for that one and
//! goes on, so no worker waits for another. Nothing is read twice and nothing is kept outside
//! the tensors.

use super::state::FileRecord;
use crate::error::{EngineError, Result};
use crate::regular_file;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use xxhash_rust::xxh3::Xxh3Default;

/// What a checkpoint's files must be, for the message refusing a FIFO, a device or a directory.
pub(crate) const CHECKPOINT_FILE: &str =
    "a checkpoint's regular file; restore it or resume from an earlier checkpoint";

/// Bytes read, and checksummed, at a time: large enough for few system calls and for the
/// workers rarely to wait for each other's turn to hash, small enough that a piece is still in
/// cache when it is hashed.
pub(super) const PIECE: usize = 4 << 20;

/// One file to read: its path, its record (size and checksums) and where its tensors' bytes go,
/// each region's bytes starting at its file offset.
pub struct FileRead<'a> {
    /// The file.
    pub path: &'a Path,
    /// Its size and checksums, as written.
    pub record: &'a FileRecord,
    /// `(offset, destination)`: the file's bytes from `offset` fill `destination`.
    pub regions: Vec<(u64, &'a mut [u8])>,
}

/// Reads every file of `reads` once, start to end (up to its recorded size), on up to one
/// worker per core, and says for each, in order, whether its content matches its record. The
/// regions of a file must not overlap; bytes outside them are checksummed and dropped.
pub fn read_all(reads: Vec<FileRead<'_>>) -> Vec<Result<bool>> {
    let mut files = Vec::with_capacity(reads.len());
    let mut pieces = Vec::new();
    for (i, read) in reads.into_iter().enumerate() {
        let planned = regular_file::open(read.path, CHECKPOINT_FILE).and_then(|(handle, _)| {
            plan(i, read.path, read.record.bytes, read.regions, &mut pieces).map(|()| handle)
        });
        files.push(Reading::new(read.path, read.record, planned));
    }
    let queue = Mutex::new(pieces.into_iter());
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(queue.lock().map_or(0, |q| q.len()));
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| work(&queue, &files));
        }
    });
    files.into_iter().map(Reading::finish).collect()
}

/// Where one piece's bytes go: into a tensor, or into a buffer of their own (bytes no tensor
/// holds, checksummed and dropped).
enum Dest<'a> {
    Tensor(&'a mut [u8]),
    Scratch(usize),
}

/// A piece of file `file`: its `index` in the file's order, its offset and where it goes.
struct Piece<'a> {
    file: usize,
    index: usize,
    offset: u64,
    into: Dest<'a>,
}

/// Appends the pieces of file number `file` (at `path`, `len` bytes) to `pieces`: its regions
/// cut into pieces, and the bytes around them.
fn plan<'a>(
    file: usize,
    path: &Path,
    len: u64,
    mut regions: Vec<(u64, &'a mut [u8])>,
    pieces: &mut Vec<Piece<'a>>,
) -> Result<()> {
    regions.sort_by_key(|r| r.0);
    let mut order: Vec<(u64, Dest<'a>)> = Vec::new();
    let mut pos = 0u64;
    for (offset, dst) in regions {
        if offset < pos {
            return Err(EngineError::bad_file(
                path,
                format!("has two tensors' bytes at offset {offset} (its header or index is inconsistent); restore it or resume from an earlier checkpoint"),
            ));
        }
        pass(&mut order, pos, offset);
        pos = offset + dst.len() as u64;
        let starts = (offset..).step_by(PIECE);
        order.extend(starts.zip(dst.chunks_mut(PIECE).map(Dest::Tensor)));
    }
    pass(&mut order, pos, len);
    let numbered = order.into_iter().enumerate();
    pieces.extend(numbered.map(|(index, (offset, into))| Piece {
        file,
        index,
        offset,
        into,
    }));
    Ok(())
}

/// Appends the scratch pieces that pass over the bytes from `from` to `to` to `order`.
fn pass(order: &mut Vec<(u64, Dest<'_>)>, from: u64, to: u64) {
    let starts = (from..to).step_by(PIECE);
    order.extend(starts.map(|at| (at, Dest::Scratch((to - at).min(PIECE as u64) as usize))));
}

/// Takes pieces from `queue` until it is empty: reads each, then checksums what is in turn.
fn work<'a>(queue: &Mutex<std::vec::IntoIter<Piece<'a>>>, files: &[Reading<'_, 'a>]) {
    loop {
        let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
        let Some(piece) = next else { return };
        let file = &files[piece.file];
        let Some(handle) = file.handle.as_ref() else {
            continue;
        };
        let read = match piece.into {
            Dest::Tensor(dst) => read_at(handle, dst, piece.offset).map(|()| Read::Tensor(dst)),
            Dest::Scratch(n) => {
                let mut bytes = vec![0; n];
                read_at(handle, &mut bytes, piece.offset).map(|()| Read::Owned(bytes))
            }
        };
        file.checksum_in_turn(piece.index, read);
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

/// One file being read: its handle and its checksum, which takes the pieces in order.
struct Reading<'f, 'a> {
    path: &'f Path,
    record: &'f FileRecord,
    handle: Option<File>,
    turn: Mutex<Turn<'a>>,
}

/// A file's checksum so far: the index of the piece it takes next, the pieces read ahead of
/// their turn, and the first error.
struct Turn<'a> {
    next: usize,
    ahead: BTreeMap<usize, Read<'a>>,
    verifier: Verifier,
    error: Option<EngineError>,
}

impl<'f, 'a> Reading<'f, 'a> {
    fn new(path: &'f Path, record: &'f FileRecord, planned: Result<File>) -> Self {
        let (handle, error) = match planned {
            Ok(handle) => (Some(handle), None),
            Err(e) => (None, Some(e)),
        };
        Reading {
            path,
            record,
            handle,
            turn: Mutex::new(Turn {
                next: 0,
                ahead: BTreeMap::new(),
                verifier: Verifier::for_record(record),
                error,
            }),
        }
    }

    /// Hands piece `index`'s bytes (or its error) to the checksum: when it is the piece's turn,
    /// they are hashed at once, and so is every piece after it already read; otherwise they
    /// wait for the worker whose piece is in turn.
    fn checksum_in_turn(&self, index: usize, read: std::io::Result<Read<'a>>) {
        let mut turn = self.turn.lock().unwrap_or_else(PoisonError::into_inner);
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

    /// Whether the file matched its record, or the first error reading it.
    fn finish(self) -> Result<bool> {
        let turn = self
            .turn
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        match turn.error {
            Some(e) => Err(e),
            None => Ok(turn.verifier.matches(self.record)),
        }
    }
}

/// The check loading makes of a file's content: its XXH3-128 where the record has one, else
/// its sha256 (checkpoints written before XXH3 was recorded).
pub(super) enum Verifier {
    Xxh3(Box<Xxh3Default>),
    Sha256(Sha256),
}

impl Verifier {
    pub(super) fn for_record(record: &FileRecord) -> Self {
        match record.xxh3_128 {
            Some(_) => Verifier::Xxh3(Box::default()),
            None => Verifier::Sha256(Sha256::new()),
        }
    }

    pub(super) fn update(&mut self, bytes: &[u8]) {
        match self {
            Verifier::Xxh3(h) => h.update(bytes),
            Verifier::Sha256(h) => h.update(bytes),
        }
    }

    pub(super) fn matches(self, record: &FileRecord) -> bool {
        match (self, &record.xxh3_128) {
            (Verifier::Xxh3(h), Some(want)) => format!("{:032x}", h.digest128()) == *want,
            (Verifier::Sha256(h), _) => {
                record.sha256.as_deref() == Some(&format!("{:x}", h.finalize()))
            }
            (Verifier::Xxh3(_), None) => unreachable!("chosen from the record"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// The record of a file holding `bytes`, as a save writes it.
    fn record(bytes: &[u8]) -> FileRecord {
        let xxh3 = xxhash_rust::xxh3::xxh3_128(bytes);
        FileRecord {
            bytes: bytes.len() as u64,
            sha256: None,
            xxh3_128: Some(format!("{xxh3:032x}")),
        }
    }

    /// `len` bytes that differ from piece to piece, written to `dir/name` with their record.
    fn written(dir: &Path, name: &str, len: usize, seed: usize) -> (PathBuf, Vec<u8>, FileRecord) {
        let bytes: Vec<u8> = (0..len).map(|i| ((i + seed) * 7 % 251) as u8).collect();
        let path = dir.join(name);
        std::fs::write(&path, &bytes).unwrap();
        (path, bytes.clone(), record(&bytes))
    }

    #[test]
    fn a_files_pieces_cover_it_once_in_order_none_larger_than_a_piece() {
        let mut a = vec![0u8; 2 * PIECE + 3];
        let mut b = [0u8; 5];
        let len = 4 * PIECE as u64;
        let (a_at, b_at) = (PIECE as u64 / 2, 3 * PIECE as u64);
        let mut pieces = Vec::new();
        let regions = vec![(b_at, &mut b[..]), (a_at, &mut a[..])];
        plan(7, Path::new("f"), len, regions, &mut pieces).unwrap();
        let mut pos = 0;
        for (i, p) in pieces.iter().enumerate() {
            assert_eq!((p.file, p.index, p.offset), (7, i, pos));
            let n = match &p.into {
                Dest::Tensor(dst) => {
                    let at = p.offset;
                    let in_a = at >= a_at && at + dst.len() as u64 <= a_at + 2 * PIECE as u64 + 3;
                    let in_b = at == b_at && dst.len() == 5;
                    assert!(in_a || in_b, "a tensor piece at {at} of {}", dst.len());
                    dst.len()
                }
                Dest::Scratch(n) => *n,
            };
            assert!(n > 0 && n <= PIECE);
            pos += n as u64;
        }
        assert_eq!(pos, len);
    }

    #[test]
    fn several_files_are_read_into_place_each_verified_on_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let (big_path, big, big_record) = written(dir.path(), "big", 5 * PIECE + 17, 0);
        let (small_path, small, mut small_record) = written(dir.path(), "small", PIECE / 3, 1);
        let (mut x, mut y) = (vec![0u8; 3 * PIECE + 1], vec![0u8; 100]);
        let reads = vec![
            FileRead {
                path: &big_path,
                record: &big_record,
                regions: vec![(PIECE as u64 + 9, &mut x[..])],
            },
            FileRead {
                path: &small_path,
                record: &small_record,
                regions: vec![(50, &mut y[..])],
            },
        ];
        let results: Vec<bool> = read_all(reads).into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(results, [true, true]);
        assert_eq!(x, big[PIECE + 9..4 * PIECE + 10]);
        assert_eq!(y, small[50..150]);

        small_record.xxh3_128 = record(b"other").xxh3_128;
        let mut damaged = big.clone();
        damaged[5 * PIECE + 16] ^= 0x10;
        std::fs::write(&big_path, &damaged).unwrap();
        let reads = [(&big_path, &big_record), (&small_path, &small_record)]
            .map(|(path, record)| FileRead {
                path,
                record,
                regions: Vec::new(),
            })
            .into();
        let results: Vec<bool> = read_all(reads).into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(results, [false, false]);
        std::fs::write(&big_path, &big).unwrap();
        let reads = vec![FileRead {
            path: &big_path,
            record: &big_record,
            regions: Vec::new(),
        }];
        assert!(read_all(reads).pop().unwrap().unwrap(), "restored");
    }
}
