//! Matrix products through the `gemm` crate, with f32 accumulation for every element type; on
//! CPUs with AVX2 and FMA (but not AVX-512) most of them through a kernel of the engine's own
//! instead (`fma_gemm`), with the same bits.
//!
//! bf16 operands are widened into tracked workspace first (exact), the product runs in f32, and a
//! bf16 output is rounded once at the end: the arithmetic of a tensor-core GEMM with fp32
//! accumulation. A device that multiplies bf16 with the CPU's dot-product instruction
//! ([`super::bf16_dot`]) packs two bf16 operands into the same workspace instead of widening
//! them.

use super::bf16_dot::{self, Bf16Products};
#[cfg(target_arch = "x86_64")]
use super::fma_gemm;
use super::math::VectorIsa;
use super::strided::Strided;
use super::CpuDevice;
use crate::device::{Device, Operand, Out};
use crate::error::Result;
use crate::memory::Category;
use crate::tensor::{DType, Elem, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

/// The f32 workspace a product takes on the CPU, in allocation order: each bf16 operand
/// widened, then a bf16 output's accumulator. The CPU's product allocates exactly this, and the
/// counting device imitating the CPU allocates it too.
pub(crate) struct Workspace<T> {
    a: Option<T>,
    b: Option<T>,
    c: Option<T>,
}

/// Allocates the workspace of a `[m, k] · [k, n]` product of operands and output of `dtypes`,
/// each buffer written in full (widened, packed or accumulated into) before it is read.
pub(crate) fn workspace<D: Device>(
    dev: &D,
    dtypes: [DType; 3],
    (m, n, k): (usize, usize, usize),
) -> Result<Workspace<D::Tensor<f32>>> {
    let wide = |dtype: DType, len: usize| match dtype {
        DType::F32 => Ok(None),
        DType::Bf16 => dev.uninit::<f32>(&[len], Category::Workspace).map(Some),
    };
    Ok(Workspace {
        a: wide(dtypes[0], m * k)?,
        b: wide(dtypes[1], k * n)?,
        c: wide(dtypes[2], m * n)?,
    })
}

/// `data` as f32: itself when it is f32, else widened into its workspace buffer.
fn widen<'a, E: Elem>(
    dev: &CpuDevice,
    data: &'a [E],
    ws: &'a mut Option<Tensor<f32>>,
) -> &'a [f32] {
    match ws {
        None => bytemuck::cast_slice(data),
        Some(t) => {
            super::math::convert(dev, data, t.as_mut_slice());
            t.as_slice()
        }
    }
}

/// The `len` elements of an operand from its offset.
fn elements<'a, E: Elem>(o: &Operand<'a, Tensor<E>>, len: usize) -> &'a [E] {
    &o.tensor.as_slice()[o.offset..o.offset + len]
}

/// `c[m, n] (+)= a[m, k] · b[k, n]`, each operand laid out as given; `accumulate` adds to `c`.
pub fn matmul<A: Elem, B: Elem, C: Elem>(
    dev: &CpuDevice,
    (m, n, k): (usize, usize, usize),
    a: Operand<'_, Tensor<A>>,
    b: Operand<'_, Tensor<B>>,
    c: Out<'_, Tensor<C>>,
    accumulate: bool,
) -> Result<()> {
    let mut ws = workspace(dev, [A::DTYPE, B::DTYPE, C::DTYPE], (m, n, k))?;
    let (a_rs, a_cs) = strides(a.transposed, k, m);
    let (b_rs, b_cs) = strides(b.transposed, n, k);
    let c = &mut c.tensor.as_mut_slice()[c.offset..c.offset + m * n];
    let c32: &mut [f32] = match &mut ws.c {
        None => bytemuck::cast_slice_mut(c),
        Some(out) => {
            if accumulate {
                super::math::convert(dev, c, out.as_mut_slice());
            }
            out.as_mut_slice()
        }
    };
    // Both operands have workspace exactly where both are bf16.
    match (&mut ws.a, &mut ws.b) {
        (Some(pa), Some(pb)) if dev.bf16_products() == Bf16Products::Dot => dev.install(|| {
            bf16_dot::gemm(
                (m, n, k),
                (bytemuck::cast_slice(elements(&a, m * k)), a.transposed),
                (bytemuck::cast_slice(elements(&b, k * n)), b.transposed),
                c32,
                accumulate,
                bytemuck::cast_slice_mut(pa.as_mut_slice()),
                bytemuck::cast_slice_mut(pb.as_mut_slice()),
            )
        }),
        _ => {
            let a32 = widen(dev, elements(&a, m * k), &mut ws.a);
            let b32 = widen(dev, elements(&b, k * n), &mut ws.b);
            dev.install(|| {
                gemm_f32(
                    (m, n, k),
                    a32,
                    (a_rs, a_cs),
                    b32,
                    (b_rs, b_cs),
                    c32,
                    accumulate,
                    dev.threads(),
                )
            })
        }
    }
    if let Some(out) = &ws.c {
        super::math::convert(dev, out.as_slice(), c);
    }
    Ok(())
}

