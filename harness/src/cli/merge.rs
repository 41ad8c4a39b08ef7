//! `ckpt-harness report merge`: the reports of a run split over machines put together as one
//! ([`crate::report::merge`]), with the benchmarks' figures and the changes against a baseline,
//! written as `run` writes its own.

use super::{run, run_status, summary_file, Verdicts};
use crate::error_text;
use crate::report::bench::Bench;
use crate::report::merge;
use crate::report::summary::Summary;
use anyhow::Result;
use std::io::Write;
use std::path::PathBuf;

/// `report merge`'s arguments.
#[derive(clap::Args)]
pub struct MergeArgs {
    /// Report directories, each holding a summary.json or trials/*.json.
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
    /// Where to write the merged report.
    #[arg(long, default_value = "report")]
    pub out: PathBuf,
    /// JUnit XML and the baseline.
    #[command(flatten)]
    pub verdicts: Verdicts,
    /// The benchmarks' figures measured with the run (`scripts/bench.sh --json FILE`), in
    /// place of those a merged summary carries.
    #[arg(long)]
    pub bench: Option<PathBuf>,
}

/// Merges, prints the table and the changes, writes the reports; exits as `run` would have.
pub fn exec(args: MergeArgs) -> Result<u8> {
    let old = args
        .verdicts
        .baseline
        .as_deref()
        .map(summary_file)
        .map(|f| Summary::read(&f).map(|s| (f, s)))
        .transpose()?;
    let bench = args.bench.as_deref().map(Bench::read).transpose()?;
    let mut summary = merge::merge(&args.dirs)?;
    if bench.is_some() {
        summary.bench = bench;
    }
    let mut text = summary.table();
    if let Some((file, old)) = &old {
        let t = run::trends(file, old, &summary);
        text.push_str(&t.text());
        summary.trends = Some(t);
    }
    run::write_reports(&summary, &args.out, args.verdicts.junit.as_deref())?;
    write!(std::io::stdout(), "{}", error_text::printable(&text))?;
    Ok(run_status(&summary, args.verdicts.fail_on_regression))
}
