//! A checkpoint saved by ranks that are processes of their own, over their connections
//! ([`Collective`]): the files the same ranks in one process save, byte for byte.
//!
//! Rank 0 does what one process does around the tensors: it takes the run's [`RunLock`](super::RunLock), puts
//! right what an interrupted save left ([`recover`](super::recover())), makes the temporary directory and tells
//! every rank its name. For a sharded checkpoint every rank then sends every other its plan
//! (which rows of which tensors it holds), so that each checks alike that the chunks tile every
//! tensor; each writes and fsyncs its own file into the temporary directory and sends rank 0
//! the file's record, where its chunks lie in it, and its part of each whole tensor's hash (the
//! digests of the hash blocks it holds whole, and its bytes of the blocks it shares with its
//! neighbours: [`super::tensor_hash::HashPart`]). Rank 0 writes the index, the configuration and the trainer
//! state, commits with one rename, and tells every rank how the save ended. A gathered
//! checkpoint is gathered by every rank and written by rank 0.
//!
//! Crash safety is one process's: nothing is renamed into place before every rank has reported
//! its file fsynced, so a rank that stops at any point of a save leaves `latest` naming the
//! previous checkpoint, and rank 0 removes the temporary directory (where rank 0 itself is
//! killed, the next save's [`recover`](super::recover()) does). The run directory must be one every rank sees:
//! the same path, on a filesystem they share.

use super::shards::{self, ChunkIndex, RankPlan, RankWritten, SHARDS_FILE};
use super::state::{FileRecord, TrainerState};
use super::tensor_hash::{decode_parts, encode_parts, BLOCK_HASHED_FROM};
use super::{begin, publish, save, save_failed, RankChunks, SaveRequest, Tensors};
use crate::error::{EngineError, Result};
use crate::parallel::collective::Collective;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// What rank 0 tells every other rank at the start and at the end of a save: go on (with the
/// temporary directory's name, then the checkpoint's directory), or stop (with why).
#[derive(Serialize, Deserialize)]
enum Word {
    Go(String),
    Stop(String),
}

/// What a rank reports to rank 0 once it has written its file (its hash parts follow the
/// header, see [`encode_parts`]), or why it could not.
#[derive(Serialize, Deserialize)]
enum Header {
    Written {
        record: FileRecord,
        chunks: Vec<Option<ChunkIndex>>,
    },
    Failed(String),
}

/// Saves this rank's share of the checkpoint `req` (its chunks where the ranks save sharded,
/// every tensor gathered where they do not) of step `req.state.global_step` into `run_dir`,
/// with the other ranks of `comm`, which call it at once; rank 0 keeps the newest `keep_last`.
/// Returns the checkpoint's directory on every rank, or on every rank an error:
/// [`EngineError::SaveFailed`] naming the rank whose part failed and what `latest` names.
pub fn save_as_rank(
    run_dir: &Path,
    req: SaveRequest<'_>,
    keep_last: Option<usize>,
    comm: &dyn Collective,
) -> Result<PathBuf> {
    let step = req.state.global_step;
    let mine = match req.tensors {
        Tensors::Whole { .. } if comm.rank() == 0 => {
            let saved = save(run_dir, req, keep_last);
            tell_every_rank(comm, word_of(&saved));
            return saved;
        }
        Tensors::Whole { .. } => return hear(comm, step).map(PathBuf::from),
        Tensors::Sharded(mut ranks) if ranks.len() == 1 => ranks.remove(0),
        Tensors::Sharded(ranks) => {
            return Err(EngineError::Config(format!(
                "rank {} saves its own chunks alone, not {} ranks'",
                comm.rank(),
                ranks.len()
            )))
        }
    };
    if comm.rank() == 0 {
        return lead(run_dir, req.config, req.state, mine, keep_last, comm);
    }
    // Once rank 0 has said go, every rank reports to it, whatever happened, and hears how the
    // save ended: no rank is left waiting for another.
    let tmp = run_dir.join(hear(comm, step)?);
    let written = exchange_plans(&tmp, &mine, comm).and_then(|_| match tmp.is_dir() {
        true => shards::write_rank(&tmp, comm.rank(), comm.world_size(), &mine),
        false => Err(EngineError::SaveFailed {
            step,
            message: format!(
                "it does not see rank 0's temporary directory {}: give every rank the same run directory, on a filesystem every rank sees",
                tmp.display()
            ),
        }),
    });
    comm.send(0, encode_report(&written.map_err(|e| e.to_string())))?;
    hear(comm, step).map(PathBuf::from)
}

