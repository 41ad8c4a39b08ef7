//! Loading a sharded checkpoint onto several ranks, each rank reading only its rows. A rank
//! reads, of every chunk that overlaps the rows it holds of a tensor, the overlapping byte
//! range, straight into its own tensor, and hashes the tensor's hash blocks (format version 5
//! on, see [`super::tensor_hash`]) that lie whole inside those rows while they are in cache.
//! Once every rank holds its rows, the blocks no rank hashed (those straddling two ranks' rows,
//! or in rows no rank holds) are hashed, each byte taken from the first rank that holds it
//! (rows no rank holds are read from the files for it), and each tensor's whole hash is
//! finished from its blocks' digests: a chunk read into the wrong place, or damage anywhere in
//! the tensor, fails it. A checkpoint of an earlier version, whose whole hash can only be fed
//! in row order, has it computed then from the ranks' rows in the same way. Only after a whole
//! hash fails are the tensor's chunks read again and checked against their own hashes, so that
//! damage names its file, tensor, rows and bytes, and with every chunk intact the error says one
//! is out of place: a clean load hashes each byte once, as one device's does. No rank ever holds
//! a whole tensor it does not keep. Ranks in processes of their own put the whole hashes
//! together on rank 0 from each rank's part of them ([`RankReads::check_placed_as_rank`]).

use super::cores::map_on_cores;
use super::load::{match_spec, open, LoadRequest, EARLIER};
use super::reading::read_at;
use super::shards::{self, read_index, TensorIndex};
use super::state::TrainerState;
use super::tensor_hash::{self, decode_parts, encode_parts, finish_parts, HashPart, TensorHash};
use crate::error::{EngineError, Result};
use crate::model::param_specs;
use crate::parallel::collective::Collective;
use crate::parallel::plan;
use crate::parallel::source::{Placed, RowSource, Which};
use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use twox_hash::XxHash3_128;

/// Bytes read, and hashed, at a time.
const PIECE: usize = 1 << 20;

/// A sharded checkpoint opened for the ranks to read their rows from (see the module's header).
pub struct RankReads {
    /// The trainer state.
    pub state: TrainerState,
    /// The ranks that saved it.
    pub saved_world_size: usize,
    /// Whether the ranks resume with AdamW moments: the optimizer took a step, and the
    /// checkpoint holds them or a fresh start without them was asked for.
    pub moments: bool,
    dir: PathBuf,
    index_path: PathBuf,
    tensor_hash: TensorHash,
    files: BTreeMap<String, File>,
    /// The tensors the ranks read, by `(which, param)`.
    tensors: BTreeMap<(Which, usize), Read>,
}

/// One whole tensor the ranks read and, under [`TensorHash::Blocks`], its hash blocks' digests
/// as ranks hash them.
struct Read {
    tensor: TensorIndex,
    blocks: Vec<Block>,
}

/// One hash block of a tensor: whether a rank has taken it to hash, and its digest once hashed.
#[derive(Default)]
struct Block {
    taken: AtomicBool,
    digest: OnceLock<u128>,
}

