//! Checkpoints: one directory per step holding `model.safetensors` + `config.json` (loadable by
//! Hugging Face transformers), `optimizer.safetensors` (AdamW moments, fp32 master weights where
//! the precision keeps them), `trainer_state.json` (see [`state`]) and its checksum
//! `trainer_state.json.sha256` (see [`state_file`]). Several ranks save, instead of the two
//! tensor files, a file per rank and an index (see [`shards`]); [`export()`] writes any
//! checkpoint's weights in the Hugging Face layout.
//!
//! Saving holds the run's [`RunLock`], writes a temporary directory beside the final one, fsyncs
//! every file and the directory, renames it into place (see [`files::replace_dir`] for a step
//! saved before), then replaces the `latest` pointer by rename: a crash at any instant leaves
//! the previous checkpoint loadable, and [`recover()`] puts right what it left. Loading checks
//! presence, sizes, the run's configuration, dtypes and shapes, allocates every tensor in its
//! final place, and reads each file once straight into them while verifying its checksum; it
//! names exactly what is wrong.
//!
//! `Trainer::save_async` runs the same [`save`] on a writer thread over copies of the tensors
//! staged in host memory, so an asynchronous checkpoint is byte for byte a synchronous one and a
//! crash while it is written leaves the previous checkpoint as `latest`.

mod checksum;
mod cores;
mod export;
mod fallback;
pub mod files;
mod foreign;
mod load;
mod lock;
mod rank_reads;
mod rank_save;
mod reading;
mod recover;
pub mod shards;
pub mod state;
pub mod state_file;
pub mod tensor_hash;
#[cfg(test)]
mod testing;
mod verify;

use crate::error::{EngineError, Result};
use crate::model::LlamaConfig;
use crate::tensor::{Elem, Tensor};
pub use export::export;
pub use fallback::{load_newest, Fallback, Skipped};
use files::{rename_synced, sync_dir, write_synced};
pub use foreign::{foreign, remove_foreign, Foreign};
pub use load::{load, LoadRequest, Loaded};
pub use lock::RunLock;
pub use rank_reads::RankReads;
pub use rank_save::save_as_rank;
pub use recover::recover;
use recover::{OLD_PREFIX, PRUNED_PREFIX, TMP_PREFIX};
use safetensors::Dtype;
use sha2::{Digest, Sha256};
pub use shards::{Chunk, RankChunks, SHARDS_FILE};
use state::{FileRecord, TrainerState};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use tensor_hash::BLOCK_HASHED_FROM;
pub use verify::{verify, FileVerdict};

/// The weights file, in Hugging Face's layout.
pub const MODEL_FILE: &str = "model.safetensors";
/// The Hugging Face configuration.
pub const CONFIG_FILE: &str = "config.json";
/// AdamW state and master weights.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Step, schedule, loader, RNG, fingerprint and checksums.
pub const STATE_FILE: &str = "trainer_state.json";
/// The sha256 of `trainer_state.json`, in `sha256sum`'s format (see [`state_file`]).
pub const STATE_SUM_FILE: &str = "trainer_state.json.sha256";
/// The file in a run directory naming its newest checkpoint.
pub const LATEST_FILE: &str = "latest";
/// The file in a run directory that its writer locks (see [`RunLock`]).
pub const LOCK_FILE: &str = ".lock";

/// The directory name of the checkpoint after `step` steps.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step a checkpoint directory's name stands for, if it is a name [`step_dir_name`] writes.
pub fn step_of_dir_name(name: &str) -> Option<u64> {
    let step: u64 = name.strip_prefix("step-")?.parse().ok()?;
    (step_dir_name(step) == name).then_some(step)
}

/// One tensor to write: name, dtype, shape and raw little-endian bytes.
pub struct Entry<'a> {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Raw bytes: borrowed from a host tensor, or a copy fetched from a device.
    pub data: Cow<'a, [u8]>,
}

impl<'a> Entry<'a> {
    /// An entry for a tensor.
    pub fn tensor<E: Elem>(name: String, t: &'a Tensor<E>) -> Self {
        Entry {
            name,
            dtype: match E::DTYPE {
                crate::tensor::DType::F32 => Dtype::F32,
                crate::tensor::DType::Bf16 => Dtype::BF16,
            },
            shape: t.shape().to_vec(),
            data: Cow::Borrowed(t.as_bytes()),
        }
    }

