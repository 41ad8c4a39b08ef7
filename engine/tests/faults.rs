//! Every deliberate fault shows where the harness's checks look, and the same scenario without
//! it is clean: resumed runs continue bit for bit, step peaks equal the memory model, step
//! boundaries hold flat memory, and a dropped trainer leaves nothing allocated.

mod common;

use ckpt_engine::backend::count::Like;
use ckpt_engine::checkpoint::{step_dir_name, OPTIMIZER_FILE};
use ckpt_engine::config::{Precision, TrainConfig};
use ckpt_engine::data::{DataConfig, LongBatch};
use ckpt_engine::estimate::{estimate, Estimate, EstimateConfig};
use ckpt_engine::model::config::MoeConfig;
use ckpt_engine::model::Family;
use ckpt_engine::trainer::{StateDigest, StepStats};
use ckpt_engine::{Checkpointing, CpuDevice, Fault, Trainer};

/// Steps of the reference run.
const STEPS: u64 = 6;
/// The step whose checkpoint the resumed run starts from.
const RESUME_AT: u64 = 3;
const LAYERS: usize = 3;

/// A 3-block Llama on rows of 16 tokens, 2 rows a batch, warmup + cosine over `STEPS`.
fn config(faults: &[Fault]) -> TrainConfig {
    let mut cfg =
        common::train_config(common::llama(64, 32, LAYERS), Precision::Fp32, 2, 16, STEPS);
    cfg.faults = faults.iter().copied().collect();
    cfg
}

/// A reference run saving at `RESUME_AT`, and a run resumed from that checkpoint.
struct Trial {
    reference: Vec<StepStats>,
    /// The reference's state when it saved.
    saved: StateDigest,
    /// The resumed trainer's state before its first step.
    resumed_state: StateDigest,
    resumed: Vec<StepStats>,
}

fn trial(cfg: &TrainConfig) -> Trial {
    let dir = tempfile::tempdir().unwrap();
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let mut t = Trainer::new(cfg.clone(), dev.clone()).unwrap();
    let mut reference = Vec::new();
    let mut saved = None;
    for _ in 0..STEPS {
        reference.push(t.step().unwrap());
        if t.step_index() == RESUME_AT {
            saved = Some(t.state_digest().unwrap());
            t.save(dir.path(), None).unwrap();
        }
    }
    drop(t);
    let ckpt = dir.path().join(step_dir_name(RESUME_AT));
    let mut r = Trainer::resume(cfg.clone(), dev, &ckpt).unwrap();
    let resumed_state = r.state_digest().unwrap();
    let resumed = (RESUME_AT..STEPS).map(|_| r.step().unwrap()).collect();
    Trial {
        reference,
        saved: saved.expect("saved at RESUME_AT"),
        resumed_state,
        resumed,
    }
}

/// The first resumed step and figure that differ from the reference, bitwise.
fn first_divergence(t: &Trial) -> Option<(u64, &'static str)> {
    for s in &t.resumed {
        let want = &t.reference[s.step as usize];
        let fields = [
            ("batch", want.batch_digest == s.batch_digest),
            ("lr", want.lr.to_bits() == s.lr.to_bits()),
            ("loss", want.loss.to_bits() == s.loss.to_bits()),
            (
                "grad_norm",
                want.grad_norm.to_bits() == s.grad_norm.to_bits(),
            ),
        ];
        if let Some((name, _)) = fields.iter().find(|(_, same)| !same) {
            return Some((s.step, name));
        }
    }
    None
}

fn assert_faithful(t: &Trial, what: &str) {
    assert_eq!(first_divergence(t), None, "{what}");
    assert_eq!(t.resumed_state, t.saved, "{what}");
}

