//! The weight gathers of `shard: full`: a group's weights gathered whole from every rank's rows
//! just before a pass reads them, and freed just after.

use super::shard_rows;
use crate::device::{Device, DeviceTensor};
use crate::error::{EngineError, Result};
use crate::fault::{Fault, Faults};
use crate::memory::Category;
use crate::model::{Group, Layout, Params};
use crate::parallel::collective::Collective;
use crate::tensor::Elem;

/// A rank's weights under `shard: full`: between uses a rank holds its rows of each weight; a
/// group's weights are gathered whole from every rank's rows just before a pass reads them and
/// freed just after.
pub(super) struct WeightGather<'a, D: Device, E: Elem> {
    dev: D,
    comm: &'a dyn Collective,
    layout: &'a Layout,
    faults: &'a Faults,
    /// The rank's rows of each weight whose whole tensor is in place.
    stash: Vec<Option<D::Tensor<E>>>,
    /// Whole weights [`Fault::GatheredWeightsKept`] keeps until the step's passes end.
    kept: Vec<D::Tensor<E>>,
}

impl<'a, D: Device, E: Elem> WeightGather<'a, D, E> {
    pub(super) fn new(
        dev: D,
        comm: &'a dyn Collective,
        layout: &'a Layout,
        faults: &'a Faults,
    ) -> Self {
        WeightGather {
            dev,
            comm,
            layout,
            faults,
            stash: (0..layout.specs.len()).map(|_| None).collect(),
            kept: Vec::new(),
        }
    }

    /// Gathers `group`'s weights whole into `w`, keeping the rank's rows aside.
    pub(super) fn weights_in(&mut self, w: &mut Params<D::Tensor<E>>, group: Group) -> Result<()> {
        let (world, elem) = (self.comm.world_size(), std::mem::size_of::<E>());
        for t in self.layout.tensors_of(group) {
            if self.stash[t].is_some() {
                return Err(EngineError::Config(format!(
                    "weight {t} was gathered twice without being freed"
                )));
            }
            let mine = w.get(t);
            let bytes = self.dev.read_bytes(mine, 0, mine.bytes() as usize)?;
            let shape = &self.layout.specs[t].shape;
            let mut whole = self.dev.zeros::<E>(shape, Category::Params)?;
            for (from, rows_bytes) in self.comm.all_gather(bytes)?.into_iter().enumerate() {
                let (rows, row) = shard_rows(shape, world, from, self.faults);
                self.dev
                    .write_bytes(&mut whole, rows.start * row * elem, &rows_bytes)?;
            }
            self.stash[t] = Some(std::mem::replace(w.get_mut(t), whole));
        }
        Ok(())
    }

    /// Frees `group`'s whole weights, putting the rank's rows back (or, with
    /// [`Fault::GatheredWeightsKept`], keeps them until the step's passes end).
    pub(super) fn weights_out(&mut self, w: &mut Params<D::Tensor<E>>, group: Group) -> Result<()> {
        for t in self.layout.tensors_of(group) {
            let mine = self.stash[t].take().ok_or_else(|| {
                EngineError::Config(format!("weight {t} was freed without being gathered"))
            })?;
            let whole = std::mem::replace(w.get_mut(t), mine);
            if self.faults.has(Fault::GatheredWeightsKept) {
                self.kept.push(whole);
            }
        }
        Ok(())
    }
}
