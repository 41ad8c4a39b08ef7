//! A full check of a checkpoint's files without a run configuration: what
//! `ckpt-harness verify` reports. The state file is checked against its sidecar, every other
//! file against the size and checksums the state records (XXH3-128; sha256 too in checkpoints
//! of format version 3 and older; loading checks only the XXH3), each file's sha256 computed
//! on demand and reported for checking against `sha256sum`,
//! and a sharded checkpoint's index against its chunks: each chunk's hash, and each tensor
//! assembled whole against its own.

use super::checksum::SEGMENT;
use super::files::{self, MappedFile};
use super::state::TrainerState;
use super::state_file::{self, StateError};
use super::{list, resolve, shards, LATEST_FILE, SHARDS_FILE, STATE_FILE, STATE_SUM_FILE};
use crate::error::{EngineError, Result};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};

/// What [`verify`] found of one file of a checkpoint, or of a run's `latest` pointer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileVerdict {
    /// The file's name in the checkpoint (or `latest`).
    pub name: String,
    /// Its size: as recorded for the files the state lists, as found for the others.
    pub bytes: u64,
    /// What is wrong with it; `None` when it is intact.
    pub problem: Option<String>,
    /// What to know about an intact file: a state file written before it had a checksum.
    pub note: Option<String>,
    /// The sha256 of an intact file as read now (what `sha256sum` prints); `None` for the state
    /// file (its sidecar holds it) and for a damaged file.
    pub sha256: Option<String>,
}

impl FileVerdict {
    fn new(name: &str, bytes: u64, problem: Option<String>) -> Self {
        FileVerdict {
            name: name.to_string(),
            bytes,
            problem,
            note: None,
            sha256: None,
        }
    }
}

/// Checks the checkpoint at `path`, or the one a run directory's `latest` names: its state file
/// against its sidecar, then every file the state lists: that it exists, has its recorded size,
/// sha256 and XXH3-128, and, for a safetensors file, a valid header. Returns the checkpoint's
/// directory and a verdict per file; a broken `latest` is a verdict on it, with the run
/// directory. An error means there is nothing this build can verify at `path`: it does not
/// exist, is neither a checkpoint nor a run directory, or was written by a newer build.
pub fn verify(path: &Path) -> Result<(PathBuf, Vec<FileVerdict>)> {
    super::check_named_path(path)?;
    let dir = match checkpoint_of(path)? {
        Ok(dir) => dir,
        Err(problem) => {
            let bytes = size(&path.join(LATEST_FILE));
            let verdict = FileVerdict::new(LATEST_FILE, bytes, Some(problem));
            return Ok((path.to_path_buf(), vec![verdict]));
        }
    };
    let state = match state_file::read(&dir) {
        Ok(state) => state,
        Err(StateError::Newer(e)) => return Err(e),
        Err(StateError::Damaged(e)) => {
            let bytes = size(&dir.join(STATE_FILE));
            return Ok((
                dir,
                vec![FileVerdict::new(STATE_FILE, bytes, Some(e.to_string()))],
            ));
        }
    };
    let mut verdicts = vec![FileVerdict {
        note: (!state.protected).then(|| {
            format!("unprotected: written without {STATE_SUM_FILE} (format version 1), so changes to it go undetected")
        }),
        ..FileVerdict::new(STATE_FILE, state.bytes, None)
    }];
    verdicts.extend(state.state.files.iter().map(|(name, record)| {
        let checked = problem(&dir, name, record);
        FileVerdict {
            sha256: checked.as_ref().ok().cloned(),
            ..FileVerdict::new(name, record.bytes, checked.err())
        }
    }));
    let intact_files = verdicts.iter().all(|v| v.problem.is_none());
    if let Some(index) = verdicts.iter_mut().find(|v| v.name == SHARDS_FILE) {
        if intact_files {
            index.problem = shard_problem(&dir, &state.state).err();
        }
    }
    Ok((dir, verdicts))
}

/// Whether the checkpoint at `dir` verifies: its state file and every file it lists intact.
pub(crate) fn intact(dir: &Path) -> bool {
    verify(dir).is_ok_and(|(_, verdicts)| verdicts.iter().all(|v| v.problem.is_none()))
}

