//! `ckpt-harness batches`: what the model sees at each step of a suite, without training: each
//! micro-batch's padded shape and its rows' samples (index, epoch, length, tokens learned; in a
//! packed batch, every sample of a row with the token it begins at), and
//! with `--tokens` the text of each row, the tokens the loss learns marked (`⟦…⟧`), or in JSON
//! the ids and labels. Every phase of a suite draws the same batches at the same step. With
//! `--validation`, the micro-batches every evaluation of the validation split reads instead.

use super::exit_codes;
use crate::forecast::data::{sample_tokens, spans, Span};
use crate::run::plan;
use anyhow::{bail, Context, Result};
use ckpt_engine::data::text::HfTokenizer;
use ckpt_engine::data::{DataConfig, DataLoader, SampleId};
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
    /// The micro-batches an evaluation of the validation split reads (every evaluation reads
    /// the same) instead of the steps'.
    #[arg(long, conflicts_with = "steps")]
    pub validation: bool,
}

/// What a group of micro-batches shown is drawn for.
#[derive(Clone, Copy)]
enum Shown {
    /// The step of this index.
    Step(u64),
    /// An evaluation of the validation split.
    Evaluation,
}

impl Shown {
    /// How a text line names it.
    fn name(self) -> String {
        match self {
            Shown::Step(step) => format!("step {step}"),
            Shown::Evaluation => "evaluation".into(),
        }
    }

    /// Its JSON object, to which the micro-batches are added.
    fn json(self) -> serde_json::Value {
        match self {
            Shown::Step(step) => serde_json::json!({"step": step}),
            Shown::Evaluation => serde_json::json!({"evaluation": true}),
        }
    }
}

/// A row as shown (in a packed batch, one sample of a row): its sample, its tokens and how many
/// of them are learned.
#[derive(serde::Serialize)]
struct RowView {
    /// A packed sample's row.
    #[serde(skip_serializing_if = "Option::is_none")]
    row: Option<usize>,
    /// The token of its row a packed sample begins at.
    #[serde(skip_serializing_if = "Option::is_none")]
    offset: Option<usize>,
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
    let (mut loader, split) =
        (train.loaders()).with_context(|| format!("{}: the data", args.suite.display()))?;
    let tokenizer = match &train.data {
        DataConfig::Text(text) if args.tokens && !args.json => {
            Some(HfTokenizer::open(&text.tokenizer)?)
        }
        _ => None,
    };
    let mut out = std::io::stdout().lock();
    let mut show = |shown: Shown, loader: &mut DataLoader, batches: &[Batch]| -> Result<()> {
        let samples = loader.take_drawn();
        show_batches(
            &mut out,
            shown,
            (loader, batches, &samples),
            &args,
            tokenizer.as_ref(),
        )
    };
    if args.validation {
        let (Some(mut split), Some(validation)) = (split, &train.validation) else {
            bail!(
                "{}: the suite has no validation split; write validation: {{share: 0.1, every: N}} or {{path: FILE, every: N}}",
                args.suite.display()
            );
        };
        let rows = validation.rows(split.samples(), train.batch_size);
        let batches = (rows.into_iter())
            .map(|rows| split.next_rows(rows, train.seq_len))
            .collect::<ckpt_engine::Result<Vec<_>>>()?;
        show(Shown::Evaluation, &mut split, &batches)?;
        return Ok(exit_codes::SUCCESS);
    }
    let end = suite.max_steps() + suite.file.training.extra_steps;
    let last = args
        .steps
        .iter()
        .copied()
        .max()
        .unwrap_or(end.saturating_sub(1));
    for step in 0..=last {
        let batches = loader.next_step(train.accumulation, train.seq_len_at(step))?;
        match args.steps.is_empty() || args.steps.contains(&step) {
            true => show(Shown::Step(step), &mut loader, &batches)?,
            false => drop(loader.take_drawn()),
        }
    }
    Ok(exit_codes::SUCCESS)
}

/// Writes `batches` (drawn by `loader` as `samples`) as `args` asks: a JSON line, or a text
/// line a micro-batch and a row, each row's text with `tokenizer`.
fn show_batches(
    out: &mut impl Write,
    shown: Shown,
    (loader, batches, samples): (&DataLoader, &[Batch], &[SampleId]),
    args: &BatchesArgs,
    tokenizer: Option<&HfTokenizer>,
) -> Result<()> {
    let mut drawn = samples.iter();
    let views: Vec<MicroBatchView> = (batches.iter())
        .map(|b| MicroBatchView {
            shape: [b.batch, b.seq],
            rows: (spans(b).zip(drawn.by_ref()))
                .map(|(span, id)| row_view(loader, b, span, *id, args.tokens))
                .collect(),
        })
        .collect();
    if args.json {
        let mut line = shown.json();
        line["micro_batches"] = serde_json::to_value(&views)?;
        writeln!(out, "{line}")?;
        return Ok(());
    }
    for (m, (view, batch)) in views.iter().zip(batches).enumerate() {
        writeln!(
            out,
            "{}  micro-batch {m}  [{} × {}]",
            shown.name(),
            view.shape[0],
            view.shape[1]
        )?;
        for (span, r) in spans(batch).zip(&view.rows) {
            let at = match r.offset {
                Some(offset) => format!("row {} at {offset}", span.row),
                None => format!("row {}", span.row),
            };
            writeln!(
                out,
                "  {at}: sample {} of epoch {}, {} tokens, {} learned",
                r.index, r.epoch, r.length, r.learned
            )?;
            if let Some(tokenizer) = tokenizer {
                let span = Span {
                    len: r.length,
                    ..span
                };
                writeln!(out, "    {}", marked_text(tokenizer, batch, span)?)?;
            }
        }
    }
    Ok(())
}

/// The sample `id` of `batch` at `span`.
fn row_view(loader: &DataLoader, batch: &Batch, span: Span, id: SampleId, tokens: bool) -> RowView {
    let packed = batch.positions.is_some();
    let length = sample_tokens(loader, span, id);
    let shown = if packed { length } else { span.len };
    let at = span.row * batch.seq + span.offset;
    let ids = &batch.input_ids[at..][..shown];
    let labels = &batch.labels[at..][..shown];
    RowView {
        row: packed.then_some(span.row),
        offset: packed.then_some(span.offset),
        epoch: id.epoch,
        index: id.index,
        length,
        learned: labels.iter().filter(|&&l| l >= 0).count(),
        input_ids: tokens.then(|| ids.to_vec()),
        labels: tokens.then(|| labels.to_vec()),
    }
}

/// The tokens of a text sample's `span` as text, each run of tokens the loss learns in `⟦…⟧`
/// (a token is learned where the label before it is not ignored).
fn marked_text(tokenizer: &HfTokenizer, batch: &Batch, span: Span) -> Result<String> {
    let at = span.row * batch.seq + span.offset;
    let ids = &batch.input_ids[at..][..span.len];
    let labels = &batch.labels[at..][..span.len];
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
