//! A `ckpt-record/1` record read back into the [`RunRecord`] the checks read: the built-in
//! engine's records (with its `extensions`) come back as the run that wrote them. Another
//! trainer's record reads too, as far as a `RunRecord` holds it: its steps, memory, saves and
//! phases; its resumed states, which name other generators than the engine's, have no engine
//! digest. Every line must parse as the contract's; an error names the file, the line and what
//! to fix.

use super::extensions::{self, EvalExt, PhaseExt, StepExt};
use super::from_run;
use super::lines::{EvalLine, Line, Memory, PhaseLine, State, StepLine};
use crate::record::fields::RecordField;
use crate::record::saves::{SaveRecord, SavedState};
use crate::record::{
    EvalRecord, HostMemory, Oom, PhaseRecord, PlannedPhase, RunRecord, StepRecord, Window,
};
use anyhow::{anyhow, bail, Context, Result};
use ckpt_engine::checkpoint::state::RngState;
use ckpt_engine::data::{LoaderState, SampleId};
use ckpt_engine::memory::Usage;
use ckpt_engine::{EnvChange, MemoryStats, StateDigest};
use serde::de::DeserializeOwned;
use std::collections::BTreeSet;
use std::path::Path;

/// The text of the record in `file`: a regular file of UTF-8 text.
pub fn text(file: &Path) -> Result<String> {
    let bytes = ckpt_engine::regular_file::read(file, "a ckpt-record/1 record file")?;
    String::from_utf8(bytes)
        .with_context(|| format!("{}: cannot read as UTF-8 text", file.display()))
}

/// Reads the record in `file`, keeping its text (see [`from_text`]).
pub fn read(file: &Path) -> Result<RunRecord> {
    let origin = file.display().to_string();
    from_text(text(file)?, &origin).with_context(|| origin)
}

/// The run a record's `text` holds, the text kept with it (the report keeps a record read from
/// elsewhere as it was read); `origin` names it in errors.
pub fn from_text(text: String, origin: &str) -> Result<RunRecord> {
    let mut record = run_record(parse(&text, origin)?)?;
    record.text = Some(text);
    Ok(record)
}

/// The lines of a record's text; `origin` names it in errors.
pub fn parse(text: &str, origin: &str) -> Result<Vec<Line>> {
    text.lines()
        .enumerate()
        .map(|(n, line)| {
            serde_json::from_str(line).map_err(|e| {
                anyhow!(
                    "{origin}:{}:{}: not a ckpt-record/1 line: {e}; see docs/RECORD.md",
                    n + 1,
                    e.column()
                )
            })
        })
        .collect()
}

/// The engine's extension of a line, or its default where the line has none.
fn ext<T: DeserializeOwned + Default>(value: &Option<serde_json::Value>) -> Result<T> {
    match value.as_ref().and_then(|v| v.get(extensions::KEY)) {
        None => Ok(T::default()),
        Some(v) => serde_json::from_value(v.clone())
            .map_err(|e| anyhow!("extensions.{}: {e}", extensions::KEY)),
    }
}

