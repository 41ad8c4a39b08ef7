//! `ckpt-harness validate`: suite files read and checked as `run` would before running them
//! (and as the engine would refuse them when a trainer starts), without running anything; each
//! error names the file, the line and column, and the fix.

use super::exit_codes;
use crate::error_text;
use crate::run::plan;
use anyhow::Result;
use std::io::Write;
use std::path::PathBuf;

/// `validate`'s arguments.
#[derive(clap::Args)]
pub struct ValidateArgs {
    /// Suite files or directories.
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
}

/// Prints `ok FILE` for each valid suite and an error for each invalid one (or two suites of
/// one name); exits [`exit_codes::INVALID`] if any is invalid.
pub fn exec(args: ValidateArgs) -> Result<u8> {
    let files = plan::files(&args.paths)?;
    let mut out = std::io::stdout().lock();
    let mut bad = 0;
    let mut valid = Vec::new();
    for f in &files {
        match plan::load_one(f).and_then(|s| s.check_run().map(|()| s)) {
            Ok(suite) => {
                writeln!(out, "ok {}", f.display())?;
                valid.push(suite);
            }
            Err(e) => {
                bad += 1;
                eprintln!("error: {}", error_text::one_line(&e));
            }
        }
    }
    if let Err(e) = plan::unique_names(&valid) {
        bad += 1;
        eprintln!("error: {e}");
    }
    writeln!(out, "{} valid, {bad} invalid", files.len() - bad)?;
    Ok(if bad == 0 {
        exit_codes::SUCCESS
    } else {
        exit_codes::INVALID
    })
}
