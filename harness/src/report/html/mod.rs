//! `index.html`: the run for people, self-contained (inline SVG and CSS, no script, no network).
//! At the top what changed against the baseline, then the benchmarks' figures measured with
//! the run (when they were), then every trial: its checks' verdicts with
//! each failure's expected against actual, the loss curves of the phases, the memory
//! timeline stacked by category, the memory anatomy (estimate against measured, bytes per
//! parameter), and wall time per phase and per step. The page is the template
//! `templates/report.html` filled from [`Summary`] alone, so a merged summary renders as a run's.

pub mod plots;
pub mod timeline;

use crate::checks::Check;
use crate::record::{HostMemory, Phase, RunRecord};
use crate::report::bench::Bench;
use crate::report::summary::{Skipped, Summary, FAILURES_SHOWN};
use crate::report::trends::{status_name, Trends};
use crate::run::memory_trace;
use crate::run::trial::TrialResult;
use anyhow::{Context, Result};
use askama::Template;
use ckpt_engine::memory::{human_bytes, Category};
use std::path::Path;
use timeline::{phase_summary, slots};

/// One failure as the page shows it.
struct FailureView {
    place: String,
    what: String,
    expected: String,
    actual: String,
    detail: String,
}

/// One check's row.
struct CheckView {
    name: &'static str,
    status: &'static str,
    expected_to_fail: bool,
    compared: u64,
    /// Why the check is not applicable; empty otherwise.
    reason: String,
    failures: Vec<FailureView>,
    more: usize,
}

/// One category's row of the anatomy table.
struct AnatomyRow {
    category: &'static str,
    colour: String,
    estimate: String,
    measured: String,
    difference: String,
    per_param_estimate: String,
    per_param_measured: String,
}

/// One phase's row of the time and reclaim table.
struct PhaseRow {
    phase: String,
    steps: usize,
    setup: String,
    median_step: String,
    max_step: String,
    total: String,
    held_at_end: String,
    reclaimed: String,
    left_behind: String,
}

/// One phase's row of the ranks table: each rank's figures, in rank order.
struct RankRow {
    phase: String,
    cells: Vec<String>,
}

/// A memory trace file of the trial.
struct TraceLink {
    phase: String,
    href: String,
}

/// One trial's section.
struct TrialView {
    id: String,
    name: String,
    passed: bool,
    negative_control: bool,
    seconds: String,
    path: String,
    verdict: String,
    failed_checks: String,
    checks: Vec<CheckView>,
    recorded: bool,
    divergence: String,
    loss_svg: String,
    memory_svg: String,
    time_svg: String,
    anatomy: Vec<AnatomyRow>,
    anatomy_note: String,
    phases: Vec<PhaseRow>,
    rank_columns: Vec<String>,
    ranks: Vec<RankRow>,
    traces: Vec<TraceLink>,
}

/// One change against the baseline.
struct ChangeView {
    regression: bool,
    kind: &'static str,
    trial: String,
    what: String,
    before: String,
    after: String,
}

/// The changes section.
struct TrendsView {
    baseline: String,
    regressions: usize,
    changes: Vec<ChangeView>,
}

/// One row of the benchmarks table.
struct FigureRow {
    name: String,
    value: String,
    reference: bool,
}

/// The benchmarks section.
struct BenchView {
    command: String,
    machine: String,
    figures: Vec<FigureRow>,
}

/// The page.
#[derive(Template)]
#[template(path = "report.html")]
struct Page {
    passed: usize,
    failed: usize,
    skipped: Vec<Skipped>,
    trends: Option<TrendsView>,
    bench: Option<BenchView>,
    trials: Vec<TrialView>,
}

/// The page id of a trial: `cpu::faults::x` → `cpu-faults-x`.
pub fn trial_id(name: &str) -> String {
    name.replace("::", "-")
}

/// The first resumed step whose check `loss_continuity` failed.
fn divergence(t: &TrialResult) -> Option<(Phase, u64)> {
    t.checks
        .iter()
        .filter(|o| o.check == Check::LossContinuity)
        .flat_map(|o| &o.failures)
        .filter_map(|f| Some((f.phase?, f.step?)))
        .min_by_key(|&(p, s)| (s, p))
}

fn checks(t: &TrialResult) -> Vec<CheckView> {
    t.checks
        .iter()
        .map(|o| CheckView {
            name: o.check.name(),
            status: status_name(o.status),
            expected_to_fail: t.expect_fail.contains(&o.check),
            compared: o.compared,
            reason: o.reason.clone().unwrap_or_default(),
            failures: o
                .failures
                .iter()
                .take(FAILURES_SHOWN)
                .map(|f| FailureView {
                    place: [
                        f.rank.map(|r| format!("rank {r}")),
                        f.phase.map(|p| p.to_string()),
                        f.step.map(|s| format!("step {s}")),
                    ]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join(" "),
                    what: f.what.clone(),
                    expected: f.expected.clone(),
                    actual: f.actual.clone(),
                    detail: f.detail.clone().unwrap_or_default(),
                })
                .collect(),
            more: o.failures.len().saturating_sub(FAILURES_SHOWN),
        })
        .collect()
}

