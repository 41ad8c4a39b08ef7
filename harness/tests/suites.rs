//! One trial per suite and device, `cpu::<suite>`, `cuda::<suite>`, and `cpu::faults::<suite>`
//! for the negative controls in `suites/faults/`. Trials whose device is absent, or whose tier is
//! not selected, are listed as ignored, decided when the trials are listed.
//!
//! `CKPT_HARNESS_TIER` (`ci`, the default; `nightly`; `all`) selects the tiers. Trials run one at
//! a time unless `--test-threads` says otherwise: each uses every core, and the host memory peak
//! is the process's. With `CKPT_HARNESS_REPORT=DIR`, each trial's summary is written to
//! `DIR/trials/<trial>.json` (under `cargo nextest run --partition`, one per test process), for
//! `ckpt-harness report merge` to put together. The binary works from the repository's root
//! (`CKPT_REPO_ROOT`, by default this workspace): suites, snapshots and a relative `DIR` are
//! named from there, as `ckpt-harness run suites` run there names them.
//!
//! One more trial, `scale_out::partitions_merge_into_the_whole_run`, splits three CPU trials the
//! way `cargo nextest run --partition count:K/2` splits this binary and checks that `report merge`
//! of the two halves is the summary `ckpt-harness run` writes for the same suites.

// Each test binary uses part of what the tests share.
#[allow(dead_code)]
mod common;

use anyhow::{ensure, Context};
use ckpt_harness::report::merge;
use ckpt_harness::report::summary;
use ckpt_harness::run::plan::{self, DeviceChoice, TierFilter};
use ckpt_harness::run::trial::{self, GoldenMode};
use ckpt_harness::suite::Suite;
use libtest_mimic::{Arguments, Trial};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

fn tier() -> Result<TierFilter, String> {
    match std::env::var("CKPT_HARNESS_TIER").as_deref() {
        Err(_) | Ok("ci") => Ok(TierFilter::Ci),
        Ok("nightly") => Ok(TierFilter::Nightly),
        Ok("all") => Ok(TierFilter::All),
        Ok(other) => Err(format!(
            "CKPT_HARNESS_TIER={other:?}; write ci, nightly or all"
        )),
    }
}

/// A trial per suite and device of `suites/`, named from the working directory.
fn trials() -> Result<Vec<Trial>, String> {
    let tier = tier()?;
    let paths = [PathBuf::from("suites")];
    let files = plan::files(&paths).map_err(|e| format!("{e:#}"))?;
    let suites: Arc<Vec<Suite>> = Arc::new(plan::load(&files).map_err(|e| format!("{e:#}"))?);
    let golden: Arc<PathBuf> = Arc::new(PathBuf::from("golden"));
    let planned =
        plan::plan(&suites, &paths, tier, DeviceChoice::Auto).map_err(|e| format!("{e:#}"))?;
    Ok(planned
        .into_iter()
        .map(|p| {
            let suites = Arc::clone(&suites);
            let golden = Arc::clone(&golden);
            let ignored = p.skip.is_some();
            Trial::test(p.name, move || {
                let suite = &suites[p.suite];
                let t = trial::run(suite, p.device, &golden, GoldenMode::Check, &mut ());
                if let Some(dir) = std::env::var_os("CKPT_HARNESS_REPORT") {
                    merge::write_trial(Path::new(&dir), &t).map_err(|e| format!("{e:#}"))?;
                }
                if t.passed {
                    return Ok(());
                }
                let mut msg = t.verdict.clone();
                for line in t.failure_lines(summary::FAILURES_SHOWN) {
                    msg.push_str(&format!("\n  {line}"));
                }
                Err(msg.into())
            })
            .with_ignored_flag(ignored)
        })
        .collect())
}

/// The trials the scale-out check splits in two, and their suite files, in the order a run of
/// `suites/` lists them.
const SPLIT: [(&str, &str); 3] = [
    ("cpu::family-mistral", "suites/family-mistral.yaml"),
    ("cpu::tiny-fp32", "suites/tiny-fp32.yaml"),
    (
        "cpu::faults::moments_not_saved",
        "suites/faults/moments_not_saved.yaml",
    ),
];

