//! Deterministic data: a seeded synthetic dataset with learnable structure and variable lengths,
//! a dataset of flat token files, and fine-tuning text tokenized by the model's tokenizer
//! ([`text`]). The loader's position is a plain value ([`LoaderState`]), so a checkpoint can
//! store it and a resumed run reads exactly the batches it would have.

pub mod text;

use crate::error::{check_host, try_vec, EngineError, Result, Setting};
use crate::model::loss::IGNORE_INDEX;
use crate::model::Batch;
use crate::regular_file;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use text::{Padding, TextData, Tokens};

/// Where samples come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum DataConfig {
    /// Token sequences from a seeded Markov chain: each token has `branching` likely successors,
    /// so a model can learn the chain and the loss falls towards `ln(branching)`.
    Synthetic {
        /// Seed of the chain and of every sample.
        seed: u64,
        /// Samples per epoch.
        #[serde(default = "default_samples")]
        samples: u64,
        /// Successors per token.
        #[serde(default = "default_branching")]
        branching: usize,
        /// Shortest sample, in tokens; rows shorter than the sequence are padded with ignored labels.
        #[serde(default)]
        min_len: Option<usize>,
    },
    /// Flat little-endian token ids, cut into windows of `seq + 1` tokens.
    TokenFile {
        /// The file.
        path: PathBuf,
        /// Bytes per token id.
        #[serde(default = "default_token_dtype")]
        dtype: TokenDtype,
    },
    /// Fine-tuning text (a JSONL file) and the model's tokenizer: a row a sample.
    Text(TextData),
}

impl DataConfig {
    /// What a run's identity records of its data (see [`crate::TrainConfig::identity`]): the
    /// synthetic data's settings, or a token file's dtype and content (its size and the sha256
    /// of its bytes, as `"N bytes, sha256 HEX"`), not its path: the same file is spelled
    /// otherwise from another directory, and another file can take its place.
    pub fn identity(&self) -> Result<serde_json::Value> {
        Ok(match self {
            DataConfig::Synthetic { .. } => serde_json::json!(self),
            DataConfig::TokenFile { path, dtype } => serde_json::json!({
                "kind": "token_file",
                "dtype": dtype,
                "content": content(path, TOKEN_FILE)?,
            }),
            DataConfig::Text(text) => text.identity()?,
        })
    }

    /// Whether training rows pack several samples ([`Padding::Packed`]).
    pub fn packs(&self) -> bool {
        matches!(self, DataConfig::Text(text) if text.padding == Padding::Packed)
    }
}

/// What a token file must be, for the message refusing a FIFO, a device or a directory.
const TOKEN_FILE: &str = "the path of a file of token ids";

/// `"N bytes, sha256 HEX"` of the file at `path` (`wanted` says what it should be), read in
/// pieces.
fn content(path: &Path, wanted: &str) -> Result<String> {
    use sha2::{Digest, Sha256};
    let (mut file, _) = regular_file::open(path, wanted)?;
    let mut hasher = Sha256::new();
    let bytes = std::io::copy(&mut file, &mut hasher).map_err(|e| EngineError::io(path, e))?;
    Ok(format!("{bytes} bytes, sha256 {}", hex(&hasher.finalize())))
}

/// `"N bytes, sha256 HEX"` of `bytes`.
fn content_of(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    format!(
        "{} bytes, sha256 {}",
        bytes.len(),
        hex(&Sha256::digest(bytes))
    )
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The width of token ids in a token file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    /// Two bytes per id.
    U16,
    /// Four bytes per id.
    U32,
}

fn default_samples() -> u64 {
    4096
}
fn default_branching() -> usize {
    4
}
fn default_token_dtype() -> TokenDtype {
    TokenDtype::U16
}

/// Longer rows from one step on: the batches of step `from_step` and every later step hold
/// `seq_len` tokens per row instead of the run's `seq_len` (a memory spike on purpose).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LongBatch {
    /// The first step with long rows.
    pub from_step: u64,
    /// Tokens per row from then on.
    pub seq_len: usize,
}