#[test]
fn resume_with_dropout_and_long_rows_is_bitwise_and_dropout_zero_changes_nothing() {
    let mut cfg = config(&[]);
    cfg.dropout = 0.1;
    cfg.long_batch = Some(LongBatch {
        from_step: 2,
        seq_len: 24,
    });
    let t = trial(&cfg);
    assert_faithful(&t, "dropout 0.1, long rows from step 2");
    assert_eq!(t.saved.rng.offset, RESUME_AT);
    let bf16 = TrainConfig {
        precision: Precision::Bf16Mixed,
        ..cfg.clone()
    };
    assert_faithful(
        &trial(&bf16),
        "bf16-mixed, dropout 0.1, long rows from step 2",
    );
    let plain = trial(&config(&[]));
    assert_faithful(&plain, "no dropout");
    assert!(
        plain.reference[0].loss != t.reference[0].loss,
        "dropout acts"
    );
    let mut zero = config(&[]);
    zero.long_batch = cfg.long_batch;
    let z = trial(&zero);
    assert_faithful(&z, "long rows, no dropout");
    assert_eq!(
        z.reference[..2],
        plain.reference[..2],
        "dropout 0 is no dropout"
    );
}

#[test]
fn rng_not_restored_changes_the_first_resumed_step_under_dropout() {
    let mut cfg = config(&[Fault::RngNotRestored]);
    cfg.dropout = 0.1;
    let t = trial(&cfg);
    let step = &t.resumed[0];
    let want = &t.reference[RESUME_AT as usize];
    println!(
        "rng_not_restored: resumed offset {} (saved {}); step {} loss {} vs reference {}",
        t.resumed_state.rng.offset, t.saved.rng.offset, step.step, step.loss, want.loss
    );
    assert_eq!(first_divergence(&t), Some((RESUME_AT, "loss")));
    assert_eq!(t.resumed_state.rng.offset, 0);
    assert_eq!(t.saved.rng.offset, RESUME_AT);
    assert_eq!(step.batch_digest, want.batch_digest);
}

#[test]
fn loader_position_not_restored_replays_the_first_batches() {
    let t = trial(&config(&[Fault::LoaderPositionNotRestored]));
    let step = &t.resumed[0];
    println!(
        "loader_position_not_restored: resumed loader {:?} (saved {:?}); step {} loss {} vs reference {}",
        t.resumed_state.loader, t.saved.loader, step.step, step.loss, t.reference[RESUME_AT as usize].loss
    );
    assert_eq!(first_divergence(&t), Some((RESUME_AT, "batch")));
    assert_eq!(step.batch_digest, t.reference[0].batch_digest);
    assert_eq!(t.resumed_state.loader.position, 0);
    assert_ne!(t.resumed_state.loader, t.saved.loader);
}

#[test]
fn a_checkpoint_saved_before_the_first_step_resumes_without_moments_like_a_fresh_run() {
    let cfg = config(&[]);
    let dir = tempfile::tempdir().unwrap();
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let mut fresh = Trainer::new(cfg.clone(), dev.clone()).unwrap();
    fresh.save(dir.path(), None).unwrap();
    let want = fresh.step().unwrap();
    drop(fresh);
    let mut resumed = Trainer::resume(cfg, dev, &dir.path().join(step_dir_name(0))).unwrap();
    let held = resumed.tracker().stats().current;
    assert_eq!(
        held.optimizer, 0,
        "moments come with the first step: {held:?}"
    );
    let got = resumed.step().unwrap();
    let figures = |s: &StepStats| (s.loss.to_bits(), s.memory.allocated, s.memory.at_peak);
    assert_eq!(figures(&got), figures(&want));
}

/// A dataset of `samples` samples in `config`'s run (2 rows a step).
fn with_samples(mut cfg: TrainConfig, samples: u64) -> TrainConfig {
    cfg.data = DataConfig::Synthetic {
        seed: 3,
        samples,
        branching: 4,
        min_len: None,
    };
    cfg
}

