//! `trainer_state.json` on disk: written with a checksum beside it, read back with that checksum
//! checked, and refused at save when its own loader would not read it back.
//!
//! The state file records every other file's size and checksums, so it protects them; the
//! sidecar `trainer_state.json.sha256` protects the state file itself. The sidecar is one line in
//! `sha256sum`'s format, so `sha256sum -c trainer_state.json.sha256` checks it with standard
//! tools. Checkpoints of format version 1 were written without it: they still load, and
//! [`super::verify()`] reports their state file as unprotected. From version 2 on a missing sidecar
//! is damage.

use super::files::{sha256_hex, write_synced, CHECKPOINT_FILE};
use super::state::{child_path, TrainerState, VersionProbe, FORMAT_VERSION};
use super::{STATE_FILE, STATE_SUM_FILE};
use crate::error::EngineError;
use crate::regular_file;
use std::path::Path;

/// The first format version whose checkpoints carry the sidecar.
const SIDECAR_SINCE: u32 = 2;

/// Fields of the trainer state that no build writing format version 1 knew: a version-1 state
/// file holding one had its version edited down, which would bypass the sidecar.
const NEWER_THAN_SIDECAR: [&str; 1] = ["environment"];

/// A checkpoint's trainer state, read and checked.
pub struct StateFile {
    /// The state.
    pub state: TrainerState,
    /// Whether the sidecar's checksum vouched for it (false for format version 1 checkpoints).
    pub protected: bool,
    /// The state file's size in bytes.
    pub bytes: u64,
}

/// Why a checkpoint's trainer state cannot be used.
#[derive(Debug)]
pub enum StateError {
    /// Written by a newer build: not known to be damaged, but this build cannot read it.
    Newer(EngineError),
    /// Missing, unreadable, changed since it was written, or not a trainer state.
    Damaged(EngineError),
}

impl From<StateError> for EngineError {
    fn from(e: StateError) -> Self {
        match e {
            StateError::Newer(e) | StateError::Damaged(e) => e,
        }
    }
}

fn damaged(path: &Path, message: String) -> StateError {
    StateError::Damaged(EngineError::bad_file(path, message))
}

/// Reads the trainer state of the checkpoint at `dir`: its checksum checked against the sidecar
/// first (so damage is named as such), then its format version, then its content.
pub fn read(dir: &Path) -> Result<StateFile, StateError> {
    if !dir.is_dir() {
        return Err(damaged(dir, "is not a checkpoint directory".into()));
    }
    let path = dir.join(STATE_FILE);
    let bytes = regular_file::read(&path, CHECKPOINT_FILE).map_err(StateError::Damaged)?;
    let recorded = read_sidecar(dir)?;
    if let Some(want) = &recorded {
        let found = sha256_hex(&bytes);
        if found != *want {
            return Err(damaged(
                &path,
                format!("sha256 {found} differs from {want} recorded in {STATE_SUM_FILE}: the file is damaged or was edited after it was written; restore it or resume from an earlier checkpoint"),
            ));
        }
    }
    let probe: VersionProbe = serde_json::from_slice(&bytes).map_err(|e| {
        damaged(
            &path,
            format!("not a trainer state ({e}); the file is damaged"),
        )
    })?;
    if probe.format_version > FORMAT_VERSION {
        return Err(StateError::Newer(EngineError::bad_file(
            &path,
            format!(
                "format version {} was written by a newer ckpt-harness; this build reads up to version {FORMAT_VERSION}; upgrade to load it",
                probe.format_version
            ),
        )));
    }
    if recorded.is_none() && probe.format_version >= SIDECAR_SINCE {
        return Err(damaged(
            &dir.join(STATE_SUM_FILE),
            format!("is missing: a checkpoint of format version {} keeps {STATE_FILE}'s checksum in it; restore it or resume from an earlier checkpoint", probe.format_version),
        ));
    }
    if probe.format_version < SIDECAR_SINCE {
        let fields: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| damaged(&path, format!("{e}; the file is damaged")))?;
        if let Some(field) = NEWER_THAN_SIDECAR.iter().find(|f| fields.get(f).is_some()) {
            return Err(damaged(
                &path,
                format!("says format version {} but holds `{field}`, which that version never had: its version was edited, and {STATE_SUM_FILE} with it; restore it or resume from an earlier checkpoint", probe.format_version),
            ));
        }
    }
    let state = serde_json::from_slice(&bytes)
        .map_err(|e| damaged(&path, format!("{e}; the file is damaged")))?;
    Ok(StateFile {
        state,
        protected: recorded.is_some(),
        bytes: bytes.len() as u64,
    })
}

