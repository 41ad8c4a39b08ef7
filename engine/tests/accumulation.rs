//! Gradient accumulation: a step of `accumulation` micro-batches trains on the loss of all their
//! rows together, each token weighted by the step's counted labels, so it equals one step over a
//! batch of all those rows (to the order of float sums), and not the mean of the micro-batches'
//! mean losses when their rows hold different numbers of counted labels.

mod common;

use ckpt_engine::config::{Precision, TrainConfig};
use ckpt_engine::data::DataLoader;
use ckpt_engine::model::loss::counted;
use ckpt_engine::model::{weights, Batch, PassOutput};
use ckpt_engine::{CpuDevice, Device, State, Trainer};

/// Rows per micro-batch.
const ROWS: usize = 3;

/// Vocab 64, hidden 32, 2 layers; micro-batches of `rows` rows of 24 tokens, 2 to 24 of them
/// counted (variable length); no clipping, so gradients are compared as computed.
fn config(rows: usize, accumulation: usize) -> TrainConfig {
    let mut cfg = common::train_config(common::llama(64, 32, 2), Precision::Fp32, rows, 24, 8);
    cfg.accumulation = accumulation;
    cfg.shuffle_seed = 1;
    cfg.optimizer.grad_clip = None;
    if let ckpt_engine::data::DataConfig::Synthetic { min_len, .. } = &mut cfg.data {
        *min_len = Some(2);
    }
    cfg
}

/// A fresh state of `cfg` with its seeded initial weights.
fn state(cfg: &TrainConfig) -> State<CpuDevice> {
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let master =
        weights::init_params(&dev.host(), &cfg.model, 11, 0.02, cfg.master_category()).unwrap();
    let master = master.try_map(|t| dev.upload(t)).unwrap();
    State::new(cfg, dev, master, None).unwrap()
}

/// The first `n` batches of `cfg`'s loader.
fn batches(cfg: &TrainConfig, n: usize) -> Vec<Batch> {
    let mut loader = DataLoader::new(
        &cfg.data,
        cfg.model.vocab_size,
        cfg.batch_size,
        cfg.seq_len,
        cfg.shuffle_seed,
    )
    .unwrap();
    (0..n).map(|_| loader.next_batch().unwrap()).collect()
}

/// Every gradient, flattened in parameter order.
fn grads(s: &State<CpuDevice>) -> Vec<f32> {
    s.grads()
        .tensors()
        .iter()
        .flat_map(|t| t.to_f32_vec())
        .collect()
}