/// The checkpoint directory `path` names, or what is wrong with a run directory's `latest`.
fn checkpoint_of(path: &Path) -> Result<std::result::Result<PathBuf, String>> {
    let in_checkpoint = [
        STATE_FILE,
        STATE_SUM_FILE,
        super::MODEL_FILE,
        super::OPTIMIZER_FILE,
        super::CONFIG_FILE,
    ];
    if in_checkpoint.iter().any(|name| path.join(name).exists()) {
        return Ok(Ok(path.to_path_buf()));
    }
    if path.join(LATEST_FILE).exists() {
        return Ok(match resolve(path) {
            Ok(dir) if dir.is_dir() => Ok(dir),
            Ok(dir) => Err(format!(
                "names {}, which does not exist; `train --resume` falls back to the newest checkpoint that loads",
                dir.file_name().unwrap_or_default().to_string_lossy()
            )),
            Err(e) => Err(e.to_string()),
        });
    }
    if !list(path)?.is_empty() {
        return Ok(Err(
            "is missing; verify the run's checkpoint directories one by one".into(),
        ));
    }
    Err(EngineError::bad_file(
        path,
        format!("is neither a checkpoint (no {STATE_FILE}) nor a run directory (no {LATEST_FILE}); nothing to verify"),
    ))
}

