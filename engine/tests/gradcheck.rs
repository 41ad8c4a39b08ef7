//! The explicit backward pass against finite differences of the loss, on random tiny Llamas:
//! every parameter tensor, grouped-query and plain attention, tied and untied embeddings, ignored
//! labels, packed rows (positions restarting and attention kept within each document), with and
//! without residual dropout (a fixed mask per step). Activation checkpointing
//! and the chunked loss must not change the gradients.

use ckpt_engine::memory::Category;
use ckpt_engine::model::config::MoeConfig;
use ckpt_engine::model::loss::{LossKind, IGNORE_INDEX};
use ckpt_engine::model::{
    param_specs, weights, Batch, Checkpointing, Dropout, Family, LlamaConfig, Model, Params,
    PassConfig, PassOutput,
};
use ckpt_engine::{CpuDevice, Faults, Tensor};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Every family's block.
const FAMILIES: [Family; 7] = Family::ALL;

/// A model shape, a batch for it and a seed for its weights.
#[derive(Clone, Debug)]
struct Case {
    cfg: LlamaConfig,
    batch: Batch,
    seed: u64,
}

/// Shapes: 1-4 query heads with any dividing number of key/value heads, head width 2-6 (4-6
/// where heads are normed), residual
/// width 4-24 (set apart from the heads or derived from them), 1-2 layers, tied or untied
/// embeddings, every family's block (Qwen2's biases, Qwen3's per-head norms, Phi-3's fused
/// projections, Qwen3-MoE's and Mixtral's router, top-k and experts with 1-4 experts and the
/// load-balancing loss), 1-2 rows of 1-5 tokens
/// with about one label in four ignored (at least one counted), half of them packed (documents
/// beginning at about two tokens in five).
fn cases() -> impl Strategy<Value = Case> {
    (1usize..=4)
        .prop_flat_map(|heads| {
            let kv: Vec<usize> = (1..=heads).filter(|k| heads % k == 0).collect();
            (
                Just(heads),
                prop::sample::select(kv),
                prop::sample::select(vec![2usize, 4, 6]),
                prop::option::of(4usize..=12),
                3usize..=24,
                2usize..=12,
                1usize..=2,
                (any::<bool>(), prop::sample::select(FAMILIES.to_vec())),
                (1usize..=2, 1usize..=5),
                any::<u64>(),
                (1usize..=4, 1usize..=4, 2usize..=8, any::<bool>()),
            )
        })
        .prop_flat_map(
            |(
                heads,
                kv,
                head_dim,
                hidden,
                vocab,
                ffn,
                layers,
                (tied, family),
                (batch, seq),
                seed,
                (experts, k, expert_ffn, normalize),
            )| {
                // RMSNorm's 1/rms makes the loss arbitrarily steep where a row's rms nears zero,
                // and random tiny shapes get there: rows narrower than 4 are left out (the
                // residual stream's, and a head's where queries and keys are normed per head),
                // and the epsilon is large enough to bound 1/rms by 10, so that finite
                // differences resolve the loss at every point drawn.
                let head_dim = if family.qk_norm() {
                    head_dim.max(4)
                } else {
                    head_dim
                };
                let derived = heads * head_dim;
                let (hidden, head_dim) = match hidden {
                    None if derived >= 4 => (derived, None),
                    other => (other.unwrap_or(4), Some(head_dim)),
                };
                let cfg = LlamaConfig {
                    head_dim,
                    rms_norm_eps: 1e-2,
                    tie_word_embeddings: tied,
                    max_position_embeddings: 16,
                    family,
                    // A coefficient large enough that the load-balancing loss's gradient shows.
                    moe: family.moe().then(|| MoeConfig {
                        num_experts: experts,
                        num_experts_per_tok: 1 + (k - 1) % experts,
                        moe_intermediate_size: match family {
                            Family::Mixtral => ffn,
                            _ => expert_ffn,
                        },
                        norm_topk_prob: normalize || family == Family::Mixtral,
                        router_aux_loss_coef: 0.5,
                        decoder_sparse_step: 1,
                        mlp_only_layers: vec![],
                    }),
                    ..LlamaConfig::new(vocab, hidden, ffn, layers, heads, kv)
                };
                let rows = batch * seq;
                let label = prop_oneof![3 => 0..vocab as i64, 1 => Just(IGNORE_INDEX)];
                (
                    Just(cfg),
                    prop::collection::vec(0..vocab as u32, rows),
                    prop::collection::vec(label, rows),
                    0..rows,
                    0..vocab as i64,
                    Just((batch, seq, seed)),
                    prop::option::of(prop::collection::vec(prop::bool::weighted(0.4), rows)),
                )
            },
        )
        .prop_map(
            |(cfg, input_ids, mut labels, keep, label, (batch, seq, seed), starts)| {
                labels[keep] = label;
                Case {
                    cfg,
                    batch: Batch {
                        batch,
                        seq,
                        input_ids,
                        labels,
                        positions: starts.map(|starts| packed(&starts, seq)),
                    },
                    seed,
                }
            },
        )
}

