//! Activation checkpointing and the chunked loss change memory, not results; and the analytic
//! memory model predicts the CPU device's measured step memory to the byte.

mod common;

use ckpt_engine::backend::count::{Like, Routes};
use ckpt_engine::config::{Init, Precision};
use ckpt_engine::data::{DataConfig, LongBatch};
use ckpt_engine::estimate::{
    estimate, estimate_every_micro_batch, recorded_steps, EstimateConfig, StepEstimate,
};
use ckpt_engine::model::config::MoeConfig;
use ckpt_engine::model::loss::{counted, LossKind, IGNORE_INDEX};
use ckpt_engine::model::{weights, Family, Group, PassConfig, PassHooks, StepShare};
use ckpt_engine::parallel::{Parallel, Shard};
use ckpt_engine::state::rounded;
use ckpt_engine::{
    Batch, Category, Checkpointing, CpuDevice, Elem, Fault, LlamaConfig, Model, Params, Tensor,
    TrainConfig, Trainer,
};
use proptest::prelude::*;

/// Every family's block.
const FAMILIES: [Family; 7] = Family::ALL;

const POLICIES: [Checkpointing; 3] = [
    Checkpointing::None,
    Checkpointing::Full,
    Checkpointing::Selective,
];

fn tiny() -> LlamaConfig {
    LlamaConfig {
        max_position_embeddings: 16,
        ..LlamaConfig::new(37, 16, 24, 3, 4, 2)
    }
}

/// A `[rows, seq]` batch with every fifth label ignored.
fn batch(cfg: &LlamaConfig, rows: usize, seq: usize) -> Batch {
    let n = rows * seq;
    let v = cfg.vocab_size;
    Batch {
        batch: rows,
        seq,
        input_ids: (0..n).map(|i| ((i * 7 + 3) % v) as u32).collect(),
        labels: (0..n)
            .map(|i| {
                if i % 5 == 4 {
                    IGNORE_INDEX
                } else {
                    ((i * 11 + 1) % v) as i64
                }
            })
            .collect(),
        positions: None,
    }
}

/// What one forward + backward pass gives: loss, blocks recomputed, every gradient.
struct Pass {
    loss: f32,
    recomputed: usize,
    grads: Vec<Vec<f32>>,
}

fn pass<E: Elem>(
    dev: &CpuDevice,
    cfg: &LlamaConfig,
    w: &mut Params<Tensor<E>>,
    b: &Batch,
    ckpt: Checkpointing,
    loss: LossKind,
) -> Pass {
    let model = Model::new(dev, cfg.clone()).unwrap();
    let mut grads = Params::try_new(cfg, |s| dev.zeros::<f32>(&s.shape, Category::Grads)).unwrap();
    let out = model
        .forward_backward(dev, w, &mut grads, b, ckpt, loss)
        .unwrap();
    Pass {
        loss: out.loss,
        recomputed: out.recomputed_blocks,
        grads: grads.tensors().iter().map(|t| t.to_f32_vec()).collect(),
    }
}

/// Every policy gives bitwise the losses and gradients of keeping everything, for `loss`.
fn assert_policies_bitwise<E: Elem>(
    dev: &CpuDevice,
    cfg: &LlamaConfig,
    w: &mut Params<Tensor<E>>,
    b: &Batch,
    loss: LossKind,
) {
    let base = pass(dev, cfg, w, b, Checkpointing::None, loss);
    assert_eq!(base.recomputed, 0);
    for policy in [Checkpointing::Full, Checkpointing::Selective] {
        let got = pass(dev, cfg, w, b, policy, loss);
        assert_eq!(
            got.loss.to_bits(),
            base.loss.to_bits(),
            "{policy:?} {loss:?}"
        );
        for (i, (g, want)) in got.grads.iter().zip(&base.grads).enumerate() {
            let same = g.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{policy:?} {loss:?}: gradient {i} differs");
        }
        assert_eq!(got.recomputed, cfg.num_hidden_layers, "{policy:?}");
    }
}