    /// Whether every number it holds is finite (no NaN, no infinity).
    pub fn is_finite(&self) -> bool {
        match self.dtype {
            Dtype::F32 => self
                .data
                .chunks_exact(4)
                .all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite()),
            Dtype::BF16 => self
                .data
                .chunks_exact(2)
                .all(|b| half::bf16::from_le_bytes([b[0], b[1]]).is_finite()),
            _ => true,
        }
    }
}

/// sha256 over entries' names, dtypes and shapes, each followed by the sha256 of its bytes, in
/// order. The entries' bytes are hashed on every core at once, a tensor to a core, the largest
/// first (where one stream over all of them took one core).
pub fn entries_digest(entries: &[Entry<'_>]) -> String {
    let hashes = cores::map_on_cores(entries, |e| e.data.len(), |e| Sha256::digest(&e.data));
    let mut digest = EntriesDigest::default();
    for (e, hash) in entries.iter().zip(hashes) {
        digest.add(&e.name, e.dtype, &e.shape, &hash);
    }
    digest.hex()
}

/// [`entries_digest`] built up one entry at a time, for tensors read one after another.
#[derive(Default)]
struct EntriesDigest(Sha256);

impl EntriesDigest {
    /// Adds an entry by its name, dtype, shape and the sha256 of its bytes.
    fn add(&mut self, name: &str, dtype: Dtype, shape: &[usize], bytes_hash: &[u8]) {
        self.0
            .update(format!("{name}:{dtype}:{shape:?}:").as_bytes());
        self.0.update(bytes_hash);
    }

    /// The digest in lowercase hexadecimal.
    fn hex(self) -> String {
        format!("{:x}", self.0.finalize())
    }
}

/// The digests of what the checkpoint in `dir` holds on disk: [`entries_digest`] over the
/// tensors of `model.safetensors` and over those of `optimizer.safetensors`, each in the order
/// they were written (as `Trainer::state_digest` computes them over the live tensors). Reads
/// the files as they are, checking nothing else. A sharded checkpoint's digests are over its
/// whole tensors, assembled from their chunks (each chunk checked): the same as one device's.
pub fn tensor_digests(dir: &Path) -> Result<[String; 2]> {
    if dir.join(SHARDS_FILE).exists() {
        return sharded_digests(dir);
    }
    let digest = |file: &str| -> Result<String> {
        let path = dir.join(file);
        let bytes = crate::regular_file::read(&path, files::CHECKPOINT_FILE)?;
        let tensors = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| EngineError::bad_file(&path, format!("not a safetensors file: {e}")))?;
        let mut views = tensors.tensors();
        // Written back to back in entry order: their data's addresses restore the order.
        views.sort_by_key(|(_, v)| v.data().as_ptr() as usize);
        let entries: Vec<Entry<'_>> = views
            .iter()
            .map(|(name, v)| Entry {
                name: name.clone(),
                dtype: v.dtype(),
                shape: v.shape().to_vec(),
                data: Cow::Borrowed(v.data()),
            })
            .collect();
        Ok(entries_digest(&entries))
    };
    Ok([digest(MODEL_FILE)?, digest(OPTIMIZER_FILE)?])
}

/// [`tensor_digests`] of the sharded checkpoint in `dir`.
fn sharded_digests(dir: &Path) -> Result<[String; 2]> {
    let state = state_file::read(dir)?.state;
    let index = shards::read_index(dir, &state, "use an earlier checkpoint")?;
    let digest = |list: &[shards::TensorIndex]| -> Result<String> {
        let mut digest = EntriesDigest::default();
        shards::each_whole(dir, index.tensor_hash, list, |t, whole| {
            digest.add(&t.name, t.dtype, &t.shape, &Sha256::digest(whole));
            Ok(())
        })?;
        Ok(digest.hex())
    };
    Ok([digest(&index.model)?, digest(&index.optimizer)?])
}