/// `a` over `params`, to two decimals.
fn per_param(bytes: u64, params: u64) -> String {
    if params == 0 {
        return "-".into();
    }
    format!("{:.2}", bytes as f64 / params as f64)
}

/// The anatomy of the steadiest step: the reference step with the largest peak once AdamW's
/// moments exist, against the memory model's prediction for it.
fn anatomy(r: &RunRecord) -> (Vec<AnatomyRow>, String) {
    let Some(p) = r.reference() else {
        return (Vec::new(), String::new());
    };
    let Some(s) = p
        .steps
        .iter()
        .skip(1)
        .max_by_key(|s| s.memory.allocated.peak)
    else {
        return (Vec::new(), String::new());
    };
    let want = r.predicted_for(s.step, false);
    let base = p.before;
    let mut rows = Vec::new();
    let row = |name, colour: String, est: u64, got: u64| AnatomyRow {
        category: name,
        colour,
        estimate: human_bytes(est),
        measured: human_bytes(got),
        difference: match got.cmp(&est) {
            std::cmp::Ordering::Equal => "=".into(),
            std::cmp::Ordering::Greater => format!("+{}", human_bytes(got - est)),
            std::cmp::Ordering::Less => format!("-{}", human_bytes(est - got)),
        },
        per_param_estimate: per_param(est, r.params),
        per_param_measured: per_param(got, r.params),
    };
    for (c, colour) in Category::ALL.into_iter().zip(plots::CATEGORY_COLOURS) {
        let got = s.memory.at_peak.get(c).saturating_sub(base.get(c));
        let hex = format!("#{:02x}{:02x}{:02x}", colour.0, colour.1, colour.2);
        rows.push(row(c.name(), hex, want.at_peak.get(c), got));
    }
    let got = s.memory.allocated.peak.saturating_sub(base.total());
    rows.push(row("total", String::new(), want.peak, got));
    let note = format!(
        "at the peak of reference step {} ({} parameters)",
        s.step, r.params
    );
    (rows, note)
}

fn phase_rows(r: &RunRecord) -> Vec<PhaseRow> {
    let secs = |s: Option<f64>| s.map_or("-".into(), |s| format!("{s:.4} s"));
    r.phases
        .iter()
        .map(|p| {
            let s = phase_summary(p);
            PhaseRow {
                phase: p.phase.to_string(),
                steps: s.steps,
                setup: format!("{:.3} s", s.setup_seconds),
                median_step: secs(s.median_step_seconds),
                max_step: secs(s.max_step_seconds),
                total: format!("{:.3} s", s.seconds),
                held_at_end: human_bytes(s.held_at_end),
                reclaimed: human_bytes(s.reclaimed),
                left_behind: if s.left_behind == 0 {
                    "nothing".into()
                } else {
                    human_bytes(s.left_behind)
                },
            }
        })
        .collect()
}

/// The ranks side by side, one row per phase on more than one rank: each rank's largest step
/// peak against its memory model's, what it held after the trainer was dropped and, where each
/// rank is a process of its own, the resident host memory its process added. The column
/// headers come first, one per rank of the widest phase.
fn rank_rows(r: &RunRecord) -> (Vec<String>, Vec<RankRow>) {
    let model = |world: usize, rank: usize| {
        r.worlds
            .iter()
            .find(|w| w.world_size == world)
            .and_then(|w| w.ranks.get(rank))
    };
    let rows: Vec<RankRow> = r
        .phases
        .iter()
        .filter(|p| !p.ranks.is_empty())
        .map(|p| RankRow {
            phase: p.phase.to_string(),
            cells: (0..p.ranks.len())
                .map(|rank| {
                    let peak = p.steps.iter().filter_map(|s| s.ranks.get(rank));
                    let peak = peak.map(|s| s.memory.allocated.peak).max().unwrap_or(0);
                    let predicted = model(p.ranks.len(), rank)
                        .map_or("-".into(), |m| human_bytes(m.predicted[1].peak));
                    let mine = &p.ranks[rank];
                    let left = mine.after.total().saturating_sub(mine.before.total());
                    let process = (mine.host.as_ref().and_then(HostMemory::growth))
                        .map_or(String::new(), |g| {
                            format!("; process +{} resident", human_bytes(g))
                        });
                    format!(
                        "peak {} (model {predicted}); {} left{process}",
                        human_bytes(peak),
                        human_bytes(left)
                    )
                })
                .collect(),
        })
        .collect();
    let widest = rows.iter().map(|row| row.cells.len()).max().unwrap_or(0);
    ((0..widest).map(|r| format!("rank {r}")).collect(), rows)
}

