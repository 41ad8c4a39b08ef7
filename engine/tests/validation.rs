//! Validation: a held-out share never trained on and the same on every run of a seed, a file
//! split read as the training data is, evaluations on the schedule with the bits of one rank at
//! every world size and stage of sharding (the same loss as a pass of the model by hand), a
//! resumed run's evaluations equal to the uninterrupted run's, and the two validation faults
//! changing exactly what they claim.

mod common;

use ckpt_engine::config::{Init, Precision};
use ckpt_engine::data::SampleId;
use ckpt_engine::model::weights::init_params;
use ckpt_engine::parallel::{Parallel, Shard};
use ckpt_engine::validation::{Evaluation, ValidationConfig};
use ckpt_engine::{Category, CpuDevice, Device, EngineError, Fault, State, TrainConfig, Trainer};
use std::collections::BTreeSet;

/// A small Llama on 64 synthetic samples, 12 micro-batches of 2 rows a step, a quarter held out
/// and evaluated after every 2 steps and after step 5.
fn run() -> TrainConfig {
    let mut cfg = common::train_config(common::llama(37, 16, 2), Precision::Fp32, 2, 8, 6);
    cfg.data = ckpt_engine::data::DataConfig::Synthetic {
        seed: 4,
        samples: 64,
        branching: 4,
        min_len: Some(3),
    };
    cfg.accumulation = 12;
    cfg.validation = Some(ValidationConfig {
        every: 2,
        share: Some(0.25),
        path: None,
        batches: None,
        end: Some(5),
    });
    cfg
}

fn device() -> CpuDevice {
    CpuDevice::new(4, u64::MAX).unwrap()
}

/// Every evaluation of `steps` steps of `t`, in order.
fn evaluations(t: &mut Trainer<CpuDevice>, steps: u64) -> Vec<Evaluation> {
    (0..steps)
        .flat_map(|_| t.step().unwrap().evaluations)
        .collect()
}

/// What an evaluation shows of itself, memory aside: step, loss bits, tokens, batches.
fn seen(e: &[Evaluation]) -> Vec<(u64, u32, usize, String)> {
    e.iter()
        .map(|e| (e.step, e.loss.to_bits(), e.tokens, e.batch_digest.clone()))
        .collect()
}

#[test]
fn a_held_out_share_is_never_trained_on_and_the_same_for_every_run_of_its_seed() {
    let cfg = run();
    let (mut train, split) = cfg.loaders().unwrap();
    let mut split = split.unwrap();
    assert_eq!((train.samples(), split.samples()), (48, 16));
    assert_eq!(train.dataset_samples(), 64);
    for _ in 0..24 {
        train.next_batch().unwrap();
    }
    let trained: BTreeSet<u64> = train.take_drawn().iter().map(|s| s.index).collect();
    split.next_rows(16, 8).unwrap();
    let held: Vec<SampleId> = split.take_drawn();
    let held_indices: Vec<u64> = held.iter().map(|s| s.index).collect();
    assert!(
        held_indices.windows(2).all(|w| w[0] < w[1]),
        "in dataset order: {held_indices:?}"
    );
    assert!(held_indices.iter().all(|i| !trained.contains(i)));
    assert_eq!(trained.len(), 48, "an epoch of the rest");
    let again = run().loaders().unwrap().1.unwrap();
    let mut again = again;
    again.next_rows(16, 8).unwrap();
    assert_eq!(again.take_drawn(), held);
    let mut other = run();
    other.shuffle_seed += 1;
    let mut other = other.loaders().unwrap().1.unwrap();
    other.next_rows(16, 8).unwrap();
    assert_ne!(
        other.take_drawn(),
        held,
        "another seed holds out other samples"
    );
}

#[test]
fn evaluations_follow_the_schedule_and_are_the_loss_of_a_forward_pass() {
    let mut t = Trainer::new(run(), device()).unwrap();
    let e = evaluations(&mut t, 7);
    let steps: Vec<u64> = e.iter().map(|e| e.step).collect();
    assert_eq!(steps, [2, 4, 5, 6]);
    // 16 samples in micro-batches of 2: 8, every sample once, in order.
    assert_eq!(e[0].shapes.len(), 8);
    assert_eq!(e[0].samples.len(), 16);
    assert!(e.iter().all(|x| x.batch_digest == e[0].batch_digest));
    assert_ne!(e[0].loss, e[1].loss, "the model trained in between");
    assert!(e
        .iter()
        .all(|x| x.memory.allocated.peak > x.memory.allocated.current));
    // Before any step: the loss of the training passes over the same rows with the same
    // initial weights, which run the same forward arithmetic.
    let cfg = run();
    let mut fresh = Trainer::new(cfg.clone(), device()).unwrap();
    let first = fresh.evaluate().unwrap();
    let mut split = cfg.loaders().unwrap().1.unwrap();
    let batches: Vec<_> = (0..8).map(|_| split.next_rows(2, 8).unwrap()).collect();
    let Init::Random { seed, std } = cfg.init else {
        unreachable!()
    };
    let dev = device();
    let master = init_params(&dev.host(), &cfg.model, seed, std, Category::Params).unwrap();
    let by_hand = State::new(&cfg, dev, master, None)
        .unwrap()
        .accumulate(&batches, None)
        .unwrap();
    assert_eq!(first.loss.to_bits(), by_hand.ce.to_bits());
    assert_eq!(first.tokens, by_hand.tokens);
    assert_eq!(first.batch_digest, ckpt_engine::Batch::digest_all(&batches));
}

