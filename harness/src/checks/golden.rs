//! `golden`: the reference trajectory (losses to 6 significant digits, learning rates, and the
//! bytes of every category at each step's peak and end) equals its snapshot in `golden/`.
//!
//! Snapshots are `golden/<device>/<suite>.snap` files in the `.snap` layout (see
//! [`crate::checks::golden_file`]). Checking never writes them; `ckpt-harness run --bless`
//! rewrites them.
//!
//! A snapshot's losses are bits of the execution environment they were made in. One whose header
//! names that environment (`environment: x86_64 fma`, the CPU's matrix kernels; `environment:
//! NVIDIA H200`, the GPU), or several that each gave the same text (`environment: x86_64
//! avx512f, x86_64 fma`), is compared in full only there; elsewhere everything but the losses is
//! compared (learning rates, memory, tokens per expert; after the first step a MoE router sent
//! tokens elsewhere, which the losses' last bits can do, the learning rates only), and the
//! outcome says what was not and how to bless a snapshot of this environment. Blessing there adds
//! the environment to the header when the run gives the snapshot's text, and otherwise writes
//! `<suite>.<environment>.snap` beside it (`NVIDIA-H200`), which then takes its place there. A
//! snapshot without `environment:` holds everywhere.

use super::{Check, Failure, GoldenInput, Input, Outcome};
use crate::checks::golden_file::{normalise, Snapshot};
use crate::record::fields::RecordField;
use crate::record::{Phase, RunRecord, StepRecord};
use anyhow::{Context, Result};
use ckpt_engine::backend::cpu::bf16_dot::Bf16Products;
use ckpt_engine::backend::cpu::matmul;
use ckpt_engine::memory::{Breakdown, Category};
use std::collections::BTreeMap;
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

/// The execution environment the numbers of a run on `device` depend on, as snapshots record
/// it: on the CPU its matrix kernels (`x86_64 fma`; their blocking is fixed whatever the caches,
/// so the instruction set is all that moves the bits; ` avx512_bf16` after them where
/// `CKPT_CPU_BF16_PRODUCTS=dot` multiplies bf16 with the dot-product instruction); on CUDA the GPU's name (cuBLAS picks its
/// kernels by GPU: an H200 rounds `tiny-fp32`'s fourth loss otherwise than an H100); `None`
/// elsewhere, and on CUDA where no GPU answers.
pub fn environment(device: &str) -> Option<String> {
    match device {
        "cpu" => Some(matmul::kernels(
            Bf16Products::from_env().unwrap_or_default(),
        )),
        "cuda" => ckpt_engine::backend::probe(ckpt_engine::DeviceKind::Cuda).ok(),
        _ => None,
    }
}

/// Where the snapshot of `device`/`suite` lives under `dir`.
pub fn path(dir: &Path, device: &str, suite: &str) -> PathBuf {
    dir.join(device).join(format!("{suite}.snap"))
}

/// Where the snapshot of `device`/`suite` made in `environment` lives under `dir` when
/// `<suite>.snap` was made in another: `<suite>.<environment>.snap`, each character but ASCII
/// letters, digits, `.` and `_` as `-`.
pub fn path_in(dir: &Path, device: &str, suite: &str, environment: &str) -> PathBuf {
    let env: String = environment
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '_' => c,
            _ => '-',
        })
        .collect();
    dir.join(device).join(format!("{suite}.{env}.snap"))
}

/// Reads `file`, if there is one.
fn read(file: &Path) -> Result<Option<Snapshot>> {
    if !file.exists() {
        return Ok(None);
    }
    let bytes = ckpt_engine::regular_file::read(file, "a golden snapshot file")?;
    let content = String::from_utf8(bytes)
        .with_context(|| format!("{}: cannot read as UTF-8 text", file.display()))?;
    let snap = Snapshot::parse(&content).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    Ok(Some(snap))
}

/// Reads the snapshot of `device`/`suite` under `dir` for this machine's environment: the one
/// made in it where there is one, else `<suite>.snap`, if there is one.
pub fn load(dir: &Path, device: &str, suite: &str) -> Result<GoldenInput> {
    let here = environment(device);
    let own = here.as_deref().map(|e| path_in(dir, device, suite, e));
    let file = match &own {
        Some(own) if own.exists() => own.clone(),
        _ => path(dir, device, suite),
    };
    let snap = read(&file)?;
    Ok(GoldenInput {
        file: file.display().to_string(),
        made_in: snap.as_ref().map_or(Vec::new(), |s| s.environments.clone()),
        stored: snap.map(|s| s.text),
        here,
        here_file: own.unwrap_or_else(|| file.clone()).display().to_string(),
    })
}