#[test]
fn epoch_skipped_at_boundary_skips_an_epoch_only_when_resumed_at_its_end() {
    // 6 samples, 2 a step: the checkpoint of step 3 is written at the end of epoch 0.
    let t = trial(&with_samples(config(&[Fault::EpochSkippedAtBoundary]), 6));
    println!(
        "epoch_skipped_at_boundary: resumed loader {:?} (saved {:?})",
        t.resumed_state.loader, t.saved.loader
    );
    assert_eq!(first_divergence(&t), Some((RESUME_AT, "batch")));
    assert_eq!(t.saved.loader.position, 6);
    assert_eq!(t.resumed_state.loader.epoch, t.saved.loader.epoch + 2);
    let epochs = |steps: &[StepStats]| -> Vec<u64> {
        steps
            .iter()
            .flat_map(|s| s.samples.iter().map(|id| id.epoch))
            .collect()
    };
    assert_eq!(epochs(&t.reference[RESUME_AT as usize..]), [1; 6]);
    assert_eq!(epochs(&t.resumed), [2; 6], "epoch 1 is skipped");
    let faithful = trial(&with_samples(config(&[]), 6));
    assert_faithful(&faithful, "resumed at an epoch's end");
    // 7 samples: the checkpoint is written mid-epoch, where the fault does nothing.
    let mid = trial(&with_samples(config(&[Fault::EpochSkippedAtBoundary]), 7));
    assert_faithful(&mid, "resumed mid-epoch with the fault");
}

#[test]
fn resume_with_accumulation_is_bitwise_for_dense_and_moe_models() {
    for mut cfg in [config(&[]), moe_config(2, &[])] {
        cfg.accumulation = 3;
        cfg.dropout = 0.1;
        let t = trial(&cfg);
        assert_faithful(&t, "accumulation 3");
        assert_eq!(t.saved.loader.position, RESUME_AT * 3 * 2);
        assert_eq!(t.saved.rng.offset, RESUME_AT * 3);
    }
}

#[test]
fn loader_position_counts_steps_rereads_samples_with_accumulation_only() {
    let mut cfg = config(&[Fault::LoaderPositionCountsSteps]);
    cfg.accumulation = 3;
    let t = trial(&cfg);
    let step = &t.resumed[0];
    println!(
        "loader_position_counts_steps: resumed loader {:?} (saved {:?}); step {} loss {} vs reference {}",
        t.resumed_state.loader, t.saved.loader, step.step, step.loss, t.reference[RESUME_AT as usize].loss
    );
    assert_eq!(first_divergence(&t), Some((RESUME_AT, "batch")));
    // Steps 0..3 read 18 samples; the checkpoint says 6, so step 3 reads step 1's.
    assert_eq!(t.saved.loader.position, 18);
    assert_eq!(t.resumed_state.loader.position, 6);
    assert_eq!(step.batch_digest, t.reference[1].batch_digest);
    assert_faithful(
        &trial(&config(&[Fault::LoaderPositionCountsSteps])),
        "one micro-batch per step",
    );
}

/// Two resumes in a chain: the reference saves at step 2; a run resumed there saves at step 4
/// into its own directory; a second run resumes from that. Returns the reference's steps, its
/// state before every step, and the two resumed runs.
fn chained_trial(cfg: &TrainConfig) -> (Vec<StepStats>, Vec<StateDigest>, Vec<Trial>) {
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let dirs = [(); 2].map(|_| tempfile::tempdir().unwrap());
    let mut t = Trainer::new(cfg.clone(), dev.clone()).unwrap();
    let mut reference = Vec::new();
    let mut states = Vec::new();
    while t.step_index() < STEPS {
        states.push(t.state_digest().unwrap());
        reference.push(t.step().unwrap());
        if t.step_index() == 2 {
            t.save(dirs[0].path(), None).unwrap();
        }
    }
    drop(t);
    let mut trials = Vec::new();
    for (i, (at, saves_at)) in [(2, Some(4)), (4, None)].into_iter().enumerate() {
        let ckpt = dirs[i].path().join(step_dir_name(at));
        let mut r = Trainer::resume(cfg.clone(), dev.clone(), &ckpt).unwrap();
        let resumed_state = r.state_digest().unwrap();
        let mut resumed = Vec::new();
        while r.step_index() < STEPS {
            resumed.push(r.step().unwrap());
            if Some(r.step_index()) == saves_at {
                r.save(dirs[i + 1].path(), None).unwrap();
            }
        }
        trials.push(Trial {
            reference: reference.clone(),
            saved: states[at as usize].clone(),
            resumed_state,
            resumed,
        });
    }
    (reference, states, trials)
}

