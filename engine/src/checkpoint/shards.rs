//! Sharded checkpoints: what several ranks save without gathering. Each rank writes its rows of
//! every tensor into a file of its own (`rank-RRRRR-of-NNNNN.safetensors`, one safetensors
//! tensor per chunk, under the tensor's name); `shards.json` lists, for every tensor, its name,
//! dtype and whole shape, the hash of the whole logical tensor ([`super::tensor_hash`]), and its chunks: their rows
//! in the tensor's own coordinates (`offsets`, `sizes`), the file and byte range holding them and
//! their own XXH3-128 (as PyTorch's distributed checkpoint keeps `.metadata` beside per-rank
//! files). The tensors keep the single-device checkpoint's two lists, `model` (the weights the
//! passes read, in Hugging Face names) and `optimizer` (masters and moments), in their order,
//! so digests over whole tensors are the same at every world size.
//!
//! The chunks of a tensor must tile its rows in rank order; a save whose ranks leave a row
//! unsaved or save one twice is refused before anything is written. A load on one device
//! assembles every tensor whole from its chunks, and a load on several ranks streams the rows
//! each rank read (`RankReads`), through the whole tensor's hash, so a chunk put in the wrong
//! place fails loudly, naming the tensor.

use super::files::{self, write_synced};
use super::state::{FileRecord, TrainerState};
use super::tensor_hash::{finish_parts, HashPart, TensorHash};
use super::{write_safetensors, Entry};
use crate::error::{EngineError, Result};
use crate::parallel::plan::shard_shape;
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use twox_hash::XxHash3_128;

/// The index of a sharded checkpoint.
pub const SHARDS_FILE: &str = "shards.json";
/// The layout `shards.json` describes.
pub const SHARDS_FORMAT: &str = "ckpt-shards/1";

/// The name of rank `rank`'s file of a checkpoint saved by `world` ranks.
pub fn rank_file_name(rank: usize, world: usize) -> String {
    format!("rank-{rank:05}-of-{world:05}.safetensors")
}

/// One rank's rows of a tensor, to save.
pub struct Chunk<'a> {
    /// The tensor's name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// The whole tensor's dimensions.
    pub shape: Vec<usize>,
    /// The rows (first-dimension indices) this chunk holds.
    pub rows: Range<usize>,
    /// Their raw little-endian bytes.
    pub data: Cow<'a, [u8]>,
    /// Left out of the rank's file and the index once the ranks' chunks are checked to tile
    /// their tensors, as a writer that skips the last, short shard does
    /// ([`crate::Fault::LastUnevenShardDropped`]).
    pub skipped: bool,
}

impl<'a> Chunk<'a> {
    /// Rows `rows` of the whole tensor `entry`.
    pub fn rows_of(entry: &Entry<'a>, rows: Range<usize>) -> Self {
        let row = row_bytes(&entry.shape, entry.dtype);
        let range = rows.start * row..rows.end * row;
        let data = match &entry.data {
            Cow::Borrowed(b) => Cow::Borrowed(&b[range]),
            Cow::Owned(v) => Cow::Owned(v[range].to_vec()),
        };
        Chunk {
            name: entry.name.clone(),
            dtype: entry.dtype,
            shape: entry.shape.clone(),
            rows,
            data,
            skipped: false,
        }
    }

    /// The shard `entry` (rows `rows` of a tensor of `shape`).
    pub fn shard(entry: Entry<'a>, shape: &[usize], rows: Range<usize>) -> Self {
        Chunk {
            name: entry.name,
            dtype: entry.dtype,
            shape: shape.to_vec(),
            rows,
            data: entry.data,
            skipped: false,
        }
    }

    /// The chunk with its data copied, owning it.
    pub fn into_owned(self) -> Chunk<'static> {
        Chunk {
            data: Cow::Owned(self.data.into_owned()),
            name: self.name,
            dtype: self.dtype,
            shape: self.shape,
            rows: self.rows,
            skipped: self.skipped,
        }
    }
}

/// What one rank saves: its chunk of every tensor of the model list and of the optimizer list,
/// in the lists' order.
#[derive(Default)]
pub struct RankChunks<'a> {
    /// Chunks of the weights the passes read.
    pub model: Vec<Chunk<'a>>,
    /// Chunks of the master weights and moments.
    pub optimizer: Vec<Chunk<'a>>,
}

