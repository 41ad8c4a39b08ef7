//! Causal grouped-query attention that saves only each row's log-sum-exp: the backward pass
//! recomputes the probabilities, so no `[heads, T, T]` tensor outlives a kernel.
//!
//! Work is split into units (one (batch, head) in forward, one (batch, kv-head) group in
//! backward so that a key/value gradient is summed over its heads by one thread, in head order).
//! Each thread works in its own slice of one tracked workspace tensor.

use super::matmul::gemm_f32;
use super::{CpuDevice, SharedMut};
use crate::memory::{Category, OutOfMemory};
use crate::tensor::Elem;
use gemm::Parallelism;
use rayon::prelude::*;

/// The shape of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Sequences in the batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl AttnShape {
    fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// f32 scratch elements one forward thread uses: Q, K, V, O heads and the score matrix.
    pub fn forward_scratch(&self) -> usize {
        4 * self.seq * self.head_dim + self.seq * self.seq
    }

    /// f32 scratch elements one backward thread uses: K, V, dK, dV, Q, O, dO, dQ heads and two
    /// score matrices.
    pub fn backward_scratch(&self) -> usize {
        8 * self.seq * self.head_dim + 2 * self.seq * self.seq
    }
}

/// Copies head `col` (width `d`) of rows `[row0, row0 + t)` of a `[rows, width]` matrix into `dst`.
fn gather<E: Elem>(src: &[E], width: usize, row0: usize, col: usize, d: usize, dst: &mut [f32]) {
    for (i, dst) in dst.chunks_mut(d).enumerate() {
        let s = &src[(row0 + i) * width + col..(row0 + i) * width + col + d];
        for (o, v) in dst.iter_mut().zip(s) {
            *o = v.to_f32();
        }
    }
}

/// Writes `src` (`[t, d]`) into head `col` of rows `[row0, row0 + t)` of a shared matrix.
///
/// # Safety
/// No other thread may write the same rows and columns concurrently; `dst` must hold the rows.
unsafe fn scatter<E: Elem>(
    dst: SharedMut<E>,
    width: usize,
    row0: usize,
    col: usize,
    d: usize,
    src: &[f32],
) {
    for (i, s) in src.chunks(d).enumerate() {
        let base = dst.get().add((row0 + i) * width + col);
        for (j, v) in s.iter().enumerate() {
            *base.add(j) = E::from_f32(*v);
        }
    }
}

fn mm(
    dims: (usize, usize, usize),
    a: &[f32],
    a_strides: (isize, isize),
    b: &[f32],
    b_strides: (isize, isize),
    c: &mut [f32],
    accumulate: bool,
) {
    gemm_f32(
        dims,
        a,
        a_strides,
        b,
        b_strides,
        c,
        accumulate,
        Parallelism::None,
    );
}

/// Splits `units` into `threads` contiguous ranges and runs `f(range, scratch)` on each.
fn for_each_unit_range(
    dev: &CpuDevice,
    units: usize,
    per_thread: usize,
    f: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
) -> Result<(), OutOfMemory> {
    let threads = dev.threads().min(units).max(1);
    let mut scratch = dev.zeros::<f32>(&[threads, per_thread], Category::Workspace)?;
    let chunk = units.div_ceil(threads);
    dev.install(|| {
        scratch
            .as_mut_slice()
            .par_chunks_mut(per_thread)
            .enumerate()
            .for_each(|(t, s)| f(t * chunk..((t + 1) * chunk).min(units), s))
    });
    Ok(())
}

/// Forward: `out = softmax(q·kᵀ/√d + causal mask)·v` per head; `lse` (`[batch, heads, seq]`)
/// receives each row's log-sum-exp. `q`/`out` are `[batch·seq, heads·d]`, `k`/`v` are
/// `[batch·seq, kv_heads·d]`, with rotary embeddings already applied.
pub fn attention_forward<E: Elem>(
    dev: &CpuDevice,
    s: AttnShape,
    q: &[E],
    k: &[E],
    v: &[E],
    out: &mut [E],
    lse: &mut [f32],
) -> Result<(), OutOfMemory> {
    let (t, d) = (s.seq, s.head_dim);
    let out_ptr = SharedMut(out.as_mut_ptr());
    let lse_ptr = SharedMut(lse.as_mut_ptr());
    for_each_unit_range(
        dev,
        s.batch * s.heads,
        s.forward_scratch(),
        |units, scratch| {
            let (qh, rest) = scratch.split_at_mut(t * d);
            let (kh, rest) = rest.split_at_mut(t * d);
            let (vh, rest) = rest.split_at_mut(t * d);
            let (oh, p) = rest.split_at_mut(t * d);
            for unit in units {
                let (b, h) = (unit / s.heads, unit % s.heads);
                let g = h / s.group();
                gather(q, s.q_width(), b * t, h * d, d, qh);
                gather(k, s.kv_width(), b * t, g * d, d, kh);
                gather(v, s.kv_width(), b * t, g * d, d, vh);
                // p = q·kᵀ
                mm(
                    (t, t, d),
                    qh,
                    (d as isize, 1),
                    kh,
                    (1, d as isize),
                    p,
                    false,
                );
                for i in 0..t {
                    let row = &mut p[i * t..(i + 1) * t];
                    let mut max = f32::NEG_INFINITY;
                    for x in &mut row[..=i] {
                        *x *= s.scale();
                        max = max.max(*x);
                    }
                    let mut sum = 0.0f32;
                    for x in &mut row[..=i] {
                        *x = (*x - max).exp();
                        sum += *x;
                    }
                    let inv = 1.0 / sum;
                    row[..=i].iter_mut().for_each(|x| *x *= inv);
                    row[i + 1..].fill(0.0);
                    // SAFETY: each (b, h, i) is written by exactly one unit.
                    unsafe { *lse_ptr.get().add(unit * t + i) = max + sum.ln() };
                }
                mm(
                    (t, d, t),
                    p,
                    (t as isize, 1),
                    vh,
                    (d as isize, 1),
                    oh,
                    false,
                );
                // SAFETY: unit (b, h) alone writes rows of batch b, columns of head h.
                unsafe { scatter(out_ptr, s.q_width(), b * t, h * d, d, oh) };
            }
        },
    )
}

