//! bf16 products through the CPU's bf16 dot-product instruction (AVX-512 BF16's `vdpbf16ps`),
//! chosen with `CKPT_CPU_BF16_PRODUCTS=dot`.
//!
//! The instruction multiplies two pairs of bf16 values and adds both products to an f32
//! accumulator, twice the products per instruction of an f32 FMA and no widened copy of the
//! operands: as Intel's manual describes it, the high element's product first, then the low one's,
//! each addition rounded to f32 (a trial checks the CPU against that, so a run's bits do not depend
//! on who made the CPU where it passes). Each output sums its inner dimension pair by pair, in
//! increasing order, in one accumulator: a fixed order that neither the thread count nor the caches
//! change. It is not the order of the widened products (`gemm`'s), and the instruction treats
//! subnormal inputs and results as zero, so a run's bits depend on the choice, which the execution
//! record names (`x86_64 avx512f avx512_bf16`).
//!
//! The operands are packed into the product's workspace, the same buffers the widened product
//! takes, so the memory a step uses does not depend on the choice: `a` as `[m, ⌈k/2⌉]` pairs
//! in micro-panels of `MR` rows (each pair of a panel's rows together), `b` as `⌈k/2⌉` rows
//! of pairs in panels of `NR` columns, each panel's rows contiguous, the last panels as
//! small as the rows and columns left.

use crate::error::{EngineError, Result};
use half::bf16;
use rayon::prelude::*;

/// The environment variable choosing how the CPU multiplies bf16 operands.
pub const PRODUCTS_VAR: &str = "CKPT_CPU_BF16_PRODUCTS";

/// How the CPU multiplies two bf16 operands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bf16Products {
    /// Widened to f32 and multiplied by the f32 kernels: the same bits on every CPU of one
    /// instruction set (the default).
    #[default]
    Widened,
    /// The bf16 dot-product instruction, on CPUs with AVX-512 BF16 in builds with the AVX-512
    /// kernels.
    Dot,
}

impl Bf16Products {
    /// The choice `CKPT_CPU_BF16_PRODUCTS` makes: unset or `widened`, or `dot`, which this CPU
    /// must be able to run.
    pub fn from_env() -> Result<Self> {
        let choice = match std::env::var(PRODUCTS_VAR).as_deref() {
            Err(std::env::VarError::NotPresent) | Ok("widened") => Bf16Products::Widened,
            Ok("dot") => Bf16Products::Dot,
            Ok(other) => {
                return Err(EngineError::Config(format!(
                    "{PRODUCTS_VAR} is `{other}`; set it to `widened` (the default) or `dot`, or unset it"
                )))
            }
            Err(e) => return Err(EngineError::Config(format!("{PRODUCTS_VAR}: {e}"))),
        };
        choice.check()?;
        Ok(choice)
    }

    /// Refuses [`Bf16Products::Dot`] where this build or CPU cannot run it.
    pub fn check(self) -> Result<()> {
        if self == Bf16Products::Dot && !available() {
            return Err(EngineError::Config(format!(
                "{PRODUCTS_VAR}=dot needs a CPU with AVX-512 BF16 and a build with the `avx512` \
                 feature (the default); this {}; unset {PRODUCTS_VAR} to multiply bf16 widened to f32",
                if cfg!(feature = "avx512") {
                    "CPU has no AVX-512 BF16"
                } else {
                    "build has no AVX-512 kernels"
                }
            )));
        }
        Ok(())
    }
}

/// Whether this build and CPU run the bf16 dot-product instruction.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        cfg!(feature = "avx512")
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Columns a tile computes: two vectors of 16 f32 accumulators.
const NR: usize = 32;
/// Rows a tile computes: 8 × 2 accumulators, the vectors of `b` and a broadcast of `a` stay in
/// the 32 vector registers.
const MR: usize = 8;
/// Rows a task computes: tasks are (panel, block of rows) and each output belongs to one.
const ROWS_PER_TASK: usize = 64;
/// Pairs of the inner dimension a tile adds before the next tile: 256 rows of a panel, 32 KiB,
/// stay in the first-level cache. The accumulators go to `c` and come back between blocks,
/// exactly, so each output still sums its pairs in order in one f32.
const DEPTH_PAIRS: usize = 256;