/// (row stride, column stride) of an operand used as `[rows, cols]` with `cols` columns.
fn strides(transposed: bool, cols: usize, rows: usize) -> (isize, isize) {
    if transposed {
        (1, rows as isize)
    } else {
        (cols as isize, 1)
    }
}

/// The vector instructions of this CPU's kernels ([`VectorIsa`]), which `gemm`'s matrix kernels
/// and the engine's own loops run with: `<arch> avx512f` (only with the `avx512` feature, which
/// builds `gemm`'s AVX-512 kernels), `<arch> fma` (AVX2 with FMA) or `<arch> neon`, else
/// `<arch> scalar`; ` avx512_bf16` after them where bf16 is multiplied with the dot-product
/// instruction ([`Bf16Products::Dot`]). Some small products (those `gemm` computes
/// as dot products across SIMD lanes) sum in another order with another lane width, so the bits
/// of a run hold for the kernels it ran with. They hold whatever the CPU's caches: the blocking
/// of the inner dimension is fixed (`depth_chunk`), so the record needs no cache sizes.
pub fn kernels(bf16_products: Bf16Products) -> String {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    let kernels = match VectorIsa::detect() {
        VectorIsa::Avx512 => "avx512f",
        VectorIsa::Avx2Fma => "fma",
        VectorIsa::Baseline => "scalar",
    };
    #[cfg(target_arch = "aarch64")]
    let kernels = if std::arch::is_aarch64_feature_detected!("neon") {
        "neon"
    } else {
        "scalar"
    };
    #[cfg(not(any(target_arch = "x86", target_arch = "x86_64", target_arch = "aarch64")))]
    let kernels = "scalar";
    match bf16_products {
        Bf16Products::Widened => format!("{} {kernels}", std::env::consts::ARCH),
        Bf16Products::Dot => format!("{} {kernels} {BF16_DOT_KERNELS}", std::env::consts::ARCH),
    }
}

/// The word [`kernels`] adds where bf16 is multiplied with the dot-product instruction.
pub const BF16_DOT_KERNELS: &str = "avx512_bf16";

/// The longest inner-dimension block `gemm` never splits, whatever the CPU: `gemm-common` 0.19
/// derives its block (`kc`) from the caches (`kernel_params`, from
/// `/sys/devices/system/cpu/cpu*/cache`) but never below 512 (nor above the depth), and its
/// paths that do not ask the caches block by 512 or 1024.
const DEPTH_BLOCK: usize = 512;

/// The inner-dimension chunk `gemm_f32` hands `gemm` at a time for an `[m, k] · [k, n]` product,
/// so that how each output's sum is split depends on the shape alone, never on the caches.
///
/// `k` whole where `gemm` blocks it without the caches: up to [`DEPTH_BLOCK`] (never split),
/// and products of at most 64 × 64 outputs (split at 512, or 1024 for at most 256 outputs).
/// Otherwise `gemm` would split at a `kc` of the caches' choosing, so the product is handed over
/// in `ceil(k / ceil(k / 512))`-long chunks, which `gemm` never splits further: the blocks it
/// takes itself on the smallest caches it considers (a 32 KiB, 8-way L1d), so the bits on such
/// CPUs are those they always had.
fn depth_chunk((m, n, k): (usize, usize, usize)) -> usize {
    if k <= DEPTH_BLOCK || (m <= 64 && n <= 64) {
        return k;
    }
    k.div_ceil(k.div_ceil(DEPTH_BLOCK))
}

