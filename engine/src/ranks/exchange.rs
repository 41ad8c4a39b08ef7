//! What ranks send each other of their gradients and weights outside the passes: whole gradients
//! along the chain and by broadcast, each rank's rows scattered to it, the updated rows gathered.

use super::{shard_rows, BF16, F32};
use crate::device::{Device, DeviceTensor};
use crate::error::Result;
use crate::fault::Faults;
use crate::memory::Category;
use crate::parallel::collective::Collective;
use crate::state::{State, Weights};
use crate::tensor::Elem;
use half::bf16;

/// Sends every gradient, whole, to rank `to`.
pub(super) fn send_whole<D: Device>(
    state: &mut State<D>,
    comm: &dyn Collective,
    to: usize,
) -> Result<()> {
    let dev = state.device().clone();
    for g in state.grads_mut().tensors() {
        comm.send(to, dev.read_bytes(g, 0, g.bytes() as usize)?)?;
    }
    Ok(())
}

/// Receives every gradient, whole, from rank `from`, in place of what the gradients hold.
pub(super) fn receive_whole<D: Device>(
    state: &mut State<D>,
    comm: &dyn Collective,
    from: usize,
) -> Result<()> {
    let dev = state.device().clone();
    for g in state.grads_mut().tensors_mut() {
        dev.write_bytes(g, 0, &comm.recv(from)?)?;
    }
    Ok(())
}

/// Every rank gets rank `root`'s gradients.
pub(super) fn broadcast_grads<D: Device>(
    state: &mut State<D>,
    comm: &dyn Collective,
    root: usize,
) -> Result<()> {
    let dev = state.device().clone();
    let rank = comm.rank();
    for g in state.grads_mut().tensors_mut() {
        let bytes = match rank == root {
            true => dev.read_bytes(g, 0, g.bytes() as usize)?,
            false => Vec::new(),
        };
        let got = comm.broadcast(root, bytes)?;
        if rank != root {
            dev.write_bytes(g, 0, &got)?;
        }
    }
    Ok(())
}

/// Rank `root` sends each rank its rows of every gradient.
pub(super) fn scatter_grads<D: Device>(
    state: &mut State<D>,
    comm: &dyn Collective,
    root: usize,
    faults: &Faults,
) -> Result<()> {
    let dev = state.device().clone();
    let (rank, world) = (comm.rank(), comm.world_size());
    for g in state.grads_mut().tensors_mut() {
        if rank == root {
            for to in (0..world).filter(|&r| r != root) {
                let (rows, row) = shard_rows(g.shape(), world, to, faults);
                let bytes = dev.read_bytes(g, rows.start * row * F32, rows.len() * row * F32)?;
                comm.send(to, bytes)?;
            }
        } else {
            let (rows, row) = shard_rows(g.shape(), world, rank, faults);
            dev.write_bytes(g, rows.start * row * F32, &comm.recv(root)?)?;
        }
    }
    Ok(())
}

/// Every rank gets every rank's updated rows: of the f32 weights in fp32, of the bf16 compute
/// weights (each rank rounding its master rows) in bf16-mixed.
pub(super) fn gather_updated<D: Device>(
    state: &mut State<D>,
    comm: &dyn Collective,
    faults: &Faults,
) -> Result<()> {
    let dev = state.device().clone();
    let (rank, world) = (comm.rank(), comm.world_size());
    let at = |shape: &[usize], from: usize, elem: usize| {
        let (rows, row) = shard_rows(shape, world, from, faults);
        (rows.start * row * elem, rows.len() * row * elem)
    };
    match state.weights_mut() {
        Weights::Fp32(params) => {
            for p in params.tensors_mut() {
                let shape = p.shape().to_vec();
                let (offset, len) = at(&shape, rank, F32);
                let mine = dev.read_bytes(p, offset, len)?;
                exchange_rows(&dev, comm, p, mine, |from| at(&shape, from, F32).0)?;
            }
        }
        Weights::Bf16Mixed { master, compute } => {
            for (m, c) in master.tensors().into_iter().zip(compute.tensors_mut()) {
                let mut rounded = dev.zeros::<bf16>(m.shape(), Category::Workspace)?;
                dev.round(m, &mut rounded)?;
                let mine = dev.read_bytes(&rounded, 0, rounded.bytes() as usize)?;
                drop(rounded);
                let shape = c.shape().to_vec();
                dev.write_bytes(c, at(&shape, rank, BF16).0, &mine)?;
                exchange_rows(&dev, comm, c, mine, |from| at(&shape, from, BF16).0)?;
            }
        }
    }
    Ok(())
}

/// Sends this rank's `mine` to every rank and writes every other rank's into `t` at the byte
/// offset `at(rank)`.
fn exchange_rows<D: Device, E: Elem>(
    dev: &D,
    comm: &dyn Collective,
    t: &mut D::Tensor<E>,
    mine: Vec<u8>,
    at: impl Fn(usize) -> usize,
) -> Result<()> {
    for (from, bytes) in comm.all_gather(mine)?.into_iter().enumerate() {
        if from != comm.rank() {
            dev.write_bytes(t, at(from), &bytes)?;
        }
    }
    Ok(())
}

/// [`crate::fault::Fault::GradientsSummedByRank`]: every rank sends its own sum to the last,
/// which adds them in rank order.
pub(super) fn add_by_rank<D: Device>(state: &mut State<D>, comm: &dyn Collective) -> Result<()> {
    let (rank, last) = (comm.rank(), comm.world_size() - 1);
    if rank < last {
        return send_whole(state, comm, last);
    }
    let dev = state.device().clone();
    let mut partials: Vec<Vec<Vec<u8>>> = Vec::new();
    for from in 0..last {
        let grads = state.grads_mut().tensors().len();
        partials.push((0..grads).map(|_| comm.recv(from)).collect::<Result<_>>()?);
    }
    for (i, g) in state.grads_mut().tensors_mut().into_iter().enumerate() {
        let own: Vec<f32> = bytes_to_f32(&dev.read_bytes(g, 0, g.bytes() as usize)?);
        let mut sum = vec![0.0f32; own.len()];
        for part in partials.iter().map(|p| bytes_to_f32(&p[i])).chain([own]) {
            for (s, x) in sum.iter_mut().zip(part) {
                *s += x;
            }
        }
        dev.write_bytes(g, 0, bytemuck::cast_slice(&sum))?;
    }
    Ok(())
}

/// Little-endian f32 bytes as values (empty from the counting device).
fn bytes_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
