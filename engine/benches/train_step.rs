//! Training throughput: builds a [`Trainer`] for a benchmark model, runs a few warmup steps,
//! times the rest, and prints one JSON object: the median step time, tokens/s, the CPU time a
//! step takes (Linux) and the peak of tracked bytes for each checkpointing policy asked for.
//!
//! Models: `bench` (the CPU benchmark: vocab 4096, hidden 256, 4 layers, 8 heads, 4 KV heads,
//! FFN 688, batch 8 × 256 tokens) and `llama-1b` (Llama-3.2-1B's shape: vocab 128256, hidden
//! 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, tied embeddings, batch 8 × 2048 tokens, as
//! `scripts/bench_gpu_torch.py` runs it). On `--device cuda` it also reports the memory pool's
//! high-water mark and the model-FLOPs utilisation against `--peak-tflops` (the card's dense
//! bf16 peak; H100 SXM: 989), counted as `bench_gpu_torch.py` counts it. On the CPU it reports
//! the CPU's fp32 peak instead (`cpu_peak_gflops`: fused multiply-adds in the products' vector
//! instructions on `--threads` threads at once, measured before the steps) and the step's FLOPs,
//! counted the same way, as a fraction of it (`fraction_of_cpu_peak`).
//!
//! ```text
//! cargo bench -p ckpt-engine --bench train_step -- [--device cpu|cuda] [--model bench|llama-1b]
//!     [--batch N] [--seq N] [--layers N] [--threads N] [--steps N] [--warmup N]
//!     [--checkpointing none,full] [--precision fp32|bf16-mixed] [--loss standard|chunked:N]
//!     [--peak-tflops X] [--loops widest|avx2|baseline] [--world N] [--shard none|gradients|full]
//!     [--data synthetic|squad]
//! ```
//! The first options can also be given as environment variables (`BENCH_THREADS`,
//! `BENCH_STEPS`, `BENCH_WARMUP`, `BENCH_CHECKPOINTING`, `BENCH_PRECISION`, `BENCH_LOSS`);
//! arguments win. With more than one policy the output also holds each policy's step time over
//! the first one's. On the CPU, `CKPT_CPU_BF16_PRODUCTS=dot` multiplies bf16 with the bf16
//! dot-product instruction, as it does in runs; `cpu_kernels` in the output says so. `--loops`
//! holds the engine's own loops (all but the matrix products) to narrower vector instructions
//! than the CPU's widest, with the same bits (`CpuDevice::limit_vector_isa`); `cpu_loops` in the
//! output says which ran. `--world N` trains data-parallel over N ranks (`--shard` says what
//! they shard; on the CPU each rank has `--threads` / N threads): the step's batch is cut into N
//! micro-batches of `batch` / N rows, so a step holds the same tokens as on one rank.
//! `--data squad` trains on real fine-tuning text instead of the synthetic chain: the fixture
//! conversations (`suites/data/squad-sft.jsonl`, its tokenizer, answer-only labels), every row
//! padded to `seq` (samples cut there), so a step has the synthetic one's shape.

use ckpt_engine::backend::cpu::bf16_dot::Bf16Products;
use ckpt_engine::backend::cpu::{peak, VectorIsa};
use ckpt_engine::{CpuDevice, CudaDevice, Device, LlamaConfig, TrainConfig, Trainer};
use serde_json::{json, Value};
use std::time::Instant;

/// What to run, from arguments and environment.
struct Options {
    threads: usize,
    steps: usize,
    warmup: usize,
    checkpointing: Vec<String>,
    precision: String,
    loss: String,
    device: String,
    model: String,
    batch: Option<usize>,
    seq: Option<usize>,
    layers: Option<usize>,
    peak_tflops: f64,
    loops: VectorIsa,
    world: usize,
    shard: String,
    data: String,
}

