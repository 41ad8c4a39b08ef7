//! `ckpt-harness run`: every planned trial through the phases and checks, with progress as it
//! goes, a summary table, `summary.json`, `index.html` and each trial's run record
//! (`records/<trial>.jsonl`, docs/RECORD.md) in the report directory, optionally
//! JUnit XML, memory traces, the benchmarks' figures measured with the run, and the changes
//! against a baseline; the caller exits non-zero on any failure.

use super::{default_paths, run_status, summary_file, Reports};
use crate::checks::golden;
use crate::error_text::printable;
use crate::record::jsonl;
use crate::report::bench::Bench;
use crate::report::html;
use crate::report::summary::{Skipped, Summary};
use crate::report::trends::Trends;
use crate::run::memory_trace::{self, Tracer};
use crate::run::plan::{self, DeviceChoice, TierFilter};
use crate::run::progress::{Reporter, Style};
use crate::run::repeat::Spread;
use crate::run::trial::{self, GoldenMode};
use anyhow::Result;
use indicatif::ProgressDrawTarget;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

/// `run`'s arguments.
#[derive(clap::Args)]
pub struct RunArgs {
    /// Suite files or directories; a directory's faults/ holds negative controls (default:
    /// suites/).
    pub paths: Vec<PathBuf>,
    /// Devices: each suite's that are present (auto), or one.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Tiers to run from directories (a suite file named runs whatever its tier).
    #[arg(long, value_enum, default_value_t = TierFilter::Ci)]
    pub tier: TierFilter,
    /// Where the reports go.
    #[command(flatten)]
    pub reports: Reports,
    /// Write every phase's allocations and frees as PyTorch memory snapshots
    /// (`REPORT/memory/<trial>/<phase>.pickle`).
    #[arg(
        long,
        help = "Write every phase's allocations and frees as PyTorch memory snapshots (REPORT/memory/<trial>/<phase>.pickle)"
    )]
    pub memory_trace: bool,
    /// The benchmarks' figures measured with this run (`scripts/bench.sh --json FILE`): put
    /// in summary.json and index.html, compared with --baseline's.
    #[arg(long)]
    pub bench: Option<PathBuf>,
    /// Rewrite the golden snapshots from this run.
    #[arg(long)]
    pub bless: bool,
    /// Run each trial N times: report the per-step spread of losses, gradient norms and
    /// peaks, and the loss_continuity tolerance it calls for; a trial passes only when
    /// every run does.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub repeat: u16,
}

/// Runs the suites with progress on standard output (bars on a terminal without `CI` set);
/// exits 1 if a trial failed, or something regressed when that must fail.
pub fn exec(args: RunArgs) -> Result<u8> {
    let stdout = std::io::stdout();
    let progress = Style::detect(stdout.is_terminal(), std::env::var_os("CI").as_deref());
    let opts = RunOptions {
        paths: default_paths(args.paths),
        device: args.device,
        tier: args.tier,
        report: args.reports.report,
        junit: args.reports.verdicts.junit,
        golden: args.reports.golden,
        bless: args.bless,
        progress,
        memory_trace: args.memory_trace,
        baseline: args.reports.verdicts.baseline.as_deref().map(summary_file),
        bench: args.bench,
        repeat: args.repeat.into(),
    };
    let summary = run(&opts, &mut stdout.lock())?;
    Ok(run_status(
        &summary,
        args.reports.verdicts.fail_on_regression,
    ))
}

/// What `run` was asked to do.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Suite files or directories.
    pub paths: Vec<PathBuf>,
    /// Devices to run on.
    pub device: DeviceChoice,
    /// Tiers to run.
    pub tier: TierFilter,
    /// Where `summary.json`, `index.html` and the memory traces go.
    pub report: PathBuf,
    /// Where JUnit XML goes, if anywhere.
    pub junit: Option<PathBuf>,
    /// Where the golden snapshots live; by default found from each suite file
    /// ([`golden::dir_for`]).
    pub golden: Option<PathBuf>,
    /// Rewrite the golden snapshots from this run.
    pub bless: bool,
    /// How progress is shown.
    pub progress: Style,
    /// Write every phase's allocations and frees as PyTorch memory snapshots.
    pub memory_trace: bool,
    /// The summary of an earlier run to compare with.
    pub baseline: Option<PathBuf>,
    /// The figures `scripts/bench.sh --json` measured with the run, to put in its summary.
    pub bench: Option<PathBuf>,
    /// Runs of each trial (1: once); from 2 on the trial's result carries their spread, and
    /// it passes only when every run does.
    pub repeat: usize,
}

