//! The built-in engine's recorded run ([`RunRecord`]) as `ckpt-record/1` lines: each phase's
//! start (the run's facts and the memory model's predictions on the reference's), its steps, its
//! saves, its resumed state with the reference's at the same step, and its end.

use super::extensions::{self, EvalExt, PhaseExt, StepExt};
use super::lines::{
    Engine, EvalLine, Host, Line, Memory, Oom, OptimizerState, Params, PhaseEndLine, PhaseLine,
    Planned, ResumeLine, ResumedFrom, Run, SaveLine, Schedule, State, StepLine,
};
use crate::record::saves::{SaveRecord, SavedState};
use crate::record::{EvalRecord, Phase, PhaseRecord, RunRecord, StepRecord};
use ckpt_engine::data::LoaderState;
use ckpt_engine::memory::Breakdown;
use ckpt_engine::{MemoryStats, StateDigest};
use serde_json::json;
use std::collections::BTreeMap;

/// The engine's name in records.
pub const ENGINE: &str = "ckpt-engine";

/// What the engine's figures measure: its own count of every allocation.
const SOURCE: &str = "engine";

/// A float as the record writes it: the value, or `None` when it is not finite.
fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// Bytes held per category at one instant.
fn held(b: Breakdown) -> Memory {
    Memory {
        source: SOURCE.into(),
        allocated: Some(b.total()),
        by_category: Some(b),
        ..Memory::default()
    }
}

/// Every line of `r`, phase by phase in run order.
pub fn lines(r: &RunRecord) -> Vec<Line> {
    let seeds = seeds(r);
    r.phases
        .iter()
        .flat_map(|p| phase_lines(r, p, &seeds))
        .collect()
}

/// The seeds the run's state digests name: the dropout generator's and the loader's shuffle.
fn seeds(r: &RunRecord) -> BTreeMap<String, u64> {
    r.phases
        .iter()
        .find_map(|p| p.resumed_digest.as_ref())
        .map(|d| {
            BTreeMap::from([
                ("dropout".to_string(), d.rng.seed),
                ("shuffle".to_string(), d.loader.shuffle_seed),
            ])
        })
        .unwrap_or_default()
}

fn phase_lines(r: &RunRecord, p: &PhaseRecord, seeds: &BTreeMap<String, u64>) -> Vec<Line> {
    let mut out = vec![Line::Phase(Box::new(start(r, p, seeds)))];
    if let Some(got) = &p.resumed_digest {
        out.push(Line::Resume(Box::new(ResumeLine {
            phase: p.phase,
            step: got.step,
            state: state(got),
            reference_state: p.reference_digest.as_ref().map(state),
            environment_changes: p.env_changes.iter().map(ToString::to_string).collect(),
            ..ResumeLine::default()
        })));
    }
    let mut saves = p.saves.iter().peekable();
    let mut evaluations = p.evaluations.iter().peekable();
    let eval_line = |e: &EvalRecord| Line::Eval(Box::new(evaluation(p.phase, e)));
    for s in &p.steps {
        // An evaluation at the step's start (one a resume repeats) comes before its line.
        while let Some(e) = evaluations.next_if(|e| e.step <= s.step) {
            out.push(eval_line(e));
        }
        out.push(Line::Step(Box::new(step(p.phase, s))));
        while let Some(e) = evaluations.next_if(|e| e.step <= s.step + 1) {
            out.push(eval_line(e));
        }
        while let Some(save) = saves.next_if(|save| save.step <= s.step + 1) {
            out.push(Line::Save(Box::new(saved(p.phase, save))));
        }
    }
    out.extend(evaluations.map(eval_line));
    out.extend(saves.map(|save| Line::Save(Box::new(saved(p.phase, save)))));
    out.push(Line::PhaseEnd(Box::new(PhaseEndLine {
        phase: p.phase,
        memory_after: held(p.after),
        host: Some(Host {
            start_rss: p.host.start_rss,
            peak_rss: p.host.peak_rss,
            reset: Some(p.host.reset),
        }),
        oom: p.oom.as_ref().map(|o| Oom {
            message: o.message.clone(),
            step: o.step,
            requested: Some(o.requested),
            allocated: Some(o.allocated),
            by_category: Some(o.by_category),
        }),
        refused: p.refused.clone(),
        seconds: Some(p.seconds),
    })));
    out
}