/// The first thing wrong with the index of the sharded checkpoint in `dir`, whose files are
/// intact, as `Err`: chunks that do not tile their tensors, or a tensor assembled from its
/// chunks that is not the tensor saved.
fn shard_problem(dir: &Path, state: &TrainerState) -> std::result::Result<(), String> {
    let index =
        shards::read_index(dir, state, "use an earlier checkpoint").map_err(|e| e.to_string())?;
    for list in [&index.model, &index.optimizer] {
        shards::each_whole(dir, index.tensor_hash, list, |_, _| Ok(()))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The size of the file at `path`, 0 if it cannot be read.
fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// The first thing wrong with file `name` of `dir`, as `Err`; its sha256 when it is intact.
fn problem(
    dir: &Path,
    name: &str,
    record: &super::FileRecord,
) -> std::result::Result<String, String> {
    if name.contains('/') || name.starts_with('.') || [STATE_FILE, STATE_SUM_FILE].contains(&name) {
        return Err(format!("{STATE_FILE} lists an invalid file name {name:?}"));
    }
    let path = dir.join(name);
    let len = crate::regular_file::len(&path, files::CHECKPOINT_FILE).map_err(|e| e.to_string())?;
    if len != record.bytes {
        return Err(format!(
            "is {len} bytes, {} were written (truncated or replaced)",
            record.bytes
        ));
    }
    let segment_bytes = record.segments.as_ref().map_or(SEGMENT, |s| s.bytes.max(1));
    let found = files::checksums(&path, segment_bytes).map_err(|e| e.to_string())?;
    if found.bytes != record.bytes {
        return Err(format!(
            "is {} bytes, {} were written (it changed while it was read)",
            found.bytes, record.bytes
        ));
    }
    if record.sha256.is_none() && record.xxh3_128.is_none() && record.segments.is_none() {
        return Err(format!(
            "has no recorded checksum in {STATE_FILE} (it was edited); its content cannot be checked"
        ));
    }
    if let Some(want) = &record.sha256 {
        if found.sha256.as_ref() != Some(want) {
            return Err(format!(
                "sha256 {} differs from the recorded {want}",
                found.sha256.unwrap_or_default()
            ));
        }
    }
    if let Some(want) = &record.xxh3_128 {
        if found.xxh3_128.as_ref() != Some(want) {
            return Err(format!(
                "XXH3-128 {} differs from the recorded {want}",
                found.xxh3_128.unwrap_or_default()
            ));
        }
    }
    if let (Some(recorded), Some(found)) = (&record.segments, &found.segments) {
        let size = recorded.bytes;
        if size == 0 || recorded.xxh3_128.len() != found.xxh3_128.len() {
            return Err(format!(
                "has {} segments of {size} bytes, its record lists {} (the record was edited)",
                found.xxh3_128.len(),
                recorded.xxh3_128.len()
            ));
        }
        let pairs = recorded.xxh3_128.iter().zip(&found.xxh3_128);
        if let Some((i, (want, got))) = pairs.enumerate().find(|(_, (w, f))| w != f) {
            let start = i as u64 * size;
            let end = (start + size).min(record.bytes);
            return Err(format!(
                "segment {i} (bytes {start}..{end}): XXH3-128 {got} differs from the recorded {want}"
            ));
        }
    }
    if name.ends_with(".safetensors") {
        let map = MappedFile::open(&path).map_err(|e| e.to_string())?;
        SafeTensors::read_metadata(map.bytes())
            .map_err(|e| format!("not a valid safetensors file: {e}"))?;
    }
    Ok(found.sha256.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::super::testing::save_step;
    use super::super::FileRecord;
    use super::*;

    /// The one verdict `verify` gives on the run directory `run`.
    fn on_latest(run: &Path) -> FileVerdict {
        let (dir, mut verdicts) = verify(run).unwrap();
        assert_eq!((dir.as_path(), verdicts.len()), (run, 1));
        verdicts.remove(0)
    }

    #[test]
    fn a_latest_naming_a_missing_checkpoint_or_none_is_a_verdict_on_it() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        save_step(&run, 1);
        std::fs::write(run.join(LATEST_FILE), "step-00000009").unwrap();
        let v = on_latest(&run);
        assert_eq!((v.name.as_str(), v.bytes), (LATEST_FILE, 13));
        assert!(v
            .problem
            .unwrap()
            .starts_with("names step-00000009, which does not exist"));
        std::fs::remove_file(run.join(LATEST_FILE)).unwrap();
        let v = on_latest(&run);
        assert_eq!(
            (v.bytes, v.problem.as_deref()),
            (
                0,
                Some("is missing; verify the run's checkpoint directories one by one")
            )
        );
        let empty = tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        assert!(verify(&empty)
            .unwrap_err()
            .to_string()
            .contains("nothing to verify"));
        let gone = tmp.path().join("gone");
        assert_eq!(
            verify(&gone).unwrap_err().to_string(),
            format!("{}: does not exist; name a checkpoint directory (one holding {STATE_FILE}) or a run directory (one holding {LATEST_FILE})", gone.display())
        );
    }

    #[test]
    fn every_file_is_reported_with_its_size_and_an_outside_name_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_step(tmp.path(), 1);
        let (_, verdicts) = verify(&dir).unwrap();
        for v in &verdicts {
            assert_eq!(v.problem, None, "{}", v.name);
            if v.name != STATE_FILE {
                let bytes = std::fs::read(dir.join(&v.name)).unwrap();
                assert_eq!(v.sha256, Some(files::sha256_hex(&bytes)), "{}", v.name);
            }
            assert_eq!(v.bytes, size(&dir.join(&v.name)), "{}", v.name);
            assert!(v.bytes > 1, "{}", v.name);
        }
        let record = FileRecord {
            bytes: 1,
            sha256: None,
            xxh3_128: None,
            segments: None,
        };
        let real = FileRecord {
            bytes: size(&dir.join(super::super::MODEL_FILE)),
            ..record.clone()
        };
        let e = problem(&dir, super::super::MODEL_FILE, &real).unwrap_err();
        assert!(e.starts_with("has no recorded checksum"), "{e}");
        for name in ["sub/model.safetensors", ".hidden", STATE_SUM_FILE] {
            let e = problem(&dir, name, &record).unwrap_err();
            assert_eq!(
                e,
                format!("{STATE_FILE} lists an invalid file name {name:?}")
            );
        }
    }

    #[test]
    fn a_damaged_segment_is_named_with_its_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_step(tmp.path(), 1);
        let name = super::super::CONFIG_FILE;
        let path = dir.join(name);
        let record = files::checksums(&path, 16).unwrap();
        let record = FileRecord {
            sha256: None,
            xxh3_128: None,
            ..record
        };
        assert!(record.segments.as_ref().unwrap().xxh3_128.len() > 3);
        assert!(problem(&dir, name, &record).is_ok());
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[40] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let e = problem(&dir, name, &record).unwrap_err();
        assert!(e.starts_with("segment 2 (bytes 32..48): XXH3-128 "), "{e}");
        let mut edited = record;
        edited.segments.as_mut().unwrap().xxh3_128.pop();
        let e = problem(&dir, name, &edited).unwrap_err();
        assert!(e.contains("(the record was edited)"), "{e}");
    }
}
