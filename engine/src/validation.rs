//! Validation: a split of the data the run never trains on, evaluated after every `every` steps
//! and after the run's last, each evaluation a forward pass without gradients over the same
//! micro-batches: the split's samples in dataset order, its loader reset before each one. The
//! split is a share held out of the training data or a file of its own (read as the training
//! data is, with its columns and tokenizer). An evaluation's loss is its token losses summed in
//! f64 in micro-batch order over its counted labels, the bits of one rank at every world size.

use crate::data::{DataConfig, DataLoader, SampleId};
use crate::error::{Result, Setting};
use crate::memory::MemoryStats;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where the validation split is and when it is evaluated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ValidationConfig {
    /// Evaluate after every `every` steps.
    pub every: u64,
    /// The share of the dataset held out of training (between 0 and 1): the samples first in
    /// a permutation of the run's `shuffle_seed`, on a stream of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<f64>,
    /// A dataset file of its own, read as the training data is (text data only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Micro-batches each evaluation reads from the split's start (Megatron's `eval_iters`);
    /// the whole split when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batches: Option<usize>,
    /// Evaluate after this step too: the run's last (the harness writes `max_steps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<u64>,
}

impl ValidationConfig {
    /// Whether an evaluation follows the step that completes `steps` steps.
    pub fn due(&self, steps: u64) -> bool {
        steps > 0 && (steps.is_multiple_of(self.every.max(1)) || Some(steps) == self.end)
    }

    /// Refuses settings that name no split, two splits, a file split of data that is not
    /// text, or no evaluation at all.
    pub fn check(&self, data: &DataConfig) -> Result<()> {
        let setting = |key: &str, message: &str| Err(Setting::new(key, message).into());
        if self.every == 0 {
            return setting(
                "validation.every",
                "validation.every is 0; write the steps between evaluations, at least 1",
            );
        }
        if self.batches == Some(0) {
            return setting(
                "validation.batches",
                "validation.batches is 0; write the micro-batches an evaluation reads, or leave it out to read the whole split",
            );
        }
        match (&self.share, &self.path, data) {
            (Some(_), None, _) | (None, Some(_), DataConfig::Text(_)) => Ok(()),
            (None, Some(_), _) => setting(
                "validation.path",
                "validation.path names a file of text samples, and the run's data is not text; hold out a share of it instead (validation.share: 0.1)",
            ),
            _ => setting(
                "validation",
                "validation names one split: a share of the data held out of training (share: 0.1) or a file of its own (path: FILE)",
            ),
        }
    }

    /// The training loader of `data` and the validation split's loader: `train` without the
    /// held-out share, or `train` whole and the split's file read as `data` is.
    pub fn split(
        &self,
        mut train: DataLoader,
        shuffle_seed: u64,
        file: impl FnOnce(&Path) -> Result<DataLoader>,
    ) -> Result<(DataLoader, DataLoader)> {
        let validation = match (&self.share, &self.path) {
            (Some(share), _) => train.hold_out(*share, shuffle_seed)?,
            (None, Some(path)) => file(path)?.in_order(),
            (None, None) => unreachable!("checked: validation names one split"),
        };
        Ok((train, validation))
    }

    /// The micro-batches' rows of one evaluation over a split of `samples` samples in
    /// micro-batches of `batch` rows: the whole split (the last micro-batch shorter where
    /// `batch` does not divide it), or `batches` full ones.
    pub fn rows(&self, samples: u64, batch: usize) -> Vec<usize> {
        match self.batches {
            Some(n) => vec![batch; n],
            None => {
                let samples = usize::try_from(samples).unwrap_or(usize::MAX);
                (0..samples.div_ceil(batch))
                    .map(|i| batch.min(samples - i * batch))
                    .collect()
            }
        }
    }

    /// What a run's identity records of it: the split, which decides what the run trains on
    /// (a share's fraction, a file's content rather than its path). When and how much it
    /// evaluates changes no bit of the training, so a resume may change them.
    pub fn identity(&self, data: &DataConfig) -> Result<serde_json::Value> {
        let split = match (&self.share, &self.path, data) {
            (_, Some(path), DataConfig::Text(text)) => {
                let mut file = text.clone();
                file.path = path.clone();
                DataConfig::Text(file).identity()?["dataset"].clone()
            }
            _ => serde_json::json!(self.share),
        };
        Ok(serde_json::json!({ "split": split }))
    }

    /// The file it reads, resolved against `base` (a suite's directory).
    pub fn relative_to(&self, base: &Path) -> Self {
        ValidationConfig {
            path: self.path.as_ref().map(|p| base.join(p)),
            ..self.clone()
        }
    }
}

/// What one evaluation saw.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    /// Steps completed when it ran.
    pub step: u64,
    /// The split's mean token loss: its token losses summed over its counted labels.
    pub loss: f32,
    /// Labels counted.
    pub tokens: usize,
    /// sha256 of the shapes, token ids and labels of its micro-batches in order.
    pub batch_digest: String,
    /// The samples of its rows, in order.
    pub samples: Vec<SampleId>,
    /// Each micro-batch's rows and tokens per row.
    pub shapes: Vec<(usize, usize)>,
    /// Memory figures, the peak covering the evaluation only (rank 0's in a data-parallel
    /// run).
    pub memory: MemoryStats,
    /// Every rank's memory figures, in rank order, in a data-parallel run; empty for one rank.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_memory: Vec<MemoryStats>,
}