/// `shards.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Index {
    /// [`SHARDS_FORMAT`].
    pub format: String,
    /// Ranks that saved it.
    pub world_size: usize,
    /// The weights the passes read, in the order a single-device `model.safetensors` holds them.
    pub model: Vec<TensorIndex>,
    /// Master weights and moments, in the order a single-device `optimizer.safetensors` holds
    /// them.
    pub optimizer: Vec<TensorIndex>,
    /// How the tensors' whole hashes are defined: not in the file, [`read_index`] takes it from
    /// the checkpoint's format version.
    #[serde(skip)]
    pub tensor_hash: TensorHash,
}

/// One tensor of a sharded checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorIndex {
    /// Its name.
    pub name: String,
    /// Its element type, as safetensors names it.
    pub dtype: Dtype,
    /// Its whole dimensions.
    pub shape: Vec<usize>,
    /// Hex hash of the whole tensor's row-major bytes, as [`Index::tensor_hash`] defines it:
    /// from format version 5 the XXH3-128 of the XXH3-128 digests of its
    /// [`super::tensor_hash::HASH_BLOCK`]-byte (64 KiB) blocks, before it the XXH3-128 of the
    /// bytes.
    pub xxh3_128: String,
    /// Its non-empty chunks, in row order.
    pub chunks: Vec<ChunkIndex>,
}

/// Where one chunk of a tensor is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkIndex {
    /// The file holding it.
    pub file: String,
    /// Its first element's index in each dimension of the tensor.
    pub offsets: Vec<usize>,
    /// Its extent in each dimension.
    pub sizes: Vec<usize>,
    /// Its bytes' range in the file: `[begin, end)`.
    pub byte_range: [u64; 2],
    /// Hex XXH3-128 of its bytes.
    pub xxh3_128: String,
}

impl TensorIndex {
    /// Its bytes when whole.
    pub fn bytes(&self) -> u64 {
        (self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8) as u64
    }

    /// Bytes of one row (first-dimension index).
    pub fn row_bytes(&self) -> usize {
        row_bytes(&self.shape, self.dtype)
    }
}

impl ChunkIndex {
    /// The rows (first-dimension indices) of its tensor it holds.
    pub fn rows(&self) -> Range<usize> {
        let start = self.offsets.first().copied().unwrap_or(0);
        start..start + self.sizes.first().copied().unwrap_or(0)
    }
}

fn row_bytes(shape: &[usize], dtype: Dtype) -> usize {
    shape.iter().skip(1).product::<usize>() * dtype.bitsize() / 8
}

fn xxh3_hex(parts: &[&[u8]]) -> String {
    let mut h = XxHash3_128::new();
    parts.iter().for_each(|p| h.write(p));
    format!("{:032x}", h.finish_128())
}

/// A rank's chunk of a tensor before anything is written: what the ranks' chunks are checked to
/// tile their tensors by ([`plan_index`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkPlan {
    /// The tensor's name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// The whole tensor's dimensions.
    pub shape: Vec<usize>,
    /// The rows (first-dimension indices) the chunk holds.
    pub rows: Range<usize>,
    /// The chunk's bytes.
    pub bytes: usize,
}

/// One rank's chunks of the model list and of the optimizer list, as [`ChunkPlan`]s: what ranks
/// in processes of their own exchange before they write.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankPlan {
    /// Chunks of the weights the passes read.
    pub model: Vec<ChunkPlan>,
    /// Chunks of the master weights and moments.
    pub optimizer: Vec<ChunkPlan>,
}

impl RankPlan {
    /// The plan of `chunks`.
    pub fn of(chunks: &RankChunks<'_>) -> Self {
        let plans = |list: &[Chunk<'_>]| {
            list.iter()
                .map(|c| ChunkPlan {
                    name: c.name.clone(),
                    dtype: c.dtype,
                    shape: c.shape.clone(),
                    rows: c.rows.clone(),
                    bytes: c.data.len(),
                })
                .collect()
        };
        RankPlan {
            model: plans(&chunks.model),
            optimizer: plans(&chunks.optimizer),
        }
    }
}

/// What writing one rank's file adds to the index: the file's record, and for every tensor
/// (the model list, then the optimizer list) where its chunk lies in the file (`None` where the
/// chunk is empty or skipped) and the chunk's part of the whole tensor's hash (a skipped chunk's
/// too: the hash is of the tensor the ranks hold).
#[derive(Clone, Debug, PartialEq)]
pub struct RankWritten {
    /// The rank's file.
    pub record: FileRecord,
    /// Each tensor's chunk, as the index lists it.
    pub chunks: Vec<Option<ChunkIndex>>,
    /// Each tensor's chunk's part of the tensor's hash.
    pub hashes: Vec<HashPart>,
}

