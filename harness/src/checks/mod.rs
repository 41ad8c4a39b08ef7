//! Checks: pure functions over a [`RunRecord`]. Each returns an [`Outcome`] holding its figures
//! and the failures it found; every failure names the check, suite, device, phase and step, and
//! what was expected against what was seen.
//!
//! Each check is a file of this folder with its `NEEDS` (the optional parts of a record it
//! compares) and its `run` (the check over an [`Input`]), and a line in the list below, which
//! gives its name, its place in reports and what it asks.

use crate::record::fields::RecordField;
use crate::record::{Phase, RunRecord};
use ckpt_engine::memory::{human_bytes, Breakdown, Category};
use serde::{Deserialize, Serialize};
use spec::ChecksSpec;
use std::collections::BTreeMap;
use std::fmt;

pub mod golden_file;
pub mod per_rank;
pub mod spec;

/// The checks from one list: each `Variant => module` line declares the check's module, its
/// [`Check`] variant (documented by the line's comment) and its name, the module's; the list's
/// order is the reports' order.
macro_rules! checks {
    ($($(#[doc = $doc:literal])* $variant:ident => $module:ident,)+) => {
        $(pub mod $module;)+

        /// A check's name.
        #[derive(
            Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
        )]
        #[serde(rename_all = "snake_case")]
        pub enum Check {
            $($(#[doc = $doc])* $variant,)+
        }

        impl Check {
            /// Every check, in report order.
            pub const ALL: [Check; [$(Check::$variant),+].len()] = [$(Check::$variant),+];
            /// Every check's name, in report order.
            pub const NAMES: [&'static str; Check::ALL.len()] = [$(stringify!($module)),+];

            /// The name used in suites and reports.
            pub fn name(self) -> &'static str {
                Check::NAMES[self as usize]
            }

            /// The optional parts of a record the check compares (docs/RECORD.md): without one
            /// of them it is not applicable.
            pub fn needs(self) -> &'static [RecordField] {
                match self {
                    $(Check::$variant => $module::NEEDS,)+
                }
            }

            /// The check over `input`, whatever the suite turned off.
            fn run(self, input: &Input) -> Outcome {
                match self {
                    $(Check::$variant => $module::run(input),)+
                }
            }
        }
    };
}

checks! {
    /// Resumed steps equal the reference's (bitwise, or within a tolerance).
    LossContinuity => loss_continuity,
    /// Weights, optimizer state, step, learning rate and batch equal at the first resumed step.
    StateDigest => state_digest,
    /// Every phase's samples, joined at its resume point, are the reference's; none skipped or
    /// repeated within an epoch.
    DataLedger => data_ledger,
    /// Every byte comes back when a trainer is dropped.
    MemoryReclaimed => memory_reclaimed,
    /// Every resumed step's peak at most the reference's same step's.
    MemoryParity => memory_parity,
    /// Every step's peak, and checkpoint loading's, under the budget.
    PeakBudget => peak_budget,
    /// Allocated bytes flat at step boundaries.
    NoLeak => no_leak,
    /// Every block recomputed under activation checkpointing.
    AcCoverage => ac_coverage,
    /// Measured step peaks equal the memory model's.
    MemoryModel => memory_model,
    /// No allocation refused.
    OomFree => oom_free,
    /// The reference trajectory equals its snapshot.
    Golden => golden,
    /// Every phase evaluates its validation split after the steps the schedule names, and every
    /// resumed evaluation equals the reference's after the same step.
    EvalContinuity => eval_continuity,
    /// Every step's loss and gradient norm are finite.
    Finite => finite,
    /// Every checkpoint on disk holds the state of its step; an asynchronous save's files are a
    /// synchronous save's.
    CheckpointEquivalence => checkpoint_equivalence,
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a check reads: the record, the suite's settings of the checks, and the stored golden
/// snapshot.
pub struct Input<'a> {
    /// The trial's record.
    pub record: &'a RunRecord,
    /// The suite's `checks:`.
    pub spec: &'a ChecksSpec,
    /// The snapshot the run is compared with.
    pub golden: &'a GoldenInput,
}

/// One failed expectation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    /// The check that failed.
    pub check: Check,
    /// The trial's name: `device::suite`, or `device::faults::suite` for a negative control.
    pub trial: String,
    /// The rank, when the failure belongs to one rank of several.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    /// The phase, when the failure belongs to one.
    pub phase: Option<Phase>,
    /// The step, when the failure belongs to one.
    pub step: Option<u64>,
    /// What was compared.
    pub what: String,
    /// What should have been seen.
    pub expected: String,
    /// What was seen.
    pub actual: String,
    /// Detail: a per-category breakdown, the likely fix.
    pub detail: Option<String>,
}

