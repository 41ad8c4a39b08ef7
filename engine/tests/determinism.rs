//! Training is a function of its configuration: two runs give the same bits, whatever the number
//! of threads and the vector instructions the engine's own loops run in, in fp32 and in
//! bf16-mixed precision, with and without dropout.

mod common;

use ckpt_engine::backend::cpu::VectorIsa;
use ckpt_engine::config::{Precision, TrainConfig};
use ckpt_engine::model::Family;
use ckpt_engine::trainer::StepStats;
use ckpt_engine::{CpuDevice, Trainer};

const STEPS: usize = 5;

/// What a run leaves behind, as bits.
struct Run {
    /// Every step's figures.
    stats: Vec<StepStats>,
    /// Each parameter's name and its f32 master weights' bits after the last step.
    params: Vec<(String, Vec<u32>)>,
    /// Both AdamW moments of every parameter, in parameter order.
    moments: Vec<Vec<u32>>,
}

/// A model big enough that the LM head and MLP products pass the threshold above which the
/// matrix-product library splits work across threads (4 rows of 32 tokens, vocab 256, hidden 64).
fn config(precision: Precision, dropout: f32) -> TrainConfig {
    let mut cfg = common::train_config(common::llama(256, 64, 2), precision, 4, 32, STEPS as u64);
    cfg.dropout = dropout;
    cfg
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|x| x.to_bits()).collect()
}

fn run(precision: Precision, dropout: f32, threads: usize) -> Run {
    let dev = CpuDevice::new(threads, u64::MAX).unwrap();
    run_on(dev, config(precision, dropout))
}

fn run_on(dev: CpuDevice, cfg: TrainConfig) -> Run {
    let names = ckpt_engine::model::param_specs(&cfg.model);
    let mut trainer = Trainer::new(cfg, dev).unwrap();
    let stats = (0..STEPS).map(|_| trainer.step().unwrap()).collect();
    let cpu = trainer.state();
    let params = names
        .into_iter()
        .zip(cpu.weights().master().tensors())
        .map(|(spec, t)| (spec.name, bits(t.as_slice())))
        .collect();
    let m = cpu.optimizer().moments().expect("moments after a step");
    let moments = m
        .exp_avg
        .tensors()
        .into_iter()
        .chain(m.exp_avg_sq.tensors())
        .map(|t| bits(t.as_slice()))
        .collect();
    Run {
        stats,
        params,
        moments,
    }
}

/// Per-step (loss, learning rate, gradient norm, tokens), as bits.
fn trajectory(r: &Run) -> Vec<(u32, u64, u64, usize)> {
    r.stats
        .iter()
        .map(|s| {
            (
                s.loss.to_bits(),
                s.lr.to_bits(),
                s.grad_norm.to_bits(),
                s.tokens,
            )
        })
        .collect()
}

/// Asserts two runs ended with the same bits, naming the first parameter and index that differ.
fn assert_same_run(what: &str, a: &Run, b: &Run) {
    assert_eq!(trajectory(a), trajectory(b), "{what}: per-step figures");
    for ((name, x), (_, y)) in a.params.iter().zip(&b.params) {
        if let Some(i) = x.iter().zip(y).position(|(p, q)| p != q) {
            panic!(
                "{what}: {name}[{i}] is {} in one run and {} in the other",
                f32::from_bits(x[i]),
                f32::from_bits(y[i])
            );
        }
    }
    assert!(a.moments == b.moments, "{what}: AdamW moments differ");
}

fn check(precision: Precision) {
    let one = [run(precision, 0.0, 1), run(precision, 0.0, 1)];
    let two = [run(precision, 0.0, 2), run(precision, 0.0, 2)];
    // Same thread count: identical in every figure, memory accounting included.
    assert_eq!(one[0].stats, one[1].stats, "{precision:?}, 1 thread");
    assert_eq!(two[0].stats, two[1].stats, "{precision:?}, 2 threads");
    assert_same_run(&format!("{precision:?}, 1 thread"), &one[0], &one[1]);
    assert_same_run(&format!("{precision:?}, 2 threads"), &two[0], &two[1]);
    assert_same_run(&format!("{precision:?}, 1 vs 2 threads"), &one[0], &two[0]);
    // Three threads split the 16 attention units and the products' blocks unevenly.
    let three = run(precision, 0.0, 3);
    assert_same_run(&format!("{precision:?}, 1 vs 3 threads"), &one[0], &three);
    // The run did what it was configured to: varied lengths, clipping, a changing rate.
    let s = &one[0].stats;
    assert!(s.iter().any(|s| s.tokens < 4 * 32), "some rows are padded");
    assert!(s.iter().any(|s| s.grad_norm > 1.0), "clipping was active");
    assert!(s[0].lr < s[1].lr && s[4].lr < s[2].lr, "warmup then decay");
    assert!(s[4].loss < s[0].loss, "the weights moved: {s:?}");
}

#[test]
fn fp32_training_is_bitwise_reproducible_across_runs_and_thread_counts() {
    check(Precision::Fp32);
}

#[test]
fn bf16_mixed_training_is_bitwise_reproducible_across_runs_and_thread_counts() {
    check(Precision::Bf16Mixed);
}

/// Dropout masks are a function of the step, not of how threads split the elements.
#[test]
fn dropout_masks_do_not_depend_on_the_thread_count() {
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        let one = run(precision, 0.1, 1);
        let three = run(precision, 0.1, 3);
        assert_same_run(
            &format!("{precision:?} with dropout, 1 vs 3 threads"),
            &one,
            &three,
        );
        let plain = run(precision, 0.0, 1);
        assert_ne!(trajectory(&one), trajectory(&plain), "dropout acts");
    }
}

/// The engine's own loops (everything but the matrix products) give the same bits in every
/// vector instruction set they run in: the CPU's widest, AVX2 with FMA, and the build's baseline
/// (4-lane SSE2 on x86-64), with dropout, in fp32 and bf16-mixed, on dense models (Llama, Qwen2's
/// biases) and a mixture of experts (Qwen3-MoE, its heads' norms too). Where the CPU has neither
/// AVX-512 nor AVX2, all three run the baseline.
#[test]
fn the_engine_loops_give_the_same_bits_in_every_vector_instruction_set() {
    let moe = {
        let mut cfg = config(Precision::Fp32, 0.1);
        cfg.model = common::qwen3_moe(cfg.model, 64);
        cfg
    };
    let qwen2 = {
        let mut cfg = config(Precision::Bf16Mixed, 0.1);
        cfg.model.family = Family::Qwen2;
        cfg
    };
    let configs = [
        ("fp32 Llama", config(Precision::Fp32, 0.1)),
        ("bf16-mixed Qwen2", qwen2),
        ("fp32 Qwen3-MoE", moe),
    ];
    for (what, cfg) in configs {
        let widest = CpuDevice::new(2, u64::MAX).unwrap();
        let isa = widest.vector_isa();
        let reference = run_on(widest, cfg.clone());
        for narrower in [VectorIsa::Avx2Fma, VectorIsa::Baseline] {
            let dev = CpuDevice::new(2, u64::MAX)
                .unwrap()
                .limit_vector_isa(narrower);
            let limited = dev.vector_isa();
            assert!(
                limited <= narrower,
                "{limited:?} is wider than {narrower:?}"
            );
            let run = run_on(dev, cfg.clone());
            assert_same_run(&format!("{what}, {isa:?} vs {limited:?}"), &reference, &run);
        }
    }
}
