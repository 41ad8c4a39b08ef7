//! Causal grouped-query attention that saves only each row's log-sum-exp: the backward pass
//! recomputes the probabilities, so no `[heads, T, T]` tensor outlives a kernel. Query rows go in
//! blocks that compute scores only against the keys they can see. In a packed batch each query
//! sees its own document's keys only, the others masked like the causal mask's.
//!
//! Work is split into units (one (batch, head) in forward, one (batch, kv-head) group in
//! backward so that a key/value gradient is summed over its heads by one thread, in head order).
//! Each thread works in its own slice of one tracked workspace tensor.

use super::math::{self, vectorized};
use super::matmul::gemm_f32;
use super::{CpuDevice, SharedMut};
use crate::device::{AttnShape, Device};
use crate::error::Result;
use crate::memory::Category;
use crate::tensor::Elem;
use rayon::prelude::*;
use std::sync::Mutex;

/// Query rows processed together: a block's scores cover only the keys its last row sees, so
/// the masked upper triangle is mostly never computed.
const QUERY_BLOCK: usize = 64;

/// Which pass of attention a scratch buffer serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Work unit (batch, head): Q, K, V, O heads and one block of scores.
    Forward,
    /// Work unit (batch, kv-head): K, V, dK, dV, Q, O, dO, dQ heads and two blocks of scores.
    Backward,
}

/// Score elements of one query block: its rows times the keys the last block sees.
fn block_scores(s: &AttnShape) -> usize {
    QUERY_BLOCK.min(s.seq) * s.seq
}

/// Work units of `pass`, and f32 scratch elements one thread of it uses.
fn units_and_scratch(s: &AttnShape, pass: Pass) -> (usize, usize) {
    match pass {
        Pass::Forward => (s.batch * s.heads, 4 * s.seq * s.head_dim + block_scores(s)),
        Pass::Backward => (
            s.batch * s.kv_heads,
            8 * s.seq * s.head_dim + 2 * block_scores(s),
        ),
    }
}

/// The scratch of one attention pass on `threads` threads: `[min(threads, units), per_thread]`
/// f32 elements, one slice per running unit.
pub(crate) fn scratch_shape(threads: usize, s: &AttnShape, pass: Pass) -> [usize; 2] {
    let (units, per_thread) = units_and_scratch(s, pass);
    [threads.min(units).max(1), per_thread]
}

/// Allocates the scratch of one attention pass as the CPU backend does on `threads` threads
/// (the counting device imitating the CPU calls this too).
pub(crate) fn scratch<D: Device>(
    dev: &D,
    threads: usize,
    s: &AttnShape,
    pass: Pass,
) -> Result<D::Tensor<f32>> {
    dev.zeros::<f32>(&scratch_shape(threads, s, pass), Category::Workspace)
}

/// Copies head `col` (width `d`) of rows `[row0, row0 + t)` of a `[rows, width]` matrix into `dst`.
#[inline(always)]
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
#[inline(always)]
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
    gemm_f32(dims, a, a_strides, b, b_strides, c, accumulate, 1);
}

/// Runs `f(unit, scratch)` for every unit of `pass`, handing units to threads as they free up.
/// Each running unit borrows one slice of the pass's scratch; a unit's results depend only on
/// the unit, never on the thread or slice.
fn for_each_unit(
    dev: &CpuDevice,
    s: &AttnShape,
    pass: Pass,
    f: impl Fn(usize, &mut [f32]) + Sync,
) -> Result<()> {
    let (units, per_thread) = units_and_scratch(s, pass);
    let mut scratch = scratch(dev, dev.threads(), s, pass)?;
    // Units do not spawn work of their own, so at most `threads` run at once and a free slice
    // is always there to take.
    let free = Mutex::new(
        scratch
            .as_mut_slice()
            .chunks_mut(per_thread)
            .collect::<Vec<_>>(),
    );
    dev.install(|| {
        (0..units).into_par_iter().with_max_len(1).for_each(|unit| {
            let slice = free
                .lock()
                .expect("no unit panics holding the lock")
                .pop()
                .expect("one scratch slice per running unit");
            f(unit, slice);
            free.lock()
                .expect("no unit panics holding the lock")
                .push(slice);
        })
    });
    Ok(())
}

/// The blocks of query rows, each as `(i0, i1)`: rows `i0..i1`, which see keys `0..i1`.
#[inline(always)]
fn query_blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t)
        .step_by(QUERY_BLOCK)
        .map(move |i0| (i0, (i0 + QUERY_BLOCK).min(t)))
}