impl Failure {
    /// A failure of `check` in the trial `r` records.
    pub fn new(check: Check, r: &RunRecord, what: impl Into<String>) -> Self {
        Failure {
            check,
            trial: r.trial(),
            rank: None,
            phase: None,
            step: None,
            what: what.into(),
            expected: String::new(),
            actual: String::new(),
            detail: None,
        }
    }

    /// Places the failure in a phase.
    pub fn phase(mut self, phase: Phase) -> Self {
        self.phase = Some(phase);
        self
    }

    /// Places the failure at a step.
    pub fn step(mut self, step: u64) -> Self {
        self.step = Some(step);
        self
    }

    /// The expected and the actual value.
    pub fn saw(mut self, expected: impl fmt::Display, actual: impl fmt::Display) -> Self {
        self.expected = expected.to_string();
        self.actual = actual.to_string();
        self
    }

    /// Detail after the comparison.
    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:", self.check)?;
        if !self.trial.is_empty() {
            write!(f, " {}", self.trial)?;
        }
        if let Some(r) = self.rank {
            write!(f, " rank {r}")?;
        }
        if let Some(p) = self.phase {
            write!(f, " {p}")?;
        }
        if let Some(s) = self.step {
            write!(f, " step {s}")?;
        }
        write!(
            f,
            ": {}: expected {}, got {}",
            self.what, self.expected, self.actual
        )?;
        if let Some(d) = &self.detail {
            write!(f, "; {d}")?;
        }
        Ok(())
    }
}

/// Whether a check ran and how it went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// It ran and found nothing wrong.
    Passed,
    /// It ran and found failures.
    Failed,
    /// It had nothing to compare: what it compares was never recorded (a phase ended early, a
    /// later one never ran). Fails the trial unless the suite lists it in `expect_not_run`.
    NotRun,
    /// The suite turned it off.
    Off,
    /// The record lacks what it compares: a trainer that does not record it (another
    /// trainer's record without memory figures, say). Never a pass; the outcome's `reason`
    /// says what is missing.
    NotApplicable,
}