#[test]
fn loader_offset_lost_on_resave_rereads_data_only_on_the_second_resume() {
    let (reference, states, trials) = chained_trial(&config(&[Fault::LoaderOffsetLostOnResave]));
    let (first, second) = (&trials[0], &trials[1]);
    assert_faithful(first, "resumed from the reference's checkpoint");
    println!(
        "loader_offset_lost_on_resave: second resume's loader {:?} (reference {:?})",
        second.resumed_state.loader, states[4].loader
    );
    assert_eq!(first_divergence(second), Some((4, "batch")));
    // Steps 2..4 read 4 samples; the resumed run saved those alone, not the 4 before them.
    assert_eq!(states[4].loader.position, 8);
    assert_eq!(second.resumed_state.loader.position, 4);
    assert_eq!(second.resumed[0].batch_digest, reference[2].batch_digest);
    let (_, _, clean) = chained_trial(&config(&[]));
    for (i, t) in clean.iter().enumerate() {
        assert_faithful(
            t,
            &format!("resume {} of the chain without the fault", i + 1),
        );
    }
}

#[test]
fn schedule_reset_restarts_the_learning_rate() {
    let t = trial(&config(&[Fault::ScheduleReset]));
    let step = &t.resumed[0];
    let want = &t.reference[RESUME_AT as usize];
    println!(
        "schedule_reset: step {} lr {} (reference {}, step 0's {}); next_lr after resume {} vs saved {}",
        step.step, step.lr, want.lr, t.reference[0].lr, t.resumed_state.next_lr, t.saved.next_lr
    );
    assert_eq!(first_divergence(&t), Some((RESUME_AT, "lr")));
    assert_eq!(step.lr.to_bits(), t.reference[0].lr.to_bits());
    assert_ne!(t.resumed_state.next_lr, t.saved.next_lr);
}

#[test]
fn moments_not_saved_loads_but_diverges_after_the_first_resumed_update() {
    let cfg = config(&[Fault::MomentsNotSaved]);
    let t = trial(&cfg);
    let (second, want) = (&t.resumed[1], &t.reference[RESUME_AT as usize + 1]);
    println!(
        "moments_not_saved: step {} loss {} vs reference {}; optimizer digest {} vs saved {}",
        second.step, second.loss, want.loss, t.resumed_state.optimizer, t.saved.optimizer
    );
    // The first resumed step's loss comes before its update; the update uses zeroed moments.
    assert_eq!(first_divergence(&t), Some((RESUME_AT + 1, "loss")));
    assert_ne!(t.resumed_state.optimizer, t.saved.optimizer);
    assert_eq!(t.resumed_state.params, t.saved.params);
    assert_eq!(t.resumed_state.optimizer_steps, t.saved.optimizer_steps);

    // The checkpoint holds no moments, and a correct engine refuses it.
    let dir = tempfile::tempdir().unwrap();
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let mut tr = Trainer::new(cfg, dev.clone()).unwrap();
    tr.step().unwrap();
    let ckpt = tr.save(dir.path(), None).unwrap();
    drop(tr);
    let opt = std::fs::read(ckpt.join(OPTIMIZER_FILE)).unwrap();
    let names = safetensors::SafeTensors::deserialize(&opt)
        .unwrap()
        .names()
        .len();
    assert_eq!(names, 0, "fp32 keeps no master copy, so nothing is left");
    let err = Trainer::resume(config(&[]), dev, &ckpt)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("holds no AdamW moments"), "{err}");
}

fn model(cfg: &TrainConfig, dev: &CpuDevice) -> Estimate {
    estimate(&EstimateConfig::from_train(
        cfg,
        Like::Cpu {
            threads: dev.threads(),
        },
    ))
    .unwrap()
}

