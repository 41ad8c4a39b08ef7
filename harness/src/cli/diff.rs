//! `ckpt-harness diff`: what changed from one run's summary to another's, as `run --baseline`
//! reports it; exits 1 when something regressed.

use super::{exit_codes, run, summary_file};
use crate::error_text;
use crate::report::summary::Summary;
use anyhow::Result;
use std::io::Write;
use std::path::PathBuf;

/// `diff`'s arguments.
#[derive(clap::Args)]
pub struct DiffArgs {
    /// The earlier run's summary.json (or its report directory).
    pub old: PathBuf,
    /// The later run's summary.json (or its report directory).
    pub new: PathBuf,
}

/// Prints the changes; exits [`exit_codes::FAILED`] when any is a regression.
pub fn exec(args: DiffArgs) -> Result<u8> {
    let (old, new) = (summary_file(&args.old), summary_file(&args.new));
    let trends = run::trends(&old, &Summary::read(&old)?, &Summary::read(&new)?);
    write!(
        std::io::stdout(),
        "{}",
        error_text::printable(&trends.text())
    )?;
    Ok(if trends.regressions() > 0 {
        exit_codes::FAILED
    } else {
        exit_codes::SUCCESS
    })
}