/// The relative L2 distance of `a` from `b`.
fn relative(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// Two micro-batches of 3 rows, and the batch of those 6 rows.
struct Case {
    micro: Vec<Batch>,
    whole: Batch,
}

fn case() -> Case {
    let micro = batches(&config(ROWS, 2), 2);
    let whole = batches(&config(2 * ROWS, 1), 1).remove(0);
    let ids: Vec<u32> = micro.iter().flat_map(|b| b.input_ids.clone()).collect();
    let labels: Vec<i64> = micro.iter().flat_map(|b| b.labels.clone()).collect();
    assert_eq!(
        (ids, labels),
        (whole.input_ids.clone(), whole.labels.clone())
    );
    let tokens: Vec<usize> = micro.iter().map(|b| counted(&b.labels)).collect();
    assert!(
        tokens[0] * 5 < tokens[1] * 4 || tokens[1] * 5 < tokens[0] * 4,
        "the micro-batches must count clearly different labels: {tokens:?}"
    );
    Case { micro, whole }
}

#[test]
fn two_micro_batches_give_the_gradients_of_one_batch_of_their_rows() {
    let c = case();
    let cfg = config(ROWS, 2);
    let mut accumulated = state(&cfg);
    let acc = accumulated.accumulate(&c.micro, None).unwrap();
    let mut whole = state(&config(2 * ROWS, 1));
    let one = whole.forward_backward(&c.whole, None).unwrap();
    let error = relative(&grads(&accumulated), &grads(&whole));
    println!(
        "tokens {:?} = {}; loss {} vs {}; gradient relative error {error:.2e}",
        c.micro
            .iter()
            .map(|b| counted(&b.labels))
            .collect::<Vec<_>>(),
        acc.tokens,
        acc.loss,
        one.loss
    );
    assert_eq!(acc.tokens, one.tokens);
    assert!(
        (acc.loss - one.loss).abs() <= 1e-6 * one.loss,
        "{acc:?} {one:?}"
    );
    assert!(error < 1e-6, "{error}");
}

#[test]
fn a_mean_of_micro_batch_means_would_fail_that_comparison() {
    let c = case();
    let cfg = config(ROWS, 2);
    let mut passes: Vec<(PassOutput, Vec<f32>)> = Vec::new();
    for b in &c.micro {
        let mut s = state(&cfg);
        let out = s.forward_backward(b, None).unwrap();
        passes.push((out, grads(&s)));
    }
    let mean_loss = (passes[0].0.loss + passes[1].0.loss) / 2.0;
    let mean_grads: Vec<f32> = passes[0]
        .1
        .iter()
        .zip(&passes[1].1)
        .map(|(a, b)| (a + b) / 2.0)
        .collect();
    let mut whole = state(&config(2 * ROWS, 1));
    let one = whole.forward_backward(&c.whole, None).unwrap();
    let error = relative(&mean_grads, &grads(&whole));
    println!(
        "mean of means: loss {mean_loss} vs {}; gradient relative error {error:.2e}",
        one.loss
    );
    assert!(
        (mean_loss - one.loss).abs() > 1e-4 * one.loss,
        "{mean_loss}"
    );
    assert!(error > 1e-3, "{error}");
}

#[test]
fn training_with_accumulation_follows_training_on_the_whole_batches() {
    let mut accumulated =
        Trainer::new(config(ROWS, 2), CpuDevice::new(2, u64::MAX).unwrap()).unwrap();
    let mut whole =
        Trainer::new(config(2 * ROWS, 1), CpuDevice::new(2, u64::MAX).unwrap()).unwrap();
    for step in 0..4 {
        let a = accumulated.step().unwrap();
        let w = whole.step().unwrap();
        println!(
            "step {step}: loss {} vs {}, grad norm {} vs {}",
            a.loss, w.loss, a.grad_norm, w.grad_norm
        );
        assert_eq!(a.tokens, w.tokens);
        assert!((a.loss - w.loss).abs() <= 1e-5 * w.loss, "step {step}");
        assert!((a.grad_norm - w.grad_norm).abs() <= 1e-4 * w.grad_norm);
        assert_ne!(
            a.batch_digest, w.batch_digest,
            "a digest names the micro-batches"
        );
    }
    assert_eq!(accumulated.loader().state(), whole.loader().state());
    assert_eq!(accumulated.state().optimizer_steps(), 4);
    let params = |t: &Trainer<CpuDevice>| -> Vec<f32> {
        let master = t.state().weights().master();
        master
            .tensors()
            .iter()
            .flat_map(|t| t.to_f32_vec())
            .collect()
    };
    let error = relative(&params(&accumulated), &params(&whole));
    println!("weights after 4 steps: relative error {error:.2e}");
    assert!(error < 1e-5, "{error}");
}

#[test]
fn one_micro_batch_is_the_step_without_accumulation() {
    let cfg = config(ROWS, 1);
    let b = batches(&cfg, 1).remove(0);
    let mut a = state(&cfg);
    let mut s = state(&cfg);
    let acc = a.accumulate(std::slice::from_ref(&b), None).unwrap();
    let one = s.forward_backward(&b, None).unwrap();
    assert_eq!(acc, one);
    assert_eq!(Batch::digest_all(std::slice::from_ref(&b)), b.digest());
    let same = grads(&a)
        .iter()
        .zip(grads(&s))
        .all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same);
}