/// Per step: recomputed blocks, measured peak, predicted peak, allocated bytes after it.
fn memory_run(cfg: &TrainConfig, steps: u64) -> (Vec<(usize, u64, u64, u64)>, u64) {
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let est = model(cfg, &dev);
    let mut t = Trainer::new(cfg.clone(), dev.clone()).unwrap();
    let rows = (0..steps)
        .map(|_| {
            let s = t.step().unwrap();
            let want = est.at_step(s.step).peak;
            let held = dev.tracker().allocated();
            (s.recomputed_blocks, s.memory.allocated.peak, want, held)
        })
        .collect();
    drop(t);
    (rows, dev.tracker().allocated())
}

#[test]
fn checkpointing_skipped_nested_keeps_later_blocks_and_exceeds_the_estimate() {
    for policy in [Checkpointing::Full, Checkpointing::Selective] {
        let mut clean = config(&[]);
        clean.checkpointing = policy;
        // Long enough rows that activations, not AdamW's first allocation, set every peak.
        clean.seq_len = 64;
        let (rows, _) = memory_run(&clean, 3);
        for &(recomputed, peak, want, _) in &rows {
            assert_eq!((recomputed, peak), (LAYERS, want), "{policy:?}");
        }
        let mut faulty = clean.clone();
        faulty.faults = [Fault::CheckpointingSkippedNested].into_iter().collect();
        let (rows, _) = memory_run(&faulty, 3);
        for (step, &(recomputed, peak, want, _)) in rows.iter().enumerate() {
            println!(
                "checkpointing_skipped_nested {policy:?}: step {step} recomputed {recomputed} of {LAYERS}, peak {peak} vs estimate {want} (+{})",
                peak - want
            );
            assert_eq!(recomputed, 1);
            assert!(peak > want, "{policy:?} step {step}: {peak} <= {want}");
        }
    }
}

#[test]
fn recompute_inputs_kept_grow_memory_at_every_step_boundary() {
    let mut clean = config(&[]);
    clean.checkpointing = Checkpointing::Full;
    let (rows, after_drop) = memory_run(&clean, 4);
    for &(_, peak, want, _) in &rows {
        assert_eq!(peak, want);
    }
    assert!(rows[1..].iter().all(|r| r.3 == rows[1].3), "flat: {rows:?}");
    assert_eq!(after_drop, 0);

    let mut faulty = clean.clone();
    faulty.faults = [Fault::RecomputeInputsKept].into_iter().collect();
    let (rows, after_drop) = memory_run(&faulty, 4);
    // Each step keeps every block's input: 2 rows × 16 tokens × 32 wide × 4 bytes × 3 blocks.
    let per_step = 2 * 16 * 32 * 4 * LAYERS as u64;
    for (step, w) in rows.windows(2).enumerate() {
        println!(
            "recompute_inputs_kept: allocated after step {} {} -> after step {} {} (+{}); peak {} vs estimate {}",
            step,
            w[0].3,
            step + 1,
            w[1].3,
            w[1].3 - w[0].3,
            w[1].1,
            w[1].2
        );
        assert_eq!(w[1].3 - w[0].3, per_step);
        assert!(w[1].1 > w[1].2);
    }
    assert_eq!(after_drop, 0, "the trainer frees them when dropped");
}

/// [`config`]'s model as a Qwen3-MoE of `layers` blocks: 4 experts, top-2, expert width 16.
fn moe_config(layers: usize, faults: &[Fault]) -> TrainConfig {
    let mut cfg = config(faults);
    let m = &mut cfg.model;
    m.num_hidden_layers = layers;
    m.family = Family::Qwen3Moe;
    m.moe = Some(MoeConfig {
        num_experts: 4,
        num_experts_per_tok: 2,
        moe_intermediate_size: 16,
        norm_topk_prob: true,
        router_aux_loss_coef: 0.01,
        decoder_sparse_step: 1,
        mlp_only_layers: vec![],
    });
    cfg.checkpointing = Checkpointing::Full;
    cfg
}

