//! The fix ladder: for a plan that breaks its budget, the playbook's changes in its order, each
//! applied alone to the suite's run and planned again over the same data on the counting
//! device, with its highest peak, whether every step and evaluation then fits, and what it
//! costs besides memory. The changes: the micro-batch halved with the accumulation doubled (the
//! same samples a step), bf16-mixed, selective then full activation checkpointing, the chunked
//! loss, a cap on the tokens a sample keeps (the longest that fits, found by bisection, with the
//! samples it would cut: it changes the data), batches grouped by length, and each ZeRO stage
//! beyond the suite's at its world sizes. The first in that order that fits is the cheapest.

use super::Forecast;
use crate::suite::Suite;
use anyhow::Result;
use ckpt_engine::backend::count::Like;
use ckpt_engine::data::text::{Overlong, Padding};
use ckpt_engine::data::DataConfig;
use ckpt_engine::model::loss::LossKind;
use ckpt_engine::parallel::Shard;
use ckpt_engine::{Checkpointing, Precision, TrainConfig};
use serde::Serialize;
use std::collections::BTreeMap;

/// Tokens per chunk of the chunked-loss rung (`estimate`'s default column).
const CHUNK_TOKENS: usize = 1024;

/// One change of the ladder, planned.
#[derive(Clone, Debug, Serialize)]
pub struct Rung {
    /// The change, as the suite would write it.
    pub change: String,
    /// What it costs besides memory.
    pub cost: String,
    /// The highest planned peak of any step or evaluation of any rank with the change.
    pub peak: u64,
    /// Whether every step and evaluation of every rank then fits its budget.
    pub fits: bool,
    /// The suite's run with the change.
    #[serde(skip)]
    pub run: TrainConfig,
}

/// The ladder of `suite`, whose plan is `planned`, on the backend `like` models, each rank's
/// budget on `world` ranks `limit(world)`; empty where the suite's own plan fits.
pub fn ladder(
    suite: &Suite,
    planned: &Forecast,
    like: Like,
    limit: &dyn Fn(usize) -> u64,
) -> Result<Vec<Rung>> {
    if fits(planned, limit) {
        return Ok(Vec::new());
    }
    let run = &suite.train;
    let micro_batches = run.accumulation
        / planned
            .phases
            .first()
            .map_or(1, |p| p.planned.world_size)
            .max(1);
    let blocks = run.model.num_hidden_layers * micro_batches;
    let mut rungs = Vec::new();
    let rung = |change: String, cost: String, changed: Suite| -> Result<Rung> {
        let f = Forecast::of(&changed, like)?;
        Ok(Rung {
            change,
            cost,
            peak: highest(&f),
            fits: fits(&f, limit),
            run: changed.train,
        })
    };
    if run.batch_size >= 2 && run.batch_size.is_multiple_of(2) {
        let changed = with(suite, |t| {
            t.batch_size /= 2;
            t.accumulation *= 2;
        });
        rungs.push(rung(
            format!(
                "batch_size: {}, training.accumulation: {}",
                run.batch_size / 2,
                run.accumulation * 2
            ),
            "the same samples a step in twice the micro-batches, each half as tall".into(),
            changed,
        )?);
    }
    if run.precision == Precision::Fp32 {
        rungs.push(rung(
            "precision: bf16-mixed".into(),
            "bf16 weights and activations: the losses move".into(),
            with(suite, |t| t.precision = Precision::Bf16Mixed),
        )?);
    }
    if run.checkpointing == Checkpointing::None {
        rungs.push(rung(
            "checkpointing: selective".into(),
            format!("each block's norms and SwiGLU recomputed in its backward pass: {blocks} blocks in part a step"),
            with(suite, |t| t.checkpointing = Checkpointing::Selective),
        )?);
    }
    if run.checkpointing != Checkpointing::Full {
        rungs.push(rung(
            "checkpointing: full".into(),
            format!("{blocks} blocks recomputed a step: a second forward pass"),
            with(suite, |t| t.checkpointing = Checkpointing::Full),
        )?);
    }
    if run.loss == LossKind::Standard {
        rungs.push(rung(
            format!("loss: {{kind: chunked, chunk_tokens: {CHUNK_TOKENS}}}"),
            "none: the logits a chunk at a time".into(),
            with(suite, |t| {
                t.loss = LossKind::Chunked {
                    chunk_tokens: CHUNK_TOKENS,
                }
            }),
        )?);
    }
    if let Some(cap) = capped(suite, planned, like, limit)? {
        rungs.push(cap);
    }
    if let DataConfig::Text(text) = &run.data {
        if !text.group_by_length && text.padding == Padding::Longest {
            rungs.push(rung(
                "data.group_by_length: true".into(),
                "the samples trained in another order: the losses move".into(),
                with(suite, |t| {
                    if let DataConfig::Text(text) = &mut t.data {
                        text.group_by_length = true;
                    }
                }),
            )?);
        }
    }
    let worlds = planned
        .phases
        .iter()
        .map(|p| p.planned.world_size)
        .max()
        .unwrap_or(1);
    if worlds > 1 {
        let stages = [Shard::None, Shard::Optimizer, Shard::Gradients, Shard::Full];
        let beyond = stages
            .iter()
            .position(|&s| s == run.parallel.shard)
            .map_or(0, |i| i + 1);
        for &shard in &stages[beyond..] {
            let name = format!("{shard:?}").to_lowercase();
            rungs.push(rung(
                format!("parallel.shard: {name}"),
                format!(
                    "ZeRO-{} at the suite's world sizes: more bytes between the ranks a step",
                    shard as usize
                ),
                with(suite, |t| t.parallel.shard = shard),
            )?);
        }
    }
    Ok(rungs)
}

