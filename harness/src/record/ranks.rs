//! Each rank's memory in a data-parallel trial, and the record as one rank saw it.
//!
//! A phase on `N > 1` ranks records every rank's bytes (each rank has a device and a tracker
//! of its own); its phase and step figures at the top level are rank 0's. The memory checks
//! read one rank at a time through [`RunRecord::views`]: the phases at one world size, with
//! that rank's figures and that rank's memory model in place of rank 0's, so the same check
//! judges every rank of every world size a trial ran at. A MoE step carries each rank's own
//! prediction, at the routing of the micro-batches that rank trained.

use super::{HostMemory, PhaseRecord, PredictedStep, RunRecord, Window};
use ckpt_engine::memory::Breakdown;
use ckpt_engine::MemoryStats;
use serde::{Deserialize, Serialize};

/// One rank's figures of a phase.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RankPhase {
    /// Bytes the rank's device held before the phase's trainer was built.
    pub before: Breakdown,
    /// Bytes it held after the trainer was dropped.
    pub after: Breakdown,
    /// Its peak while the trainer was built (the checkpoint loaded, for a resume).
    pub setup: Window,
    /// The resident host memory of the rank's own process, where each rank is a process of its
    /// own (`parallel.processes`); `None` where the ranks share one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<HostMemory>,
}

/// One rank's figures of a step.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RankStep {
    /// Bytes held per category when the step began.
    pub start: Breakdown,
    /// Bytes of an asynchronous save's staging buffers held when the step began.
    pub staging: u64,
    /// The step's memory figures on this rank.
    pub memory: MemoryStats,
    /// A MoE step's memory model on this rank, at the routing of the micro-batches the rank
    /// trained (the rank's share of the step's recorded tokens per expert).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted: Option<[PredictedStep; 2]>,
}

/// The memory model of one rank: what [`RunRecord`]'s run-wide predictions say for one device.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RankModel {
    /// A step without AdamW's moments yet and one with them.
    pub predicted: [PredictedStep; 2],
    /// The same for the long rows of a suite's `long_batch`, and the step they start at.
    pub predicted_long: Option<(u64, [PredictedStep; 2])>,
    /// The peak while a checkpoint is loaded.
    pub predicted_load: u64,
    /// An asynchronous save's staging bytes on this rank's tracker.
    pub predicted_staging: u64,
    /// The rank's device capacity in bytes.
    pub capacity: u64,
    /// The per-step budget of one rank, if the suite sets one.
    pub budget: Option<u64>,
}

/// The memory model of every rank at one world size.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct WorldModel {
    /// Ranks.
    pub world_size: usize,
    /// Each rank's model, in rank order.
    pub ranks: Vec<RankModel>,
}

/// The record as one rank of one world size saw it.
pub struct RankView {
    /// The rank, for a world size above 1; `None` for one device.
    pub rank: Option<usize>,
    /// The phases at that world size, with the rank's figures and model.
    pub record: RunRecord,
}

impl RunRecord {
    /// The record one rank at a time: for a trial on one device, the record itself; else, for
    /// each world size its phases ran at (every planned one, unless the run ended early) and
    /// each rank of it, those phases with that rank's figures and memory model. The host's resident
    /// memory is the process's: where the ranks share one, only rank 0's view keeps its budget;
    /// where each is a process of its own, each view has its process's and keeps it.
    pub fn views(&self) -> Vec<RankView> {
        if self.worlds.is_empty() {
            return vec![RankView {
                rank: None,
                record: self.clone(),
            }];
        }
        let mut views = Vec::new();
        let ran_at = |world: &WorldModel| {
            self.planned.iter().any(|p| {
                p.world_size == world.world_size && self.phases.iter().any(|r| r.phase == p.phase)
            })
        };
        // A run that ended early never reached the world sizes of its later phases: nothing
        // there to judge.
        for world in self
            .worlds
            .iter()
            .filter(|w| !self.ended_early() || ran_at(w))
        {
            for (r, model) in world.ranks.iter().enumerate() {
                views.push(RankView {
                    rank: (world.world_size > 1).then_some(r),
                    record: self.rank_view(world.world_size, r, model),
                });
            }
        }
        views
    }

    /// The phases planned at `world_size` ranks, as rank `rank` saw them under `model`.
    fn rank_view(&self, world_size: usize, rank: usize, model: &RankModel) -> RunRecord {
        let own_host = self
            .phases
            .iter()
            .any(|p| p.ranks.get(rank).is_some_and(|r| r.host.is_some()));
        let at_world = |phase| {
            self.planned
                .iter()
                .any(|p| p.phase == phase && p.world_size == world_size)
        };
        let phases = self
            .phases
            .iter()
            .filter(|p| at_world(p.phase))
            .map(|p| rank_phase(p, rank))
            .collect();
        RunRecord {
            predicted: model.predicted.clone(),
            predicted_long: model.predicted_long.clone(),
            predicted_load: model.predicted_load,
            predicted_staging: model.predicted_staging,
            capacity: model.capacity,
            budget: model.budget,
            rss_budget: self.rss_budget.filter(|_| rank == 0 || own_host),
            planned: self
                .planned
                .iter()
                .filter(|p| p.world_size == world_size)
                .copied()
                .collect(),
            phases,
            worlds: Vec::new(),
            ..self.clone()
        }
    }
}

/// Phase `p` with rank `rank`'s figures in place of rank 0's (unchanged on one device).
fn rank_phase(p: &PhaseRecord, rank: usize) -> PhaseRecord {
    let mut p = p.clone();
    if let Some(mine) = p.ranks.get(rank).cloned() {
        p.before = mine.before;
        p.after = mine.after;
        p.setup = mine.setup;
        if let Some(host) = mine.host {
            p.host = host;
        }
    }
    for s in &mut p.steps {
        if let Some(mine) = s.ranks.get(rank).cloned() {
            s.start = mine.start;
            s.staging = mine.staging;
            s.memory = mine.memory;
            s.predicted = mine.predicted;
        }
    }
    for e in &mut p.evaluations {
        if let Some(&peak) = e.rank_peaks.get(rank) {
            if rank > 0 {
                e.memory = MemoryStats::default();
            }
            e.memory.allocated.peak = peak;
        }
        e.rank_peaks.clear();
        e.predicted_peaks = e.predicted_peaks.get(rank).copied().into_iter().collect();
    }
    p.ranks.clear();
    p.steps.iter_mut().for_each(|s| s.ranks.clear());
    p
}
