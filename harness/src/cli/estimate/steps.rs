//! The plan's part of `estimate` on a suite: phase by phase, the step that sets its peak (its
//! micro-batches' shapes and samples, the rank, the peak by category and how far it sits from
//! the budget) and its evaluations' peak; the fix ladder; the plan as JSON.

use crate::forecast::ladder::{cheapest, Rung};
use crate::forecast::{Forecast, PhaseForecast};
use ckpt_engine::memory::human_bytes;

/// The section: a line a phase for its highest step with that step's micro-batches below it,
/// and its evaluations' highest peak; `limit` is the budget in bytes, where one is known.
pub(super) fn section(f: &Forecast, limit: Option<u64>, exact: bool) -> String {
    let show = |b: u64| match exact {
        true => format!("{b} B"),
        false => human_bytes(b),
    };
    let margin = |peak: u64| match limit {
        Some(l) if peak <= l => format!(", {} under the budget", show(l - peak)),
        Some(l) => format!(", {} OVER the budget", show(peak - l)),
        None => String::new(),
    };
    let steps: usize = f.phases.iter().map(|p| p.steps.len()).sum();
    let mut text = format!(
        "\nThe plan: {steps} steps in {} phases, {} distinct step shapes; the step that sets each phase's peak (every step: --json)\n",
        f.phases.len(),
        f.dry_runs
    );
    for p in &f.phases {
        let planned = &p.planned;
        text.push_str(&format!(
            "- {} (steps {}..{}, {} rank{}): ",
            planned.phase,
            planned.from,
            planned.end,
            planned.world_size,
            if planned.world_size == 1 { "" } else { "s" }
        ));
        let Some(s) = p.highest_step() else {
            text.push_str("no steps\n");
            continue;
        };
        let (rank, peak) = s.highest();
        text.push_str(&format!(
            "step {}{}, peak {}{} ({})\n",
            s.step,
            on_rank(p, rank),
            show(peak),
            margin(peak),
            s.ranks[rank].at_peak
        ));
        for line in f.micro_batch_lines(s.step) {
            text.push_str(&format!("  {line}\n"));
        }
        if let Some(e) = p
            .evaluations
            .iter()
            .max_by_key(|e| e.rank_peaks.iter().max())
        {
            let peak = e.rank_peaks.iter().copied().max().unwrap_or(0);
            text.push_str(&format!(
                "  evaluation after step {}: peak {}{} ({} micro-batches of the validation split)\n",
                e.step,
                show(peak),
                margin(peak),
                f.data.evaluation.len()
            ));
        }
    }
    text
}

/// ` on rank r` where the phase runs on more than one rank.
fn on_rank(p: &PhaseForecast, rank: usize) -> String {
    match p.planned.world_size {
        1 => String::new(),
        _ => format!(" on rank {rank}"),
    }
}

/// The plan as one JSON document: every step of every phase with each rank's prediction, the
/// data's batches, the budget in bytes (`null` where unknown) and the highest peak.
pub(super) fn json(f: &Forecast, limit: Option<u64>) -> serde_json::Result<serde_json::Value> {
    let mut v = serde_json::to_value(f)?;
    v["budget"] = serde_json::json!(limit);
    v["highest"] = match f.highest() {
        Some((peak, at)) => serde_json::json!({"peak": peak, "at": at}),
        None => serde_json::Value::Null,
    };
    Ok(v)
}

/// The fix ladder as a table, each change's highest peak and whether it fits, then the cheapest
/// that fits; nothing where the plan fits its budget.
pub(super) fn ladder_section(rungs: &[Rung], exact: bool) -> String {
    if rungs.is_empty() {
        return String::new();
    }
    let show = |b: u64| match exact {
        true => format!("{b} B"),
        false => human_bytes(b),
    };
    let mut text = String::from(
        "\nThe fix ladder: each change alone, planned again over the same data, in the playbook's order\n",
    );
    for r in rungs {
        text.push_str(&format!(
            "- {}: highest peak {}, {} ({})\n",
            r.change,
            show(r.peak),
            if r.fits { "fits" } else { "does not fit" },
            r.cost
        ));
    }
    text.push_str(&match cheapest(rungs) {
        Some(r) => format!("The cheapest change that fits: {}\n", r.change),
        None => "No single change fits; combine them (the columns above) or raise memory.budget\n"
            .into(),
    });
    text
}
