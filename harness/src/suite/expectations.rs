//! What a suite's checks and expectations must leave to compare: a suite whose checks are all
//! off, whose every check is expected to fail or not to run, or whose negative control has
//! nothing that could make its checks fail, would pass while checking nothing.

use super::places::{place, Places};
use super::SuiteFile;
use crate::checks::Check;
use anyhow::{bail, Result};
use serde_saphyr::Location;
use std::path::Path;

/// The checks a run's own numbers or files can fail without a deliberate bug: `finite` (a
/// learning rate too large), `golden` (a snapshot that differs). Any other check of a negative
/// control fails only through a fault or a memory setting.
const FAILABLE_WITHOUT_FAULT: [Check; 2] = [Check::Finite, Check::Golden];

/// Refuses, at its place, a suite that would pass comparing nothing: every check off; every
/// check on expected to fail or not to run; or `expect_fail` without a fault, a memory
/// capacity or budget, or a check from [`FAILABLE_WITHOUT_FAULT`] to explain it.
pub(super) fn check(path: &Path, places: &Places, file: &SuiteFile) -> Result<()> {
    let on: Vec<Check> = Check::ALL
        .into_iter()
        .filter(|c| file.checks.enabled(*c))
        .collect();
    if on.is_empty() {
        bail!(
            "{}: every check is off, so the trial would compare nothing and pass; turn at least one on (remove its `false`)",
            places.value("checks")
        );
    }
    let listed = |list: &Option<serde_saphyr::Spanned<Vec<Check>>>, c: &Check| {
        list.as_ref().is_some_and(|l| l.value.contains(c))
    };
    let at = |list: &Option<serde_saphyr::Spanned<Vec<Check>>>| {
        place(
            path,
            list.as_ref().map_or(Location::UNKNOWN, |l| l.referenced),
        )
    };
    let expect_fail = &file.expect_fail;
    let not_run = &file.expect_not_run;
    if on
        .iter()
        .all(|c| listed(expect_fail, c) || listed(not_run, c))
    {
        bail!(
            "{}: every check that is on is in expect_fail or expect_not_run, so nothing would be compared and pass; leave at least one check to pass (remove it from expect_not_run)",
            at(not_run)
        );
    }
    let Some(fail) = expect_fail.as_ref().filter(|l| !l.value.is_empty()) else {
        return Ok(());
    };
    let memory = file.memory.capacity.is_some() || file.memory.budget.is_some();
    let explained = !file.faults.is_empty()
        || file.engine.is_some()
        || memory
        || fail
            .value
            .iter()
            .any(|c| FAILABLE_WITHOUT_FAULT.contains(c));
    if !explained {
        bail!(
            "{}: expect_fail names {} but the suite injects no fault and sets no memory.capacity or memory.budget, so nothing makes it fail; add the fault the control tests (faults: [...]) or remove expect_fail",
            at(expect_fail),
            fail.value
                .iter()
                .map(|c| c.name())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}