fn start(r: &RunRecord, p: &PhaseRecord, seeds: &BTreeMap<String, u64>) -> PhaseLine {
    let planned = r.planned.iter().find(|q| q.phase == p.phase);
    let reference = p.phase == Phase::Reference;
    PhaseLine {
        record: super::VERSION.into(),
        phase: p.phase,
        trial: Some(r.name.clone()),
        engine: Engine {
            name: ENGINE.into(),
            version: env!("CARGO_PKG_VERSION").into(),
            libraries: None,
        },
        device: r.device.clone(),
        world_size: planned.map_or(1, |q| q.world_size as u64),
        seeds: seeds.clone(),
        resumed_from: planned
            .filter(|q| q.phase != Phase::Reference)
            .map(|q| ResumedFrom {
                step: q.from,
                checkpoint: None,
            }),
        planned: planned.map(|q| Planned {
            from: q.from,
            end: q.end,
            horizon: None,
        }),
        run: reference.then(|| Run {
            layers: r.layers as u64,
            params: r.params,
            checkpointing: r.checkpointing,
            samples_per_epoch: r.samples_per_epoch,
            dataset_samples: r.dataset_samples,
            planned_saves: r.planned_saves.clone(),
            planned_evaluations: r.planned_evaluations.clone(),
            capacity: r.capacity,
            budget: r.budget,
            rss_budget: r.rss_budget,
        }),
        memory_before: Some(held(p.before)),
        setup: Some(Memory {
            source: SOURCE.into(),
            allocated_peak: Some(p.setup.peak),
            by_category_at_peak: Some(p.setup.at_peak),
            oom_count: Some(p.setup.oom_count),
            ..Memory::default()
        }),
        extensions: Some(json!({extensions::KEY: PhaseExt {
            setup_seconds: p.setup_seconds,
            ranks: p.ranks.clone(),
            ..if reference { run_ext(r) } else { PhaseExt::default() }
        }})),
        ..PhaseLine::default()
    }
}

/// The run's fields the contract has no place for, on the reference's `phase` line.
fn run_ext(r: &RunRecord) -> PhaseExt {
    PhaseExt {
        setup_seconds: 0.0,
        suite: Some(r.suite.clone()),
        planned: Some(r.planned.clone()),
        predicted: Some(r.predicted.clone()),
        predicted_long: r.predicted_long.clone(),
        predicted_load: Some(r.predicted_load),
        predicted_staging: Some(r.predicted_staging),
        worlds: (!r.worlds.is_empty()).then(|| r.worlds.clone()),
        ranks: Vec::new(),
    }
}

fn step(phase: Phase, s: &StepRecord) -> StepLine {
    let m = &s.memory;
    let own = StepExt {
        tokens_per_expert: s.tokens_per_expert.clone(),
        predicted: s.predicted.clone(),
        staging: s.staging,
        peak_by_category: m.peak_by_category,
        capacity: m.capacity,
        alloc_count: m.alloc_count,
        ranks: s.ranks.clone(),
    };
    StepLine {
        phase,
        step: s.step,
        loss: finite(f64::from(s.loss)),
        loss_dtype: Some("float32".into()),
        lr: finite(s.lr),
        grad_norm: finite(s.grad_norm),
        batch_digest: Some(s.batch_digest.clone()),
        samples: Some(s.samples.clone()),
        recomputed_blocks: Some(s.recomputed_blocks as u64),
        memory: Some(Memory {
            allocated_at_start: Some(s.start.total()),
            by_category_at_start: Some(s.start),
            ..figures(m)
        }),
        seconds: Some(s.seconds),
        extensions: Some(json!({extensions::KEY: own})),
        ..StepLine::default()
    }
}

/// The tracker's figures over a step or an evaluation whose peak was reset as it began.
fn figures(m: &MemoryStats) -> Memory {
    Memory {
        source: SOURCE.into(),
        peak_reset: Some(true),
        allocated: Some(m.allocated.current),
        reserved: Some(m.reserved.current),
        allocated_peak: Some(m.allocated.peak),
        reserved_peak: Some(m.reserved.peak),
        by_category: Some(m.current),
        by_category_at_peak: Some(m.at_peak),
        oom_count: Some(m.oom_count),
        ..Memory::default()
    }
}

fn evaluation(phase: Phase, e: &EvalRecord) -> EvalLine {
    let m = &e.memory;
    EvalLine {
        phase,
        step: e.step,
        loss: finite(f64::from(e.loss)),
        tokens: Some(e.tokens),
        batch_digest: Some(e.batch_digest.clone()),
        memory: Some(figures(m)),
        rank_peaks: (!e.rank_peaks.is_empty()).then(|| e.rank_peaks.clone()),
        extensions: (!e.predicted_peaks.is_empty()).then(|| {
            json!({extensions::KEY: EvalExt {
                predicted_peaks: e.predicted_peaks.clone(),
            }})
        }),
    }
}

/// A live trainer's full state digest.
fn state(d: &StateDigest) -> State {
    State {
        schedule: Some(Schedule {
            next_lr: finite(d.next_lr),
            digest: None,
        }),
        rng: Some(BTreeMap::from([(
            "dropout".to_string(),
            json!({"seed": d.rng.seed, "offset": d.rng.offset}),
        )])),
        data: Some(loader_data(&d.loader)),
        ..tensors(&SavedState::in_memory(d))
    }
}

