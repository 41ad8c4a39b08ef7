//! Resuming a run whose `latest` is broken: the newest checkpoint that loads, and what was
//! skipped on the way.

use super::load::check_identity;
use super::state_file::{self, StateError};
use super::{list, resolve, LATEST_FILE, STATE_FILE};
use crate::error::{EngineError, Result};
use std::path::{Path, PathBuf};

/// A checkpoint (or a run's `latest` pointer) passed over because it is damaged.
#[derive(Debug)]
pub struct Skipped {
    /// The checkpoint directory or pointer.
    pub path: PathBuf,
    /// Why it was skipped; it names the file at fault.
    pub error: EngineError,
}

/// What [`load_newest`] loaded, from which checkpoint, and what it skipped first.
#[derive(Debug)]
pub struct Fallback<T> {
    /// What the loader returned.
    pub value: T,
    /// The checkpoint it was loaded from.
    pub dir: PathBuf,
    /// The damaged checkpoints tried before it, newest first; empty when `latest` loaded.
    pub skipped: Vec<Skipped>,
}

/// Loads with `load` the checkpoint `path` names. A checkpoint directory is loaded as it is,
/// and its errors returned. For a run directory, `latest`'s checkpoint is tried first, then the
/// others, newest first: one that is damaged (missing, unreadable, failing a check) is skipped,
/// and the first that loads is returned with the list of those skipped. A checkpoint of another
/// run configuration, or of a newer build, ends the search with its error: it is not damage.
pub fn load_newest<T>(
    path: &Path,
    identity: &serde_json::Value,
    mut load: impl FnMut(&Path) -> Result<T>,
) -> Result<Fallback<T>> {
    let pointer = path.join(LATEST_FILE);
    let steps = list(path).unwrap_or_default();
    if path.join(STATE_FILE).exists() || (!pointer.exists() && steps.is_empty()) {
        let value = load(path)?;
        return Ok(Fallback {
            value,
            dir: path.to_path_buf(),
            skipped: Vec::new(),
        });
    }
    let mut skipped = Vec::new();
    let mut candidates = Vec::new();
    match pointer.exists().then(|| resolve(path)) {
        Some(Ok(dir)) => candidates.push(dir),
        Some(Err(error)) => skipped.push(Skipped {
            path: pointer,
            error,
        }),
        None => skipped.push(Skipped {
            error: EngineError::bad_file(&pointer, "is missing"),
            path: pointer,
        }),
    }
    for dir in steps.into_iter().rev() {
        if !candidates.contains(&dir) {
            candidates.push(dir);
        }
    }
    for dir in candidates {
        match state_file::read(&dir) {
            Ok(state) => check_identity(&dir, &state.state, identity)?,
            Err(StateError::Newer(e)) => return Err(e),
            Err(StateError::Damaged(_)) => {}
        }
        match load(&dir) {
            Ok(value) => {
                return Ok(Fallback {
                    value,
                    dir,
                    skipped,
                })
            }
            Err(error @ (EngineError::Io { .. } | EngineError::BadFile { .. })) => {
                skipped.push(Skipped { path: dir, error })
            }
            Err(e) => return Err(e),
        }
    }
    let reasons: Vec<String> = skipped.iter().map(|s| s.error.to_string()).collect();
    Err(EngineError::bad_file(
        path,
        format!(
            "no checkpoint of this run loads ({}); resume from another run or train from scratch",
            reasons.join("; ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::super::testing::save_step;
    use super::*;

    /// The step of the newest checkpoint of `path` that loads for `identity`, and the paths
    /// skipped.
    fn newest(path: &Path, identity: &serde_json::Value) -> Result<(u64, Vec<PathBuf>)> {
        let found = load_newest(path, identity, |dir| {
            Ok(state_file::read(dir)?.state.global_step)
        })?;
        let skipped = found.skipped.into_iter().map(|s| s.path).collect();
        Ok((found.value, skipped))
    }

    #[test]
    fn damaged_checkpoints_are_skipped_and_another_configuration_stops_the_search() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path();
        let dirs: Vec<PathBuf> = (1..=3).map(|step| save_step(run, step)).collect();
        let identity = state_file::read(&dirs[0]).unwrap().state.identity;
        assert_eq!(newest(run, &identity).unwrap(), (3, vec![]));

        std::fs::write(dirs[2].join(STATE_FILE), "{}").unwrap();
        assert_eq!(newest(run, &identity).unwrap(), (2, vec![dirs[2].clone()]));
        // A checkpoint named explicitly is loaded as it is.
        assert!(newest(&dirs[2], &identity).is_err());

        std::fs::remove_file(run.join(LATEST_FILE)).unwrap();
        let pointer = run.join(LATEST_FILE);
        assert_eq!(
            newest(run, &identity).unwrap(),
            (2, vec![pointer, dirs[2].clone()])
        );

        let other = serde_json::json!({"model": "another"});
        let err = newest(run, &other).unwrap_err().to_string();
        assert!(err.contains("another run configuration"), "{err}");
    }

    #[test]
    fn a_directory_without_checkpoints_or_latest_is_loaded_as_it_is() {
        let tmp = tempfile::tempdir().unwrap();
        let mut tried = Vec::new();
        let err = load_newest(tmp.path(), &serde_json::json!({}), |dir| -> Result<()> {
            tried.push(dir.to_path_buf());
            Err(EngineError::bad_file(dir, "is not a checkpoint directory"))
        })
        .unwrap_err();
        assert_eq!(tried, [tmp.path()], "the loader's own error, not a search");
        assert!(
            err.to_string().ends_with("is not a checkpoint directory"),
            "{err}"
        );
    }
}