/// Writes a safetensors file straight from tensor buffers (no staging copy), fsynced; returns
/// its record and each entry's byte range in the file.
fn write_safetensors(path: &Path, entries: &[Entry<'_>]) -> Result<(FileRecord, Vec<[u64; 2]>)> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0usize;
    for e in entries {
        let want = e.shape.iter().product::<usize>() * e.dtype.bitsize() / 8;
        if e.data.len() != want {
            return Err(EngineError::bad_file(
                path,
                format!(
                    "tensor {} has {} bytes, but its shape {:?} of {} holds {want}; nothing was written",
                    e.name,
                    e.data.len(),
                    e.shape,
                    e.dtype
                ),
            ));
        }
        let end = offset + e.data.len();
        header.insert(
            e.name.clone(),
            serde_json::json!({"dtype": e.dtype.to_string(), "shape": e.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut header = serde_json::to_vec(&header).expect("plain JSON");
    header.resize(header.len().next_multiple_of(8), b' ');
    let len = (header.len() as u64).to_le_bytes();
    let mut parts: Vec<&[u8]> = vec![&len, &header];
    parts.extend(entries.iter().map(|e| &*e.data));
    let mut at = (8 + header.len()) as u64;
    let ranges = entries
        .iter()
        .map(|e| {
            at += e.data.len() as u64;
            [at - e.data.len() as u64, at]
        })
        .collect();
    Ok((write_synced(path, &parts)?, ranges))
}

/// What a checkpoint's tensors are written from.
pub enum Tensors<'a> {
    /// Whole tensors, into `model.safetensors` (the weights the passes use, in Hugging Face
    /// names) and `optimizer.safetensors` (masters and moments): one device's layout.
    Whole {
        /// `model.safetensors` tensors.
        model: Vec<Entry<'a>>,
        /// `optimizer.safetensors` tensors.
        optimizer: Vec<Entry<'a>>,
    },
    /// Every rank's chunks, into a file per rank and the index (see [`shards`]).
    Sharded(Vec<RankChunks<'a>>),
}

impl Tensors<'_> {
    /// The tensors with their data copied, owning it: what an asynchronous save stages.
    pub fn into_owned(self) -> Tensors<'static> {
        let owned = |e: Entry<'_>| Entry {
            data: Cow::Owned(e.data.into_owned()),
            name: e.name,
            dtype: e.dtype,
            shape: e.shape,
        };
        match self {
            Tensors::Whole { model, optimizer } => Tensors::Whole {
                model: model.into_iter().map(owned).collect(),
                optimizer: optimizer.into_iter().map(owned).collect(),
            },
            Tensors::Sharded(ranks) => Tensors::Sharded(
                ranks
                    .into_iter()
                    .map(|r| RankChunks {
                        model: r.model.into_iter().map(Chunk::into_owned).collect(),
                        optimizer: r.optimizer.into_iter().map(Chunk::into_owned).collect(),
                    })
                    .collect(),
            ),
        }
    }

    /// The bytes of each tensor, or each chunk.
    pub fn sizes(&self) -> Vec<u64> {
        match self {
            Tensors::Whole { model, optimizer } => model
                .iter()
                .chain(optimizer)
                .map(|e| e.data.len() as u64)
                .collect(),
            Tensors::Sharded(ranks) => ranks
                .iter()
                .flat_map(|r| r.model.iter().chain(&r.optimizer))
                .map(|c| c.data.len() as u64)
                .collect(),
        }
    }

    /// Drops the AdamW moments (what [`crate::Fault::MomentsNotSaved`] saves).
    pub fn without_moments(&mut self) {
        let moment = |name: &str| name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq");
        match self {
            Tensors::Whole { optimizer, .. } => optimizer.retain(|e| !moment(&e.name)),
            Tensors::Sharded(ranks) => ranks
                .iter_mut()
                .for_each(|r| r.optimizer.retain(|c| !moment(&c.name))),
        }
    }
}

/// What a checkpoint holds, borrowed from a trainer.
pub struct SaveRequest<'a> {
    /// Model shape.
    pub config: &'a LlamaConfig,
    /// The tensors, whole or as the ranks' chunks.
    pub tensors: Tensors<'a>,
    /// `trainer_state.json` without `files` (filled in here).
    pub state: TrainerState,
}

/// Writes a checkpoint for `req.state.global_step` into `run_dir`, atomically, points `latest` at
/// it and keeps only the newest `keep_last` checkpoints, holding the run's [`RunLock`]
/// throughout. Returns the checkpoint's directory.
///
/// A failure once writing has begun is [`EngineError::SaveFailed`], naming the step and what
/// `latest` names after it (the previous checkpoint, unless only the cleanup after publishing
/// failed).
pub fn save(run_dir: &Path, req: SaveRequest<'_>, keep_last: Option<usize>) -> Result<PathBuf> {
    let (_lock, tmp) = begin(run_dir, &req.state)?;
    let step = req.state.global_step;
    write_and_publish(run_dir, req, keep_last, tmp.path())
        .map_err(|cause| save_failed(run_dir, step, Some(tmp.path()), cause))
}

/// What a save does before it writes: checks that `state` can be stored, takes `run_dir`'s
/// [`RunLock`], puts right what interrupted saves left ([`recover()`]), and makes the temporary
/// directory step `state.global_step`'s checkpoint is written into, which is removed when
/// dropped unless it was renamed into place.
fn begin(run_dir: &Path, state: &TrainerState) -> Result<(RunLock, tempfile::TempDir)> {
    state_file::check_storable(state)?;
    let lock = RunLock::acquire(run_dir)?;
    recover(run_dir)?;
    let step = state.global_step;
    let tmp = tempfile::Builder::new()
        .prefix(&format!("{TMP_PREFIX}{}-", step_dir_name(step)))
        .tempdir_in(run_dir)
        .map_err(|e| save_failed(run_dir, step, None, EngineError::io(run_dir, e)))?;
    Ok((lock, tmp))
}

/// [`EngineError::SaveFailed`] for step `step`'s save into `run_dir`, which failed with `cause`
/// while writing into `tmp` (removed since): the cause with the temporary copy's files named by
/// their names alone, and what `latest` names now.
fn save_failed(run_dir: &Path, step: u64, tmp: Option<&Path>, cause: EngineError) -> EngineError {
    let within = |path: &Path| {
        tmp.and_then(|t| path.strip_prefix(t).ok())
            .map(Path::to_owned)
    };
    let cause = match &cause {
        EngineError::Io { path, source } => match within(path) {
            Some(file) => format!("writing its {}: {source}", file.display()),
            None => cause.to_string(),
        },
        EngineError::BadFile { path, message } => match within(path) {
            Some(file) => format!("its {}: {message}", file.display()),
            None => cause.to_string(),
        },
        _ => cause.to_string(),
    };
    let name = step_dir_name(step);
    let pointer = run_dir.join(LATEST_FILE);
    let now = pointer
        .exists()
        .then(|| resolve(run_dir).ok())
        .flatten()
        .and_then(|dir| dir.file_name().map(|n| n.to_string_lossy().into_owned()));
    let latest = match now {
        Some(n) if n == name => format!(
            "the checkpoint was published and {} names it; only the cleanup after it failed",
            pointer.display()
        ),
        Some(n) => format!(
            "its unfinished copy was removed, and {} still names {n}, the previous checkpoint; fix the cause (free space, permissions), then resume from it",
            pointer.display()
        ),
        None => format!(
            "its unfinished copy was removed; {} holds no earlier checkpoint; fix the cause (free space, permissions) and train again",
            run_dir.display()
        ),
    };
    EngineError::SaveFailed {
        step,
        message: format!(
            "saving step {step} into {} failed: {cause}; {latest}",
            run_dir.display()
        ),
    }
}

/// The body of [`save`] once it has begun ([`begin`]): writes the checkpoint into the temporary
/// directory `tmp_path` and publishes it.
fn write_and_publish(
    run_dir: &Path,
    req: SaveRequest<'_>,
    keep_last: Option<usize>,
    tmp_path: &Path,
) -> Result<PathBuf> {
    let mut state = req.state;
    match &req.tensors {
        Tensors::Whole { model, optimizer } => {
            // The two files are written concurrently: hashing one need not wait for the other.
            let (model, optimizer) = std::thread::scope(|scope| {
                let model = scope.spawn(|| write_safetensors(&tmp_path.join(MODEL_FILE), model));
                let optimizer = write_safetensors(&tmp_path.join(OPTIMIZER_FILE), optimizer);
                (model.join().expect("writing does not panic"), optimizer)
            });
            state.files.insert(MODEL_FILE.into(), model?.0);
            state.files.insert(OPTIMIZER_FILE.into(), optimizer?.0);
        }
        Tensors::Sharded(ranks) => {
            state.format_version = state.format_version.max(BLOCK_HASHED_FROM);
            state.files.extend(shards::write(tmp_path, ranks)?);
        }
    }
    publish(run_dir, tmp_path, req.config, state, keep_last)
}

/// Completes the checkpoint whose tensor files are in the temporary directory `tmp_path` (and
/// recorded in `state`): writes its configuration and trainer state, fsyncs the directory,
/// renames it into place as step `state.global_step`'s checkpoint of `run_dir`, points `latest`
/// at it and keeps the newest `keep_last`. Returns its directory.
fn publish(
    run_dir: &Path,
    tmp_path: &Path,
    config: &LlamaConfig,
    mut state: TrainerState,
    keep_last: Option<usize>,
) -> Result<PathBuf> {
    let name = step_dir_name(state.global_step);
    let config = serde_json::to_vec_pretty(&config.to_hf_json()).expect("plain JSON");
    let record = write_synced(&tmp_path.join(CONFIG_FILE), &[&config])?;
    state.files.insert(CONFIG_FILE.into(), record);
    state_file::write(tmp_path, &state)?;
    sync_dir(tmp_path)?;

    let dest = run_dir.join(&name);
    let old = if dest.exists() {
        // Saving a step again: the new copy takes the old one's place (see `replace_dir`).
        let tmp_name = tmp_path.file_name().unwrap_or_default().to_string_lossy();
        let aside = run_dir.join(tmp_name.replacen(TMP_PREFIX, OLD_PREFIX, 1));
        Some(files::replace_dir(tmp_path, &dest, &aside, run_dir)?)
    } else {
        rename_synced(tmp_path, &dest, run_dir)?;
        None
    };
    let pointer = run_dir.join(format!(".{LATEST_FILE}.tmp"));
    write_synced(&pointer, &[format!("{name}\n").as_bytes()])?;
    rename_synced(&pointer, &run_dir.join(LATEST_FILE), run_dir)?;
    if let Some(old) = old {
        std::fs::remove_dir_all(&old).map_err(|e| EngineError::io(&old, e))?;
    }
    if let Some(keep) = keep_last {
        prune(run_dir, keep.max(1), &name)?;
    }
    Ok(dest)
}

/// The checkpoint directories of a run, oldest first.
pub fn list(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(run_dir).map_err(|e| EngineError::io(run_dir, e))?;
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
        })
        .collect();
    dirs.sort();
    Ok(dirs)
}

