//! `parallel:` in a suite: how many ranks each phase runs on and what they shard.

use super::places::{place, Places};
use anyhow::{bail, Result};
use ckpt_engine::parallel::{Checkpoints, Shard, Transport};
use serde::Deserialize;
use serde_saphyr::Spanned;
use std::path::Path;

/// `parallel: {world_size: 4, shard: optimizer, resume_world_sizes: [3, 2]}`: the reference
/// phase on `world_size` ranks, each resumed phase on its own.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelSpec {
    /// Ranks of the reference phase, and of every resumed phase `resume_world_sizes` does not
    /// name; it must divide `training.accumulation`.
    #[serde(default = "one_rank")]
    pub world_size: usize,
    /// What the ranks shard.
    #[serde(default)]
    pub shard: Shard,
    /// How several ranks save checkpoints: `sharded` (a file per rank and an index, the
    /// default) or `gathered` (one device's layout).
    #[serde(default)]
    pub checkpoints: Checkpoints,
    /// How the ranks pass their messages: `channels` (a send returns at once, the default) or
    /// `rendezvous` (each send waits for its receive, as NCCL's do; the same bits).
    #[serde(default)]
    pub transport: Transport,
    /// Each rank a process of its own, as `train --rank` runs one (meeting over loopback TCP),
    /// rather than a thread of the harness's process: each phase's ranks are started, met and
    /// ended as processes, and each rank's resident host memory is its own.
    #[serde(default)]
    pub processes: bool,
    /// The ranks of each resumed phase in run order: `resume-mid`, each later resume of a chain,
    /// then `resume-end`. Absent: every phase on `world_size` ranks.
    #[serde(default)]
    pub resume_world_sizes: Option<Spanned<Vec<Spanned<usize>>>>,
}

fn one_rank() -> usize {
    1
}

impl ParallelSpec {
    /// The world size of each phase in run order: the reference's, then the `resumes` resumed
    /// phases'.
    pub fn world_sizes(&self, resumes: usize) -> Vec<usize> {
        let resumed = match &self.resume_world_sizes {
            Some(list) => list.value.iter().map(|w| w.value).collect(),
            None => vec![self.world_size; resumes],
        };
        std::iter::once(self.world_size).chain(resumed).collect()
    }

    /// Refuses what cannot run: a world size of 0 or one that does not divide the
    /// `accumulation` micro-batches of a step, and a `resume_world_sizes` list whose length is
    /// not the number of resumed phases. Each error names the key's place.
    pub fn validate(
        &self,
        path: &Path,
        places: &Places,
        accumulation: usize,
        resumes: usize,
    ) -> Result<()> {
        let at_world = places.value("parallel.world_size");
        divides(
            &at_world,
            "parallel.world_size",
            self.world_size,
            accumulation,
        )?;
        if let Some(list) = &self.resume_world_sizes {
            if list.value.len() != resumes {
                bail!(
                    "{}: parallel.resume_world_sizes lists {} world sizes, but the suite has {resumes} resumed phases (each resume point, then resume-end); list one per resumed phase, e.g. resume_world_sizes: {:?}",
                    place(path, list.referenced),
                    list.value.len(),
                    vec![self.world_size; resumes]
                );
            }
            for w in &list.value {
                let at = place(path, w.referenced);
                divides(&at, "parallel.resume_world_sizes", w.value, accumulation)?;
            }
        }
        Ok(())
    }
}

