//! Tokenizing fine-tuning data: a dataset of `--rows` SQuAD-shaped conversations (the fixture
//! rows of `suites/data/squad-sft.jsonl` over and over, each question numbered so that no two
//! rows are alike), written to `--dataset` (default `target/bench/squad-sft-100k.jsonl`) unless it exists, rendered by the fixture tokenizer's
//! chat template and tokenized with answer-only labels, as a run's loader does. Prints one JSON
//! object: the rows a second tokenized without a cache, then into an empty cache (tokenized and
//! kept) and read back from it, and how many times faster the read back is than the first.
//!
//! ```text
//! cargo bench -p ckpt-engine --bench tokenize -- [--rows N] [--dataset FILE.jsonl]
//! ```
//! `scripts/bench_tokenize.py` times transformers' `apply_chat_template` on the same file.

use ckpt_engine::data::text::{Columns, Labels, Overlong, Padding, TextData};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../suites/data")
}

/// Writes `rows` conversations to `path`: the fixture rows in turn, the last user message of
/// each ending in its row number.
fn write_dataset(path: &Path, rows: usize) -> Result<(), String> {
    let fixture = std::fs::read_to_string(fixtures().join("squad-sft.jsonl"))
        .map_err(|e| format!("the fixture dataset: {e}"))?;
    let base: Vec<serde_json::Value> = fixture
        .lines()
        .map(|l| serde_json::from_str(l).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let mut out = String::new();
    for i in 0..rows {
        let mut messages = base[i % base.len()]["messages"].clone();
        if let Some(user) = (messages.as_array_mut().into_iter().flatten())
            .rev()
            .find(|m| m["role"] == "user")
        {
            let content = format!("{} (#{i})", user["content"].as_str().unwrap_or_default());
            user["content"] = json!(content);
        }
        out.push_str(&json!({ "messages": messages }).to_string());
        out.push('\n');
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::write(path, out).map_err(|e| format!("{}: {e}", path.display()))
}

fn run() -> Result<serde_json::Value, String> {
    let mut rows = 100_000usize;
    let mut dataset =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench/squad-sft-100k.jsonl");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--rows" => rows = value()?.parse().map_err(|e| format!("--rows: {e}"))?,
            "--dataset" => dataset = value()?.into(),
            "--bench" => {}
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if !dataset.exists() {
        write_dataset(&dataset, rows)?;
    }
    let data = TextData {
        path: dataset.clone(),
        columns: Columns {
            messages: Some("messages".into()),
            ..Columns::default()
        },
        tokenizer: fixtures().join("tokenizer"),
        labels: Labels::Answer,
        padding: Padding::Longest,
        overlong: Overlong::Truncate,
        group_by_length: false,
    };
    let cache = tempfile::tempdir().map_err(|e| e.to_string())?;
    let time = |cache: Option<&Path>| -> Result<(f64, usize), String> {
        let start = Instant::now();
        let samples = data
            .load_cached(512, 1 << 20, cache)
            .map_err(|e| e.to_string())?;
        Ok((start.elapsed().as_secs_f64(), samples.tokens.len()))
    };
    let (uncached, n) = time(None)?;
    let (cold, _) = time(Some(cache.path()))?;
    let (warm, _) = time(Some(cache.path()))?;
    Ok(json!({
        "dataset": dataset,
        "rows": n,
        "tokenize_rows_per_s": n as f64 / uncached,
        "tokenize_and_keep_s": cold,
        "read_back_s": warm,
        "read_back_vs_first": cold / warm,
    }))
}

fn main() {
    match run() {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("tokenize bench: {e}");
            std::process::exit(1);
        }
    }
}
