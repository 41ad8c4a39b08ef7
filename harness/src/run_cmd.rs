//! `ckpt-harness run`: every suite through the phases and checks, a line per phase, a summary,
//! `summary.json` in the report directory, and a non-zero exit on any failure.

use crate::checks::{self, Failure};
use crate::phases;
use crate::suite::Suite;
use anyhow::{Context, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// The suite files under `paths` (files as given, directories searched for `*.yaml`, not
/// descending into `faults/`), sorted.
pub fn suite_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            let entries =
                std::fs::read_dir(p).with_context(|| format!("{}: cannot list", p.display()))?;
            let mut found: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|f| f.extension().is_some_and(|x| x == "yaml" || x == "yml"))
                .collect();
            found.sort();
            out.extend(found);
        } else {
            out.push(p.clone());
        }
    }
    Ok(out)
}

/// One suite's verdict.
#[derive(Serialize)]
struct Verdict {
    suite: String,
    device: String,
    passed: bool,
    failures: Vec<Failure>,
}

/// Runs the suites; returns whether all passed.
pub fn run(paths: &[PathBuf], report: &Path) -> Result<bool> {
    let files = suite_files(paths)?;
    let suites: Vec<Suite> = files
        .iter()
        .map(|f| Suite::load(f))
        .collect::<Result<_>>()?;
    std::fs::create_dir_all(report)
        .with_context(|| format!("{}: cannot create", report.display()))?;
    let mut verdicts = Vec::new();
    for suite in &suites {
        let work = tempfile::tempdir().context("cannot create a temporary directory")?;
        let record = phases::run(suite, work.path(), |p| {
            let last = p.steps.last();
            println!(
                "cpu::{:<24} {:<10} {:>3} steps  last loss {:>9}  peak {}",
                suite.file.name,
                p.phase.to_string(),
                p.steps.len(),
                last.map_or("-".into(), |s| format!("{:.5}", s.loss)),
                ckpt_engine::memory::human_bytes(
                    p.steps
                        .iter()
                        .map(|s| s.memory.allocated.peak)
                        .max()
                        .unwrap_or(0)
                ),
            )
        })?;
        let failures = checks::run_all(&record);
        verdicts.push(Verdict {
            suite: suite.file.name.clone(),
            device: record.device.clone(),
            passed: failures.is_empty(),
            failures,
        });
    }
    println!();
    println!("{:<32} {:<6} failed checks", "trial", "result");
    for v in &verdicts {
        let names: Vec<&str> = checks::ALL
            .iter()
            .copied()
            .filter(|c| v.failures.iter().any(|f| f.check == *c))
            .collect();
        println!(
            "{:<32} {:<6} {}",
            format!("{}::{}", v.device, v.suite),
            if v.passed { "PASS" } else { "FAIL" },
            names.join(", ")
        );
        for f in &v.failures {
            println!("    {}: {}", f.check, f.message);
        }
    }
    let summary = report.join("summary.json");
    std::fs::write(&summary, serde_json::to_vec_pretty(&verdicts)?)
        .with_context(|| format!("{}: cannot write", summary.display()))?;
    let passed = verdicts.iter().filter(|v| v.passed).count();
    println!("\n{passed} passed, {} failed", verdicts.len() - passed);
    Ok(passed == verdicts.len())
}
