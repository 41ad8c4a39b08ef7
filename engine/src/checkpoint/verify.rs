//! A full check of a checkpoint's files against `trainer_state.json`, without a run
//! configuration: what `ckpt-harness verify` reports. Loading checks each file's XXH3-128; this
//! also recomputes its sha256, the checksum standard tools print.

use super::files::{self, MappedFile};
use super::{read_state, resolve, STATE_FILE};
use crate::error::Result;
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};

/// What [`verify`] found of one file of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileVerdict {
    /// The file's name in the checkpoint.
    pub name: String,
    /// Its size as recorded.
    pub bytes: u64,
    /// What is wrong with it; `None` when it is intact.
    pub problem: Option<String>,
}

/// Checks every file `trainer_state.json` of the checkpoint at `path` (or the `latest` of a run
/// directory) lists: that it exists, has its recorded size, sha256 and XXH3-128, and, for a
/// safetensors file, a valid header. Returns the checkpoint's directory and a verdict per file;
/// an unreadable or newer-format `trainer_state.json` is an error.
pub fn verify(path: &Path) -> Result<(PathBuf, Vec<FileVerdict>)> {
    let dir = resolve(path)?;
    let state = read_state(&dir)?;
    let verdicts = state
        .files
        .iter()
        .map(|(name, record)| FileVerdict {
            name: name.clone(),
            bytes: record.bytes,
            problem: problem(&dir, name, record).err(),
        })
        .collect();
    Ok((dir, verdicts))
}

/// The first thing wrong with file `name` of `dir`, as `Err`.
fn problem(dir: &Path, name: &str, record: &super::FileRecord) -> std::result::Result<(), String> {
    if name.contains('/') || name.starts_with('.') || name == STATE_FILE {
        return Err(format!("{STATE_FILE} lists an invalid file name {name:?}"));
    }
    let path = dir.join(name);
    let found = files::checksums(&path).map_err(|e| e.to_string())?;
    if found.bytes != record.bytes {
        return Err(format!(
            "is {} bytes, {} were written (truncated or replaced)",
            found.bytes, record.bytes
        ));
    }
    if found.sha256 != record.sha256 {
        return Err(format!(
            "sha256 {} differs from the recorded {}",
            found.sha256, record.sha256
        ));
    }
    if let Some(want) = &record.xxh3_128 {
        if found.xxh3_128.as_ref() != Some(want) {
            return Err(format!(
                "XXH3-128 {} differs from the recorded {want}",
                found.xxh3_128.unwrap_or_default()
            ));
        }
    }
    if name.ends_with(".safetensors") {
        let map = MappedFile::open(&path).map_err(|e| e.to_string())?;
        SafeTensors::read_metadata(map.bytes())
            .map_err(|e| format!("not a valid safetensors file: {e}"))?;
    }
    Ok(())
}