impl Options {
    fn parse() -> Result<Self, String> {
        let mut opts = Options {
            threads: env_or("BENCH_THREADS", "2")
                .parse()
                .map_err(bad("threads"))?,
            steps: env_or("BENCH_STEPS", "10").parse().map_err(bad("steps"))?,
            warmup: env_or("BENCH_WARMUP", "2").parse().map_err(bad("warmup"))?,
            checkpointing: split_list(&env_or("BENCH_CHECKPOINTING", "none")),
            precision: env_or("BENCH_PRECISION", "fp32"),
            loss: env_or("BENCH_LOSS", "standard"),
            device: "cpu".into(),
            model: "bench".into(),
            batch: None,
            seq: None,
            layers: None,
            peak_tflops: 989.0,
            loops: VectorIsa::Avx512,
            world: 1,
            shard: "none".into(),
            data: "synthetic".into(),
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            // `cargo bench` appends `--bench`; other harness flags are ignored the same way.
            if arg == "--bench" {
                continue;
            }
            let (key, inline) = match arg.split_once('=') {
                Some((k, v)) => (k.to_string(), Some(v.to_string())),
                None => (arg.clone(), None),
            };
            let mut value = || {
                inline
                    .clone()
                    .or_else(|| args.next())
                    .ok_or_else(|| format!("{key} needs a value"))
            };
            match key.as_str() {
                "--threads" => opts.threads = value()?.parse().map_err(bad("threads"))?,
                "--steps" => opts.steps = value()?.parse().map_err(bad("steps"))?,
                "--warmup" => opts.warmup = value()?.parse().map_err(bad("warmup"))?,
                "--checkpointing" => opts.checkpointing = split_list(&value()?),
                "--precision" => opts.precision = value()?,
                "--loss" => opts.loss = value()?,
                "--device" => opts.device = value()?,
                "--model" => opts.model = value()?,
                "--batch" => opts.batch = Some(value()?.parse().map_err(bad("batch"))?),
                "--seq" => opts.seq = Some(value()?.parse().map_err(bad("seq"))?),
                "--layers" => opts.layers = Some(value()?.parse().map_err(bad("layers"))?),
                "--peak-tflops" => {
                    opts.peak_tflops = value()?.parse().map_err(bad("peak-tflops"))?
                }
                "--world" => opts.world = value()?.parse().map_err(bad("world"))?,
                "--shard" => opts.shard = value()?,
                "--data" => opts.data = value()?,
                "--loops" => {
                    opts.loops = match value()?.as_str() {
                        "widest" => VectorIsa::Avx512,
                        "avx2" => VectorIsa::Avx2Fma,
                        "baseline" => VectorIsa::Baseline,
                        other => {
                            return Err(format!(
                                "--loops takes widest, avx2 or baseline, not {other}"
                            ))
                        }
                    }
                }
                other => return Err(format!("unknown argument {other}")),
            }
        }
        if opts.steps == 0 || opts.checkpointing.is_empty() {
            return Err("at least one step and one checkpointing policy are needed".into());
        }
        let (batch, _) = opts.batch_shape()?;
        if opts.world == 0 || !batch.is_multiple_of(opts.world) {
            return Err(format!(
                "a batch of {batch} rows cannot be cut into {} ranks' micro-batches; give a --world that divides --batch",
                opts.world
            ));
        }
        if !["cpu", "cuda"].contains(&opts.device.as_str()) {
            return Err(format!("device {} is neither cpu nor cuda", opts.device));
        }
        Ok(opts)
    }

    /// The model's shape, and the batch shape it runs at by default.
    fn model_json(&self) -> Result<(Value, usize, usize), String> {
        match self.model.as_str() {
            "bench" => Ok((
                json!({
                    "vocab_size": 4096,
                    "hidden_size": 256,
                    "intermediate_size": 688,
                    "num_hidden_layers": self.layers.unwrap_or(4),
                    "num_attention_heads": 8,
                    "num_key_value_heads": 4,
                    "rms_norm_eps": 1e-5,
                    "rope_theta": 10000.0,
                    "tie_word_embeddings": false,
                    "max_position_embeddings": self.seq.unwrap_or(256).max(256),
                }),
                8,
                256,
            )),
            "llama-1b" => Ok((
                json!({
                    "vocab_size": 128256,
                    "hidden_size": 2048,
                    "intermediate_size": 8192,
                    "num_hidden_layers": self.layers.unwrap_or(16),
                    "num_attention_heads": 32,
                    "num_key_value_heads": 8,
                    "rms_norm_eps": 1e-5,
                    "rope_theta": 500000.0,
                    "tie_word_embeddings": true,
                    "max_position_embeddings": self.seq.unwrap_or(2048).max(2048),
                }),
                8,
                2048,
            )),
            other => Err(format!("model {other} is neither bench nor llama-1b")),
        }
    }

    fn batch_shape(&self) -> Result<(usize, usize), String> {
        let (_, batch, seq) = self.model_json()?;
        Ok((self.batch.unwrap_or(batch), self.seq.unwrap_or(seq)))
    }

