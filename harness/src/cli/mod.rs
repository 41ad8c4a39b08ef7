//! The `ckpt-harness` command line: [`Cli`] parses it (clap), a file per command does what the
//! command asks with its arguments (`exec`), and [`exit_codes`] names every status a command
//! exits with. The binary (`main.rs`) only hands each command to its file; the runner, the
//! checks and the reports the commands drive are the library's other stages.

pub mod batches;
pub mod diff;
pub mod estimate;
pub mod eval;
pub mod exit_codes;
pub mod export;
pub mod judge;
pub mod list;
pub mod merge;
pub mod rank_phase;
pub mod run;
pub mod train;
pub mod validate;
pub mod verify;

use crate::report::summary::Summary;
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};

/// The command line.
#[derive(Parser)]
#[command(
    name = "ckpt-harness",
    version,
    about = "Checkpoint-robustness harness for LLM training"
)]
pub struct Cli {
    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Every command, with its arguments.
#[derive(Subcommand)]
pub enum Command {
    /// Loss and gradients of a Hugging Face Llama on one batch; optionally N AdamW steps on it.
    #[command(after_help = exit_codes::plain_help())]
    Eval(eval::EvalArgs),
    /// Runs suites through train -> save -> resume -> resume past the end, and checks them.
    #[command(after_help = exit_codes::run_help())]
    Run(run::RunArgs),
    /// Judges runs by the suites' checks: with --records, runs recorded elsewhere
    /// (ckpt-record/1, docs/RECORD.md: another trainer's through the Python recorder, a cluster
    /// job's, `run`'s own records/); without, the suites' trainers run through their phases as
    /// `run` runs them (a suite's `engine: {command}` runs that command). Checks whose inputs a
    /// record lacks are reported not applicable.
    #[command(after_help = exit_codes::run_help())]
    Judge(judge::JudgeArgs),
    /// Lists the trials the suites hold, and which cannot run here.
    #[command(after_help = exit_codes::plain_help())]
    List(list::ListArgs),
    /// What the model sees at each step of a suite, without training: each micro-batch's shape
    /// and its rows' samples; with --tokens their text, the learned tokens marked.
    #[command(after_help = exit_codes::plain_help())]
    Batches(batches::BatchesArgs),
    /// Checks suite files without running them.
    #[command(after_help = exit_codes::validate_help())]
    Validate(validate::ValidateArgs),
    /// Trains a suite's model, saving checkpoints as the suite says and after its last step; one
    /// JSON line per step.
    #[command(after_help = exit_codes::train_help())]
    Train(train::TrainArgs),
    /// Runs one rank of a phase whose ranks are processes of their own (`parallel.processes`):
    /// started by `run`, one per rank, never by hand.
    #[command(hide = true)]
    RankPhase(rank_phase::RankPhaseArgs),
    /// Predicted memory of a training step, part by part and phase by phase.
    #[command(after_help = exit_codes::estimate_help())]
    Estimate(estimate::EstimateArgs),
    /// Checks checkpoints' files against their recorded sizes and checksums (XXH3-128, and sha256
    /// where recorded), printing each intact file's sha256.
    #[command(after_help = exit_codes::verify_help())]
    Verify(verify::VerifyArgs),
    /// Writes a checkpoint's weights in the Hugging Face layout (model.safetensors and
    /// config.json), assembling a sharded checkpoint's tensors whole from every rank's file.
    #[command(after_help = exit_codes::plain_help())]
    Export(export::ExportArgs),
    /// What changed from one run to another: checks newly failing or skipped, step peaks up
    /// more than 2%, step time up more than 10%, loss trajectories that moved, benchmark
    /// figures down more than 10%.
    #[command(after_help = exit_codes::diff_help())]
    Diff(diff::DiffArgs),
    /// Reports built from recorded runs.
    #[command(subcommand)]
    Report(ReportCommand),
}

/// The commands under `report`.
#[derive(Subcommand)]
pub enum ReportCommand {
    /// Merges the reports of a run split over machines (`run` per machine, or `cargo nextest
    /// run --partition` with CKPT_HARNESS_REPORT set) into one: summary.json, index.html and
    /// JUnit XML.
    #[command(after_help = exit_codes::merge_help())]
    Merge(merge::MergeArgs),
}

/// Where a run's (or a judging's) reports go, the baseline they are compared with, and the
/// golden snapshots.
#[derive(clap::Args)]
pub struct Reports {
    /// Where to write summary.json, index.html, each trial's record and the memory traces.
    #[arg(long, default_value = "report")]
    pub report: PathBuf,
    /// JUnit XML and the baseline.
    #[command(flatten)]
    pub verdicts: Verdicts,
    /// The golden snapshot directory [default: the nearest golden/ in or above each suite
    /// file's directory; without one, golden/ beside the directory of suites (where --bless
    /// creates it), whatever the working directory].
    #[arg(long)]
    pub golden: Option<PathBuf>,
}

/// What the verdicts of a run (or a judging, or a merge) are also written as, and what they
/// are compared with.
#[derive(clap::Args)]
pub struct Verdicts {
    /// Also write JUnit XML to this file.
    #[arg(long)]
    pub junit: Option<PathBuf>,
    /// The summary.json of an earlier run: say what changed against it.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    /// Exit 1 when something regressed against --baseline, even if every trial passed.
    #[arg(long, requires = "baseline")]
    pub fail_on_regression: bool,
}

/// The summary file `path` names: itself, or the `summary.json` in a directory.
pub fn summary_file(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("summary.json")
    } else {
        path.to_path_buf()
    }
}

/// The exit status of a run or merge: failed trials, or regressions when they must fail.
pub fn run_status(summary: &Summary, fail_on_regression: bool) -> u8 {
    let regressed = summary.trends.as_ref().is_some_and(|t| t.regressions() > 0);
    if summary.failed > 0 || (fail_on_regression && regressed) {
        exit_codes::FAILED
    } else {
        exit_codes::SUCCESS
    }
}

/// The suite paths given, or `suites/` when none is.
pub fn default_paths(paths: Vec<PathBuf>) -> Vec<PathBuf> {
    if paths.is_empty() {
        vec![PathBuf::from("suites")]
    } else {
        paths
    }
}
