//! `export`: a checkpoint's weights in the Hugging Face layout (`model.safetensors` and
//! `config.json`), whatever layout it was saved in. A sharded checkpoint's tensors are
//! assembled whole from their chunks, each chunk and each whole tensor checked against its
//! hash; one device's `model.safetensors` is copied after its checksum is verified.

use super::files::{self, sync_dir, write_synced};
use super::{
    resolve, shards, state_file, write_safetensors, Entry, CONFIG_FILE, MODEL_FILE, SHARDS_FILE,
    STATE_FILE,
};
use crate::error::{EngineError, Result};
use std::borrow::Cow;
use std::path::{Path, PathBuf};

/// What a damaged file's error tells to do instead.
const EARLIER: &str = "export an earlier checkpoint";

/// Writes the weights of the checkpoint at `from` (a checkpoint, or a run directory whose
/// `latest` names one) into the new directory `out` in the Hugging Face layout, each file
/// fsynced; returns the checkpoint exported. `out` must not exist or be empty: nothing is
/// overwritten.
pub fn export(from: &Path, out: &Path) -> Result<PathBuf> {
    super::check_named_path(from)?;
    let dir = resolve(from)?;
    let state = state_file::read(&dir)?.state;
    let record = |name: &str| {
        state.files.get(name).ok_or_else(|| {
            EngineError::bad_file(
                dir.join(STATE_FILE),
                format!("lists no record of {name}; the checkpoint is incomplete"),
            )
        })
    };
    let config = files::read_checked(&dir.join(CONFIG_FILE), record(CONFIG_FILE)?, EARLIER)?;
    let mut tensors = Vec::new();
    if state.files.contains_key(SHARDS_FILE) {
        let index = shards::read_index(&dir, &state, EARLIER)?;
        shards::each_whole(&dir, index.tensor_hash, &index.model, |t, whole| {
            tensors.push(Entry {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                data: Cow::Owned(whole.to_vec()),
            });
            Ok(())
        })?;
    }
    create_empty(out)?;
    if tensors.is_empty() {
        let bytes = files::read_checked(&dir.join(MODEL_FILE), record(MODEL_FILE)?, EARLIER)?;
        write_synced(&out.join(MODEL_FILE), &[&bytes])?;
    } else {
        write_safetensors(&out.join(MODEL_FILE), &tensors)?;
    }
    write_synced(&out.join(CONFIG_FILE), &[&config])?;
    sync_dir(out)?;
    Ok(dir)
}

/// Creates `out`, or accepts it when it is an empty directory.
fn create_empty(out: &Path) -> Result<()> {
    match std::fs::read_dir(out).map(|mut entries| entries.next().is_none()) {
        Ok(true) => Ok(()),
        Ok(false) => Err(EngineError::bad_file(
            out,
            "is not empty; export into a new directory (nothing is overwritten)",
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(out).map_err(|e| EngineError::io(out, e))
        }
        Err(e) => Err(EngineError::io(out, e)),
    }
}