/// A packed batch's positions for rows of `seq` tokens where a document begins at each row's
/// first token and at each token `starts` marks.
fn packed(starts: &[bool], seq: usize) -> Vec<u32> {
    let mut positions = Vec::with_capacity(starts.len());
    for (i, &start) in starts.iter().enumerate() {
        let p = match positions.last() {
            Some(&p) if i % seq != 0 && !start => p + 1,
            _ => 0,
        };
        positions.push(p);
    }
    positions
}

/// Weights from N(0, 0.5²) so gradients are far from zero, and norm scales drawn from [0.5, 1.5]
/// so the norms' own gradients are not those of the identity.
fn init(dev: &CpuDevice, case: &Case) -> Params<Tensor<f32>> {
    let mut p =
        weights::init_params(dev.tracker(), &case.cfg, case.seed, 0.5, Category::Params).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    for (spec, t) in param_specs(&case.cfg).iter().zip(p.tensors_mut()) {
        if spec.is_norm {
            t.as_mut_slice()
                .iter_mut()
                .for_each(|x| *x = rng.random_range(0.5..1.5));
        }
    }
    p
}

/// A zeroed f32 gradient for every parameter.
fn zero_grads(dev: &CpuDevice, cfg: &LlamaConfig) -> Params<Tensor<f32>> {
    Params::try_new(cfg, |s| dev.zeros::<f32>(&s.shape, Category::Grads)).unwrap()
}

/// Runs one pass; returns the loss, the gradients and the blocks recomputed.
fn pass(
    dev: &CpuDevice,
    model: &Model<CpuDevice>,
    w: &mut Params<Tensor<f32>>,
    batch: &Batch,
    ckpt: Checkpointing,
    loss: LossKind,
) -> (f32, Vec<Vec<f32>>, usize) {
    pass_with(dev, model, w, batch, ckpt, loss, None)
}

/// [`pass`] with residual dropout.
fn pass_with(
    dev: &CpuDevice,
    model: &Model<CpuDevice>,
    w: &mut Params<Tensor<f32>>,
    batch: &Batch,
    checkpointing: Checkpointing,
    loss: LossKind,
    dropout: Option<Dropout>,
) -> (f32, Vec<Vec<f32>>, usize) {
    let (out, grads) = pass_output(dev, model, w, batch, (checkpointing, loss), dropout);
    (out.loss, grads, out.recomputed_blocks)
}

/// One pass's output and gradients.
fn pass_output(
    dev: &CpuDevice,
    model: &Model<CpuDevice>,
    w: &mut Params<Tensor<f32>>,
    batch: &Batch,
    (checkpointing, loss): (Checkpointing, LossKind),
    dropout: Option<Dropout>,
) -> (PassOutput, Vec<Vec<f32>>) {
    let mut g = zero_grads(dev, model.config());
    let faults = Faults::default();
    let cfg = PassConfig {
        checkpointing,
        loss,
        dropout,
        faults: &faults,
        share: None,
    };
    let (out, kept) = model
        .forward_backward_with(dev, w, &mut g, batch, &cfg)
        .unwrap();
    assert!(kept.is_empty());
    let grads = g.tensors().iter().map(|t| t.to_f32_vec()).collect();
    (out, grads)
}

/// Finite-difference step. The loss is f32, so its rounding (about 1e-6 of its size) divided by
/// the step is the noise floor; the step is as small as that floor allows.
const STEP: f32 = 2e-3;
/// Tolerance `ABS + REL · max(|analytic|, |numeric|) + 2 · |Richardson correction|`, where the
/// correction may be at most `RESOLVED` of the larger derivative (a point where the loss curves
/// more sharply than that over the step is not resolved by finite differences, and fails).
/// Measured over about 1,300 cases of random seeds (30,000 coordinates without dropout, 68,000
/// with; docs/PRECISION.md): the largest error was 0.71 of this tolerance, the largest
/// correction 0.84 of what `RESOLVED` allows, and 7 coordinates needed the correction term.
const ABS: f64 = 1e-3;
const REL: f64 = 5e-3;
const RESOLVED: f64 = 0.25;
/// The cases run: fixed, so that the test's verdict does not depend on the run
/// (`PROPTEST_RNG_SEED` draws others).
const SEED: u64 = 0x6772_6164;
/// Coordinates checked per tensor: the largest analytic gradients, and a few random ones.
const LARGEST: usize = 2;
const RANDOM: usize = 3;

