//! What a checkpoint of the ranks holds: each rank's chunk of every tensor for a sharded save, or
//! every tensor gathered whole in one device's layout.

use super::experts;
use super::{shard_rows, Ranks};
use crate::checkpoint::{Chunk, Entry, RankChunks, Tensors};
use crate::device::Device;
use crate::error::{EngineError, Result};
use crate::fault::Fault;
use crate::model::ParamSpec;
use crate::parallel::collective::Collective;
use crate::parallel::plan::shard_of;
use crate::parallel::{Checkpoints, Shard};
use crate::state::State;
use std::borrow::Cow;

impl<D: Device> Ranks<D> {
    /// The bytes of the tensors [`Ranks::checkpoint_entries`] returns, from their sizes alone:
    /// rank 0's, and with sharded optimizer state every other rank's share of it (under
    /// `shard: full`, every other rank's share of everything).
    pub fn checkpoint_bytes(&self) -> u64 {
        let others = self.states[1..].iter();
        let others = match self.parallel.shard {
            Shard::None => 0,
            Shard::Optimizer | Shard::Gradients => others.map(State::optimizer_state_bytes).sum(),
            Shard::Full => others.map(State::checkpoint_bytes).sum(),
        };
        self.states[0].checkpoint_bytes() + others
    }

    /// What a checkpoint of the ranks holds: one rank's tensors; with several ranks that save
    /// [`Checkpoints::Sharded`], each rank's chunk of every tensor (see
    /// `Ranks::checkpoint_chunks`: where the ranks are processes of their own, this
    /// process's rank's alone); else every tensor gathered whole (see
    /// [`Ranks::checkpoint_entries`]).
    pub fn checkpoint_tensors(&self) -> Result<Tensors<'_>> {
        if self.world() > 1 && self.parallel.checkpoints == Checkpoints::Sharded {
            return self.checkpoint_chunks().map(Tensors::Sharded);
        }
        let (model, optimizer) = self.checkpoint_entries()?;
        Ok(Tensors::Whole { model, optimizer })
    }

    /// Each rank's chunk of every checkpoint tensor: its rows of what it holds sharded (as it
    /// holds them), and its rows by the shard plan of what it holds whole, so that the ranks
    /// write a tensor's rows between them once and nothing is gathered
    /// ([`Fault::OnlyRankZeroExpertsSaved`] writes rank 0's experts in the others' place).
    fn checkpoint_chunks(&self) -> Result<Vec<RankChunks<'_>>> {
        let world = self.world();
        let shard = self.parallel.shard;
        let first = self.rank();
        let mut ranks = Vec::with_capacity(self.states.len());
        for (rank, state) in (first..).zip(&self.states) {
            let (mut model, mut optimizer) = state.checkpoint_entries()?;
            if self.faults.has(Fault::OnlyRankZeroExpertsSaved) {
                model = experts::as_rank_zero_s(model, world);
                optimizer = experts::as_rank_zero_s(optimizer, world);
            }
            ranks.push(RankChunks {
                model: self.chunks(model, rank, shard == Shard::Full)?,
                optimizer: self.chunks(optimizer, rank, shard != Shard::None)?,
            });
        }
        Ok(ranks)
    }

    /// Rank `rank`'s chunks of its checkpoint `entries`: the whole shard where the rank holds
    /// them `sharded`, else its rows by the shard plan ([`Fault::LastUnevenShardDropped`] marks
    /// a tensor's last, short shard skipped).
    fn chunks<'s>(
        &self,
        entries: Vec<Entry<'s>>,
        rank: usize,
        sharded: bool,
    ) -> Result<Vec<Chunk<'s>>> {
        let world = self.world();
        entries
            .into_iter()
            .map(|entry| {
                let spec = self.spec_of(&entry.name)?;
                let mut chunk = if sharded {
                    let rows = shard_rows(&spec.shape, world, rank, &self.faults).0;
                    Chunk::shard(entry, &spec.shape, rows)
                } else {
                    Chunk::rows_of(&entry, shard_of(&spec.shape, world, rank).0)
                };
                let d0 = spec.shape.first().copied().unwrap_or(1);
                let short_last = !chunk.rows.is_empty()
                    && chunk.rows.end == d0
                    && chunk.rows.len() < d0.div_ceil(world);
                chunk.skipped = short_last && self.faults.has(Fault::LastUnevenShardDropped);
                Ok(chunk)
            })
            .collect()
    }

    /// The parameter whose weight, moment or master weight a checkpoint entry named `name` holds.
    fn spec_of(&self, name: &str) -> Result<&ParamSpec> {
        let param = parameter_of(name);
        self.specs.iter().find(|s| s.name == param).ok_or_else(|| {
            EngineError::Config(format!("checkpoint entry {name} names no parameter"))
        })
    }

    /// What a checkpoint of the ranks holds, as one device's checkpoint holds it: with sharded
    /// optimizer state each moment's (and bf16-mixed master weight's) rows gathered from the
    /// ranks that hold them, in rank order; under `shard: full` each weight's rows too; rank 0's
    /// tensors where they are whole. Where the ranks are processes of their own, the rows come
    /// over the connections, and every rank must ask at once.
    pub fn checkpoint_entries(&self) -> Result<(Vec<Entry<'_>>, Vec<Entry<'_>>)> {
        let (mut model, mut optimizer) = self.states[0].checkpoint_entries()?;
        let shard = self.parallel.shard;
        if shard == Shard::None || self.world() == 1 {
            return Ok((model, optimizer));
        }
        // The other ranks' entries, where this process holds them.
        let others = match self.process {
            Some(_) => Vec::new(),
            None => (self.states[1..].iter())
                .map(State::checkpoint_entries)
                .collect::<Result<Vec<_>>>()?,
        };
        let mut sharded = vec![(&mut optimizer, false)];
        if shard == Shard::Full {
            sharded.push((&mut model, true));
        }
        for (entries, of_model) in sharded {
            for (i, entry) in entries.iter_mut().enumerate() {
                *entry = match &self.process {
                    Some(process) => {
                        let comm = process.connections()?.0;
                        let shards = comm.all_gather(entry.data.to_vec())?;
                        self.whole(entry, shards.iter().map(Vec::as_slice))?
                    }
                    None => {
                        let theirs = others.iter().map(|(model, optimizer)| match of_model {
                            true => &*model[i].data,
                            false => &*optimizer[i].data,
                        });
                        self.whole(entry, std::iter::once(&*entry.data).chain(theirs))?
                    }
                };
            }
        }
        Ok((model, optimizer))
    }

    /// `entry` made whole from every rank's rows of it (`shards`, in rank order), each written
    /// at its shard's offset.
    fn whole<'e, 's>(
        &self,
        entry: &Entry<'e>,
        shards: impl Iterator<Item = &'s [u8]>,
    ) -> Result<Entry<'e>> {
        let world = self.world();
        let spec = self.spec_of(&entry.name)?;
        let elem = entry.dtype.bitsize() / 8;
        let mut data = vec![0u8; spec.shape.iter().product::<usize>() * elem];
        for (rank, shard) in shards.enumerate() {
            let (rows, row) = shard_rows(&spec.shape, world, rank, &self.faults);
            let at = rows.start * row * elem;
            let into = data.get_mut(at..at + shard.len()).ok_or_else(|| {
                EngineError::Config(format!(
                    "rank {rank}'s shard of {} ({} bytes from byte {at}) overruns the tensor",
                    entry.name,
                    shard.len()
                ))
            })?;
            into.copy_from_slice(shard);
        }
        Ok(Entry {
            name: entry.name.clone(),
            dtype: entry.dtype,
            shape: spec.shape.clone(),
            data: Cow::Owned(data),
        })
    }
}

/// The parameter whose moment or master weight an optimizer entry holds.
fn parameter_of(name: &str) -> &str {
    [".exp_avg_sq", ".exp_avg", ".master"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .unwrap_or(name)
}
