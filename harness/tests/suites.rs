//! One trial per suite and device, `cpu::<suite>`, `cuda::<suite>`, and `cpu::faults::<suite>`
//! for the negative controls in `suites/faults/`. Trials whose device is absent, or whose tier is
//! not selected, are listed as ignored, decided when the trials are listed.
//!
//! `CKPT_HARNESS_TIER` (`ci`, the default; `nightly`; `all`) selects the tiers. Trials run one at
//! a time unless `--test-threads` says otherwise: each uses every core, and the host memory peak
//! is the process's. With `CKPT_HARNESS_REPORT=DIR`, each trial's summary is written to
//! `DIR/trials/<trial>.json` (under `cargo nextest run --partition`, one per test process), for
//! `ckpt-harness report merge` to put together.

use ckpt_harness::merge;
use ckpt_harness::plan::{self, DeviceChoice, TierFilter};
use ckpt_harness::report;
use ckpt_harness::suite::Suite;
use ckpt_harness::trial::{self, GoldenMode};
use libtest_mimic::{Arguments, Trial};
use std::path::{Path, PathBuf};
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

fn trials(root: &Path) -> Result<Vec<Trial>, String> {
    let tier = tier()?;
    let paths = [root.join("suites")];
    let files = plan::files(&paths).map_err(|e| format!("{e:#}"))?;
    let suites: Arc<Vec<Suite>> = Arc::new(plan::load(&files).map_err(|e| format!("{e:#}"))?);
    let golden: Arc<PathBuf> = Arc::new(root.join("golden"));
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
                for line in t.failure_lines(report::FAILURES_SHOWN) {
                    msg.push_str(&format!("\n  {line}"));
                }
                Err(msg.into())
            })
            .with_ignored_flag(ignored)
        })
        .collect())
}

fn main() {
    let mut args = Arguments::from_args();
    if args.test_threads.is_none() {
        args.test_threads = Some(1);
    }
    // A copy of the repository elsewhere (a GPU machine without the sources) via CKPT_REPO_ROOT.
    let root = std::env::var_os("CKPT_REPO_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    let trials = trials(&root)
        .unwrap_or_else(|e| vec![Trial::test("suites::load", move || Err(e.clone().into()))]);
    libtest_mimic::run(&args, trials).exit();
}