/// Rows of the output each thread takes where a product's depth is handed over in more than
/// one chunk, or `m` where `gemm` parallelises it better itself.
///
/// `gemm` adds each chunk to the whole output before the next, so a deep product with a large
/// output (a weight's gradient: `[out, in]` summed over every token) reads and writes all of it
/// once a chunk from memory. Split by rows among the threads, each thread adds every chunk to
/// its own rows while they are in its cache. The bits are those of one call: each output is
/// summed by the same kernel in the same order, whichever rows share a call with it, as long as
/// no call falls to `gemm`'s paths for tiny products (one row, or at most 16 × 16 outputs), hence
/// at least [`MIN_ROWS`] rows a thread and more than 16 columns.
fn rows_per_thread((m, n, k): (usize, usize, usize), chunk: usize, threads: usize) -> usize {
    if threads < 2 || chunk >= k || n <= 16 {
        return m;
    }
    let rows = m.div_ceil(threads).next_multiple_of(MIN_ROWS);
    let last = m - (m.div_ceil(rows) - 1) * rows;
    if rows >= m || last < MIN_ROWS {
        return m;
    }
    rows
}

/// The fewest output rows a thread takes in [`rows_per_thread`]: one register block of `gemm`'s
/// AVX2 kernels.
const MIN_ROWS: usize = 16;

/// The single call into `gemm` (or [`fma_gemm`], [`by_fma_gemm`]): `c = (accumulate ? c : 0) +
/// a·b`, all f32 and row-major `c`, the inner dimension handed over in [`depth_chunk`]s, each
/// added to what the ones before left, on `threads` threads (1: the calling thread alone); a deep
/// product's output rows shared among the threads ([`rows_per_thread`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_f32(
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    a_strides: (isize, isize),
    b: &[f32],
    b_strides: (isize, isize),
    c: &mut [f32],
    accumulate: bool,
    threads: usize,
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
    let chunk = depth_chunk((m, n, k));
    let rows = rows_per_thread((m, n, k), chunk, threads);
    let a = Strided::new(a, a_strides);
    let b = Strided::new(b, b_strides);
    let part = |row0, c: &mut [f32], threads| {
        in_depth_chunks((row0, n, k), chunk, a, b, c, accumulate, threads)
    };
    let c = &mut c[..m * n];
    if rows == m {
        return part(0, c, threads);
    }
    c.par_chunks_mut(rows * n)
        .enumerate()
        .for_each(|(i, c)| part(i * rows, c, 1));
}

/// `gemm`'s own threading for `threads` threads.
fn gemm_parallelism(threads: usize) -> Parallelism {
    if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    }
}

/// `c` (whole rows of the product from row `row0`) `= (accumulate ? c : 0) + a·b` over those
/// rows, the inner dimension handed over in `chunk`s, on `threads` threads.
fn in_depth_chunks(
    (row0, n, k): (usize, usize, usize),
    chunk: usize,
    a: Strided,
    b: Strided,
    c: &mut [f32],
    accumulate: bool,
    threads: usize,
) {
    let rows = c.len() / n;
    let mut depth = 0;
    while depth < k {
        let len = chunk.min(k - depth);
        let a_chunk = a.from(row0, depth);
        let b_chunk = b.from(depth, 0);
        let read_c = accumulate || depth > 0;
        // SAFETY: the operands address m·k and k·n elements (checked by callers) and their
        // strides describe row-major layouts of exactly those shapes; `c` holds rows
        // `row0..row0 + rows` of the output, and the chunks start at row `row0` and column
        // `depth` of a and row `depth` of b, `rows` and `len` more of which lie inside.
        unsafe {
            if !by_fma_gemm((rows, n, len), a_chunk, b_chunk, c, read_c, threads) {
                gemm::gemm(
                    rows,
                    n,
                    len,
                    c.as_mut_ptr(),
                    1,
                    n as isize,
                    read_c,
                    a_chunk.ptr,
                    a_chunk.col_stride,
                    a_chunk.row_stride,
                    b_chunk.ptr,
                    b_chunk.col_stride,
                    b_chunk.row_stride,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm_parallelism(threads),
                )
            }
        }
        depth += len;
    }
}