/// The run the lines record, phase by phase.
pub fn run_record(lines: Vec<Line>) -> Result<RunRecord> {
    let mut r = RunRecord::default();
    let mut ran = Vec::new();
    let mut seen = Seen::default();
    let mut foreign = false;
    for (n, line) in lines.into_iter().enumerate() {
        let at = || format!("line {}", n + 1);
        seen.note(&line);
        if let Line::Phase(start) = line {
            foreign |= start.engine.name != from_run::ENGINE;
            begin(&mut r, &mut ran, *start).with_context(at)?;
            continue;
        }
        let Some(p) = r.phases.last_mut() else {
            bail!(
                "{}: a record begins with a `phase` line, before any step, save, resume or end",
                at()
            );
        };
        match line {
            Line::Phase(_) => unreachable!("handled above"),
            Line::Step(s) => p.steps.push(step(*s).with_context(at)?),
            Line::Eval(e) => p.evaluations.push(evaluation(*e).with_context(at)?),
            Line::Save(s) => p.saves.push(SaveRecord {
                step: s.step,
                asynchronous: s.asynchronous.unwrap_or_default(),
                in_memory: saved(&s.state),
                on_disk: s.on_disk.as_ref().map(saved),
                differing_files: s.differing_files,
                named: foreign.then_some(s.state),
                unreadable: s.unreadable,
            }),
            Line::Resume(x) => {
                p.resumed_digest = digest(&x.state).with_context(at)?;
                if p.resumed_digest.is_none() {
                    p.resumed_state = Some(x.state.clone());
                }
                p.reference_digest = match &x.reference_state {
                    Some(state) => digest(state).with_context(at)?,
                    None => None,
                };
                p.env_changes = x
                    .environment_changes
                    .iter()
                    .map(|c| env_change(c))
                    .collect::<Result<_>>()
                    .with_context(at)?;
            }
            Line::PhaseEnd(e) => {
                p.after = e.memory_after.by_category.unwrap_or_default();
                let host = e.host.unwrap_or_default();
                p.host = HostMemory {
                    start_rss: host.start_rss,
                    peak_rss: host.peak_rss,
                    reset: host.reset.unwrap_or_default(),
                };
                p.oom = e.oom.map(|o| Oom {
                    message: o.message,
                    step: o.step,
                    requested: o.requested.unwrap_or_default(),
                    allocated: o.allocated.unwrap_or_default(),
                    by_category: o.by_category.unwrap_or_default(),
                });
                p.refused = e.refused;
                p.seconds = e.seconds.unwrap_or_default();
            }
        }
    }
    // Records that do not list every planned phase (as the engine's extension does) plan the
    // phases they ran.
    if r.planned.is_empty() {
        r.planned = ran;
    }
    r.lacks = seen.lacks(&r);
    Ok(r)
}

/// Which optional parts of the record ([`RecordField`]) its lines carried.
#[derive(Default)]
struct Seen {
    step_lines: usize,
    save_lines: usize,
    samples: bool,
    step_peak: bool,
    step_by_category: bool,
    host_memory: bool,
    phase_lines: usize,
    phase_starts_by_category: usize,
    phase_ends_by_category: usize,
    recomputed_blocks: bool,
    predictions: bool,
    oom_count: bool,
    on_disk: bool,
}

impl Seen {
    fn note(&mut self, line: &Line) {
        match line {
            Line::Phase(p) => {
                self.phase_lines += 1;
                let before = p.memory_before.as_ref();
                self.phase_starts_by_category +=
                    usize::from(before.is_some_and(|m| m.by_category.is_some()));
                let own = p.extensions.as_ref().and_then(|e| e.get(extensions::KEY));
                self.predictions |= own.is_some_and(|e| e.get("predicted").is_some());
            }
            Line::Step(s) => {
                self.step_lines += 1;
                self.samples |= s.samples.is_some();
                self.recomputed_blocks |= s.recomputed_blocks.is_some();
                if let Some(m) = &s.memory {
                    self.step_peak |= m.allocated_peak.is_some();
                    self.step_by_category |= m.by_category.is_some();
                    self.oom_count |= m.oom_count.is_some();
                    self.host_memory |= !matches!(m.source.as_str(), "engine" | "cuda");
                }
            }
            Line::Save(s) => {
                self.save_lines += 1;
                self.on_disk |= s.on_disk.is_some() || s.unreadable.is_some();
            }
            Line::PhaseEnd(e) => {
                self.phase_ends_by_category += usize::from(e.memory_after.by_category.is_some());
            }
            Line::Resume(_) | Line::Eval(_) => {}
        }
    }

    /// The parts missing from the record `r` read. A part of step (or save) lines is missing
    /// only where the record has such lines and none carries it: a run that ended before its
    /// first step lacks nothing, and its checks have nothing to compare (not run), as when the
    /// run itself is judged.
    fn lacks(&self, r: &RunRecord) -> BTreeSet<RecordField> {
        let steps = self.step_lines > 0;
        let missing = [
            (RecordField::Samples, steps && !self.samples),
            (RecordField::StepMemory, steps && !self.step_peak),
            (
                RecordField::DeviceMemory,
                steps && (!self.step_peak || self.host_memory),
            ),
            (RecordField::StepByCategory, steps && !self.step_by_category),
            (
                RecordField::MemoryByCategory,
                self.phase_starts_by_category < self.phase_lines
                    || self.phase_ends_by_category < self.phase_lines,
            ),
            (
                RecordField::RecomputedBlocks,
                steps && (!self.recomputed_blocks || r.layers == 0),
            ),
            (RecordField::MemoryModel, !self.predictions),
            (RecordField::OomCount, steps && !self.oom_count),
            (RecordField::OnDisk, self.save_lines > 0 && !self.on_disk),
        ];
        missing
            .into_iter()
            .filter(|(_, absent)| *absent)
            .map(|(field, _)| field)
            .collect()
    }
}

