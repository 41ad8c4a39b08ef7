//! `golden`: the reference trajectory (losses to 6 significant digits, learning rates, and the
//! bytes of every category at each step's peak and end) equals its snapshot in `golden/`.
//!
//! Snapshots are `golden/<device>/<suite>.snap` files in the `.snap` layout (see
//! [`crate::snapshot`]). Checking never writes them; `ckpt-harness run --bless` rewrites them.

use super::{Check, Failure, GoldenInput, Outcome};
use crate::phases::{Phase, RunRecord, StepRecord};
use crate::snapshot::{normalise, Snapshot};
use anyhow::{Context, Result};
use ckpt_engine::memory::{Breakdown, Category};
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// `x` to 6 significant digits.
fn sig6(x: f64) -> String {
    format!("{x:.5e}")
}

fn categories(b: &Breakdown) -> String {
    Category::ALL
        .iter()
        .map(|&c| b.get(c).to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// How the line after a MoE step's row starts: its tokens per expert, which its memory depends on.
pub const TOKENS_PER_EXPERT: &str = "  tokens per expert: ";

/// Each block's tokens per expert, blocks separated by ` | `, a dense block as `-`.
fn tokens_per_expert(s: &StepRecord) -> String {
    s.tokens_per_expert
        .iter()
        .map(|counts| match counts.is_empty() {
            true => "-".to_string(),
            false => counts
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(" "),
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The snapshot text of a run's reference trajectory.
pub fn render(r: &RunRecord) -> String {
    let mut out = String::new();
    let names: Vec<&str> = Category::ALL.iter().map(|c| c.name()).collect();
    let _ = writeln!(out, "reference trajectory of {}", r.trial());
    let _ = writeln!(
        out,
        "step | loss | lr | peak bytes | at peak: {} | at end: {}",
        names.join(" "),
        names.join(" ")
    );
    for s in r.reference().map_or(&[][..], |p| &p.steps[..]) {
        let _ = writeln!(
            out,
            "{} | {} | {} | {} | {} | {}",
            s.step,
            sig6(s.loss as f64),
            sig6(s.lr),
            s.memory.allocated.peak,
            categories(&s.memory.at_peak),
            categories(&s.memory.current)
        );
        if !s.tokens_per_expert.is_empty() {
            let _ = writeln!(out, "{TOKENS_PER_EXPERT}{}", tokens_per_expert(s));
        }
    }
    normalise(&out)
}

/// The golden directory of the suite file `suite`: the nearest `golden/` directory in the
/// suite's directory or above it; without one, `golden/` beside the suite's directory (beside
/// `suites/` for `suites/faults/x.yaml` too), where `run --bless` creates it. Shown relative to
/// the working directory when it lies under it.
pub fn dir_for(suite: &Path) -> PathBuf {
    let Ok(file) = suite.canonicalize() else {
        return PathBuf::from("golden");
    };
    let found = file
        .ancestors()
        .skip(1)
        .map(|d| d.join("golden"))
        .find(|g| g.is_dir());
    let dir = found.unwrap_or_else(|| {
        let mut home = file.parent().unwrap_or(&file);
        if home.file_name().is_some_and(|n| n == "faults") {
            home = home.parent().unwrap_or(home);
        }
        home.parent().unwrap_or(home).join("golden")
    });
    let cwd = std::env::current_dir().and_then(|d| d.canonicalize());
    match cwd
        .ok()
        .and_then(|cwd| dir.strip_prefix(cwd).ok().map(Path::to_path_buf))
    {
        Some(relative) => relative,
        None => dir,
    }
}

/// Where the snapshot of `device`/`suite` lives under `dir`.
pub fn path(dir: &Path, device: &str, suite: &str) -> PathBuf {
    dir.join(device).join(format!("{suite}.snap"))
}

/// Reads the snapshot of `device`/`suite` under `dir`, if there is one.
pub fn load(dir: &Path, device: &str, suite: &str) -> Result<GoldenInput> {
    let file = path(dir, device, suite);
    let stored = if file.exists() {
        let content = std::fs::read_to_string(&file)
            .with_context(|| format!("{}: cannot read", file.display()))?;
        let snap =
            Snapshot::parse(&content).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
        Some(snap.text)
    } else {
        None
    };
    Ok(GoldenInput {
        file: file.display().to_string(),
        stored,
    })
}

/// Writes the run's snapshot under `dir`; returns its path.
pub fn bless(dir: &Path, r: &RunRecord) -> Result<PathBuf> {
    let file = path(dir, &r.device, &r.suite);
    let snap = Snapshot {
        source: "harness/src/checks/golden.rs".into(),
        expression: format!("reference trajectory of {}", r.trial()),
        text: render(r),
    };
    crate::report_file::write(&file, snap.to_file().as_bytes())?;
    Ok(file)
}

/// Compares the run's reference trajectory with the stored snapshot; `compared` counts the
/// reference steps.
pub fn check(r: &RunRecord, golden: &GoldenInput) -> Outcome {
    let fresh = render(r);
    let fail = |what: &str| Failure::new(Check::Golden, r, what).phase(Phase::Reference);
    let failures = match &golden.stored {
        None => vec![fail("snapshot")
            .saw(&golden.file, "no such file")
            .detail("write it with `ckpt-harness run --bless` and commit it")],
        Some(stored) if *stored == fresh => Vec::new(),
        Some(stored) => {
            let mut stored_lines = stored.lines();
            let mut fresh_lines = fresh.lines();
            let mut line = 1;
            loop {
                match (stored_lines.next(), fresh_lines.next()) {
                    (Some(a), Some(b)) if a == b => line += 1,
                    (a, b) => {
                        let step = b
                            .or(a)
                            .and_then(|l| l.split(" | ").next())
                            .and_then(|s| s.parse().ok());
                        let mut f = fail(&format!("line {line} of {}", golden.file))
                            .saw(a.unwrap_or("(end)"), b.unwrap_or("(end)"))
                            .detail(
                                "the trajectory changed; if intended, rewrite the snapshot with `ckpt-harness run --bless`",
                            );
                        f.step = step;
                        break vec![f];
                    }
                }
            }
        }
    };
    let compared = r.reference().map_or(0, |p| p.steps.len() as u64);
    let implied = r.planned.iter().find(|p| p.phase == Phase::Reference);
    let implied = implied.map_or(0, |p| p.steps());
    Outcome::new(Check::Golden, r, compared, implied, failures)
        .with("snapshot", golden.file.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;

    #[test]
    fn rendering_rounds_losses_to_six_digits() {
        let mut r = fixtures::run();
        r.phases[0].steps[1].loss = 3.8751234;
        let text = render(&r);
        assert!(
            text.contains("\n1 | 3.87512e0 | 2.00000e-3 | 7500 | 1000 1000 2000 3000 500 0 | 1000 1000 2000 0 0 0\n"),
            "{text}"
        );
    }

    #[test]
    fn blessed_snapshots_load_and_match() {
        let dir = tempfile::tempdir().unwrap();
        let r = fixtures::run();
        let file = bless(dir.path(), &r).unwrap();
        assert!(file.ends_with("cpu/s.snap"));
        let g = load(dir.path(), "cpu", "s").unwrap();
        assert!(!check(&r, &g).failed(), "{:?}", check(&r, &g).failures);
    }

    #[test]
    fn a_changed_loss_fails_at_its_step() {
        let r = fixtures::run();
        let g = GoldenInput {
            file: "g.snap".into(),
            stored: Some(render(&r)),
        };
        let mut changed = r.clone();
        changed.phases[0].steps[4].loss += 1e-3;
        let o = check(&changed, &g);
        assert_eq!(o.failures.len(), 1);
        let m = o.failures[0].to_string();
        assert!(
            m.starts_with(
                "golden: cpu::s reference step 4: line 7 of g.snap: expected 4 | 3.50000e0"
            ),
            "{m}"
        );
    }

    #[test]
    fn a_file_that_is_not_a_snapshot_is_an_error_naming_it_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("cpu")).unwrap();
        std::fs::write(dir.path().join("cpu/s.snap"), "step | loss\n0 | 1\n").unwrap();
        let e = format!("{:#}", load(dir.path(), "cpu", "s").unwrap_err());
        assert!(e.contains("cpu/s.snap: line 1:"), "{e}");
        assert!(e.contains("ckpt-harness run --bless"), "{e}");
    }

    #[test]
    fn a_missing_snapshot_fails() {
        let dir = tempfile::tempdir().unwrap();
        let g = load(dir.path(), "cpu", "s").unwrap();
        let o = check(&fixtures::run(), &g);
        assert!(o.failures[0].to_string().contains("--bless"));
    }

    #[test]
    fn the_golden_directory_is_the_nearest_above_the_suite_or_beside_its_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().canonicalize().unwrap();
        std::fs::create_dir_all(base.join("suites/faults")).unwrap();
        let (top, control) = (
            base.join("suites/x.yaml"),
            base.join("suites/faults/y.yaml"),
        );
        std::fs::write(&top, "").unwrap();
        std::fs::write(&control, "").unwrap();
        // No golden/ above either: beside suites/, the controls' faults/ skipped.
        assert_eq!(dir_for(&top), base.join("golden"));
        assert_eq!(dir_for(&control), base.join("golden"));
        std::fs::create_dir(base.join("suites/golden")).unwrap();
        assert_eq!(dir_for(&top), base.join("suites/golden"));
        assert_eq!(dir_for(&control), base.join("suites/golden"));
    }
}
