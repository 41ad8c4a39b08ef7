//! `ckpt-harness estimate`: the memory model of a run as a table: the run as configured (what
//! `run` will measure, long rows included), then with activation checkpointing and the chunked
//! loss switched on one at a time and together, for the CPU or the CUDA backend; a suite's
//! budget checked against it; optionally next to the peaks measured on this machine's CPU.

use super::exit_codes;
use crate::checks::bytes as exact_bytes;
use crate::forecast::ladder::ladder;
use crate::forecast::Forecast;
use crate::suite::{Budget, ParallelSpec, Suite};
use anyhow::{bail, Context, Result};
use ckpt_engine::backend::count::{Like, Routes};
use ckpt_engine::estimate::{estimate, Estimate, EstimateConfig};
use ckpt_engine::memory::human_bytes;
use ckpt_engine::model::loss::LossKind;
use ckpt_engine::parallel::Shard;
use ckpt_engine::{Checkpointing, CpuDevice, DeviceKind, LlamaConfig, Precision};
use ckpt_engine::{TrainConfig, Trainer};
use clap::{Args, ValueEnum};
use std::io::Write;
use std::path::PathBuf;

mod limits;
mod steps;

/// The `estimate` subcommand's flags. The run comes from a suite, `--config`, `--llama-1b` or the
/// model flags; any flag given also overrides the run's value. The first column is the run as
/// configured; the others replace its checkpointing and loss.
#[derive(Args, Debug)]
pub struct EstimateArgs {
    /// A suite file whose run to estimate.
    #[arg(conflicts_with_all = ["config", "llama_1b"])]
    suite: Option<PathBuf>,
    /// A training configuration, as JSON in the engine's `TrainConfig` shape.
    #[arg(long, conflicts_with = "llama_1b")]
    config: Option<PathBuf>,
    /// Llama-3.2-1B's shape at batch 8 × 2048 tokens, bf16-mixed.
    #[arg(long)]
    llama_1b: bool,
    /// Vocabulary size.
    #[arg(long)]
    vocab: Option<usize>,
    /// Hidden (residual) width.
    #[arg(long)]
    hidden: Option<usize>,
    /// MLP width.
    #[arg(long)]
    ffn: Option<usize>,
    /// Decoder blocks.
    #[arg(long)]
    layers: Option<usize>,
    /// Query heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Key/value heads (default: as many as query heads).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Rows per batch.
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per row.
    #[arg(long)]
    seq: Option<usize>,
    /// Step arithmetic.
    #[arg(long, value_enum)]
    precision: Option<Precision>,
    /// Micro-batches per optimizer step.
    #[arg(long)]
    accumulation: Option<usize>,
    /// Data-parallel ranks, each a device of its own; the table is rank 0's (whose shards are
    /// the largest) and each rank's peaks follow it; a suite's plan runs every phase on them.
    #[arg(long)]
    world_size: Option<usize>,
    /// What the ranks shard.
    #[arg(long, value_enum)]
    shard: Option<Shard>,
    /// The backend whose allocations to model.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// The device's memory in bytes, against which a suite's budget given as a fraction is
    /// checked: a card this machine does not have (80000000000 for an 80 GB one). Default: the
    /// suite's `memory.capacity`.
    #[arg(long)]
    capacity: Option<u64>,
    /// The CPU device's worker threads (attention scratch is per thread); the suite's, else 1.
    #[arg(long)]
    threads: Option<usize>,
    /// The policy of the checkpointing columns.
    #[arg(long, value_enum, default_value_t = PolicyArg::Full)]
    checkpointing: PolicyArg,
    /// Tokens per chunk of the chunked-loss columns (at least 1).
    #[arg(long, default_value_t = 1024, value_parser = at_least_one)]
    chunk_tokens: usize,
    /// Exact byte counts instead of KiB/MiB/GiB.
    #[arg(long)]
    bytes: bool,
    /// Also train two steps of every column on this machine's CPU and print the measured peaks.
    #[arg(long)]
    measure: bool,
    /// The plan of a suite's every step as JSON (each phase's steps with each rank's predicted
    /// peak, the samples of every micro-batch, the evaluations) instead of the table.
    #[arg(long, requires = "suite", conflicts_with = "measure")]
    json: bool,
}

