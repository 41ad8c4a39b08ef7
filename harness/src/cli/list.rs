//! `ckpt-harness list`: the trials the suites hold, a line each with its tier and suite file,
//! and which of them cannot run here, with the reason.

use super::exit_codes;
use crate::run::plan::{self, DeviceChoice, TierFilter};
use anyhow::Result;
use std::io::Write;
use std::path::PathBuf;

/// `list`'s arguments.
#[derive(clap::Args)]
pub struct ListArgs {
    /// Suite files or directories (default: suites/).
    pub paths: Vec<PathBuf>,
    /// Devices to list.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Tiers to list.
    #[arg(long, value_enum, default_value_t = TierFilter::All)]
    pub tier: TierFilter,
}

/// Lists the trials; exits 0.
pub fn exec(args: ListArgs) -> Result<u8> {
    let paths = super::default_paths(args.paths);
    let suites = plan::load(&plan::files(&paths)?)?;
    let mut out = std::io::stdout().lock();
    for p in plan::plan(&suites, &paths, args.tier, args.device)? {
        let s = &suites[p.suite];
        let state = p
            .skip
            .map_or("runs".to_string(), |why| format!("skipped: {why}"));
        writeln!(
            out,
            "{:<40} {:<8} {}  {state}",
            p.name,
            format!("{:?}", s.file.tier).to_lowercase(),
            s.path.display()
        )?;
    }
    Ok(exit_codes::SUCCESS)
}
