//! The memory model against measured trajectories: every golden snapshot under `golden/<device>/`
//! records, for each reference step of a CI suite, the tracker's step peak and the bytes of every
//! category at the peak and at the step's end, as measured on that device (`golden/cuda/` on an
//! NVIDIA H100). The estimate for the same backend must give the same figures; the other
//! backend's estimate must not, which shows the comparison can fail. A snapshot is required for
//! every suite that needs one (see [`needs_snapshot`]), so none can vanish unnoticed.

use ckpt_engine::backend::count::{Like, Routes};
use ckpt_engine::estimate::{estimate, recorded_steps, Estimate, EstimateConfig};
use ckpt_engine::memory::Breakdown;

use ckpt_harness::checks::{golden, Check};
use ckpt_harness::suite::{Suite, Tier};
use common::{root, suites_in};

// Each test binary uses part of what the tests share.
#[allow(dead_code)]
mod common;

/// One measured step of a snapshot.
#[derive(Debug, PartialEq)]
struct Row {
    step: u64,
    peak: u64,
    at_peak: Breakdown,
    end: Breakdown,
    /// A MoE step's tokens per expert, per block (empty for a dense block).
    tokens_per_expert: Vec<Vec<u32>>,
}

/// A snapshot's bytes per category, in its header's order:
/// params grads optimizer activations workspace io.
fn breakdown(field: &str) -> Breakdown {
    let values: Vec<u64> = field
        .split_whitespace()
        .map(|v| v.parse().expect("a byte count"))
        .collect();
    let values: [u64; 6] = values
        .try_into()
        .unwrap_or_else(|v| panic!("{field:?}: {v:?} is not one byte count per category"));
    Breakdown::from(values)
}

/// The step rows of a snapshot's text (`step | loss | lr | peak | at peak | at end`), each
/// with the tokens per expert of the line after it, if a MoE step's.
fn rows(text: &str) -> Vec<Row> {
    let mut out: Vec<Row> = Vec::new();
    for l in text.lines() {
        if let Some(tokens) = l.strip_prefix(golden::TOKENS_PER_EXPERT) {
            let row = out.last_mut().expect("tokens per expert follow a step row");
            row.tokens_per_expert = tokens
                .split(" | ")
                .map(|block| match block {
                    "-" => Vec::new(),
                    counts => counts.split(' ').map(|c| c.parse().unwrap()).collect(),
                })
                .collect();
        } else if l.starts_with(|c: char| c.is_ascii_digit()) {
            let f: Vec<&str> = l.split(" | ").collect();
            assert_eq!(f.len(), 6, "{l:?}");
            out.push(Row {
                step: f[0].parse().unwrap(),
                peak: f[3].parse().unwrap(),
                at_peak: breakdown(f[4]),
                end: breakdown(f[5]),
                tokens_per_expert: Vec::new(),
            });
        }
    }
    out
}

/// Each step's micro-batch lengths, drawn as the trainer draws them, for the steps of
/// `measured`: empty for a step of the run's own length.
fn seq_lens(suite: &Suite, measured: &[Row]) -> Vec<Vec<usize>> {
    let run = &suite.train;
    let mut loader = run.loader().unwrap();
    let last = measured.iter().map(|m| m.step).max().unwrap_or(0);
    (0..=last)
        .map(|step| {
            let seq = run.seq_len_at(step);
            let batches = loader.next_step(run.accumulation, seq).unwrap();
            let lens: Vec<usize> = batches.iter().map(|b| b.seq).collect();
            match lens.iter().all(|&l| l == seq) {
                true => Vec::new(),
                false => lens,
            }
        })
        .collect()
}

/// What the estimate says of the steps of `measured`: a MoE step's at the routing it recorded,
/// a step of text at its micro-batches' lengths.
fn predicted(e: &Estimate, suite: &Suite, measured: &[Row]) -> Vec<Row> {
    let shapes = seq_lens(suite, measured);
    measured
        .iter()
        .map(|m| {
            let own;
            let lens = &shapes[m.step as usize];
            let s = match m.tokens_per_expert.is_empty() && lens.is_empty() {
                true => e.at_step(m.step),
                false => {
                    let mut cfg = e.config.clone().with_seq_lens(lens.clone());
                    if !m.tokens_per_expert.is_empty() {
                        cfg = cfg.with_routes(Routes::Recorded(m.tokens_per_expert.clone()));
                    }
                    let seq = e.config.run.seq_len_at(m.step);
                    own = recorded_steps(&cfg, seq).unwrap();
                    &own[usize::from(m.step > 0)]
                }
            };
            // A step after an asynchronous save holds its staging buffers until its end: all of
            // them on rank 0 in one process, rank 0's own rows where ranks are processes.
            let staged = match suite.rank_processes() {
                true => e.save_staging_on_process_ranks()[0],
                false => e.save_staging_on_device(),
            };
            let staging =
                match suite.file.training.async_save && m.step > 0 && suite.saves_at(0, m.step) {
                    true => staged,
                    false => 0,
                };
            Row {
                step: m.step,
                peak: s.peak + staging,
                at_peak: Breakdown {
                    io: s.at_peak.io + staging,
                    ..s.at_peak
                },
                end: s.end,
                tokens_per_expert: m.tokens_per_expert.clone(),
            }
        })
        .collect()
}