/// The checkpointing policy of the checkpointing columns, as a flag value.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum PolicyArg {
    /// Keep block inputs only.
    Full,
    /// Keep block inputs and matrix-product outputs.
    Selective,
}

/// Llama-3.2-1B's published shape (tied embeddings, 131072 positions).
fn llama_1b() -> LlamaConfig {
    LlamaConfig {
        head_dim: Some(64),
        rope_theta: 500000.0,
        tie_word_embeddings: true,
        max_position_embeddings: 131072,
        ..LlamaConfig::new(128256, 2048, 8192, 16, 32, 8)
    }
}

/// The run the flags describe (`suite` is the suite file's, when one is given).
fn run_config(a: &EstimateArgs, suite: Option<&Suite>) -> Result<TrainConfig> {
    let mut run = if let Some(s) = suite {
        s.train.clone()
    } else if let Some(path) = &a.config {
        let text = ckpt_engine::regular_file::read(path, "a TrainConfig JSON file")?;
        serde_json::from_slice(&text)
            .with_context(|| format!("{}: not a TrainConfig", path.display()))?
    } else if a.llama_1b {
        let mut run = TrainConfig::new(llama_1b(), 8, 2048);
        run.precision = Precision::Bf16Mixed;
        run
    } else {
        let need = |v: Option<usize>, flag: &str| {
            v.with_context(|| format!("--{flag} is required without --config or --llama-1b"))
        };
        let vocab_size = need(a.vocab, "vocab")?;
        let hidden_size = need(a.hidden, "hidden")?;
        let intermediate_size = need(a.ffn, "ffn")?;
        let num_hidden_layers = need(a.layers, "layers")?;
        let heads = need(a.heads, "heads")?;
        let model = LlamaConfig {
            max_position_embeddings: need(a.seq, "seq")?,
            ..LlamaConfig::new(
                vocab_size,
                hidden_size,
                intermediate_size,
                num_hidden_layers,
                heads,
                heads,
            )
        };
        TrainConfig::new(model, need(a.batch, "batch")?, need(a.seq, "seq")?)
    };
    let m = &mut run.model;
    let overrides = [
        (a.vocab, &mut m.vocab_size),
        (a.hidden, &mut m.hidden_size),
        (a.ffn, &mut m.intermediate_size),
        (a.layers, &mut m.num_hidden_layers),
        (a.heads, &mut m.num_attention_heads),
        (a.kv_heads, &mut m.num_key_value_heads),
        (a.batch, &mut run.batch_size),
        (a.seq, &mut run.seq_len),
        (a.accumulation, &mut run.accumulation),
        (a.world_size, &mut run.parallel.world_size),
    ];
    for (flag, slot) in overrides {
        if let Some(v) = flag {
            *slot = v;
        }
    }
    if let Some(p) = a.precision {
        run.precision = p;
    }
    if let Some(shard) = a.shard {
        run.parallel.shard = shard;
    }
    Ok(run)
}

/// One column: a run with a checkpointing policy and a loss kind.
struct Column {
    title: String,
    run: TrainConfig,
}

/// A loss kind as the column titles name it.
fn loss_name(loss: LossKind) -> String {
    match loss {
        LossKind::Standard => "standard loss".into(),
        LossKind::Chunked { chunk_tokens } => format!("chunked CE, {chunk_tokens} tokens"),
    }
}

/// A count of at least 1, for a flag where 0 would estimate an impossible run.
fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("0 chunks nothing; write at least 1, e.g. 1024".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!(
            "{text:?}: {e}; write a count of at least 1, e.g. 1024"
        )),
    }
}