/// Writes the run's snapshot under `dir`, made in this machine's environment; returns its path.
/// A snapshot of this environment whose text is the run's is left as it is (a snapshot that
/// holds everywhere stays so). `<suite>.snap` made in other environments is kept: where its
/// text is the run's, this environment joins its header (and a snapshot of this environment
/// beside it, which would take its place here, is removed); otherwise this one's is written
/// beside it.
pub fn bless(dir: &Path, r: &RunRecord) -> Result<PathBuf> {
    bless_in(dir, r, environment(&r.device))
}

/// [`bless`] in the environment `here`. A snapshot made to hold everywhere never takes an
/// environment into its header, which would narrow it to that one.
fn bless_in(dir: &Path, r: &RunRecord, here: Option<String>) -> Result<PathBuf> {
    let main = path(dir, &r.device, &r.suite);
    let text = render(r);
    let file = match (read(&main)?, &here) {
        (Some(s), Some(env)) if !holds_in(&s.environments, Some(env)) => {
            let own = path_in(dir, &r.device, &r.suite, env);
            if s.text == text && !s.environments.is_empty() {
                return add_environment(main, s, env, &own);
            }
            own
        }
        _ => main,
    };
    if read(&file)?.is_some_and(|s| s.text == text && holds_in(&s.environments, here.as_ref())) {
        return Ok(file);
    }
    let snap = Snapshot {
        source: "harness/src/checks/golden.rs".into(),
        expression: format!("reference trajectory of {}", r.trial()),
        environments: here.into_iter().collect(),
        text,
    };
    crate::atomic_file::write(&file, snap.to_file().as_bytes())?;
    Ok(file)
}

/// What a snapshot made to hold everywhere (its header names no environment) holds in: the
/// CPU's bits are the same on every instruction set while bf16 is multiplied widened to f32,
/// but not with the bf16 dot-product instruction, which sums in its own order.
const EVERYWHERE: &str = "every environment that multiplies bf16 widened to f32";

/// Whether a snapshot made in `made_in` (empty: made to hold [`EVERYWHERE`]) holds in the
/// environment `here`, so that its losses are compared there.
fn holds_in(made_in: &[String], here: Option<&String>) -> bool {
    if made_in.is_empty() {
        return !here.is_some_and(|h| h.split(' ').any(|k| k == matmul::BF16_DOT_KERNELS));
    }
    here.is_some_and(|h| made_in.contains(h))
}

/// The environments a snapshot was made in, as a note names them.
fn made_in_words(made_in: &[String]) -> String {
    if made_in.is_empty() {
        EVERYWHERE.to_string()
    } else {
        made_in.join(" and ")
    }
}

/// Adds `env` to the environments of `snap`, the snapshot at `main` whose text a run there
/// gives, and removes `own`, a snapshot of `env` beside it that would take its place there.
fn add_environment(main: PathBuf, mut snap: Snapshot, env: &str, own: &Path) -> Result<PathBuf> {
    snap.environments.push(env.to_string());
    crate::atomic_file::write(&main, snap.to_file().as_bytes())?;
    if own.exists() {
        std::fs::remove_file(own).with_context(|| format!("{}: cannot remove", own.display()))?;
    }
    Ok(main)
}

/// Each line of `text` with the step it belongs to: a step's row and the tokens-per-expert line
/// after it, `None` before the first row.
fn by_step(text: &str) -> Vec<(Option<u64>, &str)> {
    let mut step = None;
    text.lines()
        .map(|l| {
            if let Some(s) = l.split(" | ").next().and_then(|s| s.parse().ok()) {
                step = Some(s);
            }
            (step, l)
        })
        .collect()
}

/// The first step whose tokens per expert differ between `stored` and `fresh`: where a MoE
/// router sent a token to another expert.
fn rerouted_at(stored: &str, fresh: &str) -> Option<u64> {
    let tokens = |text| -> BTreeMap<u64, &str> {
        by_step(text)
            .into_iter()
            .filter(|(_, l)| l.starts_with(TOKENS_PER_EXPERT))
            .filter_map(|(s, l)| Some((s?, l)))
            .collect()
    };
    let (a, b) = (tokens(stored), tokens(fresh));
    a.keys()
        .chain(b.keys())
        .filter(|s| a.get(s) != b.get(s))
        .min()
        .copied()
}

