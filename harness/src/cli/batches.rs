//! `ckpt-harness batches`: what the model sees at each step of a suite, without training: each
//! micro-batch's padded shape and its rows' samples (index, epoch, length, tokens learned), and
//! with `--tokens` the text of each row, the tokens the loss learns marked (`⟦…⟧`), or in JSON
//! the ids and labels. Every phase of a suite draws the same batches at the same step.

use super::exit_codes;
use crate::run::plan;
use anyhow::{Context, Result};
use ckpt_engine::data::text::HfTokenizer;
use ckpt_engine::data::{DataConfig, DataLoader};
use ckpt_engine::model::Batch;
use std::io::Write;
use std::path::PathBuf;

/// `batches`' arguments.
#[derive(clap::Args)]
pub struct BatchesArgs {
    /// The suite file.
    pub suite: PathBuf,
    /// Steps to show (repeat for several; default: every step of the run, `max_steps +
    /// extra_steps`).
    #[arg(long = "step")]
    pub steps: Vec<u64>,
    /// Each row's tokens too: its text with the learned tokens marked, or in JSON its ids and
    /// labels.
    #[arg(long)]
    pub tokens: bool,
    /// One JSON object a step instead of text.
    #[arg(long)]
    pub json: bool,
}

/// A row as shown: its sample, its tokens and how many of them are learned.
#[derive(serde::Serialize)]
struct RowView {
    epoch: u64,
    index: u64,
    /// The sample's tokens (a text sample's own length; the row's for other data).
    length: usize,
    /// Labels the loss counts.
    learned: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    input_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    labels: Option<Vec<i64>>,
}

/// A micro-batch as shown.
#[derive(serde::Serialize)]
struct MicroBatchView {
    /// Rows × tokens a row.
    shape: [usize; 2],
    rows: Vec<RowView>,
}

/// Prints the batches of the steps asked for; exits 0, or [`exit_codes::INVALID`] for a suite
/// or data that cannot be read.
pub fn exec(args: BatchesArgs) -> Result<u8> {
    let suite = plan::load_one(&args.suite)?;
    let train = &suite.train;
    let mut loader =
        (train.loader()).with_context(|| format!("{}: the data", args.suite.display()))?;
    let tokenizer = match &train.data {
        DataConfig::Text(text) if args.tokens && !args.json => {
            Some(HfTokenizer::open(&text.tokenizer)?)
        }
        _ => None,
    };
    let end = suite.max_steps() + suite.file.training.extra_steps;
    let last = args
        .steps
        .iter()
        .copied()
        .max()
        .unwrap_or(end.saturating_sub(1));
    let mut out = std::io::stdout().lock();
    for step in 0..=last {
        let batches = loader.next_step(train.accumulation, train.seq_len_at(step))?;
        let samples = loader.take_drawn();
        if !args.steps.is_empty() && !args.steps.contains(&step) {
            continue;
        }
        let mut drawn = samples.iter();
        let views: Vec<MicroBatchView> = (batches.iter())
            .map(|b| MicroBatchView {
                shape: [b.batch, b.seq],
                rows: (0..b.batch)
                    .zip(drawn.by_ref())
                    .map(|(row, id)| row_view(&loader, b, row, *id, args.tokens))
                    .collect(),
            })
            .collect();
        if args.json {
            let line = serde_json::json!({"step": step, "micro_batches": views});
            writeln!(out, "{line}")?;
            continue;
        }
        for (m, (view, batch)) in views.iter().zip(&batches).enumerate() {
            writeln!(
                out,
                "step {step}  micro-batch {m}  [{} × {}]",
                view.shape[0], view.shape[1]
            )?;
            for (row, r) in view.rows.iter().enumerate() {
                writeln!(
                    out,
                    "  row {row}: sample {} of epoch {}, {} tokens, {} learned",
                    r.index, r.epoch, r.length, r.learned
                )?;
                if let Some(tokenizer) = &tokenizer {
                    writeln!(out, "    {}", marked_text(tokenizer, batch, row, r.length)?)?;
                }
            }
        }
    }
    Ok(exit_codes::SUCCESS)
}

/// Row `row` of `batch`, drawn as sample `id`.
fn row_view(
    loader: &DataLoader,
    batch: &Batch,
    row: usize,
    id: ckpt_engine::data::SampleId,
    tokens: bool,
) -> RowView {
    let ids = &batch.input_ids[row * batch.seq..][..batch.seq];
    let labels = &batch.labels[row * batch.seq..][..batch.seq];
    let length = loader
        .text_sample(id.index)
        .map_or(batch.seq, |t| t.ids.len().min(batch.seq));
    RowView {
        epoch: id.epoch,
        index: id.index,
        length,
        learned: labels.iter().filter(|&&l| l >= 0).count(),
        input_ids: tokens.then(|| ids.to_vec()),
        labels: tokens.then(|| labels.to_vec()),
    }
}

/// A text row's first `length` tokens as text, each run of tokens the loss learns in `⟦…⟧`
/// (a token is learned where the label before it is not ignored).
fn marked_text(
    tokenizer: &HfTokenizer,
    batch: &Batch,
    row: usize,
    length: usize,
) -> Result<String> {
    let ids = &batch.input_ids[row * batch.seq..][..length];
    let labels = &batch.labels[row * batch.seq..][..batch.seq];
    let learned = |i: usize| i > 0 && labels[i - 1] >= 0;
    let mut text = String::new();
    let mut start = 0;
    for end in 1..=ids.len() {
        if end == ids.len() || learned(end) != learned(start) {
            let piece = tokenizer
                .decode(&ids[start..end])
                .map_err(anyhow::Error::msg)?
                .escape_debug()
                .to_string();
            match learned(start) {
                true => text.push_str(&format!("⟦{piece}⟧")),
                false => text.push_str(&piece),
            }
            start = end;
        }
    }
    Ok(text)
}
