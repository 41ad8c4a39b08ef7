//! The CPU's bf16 products through the bf16 dot-product instruction (`CKPT_CPU_BF16_PRODUCTS=dot`):
//! the instruction against Intel's manual; each output against the instruction applied pair by pair
//! in increasing order, whatever the operands' layout, the thread count and the shape's edges; near
//! the widened products; a bf16-mixed run on it resuming bit for bit and recording it. Trials that
//! need AVX-512 BF16 are listed as ignored where this CPU or build has none, so test runners report
//! them as skipped; the refusal there is a trial of its own.

mod common;

use ckpt_engine::backend::cpu::bf16_dot::{self, Bf16Products};
use ckpt_engine::backend::cpu::matmul;
use ckpt_engine::config::Precision;
use ckpt_engine::device::{n, out, t, Operand};
use ckpt_engine::memory::Category;
use ckpt_engine::tensor::Tensor;
use ckpt_engine::{CpuDevice, Device, Trainer};
use half::bf16;
use libtest_mimic::{Arguments, Failed, Trial};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

type Outcome = Result<(), Failed>;

fn main() {
    let args = Arguments::from_args();
    let missing = !bf16_dot::available();
    if missing {
        eprintln!("bf16 dot-product trials are ignored: this CPU or build has no AVX-512 BF16");
    }
    let needs_dot =
        |name: &str, f: fn() -> Outcome| Trial::test(name, f).with_ignored_flag(missing);
    let trials = vec![
        needs_dot(
            "every_layout_and_edge_matches_the_instruction_pair_by_pair",
            every_layout_and_edge,
        ),
        needs_dot(
            "random_products_match_the_instruction_pair_by_pair",
            random_products,
        ),
        needs_dot(
            "the_instruction_adds_the_high_product_then_the_low_one_rounding_each_as_documented",
            as_documented,
        ),
        needs_dot(
            "dot_products_stay_near_the_widened_ones_in_the_same_workspace",
            near_the_widened,
        ),
        needs_dot(
            "a_bf16_run_on_dot_products_resumes_bit_for_bit_and_records_them",
            a_run_resumes,
        ),
        Trial::test(
            "dot_products_are_refused_exactly_where_the_cpu_cannot_run_them",
            refused_where_missing,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

fn dot_device(threads: usize) -> CpuDevice {
    CpuDevice::new(threads, u64::MAX)
        .unwrap()
        .with_bf16_products(Bf16Products::Dot)
        .unwrap()
}

/// Two consecutive inner-dimension elements as the instruction reads them: the first low.
fn pair(lo: bf16, hi: bf16) -> u32 {
    u32::from(lo.to_bits()) | (u32::from(hi.to_bits()) << 16)
}

/// `acc` after one `vdpbf16ps` of the pairs `x` and `y`, on one lane.
fn dot_step(acc: f32, x: u32, y: u32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx512f,avx512bf16")]
        unsafe fn step(acc: f32, x: u32, y: u32) -> f32 {
            let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(x as i32));
            let y: __m512bh = std::mem::transmute(_mm512_set1_epi32(y as i32));
            _mm512_cvtss_f32(_mm512_dpbf16_ps(_mm512_set1_ps(acc), x, y))
        }
        assert!(bf16_dot::available());
        // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (asserted above).
        unsafe { step(acc, x, y) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no bf16 dot products off x86-64 ({acc}, {x}, {y})")
}

/// The products of the pairs `x` and `y`: their high (odd) elements' and their low (even) ones',
/// exact in f32 where they lie in its normal range.
fn pair_products(x: u32, y: u32) -> (f32, f32) {
    let element = |pair: u32, half: u32| f32::from_bits((pair >> half) << 16);
    (
        element(x, 16) * element(y, 16),
        element(x, 0) * element(y, 0),
    )
}

/// `acc` after one `vdpbf16ps` as Intel's manual describes it: the high elements' product added
/// first, then the low ones', each addition rounded to nearest even. Exact for operands and sums
/// in f32's normal range, where the instruction's treatment of subnormals never applies.
fn documented_step(acc: f32, x: u32, y: u32) -> f32 {
    let (high, low) = pair_products(x, y);
    (acc + high) + low
}

/// A pair of bf16 values of either sign, their exponents drawn from `lowest..lowest + span`
/// (biased), from the generator `s`.
fn normal_pair(s: &mut u64, lowest: u64, span: u64) -> u32 {
    let mut half = || {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        let (sign, exponent, mantissa) = (*s & 1, lowest + (*s >> 1) % span, (*s >> 20) & 0x7f);
        (sign << 15 | exponent << 7 | mantissa) as u32
    };
    half() | half() << 16
}

/// A product to compute: `[m, k] · [k, n]`, each operand stored transposed or not, added to a
/// `c` of ones or not.
#[derive(Clone, Copy, Debug)]
struct Case {
    m: usize,
    n: usize,
    k: usize,
    a_transposed: bool,
    b_transposed: bool,
    accumulate: bool,
    seed: u64,
}

/// Values of many magnitudes and both signs, from `seed`.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let mantissa = (s % 2001) as f32 / 1000.0 - 1.0;
            mantissa * 2f32.powi((s >> 20) as i32 % 9 - 4)
        })
        .collect()
}

