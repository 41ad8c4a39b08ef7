//! f32 matrix products on CPUs with AVX2 and FMA, with the bits of `gemm`'s blocked path.
//!
//! On its blocked path `gemm` 0.19 sums each output of a product it does not split along the
//! depth from zero, one fused multiply-add at a time in depth order, then adds the sum to the
//! output (or writes it, where the output is not read): its micro-kernels differ in how many
//! outputs they hold in registers, never in that arithmetic. This module computes the same sums
//! with a micro-kernel of its own, 6 rows by 16 columns of the output (twelve 8-lane registers)
//! as in BLIS's Haswell kernel, and blocks the operands for a core's caches: the right operand
//! packed a block of columns at a time into 16-column panels, the left read where it lies when
//! its rows are contiguous and packed into 6-row panels otherwise. So a product has the same
//! bits whichever computes it, and only the time differs.
//!
//! [`takes`] says which products these are (those `gemm` would not hand to its paths for
//! vectors, tiny outputs, a depth of one or two, or split along the depth, less the small ones
//! it computes faster); every other one goes to `gemm`.

use super::strided::Strided;
use std::arch::x86_64::*;

/// Output rows of the micro-kernel.
const MR: usize = 6;
/// Output columns of the micro-kernel: two 8-lane registers.
const NR: usize = 16;
/// The deepest product handed over at once: `gemm` never splits one of at most this depth.
const MAX_DEPTH: usize = 512;
/// Bytes of the right operand's packed block, which every row of the left runs over.
const RIGHT_BLOCK_BYTES: usize = 2 << 20;
/// Rows of the left operand each panel of the right runs down before the next.
const LEFT_BLOCK_ROWS: usize = 8 * MR;

/// Whether this module computes an `[m, k] · [k, n]` product: one `gemm` would put through its
/// blocked path unsplit. `gemm` takes a depth of at most 2 as outer products, a single row or
/// column as a matrix-vector product, at most 256 outputs with dot products across lanes, and
/// splits the depth of any other product only beyond 512, whatever the caches. Of those, the
/// products of at most 64 × 64 outputs (attention's, a query block's) stay with `gemm` too: it
/// computes them faster than this module does.
pub(crate) fn takes((m, n, k): (usize, usize, usize)) -> bool {
    (3..=MAX_DEPTH).contains(&k) && m > 1 && n > 1 && m * n > 256 && (m > 64 || n > 64)
}

/// The output pointer, shared by the threads that write disjoint parts of it.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: each thread writes only its own rows or columns of the output, see `product`.
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

/// `c = (accumulate ? c : 0) + a·b` for `c` row-major `[m, n]`, `a` `[m, k]` and `b` `[k, n]`,
/// the work shared among `threads` (by rows where the output has at least as many rows as
/// columns, else by columns).
///
/// # Safety
/// [`takes`] holds for `(m, n, k)`, the CPU has AVX2 and FMA, `a` and `b` address `m × k` and
/// `k × n` readable elements through their strides, and `c` holds `m × n` elements that nothing
/// else reads or writes meanwhile.
pub(crate) unsafe fn product(
    (m, n, k): (usize, usize, usize),
    a: Strided,
    b: Strided,
    c: &mut [f32],
    accumulate: bool,
    threads: usize,
) {
    debug_assert!(takes((m, n, k)) && c.len() >= m * n);
    let out = Out(c.as_mut_ptr());
    let by_rows = m >= n;
    let (len, unit) = if by_rows { (m, MR) } else { (n, NR) };
    let share = len.div_ceil(threads.max(1)).next_multiple_of(unit);
    let parts = len.div_ceil(share);
    let part = move |t: usize| {
        let (lo, hi) = (t * share, ((t + 1) * share).min(len));
        let out = out;
        // SAFETY: part `t` writes rows (or columns) `lo..hi` of the output alone; its operands'
        // rows (or columns) are among those the caller vouches for.
        unsafe {
            if by_rows {
                block(
                    (hi - lo, n, k),
                    a.from(lo, 0),
                    b,
                    out.0.add(lo * n),
                    n,
                    accumulate,
                );
            } else {
                block(
                    (m, hi - lo, k),
                    a,
                    b.from(0, lo),
                    out.0.add(lo),
                    n,
                    accumulate,
                );
            }
        }
    };
    if parts == 1 {
        part(0);
    } else {
        use rayon::prelude::*;
        (0..parts).into_par_iter().for_each(part);
    }
}

