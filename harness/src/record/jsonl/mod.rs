//! The run record as a published contract, `ckpt-record/1` (docs/RECORD.md, schema in
//! `harness/record/`): the lines of the format ([`lines`], their memory categories
//! [`by_category`]), and the built-in engine's recorded run written in it ([`from_run`]), one
//! JSON-lines file per trial beside `summary.json`.

pub mod by_category;
pub mod extensions;
pub mod from_run;
pub mod lines;
pub mod to_run;

use crate::atomic_file;
use crate::record::RunRecord;
use anyhow::Result;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The record's version, written on every `phase` line.
pub const VERSION: &str = "ckpt-record/1";

/// The folder of a report directory that holds the trials' records.
pub const DIR: &str = "records";

/// The record file of `trial` under `dir`: the trial's name with `::` as `.` (`cpu::tiny` is
/// `cpu.tiny.jsonl`).
pub fn file(dir: &Path, trial: &str) -> PathBuf {
    dir.join(format!("{}.jsonl", trial.replace("::", ".")))
}

/// Writes every trial's record under `dir`, one file each (see [`file()`]): a record read from
/// elsewhere as it was read, the engine's as its lines; a trial that recorded nothing (it could
/// not run) has none.
pub fn write_all<'a>(records: impl IntoIterator<Item = &'a RunRecord>, dir: &Path) -> Result<()> {
    for r in records {
        if r.phases.is_empty() && r.text.is_none() {
            continue;
        }
        if let Some(text) = &r.text {
            atomic_file::write(&file(dir, &r.name), text.as_bytes())?;
            continue;
        }
        let lines = from_run::lines(r);
        atomic_file::write_with(&file(dir, &r.name), |out: &mut dyn Write| {
            for line in &lines {
                serde_json::to_writer(&mut *out, line)?;
                out.write_all(b"\n")?;
            }
            Ok(())
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;

    #[test]
    fn every_trial_gets_a_file_of_one_json_object_per_line() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = fixtures::run();
        r.name = "cpu::faults::s".into();
        write_all([&r], dir.path()).unwrap();
        let text = std::fs::read_to_string(dir.path().join("cpu.faults.s.jsonl")).unwrap();
        let kinds: Vec<String> = text
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["kind"].as_str().unwrap().to_string()
            })
            .collect();
        assert_eq!(kinds.len(), from_run::lines(&fixtures::run()).len());
        assert_eq!(kinds.first().map(String::as_str), Some("phase"));
        assert_eq!(kinds.last().map(String::as_str), Some("phase_end"));
    }
}