/// The first rung that fits: the cheapest change.
pub fn cheapest(rungs: &[Rung]) -> Option<&Rung> {
    rungs.iter().find(|r| r.fits)
}

/// `suite` with its run changed by `change`.
fn with(suite: &Suite, change: impl FnOnce(&mut TrainConfig)) -> Suite {
    let mut changed = suite.clone();
    change(&mut changed.train);
    changed
}

/// Whether every step and evaluation of `f` fits its rank's budget.
fn fits(f: &Forecast, limit: &dyn Fn(usize) -> u64) -> bool {
    f.phases.iter().all(|p| {
        let budget = limit(p.planned.world_size);
        let steps = p.steps.iter().all(|s| s.highest().1 <= budget);
        let evaluations = (p.evaluations.iter()).all(|e| e.rank_peaks.iter().all(|&b| b <= budget));
        steps && evaluations
    })
}

/// The highest peak of any step or evaluation of any rank of `f`.
fn highest(f: &Forecast) -> u64 {
    f.highest().map_or(0, |(peak, _)| peak)
}

/// The cap rung of text padded to each micro-batch's longest or to `seq_len`: the most tokens a
/// sample may keep for the plan to fit (bisected; samples over it cut, `overlong: truncate`),
/// with the samples of the run it cuts and the tokens they lose; `None` for other data, or
/// where no cap below `seq_len` fits. `planned` is the suite's own plan.
fn capped(
    suite: &Suite,
    planned: &Forecast,
    like: Like,
    limit: &dyn Fn(usize) -> u64,
) -> Result<Option<Rung>> {
    let DataConfig::Text(text) = &suite.train.data else {
        return Ok(None);
    };
    if text.padding == Padding::Packed || suite.train.long_batch.is_some() {
        return Ok(None);
    }
    let changed = |cap: usize| {
        with(suite, |t| {
            t.seq_len = cap;
            if let DataConfig::Text(text) = &mut t.data {
                text.overlong = Overlong::Truncate;
            }
        })
    };
    // The longest cap that fits, and its plan's highest peak.
    let (mut lo, mut hi, mut peak) = (0, suite.train.seq_len, 0);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        let f = Forecast::of(&changed(mid), like)?;
        match fits(&f, limit) {
            true => (lo, peak) = (mid, highest(&f)),
            false => hi = mid,
        }
    }
    if lo == 0 {
        return Ok(None);
    }
    let mut cut: BTreeMap<u64, usize> = BTreeMap::new();
    for sample in planned.data.steps.iter().flatten().flat_map(|m| &m.samples) {
        if sample.tokens > lo {
            cut.insert(sample.index, sample.tokens - lo);
        }
    }
    let lost: usize = cut.values().sum();
    Ok(Some(Rung {
        change: format!("seq_len: {lo}, data.overlong: truncate"),
        cost: format!(
            "changes the data: {} sample(s) the run trains cut, {lost} tokens lost (samples {})",
            cut.len(),
            cut.keys()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        peak,
        fits: true,
        run: changed(lo).train,
    }))
}