/// A check's verdict, figures and failures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// The check.
    pub check: Check,
    /// The verdict.
    pub status: Status,
    /// How many things it compared (steps, resume points, phases, ...; see each check).
    pub compared: u64,
    /// How many a complete record of the suite holds: fewer compared is not a pass. A summary
    /// written before this was recorded reads as 0 (last night's baseline stays readable).
    #[serde(default)]
    pub implied: u64,
    /// What it measured, by name.
    pub figures: BTreeMap<String, serde_json::Value>,
    /// What it found wrong.
    pub failures: Vec<Failure>,
    /// Why it is not applicable, for [`Status::NotApplicable`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Outcome {
    /// The verdict of `check` over `r`, having compared `compared` of the `implied` things a
    /// complete record of the suite holds: failed with any failure; below `implied`, not run
    /// when an out-of-memory error ended the run early, and failed otherwise (the record lacks
    /// what the suite's phases should have produced); not run when it compared nothing; passed
    /// otherwise.
    pub fn new(
        check: Check,
        r: &RunRecord,
        compared: u64,
        implied: u64,
        mut failures: Vec<Failure>,
    ) -> Self {
        if compared < implied && !r.ended_early() {
            failures.push(
                Failure::new(check, r, "comparisons")
                    .saw(format!("{implied}, as the suite's phases imply"), compared)
                    .detail("the record lacks steps or phases the suite plans, and no out-of-memory error ended it"),
            );
        }
        let status = if !failures.is_empty() {
            Status::Failed
        } else if compared == 0 || compared < implied {
            Status::NotRun
        } else {
            Status::Passed
        };
        Outcome {
            check,
            status,
            compared,
            implied,
            figures: BTreeMap::new(),
            failures,
            reason: None,
        }
    }

    /// A check the suite asks nothing of (`peak_budget` without budgets): passed, having
    /// compared nothing.
    pub fn nothing_asked(check: Check) -> Self {
        Outcome {
            status: Status::Passed,
            ..Outcome::off(check)
        }
    }

    /// A check the suite turned off.
    pub fn off(check: Check) -> Self {
        Outcome {
            check,
            status: Status::Off,
            compared: 0,
            implied: 0,
            figures: BTreeMap::new(),
            failures: Vec::new(),
            reason: None,
        }
    }

    /// A check whose inputs the record lacks: `missing` says which, for people.
    pub fn not_applicable(check: Check, missing: impl Into<String>) -> Self {
        Outcome {
            status: Status::NotApplicable,
            reason: Some(missing.into()),
            ..Outcome::off(check)
        }
    }

    /// Adds a figure.
    pub fn with(mut self, name: &'static str, value: impl Into<serde_json::Value>) -> Self {
        self.figures.insert(name.into(), value.into());
        self
    }

    /// Whether the check ran and failed.
    pub fn failed(&self) -> bool {
        self.status == Status::Failed
    }

    /// Whether the check had nothing to compare.
    pub fn not_run(&self) -> bool {
        self.status == Status::NotRun
    }
}

/// The stored golden snapshot a run is compared with.
#[derive(Clone, Debug, Default)]
pub struct GoldenInput {
    /// The snapshot file, as named in messages.
    pub file: String,
    /// Its content, normalised; `None` when there is none.
    pub stored: Option<String>,
    /// The execution environments its numbers were made in (its `environment:`), where they
    /// hold only there; empty for a snapshot that holds everywhere.
    pub made_in: Vec<String>,
    /// The execution environment of the device the run is compared on (see
    /// [`golden::environment`]).
    pub here: Option<String>,
    /// Where `run --bless` writes the snapshot of this environment when `file` was made in
    /// another.
    pub here_file: String,
}

/// Runs every check `spec` enables over `r`, in report order.
pub fn run_all(r: &RunRecord, spec: &ChecksSpec, golden: &GoldenInput) -> Vec<Outcome> {
    let input = Input {
        record: r,
        spec,
        golden,
    };
    Check::ALL
        .into_iter()
        .map(|check| {
            if !spec.enabled(check) {
                return Outcome::off(check);
            }
            if let Some(field) = check.needs().iter().find(|f| r.lacks.contains(f)) {
                return Outcome::not_applicable(check, format!("the record lacks it: {field}"));
            }
            check.run(&input)
        })
        .collect()
}

/// `a - b` per category, clamped at zero.
pub fn excess(a: &Breakdown, b: &Breakdown) -> Breakdown {
    Breakdown {
        params: a.params.saturating_sub(b.params),
        grads: a.grads.saturating_sub(b.grads),
        optimizer: a.optimizer.saturating_sub(b.optimizer),
        activations: a.activations.saturating_sub(b.activations),
        workspace: a.workspace.saturating_sub(b.workspace),
        io: a.io.saturating_sub(b.io),
    }
}

/// The per-category breakdown of `b` and the likely fix for the category that dominates it.
pub fn memory_detail(b: &Breakdown) -> String {
    let fix = match b.largest() {
        Category::Activations => {
            "activations dominate: enable activation checkpointing (checkpointing: full or selective), or shorten seq_len or batch_size"
        }
        Category::Params => {
            "params dominate: use bf16-mixed precision or a smaller model, or raise the budget"
        }
        Category::Grads => {
            "grads dominate: gradients are held in f32 for every parameter; use a smaller model or raise the budget"
        }
        Category::Optimizer => {
            "optimizer state dominates: AdamW holds two f32 moments (and f32 masters in bf16-mixed) per parameter; use a smaller model or raise the budget"
        }
        Category::Workspace => {
            "workspace dominates: use the chunked loss (loss: {kind: chunked, chunk_tokens: N}) or fewer threads"
        }
        Category::Io => {
            "io dominates: checkpoint or data staging buffers are large; load checkpoints tensor by tensor"
        }
    };
    format!("by category: {b}; {fix}")
}