/// The operands as row-major `[m, k]` and `[k, n]` values, rounded to bf16.
fn operands(c: &Case) -> (Vec<bf16>, Vec<bf16>) {
    let round = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    (
        round(values(c.m * c.k, c.seed)),
        round(values(c.k * c.n, c.seed + 1)),
    )
}

/// The product the instruction gives applied to each output's pairs in increasing order, from
/// `c0` (or zero).
fn reference(c: &Case, a: &[bf16], b: &[bf16], c0: f32) -> Vec<f32> {
    // an odd inner dimension's last pair is padded with zero
    let a_at = |i: usize, q: usize| if q < c.k { a[i * c.k + q] } else { bf16::ZERO };
    let b_at = |q: usize, j: usize| if q < c.k { b[q * c.n + j] } else { bf16::ZERO };
    let mut out = vec![0.0; c.m * c.n];
    for i in 0..c.m {
        for j in 0..c.n {
            let mut acc = if c.accumulate { c0 } else { 0.0 };
            for p in (0..c.k).step_by(2) {
                let x = pair(a_at(i, p), a_at(i, p + 1));
                acc = dot_step(acc, x, pair(b_at(p, j), b_at(p + 1, j)));
            }
            out[i * c.n + j] = acc;
        }
    }
    out
}

/// `v` (`[rows, cols]`) stored transposed when `transposed`, as a tensor on `dev`.
fn stored(
    dev: &CpuDevice,
    v: &[bf16],
    (rows, cols): (usize, usize),
    transposed: bool,
) -> Tensor<bf16> {
    let data: Vec<f32> = if transposed {
        (0..rows * cols)
            .map(|idx| v[(idx % rows) * cols + idx / rows].to_f32())
            .collect()
    } else {
        v.iter().map(|x| x.to_f32()).collect()
    };
    Tensor::from_f32(dev.tracker(), &[data.len()], &data, Category::Activations).unwrap()
}

fn operand(tensor: &Tensor<bf16>, transposed: bool) -> Operand<'_, Tensor<bf16>> {
    if transposed {
        t(tensor)
    } else {
        n(tensor)
    }
}

/// The product of `case` on `dev`, into an f32 output of ones or zeros.
fn product(dev: &CpuDevice, case: &Case, a: &[bf16], b: &[bf16]) -> Vec<f32> {
    let ta = stored(dev, a, (case.m, case.k), case.a_transposed);
    let tb = stored(dev, b, (case.k, case.n), case.b_transposed);
    let c0 = if case.accumulate { 1.0 } else { 0.0 };
    let mut c = Tensor::<f32>::from_f32(
        dev.tracker(),
        &[case.m * case.n],
        &vec![c0; case.m * case.n],
        Category::Activations,
    )
    .unwrap();
    dev.matmul(
        (case.m, case.n, case.k),
        operand(&ta, case.a_transposed),
        operand(&tb, case.b_transposed),
        out(&mut c),
        case.accumulate,
    )
    .unwrap();
    c.as_slice().to_vec()
}

/// Checks `case` bit for bit against the reference, on devices of 1 and 3 threads.
fn check(case: &Case) -> Result<(), String> {
    let (a, b) = operands(case);
    let want = reference(case, &a, &b, 1.0);
    for threads in [1, 3] {
        let got = product(&dot_device(threads), case, &a, &b);
        if let Some(at) = (0..want.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            return Err(format!(
                "{case:?} on {threads} threads: output {at} (row {}, column {}) is {:e}, the \
                 instruction pair by pair gives {:e}",
                at / case.n,
                at % case.n,
                got[at],
                want[at]
            ));
        }
    }
    Ok(())
}