/// A `phase` line: a new phase, and on the reference's the run's facts; the steps it plans are
/// added to `ran`.
fn begin(r: &mut RunRecord, ran: &mut Vec<PlannedPhase>, start: PhaseLine) -> Result<()> {
    if start.record != super::VERSION {
        bail!(
            "record version {:?}: this reader reads {}",
            start.record,
            super::VERSION
        );
    }
    let own: PhaseExt = ext(&start.extensions)?;
    if let Some(run) = &start.run {
        r.name = start.trial.clone().unwrap_or_default();
        r.device = start.device.clone();
        r.layers = usize::try_from(run.layers)?;
        r.params = run.params;
        r.checkpointing = run.checkpointing;
        r.samples_per_epoch = run.samples_per_epoch;
        r.dataset_samples = run.dataset_samples;
        r.planned_saves = run.planned_saves.clone();
        r.planned_evaluations = run.planned_evaluations.clone();
        r.capacity = run.capacity;
        r.budget = run.budget;
        r.rss_budget = run.rss_budget;
        r.suite = own.suite.clone().unwrap_or_default();
        r.planned = own.planned.clone().unwrap_or_default();
        r.predicted = own.predicted.clone().unwrap_or_default();
        r.predicted_long = own.predicted_long.clone();
        r.predicted_load = own.predicted_load.unwrap_or_default();
        r.predicted_staging = own.predicted_staging.unwrap_or_default();
        r.worlds = own.worlds.clone().unwrap_or_default();
    }
    if let Some(p) = &start.planned {
        ran.push(PlannedPhase {
            phase: start.phase,
            from: p.from,
            end: p.end,
            world_size: usize::try_from(start.world_size)?.max(1),
        });
    }
    r.phases.push(PhaseRecord {
        phase: start.phase,
        before: start
            .memory_before
            .and_then(|m| m.by_category)
            .unwrap_or_default(),
        setup: start.setup.as_ref().map(window).unwrap_or_default(),
        setup_seconds: own.setup_seconds,
        ranks: own.ranks,
        ..PhaseRecord::default()
    });
    Ok(())
}

fn window(m: &Memory) -> Window {
    Window {
        peak: m.allocated_peak.unwrap_or_default(),
        at_peak: m.by_category_at_peak.unwrap_or_default(),
        oom_count: m.oom_count.unwrap_or_default(),
    }
}

/// A tracker's figures from what a line's memory holds of them (0 where it holds nothing; the
/// tracker's own counters, which only the engine's extensions carry, left at 0).
fn stats(m: &Memory) -> MemoryStats {
    let usage = |current: Option<u64>, peak: Option<u64>| Usage {
        current: current.unwrap_or_default(),
        peak: peak.unwrap_or_default(),
    };
    MemoryStats {
        allocated: usage(m.allocated, m.allocated_peak),
        reserved: usage(m.reserved, m.reserved_peak),
        current: m.by_category.unwrap_or_default(),
        at_peak: m.by_category_at_peak.unwrap_or_default(),
        oom_count: m.oom_count.unwrap_or_default(),
        ..MemoryStats::default()
    }
}

/// A float the record holds as `null` when it was not finite.
fn float(x: Option<f64>) -> f64 {
    x.unwrap_or(f64::NAN)
}

fn step(s: StepLine) -> Result<StepRecord> {
    let own: StepExt = ext(&s.extensions)?;
    let m = s.memory.unwrap_or_default();
    Ok(StepRecord {
        step: s.step,
        loss: float(s.loss) as f32,
        lr: float(s.lr),
        grad_norm: float(s.grad_norm),
        batch_digest: s.batch_digest.unwrap_or_default(),
        samples: s.samples.unwrap_or_default(),
        recomputed_blocks: usize::try_from(s.recomputed_blocks.unwrap_or_default())?,
        tokens_per_expert: own.tokens_per_expert,
        predicted: own.predicted,
        start: m.by_category_at_start.unwrap_or_default(),
        staging: own.staging,
        memory: MemoryStats {
            peak_by_category: own.peak_by_category,
            capacity: own.capacity,
            alloc_count: own.alloc_count,
            ..stats(&m)
        },
        seconds: s.seconds.unwrap_or_default(),
        ranks: own.ranks,
    })
}

