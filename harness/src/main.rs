//! The `ckpt-harness` command-line tool.

use ckpt_engine::optim::AdamWConfig;
use ckpt_engine::trainer::Precision;
use ckpt_harness::plan::{self, DeviceChoice, TierFilter};
use ckpt_harness::suite::Suite;
use ckpt_harness::{eval, run_cmd, train_cmd};
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;

mod estimate_cmd;

/// Exit statuses of `verify` (2 is also every command's status on bad input).
mod exit_status {
    /// Every checkpoint verified is intact.
    pub const INTACT: u8 = 0;
    /// Something verified is damaged (a file, the state file, or a run's `latest`).
    pub const DAMAGED: u8 = 1;
    /// Bad usage or nothing to verify (and nothing damaged): a path that does not exist, that is
    /// neither a checkpoint nor a run directory, or a checkpoint written by a newer build.
    pub const USAGE: u8 = 2;
    /// The statuses as `verify --help` lists them.
    pub const VERIFY_HELP: &str = "Exit status:
  0  every checkpoint is intact
  1  something is damaged: a file, the state file, or a run's latest pointer
  2  nothing damaged, but bad usage or nothing to verify: a path that does not exist, is
     neither a checkpoint nor a run directory, or holds a checkpoint of a newer build";
}

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

#[derive(Clone, Copy, ValueEnum)]
enum PrecisionArg {
    Fp32,
    Bf16Mixed,
}

#[derive(Subcommand)]
enum Command {
    /// Loss and gradients of a Hugging Face Llama on one batch; optionally N AdamW steps on it.
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
        #[arg(long, value_enum, default_value_t = PrecisionArg::Fp32)]
        precision: PrecisionArg,
        /// Worker threads (0 = one per core).
        #[arg(long, default_value_t = 0)]
        threads: usize,
    },
    /// Runs suites through train -> save -> resume -> resume past the end, and checks them.
    Run {
        /// Suite files or directories; a directory's faults/ holds negative controls (default:
        /// suites/).
        paths: Vec<PathBuf>,
        /// Devices: each suite's that are present (auto), or one.
        #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
        device: DeviceChoice,
        /// Tiers to run.
        #[arg(long, value_enum, default_value_t = TierFilter::Ci)]
        tier: TierFilter,
        /// Where to write summary.json.
        #[arg(long, default_value = "report")]
        report: PathBuf,
        /// Also write JUnit XML to this file.
        #[arg(long)]
        junit: Option<PathBuf>,
        /// The golden snapshot directory.
        #[arg(long, default_value = "golden")]
        golden: PathBuf,
        /// Rewrite the golden snapshots from this run.
        #[arg(long)]
        bless: bool,
    },
    /// Lists the trials the suites hold, and which cannot run here.
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
    Validate {
        /// Suite files or directories.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Trains a suite's model, saving checkpoints as the suite says and after its last step; one
    /// JSON line per step.
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
    },
    /// Predicted memory of a training step, part by part and phase by phase.
    Estimate(estimate_cmd::EstimateArgs),
    /// Checks checkpoints' files against their recorded sizes, sha256 and XXH3-128 checksums.
    #[command(after_help = exit_status::VERIFY_HELP)]
    Verify {
        /// Checkpoint directories, or run directories (their `latest` is checked).
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
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

fn list(paths: &[PathBuf], tier: TierFilter, device: DeviceChoice) -> anyhow::Result<()> {
    let suites = plan::load(&plan::files(paths)?)?;
    for p in plan::plan(&suites, tier, device)? {
        let s = &suites[p.suite];
        let state = p
            .skip
            .map_or("runs".to_string(), |why| format!("skipped: {why}"));
        println!(
            "{:<40} {:<8} {}  {state}",
            p.name,
            format!("{:?}", s.file.tier).to_lowercase(),
            s.path.display()
        );
    }
    Ok(())
}

fn validate(paths: &[PathBuf]) -> ExitCode {
    let files = match plan::files(paths) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    };
    let mut bad = 0;
    for f in &files {
        match Suite::load(f) {
            Ok(_) => println!("ok {}", f.display()),
            Err(e) => {
                bad += 1;
                eprintln!("error: {e:#}");
            }
        }
    }
    println!("{} valid, {bad} invalid", files.len() - bad);
    if bad == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    }
}

/// Prints each file's verdict per checkpoint; exits with [`exit_status::DAMAGED`] if anything is
/// damaged, else [`exit_status::USAGE`] if a path held nothing to verify.
fn verify(paths: &[PathBuf]) -> ExitCode {
    let (mut intact, mut damaged, mut unreadable) = (0, 0, 0);
    for path in paths {
        match ckpt_engine::checkpoint::verify(path) {
            Ok((dir, verdicts)) => {
                println!("{}", dir.display());
                let bad = verdicts.iter().filter(|v| v.problem.is_some()).count();
                for v in verdicts {
                    let size = format!("{} bytes", v.bytes);
                    let note = v.note.map(|n| format!(" ({n})")).unwrap_or_default();
                    match v.problem {
                        None => println!("  ok       {:<24} {size}{note}", v.name),
                        Some(why) => println!("  DAMAGED  {:<24} {size}: {why}", v.name),
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
    println!("{intact} intact, {damaged} damaged, {unreadable} unreadable");
    ExitCode::from(match (damaged, unreadable) {
        (0, 0) => exit_status::INTACT,
        (0, _) => exit_status::USAGE,
        _ => exit_status::DAMAGED,
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
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
                precision: match precision {
                    PrecisionArg::Fp32 => Precision::Fp32,
                    PrecisionArg::Bf16Mixed => Precision::Bf16Mixed,
                },
                threads,
            };
            eval::run(&req)
                .map(|r| println!("{}", serde_json::to_string(&r).expect("plain numbers")))
        }
        Command::Run {
            paths,
            device,
            tier,
            report,
            junit,
            golden,
            bless,
        } => {
            let opts = run_cmd::RunOptions {
                paths: default_paths(paths),
                device,
                tier,
                report,
                junit,
                golden,
                bless,
            };
            match run_cmd::run(&opts) {
                Ok(summary) if summary.failed == 0 => Ok(()),
                Ok(_) => return ExitCode::from(1),
                Err(e) => Err(e),
            }
        }
        Command::List {
            paths,
            device,
            tier,
        } => list(&default_paths(paths), tier, device),
        Command::Validate { paths } => return validate(&paths),
        Command::Train {
            suite,
            out,
            resume,
            steps,
            overwrite,
        } => {
            let opts = train_cmd::TrainOptions {
                out: &out,
                resume: resume.as_deref(),
                steps,
                overwrite,
            };
            Suite::load(&suite).and_then(|s| train_cmd::run(&s, &opts))
        }
        Command::Estimate(args) => estimate_cmd::table(&args).map(|t| print!("{t}")),
        Command::Verify { paths } => return verify(&paths),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