/// Rank 0's part of a sharded save: [`save_as_rank`]'s steps around every rank's writing.
fn lead(
    run_dir: &Path,
    config: &crate::model::LlamaConfig,
    mut state: TrainerState,
    mine: RankChunks<'_>,
    keep_last: Option<usize>,
    comm: &dyn Collective,
) -> Result<PathBuf> {
    let step = state.global_step;
    let (_lock, tmp) = match begin(run_dir, &state) {
        Ok(begun) => begun,
        Err(e) => {
            tell_every_rank(comm, Word::Stop(e.to_string()));
            return Err(e);
        }
    };
    let name = tmp.path().file_name().unwrap_or_default();
    tell_every_rank(comm, Word::Go(name.to_string_lossy().into_owned()));
    let fail = |cause| save_failed(run_dir, step, Some(tmp.path()), cause);
    let own = exchange_plans(tmp.path(), &mine, comm).and_then(|index| {
        let written = shards::write_rank(tmp.path(), 0, comm.world_size(), &mine)?;
        Ok((index, written))
    });
    let mut written = Vec::with_capacity(comm.world_size() - 1);
    for from in 1..comm.world_size() {
        let report = comm
            .recv(from)
            .and_then(|bytes| decode_report(from, &bytes));
        let report = match report {
            Ok(report) => report.map_err(|message| EngineError::SaveFailed {
                step,
                message: format!("rank {from}: {message}"),
            }),
            Err(e) => {
                let failed = fail(e);
                tell_every_rank(comm, Word::Stop(failed.to_string()));
                return Err(failed);
            }
        };
        written.push(report);
    }
    let saved = own
        .and_then(|(index, own)| {
            let others = written.into_iter().collect::<Result<Vec<_>>>()?;
            let written = std::iter::once(own).chain(others).collect();
            state.format_version = state.format_version.max(BLOCK_HASHED_FROM);
            state
                .files
                .extend(shards::write_index(tmp.path(), index, written)?);
            publish(run_dir, tmp.path(), config, state, keep_last)
        })
        .map_err(fail);
    tell_every_rank(comm, word_of(&saved));
    saved
}

/// Every rank's plan of its chunks, sent to every other; the index they make, or the same
/// error on every rank where they do not tile the tensors (`dir` is where the index would be
/// written).
fn exchange_plans(
    dir: &Path,
    mine: &RankChunks<'_>,
    comm: &dyn Collective,
) -> Result<shards::Index> {
    let plan = serde_json::to_vec(&RankPlan::of(mine)).expect("plain JSON");
    let plans = (comm.all_gather(plan)?.iter().enumerate())
        .map(|(from, bytes)| {
            serde_json::from_slice(bytes).map_err(|e| {
                EngineError::Config(format!(
                    "rank {from}'s plan of its chunks is not in this build's layout ({e}); run one build on every rank"
                ))
            })
        })
        .collect::<Result<Vec<RankPlan>>>()?;
    shards::plan_index(&dir.join(SHARDS_FILE), &plans)
}

/// What `outcome` tells the other ranks.
fn word_of<T: AsRef<Path>>(outcome: &Result<T>) -> Word {
    match outcome {
        Ok(dir) => Word::Go(dir.as_ref().display().to_string()),
        Err(e) => Word::Stop(e.to_string()),
    }
}

/// Sends `word` to every other rank, directly, so that a rank that stopped keeps none of the
/// others from hearing it (each has its own error to report, so a send's is not returned).
fn tell_every_rank(comm: &dyn Collective, word: Word) {
    let bytes = serde_json::to_vec(&word).expect("plain JSON");
    for to in 1..comm.world_size() {
        let _ = comm.send(to, bytes.clone());
    }
}

/// Rank 0's word: what it says to go on with, or [`EngineError::SaveFailed`] for step `step`
/// with why it stopped.
fn hear(comm: &dyn Collective, step: u64) -> Result<String> {
    let bytes = comm.recv(0)?;
    match serde_json::from_slice(&bytes) {
        Ok(Word::Go(what)) => Ok(what),
        Ok(Word::Stop(why)) => Err(EngineError::SaveFailed {
            step,
            message: format!("rank {}: rank 0 stopped the save: {why}", comm.rank()),
        }),
        Err(e) => Err(EngineError::Config(format!(
            "rank 0's word on the save is not in this build's layout ({e}); run one build on every rank"
        ))),
    }
}

/// `written` as one message: the header's length (8 bytes, little-endian), the header as JSON,
/// then the hash parts ([`encode_parts`]).
fn encode_report(written: &std::result::Result<RankWritten, String>) -> Vec<u8> {
    let (header, parts) = match written {
        Ok(w) => (
            Header::Written {
                record: w.record.clone(),
                chunks: w.chunks.clone(),
            },
            encode_parts(&w.hashes),
        ),
        Err(message) => (Header::Failed(message.clone()), encode_parts(&[])),
    };
    let header = serde_json::to_vec(&header).expect("plain JSON");
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&parts);
    out
}