/// `text` as a snapshot made in another environment is compared with: each step row's loss as
/// `-`, and from step `rerouted` on only the step and its learning rate (its memory and tokens
/// per expert follow the routing, which the losses' last bits can change).
fn without_losses(text: &str, rerouted: Option<u64>) -> String {
    let line = |(step, l): (Option<u64>, &str)| {
        let after = step.zip(rerouted).is_some_and(|(s, r)| s >= r);
        if l.starts_with(TOKENS_PER_EXPERT) {
            return match after {
                true => format!("{TOKENS_PER_EXPERT}(rerouted)"),
                false => l.to_string(),
            };
        }
        let mut fields: Vec<&str> = l.split(" | ").collect();
        if fields.len() > 2 && fields[0].parse::<u64>().is_ok() {
            fields[1] = "-";
            if after {
                fields.truncate(3);
            }
        }
        fields.join(" | ")
    };
    by_step(text)
        .into_iter()
        .map(line)
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first line where `stored` and `fresh` differ, as a failure (none when they are equal).
fn first_difference(
    stored: &str,
    fresh: &str,
    golden: &GoldenInput,
    fail: impl Fn(&str) -> Failure,
) -> Vec<Failure> {
    let mut stored_lines = stored.lines();
    let mut fresh_lines = fresh.lines();
    let mut line = 1;
    loop {
        match (stored_lines.next(), fresh_lines.next()) {
            (None, None) => return Vec::new(),
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
                return vec![f];
            }
        }
    }
}

/// The optional parts of a record it compares.
pub const NEEDS: &[RecordField] = &[];

/// The check as [`super::run_all`] runs it.
pub fn run(input: &Input) -> Outcome {
    check(input.record, input.golden)
}

/// Compares the run's reference trajectory with the stored snapshot; `compared` counts the
/// reference steps.
pub fn check(r: &RunRecord, golden: &GoldenInput) -> Outcome {
    let fresh = render(r);
    let fail = |what: &str| Failure::new(Check::Golden, r, what).phase(Phase::Reference);
    let elsewhere =
        (!holds_in(&golden.made_in, golden.here.as_ref())).then(|| made_in_words(&golden.made_in));
    let rerouted = match (&golden.stored, &elsewhere) {
        (Some(stored), Some(_)) => rerouted_at(stored, &fresh),
        _ => None,
    };
    let failures = match (&golden.stored, &elsewhere) {
        (None, _) => vec![fail("snapshot")
            .saw(&golden.file, "no such file")
            .detail("write it with `ckpt-harness run --bless` and commit it")],
        (Some(stored), None) => first_difference(stored, &fresh, golden, fail),
        (Some(stored), Some(_)) => first_difference(
            &without_losses(stored, rerouted),
            &without_losses(&fresh, rerouted),
            golden,
            fail,
        ),
    };
    let compared = r.reference().map_or(0, |p| p.steps.len() as u64);
    let implied = r.planned.iter().find(|p| p.phase == Phase::Reference);
    let implied = implied.map_or(0, |p| p.steps());
    let outcome = Outcome::new(Check::Golden, r, compared, implied, failures)
        .with("snapshot", golden.file.clone());
    match elsewhere {
        None => outcome,
        Some(made_in) => {
            let compared = match rerouted {
                None => "its learning rates, memory and tokens per expert were".to_string(),
                Some(step) => format!(
                    "its learning rates were, and its memory and tokens per expert up to step {step}, where the router sent tokens to other experts: a consequence of the losses' last bits"
                ),
            };
            outcome.with(
                LOSSES_NOT_COMPARED,
                format!(
                    "{} was made with {made_in}, this run has {}: its losses were not compared ({compared}); to compare them here, bless a snapshot of this environment with `ckpt-harness run <suite> --device {} --bless` (it writes {}) and commit it",
                    golden.file,
                    golden.here.as_deref().unwrap_or("no recorded environment"),
                    r.device,
                    golden.here_file
                ),
            )
        }
    }
}

