//! Tokenized samples kept on disk, by the content of what made them: the dataset, the
//! tokenizer's files, the columns and the labels. A run, its resumes and every rank of it
//! tokenize a dataset once; a changed file is another key, never a stale hit. Entries are
//! written atomically (a temporary file renamed into place) and carry a checksum: a damaged one
//! is tokenized again, never trusted.
//!
//! The directory: `CKPT_CACHE_DIR`, else `$XDG_CACHE_HOME/ckpt-harness/tokens`, else
//! `$HOME/.cache/ckpt-harness/tokens`; `CKPT_CACHE_DIR` set empty keeps nothing.

use super::Tokens;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};

/// What an entry's bytes start with: the format and its version.
const MAGIC: &[u8; 16] = b"ckpt-tokens/1\0\0\0";

/// The directory entries are kept in; `None` where caching is off or no directory is known.
pub fn dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("CKPT_CACHE_DIR") {
        return (!dir.is_empty()).then(|| PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("ckpt-harness").join("tokens"))
}

/// The entry for `key` (the content of everything that made the samples) under `dir`.
pub fn entry(dir: &Path, key: &str) -> PathBuf {
    let name: String = Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    dir.join(format!("{name}.tokens"))
}

/// The samples and padding id `path` holds, or `None` for an entry that is missing, damaged or
/// of another format.
pub fn read(path: &Path) -> Option<(Vec<Tokens>, u32)> {
    let bytes = std::fs::read(path).ok()?;
    let (body, sum) = bytes.split_at_checked(bytes.len().checked_sub(32)?)?;
    if Sha256::digest(body).as_slice() != sum {
        return None;
    }
    let mut at = body.strip_prefix(MAGIC)?;
    let mut word = || -> Option<u32> {
        let (w, rest) = at.split_first_chunk::<4>()?;
        at = rest;
        Some(u32::from_le_bytes(*w))
    };
    let pad = word()?;
    let count = word()? as usize;
    let mut samples = Vec::with_capacity(count.min(body.len()));
    for _ in 0..count {
        let len = word()? as usize;
        let ids = (0..len).map(|_| word()).collect::<Option<Vec<u32>>>()?;
        samples.push(Tokens {
            ids,
            learned: Vec::new(),
        });
    }
    for sample in &mut samples {
        let (flags, rest) = at.split_at_checked(sample.ids.len())?;
        sample.learned = flags.iter().map(|&f| f == 1).collect();
        at = rest;
    }
    at.is_empty().then_some((samples, pad))
}

/// Writes `samples` and `pad` as the entry at `path`, atomically; a failure leaves no entry
/// and is no error (the next run tokenizes again).
pub fn write(path: &Path, samples: &[Tokens], pad: u32) {
    let mut body = Vec::with_capacity(
        MAGIC.len() + 8 + samples.iter().map(|s| 4 + 5 * s.ids.len()).sum::<usize>(),
    );
    body.extend_from_slice(MAGIC);
    body.extend_from_slice(&pad.to_le_bytes());
    body.extend_from_slice(&(samples.len() as u32).to_le_bytes());
    for s in samples {
        body.extend_from_slice(&(s.ids.len() as u32).to_le_bytes());
        s.ids
            .iter()
            .for_each(|id| body.extend_from_slice(&id.to_le_bytes()));
    }
    for s in samples {
        body.extend(s.learned.iter().map(|&l| u8::from(l)));
    }
    let sum = Sha256::digest(&body);
    let Some(dir) = path.parent() else {
        return;
    };
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| tempfile::NamedTempFile::new_in(dir))
        .and_then(|mut tmp| {
            tmp.write_all(&body)?;
            tmp.write_all(&sum)?;
            tmp.persist(path).map_err(|e| e.error)?;
            Ok(())
        });
    drop(written);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Tokens> {
        vec![
            Tokens {
                ids: vec![3, 70000, 5],
                learned: vec![false, true, true],
            },
            Tokens::default(),
            Tokens {
                ids: vec![9],
                learned: vec![true],
            },
        ]
    }

    #[test]
    fn an_entry_reads_back_as_written_and_a_damaged_one_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = entry(dir.path(), "key");
        assert_eq!(read(&path), None);
        write(&path, &samples(), 4);
        assert_eq!(read(&path), Some((samples(), 4)));
        let mut bytes = std::fs::read(&path).unwrap();
        for at in [0, 20, bytes.len() / 2, bytes.len() - 1] {
            bytes[at] ^= 1;
            std::fs::write(&path, &bytes).unwrap();
            assert_eq!(read(&path), None, "byte {at} flipped");
            bytes[at] ^= 1;
        }
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        assert_eq!(read(&path), None, "cut short");
        assert_ne!(entry(dir.path(), "key"), entry(dir.path(), "other key"));
    }
}
