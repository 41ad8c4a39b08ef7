//! Files read only when they are regular files. A FIFO blocks its reader until a writer comes,
//! and a device such as `/dev/zero` never ends, so reading either as a suite, a summary, a
//! token file or a checkpoint's file would hang. Every such read goes through here: the path's
//! metadata (through any symbolic link) must say a regular file before it is opened, and the
//! opened handle is asked again, so a file swapped for a FIFO in between is refused too.

use crate::error::{EngineError, Result};
use std::fs::{File, FileType, Metadata};
use std::io::Read;
use std::path::Path;

/// What a file of type `t` is, for a message: "a FIFO", "a character device", ...
fn kind(t: FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// The error for `path`, whose metadata is `meta`, when `wanted` was asked for: what it is (a
/// symbolic link to what, where it is one) and what to give instead.
fn refusal(path: &Path, meta: &Metadata, wanted: &str) -> EngineError {
    let link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let what = kind(meta.file_type());
    let is = if link {
        format!("is a symbolic link to {what}")
    } else {
        format!("is {what}")
    };
    EngineError::bad_file(
        path,
        format!("{is}, not a regular file; nothing is read from it; give {wanted}"),
    )
}

/// The metadata of the regular file at `path`, following symbolic links; anything else (a
/// FIFO, a device, a socket, a directory) is refused, naming what it is and `wanted`, the kind
/// of file the caller reads (`"a suite file"`).
pub fn metadata(path: &Path, wanted: &str) -> Result<Metadata> {
    let meta = std::fs::metadata(path).map_err(|e| EngineError::io(path, e))?;
    if !meta.is_file() {
        return Err(refusal(path, &meta, wanted));
    }
    Ok(meta)
}

/// The size of the regular file at `path`, from its metadata (see [`metadata`]).
pub fn len(path: &Path, wanted: &str) -> Result<u64> {
    metadata(path, wanted).map(|m| m.len())
}

/// Opens the regular file at `path` for reading and returns it with its size. Its metadata is
/// checked first (see [`metadata`]); the open does not wait for a FIFO's writer (on Linux), and
/// the opened handle must be a regular file too.
pub fn open(path: &Path, wanted: &str) -> Result<(File, u64)> {
    metadata(path, wanted)?;
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        let flags = rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::NOCTTY;
        options.custom_flags(flags.bits() as i32);
    }
    let file = options.open(path).map_err(|e| EngineError::io(path, e))?;
    let meta = file.metadata().map_err(|e| EngineError::io(path, e))?;
    if !meta.is_file() {
        return Err(refusal(path, &meta, wanted));
    }
    Ok((file, meta.len()))
}

/// The bytes of the regular file at `path` (see [`open`]).
pub fn read(path: &Path, wanted: &str) -> Result<Vec<u8>> {
    let (file, len) = open(path, wanted)?;
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(usize::try_from(len).unwrap_or(usize::MAX))
        .map_err(|_| EngineError::HostMemory {
            what: format!("reading {}", path.display()),
            bytes: len,
        })?;
    file.take(len)
        .read_to_end(&mut bytes)
        .map_err(|e| EngineError::io(path, e))?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// What `f` returns, or a panic when it takes more than a few seconds: a read that blocks
    /// fails the test instead of hanging it.
    fn within_seconds<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the read blocked for 10 s instead of refusing the file")
    }

    fn refused(path: &Path) -> String {
        let path = path.to_path_buf();
        within_seconds(move || read(&path, "a file of numbers"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_regular_file_is_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"twelve bytes").unwrap();
        assert_eq!(read(&file, "a file").unwrap(), b"twelve bytes");
        assert_eq!(len(&file, "a file").unwrap(), 12);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(read(&link, "a file").unwrap(), b"twelve bytes");
    }

    #[test]
    fn fifos_devices_and_directories_are_refused_naming_what_they_are() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.unwrap().success());
        let zero_link = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero_link).unwrap();
        let cases = [
            (fifo.as_path(), "is a FIFO, not a regular file"),
            (
                Path::new("/dev/zero"),
                "is a character device, not a regular file",
            ),
            (
                zero_link.as_path(),
                "is a symbolic link to a character device, not a regular file",
            ),
            (dir.path(), "is a directory, not a regular file"),
        ];
        for (path, want) in cases {
            let e = refused(path);
            assert!(e.starts_with(&path.display().to_string()), "{e}");
            assert!(e.contains(want), "{e}");
            assert!(e.ends_with("give a file of numbers"), "{e}");
        }
    }
}