/// The loader's state as a state line's `data`: its epoch, position and shuffle seed, and a
/// pack in flight as `in_flight_epoch` and `in_flight_index`.
fn loader_data(l: &LoaderState) -> BTreeMap<String, serde_json::Value> {
    let mut data = BTreeMap::from([
        ("epoch".to_string(), json!(l.epoch)),
        ("position".to_string(), json!(l.position)),
        ("shuffle_seed".to_string(), json!(l.shuffle_seed)),
    ]);
    if let Some(id) = l.in_flight {
        data.insert("in_flight_epoch".to_string(), json!(id.epoch));
        data.insert("in_flight_index".to_string(), json!(id.index));
    }
    data
}

/// The tensors' digests and steps of a saved state.
fn tensors(s: &SavedState) -> State {
    State {
        step: s.step,
        optimizer_steps: Some(s.optimizer_steps),
        params: Some(Params {
            digest: Some(s.params.clone()),
            ..Params::default()
        }),
        optimizer: Some(OptimizerState {
            digest: Some(s.optimizer.clone()),
            ..OptimizerState::default()
        }),
        ..State::default()
    }
}

fn saved(phase: Phase, s: &SaveRecord) -> SaveLine {
    SaveLine {
        phase,
        step: s.step,
        checkpoint: None,
        asynchronous: Some(s.asynchronous),
        state: tensors(&s.in_memory),
        on_disk: s.on_disk.as_ref().map(tensors),
        unreadable: s.unreadable.clone(),
        differing_files: s.differing_files.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;

    fn kinds(lines: &[Line], phase: Phase) -> Vec<String> {
        lines
            .iter()
            .filter_map(|l| match l {
                Line::Phase(p) if p.phase == phase => Some("phase".into()),
                Line::Resume(r) if r.phase == phase => Some(format!("resume {}", r.step)),
                Line::Step(s) if s.phase == phase => Some(format!("step {}", s.step)),
                Line::Save(s) if s.phase == phase => Some(format!("save {}", s.step)),
                Line::PhaseEnd(e) if e.phase == phase => Some("end".into()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn every_phase_writes_its_start_resume_steps_saves_and_end_in_order() {
        let lines = lines(&fixtures::run());
        assert_eq!(
            kinds(&lines, Phase::Reference),
            [
                "phase", "step 0", "step 1", "save 2", "step 2", "step 3", "save 4", "step 4",
                "step 5", "save 6", "end"
            ]
        );
        assert_eq!(
            kinds(&lines, Phase::ResumeEnd),
            ["phase", "resume 4", "step 4", "step 5", "end"]
        );
        let Line::Phase(start) = &lines[0] else {
            panic!("{:?}", lines[0])
        };
        assert_eq!(start.record, "ckpt-record/1");
        assert_eq!(start.resumed_from, None);
        assert_eq!(start.run.as_ref().map(|r| r.samples_per_epoch), Some(10));
    }

    #[test]
    fn a_resume_carries_its_state_and_the_reference_s_at_the_same_step() {
        let r = fixtures::run();
        let lines = lines(&r);
        let resume = lines
            .iter()
            .find_map(|l| match l {
                Line::Resume(x) if x.phase == Phase::ResumeMid => Some(x),
                _ => None,
            })
            .unwrap();
        let got = r.phases[1].resumed_digest.as_ref().unwrap();
        assert_eq!(
            resume.state.params.as_ref().unwrap().digest.as_deref(),
            Some(got.params.as_str())
        );
        assert_eq!(
            resume.state.data.as_ref().unwrap()["position"],
            json!(got.loader.position)
        );
        let want = r.phases[1].reference_digest.as_ref().unwrap();
        let reference = resume.reference_state.as_ref().unwrap();
        assert_eq!(
            reference.schedule.as_ref().unwrap().next_lr,
            Some(want.next_lr)
        );
        assert_eq!(
            reference.rng.as_ref().unwrap()["dropout"],
            json!({"seed": want.rng.seed, "offset": want.rng.offset})
        );
    }

    #[test]
    fn a_loss_reads_back_as_the_same_bits_and_a_non_finite_one_as_null() {
        let mut r = fixtures::run();
        r.phases[0].steps[0].loss = 1.0 / 3.0;
        r.phases[0].steps[0].grad_norm = f64::NAN;
        let Line::Step(s) = &lines(&r)[1] else {
            panic!("not a step")
        };
        let text = serde_json::to_string(&Line::Step(s.clone())).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["kind"], "step");
        let loss = json["loss"].as_f64().unwrap();
        assert_eq!((loss as f32).to_bits(), (1.0f32 / 3.0).to_bits());
        assert_eq!(loss, f64::from(1.0f32 / 3.0));
        assert!(json["grad_norm"].is_null());
        assert_eq!(json["memory"]["source"], "engine");
    }
}
