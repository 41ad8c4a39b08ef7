//! The `ckpt-harness` command-line tool.

use anyhow::Result;
use ckpt_engine::optim::AdamWConfig;
use ckpt_engine::{DeviceKind, Precision};
use ckpt_harness::bench::Bench;
use ckpt_harness::cli::{estimate, eval, judge, run, train};
use ckpt_harness::meeting::MeetAt;
use ckpt_harness::plan::{self, DeviceChoice, TierFilter};
use ckpt_harness::progress::Style;
use ckpt_harness::report::Summary;
use ckpt_harness::suite::Suite;
use ckpt_harness::{error_text, exit_codes, merge};
use clap::{Parser, Subcommand};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "ckpt-harness",
    version,
    about = "Checkpoint-robustness harness for LLM training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Loss and gradients of a Hugging Face Llama on one batch; optionally N AdamW steps on it.
    #[command(after_help = exit_codes::plain_help())]
    Eval {
        /// Hugging Face Llama directory (config.json + model.safetensors).
        #[arg(long)]
        model: PathBuf,
        /// safetensors file with `input_ids` and `labels` ([B, T] int64, -100 ignored).
        #[arg(long)]
        batch: PathBuf,
        /// Write `grad.<name>` (and `after_adamw.<name>`) tensors to this safetensors file.
        #[arg(long)]
        grads_out: Option<PathBuf>,
        /// AdamW steps to take on the batch; prints the loss before each.
        #[arg(long, default_value_t = 0)]
        adamw_steps: usize,
        /// Learning rate of the AdamW steps (constant).
        #[arg(long, default_value_t = 1e-3)]
        lr: f64,
        /// Decoupled weight decay, on every parameter.
        #[arg(long, default_value_t = 0.01)]
        weight_decay: f64,
        /// β₁,β₂.
        #[arg(long, value_parser = parse_betas, default_value = "0.9,0.999")]
        betas: [f64; 2],
        /// Denominator epsilon.
        #[arg(long, default_value_t = 1e-8)]
        eps: f64,
        /// Step arithmetic.
        #[arg(long, value_enum, default_value_t = Precision::Fp32)]
        precision: Precision,
        /// Worker threads (0 = one per core).
        #[arg(long, default_value_t = 0)]
        threads: usize,
    },
    /// Runs suites through train -> save -> resume -> resume past the end, and checks them.
    #[command(after_help = exit_codes::run_help())]
    Run {
        /// Suite files or directories; a directory's faults/ holds negative controls (default:
        /// suites/).
        paths: Vec<PathBuf>,
        /// Devices: each suite's that are present (auto), or one.
        #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
        device: DeviceChoice,
        /// Tiers to run from directories (a suite file named runs whatever its tier).
        #[arg(long, value_enum, default_value_t = TierFilter::Ci)]
        tier: TierFilter,
        #[command(flatten)]
        reports: Reports,
        /// Write every phase's allocations and frees as PyTorch memory snapshots
        /// (REPORT/memory/<trial>/<phase>.pickle).
        #[arg(long)]
        memory_trace: bool,
        /// The benchmarks' figures measured with this run (`scripts/bench.sh --json FILE`): put
        /// in summary.json and index.html, compared with --baseline's.
        #[arg(long)]
        bench: Option<PathBuf>,
        /// Rewrite the golden snapshots from this run.
        #[arg(long)]
        bless: bool,
        /// Run each trial N times: report the per-step spread of losses, gradient norms and
        /// peaks, and the loss_continuity tolerance it calls for; a trial passes only when
        /// every run does.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
        repeat: u16,
    },
    /// Judges runs by the suites' checks: with --records, runs recorded elsewhere
    /// (ckpt-record/1, docs/RECORD.md: another trainer's through the Python recorder, a cluster
    /// job's, `run`'s own records/); without, the suites' trainers run through their phases as
    /// `run` runs them (a suite's `engine: {command}` runs that command). Checks whose inputs a
    /// record lacks are reported not applicable.
    #[command(after_help = exit_codes::run_help())]
    Judge {
        /// Suite files or directories: the trials to judge and their checks (default: suites/).
        paths: Vec<PathBuf>,
        /// The directory of records, `<trial>.jsonl` each (`cpu::tiny` is `cpu.tiny.jsonl`).
        #[arg(long)]
        records: Option<PathBuf>,
        #[command(flatten)]
        reports: Reports,
    },
    /// Lists the trials the suites hold, and which cannot run here.
    #[command(after_help = exit_codes::plain_help())]
    List {
        /// Suite files or directories (default: suites/).
        paths: Vec<PathBuf>,
        /// Devices to list.
        #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
        device: DeviceChoice,
        /// Tiers to list.
        #[arg(long, value_enum, default_value_t = TierFilter::All)]
        tier: TierFilter,
    },
    /// Checks suite files without running them.
    #[command(after_help = exit_codes::validate_help())]
    Validate {
        /// Suite files or directories.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Trains a suite's model, saving checkpoints as the suite says and after its last step; one
    /// JSON line per step.
    #[command(after_help = exit_codes::train_help())]
    Train {
        /// The suite file.
        suite: PathBuf,
        /// Run directory for checkpoints.
        #[arg(long)]
        out: PathBuf,
        /// Continue from this checkpoint (or run directory, following its `latest`).
        #[arg(long)]
        resume: Option<PathBuf>,
        /// Train until this many steps are done (default: the suite's max_steps). The last step
        /// trained is always saved.
        #[arg(long)]
        steps: Option<u64>,
        /// Delete the checkpoints of another configuration that --out holds, instead of
        /// refusing to train into it.
        #[arg(long)]
        overwrite: bool,
        /// The device to train on.
        #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
        device: DeviceKind,
        /// Train only rank RANK of the suite's `parallel.world_size` ranks, each rank a `train`
        /// of its own, started with the same arguments and its own --rank (as torchrun starts
        /// them); the ranks meet at --meet or through --meet-file.
        #[arg(long, requires = "meeting")]
        rank: Option<usize>,
        /// Where the ranks of --rank meet (HOST:PORT): rank 0 listens there, every other rank
        /// connects to it.
        #[arg(long, group = "meeting", requires = "rank")]
        meet: Option<std::net::SocketAddr>,
        /// A file through which the ranks of --rank, all on this machine, meet: rank 0 listens
        /// at a port of the loopback the system gives it and writes its address there, the
        /// other ranks read it (no port to choose). It must not exist when the ranks start.
        #[arg(long, group = "meeting", requires = "rank")]
        meet_file: Option<PathBuf>,
    },
    /// Runs one rank of a phase whose ranks are processes of their own (`parallel.processes`):
    /// started by `run`, one per rank, never by hand.
    #[command(hide = true)]
    RankPhase {
        /// The phase's job file, written by `run`.
        job: PathBuf,
        /// The rank to run.
        #[arg(long)]
        rank: usize,
        /// Where to write the phase as this rank saw it.
        #[arg(long)]
        out: PathBuf,
    },
    /// Predicted memory of a training step, part by part and phase by phase.
    #[command(after_help = exit_codes::estimate_help())]
    Estimate(estimate::EstimateArgs),
    /// Checks checkpoints' files against their recorded sizes and checksums (XXH3-128, and sha256
    /// where recorded), printing each intact file's sha256.
    #[command(after_help = exit_codes::verify_help())]
    Verify {
        /// Checkpoint directories, or run directories (their `latest` is checked).
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Writes a checkpoint's weights in the Hugging Face layout (model.safetensors and
    /// config.json), assembling a sharded checkpoint's tensors whole from every rank's file.
    #[command(after_help = exit_codes::plain_help())]
    Export {
        /// A checkpoint directory, or a run directory (its `latest` is exported).
        checkpoint: PathBuf,
        /// The directory to write; it must not exist or be empty.
        #[arg(long)]
        out: PathBuf,
    },
    /// What changed from one run to another: checks newly failing or skipped, step peaks up
    /// more than 2%, step time up more than 10%, loss trajectories that moved, benchmark
    /// figures down more than 10%.
    #[command(after_help = exit_codes::diff_help())]
    Diff {
        /// The earlier run's summary.json (or its report directory).
        old: PathBuf,
        /// The later run's summary.json (or its report directory).
        new: PathBuf,
    },
    /// Reports built from recorded runs.
    #[command(subcommand)]
    Report(ReportCommand),
}

/// Where a run's (or a judging's) reports go, the baseline they are compared with, and the
/// golden snapshots.
#[derive(clap::Args)]
struct Reports {
    /// Where to write summary.json, index.html, each trial's record and the memory traces.
    #[arg(long, default_value = "report")]
    report: PathBuf,
    /// Also write JUnit XML to this file.
    #[arg(long)]
    junit: Option<PathBuf>,
    /// The summary.json of an earlier run: say what changed against it.
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// Exit 1 when something regressed against --baseline, even if every trial passed.
    #[arg(long, requires = "baseline")]
    fail_on_regression: bool,
    /// The golden snapshot directory [default: the nearest golden/ in or above each suite
    /// file's directory; without one, golden/ beside the directory of suites (where --bless
    /// creates it), whatever the working directory].
    #[arg(long)]
    golden: Option<PathBuf>,
}

#[derive(Subcommand)]
enum ReportCommand {
    /// Merges the reports of a run split over machines (`run` per machine, or `cargo nextest
    /// run --partition` with CKPT_HARNESS_REPORT set) into one: summary.json, index.html and
    /// JUnit XML.
    #[command(after_help = exit_codes::merge_help())]
    Merge {
        /// Report directories, each holding a summary.json or trials/*.json.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        /// Where to write the merged report.
        #[arg(long, default_value = "report")]
        out: PathBuf,
        /// Also write JUnit XML to this file.
        #[arg(long)]
        junit: Option<PathBuf>,
        /// The summary.json of an earlier run: say what changed against it.
        #[arg(long)]
        baseline: Option<PathBuf>,
        /// Exit 1 when something regressed against --baseline, even if every trial passed.
        #[arg(long, requires = "baseline")]
        fail_on_regression: bool,
        /// The benchmarks' figures measured with the run (`scripts/bench.sh --json FILE`), in
        /// place of those a merged summary carries.
        #[arg(long)]
        bench: Option<PathBuf>,
    },
}

/// The summary file `path` names: itself, or the `summary.json` in a directory.
fn summary_file(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("summary.json")
    } else {
        path.to_path_buf()
    }
}

