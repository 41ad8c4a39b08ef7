//! `ckpt-harness export`: a checkpoint's weights written in the Hugging Face layout
//! (`model.safetensors` and `config.json`), a sharded checkpoint's tensors assembled whole from
//! every rank's file.

use super::exit_codes;
use anyhow::Result;
use ckpt_engine::checkpoint::{self, CONFIG_FILE, MODEL_FILE};
use std::path::PathBuf;

/// `export`'s arguments.
#[derive(clap::Args)]
pub struct ExportArgs {
    /// A checkpoint directory, or a run directory (its `latest` is exported).
    pub checkpoint: PathBuf,
    /// The directory to write; it must not exist or be empty.
    #[arg(long)]
    pub out: PathBuf,
}

/// Exports the checkpoint and says where; exits 0.
pub fn exec(args: ExportArgs) -> Result<u8> {
    let dir = checkpoint::export(&args.checkpoint, &args.out)?;
    println!(
        "exported {} to {}: {MODEL_FILE} and {CONFIG_FILE}",
        dir.display(),
        args.out.display(),
    );
    Ok(exit_codes::SUCCESS)
}