/// One sample a batch row holds: the epoch it was drawn in and its index in the dataset. A run's
/// sequence of these is its sample ledger: within an epoch no index repeats, and an epoch begins
/// only after the previous one handed out every sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SampleId {
    /// The epoch (completed passes over the dataset before it).
    pub epoch: u64,
    /// The sample's index in the dataset.
    pub index: u64,
}

impl std::fmt::Display for SampleId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sample {} of epoch {}", self.index, self.epoch)
    }
}

/// Where the loader stands: everything needed to continue with the same batches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// Completed passes over the dataset.
    pub epoch: u64,
    /// Samples of the current epoch already handed out.
    pub position: u64,
    /// Seed of the per-epoch shuffles.
    pub shuffle_seed: u64,
    /// The pack in flight: a packing loader's sample drawn for a row it did not fit in, which
    /// begins the next row (counted in `position` already, in no batch yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<SampleId>,
}

enum Source {
    Synthetic {
        seed: u64,
        samples: u64,
        min_len: usize,
        successors: Vec<u32>,
        branching: usize,
    },
    Tokens {
        tokens: Vec<u32>,
    },
    Text {
        samples: Vec<Tokens>,
        pad: u32,
        padding: Padding,
        group_by_length: bool,
    },
}

/// Shuffles `order` by the seeded generator's stream `stream` (Fisher–Yates from the end).
fn seeded_shuffle(order: &mut [u64], seed: u64, stream: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    for i in (1..order.len()).rev() {
        let j = rng.random_range(0..=i);
        order.swap(i, j);
    }
}

/// The generator stream of the held-out draw, apart from every epoch's.
const HOLD_OUT_STREAM: u64 = u64::MAX - 1;

/// transformers' `LengthGroupedSampler` over a shuffled `order`, with micro-batches of `batch`
/// rows: the order cut into mega-batches of `batch` times the lesser of 50 and a quarter of the
/// micro-batches an epoch holds (at least 1), each sorted longest first (a stable sort, ties in
/// shuffled order), and the longest sample of all moved to the front, so that the epoch's first
/// micro-batch is its largest: a step that will not fit fails first, not hours in.
fn group_by_length(order: &mut [u64], batch: usize, len: impl Fn(u64) -> usize) {
    let mult = (order.len() / batch.saturating_mul(4)).clamp(1, 50);
    let mega = batch.saturating_mul(mult);
    for chunk in order.chunks_mut(mega) {
        chunk.sort_by_key(|&i| std::cmp::Reverse(len(i)));
    }
    let firsts = (0..order.len()).step_by(mega);
    if let Some(longest) = firsts.max_by_key(|&at| (len(order[at]), std::cmp::Reverse(at))) {
        order.swap(0, longest);
    }
}

/// Hands out batches in a seeded shuffled order (a validation loader in the dataset's order).
pub struct DataLoader {
    source: Arc<Source>,
    /// The dataset indices it hands out, ascending; `None` for every sample.
    members: Option<Arc<[u64]>>,
    /// Whether each epoch has its own seeded order (else the members' order).
    shuffle: bool,
    /// Whether rows pack whole samples ([`Padding::Packed`] training data).
    pack: bool,
    vocab: usize,
    batch: usize,
    seq: usize,
    state: LoaderState,
    order: Vec<u64>,
    order_epoch: Option<u64>,
    drawn: Vec<SampleId>,
}

/// The padding token of short rows (their labels are ignored).
const PAD: u32 = 0;