    fn loss_json(&self) -> Result<Value, String> {
        match self.loss.split_once(':') {
            None if self.loss == "standard" => Ok(json!({"kind": "standard"})),
            Some(("chunked", n)) => Ok(json!({
                "kind": "chunked",
                "chunk_tokens": n.parse::<usize>().map_err(bad("loss chunk"))?,
            })),
            _ => Err(format!(
                "loss {} is neither standard nor chunked:N",
                self.loss
            )),
        }
    }
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(String::from)
        .collect()
}

fn bad<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("bad {what}: {e}")
}

impl Options {
    /// The data the steps train on.
    fn data_json(&self) -> Result<Value, String> {
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../suites/data");
        match self.data.as_str() {
            "synthetic" => Ok(json!({"kind": "synthetic", "seed": 0, "samples": 4096})),
            "squad" => Ok(json!({
                "kind": "text",
                "path": fixtures.join("squad-sft.jsonl"),
                "columns": {"messages": "messages"},
                "tokenizer": fixtures.join("tokenizer"),
                "padding": "max_length",
                "overlong": "truncate",
            })),
            other => Err(format!("--data takes synthetic or squad, not {other}")),
        }
    }
}

/// The benchmark's training configuration, as the trainer reads it.
fn train_config(opts: &Options, checkpointing: &str) -> Result<Value, String> {
    let (model, _, _) = opts.model_json()?;
    let (batch, seq) = opts.batch_shape()?;
    Ok(json!({
        "model": model,
        "init": {"kind": "random", "seed": 0, "std": 0.02},
        "precision": opts.precision,
        "optimizer": {
            "lr": 1e-3,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.1,
            "grad_clip": 1.0,
        },
        "schedule": {"kind": "constant"},
        "data": opts.data_json()?,
        "batch_size": batch / opts.world,
        "accumulation": opts.world,
        "parallel": {"world_size": opts.world, "shard": opts.shard},
        "seq_len": seq,
        "checkpointing": checkpointing,
        "loss": opts.loss_json()?,
    }))
}