#[test]
fn moe_dispatch_kept_grows_with_the_recomputed_moe_layers() {
    for layers in 1..=3 {
        let (rows, after_drop) = memory_run(&moe_config(layers, &[]), 4);
        assert!(rows[1..].iter().all(|r| r.3 == rows[1].3), "flat: {rows:?}");
        assert_eq!(after_drop, 0);

        let (rows, after_drop) = memory_run(&moe_config(layers, &[Fault::MoeDispatchKept]), 4);
        // Every row goes to 2 experts, and each expert's rows and their gradient are kept:
        // 2 × (2 rows × 16 tokens × top-2) × 32 wide × 4 bytes per recomputed MoE layer.
        let per_step = 2 * (2 * 16 * 2) * 32 * 4 * layers as u64;
        for (step, w) in rows.windows(2).enumerate() {
            println!(
                "moe_dispatch_kept, {layers} MoE layers: allocated after step {step} {} -> {} (+{})",
                w[0].3,
                w[1].3,
                w[1].3 - w[0].3
            );
            assert_eq!(w[1].3 - w[0].3, per_step, "{layers} layers");
        }
        assert_eq!(after_drop, 0, "the trainer frees them when dropped");
    }
}

#[test]
fn optimizer_state_retained_outlives_the_trainer() {
    let (_, after_drop) = memory_run(&config(&[]), 2);
    assert_eq!(after_drop, 0);
    let cfg = config(&[Fault::OptimizerStateRetained]);
    let (_, after_drop) = memory_run(&cfg, 2);
    let moments = 2 * 4 * cfg.model.num_params() as u64;
    println!(
        "optimizer_state_retained: {after_drop} bytes allocated after drop (moments {moments})"
    );
    assert_eq!(after_drop, moments);
}

/// Each resumed step's peak above the reference's same step, and the bytes held when the
/// resumed trainer was loaded above those when the reference saved.
fn resumed_excess(t: &Trial) -> Vec<u64> {
    t.resumed
        .iter()
        .map(|s| {
            let want = t.reference[s.step as usize].memory.allocated.peak;
            s.memory.allocated.peak - want.min(s.memory.allocated.peak)
        })
        .collect()
}

#[test]
fn optimizer_state_allocated_at_load_holds_a_second_copy_through_the_first_resumed_step() {
    let clean = trial(&config(&[]));
    assert_eq!(
        resumed_excess(&clean),
        [0, 0, 0],
        "a resume holds what the run held"
    );
    let cfg = config(&[Fault::OptimizerStateAllocatedAtLoad]);
    let t = trial(&cfg);
    assert_faithful(&t, "optimizer_state_allocated_at_load");
    let moments = 2 * 4 * cfg.model.num_params() as u64;
    let excess = resumed_excess(&t);
    println!("optimizer_state_allocated_at_load: resumed step peaks above the reference's {excess:?} (moments {moments})");
    assert_eq!(excess, [moments, 0, 0]);
    let first = &t.resumed[0].memory;
    assert_eq!(
        first.allocated.current, t.resumed[1].memory.allocated.current,
        "freed by the first step's end"
    );
}

#[test]
fn long_rows_spike_the_peak_exactly_as_the_estimate_predicts() {
    let mut cfg = config(&[]);
    cfg.long_batch = Some(LongBatch {
        from_step: 2,
        seq_len: 64,
    });
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let est = model(&cfg, &dev);
    let mut t = Trainer::new(cfg, dev).unwrap();
    let peaks: Vec<u64> = (0..4)
        .map(|_| {
            let s = t.step().unwrap();
            assert_eq!(s.memory.allocated.peak, est.at_step(s.step).peak);
            s.memory.allocated.peak
        })
        .collect();
    let base = est.step(true).peak;
    println!("long_batch: step peaks {peaks:?}; run-length estimate {base}");
    assert_eq!(peaks[1], base);
    assert!(peaks[2] > base && peaks[3] == peaks[2]);
}