/// The exit status of a run or merge: failed trials, or regressions when they must fail.
fn run_status(summary: &Summary, fail_on_regression: bool) -> u8 {
    let regressed = summary.trends.as_ref().is_some_and(|t| t.regressions() > 0);
    if summary.failed > 0 || (fail_on_regression && regressed) {
        exit_codes::FAILED
    } else {
        exit_codes::SUCCESS
    }
}

fn parse_betas(text: &str) -> Result<[f64; 2], String> {
    let parts: Vec<&str> = text.split(',').collect();
    let [a, b] = parts.as_slice() else {
        return Err(format!("expected two numbers like 0.9,0.95, got {text:?}"));
    };
    let num = |s: &str| s.trim().parse::<f64>().map_err(|e| format!("{s:?}: {e}"));
    Ok([num(a)?, num(b)?])
}

fn default_paths(paths: Vec<PathBuf>) -> Vec<PathBuf> {
    if paths.is_empty() {
        vec![PathBuf::from("suites")]
    } else {
        paths
    }
}

fn list(paths: &[PathBuf], tier: TierFilter, device: DeviceChoice) -> Result<u8> {
    let suites = plan::load(&plan::files(paths)?)?;
    let mut out = std::io::stdout().lock();
    for p in plan::plan(&suites, paths, tier, device)? {
        let s = &suites[p.suite];
        let state = p
            .skip
            .map_or("runs".to_string(), |why| format!("skipped: {why}"));
        writeln!(
            out,
            "{:<40} {:<8} {}  {state}",
            p.name,
            format!("{:?}", s.file.tier).to_lowercase(),
            s.path.display()
        )?;
    }
    Ok(exit_codes::SUCCESS)
}