/// The report rank `from` encoded with [`encode_report`]; an error naming it where the bytes
/// are not one.
fn decode_report(from: usize, bytes: &[u8]) -> Result<std::result::Result<RankWritten, String>> {
    let malformed = || {
        EngineError::Config(format!(
            "rank {from}'s report of its file is not in this build's layout; run one build on every rank"
        ))
    };
    let (len, rest) = bytes.split_first_chunk::<8>().ok_or_else(malformed)?;
    let len = usize::try_from(u64::from_le_bytes(*len)).map_err(|_| malformed())?;
    let (header, parts) = rest.split_at_checked(len).ok_or_else(malformed)?;
    let header: Header = serde_json::from_slice(header).map_err(|_| malformed())?;
    let hashes = decode_parts(parts).ok_or_else(malformed)?;
    Ok(match header {
        Header::Failed(message) => Err(message),
        Header::Written { record, chunks } => Ok(RankWritten {
            record,
            chunks,
            hashes,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::super::testing;
    use super::super::{Chunk, Entry, LOCK_FILE};
    use super::*;
    use crate::parallel::collective::thread_group;
    use safetensors::Dtype;
    use std::borrow::Cow;
    use std::collections::BTreeMap;
    use std::ops::Range;

    /// A 10-row tensor of 3 f32s a row, each byte from its place.
    fn tensor() -> Entry<'static> {
        Entry {
            name: "model.norm.weight".into(),
            dtype: Dtype::F32,
            shape: vec![10, 3],
            data: Cow::Owned((0..120).map(|i| (i * 7) as u8).collect()),
        }
    }

    /// Rank `r`'s chunks of [`tensor`]: rows `rows[r]`.
    fn chunks(rows: &[Range<usize>; 2], r: usize) -> RankChunks<'static> {
        RankChunks {
            model: vec![Chunk::rows_of(&tensor(), rows[r].clone()).into_owned()],
            optimizer: Vec::new(),
        }
    }

    /// Both ranks of a group in this process save step `step` into `run` at once, rank `r`
    /// holding rows `rows[r]`; each rank's outcome.
    fn save_both(run: &Path, step: u64, rows: [Range<usize>; 2]) -> Vec<Result<PathBuf>> {
        let config = testing::config();
        std::thread::scope(|s| {
            let ranks: Vec<_> = thread_group(2)
                .into_iter()
                .enumerate()
                .map(|(r, comm)| {
                    let (config, rows) = (&config, &rows);
                    s.spawn(move || {
                        let req = SaveRequest {
                            config,
                            tensors: Tensors::Sharded(vec![chunks(rows, r)]),
                            state: testing::state(step),
                        };
                        save_as_rank(run, req, None, &comm)
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Every file under `dir` but the run's lock (which names its holder), by its path under
    /// `root`.
    fn files(root: &Path, dir: &Path) -> BTreeMap<String, Vec<u8>> {
        let mut found = BTreeMap::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                found.extend(files(root, &path));
            } else if !path.ends_with(LOCK_FILE) {
                let name = path.strip_prefix(root).unwrap().display().to_string();
                found.insert(name, std::fs::read(&path).unwrap());
            }
        }
        found
    }

    #[test]
    fn chunks_that_do_not_tile_fail_every_rank_and_the_next_save_goes_through() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        std::fs::create_dir(&run).unwrap();
        for failed in save_both(&run, 1, [0..4, 5..10]) {
            let e = failed.unwrap_err().to_string();
            assert!(
                e.contains("the ranks' chunks of model.norm.weight do not tile it: rows 4..5 are saved by no rank"),
                "{e}"
            );
        }
        assert!(
            files(&run, &run).is_empty(),
            "nothing of the failed save is left"
        );

        // The ranks stay in step: the next save goes through, the files one process writes.
        let saved = save_both(&run, 2, [0..4, 4..10]);
        let dir = run.join(super::super::step_dir_name(2));
        for s in saved {
            assert_eq!(s.unwrap(), dir);
        }
        let alone = tmp.path().join("alone");
        std::fs::create_dir(&alone).unwrap();
        let config = testing::config();
        let req = SaveRequest {
            config: &config,
            tensors: Tensors::Sharded(vec![chunks(&[0..4, 4..10], 0), chunks(&[0..4, 4..10], 1)]),
            state: testing::state(2),
        };
        save(&alone, req, None).unwrap();
        assert_eq!(files(&run, &run), files(&alone, &alone));
    }
}
