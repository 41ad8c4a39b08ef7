//! The ring of `shard: gradients` and `full`: each tensor's gradient sum handed from the rank of
//! one micro-batch to the rank of the next, as the backward pass finishes with it.

use super::{shard_rows, F32};
use crate::device::{Device, DeviceTensor};
use crate::error::{EngineError, Result};
use crate::fault::Faults;
use crate::memory::Category;
use crate::model::{Group, Layout, Params};
use crate::parallel::collective::Collective;

/// A rank's gradients under `shard: gradients`. Between passes a rank holds its rows of each
/// gradient only. Just before a pass first adds to a tensor's gradient the ring makes it whole:
/// zeros for the step's first micro-batch, else the sum so far, received from the rank of the
/// micro-batch before. Just after the pass's last addition it hands the sum on to the rank of
/// the next micro-batch and frees it; after the step's last micro-batch it sends each rank its
/// rows instead, keeping the tensor's sum of squares for the norm. Each tensor is added to in
/// global micro-batch order, on one buffer, as on one device.
pub(super) struct GradRing<'a, D: Device> {
    dev: D,
    comm: &'a dyn Collective,
    layout: &'a Layout,
    faults: &'a Faults,
    rank: usize,
    /// The global index of the micro-batch the pass running now trains.
    pass: u64,
    /// Micro-batches in the step.
    micro_batches: u64,
    /// How many groups of one backward pass write each tensor (2 for tied embeddings: the
    /// head, added last, then the embedding).
    writes: Vec<usize>,
    /// The writes of the running pass still to come, per tensor.
    remaining: Vec<usize>,
    /// The rank's rows of each tensor whose whole gradient is in place.
    stash: Vec<Option<D::Tensor<f32>>>,
    /// Each tensor's sum of squares, on the last rank after the last micro-batch.
    pub(super) sums: Vec<f64>,
}

impl<'a, D: Device> GradRing<'a, D> {
    /// Rank `rank`'s ring over `comm`, for a step of `micro_batches`.
    pub(super) fn new(
        dev: D,
        comm: &'a dyn Collective,
        layout: &'a Layout,
        (faults, micro_batches): (&'a Faults, usize),
        rank: usize,
    ) -> Self {
        let n = layout.specs.len();
        let mut writes = vec![0; n];
        for g in Group::backward_order(layout.layers.len()) {
            layout
                .tensors_of(g)
                .into_iter()
                .for_each(|t| writes[t] += 1);
        }
        GradRing {
            dev,
            comm,
            layout,
            faults,
            rank,
            pass: rank as u64,
            micro_batches: micro_batches as u64,
            remaining: writes.clone(),
            writes,
            stash: (0..n).map(|_| None).collect(),
            sums: vec![0.0; n],
        }
    }

    /// The ranks before and after this one on the ring.
    fn neighbours(&self) -> (usize, usize) {
        let world = self.comm.world_size();
        ((self.rank + world - 1) % world, (self.rank + 1) % world)
    }

    /// The order the tensors' sums are complete in on the last micro-batch: as the backward
    /// pass finishes with each.
    fn completion_order(&self) -> Vec<usize> {
        let mut remaining = self.writes.clone();
        let mut order = Vec::new();
        for g in Group::backward_order(self.layout.layers.len()) {
            for t in self.layout.tensors_of(g) {
                remaining[t] -= 1;
                if remaining[t] == 0 {
                    order.push(t);
                }
            }
        }
        order
    }

    /// Every tensor's rows of the step's sum from rank `from`, into `grads`, in the order the
    /// sums were completed.
    pub(super) fn receive_rows(
        &self,
        grads: &mut Params<D::Tensor<f32>>,
        from: usize,
    ) -> Result<()> {
        for t in self.completion_order() {
            self.dev
                .write_bytes(grads.get_mut(t), 0, &self.comm.recv(from)?)?;
        }
        Ok(())
    }

    /// Sends each rank its rows of `whole`, tensor `t`'s sum over the step (this rank's rows
    /// into `mine`).
    fn scatter(&self, t: usize, whole: &D::Tensor<f32>, mine: &mut D::Tensor<f32>) -> Result<()> {
        let shape = &self.layout.specs[t].shape;
        for to in 0..self.comm.world_size() {
            let (rows, row) = shard_rows(shape, self.comm.world_size(), to, self.faults);
            let bytes =
                self.dev
                    .read_bytes(whole, rows.start * row * F32, rows.len() * row * F32)?;
            match to == self.rank {
                true => self.dev.write_bytes(mine, 0, &bytes)?,
                false => self.comm.send(to, bytes)?,
            }
        }
        Ok(())
    }
}

impl<D: Device> GradRing<'_, D> {
    /// Makes `group`'s gradients whole before a pass first adds to them.
    pub(super) fn grads_in(
        &mut self,
        grads: &mut Params<D::Tensor<f32>>,
        group: Group,
    ) -> Result<()> {
        for t in self.layout.tensors_of(group) {
            if self.remaining[t] != self.writes[t] {
                continue;
            }
            let shape = &self.layout.specs[t].shape;
            let mut whole = self.dev.zeros::<f32>(shape, Category::Grads)?;
            if self.pass > 0 {
                let bytes = self.comm.recv(self.neighbours().0)?;
                self.dev.write_bytes(&mut whole, 0, &bytes)?;
            }
            self.stash[t] = Some(std::mem::replace(grads.get_mut(t), whole));
        }
        Ok(())
    }

    /// Hands `group`'s sums on after a pass has added its last.
    pub(super) fn grads_out(
        &mut self,
        grads: &mut Params<D::Tensor<f32>>,
        group: Group,
    ) -> Result<()> {
        for t in self.layout.tensors_of(group) {
            self.remaining[t] -= 1;
            if self.remaining[t] > 0 {
                continue;
            }
            let mine = self.stash[t].take().ok_or_else(|| {
                EngineError::Config(format!(
                    "gradient {t} was handed on before it was made whole"
                ))
            })?;
            let whole = std::mem::replace(grads.get_mut(t), mine);
            if self.pass + 1 < self.micro_batches {
                let bytes = self.dev.read_bytes(&whole, 0, whole.bytes() as usize)?;
                self.comm.send(self.neighbours().1, bytes)?;
            } else {
                self.sums[t] = self.dev.sum_squares(&whole)?;
                self.scatter(t, &whole, grads.get_mut(t))?;
            }
        }
        if group == Group::Embed {
            self.pass += self.comm.world_size() as u64;
            self.remaining = self.writes.clone();
        }
        Ok(())
    }
}