#[test]
fn checkpointing_policies_give_bitwise_identical_losses_and_gradients() {
    let cfg = tiny();
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let mut master = weights::init_params(dev.tracker(), &cfg, 1, 0.1, Category::Params).unwrap();
    let mut compute = rounded::<_, half::bf16>(&dev, &cfg, &master).unwrap();
    let b = batch(&cfg, 3, 7);
    for loss in [LossKind::Standard, LossKind::Chunked { chunk_tokens: 4 }] {
        assert_policies_bitwise(&dev, &cfg, &mut master, &b, loss);
        assert_policies_bitwise(&dev, &cfg, &mut compute, &b, loss);
    }
}

/// ‖a − b‖ / ‖b‖.
fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// The chunked loss sums the head's gradient chunk by chunk and runs smaller products, so its
/// rounding differs from the standard loss's in the last bits, never more.
fn assert_chunked_matches<E: Elem>(
    dev: &CpuDevice,
    cfg: &LlamaConfig,
    w: &mut Params<Tensor<E>>,
    b: &Batch,
    tolerance: f64,
) {
    let base = pass(dev, cfg, w, b, Checkpointing::None, LossKind::Standard);
    let rows = b.batch * b.seq;
    for chunk_tokens in [1, 4, rows - 1, rows, rows + 5] {
        let got = pass(
            dev,
            cfg,
            w,
            b,
            Checkpointing::None,
            LossKind::Chunked { chunk_tokens },
        );
        let loss_err = ((got.loss - base.loss) / base.loss).abs();
        assert!(
            loss_err <= 1e-6,
            "chunk {chunk_tokens}: loss error {loss_err}"
        );
        for (i, (g, want)) in got.grads.iter().zip(&base.grads).enumerate() {
            let err = relative_error(g, want);
            assert!(
                err <= tolerance,
                "chunk {chunk_tokens}: gradient {i} relative error {err}"
            );
        }
        if chunk_tokens >= rows {
            assert_eq!(got.loss.to_bits(), base.loss.to_bits());
            assert_eq!(got.grads, base.grads, "one chunk is the standard path");
        }
    }
}

#[test]
fn chunked_loss_matches_the_standard_loss() {
    let cfg = tiny();
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let mut master = weights::init_params(dev.tracker(), &cfg, 2, 0.1, Category::Params).unwrap();
    let mut compute = rounded::<_, half::bf16>(&dev, &cfg, &master).unwrap();
    let b = batch(&cfg, 3, 7);
    assert_chunked_matches(&dev, &cfg, &mut master, &b, 1e-6);
    assert_chunked_matches(&dev, &cfg, &mut compute, &b, 1e-5);
}

/// Hooks that only ask for a tied head's gradient at the end of the backward pass, and note
/// the groups whose gradients the pass adds to, in order.
#[derive(Default)]
struct HeadLast {
    added: Vec<Group>,
}

impl<E: Elem> PassHooks<CpuDevice, E> for HeadLast {
    fn weights_in(&mut self, _: &mut Params<Tensor<E>>, _: Group) -> ckpt_engine::Result<()> {
        Ok(())
    }
    fn weights_out(&mut self, _: &mut Params<Tensor<E>>, _: Group) -> ckpt_engine::Result<()> {
        Ok(())
    }
    fn grads_in(&mut self, _: &mut Params<Tensor<f32>>, group: Group) -> ckpt_engine::Result<()> {
        self.added.push(group);
        Ok(())
    }
    fn grads_out(&mut self, _: &mut Params<Tensor<f32>>, _: Group) -> ckpt_engine::Result<()> {
        Ok(())
    }
    fn tied_head_last(&self) -> bool {
        true
    }
}

/// Each pass's loss bits and every gradient's bits.
type PassBits = (Vec<u32>, Vec<Vec<u32>>);