/// Indices of the `LARGEST` biggest |g| and `RANDOM` random others.
fn coordinates(g: &[f32], rng: &mut ChaCha8Rng) -> Vec<usize> {
    let mut by_size: Vec<usize> = (0..g.len()).collect();
    by_size.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()));
    let mut picked: Vec<usize> = by_size.into_iter().take(LARGEST).collect();
    for _ in 0..RANDOM {
        picked.push(rng.random_range(0..g.len()));
    }
    picked.sort_unstable();
    picked.dedup();
    picked
}

/// The derivative of `f` at `x` by Richardson extrapolation of central differences with steps
/// `STEP` and `2·STEP` (error of order STEP⁴), and the size of the extrapolation's correction,
/// which bounds the error where the loss curves sharply.
fn derivative(x: f32, mut f: impl FnMut(f32) -> f64) -> (f64, f64) {
    let mut central = |h: f32| {
        let (hi, lo) = (x + h, x - h);
        (f(hi) - f(lo)) / (hi as f64 - lo as f64)
    };
    let (near, far) = (central(STEP), central(2.0 * STEP));
    let extrapolated = (4.0 * near - far) / 3.0;
    (extrapolated, (extrapolated - near).abs())
}

/// Each block's set of experts for each token (`top_k` of them, in expert order): what the loss
/// is smooth in. Counts per expert are not enough, since two tokens can trade experts.
fn expert_sets(out: &PassOutput, top_k: usize) -> Vec<Vec<u32>> {
    out.experts_chosen
        .iter()
        .map(|block| {
            block
                .chunks(top_k)
                .flat_map(|token| {
                    let mut set = token.to_vec();
                    set.sort_unstable();
                    set
                })
                .collect()
        })
        .collect()
}

/// Checks a sample of coordinates of every parameter tensor against finite differences, with
/// `dropout`'s mask held fixed. A MoE router's top-k choice is a step function: a coordinate
/// whose steps move a token to another expert has no derivative there and is skipped (compared
/// token by token: two tokens trading experts leave the counts as they were).
fn check_gradients(case: &Case, dropout: Option<Dropout>) -> Result<(), TestCaseError> {
    let dev = CpuDevice::new(1, u64::MAX).unwrap();
    let model = Model::new(&dev, case.cfg.clone()).unwrap();
    let mut w = init(&dev, case);
    let plain = (Checkpointing::None, LossKind::Standard);
    let (base, analytic) = pass_output(&dev, &model, &mut w, &case.batch, plain, dropout);
    let specs = param_specs(&case.cfg);
    let top_k = case.cfg.moe.as_ref().map_or(1, |m| m.num_experts_per_tok);
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ 0x5eed);
    for (ti, spec) in specs.iter().enumerate() {
        for i in coordinates(&analytic[ti], &mut rng) {
            let orig = w.tensors()[ti].as_slice()[i];
            let mut rerouted = false;
            let (numeric, correction) = derivative(orig, |x| {
                w.tensors_mut()[ti].as_mut_slice()[i] = x;
                let (out, _) = pass_output(&dev, &model, &mut w, &case.batch, plain, dropout);
                rerouted |= expert_sets(&out, top_k) != expert_sets(&base, top_k);
                out.loss as f64
            });
            w.tensors_mut()[ti].as_mut_slice()[i] = orig;
            if rerouted {
                continue;
            }
            let a = analytic[ti][i] as f64;
            let size = a.abs().max(numeric.abs());
            prop_assert!(
                correction <= ABS + RESOLVED * size,
                "{}[{}]: finite differences do not resolve the loss: Richardson correction {correction:e} for a derivative of {size:e}",
                spec.name,
                i
            );
            let tol = ABS + REL * size + 2.0 * correction;
            prop_assert!(
                (a - numeric).abs() <= tol,
                "{}[{}]: analytic {a:e}, finite difference {numeric:e} (tolerance {tol:e})",
                spec.name,
                i
            );
        }
    }
    Ok(())
}

/// Fails at the first element whose bits differ, naming the tensor and index.
fn same_bits(
    what: &str,
    a: &[Vec<f32>],
    b: &[Vec<f32>],
    names: &[String],
) -> Result<(), TestCaseError> {
    for ((x, y), name) in a.iter().zip(b).zip(names) {
        if let Some(i) = x
            .iter()
            .zip(y)
            .position(|(p, q)| p.to_bits() != q.to_bits())
        {
            return Err(TestCaseError::fail(format!(
                "{what}: {name}[{i}] is {} instead of {}",
                x[i], y[i]
            )));
        }
    }
    Ok(())
}

/// Largest |a − b| / max(|b|∞, 1e-3) over each tensor.
fn max_relative_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let scale = y.iter().fold(1e-3f64, |m, v| m.max(v.abs() as f64));
            x.iter()
                .zip(y)
                .map(|(p, q)| (*p as f64 - *q as f64).abs() / scale)
                .fold(0.0, f64::max)
        })
        .fold(0.0, f64::max)
}

