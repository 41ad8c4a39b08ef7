//! Loading a sharded checkpoint onto several ranks, each rank reading only its rows. A rank
//! reads, of every chunk that overlaps the rows it holds of a tensor, the overlapping byte
//! range, straight into its own tensor; a chunk that lies whole inside those rows is checked
//! against its hash as it arrives, and rows that continue a tensor's whole hash (a rank's rows
//! starting where the rows hashed so far end, as rank 0's always do) are fed to it while they
//! are in cache. Once every rank holds its rows, each tensor's whole hash is finished in row
//! order, each row taken from the first rank that holds it (rows no rank holds are read from
//! the files for it): a chunk read into the wrong place, or
//! damage in a chunk two ranks share, fails it. Only then are the shared chunks read again and
//! checked against their own hashes, so that damage names its file, tensor, rows and bytes; a
//! clean load hashes each byte once, as one device's does. No rank ever holds a whole tensor
//! it does not keep.

use super::load::{match_spec, open, LoadRequest, EARLIER};
use super::reading::read_at;
use super::shards::{self, read_index, TensorIndex};
use super::state::TrainerState;
use crate::error::{EngineError, Result};
use crate::model::param_specs;
use crate::parallel::source::{Placed, RowSource, Which};
use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use xxhash_rust::xxh3::Xxh3Default;

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
    files: BTreeMap<String, File>,
    /// The tensors the ranks read, by `(which, param)`.
    tensors: BTreeMap<(Which, usize), Read>,
}

/// One whole tensor the ranks read, which of its chunks a rank has checked whole, and its
/// whole hash over the rows fed so far (the row it has reached).
struct Read {
    tensor: TensorIndex,
    checked: Vec<AtomicBool>,
    stream: Mutex<(usize, Xxh3Default)>,
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
        let index = read_index(&dir, &state.files, EARLIER)?;
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
                let checked = tensor
                    .chunks
                    .iter()
                    .map(|_| AtomicBool::new(false))
                    .collect();
                let stream = Mutex::new((0, Xxh3Default::new()));
                tensors.insert(
                    (which, i),
                    Read {
                        tensor,
                        checked,
                        stream,
                    },
                );
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
        for (at, (&(which, param), read)) in self.tensors.iter().enumerate() {
            work.push((at, read, placed(which, param)?));
        }
        work.sort_by_key(|(_, read, _)| std::cmp::Reverse(read.tensor.bytes()));
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let next = AtomicUsize::new(0);
        let mut checked: Vec<(usize, Result<()>)> = std::thread::scope(|scope| {
            let running: Vec<_> = (0..threads.min(work.len()))
                .map(|_| {
                    scope.spawn(|| {
                        let mut done = Vec::new();
                        while let Some((at, read, pieces)) =
                            work.get(next.fetch_add(1, Ordering::Relaxed))
                        {
                            done.push((*at, self.check_whole(read, pieces)));
                        }
                        done
                    })
                })
                .collect();
            running
                .into_iter()
                .flat_map(|h| h.join().expect("hashing does not panic"))
                .collect()
        });
        checked.sort_by_key(|(at, _)| *at);
        checked.into_iter().try_for_each(|(_, r)| r)
    }

    /// Streams `read`'s tensor in row order through its whole hash, each row from the first of
    /// `pieces` that holds it, or from the files. When it does not match, the chunks no rank
    /// checked are read again and checked, so that damage names its chunk; with every chunk
    /// intact, one is out of place.
    fn check_whole(&self, read: &Read, pieces: &Placed<'_>) -> Result<()> {
        let tensor = &read.tensor;
        let row = tensor.row_bytes();
        let rows = tensor.shape.first().copied().unwrap_or(1);
        let (mut next, mut whole) = read
            .stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut gap = Vec::new();
        for (held, bytes) in pieces {
            if held.end <= next {
                continue;
            }
            if held.start > next {
                gap.resize((held.start - next) * row, 0);
                self.read_into(read, next..held.start, &mut gap)?;
                whole.update(&gap);
                next = held.start;
            }
            whole.update(&bytes[(next - held.start) * row..]);
            next = held.end;
        }
        if next < rows {
            gap.resize((rows - next) * row, 0);
            self.read_into(read, next..rows, &mut gap)?;
            whole.update(&gap);
        }
        let found = format!("{:032x}", whole.digest128());
        if found != tensor.xxh3_128 {
            for (chunk, checked) in tensor.chunks.iter().zip(&read.checked) {
                if !checked.load(Ordering::Relaxed) {
                    let held = chunk.rows();
                    gap.resize(held.len() * row, 0);
                    self.read_into(read, held, &mut gap)?;
                }
            }
        }
        shards::check_found(&self.index_path, tensor, &found)
    }

    /// Reads rows `rows` of `read`'s tensor into `dst` (exactly those rows), checking each chunk
    /// that lies whole inside them against its hash.
    fn read_into(&self, read: &Read, rows: Range<usize>, dst: &mut [u8]) -> Result<()> {
        let tensor = &read.tensor;
        let row = tensor.row_bytes();
        for (chunk, checked) in tensor.chunks.iter().zip(&read.checked) {
            let held = chunk.rows();
            let (from, to) = (held.start.max(rows.start), held.end.min(rows.end));
            if from >= to {
                continue;
            }
            let whole = from == held.start && to == held.end;
            let mut hasher = whole.then(Xxh3Default::new);
            let at = chunk.byte_range[0] + ((from - held.start) * row) as u64;
            let into = &mut dst[(from - rows.start) * row..(to - rows.start) * row];
            let path = self.dir.join(&chunk.file);
            let file = &self.files[&chunk.file];
            let mut offset = at;
            for piece in into.chunks_mut(PIECE) {
                read_at(file, piece, offset).map_err(|e| EngineError::io(&path, e))?;
                if let Some(h) = &mut hasher {
                    h.update(piece);
                }
                offset += piece.len() as u64;
            }
            if let Some(h) = hasher {
                if format!("{:032x}", h.digest128()) != chunk.xxh3_128 {
                    return Err(self.damaged(tensor, chunk));
                }
                checked.store(true, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// The error for `chunk` of `tensor`, whose bytes do not match its hash.
    fn damaged(&self, tensor: &TensorIndex, chunk: &shards::ChunkIndex) -> EngineError {
        let [begin, end] = chunk.byte_range;
        let rows = chunk.rows();
        EngineError::bad_file(
            self.dir.join(&chunk.file),
            format!(
                "checksum mismatch: the chunk of {} (rows {}..{}) at bytes {begin}..{end} does not match its hash: the file changed after it was written (corruption?); restore it or {EARLIER}",
                tensor.name, rows.start, rows.end
            ),
        )
    }
}

impl RowSource for RankReads {
    fn read_rows(
        &self,
        which: Which,
        param: usize,
        rows: Range<usize>,
        kept: bool,
        dst: &mut [u8],
    ) -> Result<()> {
        let Some(read) = self.tensors.get(&(which, param)) else {
            // Moments a fresh start goes without: the rank's zeros stay.
            return Ok(());
        };
        self.read_into(read, rows.clone(), dst)?;
        // Rows that continue the whole hash are fed to it while they are in cache, if no other
        // rank is feeding it; the rest wait for `check_placed`.
        if let (true, Ok(mut stream)) = (kept && !rows.is_empty(), read.stream.try_lock()) {
            if stream.0 == rows.start {
                stream.1.update(dst);
                stream.0 = rows.end;
            }
        }
        if cfg!(target_endian = "big") {
            for x in dst.chunks_exact_mut(4) {
                x.reverse();
            }
        }
        Ok(())
    }
}
