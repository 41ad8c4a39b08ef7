//! Writing a report file whole or not at all: the text goes to a temporary file beside it,
//! which is synced and then renamed over it, as checkpoints are. A failure part-way (a full
//! disk) leaves the previous file, which may be tonight's `--baseline`, as it was.

use anyhow::{Context, Result};
use std::io::Write;
use std::path::Path;

/// Writes `file` through `fill`, creating its directory: into a temporary file in the same
/// directory, synced, then renamed over `file`. On failure `file` is unchanged and the
/// temporary file is removed.
pub fn write_with(file: &Path, fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let dir = file
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let cannot = || format!("{}: cannot write", file.display());
    let mut tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .tempfile_in(dir)
        .with_context(cannot)?;
    let mut out = std::io::BufWriter::new(tmp.as_file_mut());
    fill(&mut out).with_context(cannot)?;
    out.flush().with_context(cannot)?;
    drop(out);
    tmp.as_file().sync_all().with_context(cannot)?;
    tmp.persist(file)
        .map_err(|e| e.error)
        .with_context(cannot)?;
    Ok(())
}

/// Writes `bytes` to `file` as [`write_with`] does.
pub fn write(file: &Path, bytes: &[u8]) -> Result<()> {
    write_with(file, |out| Ok(out.write_all(bytes)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_previous_file_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("summary.json");
        write(&file, b"before").unwrap();
        let err = write_with(&file, |out| {
            out.write_all(b"part of it")?;
            anyhow::bail!("the disk is full")
        })
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("summary.json: cannot write"),
            "{err:#}"
        );
        assert_eq!(std::fs::read(&file).unwrap(), b"before");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "{names:?}");
        write(&file, b"after").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"after");
    }
}
