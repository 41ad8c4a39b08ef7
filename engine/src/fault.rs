//! Deliberate engine faults. Each one reproduces a bug that real training stacks have shipped;
//! the harness's negative controls switch one on and prove that the check aimed at it fails.
//! With no fault set (the default) the engine is correct.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// One deliberate bug.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// Activation checkpointing is configured but blocks inside a nested container (every
    /// layer after the first) silently keep all their activations.
    CheckpointingSkippedNested,
    /// The inputs a checkpointed block recomputed from are kept alive after the backward pass.
    RecomputeInputsKept,
    /// A recomputed MoE block keeps each expert's dispatched input rows and their gradient
    /// alive after its backward pass, so memory grows with the recomputed MoE layers.
    MoeDispatchKept,
    /// The optimizer state outlives the trainer that owned it.
    OptimizerStateRetained,
    /// A resumed trainer allocates the optimizer state at load a second time, a zeroed copy of
    /// every moment beside the loaded ones, and frees the copy only at the end of the first
    /// resumed step, instead of allocating nothing more than the loaded state before the first
    /// step (Megatron-LM #3558 and #4638: more memory reserved on resume than in the fresh run).
    /// The bits are untouched and the steps after the first hold what the fresh run's hold.
    OptimizerStateAllocatedAtLoad,
    /// The dropout generator restarts from its seed on resume instead of its saved offset.
    RngNotRestored,
    /// The data loader restarts from the beginning on resume.
    LoaderPositionNotRestored,
    /// A run resumed from a checkpoint written exactly at an epoch's end starts the epoch after
    /// the next: the finished epoch is counted twice, so a whole epoch of samples is skipped.
    EpochSkippedAtBoundary,
    /// With gradient accumulation, checkpoints save the loader position as if each optimizer
    /// step had read one micro-batch (`steps × batch_size` samples) instead of
    /// `accumulation` of them, so a resumed run reads samples again.
    LoaderPositionCountsSteps,
    /// A trainer that was resumed saves its loader position without the position it was
    /// resumed at: only the samples read since the resume. A resume from a fresh run's
    /// checkpoint is unharmed; a resume from a resumed run's checkpoint reads samples again.
    LoaderOffsetLostOnResave,
    /// The learning-rate schedule restarts from step 0 on resume.
    ScheduleReset,
    /// Checkpoints are written without the AdamW moments.
    MomentsNotSaved,
    /// An asynchronous save copies nothing when it is asked for: its writer reads the live
    /// weights and optimizer state when the save is finished, after the next step has updated
    /// them, so the checkpoint of step `s` holds step `s + 1`'s tensors under step `s`'s
    /// trainer state.
    AsyncSaveReadsLiveWeights,
    /// Data parallelism sums the gradients by rank: each rank adds up its own micro-batches
    /// from zero and the ranks' sums are added in rank order, so the bits depend on the world
    /// size (as an all-reduce's do). Acts on the chain of `shard: none` and `optimizer`.
    GradientsSummedByRank,
    /// The optimizer shards of data parallelism start one row late on every rank but the
    /// first: a row at each shard boundary is never updated.
    ShardBoundaryOffByOne,
    /// Data-parallel ranks take every `world_size`-th micro-batch of a step (rank r takes r,
    /// r + N, ...), a rule that depends on the world size, instead of a contiguous run in global
    /// order. Acts on the chain of `shard: none` and `optimizer` (under `shard: gradients` that
    /// is the rule, and the ring keeps the order).
    MicroBatchesStrided,
    /// Each data-parallel checkpoint saves the data position one rank read (the global count
    /// divided by the world size), and a resumed run multiplies it by its own world size: at
    /// the same world size the position comes back, at another the loader lands elsewhere
    /// (Megatron-Bridge #5637: a run on 2 ranks resumed on 1 drops rank 1's position).
    LoaderPositionPerRank,
    /// Full sharding keeps every weight it gathers until the step's passes end instead of
    /// freeing it once the pass has read it: each rank's step peak holds a gathered copy of the
    /// weights for every use (FSDP's `reshard_after_forward` off, and the backward's copies
    /// never freed). The bits are untouched and the step ends with nothing held.
    GatheredWeightsKept,
    /// A resume at another world size than the save's gives each rank the moments at the
    /// saving world size's offsets (its rows' count, starting where the saving rank of its
    /// index started), as a resharding loader that keeps the old plan would (ROCm/Megatron-LM
    /// #63: at another GPU count a weight's chunks load in the wrong order). Needs a sharded
    /// checkpoint, whose index records the saving world size; at the same world size it does
    /// nothing.
    MomentsAtSavedOffsets,
    /// A resume restores the dropout generator's position on rank 0 only: every other rank
    /// draws its masks as a generator started at the resume would (trainers that save only rank
    /// 0's random state). Needs dropout and several ranks; the saved state is untouched.
    RngRestoredOnRankZeroOnly,
    /// A sharded save on several ranks writes each expert's tensors (weights, moments and
    /// master weights) as rank 0's expert of the same index among the experts its rank would
    /// own in an expert-parallel layout (`ceil(E / N)` a rank): an expert-parallel checkpoint
    /// that kept one rank's expert files for every rank. The trainer's state is untouched;
    /// one rank and gathered saves are unharmed.
    OnlyRankZeroExpertsSaved,
    /// A sharded save on several ranks leaves out every tensor's last shard where it is short
    /// (fewer rows than the others', a first dimension the world size does not divide): not in
    /// the last rank's file nor in the index, as a writer that skips the uneven last shard does
    /// (PyTorch #102821). It acts past the writer's own check that the chunks tile each
    /// tensor, as another writer would have produced it. The trainer's state is untouched; one
    /// rank's and gathered saves, and tensors the world size divides, are unharmed.
    LastUnevenShardDropped,
    /// A resumed trainer evaluates its validation split again at the step it resumed at, when
    /// that step was due one: the run saved there had already evaluated it (axolotl #3575,
    /// Megatron-Bridge #5076: evaluation re-run on every resume). The training is untouched.
    EvaluationRepeatedAtResume,
    /// The validation loader is not reset before an evaluation: each one reads on from where
    /// the last stopped, so an evaluation depends on how many came before it in the process,
    /// and a resumed run evaluates other samples than the uninterrupted run at the same step.
    /// Needs `validation.batches` short of the whole split. The training is untouched.
    ValidationLoaderNotReset,
    /// An evaluation's forward pass keeps every block's activations until its loss, as a
    /// forward pass run without `torch.no_grad()` keeps the autograd graph: its peak is a
    /// training forward pass's, not the one block's an evaluation needs (the evaluation that
    /// runs out of memory on its own). The bits are untouched and nothing outlives the pass.
    EvaluationKeepsActivations,
    /// A packing loader's checkpoint leaves out the pack in flight: the sample drawn for a row
    /// it did not fit in. The resumed run begins its next row with the sample after it, and the
    /// dropped one is never trained on in its epoch (torchtitan #3008: the sample in flight at
    /// a pack boundary lost on resume). Needs `padding: packed` data.
    PackInFlightDropped,
}

/// The set of faults a run injects.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Faults(BTreeSet<Fault>);

impl Faults {
    /// Whether `fault` is injected.
    pub fn has(&self, fault: Fault) -> bool {
        self.0.contains(&fault)
    }

    /// Whether no fault is injected.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The injected faults, in order.
    pub fn iter(&self) -> impl Iterator<Item = Fault> + '_ {
        self.0.iter().copied()
    }
}

impl FromIterator<Fault> for Faults {
    fn from_iter<I: IntoIterator<Item = Fault>>(iter: I) -> Self {
        Faults(iter.into_iter().collect())
    }
}