/// Standard output and error of `out`.
fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The `summary.json` under `dir`, without times.
fn json(dir: &Path) -> anyhow::Result<serde_json::Value> {
    let file = dir.join("summary.json");
    let text = std::fs::read(&file).with_context(|| format!("{}", file.display()))?;
    let mut v = serde_json::from_slice(&text)?;
    common::without_timings(&mut v);
    Ok(v)
}

/// What `cargo nextest run --partition count:K/2` does on two machines: each trial of [`SPLIT`]
/// in a process of its own (`--exact`), started in the package's directory, with
/// `CKPT_REPO_ROOT` naming a checkout elsewhere (their suite files and snapshots copied) and
/// the relative `CKPT_HARNESS_REPORT=partition-K`. `report merge` of the two partitions must be
/// the summary `ckpt-harness run` writes for the same suites in that checkout, but for times.
fn scale_out() -> anyhow::Result<()> {
    let checkout = tempfile::tempdir()?;
    for (_, file) in SPLIT {
        let stem = Path::new(file).file_stem().unwrap_or_default();
        let snapshot = Path::new("golden/cpu").join(stem).with_extension("snap");
        for f in [Path::new(file), &snapshot]
            .into_iter()
            .filter(|f| f.is_file())
        {
            let to = checkout.path().join(f);
            std::fs::create_dir_all(to.parent().unwrap_or(checkout.path()))?;
            std::fs::copy(f, &to).with_context(|| format!("{}", f.display()))?;
        }
    }
    let exe = std::env::current_exe()?;
    for (i, (name, _)) in SPLIT.iter().enumerate() {
        let out = Command::new(&exe)
            .args(["--exact", name])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("CKPT_REPO_ROOT", checkout.path())
            .env("CKPT_HARNESS_TIER", "ci")
            .env("CKPT_HARNESS_REPORT", format!("partition-{}", i % 2 + 1))
            .output()?;
        ensure!(
            out.status.success() && said(&out).contains("1 passed;"),
            "{name} in a process of its own: {}",
            said(&out)
        );
    }
    let parts = [1, 2].map(|k| checkout.path().join(format!("partition-{k}")));
    merge::merge(&parts)?.write_json(&checkout.path().join("merged"))?;
    let whole = checkout.path().join("whole");
    let out = Command::new(env!("CARGO_BIN_EXE_ckpt-harness"))
        .args(["run", "--device", "cpu", "--report"])
        .arg(&whole)
        .args(SPLIT.map(|(_, file)| file))
        .current_dir(checkout.path())
        .env_remove("CI")
        .output()?;
    ensure!(out.status.success(), "ckpt-harness run: {}", said(&out));
    let (want, merged) = (json(&whole)?, json(&checkout.path().join("merged"))?);
    ensure!(
        want == merged,
        "the merged partitions differ from the whole run at {}",
        common::first_difference(&want, &merged, String::new())
    );
    Ok(())
}

fn main() {
    ckpt_harness::run::host_memory::limit_malloc_arenas();
    let mut args = Arguments::from_args();
    if args.test_threads.is_none() {
        args.test_threads = Some(1);
    }
    // A copy of the repository elsewhere (a GPU machine without the sources) via CKPT_REPO_ROOT.
    let root = std::env::var_os("CKPT_REPO_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    let mut trials = std::env::set_current_dir(&root)
        .map_err(|e| format!("{}: cannot work from there: {e}", root.display()))
        .and_then(|()| trials())
        .unwrap_or_else(|e| vec![Trial::test("suites::load", move || Err(e.clone().into()))]);
    trials.push(Trial::test(
        "scale_out::partitions_merge_into_the_whole_run",
        || scale_out().map_err(|e| format!("{e:#}").into()),
    ));
    libtest_mimic::run(&args, trials).exit();
}
