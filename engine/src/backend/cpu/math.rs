//! Branch-free f32 math that the compiler vectorises: `exp`, and sums, maxima and dot products
//! over fixed lanes (any element type, computed in f32), and conversions between element types.
//! Every function gives the same bits for the same inputs on every thread count: lanes are
//! combined in one fixed order. [`vectorized!`] compiles a kernel's loops for the widest vector
//! instructions the CPU has.

use super::CpuDevice;
use crate::tensor::Elem;
use rayon::prelude::*;

/// `vectorized!(isa, expr)`: evaluates `expr` compiled for the vector instructions `isa` names
/// ([`run_vectorized`] with `expr` in an `#[inline(always)]` closure).
macro_rules! vectorized {
    ($isa:expr, $body:expr) => {
        $crate::backend::cpu::math::run_vectorized(
            $isa,
            #[inline(always)]
            || $body,
        )
    };
}
pub(crate) use vectorized;

/// The vector instructions the CPU's kernels run with: `gemm`'s matrix kernels pick the widest
/// this CPU has ([`VectorIsa::detect`]), the engine's own loops run with their device's
/// ([`super::CpuDevice::vector_isa`]). Ordered from the narrowest.
///
/// The engine's loops give the same bits in each: Rust neither fuses a multiply and an add into
/// one FMA nor reorders floating-point operations, so every instruction set computes the same
/// operations in the same order, only more lanes at a time. Only which NaN an operation on two
/// NaNs returns (its sign and payload) may differ, as the compiler may swap the operands of a
/// commutative operation; Rust leaves it unspecified.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum VectorIsa {
    /// What the engine is built for: its target's baseline (on x86-64, 4-lane SSE2).
    Baseline,
    /// AVX2 with FMA.
    Avx2Fma,
    /// AVX-512 (foundation, byte and word, doubleword and quadword, vector length): only with the
    /// `avx512` feature, which builds `gemm`'s AVX-512 kernels.
    Avx512,
}

impl VectorIsa {
    /// The widest this CPU has, as this build uses it.
    pub fn detect() -> Self {
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        {
            if cfg!(feature = "avx512") && std::arch::is_x86_feature_detected!("avx512f") {
                return Self::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Self::Avx2Fma;
            }
        }
        Self::Baseline
    }
}

/// Runs `f` compiled for the vector instructions `isa` names, which the CPU must have (a
/// [`VectorIsa::detect`] or narrower). The engine is built for its target's baseline, so
/// without this its element-wise loops vectorise 4 lanes wide on x86-64.
///
/// Only what is inlined into the dispatching function is compiled for its instructions: `f` must
/// be `#[inline(always)]` ([`vectorized!`] makes it so), and so must every function it calls for
/// its loops (the math here is).
///
/// The bits are the same on every path ([`VectorIsa`]).
#[inline(always)]
pub(crate) fn run_vectorized<R>(isa: VectorIsa, f: impl FnOnce() -> R) -> R {
    debug_assert!(
        isa <= VectorIsa::detect(),
        "{isa:?} is wider than this CPU's"
    );
    match isa {
        // SAFETY: the CPU has the instructions `with_avx512` is compiled for (above).
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        VectorIsa::Avx512 => unsafe { with_avx512(f) },
        // SAFETY: the CPU has the instructions `with_avx2` is compiled for (above).
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        VectorIsa::Avx2Fma => unsafe { with_avx2(f) },
        _ => f(),
    }
}

/// `f()` compiled for AVX-512 ([`VectorIsa::Avx512`]).
///
/// # Safety
/// The CPU must have those instructions.
#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
unsafe fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// `f()` compiled for AVX2 and FMA.
///
/// # Safety
/// The CPU must have those instructions.
#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
#[target_feature(enable = "avx2,fma")]
unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Lanes of the partial sums and maxima.
const LANES: usize = 8;

/// `e^x` to within 2 ulp for normal results (Cephes' polynomial); 0 below −87.3, +∞ above
/// 88.7, NaN for NaN. Written without branches so loops over it vectorise.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const HI: f32 = 88.722_84;
    const LO: f32 = -87.336_55;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n·LN2_HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5·2²³: adding it rounds to the nearest integer n and leaves n in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(LO, HI);
    let shifted = xc * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2ⁿ built from n's bits: no float-to-int conversion, so the compiler keeps it in vectors.
    let biased = shifted
        .to_bits()
        .wrapping_sub(ROUND.to_bits())
        .wrapping_add(127);
    let scale = f32::from_bits(biased << 23);
    let result = (y * scale).to_bits();
    // Selects as bit masks: the compiler keeps masks in vectors where it may branch on `if`.
    let keep = mask(x >= LO);
    let nan = mask(x.is_nan());
    f32::from_bits((nan & x.to_bits()) | (!nan & keep & result))
}