fn evaluation(e: EvalLine) -> Result<EvalRecord> {
    let own: EvalExt = ext(&e.extensions)?;
    Ok(EvalRecord {
        step: e.step,
        loss: float(e.loss) as f32,
        tokens: e.tokens.unwrap_or_default(),
        batch_digest: e.batch_digest.unwrap_or_default(),
        memory: stats(&e.memory.unwrap_or_default()),
        rank_peaks: e.rank_peaks.unwrap_or_default(),
        predicted_peaks: own.predicted_peaks,
    })
}

/// A state's steps and one-digest summaries of its tensors (empty where the record has none).
fn saved(s: &State) -> SavedState {
    SavedState {
        step: s.step,
        optimizer_steps: s.optimizer_steps.unwrap_or_default(),
        params: s
            .params
            .as_ref()
            .and_then(|p| p.digest.clone())
            .unwrap_or_default(),
        optimizer: s
            .optimizer
            .as_ref()
            .and_then(|o| o.digest.clone())
            .unwrap_or_default(),
    }
}

/// A resumed (or reference) state as the engine's digest, when it is the engine's (it has the
/// engine's `dropout` generator); then it needs the schedule's next learning rate and the
/// loader's position too. Another trainer's state has no such digest: `None`.
fn digest(s: &State) -> Result<Option<StateDigest>> {
    let Some(rng) = s.rng.as_ref().and_then(|r| r.get("dropout")) else {
        return Ok(None);
    };
    let missing = |what: &str| anyhow!("the state of step {} has no {what}", s.step);
    let data = s.data.as_ref().ok_or_else(|| missing("data"))?;
    let at = |key: &str| {
        data.get(key)
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| missing(&format!("data.{key} as an integer")))
    };
    let rng: RngState = serde_json::from_value(rng.clone())
        .map_err(|e| anyhow!("the state of step {}: rng.dropout: {e}", s.step))?;
    let next_lr = s
        .schedule
        .as_ref()
        .ok_or_else(|| missing("schedule"))?
        .next_lr;
    let SavedState {
        step,
        optimizer_steps,
        params,
        optimizer,
    } = saved(s);
    Ok(Some(StateDigest {
        step,
        params,
        optimizer,
        optimizer_steps,
        next_lr: float(next_lr),
        loader: LoaderState {
            epoch: at("epoch")?,
            position: at("position")?,
            shuffle_seed: at("shuffle_seed")?,
            in_flight: match data.contains_key("in_flight_index") {
                true => Some(SampleId {
                    epoch: at("in_flight_epoch")?,
                    index: at("in_flight_index")?,
                }),
                false => None,
            },
        },
        rng,
    }))
}