/// The first key query row `i` of sequence `b` sees: the start of its document in a packed
/// batch (`positions[b·t + i]` tokens back), else the sequence's first.
#[inline(always)]
fn first_key(positions: Option<&[u32]>, t: usize, b: usize, i: usize) -> usize {
    positions.map_or(0, |p| i.saturating_sub(p[b * t + i] as usize))
}

/// Masks one score row of query `i` to keys `first..=i` (the others set to 0) and returns the
/// keys it sees.
#[inline(always)]
fn visible(row: &mut [f32], first: usize, i: usize) -> &mut [f32] {
    let (seen, after) = row.split_at_mut(i + 1);
    after.fill(0.0);
    let (before, seen) = seen.split_at_mut(first.min(i));
    before.fill(0.0);
    seen
}

/// Softmax of one causal score row in place, `row[j] = e^{scale·row[j] − lse}`, returning the
/// row's log-sum-exp of the scaled scores.
#[inline(always)]
fn softmax_row(row: &mut [f32], scale: f32) -> f32 {
    let max = scale * math::max(row);
    for x in row.iter_mut() {
        *x = math::exp(scale * *x - max);
    }
    let sum = math::sum(row);
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|x| *x *= inv);
    max + sum.ln()
}

/// Forward: `out = softmax(q·kᵀ/√d + causal mask)·v` per head; `lse` (`[batch, heads, seq]`)
/// receives each row's log-sum-exp. `q`/`out` are `[batch·seq, heads·d]`, `k`/`v` are
/// `[batch·seq, kv_heads·d]`, with rotary embeddings already applied. With a packed batch's
/// positions, each query sees its own document's keys only ([`first_key`]).
pub(crate) fn forward<E: Elem>(
    dev: &CpuDevice,
    (s, positions): (AttnShape, Option<&[u32]>),
    q: &[E],
    k: &[E],
    v: &[E],
    out: &mut [E],
    lse: &mut [f32],
) -> Result<()> {
    let (t, d) = (s.seq, s.head_dim);
    let di = d as isize;
    let out_ptr = SharedMut(out.as_mut_ptr());
    let lse_ptr = SharedMut(lse.as_mut_ptr());
    for_each_unit(dev, &s, Pass::Forward, |unit, scratch| {
        vectorized!(dev.vector_isa(), {
            let (qh, rest) = scratch.split_at_mut(t * d);
            let (kh, rest) = rest.split_at_mut(t * d);
            let (vh, rest) = rest.split_at_mut(t * d);
            let (oh, scores) = rest.split_at_mut(t * d);
            let (b, h) = (unit / s.heads, unit % s.heads);
            let g = h / s.group();
            gather(q, s.q_width(), b * t, h * d, d, qh);
            gather(k, s.kv_width(), b * t, g * d, d, kh);
            gather(v, s.kv_width(), b * t, g * d, d, vh);
            for (i0, i1) in query_blocks(t) {
                let kv = i1;
                let p = &mut scores[..(i1 - i0) * kv];
                // p = q·kᵀ over the keys the block can see
                mm(
                    (i1 - i0, kv, d),
                    &qh[i0 * d..i1 * d],
                    (di, 1),
                    &kh[..kv * d],
                    (1, di),
                    p,
                    false,
                );
                for (i, row) in (i0..i1).zip(p.chunks_mut(kv)) {
                    let seen = visible(row, first_key(positions, t, b, i), i);
                    let l = softmax_row(seen, s.scale());
                    // SAFETY: each (b, h, i) is written by exactly one unit.
                    unsafe { *lse_ptr.get().add(unit * t + i) = l };
                }
                mm(
                    (i1 - i0, d, kv),
                    p,
                    (kv as isize, 1),
                    &vh[..kv * d],
                    (di, 1),
                    &mut oh[i0 * d..i1 * d],
                    false,
                );
            }
            // SAFETY: unit (b, h) alone writes rows of batch b, columns of head h.
            unsafe { scatter(out_ptr, s.q_width(), b * t, h * d, d, oh) };
        })
    })
}

