//! The plan of every step (`ckpt_harness::forecast`) against a run of the same suite: every
//! step's and evaluation's measured peak on every rank of every phase is the one planned before
//! anything ran, to the byte on the CPU; and a budget the plan breaks stops the run before it
//! trains, naming the step that `peak_budget` fails at when the suite runs it anyway.

// Each test binary uses part of what the tests share.
#[allow(dead_code)]
mod common;

use ckpt_engine::backend::count::Like;
use ckpt_harness::devices::DeviceKind;
use ckpt_harness::forecast::Forecast;
use ckpt_harness::run::trial::{self, GoldenMode, TrialResult};
use ckpt_harness::suite::Suite;
use std::path::Path;

/// SQuAD-shaped conversations padded to each micro-batch's longest sample, a held-out split
/// evaluated every 3 steps, resumed on 2 ranks mid-run and at `max_steps`.
fn suite_text(extra: &str) -> String {
    let data = common::root().join("suites/data");
    let data = data.display();
    format!(
        "name: planned
model: {{vocab_size: 512, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 512}}
init: {{kind: random, seed: 21, std: 0.05}}
precision: fp32
data:
  kind: text
  path: {data}/squad-sft.jsonl
  columns: {{messages: messages}}
  tokenizer: {data}/tokenizer
  overlong: truncate
validation: {{share: 0.1, every: 3}}
devices: [cpu]
checks: {{golden: false}}
batch_size: 2
seq_len: 384
shuffle_seed: 5
optimizer: {{lr: 0.003}}
training: {{max_steps: 6, extra_steps: 3, resume_from: 3, accumulation: 2}}
threads: 2
parallel: {{world_size: 1, resume_world_sizes: [2, 2]}}
{extra}"
    )
}

fn suite(dir: &Path, extra: &str) -> Suite {
    let path = dir.join("planned.yaml");
    std::fs::write(&path, suite_text(extra)).unwrap();
    Suite::load(&path).unwrap()
}

fn run(suite: &Suite) -> TrialResult {
    trial::run(
        suite,
        DeviceKind::Cpu,
        Path::new("golden"),
        GoldenMode::Check,
        &mut (),
    )
}

fn plan(suite: &Suite) -> Forecast {
    Forecast::of(suite, Like::new(DeviceKind::Cpu, suite.file.threads)).unwrap()
}

#[test]
fn every_step_and_evaluation_peaks_as_planned_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let suite = suite(dir.path(), "");
    let forecast = plan(&suite);
    let peaks: std::collections::BTreeSet<u64> = (forecast.phases.iter())
        .flat_map(|p| &p.steps)
        .map(|s| s.ranks[0].peak)
        .collect();
    assert!(peaks.len() > 3, "the steps' shapes differ: {peaks:?}");
    let t = run(&suite);
    assert!(t.passed, "{}", t.verdict);
    let (mut steps, mut evaluations) = (0, 0);
    for view in t.record.views() {
        let rank = view.rank.unwrap_or(0);
        for p in &view.record.phases {
            let planned = forecast
                .phases
                .iter()
                .find(|f| f.planned.phase == p.phase)
                .unwrap();
            let base = p.before.total();
            assert_eq!(p.steps.len(), planned.steps.len(), "{}", p.phase);
            for (s, want) in p.steps.iter().zip(&planned.steps) {
                assert_eq!(s.step, want.step);
                let own = s.memory.allocated.peak - base;
                assert_eq!(
                    own, want.ranks[rank].peak,
                    "{} step {} rank {rank}",
                    p.phase, s.step
                );
                steps += 1;
            }
            assert_eq!(
                p.evaluations.len(),
                planned.evaluations.len(),
                "{}",
                p.phase
            );
            for (e, want) in p.evaluations.iter().zip(&planned.evaluations) {
                assert_eq!(e.step, want.step);
                let own = e.memory.allocated.peak - base;
                assert_eq!(
                    own, want.rank_peaks[rank],
                    "{} evaluation {}",
                    p.phase, e.step
                );
                evaluations += 1;
            }
        }
    }
    // 9 steps on 1 rank, then 6 and 3 on each of 2; 3 evaluations, then 2 and 1 on each of 2.
    assert_eq!((steps, evaluations), (9 + 2 * (6 + 3), 3 + 2 * (2 + 1)));
}

/// A budget one byte under the plan's highest step peak stops the run before it trains,
/// naming that step and its samples; with `peak_budget` expected to fail, the run goes on and
/// fails it first at that very step.
#[test]
fn a_budget_the_plan_breaks_stops_the_run_at_the_step_it_names() {
    let dir = tempfile::tempdir().unwrap();
    let forecast = plan(&suite(dir.path(), ""));
    let (phase, step) = forecast.highest_step().unwrap();
    let (_, peak) = step.highest();
    let budget = format!("memory: {{budget: {}}}\n", peak - 1);
    let t = run(&suite(dir.path(), &budget));
    assert!(!t.passed);
    let named = format!(
        "{} step {} is predicted to peak at",
        phase.planned.phase, step.step
    );
    assert!(
        t.verdict
            .contains("the plan breaks the budget before anything runs"),
        "{}",
        t.verdict
    );
    assert!(t.verdict.contains(&named), "{named}: {}", t.verdict);
    assert!(t.record.phases.is_empty(), "nothing trained");
    let sample = &forecast.data.steps[step.step as usize][0].samples[0];
    let listed = format!("samples {} ({} tokens)", sample.index, sample.tokens);
    assert!(t.verdict.contains(&listed), "{listed}: {}", t.verdict);

    let expected = format!("{budget}expect_fail: [peak_budget]\n");
    let t = run(&suite(dir.path(), &expected));
    assert!(t.passed, "{}", t.verdict);
    let failed = t
        .checks
        .iter()
        .find(|o| o.check.to_string() == "peak_budget")
        .unwrap();
    let first = &failed.failures[0];
    assert_eq!(
        (first.phase, first.step),
        (Some(phase.planned.phase), Some(step.step)),
        "{first}"
    );
}