#[test]
fn every_world_size_and_stage_evaluates_the_bits_of_one_rank() {
    let one = {
        let mut t = Trainer::new(run(), device()).unwrap();
        seen(&evaluations(&mut t, 6))
    };
    for (world, shard) in [
        (2, Shard::None),
        (3, Shard::Optimizer),
        (4, Shard::Gradients),
        (3, Shard::Full),
    ] {
        let cfg = TrainConfig {
            parallel: Parallel {
                world_size: world,
                shard,
                ..Parallel::default()
            },
            ..run()
        };
        let mut t = Trainer::new(cfg, device()).unwrap();
        let e = evaluations(&mut t, 6);
        assert_eq!(seen(&e), one, "{world} ranks, shard {shard:?}");
        assert_eq!(e[0].rank_memory.len(), world);
    }
}

#[test]
fn a_resumed_run_evaluates_as_the_uninterrupted_one_and_the_faults_break_that() {
    let dir = tempfile::tempdir().unwrap();
    let whole = {
        let mut t = Trainer::new(run(), device()).unwrap();
        seen(&evaluations(&mut t, 7))
    };
    let resumed = |faults: &[Fault], batches: Option<usize>| {
        let mut cfg = run();
        cfg.faults = faults.iter().copied().collect();
        cfg.validation.as_mut().unwrap().batches = batches;
        let mut t = Trainer::new(cfg.clone(), device()).unwrap();
        let mut e = evaluations(&mut t, 4);
        let saved = t.save(dir.path(), None).unwrap();
        drop(t);
        let mut t = Trainer::resume(cfg, device(), &saved).unwrap();
        e.extend(evaluations(&mut t, 3));
        seen(&e)
    };
    assert_eq!(resumed(&[], None), whole);
    let repeated = resumed(&[Fault::EvaluationRepeatedAtResume], None);
    let steps: Vec<u64> = repeated.iter().map(|e| e.0).collect();
    assert_eq!(
        steps,
        [2, 4, 4, 5, 6],
        "evaluated again at the resume step 4"
    );
    // Without a cap every evaluation reads the whole split: a loader left where it stood
    // starts the next epoch of the split, in the same order.
    assert_eq!(resumed(&[Fault::ValidationLoaderNotReset], None), whole);
    let capped = |faults: &[Fault]| {
        let mut cfg = run();
        cfg.faults = faults.iter().copied().collect();
        cfg.validation.as_mut().unwrap().batches = Some(3);
        let mut t = Trainer::new(cfg, device()).unwrap();
        seen(&evaluations(&mut t, 7))
    };
    let (reset, not_reset) = (capped(&[]), capped(&[Fault::ValidationLoaderNotReset]));
    assert_eq!(
        reset[0], not_reset[0],
        "the first evaluation starts at the split's start"
    );
    assert_ne!(reset[1].3, not_reset[1].3, "the second reads on");
    assert!(reset.iter().all(|e| e.3 == reset[0].3));
    assert_ne!(
        resumed(&[Fault::ValidationLoaderNotReset], Some(3)),
        not_reset
    );
}

#[test]
fn validation_settings_that_name_no_split_or_no_evaluation_are_refused() {
    let refused = |change: fn(&mut ValidationConfig)| {
        let mut cfg = run();
        change(cfg.validation.as_mut().unwrap());
        match cfg.loaders() {
            Err(EngineError::Setting(s)) => (s.key, s.message),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("accepted"),
        }
    };
    let (key, message) = refused(|v| v.every = 0);
    assert_eq!(key, "validation.every");
    assert!(message.contains("at least 1"), "{message}");
    let (key, _) = refused(|v| v.batches = Some(0));
    assert_eq!(key, "validation.batches");
    let (key, message) = refused(|v| v.share = None);
    assert_eq!(key, "validation");
    assert!(
        message.contains("share: 0.1") && message.contains("path: FILE"),
        "{message}"
    );
    let (key, message) = refused(|v| v.path = Some("v.jsonl".into()));
    assert_eq!(key, "validation");
    assert!(message.contains("one split"), "{message}");
    let (key, message) = refused(|v| {
        v.share = None;
        v.path = Some("v.jsonl".into());
    });
    assert_eq!(key, "validation.path");
    assert!(message.contains("validation.share"), "{message}");
    for share in [0.0, 1.0, 0.999, -0.5, f64::NAN] {
        let mut cfg = run();
        cfg.validation.as_mut().unwrap().share = Some(share);
        match cfg.loaders() {
            Err(EngineError::Setting(s)) => {
                assert_eq!(s.key, "validation.share");
                assert!(
                    s.message.contains("of the dataset's 64 samples"),
                    "{}",
                    s.message
                );
            }
            other => panic!("share {share}: {:?}", other.err()),
        }
    }
    let mut none = run();
    none.validation = None;
    let e = Trainer::new(none, device())
        .unwrap()
        .evaluate()
        .unwrap_err();
    assert!(e.to_string().contains("no validation split"), "{e}");
}

#[test]
fn a_resume_with_another_validation_split_is_refused_and_another_schedule_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(run(), device()).unwrap();
    t.step().unwrap();
    let saved = t.save(dir.path(), None).unwrap();
    drop(t);
    let mut other = run();
    other.validation.as_mut().unwrap().share = Some(0.5);
    let e = Trainer::resume(other, device(), &saved)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("validation"), "{e}");
    // When and how much it evaluates changes no bit of the training.
    let mut every = run();
    every.validation.as_mut().unwrap().every = 3;
    every.validation.as_mut().unwrap().batches = Some(1);
    assert!(Trainer::resume(every, device(), &saved).is_ok());
}