/// Backward of [`forward`]: writes `dq`, `dk`, `dv` from `dout`, recomputing the probabilities
/// from `q`, `k` and the saved `lse`. `saved` is `[q, k, v, out, dout]`.
pub(crate) fn backward<E: Elem>(
    dev: &CpuDevice,
    (s, positions): (AttnShape, Option<&[u32]>),
    [q, k, v, out, dout]: [&[E]; 5],
    lse: &[f32],
    [dq, dk, dv]: [&mut [E]; 3],
) -> Result<()> {
    let (t, d) = (s.seq, s.head_dim);
    let (dq_ptr, dk_ptr, dv_ptr) = (
        SharedMut(dq.as_mut_ptr()),
        SharedMut(dk.as_mut_ptr()),
        SharedMut(dv.as_mut_ptr()),
    );
    let di = d as isize;
    let scale = s.scale();
    for_each_unit(dev, &s, Pass::Backward, |unit, scratch| {
        vectorized!(dev.vector_isa(), {
            let (heads, scores) = scratch.split_at_mut(8 * t * d);
            let (p, dp) = scores.split_at_mut(scores.len() / 2);
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
            let (b, g) = (unit / s.kv_heads, unit % s.kv_heads);
            gather(k, s.kv_width(), b * t, g * d, d, kh);
            gather(v, s.kv_width(), b * t, g * d, d, vh);
            dkh.fill(0.0);
            dvh.fill(0.0);
            for h in g * s.group()..(g + 1) * s.group() {
                gather(q, s.q_width(), b * t, h * d, d, qh);
                gather(out, s.q_width(), b * t, h * d, d, oh);
                gather(dout, s.q_width(), b * t, h * d, d, doh);
                let lse_row = &lse[(b * s.heads + h) * t..(b * s.heads + h + 1) * t];
                for (i0, i1) in query_blocks(t) {
                    let (rows, kv) = (i1 - i0, i1);
                    let kvi = kv as isize;
                    let (p, dp) = (&mut p[..rows * kv], &mut dp[..rows * kv]);
                    let (qb, dob) = (&qh[i0 * d..i1 * d], &doh[i0 * d..i1 * d]);
                    // p = softmax(q·kᵀ), recomputed from the saved log-sum-exp
                    mm((rows, kv, d), qb, (di, 1), &kh[..kv * d], (1, di), p, false);
                    for (i, row) in (i0..i1).zip(p.chunks_mut(kv)) {
                        for x in visible(row, first_key(positions, t, b, i), i) {
                            *x = math::exp(*x * scale - lse_row[i]);
                        }
                    }
                    // dV += pᵀ·dO ; dP = dO·Vᵀ
                    mm(
                        (kv, d, rows),
                        p,
                        (1, kvi),
                        dob,
                        (di, 1),
                        &mut dvh[..kv * d],
                        true,
                    );
                    mm(
                        (rows, kv, d),
                        dob,
                        (di, 1),
                        &vh[..kv * d],
                        (1, di),
                        dp,
                        false,
                    );
                    // dS = p ∘ (dP − rowsum(dO ∘ O)), scaled
                    for ((i, dpr), pr) in (i0..i1).zip(dp.chunks_mut(kv)).zip(p.chunks(kv)) {
                        let delta = math::dot(&doh[i * d..(i + 1) * d], &oh[i * d..(i + 1) * d]);
                        for (x, &pv) in dpr.iter_mut().zip(pr) {
                            *x = pv * (*x - delta) * scale;
                        }
                    }
                    // dQ = dS·K ; dK += dSᵀ·Q
                    mm(
                        (rows, d, kv),
                        dp,
                        (kvi, 1),
                        &kh[..kv * d],
                        (di, 1),
                        &mut dqh[i0 * d..i1 * d],
                        false,
                    );
                    mm(
                        (kv, d, rows),
                        dp,
                        (1, kvi),
                        qb,
                        (di, 1),
                        &mut dkh[..kv * d],
                        true,
                    );
                }
                // SAFETY: unit (b, g) alone writes rows of batch b in the heads of group g.
                unsafe { scatter(dq_ptr, s.q_width(), b * t, h * d, d, dqh) };
            }
            // SAFETY: as above, for kv-head g.
            unsafe {
                scatter(dk_ptr, s.kv_width(), b * t, g * d, d, dkh);
                scatter(dv_ptr, s.kv_width(), b * t, g * d, d, dvh);
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain f64 attention: `(out, lse, dq, dk, dv)` for row-major inputs as the kernels take.
    #[allow(clippy::type_complexity)]
    fn reference(
        (s, positions): (AttnShape, Option<&[u32]>),
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dout: &[f32],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (t, d, qw, kw) = (s.seq, s.head_dim, s.q_width(), s.kv_width());
        let scale = 1.0 / (d as f64).sqrt();
        let mut out = vec![0.0; q.len()];
        let mut lse = vec![0.0; s.batch * s.heads * t];
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        for b in 0..s.batch {
            for h in 0..s.heads {
                let g = h / s.group();
                let qi = |i: usize, c: usize| q[(b * t + i) * qw + h * d + c] as f64;
                let kj = |j: usize, c: usize| k[(b * t + j) * kw + g * d + c] as f64;
                let vj = |j: usize, c: usize| v[(b * t + j) * kw + g * d + c] as f64;
                let doi = |i: usize, c: usize| dout[(b * t + i) * qw + h * d + c] as f64;
                for i in 0..t {
                    let first = positions.map_or(0, |p| i - p[b * t + i] as usize);
                    let sc: Vec<f64> = (first..=i)
                        .map(|j| (0..d).map(|c| qi(i, c) * kj(j, c)).sum::<f64>() * scale)
                        .collect();
                    let max = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = sc.iter().map(|x| (x - max).exp()).sum();
                    lse[(b * s.heads + h) * t + i] = max + sum.ln();
                    let p: Vec<f64> = sc.iter().map(|x| (x - max).exp() / sum).collect();
                    let o: Vec<f64> = (0..d)
                        .map(|c| (first..=i).zip(&p).map(|(j, pj)| pj * vj(j, c)).sum())
                        .collect();
                    let delta: f64 = (0..d).map(|c| doi(i, c) * o[c]).sum();
                    for (j, &pj) in (first..).zip(&p) {
                        let dpj: f64 = (0..d).map(|c| doi(i, c) * vj(j, c)).sum();
                        let ds = pj * (dpj - delta) * scale;
                        for c in 0..d {
                            dv[(b * t + j) * kw + g * d + c] += pj * doi(i, c);
                            dq[(b * t + i) * qw + h * d + c] += ds * kj(j, c);
                            dk[(b * t + j) * kw + g * d + c] += ds * qi(i, c);
                        }
                    }
                    for (c, oc) in o.into_iter().enumerate() {
                        out[(b * t + i) * qw + h * d + c] = oc;
                    }
                }
            }
        }
        (out, lse, dq, dk, dv)
    }

    fn run(
        threads: usize,
        (s, positions): (AttnShape, Option<&[u32]>),
        inputs: &[Vec<f32>; 4],
    ) -> [Vec<f32>; 5] {
        let dev = CpuDevice::new(threads, u64::MAX).unwrap();
        let [q, k, v, dout] = inputs;
        let mut out = vec![0.0; q.len()];
        let mut lse = vec![0.0; s.batch * s.heads * s.seq];
        let s = (s, positions);
        forward(&dev, s, q, k, v, &mut out, &mut lse).unwrap();
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        let saved = [&q[..], k, v, &out, dout];
        backward(&dev, s, saved, &lse, [&mut dq, &mut dk, &mut dv]).unwrap();
        assert_eq!(dev.tracker().allocated(), 0);
        [out, lse, dq, dk, dv]
    }

    /// The kernels against [`reference`] on one thread, and the same bits on two and three.
    fn matches_the_reference(s: (AttnShape, Option<&[u32]>)) {
        let rows = s.0.batch * s.0.seq;
        let gen = |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin()).collect() };
        let inputs = [
            gen(rows * s.0.q_width(), 0.37),
            gen(rows * s.0.kv_width(), 0.71),
            gen(rows * s.0.kv_width(), 0.13),
            gen(rows * s.0.q_width(), 0.53),
        ];
        let got = run(1, s, &inputs);
        let [q, k, v, dout] = &inputs;
        let (out, lse, dq, dk, dv) = reference(s, q, k, v, dout);
        for (name, g, w) in [
            ("out", &got[0], out),
            ("lse", &got[1], lse),
            ("dq", &got[2], dq),
            ("dk", &got[3], dk),
            ("dv", &got[4], dv),
        ] {
            for (i, (g, w)) in g.iter().zip(&w).enumerate() {
                assert!(
                    (*g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "{name}[{i}]: {g} vs {w}"
                );
            }
        }
        for threads in [2, 3] {
            assert_eq!(run(threads, s, &inputs), got, "{threads} threads");
        }
    }

    /// A shape of two sequences of 100 rows: one full query block and one partial one.
    fn two_blocks() -> AttnShape {
        AttnShape {
            batch: 2,
            seq: QUERY_BLOCK + 36,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
        }
    }

    #[test]
    fn blocked_attention_matches_a_plain_reference_on_every_thread_count() {
        matches_the_reference((two_blocks(), None));
    }

    #[test]
    fn packed_documents_see_only_their_own_keys() {
        // Documents of 30, 50 and 20 tokens in the first sequence (one crossing the query
        // blocks' boundary), of 1, 64 and 35 in the second.
        let s = two_blocks();
        let positions: Vec<u32> = [30, 50, 20, 1, 64, 35]
            .into_iter()
            .flat_map(|len| 0..len)
            .collect();
        assert_eq!(positions.len(), s.batch * s.seq);
        matches_the_reference((s, Some(&positions)));
    }
}