/// Two passes of one accumulating step into the same gradients (so the second adds to sums
/// already there), on `hooks`: each pass's loss bits and every gradient after both.
fn two_passes<E: Elem>(
    dev: &CpuDevice,
    cfg: &LlamaConfig,
    w: &mut Params<Tensor<E>>,
    b: &Batch,
    loss: LossKind,
    hooks: &mut dyn PassHooks<CpuDevice, E>,
) -> PassBits {
    let model = Model::new(dev, cfg.clone()).unwrap();
    let mut grads = Params::try_new(cfg, |s| dev.zeros::<f32>(&s.shape, Category::Grads)).unwrap();
    let faults = Default::default();
    let pass = PassConfig {
        checkpointing: Checkpointing::Full,
        loss,
        dropout: None,
        faults: &faults,
        share: Some(StepShare {
            tokens: 2 * counted(&b.labels),
            micro_batches: 2,
        }),
    };
    let losses = (0..2)
        .map(|_| {
            let (out, _) = model
                .forward_backward_hooked(dev, w, &mut grads, b, &pass, hooks)
                .unwrap();
            out.loss.to_bits()
        })
        .collect();
    let bits = |t: &Tensor<f32>| t.to_f32_vec().iter().map(|x| x.to_bits()).collect();
    (losses, grads.tensors().into_iter().map(bits).collect())
}

/// Two passes' losses and gradients (as [`two_passes`] gives them) bit for bit the same.
fn assert_same_bits(got: &PassBits, want: &PassBits, at: &str) {
    assert_eq!(got.0, want.0, "{at}: the losses");
    for (i, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
        assert!(g == w, "{at}: gradient {i} differs");
    }
}

/// A tied head's gradient added at the end of the backward pass, from logits computed again,
/// has the bits of the one the fused loss adds, in both precisions and with the loss whole or
/// in chunks (one that does not divide the rows included); the pass adds to the head just
/// before the embedding. An untied head is added with the loss whatever the hooks ask.
#[test]
fn a_tied_head_added_last_has_the_bits_of_the_fused_loss() {
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    for tied in [true, false] {
        let cfg = LlamaConfig {
            tie_word_embeddings: tied,
            ..tiny()
        };
        let mut master =
            weights::init_params(dev.tracker(), &cfg, 5, 0.1, Category::Params).unwrap();
        let mut compute = rounded::<_, half::bf16>(&dev, &cfg, &master).unwrap();
        let b = batch(&cfg, 3, 7);
        let losses = [
            LossKind::Standard,
            LossKind::Chunked { chunk_tokens: 4 },
            LossKind::Chunked { chunk_tokens: 7 },
        ];
        for loss in losses {
            let at = format!("tied {tied}, {loss:?}");
            let mut last = HeadLast::default();
            let want = two_passes(&dev, &cfg, &mut master, &b, loss, &mut ());
            let got = two_passes(&dev, &cfg, &mut master, &b, loss, &mut last);
            assert_same_bits(&got, &want, &format!("{at}, fp32"));
            let want = two_passes(&dev, &cfg, &mut compute, &b, loss, &mut ());
            let got = two_passes(&dev, &cfg, &mut compute, &b, loss, &mut HeadLast::default());
            assert_same_bits(&got, &want, &format!("{at}, bf16"));
            let layers = (0..cfg.num_hidden_layers).rev().map(Group::Layer);
            let pass: Vec<Group> = match tied {
                true => [Group::FinalNorm]
                    .into_iter()
                    .chain(layers)
                    .chain([Group::Head, Group::Embed])
                    .collect(),
                false => [Group::Head, Group::FinalNorm]
                    .into_iter()
                    .chain(layers)
                    .chain([Group::Embed])
                    .collect(),
            };
            assert_eq!(last.added, [pass.clone(), pass].concat(), "{at}");
        }
    }
}