/// The figure of a `golden` outcome that says its losses were not compared (the snapshot was
/// made in another execution environment), and how to bless one for this environment.
pub const LOSSES_NOT_COMPARED: &str = "losses_not_compared";

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
            ..GoldenInput::default()
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

    /// The snapshot of `fixtures::run()` as if made in `made_in`, compared where the run has `here`.
    fn made_in(made_in: &str, here: &str) -> GoldenInput {
        GoldenInput {
            file: "g.snap".into(),
            stored: Some(render(&fixtures::run())),
            made_in: vec![made_in.into()],
            here: Some(here.into()),
            here_file: "g.here.snap".into(),
        }
    }

    #[test]
    fn a_snapshot_of_another_environment_compares_all_but_the_losses_and_says_so() {
        let mut moved = fixtures::run();
        moved.phases[0].steps[4].loss += 1e-3;
        let elsewhere = made_in("x86_64 avx512f", "x86_64 fma");
        let o = check(&moved, &elsewhere);
        assert!(!o.failed(), "{:?}", o.failures);
        let note = o.figures[LOSSES_NOT_COMPARED].as_str().unwrap();
        assert!(
            note.contains("made with x86_64 avx512f, this run has x86_64 fma")
                && note.contains("--bless")
                && note.contains("g.here.snap"),
            "{note}"
        );
        // In its own environment the same loss fails, and nothing is left uncompared.
        let o = check(&moved, &made_in("x86_64 fma", "x86_64 fma"));
        assert!(o.failed());
        assert!(!o.figures.contains_key(LOSSES_NOT_COMPARED));
        // Memory and learning rates are compared everywhere; memory up to a reroute.
        type Edit = fn(&mut RunRecord);
        let edits: [Edit; 2] = [
            |r| r.phases[0].steps[2].memory.allocated.peak += 512,
            |r| r.phases[0].steps[2].lr *= 1.5,
        ];
        for edit in edits {
            let mut changed = fixtures::run();
            edit(&mut changed);
            let o = check(&changed, &elsewhere);
            assert_eq!(o.failures.len(), 1, "{:?}", o.failures);
            assert_eq!(o.failures[0].step, Some(2), "{:?}", o.failures);
        }
        let moe = |counts: [u32; 2]| {
            let mut r = fixtures::run();
            for s in &mut r.phases[0].steps {
                s.tokens_per_expert = vec![counts.to_vec()];
            }
            r
        };
        let mut stored = made_in("x86_64 avx512f", "x86_64 fma");
        stored.stored = Some(render(&moe([2, 2])));
        let mut rerouted = moe([2, 2]);
        rerouted.phases[0].steps[3].tokens_per_expert = vec![vec![3, 1]];
        rerouted.phases[0].steps[4].memory.allocated.peak += 512;
        let o = check(&rerouted, &stored);
        assert!(!o.failed(), "{:?}", o.failures);
        let note = o.figures[LOSSES_NOT_COMPARED].as_str().unwrap();
        assert!(note.contains("up to step 3, where the router"), "{note}");
        rerouted.phases[0].steps[2].memory.allocated.peak += 512;
        assert!(check(&rerouted, &stored).failed(), "before the reroute");
        let mut late = rerouted.clone();
        late.phases[0].steps[2].memory.allocated.peak -= 512;
        late.phases[0].steps[4].lr *= 1.5;
        assert!(
            check(&late, &stored).failed(),
            "a learning rate after the reroute"
        );
        // In its own environment a reroute fails.
        stored.made_in = vec!["x86_64 fma".into()];
        let mut own = moe([2, 2]);
        own.phases[0].steps[3].tokens_per_expert = vec![vec![3, 1]];
        assert!(check(&own, &stored).failed());
    }

    #[test]
    fn blessing_records_the_environment_and_keeps_another_environment_s_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let here = environment("cpu").unwrap();
        let r = fixtures::run();
        let main = bless(dir.path(), &r).unwrap();
        let snap = read(&main).unwrap().unwrap();
        assert_eq!(snap.environments, std::slice::from_ref(&here));
        // A snapshot that holds everywhere and still matches is left as it is.
        let everywhere = Snapshot {
            environments: Vec::new(),
            ..snap.clone()
        };
        std::fs::write(&main, everywhere.to_file()).unwrap();
        assert_eq!(bless(dir.path(), &r).unwrap(), main);
        assert_eq!(read(&main).unwrap().unwrap(), everywhere);
        // One made in another environment is kept; this environment's is written beside it and
        // is the one loaded here.
        let other = Snapshot {
            environments: vec!["riscv64 scalar".into()],
            text: snap.text.replace("3.50000e0", "3.50001e0"),
            ..snap
        };
        std::fs::write(&main, other.to_file()).unwrap();
        let own = bless(dir.path(), &r).unwrap();
        assert_eq!(own, path_in(dir.path(), "cpu", "s", &here));
        assert_eq!(read(&main).unwrap().unwrap(), other);
        let g = load(dir.path(), "cpu", "s").unwrap();
        assert_eq!(g.file, own.display().to_string());
        assert!(!check(&r, &g).figures.contains_key(LOSSES_NOT_COMPARED));
        std::fs::remove_file(&own).unwrap();
        let g = load(dir.path(), "cpu", "s").unwrap();
        assert_eq!(g.made_in, ["riscv64 scalar"]);
        assert_eq!(g.here_file, own.display().to_string());
    }

    #[test]
    fn a_snapshot_made_to_hold_everywhere_is_not_compared_on_bf16_dot_products_nor_narrowed() {
        let dot = format!("x86_64 avx512f {}", matmul::BF16_DOT_KERNELS);
        let everywhere = |here: &str| GoldenInput {
            made_in: Vec::new(),
            ..made_in("", here)
        };
        let mut moved = fixtures::run();
        moved.phases[0].steps[4].loss += 1e-3;
        assert!(check(&moved, &everywhere("x86_64 fma")).failed());
        let o = check(&moved, &everywhere(&dot));
        assert!(!o.failed(), "{:?}", o.failures);
        let note = o.figures[LOSSES_NOT_COMPARED].as_str().unwrap();
        assert!(
            note.contains(&format!("made with {EVERYWHERE}, this run has {dot}")),
            "{note}"
        );
        // Blessing there writes its own snapshot beside, even where the text is the same.
        let dir = tempfile::tempdir().unwrap();
        let r = fixtures::run();
        let main = bless_in(dir.path(), &r, Some("x86_64 fma".into())).unwrap();
        let held = Snapshot {
            environments: Vec::new(),
            ..read(&main).unwrap().unwrap()
        };
        std::fs::write(&main, held.to_file()).unwrap();
        let own = bless_in(dir.path(), &r, Some(dot.clone())).unwrap();
        assert_eq!(own, path_in(dir.path(), "cpu", "s", &dot));
        assert_eq!(read(&main).unwrap().unwrap(), held);
        assert_eq!(read(&own).unwrap().unwrap().environments, [dot]);
    }

    #[test]
    fn blessing_the_same_text_in_another_environment_adds_it_to_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let here = environment("cpu").unwrap();
        let r = fixtures::run();
        let main = bless(dir.path(), &r).unwrap();
        let made_elsewhere = Snapshot {
            environments: vec!["riscv64 scalar".into()],
            ..read(&main).unwrap().unwrap()
        };
        std::fs::write(&main, made_elsewhere.to_file()).unwrap();
        // A stale snapshot of this environment beside it would take its place here.
        let own = path_in(dir.path(), "cpu", "s", &here);
        let stale = Snapshot {
            text: made_elsewhere.text.replace("3.50000e0", "3.50001e0"),
            ..made_elsewhere.clone()
        };
        std::fs::write(&own, stale.to_file()).unwrap();
        assert_eq!(bless(dir.path(), &r).unwrap(), main);
        let joined = read(&main).unwrap().unwrap();
        assert_eq!(
            joined.environments,
            ["riscv64 scalar".to_string(), here.clone()]
        );
        assert_eq!(joined.text, made_elsewhere.text);
        assert!(
            !own.exists(),
            "the stale snapshot of this environment is removed"
        );
        // Compared in full in each of its environments, without its losses elsewhere, where
        // the note names them all.
        let g = load(dir.path(), "cpu", "s").unwrap();
        assert_eq!(g.file, main.display().to_string());
        let mut moved = r.clone();
        moved.phases[0].steps[4].loss += 1e-3;
        assert!(check(&moved, &g).failed());
        let riscv = GoldenInput {
            here: Some("riscv64 scalar".into()),
            ..g.clone()
        };
        assert!(check(&moved, &riscv).failed());
        let arm = GoldenInput {
            here: Some("aarch64 neon".into()),
            ..g
        };
        let o = check(&moved, &arm);
        assert!(!o.failed(), "{:?}", o.failures);
        let note = o.figures[LOSSES_NOT_COMPARED].as_str().unwrap();
        assert!(
            note.contains(&format!(
                "made with riscv64 scalar and {here}, this run has aarch64 neon"
            )),
            "{note}"
        );
        // Blessing again in one of its environments leaves it as it is.
        assert_eq!(bless(dir.path(), &r).unwrap(), main);
        assert_eq!(read(&main).unwrap().unwrap(), joined);
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
