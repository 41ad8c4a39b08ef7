//! Row-wise and element-wise kernels of the Llama block, generic over the stored element type
//! and computed in f32. Each output row is written by one thread; reductions across rows (weight
//! gradients) run in a fixed sequential order.

use super::{math, CpuDevice};
use crate::model::dropout::DropoutMask;
use crate::tensor::Elem;
use rayon::prelude::*;

/// Rows handed to a thread at a time: large enough to amortise scheduling.
const ROWS_PER_TASK: usize = 16;

/// `dst[i] = src[i]` converted between element types.
pub fn convert<S: Elem, D: Elem>(dev: &CpuDevice, src: &[S], dst: &mut [D]) {
    debug_assert_eq!(src.len(), dst.len());
    dev.install(|| {
        dst.par_chunks_mut(4096)
            .zip(src.par_chunks(4096))
            .for_each(|(d, s)| {
                for (d, s) in d.iter_mut().zip(s) {
                    *d = D::from_f32(s.to_f32());
                }
            })
    });
}

/// `dst[i] += src[i]`.
pub fn add_assign<E: Elem>(dev: &CpuDevice, dst: &mut [E], src: &[E]) {
    debug_assert_eq!(src.len(), dst.len());
    dev.install(|| {
        dst.par_chunks_mut(4096)
            .zip(src.par_chunks(4096))
            .for_each(|(d, s)| {
                for (d, s) in d.iter_mut().zip(s) {
                    *d = E::from_f32(d.to_f32() + s.to_f32());
                }
            })
    });
}

/// RMSNorm as Hugging Face computes it: `y = w · round(x / sqrt(mean(x²) + eps))`, rows of width
/// `w.len()`. Saves each row's `1 / sqrt(mean(x²) + eps)` in `rinv` for the backward pass.
pub fn rmsnorm_forward<E: Elem>(
    dev: &CpuDevice,
    x: &[E],
    w: &[E],
    eps: f32,
    y: &mut [E],
    rinv: &mut [f32],
) {
    let h = w.len();
    dev.install(|| {
        y.par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .zip(rinv.par_chunks_mut(ROWS_PER_TASK))
            .for_each(|((y, x), r)| {
                for ((y, x), r) in y.chunks_mut(h).zip(x.chunks(h)).zip(r.iter_mut()) {
                    let ss: f32 = x.iter().map(|v| v.to_f32() * v.to_f32()).sum();
                    *r = 1.0 / (ss / h as f32 + eps).sqrt();
                    for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                        let normed = E::from_f32(x.to_f32() * *r).to_f32();
                        *y = E::from_f32(w.to_f32() * normed);
                    }
                }
            })
    });
}

/// RMSNorm backward: `dx += ∂L/∂x` (accumulated: the norm reads the residual stream) and
/// `dw += ∂L/∂w` in f32.
pub fn rmsnorm_backward<E: Elem>(
    dev: &CpuDevice,
    dy: &[E],
    x: &[E],
    w: &[E],
    rinv: &[f32],
    dx: &mut [E],
    dw: &mut [f32],
) {
    let h = w.len();
    dev.install(|| {
        dx.par_chunks_mut(h * ROWS_PER_TASK)
            .zip(dy.par_chunks(h * ROWS_PER_TASK))
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .zip(rinv.par_chunks(ROWS_PER_TASK))
            .for_each(|(((dx, dy), x), r)| {
                for (((dx, dy), x), &r) in
                    dx.chunks_mut(h).zip(dy.chunks(h)).zip(x.chunks(h)).zip(r)
                {
                    // g = dy·w; dx = r·g − r³·x·mean(g·x)
                    let dot: f32 = dy
                        .iter()
                        .zip(w)
                        .zip(x)
                        .map(|((d, w), x)| d.to_f32() * w.to_f32() * x.to_f32())
                        .sum();
                    let c = r * r * r * dot / h as f32;
                    for (((dx, dy), w), x) in dx.iter_mut().zip(dy).zip(w).zip(x) {
                        let g = dy.to_f32() * w.to_f32();
                        *dx = E::from_f32(dx.to_f32() + r * g - c * x.to_f32());
                    }
                }
            })
    });
    // dw[j] = Σ_i dy[i,j]·x[i,j]·r_i, summed over rows in order.
    for ((dy, x), &r) in dy.chunks(h).zip(x.chunks(h)).zip(rinv) {
        for ((dw, dy), x) in dw.iter_mut().zip(dy).zip(x) {
            *dw += dy.to_f32() * E::from_f32(x.to_f32() * r).to_f32();
        }
    }
}

