//! What interrupted saves leave in a run directory, and how it is put right.
//!
//! A save writes `.tmp-step-N-…` and renames it into place; where a step is saved again and the
//! directories cannot be exchanged atomically, the old `step-N` is first renamed to
//! `.old-step-N-…`. A crash can leave either behind. Recovery never deletes the only complete
//! copy of a step: a copy that verifies is moved back to `step-N` when that is missing, deleted
//! when `step-N` verifies too, and otherwise kept; a copy that does not verify is unfinished
//! and deleted. `.old-` copies are looked at first, so a step that has both gets back the copy
//! `latest` named when it was published. A `.pruned-step-N` directory is a checkpoint that
//! `keep_last` was deleting: it is deleted.

use super::{verify, RunLock};
use crate::error::{EngineError, Result};
use std::path::{Path, PathBuf};

/// Prefix of the directory a save is written into.
pub(crate) const TMP_PREFIX: &str = ".tmp-";
/// Prefix of the old copy of a step saved again, while its new copy is renamed into place.
pub(crate) const OLD_PREFIX: &str = ".old-";
/// Prefix of a checkpoint `keep_last` is deleting.
pub(crate) const PRUNED_PREFIX: &str = ".pruned-";

/// Puts right what interrupted saves left in `run_dir`, holding its lock; returns one line per
/// copy restored, deleted or kept.
pub fn recover(run_dir: &Path) -> Result<Vec<String>> {
    if !run_dir.is_dir() {
        return Ok(Vec::new());
    }
    let _lock = RunLock::acquire(run_dir)?;
    let mut notes = Vec::new();
    for pruned in pruned(run_dir)? {
        remove(&pruned)?;
        notes.push(format!(
            "removed {}, a checkpoint keep_last was deleting",
            pruned.display()
        ));
    }
    for (copy, step) in leftovers(run_dir)? {
        let shown = copy.display();
        let dest = step.map(|s| run_dir.join(s));
        if !verify::intact(&copy) {
            remove(&copy)?;
            notes.push(format!("removed {shown}, an unfinished save"));
        } else if let Some(dest) = dest.as_ref().filter(|d| !d.exists()) {
            super::files::rename_synced(&copy, dest, run_dir)?;
            notes.push(format!(
                "restored {} from {shown}, left by an interrupted save",
                dest.display()
            ));
        } else if dest.as_deref().is_some_and(verify::intact) {
            remove(&copy)?;
            notes.push(format!("removed {shown}, a copy of an intact checkpoint"));
        } else {
            notes.push(format!(
                "kept {shown}: it is a complete checkpoint, and the directory it was saved for is damaged; keep whichever you need and delete the other"
            ));
        }
    }
    Ok(notes)
}

/// The copies interrupted saves left in `run_dir`, `.old-` ones first, each with the step
/// directory it belongs to when its name says.
fn leftovers(run_dir: &Path) -> Result<Vec<(PathBuf, Option<String>)>> {
    let entries = std::fs::read_dir(run_dir).map_err(|e| EngineError::io(run_dir, e))?;
    let mut found: Vec<(bool, PathBuf, Option<String>)> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let (is_tmp, rest) =
                match (name.strip_prefix(TMP_PREFIX), name.strip_prefix(OLD_PREFIX)) {
                    (Some(rest), _) => (true, rest),
                    (_, Some(rest)) => (false, rest),
                    _ => return None,
                };
            Some((is_tmp, e.path(), step_of(rest)))
        })
        .collect();
    found.sort();
    Ok(found
        .into_iter()
        .map(|(_, path, step)| (path, step))
        .collect())
}

/// The checkpoints `keep_last` was deleting when a crash stopped it.
fn pruned(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(run_dir).map_err(|e| EngineError::io(run_dir, e))?;
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(PRUNED_PREFIX))
        .map(|e| e.path())
        .collect();
    found.sort();
    Ok(found)
}

/// The step directory name `rest` (a copy's name after its prefix) begins with.
fn step_of(rest: &str) -> Option<String> {
    let step = rest.get(..13)?;
    let digits = step.strip_prefix("step-")?;
    digits
        .bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| step.to_string())
}

fn remove(dir: &Path) -> Result<()> {
    std::fs::remove_dir_all(dir).map_err(|e| EngineError::io(dir, e))
}

#[cfg(test)]
mod tests {
    use super::super::testing::save_step;
    use super::super::{MODEL_FILE, STATE_FILE};
    use super::*;

    fn copy_dir(from: &Path, to: &Path) {
        std::fs::create_dir(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }

    #[test]
    fn the_only_complete_copy_of_a_step_is_never_deleted() {
        let run = tempfile::tempdir().unwrap();
        let run = run.path();
        let (one, two, three) = (save_step(run, 1), save_step(run, 2), save_step(run, 3));
        // Step 1: moved aside and copied, as an interrupted save again left it.
        let old_one = run.join(".old-step-00000001-7");
        std::fs::rename(&one, &old_one).unwrap();
        copy_dir(&old_one, &run.join(".tmp-step-00000001-8"));
        // Step 2: an unfinished copy beside an intact directory.
        let tmp_two = run.join(".tmp-step-00000002-9");
        std::fs::create_dir(&tmp_two).unwrap();
        std::fs::copy(two.join(MODEL_FILE), tmp_two.join(MODEL_FILE)).unwrap();
        // Step 3: a complete copy beside a damaged directory.
        let tmp_three = run.join(".tmp-step-00000003-a");
        copy_dir(&three, &tmp_three);
        std::fs::write(three.join(STATE_FILE), "{}").unwrap();

        let notes = recover(run).unwrap();
        assert_eq!(notes.len(), 4, "{notes:?}");
        assert!(verify::intact(&one), "{notes:?}");
        assert!(!old_one.exists() && !tmp_two.exists());
        assert!(!run.join(".tmp-step-00000001-8").exists());
        assert!(verify::intact(&tmp_three), "{notes:?}");
        assert!(notes[3].starts_with("kept"), "{notes:?}");
        // Saving again recovers nothing more and keeps the copy.
        save_step(run, 4);
        assert!(verify::intact(&tmp_three));
    }

    #[test]
    fn a_checkpoint_left_half_pruned_is_deleted() {
        let run = tempfile::tempdir().unwrap();
        let run = run.path();
        let one = save_step(run, 1);
        let aside = run.join(format!("{PRUNED_PREFIX}step-00000001"));
        std::fs::rename(&one, &aside).unwrap();
        std::fs::remove_file(aside.join(MODEL_FILE)).unwrap();
        let notes = recover(run).unwrap();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("keep_last was deleting"), "{notes:?}");
        assert!(!aside.exists());
    }

    #[test]
    fn a_copy_names_its_step() {
        assert_eq!(
            step_of("step-00000008-4242").as_deref(),
            Some("step-00000008")
        );
        assert_eq!(
            step_of("step-00000012-a1B2c3").as_deref(),
            Some("step-00000012")
        );
        for rest in ["", "step-0000008", "step-0000000x-1", "other-00000008"] {
            assert_eq!(step_of(rest), None, "{rest}");
        }
    }
}
