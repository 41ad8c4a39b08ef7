//! The CPU's fp32 peak as the engine's products could reach it: fused multiply-adds in the
//! vector instructions `gemm`'s kernels use ([`VectorIsa::detect`]), in a loop that touches no
//! memory, on several threads at once. Benchmarks report a step's throughput as a fraction of it.

use super::VectorIsa;
use std::sync::Barrier;
use std::time::Instant;

/// Independent accumulators a thread keeps: more than an FMA's latency times its units, so the
/// loop is bound by the units' throughput alone.
const ACCUMULATORS: usize = 12;

/// Trips of the loop each thread makes a measurement: a few hundredths of a second on a core of
/// 2026.
const TRIPS: usize = 20_000_000;

/// Measurements taken; the fastest is the peak.
const MEASUREMENTS: usize = 3;

/// fp32 GFLOP/s of `threads` threads running fused multiply-adds in the products' vector
/// instructions at once (two floating-point operations each), the best of a few measurements;
/// `None` where those instructions have no fused multiply-add (the build's baseline).
pub fn fp32_peak_gflops(threads: usize) -> Option<f64> {
    let (lanes, fma_loop) = fma_loop()?;
    let threads = threads.max(1);
    let flops = (threads * TRIPS * ACCUMULATORS * lanes * 2) as f64;
    let fastest = (0..MEASUREMENTS)
        .map(|_| slowest_thread_seconds(threads, fma_loop))
        .fold(f64::INFINITY, f64::min);
    Some(flops / fastest / 1e9)
}

/// A loop of fused multiply-adds: `trips` rounds of one on each accumulator.
type FmaLoop = fn(usize) -> f32;

/// The f32 lanes of one fused multiply-add in the instructions [`VectorIsa::detect`] finds and
/// a loop that makes `trips` rounds of one on each accumulator, returning their sum so the work
/// is kept; `None` without one.
fn fma_loop() -> Option<(usize, FmaLoop)> {
    match VectorIsa::detect() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `detect` found AVX-512.
        VectorIsa::Avx512 => Some((16, |trips| unsafe { x86::avx512(trips) })),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `detect` found AVX2 and FMA.
        VectorIsa::Avx2Fma => Some((8, |trips| unsafe { x86::avx2(trips) })),
        _ => None,
    }
}

/// Seconds from a common start until the last of `threads` threads has run `fma_loop`.
fn slowest_thread_seconds(threads: usize, fma_loop: FmaLoop) -> f64 {
    let start = Barrier::new(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    let began = Instant::now();
                    std::hint::black_box(fma_loop(std::hint::black_box(TRIPS)));
                    began.elapsed().as_secs_f64()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("the loop does not panic"))
            .fold(0.0, f64::max)
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::ACCUMULATORS;
    use std::arch::x86_64::*;

    /// The loop in AVX2 and FMA.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2(trips: usize) -> f32 {
        let mut acc = [_mm256_set1_ps(1.0); ACCUMULATORS];
        let (b, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        for _ in 0..trips {
            for a in &mut acc {
                *a = _mm256_fmadd_ps(*a, b, c);
            }
        }
        let mut lanes = [0.0f32; 8];
        let sum = acc
            .iter()
            .fold(_mm256_setzero_ps(), |s, a| _mm256_add_ps(s, *a));
        // SAFETY: `lanes` holds the 8 floats stored.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        lanes.iter().sum()
    }

    /// The loop in AVX-512.
    ///
    /// # Safety
    /// The CPU must have AVX-512 (foundation).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512(trips: usize) -> f32 {
        let mut acc = [_mm512_set1_ps(1.0); ACCUMULATORS];
        let (b, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        for _ in 0..trips {
            for a in &mut acc {
                *a = _mm512_fmadd_ps(*a, b, c);
            }
        }
        _mm512_reduce_add_ps(
            acc.iter()
                .fold(_mm512_setzero_ps(), |s, a| _mm512_add_ps(s, *a)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_what_fma_units_can_do_and_absent_without_them() {
        let Some((lanes, _)) = fma_loop() else {
            assert_eq!(fp32_peak_gflops(1), None);
            return;
        };
        let one = fp32_peak_gflops(1).expect("instructions with a fused multiply-add");
        // A core issues at most two vector FMAs a cycle, and none runs at 6 GHz; a loop that
        // did not run, or a count off by a factor of two, falls outside.
        let most = (lanes * 2 * 2) as f64 * 6.0;
        let least = (lanes * 2) as f64 * 0.5;
        assert!((least..most).contains(&one), "{one} GFLOP/s on one thread");
    }
}
