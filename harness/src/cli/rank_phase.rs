//! `ckpt-harness rank-phase` (hidden): one rank of a phase whose ranks are processes of their
//! own, started by `run` ([`crate::run::phases::processes`]), never by hand.

use super::exit_codes;
use crate::run::phases::processes;
use anyhow::Result;
use std::path::PathBuf;

/// `rank-phase`'s arguments.
#[derive(clap::Args)]
pub struct RankPhaseArgs {
    /// The phase's job file, written by `run`.
    pub job: PathBuf,
    /// The rank to run.
    #[arg(long)]
    pub rank: usize,
    /// Where to write the phase as this rank saw it.
    #[arg(long)]
    pub out: PathBuf,
}

/// Runs the rank's part of the phase; exits 0.
pub fn exec(args: RankPhaseArgs) -> Result<u8> {
    processes::serve(&args.job, args.rank, &args.out)?;
    Ok(exit_codes::SUCCESS)
}