/// Backward of [`attention_forward`]: writes `dq`, `dk`, `dv` from `dout`, recomputing the
/// probabilities from `q`, `k` and the saved `lse`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<E: Elem>(
    dev: &CpuDevice,
    s: AttnShape,
    q: &[E],
    k: &[E],
    v: &[E],
    out: &[E],
    lse: &[f32],
    dout: &[E],
    dq: &mut [E],
    dk: &mut [E],
    dv: &mut [E],
) -> Result<(), OutOfMemory> {
    let (t, d) = (s.seq, s.head_dim);
    let (dq_ptr, dk_ptr, dv_ptr) = (
        SharedMut(dq.as_mut_ptr()),
        SharedMut(dk.as_mut_ptr()),
        SharedMut(dv.as_mut_ptr()),
    );
    let (ti, di) = (t as isize, d as isize);
    for_each_unit_range(
        dev,
        s.batch * s.kv_heads,
        s.backward_scratch(),
        |units, scratch| {
            let (heads, scores) = scratch.split_at_mut(8 * t * d);
            let (p, dp) = scores.split_at_mut(t * t);
            let mut parts = heads.chunks_mut(t * d);
            let mut next = || parts.next().expect("scratch holds eight head buffers");
            let (kh, vh, dkh, dvh, qh, oh, doh, dqh) = (
                next(),
                next(),
                next(),
                next(),
                next(),
                next(),
                next(),
                next(),
            );
            for unit in units {
                let (b, g) = (unit / s.kv_heads, unit % s.kv_heads);
                gather(k, s.kv_width(), b * t, g * d, d, kh);
                gather(v, s.kv_width(), b * t, g * d, d, vh);
                dkh.fill(0.0);
                dvh.fill(0.0);
                for h in g * s.group()..(g + 1) * s.group() {
                    gather(q, s.q_width(), b * t, h * d, d, qh);
                    gather(out, s.q_width(), b * t, h * d, d, oh);
                    gather(dout, s.q_width(), b * t, h * d, d, doh);
                    mm((t, t, d), qh, (di, 1), kh, (1, di), p, false);
                    let lse_row = &lse[(b * s.heads + h) * t..(b * s.heads + h + 1) * t];
                    for i in 0..t {
                        let row = &mut p[i * t..(i + 1) * t];
                        for x in &mut row[..=i] {
                            *x = (*x * s.scale() - lse_row[i]).exp();
                        }
                        row[i + 1..].fill(0.0);
                    }
                    // dV += pᵀ·dO ; dP = dO·Vᵀ
                    mm((t, d, t), p, (1, ti), doh, (di, 1), dvh, true);
                    mm((t, t, d), doh, (di, 1), vh, (1, di), dp, false);
                    // dS = p ∘ (dP − rowsum(dO ∘ O)), scaled
                    for i in 0..t {
                        let delta: f32 = doh[i * d..(i + 1) * d]
                            .iter()
                            .zip(&oh[i * d..(i + 1) * d])
                            .map(|(a, b)| a * b)
                            .sum();
                        let (pr, dpr) = (&p[i * t..(i + 1) * t], &mut dp[i * t..(i + 1) * t]);
                        for j in 0..=i {
                            dpr[j] = pr[j] * (dpr[j] - delta) * s.scale();
                        }
                        dpr[i + 1..].fill(0.0);
                    }
                    // dQ = dS·K ; dK += dSᵀ·Q
                    mm((t, d, t), dp, (ti, 1), kh, (di, 1), dqh, false);
                    mm((t, d, t), dp, (1, ti), qh, (di, 1), dkh, true);
                    // SAFETY: unit (b, g) alone writes rows of batch b in the heads of group g.
                    unsafe { scatter(dq_ptr, s.q_width(), b * t, h * d, d, dqh) };
                }
                // SAFETY: as above, for kv-head g.
                unsafe {
                    scatter(dk_ptr, s.kv_width(), b * t, g * d, d, dkh);
                    scatter(dv_ptr, s.kv_width(), b * t, g * d, d, dvh);
                }
            }
        },
    )
}