/// `c (+)= a·b` for one depth chunk by [`fma_gemm`] on `threads` threads, where the CPU has AVX2
/// and FMA and it takes the product (the same bits as `gemm`'s, faster); false, with nothing
/// done, where it leaves the product to `gemm` (always, off x86-64).
///
/// # Safety
/// The operands address `m × k` and `k × n` readable elements through their strides, and `c`
/// holds `m × n`.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
unsafe fn by_fma_gemm(
    (m, n, k): (usize, usize, usize),
    a: Strided,
    b: Strided,
    c: &mut [f32],
    accumulate: bool,
    threads: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if VectorIsa::detect() == VectorIsa::Avx2Fma && fma_gemm::takes((m, n, k)) {
        // SAFETY: the CPU has AVX2 and FMA and `fma_gemm` takes the product; the caller
        // vouches for the operands and the output.
        unsafe { fma_gemm::product((m, n, k), a, b, c, accumulate, threads) };
        return true;
    }
    false
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

    fn tensor<E: Elem>(dev: &CpuDevice, values: &[f32]) -> Tensor<E> {
        Tensor::from_f32(
            dev.tracker(),
            &[values.len()],
            values,
            Category::Activations,
        )
        .unwrap()
    }

    #[test]
    fn every_layout_matches_a_naive_product() {
        use crate::device::{n, out, t};
        let dev = CpuDevice::new(2, u64::MAX).unwrap();
        let (m, nn, k) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..k * nn).map(|i| (i as f32).sin()).collect();
        let want = naive(m, nn, k, |i, p| a[i * k + p], |p, j| b[p * nn + j]);
        let (ta, tb) = (tensor::<f32>(&dev, &a), tensor::<f32>(&dev, &b));
        let mut c = tensor::<f32>(&dev, &vec![0.0; m * nn]);
        matmul(&dev, (m, nn, k), n(&ta), n(&tb), out(&mut c), false).unwrap();
        assert_close(c.as_slice(), &want);
        // a stored transposed: [k, m]
        let at: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
        let bt: Vec<f32> = (0..nn * k).map(|idx| b[(idx % k) * nn + idx / k]).collect();
        let (tat, tbt) = (tensor::<f32>(&dev, &at), tensor::<f32>(&dev, &bt));
        let mut c2 = tensor::<f32>(&dev, &vec![1.0; m * nn]);
        matmul(&dev, (m, nn, k), t(&tat), t(&tbt), out(&mut c2), true).unwrap();
        let want2: Vec<f32> = want.iter().map(|x| x + 1.0).collect();
        assert_close(c2.as_slice(), &want2);
        // a block of rows from an offset: the last two rows of a
        let mut c3 = tensor::<f32>(&dev, &vec![0.0; 2 * nn]);
        matmul(
            &dev,
            (2, nn, k),
            n(&ta).at(3 * k),
            n(&tb),
            out(&mut c3),
            false,
        )
        .unwrap();
        assert_close(c3.as_slice(), &want[3 * nn..]);
        // bf16 operands and output go through workspace, which is returned afterwards
        let ab = tensor::<bf16>(&dev, &a);
        let mut cb = tensor::<bf16>(&dev, &vec![0.0; m * nn]);
        matmul(&dev, (m, nn, k), n(&ab), n(&tb), out(&mut cb), false).unwrap();
        for (g, w) in cb.to_f32_vec().iter().zip(&want) {
            assert!((g - w).abs() <= 0.02 * w.abs().max(1.0), "{g} vs {w}");
        }
        let stats = dev.tracker().stats();
        assert_eq!(stats.current.workspace, 0);
        assert_eq!(
            stats.peak_by_category.workspace,
            ((m * k + m * nn) * 4) as u64
        );
    }

    #[test]
    fn deep_products_are_handed_over_in_chunks_and_match_a_naive_product() {
        use crate::device::{n, out, t};
        let (m, nn, k) = (70, 66, 1300);
        let chunk = depth_chunk((m, nn, k));
        assert!(chunk < k && chunk <= DEPTH_BLOCK, "{chunk}");
        assert_eq!(k.div_ceil(chunk), k.div_ceil(DEPTH_BLOCK));
        assert_eq!(depth_chunk((64, 64, k)), k, "gemm's own blocking there");
        assert_eq!(depth_chunk((m, nn, DEPTH_BLOCK)), DEPTH_BLOCK);
        let dev = CpuDevice::new(2, u64::MAX).unwrap();
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
            .collect();
        let b: Vec<f32> = (0..k * nn)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let want = naive(m, nn, k, |i, p| a[i * k + p], |p, j| b[p * nn + j]);
        let at: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
        let bt: Vec<f32> = (0..nn * k).map(|idx| b[(idx % k) * nn + idx / k]).collect();
        let (ta, tb) = (tensor::<f32>(&dev, &a), tensor::<f32>(&dev, &b));
        let (tat, tbt) = (tensor::<f32>(&dev, &at), tensor::<f32>(&dev, &bt));
        for (transposed_a, transposed_b) in
            [(false, false), (true, false), (false, true), (true, true)]
        {
            let ua = if transposed_a { t(&tat) } else { n(&ta) };
            let ub = if transposed_b { t(&tbt) } else { n(&tb) };
            let mut c = tensor::<f32>(&dev, &vec![1.0; m * nn]);
            matmul(&dev, (m, nn, k), ua, ub, out(&mut c), true).unwrap();
            let plus_one: Vec<f32> = want.iter().map(|x| x + 1.0).collect();
            assert_close(c.as_slice(), &plus_one);
        }
    }

    #[test]
    fn deep_products_shared_by_rows_among_threads_have_the_bits_of_one_thread() {
        assert_eq!(rows_per_thread((256, 256, 2048), 512, 2), 128);
        assert_eq!(rows_per_thread((130, 66, 1300), 434, 2), 80);
        assert_eq!(rows_per_thread((256, 256, 512), 512, 2), 256, "one chunk");
        assert_eq!(rows_per_thread((256, 16, 2048), 512, 2), 256, "16 columns");
        assert_eq!(
            rows_per_thread((34, 66, 2048), 512, 2),
            34,
            "a 2-row last part"
        );
        assert_eq!(rows_per_thread((256, 256, 2048), 512, 1), 256, "one thread");
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        let value = |i: usize| ((i * 7919 % 1009) as f32 - 504.0) / 97.0;
        for (m, n, k) in [
            (130, 66, 1300),
            (64, 17, 1025),
            (33, 40, 700),
            (200, 24, 2048),
        ] {
            let a: Vec<f32> = (0..m * k).map(value).collect();
            let b: Vec<f32> = (0..k * n).map(|i| value(i + 3)).collect();
            for (a_strides, b_strides) in [
                ((k as isize, 1), (n as isize, 1)),
                ((1, m as isize), (n as isize, 1)),
                ((k as isize, 1), (1, k as isize)),
                ((1, m as isize), (1, k as isize)),
            ] {
                let product = |threads| {
                    let mut c: Vec<f32> = (0..m * n).map(|i| value(i + 5)).collect();
                    pool.install(|| {
                        gemm_f32(
                            (m, n, k),
                            &a,
                            a_strides,
                            &b,
                            b_strides,
                            &mut c,
                            true,
                            threads,
                        )
                    });
                    c.into_iter().map(f32::to_bits).collect::<Vec<_>>()
                };
                let one = product(1);
                for threads in [2, 3, 4] {
                    assert!(
                        one == product(threads),
                        "[{m}, {k}] · [{k}, {n}], strides {a_strides:?} {b_strides:?}, {threads} threads"
                    );
                }
            }
        }
    }

    fn assert_close(a: &[f32], b: &[f32]) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "{x} vs {y}");
        }
    }
}
