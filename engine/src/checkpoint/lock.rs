//! One writer per run directory.
//!
//! A writer (`ckpt-harness train` for its whole run, and every save) holds an exclusive advisory
//! lock on `.lock` in the run directory, a file that records the holder's process id and command
//! line for whoever is refused. The operating system releases the lock when the holder's process
//! ends, however it ends, so a crash leaves no stale lock behind. The lock belongs to the
//! process: taking it again while this process holds it gives another handle to the same lock.

use super::LOCK_FILE;
use crate::error::{EngineError, Result};
use fs4::{FileExt, TryLockError};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// The run directories this process holds, by canonical path.
static HELD: Mutex<BTreeMap<PathBuf, Weak<File>>> = Mutex::new(BTreeMap::new());

/// An exclusive hold on a run directory, released when its last handle is dropped.
#[derive(Clone)]
pub struct RunLock {
    _file: Arc<File>,
}

impl RunLock {
    /// Takes the lock of `run_dir` (created if missing), or fails naming the process that
    /// holds it.
    pub fn acquire(run_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(run_dir).map_err(|e| EngineError::io(run_dir, e))?;
        let key = run_dir
            .canonicalize()
            .map_err(|e| EngineError::io(run_dir, e))?;
        let mut held = HELD.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(file) = held.get(&key).and_then(Weak::upgrade) {
            return Ok(RunLock { _file: file });
        }
        let path = run_dir.join(LOCK_FILE);
        let io = |e| EngineError::io(&path, e);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        // Called through the trait: std's own `File::try_lock` needs a newer Rust than the
        // workspace's rust-version.
        match FileExt::try_lock(&file) {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(EngineError::bad_file(
                    &path,
                    format!(
                        "{} is writing this run directory, and only one process at a time may; wait for it to end, or write to another directory",
                        holder(&mut file)
                    ),
                ))
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        let me = format!("pid {}\ncommand {}\n", std::process::id(), command_line());
        file.set_len(0)
            .and_then(|()| file.write_all(me.as_bytes()))
            .map_err(io)?;
        let file = Arc::new(file);
        held.retain(|_, f| f.strong_count() > 0);
        held.insert(key, Arc::downgrade(&file));
        Ok(RunLock { _file: file })
    }
}

/// This process's command line, as one string.
fn command_line() -> String {
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    args.join(" ")
}

/// Who holds the lock, from what the holder recorded in `file`.
fn holder(file: &mut File) -> String {
    let mut text = String::new();
    if file.read_to_string(&mut text).is_err() {
        text.clear();
    }
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
            .map(str::to_string)
    };
    match (field("pid"), field("command")) {
        (Some(pid), Some(command)) => format!("process {pid} ({command})"),
        _ => "another process (it has not recorded its id yet)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether another open file description can lock `run_dir`'s lock file, as another
    /// process's would.
    fn free(run_dir: &Path) -> bool {
        let file = File::open(run_dir.join(LOCK_FILE)).unwrap();
        FileExt::try_lock(&file).is_ok()
    }

    #[test]
    fn the_lock_is_exclusive_shared_within_the_process_and_released_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let first = RunLock::acquire(&run).unwrap();
        let again = RunLock::acquire(&run.join("..").join("run")).unwrap();
        assert!(!free(&run));
        let recorded = std::fs::read_to_string(run.join(LOCK_FILE)).unwrap();
        assert!(
            recorded.starts_with(&format!("pid {}\ncommand ", std::process::id())),
            "{recorded}"
        );
        drop(first);
        assert!(!free(&run), "a handle is still held");
        drop(again);
        assert!(free(&run));
    }

    #[test]
    fn a_lock_stays_shared_within_the_process_while_another_directory_is_locked() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let first = RunLock::acquire(&a).unwrap();
        let other = RunLock::acquire(&b).unwrap();
        let again = RunLock::acquire(&a).expect("the process already holds a's lock");
        drop((first, other, again));
        assert!(free(&a) && free(&b));
    }

    #[test]
    fn the_holder_is_named_from_what_it_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        std::fs::write(&path, "pid 42\ncommand ckpt-harness train s.yaml\n").unwrap();
        let mut file = File::open(&path).unwrap();
        assert_eq!(holder(&mut file), "process 42 (ckpt-harness train s.yaml)");
        std::fs::write(&path, "").unwrap();
        let mut file = File::open(&path).unwrap();
        assert!(holder(&mut file).starts_with("another process"));
    }
}