fn every_layout_and_edge() -> Outcome {
    let shapes = [
        (1, 1, 1),
        (1, 1, 2),
        (3, 5, 2),
        (8, 32, 7),
        (9, 33, 17),
        (17, 16, 64),
        (65, 100, 3),
        (70, 66, 301),
        (130, 31, 40),
        (4, 6, 0),
    ];
    let mut seed = 1;
    for (m, n, k) in shapes {
        for layout in 0..8 {
            seed += 2;
            check(&Case {
                m,
                n,
                k,
                a_transposed: layout & 1 != 0,
                b_transposed: layout & 2 != 0,
                accumulate: layout & 4 != 0,
                seed,
            })?;
        }
    }
    Ok(())
}

fn random_products() -> Outcome {
    let case = (
        1usize..40,
        1usize..80,
        0usize..70,
        any::<[bool; 3]>(),
        any::<u64>(),
    )
        .prop_map(
            |(m, n, k, [a_transposed, b_transposed, accumulate], seed)| Case {
                m,
                n,
                k,
                a_transposed,
                b_transposed,
                accumulate,
                seed,
            },
        );
    let mut runner = TestRunner::new(Config {
        cases: 48,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&case, |c| check(&c).map_err(TestCaseError::fail))
        .map_err(|e| Failed::from(e.to_string()))
}

/// The instruction against [`documented_step`] on many steps whose values lie in f32's normal
/// range: exponents 2⁻²⁷ to 2²³ (half of them 2⁻⁷ to 2⁸, where sums cancel most), so products
/// and sums stay normal. Where every CPU with AVX-512 BF16 passes, a run on dot products has the
/// same bits on all of them, whoever made the CPU. The samples must also tell the documented
/// order from the low product first and from one rounding of both products, or the trial could
/// not see either.
fn as_documented() -> Outcome {
    let mut s = 0x2545_f491_4f6c_dd1d_u64;
    let (mut low_first_differs, mut fused_differs) = (0, 0);
    for i in 0..400_000 {
        let (lowest, span) = if i % 2 == 0 { (100, 51) } else { (120, 16) };
        let (x, y) = (
            normal_pair(&mut s, lowest, span),
            normal_pair(&mut s, lowest, span),
        );
        // a normal f32: a normal bf16 in the high half, any low mantissa bits
        let acc = f32::from_bits(normal_pair(&mut s, lowest, span));
        let (got, want) = (dot_step(acc, x, y), documented_step(acc, x, y));
        if got.to_bits() != want.to_bits() {
            return Err(format!(
                "vdpbf16ps on accumulator {acc:e} ({:#010x}) and pairs {x:#010x}, {y:#010x} gives \
                 {got:e}, not {want:e} as the manual's order (high product first, each addition \
                 rounded) gives: dot-product runs on this CPU do not have the bits of other CPUs \
                 with AVX-512 BF16",
                acc.to_bits()
            )
            .into());
        }
        let (high, low) = pair_products(x, y);
        low_first_differs += usize::from(((acc + low) + high).to_bits() != got.to_bits());
        // both products added in f64 and rounded to f32 once (near enough to tell it apart)
        let fused = (f64::from(acc) + f64::from(high) + f64::from(low)) as f32;
        fused_differs += usize::from(fused.to_bits() != got.to_bits());
    }
    if low_first_differs == 0 || fused_differs == 0 {
        return Err(format!(
            "the samples cannot tell the documented order from another ({low_first_differs} \
             differ from the low product first, {fused_differs} from one rounding)"
        )
        .into());
    }
    Ok(())
}

fn near_the_widened() -> Outcome {
    let case = Case {
        m: 37,
        n: 45,
        k: 129,
        a_transposed: true,
        b_transposed: false,
        accumulate: false,
        seed: 7,
    };
    let (a, b) = operands(&case);
    let exact: Vec<f64> = (0..case.m * case.n)
        .map(|idx| {
            let (i, j) = (idx / case.n, idx % case.n);
            (0..case.k)
                .map(|p| {
                    f64::from(a[i * case.k + p].to_f32()) * f64::from(b[p * case.n + j].to_f32())
                })
                .sum()
        })
        .collect();
    let scale = exact.iter().fold(0f64, |m, x| m.max(x.abs()));
    let widened_dev = CpuDevice::new(2, u64::MAX).unwrap();
    let dot_dev = dot_device(2);
    let widened = product(&widened_dev, &case, &a, &b);
    let dot = product(&dot_dev, &case, &a, &b);
    for (name, got) in [("widened", &widened), ("dot", &dot)] {
        for (g, e) in got.iter().zip(&exact) {
            if (f64::from(*g) - e).abs() > 1e-5 * scale {
                return Err(format!("{name}: {g:e} against the exact {e:e}").into());
            }
        }
    }
    if widened
        .iter()
        .zip(&dot)
        .all(|(w, d)| w.to_bits() == d.to_bits())
    {
        return Err(
            "the dot products gave the widened products' bits: was the instruction used?".into(),
        );
    }
    let peak = |dev: &CpuDevice| dev.tracker().stats().peak_by_category.workspace;
    if peak(&widened_dev) != peak(&dot_dev) || peak(&dot_dev) == 0 {
        return Err(format!(
            "workspace peak: widened {}, dot {}; the two must take the same workspace",
            peak(&widened_dev),
            peak(&dot_dev)
        )
        .into());
    }
    Ok(())
}

fn a_run_resumes() -> Outcome {
    let cfg = common::train_config(common::llama(64, 32, 2), Precision::Bf16Mixed, 4, 16, 6);
    let losses = |t: &mut Trainer<CpuDevice>, steps: usize| -> Vec<u32> {
        (0..steps)
            .map(|_| t.step().unwrap().loss.to_bits())
            .collect()
    };
    let mut whole = Trainer::new(cfg.clone(), dot_device(2)).unwrap();
    let want = losses(&mut whole, 4);
    let mut widened = Trainer::new(cfg.clone(), CpuDevice::new(2, u64::MAX).unwrap()).unwrap();
    losses(&mut widened, 4);
    if widened.state_digest().unwrap() == whole.state_digest().unwrap() {
        return Err("a bf16-mixed run on dot products ended in the widened run's state".into());
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut first = Trainer::new(cfg.clone(), dot_device(1)).unwrap();
    let mut got = losses(&mut first, 2);
    let ckpt = first.save(tmp.path(), None).unwrap();
    let mut resumed = Trainer::resume(cfg.clone(), dot_device(3), &ckpt).unwrap();
    if !resumed.env_changes().is_empty() {
        return Err(format!("resumed on the same kernels: {:?}", resumed.env_changes()).into());
    }
    got.extend(losses(&mut resumed, 2));
    if got != want || resumed.state_digest().unwrap() != whole.state_digest().unwrap() {
        return Err(format!("resumed losses {got:?} against {want:?}, or another state").into());
    }
    let kernels = matmul::kernels(Bf16Products::Dot);
    if !kernels.ends_with(" avx512_bf16")
        || dot_device(1).execution_env().cpu_kernels != Some(kernels.clone())
    {
        return Err(format!("the record names {kernels}").into());
    }
    let elsewhere = Trainer::resume(cfg, CpuDevice::new(1, u64::MAX).unwrap(), &ckpt).unwrap();
    let changes: Vec<String> = elsewhere
        .env_changes()
        .iter()
        .map(ToString::to_string)
        .collect();
    let noted = format!(
        "cpu_kernels: {kernels} → {}",
        matmul::kernels(Bf16Products::Widened)
    );
    if changes != [noted.clone()] {
        return Err(format!("resumed on widened products: {changes:?}, not [{noted}]").into());
    }
    Ok(())
}

fn refused_where_missing() -> Outcome {
    let asked = CpuDevice::new(1, u64::MAX)
        .unwrap()
        .with_bf16_products(Bf16Products::Dot);
    match (bf16_dot::available(), asked) {
        (true, Ok(dev)) if dev.bf16_products() == Bf16Products::Dot => Ok(()),
        (false, Err(e)) if e.to_string().contains(bf16_dot::PRODUCTS_VAR) => Ok(()),
        (available, other) => Err(format!(
            "AVX-512 BF16 {}: asking for dot products gave {other:?}",
            if available { "present" } else { "absent" }
        )
        .into()),
    }
}