/// All ones when `b`, else zero.
#[inline(always)]
fn mask(b: bool) -> u32 {
    (b as u32).wrapping_neg()
}

/// The logistic function `1 / (1 + e^−x)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// Folds `g(x)` into [`LANES`] lanes with `f` and combines the lanes in order.
#[inline(always)]
fn fold_lanes<E: Elem>(
    x: &[E],
    init: f32,
    g: impl Fn(f32) -> f32,
    f: impl Fn(f32, f32) -> f32,
) -> f32 {
    let mut acc = [init; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a = f(*a, g(v.to_f32()));
        }
    }
    for (a, v) in acc.iter_mut().zip(tail) {
        *a = f(*a, g(v.to_f32()));
    }
    acc.into_iter().fold(init, f)
}

/// `Σ x`, in lanes.
#[inline(always)]
pub fn sum<E: Elem>(x: &[E]) -> f32 {
    fold_lanes(x, 0.0, |v| v, |a, b| a + b)
}

/// `Σ e^(x − shift)`, in lanes.
#[inline(always)]
pub fn sum_exp<E: Elem>(x: &[E], shift: f32) -> f32 {
    fold_lanes(x, 0.0, |v| exp(v - shift), |a, b| a + b)
}

/// `max x` (−∞ for an empty slice).
#[inline(always)]
pub fn max<E: Elem>(x: &[E]) -> f32 {
    fold_lanes(x, f32::NEG_INFINITY, |v| v, f32::max)
}

/// `Σ a·b`, in lanes.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (ca, cb) in ca.zip(cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(ca).zip(cb) {
            *s += x * y;
        }
    }
    for ((s, &x), &y) in acc.iter_mut().zip(ta).zip(tb) {
        *s += x * y;
    }
    acc.into_iter().fold(0.0, |s, v| s + v)
}

/// Threads of a CUDA row block: [`block_dot`] sums in their order.
const BLOCK_THREADS: usize = 256;

/// `Σ a·b` in the order a CUDA block of [`BLOCK_THREADS`] threads sums it: each thread's strided
/// products in turn, then the threads' sums by a halving tree, so both backends give the same
/// bits.
pub fn block_dot<E: Elem>(a: &[E], b: &[E]) -> f32 {
    let mut lanes = [0.0f32; BLOCK_THREADS];
    for (j, (x, y)) in a.iter().zip(b).enumerate() {
        lanes[j % BLOCK_THREADS] += x.to_f32() * y.to_f32();
    }
    let mut width = BLOCK_THREADS / 2;
    while width > 0 {
        let (lo, hi) = lanes.split_at_mut(width);
        for (l, h) in lo.iter_mut().zip(&hi[..width]) {
            *l += *h;
        }
        width /= 2;
    }
    lanes[0]
}

/// `dst[i] = src[i]` converted between element types.
pub(crate) fn convert<S: Elem, D: Elem>(dev: &CpuDevice, src: &[S], dst: &mut [D]) {
    debug_assert_eq!(src.len(), dst.len());
    dev.install(|| {
        dst.par_chunks_mut(4096)
            .zip(src.par_chunks(4096))
            .for_each(|(d, s)| {
                vectorized!(dev.vector_isa(), {
                    for (d, s) in d.iter_mut().zip(s) {
                        *d = D::from_f32(s.to_f32());
                    }
                })
            })
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_the_library() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            let ulp = (want.to_bits() as i64 - got.to_bits() as i64).abs();
            assert!(ulp <= 2, "exp({x}) = {got}, library {want}");
            x += 0.001_37;
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn lane_reductions_match_plain_ones() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.7).sin()).collect();
        let y: Vec<f32> = (0..37).map(|i| (i as f32 * 0.3).cos()).collect();
        let plain_sum: f32 = x.iter().sum();
        let plain_dot: f32 = x.iter().zip(&y).map(|(a, b)| a * b).sum();
        assert!((sum(&x) - plain_sum).abs() < 1e-5);
        assert!((dot(&x, &y) - plain_dot).abs() < 1e-5);
        let plain_sum_exp: f32 = x.iter().map(|v| (v - 0.5).exp()).sum();
        assert!((sum_exp(&x, 0.5) - plain_sum_exp).abs() < 1e-5);
        assert_eq!(max(&x), x.iter().cloned().fold(f32::NEG_INFINITY, f32::max));
        assert_eq!(max::<f32>(&[]), f32::NEG_INFINITY);
        assert_eq!(sum::<f32>(&[]), 0.0);
    }
}