/// Two consecutive inner-dimension elements as the instruction reads them: the first in the
/// low half.
fn pair(lo: bf16, hi: bf16) -> u32 {
    u32::from(lo.to_bits()) | (u32::from(hi.to_bits()) << 16)
}

/// A read-only operand `[rows, cols]`: its elements, row-major, or column-major (stored
/// transposed) where the flag says so.
pub(crate) type Stored<'a> = (&'a [bf16], bool);

/// The side of the blocks a transposing pack moves at a time: 16 pairs are a cache line.
const BLOCK: usize = 16;

/// Fills `to`, chunk `p` of `len` pairs from rows `2p` and `2p + 1` of a row-major source
/// `gap` elements a row, `len` elements of each from `start`; past the source's last row, zeros.
fn interleave_rows(data: &[bf16], (start, gap): (usize, usize), to: &mut [u32], len: usize) {
    for (p, at) in to.chunks_exact_mut(len).enumerate() {
        let lo = &data[2 * p * gap + start..][..len];
        match data.get((2 * p + 1) * gap + start..) {
            Some(hi) if hi.len() >= len => {
                for ((v, &lo), &hi) in at.iter_mut().zip(lo).zip(&hi[..len]) {
                    *v = pair(lo, hi);
                }
            }
            _ => {
                for (v, &lo) in at.iter_mut().zip(lo) {
                    *v = pair(lo, bf16::ZERO);
                }
            }
        }
    }
}

/// Hands `put` the pairs `pairs` of `line`, a contiguous run of the inner dimension; an odd
/// line's last pair zero-padded.
fn line_pairs(line: &[bf16], pairs: std::ops::Range<usize>, mut put: impl FnMut(usize, u32)) {
    let whole: &[[bf16; 2]] = bytemuck::cast_slice(&line[..line.len() / 2 * 2]);
    for (p, &[lo, hi]) in whole.iter().enumerate().take(pairs.end).skip(pairs.start) {
        put(p, pair(lo, hi));
    }
    if line.len() % 2 == 1 && pairs.contains(&whole.len()) {
        put(whole.len(), pair(line[line.len() - 1], bf16::ZERO));
    }
}

/// Packs the `lines` lines of an operand, each `k` elements of the inner dimension, into `out`
/// in panels of `width` lines: the panel of lines `l..` starts at `l·⌈k/2⌉` and holds its
/// lines' pair `p` together, at `p·(lines in the panel)`, an odd `k`'s last pair zero-padded;
/// panels in parallel on the calling pool. `contiguous`: each line's elements lie together
/// (stored `[lines, k]`); else the lines interleave (stored `[k, lines]`).
fn pack(
    data: &[bf16],
    contiguous: bool,
    (lines, k): (usize, usize),
    width: usize,
    out: &mut [u32],
) {
    let kp = k.div_ceil(2);
    out[..lines * kp]
        .par_chunks_mut(width * kp)
        .enumerate()
        .for_each(|(q, panel)| {
            let l0 = q * width;
            let width = panel.len() / kp;
            if !contiguous {
                interleave_rows(data, (l0, lines), panel, width);
                return;
            }
            // in blocks of pairs, reading along the stored lines
            for p0 in (0..kp).step_by(BLOCK) {
                for l in 0..width {
                    let line = &data[(l0 + l) * k..][..k];
                    line_pairs(line, p0..kp.min(p0 + BLOCK), |p, v| {
                        panel[p * width + l] = v
                    });
                }
            }
        });
}