/// Bytes for people, with the exact count.
pub fn bytes(n: u64) -> String {
    if n < 1024 {
        human_bytes(n)
    } else {
        format!("{} ({n} bytes)", human_bytes(n))
    }
}

#[cfg(test)]
pub(crate) mod fixtures {
    //! Hand-made records: a faithful run that every check passes.

    use crate::record::ranks::{RankModel, RankPhase, RankStep, WorldModel};
    use crate::record::saves::{SaveRecord, SavedState};
    use crate::record::{
        EvalRecord, Oom, Phase, PhaseRecord, PlannedPhase, PredictedStep, RunRecord, StepRecord,
        Window,
    };
    use ckpt_engine::checkpoint::state::RngState;
    use ckpt_engine::data::{LoaderState, SampleId};
    use ckpt_engine::memory::{Breakdown, MemoryStats, Usage};
    use ckpt_engine::StateDigest;

    /// Held between steps.
    pub const HELD: Breakdown = Breakdown {
        params: 1000,
        grads: 1000,
        optimizer: 2000,
        activations: 0,
        workspace: 0,
        io: 0,
    };
    /// The step peak's breakdown.
    pub const AT_PEAK: Breakdown = Breakdown {
        params: 1000,
        grads: 1000,
        optimizer: 2000,
        activations: 3000,
        workspace: 500,
        io: 0,
    };

    /// A step of the faithful run.
    pub fn step(step: u64) -> StepRecord {
        StepRecord {
            step,
            loss: 4.0 - step as f32 * 0.125,
            lr: 0.001 * (step + 1) as f64,
            grad_norm: 1.5,
            batch_digest: format!("batch{step}"),
            samples: (step * 4..step * 4 + 4)
                .map(|n| SampleId {
                    epoch: n / 10,
                    index: n % 10,
                })
                .collect(),
            recomputed_blocks: 2,
            tokens_per_expert: Vec::new(),
            predicted: None,
            start: HELD,
            staging: 0,
            memory: MemoryStats {
                allocated: Usage {
                    current: HELD.total(),
                    peak: AT_PEAK.total(),
                },
                reserved: Usage {
                    current: HELD.total(),
                    peak: AT_PEAK.total(),
                },
                current: HELD,
                peak_by_category: AT_PEAK,
                at_peak: AT_PEAK,
                capacity: u64::MAX,
                alloc_count: 10,
                oom_count: 0,
            },
            seconds: 0.01,
            ranks: Vec::new(),
        }
    }

    /// An allocation of `requested` bytes refused at `step` (`None`: building the trainer) with
    /// `allocated` bytes held, most of them activations.
    pub fn oom(step: Option<u64>, allocated: u64, requested: u64) -> Oom {
        Oom {
            message: "out of memory".into(),
            step,
            requested,
            allocated,
            by_category: Breakdown {
                activations: allocated,
                ..Breakdown::default()
            },
        }
    }

    /// The state before `step`.
    pub fn digest(step: u64) -> StateDigest {
        StateDigest {
            step,
            params: format!("params{step}"),
            optimizer: format!("opt{step}"),
            optimizer_steps: step,
            next_lr: 0.001 * (step + 1) as f64,
            loader: LoaderState {
                position: step * 4,
                ..LoaderState::default()
            },
            rng: RngState {
                seed: 0,
                offset: step,
            },
        }
    }

    /// `r` with a validation split evaluated after steps 3 and 6, each phase evaluating after
    /// those it trains past.
    pub fn validated(mut r: RunRecord) -> RunRecord {
        r.planned_evaluations = vec![3, 6];
        for p in &mut r.phases {
            let from = p.steps.first().map_or(0, |s| s.step);
            let end = p.steps.last().map_or(0, |s| s.step + 1);
            p.evaluations = (r.planned_evaluations.iter())
                .filter(|&&s| s > from && s <= end)
                .map(|&s| evaluation(s))
                .collect();
        }
        r
    }

