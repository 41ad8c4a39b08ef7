//! `ckpt-harness judge --records DIR`: runs recorded elsewhere (a cluster job, another trainer
//! through the Python recorder, `ckpt-harness run`'s own `records/`) judged by the suites'
//! checks and expectations, with the same summary, report, JUnit and trends as `run`. Each
//! trial's record is `DIR/<trial>.jsonl` (`cpu::tiny` is `cpu.tiny.jsonl`); a check whose inputs
//! the record lacks is reported not applicable, with the reason.

use super::run::{self as run_cmd, RunArgs};
use super::{default_paths, run_status, summary_file, Reports};
use crate::checks::golden;
use crate::error_text::printable;
use crate::record::jsonl::{self, to_run};
use crate::report::summary::{Skipped, Summary};
use crate::run::plan::{self, DeviceChoice, TierFilter};
use crate::run::trial;
use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `judge`'s arguments.
#[derive(clap::Args)]
pub struct JudgeArgs {
    /// Suite files or directories: the trials to judge and their checks (default: suites/).
    pub paths: Vec<PathBuf>,
    /// The directory of records, `<trial>.jsonl` each (`cpu::tiny` is `cpu.tiny.jsonl`).
    #[arg(long)]
    pub records: Option<PathBuf>,
    /// Where the reports go.
    #[command(flatten)]
    pub reports: Reports,
}

/// Judges the records of `--records`, or without it runs the suites' trainers as `run` does;
/// exits as `run` does.
pub fn exec(args: JudgeArgs) -> Result<u8> {
    let Some(records) = args.records else {
        return run_cmd::exec(RunArgs {
            paths: args.paths,
            device: DeviceChoice::Auto,
            tier: TierFilter::Ci,
            reports: args.reports,
            memory_trace: false,
            bench: None,
            bless: false,
            repeat: 1,
        });
    };
    let opts = JudgeOptions {
        paths: default_paths(args.paths),
        records,
        report: args.reports.report,
        junit: args.reports.verdicts.junit,
        golden: args.reports.golden,
        baseline: args.reports.verdicts.baseline.as_deref().map(summary_file),
    };
    let summary = judge(&opts, &mut std::io::stdout().lock())?;
    Ok(run_status(
        &summary,
        args.reports.verdicts.fail_on_regression,
    ))
}

/// What `judge` was asked to do.
#[derive(Clone, Debug)]
pub struct JudgeOptions {
    /// Suite files or directories: the trials to judge and their checks.
    pub paths: Vec<PathBuf>,
    /// The directory of records, one `<trial>.jsonl` each.
    pub records: PathBuf,
    /// Where `summary.json`, `index.html` and the records judged go.
    pub report: PathBuf,
    /// Where JUnit XML goes, if anywhere.
    pub junit: Option<PathBuf>,
    /// Where the golden snapshots live; by default found from each suite file.
    pub golden: Option<PathBuf>,
    /// The summary of an earlier run to compare with.
    pub baseline: Option<PathBuf>,
}

/// Judges every trial of the suites whose record `opts.records` holds, printing the summary
/// table to `out`; returns the summary (the caller decides the exit status). A suite file named
/// on the command line with no record on any of its devices fails; one found in a directory
/// without a record is listed as skipped.
pub fn judge(opts: &JudgeOptions, out: &mut impl Write) -> Result<Summary> {
    if !opts.records.is_dir() {
        bail!(
            "--records {}: not a directory; name the directory that holds the `<trial>.jsonl` records (a report's records/)",
            opts.records.display()
        );
    }
    let baseline = run_cmd::read_baseline(opts.baseline.as_ref())?;
    let suites = plan::load(&plan::files(&opts.paths)?)?;
    let mut trials = Vec::new();
    let mut skipped = Vec::new();
    let mut judged = Vec::new();
    for suite in &suites {
        let golden_dir = opts
            .golden
            .clone()
            .unwrap_or_else(|| golden::dir_for(&suite.path));
        let mut found = false;
        for &device in suite.devices() {
            let name = suite.trial_name(device);
            let file = jsonl::file(&opts.records, &name);
            if !file.is_file() {
                continue;
            }
            found = true;
            let result = match to_run::read(&file) {
                Ok(run) => trial::judge(suite, device, run, &golden_dir),
                Err(e) => trial::failed(suite, device, format!("could not read its record: {e:#}")),
            };
            writeln!(
                out,
                "{} {}",
                if result.passed { "PASS" } else { "FAIL" },
                printable(&name)
            )?;
            judged.push(file);
            trials.push(result);
        }
        if !found {
            let wanted = suite
                .devices()
                .iter()
                .map(|&d| {
                    jsonl::file(&opts.records, &suite.trial_name(d))
                        .display()
                        .to_string()
                })
                .collect::<Vec<_>>()
                .join(" or ");
            let device = suite.devices()[0];
            if opts.paths.contains(&suite.path) {
                trials.push(trial::failed(
                    suite,
                    device,
                    format!("no record: expected {wanted}"),
                ));
            } else {
                skipped.push(Skipped {
                    name: suite.trial_name(device),
                    reason: format!("no record ({wanted})"),
                });
            }
        }
    }
    let unmatched = unmatched(&opts.records, &judged)?;
    let summary = run_cmd::conclude(
        Summary::new(trials, skipped),
        baseline,
        &opts.report,
        opts.junit.as_deref(),
        out,
    )?;
    if !unmatched.is_empty() {
        writeln!(
            out,
            "note: {} record(s) in {} match no suite named: {}",
            unmatched.len(),
            opts.records.display(),
            printable(&unmatched.join(", "))
        )?;
    }
    Ok(summary)
}

/// The `.jsonl` files in `dir` that no judged trial read.
fn unmatched(dir: &Path, judged: &[PathBuf]) -> Result<Vec<String>> {
    let read: BTreeSet<&Path> = judged.iter().map(PathBuf::as_path).collect();
    let mut out = Vec::new();
    for entry in
        std::fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))?
    {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "jsonl") && !read.contains(path.as_path()) {
            out.push(
                path.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    out.sort();
    Ok(out)
}