/// Rotary position tables in Hugging Face's convention: for position `p` and pair `i < d/2`,
/// angle `p · theta^(−2i/d)`; `cos` and `sin` are `[positions, d/2]`.
#[derive(Clone, Debug)]
pub struct RopeTable {
    /// cos of every angle, `[positions, half]`.
    pub cos: Vec<f32>,
    /// sin of every angle, `[positions, half]`.
    pub sin: Vec<f32>,
    /// Half the head dimension.
    pub half: usize,
}

impl RopeTable {
    /// Tables for `positions` positions of heads of width `head_dim`.
    pub fn new(head_dim: usize, theta: f64, positions: usize) -> Self {
        let half = head_dim / 2;
        // Hugging Face computes inv_freq and the angles in f32.
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| (1.0 / theta.powf((2 * i) as f64 / head_dim as f64)) as f32)
            .collect();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for &f in &inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        RopeTable { cos, sin, half }
    }

    /// Bytes the tables hold.
    pub fn bytes(&self) -> u64 {
        ((self.cos.len() + self.sin.len()) * 4) as u64
    }
}

/// Rotates every head of `x` (`[rows, heads·d]`, row `r` at position `r % seq`) in place;
/// `inverse` applies the transposed rotation, which is the backward pass.
pub fn rope<E: Elem>(
    dev: &CpuDevice,
    x: &mut [E],
    width: usize,
    seq: usize,
    table: &RopeTable,
    inverse: bool,
) {
    let half = table.half;
    let sign = if inverse { -1.0 } else { 1.0 };
    dev.install(|| {
        x.par_chunks_mut(width).enumerate().for_each(|(row, x)| {
            let p = row % seq;
            let cos = &table.cos[p * half..(p + 1) * half];
            let sin = &table.sin[p * half..(p + 1) * half];
            for head in x.chunks_mut(2 * half) {
                let (lo, hi) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (lo[i].to_f32(), hi[i].to_f32());
                    let s = sign * sin[i];
                    lo[i] = E::from_f32(a * cos[i] - b * s);
                    hi[i] = E::from_f32(b * cos[i] + a * s);
                }
            }
        })
    });
}

/// SwiGLU: `act = silu(gate) · up`.
pub fn swiglu_forward<E: Elem>(dev: &CpuDevice, gate: &[E], up: &[E], act: &mut [E]) {
    dev.install(|| {
        act.par_chunks_mut(4096)
            .zip(gate.par_chunks(4096).zip(up.par_chunks(4096)))
            .for_each(|(a, (g, u))| {
                for ((a, g), u) in a.iter_mut().zip(g).zip(u) {
                    let g = g.to_f32();
                    let silu = E::from_f32(g * math::sigmoid(g)).to_f32();
                    *a = E::from_f32(silu * u.to_f32());
                }
            })
    });
}

