//! `ckpt-harness run`: every planned trial through the phases and checks, a line per phase, a
//! summary table, `summary.json` in the report directory, optionally JUnit XML; the caller exits
//! non-zero on any failure.

use crate::checks::{bytes, golden};
use crate::plan::{self, DeviceChoice, TierFilter};
use crate::report::{Skipped, Summary};
use crate::trial::{self, GoldenMode};
use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// What `run` was asked to do.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Suite files or directories.
    pub paths: Vec<PathBuf>,
    /// Devices to run on.
    pub device: DeviceChoice,
    /// Tiers to run.
    pub tier: TierFilter,
    /// Where `summary.json` goes.
    pub report: PathBuf,
    /// Where JUnit XML goes, if anywhere.
    pub junit: Option<PathBuf>,
    /// Where the golden snapshots live; by default found from each suite file
    /// ([`golden::dir_for`]).
    pub golden: Option<PathBuf>,
    /// Rewrite the golden snapshots from this run.
    pub bless: bool,
}

/// Runs the trials, printing to `out`; returns the summary (the caller decides the exit status).
/// A failed write to `out` (a closed pipe) stops the run after the trial it happened in.
pub fn run(opts: &RunOptions, out: &mut impl Write) -> Result<Summary> {
    let suites = plan::load(&plan::files(&opts.paths)?)?;
    let planned = plan::plan(&suites, &opts.paths, opts.tier, opts.device)?;
    let mode = if opts.bless {
        GoldenMode::Bless
    } else {
        GoldenMode::Check
    };
    let w = planned.iter().map(|p| p.name.len()).fold(0, usize::max);
    let mut trials = Vec::new();
    let mut skipped = Vec::new();
    for p in planned {
        if let Some(reason) = p.skip {
            skipped.push(Skipped {
                name: p.name,
                reason,
            });
            continue;
        }
        let suite = &suites[p.suite];
        let golden = opts
            .golden
            .clone()
            .unwrap_or_else(|| golden::dir_for(&suite.path));
        let name = p.name.clone();
        let mut written = Ok(());
        let result = trial::run(suite, p.device, &golden, mode, |ph| {
            if written.is_err() {
                return;
            }
            let last = ph.steps.last();
            written = writeln!(
                out,
                "{name:<w$} {:<10} {:>3} steps  last loss {:>9}  peak {}{}",
                ph.phase.to_string(),
                ph.steps.len(),
                last.map_or("-".into(), |s| format!("{:.5}", s.loss)),
                bytes(
                    ph.steps
                        .iter()
                        .map(|s| s.memory.allocated.peak)
                        .fold(ph.setup.peak, u64::max)
                ),
                ph.oom
                    .as_ref()
                    .map_or(String::new(), |e| format!("  OOM: {}", e.message)),
            );
        });
        written?;
        trials.push(result);
    }
    let summary = Summary::new(trials, skipped);
    write!(out, "\n{}", summary.table())?;
    summary.write_json(&opts.report)?;
    if let Some(file) = &opts.junit {
        write_file(file, &summary.junit())?;
    }
    Ok(summary)
}

fn write_file(file: &Path, text: &str) -> Result<()> {
    if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("{}: cannot create", dir.display()))?;
    }
    std::fs::write(file, text).with_context(|| format!("{}: cannot write", file.display()))
}