/// `field: saved → now`, as [`EnvChange`] displays itself.
fn env_change(text: &str) -> Result<EnvChange> {
    let parsed = text.split_once(": ").and_then(|(field, rest)| {
        let (saved, now) = rest.split_once(" → ")?;
        Some(EnvChange {
            field: field.into(),
            saved: saved.into(),
            now: now.into(),
        })
    });
    parsed.ok_or_else(|| anyhow!("environment change {text:?}: expected `field: saved → now`"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use crate::devices::DeviceKind;
    use crate::record::jsonl::from_run;
    use crate::run::phases;
    use crate::suite::Suite;

    /// `r` written as a record's text and read back.
    fn round_trip(r: &RunRecord) -> RunRecord {
        let text: String = from_run::lines(r)
            .iter()
            .map(|l| serde_json::to_string(l).unwrap() + "\n")
            .collect();
        run_record(parse(&text, "r.jsonl").unwrap()).unwrap()
    }

    fn json(r: &RunRecord) -> serde_json::Value {
        serde_json::to_value(r).unwrap()
    }

    #[test]
    fn a_real_run_reads_back_as_the_run_that_wrote_it() {
        let text = "name: t
model: {vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 4, max_position_embeddings: 64}
data: {kind: synthetic, seed: 1, samples: 64}
batch_size: 2
seq_len: 16
optimizer: {lr: 0.001}
training: {max_steps: 4, resume_from: [1, 2], async_save: true}
";
        let suite = Suite::parse(Path::new("t.yaml"), text).unwrap();
        let work = tempfile::tempdir().unwrap();
        let r = phases::run(&suite, DeviceKind::Cpu, work.path(), &mut ()).unwrap();
        assert_eq!(r.phases.len(), 4);
        assert_eq!(json(&round_trip(&r)), json(&r));
    }

    #[test]
    fn every_field_of_a_hand_made_run_reads_back() {
        let mut r = fixtures::run();
        r.budget = Some(1 << 20);
        r.predicted_long = Some((3, r.predicted.clone()));
        let s = &mut r.phases[0].steps[1];
        s.loss = f32::NAN;
        s.tokens_per_expert = vec![vec![3, 5]];
        s.staging = 64;
        r.phases[1].env_changes = vec![EnvChange {
            field: "cpu_kernels".into(),
            saved: "x86_64 fma".into(),
            now: "x86_64 avx512f".into(),
        }];
        r.phases[2].oom = Some(Oom {
            message: "step 5: out of memory".into(),
            step: Some(5),
            requested: 10,
            allocated: 20,
            ..Oom::default()
        });
        let back = round_trip(&r);
        assert!(back.phases[0].steps[1].loss.is_nan());
        assert_eq!(json(&back), json(&r));
    }

    #[test]
    fn a_changed_field_does_not_read_back_as_the_original() {
        let r = fixtures::run();
        let mut lines = from_run::lines(&r);
        let Line::Step(s) = &mut lines[1] else {
            panic!("not a step")
        };
        s.loss = Some(f64::from(s.loss.unwrap() as f32 + 1.0));
        assert_ne!(json(&run_record(lines).unwrap()), json(&r));
    }

    #[test]
    fn bad_lines_are_refused_naming_the_place_and_the_fix() {
        let err = parse("{\"kind\": \"phase\"}\nnot json\n", "run.jsonl").unwrap_err();
        assert!(err.to_string().starts_with("run.jsonl:1:"), "{err}");
        assert!(err.to_string().contains("see docs/RECORD.md"), "{err}");
        let err = parse(
            r#"{"kind": "step", "phase": "reference", "step": 0, "loss": 1.0, "lr": 0.1, "losses": []}"#,
            "run.jsonl",
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `losses`"), "{err}");
        let mut lines = from_run::lines(&fixtures::run());
        let step = lines.remove(1);
        let err = run_record(vec![step]).unwrap_err();
        assert!(
            format!("{err}").contains("line 1: a record begins with a `phase` line"),
            "{err}"
        );
        let Line::Phase(start) = &mut lines[0] else {
            panic!("not a phase line")
        };
        start.record = "ckpt-record/2".into();
        let err = format!("{:#}", run_record(lines).unwrap_err());
        assert!(err.contains("record version \"ckpt-record/2\""), "{err}");
    }

    #[test]
    fn the_python_recorder_s_record_reads_with_its_steps_and_saves() {
        let text = include_str!("../../../record/examples/pytorch-loop.jsonl");
        let r = run_record(parse(text, "pytorch-loop.jsonl").unwrap()).unwrap();
        let phases: Vec<String> = r.phases.iter().map(|p| p.phase.to_string()).collect();
        assert_eq!(phases, ["reference", "resume-mid", "resume-end"]);
        let steps: Vec<usize> = r.phases.iter().map(|p| p.steps.len()).collect();
        assert_eq!(steps, [8, 5, 2]);
        let reference = &r.phases[0];
        for p in &r.phases[1..] {
            assert!(p.resumed_digest.is_none());
            for s in &p.steps {
                let want = &reference.steps[s.step as usize];
                assert_eq!(s.loss.to_bits(), want.loss.to_bits(), "step {}", s.step);
                assert_eq!(s.samples, want.samples);
            }
        }
        assert_eq!(
            reference.saves.iter().map(|s| s.step).collect::<Vec<_>>(),
            [3, 6]
        );
        assert!(reference.steps.iter().all(|s| s.memory.allocated.peak > 0));
    }

    /// The Python recorder's record read back: what it lacks, and the checks that can judge it
    /// pass on it.
    #[test]
    fn another_trainer_s_record_says_what_it_lacks_and_its_states_compare_by_name() {
        use crate::checks::{self, state_digest, Status};
        let text = include_str!("../../../record/examples/pytorch-loop.jsonl");
        let r = run_record(parse(text, "pytorch-loop.jsonl").unwrap()).unwrap();
        let lacks: Vec<RecordField> = r.lacks.iter().copied().collect();
        assert_eq!(
            lacks,
            [
                RecordField::DeviceMemory,
                RecordField::StepByCategory,
                RecordField::MemoryByCategory,
                RecordField::RecomputedBlocks,
                RecordField::MemoryModel,
                RecordField::OomCount,
                RecordField::OnDisk,
            ]
        );
        let o = state_digest::check(&r);
        assert_eq!(
            (o.status, o.compared),
            (Status::Passed, 2),
            "{:?}",
            o.failures
        );
        assert!(r.phases[0].saves.iter().all(|s| s.named.is_some()));
        let spec = crate::suite::ChecksSpec::default();
        let all = checks::run_all(&r, &spec, &checks::GoldenInput::default());
        let not_applicable: Vec<&str> = all
            .iter()
            .filter(|o| o.status == Status::NotApplicable)
            .map(|o| o.check.name())
            .collect();
        assert_eq!(
            not_applicable,
            [
                "memory_reclaimed",
                "memory_parity",
                "no_leak",
                "ac_coverage",
                "memory_model",
                "oom_free",
                "checkpoint_equivalence"
            ]
        );
    }

    /// A resumed tensor that is not the saved one fails `state_digest`, naming the tensor.
    #[test]
    fn another_trainer_s_resumed_tensor_that_differs_is_named() {
        use crate::checks::state_digest;
        let text = include_str!("../../../record/examples/pytorch-loop.jsonl");
        let mut lines = parse(text, "pytorch-loop.jsonl").unwrap();
        for line in &mut lines {
            if let Line::Resume(x) = line {
                if x.phase == crate::record::Phase::ResumeEnd {
                    let by_name = x.state.params.as_mut().unwrap().by_name.as_mut().unwrap();
                    by_name.insert("hidden.bias".into(), "0".repeat(64));
                }
            }
        }
        let r = run_record(lines).unwrap();
        let o = state_digest::check(&r);
        let failures: Vec<String> = o.failures.iter().map(ToString::to_string).collect();
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(
            failures[0]
                .starts_with("state_digest: resume-end step 6: params hidden.bias: expected "),
            "{}",
            failures[0]
        );
    }

    /// A writer that counts only the live training state (`params`, `grads`, `optimizer`) at
    /// each phase's start and end is judged by `memory_reclaimed`; the parameters one phase
    /// left behind are named.
    #[test]
    fn live_state_by_some_categories_is_judged_by_memory_reclaimed() {
        use crate::checks::{memory_reclaimed, Status};
        let text = include_str!("../../../record/examples/pytorch-loop.jsonl");
        let counted = |params: u64| {
            format!(r#""by_category": {{"params": {params}, "grads": 0, "optimizer": 0}}"#)
        };
        let with = |left: u64| -> String {
            text.lines()
                .map(|l| {
                    let l = l.replacen(
                        r#""kind": "phase","#,
                        &format!(
                            r#""kind": "phase", "memory_before": {{"source": "host_rss", {}}},"#,
                            counted(0)
                        ),
                        1,
                    );
                    let left = if l.contains(r#""phase": "resume-mid""#) {
                        left
                    } else {
                        0
                    };
                    l.replacen(
                        r#""memory_after": {"#,
                        &format!(r#""memory_after": {{{}, "#, counted(left)),
                        1,
                    ) + "\n"
                })
                .collect()
        };
        let clean = run_record(parse(&with(0), "r.jsonl").unwrap()).unwrap();
        assert!(!clean.lacks.contains(&RecordField::MemoryByCategory));
        let o = memory_reclaimed::check(&clean);
        assert_eq!(
            (o.status, o.compared),
            (Status::Passed, 3),
            "{:?}",
            o.failures
        );
        let kept = run_record(parse(&with(9216), "r.jsonl").unwrap()).unwrap();
        let failures: Vec<String> = memory_reclaimed::check(&kept)
            .failures
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].contains("resume-mid"), "{}", failures[0]);
        assert!(
            failures[0].contains("params outlives the trainer"),
            "{}",
            failures[0]
        );
    }

    #[test]
    fn an_engine_state_without_its_loader_position_is_refused() {
        let r = fixtures::run();
        let mut lines = from_run::lines(&r);
        for line in &mut lines {
            if let Line::Resume(x) = line {
                x.state.data = None;
            }
        }
        let err = format!("{:#}", run_record(lines).unwrap_err());
        assert!(err.contains("has no data"), "{err}");
    }
}
