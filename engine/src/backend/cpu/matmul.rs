//! Matrix products through the `gemm` crate, with f32 accumulation for every element type.
//!
//! bf16 operands are widened into tracked workspace first (exact), the product runs in f32, and a
//! bf16 output is rounded once at the end: the arithmetic of a tensor-core GEMM with fp32
//! accumulation.

use super::CpuDevice;
use crate::memory::{Category, OutOfMemory};
use crate::tensor::{DType, Elem, Tensor};
use gemm::Parallelism;

/// How an operand is stored relative to the product that uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Row-major as used: `[rows, cols]`.
    Normal,
    /// Row-major transposed: stored `[cols, rows]`.
    Transposed,
}

/// One operand of a product: its elements and how they are laid out.
pub struct Operand<'a, E: Elem> {
    data: &'a [E],
    layout: Layout,
}

/// `data` used as stored (row-major).
pub fn n<E: Elem>(data: &[E]) -> Operand<'_, E> {
    Operand {
        data,
        layout: Layout::Normal,
    }
}

/// `data` used transposed.
pub fn t<E: Elem>(data: &[E]) -> Operand<'_, E> {
    Operand {
        data,
        layout: Layout::Transposed,
    }
}

/// An operand as f32: borrowed when it already is, else a tracked workspace copy.
enum Wide<'a> {
    Borrowed(&'a [f32]),
    Owned(Tensor<f32>),
}

impl Wide<'_> {
    fn get(&self) -> &[f32] {
        match self {
            Wide::Borrowed(s) => s,
            Wide::Owned(t) => t.as_slice(),
        }
    }
}

fn widen<'a, E: Elem>(dev: &CpuDevice, data: &'a [E]) -> Result<Wide<'a>, OutOfMemory> {
    if E::DTYPE == DType::F32 {
        return Ok(Wide::Borrowed(bytemuck::cast_slice(data)));
    }
    let mut ws = dev.zeros::<f32>(&[data.len()], Category::Workspace)?;
    super::kernels::convert(dev, data, ws.as_mut_slice());
    Ok(Wide::Owned(ws))
}

/// `c[m, n] (+)= a[m, k] · b[k, n]`, each operand laid out as given; `accumulate` adds to `c`.
pub fn matmul<A: Elem, B: Elem, C: Elem>(
    dev: &CpuDevice,
    (m, n, k): (usize, usize, usize),
    a: Operand<'_, A>,
    b: Operand<'_, B>,
    c: &mut [C],
    accumulate: bool,
) -> Result<(), OutOfMemory> {
    debug_assert_eq!(a.data.len(), m * k);
    debug_assert_eq!(b.data.len(), k * n);
    debug_assert_eq!(c.len(), m * n);
    let a32 = widen(dev, a.data)?;
    let b32 = widen(dev, b.data)?;
    let (a32, b32) = (a32.get(), b32.get());
    let (a_rs, a_cs) = strides(a.layout, k, m);
    let (b_rs, b_cs) = strides(b.layout, n, k);
    let parallelism = if dev.threads() > 1 {
        Parallelism::Rayon(dev.threads())
    } else {
        Parallelism::None
    };
    if C::DTYPE == DType::F32 {
        let c32: &mut [f32] = bytemuck::cast_slice_mut(c);
        dev.install(|| {
            gemm_f32(
                (m, n, k),
                a32,
                (a_rs, a_cs),
                b32,
                (b_rs, b_cs),
                c32,
                accumulate,
                parallelism,
            )
        });
        return Ok(());
    }
    let mut out = dev.zeros::<f32>(&[m * n], Category::Workspace)?;
    if accumulate {
        super::kernels::convert(dev, c, out.as_mut_slice());
    }
    dev.install(|| {
        gemm_f32(
            (m, n, k),
            a32,
            (a_rs, a_cs),
            b32,
            (b_rs, b_cs),
            out.as_mut_slice(),
            accumulate,
            parallelism,
        )
    });
    super::kernels::convert(dev, out.as_slice(), c);
    Ok(())
}

/// (row stride, column stride) of an operand used as `[rows, cols]` with `cols` columns.
fn strides(layout: Layout, cols: usize, rows: usize) -> (isize, isize) {
    match layout {
        Layout::Normal => (cols as isize, 1),
        Layout::Transposed => (1, rows as isize),
    }
}

/// The single call into `gemm`: `c = (accumulate ? c : 0) + a·b`, all f32 and row-major `c`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_f32(
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    (a_rs, a_cs): (isize, isize),
    b: &[f32],
    (b_rs, b_cs): (isize, isize),
    c: &mut [f32],
    accumulate: bool,
    parallelism: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return;
    }
    // SAFETY: the slices hold m·k, k·n and m·n elements (checked by callers), and the strides
    // describe row-major layouts of exactly those shapes.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn naive(
        m: usize,
        n: usize,
        k: usize,
        a: impl Fn(usize, usize) -> f32,
        b: impl Fn(usize, usize) -> f32,
    ) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a(i, p) * b(p, j)).sum();
            }
        }
        c
    }

    #[test]
    fn every_layout_matches_a_naive_product() {
        let dev = CpuDevice::new(2, u64::MAX).unwrap();
        let (m, n, k) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32).sin()).collect();
        let want = naive(m, n, k, |i, p| a[i * k + p], |p, j| b[p * n + j]);
        let mut c = vec![0.0f32; m * n];
        matmul(&dev, (m, n, k), n_(&a), n_(&b), &mut c, false).unwrap();
        assert_close(&c, &want);
        // a stored transposed: [k, m]
        let at: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
        let bt: Vec<f32> = (0..n * k).map(|idx| b[(idx % k) * n + idx / k]).collect();
        let mut c2 = vec![1.0f32; m * n];
        matmul(&dev, (m, n, k), t(&at), t(&bt), &mut c2, true).unwrap();
        let want2: Vec<f32> = want.iter().map(|x| x + 1.0).collect();
        assert_close(&c2, &want2);
        // bf16 operands and output go through workspace, which is returned afterwards
        let ab: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut cb = vec![bf16::ZERO; m * n];
        matmul(&dev, (m, n, k), n_(&ab), n_(&b), &mut cb, false).unwrap();
        let got: Vec<f32> = cb.iter().map(|x| x.to_f32()).collect();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 0.02 * w.abs().max(1.0), "{g} vs {w}");
        }
        assert_eq!(dev.tracker().allocated(), 0);
        assert!(dev.tracker().stats().peak_by_category.workspace > 0);
    }

    fn n_(x: &[impl Elem]) -> Operand<'_, impl Elem> {
        n(x)
    }

    fn assert_close(a: &[f32], b: &[f32]) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "{x} vs {y}");
        }
    }
}