impl RankReads {
    /// Opens the checkpoint at `dir` (a checkpoint or a run directory) as `load` checks it up to
    /// its tensors, and its index (checksum, tiling, files); `None` when it is not sharded.
    pub fn open(dir: &Path, req: &LoadRequest<'_>) -> Result<Option<Self>> {
        let opened = open(dir, req)?;
        if !opened.sharded {
            return Ok(None);
        }
        let (dir, state) = (opened.dir, opened.state);
        let index = read_index(&dir, &state, EARLIER)?;
        let index_path = dir.join(super::SHARDS_FILE);
        let specs = param_specs(req.config);
        let (master_list, suffix) = if req.master_in_optimizer {
            (&index.optimizer, ".master")
        } else {
            (&index.model, "")
        };
        let find = |list: &[TensorIndex], name: String, spec| {
            let found = list
                .iter()
                .find(|t| t.name == name)
                .ok_or_else(|| format!("tensor {name} is missing"))
                .and_then(|t| match_spec(&name, &t.shape, t.dtype, spec).map(|()| t.clone()));
            found.map_err(|m| EngineError::bad_file(&index_path, m))
        };
        let has_moments = specs.first().is_some_and(|s| {
            let name = format!("{}.exp_avg", s.name);
            index.optimizer.iter().any(|t| t.name == name)
        });
        let moments = state.optimizer_step > 0;
        if moments && !has_moments && !req.fresh_moments_if_missing {
            return Err(EngineError::bad_file(
                &index_path,
                format!(
                    "holds no AdamW moments although the optimizer took {} steps; the checkpoint is incomplete; resume from a checkpoint saved with its moments",
                    state.optimizer_step
                ),
            ));
        }
        let mut tensors = BTreeMap::new();
        for (i, spec) in specs.iter().enumerate() {
            let mut wanted = vec![(
                Which::Master,
                find(master_list, format!("{}{suffix}", spec.name), spec)?,
            )];
            if moments && has_moments {
                for (which, name) in [(Which::ExpAvg, "exp_avg"), (Which::ExpAvgSq, "exp_avg_sq")] {
                    let name = format!("{}.{name}", spec.name);
                    wanted.push((which, find(&index.optimizer, name, spec)?));
                }
            }
            for (which, tensor) in wanted {
                let blocks = match index.tensor_hash {
                    TensorHash::Blocks => tensor_hash::block_count(tensor.bytes() as usize),
                    TensorHash::Plain => 0,
                };
                let blocks = (0..blocks).map(|_| Block::default()).collect();
                tensors.insert((which, i), Read { tensor, blocks });
            }
        }
        let mut files = BTreeMap::new();
        for read in tensors.values() {
            for chunk in &read.tensor.chunks {
                if !files.contains_key(&chunk.file) {
                    let path = dir.join(&chunk.file);
                    let (file, _) =
                        crate::regular_file::open(&path, super::files::CHECKPOINT_FILE)?;
                    files.insert(chunk.file.clone(), file);
                }
            }
        }
        Ok(Some(RankReads {
            saved_world_size: index.world_size,
            state,
            moments,
            dir,
            index_path,
            tensor_hash: index.tensor_hash,
            files,
            tensors,
        }))
    }

