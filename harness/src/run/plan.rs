//! Which trials a run holds: suite files found under the paths given, crossed with their devices,
//! filtered by tier and device; trials that cannot run here are kept with the reason.

use crate::devices::{self, DeviceKind};
use crate::suite::{Suite, Tier};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Which tiers run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TierFilter {
    /// Suites of the `ci` tier.
    Ci,
    /// Suites of the `nightly` tier.
    Nightly,
    /// Every suite.
    All,
}

impl TierFilter {
    /// Whether suites of `tier` run.
    pub fn admits(self, tier: Tier) -> bool {
        match self {
            TierFilter::All => true,
            TierFilter::Ci => tier == Tier::Ci,
            TierFilter::Nightly => tier == Tier::Nightly,
        }
    }
}

/// Which devices run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// Each suite's devices that are present; the others are skipped.
    Auto,
    /// The CPU only.
    Cpu,
    /// CUDA only; an error when no CUDA device is present.
    Cuda,
}

/// One trial of the plan.
#[derive(Clone, Debug)]
pub struct Planned {
    /// Index of its suite.
    pub suite: usize,
    /// The device.
    pub device: DeviceKind,
    /// `device::suite`.
    pub name: String,
    /// Why it does not run here, if it does not.
    pub skip: Option<String>,
}

/// Suite files under `paths`: files as given; directories searched for `*.yaml` (a FIFO or a
/// device of that name too, for loading to refuse by name), then their
/// `faults/` directory (the negative controls); sorted within each directory; a file reached
/// twice listed once. Finding none is an error.
pub fn files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    fn yaml_in(dir: &Path) -> Result<Vec<PathBuf>> {
        let entries =
            std::fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))?;
        let mut found: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|f| !f.is_dir() && f.extension().is_some_and(|x| x == "yaml" || x == "yml"))
            .collect();
        found.sort();
        Ok(found)
    }
    let mut found = Vec::new();
    for p in paths {
        if p.is_dir() {
            found.extend(yaml_in(p)?);
            let faults = p.join("faults");
            if faults.is_dir() {
                found.extend(yaml_in(&faults)?);
            }
        } else if p.exists() {
            found.push(p.clone());
        } else {
            bail!("{}: no such file or directory", p.display());
        }
    }
    if found.is_empty() {
        let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        bail!(
            "no suite files (*.yaml, *.yml) in {}; name suite files, or directories that hold them (their faults/ is searched too)",
            names.join(", ")
        );
    }
    let mut seen = Vec::new();
    found.retain(|f| {
        let same = f.canonicalize().unwrap_or_else(|_| f.clone());
        let new = !seen.contains(&same);
        seen.push(same);
        new
    });
    Ok(found)
}

/// Loads a suite file for `run`: valid, and resumable under its `keep_last`.
pub fn load_one(file: &Path) -> Result<Suite> {
    let suite = Suite::load(file)?;
    suite.check_retention()?;
    Ok(suite)
}

/// Loads every suite file for `run`, failing on the first invalid one, or on two of one name.
pub fn load(files: &[PathBuf]) -> Result<Vec<Suite>> {
    let suites: Vec<Suite> = files.iter().map(|f| load_one(f)).collect::<Result<_>>()?;
    unique_names(&suites)?;
    Ok(suites)
}

/// Refuses two suites of one name: they would share trial names and golden snapshots.
pub fn unique_names(suites: &[Suite]) -> Result<()> {
    for (i, s) in suites.iter().enumerate() {
        if let Some(first) = suites[..i].iter().find(|o| o.file.name == s.file.name) {
            bail!(
                "{}: name {} is taken by {}; give each suite its own name (it names the trials and the golden snapshots)",
                s.name_place(),
                s.file.name,
                first.name_place()
            );
        }
    }
    Ok(())
}

/// Whether `paths` name `file` itself, not a directory holding it.
fn named(paths: &[PathBuf], file: &Path) -> bool {
    let Ok(file) = file.canonicalize() else {
        return false;
    };
    paths
        .iter()
        .any(|p| p.is_file() && p.canonicalize().is_ok_and(|p| p == file))
}

/// The trials of `suites`, found under `paths`, for `tier` and `device`. A suite file `paths`
/// name itself runs whatever its tier; the tier filters the suites found in directories.
pub fn plan(
    suites: &[Suite],
    paths: &[PathBuf],
    tier: TierFilter,
    device: DeviceChoice,
) -> Result<Vec<Planned>> {
    if device == DeviceChoice::Cuda {
        if let Err(why) = devices::probe(DeviceKind::Cuda) {
            bail!("--device cuda: no CUDA device: {why}");
        }
    }
    let mut out = Vec::new();
    for (i, s) in suites.iter().enumerate() {
        for &d in s.devices() {
            let wanted = match device {
                DeviceChoice::Auto => true,
                DeviceChoice::Cpu => d == DeviceKind::Cpu,
                DeviceChoice::Cuda => d == DeviceKind::Cuda,
            };
            if !wanted {
                continue;
            }
            let skip = if !tier.admits(s.file.tier) && !named(paths, &s.path) {
                Some(format!("tier {:?} not selected", s.file.tier).to_lowercase())
            } else {
                devices::probe(d)
                    .err()
                    .map(|why| format!("no {d} device: {why}"))
            };
            out.push(Planned {
                suite: i,
                device: d,
                name: s.trial_name(d),
                skip,
            });
        }
    }
    Ok(out)
}