fn validate(paths: &[PathBuf]) -> Result<u8> {
    let files = plan::files(paths)?;
    let mut out = std::io::stdout().lock();
    let mut bad = 0;
    let mut valid = Vec::new();
    for f in &files {
        match plan::load_one(f).and_then(|s| s.check_run().map(|()| s)) {
            Ok(suite) => {
                writeln!(out, "ok {}", f.display())?;
                valid.push(suite);
            }
            Err(e) => {
                bad += 1;
                eprintln!("error: {}", error_text::one_line(&e));
            }
        }
    }
    if let Err(e) = plan::unique_names(&valid) {
        bad += 1;
        eprintln!("error: {e}");
    }
    writeln!(out, "{} valid, {bad} invalid", files.len() - bad)?;
    Ok(if bad == 0 {
        exit_codes::SUCCESS
    } else {
        exit_codes::INVALID
    })
}

/// Prints each file's verdict per checkpoint; exits with [`exit_codes::FAILED`] if anything is
/// damaged, else [`exit_codes::INVALID`] if a path held nothing to verify.
fn verify(paths: &[PathBuf]) -> Result<u8> {
    let mut out = std::io::stdout().lock();
    let (mut intact, mut damaged, mut unreadable) = (0, 0, 0);
    for path in paths {
        match ckpt_engine::checkpoint::verify(path) {
            Ok((dir, verdicts)) => {
                writeln!(out, "{}", dir.display())?;
                let bad = verdicts.iter().filter(|v| v.problem.is_some()).count();
                for v in verdicts {
                    let size = format!("{} bytes", v.bytes);
                    let sha256 = v.sha256.map(|s| format!(", sha256 {s}"));
                    let note = v.note.map(|n| format!(" ({n})"));
                    let note = sha256.unwrap_or_default() + &note.unwrap_or_default();
                    match v.problem {
                        None => writeln!(out, "  ok       {:<24} {size}{note}", v.name)?,
                        Some(why) => writeln!(out, "  DAMAGED  {:<24} {size}: {why}", v.name)?,
                    }
                }
                if bad == 0 {
                    intact += 1;
                } else {
                    damaged += 1;
                }
            }
            Err(e) => {
                unreadable += 1;
                eprintln!("error: {e}");
            }
        }
    }
    writeln!(
        out,
        "{intact} intact, {damaged} damaged, {unreadable} unreadable"
    )?;
    Ok(match (damaged, unreadable) {
        (0, 0) => exit_codes::SUCCESS,
        (0, _) => exit_codes::INVALID,
        _ => exit_codes::FAILED,
    })
}

