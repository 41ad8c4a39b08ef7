//! What every step of a suite trains on, drawn from its loader as the trainer draws it: each
//! micro-batch's padded or packed shape and its samples with their token counts; and the
//! micro-batches every evaluation of the validation split reads. Every phase of a suite draws
//! the same batches at the same step, so one walk over `0..max_steps + extra_steps` serves all.

use crate::suite::Suite;
use anyhow::{Context, Result};
use ckpt_engine::data::{DataLoader, SampleId};
use ckpt_engine::model::Batch;
use serde::Serialize;

/// A sample as a micro-batch holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PlannedSample {
    /// The epoch it is drawn in.
    pub epoch: u64,
    /// Its index in the dataset.
    pub index: u64,
    /// Its tokens in the batch (a text sample's own length, cut to its row; the row's for
    /// other data).
    pub tokens: usize,
}

/// One micro-batch of a step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlannedMicroBatch {
    /// Rows × tokens a row, padding included.
    pub shape: [usize; 2],
    /// Its samples in row order (in a packed batch, every sample of every row).
    pub samples: Vec<PlannedSample>,
}

/// Every step's micro-batches, and an evaluation's.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DataPlan {
    /// Step `i`'s micro-batches in global order, for every step a phase trains.
    pub steps: Vec<Vec<PlannedMicroBatch>>,
    /// The shapes of the micro-batches an evaluation reads (every evaluation reads the same);
    /// empty without a validation split.
    pub evaluation: Vec<[usize; 2]>,
}

impl DataPlan {
    /// Draws the batches of `suite`'s steps `0..end` and of an evaluation, as its trainer
    /// would.
    pub fn draw(suite: &Suite, end: u64) -> Result<DataPlan> {
        let train = &suite.train;
        let (mut loader, split) =
            (train.loaders()).with_context(|| format!("{}: the data", suite.path.display()))?;
        let mut steps = Vec::with_capacity(usize::try_from(end).unwrap_or(0));
        for step in 0..end {
            let batches = loader.next_step(train.accumulation, train.seq_len_at(step))?;
            steps.push(planned(&mut loader, &batches));
        }
        let evaluation = match (split, &train.validation) {
            (Some(mut split), Some(validation)) => {
                let rows = validation.rows(split.samples(), train.batch_size);
                (rows.into_iter())
                    .map(|rows| {
                        Ok(split
                            .next_rows(rows, train.seq_len)
                            .map(|b| [b.batch, b.seq])?)
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            _ => Vec::new(),
        };
        Ok(DataPlan { steps, evaluation })
    }
}

/// `batches` as planned, their samples those `loader` drew for them.
fn planned(loader: &mut DataLoader, batches: &[Batch]) -> Vec<PlannedMicroBatch> {
    let drawn = loader.take_drawn();
    let mut drawn = drawn.iter();
    (batches.iter())
        .map(|b| PlannedMicroBatch {
            shape: [b.batch, b.seq],
            samples: (spans(b).zip(drawn.by_ref()))
                .map(|(span, id)| sample(loader, span, *id))
                .collect(),
        })
        .collect()
}

/// The sample `id` at `span` of its batch.
fn sample(loader: &DataLoader, span: Span, id: SampleId) -> PlannedSample {
    PlannedSample {
        epoch: id.epoch,
        index: id.index,
        tokens: sample_tokens(loader, span, id),
    }
}

/// The tokens of the sample `id` at `span`: a text sample's own, at most the span's; the span's
/// for other data.
pub(crate) fn sample_tokens(loader: &DataLoader, span: Span, id: SampleId) -> usize {
    loader
        .text_sample(id.index)
        .map_or(span.len, |t| t.ids.len().min(span.len))
}

/// Where a sample sits in a batch: its row, the token it begins at, and the tokens it spans
/// (a whole row, padding included, unless the batch is packed).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    /// The row.
    pub(crate) row: usize,
    /// The token of the row it begins at.
    pub(crate) offset: usize,
    /// Its tokens, up to the next sample's start or the row's end.
    pub(crate) len: usize,
}

/// The spans of `batch`'s samples in order: its rows, or in a packed batch each sample of each
/// row, from each token at position 0 to the next (the padding after a row's last sample
/// continues its positions).
pub(crate) fn spans(batch: &Batch) -> impl Iterator<Item = Span> + '_ {
    let seq = batch.seq;
    (0..batch.batch).flat_map(move |row| {
        let starts: Vec<usize> = match &batch.positions {
            Some(p) => (0..seq).filter(|&i| p[row * seq + i] == 0).collect(),
            None => vec![0],
        };
        let ends: Vec<usize> = starts.iter().skip(1).copied().chain([seq]).collect();
        (starts.into_iter().zip(ends)).map(move |(offset, end)| Span {
            row,
            offset,
            len: end - offset,
        })
    })
}