    /// The evaluation after `step` steps: its loss and batches depend on the step alone.
    pub fn evaluation(step: u64) -> EvalRecord {
        EvalRecord {
            step,
            loss: 2.0 + step as f32 / 16.0,
            tokens: 40,
            batch_digest: format!("eval-{step}"),
            ..EvalRecord::default()
        }
    }

    fn phase(phase: Phase, from: u64, end: u64) -> PhaseRecord {
        PhaseRecord {
            phase,
            steps: (from..end).map(step).collect(),
            resumed_digest: (from > 0).then(|| digest(from)),
            reference_digest: (from > 0).then(|| digest(from)),
            setup: Window {
                peak: if from > 0 { HELD.total() } else { 0 },
                at_peak: if from > 0 { HELD } else { Breakdown::default() },
                oom_count: 0,
            },
            ..PhaseRecord::default()
        }
    }

    /// A faithful run: 6 steps, resumed at 2 and at 4, two checkpointed blocks.
    pub fn run() -> RunRecord {
        let mut first = PredictedStep {
            start: HELD,
            peak: AT_PEAK.total(),
            at_peak: AT_PEAK,
        };
        let later = first.clone();
        first.start.optimizer = 0;
        let mut r = RunRecord {
            name: "cpu::s".into(),
            suite: "s".into(),
            device: "cpu".into(),
            layers: 2,
            params: 250,
            checkpointing: true,
            predicted: [first, later],
            predicted_long: None,
            predicted_load: HELD.total(),
            predicted_staging: 0,
            planned_saves: vec![2, 4, 6],
            planned_evaluations: Vec::new(),
            capacity: u64::MAX,
            budget: None,
            rss_budget: None,
            samples_per_epoch: 10,
            dataset_samples: None,
            planned: [
                (Phase::Reference, 0),
                (Phase::ResumeMid, 2),
                (Phase::ResumeEnd, 4),
            ]
            .map(|(phase, from)| PlannedPhase {
                phase,
                from,
                end: 6,
                world_size: 1,
            })
            .to_vec(),
            phases: vec![
                phase(Phase::Reference, 0, 6),
                phase(Phase::ResumeMid, 2, 6),
                phase(Phase::ResumeEnd, 4, 6),
            ],
            worlds: Vec::new(),
            lacks: Default::default(),
            text: None,
        };
        r.phases[0].steps[0].start.optimizer = 0;
        r.phases[0].saves = [2, 4, 6].map(save).to_vec();
        r
    }

    /// The asynchronous save of the state before `step`, read back as it was asked for and
    /// identical to its synchronous twin.
    pub fn save(step: u64) -> SaveRecord {
        let d = digest(step);
        let state = SavedState {
            step,
            optimizer_steps: d.optimizer_steps,
            params: d.params,
            optimizer: d.optimizer,
        };
        SaveRecord {
            step,
            asynchronous: true,
            in_memory: state.clone(),
            on_disk: Some(state),
            differing_files: Some(Vec::new()),
            named: None,
            unreadable: None,
        }
    }

    /// A faithful chained run: the run above with `resume_from: [2, 3]`, `resume-mid` saving at
    /// step 3 and `resume-mid-2` resuming there.
    pub fn chained() -> RunRecord {
        let mut r = run();
        let chained = PlannedPhase {
            phase: Phase::ResumeChained(2),
            from: 3,
            end: 6,
            world_size: 1,
        };
        r.planned.insert(2, chained);
        r.phases.insert(2, phase(Phase::ResumeChained(2), 3, 6));
        r
    }

