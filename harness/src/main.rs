//! The `ckpt-harness` command-line tool.

use ckpt_engine::optim::AdamWConfig;
use ckpt_engine::{DeviceKind, Precision};
use ckpt_harness::plan::{self, DeviceChoice, TierFilter};
use ckpt_harness::suite::Suite;
use ckpt_harness::{eval, run_cmd, train_cmd};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

mod estimate_cmd;

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
    /// Trains a suite's model, saving checkpoints as the suite says; one JSON line per step.
    Train {
        /// The suite file.
        suite: PathBuf,
        /// Run directory for checkpoints.
        #[arg(long)]
        out: PathBuf,
        /// Continue from this checkpoint (or run directory, following its `latest`).
        #[arg(long)]
        resume: Option<PathBuf>,
        /// Train until this many steps are done (default: the suite's max_steps).
        #[arg(long)]
        steps: Option<u64>,
        /// The device to train on.
        #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
        device: DeviceKind,
    },
    /// Predicted memory of a training step, part by part and phase by phase.
    Estimate(estimate_cmd::EstimateArgs),
    /// Checks checkpoints' files against their recorded sizes, sha256 and XXH3-128 checksums.
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

/// Prints each file's verdict per checkpoint; exit status 1 if any file is damaged, 2 if a
/// checkpoint's state cannot be read.
fn verify(paths: &[PathBuf]) -> ExitCode {
    let (mut intact, mut damaged, mut unreadable) = (0, 0, 0);
    for path in paths {
        match ckpt_engine::checkpoint::verify(path) {
            Ok((dir, verdicts)) => {
                println!("{}", dir.display());
                let bad = verdicts.iter().filter(|v| v.problem.is_some()).count();
                for v in verdicts {
                    let size = format!("{} bytes", v.bytes);
                    match v.problem {
                        None => println!("  ok       {:<24} {size}", v.name),
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
    match (damaged, unreadable) {
        (0, 0) => ExitCode::SUCCESS,
        (_, 0) => ExitCode::from(1),
        _ => ExitCode::from(2),
    }
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
                precision,
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
            device,
        } => Suite::load(&suite)
            .and_then(|s| train_cmd::run(&s, device, &out, resume.as_deref(), steps)),
        Command::Estimate(args) => match estimate_cmd::table(&args) {
            Ok(report) => {
                print!("{}", report.text);
                if !report.within_budget {
                    return ExitCode::from(1);
                }
                Ok(())
            }
            Err(e) => Err(e),
        },
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