/// Whether `suite` must have a snapshot for `device`: the suite runs there with `golden` on, and
/// it is a CI suite or the device is the CPU (every tier's CPU snapshot is blessed here; CUDA
/// snapshots need a GPU, and the nightly suites' are not written yet).
fn needs_snapshot(suite: &Suite, device: &str) -> bool {
    suite.file.checks.enabled(Check::Golden)
        && suite.devices().iter().any(|d| d.name() == device)
        && (suite.file.tier == Tier::Ci || device == "cpu")
}

/// The snapshots that a suite needs and that only its device can write, not blessed yet (a new
/// CI suite's CUDA trajectory, to be blessed on a GPU with `ckpt-harness run --device cuda
/// --bless`). Each must still be missing: the test fails once one is written, so that its entry
/// goes. The fine-tuning suites' (2026-12-02) await a lent card.
const AWAITING_THEIR_DEVICE: [(&str, &str); 4] = [
    ("cuda", "sft-chat"),
    ("cuda", "sft-prompt-completion"),
    ("cuda", "sft-packed"),
    ("cuda", "phi4-squad"),
];

/// Whether `device`/`suite` is listed in [`AWAITING_THEIR_DEVICE`].
fn awaits_its_device(device: &str, suite: &str) -> bool {
    AWAITING_THEIR_DEVICE.contains(&(device, suite))
}

/// Every suite of `suites/` with a snapshot for `device`, with its measured rows; panics naming
/// every suite that needs a snapshot there and has none (those awaiting their device aside),
/// and every suite awaiting its device that has one.
fn measured(device: &str) -> Vec<(Suite, Vec<Row>)> {
    let mut out = Vec::new();
    let mut missing = Vec::new();
    let mut awaiting = Vec::new();
    for suite in suites_in("suites") {
        let snap = golden::load(&root().join("golden"), device, &suite.file.name).unwrap();
        let awaited = awaits_its_device(device, &suite.file.name);
        match snap.stored {
            Some(_) if awaited => panic!(
                "{}: blessed; remove it from AWAITING_THEIR_DEVICE",
                snap.file
            ),
            Some(text) => {
                let rows = rows(&text);
                assert!(!rows.is_empty(), "{}: no step rows", snap.file);
                out.push((suite, rows));
            }
            None if needs_snapshot(&suite, device) => {
                if awaited {
                    awaiting.push(suite.file.name.clone());
                } else {
                    missing.push(snap.file);
                }
            }
            None => {}
        }
    }
    let listed = AWAITING_THEIR_DEVICE.iter().filter(|(d, _)| *d == device);
    assert_eq!(
        listed.count(),
        awaiting.len(),
        "{device}: AWAITING_THEIR_DEVICE lists a suite that is gone or needs no snapshot; found {awaiting:?}"
    );
    assert!(
        missing.is_empty(),
        "{device}: missing snapshots {missing:?}: bless them on that device with `ckpt-harness run --bless`"
    );
    out
}

fn backend(device: &str, suite: &Suite) -> Like {
    match device {
        "cuda" => Like::Cuda,
        _ => Like::Cpu {
            threads: suite.file.threads,
        },
    }
}

fn model(suite: &Suite, backend: Like) -> Estimate {
    estimate(&EstimateConfig::from_train(&suite.train, backend)).unwrap()
}

fn equals_the_measurements_of(device: &str) {
    let suites = measured(device);
    assert!(suites.len() >= 4, "{device}: {} snapshots", suites.len());
    for (suite, rows) in &suites {
        let e = model(suite, backend(device, suite));
        assert_eq!(
            predicted(&e, suite, rows),
            *rows,
            "{device}::{}: the estimate differs from the snapshot",
            suite.file.name
        );
    }
}

#[test]
fn the_cpu_estimate_equals_the_cpu_snapshots_to_the_byte() {
    equals_the_measurements_of("cpu");
}

#[test]
fn the_cuda_estimate_equals_the_gpu_snapshots_to_the_byte() {
    equals_the_measurements_of("cuda");
}

/// The bf16 suite's products widen into workspace on the CPU and not on the GPU, which uploads
/// its batch instead: each backend's model misses the other's measurements.
#[test]
fn each_backend_s_model_misses_the_other_s_measurements() {
    for (device, other) in [("cpu", "cuda"), ("cuda", "cpu")] {
        let misses = measured(device)
            .iter()
            .filter(|(suite, rows)| {
                predicted(&model(suite, backend(other, suite)), suite, rows) != *rows
            })
            .count();
        assert!(misses > 0, "the {other} model fits every {device} snapshot");
    }
}