    /// The faithful run on `world` ranks in every phase, each rank holding what the one device
    /// holds, under a memory model that says so.
    pub fn ranked(world: usize) -> RunRecord {
        let mut r = run();
        for p in &mut r.planned {
            p.world_size = world;
        }
        for p in &mut r.phases {
            let mine = RankPhase {
                before: p.before,
                after: p.after,
                setup: p.setup.clone(),
                host: None,
            };
            p.ranks = vec![mine; world];
            for s in &mut p.steps {
                let mine = RankStep {
                    start: s.start,
                    staging: s.staging,
                    memory: s.memory.clone(),
                    predicted: s.predicted.clone(),
                };
                s.ranks = vec![mine; world];
            }
        }
        let model = RankModel {
            predicted: r.predicted.clone(),
            predicted_long: None,
            predicted_load: r.predicted_load,
            predicted_staging: 0,
            capacity: r.capacity,
            budget: r.budget,
        };
        r.worlds = vec![WorldModel {
            world_size: world,
            ranks: vec![model; world],
        }];
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::spec::{ChecksSpec, Continuity};

    #[test]
    fn each_check_is_written_in_suites_and_summaries_by_its_module_s_name() {
        for check in Check::ALL {
            let json = serde_json::to_string(&check).unwrap();
            assert_eq!(json, format!("\"{}\"", check.name()));
            assert_eq!(serde_json::from_str::<Check>(&json).unwrap(), check);
        }
        assert_eq!(Check::NAMES[0], "loss_continuity");
        assert_eq!(Check::ALL.len(), 14);
    }

    /// Every check over `r`, with its own trajectory as the snapshot.
    fn outcomes(r: &RunRecord) -> Vec<Outcome> {
        let golden = GoldenInput {
            file: "g.snap".into(),
            stored: Some(golden::render(r)),
            ..GoldenInput::default()
        };
        run_all(r, &ChecksSpec::default(), &golden)
    }

    #[test]
    fn a_faithful_run_passes_every_check() {
        for o in outcomes(&fixtures::run()) {
            assert_eq!(o.status, Status::Passed, "{:?}", o.failures);
        }
    }

    #[test]
    fn every_check_says_how_much_it_compared_of_what_the_suite_implies() {
        let compared: Vec<(Check, u64, u64)> = outcomes(&fixtures::run())
            .iter()
            .map(|o| (o.check, o.compared, o.implied))
            .collect();
        use Check::*;
        assert_eq!(
            compared,
            [
                (LossContinuity, 6, 6),
                (StateDigest, 2, 2),
                (DataLedger, 12, 12),
                (MemoryReclaimed, 3, 3),
                (MemoryParity, 6, 6),
                (PeakBudget, 0, 0),
                (NoLeak, 9, 9),
                (AcCoverage, 12, 12),
                (MemoryModel, 14, 14),
                (OomFree, 15, 15),
                (Golden, 6, 6),
                (EvalContinuity, 0, 0),
                (Finite, 12, 12),
                (CheckpointEquivalence, 3, 3),
            ]
        );
    }

    #[test]
    fn a_faithful_chained_run_passes_every_check_counting_every_resume() {
        let r = fixtures::chained();
        let compared: Vec<(Check, Status, u64, u64)> = outcomes(&r)
            .iter()
            .map(|o| (o.check, o.status, o.compared, o.implied))
            .collect();
        use Check::*;
        use Status::*;
        assert_eq!(
            compared,
            [
                (LossContinuity, Passed, 9, 9),
                (StateDigest, Passed, 3, 3),
                (DataLedger, Passed, 15, 15),
                (MemoryReclaimed, Passed, 4, 4),
                (MemoryParity, Passed, 9, 9),
                (PeakBudget, Passed, 0, 0),
                (NoLeak, Passed, 11, 11),
                (AcCoverage, Passed, 15, 15),
                (MemoryModel, Passed, 18, 18),
                (OomFree, Passed, 19, 19),
                (Golden, Passed, 6, 6),
                (EvalContinuity, Passed, 0, 0),
                (Finite, Passed, 15, 15),
                (CheckpointEquivalence, Passed, 3, 3),
            ]
        );
        let mut lost = r.clone();
        lost.phases.remove(2);
        let failed: Vec<Check> = outcomes(&lost)
            .iter()
            .filter(|o| o.failed())
            .map(|o| o.check)
            .collect();
        assert_eq!(
            failed,
            [
                LossContinuity,
                StateDigest,
                DataLedger,
                MemoryReclaimed,
                MemoryParity,
                NoLeak,
                AcCoverage,
                MemoryModel,
                OomFree,
                Finite
            ],
            "a chain's lost resume is missed by no check that counts it"
        );
    }

    /// `loader_offset_lost_on_resave` as a record shows it: `resume-mid` (from the reference's
    /// checkpoint) is faithful; `resume-mid-2` resumes from the checkpoint `resume-mid` saved at
    /// step 3, which holds only the 4 samples read since step 2, so it reads step 1's rows again.
    #[test]
    fn a_resave_that_loses_the_resumed_offset_fails_the_second_resume_only() {
        let mut r = fixtures::chained();
        let second = &mut r.phases[2];
        second.resumed_digest.as_mut().unwrap().loader.position = 4;
        for s in &mut second.steps {
            let reread = fixtures::step(s.step - 2);
            s.samples = reread.samples;
            s.batch_digest = reread.batch_digest;
            s.loss = reread.loss;
        }
        let out = outcomes(&r);
        let failed: Vec<Check> = out.iter().filter(|o| o.failed()).map(|o| o.check).collect();
        use Check::*;
        assert_eq!(failed, [LossContinuity, StateDigest, DataLedger]);
        for o in out.iter().filter(|o| o.failed()) {
            for f in &o.failures {
                assert_eq!(f.phase, Some(Phase::ResumeChained(2)), "{f}");
            }
        }
        let digest = &out[1].failures;
        assert_eq!(
            digest[0].to_string(),
            "state_digest: cpu::s resume-mid-2 step 3: loader position: expected LoaderState { epoch: 0, position: 12, shuffle_seed: 0, in_flight: None }, got LoaderState { epoch: 0, position: 4, shuffle_seed: 0, in_flight: None }"
        );
        let ledger: Vec<&str> = out[2].failures.iter().map(|f| f.what.as_str()).collect();
        assert_eq!(
            ledger,
            ["sample ledger", "epoch order"],
            "epoch 0's samples again"
        );
    }

    /// The statuses of every check over `r`, in report order.
    fn statuses(r: &RunRecord) -> Vec<(Check, Status)> {
        outcomes(r).iter().map(|o| (o.check, o.status)).collect()
    }

    #[test]
    fn a_record_short_of_what_the_suite_implies_fails_every_check_that_counts_it() {
        use Check::*;
        use Status::*;
        let mut lost_step = fixtures::run();
        lost_step.phases[2].steps.pop();
        let mut lost_phase = fixtures::run();
        lost_phase.phases.pop();
        for (r, passing) in [
            (
                lost_step,
                [StateDigest, MemoryReclaimed, Golden, CheckpointEquivalence].as_slice(),
            ),
            (lost_phase, [Golden, CheckpointEquivalence].as_slice()),
        ] {
            for (check, status) in statuses(&r) {
                let nothing_asked = [PeakBudget, EvalContinuity].contains(&check);
                let want = if nothing_asked || passing.contains(&check) {
                    Passed
                } else {
                    Failed
                };
                assert_eq!(status, want, "{check}");
            }
            let o = loss_continuity::check(&r, Continuity::Bitwise);
            let f = o.failures.last().unwrap().to_string();
            assert!(
                f.starts_with("loss_continuity: cpu::s: comparisons: expected 6, as the suite's phases imply, got "),
                "{f}"
            );
        }
    }

    #[test]
    fn checks_left_short_by_an_out_of_memory_did_not_run() {
        let mut r = fixtures::run();
        r.phases.truncate(1);
        r.phases[0].steps.truncate(1);
        r.phases[0].saves.clear();
        r.phases[0].oom = Some(fixtures::oom(Some(1), 4000, 1000));
        use Check::*;
        use Status::*;
        assert_eq!(
            statuses(&r),
            [
                (LossContinuity, NotRun),
                (StateDigest, NotRun),
                (DataLedger, NotRun),
                (MemoryReclaimed, NotRun),
                (MemoryParity, NotRun),
                (PeakBudget, Passed),
                (NoLeak, NotRun),
                (AcCoverage, NotRun),
                (MemoryModel, NotRun),
                (OomFree, Failed),
                (Golden, NotRun),
                (EvalContinuity, Passed),
                (Finite, NotRun),
                (CheckpointEquivalence, NotRun),
            ]
        );
    }

    /// A record without a part a check compares leaves that check not applicable, saying which
    /// part is missing, whatever the check would have made of the defaults; the others run.
    #[test]
    fn a_check_whose_inputs_the_record_lacks_is_not_applicable() {
        use Check::*;
        let mut r = fixtures::run();
        for p in &mut r.phases {
            for s in &mut p.steps {
                s.samples.clear();
            }
        }
        assert_eq!(data_ledger::check(&r).status, Status::Failed);
        r.lacks.insert(RecordField::Samples);
        let o = &outcomes(&r)[2];
        assert_eq!((o.check, o.status), (DataLedger, Status::NotApplicable));
        assert_eq!(
            o.reason.as_deref(),
            Some("the record lacks it: no step line carries `samples`")
        );
        assert!(o.failures.is_empty());
        r.lacks = [
            RecordField::StepMemory,
            RecordField::DeviceMemory,
            RecordField::StepByCategory,
            RecordField::MemoryByCategory,
            RecordField::RecomputedBlocks,
            RecordField::MemoryModel,
            RecordField::OomCount,
            RecordField::OnDisk,
        ]
        .into();
        let applicable: Vec<Check> = outcomes(&r)
            .iter()
            .filter(|o| o.status != Status::NotApplicable)
            .map(|o| o.check)
            .collect();
        assert_eq!(
            applicable,
            [
                LossContinuity,
                StateDigest,
                DataLedger,
                Golden,
                EvalContinuity,
                Finite
            ]
        );
    }

    #[test]
    fn turned_off_checks_do_not_run() {
        let spec: ChecksSpec = serde_saphyr::from_str("golden: false").unwrap();
        let golden = GoldenInput {
            file: "g.snap".into(),
            stored: None,
            ..GoldenInput::default()
        };
        let out = run_all(&fixtures::run(), &spec, &golden);
        assert_eq!(
            (out[10].check, out[10].status),
            (Check::Golden, Status::Off)
        );
    }

    #[test]
    fn memory_details_name_the_fix() {
        let d = memory_detail(&fixtures::AT_PEAK);
        assert!(
            d.contains("activations dominate: enable activation checkpointing"),
            "{d}"
        );
        assert!(d.contains("activations 2.9 KiB"), "{d}");
    }

    #[test]
    fn failures_say_where_and_what() {
        let r = fixtures::run();
        let f = Failure::new(Check::NoLeak, &r, "allocated at the step's end")
            .phase(Phase::ResumeMid)
            .step(3)
            .saw(1, 2)
            .detail("why");
        assert_eq!(
            f.to_string(),
            "no_leak: cpu::s resume-mid step 3: allocated at the step's end: expected 1, got 2; why"
        );
    }

    #[test]
    fn an_outcome_says_whether_it_failed_or_did_not_run() {
        let r = fixtures::run();
        let passed = Outcome::new(Check::Finite, &r, 12, 12, Vec::new());
        assert_eq!(
            (passed.status, passed.failed(), passed.not_run()),
            (Status::Passed, false, false)
        );
        let nothing = Outcome::new(Check::Finite, &r, 0, 0, Vec::new());
        assert_eq!(
            (nothing.status, nothing.failed(), nothing.not_run()),
            (Status::NotRun, false, true)
        );
        let short = Outcome::new(Check::Finite, &r, 11, 12, Vec::new());
        assert_eq!(
            (short.status, short.failed(), short.not_run()),
            (Status::Failed, true, false)
        );
        assert!(!Outcome::off(Check::Finite).not_run());
    }

    #[test]
    fn byte_counts_from_a_kibibyte_on_carry_the_exact_figure() {
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.0 KiB (1024 bytes)");
    }
}
