//! [`Device`] for [`CpuDevice`]: host tensors, and the row-wise and element-wise kernels of the
//! Llama block, generic over the stored element type and computed in f32. Each output row is
//! written by one thread; reductions across rows (weight gradients) run in a fixed sequential
//! order, so results do not depend on the thread count.

use super::math::{convert, vectorized};
use super::{attention, math, matmul, CpuDevice, CpuRope};
use crate::backend::span;
use crate::device::dropout::DropoutMask;
use crate::device::rope::RopeSpec;
use crate::device::{AdamWArgs, AttnShape, Device, DeviceKind, Operand, Out};
use crate::environment::ExecutionEnv;
use crate::error::Result;
use crate::memory::{Category, MemoryTracker};
use crate::model::loss::IGNORE_INDEX;
use crate::optim::CHUNK;
use crate::tensor::{Elem, Tensor};
use rayon::prelude::*;
use std::borrow::Cow;

/// Rows handed to a thread at a time: large enough to amortise scheduling.
const ROWS_PER_TASK: usize = 16;

#[inline(always)]
fn softmax_xent_grad<E: Elem>(row: &mut [E], label: i64, scale: f32) -> f32 {
    if label == IGNORE_INDEX {
        row.fill(E::default());
        return 0.0;
    }
    let label = label as usize;
    let max = math::max(row);
    let lse = max + math::sum_exp(row, max).ln();
    let logit = row[label].to_f32();
    for x in row.iter_mut() {
        *x = E::from_f32(scale * math::exp(x.to_f32() - lse));
    }
    row[label] = E::from_f32(scale * (math::exp(logit - lse) - 1.0));
    lse - logit
}

impl Device for CpuDevice {
    type Tensor<E: Elem> = Tensor<E>;
    type Rope = CpuRope;
    type Ids = Vec<u32>;
    type Labels = Vec<i64>;

    fn tracker(&self) -> &MemoryTracker {
        CpuDevice::tracker(self)
    }

    fn host(&self) -> MemoryTracker {
        CpuDevice::tracker(self).clone()
    }

    /// The backend and its matrix kernels; not the thread count, which results do not depend on.
    fn execution_env(&self) -> ExecutionEnv {
        ExecutionEnv {
            cpu_kernels: Some(matmul::kernels(self.bf16_products())),
            ..ExecutionEnv::new(DeviceKind::Cpu.name())
        }
    }