/// Deletes the oldest checkpoints beyond `keep`, never `latest`'s. Each is first renamed out of
/// the checkpoints' names (to `.pruned-step-N`), so a crash while its files are deleted leaves
/// no half-deleted `step-N` behind; [`recover()`] deletes what it left.
fn prune(run_dir: &Path, keep: usize, latest: &str) -> Result<()> {
    let dirs = list(run_dir)?;
    let excess = dirs.len().saturating_sub(keep);
    for dir in dirs.into_iter().take(excess) {
        let Some(name) = dir.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            continue;
        };
        if name == latest {
            continue;
        }
        let aside = run_dir.join(format!("{PRUNED_PREFIX}{name}"));
        rename_synced(&dir, &aside, run_dir)?;
        std::fs::remove_dir_all(&aside).map_err(|e| EngineError::io(&aside, e))?;
    }
    Ok(())
}

/// Refuses `path`, given to a command as a checkpoint or run directory, when nothing is there,
/// saying what to name instead.
pub fn check_named_path(path: &Path) -> Result<()> {
    let what = match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => "is not a directory",
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "does not exist",
        Err(e) => return Err(EngineError::io(path, e)),
    };
    Err(EngineError::bad_file(
        path,
        format!("{what}; name a checkpoint directory (one holding {STATE_FILE}) or a run directory (one holding {LATEST_FILE})"),
    ))
}