/// Writes every rank's file and the index into the temporary directory `dir`, each fsynced,
/// and returns the files' records by name. The ranks' files are written concurrently, as ranks
/// of their own would. Nothing is written when the chunks do not tile their tensors.
pub fn write(dir: &Path, ranks: &[RankChunks<'_>]) -> Result<Vec<(String, FileRecord)>> {
    let world = ranks.len();
    let plans: Vec<RankPlan> = ranks.iter().map(RankPlan::of).collect();
    let index = plan_index(&dir.join(SHARDS_FILE), &plans)?;
    let written: Vec<Result<RankWritten>> = std::thread::scope(|scope| {
        let running: Vec<_> = (ranks.iter().enumerate())
            .map(|(rank, chunks)| scope.spawn(move || write_rank(dir, rank, world, chunks)))
            .collect();
        running
            .into_iter()
            .map(|w| w.join().expect("writing does not panic"))
            .collect()
    });
    let written = written.into_iter().collect::<Result<Vec<_>>>()?;
    write_index(dir, index, written)
}

/// Writes rank `rank` of `world`'s file of `chunks` (its non-empty chunks, in list order) into
/// `dir`, fsynced, and returns what it adds to the index.
pub fn write_rank(
    dir: &Path,
    rank: usize,
    world: usize,
    chunks: &RankChunks<'_>,
) -> Result<RankWritten> {
    let file = rank_file_name(rank, world);
    let all = || chunks.model.iter().chain(&chunks.optimizer);
    let written = |c: &&Chunk<'_>| !c.rows.is_empty() && !c.skipped;
    let entries: Vec<Entry<'_>> = all()
        .filter(written)
        .map(|c| Entry {
            name: c.name.clone(),
            dtype: c.dtype,
            shape: shard_shape(&c.shape, c.rows.len()),
            data: Cow::Borrowed(&c.data),
        })
        .collect();
    let (record, ranges) = write_safetensors(&dir.join(&file), &entries)?;
    let mut ranges = ranges.into_iter();
    let mut out = RankWritten {
        record,
        chunks: Vec::new(),
        hashes: Vec::new(),
    };
    for chunk in all() {
        let row = row_bytes(&chunk.shape, chunk.dtype);
        let bytes = chunk.shape.iter().product::<usize>() * chunk.dtype.bitsize() / 8;
        out.hashes
            .push(HashPart::of(&chunk.data, chunk.rows.start * row, bytes));
        out.chunks.push(written(&chunk).then(|| {
            let mut offsets = vec![0; chunk.shape.len().max(1)];
            offsets[0] = chunk.rows.start;
            ChunkIndex {
                file: file.clone(),
                offsets,
                sizes: shard_shape(&chunk.shape, chunk.rows.len()),
                byte_range: ranges.next().expect("one range per chunk written"),
                xxh3_128: xxh3_hex(&[&chunk.data]),
            }
        }));
    }
    Ok(out)
}

/// Completes `index` (from [`plan_index`]) with every rank's chunks and the whole tensors'
/// hashes from what each rank's write gave (`written`, in rank order), writes it into `dir`,
/// fsynced, and returns the records of the ranks' files and of the index by name.
pub fn write_index(
    dir: &Path,
    mut index: Index,
    written: Vec<RankWritten>,
) -> Result<Vec<(String, FileRecord)>> {
    let path = dir.join(SHARDS_FILE);
    let world = index.world_size;
    let tensors = index.model.len() + index.optimizer.len();
    if let Some(rank) =
        (written.iter()).position(|w| w.chunks.len() != tensors || w.hashes.len() != tensors)
    {
        return Err(EngineError::bad_file(
            &path,
            format!("rank {rank} wrote chunks of another list of tensors than the plan's {tensors}; run one build on every rank"),
        ));
    }
    for (i, tensor) in (index.model.iter_mut())
        .chain(&mut index.optimizer)
        .enumerate()
    {
        let parts = written.iter().map(|w| &w.hashes[i]);
        tensor.xxh3_128 = finish_parts(parts, tensor.bytes() as usize).ok_or_else(|| {
            EngineError::bad_file(
                &path,
                format!(
                    "the ranks' chunks of {} do not tile its bytes; run one build on every rank",
                    tensor.name
                ),
            )
        })?;
        tensor.chunks = written.iter().filter_map(|w| w.chunks[i].clone()).collect();
    }
    let mut records: Vec<(String, FileRecord)> = (written.into_iter().enumerate())
        .map(|(rank, w)| (rank_file_name(rank, world), w.record))
        .collect();
    let text = serde_json::to_vec_pretty(&index).expect("plain JSON");
    records.push((SHARDS_FILE.into(), write_synced(&path, &[&text])?));
    Ok(records)
}

/// The index of a checkpoint the ranks of `plans` (in rank order) save, its tensors without
/// hashes or chunks yet; an error, naming the tensor and rows, where the ranks' chunks do not
/// tile a tensor in rank order or do not fill their rows (`index_path` is where the index
/// would be written).
pub fn plan_index(index_path: &Path, plans: &[RankPlan]) -> Result<Index> {
    Ok(Index {
        format: SHARDS_FORMAT.into(),
        world_size: plans.len(),
        model: planned_tensors(index_path, plans, |r| &r.model)?,
        optimizer: planned_tensors(index_path, plans, |r| &r.optimizer)?,
        tensor_hash: TensorHash::Blocks,
    })
}

/// The index entries of one list of tensors (`list` picks it from each rank's plan), without
/// hashes or chunks; see [`plan_index`].
fn planned_tensors<'c>(
    index_path: &Path,
    ranks: &'c [RankPlan],
    list: impl Fn(&'c RankPlan) -> &'c Vec<ChunkPlan>,
) -> Result<Vec<TensorIndex>> {
    let first = list(&ranks[0]);
    let refuse = |message: String| {
        Err(EngineError::bad_file(
            index_path,
            format!("{message}; nothing was written"),
        ))
    };
    let mut tensors = Vec::with_capacity(first.len());
    for (i, lead) in first.iter().enumerate() {
        let mut next_row = 0;
        for (rank, chunks) in ranks.iter().enumerate() {
            let Some(chunk) = list(chunks).get(i).filter(|c| c.name == lead.name) else {
                return refuse(format!(
                    "rank {rank} holds no chunk of {} where rank 0 does",
                    lead.name
                ));
            };
            if chunk.shape != lead.shape || chunk.dtype != lead.dtype {
                return refuse(format!(
                    "rank {rank}'s chunk of {} is of a {:?} {} tensor, rank 0's of a {:?} {}",
                    lead.name, chunk.shape, chunk.dtype, lead.shape, lead.dtype
                ));
            }
            if chunk.rows.is_empty() {
                continue;
            }
            if chunk.rows.start != next_row {
                let what = if chunk.rows.start > next_row {
                    format!("rows {next_row}..{} are saved by no rank", chunk.rows.start)
                } else {
                    format!("rows {}..{next_row} are saved twice", chunk.rows.start)
                };
                return refuse(format!(
                    "the ranks' chunks of {} do not tile it: {what} (rank {rank} saves rows {}..{})",
                    lead.name, chunk.rows.start, chunk.rows.end
                ));
            }
            let want = chunk.rows.len() * row_bytes(&chunk.shape, chunk.dtype);
            if chunk.bytes != want {
                return refuse(format!(
                    "rank {rank}'s chunk of {} holds {} bytes, its rows {}..{} hold {want}",
                    lead.name, chunk.bytes, chunk.rows.start, chunk.rows.end
                ));
            }
            next_row = chunk.rows.end;
        }
        let rows = lead.shape.first().copied().unwrap_or(1);
        if next_row != rows {
            return refuse(format!(
                "the ranks' chunks of {} do not tile it: rows {next_row}..{rows} are saved by no rank",
                lead.name
            ));
        }
        tensors.push(TensorIndex {
            name: lead.name.clone(),
            dtype: lead.dtype,
            shape: lead.shape.clone(),
            xxh3_128: String::new(),
            chunks: Vec::new(),
        });
    }
    Ok(tensors)
}

/// Reads and checks the index of the sharded checkpoint in `dir`, whose files (the index among
/// them) are recorded in `state`: its checksum (a mismatch's error ends with `fix`), its format,
/// and that every tensor's chunks tile it and lie inside files the checkpoint lists, no two
/// overlapping. So a tensor's whole bytes, which loading allocates, are at most the files'.
/// Its [`Index::tensor_hash`] is the one of `state`'s format version.
pub fn read_index(dir: &Path, state: &TrainerState, fix: &str) -> Result<Index> {
    let files = &state.files;
    let path = dir.join(SHARDS_FILE);
    let record = files.get(SHARDS_FILE).ok_or_else(|| {
        EngineError::bad_file(
            dir.join(super::STATE_FILE),
            format!("lists no record of {SHARDS_FILE}; the checkpoint is incomplete"),
        )
    })?;
    let bytes = files::read_checked(&path, record, fix)?;
    let mut index: Index = serde_json::from_slice(&bytes)
        .map_err(|e| EngineError::bad_file(&path, format!("not a shard index: {e}")))?;
    index.tensor_hash = TensorHash::of_version(state.format_version);
    if index.format != SHARDS_FORMAT {
        return Err(EngineError::bad_file(
            &path,
            format!(
                "is in the layout {:?}, this build reads {SHARDS_FORMAT:?}; load it with the build that saved it",
                index.format
            ),
        ));
    }
    let mut ranges: BTreeMap<&str, Vec<[u64; 2]>> = BTreeMap::new();
    for tensor in index.model.iter().chain(&index.optimizer) {
        check_tiling(tensor, index.world_size, files)
            .map_err(|m| EngineError::bad_file(&path, m))?;
        for chunk in &tensor.chunks {
            ranges
                .entry(&chunk.file)
                .or_default()
                .push(chunk.byte_range);
        }
    }
    for (file, mut ranges) in ranges {
        let on_disk = dir.join(file);
        let len = std::fs::metadata(&on_disk)
            .map_err(|e| EngineError::io(&on_disk, e))?
            .len();
        if len != files[file].bytes {
            return Err(EngineError::bad_file(
                &on_disk,
                format!(
                    "is {len} bytes, {} were written (truncated or replaced); restore it or {fix}",
                    files[file].bytes
                ),
            ));
        }
        ranges.sort_unstable();
        if let Some(w) = ranges.windows(2).find(|w| w[1][0] < w[0][1]) {
            return Err(EngineError::bad_file(
                &path,
                format!(
                    "lists chunks at bytes {}..{} and {}..{} of {file:?}, which overlap; restore the checkpoint or {fix}",
                    w[0][0], w[0][1], w[1][0], w[1][1]
                ),
            ));
        }
    }
    Ok(index)
}

/// That `tensor`'s chunks tile its rows in order, each a whole-row block of the right byte
/// length inside a file of `files`, and that its size is a number this machine can hold; rows
/// missing at its end are named with the files of the `world` saving ranks the plan gave them.
fn check_tiling(
    tensor: &TensorIndex,
    world: usize,
    files: &BTreeMap<String, FileRecord>,
) -> std::result::Result<(), String> {
    let too_large = || {
        format!(
            "{} is a {:?} {} tensor, more bytes than this machine can address",
            tensor.name, tensor.shape, tensor.dtype
        )
    };
    let rows = tensor.shape.first().copied().unwrap_or(1);
    let row = checked_bytes(tensor.shape.iter().skip(1), tensor.dtype).ok_or_else(too_large)?;
    checked_bytes(tensor.shape.iter(), tensor.dtype).ok_or_else(too_large)?;
    let mut next_row = 0usize;
    for chunk in &tensor.chunks {
        let whole_rows = shard_shape(&tensor.shape, chunk.sizes.first().copied().unwrap_or(0));
        let start = chunk.offsets.first().copied().unwrap_or(0);
        let [begin, end] = chunk.byte_range;
        let fits = chunk.offsets.iter().skip(1).all(|&o| o == 0)
            && chunk.sizes == whole_rows
            && start == next_row
            && end.checked_sub(begin) == (chunk.sizes[0] as u64).checked_mul(row);
        if !fits {
            return Err(format!(
                "chunk of {} at offsets {:?}, sizes {:?}, bytes {begin}..{end} does not continue its rows at {next_row} (a {:?} {} tensor)",
                tensor.name, chunk.offsets, chunk.sizes, tensor.shape, tensor.dtype
            ));
        }
        let Some(file) = files.get(&chunk.file) else {
            return Err(format!(
                "chunk of {} lies in {:?}, a file the checkpoint does not list",
                tensor.name, chunk.file
            ));
        };
        if end > file.bytes {
            return Err(format!(
                "chunk of {} at bytes {begin}..{end} lies past the end of {:?}, which is {} bytes",
                tensor.name, chunk.file, file.bytes
            ));
        }
        next_row = next_row.saturating_add(chunk.sizes[0]);
    }
    if next_row != rows {
        let owners: Vec<String> = (0..world)
            .filter(|&r| {
                let planned = crate::parallel::plan::rows(rows, world, r);
                planned.start < rows && planned.end > next_row
            })
            .map(|r| rank_file_name(r, world))
            .collect();
        return Err(format!(
            "the chunks of {} cover rows 0..{next_row} of its {rows}: rows {next_row}..{rows}, which the saving plan gives {}, are in no rank's file (a writer that skipped the last, short shard leaves them out); the tensor cannot be rebuilt from this checkpoint: resume from an earlier checkpoint, or save the state again with a writer that writes every shard",
            tensor.name,
            owners.join(" and ")
        ));
    }
    Ok(())
}

/// The bytes of `dims` elements of `dtype`, unless they overflow a `u64` or this machine's
/// address space.
fn checked_bytes<'d>(mut dims: impl Iterator<Item = &'d usize>, dtype: Dtype) -> Option<u64> {
    let elements = dims.try_fold(1usize, |n, &d| n.checked_mul(d))?;
    let bytes = elements.checked_mul(dtype.bitsize() / 8)?;
    u64::try_from(bytes).ok()
}