/// CPU time all threads of this process have used, in seconds, where Linux reports it: on a
/// shared machine it shows the work a step costs apart from time spent waiting for a core.
fn process_cpu_s() -> Option<f64> {
    let tasks = std::fs::read_dir("/proc/self/task").ok()?;
    let mut ns = 0u64;
    for task in tasks {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        ns += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 * 1e-9)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Model FLOPs of one token at row length `seq`: 6·N for the matrix products plus causal
/// attention's score and value products, as `scripts/bench_gpu_torch.py` counts them.
fn flops_per_token(m: &LlamaConfig, seq: usize) -> f64 {
    let (h, f, layers) = (m.hidden_size, m.intermediate_size, m.num_hidden_layers);
    let kv = m.num_key_value_heads * m.head_dim();
    let per_layer = h * h * 2 + h * kv * 2 + 3 * h * f;
    let dense = layers * per_layer + m.vocab_size * h;
    let attention = layers * 2 * seq * h;
    (6 * dense + 3 * attention) as f64
}

/// Median step time, throughput and peak bytes of one policy; on a GPU also the pool's
/// high-water marks and the model-FLOPs utilisation.
fn measure(opts: &Options, checkpointing: &str) -> Result<Value, String> {
    let cfg: TrainConfig = serde_json::from_value(train_config(opts, checkpointing)?)
        .map_err(|e| format!("configuration for {checkpointing}: {e}"))?;
    if opts.device == "cuda" {
        let dev = CudaDevice::new(0, None).map_err(err)?;
        let trainer = Trainer::new(cfg, dev.clone()).map_err(err)?;
        time_steps(opts, checkpointing, trainer, Some(&dev), None)
    } else {
        let dev = CpuDevice::new(opts.threads, u64::MAX)
            .and_then(|d| d.with_bf16_products(Bf16Products::from_env()?))
            .map_err(err)?
            .limit_vector_isa(opts.loops);
        let loops = format!("{:?}", dev.vector_isa());
        let mut result = time_steps(
            opts,
            checkpointing,
            Trainer::new(cfg, dev).map_err(err)?,
            None,
            peak::fp32_peak_gflops(opts.threads),
        )?;
        result["cpu_loops"] = json!(loops);
        Ok(result)
    }
}

fn err(e: ckpt_engine::EngineError) -> String {
    e.to_string()
}

/// Times `opts.steps` steps of `trainer` after `opts.warmup` (`gpu` is its device on CUDA;
/// `cpu_peak_gflops` the CPU's measured fp32 peak on the CPU).
fn time_steps<D: Device>(
    opts: &Options,
    checkpointing: &str,
    mut trainer: Trainer<D>,
    gpu: Option<&CudaDevice>,
    cpu_peak_gflops: Option<f64>,
) -> Result<Value, String> {
    let sync = || gpu.map_or(Ok(()), |d| d.sync()).map_err(err);
    let tokens =
        trainer.config().batch_size * trainer.config().seq_len * trainer.config().accumulation;
    for _ in 0..opts.warmup {
        trainer.step().map_err(|e| e.to_string())?;
    }
    sync()?;
    let (mut times, mut cpu) = (Vec::with_capacity(opts.steps), Vec::new());
    let (mut peak, mut loss, mut recomputed) = (0u64, 0.0f32, 0usize);
    for _ in 0..opts.steps {
        let (start, cpu_start) = (Instant::now(), process_cpu_s());
        let stats = trainer.step().map_err(|e| e.to_string())?;
        sync()?;
        times.push(start.elapsed().as_secs_f64());
        if let (Some(a), Some(b)) = (cpu_start, process_cpu_s()) {
            cpu.push(b - a);
        }
        peak = peak.max(stats.memory.allocated.peak);
        loss = stats.loss;
        recomputed = stats.recomputed_blocks;
    }
    let min = times.iter().cloned().fold(f64::INFINITY, f64::min);
    let step = median(times);
    let cpu_ms = (cpu.len() == opts.steps).then(|| median(cpu) * 1e3);
    let pool = gpu.map(|d| d.pool_stats()).transpose().map_err(err)?;
    let flops = flops_per_token(&trainer.config().model, trainer.config().seq_len) * tokens as f64;
    Ok(json!({
        "checkpointing": checkpointing,
        "median_step_ms": step * 1e3,
        "min_step_ms": min * 1e3,
        "median_cpu_ms_per_step": cpu_ms,
        "tokens_per_s": tokens as f64 / step,
        "flops_per_step": flops,
        "peak_bytes": peak,
        "recomputed_blocks": recomputed,
        "last_loss": loss,
        "pool_reserved_high_bytes": pool.map(|p| p.reserved_high),
        "pool_used_high_bytes": pool.map(|p| p.used_high),
        "mfu": gpu.is_some().then(|| flops / step / (opts.peak_tflops * 1e12)),
        "cpu_kernels": gpu.is_none().then(|| trainer.device().execution_env().cpu_kernels),
        "cpu_peak_gflops": cpu_peak_gflops,
        "fraction_of_cpu_peak": cpu_peak_gflops.map(|p| flops / step / (p * 1e9)),
    }))
}

fn run() -> Result<Value, String> {
    let opts = Options::parse()?;
    let results = opts
        .checkpointing
        .iter()
        .map(|policy| measure(&opts, policy))
        .collect::<Result<Vec<_>, _>>()?;
    let base = results[0]["median_step_ms"].as_f64().unwrap_or(f64::NAN);
    let ratios: serde_json::Map<String, Value> = results
        .iter()
        .skip(1)
        .map(|r| {
            let ms = r["median_step_ms"].as_f64().unwrap_or(f64::NAN);
            let key = format!(
                "{}_over_{}",
                r["checkpointing"].as_str().unwrap_or("?"),
                results[0]["checkpointing"].as_str().unwrap_or("?")
            );
            (key, json!(ms / base))
        })
        .collect();
    let (batch, seq) = opts.batch_shape()?;
    Ok(json!({
        "engine": "ckpt-engine",
        "device": opts.device,
        "model": opts.model,
        "batch": batch,
        "seq": seq,
        "threads": opts.threads,
        "world": opts.world,
        "shard": opts.shard,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "precision": opts.precision,
        "loss": opts.loss,
        "data": opts.data,
        "tokens_per_step": batch * seq,
        "tokens_per_s": results[0]["tokens_per_s"],
        "results": results,
        "step_time_ratios": ratios,
    }))
}

fn main() {
    match run() {
        Ok(report) => println!("{report}"),
        Err(e) => {
            eprintln!("train_step: {e}");
            std::process::exit(2);
        }
    }
}
