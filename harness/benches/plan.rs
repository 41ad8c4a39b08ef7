//! The plan of every step (`ckpt_harness::forecast`) over 100,000 SQuAD-shaped conversations in
//! a 1,000-step run (4 rows × 25 micro-batches a step, each padded to its longest sample): the
//! seconds to draw every step's batches alone, then to plan every step's memory at
//! `suites/phi4-squad.yaml`'s shape and at phi-4's real one (hidden 5120, 40 layers, vocab
//! 100352, the CUDA backend's allocations), and each plan against the draw. Prints one JSON
//! object.
//!
//! ```text
//! cargo bench -p ckpt-harness --bench plan -- [--dataset FILE.jsonl]
//! ```
//! The dataset is the one the engine's `tokenize` bench writes (`target/bench/squad-sft-100k.jsonl`),
//! its tokens read back from the cache that bench leaves.

use ckpt_engine::backend::count::Like;
use ckpt_harness::devices::DeviceKind;
use ckpt_harness::forecast::{DataPlan, Forecast};
use ckpt_harness::suite::Suite;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `suites/phi4-squad.yaml` over `dataset`, in 1,000 steps of 100 samples.
fn suite(dataset: &Path, dir: &Path) -> Result<Suite, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("suites/phi4-squad.yaml"))
        .map_err(|e| e.to_string())?
        .replace(
            "path: data/squad-sft.jsonl",
            &format!("path: {}", dataset.display()),
        )
        .replace(
            "tokenizer: data/tokenizer",
            &format!(
                "tokenizer: {}",
                root.join("suites/data/tokenizer").display()
            ),
        )
        .replace("batch_size: 2", "batch_size: 4")
        .replace(
            "training: {max_steps: 8, extra_steps: 3}",
            "training: {max_steps: 997, extra_steps: 3, accumulation: 25}",
        );
    let path = dir.join("plan-bench.yaml");
    std::fs::write(&path, text).map_err(|e| e.to_string())?;
    Suite::load(&path).map_err(|e| format!("{e:#}"))
}

/// Seconds `f` takes.
fn seconds<T>(f: impl FnOnce() -> anyhow::Result<T>) -> Result<(f64, T), String> {
    let start = Instant::now();
    let out = f().map_err(|e| format!("{e:#}"))?;
    Ok((start.elapsed().as_secs_f64(), out))
}

fn run() -> Result<serde_json::Value, String> {
    let mut dataset =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench/squad-sft-100k.jsonl");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--dataset" => dataset = PathBuf::from(args.next().ok_or("--dataset needs a value")?),
            "--bench" => {}
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if !dataset.exists() {
        return Err(format!(
            "{}: no dataset; the engine's tokenize bench writes it (cargo bench -p ckpt-engine --bench tokenize)",
            dataset.display()
        ));
    }
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let small = suite(&dataset, dir.path())?;
    let end = small.max_steps() + small.file.training.extra_steps;
    DataPlan::draw(&small, end).map_err(|e| format!("{e:#}"))?;
    let (draw_s, data) = seconds(|| DataPlan::draw(&small, end))?;
    let like = Like::new(DeviceKind::Cpu, small.file.threads);
    let (small_s, planned) = seconds(|| Forecast::of(&small, like))?;
    let mut phi4 = small.clone();
    let model = &mut phi4.train.model;
    (model.vocab_size, model.hidden_size, model.intermediate_size) = (100352, 5120, 17920);
    (
        model.num_hidden_layers,
        model.num_attention_heads,
        model.num_key_value_heads,
    ) = (40, 40, 10);
    model.max_position_embeddings = 16384;
    let (phi4_s, phi4_planned) = seconds(|| Forecast::of(&phi4, Like::Cuda))?;
    let samples: usize = (data.steps.iter().flatten()).map(|m| m.samples.len()).sum();
    Ok(json!({
        "samples": samples,
        "steps": data.steps.len(),
        "draw_s": draw_s,
        "plan_s": small_s,
        "plan_dry_runs": planned.dry_runs,
        "plan_vs_draw": small_s / draw_s,
        "plan_phi4_s": phi4_s,
        "plan_phi4_dry_runs": phi4_planned.dry_runs,
        "plan_phi4_vs_draw": phi4_s / draw_s,
    }))
}

fn main() {
    match run() {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("plan bench: {e}");
            std::process::exit(1);
        }
    }
}