/// The columns: baseline, +checkpointing, +chunked loss and both, the one the run is
/// configured as marked so; a run configured otherwise gets a column of its own first. Returns
/// the columns and the index of the configured one.
fn columns(a: &EstimateArgs, run: &TrainConfig) -> (Vec<Column>, usize) {
    let (policy, name) = match a.checkpointing {
        PolicyArg::Full => (Checkpointing::Full, "full"),
        PolicyArg::Selective => (Checkpointing::Selective, "selective"),
    };
    let chunked = LossKind::Chunked {
        chunk_tokens: a.chunk_tokens,
    };
    let mut cols: Vec<Column> = [
        (
            "baseline".to_string(),
            Checkpointing::None,
            LossKind::Standard,
        ),
        (
            format!("+checkpointing ({name})"),
            policy,
            LossKind::Standard,
        ),
        (
            format!("+chunked CE ({} tokens)", a.chunk_tokens),
            Checkpointing::None,
            chunked,
        ),
        ("both".to_string(), policy, chunked),
    ]
    .into_iter()
    .map(|(title, checkpointing, loss)| Column {
        title,
        run: TrainConfig {
            checkpointing,
            loss,
            ..run.clone()
        },
    })
    .collect();
    let configured = (run.checkpointing, run.loss);
    match cols
        .iter()
        .position(|c| (c.run.checkpointing, c.run.loss) == configured)
    {
        Some(i) => {
            cols[i].title.push_str(" = as configured");
            (cols, i)
        }
        None => {
            let title = format!(
                "as configured ({} checkpointing, {})",
                format!("{:?}", run.checkpointing).to_lowercase(),
                loss_name(run.loss)
            );
            let column = Column {
                title,
                run: run.clone(),
            };
            (std::iter::once(column).chain(cols).collect(), 0)
        }
    }
}