/// Peak bytes of one pass above what was held before it.
fn pass_peak<E: Elem>(
    dev: &CpuDevice,
    cfg: &LlamaConfig,
    w: &mut Params<Tensor<E>>,
    b: &Batch,
    loss: LossKind,
) -> u64 {
    let model = Model::new(dev, cfg.clone()).unwrap();
    let mut grads = Params::try_new(cfg, |s| dev.zeros::<f32>(&s.shape, Category::Grads)).unwrap();
    let before = dev.tracker().allocated();
    dev.tracker().reset_peak();
    model
        .forward_backward(dev, w, &mut grads, b, Checkpointing::None, loss)
        .unwrap();
    dev.tracker().stats().allocated.peak - before
}

#[test]
fn chunked_loss_never_holds_logits_of_every_token() {
    // The vocabulary dwarfs everything else but the head, and tokens outnumber twice the
    // hidden width (bf16 products widen the [vocab, hidden] head to f32), so any [tokens, vocab]
    // buffer would show.
    let cfg = LlamaConfig {
        vocab_size: 3000,
        num_hidden_layers: 1,
        ..tiny()
    };
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let mut master = weights::init_params(dev.tracker(), &cfg, 3, 0.1, Category::Params).unwrap();
    let mut compute = rounded::<_, half::bf16>(&dev, &cfg, &master).unwrap();
    let b = batch(&cfg, 4, 16);
    let all_logits = |elem: u64| (b.batch * b.seq * cfg.vocab_size) as u64 * elem;
    let chunked = LossKind::Chunked { chunk_tokens: 2 };
    assert!(pass_peak(&dev, &cfg, &mut master, &b, chunked) < all_logits(4));
    assert!(pass_peak(&dev, &cfg, &mut master, &b, LossKind::Standard) > all_logits(4));
    assert!(pass_peak(&dev, &cfg, &mut compute, &b, chunked) < all_logits(2));
    assert!(pass_peak(&dev, &cfg, &mut compute, &b, LossKind::Standard) > all_logits(2));
}

/// A tiny run with every memory-relevant choice drawn at random.
#[derive(Clone, Debug)]
struct Case {
    train: TrainConfig,
    threads: usize,
}

