//! The end of what a child process printed, for an error that names why it failed: at most a
//! number of lines and of bytes, read from the end of its log without reading the rest, invalid
//! UTF-8 shown as U+FFFD rather than the tail dropped. A command that prints gigabytes on one line
//! costs its error a few kilobytes.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// Bytes of a log's end an error shows at most.
pub const TAIL_BYTES: u64 = 4096;

/// The last `lines` non-empty lines of the last [`TAIL_BYTES`] of `log`, each trimmed; a first
/// line cut by the byte limit begins with `…`. Empty when the log is empty or cannot be read.
pub fn last_lines(log: &Path, lines: usize) -> Vec<String> {
    let Ok(mut file) = std::fs::File::open(log) else {
        return Vec::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let start = len.saturating_sub(TAIL_BYTES);
    let mut bytes = Vec::new();
    if file.seek(SeekFrom::Start(start)).is_err()
        || file.take(TAIL_BYTES).read_to_end(&mut bytes).is_err()
    {
        return Vec::new();
    }
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    let cut_first = start > 0;
    let mut out: Vec<String> = (all.iter().enumerate())
        .map(|(i, l)| match i == 0 && cut_first {
            true => format!("…{}", l.trim()),
            false => l.trim().to_string(),
        })
        .filter(|l| !l.is_empty() && l != "…")
        .collect();
    out.drain(..out.len().saturating_sub(lines));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_of(bytes: &[u8]) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        std::fs::write(&path, bytes).unwrap();
        (dir, path)
    }

    #[test]
    fn the_last_non_empty_lines_are_kept_trimmed() {
        let (_dir, log) = log_of(b"one\n\n  two  \nthree\n\n");
        assert_eq!(last_lines(&log, 2), ["two", "three"]);
        assert_eq!(last_lines(&log, 8), ["one", "two", "three"]);
    }

    #[test]
    fn a_huge_line_is_cut_to_the_byte_limit_and_marked() {
        let mut bytes = vec![b'x'; 3 << 20];
        bytes.extend_from_slice(b"\nthe end\n");
        let (_dir, log) = log_of(&bytes);
        let got = last_lines(&log, 20);
        assert_eq!(got.len(), 2);
        assert!(got[0].starts_with('…'), "{}", &got[0][..10]);
        assert!(got.iter().map(String::len).sum::<usize>() <= TAIL_BYTES as usize + 4);
        assert_eq!(got[1], "the end");
    }

    #[test]
    fn invalid_utf8_is_replaced_not_dropped() {
        let (_dir, log) = log_of(b"fine\nbad \xff byte\n");
        assert_eq!(last_lines(&log, 20), ["fine", "bad \u{fffd} byte"]);
    }

    #[test]
    fn a_missing_or_empty_log_has_no_lines() {
        let (dir, log) = log_of(b"");
        assert!(last_lines(&log, 20).is_empty());
        assert!(last_lines(&dir.path().join("absent"), 20).is_empty());
    }
}