/// The table's rows: a label and the figure of each estimate.
type Row = (&'static str, fn(&Estimate) -> u64);

const ROWS: [Row; 17] = [
    ("params (weights + rotary tables)", |e| e.anatomy.params),
    ("master weights (f32)", |e| e.anatomy.master_weights),
    ("gradients (f32)", |e| e.anatomy.grads),
    ("AdamW moments (f32)", |e| e.anatomy.optimizer),
    ("saved activations per block", |e| e.anatomy.saved_per_block),
    ("saved activations, all blocks", |e| {
        e.anatomy.saved_activations
    }),
    ("recompute working set per block", |e| {
        e.anatomy.recompute_per_block
    }),
    ("logits (all tokens or one chunk)", |e| e.anatomy.logits),
    ("attention scratch", |e| e.anatomy.attention_scratch),
    ("workspace peak", |e| {
        e.later_step.peak_by_category.workspace
    }),
    ("peak of later steps: forward", |e| {
        e.later_step.phases.forward
    }),
    ("peak of later steps: loss", |e| e.later_step.phases.loss),
    ("peak of later steps: backward", |e| {
        e.later_step.phases.backward
    }),
    ("peak of the first step: optimizer", |e| {
        e.first_step.phases.optimizer
    }),
    ("**step peak, first step**", |e| e.first_step.peak),
    ("**step peak, later steps**", |e| e.later_step.peak),
    ("**step peak, long rows**", |e| {
        e.long_batch.as_ref().map_or(0, |l| l.later_step.peak)
    }),
];

/// A MoE run's step peaks at the routing that holds the most: every row sent to the same
/// `top_k` experts (the rows above are at balanced routing).
const MOE_BOUND_ROWS: [Row; 2] = [
    ("**step peak, later steps, any routing**", |e| {
        e.later_step.peak
    }),
    ("**step peak, long rows, any routing**", |e| {
        e.long_batch.as_ref().map_or(0, |l| l.later_step.peak)
    }),
];

/// The largest step peak a run reaches, and where: its later steps, its long rows, or another
/// rank's steps.
fn largest_peak(e: &Estimate) -> (u64, String) {
    let mut peak = (e.first_step.peak, "the first step".to_string());
    if e.later_step.peak > peak.0 {
        peak = (e.later_step.peak, "every step after the first".into());
    }
    for (rank, [first, later]) in e.ranks.iter().enumerate().skip(1) {
        if first.peak.max(later.peak) > peak.0 {
            peak = (first.peak.max(later.peak), format!("rank {rank}'s steps"));
        }
    }
    if let Some(long) = &e.long_batch {
        let long_peak = long.first_step.peak.max(long.later_step.peak);
        if long_peak > peak.0 {
            peak = (
                long_peak,
                format!("the long rows from step {}", long.from_step),
            );
        }
    }
    peak
}

/// Whether the suite's budget holds for the run as configured, in one line; a fraction is of
/// `capacity` bytes.
fn budget_verdict(
    suite: &Suite,
    kind: DeviceKind,
    (peak, at): (u64, String),
    load: u64,
    capacity: Option<u64>,
) -> Option<(bool, String)> {
    let limit = match (suite.budget()?, capacity) {
        (Budget::Bytes(b), _) => b,
        (fraction, Some(capacity)) => fraction.bytes(capacity),
        (Budget::Fraction(f), None) => {
            return Some((
                true,
                format!("budget: {f} of the {kind} device's memory, whose size this machine does not know; not checked (--capacity BYTES names it)"),
            ))
        }
    };
    Some(if peak <= limit && load <= limit {
        (
            true,
            format!(
                "budget {} on {kind}: holds (largest step peak {} at {at}; checkpoint load {})",
                exact_bytes(limit),
                exact_bytes(peak),
                exact_bytes(load)
            ),
        )
    } else {
        (
            false,
            format!(
                "budget {} on {kind}: EXCEEDED by {} at {at} (step peak {}, checkpoint load {}); the fix ladder above plans each change that could fix it (the columns, checkpointing and the chunked loss together), or raise memory.budget",
                exact_bytes(limit),
                exact_bytes(peak.max(load).saturating_sub(limit)),
                exact_bytes(peak),
                exact_bytes(load)
            ),
        )
    })
}

/// Whether each column's largest step peak (of any rank) and checkpoint load fit a device of
/// `capacity` bytes, one line a column.
fn fits(cols: &[Column], estimates: &[Estimate], capacity: u64) -> String {
    let mut text = format!("\nOn a device of {}:\n", exact_bytes(capacity));
    for (c, e) in cols.iter().zip(estimates) {
        let (peak, at) = largest_peak(e);
        let need = peak.max(e.checkpoint_io);
        let verdict = match need <= capacity {
            true => format!("fits, {} to spare", human_bytes(capacity - need)),
            false => format!("does not fit, {} over", human_bytes(need - capacity)),
        };
        text.push_str(&format!(
            "- {}: {verdict} (largest step peak {} at {at})\n",
            c.title,
            human_bytes(peak)
        ));
    }
    text
}

/// Each data-parallel rank's step peaks and what its later steps hold at the peak, for the run
/// as configured; nothing for one rank.
fn rank_table(e: &Estimate, exact: bool) -> String {
    if e.ranks.is_empty() {
        return String::new();
    }
    let p = &e.config.run.parallel;
    let mut rows = vec![[
        "rank",
        "first step",
        "later steps",
        "params",
        "grads",
        "optimizer",
        "activations",
        "workspace",
    ]
    .map(String::from)
    .to_vec()];
    for (rank, [first, later]) in e.ranks.iter().enumerate() {
        let at = later.at_peak;
        let mut row = vec![
            rank.to_string(),
            show(first.peak, exact),
            show(later.peak, exact),
        ];
        row.extend(
            [
                at.params,
                at.grads,
                at.optimizer,
                at.activations,
                at.workspace,
            ]
            .map(|b| show(b, exact)),
        );
        rows.push(row);
    }
    format!(
        "
{} ranks, shard {}: each rank's step peak and, for later steps, the bytes at the peak by category

{}",
        p.world_size,
        format!("{:?}", p.shard).to_lowercase(),
        markdown(&rows)
    )
}

/// `bytes` in binary units with two decimals, or exact.
fn show(bytes: u64, exact: bool) -> String {
    if exact || bytes < 1024 {
        return format!("{bytes} B");
    }
    let units = ["KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", units[unit])
}

/// Step peaks of the first and a later step, measured on the CPU.
fn measure(run: &TrainConfig, threads: usize) -> Result<[u64; 2]> {
    let dev = CpuDevice::new(threads, u64::MAX)?;
    let mut trainer = Trainer::new(run.clone(), dev)?;
    let first = trainer.step()?.memory.allocated.peak;
    let later = trainer.step()?.memory.allocated.peak;
    Ok([first, later])
}

/// A markdown table, columns padded to their widest cell.
fn markdown(rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let line = |r: &[String]| {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (cell, &w))| match i {
                0 => format!("{cell:<w$}"),
                _ => format!("{cell:>w$}"),
            })
            .collect();
        format!("| {} |\n", cells.join(" | "))
    };
    let rule: Vec<String> = widths
        .iter()
        .enumerate()
        .map(|(i, &w)| match i {
            0 => "-".repeat(w + 2),
            _ => format!("{}:", "-".repeat(w + 1)),
        })
        .collect();
    let mut out = line(&rows[0]);
    out.push_str(&format!("|{}|\n", rule.join("|")));
    rows[1..].iter().for_each(|r| out.push_str(&line(r)));
    out
}