/// SwiGLU backward: writes `dgate` and `dup` from `dact`.
pub fn swiglu_backward<E: Elem>(
    dev: &CpuDevice,
    dact: &[E],
    gate: &[E],
    up: &[E],
    dgate: &mut [E],
    dup: &mut [E],
) {
    dev.install(|| {
        dgate
            .par_chunks_mut(4096)
            .zip(dup.par_chunks_mut(4096))
            .zip(dact.par_chunks(4096))
            .zip(gate.par_chunks(4096).zip(up.par_chunks(4096)))
            .for_each(|(((dg, du), da), (g, u))| {
                for ((((dg, du), da), g), u) in dg.iter_mut().zip(du).zip(da).zip(g).zip(u) {
                    let (g, u, da) = (g.to_f32(), u.to_f32(), da.to_f32());
                    let s = math::sigmoid(g);
                    let silu = E::from_f32(g * s).to_f32();
                    *du = E::from_f32(da * silu);
                    *dg = E::from_f32(da * u * s * (1.0 + g * (1.0 - s)));
                }
            })
    });
}

/// Embedding lookup: row `i` of `out` is row `ids[i]` of `table` (`[vocab, width]`).
pub fn embedding_forward<E: Elem>(dev: &CpuDevice, table: &[E], ids: &[u32], out: &mut [E]) {
    let width = out.len() / ids.len().max(1);
    dev.install(|| {
        out.par_chunks_mut(width)
            .zip(ids.par_iter())
            .for_each(|(o, &id)| {
                let id = id as usize;
                o.copy_from_slice(&table[id * width..(id + 1) * width]);
            })
    });
}

/// Embedding backward: `dtable[ids[i]] += dout[i]`, in token order.
pub fn embedding_backward<E: Elem>(dout: &[E], ids: &[u32], dtable: &mut [f32]) {
    let width = dout.len() / ids.len().max(1);
    for (row, &id) in dout.chunks(width).zip(ids) {
        let id = id as usize;
        for (d, g) in dtable[id * width..(id + 1) * width].iter_mut().zip(row) {
            *d += g.to_f32();
        }
    }
}

/// Residual dropout: `out[i] = x[i] + y[i] · scale` where `mask` keeps element `i`, else `x[i]`.
pub fn dropout_add<E: Elem>(dev: &CpuDevice, mask: &DropoutMask, x: &[E], y: &[E], out: &mut [E]) {
    debug_assert_eq!(x.len(), y.len());
    debug_assert_eq!(x.len(), out.len());
    let scale = mask.scale();
    dev.install(|| {
        out.par_chunks_mut(4096)
            .zip(x.par_chunks(4096).zip(y.par_chunks(4096)))
            .enumerate()
            .for_each(|(c, (o, (x, y)))| {
                let base = (c * 4096) as u64;
                for (i, (o, (x, y))) in o.iter_mut().zip(x.iter().zip(y)).enumerate() {
                    *o = if mask.keeps(base + i as u64) {
                        E::from_f32(x.to_f32() + y.to_f32() * scale)
                    } else {
                        *x
                    };
                }
            })
    });
}

/// Backward of [`dropout_add`] for `y`: `dy[i] = dout[i] · scale` where `mask` keeps element
/// `i`, else 0.
pub fn dropout_backward<E: Elem>(dev: &CpuDevice, mask: &DropoutMask, dout: &[E], dy: &mut [E]) {
    debug_assert_eq!(dout.len(), dy.len());
    let scale = mask.scale();
    dev.install(|| {
        dy.par_chunks_mut(4096)
            .zip(dout.par_chunks(4096))
            .enumerate()
            .for_each(|(c, (d, g))| {
                let base = (c * 4096) as u64;
                for (i, (d, g)) in d.iter_mut().zip(g).enumerate() {
                    *d = if mask.keeps(base + i as u64) {
                        E::from_f32(g.to_f32() * scale)
                    } else {
                        E::default()
                    };
                }
            })
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_inverse_undoes_rope() {
        let dev = CpuDevice::new(2, u64::MAX).unwrap();
        let table = RopeTable::new(8, 10000.0, 4);
        let x: Vec<f32> = (0..4 * 16).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = x.clone();
        rope(&dev, &mut y, 16, 4, &table, false);
        assert_ne!(x, y);
        rope(&dev, &mut y, 16, 4, &table, true);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-6);
        }
    }
}