    fn run_step<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.install(f)
    }

    fn zeros<E: Elem>(&self, shape: &[usize], category: Category) -> Result<Tensor<E>> {
        Ok(CpuDevice::zeros(self, shape, category)?)
    }

    fn zeros_kept<E: Elem>(&self, shape: &[usize], category: Category) -> Result<Tensor<E>> {
        Ok(Tensor::zeros_kept(&self.tracker, shape, category)?)
    }

    fn uninit<E: Elem>(&self, shape: &[usize], category: Category) -> Result<Tensor<E>> {
        let mut t = Tensor::unfilled(&self.tracker, shape, category)?;
        if cfg!(debug_assertions) {
            t.as_mut_slice().fill(E::from_f32(f32::NAN));
        }
        Ok(t)
    }

    fn upload<E: Elem>(&self, host: Tensor<E>) -> Result<Tensor<E>> {
        Ok(host)
    }

    fn to_host<E: Elem>(&self, t: &Tensor<E>) -> Result<Vec<E>> {
        Ok(t.as_slice().to_vec())
    }

    fn raw_bytes<'a, E: Elem>(&self, t: &'a Tensor<E>) -> Result<Cow<'a, [u8]>> {
        Ok(Cow::Borrowed(t.as_bytes()))
    }

    fn read_bytes<E: Elem>(&self, t: &Tensor<E>, offset: usize, len: usize) -> Result<Vec<u8>> {
        let range = span(t.as_bytes().len(), offset, len)?;
        Ok(t.as_bytes()[range].to_vec())
    }

    fn write_bytes<E: Elem>(&self, t: &mut Tensor<E>, offset: usize, bytes: &[u8]) -> Result<()> {
        let dst: &mut [u8] = bytemuck::cast_slice_mut(t.as_mut_slice());
        let range = span(dst.len(), offset, bytes.len())?;
        dst[range].copy_from_slice(bytes);
        Ok(())
    }

    fn ranks(&self, world: usize) -> Result<Vec<Self>> {
        if world == 1 {
            return Ok(vec![self.clone()]);
        }
        let capacity = self.rank_capacity(world);
        (0..world)
            .map(|_| {
                Ok(CpuDevice::new((self.threads() / world).max(1), capacity)?
                    .with_bf16_products(self.bf16_products())?
                    .limit_vector_isa(self.vector_isa()))
            })
            .collect()
    }

    /// An equal share of this device's: the ranks share the host's memory.
    fn rank_capacity(&self, world: usize) -> u64 {
        self.tracker().stats().capacity / world.max(1) as u64
    }

    fn copy<E: Elem>(&self, src: &Tensor<E>, dst: &mut Tensor<E>) -> Result<()> {
        dst.as_mut_slice().copy_from_slice(src.as_slice());
        Ok(())
    }

    fn fill_zero(&self, t: &mut Tensor<f32>) -> Result<()> {
        t.fill(0.0);
        Ok(())
    }

    fn round<E: Elem>(&self, src: &Tensor<f32>, dst: &mut Tensor<E>) -> Result<()> {
        convert(self, src.as_slice(), dst.as_mut_slice());
        Ok(())
    }

    fn rope_tables(&self, spec: RopeSpec) -> Result<CpuRope> {
        let bytes = spec.elements() as u64 * 8;
        let lease = CpuDevice::tracker(self).allocate(bytes, Category::Params)?;
        Ok(CpuRope {
            table: spec.table()?,
            _lease: lease,
        })
    }

    fn ids(&self, ids: &[u32]) -> Result<Vec<u32>> {
        Ok(ids.to_vec())
    }

    fn labels(&self, labels: &[i64]) -> Result<Vec<i64>> {
        Ok(labels.to_vec())
    }

    fn matmul<A: Elem, B: Elem, C: Elem>(
        &self,
        dims: (usize, usize, usize),
        a: Operand<'_, Tensor<A>>,
        b: Operand<'_, Tensor<B>>,
        c: Out<'_, Tensor<C>>,
        accumulate: bool,
    ) -> Result<()> {
        matmul::matmul(self, dims, a, b, c, accumulate)
    }

    fn embedding_forward<E: Elem>(
        &self,
        table: &Tensor<E>,
        ids: &Vec<u32>,
        out: &mut Tensor<E>,
    ) -> Result<()> {
        let (dev, table, out) = (self, table.as_slice(), out.as_mut_slice());
        let width = out.len() / ids.len().max(1);
        dev.install(|| {
            out.par_chunks_mut(width)
                .zip(ids.par_iter())
                .for_each(|(o, &id)| {
                    let id = id as usize;
                    o.copy_from_slice(&table[id * width..(id + 1) * width]);
                })
        });
        Ok(())
    }

    fn embedding_backward<E: Elem>(
        &self,
        dout: &Tensor<E>,
        ids: &Vec<u32>,
        dtable: &mut Tensor<f32>,
    ) -> Result<()> {
        let (dout, dtable) = (dout.as_slice(), dtable.as_mut_slice());
        let width = dout.len() / ids.len().max(1);
        vectorized!(self.vector_isa(), {
            for (row, &id) in dout.chunks(width).zip(ids) {
                let id = id as usize;
                for (d, g) in dtable[id * width..(id + 1) * width].iter_mut().zip(row) {
                    *d += g.to_f32();
                }
            }
        });
        Ok(())
    }

    fn rmsnorm_forward<E: Elem>(
        &self,
        x: &Tensor<E>,
        w: &Tensor<E>,
        eps: f32,
        y: &mut Tensor<E>,
        rinv: &mut Tensor<f32>,
    ) -> Result<()> {
        let (dev, x, w) = (self, x.as_slice(), w.as_slice());
        let (y, rinv) = (y.as_mut_slice(), rinv.as_mut_slice());
        let h = w.len();
        dev.install(|| {
            y.par_chunks_mut(h * ROWS_PER_TASK)
                .zip(x.par_chunks(h * ROWS_PER_TASK))
                .zip(rinv.par_chunks_mut(ROWS_PER_TASK))
                .for_each(|((y, x), r)| {
                    vectorized!(self.vector_isa(), {
                        for ((y, x), r) in y.chunks_mut(h).zip(x.chunks(h)).zip(r.iter_mut()) {
                            let ss: f32 = x.iter().map(|v| v.to_f32() * v.to_f32()).sum();
                            *r = 1.0 / (ss / h as f32 + eps).sqrt();
                            for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                                let normed = E::from_f32(x.to_f32() * *r).to_f32();
                                *y = E::from_f32(w.to_f32() * normed);
                            }
                        }
                    })
                })
        });
        Ok(())
    }

    fn rmsnorm_backward<E: Elem>(
        &self,
        dy: &Tensor<E>,
        x: &Tensor<E>,
        w: &Tensor<E>,
        rinv: &Tensor<f32>,
        dx: &mut Tensor<E>,
        dw: &mut Tensor<f32>,
    ) -> Result<()> {
        let (dev, dy, x, w, rinv) = (
            self,
            dy.as_slice(),
            x.as_slice(),
            w.as_slice(),
            rinv.as_slice(),
        );
        let (dx, dw) = (dx.as_mut_slice(), dw.as_mut_slice());
        let h = w.len();
        dev.install(|| {
            dx.par_chunks_mut(h * ROWS_PER_TASK)
                .zip(dy.par_chunks(h * ROWS_PER_TASK))
                .zip(x.par_chunks(h * ROWS_PER_TASK))
                .zip(rinv.par_chunks(ROWS_PER_TASK))
                .for_each(|(((dx, dy), x), r)| {
                    vectorized!(self.vector_isa(), {
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
                })
        });
        // dw[j] = Σ_i dy[i,j]·x[i,j]·r_i, summed over rows in order.
        vectorized!(self.vector_isa(), {
            for ((dy, x), &r) in dy.chunks(h).zip(x.chunks(h)).zip(rinv) {
                for ((dw, dy), x) in dw.iter_mut().zip(dy).zip(x) {
                    *dw += dy.to_f32() * E::from_f32(x.to_f32() * r).to_f32();
                }
            }
        });
        Ok(())
    }

    fn rope<E: Elem>(
        &self,
        x: &mut Tensor<E>,
        (width, seq): (usize, usize),
        tables: &CpuRope,
        positions: Option<&Vec<u32>>,
        inverse: bool,
    ) -> Result<()> {
        let (dev, x, table) = (self, x.as_mut_slice(), &tables.table);
        let half = table.half;
        let sign = if inverse { -1.0 } else { 1.0 };
        dev.install(|| {
            x.par_chunks_mut(width).enumerate().for_each(|(row, x)| {
                vectorized!(self.vector_isa(), {
                    let p = positions.map_or(row % seq, |p| p[row] as usize);
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
            })
        });
        Ok(())
    }

    fn add_bias<E: Elem>(&self, y: &mut Tensor<E>, b: &Tensor<E>) -> Result<()> {
        let (y, b) = (y.as_mut_slice(), b.as_slice());
        let w = b.len();
        self.install(|| {
            y.par_chunks_mut(w * ROWS_PER_TASK).for_each(|rows| {
                vectorized!(self.vector_isa(), {
                    for row in rows.chunks_mut(w) {
                        for (y, b) in row.iter_mut().zip(b) {
                            *y = E::from_f32(y.to_f32() + b.to_f32());
                        }
                    }
                })
            })
        });
        Ok(())
    }

    fn bias_grad<E: Elem>(&self, dy: &Tensor<E>, db: &mut Tensor<f32>) -> Result<()> {
        let db = db.as_mut_slice();
        vectorized!(self.vector_isa(), {
            for row in dy.as_slice().chunks(db.len()) {
                for (d, g) in db.iter_mut().zip(row) {
                    *d += g.to_f32();
                }
            }
        });
        Ok(())
    }

    fn scale_rows<E: Elem>(&self, x: &mut Tensor<E>, w: &Tensor<E>) -> Result<()> {
        let (x, w) = (x.as_mut_slice(), w.as_slice());
        let width = x.len() / w.len().max(1);
        self.install(|| {
            x.par_chunks_mut(width).zip(w).for_each(|(row, w)| {
                vectorized!(self.vector_isa(), {
                    let w = w.to_f32();
                    for x in row {
                        *x = E::from_f32(x.to_f32() * w);
                    }
                })
            })
        });
        Ok(())
    }

    fn scatter_add_rows<E: Elem>(
        &self,
        src: &Tensor<E>,
        rows: &Vec<u32>,
        weights: Option<&Tensor<E>>,
        dst: &mut Tensor<E>,
    ) -> Result<()> {
        let (src, dst) = (src.as_slice(), dst.as_mut_slice());
        let width = src.len() / rows.len().max(1);
        vectorized!(self.vector_isa(), {
            for (i, (s, &r)) in src.chunks(width).zip(rows).enumerate() {
                let w = weights.map_or(1.0, |w| w.as_slice()[i].to_f32());
                let d = &mut dst[r as usize * width..(r as usize + 1) * width];
                for (d, s) in d.iter_mut().zip(s) {
                    let product = E::from_f32(s.to_f32() * w).to_f32();
                    *d = E::from_f32(d.to_f32() + product);
                }
            }
        });
        Ok(())
    }

    fn row_dots<E: Elem>(&self, a: &Tensor<E>, b: &Tensor<E>, out: &mut Tensor<f32>) -> Result<()> {
        let (a, b, out) = (a.as_slice(), b.as_slice(), out.as_mut_slice());
        let width = a.len() / out.len().max(1);
        self.install(|| {
            out.par_iter_mut()
                .zip(a.par_chunks(width).zip(b.par_chunks(width)))
                .for_each(|(o, (a, b))| *o = math::block_dot(a, b))
        });
        Ok(())
    }

    fn swiglu_forward<E: Elem>(
        &self,
        gate: &Tensor<E>,
        up: &Tensor<E>,
        act: &mut Tensor<E>,
    ) -> Result<()> {
        let (dev, gate, up, act) = (self, gate.as_slice(), up.as_slice(), act.as_mut_slice());
        dev.install(|| {
            act.par_chunks_mut(4096)
                .zip(gate.par_chunks(4096).zip(up.par_chunks(4096)))
                .for_each(|(a, (g, u))| {
                    vectorized!(self.vector_isa(), {
                        for ((a, g), u) in a.iter_mut().zip(g).zip(u) {
                            let g = g.to_f32();
                            let silu = E::from_f32(g * math::sigmoid(g)).to_f32();
                            *a = E::from_f32(silu * u.to_f32());
                        }
                    })
                })
        });
        Ok(())
    }

    fn swiglu_backward<E: Elem>(
        &self,
        dact: &Tensor<E>,
        (gate, up): (&Tensor<E>, &Tensor<E>),
        dgate: &mut Tensor<E>,
        dup: &mut Tensor<E>,
    ) -> Result<()> {
        let (dev, dact, gate, up) = (self, dact.as_slice(), gate.as_slice(), up.as_slice());
        let (dgate, dup) = (dgate.as_mut_slice(), dup.as_mut_slice());
        dev.install(|| {
            dgate
                .par_chunks_mut(4096)
                .zip(dup.par_chunks_mut(4096))
                .zip(dact.par_chunks(4096))
                .zip(gate.par_chunks(4096).zip(up.par_chunks(4096)))
                .for_each(|(((dg, du), da), (g, u))| {
                    vectorized!(self.vector_isa(), {
                        for ((((dg, du), da), g), u) in dg.iter_mut().zip(du).zip(da).zip(g).zip(u)
                        {
                            let (g, u, da) = (g.to_f32(), u.to_f32(), da.to_f32());
                            let s = math::sigmoid(g);
                            let silu = E::from_f32(g * s).to_f32();
                            *du = E::from_f32(da * silu);
                            *dg = E::from_f32(da * u * s * (1.0 + g * (1.0 - s)));
                        }
                    })
                })
        });
        Ok(())
    }

    fn dropout_add<E: Elem>(
        &self,
        mask: &DropoutMask,
        x: &Tensor<E>,
        y: &Tensor<E>,
        out: &mut Tensor<E>,
    ) -> Result<()> {
        let (dev, x, y, out) = (self, x.as_slice(), y.as_slice(), out.as_mut_slice());
        debug_assert_eq!(x.len(), y.len());
        debug_assert_eq!(x.len(), out.len());
        let scale = mask.scale();
        dev.install(|| {
            out.par_chunks_mut(4096)
                .zip(x.par_chunks(4096).zip(y.par_chunks(4096)))
                .enumerate()
                .for_each(|(c, (o, (x, y)))| {
                    vectorized!(self.vector_isa(), {
                        let base = (c * 4096) as u64;
                        for (i, (o, (x, y))) in o.iter_mut().zip(x.iter().zip(y)).enumerate() {
                            *o = if mask.keeps(base + i as u64) {
                                E::from_f32(x.to_f32() + y.to_f32() * scale)
                            } else {
                                *x
                            };
                        }
                    })
                })
        });
        Ok(())
    }

    fn dropout_backward<E: Elem>(
        &self,
        mask: &DropoutMask,
        dout: &Tensor<E>,
        dy: &mut Tensor<E>,
    ) -> Result<()> {
        let (dev, dout, dy) = (self, dout.as_slice(), dy.as_mut_slice());
        debug_assert_eq!(dout.len(), dy.len());
        let scale = mask.scale();
        dev.install(|| {
            dy.par_chunks_mut(4096)
                .zip(dout.par_chunks(4096))
                .enumerate()
                .for_each(|(c, (d, g))| {
                    vectorized!(self.vector_isa(), {
                        let base = (c * 4096) as u64;
                        for (i, (d, g)) in d.iter_mut().zip(g).enumerate() {
                            *d = if mask.keeps(base + i as u64) {
                                E::from_f32(g.to_f32() * scale)
                            } else {
                                E::default()
                            };
                        }
                    })
                })
        });
        Ok(())
    }

    fn attention_forward<E: Elem>(
        &self,
        s: AttnShape,
        positions: Option<&Vec<u32>>,
        q: &Tensor<E>,
        k: &Tensor<E>,
        v: &Tensor<E>,
        out: &mut Tensor<E>,
        lse: &mut Tensor<f32>,
    ) -> Result<()> {
        let (q, k, v) = (q.as_slice(), k.as_slice(), v.as_slice());
        let (out, lse) = (out.as_mut_slice(), lse.as_mut_slice());
        attention::forward(self, (s, positions.map(|p| &p[..])), q, k, v, out, lse)
    }

    fn attention_backward<E: Elem>(
        &self,
        s: AttnShape,
        positions: Option<&Vec<u32>>,
        q: &Tensor<E>,
        k: &Tensor<E>,
        v: &Tensor<E>,
        (out, lse): (&Tensor<E>, &Tensor<f32>),
        dout: &Tensor<E>,
        dq: &mut Tensor<E>,
        dk: &mut Tensor<E>,
        dv: &mut Tensor<E>,
    ) -> Result<()> {
        let saved = [q, k, v, out, dout].map(|t| t.as_slice());
        let grads = [dq, dk, dv].map(|t| t.as_mut_slice());
        let s = (s, positions.map(|p| &p[..]));
        attention::backward(self, s, saved, lse.as_slice(), grads)
    }

    fn cross_entropy_rows<E: Elem>(
        &self,
        logits: &mut Tensor<E>,
        labels: &Vec<i64>,
        row_loss: &mut Tensor<f32>,
        (start, len, vocab): (usize, usize, usize),
        scale: f32,
    ) -> Result<()> {
        let logits = &mut logits.as_mut_slice()[..len * vocab];
        let labels = &labels[start..start + len];
        let row_loss = &mut row_loss.as_mut_slice()[start..start + len];
        self.install(|| {
            logits
                .par_chunks_mut(vocab)
                .zip(row_loss.par_iter_mut())
                .zip(labels.par_iter())
                .for_each(|((row, loss), &label)| {
                    *loss = vectorized!(self.vector_isa(), softmax_xent_grad(row, label, scale))
                })
        });
        Ok(())
    }

    fn norm(&self, tensors: &[&Tensor<f32>]) -> Result<f64> {
        let mut total = 0.0f64;
        for t in tensors {
            total += self.sum_squares(t)?;
        }
        Ok(total.sqrt())
    }

    fn sum_squares(&self, t: &Tensor<f32>) -> Result<f64> {
        let partial: Vec<f64> = self.install(|| {
            t.as_slice()
                .par_chunks(CHUNK)
                .map(|c| c.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>())
                .collect()
        });
        Ok(partial.iter().sum::<f64>())
    }

    fn scale(&self, x: &mut Tensor<f32>, coef: f32) -> Result<()> {
        let x = x.as_mut_slice();
        vectorized!(self.vector_isa(), x.iter_mut().for_each(|v| *v *= coef));
        Ok(())
    }

    fn adamw_range(
        &self,
        p: &mut Tensor<f32>,
        g: &Tensor<f32>,
        (m, v): (&mut Tensor<f32>, &mut Tensor<f32>),
        a: AdamWArgs,
        (p_offset, g_offset): (usize, usize),
    ) -> Result<()> {
        let (p_span, g_span) = (
            span(p.numel(), p_offset, m.numel())?,
            span(g.numel(), g_offset, m.numel())?,
        );
        let (p, g) = (&mut p.as_mut_slice()[p_span], &g.as_slice()[g_span]);
        let (m, v) = (m.as_mut_slice(), v.as_mut_slice());
        self.install(|| {
            p.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
                .for_each(|((p, g), (m, v))| {
                    vectorized!(self.vector_isa(), {
                        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                            *p *= a.decay;
                            *m += (g - *m) * a.one_minus_b1;
                            *v = *v * a.b2 + a.one_minus_b2 * g * g;
                            let denom = v.sqrt() / a.bc2_sqrt + a.eps;
                            *p -= a.step_size * *m / denom;
                        }
                    })
                })
        });
        Ok(())
    }

    fn adamw(
        &self,
        p: &mut Tensor<f32>,
        g: &Tensor<f32>,
        moments: (&mut Tensor<f32>, &mut Tensor<f32>),
        a: AdamWArgs,
    ) -> Result<()> {
        self.adamw_range(p, g, moments, a, (0, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tests run with debug assertions, so an output tensor reads as NaN until it is written:
    /// a model op that reads one (an accumulator taken with `uninit` in place of `zeros`) turns
    /// the loss and gradients NaN. Outside tests it is zero-filled memory like `zeros`.
    #[test]
    fn each_rank_gets_the_capacity_rank_capacity_says() {
        let dev = CpuDevice::new(4, 1_000_000).unwrap();
        for world in [1, 3, 4] {
            let got: Vec<u64> = dev
                .ranks(world)
                .unwrap()
                .iter()
                .map(|d| d.tracker().stats().capacity)
                .collect();
            assert_eq!(got, vec![dev.rank_capacity(world); world]);
        }
        assert_eq!(dev.rank_capacity(3), 333_333);
    }

    /// A step runs on one of the device's own threads, so each kernel's parallel loop starts
    /// there instead of waking the pool from outside.
    #[test]
    fn a_step_runs_on_one_of_the_device_pool_threads() {
        let dev = CpuDevice::new(3, u64::MAX).unwrap();
        let (index, threads) =
            dev.run_step(|| (rayon::current_thread_index(), rayon::current_num_threads()));
        assert!(index.is_some_and(|i| i < 3), "ran on thread {index:?}");
        assert_eq!(threads, 3);
    }

    #[test]
    fn uninit_tensors_read_as_nan_under_debug_assertions() {
        let dev = CpuDevice::new(1, u64::MAX).unwrap();
        let t = Device::uninit::<half::bf16>(&dev, &[3, 5], Category::Activations).unwrap();
        assert_eq!(t.as_slice().len(), 15);
        let nan = t.as_slice().iter().all(|x| x.to_f32().is_nan());
        let zero = t.as_slice().iter().all(|x| x.to_f32() == 0.0);
        assert_eq!(
            (nan, zero),
            (cfg!(debug_assertions), !cfg!(debug_assertions))
        );
    }

    /// The inverse rotation undoes the rotation, and the rotation is Hugging Face's: the first
    /// pair of a head at position 1 turns by angle 1 (`theta^0`).
    #[test]
    fn rope_inverse_undoes_rope() {
        let dev = CpuDevice::new(2, u64::MAX).unwrap();
        let spec = RopeSpec {
            head_dim: 8,
            theta: 10000.0,
            positions: 4,
        };
        let tables = dev.rope_tables(spec).unwrap();
        let values: Vec<f32> = (0..4 * 16).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y =
            Tensor::<f32>::from_f32(dev.tracker(), &[4, 16], &values, Category::Activations)
                .unwrap();
        dev.rope(&mut y, (16, 4), &tables, None, false).unwrap();
        // Row p is position p; each of its two heads of 8 rotates pair (i, i + 4) by
        // p · 10000^(−2i/8), Hugging Face's angle.
        for (at, got) in y.as_slice().iter().enumerate() {
            let (p, i, second) = (at / 16, at % 8 % 4, at % 8 >= 4);
            let angle = p as f64 * 10000f64.powf(-((2 * i) as f64) / 8.0);
            let (c, s) = (angle.cos() as f32, angle.sin() as f32);
            let first = at - if second { 4 } else { 0 };
            let (a, b) = (values[first], values[first + 4]);
            let want = if second { b * c + a * s } else { a * c - b * s };
            assert!((got - want).abs() < 1e-6, "element {at}: {got} vs {want}");
        }
        dev.rope(&mut y, (16, 4), &tables, None, true).unwrap();
        for (a, b) in values.iter().zip(y.as_slice()) {
            assert!((a - b).abs() < 1e-6);
        }
    }
}