/// The trace files of `t` under `dir`, linked relative to it.
fn traces(dir: &Path, t: &TrialResult) -> Vec<TraceLink> {
    let trial_dir = memory_trace::trial_dir(Path::new(memory_trace::DIR), &t.name);
    t.record
        .phases
        .iter()
        .map(|p| trial_dir.join(format!("{}.pickle", p.phase)))
        .filter(|f| dir.join(f).is_file())
        .map(|f| TraceLink {
            phase: f
                .file_stem()
                .map_or(String::new(), |s| s.to_string_lossy().into_owned()),
            href: f.to_string_lossy().replace('\\', "/"),
        })
        .collect()
}

fn trial(dir: &Path, t: &TrialResult) -> Result<TrialView> {
    let r = &t.record;
    let recorded = !r.phases.is_empty();
    let div = divergence(t);
    let (loss_svg, memory_svg, time_svg) = if recorded {
        let s = slots(r);
        (
            plots::loss(r, div)?,
            plots::memory(r, &s)?,
            plots::time(&s)?,
        )
    } else {
        Default::default()
    };
    let (anatomy, anatomy_note) = anatomy(r);
    let (rank_columns, ranks) = rank_rows(r);
    Ok(TrialView {
        id: trial_id(&t.name),
        name: t.name.clone(),
        passed: t.passed,
        negative_control: !t.expect_fail.is_empty(),
        seconds: format!("{:.2}", t.seconds),
        path: t.path.display().to_string(),
        verdict: t.verdict.clone(),
        failed_checks: t
            .failed_checks()
            .iter()
            .map(|c| c.name())
            .collect::<Vec<_>>()
            .join(", "),
        checks: checks(t),
        recorded,
        divergence: div.map_or(String::new(), |(p, s)| format!("{p} step {s}")),
        loss_svg,
        memory_svg,
        time_svg,
        anatomy,
        anatomy_note,
        phases: phase_rows(r),
        rank_columns,
        ranks,
        traces: traces(dir, t),
    })
}

fn trends_view(t: &Trends) -> TrendsView {
    TrendsView {
        baseline: t.baseline.clone(),
        regressions: t.regressions(),
        changes: t
            .changes
            .iter()
            .map(|c| ChangeView {
                regression: c.kind.regression(),
                kind: c.kind.name(),
                trial: c.trial.clone(),
                what: c.what.clone(),
                before: c.before.clone(),
                after: c.after.clone(),
            })
            .collect(),
    }
}

fn bench_view(b: &Bench) -> BenchView {
    BenchView {
        command: b.command.clone(),
        machine: b.machine.clone(),
        figures: b
            .figures
            .iter()
            .map(|f| FigureRow {
                name: f.name.clone(),
                value: f.shown(),
                reference: f.reference,
            })
            .collect(),
    }
}

/// The page of `summary`, linking the memory traces found under `dir`.
pub fn render(summary: &Summary, dir: &Path) -> Result<String> {
    let page = Page {
        passed: summary.passed,
        failed: summary.failed,
        skipped: summary.skipped.clone(),
        trends: summary.trends.as_ref().map(trends_view),
        bench: summary.bench.as_ref().map(bench_view),
        trials: summary
            .trials
            .iter()
            .map(|t| trial(dir, t))
            .collect::<Result<_>>()?,
    };
    page.render().context("cannot fill the report's template")
}

/// Writes `index.html` of `summary` under `dir`.
pub fn write(summary: &Summary, dir: &Path) -> Result<()> {
    let text = render(summary, dir)?;
    crate::atomic_file::write(&dir.join("index.html"), text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;

    #[test]
    fn each_rank_s_cell_has_its_peak_model_and_leftover_and_its_process_s_growth() {
        let mut r = fixtures::ranked(2);
        let (columns, rows) = rank_rows(&r);
        assert_eq!(columns, ["rank 0", "rank 1"]);
        assert_eq!(rows.len(), r.phases.len());
        assert!(
            rows[0].cells[1].starts_with("peak "),
            "{}",
            rows[0].cells[1]
        );
        assert!(
            !rows[0].cells[1].contains("process"),
            "{}",
            rows[0].cells[1]
        );
        r.phases[0].ranks[1].host = Some(HostMemory {
            start_rss: Some(4 << 20),
            peak_rss: Some(5 << 20),
            reset: true,
        });
        let (_, rows) = rank_rows(&r);
        assert!(
            rows[0].cells[1].ends_with("; 0 B left; process +1.0 MiB resident"),
            "{}",
            rows[0].cells[1]
        );
    }
}