/// Where each chunk of `tensor` goes in the tensor's bytes `whole`: `(file, file offset,
/// destination)`.
pub fn regions<'w>(tensor: &TensorIndex, whole: &'w mut [u8]) -> Vec<(String, u64, &'w mut [u8])> {
    let row = row_bytes(&tensor.shape, tensor.dtype);
    let mut rest = whole;
    let mut out = Vec::with_capacity(tensor.chunks.len());
    for chunk in &tensor.chunks {
        let (mine, after) = std::mem::take(&mut rest).split_at_mut(chunk.sizes[0] * row);
        out.push((chunk.file.clone(), chunk.byte_range[0], mine));
        rest = after;
    }
    out
}

/// Fails unless `whole`, assembled from `tensor`'s chunks, has the whole tensor's hash (as
/// `tensor_hash` defines it): a chunk read into the wrong place, or the wrong chunk, is named
/// here.
pub fn check_whole(
    index_path: &Path,
    tensor_hash: TensorHash,
    tensor: &TensorIndex,
    whole: &[u8],
) -> Result<()> {
    check_found(index_path, tensor, &tensor_hash.hex(whole))
}

/// Fails unless `found`, the hex hash of `tensor` assembled from its chunks, is the whole
/// tensor's hash.
pub fn check_found(index_path: &Path, tensor: &TensorIndex, found: &str) -> Result<()> {
    if found == tensor.xxh3_128 {
        return Ok(());
    }
    Err(EngineError::bad_file(
        index_path,
        format!(
            "{} assembled from its chunks has XXH3-128 {found}, the saved tensor {}: a chunk is out of place or another's; restore the checkpoint or resume from an earlier one",
            tensor.name, tensor.xxh3_128
        ),
    ))
}

