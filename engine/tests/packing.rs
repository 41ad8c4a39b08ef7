//! Packed fine-tuning rows: whole samples one after another in rows of a fixed length, positions
//! restarting and attention kept within each sample, the sample that does not fit carried to the
//! next row (the pack in flight) and kept in the loader's state, so that a loader restored at any
//! step, mid-pack or at an epoch boundary, hands out the same batches.

mod common;

use ckpt_engine::data::text::{Columns, Labels, Overlong, Padding, TextData};
use ckpt_engine::data::{DataConfig, DataLoader, LoaderState, SampleId};
use ckpt_engine::memory::Category;
use ckpt_engine::model::loss::{LossKind, IGNORE_INDEX};
use ckpt_engine::model::{weights, Batch, Checkpointing, Model, Params};
use ckpt_engine::{CpuDevice, Tensor};
use std::collections::BTreeSet;
use std::path::Path;

const SEQ: usize = 512;
const ROWS: usize = 2;

fn packed_data() -> DataConfig {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../suites/data");
    DataConfig::Text(TextData {
        path: fixtures.join("squad-sft.jsonl"),
        columns: Columns {
            messages: Some("messages".into()),
            ..Columns::default()
        },
        tokenizer: fixtures.join("tokenizer"),
        labels: Labels::Answer,
        padding: Padding::Packed,
        overlong: Overlong::Truncate,
        group_by_length: false,
    })
}

fn loader() -> DataLoader {
    DataLoader::new(&packed_data(), 512, ROWS, SEQ, 6).unwrap()
}

/// `steps` steps of 3 micro-batches, each with the samples it drew.
fn steps(loader: &mut DataLoader, steps: usize) -> Vec<(Vec<Batch>, Vec<SampleId>)> {
    (0..steps)
        .map(|_| {
            let batches = loader.next_step(3, SEQ).unwrap();
            (batches, loader.take_drawn())
        })
        .collect()
}

#[test]
fn packed_rows_hold_whole_samples_each_at_positions_from_0() {
    let mut loader = loader();
    let drawn = steps(&mut loader, 20);
    let mut seen: BTreeSet<SampleId> = BTreeSet::new();
    let samples = loader.samples();
    let mut several = 0;
    for (batches, ids) in &drawn {
        let mut ids = ids.iter();
        for b in batches {
            assert_eq!((b.batch, b.seq), (ROWS, SEQ));
            let positions = b.positions.as_ref().expect("a packed batch has positions");
            for row in 0..ROWS {
                let at = row * SEQ;
                let mut offset = 0;
                let mut in_row = 0;
                while offset < SEQ && positions[at + offset] == 0 {
                    let id = ids.next().expect("a sample for every document");
                    assert!(seen.insert(*id), "{id} handed out twice");
                    let sample = loader.text_sample(id.index).unwrap();
                    let len = sample.ids.len().min(SEQ);
                    let span = at + offset..at + offset + len;
                    assert_eq!(b.input_ids[span.clone()], sample.ids[..len], "{id}");
                    let want: Vec<u32> = (0..len as u32).collect();
                    assert_eq!(positions[span.clone()], want, "{id}'s positions");
                    for (i, &label) in b.labels[span.clone()].iter().enumerate() {
                        let next = i + 1 < sample.ids.len() && sample.learned[i + 1];
                        let want = match next && i + 1 < len {
                            true => sample.ids[i + 1] as i64,
                            false => IGNORE_INDEX,
                        };
                        assert_eq!(label, want, "{id}: label {i}");
                    }
                    offset += len;
                    in_row += 1;
                }
                several += usize::from(in_row > 1);
                // The rest is padding that learns nothing, its positions going on.
                assert!(b.labels[at + offset..at + SEQ]
                    .iter()
                    .all(|&l| l == IGNORE_INDEX));
                for i in offset.max(1)..SEQ {
                    if i >= offset {
                        assert_eq!(positions[at + i], positions[at + i - 1] + 1);
                    }
                }
            }
        }
        assert!(ids.next().is_none(), "every drawn sample is in a row");
    }
    assert!(several > 20, "rows holding several samples: {several}");
    // Two whole epochs went by: each handed out every sample once.
    for epoch in 0..2 {
        let n = seen.iter().filter(|id| id.epoch == epoch).count() as u64;
        assert_eq!(n, samples, "epoch {epoch}");
    }
}