    /// Checks every tensor the ranks read against its whole hash, from the rows the ranks hold:
    /// `placed(which, param)` gives each rank's rows of that tensor and their bytes, in rank
    /// order (borrowed on the CPU; from a GPU, a host copy of each rank's tensors). The tensors
    /// are hashed on as many threads as the machine runs, largest first; the error of the first
    /// tensor in order wins.
    pub fn check_placed<'p>(
        &self,
        mut placed: impl FnMut(Which, usize) -> Result<Placed<'p>>,
    ) -> Result<()> {
        let mut work = Vec::with_capacity(self.tensors.len());
        for (&(which, param), read) in &self.tensors {
            work.push((read, placed(which, param)?));
        }
        let cost = |(read, _): &(&Read, Placed<'_>)| read.tensor.bytes();
        map_on_cores(&work, cost, |(read, pieces)| self.check_whole(read, pieces))
            .into_iter()
            .collect()
    }

    /// [`RankReads::check_placed`] where the ranks are processes of their own, this process
    /// holding rank `comm.rank()` (`placed` gives its rows alone): each rank sends rank 0 its
    /// part of every tensor's whole hash over the rows the loading plan gives it
    /// ([`HashPart`]: the digests of the blocks inside them, most hashed as they were read, and
    /// its bytes of the blocks it shares with its neighbours), rank 0 finishes every hash and
    /// tells every rank the first tensor that fails and why, so each returns the same error. A
    /// checkpoint of format version 4 or earlier, whose whole hashes take their bytes in row
    /// order, is checked by each rank on its own, the rows it does not hold read from the files.
    pub fn check_placed_as_rank<'p>(
        &self,
        mut placed: impl FnMut(Which, usize) -> Result<Placed<'p>>,
        comm: &dyn Collective,
    ) -> Result<()> {
        if self.tensor_hash == TensorHash::Plain {
            return self.check_placed(placed);
        }
        let (rank, world) = (comm.rank(), comm.world_size());
        let mut parts = Vec::with_capacity(self.tensors.len());
        for (&(which, param), read) in &self.tensors {
            let row = read.tensor.row_bytes();
            let d0 = read.tensor.shape.first().copied().unwrap_or(1);
            let rows = plan::rows(d0, world, rank);
            let pieces = placed(which, param)?;
            parts.push(self.part_of(read, &pieces, rows.start * row..rows.end * row)?);
        }
        if rank > 0 {
            comm.send(0, encode_parts(&parts))?;
            let word: Option<(PathBuf, String)> = serde_json::from_slice(&comm.recv(0)?)
                .map_err(|e| {
                    EngineError::Config(format!(
                        "rank 0's word on the checkpoint is not in this build's layout ({e}); run one build on every rank"
                    ))
                })?;
            return match word {
                None => Ok(()),
                Some((path, message)) => Err(EngineError::bad_file(path, message)),
            };
        }
        let mut by_rank = vec![parts];
        let received = (1..world).try_for_each(|from| {
            let parts = decode_parts(&comm.recv(from)?).ok_or_else(|| {
                EngineError::Config(format!(
                    "rank {from}'s parts of the checkpoint's hashes are not in this build's layout; run one build on every rank"
                ))
            })?;
            by_rank.push(parts);
            Ok(())
        });
        let checked = received.and_then(|()| self.check_parts(&by_rank));
        let word = match &checked {
            Ok(()) => None,
            Err(EngineError::BadFile { path, message }) => Some((path.clone(), message.clone())),
            Err(e) => Some((self.index_path.clone(), e.to_string())),
        };
        // Every rank still there hears the outcome, even where another rank has gone.
        let word = serde_json::to_vec(&word).expect("plain JSON");
        for to in 1..world {
            let _ = comm.send(to, word.clone());
        }
        checked
    }

    /// Checks every tensor's whole hash put together from every rank's part of it (`by_rank`:
    /// each rank's parts, in the order of [`RankReads::tensors`]).
    fn check_parts(&self, by_rank: &[Vec<HashPart>]) -> Result<()> {
        for (i, read) in self.tensors.values().enumerate() {
            let tensor = &read.tensor;
            let parts = by_rank.iter().filter_map(|parts| parts.get(i));
            let found = finish_parts(parts, tensor.bytes() as usize).ok_or_else(|| {
                EngineError::bad_file(
                    &self.index_path,
                    format!(
                        "the ranks' rows of {} do not tile it; run one build on every rank",
                        tensor.name
                    ),
                )
            })?;
            if found != tensor.xxh3_128 {
                self.check_chunks(tensor)?;
            }
            shards::check_found(&self.index_path, tensor, &found)?;
        }
        Ok(())
    }

    /// The part of `read`'s tensor's whole hash over its bytes `range`: each block inside it
    /// with the digest hashed as it was read, or hashed now; the bytes from the first of
    /// `pieces` that holds them, or from the files.
    fn part_of(&self, read: &Read, pieces: &Placed<'_>, range: Range<usize>) -> Result<HashPart> {
        let bytes = read.tensor.bytes() as usize;
        let whole = tensor_hash::blocks_within(range.clone(), bytes);
        let mut part = HashPart {
            at: range.start,
            ..HashPart::default()
        };
        let (first, last) = match whole.is_empty() {
            true => (range.end, range.end),
            false => (
                tensor_hash::block_bytes(whole.start, bytes).start,
                tensor_hash::block_bytes(whole.end - 1, bytes).end,
            ),
        };
        self.walk(read, pieces, range.start..first, |s| {
            part.head.extend_from_slice(s)
        })?;
        let mut block = Vec::new();
        for b in whole {
            part.digests
                .push(self.digest_of(read, pieces, b, &mut block)?);
        }
        self.walk(read, pieces, last..range.end, |s| {
            part.tail.extend_from_slice(s)
        })?;
        Ok(part)
    }

    /// The digest of hash block `b` of `read`'s tensor: the one a rank took as it read it, or
    /// hashed now, its bytes (gathered in `scratch`) from the first of `pieces` that holds them
    /// or from the files.
    fn digest_of(
        &self,
        read: &Read,
        pieces: &Placed<'_>,
        b: usize,
        scratch: &mut Vec<u8>,
    ) -> Result<u128> {
        if let Some(&digest) = read.blocks[b].digest.get() {
            return Ok(digest);
        }
        scratch.clear();
        let at = tensor_hash::block_bytes(b, read.tensor.bytes() as usize);
        self.walk(read, pieces, at, |s| scratch.extend_from_slice(s))?;
        Ok(tensor_hash::block_digest(scratch))
    }

    /// Finishes `read`'s whole hash, the bytes no rank hashed as it read them taken from the
    /// first of `pieces` that holds them, or from the files. When it does not match, its chunks
    /// are read again and checked, so that damage names its chunk; with every chunk intact, one
    /// is out of place.
    fn check_whole(&self, read: &Read, pieces: &Placed<'_>) -> Result<()> {
        let tensor = &read.tensor;
        let bytes = tensor.bytes() as usize;
        let found = match self.tensor_hash {
            TensorHash::Blocks => {
                let mut block = Vec::new();
                let mut digests = Vec::with_capacity(read.blocks.len());
                for b in 0..read.blocks.len() {
                    digests.push(self.digest_of(read, pieces, b, &mut block)?);
                }
                tensor_hash::finish(digests)
            }
            TensorHash::Plain => {
                let mut whole = TensorHash::Plain.hasher();
                self.walk(read, pieces, 0..bytes, |s| whole.update(s))?;
                whole.hex()
            }
        };
        if found != tensor.xxh3_128 {
            self.check_chunks(tensor)?;
        }
        shards::check_found(&self.index_path, tensor, &found)
    }

    /// Reads every chunk of `tensor` again, a piece at a time, and fails naming the first whose
    /// bytes do not match its hash.
    fn check_chunks(&self, tensor: &TensorIndex) -> Result<()> {
        let mut piece = Vec::new();
        for chunk in &tensor.chunks {
            let path = self.dir.join(&chunk.file);
            let [mut at, end] = chunk.byte_range;
            let mut hasher = XxHash3_128::new();
            while at < end {
                piece.resize((end - at).min(PIECE as u64) as usize, 0);
                read_at(&self.files[&chunk.file], &mut piece, at)
                    .map_err(|e| EngineError::io(&path, e))?;
                hasher.write(&piece);
                at += piece.len() as u64;
            }
            if format!("{:032x}", hasher.finish_128()) != chunk.xxh3_128 {
                return Err(shards::damaged_chunk(&self.dir, tensor, chunk, EARLIER));
            }
        }
        Ok(())
    }

    /// Hands `read`'s tensor's bytes `bytes` to `each` in order, each byte from the first of
    /// `pieces` that holds it, or read from the files where none does.
    fn walk(
        &self,
        read: &Read,
        pieces: &Placed<'_>,
        bytes: Range<usize>,
        mut each: impl FnMut(&[u8]),
    ) -> Result<()> {
        let row = read.tensor.row_bytes();
        let mut gap = Vec::new();
        let mut at = bytes.start;
        while at < bytes.end {
            let holder = pieces
                .iter()
                .find(|(held, _)| held.start * row <= at && at < held.end * row);
            if let Some((held, data)) = holder {
                let end = (held.end * row).min(bytes.end);
                let first = held.start * row;
                each(&data[at - first..end - first]);
                at = end;
                continue;
            }
            let next = pieces
                .iter()
                .map(|(held, _)| held.start * row)
                .filter(|&start| start > at)
                .fold(bytes.end, usize::min);
            let rows = at / row..next.div_ceil(row);
            gap.resize(rows.len() * row, 0);
            self.read_into(read, rows.clone(), &mut gap, 0..0)?;
            let first = rows.start * row;
            each(&gap[at - first..next - first]);
            at = next;
        }
        Ok(())
    }

    /// Reads rows `rows` of `read`'s tensor into `dst` (exactly those rows), and hashes each of
    /// the tensor's hash blocks that lies whole inside rows `keep` (inside `rows`, the rows the
    /// rank keeps), and that no other rank has taken, as soon as it is read.
    fn read_into(
        &self,
        read: &Read,
        rows: Range<usize>,
        dst: &mut [u8],
        keep: Range<usize>,
    ) -> Result<()> {
        let tensor = &read.tensor;
        let row = tensor.row_bytes();
        let first_byte = rows.start * row;
        let mut blocks = match keep.is_empty() || read.blocks.is_empty() {
            true => 0..0,
            false => tensor_hash::blocks_within(
                keep.start * row..keep.end * row,
                tensor.bytes() as usize,
            ),
        };
        for chunk in &tensor.chunks {
            let held = chunk.rows();
            let (from, to) = (held.start.max(rows.start), held.end.min(rows.end));
            if from >= to {
                continue;
            }
            let path = self.dir.join(&chunk.file);
            let file = &self.files[&chunk.file];
            let mut offset = chunk.byte_range[0] + ((from - held.start) * row) as u64;
            let (mut at, end) = ((from - rows.start) * row, (to - rows.start) * row);
            while at < end {
                let piece = &mut dst[at..end.min(at + PIECE)];
                read_at(file, piece, offset).map_err(|e| EngineError::io(&path, e))?;
                offset += piece.len() as u64;
                at += piece.len();
                hash_inside(read, &mut blocks, &dst[..at], first_byte);
            }
        }
        Ok(())
    }
}