/// The error for `chunk` of `tensor`, in the checkpoint at `dir`, whose bytes do not match its
/// hash: its file, rows and bytes, then `fix`.
pub fn damaged_chunk(
    dir: &Path,
    tensor: &TensorIndex,
    chunk: &ChunkIndex,
    fix: &str,
) -> EngineError {
    let [begin, end] = chunk.byte_range;
    let rows = chunk.rows();
    EngineError::bad_file(
        dir.join(&chunk.file),
        format!(
            "checksum mismatch: the chunk of {} (rows {}..{}) at bytes {begin}..{end} does not match its hash: the file changed after it was written (corruption?); restore it or {fix}",
            tensor.name, rows.start, rows.end
        ),
    )
}

/// The bytes of `chunk` of `tensor` in `file`, the bytes of its rank file in the checkpoint at
/// `dir`, once they match the chunk's hash; otherwise an error naming the chunk's file, rows and
/// bytes ([`damaged_chunk`]), `fix` ending it.
pub fn checked_chunk<'f>(
    dir: &Path,
    tensor: &TensorIndex,
    chunk: &ChunkIndex,
    file: &'f [u8],
    fix: &str,
) -> Result<&'f [u8]> {
    let [begin, end] = chunk.byte_range;
    let src = file.get(begin as usize..end as usize).ok_or_else(|| {
        EngineError::bad_file(
            dir.join(&chunk.file),
            format!(
                "is {} bytes, shorter than the chunk of {} at {begin}..{end}; restore it or {fix}",
                file.len(),
                tensor.name
            ),
        )
    })?;
    if xxh3_hex(&[src]) != chunk.xxh3_128 {
        return Err(damaged_chunk(dir, tensor, chunk, fix));
    }
    Ok(src)
}