/// One thread's share: `c` (row stride `ldc`) `(+)= a·b` for `[m, k] · [k, n]`.
///
/// BLIS's loops: the right operand packed a block of columns at a time (which stays in the L3
/// cache), and for each [`LEFT_BLOCK_ROWS`] rows of the left operand (which stay in L2) each of
/// the block's 16-column panels (in L1) runs down the rows six at a time.
///
/// # Safety
/// As [`product`], for this share.
unsafe fn block(
    (m, n, k): (usize, usize, usize),
    a: Strided,
    b: Strided,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    let right_cols = (RIGHT_BLOCK_BYTES / (4 * k) / NR * NR).max(NR);
    let mut right = vec![0.0f32; right_cols.min(n.next_multiple_of(NR)) * k];
    let in_place = a.col_stride == 1;
    let mut left = if in_place {
        Vec::new()
    } else {
        vec![0.0f32; LEFT_BLOCK_ROWS * k]
    };
    let mut edge = [0.0f32; MR * NR];
    for j0 in (0..n).step_by(right_cols) {
        let cols = right_cols.min(n - j0);
        pack_right(k, cols, b, j0, &mut right);
        for i0 in (0..m).step_by(LEFT_BLOCK_ROWS) {
            let rows = LEFT_BLOCK_ROWS.min(m - i0);
            if !in_place {
                pack_left(k, rows, a, i0, &mut left);
            }
            for jp in 0..cols.div_ceil(NR) {
                let live_cols = NR.min(cols - jp * NR);
                let panel_b = right.as_ptr().add(jp * NR * k);
                for ip in 0..rows.div_ceil(MR) {
                    let live_rows = MR.min(rows - ip * MR);
                    let panel_a = if in_place {
                        LeftPanel {
                            ptr: a.ptr.offset((i0 + ip * MR) as isize * a.row_stride),
                            row_stride: a.row_stride as usize,
                            depth_stride: 1,
                            live_rows,
                        }
                    } else {
                        LeftPanel {
                            ptr: left.as_ptr().add(ip * MR * k),
                            row_stride: 1,
                            depth_stride: MR,
                            live_rows: MR,
                        }
                    };
                    let dst = c.add((i0 + ip * MR) * ldc + j0 + jp * NR);
                    if live_rows == MR && live_cols == NR {
                        tile(k, panel_a, panel_b, dst, ldc, accumulate);
                    } else {
                        for i in 0..live_rows {
                            for j in 0..live_cols {
                                edge[i * NR + j] = *dst.add(i * ldc + j);
                            }
                        }
                        tile(k, panel_a, panel_b, edge.as_mut_ptr(), NR, accumulate);
                        for i in 0..live_rows {
                            for j in 0..live_cols {
                                *dst.add(i * ldc + j) = edge[i * NR + j];
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Six rows of the left operand as the micro-kernel reads them: row `r` (of `live_rows`; the
/// rest repeat the last live one) at depth `p` is at `ptr + r·row_stride + p·depth_stride`.
#[derive(Clone, Copy)]
struct LeftPanel {
    ptr: *const f32,
    row_stride: usize,
    depth_stride: usize,
    live_rows: usize,
}

/// Packs columns `j0..j0 + cols` of `b` (`k` deep) into `ceil(cols / 16)` panels, each `k` rows
/// of 16 contiguous columns, the columns past `cols` zero.
///
/// # Safety
/// `b` addresses those columns through its strides; `out` holds the panels.
unsafe fn pack_right(k: usize, cols: usize, b: Strided, j0: usize, out: &mut [f32]) {
    for jp in 0..cols.div_ceil(NR) {
        let panel = &mut out[jp * NR * k..(jp + 1) * NR * k];
        let first = j0 + jp * NR;
        let live = NR.min(j0 + cols - first);
        if live < NR {
            panel.fill(0.0);
        }
        let col = b.ptr.offset(first as isize * b.col_stride);
        if b.col_stride == 1 {
            for (p, row) in panel.chunks_exact_mut(NR).enumerate() {
                let src = col.offset(p as isize * b.row_stride);
                row[..live].copy_from_slice(std::slice::from_raw_parts(src, live));
            }
        } else {
            for j in 0..live {
                let src = col.offset(j as isize * b.col_stride);
                for p in 0..k {
                    panel[p * NR + j] = *src.offset(p as isize * b.row_stride);
                }
            }
        }
    }
}

/// Packs rows `i0..i0 + rows` of `a` (`k` deep) into `ceil(rows / 6)` panels, each `k` groups of
/// 6 rows' elements, the rows past `rows` repeating the last.
///
/// # Safety
/// `a` addresses those rows through its strides; `out` holds the panels.
unsafe fn pack_left(k: usize, rows: usize, a: Strided, i0: usize, out: &mut [f32]) {
    for ip in 0..rows.div_ceil(MR) {
        let panel = &mut out[ip * MR * k..(ip + 1) * MR * k];
        let first = i0 + ip * MR;
        let live = MR.min(i0 + rows - first);
        for (p, group) in panel.chunks_exact_mut(MR).enumerate() {
            let src = a
                .ptr
                .offset(first as isize * a.row_stride + p as isize * a.col_stride);
            for (r, x) in group.iter_mut().enumerate() {
                *x = *src.offset(r.min(live - 1) as isize * a.row_stride);
            }
        }
    }
}

/// The micro-kernel: `c[0..6][0..16]` (row stride `ldc`) `(+)= Σ_p a[r][p]·b[p][0..16]`, each
/// sum from zero, one fused multiply-add per depth in depth order, then added to `c` (or written
/// where `accumulate` is false).
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` addresses its live rows `k` deep, `b` a packed `k × 16` panel,
/// `c` six rows of 16 writable elements.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile(k: usize, a: LeftPanel, b: *const f32, c: *mut f32, ldc: usize, accumulate: bool) {
    let rows: [*const f32; MR] =
        std::array::from_fn(|r| a.ptr.add(r.min(a.live_rows - 1) * a.row_stride));
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    for p in 0..k {
        let b0 = _mm256_loadu_ps(b.add(p * NR));
        let b1 = _mm256_loadu_ps(b.add(p * NR + 8));
        let q = p * a.depth_stride;
        for r in 0..MR {
            let x = _mm256_broadcast_ss(&*rows[r].add(q));
            acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
        }
    }
    for (r, [lo, hi]) in acc.into_iter().enumerate() {
        let dst = c.add(r * ldc);
        if accumulate {
            _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), lo));
            _mm256_storeu_ps(dst.add(8), _mm256_add_ps(_mm256_loadu_ps(dst.add(8)), hi));
        } else {
            _mm256_storeu_ps(dst, lo);
            _mm256_storeu_ps(dst.add(8), hi);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn has_fma() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    /// Values of a few bits' spread, so that sums round and any change of order shows.
    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed * 104_729) % 1009) as f32 / 97.0 - 5.2)
            .collect()
    }

    /// (row stride, column stride) of a `[rows, cols]` operand stored row-major, or transposed
    /// (stored as `[cols, rows]`).
    fn strides(transposed: bool, rows: usize, cols: usize) -> (isize, isize) {
        if transposed {
            (1, rows as isize)
        } else {
            (cols as isize, 1)
        }
    }

    /// The product's output bits by `gemm` and by this module, from the same `c`: by [`product`]
    /// where it [`takes`] the product, else (to show why it must not) by one thread's [`block`].
    fn both(
        (m, n, k): (usize, usize, usize),
        (at, bt): (bool, bool),
        accumulate: bool,
        threads: usize,
    ) -> (Vec<u32>, Vec<u32>) {
        let (a, b) = (values(m * k, 1), values(k * n, 2));
        let ((ars, acs), (brs, bcs)) = (strides(at, m, k), strides(bt, k, n));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut by_gemm = values(m * n, 3);
        let mut by_module = by_gemm.clone();
        // SAFETY: the strides describe `a` and `b` as stored, the outputs hold m × n elements,
        // the callers check that the CPU has AVX2 and FMA, and `product` runs only where `takes`
        // holds.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                by_gemm.as_mut_ptr(),
                1,
                n as isize,
                accumulate,
                a.as_ptr(),
                acs,
                ars,
                b.as_ptr(),
                bcs,
                brs,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
            let (a, b) = (Strided::new(&a, (ars, acs)), Strided::new(&b, (brs, bcs)));
            if takes((m, n, k)) {
                let c = &mut by_module;
                pool.install(move || product((m, n, k), a, b, c, accumulate, threads));
            } else {
                block((m, n, k), a, b, by_module.as_mut_ptr(), n, accumulate);
            }
        }
        let bits = |c: Vec<f32>| c.into_iter().map(f32::to_bits).collect();
        (bits(by_gemm), bits(by_module))
    }

    #[test]
    fn the_bench_models_products_have_gemms_bits() {
        if !has_fma() {
            return;
        }
        let t = 2048;
        for (i, o) in [(256, 256), (256, 128), (256, 688), (688, 256)] {
            for (shape, layout) in [
                ((t, o, i.min(MAX_DEPTH)), (false, true)),
                ((t, i, o.min(MAX_DEPTH)), (false, false)),
                ((o, i, MAX_DEPTH), (true, false)),
            ] {
                for (accumulate, threads) in [(false, 1), (true, 2)] {
                    assert!(takes(shape), "{shape:?}");
                    let (want, got) = both(shape, layout, accumulate, threads);
                    assert!(want == got, "{shape:?} {layout:?} {accumulate}");
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn every_product_it_takes_has_gemms_bits(
            m in 2usize..200,
            n in 2usize..200,
            k in 3usize..=MAX_DEPTH,
            at: bool,
            bt: bool,
            accumulate: bool,
            threads in 1usize..4,
        ) {
            prop_assume!(has_fma() && takes((m, n, k)));
            let (want, got) = both((m, n, k), (at, bt), accumulate, threads);
            prop_assert!(want == got);
        }
    }

    #[test]
    fn gemm_sums_the_products_it_is_not_given_in_another_order() {
        if !has_fma() {
            return;
        }
        // 16 × 16 outputs with both operands contiguous along the depth: `gemm` sums them with
        // dot products across lanes, so `takes` must leave them (and the tiny and deep ones) to it.
        let shape = (16, 16, 300);
        assert!(!takes(shape));
        assert!(!takes((64, 64, 600)) && !takes((1, 500, 40)) && !takes((300, 300, 2)));
        assert!(!takes((100, 1, 40)) && !takes((100, 100, MAX_DEPTH + 1)));
        assert!(takes((65, 4, 40)) && takes((2, 500, 40)) && takes((100, 100, MAX_DEPTH)));
        let (by_gemm, by_module) = both(shape, (false, true), false, 1);
        let differ = by_gemm
            .iter()
            .zip(&by_module)
            .filter(|(x, y)| x != y)
            .count();
        assert!(differ > 0, "no output of 256 differs");
    }
}