#[test]
fn a_loader_restored_mid_pack_or_at_an_epoch_boundary_hands_out_the_same_batches() {
    let mut reference = loader();
    let mut states = vec![reference.state()];
    let mut drawn = Vec::new();
    for _ in 0..21 {
        drawn.extend(steps(&mut reference, 1));
        states.push(reference.state());
    }
    let mid_pack = states.iter().filter(|s| s.in_flight.is_some()).count();
    assert!(
        mid_pack >= 18,
        "{mid_pack} of 22 states with a pack in flight"
    );
    let crossings = (states.windows(2))
        .filter(|w| w[1].epoch > w[0].epoch)
        .count();
    assert_eq!(crossings, 2, "the run crosses two epoch boundaries");
    for (step, state) in states.iter().enumerate().take(21) {
        let mut restored = loader();
        restored.set_state(*state);
        assert_eq!(
            steps(&mut restored, 21 - step),
            drawn[step..],
            "restored at step {step} ({state:?})"
        );
    }
}

#[test]
fn a_pack_in_flight_lost_on_restore_shifts_every_later_batch() {
    let mut reference = loader();
    let state = (0..5)
        .map(|_| steps(&mut reference, 1))
        .last()
        .map(|_| reference.state())
        .unwrap();
    let in_flight = state.in_flight.expect("a pack in flight after step 5");
    let next = steps(&mut reference, 1);
    let mut dropped = loader();
    dropped.set_state(LoaderState {
        in_flight: None,
        ..state
    });
    let shifted = steps(&mut dropped, 1);
    assert_ne!(shifted, next);
    assert_eq!(next[0].1[0], in_flight);
    assert!(!shifted[0].1.contains(&in_flight));
}

#[test]
fn a_loader_state_saved_before_packing_reads_with_no_pack_in_flight() {
    let old: LoaderState =
        serde_json::from_str(r#"{"epoch": 1, "position": 7, "shuffle_seed": 3}"#).unwrap();
    assert_eq!(old.in_flight, None);
    let packed = LoaderState {
        in_flight: Some(SampleId { epoch: 1, index: 9 }),
        ..old
    };
    let json = serde_json::to_string(&packed).unwrap();
    assert_eq!(serde_json::from_str::<LoaderState>(&json).unwrap(), packed);
    assert!(!serde_json::to_string(&old).unwrap().contains("in_flight"));
}

/// A packed row's loss and gradients are the sum of its samples' trained one a row: positions
/// restart and no token attends across a sample's edge.
#[test]
fn a_packed_row_trains_as_its_samples_one_a_row() {
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let mut cfg = common::llama(512, 32, 2);
    cfg.max_position_embeddings = SEQ;
    let model = Model::new(&dev, cfg.clone()).unwrap();
    let mut w = weights::init_params(dev.tracker(), &cfg, 3, 0.1, Category::Params).unwrap();
    let mut loader = loader();
    let packed = loader.next_rows(1, SEQ).unwrap();
    let ids = loader.take_drawn();
    assert!(ids.len() >= 3, "{} samples in the row", ids.len());
    let pass = |w: &mut Params<Tensor<f32>>, batch: &Batch| {
        let mut g = Params::try_new(&cfg, |s| dev.zeros::<f32>(&s.shape, Category::Grads)).unwrap();
        let out = model
            .forward_backward(
                &dev,
                w,
                &mut g,
                batch,
                Checkpointing::None,
                LossKind::Standard,
            )
            .unwrap();
        let grads: Vec<Vec<f32>> = g.tensors().iter().map(|t| t.as_slice().to_vec()).collect();
        (out.ce_sum, grads)
    };
    // Each pass's gradients are of the mean over its counted labels: compare them as sums.
    let counted = |labels: &[i64]| labels.iter().filter(|&&l| l != IGNORE_INDEX).count() as f64;
    let (packed_sum, packed_grads) = pass(&mut w, &packed);
    let packed_grads: Vec<f64> = (packed_grads.iter().flatten())
        .map(|&g| g as f64 * counted(&packed.labels))
        .collect();
    let positions = packed.positions.as_ref().unwrap();
    let starts: Vec<usize> = (0..SEQ).filter(|&i| positions[i] == 0).collect();
    assert_eq!(starts.len(), ids.len());
    let mut sum = 0.0;
    let mut grads = vec![0.0f64; packed_grads.len()];
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(SEQ);
        let alone = Batch {
            batch: 1,
            seq: end - start,
            input_ids: packed.input_ids[start..end].to_vec(),
            labels: packed.labels[start..end].to_vec(),
            positions: None,
        };
        let (s, g) = pass(&mut w, &alone);
        sum += s;
        let n = counted(&alone.labels);
        (grads.iter_mut().zip(g.iter().flatten())).for_each(|(acc, &g)| *acc += g as f64 * n);
    }
    assert!(
        (packed_sum - sum).abs() <= 1e-5 * sum.abs(),
        "packed {packed_sum} vs one a row {sum}"
    );
    let scale = grads.iter().fold(0.0f64, |m, g| m.max(g.abs()));
    let worst = (packed_grads.iter().zip(&grads))
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f64, f64::max);
    assert!(
        worst <= 1e-4 * scale,
        "gradients differ by {worst} of {scale}"
    );
}
