//! The plan of every step (`ckpt_harness::forecast`) against a run of the same suite: every
//! step's and evaluation's measured peak on every rank of every phase is the one planned before
//! anything ran, to the byte on the CPU; and a budget the plan breaks stops the run before it
//! trains, naming the step that `peak_budget` fails at when the suite runs it anyway.

// Each test binary uses part of what the tests share.
#[allow(dead_code)]
mod common;

use ckpt_engine::backend::count::Like;
use ckpt_harness::checks::{Check, Failure};
use ckpt_harness::devices::DeviceKind;
use ckpt_harness::forecast::ladder::{cheapest, ladder};
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

/// The failures of `peak_budget` in `t` at a step or an evaluation (the resident host memory it
/// also holds to a budget is the whole test process's, which other tests share).
fn peak_budget(t: &TrialResult) -> Vec<&Failure> {
    let outcome = (t.checks.iter())
        .find(|o| o.check == Check::PeakBudget)
        .unwrap();
    assert!(outcome.compared > 0);
    outcome
        .failures
        .iter()
        .filter(|f| f.step.is_some())
        .collect()
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
    let failed = peak_budget(&t);
    let first = failed[0];
    assert_eq!(
        (first.phase, first.step),
        (Some(phase.planned.phase), Some(step.step)),
        "{first}"
    );
}

/// phi-4 fine-tuned on SQuAD without activation checkpointing
/// (`suites/faults/phi4_squad_no_checkpointing.yaml`): the plan names the data's longest batch,
/// in the `max_steps + 3` tail, as the first step over the budget, every step before `max_steps`
/// under it; the run fails `peak_budget` at exactly the steps the plan puts over it, in every
/// phase. With full checkpointing (`suites/phi4-squad.yaml`) no planned step breaks it.
#[test]
fn phi4_on_squad_fails_its_budget_at_the_steps_the_plan_names() {
    let control =
        Suite::load(&common::root().join("suites/faults/phi4_squad_no_checkpointing.yaml"))
            .unwrap();
    let budget = 17_000_000;
    let forecast = plan(&control);
    let over: Vec<(String, u64)> = (forecast.phases.iter())
        .flat_map(|p| {
            (p.steps.iter())
                .filter(|s| s.highest().1 > budget)
                .map(|s| (p.planned.phase.to_string(), s.step))
        })
        .collect();
    let tail = control.max_steps();
    assert!(
        !over.is_empty() && over.iter().all(|(_, step)| *step >= tail),
        "{over:?}"
    );
    let named = forecast.first_over_budget(|_| budget).unwrap();
    let (phase, step) = &over[0];
    assert!(
        named.starts_with(&format!("{phase} step {step} is predicted")),
        "{named}"
    );
    let longest = |step: u64| {
        (forecast.data.steps[step as usize].iter())
            .map(|m| m.shape[1])
            .max()
            .unwrap()
    };
    assert!(
        (0..*step).all(|s| longest(s) < longest(*step)),
        "the longest batch"
    );

    let t = run(&control);
    assert!(t.passed, "{}", t.verdict);
    let failed = peak_budget(&t);
    let at: Vec<(String, u64)> = (failed.iter())
        .map(|f| (f.phase.unwrap().to_string(), f.step.unwrap()))
        .collect();
    assert_eq!(at, over);

    let checkpointed = Suite::load(&common::root().join("suites/phi4-squad.yaml")).unwrap();
    let forecast = plan(&checkpointed);
    assert!(forecast.first_over_budget(|_| budget).is_none());
    let (_, highest) = forecast.highest_step().unwrap();
    assert_eq!(highest.step, *step, "the same batch sets the peak");
}

/// The fix ladder of phi-4 on SQuAD without checkpointing holds when run: every change it
/// says fits passes `peak_budget`, every change it says does not fit fails it; the cheapest
/// that fits is named when the plan stops the run.
#[test]
fn each_rung_of_the_fix_ladder_fits_when_run_as_it_was_planned_to() {
    let control =
        Suite::load(&common::root().join("suites/faults/phi4_squad_no_checkpointing.yaml"))
            .unwrap();
    let like = Like::new(DeviceKind::Cpu, control.file.threads);
    let planned = Forecast::of(&control, like).unwrap();
    let rungs = ladder(&control, &planned, like, &|_| 17_000_000).unwrap();
    assert!(
        rungs.iter().any(|r| r.fits) && rungs.iter().any(|r| !r.fits),
        "{rungs:?}"
    );
    for rung in &rungs {
        let mut changed = control.clone();
        changed.train = rung.run.clone();
        let t = run(&changed);
        let budget = peak_budget(&t);
        assert_eq!(budget.is_empty(), rung.fits, "{}: {budget:?}", rung.change);
    }
    let mut unexpected = control.clone();
    unexpected.file.expect_fail = None;
    let t = run(&unexpected);
    let cheapest = cheapest(&rungs).unwrap();
    let named = format!("the cheapest change that fits: {}", cheapest.change);
    assert!(t.verdict.contains(&named), "{named}: {}", t.verdict);
}