/// The sha256 the sidecar of `dir` records, or `None` when there is no sidecar.
fn read_sidecar(dir: &Path) -> Result<Option<String>, StateError> {
    let path = dir.join(STATE_SUM_FILE);
    let bytes = match regular_file::read(&path, CHECKPOINT_FILE) {
        Ok(bytes) => bytes,
        Err(EngineError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Ok(None)
        }
        Err(e) => return Err(StateError::Damaged(e)),
    };
    let text = String::from_utf8_lossy(&bytes);
    let mut words = text.split_whitespace();
    match (words.next(), words.next(), words.next()) {
        (Some(sum), Some(name), None)
            if sum.len() == 64
                && sum.bytes().all(|b| b.is_ascii_hexdigit())
                && name.trim_start_matches('*') == STATE_FILE =>
        {
            Ok(Some(sum.to_ascii_lowercase()))
        }
        _ => Err(damaged(
            &path,
            format!("is not a sha256sum line for {STATE_FILE}; the file is damaged; restore it or resume from an earlier checkpoint"),
        )),
    }
}

/// Writes `state` into `dir` as `trainer_state.json`, then its sidecar, each fsynced.
pub(crate) fn write(dir: &Path, state: &TrainerState) -> crate::Result<()> {
    let json = serde_json::to_vec_pretty(state).expect("a trainer state is plain JSON");
    write_synced(&dir.join(STATE_FILE), &[&json])?;
    write_sidecar(dir, &sha256_hex(&json))
}

/// Records the checksum of `dir`'s state file as it is now in its sidecar: for tools and tests
/// that rewrite a state file on purpose.
pub fn reseal(dir: &Path) -> crate::Result<()> {
    let path = dir.join(STATE_FILE);
    let bytes = regular_file::read(&path, CHECKPOINT_FILE)?;
    write_sidecar(dir, &sha256_hex(&bytes))
}

fn write_sidecar(dir: &Path, sha256: &str) -> crate::Result<()> {
    let line = format!("{sha256}  {STATE_FILE}\n");
    write_synced(&dir.join(STATE_SUM_FILE), &[line.as_bytes()]).map(drop)
}

/// Refuses a state that its own loader would not read back. JSON has no NaN or infinity:
/// serde_json writes them as `null`, which loading refuses, so the error names the field.
pub(crate) fn check_storable(state: &TrainerState) -> crate::Result<()> {
    let json = serde_json::to_vec(state).expect("a trainer state is plain JSON");
    let Err(parse) = serde_json::from_slice::<TrainerState>(&json) else {
        return Ok(());
    };
    let mut fields = Vec::new();
    if let Ok(value) = serde_json::to_value(state) {
        nulls(&value, "", &mut fields);
    }
    let what = if fields.is_empty() {
        format!("it would not load back ({parse})")
    } else {
        format!(
            "{} is NaN or infinite, which JSON cannot hold ({STATE_FILE} would not load back)",
            fields.join(", ")
        )
    };
    Err(EngineError::Config(format!(
        "cannot save the checkpoint of step {}: {what}; make the learning rate (optimizer.lr) and the schedule finite numbers",
        state.global_step
    )))
}

/// Appends to `out` the path (as `a.b[2].c`) of every `null` in `v` outside the run's identity,
/// where `null` is a valid value.
fn nulls(v: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    use serde_json::Value;
    match v {
        Value::Null => out.push(path.to_string()),
        Value::Object(map) => map
            .iter()
            .filter(|(k, _)| !(path.is_empty() && k.as_str() == "identity"))
            .for_each(|(k, v)| nulls(v, &child_path(path, k), out)),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .for_each(|(i, v)| nulls(v, &format!("{path}[{i}]"), out)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_sidecar(line: &str) -> Result<Option<String>, StateError> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(STATE_SUM_FILE), line).unwrap();
        read_sidecar(dir.path())
    }

    #[test]
    fn the_sidecar_is_read_as_sha256sum_writes_it() {
        let sum = "ab".repeat(32);
        for line in [
            format!("{sum}  {STATE_FILE}\n"),
            format!("{}  {STATE_FILE}", sum.to_uppercase()),
            format!("{sum} *{STATE_FILE}\n"),
        ] {
            assert_eq!(
                with_sidecar(&line).unwrap().as_deref(),
                Some(&*sum),
                "{line}"
            );
        }
        for line in [
            String::new(),
            format!("{sum}\n"),
            format!("{}  {STATE_FILE}\n", &sum[1..]),
            format!("{sum}  other.json\n"),
            format!("{sum}  {STATE_FILE} extra\n"),
        ] {
            assert!(
                matches!(with_sidecar(&line), Err(StateError::Damaged(_))),
                "{line:?}"
            );
        }
        assert!(read_sidecar(tempfile::tempdir().unwrap().path())
            .unwrap()
            .is_none());
    }

    #[test]
    fn an_unreadable_sidecar_is_damage_not_absence() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(STATE_SUM_FILE)).unwrap();
        assert!(matches!(
            read_sidecar(dir.path()),
            Err(StateError::Damaged(_))
        ));
    }

    #[test]
    fn nulls_are_found_outside_the_identity_only() {
        let v = serde_json::json!({
            "identity": {"head_dim": null},
            "schedule": {"next_lr": null, "peak_lr": 1.0, "steps": [1, null]},
        });
        let mut found = Vec::new();
        nulls(&v, "", &mut found);
        assert_eq!(found, ["schedule.next_lr", "schedule.steps[1]"]);
    }
}