/// The checkpoint a path names: a checkpoint directory itself, or a run directory whose
/// `latest` file names one.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    let pointer = path.join(LATEST_FILE);
    if path.join(STATE_FILE).exists() || !pointer.exists() {
        return Ok(path.to_path_buf());
    }
    let name = crate::regular_file::read(
        &pointer,
        "a run's latest pointer, a file naming its newest checkpoint",
    )?;
    let name = String::from_utf8_lossy(&name);
    let name = name.trim();
    if step_of_dir_name(name).is_none() {
        return Err(EngineError::bad_file(
            &pointer,
            format!("names {name:?}, not a checkpoint directory of this run"),
        ));
    }
    Ok(path.join(name))
}

/// sha256 of a canonical JSON value.
pub fn fingerprint(identity: &serde_json::Value) -> String {
    files::sha256_hex(
        serde_json::to_string(identity)
            .expect("plain JSON")
            .as_bytes(),
    )
}

#[cfg(all(test, unix))]
mod tests {
    use super::testing::{environment, save_step, save_step_with};
    use super::{entries_digest, resolve, state_file, Entry, LATEST_FILE};
    use safetensors::Dtype;
    use std::borrow::Cow;
    use std::os::unix::fs::PermissionsExt;

    fn entry(name: &str, dtype: Dtype, shape: &[usize], data: &[u8]) -> Entry<'static> {
        Entry {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            data: Cow::Owned(data.to_vec()),
        }
    }

    #[test]
    fn the_entries_digest_changes_with_every_name_type_shape_and_byte() {
        let base = || {
            vec![
                entry("a", Dtype::F32, &[2], &[0; 8]),
                entry("b", Dtype::BF16, &[1, 2], &[1; 4]),
            ]
        };
        let digest = entries_digest(&base());
        assert_eq!(digest.len(), 64);
        assert!(digest.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(
            digest,
            entries_digest(&base()),
            "the same entries, the same digest"
        );
        type Change = fn(&mut Vec<Entry<'static>>);
        let changes: [(&str, Change); 5] = [
            ("name", |e| e[1].name = "c".into()),
            ("dtype", |e| e[1].dtype = Dtype::F16),
            ("shape", |e| e[1].shape = vec![2, 1]),
            ("byte", |e| e[0].data.to_mut()[7] = 1),
            ("order", |e| e.swap(0, 1)),
        ];
        for (what, change) in changes {
            let mut changed = base();
            change(&mut changed);
            assert_ne!(entries_digest(&changed), digest, "{what}");
        }
    }

    #[test]
    fn a_tensor_whose_bytes_do_not_fill_its_shape_is_refused_and_latest_stays() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        let first = save_step(&run, 1);
        let short = vec![entry("w", Dtype::F32, &[2, 2], &[0; 12])];
        let e = save_step_with(&run, 2, short).unwrap_err().to_string();
        let said = format!(
            "saving step 2 into {} failed: its model.safetensors: tensor w has 12 bytes, but its shape [2, 2] of F32 holds 16; nothing was written; its unfinished copy was removed, and {} still names step-00000001, the previous checkpoint",
            run.display(),
            run.join(LATEST_FILE).display()
        );
        assert!(e.starts_with(&said), "{e}");
        assert_eq!(resolve(&run).unwrap(), first);
        let whole = vec![entry("w", Dtype::F32, &[2, 2], &[0; 16])];
        assert!(save_step_with(&run, 2, whole).is_ok());
    }

    #[test]
    fn a_path_resolves_to_itself_unless_only_its_latest_names_a_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        let saved = save_step(&run, 2);
        assert_eq!(resolve(&run).unwrap(), saved, "a run directory: its latest");
        assert_eq!(resolve(&saved).unwrap(), saved, "a checkpoint: itself");
        std::fs::write(saved.join(LATEST_FILE), "elsewhere").unwrap();
        assert_eq!(
            resolve(&saved).unwrap(),
            saved,
            "a checkpoint's stray latest is ignored"
        );
        let empty = tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        assert_eq!(
            resolve(&empty).unwrap(),
            empty,
            "neither: itself, for load to refuse"
        );
        for name in ["", "../elsewhere", "..", ".", "step-2", "step-00000002/.."] {
            std::fs::write(run.join(LATEST_FILE), name).unwrap();
            let e = resolve(&run).unwrap_err().to_string();
            assert!(
                e.ends_with("not a checkpoint directory of this run"),
                "{name:?}: {e}"
            );
        }
    }

    #[test]
    fn the_execution_record_reads_back_from_a_saved_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let saved = save_step(&tmp.path().join("run"), 1);
        let state = state_file::read(&saved).unwrap().state;
        assert_eq!(state.environment, Some(environment()));
    }

    #[test]
    fn a_state_written_before_the_execution_record_reads_without_one() {
        let frozen = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../golden/checkpoints/llama-fp32/step-00000004");
        let text = std::fs::read_to_string(frozen.join(super::STATE_FILE)).unwrap();
        assert!(!text.contains("environment"), "written before it was kept");
        let read = state_file::read(&frozen).unwrap();
        assert!(read.protected);
        assert_eq!(read.state.environment, None);
    }

    #[test]
    fn a_checkpoint_directory_is_created_as_any_other() {
        let tmp = tempfile::tempdir().unwrap();
        let plain = tmp.path().join("plain");
        std::fs::create_dir(&plain).unwrap();
        let saved = save_step(&tmp.path().join("run"), 1);
        let mode = |p: &std::path::Path| p.metadata().unwrap().permissions().mode();
        assert_eq!(mode(&saved), mode(&plain));
    }
}