/// Writes the reports of `summary` into `dir` (`summary.json`, `index.html`, every trial's
/// `ckpt-record/1` record under `records/`) and JUnit XML to `junit` when given.
pub fn write_reports(summary: &Summary, dir: &Path, junit: Option<&Path>) -> Result<()> {
    summary.write_json(dir)?;
    jsonl::write_all(
        summary.trials.iter().map(|t| &t.record),
        &dir.join(jsonl::DIR),
    )?;
    html::write(summary, dir)?;
    if let Some(file) = junit {
        write_file(file, &summary.junit())?;
    }
    Ok(())
}

/// The changes of `summary` against the summary in `file`, read and compared.
pub fn trends(file: &Path, baseline: &Summary, summary: &Summary) -> Trends {
    Trends::new(&file.display().to_string(), baseline, summary)
}

/// The baseline summary in `file`, if one is named, with its file.
pub fn read_baseline(file: Option<&PathBuf>) -> Result<Option<(&PathBuf, Summary)>> {
    file.map(|f| Summary::read(f).map(|s| (f, s))).transpose()
}

/// Runs the trials, printing to `out`; returns the summary (the caller decides the exit status).
/// A failed write to `out` (a closed pipe) stops the run after the trial it happened in.
pub fn run(opts: &RunOptions, out: &mut impl Write) -> Result<Summary> {
    let baseline = read_baseline(opts.baseline.as_ref())?;
    let bench = opts.bench.as_deref().map(Bench::read).transpose()?;
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
    let mut reporter = match opts.progress {
        Style::Lines => Reporter::lines(&mut *out),
        Style::Bars => Reporter::Bars {
            target: Box::new(ProgressDrawTarget::stdout),
        },
    };
    let traces = opts.report.join(memory_trace::DIR);
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
        let tracer = opts
            .memory_trace
            .then(|| Tracer::new(memory_trace::trial_dir(&traces, &p.name)));
        let mut watch = (reporter.trial(&p.name, w), tracer);
        let mut result = trial::run(suite, p.device, &golden, mode, &mut watch);
        let (progress, tracer) = watch;
        drop(progress);
        if let Some(tracer) = tracer {
            tracer.finish()?;
        }
        if opts.repeat > 1 {
            let mut records = vec![result.record.clone()];
            for k in 2..=opts.repeat {
                let label = format!("{} (run {k})", p.name);
                let mut progress = reporter.trial(&label, w);
                let again = trial::run(suite, p.device, &golden, GoldenMode::Check, &mut progress);
                drop(progress);
                if result.passed && !again.passed {
                    result.passed = false;
                    result.verdict = format!("run {k} of {}: {}", opts.repeat, again.verdict);
                }
                records.push(again.record);
            }
            result.repeat = Some(Spread::of(&records));
        }
        if let Some(e) = reporter.take_error() {
            return Err(e.into());
        }
        trials.push(result);
    }
    drop(reporter);
    let mut summary = Summary::new(trials, skipped);
    summary.bench = bench;
    conclude(summary, baseline, &opts.report, opts.junit.as_deref(), out)
}

/// The end of a run (or a judging) of trials: `summary`'s table printed to `out`, what changed
/// against `baseline` printed and kept in it, and its reports written into `report` (and JUnit
/// XML to `junit`).
pub fn conclude(
    mut summary: Summary,
    baseline: Option<(&PathBuf, Summary)>,
    report: &Path,
    junit: Option<&Path>,
    out: &mut impl Write,
) -> Result<Summary> {
    write!(out, "\n{}", printable(&summary.table()))?;
    if let Some((file, old)) = &baseline {
        let t = trends(file, old, &summary);
        write!(out, "{}", printable(&t.text()))?;
        summary.trends = Some(t);
    }
    write_reports(&summary, report, junit)?;
    Ok(summary)
}

fn write_file(file: &Path, text: &str) -> Result<()> {
    crate::atomic_file::write(file, text.as_bytes())
}