/// Compares the gradients of every checkpointing policy and loss kind with the plain pass.
fn check_policies(case: &Case, chunk_tokens: usize) -> Result<(), TestCaseError> {
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let model = Model::new(&dev, case.cfg.clone()).unwrap();
    let mut w = init(&dev, case);
    let names: Vec<String> = param_specs(&case.cfg).into_iter().map(|s| s.name).collect();
    let layers = case.cfg.num_hidden_layers;
    let chunked = LossKind::Chunked { chunk_tokens };
    let b = &case.batch;
    let (loss, grads, recomputed) = pass(
        &dev,
        &model,
        &mut w,
        b,
        Checkpointing::None,
        LossKind::Standard,
    );
    prop_assert_eq!(recomputed, 0);

    let (ac_loss, ac_grads, ac_recomputed) = pass(
        &dev,
        &model,
        &mut w,
        b,
        Checkpointing::Full,
        LossKind::Standard,
    );
    prop_assert_eq!(ac_recomputed, layers);
    prop_assert_eq!(ac_loss.to_bits(), loss.to_bits());
    same_bits("full checkpointing", &ac_grads, &grads, &names)?;

    let (ch_loss, ch_grads, _) = pass(&dev, &model, &mut w, b, Checkpointing::None, chunked);
    let loss_diff = ((ch_loss - loss) / loss.abs().max(1e-6)).abs();
    prop_assert!(loss_diff <= 1e-6, "chunked loss {ch_loss} vs {loss}");
    let grad_diff = max_relative_diff(&ch_grads, &grads);
    prop_assert!(
        grad_diff <= 1e-6,
        "chunked gradients differ by {grad_diff:e}"
    );

    let (both_loss, both_grads, _) = pass(&dev, &model, &mut w, b, Checkpointing::Full, chunked);
    prop_assert_eq!(both_loss.to_bits(), ch_loss.to_bits());
    same_bits(
        "full checkpointing, chunked loss",
        &both_grads,
        &ch_grads,
        &names,
    )?;
    Ok(())
}

/// Every checkpointing policy gives the bits of keeping everything under `dropout`, and the
/// masks change the gradients.
fn check_dropout_policies(case: &Case, dropout: Option<Dropout>) -> Result<(), TestCaseError> {
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let model = Model::new(&dev, case.cfg.clone()).unwrap();
    let mut w = init(&dev, case);
    let names: Vec<String> = param_specs(&case.cfg).into_iter().map(|s| s.name).collect();
    let (b, kind) = (&case.batch, LossKind::Standard);
    let (loss, grads, _) = pass_with(&dev, &model, &mut w, b, Checkpointing::None, kind, dropout);
    for policy in [Checkpointing::Full, Checkpointing::Selective] {
        let (l, g, recomputed) = pass_with(&dev, &model, &mut w, b, policy, kind, dropout);
        prop_assert_eq!(recomputed, case.cfg.num_hidden_layers);
        prop_assert_eq!(l.to_bits(), loss.to_bits());
        same_bits(&format!("{policy:?} with dropout"), &g, &grads, &names)?;
    }
    let (_, plain, _) = pass(&dev, &model, &mut w, b, Checkpointing::None, kind);
    prop_assert!(plain != grads, "dropout changed no gradient");
    Ok(())
}

/// 16 cases drawn from [`SEED`], unless `PROPTEST_RNG_SEED` names another seed.
fn config() -> ProptestConfig {
    let default = ProptestConfig::default();
    let rng_seed = match default.rng_seed {
        RngSeed::Random => RngSeed::Fixed(SEED),
        chosen => chosen,
    };
    ProptestConfig {
        cases: 16,
        rng_seed,
        ..default
    }
}

proptest! {
    #![proptest_config(config())]

    /// Every parameter tensor's analytic gradient matches finite differences of the loss.
    #[test]
    fn gradients_match_finite_differences(case in cases()) {
        check_gradients(&case, None)?;
    }

    /// With residual dropout too; and checkpointed blocks regenerate the same masks, so every
    /// policy gives the same bits.
    #[test]
    fn gradients_with_dropout_match_finite_differences(case in cases(), p in 0.1f32..0.5) {
        let dropout = Some(Dropout { p, seed: case.seed, offset: 3 });
        check_gradients(&case, dropout)?;
        check_dropout_policies(&case, dropout)?;
    }

    /// Full checkpointing recomputes every block and changes no bit of the loss or gradients; a
    /// chunked loss matches the standard one to rounding.
    #[test]
    fn checkpointing_and_chunked_loss_keep_the_gradients(case in cases(), chunk in 1usize..=11) {
        check_policies(&case, chunk)?;
    }
}