fn case() -> impl Strategy<Value = Case> {
    let shape = (
        (1usize..=4, 1usize..=4, 1usize..=3), // kv heads, group, head_dim / 2
        (3usize..=50, 1usize..=40, 1usize..=3), // vocab, ffn, layers
        (1usize..=3, 1usize..=9, 0usize..=4), // batch, seq, extra positions
        (any::<bool>(), prop::sample::select(FAMILIES.to_vec())), // tied embeddings, family
    );
    let run = (
        prop_oneof![Just(Precision::Fp32), Just(Precision::Bf16Mixed)],
        prop::sample::select(POLICIES.to_vec()),
        prop_oneof![
            Just(LossKind::Standard),
            (1usize..=30).prop_map(|chunk_tokens| LossKind::Chunked { chunk_tokens })
        ],
        1usize..=2,
        any::<u64>(),
    );
    let step = (
        prop_oneof![Just(0.0f32), Just(0.2)],     // dropout
        prop::option::of((0u64..=2, 0usize..=4)), // long rows: first step, extra tokens
        1usize..=6, // micro-batches per step (from 5 the estimate runs a few of them)
    );
    // Experts, top-k (reduced below the experts), expert width, renormalised, a dense first layer.
    let moe = (
        1usize..=4,
        1usize..=4,
        1usize..=24,
        any::<bool>(),
        any::<bool>(),
    );
    (shape, run, step, moe).prop_map(
        |(
            ((kv, group, half), (vocab, ffn, layers), (rows, seq, extra), (tied, family)),
            run,
            step,
            (experts, k, expert_ffn, normalize, dense_first),
        )| {
            let (precision, checkpointing, loss, threads, seed) = run;
            let (dropout, long, accumulation) = step;
            let moe = family.moe().then(|| MoeConfig {
                num_experts: experts,
                num_experts_per_tok: 1 + (k - 1) % experts,
                moe_intermediate_size: if family == Family::Mixtral {
                    ffn
                } else {
                    expert_ffn
                },
                norm_topk_prob: normalize || family == Family::Mixtral,
                router_aux_loss_coef: 0.01,
                decoder_sparse_step: 1,
                mlp_only_layers: match dense_first && layers > 1 && family == Family::Qwen3Moe {
                    true => vec![0],
                    false => vec![],
                },
            });
            let heads = kv * group;
            let model = LlamaConfig {
                tie_word_embeddings: tied,
                max_position_embeddings: seq + extra,
                family,
                moe,
                ..LlamaConfig::new(vocab, heads * 2 * half, ffn, layers, heads, kv)
            };
            let mut train = TrainConfig {
                init: Init::Random { seed, std: 0.05 },
                precision,
                data: DataConfig::Synthetic {
                    seed,
                    samples: 16,
                    branching: 2,
                    min_len: Some(1),
                },
                accumulation,
                shuffle_seed: seed,
                checkpointing,
                loss,
                dropout,
                long_batch: long.map(|(from_step, more)| LongBatch {
                    from_step,
                    seq_len: seq + more.min(extra),
                }),
                ..TrainConfig::new(model, rows, seq)
            };
            train.optimizer.lr = 1e-2;
            Case { train, threads }
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Steps 0, 1 and 2 of a fresh trainer, with or without dropout, gradient accumulation and
    /// long rows from one of them on: the measured peak, the breakdown at the peak, each category's peak, the bytes
    /// held at the step's start and end and the number of allocations all equal the estimate's
    /// (for a MoE model, the estimate at the tokens per expert the step recorded).
    #[test]
    fn estimate_equals_the_measured_step_memory(c in case()) {
        let dev = CpuDevice::new(c.threads, u64::MAX).unwrap();
        let cfg = EstimateConfig::from_train(&c.train, Like::Cpu { threads: dev.threads() });
        let est = estimate(&cfg).unwrap();
        let mut trainer = Trainer::new(c.train.clone(), dev.clone()).unwrap();
        let mut before = dev.tracker().stats();
        for step in 0..3 {
            let stats = trainer.step().unwrap();
            let routed;
            let want = match stats.tokens_per_expert.is_empty() {
                true => est.at_step(step),
                false => {
                    let cfg = cfg.clone().with_routes(Routes::Recorded(stats.tokens_per_expert.clone()));
                    routed = recorded_steps(&cfg, c.train.seq_len_at(step)).unwrap();
                    &routed[usize::from(step > 0)]
                }
            };
            prop_assert_eq!(before.current, want.start, "step {} start", step);
            let got = &stats.memory;
            prop_assert_eq!(got.allocated.peak, want.peak, "step {} peak", step);
            prop_assert_eq!(got.at_peak, want.at_peak, "step {} at peak", step);
            prop_assert_eq!(got.peak_by_category, want.peak_by_category, "step {}", step);
            prop_assert_eq!(got.current, want.end, "step {} end", step);
            prop_assert_eq!(got.alloc_count - before.alloc_count, want.allocations, "step {}", step);
            let p = want.phases;
            prop_assert_eq!(p.forward.max(p.loss).max(p.backward).max(p.optimizer), want.peak);
            let recomputing = c.train.checkpointing != Checkpointing::None;
            let layers = c.train.model.num_hidden_layers;
            prop_assert_eq!(stats.recomputed_blocks, if recomputing { layers } else { 0 });
            before = stats.memory;
        }
    }

    /// Many micro-batches a step, on one rank or several at every sharding stage: the estimate,
    /// which runs a few micro-batches per rank, equals the dry run of every one of them, figure
    /// by figure (each rank's and the long rows' steps included).
    #[test]
    fn a_few_micro_batches_give_the_estimate_of_all(
        c in case(),
        per_rank in 5usize..=12,
        world in prop::sample::select(vec![1usize, 2, 3]),
        shard in prop::sample::select(vec![Shard::None, Shard::Optimizer, Shard::Gradients, Shard::Full]),
    ) {
        let mut train = c.train;
        train.accumulation = per_rank * world;
        train.parallel = Parallel {
            world_size: world,
            shard,
            ..Parallel::default()
        };
        let cfg = EstimateConfig::from_train(&train, Like::Cpu { threads: c.threads });
        let full = estimate_every_micro_batch(&cfg).unwrap();
        prop_assert_eq!(estimate(&cfg).unwrap(), full);
    }

    /// Random shapes: every policy is bitwise the same as keeping everything.
    #[test]
    fn checkpointing_is_bitwise_on_random_shapes(c in case()) {
        let t = &c.train;
        let dev = CpuDevice::new(c.threads, u64::MAX).unwrap();
        let mut master = weights::init_params(dev.tracker(), &t.model, 7, 0.2, Category::Params).unwrap();
        let b = batch(&t.model, t.batch_size, t.seq_len);
        match t.precision {
            Precision::Fp32 => assert_policies_bitwise(&dev, &t.model, &mut master, &b, t.loss),
            Precision::Bf16Mixed => {
                let mut compute = rounded::<_, half::bf16>(&dev, &t.model, &master).unwrap();
                assert_policies_bitwise(&dev, &t.model, &mut compute, &b, t.loss);
            }
        }
    }
}

/// Micro-batches that do not repeat (each keeps its recomputed inputs, a fault the memory
/// model is never given by `from_train`) are run one by one: the estimate is still the dry run
/// of every one of them, and the step's peak grows with them.
#[test]
fn micro_batches_that_do_not_repeat_are_each_run() {
    let mut train = common::train_config(common::llama(37, 16, 2), Precision::Fp32, 2, 8, 4);
    train.checkpointing = Checkpointing::Full;
    let mut cfg = EstimateConfig::from_train(&train, Like::Cpu { threads: 1 });
    cfg.run.faults = [Fault::RecomputeInputsKept].into_iter().collect();
    let peak = |accumulation: usize| {
        let cfg = EstimateConfig {
            run: TrainConfig {
                accumulation,
                ..cfg.run.clone()
            },
            ..cfg.clone()
        };
        let e = estimate(&cfg).unwrap();
        assert_eq!(
            e,
            estimate_every_micro_batch(&cfg).unwrap(),
            "{accumulation}"
        );
        e.later_step.peak
    };
    assert!(peak(6) < peak(8));
}

/// A step of 2^40 micro-batches, whose token ids alone would not fit in any host, is estimated
/// from a few of them: the figures of a step of 8, and as many allocations more as its extra
/// micro-batches make.
#[test]
fn the_estimate_of_any_accumulation_costs_a_few_micro_batches() {
    let train = common::train_config(common::llama(37, 16, 2), Precision::Bf16Mixed, 2, 8, 4);
    let at = |accumulation: usize| {
        let run = TrainConfig {
            accumulation,
            ..train.clone()
        };
        estimate(&EstimateConfig::from_train(&run, Like::Cpu { threads: 2 })).unwrap()
    };
    let huge = 1usize << 40;
    let (big, eight, nine) = (at(huge), at(8), at(9));
    for (got, want, next) in [
        (&big.first_step, &eight.first_step, &nine.first_step),
        (&big.later_step, &eight.later_step, &nine.later_step),
    ] {
        let per_micro_batch = next.allocations - want.allocations;
        assert!(per_micro_batch > 0);
        assert_eq!(
            got.allocations,
            want.allocations + (huge as u64 - 8) * per_micro_batch
        );
        let same = StepEstimate {
            allocations: want.allocations,
            ..got.clone()
        };
        assert_eq!(&same, want);
    }
}