/// `c[m, n] = (accumulate ? c : 0) + a · b`, `c` row-major f32, the operands bf16, each
/// row-major or stored transposed, on the calling thread pool; `packed_a` and `packed_b` hold
/// at least `m·⌈k/2⌉` and `⌈k/2⌉·n` words. Only where [`available`].
pub(crate) fn gemm(
    (m, n, k): (usize, usize, usize),
    (a, a_transposed): Stored<'_>,
    (b, b_transposed): Stored<'_>,
    c: &mut [f32],
    accumulate: bool,
    packed_a: &mut [u32],
    packed_b: &mut [u32],
) {
    assert!(available(), "bf16 dot products asked of a CPU without them");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(0.0);
        }
        return;
    }
    let kp = k.div_ceil(2);
    // a's lines are its rows, b's its columns
    pack(a, !a_transposed, (m, k), MR, packed_a);
    pack(b, b_transposed, (n, k), NR, packed_b);
    let (pa, pb) = (&packed_a[..m * kp], &packed_b[..kp * n]);
    let blocks = m.div_ceil(ROWS_PER_TASK);
    let out = super::SharedMut(c.as_mut_ptr());
    (0..n.div_ceil(NR) * blocks)
        .into_par_iter()
        .with_max_len(1)
        .for_each(|task| {
            let (q, block) = (task / blocks, task % blocks);
            let (j0, i0) = (q * NR, block * ROWS_PER_TASK);
            let width = NR.min(n - j0);
            let panel = &pb[j0 * kp..j0 * kp + kp * width];
            let rows_end = m.min(i0 + ROWS_PER_TASK);
            for p0 in (0..kp).step_by(DEPTH_PAIRS) {
                let pairs = DEPTH_PAIRS.min(kp - p0);
                let mut i = i0;
                while i < rows_end {
                    let rows = MR.min(rows_end - i);
                    // SAFETY: `available` holds; the tile reads `pairs` pairs of its `rows` rows
                    // from pair `p0` of the micro-panel of rows `i..` and `pairs` rows of the
                    // panel from row `p0`, and writes rows `i..i + rows`, columns
                    // `j0..j0 + width` of `c` (`m·n`, row-major), which no other task writes.
                    unsafe {
                        tile(
                            rows,
                            &pa[i * kp + p0 * rows..],
                            &panel[p0 * width..],
                            (pairs, width),
                            out.get().add(i * n + j0),
                            n,
                            accumulate || p0 > 0,
                        )
                    }
                    i += rows;
                }
            }
        });
}

/// One tile of `rows` ≤ `MR` rows of `a` (a micro-panel's) and `width` ≤ `NR` columns,
/// `pairs` of its inner dimension.
unsafe fn tile(
    rows: usize,
    pa: &[u32],
    panel: &[u32],
    (pairs, width): (usize, usize),
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    macro_rules! rows {
        ($($r:literal)*) => {
            match rows {
                $($r => x86::tile::<$r>(pa, panel, (pairs, width), c, ldc, accumulate),)*
                _ => unreachable!("a tile has 1 to {MR} rows"),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    rows!(1 2 3 4 5 6 7 8);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, pa, panel, pairs, width, c, ldc, accumulate);
        unreachable!("bf16 dot products run on x86-64 alone, where `available` says so");
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The mask of the first `lanes` (≤ 16) lanes.
    fn lanes(lanes: usize) -> __mmask16 {
        ((1u32 << lanes) - 1) as __mmask16
    }

    /// `R` rows of a tile: `R × 2` vectors of accumulators, from `c` where `accumulate` says
    /// so, each of `pairs` pairs of the inner dimension added in turn.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512 BF16; `pa` holds `pairs` pairs of `R` rows, each
    /// pair's `R` together, `panel` `pairs` rows of `width` (1 to 32), and `c` `R` rows `ldc`
    /// apart of `width` writable floats.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn tile<const R: usize>(
        pa: &[u32],
        panel: &[u32],
        (pairs, width): (usize, usize),
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        let (m0, m1) = (lanes(width.min(16)), lanes(width.saturating_sub(16)));
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        if accumulate {
            for (r, row) in acc.iter_mut().enumerate() {
                let at = c.add(r * ldc);
                row[0] = _mm512_maskz_loadu_ps(m0, at);
                row[1] = _mm512_maskz_loadu_ps(m1, at.add(16));
            }
        }
        let (a, b) = (pa.as_ptr(), panel.as_ptr());
        for p in 0..pairs {
            let row = b.add(p * width) as *const i32;
            let b0: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi32(m0, row));
            let b1: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi32(m1, row.add(16)));
            for (r, out) in acc.iter_mut().enumerate() {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(p * R + r) as i32));
                out[0] = _mm512_dpbf16_ps(out[0], x, b0);
                out[1] = _mm512_dpbf16_ps(out[1], x, b1);
            }
        }
        for (r, row) in acc.iter().enumerate() {
            let at = c.add(r * ldc);
            _mm512_mask_storeu_ps(at, m0, row[0]);
            _mm512_mask_storeu_ps(at.add(16), m1, row[1]);
        }
    }
}