impl RowSource for RankReads {
    fn read_rows(
        &self,
        which: Which,
        param: usize,
        rows: Range<usize>,
        keep: Range<usize>,
        dst: &mut [u8],
    ) -> Result<()> {
        let Some(read) = self.tensors.get(&(which, param)) else {
            // Moments a fresh start goes without: the rank's zeros stay.
            return Ok(());
        };
        // The hash blocks inside rows the rank keeps are hashed as they arrive; the rest wait
        // for `check_placed`.
        self.read_into(read, rows, dst, keep)?;
        if cfg!(target_endian = "big") {
            for x in dst.chunks_exact_mut(4) {
                x.reverse();
            }
        }
        Ok(())
    }
}

/// Hashes the blocks of `read`'s tensor from the start of `blocks` that `filled` (the
/// tensor's bytes from `first_byte` on, as read so far) holds whole, and moves past them.
fn hash_inside(read: &Read, blocks: &mut Range<usize>, filled: &[u8], first_byte: usize) {
    let bytes = read.tensor.bytes() as usize;
    while blocks.start < blocks.end {
        let b = blocks.start;
        let at = tensor_hash::block_bytes(b, bytes);
        if at.end > first_byte + filled.len() {
            return;
        }
        let block = &read.blocks[b];
        if !block.taken.swap(true, Ordering::Relaxed) {
            let digest =
                tensor_hash::block_digest(&filled[at.start - first_byte..at.end - first_byte]);
            // Taken by this rank alone: nobody else sets it.
            let _ = block.digest.set(digest);
        }
        blocks.start += 1;
    }
}
