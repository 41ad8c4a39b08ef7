//! `ckpt-harness verify`: checkpoints' files checked against the sizes and checksums their state
//! file records, a line per file, each intact file's sha256 printed.

use super::exit_codes;
use anyhow::Result;
use std::io::Write;
use std::path::PathBuf;

/// `verify`'s arguments.
#[derive(clap::Args)]
pub struct VerifyArgs {
    /// Checkpoint directories, or run directories (their `latest` is checked).
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
}

/// Prints each file's verdict per checkpoint; exits with [`exit_codes::FAILED`] if anything is
/// damaged, else [`exit_codes::INVALID`] if a path held nothing to verify.
pub fn exec(args: VerifyArgs) -> Result<u8> {
    let mut out = std::io::stdout().lock();
    let (mut intact, mut damaged, mut unreadable) = (0, 0, 0);
    for path in &args.paths {
        match ckpt_engine::checkpoint::verify(path) {
            Ok((dir, verdicts)) => {
                writeln!(out, "{}", dir.display())?;
                let bad = verdicts.iter().filter(|v| v.problem.is_some()).count();
                for v in verdicts {
                    let size = format!("{} bytes", v.bytes);
                    let sha256 = v.sha256.map(|s| format!(", sha256 {s}"));
                    let note = v.note.map(|n| format!(" ({n})"));
                    let note = sha256.unwrap_or_default() + &note.unwrap_or_default();
                    match v.problem {
                        None => writeln!(out, "  ok       {:<24} {size}{note}", v.name)?,
                        Some(why) => writeln!(out, "  DAMAGED  {:<24} {size}: {why}", v.name)?,
                    }
                }
                if bad == 0 {
                    intact += 1;
                } else {
                    damaged += 1;
                }
            }
            Err(e) => {
                unreadable += 1;
                eprintln!("error: {e}");
            }
        }
    }
    writeln!(
        out,
        "{intact} intact, {damaged} damaged, {unreadable} unreadable"
    )?;
    Ok(match (damaged, unreadable) {
        (0, 0) => exit_codes::SUCCESS,
        (0, _) => exit_codes::INVALID,
        _ => exit_codes::FAILED,
    })
}