/// Refuses a world size `world` written at `at` under `key` that is 0 or does not divide the
/// step's `accumulation` micro-batches.
fn divides(at: &str, key: &str, world: usize, accumulation: usize) -> Result<()> {
    if world == 0 {
        bail!("{at}: {key} has a world size of 0; write the number of ranks, at least 1");
    }
    if !accumulation.is_multiple_of(world) {
        bail!(
            "{at}: {key} has a world size of {world}, which does not divide the {accumulation} micro-batches of a step (training.accumulation); each rank takes an equal run of them, so write a world size that divides {accumulation} or an accumulation that is a multiple of {world}"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Transport;
    use crate::forecast::plan;
    use crate::suite::Suite;
    use std::path::Path;

    const BASE: &str = "name: t
devices: [cpu]
model: {vocab_size: 37, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64}
data: {kind: synthetic, seed: 1, samples: 64}
batch_size: 2
seq_len: 16
optimizer: {lr: 0.001}
";

    fn parse(extra: &str) -> anyhow::Result<Suite> {
        Suite::parse(Path::new("s.yaml"), &format!("{BASE}{extra}"))
    }

    fn error(extra: &str) -> String {
        format!("{:#}", parse(extra).unwrap_err())
    }

    #[test]
    fn each_phase_runs_at_its_world_size() {
        let s = parse(
            "training: {max_steps: 8, resume_from: [2, 4], accumulation: 12}
parallel: {world_size: 4, shard: optimizer, resume_world_sizes: [3, 1, 2]}
",
        )
        .unwrap();
        let worlds: Vec<_> = plan(&s).iter().map(|p| p.world_size).collect();
        assert_eq!(worlds, [4, 3, 1, 2]);
        assert_eq!(s.train.parallel.world_size, 4);
        assert_eq!(s.train_at(3).parallel.world_size, 3);
        let same = parse("training: {max_steps: 8, accumulation: 6}\nparallel: {world_size: 3}\n");
        let worlds: Vec<_> = plan(&same.unwrap()).iter().map(|p| p.world_size).collect();
        assert_eq!(worlds, [3, 3, 3]);
    }

    #[test]
    fn a_world_size_that_does_not_divide_the_micro_batches_is_refused_at_its_place() {
        let m = error("training: {max_steps: 8, accumulation: 6}\nparallel:\n  world_size: 4\n");
        assert!(
            m.starts_with("s.yaml:10:15: parallel.world_size has a world size of 4, which does not divide the 6 micro-batches"),
            "{m}"
        );
        let m = error(
            "training: {max_steps: 8, accumulation: 6}\nparallel: {world_size: 2, resume_world_sizes: [3, 4]}\n",
        );
        assert!(
            m.starts_with("s.yaml:9:51: parallel.resume_world_sizes has a world size of 4"),
            "{m}"
        );
        let m = error("training: {max_steps: 8}\nparallel: {world_size: 0}\n");
        assert!(
            m.contains("world size of 0; write the number of ranks"),
            "{m}"
        );
    }

    #[test]
    fn resume_world_sizes_list_one_per_resumed_phase() {
        let m = error(
            "training: {max_steps: 8, resume_from: [2, 4], accumulation: 4}\nparallel: {world_size: 2, resume_world_sizes: [4, 1]}\n",
        );
        assert!(
            m.contains("lists 2 world sizes, but the suite has 3 resumed phases (each resume point, then resume-end); list one per resumed phase, e.g. resume_world_sizes: [2, 2, 2]"),
            "{m}"
        );
    }

    #[test]
    fn ranks_run_on_cuda_and_experts_on_ranks() {
        let text = format!(
            "{BASE}training: {{max_steps: 8, accumulation: 2}}\nparallel: {{world_size: 2}}\n"
        )
        .replace("devices: [cpu]", "devices: [cpu, cuda]");
        let s = Suite::parse(Path::new("s.yaml"), &text).unwrap();
        let worlds: Vec<_> = plan(&s).iter().map(|p| p.world_size).collect();
        assert_eq!(worlds, [2, 2, 2]);
        let moe = BASE.replace(
            "model: {",
            "model: {family: qwen3_moe, moe: {num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 16}, ",
        );
        let text = format!(
            "{moe}training: {{max_steps: 8, accumulation: 12}}\nparallel: {{world_size: 4, shard: full, resume_world_sizes: [3, 2]}}\n"
        );
        let s = Suite::parse(Path::new("s.yaml"), &text).unwrap();
        let worlds: Vec<_> = plan(&s).iter().map(|p| p.world_size).collect();
        assert_eq!(worlds, [4, 3, 2]);
    }

    #[test]
    fn the_transport_reaches_the_engine_and_a_misspelt_one_is_refused_at_its_place() {
        let s = parse("training: {max_steps: 8, accumulation: 2}\nparallel: {world_size: 2, transport: rendezvous}\n").unwrap();
        assert_eq!(s.train.parallel.transport, Transport::Rendezvous);
        let s = parse("training: {max_steps: 8, accumulation: 2}\nparallel: {world_size: 2, transport: sockets}\n").unwrap();
        assert_eq!(s.train.parallel.transport, Transport::Sockets);
        let s = parse("training: {max_steps: 8, accumulation: 2}\nparallel: {world_size: 2}\n")
            .unwrap();
        assert_eq!(s.train.parallel.transport, Transport::Channels);
        let m = error("training: {max_steps: 8}\nparallel: {world_size: 1, transport: nccl}\n");
        assert!(
            m.starts_with("s.yaml:9:38: transport: unknown variant `nccl`"),
            "{m}"
        );
        assert!(m.contains("rendezvous") && m.contains("sockets"), "{m}");
    }

    #[test]
    fn a_misspelt_stage_is_refused_at_its_place() {
        let m = error("training: {max_steps: 8}\nparallel: {world_size: 1, shard: optimiser}\n");
        assert!(
            m.starts_with("s.yaml:9:34: shard: unknown variant `optimiser`"),
            "{m}"
        );
        assert!(m.contains("optimiser"), "{m}");
        assert!(m.contains("optimizer"), "{m}");
    }
}