/// What the subcommand prints, and whether the suite's budget holds.
pub struct Report {
    /// The header, the table and the budget's verdict.
    pub text: String,
    /// Whether the run as configured stays within the suite's budget (true without one).
    pub within_budget: bool,
}

/// Prints the table; exits [`exit_codes::FAILED`] when the run breaks the suite's budget.
pub fn exec(args: EstimateArgs) -> Result<u8> {
    let report = table(&args)?;
    write!(std::io::stdout(), "{}", report.text)?;
    Ok(if report.within_budget {
        exit_codes::SUCCESS
    } else {
        exit_codes::FAILED
    })
}

/// Builds the table the subcommand prints.
pub fn table(a: &EstimateArgs) -> Result<Report> {
    let suite = a.suite.as_deref().map(Suite::load).transpose()?;
    let threads = a
        .threads
        .or(suite.as_ref().map(|s| s.file.threads))
        .unwrap_or(1);
    if threads == 0 {
        bail!("--threads must be at least 1");
    }
    if a.device == DeviceKind::Cuda && a.measure {
        bail!("--measure trains on this machine's CPU; drop it or --device cuda");
    }
    let like = Like::new(a.device, threads);
    let run = run_config(a, suite.as_ref())?;
    limits::check(a, &run)?;
    let (cols, configured) = columns(a, &run);
    let estimates = cols
        .iter()
        .map(|c| estimate(&EstimateConfig::from_train(&c.run, like)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut rows = vec![std::iter::once(String::new())
        .chain(cols.iter().map(|c| c.title.clone()))
        .collect::<Vec<_>>()];
    let long_rows = run.long_batch.is_some();
    for (label, figure) in ROWS {
        if label.contains("long rows") && !long_rows {
            continue;
        }
        let cells = estimates.iter().map(|e| show(figure(e), a.bytes));
        rows.push(std::iter::once(label.to_string()).chain(cells).collect());
    }
    if run.model.moe.is_some() {
        // The rows above route every MoE layer evenly; a step's expert buffers depend on its
        // routing, and sending every row to the same experts is the most any routing holds.
        let bounds = cols
            .iter()
            .map(|c| {
                let cfg =
                    EstimateConfig::from_train(&c.run, like).with_routes(Routes::Concentrated);
                estimate(&cfg)
            })
            .collect::<Result<Vec<_>, _>>()?;
        for (label, figure) in MOE_BOUND_ROWS {
            if label.contains("long rows") && !long_rows {
                continue;
            }
            let cells = bounds.iter().map(|e| show(figure(e), a.bytes));
            rows.push(std::iter::once(label.to_string()).chain(cells).collect());
        }
    }
    rows.push(
        std::iter::once("checkpoint save / load".to_string())
            .chain(estimates.iter().map(|e| show(e.checkpoint_io, a.bytes)))
            .collect(),
    );
    if a.measure {
        let measured = cols
            .iter()
            .map(|c| measure(&c.run, threads))
            .collect::<Result<Vec<_>>>()?;
        for (i, label) in [
            "measured step peak, first step",
            "measured step peak, later steps",
        ]
        .into_iter()
        .enumerate()
        {
            let cells = measured.iter().map(|m| show(m[i], a.bytes));
            rows.push(
                std::iter::once(format!("**{label}**"))
                    .chain(cells)
                    .collect(),
            );
        }
    }
    let m = &run.model;
    let header = format!(
        "{} parameters (vocab {}, hidden {}, FFN {}, {} layers, {}/{} heads), batch {} × {} tokens{}, {}, {}\n\n",
        m.num_params(),
        m.vocab_size,
        m.hidden_size,
        m.intermediate_size,
        m.num_hidden_layers,
        m.num_attention_heads,
        m.num_key_value_heads,
        run.batch_size,
        run.seq_len,
        match run.accumulation {
            1 => String::new(),
            n => format!(" × {n} micro-batches per step"),
        },
        match run.precision {
            Precision::Fp32 => "fp32",
            Precision::Bf16Mixed => "bf16-mixed",
        },
        match like {
            Like::Cpu { threads } => format!("CPU, {threads} thread(s)"),
            Like::Cuda => "CUDA".to_string(),
        }
    );
    let experts = m.moe.as_ref().map_or(String::new(), |moe| {
        format!(
            "MoE: {} experts, top-{}, expert FFN {}; the peaks are at balanced routing unless the row says any routing

",
            moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size
        )
    });
    let mut text = header + &experts + &markdown(&rows);
    text.push_str(&rank_table(&estimates[configured], a.bytes));
    if let Some(capacity) = a.capacity {
        text.push_str(&fits(&cols, &estimates, capacity));
    }
    let Some(suite) = suite else {
        return Ok(Report {
            text,
            within_budget: true,
        });
    };
    // The plan follows the suite's phases over its data, in the run the flags make of it:
    // with --world-size, every phase on that many ranks.
    let mut planned = suite.clone();
    planned.train = run.clone();
    if a.world_size.is_some() {
        let p = &run.parallel;
        planned.file.parallel = Some(ParallelSpec {
            world_size: p.world_size,
            shard: p.shard,
            checkpoints: p.checkpoints,
            transport: p.transport,
            processes: false,
            resume_world_sizes: None,
        });
    }
    let forecast = Forecast::of(&planned, like)?;
    let capacity = a.capacity.or(suite.capacity());
    let limit = suite.budget().and_then(|b| match (b, capacity) {
        (Budget::Bytes(bytes), _) => Some(bytes),
        (fraction, Some(capacity)) => Some(fraction.bytes(capacity)),
        _ => None,
    });
    let largest = forecast
        .highest()
        .unwrap_or_else(|| largest_peak(&estimates[configured]));
    let verdict = budget_verdict(
        &suite,
        a.device,
        largest,
        estimates[configured].checkpoint_io,
        capacity,
    );
    let within_budget = verdict.as_ref().is_none_or(|(holds, _)| *holds);
    let rungs = match limit {
        Some(limit) => ladder(&planned, &forecast, like, &|_| limit)?,
        None => Vec::new(),
    };
    if a.json {
        let mut plan = steps::json(&forecast, limit)?;
        plan["ladder"] = serde_json::to_value(&rungs)?;
        return Ok(Report {
            text: format!("{plan}\n"),
            within_budget,
        });
    }
    text.push_str(&steps::section(&forecast, limit, a.bytes));
    text.push_str(&steps::ladder_section(&rungs, a.bytes));
    if let Some((_, line)) = &verdict {
        text.push_str(&format!("\n{line}\n"));
    }
    Ok(Report {
        text,
        within_budget,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: EstimateArgs,
    }

    fn args(flags: &[&str]) -> EstimateArgs {
        Cli::parse_from(std::iter::once("estimate").chain(flags.iter().copied())).args
    }

    /// With ranks, the table is rank 0's (its measured peaks equal it) and each rank's peaks
    /// follow; the ranks' shards of the optimizer state shrink with the world size.
    #[test]
    fn each_rank_s_peaks_are_listed_and_rank_0_s_are_measured() {
        let flags = |world: &'static str| {
            args(&[
                "--vocab",
                "37",
                "--hidden",
                "16",
                "--ffn",
                "24",
                "--layers",
                "2",
                "--heads",
                "4",
                "--batch",
                "1",
                "--seq",
                "8",
                "--accumulation",
                "4",
                "--world-size",
                world,
                "--shard",
                "optimizer",
                "--bytes",
                "--measure",
            ])
        };
        let text = table(&flags("4")).unwrap().text;
        assert!(text.contains("4 ranks, shard optimizer"), "{text}");
        let rank_rows: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("| ") && l[2..].starts_with(char::is_numeric))
            .collect();
        assert_eq!(rank_rows.len(), 4, "{text}");
        let cells = |line: &str| -> Vec<String> {
            line.split('|')
                .skip(2)
                .map(|c| c.trim().to_string())
                .filter(|c| !c.is_empty())
                .collect()
        };
        let row = |label: &str| cells(text.lines().find(|l| l.contains(label)).unwrap());
        assert_eq!(
            row("| **step peak, later steps**"),
            row("measured step peak, later steps")
        );
        let optimizer = |line: &str| cells(line)[4].clone();
        assert_ne!(
            optimizer(rank_rows[0]),
            optimizer(rank_rows[3]),
            "the last shard is short"
        );
        let one = table(&flags("1")).unwrap().text;
        assert!(!one.contains("ranks, shard"), "{one}");
    }

    /// With `--capacity`, each column says whether its largest step peak fits the device; full
    /// sharding over 4 ranks fits a device the unsharded run does not.
    #[test]
    fn each_column_says_whether_it_fits_the_capacity() {
        let run = |shard: &str, capacity: &str| {
            let flags = [
                "--vocab",
                "512",
                "--hidden",
                "64",
                "--ffn",
                "128",
                "--layers",
                "4",
                "--heads",
                "4",
                "--batch",
                "1",
                "--seq",
                "16",
                "--accumulation",
                "4",
                "--world-size",
                "4",
                "--shard",
                shard,
                "--capacity",
                capacity,
            ];
            table(&args(&flags)).unwrap().text
        };
        let verdicts = |text: &str| -> Vec<bool> {
            let lines = text
                .lines()
                .skip_while(|l| !l.starts_with("On a device of"));
            lines.skip(1).map(|l| l.contains(": fits,")).collect()
        };
        let roomy = run("none", "100000000");
        assert_eq!(verdicts(&roomy), [true; 4], "{roomy}");
        let none = run("none", "3000000");
        let full = run("full", "3000000");
        assert_eq!(verdicts(&none), [false; 4], "{none}");
        assert_eq!(verdicts(&full), [true; 4], "{full}");
        assert!(none.contains("does not fit,"), "{none}");
    }

    #[test]
    fn zero_tokens_per_chunk_is_refused_by_the_flag() {
        let flags = ["estimate", "--vocab", "64", "--chunk-tokens", "0"];
        let e = Cli::try_parse_from(flags).err().unwrap().to_string();
        assert!(e.contains("--chunk-tokens"), "{e}");
        assert!(e.contains("write at least 1"), "{e}");
    }

    #[test]
    fn measured_peaks_equal_the_estimate_in_every_column() {
        let a = args(&[
            "--vocab",
            "64",
            "--hidden",
            "16",
            "--ffn",
            "24",
            "--layers",
            "2",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--batch",
            "2",
            "--seq",
            "8",
            "--chunk-tokens",
            "4",
            "--bytes",
            "--measure",
            "--threads",
            "2",
        ]);
        let text = table(&a).unwrap().text;
        let row = |label: &str| -> Vec<String> {
            let line = text.lines().find(|l| l.contains(label)).unwrap();
            line.split('|')
                .skip(2)
                .map(|c| c.trim().to_string())
                .filter(|c| !c.is_empty())
                .collect()
        };
        assert_eq!(
            row("| **step peak, first step**"),
            row("measured step peak, first step")
        );
        assert_eq!(
            row("| **step peak, later steps**"),
            row("measured step peak, later steps")
        );
        let baseline = row("| **step peak, later steps**");
        assert_eq!(baseline.len(), 4);
        assert!(baseline.iter().all(|c| c.ends_with(" B")), "{text}");
    }

    #[test]
    fn a_config_file_is_read_and_flags_override_it() {
        let mut run = TrainConfig::new(llama_1b(), 2, 16);
        run.model.num_hidden_layers = 1;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.json");
        std::fs::write(&path, serde_json::to_string(&run).unwrap()).unwrap();
        let text = table(&args(&["--config", path.to_str().unwrap(), "--batch", "3"]))
            .unwrap()
            .text;
        assert!(text.contains("1 layers"), "{text}");
        assert!(text.contains("batch 3 × 16 tokens, fp32"), "{text}");
    }

    #[test]
    fn accumulation_is_named_beside_the_batch() {
        let mut run = TrainConfig::new(llama_1b(), 2, 16);
        run.model.num_hidden_layers = 1;
        run.accumulation = 3;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.json");
        std::fs::write(&path, serde_json::to_string(&run).unwrap()).unwrap();
        let text = table(&args(&["--config", path.to_str().unwrap()]))
            .unwrap()
            .text;
        assert!(
            text.contains("batch 2 × 16 tokens × 3 micro-batches per step, fp32"),
            "{text}"
        );
    }

    /// A world size that cannot share the step is refused naming the flags and a count that
    /// works, before anything is estimated.
    #[test]
    fn ranks_that_cannot_share_the_step_are_refused_naming_the_flags() {
        let err = |flags: &[&str]| table(&args(flags)).err().unwrap().to_string();
        let e = err(&["--llama-1b", "--world-size", "8"]);
        assert!(
            e.starts_with("--world-size is 8, which does not divide the step's 1 micro-batch (accumulation): each rank takes an equal run of them; write accumulation 8"),
            "{e}"
        );
        let e = err(&["--llama-1b", "--world-size", "3", "--accumulation", "4"]);
        assert!(e.contains("4 micro-batches (--accumulation)"), "{e}");
        assert!(
            e.contains("write --accumulation 6 (or another multiple of 3)"),
            "{e}"
        );
        let e = err(&["--llama-1b", "--world-size", "0"]);
        assert_eq!(
            e,
            "--world-size is 0; write the number of ranks, at least 1"
        );
        assert!(table(&args(&[
            "--llama-1b",
            "--world-size",
            "3",
            "--accumulation",
            "6"
        ]))
        .is_ok());
    }

    #[test]
    fn model_flags_are_required_without_a_preset() {
        let err = table(&args(&["--vocab", "64"])).err().unwrap().to_string();
        assert!(err.contains("--hidden is required"), "{err}");
    }

    #[test]
    fn the_cuda_backend_has_no_product_workspace() {
        let peak = |device: &str| {
            let text = table(&args(&["--llama-1b", "--bytes", "--device", device]))
                .unwrap()
                .text;
            let line = text
                .lines()
                .find(|l| l.starts_with("| **step peak, later steps**"))
                .unwrap()
                .to_string();
            (text, line)
        };
        let (cpu_text, cpu) = peak("cpu");
        let (cuda_text, cuda) = peak("cuda");
        assert!(
            cpu_text.contains("bf16-mixed, CPU, 1 thread(s)"),
            "{cpu_text}"
        );
        assert!(cuda_text.contains("bf16-mixed, CUDA"), "{cuda_text}");
        assert_ne!(cpu, cuda);
    }

    #[test]
    fn measuring_is_refused_for_cuda() {
        let err = table(&args(&["--llama-1b", "--device", "cuda", "--measure"]))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("--measure trains on this machine's CPU"),
            "{err}"
        );
    }

    #[test]
    fn the_preset_is_llama_3_2_1b() {
        let text = table(&args(&["--llama-1b"])).unwrap().text;
        assert!(text.starts_with("1235814400 parameters"), "{text}");
        assert!(text.contains("batch 8 × 2048 tokens, bf16-mixed"), "{text}");
    }
}