/// What to do about a damaged chunk that [`each_whole`] reads (for `verify`, the digests and
/// `export`).
const WHOLE_FIX: &str = "use an earlier checkpoint";

/// Every tensor of `list`, whole, read from the checkpoint in `dir` (chunk by chunk, each
/// checked against its own hash, then the whole tensor against its hash as `tensor_hash`
/// defines it), handed to `each` in order.
pub fn each_whole(
    dir: &Path,
    tensor_hash: TensorHash,
    list: &[TensorIndex],
    mut each: impl FnMut(&TensorIndex, &[u8]) -> Result<()>,
) -> Result<()> {
    let mut maps = std::collections::BTreeMap::new();
    for tensor in list {
        let mut whole = vec![0u8; tensor.bytes() as usize];
        for ((file, _, dst), chunk) in regions(tensor, &mut whole).into_iter().zip(&tensor.chunks) {
            if !maps.contains_key(&file) {
                maps.insert(file.clone(), files::MappedFile::open(&dir.join(&file))?);
            }
            let src = checked_chunk(dir, tensor, chunk, maps[&file].bytes(), WHOLE_FIX)?;
            dst.copy_from_slice(src);
        }
        check_whole(&dir.join(SHARDS_FILE), tensor_hash, tensor, &whole)?;
        each(tensor, &whole)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::tensor_hash::HASH_BLOCK;
    use crate::parallel::plan;

    /// A tensor of `rows` rows of `row` f32 elements, each byte from its place.
    fn entry(name: &str, rows: usize, row: usize) -> Entry<'static> {
        let data = (0..rows * row * 4)
            .map(|i| (i.wrapping_mul(2654435761) >> 11) as u8)
            .collect();
        Entry {
            name: name.into(),
            dtype: Dtype::F32,
            shape: vec![rows, row],
            data: Cow::Owned(data),
        }
    }

    /// The definition written out: XXH3-128 of the 16-byte little-endian XXH3-128 digests of
    /// the 64 KiB blocks of the row-major bytes.
    fn by_definition(bytes: &[u8]) -> String {
        let digests: Vec<u8> = bytes
            .chunks(HASH_BLOCK)
            .flat_map(|b| XxHash3_128::oneshot(b).to_le_bytes())
            .collect();
        format!("{:032x}", XxHash3_128::oneshot(&digests))
    }

    #[test]
    fn a_block_hashed_tensor_has_one_hash_at_every_world_size() {
        // Rows of 300 bytes: no rank's rows start or end on a block boundary.
        let tensors = [
            entry("a", 1001, 75),
            entry("b", 7, 3),
            entry("c", 450, 1024),
        ];
        let tmp = tempfile::tempdir().unwrap();
        let mut hashes = Vec::new();
        for world in 1..=5 {
            let ranks: Vec<RankChunks<'_>> = (0..world)
                .map(|rank| RankChunks {
                    model: tensors
                        .iter()
                        .map(|t| Chunk::rows_of(t, plan::rows(t.shape[0], world, rank)))
                        .collect(),
                    optimizer: Vec::new(),
                })
                .collect();
            let dir = tmp.path().join(format!("world-{world}"));
            std::fs::create_dir(&dir).unwrap();
            write(&dir, &ranks).unwrap();
            let index: Index =
                serde_json::from_slice(&std::fs::read(dir.join(SHARDS_FILE)).unwrap()).unwrap();
            assert_eq!(index.world_size, world);
            let found: Vec<String> = index.model.iter().map(|t| t.xxh3_128.clone()).collect();
            hashes.push(found);
        }
        let direct: Vec<String> = tensors.iter().map(|t| by_definition(&t.data)).collect();
        for (world, found) in (1..).zip(&hashes) {
            assert_eq!(found, &direct, "world size {world}");
        }
        let plain: Vec<String> = tensors
            .iter()
            .map(|t| TensorHash::Plain.hex(&t.data))
            .collect();
        assert_ne!(plain, direct, "the two definitions differ");
    }
}