/// Whether `e` is a write to a closed standard output.
fn broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Runs `command`; its exit status, or the error that stopped it.
fn dispatch(command: Command) -> Result<u8> {
    match command {
        Command::Eval {
            model,
            batch,
            grads_out,
            adamw_steps,
            lr,
            weight_decay,
            betas,
            eps,
            precision,
            threads,
        } => {
            let req = eval::EvalRequest {
                model,
                batch,
                grads_out,
                adamw_steps,
                adamw: AdamWConfig {
                    lr,
                    betas,
                    eps,
                    weight_decay,
                    grad_clip: None,
                },
                precision,
                threads,
            };
            let result = eval::run(&req)?;
            let line = serde_json::to_string(&result)?;
            writeln!(std::io::stdout(), "{line}")?;
            Ok(exit_codes::SUCCESS)
        }
        Command::Run {
            paths,
            device,
            tier,
            reports,
            memory_trace,
            bench,
            bless,
            repeat,
        } => {
            let stdout = std::io::stdout();
            let progress = Style::detect(stdout.is_terminal(), std::env::var_os("CI").as_deref());
            let opts = run::RunOptions {
                paths: default_paths(paths),
                device,
                tier,
                report: reports.report,
                junit: reports.junit,
                golden: reports.golden,
                bless,
                progress,
                memory_trace,
                baseline: reports.baseline.as_deref().map(summary_file),
                bench,
                repeat: repeat.into(),
            };
            let summary = run::run(&opts, &mut stdout.lock())?;
            Ok(run_status(&summary, reports.fail_on_regression))
        }
        Command::Judge {
            paths,
            records: None,
            reports,
        } => dispatch(Command::Run {
            paths,
            device: DeviceChoice::Auto,
            tier: TierFilter::Ci,
            reports,
            memory_trace: false,
            bench: None,
            bless: false,
            repeat: 1,
        }),
        Command::Judge {
            paths,
            records: Some(records),
            reports,
        } => {
            let opts = judge::JudgeOptions {
                paths: default_paths(paths),
                records,
                report: reports.report,
                junit: reports.junit,
                golden: reports.golden,
                baseline: reports.baseline.as_deref().map(summary_file),
            };
            let summary = judge::judge(&opts, &mut std::io::stdout().lock())?;
            Ok(run_status(&summary, reports.fail_on_regression))
        }
        Command::Diff { old, new } => {
            let (old, new) = (summary_file(&old), summary_file(&new));
            let trends = run::trends(&old, &Summary::read(&old)?, &Summary::read(&new)?);
            write!(
                std::io::stdout(),
                "{}",
                error_text::printable(&trends.text())
            )?;
            Ok(if trends.regressions() > 0 {
                exit_codes::FAILED
            } else {
                exit_codes::SUCCESS
            })
        }
        Command::Report(ReportCommand::Merge {
            dirs,
            out,
            junit,
            baseline,
            fail_on_regression,
            bench,
        }) => {
            let old = baseline
                .as_deref()
                .map(summary_file)
                .map(|f| Summary::read(&f).map(|s| (f, s)))
                .transpose()?;
            let bench = bench.as_deref().map(Bench::read).transpose()?;
            let mut summary = merge::merge(&dirs)?;
            if bench.is_some() {
                summary.bench = bench;
            }
            let mut text = summary.table();
            if let Some((file, old)) = &old {
                let t = run::trends(file, old, &summary);
                text.push_str(&t.text());
                summary.trends = Some(t);
            }
            run::write_reports(&summary, &out, junit.as_deref())?;
            write!(std::io::stdout(), "{}", error_text::printable(&text))?;
            Ok(run_status(&summary, fail_on_regression))
        }
        Command::List {
            paths,
            device,
            tier,
        } => list(&default_paths(paths), tier, device),
        Command::Validate { paths } => validate(&paths),
        Command::Train {
            suite,
            out,
            resume,
            steps,
            overwrite,
            device,
            rank,
            meet,
            meet_file,
        } => {
            let suite = Suite::load(&suite)?;
            let opts = train::TrainOptions {
                out: &out,
                resume: resume.as_deref(),
                steps,
                overwrite,
                device,
                rank: rank
                    .zip(meet.map(MeetAt::Address).or(meet_file.map(MeetAt::File)))
                    .map(|(rank, meet)| train::RankOf { rank, meet }),
            };
            train::run(&suite, &opts)?;
            Ok(exit_codes::SUCCESS)
        }
        Command::RankPhase { job, rank, out } => {
            ckpt_harness::phases::processes::serve(&job, rank, &out)?;
            Ok(exit_codes::SUCCESS)
        }
        Command::Estimate(args) => {
            let report = estimate::table(&args)?;
            write!(std::io::stdout(), "{}", report.text)?;
            Ok(if report.within_budget {
                exit_codes::SUCCESS
            } else {
                exit_codes::FAILED
            })
        }
        Command::Verify { paths } => verify(&paths),
        Command::Export { checkpoint, out } => {
            let dir = ckpt_engine::checkpoint::export(&checkpoint, &out)?;
            println!(
                "exported {} to {}: {} and {}",
                dir.display(),
                out.display(),
                ckpt_engine::checkpoint::MODEL_FILE,
                ckpt_engine::checkpoint::CONFIG_FILE
            );
            Ok(exit_codes::SUCCESS)
        }
    }
}

fn main() -> ExitCode {
    ckpt_harness::host_memory::limit_malloc_arenas();
    let cli = Cli::parse();
    match dispatch(cli.command) {
        Ok(code) => ExitCode::from(code),
        Err(e) if broken_pipe(&e) => ExitCode::from(exit_codes::BROKEN_PIPE),
        Err(e) => {
            eprintln!(
                "error: {}",
                error_text::printable(&error_text::one_line(&e))
            );
            let stopped = e.downcast_ref::<train::Stopped>().is_some();
            ExitCode::from(if stopped {
                exit_codes::FAILED
            } else {
                exit_codes::INVALID
            })
        }
    }
}
