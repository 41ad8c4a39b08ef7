//! Checkpoints of another run configuration in a run directory: found before training into it,
//! deleted only when asked, so that one run directory never mixes two runs.

use super::state::{comparable, first_difference};
use super::{files, list, resolve, state_file, RunLock, LATEST_FILE};
use crate::error::{EngineError, Result};
use std::path::{Path, PathBuf};

/// A checkpoint saved by another run configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Foreign {
    /// Its directory.
    pub dir: PathBuf,
    /// The first difference, as `key: checkpoint's vs the run's`.
    pub difference: String,
}

/// The checkpoints of `run_dir` whose configuration differs from `identity` (see
/// [`crate::TrainConfig::identity`]), oldest first. A checkpoint whose state cannot be read is
/// not counted: nothing says whose it is.
pub fn foreign(run_dir: &Path, identity: &serde_json::Value) -> Result<Vec<Foreign>> {
    if !run_dir.is_dir() {
        return Ok(Vec::new());
    }
    Ok(list(run_dir)?
        .into_iter()
        .filter_map(|dir| {
            let state = state_file::read(&dir).ok()?.state;
            let (recorded, current) = comparable(&state.identity, identity);
            let difference = first_difference(&recorded, &current, "")?;
            Some(Foreign { dir, difference })
        })
        .collect())
}

/// Deletes `checkpoints` of `run_dir`, holding its lock. When `latest` names one of them it is
/// deleted first, so that it never names a missing checkpoint.
pub fn remove_foreign(run_dir: &Path, checkpoints: &[Foreign]) -> Result<()> {
    let _lock = RunLock::acquire(run_dir)?;
    let pointer = run_dir.join(LATEST_FILE);
    let named = pointer.exists().then(|| resolve(run_dir));
    if named.is_some_and(|dir| dir.is_ok_and(|dir| checkpoints.iter().any(|c| c.dir == dir))) {
        std::fs::remove_file(&pointer).map_err(|e| EngineError::io(&pointer, e))?;
        files::sync_dir(run_dir)?;
    }
    for c in checkpoints {
        std::fs::remove_dir_all(&c.dir).map_err(|e| EngineError::io(&c.dir, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testing::save_step;
    use super::*;

    fn named(dir: &Path) -> Foreign {
        Foreign {
            dir: dir.to_path_buf(),
            difference: "model: a vs b".into(),
        }
    }

    #[test]
    fn latest_goes_only_when_it_names_a_deleted_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        let older = save_step(&run, 1);
        let newer = save_step(&run, 2);
        remove_foreign(&run, &[named(&older)]).unwrap();
        assert!(!older.exists());
        assert_eq!(
            resolve(&run).unwrap(),
            newer,
            "latest names a kept checkpoint"
        );
        remove_foreign(&run, &[named(&newer)]).unwrap();
        assert!(!newer.exists());
        assert!(
            !run.join(LATEST_FILE).exists(),
            "latest named the deleted one"
        );
    }
}
