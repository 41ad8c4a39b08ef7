//! What data-parallel ranks share below the checkpoints: how they move bytes, which rows each
//! holds, what they are built from, and how a suite configures them. The ranks themselves, one
//! model trained by several ranks with the bits of one, are [`crate::ranks`], above
//! [`crate::checkpoint`], which reads and writes through the plan and the collectives here.
//!
//! - [`collective`]: how ranks move bytes (never add them): the trait and the in-process group
//!   CPU ranks use.
//! - [`buffered`]: a rank's receiving ends kept open, over a transport whose sends wait for
//!   their receive (NCCL's point-to-point).
//! - [`rendezvous`]: such a transport in one process, which CPU ranks can run on
//!   ([`Transport::Rendezvous`]).
//! - [`sockets`]: a transport over TCP, a connection for each pair of ranks, wherever the
//!   ranks run; CPU ranks in one process can run on it over the loopback
//!   ([`Transport::Sockets`]).
//! - [`plan`]: which rows of each tensor a rank holds (`ceil(d0 / N)` rows, the last shards
//!   short or empty).
//! - [`source`]: the rows a rank is built from.
//!
//! docs/PARALLEL.md has the design and why the reduction order does not depend on the world
//! size.

pub mod buffered;
pub mod collective;
#[cfg(test)]
mod conformance;
pub mod plan;
pub mod rendezvous;
pub mod sockets;
pub mod source;

use serde::{Deserialize, Serialize};

/// What the ranks split between them besides the micro-batches (ZeRO's stages; FSDP's
/// NO_SHARD and SHARD_GRAD_OP).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Shard {
    /// Every rank holds every weight, gradient and moment.
    #[default]
    None,
    /// Each rank holds the AdamW moments (and updates the weights) of its rows of every tensor
    /// only; the updated rows are gathered onto every rank (ZeRO-1).
    Optimizer,
    /// The optimizer's split, and each rank holds its rows of every gradient only: a gradient
    /// is whole only while a pass adds to it, passed from rank to rank in global micro-batch
    /// order (ZeRO-2).
    Gradients,
    /// The gradients' split, and each rank holds its rows of every weight only: a block's
    /// weights are gathered whole just before a pass reads them and freed just after, in the
    /// forward pass and again in the backward pass (ZeRO-3, FSDP's FULL_SHARD).
    Full,
}

/// How several ranks save a checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Checkpoints {
    /// Each rank writes its rows of every tensor into a file of its own, listed by an index
    /// (see [`crate::checkpoint::shards`]); nothing is gathered.
    #[default]
    Sharded,
    /// Every tensor is gathered whole and written in one device's layout (`model.safetensors`,
    /// `optimizer.safetensors`), as a single-device run writes it.
    Gathered,
}

/// How the ranks of one process pass their messages to each other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Transport {
    /// A channel for each ordered pair of ranks: a send returns at once ([`collective`]).
    #[default]
    Channels,
    /// Each send waits until its peer takes the message, as NCCL's point-to-point does; each
    /// rank keeps a receive posted for every peer on a thread of its own ([`rendezvous`],
    /// [`buffered`]). The same bits as over channels: a run on it shows that a stage's messages
    /// need nothing more of NCCL.
    Rendezvous,
    /// A TCP connection for each pair of ranks, over the loopback, each message its length and
    /// then its bytes ([`sockets`]): the transport ranks in processes of their own, or on other
    /// machines, pass their messages over. The same bits as over channels.
    Sockets,
}

/// How a run is spread over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Parallel {
    /// Ranks, each on its own device; it must divide the micro-batches of a step.
    #[serde(default = "one_rank")]
    pub world_size: usize,
    /// What the ranks shard.
    #[serde(default)]
    pub shard: Shard,
    /// How the ranks save checkpoints (a single rank always saves one device's layout).
    #[serde(default)]
    pub checkpoints: Checkpoints,
    /// How the ranks pass their messages.
    #[serde(default)]
    pub transport: Transport,
}

fn one_rank() -> usize {
    1
}

impl Default for Parallel {
    fn default() -> Self {
        Parallel {
            world_size: 1,
            shard: Shard::None,
            checkpoints: Checkpoints::Sharded,
            transport: Transport::Channels,
        }
    }
}

impl Parallel {
    /// One rank holding everything: a run without data parallelism.
    pub fn is_single(&self) -> bool {
        self.world_size == 1 && self.shard == Shard::None
    }
}