impl DataLoader {
    /// A loader of `[batch, seq]` batches for a model of `vocab` tokens.
    pub fn new(
        cfg: &DataConfig,
        vocab: usize,
        batch: usize,
        seq: usize,
        shuffle_seed: u64,
    ) -> Result<Self> {
        if batch == 0 || seq == 0 {
            let key = if batch == 0 { "batch_size" } else { "seq_len" };
            return Err(Setting::new(key, "batch_size and seq_len must be at least 1").into());
        }
        let source = match cfg {
            DataConfig::Synthetic {
                seed,
                samples,
                branching,
                min_len,
            } => {
                let branching = (*branching).clamp(1, vocab);
                let min_len = min_len.unwrap_or(seq);
                if min_len == 0 || min_len > seq {
                    return Err(Setting::new(
                        "data.min_len",
                        format!(
                            "data.min_len is {min_len}; it must be between 1 and seq_len ({seq})"
                        ),
                    )
                    .into());
                }
                if *samples == 0 {
                    return Err(
                        Setting::new("data.samples", "data.samples must be at least 1").into(),
                    );
                }
                check_host(
                    samples.saturating_mul(8),
                    "the data order (one index per sample)",
                )?;
                let mut rng = ChaCha8Rng::seed_from_u64(*seed);
                rng.set_stream(u64::MAX);
                let mut successors = try_vec(
                    vocab.saturating_mul(branching),
                    0u32,
                    "the synthetic data's successor table",
                )?;
                successors
                    .iter_mut()
                    .for_each(|s| *s = rng.random_range(0..vocab as u32));
                Source::Synthetic {
                    seed: *seed,
                    samples: *samples,
                    min_len,
                    successors,
                    branching,
                }
            }
            DataConfig::TokenFile { path, dtype } => {
                let len = regular_file::len(path, TOKEN_FILE)?;
                let (width, name) = match dtype {
                    TokenDtype::U16 => (2, "u16"),
                    TokenDtype::U32 => (4, "u32"),
                };
                if len % width != 0 {
                    return Err(EngineError::bad_file(
                        path,
                        format!("is {len} bytes, not a whole number of {width}-byte token ids (dtype: {name}); a truncated file, or one written with another dtype?"),
                    ));
                }
                check_host(len, "the token file")?;
                let bytes = regular_file::read(path, TOKEN_FILE)?;
                let tokens: Vec<u32> = match dtype {
                    TokenDtype::U16 => bytes
                        .chunks_exact(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]) as u32)
                        .collect(),
                    TokenDtype::U32 => bytes
                        .chunks_exact(4)
                        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                };
                if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
                    return Err(EngineError::bad_file(
                        path,
                        format!("token id {t} is outside the vocabulary of {vocab}"),
                    ));
                }
                if tokens.len() < seq + 1 {
                    return Err(EngineError::bad_file(
                        path,
                        format!(
                            "holds {} tokens; one sample needs seq_len + 1 = {}",
                            tokens.len(),
                            seq + 1
                        ),
                    ));
                }
                Source::Tokens { tokens }
            }
            DataConfig::Text(text) => {
                let samples = text.load(vocab, seq)?;
                Source::Text {
                    samples: samples.tokens,
                    pad: samples.pad_id,
                    padding: text.padding,
                    group_by_length: text.group_by_length,
                }
            }
        };
        Ok(DataLoader {
            pack: cfg.packs(),
            source: Arc::new(source),
            members: None,
            shuffle: true,
            vocab,
            batch,
            seq,
            state: LoaderState {
                shuffle_seed,
                ..LoaderState::default()
            },
            order: Vec::new(),
            order_epoch: None,
            drawn: Vec::new(),
        })
    }

    /// Samples per epoch.
    pub fn samples(&self) -> u64 {
        match &self.members {
            Some(members) => members.len() as u64,
            None => self.dataset_samples(),
        }
    }

    /// Samples in the whole dataset, held-out ones included: dataset indices are below it.
    pub fn dataset_samples(&self) -> u64 {
        match &*self.source {
            Source::Synthetic { samples, .. } => *samples,
            Source::Tokens { tokens } => ((tokens.len() - 1) / self.seq) as u64,
            Source::Text { samples, .. } => samples.len() as u64,
        }
    }

    /// Text sample `index`'s tokens and which of them the loss learns; `None` for other data.
    pub fn text_sample(&self, index: u64) -> Option<&Tokens> {
        match &*self.source {
            Source::Text { samples, .. } => samples.get(usize::try_from(index).ok()?),
            _ => None,
        }
    }

    /// Holds out `share` of the dataset (at least one sample, and at least one left to train
    /// on) as a validation split: the samples first in a permutation drawn from `seed` on a
    /// stream of its own, the same on every run of that seed. This loader keeps the others;
    /// the returned one hands out the held-out samples in dataset order ([`Self::in_order`]).
    pub fn hold_out(&mut self, share: f64, seed: u64) -> Result<DataLoader> {
        let n = self.dataset_samples();
        let held = (share * n as f64).ceil() as u64;
        if !(share > 0.0 && share < 1.0) || held >= n {
            return Err(Setting::new(
                "validation.share",
                format!("validation.share is {share}; it must hold out at least one of the dataset's {n} samples and leave at least one to train on (a share between 0 and 1, at most {:.4})", (n.saturating_sub(1)) as f64 / n as f64),
            )
            .into());
        }
        let len = usize::try_from(n).unwrap_or(usize::MAX);
        let mut order = try_vec(len, 0u64, "the held-out draw (one index per sample)")?;
        order.iter_mut().zip(0..).for_each(|(o, i)| *o = i);
        seeded_shuffle(&mut order, seed, HOLD_OUT_STREAM);
        let (validation, train) = order.split_at_mut(held as usize);
        validation.sort_unstable();
        train.sort_unstable();
        self.members = Some(train.into());
        self.order_epoch = None;
        Ok(DataLoader {
            source: Arc::clone(&self.source),
            members: Some(validation.into()),
            shuffle: false,
            pack: false,
            vocab: self.vocab,
            batch: self.batch,
            seq: self.seq,
            state: LoaderState::default(),
            order: Vec::new(),
            order_epoch: None,
            drawn: Vec::new(),
        })
    }

    /// The loader handing out its samples in their order, every epoch the same, one a row (a
    /// validation split's).
    pub fn in_order(mut self) -> DataLoader {
        self.shuffle = false;
        self.pack = false;
        self.order_epoch = None;
        self
    }

    /// Where the loader stands.
    pub fn state(&self) -> LoaderState {
        self.state
    }

    /// Continues from a saved position.
    pub fn set_state(&mut self, state: LoaderState) {
        self.state = state;
    }

    /// The samples of the rows handed out since the last call, in row order.
    pub fn take_drawn(&mut self) -> Vec<SampleId> {
        std::mem::take(&mut self.drawn)
    }

    /// The next `[batch, seq]` batch; moves the position on.
    pub fn next_batch(&mut self) -> Result<Batch> {
        self.next_batch_of(self.seq)
    }

    /// The next batch with `seq` tokens per row instead of the loader's own length; moves the
    /// position on as [`DataLoader::next_batch`] does. Synthetic samples are drawn up to `seq`
    /// tokens long; token-file samples are read from the same window starts, `seq + 1` tokens
    /// long, padded with ignored labels where the file ends first. Text samples are as long as
    /// they are, in rows as long as the micro-batch's longest or `seq`, or packed into rows of
    /// `seq` (its `padding`).
    pub fn next_batch_of(&mut self, seq: usize) -> Result<Batch> {
        self.next_rows(self.batch, seq)
    }

    /// The next batch of `rows` rows (not the loader's batch size) of `seq` tokens, as
    /// [`DataLoader::next_batch_of`] makes them: a validation split's last, shorter micro-batch.
    pub fn next_rows(&mut self, rows: usize, seq: usize) -> Result<Batch> {
        if self.pack {
            return self.next_packed(rows, seq);
        }
        let indices = (0..rows).map(|_| self.draw()).collect::<Result<Vec<_>>>()?;
        let seq = match &*self.source {
            Source::Text {
                samples, padding, ..
            } if *padding != Padding::MaxLength => (indices.iter())
                .map(|&i| samples[i as usize].ids.len())
                .max()
                .unwrap_or(1)
                .max(1),
            _ => seq,
        };
        let tokens = rows.saturating_mul(seq);
        check_host(tokens as u64 * 12, "a batch (token ids and labels)")?;
        let pad = match &*self.source {
            Source::Text { pad, .. } => *pad,
            _ => PAD,
        };
        let mut input_ids = try_vec(tokens, pad, "a batch's token ids")?;
        let mut labels = try_vec(tokens, IGNORE_INDEX, "a batch's labels")?;
        let chunks = input_ids.chunks_mut(seq).zip(labels.chunks_mut(seq));
        for ((ids, labels), &index) in chunks.zip(&indices) {
            self.fill_row(index, ids, labels);
        }
        Ok(Batch {
            batch: rows,
            seq,
            input_ids,
            labels,
            positions: None,
        })
    }

    /// The next batch of `rows` rows of `seq` tokens packed with whole samples
    /// ([`Padding::Packed`]), with their positions: the pack in flight first, then samples
    /// drawn in order while they fit; the first that does not fit in a row that holds one
    /// already becomes the pack in flight. A row's tokens after its last sample are padding,
    /// ignored, their positions continuing that sample's.
    fn next_packed(&mut self, rows: usize, seq: usize) -> Result<Batch> {
        let tokens = rows.saturating_mul(seq);
        check_host(
            tokens as u64 * 16,
            "a packed batch (token ids, labels and positions)",
        )?;
        let source = Arc::clone(&self.source);
        let Source::Text { samples, pad, .. } = &*source else {
            unreachable!("only text data packs");
        };
        let mut input_ids = try_vec(tokens, *pad, "a batch's token ids")?;
        let mut labels = try_vec(tokens, IGNORE_INDEX, "a batch's labels")?;
        let mut positions = try_vec(tokens, 0u32, "a packed batch's positions")?;
        let parts = (input_ids.chunks_mut(seq))
            .zip(labels.chunks_mut(seq))
            .zip(positions.chunks_mut(seq));
        for ((ids, labels), positions) in parts {
            let mut at = 0;
            while at < seq {
                let id = match self.state.in_flight.take() {
                    Some(id) => id,
                    None => self.draw_id()?,
                };
                let len = samples[id.index as usize].ids.len().min(seq);
                if at > 0 && at + len > seq {
                    self.state.in_flight = Some(id);
                    break;
                }
                self.drawn.push(id);
                let span = at..at + len;
                self.fill_row(id.index, &mut ids[span.clone()], &mut labels[span.clone()]);
                positions[span]
                    .iter_mut()
                    .zip(0..)
                    .for_each(|(p, i)| *p = i);
                at += len;
            }
            let last = positions[at - 1];
            (positions[at..].iter_mut())
                .zip(last + 1..)
                .for_each(|(p, next)| *p = next);
        }
        Ok(Batch {
            batch: rows,
            seq,
            input_ids,
            labels,
            positions: Some(positions),
        })
    }

    /// The next step's `micro_batches` batches of rows of `seq` tokens (see
    /// [`DataLoader::next_batch_of`]): what a trainer takes a step on.
    pub fn next_step(&mut self, micro_batches: usize, seq: usize) -> Result<Vec<Batch>> {
        (0..micro_batches)
            .map(|_| self.next_batch_of(seq))
            .collect()
    }

    /// The dataset index of the next sample, which the next row holds; moves the position on
    /// ([`DataLoader::draw_id`]).
    fn draw(&mut self) -> Result<u64> {
        let id = self.draw_id()?;
        self.drawn.push(id);
        Ok(id.index)
    }

    /// The next sample; moves the position on, into the next epoch after the last sample of
    /// one.
    fn draw_id(&mut self) -> Result<SampleId> {
        if self.state.position >= self.samples() {
            self.state.epoch += 1;
            self.state.position = 0;
        }
        let index = self.shuffled(self.state.position)?;
        self.state.position += 1;
        Ok(SampleId {
            epoch: self.state.epoch,
            index,
        })
    }

    /// Writes sample `index` into a row's `ids` and `labels` (as long as each other): each
    /// token's label is the next token, ignored where the next is not learned. A synthetic or
    /// token-file row leaves out its sample's last token (the label of the one before it); a
    /// text row holds every token, the last one's label ignored, as transformers' rows do.
    fn fill_row(&self, index: u64, ids: &mut [u32], labels: &mut [i64]) {
        let tokens = self.sample(index, ids.len());
        let (len, learned) = match &*self.source {
            Source::Text { samples, .. } => (
                tokens.len().min(ids.len()),
                Some(&samples[index as usize].learned),
            ),
            _ => (tokens.len() - 1, None),
        };
        ids[..len].copy_from_slice(&tokens[..len]);
        for (i, (l, &t)) in labels.iter_mut().zip(&tokens[1..]).enumerate() {
            if learned.is_none_or(|learned| learned[i + 1]) {
                *l = t as i64;
            }
        }
    }

    /// The dataset index at `position` of the current epoch's permutation.
    fn shuffled(&mut self, position: u64) -> Result<u64> {
        if self.order_epoch != Some(self.state.epoch) {
            let n = self.samples();
            let len = usize::try_from(n).unwrap_or(usize::MAX);
            let mut order = try_vec(len, 0u64, "the data order (one index per sample)")?;
            match &self.members {
                Some(members) => order.copy_from_slice(members),
                None => order.iter_mut().zip(0..).for_each(|(o, i)| *o = i),
            }
            if self.shuffle {
                seeded_shuffle(&mut order, self.state.shuffle_seed, self.state.epoch);
                if let Source::Text {
                    samples,
                    group_by_length: true,
                    ..
                } = &*self.source
                {
                    group_by_length(&mut order, self.batch, |i| samples[i as usize].ids.len());
                }
            }
            self.order = order;
            self.order_epoch = Some(self.state.epoch);
        }
        Ok(self.order[position as usize])
    }

    /// Sample `index` for rows of `seq` tokens: between `min_len + 1` and `seq + 1` tokens
    /// (synthetic or a token file's), or a text sample's tokens, at most `seq`.
    fn sample(&self, index: u64, seq: usize) -> Vec<u32> {
        match &*self.source {
            Source::Synthetic {
                seed,
                min_len,
                successors,
                branching,
                ..
            } => {
                let mut rng = ChaCha8Rng::seed_from_u64(*seed);
                rng.set_stream(index);
                let len = rng.random_range((*min_len).min(seq)..=seq);
                let mut tok = rng.random_range(0..self.vocab as u32);
                let mut out = Vec::with_capacity(len + 1);
                out.push(tok);
                for _ in 0..len {
                    // Mostly follow the chain; one token in sixteen is uniform noise.
                    tok = if rng.random_range(0..16) == 0 {
                        rng.random_range(0..self.vocab as u32)
                    } else {
                        successors[tok as usize * branching + rng.random_range(0..*branching)]
                    };
                    out.push(tok);
                }
                out
            }
            Source::Tokens { tokens } => {
                let start = index as usize * self.seq;
                tokens[start..(start + seq + 1).min(tokens.len())].to_vec()
            }
            Source::Text { samples, .. } => samples[index as usize].ids.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synthetic(min_len: Option<usize>) -> DataConfig {
        DataConfig::Synthetic {
            seed: 7,
            samples: 10,
            branching: 4,
            min_len,
        }
    }

    #[test]
    fn a_restored_loader_continues_with_the_same_batches() {
        let mut a = DataLoader::new(&synthetic(Some(3)), 50, 3, 8, 1).unwrap();
        for _ in 0..5 {
            a.next_batch().unwrap();
        }
        let state = a.state();
        let mut b = DataLoader::new(&synthetic(Some(3)), 50, 3, 8, 1).unwrap();
        b.set_state(state);
        for _ in 0..6 {
            assert_eq!(a.next_batch().unwrap(), b.next_batch().unwrap());
        }
        assert!(a.state().epoch >= 2, "crossed epochs: {:?}", a.state());
    }

    #[test]
    fn every_epoch_hands_out_each_sample_once_in_its_own_order() {
        let mut l = DataLoader::new(&synthetic(Some(3)), 50, 3, 8, 1).unwrap();
        for _ in 0..7 {
            l.next_batch().unwrap();
        }
        let drawn = l.take_drawn();
        assert_eq!(drawn.len(), 21);
        assert!(l.take_drawn().is_empty());
        let epoch = |e: u64| -> Vec<u64> {
            drawn
                .iter()
                .filter(|s| s.epoch == e)
                .map(|s| s.index)
                .collect()
        };
        for e in 0..2 {
            let mut sorted = epoch(e);
            sorted.sort_unstable();
            assert_eq!(sorted, (0..10).collect::<Vec<_>>(), "epoch {e}");
        }
        assert_ne!(epoch(0), epoch(1), "each epoch has its own shuffle");
        assert_eq!(epoch(2).len(), 1);
    }

    #[test]
    fn short_rows_are_padded_with_ignored_labels() {
        let mut l = DataLoader::new(&synthetic(Some(2)), 50, 10, 16, 0).unwrap();
        let b = l.next_batch().unwrap();
        let ignored = b.labels.iter().filter(|&&x| x == IGNORE_INDEX).count();
        assert!(ignored > 0);
        for row in b.labels.chunks(16) {
            let first_pad = row.iter().position(|&x| x == IGNORE_INDEX).unwrap_or(16);
            assert!(first_pad >= 2);
            assert!(row[first_pad..].iter().all(|&x| x == IGNORE_INDEX));
        }
    }

    #[test]
    fn long_batches_follow_the_same_order_and_resume() {
        let mut a = DataLoader::new(&synthetic(Some(3)), 50, 2, 8, 1).unwrap();
        let mut b = DataLoader::new(&synthetic(Some(3)), 50, 2, 8, 1).unwrap();
        a.next_batch().unwrap();
        b.next_batch().unwrap();
        let long = a.next_batch_of(12).unwrap();
        assert_eq!((long.batch, long.seq, long.input_ids.len()), (2, 12, 24));
        assert_eq!(long, b.next_batch_of(12).unwrap());
        let mut c = DataLoader::new(&synthetic(Some(3)), 50, 2, 8, 1).unwrap();
        c.set_state(a.state());
        assert_eq!(a.next_batch_of(12).unwrap(), c.next_batch_of(12).unwrap());
        assert_eq!(a.state().position, 6);
    }

    #[test]
    fn long_token_file_windows_are_padded_at_the_end_of_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = counting_file(dir.path(), 41);
        let mut l = DataLoader::new(&cfg, 64, 5, 8, 3).unwrap();
        let b = l.next_batch_of(12).unwrap();
        for row in 0..5 {
            let ids = &b.input_ids[row * 12..(row + 1) * 12];
            let labels = &b.labels[row * 12..(row + 1) * 12];
            let counted = labels.iter().filter(|&&x| x != IGNORE_INDEX).count();
            let expected = if ids[0] == 32 { 8 } else { 12 };
            assert_eq!(counted, expected, "row starting at {}", ids[0]);
        }
    }

    #[test]
    fn token_files_are_read_as_windows() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = counting_file(dir.path(), 41);
        let mut l = DataLoader::new(&cfg, 64, 1, 8, 3).unwrap();
        assert_eq!(l.samples(), 5);
        let b = l.next_batch().unwrap();
        assert_eq!(b.input_ids[0] % 8, 0);
        for i in 0..8 {
            assert_eq!(b.labels[i], b.input_ids[i] as i64 + 1);
        }
    }

    /// A file of the ids `0..n` as u16.
    fn counting_file(dir: &std::path::Path, n: u16) -> DataConfig {
        let path = dir.join("tokens.bin");
        let tokens: Vec<u8> = (0..n).flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(&path, tokens).unwrap();
        DataConfig::TokenFile {
            path,
            dtype: TokenDtype::U16,
        }
    }

    #[test]
    fn a_token_file_that_is_not_whole_ids_or_not_a_regular_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let data = counting_file(dir.path(), 40);
        let DataConfig::TokenFile { path, .. } = &data else {
            unreachable!()
        };
        let mut odd = std::fs::read(path).unwrap();
        odd.push(7);
        std::fs::write(path, odd).unwrap();
        let e = DataLoader::new(&data, 64, 1, 8, 0)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("is 81 bytes, not a whole number of 2-byte token ids"),
            "{e}"
        );
        for special in ["/dev/zero", "/dev/null"] {
            let data = DataConfig::TokenFile {
                path: special.into(),
                dtype: TokenDtype::U16,
            };
            let e = DataLoader::new(&data, 64, 1, 8, 0)
                .err()
                .unwrap()
                .to_string();
            assert!(
                e.contains("is a character device, not a regular file"),
                "{special}: {e}"
            );
            let e = data.identity().unwrap_err().to_string();
            assert!(
                e.contains("is a character device, not a regular file"),
                "{special}: {e}"
            );
        }
    }

    #[test]
    fn a_token_file_holds_a_sample_per_whole_window() {
        let dir = tempfile::tempdir().unwrap();
        // 16 tokens: one window of 8 and its next token, 7 left over.
        let l = DataLoader::new(&counting_file(dir.path(), 16), 64, 1, 8, 0).unwrap();
        assert_eq!(l.samples(), 1);
    }

    #[test]
    fn an_epoch_of_a_token_file_reads_every_window_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = DataLoader::new(&counting_file(dir.path(), 41), 64, 5, 8, 3).unwrap();
        let b = l.next_batch().unwrap();
        let mut starts: Vec<u32> = b.input_ids.chunks(8).map(|row| row[0]).collect();
        starts.sort_unstable();
        assert_eq!(starts, [0, 8, 16, 24, 32]);
    }

    #[test]
    fn grouping_by_length_sorts_each_mega_batch_and_puts_the_longest_first() {
        // 40 samples in micro-batches of 2: mega-batches of 2 × min(40 / 8, 50) = 10.
        let lengths: Vec<usize> = (0..40).map(|i| (i * 37) % 101).collect();
        let mut order: Vec<u64> = (0..40).rev().collect();
        group_by_length(&mut order, 2, |i| lengths[i as usize]);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..40).collect::<Vec<u64>>());
        let len = |at: usize| lengths[order[at] as usize];
        assert_eq!(len(0), *lengths.iter().max().unwrap());
        // Each mega-batch sorted longest first, but for its first sample: the longest of all
        // took the first mega-batch's front, and the one it replaced went to its place.
        for mega in order.chunks(10) {
            let l: Vec<usize> = mega[1..].iter().map(|&i| lengths[i as usize]).collect();
            assert!(l.windows(2).all(|w| w[0] >= w[1]), "{l:?}");
        }
    }

    #[test]
    fn synthetic_samples_follow_the_chain() {
        let l = DataLoader::new(&synthetic(None), 50, 1, 64, 0).unwrap();
        let Source::Synthetic { successors, .. } = &*l.source else {
            unreachable!()
        };
        let (mut transitions, mut followed) = (0, 0);
        for index in 0..10 {
            for pair in l.sample(index, 64).windows(2) {
                let next = &successors[pair[0] as usize * 4..][..4];
                transitions += 1;
                followed += usize::from(next.contains(&pair[1]));
            }
        }
        // One token in sixteen is noise (which may still hit a successor).
        assert!(
            followed * 100 >= transitions * 90,
            "{followed} of {transitions} transitions follow the chain"
        );
    }

    #[test]
    fn synthetic_data_defaults_to_4096_samples_of_4_successors() {
        let cfg: DataConfig = serde_json::from_str(r#"{"kind": "synthetic", "seed": 1}"#).unwrap();
        assert_eq!(
            cfg,
            DataConfig::Synthetic {
                seed: 1,
                samples: 4096,
                branching: 4,
                min_len: None,
            }
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_batch_larger_than_the_host_is_refused_before_anything_is_allocated() {
        let available = crate::memory::host_available().unwrap();
        // Twelve bytes a token (a u32 id and an i64 label): half the host's bytes in tokens is
        // six times what it has; the ids alone would be twice.
        let seq = usize::try_from(available / 2).unwrap();
        let mut l = DataLoader::new(&synthetic(Some(1)), 50, 1, seq, 0).unwrap();
        match l.next_batch() {
            Err(EngineError::HostMemory { what, bytes }) => {
                assert_eq!(what, "a batch (token ids and labels)");
                assert_eq!(bytes, seq as u64 * 12);
            }
            other => panic!("{:?}", other.map(|b| b.input_ids.len())),
        }
    }
}
