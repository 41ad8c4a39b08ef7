//! Durable file operations: write-and-fsync with a running sha256, directory fsync, atomic
//! replacement by rename, and reading files through a memory map.

use crate::error::{EngineError, Result};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::Write;
use std::path::Path;

/// Hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `parts` (concatenated) to a new file at `path`, fsyncs it, and returns the byte count
/// and sha256 of what was written. The hash is computed from the in-memory parts on a second
/// thread while this one writes and fsyncs, so hashing hides behind the disk.
pub fn write_synced(path: &Path, parts: &[&[u8]]) -> Result<(u64, String)> {
    let io = |e| EngineError::io(path, e);
    std::thread::scope(|scope| {
        let hashing = scope.spawn(|| {
            let mut hasher = Sha256::new();
            for part in parts {
                hasher.update(part);
            }
            hasher.finalize()
        });
        let mut file = File::create(path).map_err(io)?;
        for part in parts {
            file.write_all(part).map_err(io)?;
        }
        file.sync_all().map_err(io)?;
        let digest = hashing.join().expect("hashing does not panic");
        let len = parts.iter().map(|p| p.len() as u64).sum();
        let hex = digest.iter().map(|b| format!("{b:02x}")).collect();
        Ok((len, hex))
    })
}

/// Makes a directory's entries (creations, renames) durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| EngineError::io(dir, e))
}

/// Renames `from` to `to` and makes the rename durable in `parent`.
pub fn rename_synced(from: &Path, to: &Path, parent: &Path) -> Result<()> {
    std::fs::rename(from, to).map_err(|e| EngineError::io(to, e))?;
    sync_dir(parent)
}

/// A read-only view of a file's bytes (memory-mapped, so it costs no heap copy).
pub struct MappedFile {
    map: Option<memmap2::Mmap>,
}

impl MappedFile {
    /// Maps `path`; a missing file is an error naming it.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
        let len = file.metadata().map_err(|e| EngineError::io(path, e))?.len();
        if len == 0 {
            return Ok(MappedFile { map: None });
        }
        // SAFETY: checkpoints are written once into a temporary directory and renamed; nothing
        // writes to a published checkpoint's files while it is read.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))?;
        Ok(MappedFile { map: Some(map) })
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}
