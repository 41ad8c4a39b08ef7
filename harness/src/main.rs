//! The `ckpt-harness` command-line tool: parses the command line and hands each command to its
//! file in `cli/`; an error is printed on one line and exits with its status.

use anyhow::Result;
use ckpt_harness::cli::{self, exit_codes, Cli, Command, ReportCommand};
use ckpt_harness::error_text;
use clap::Parser;
use std::process::ExitCode;

/// Runs `command`; its exit status, or the error that stopped it.
fn dispatch(command: Command) -> Result<u8> {
    match command {
        Command::Eval(args) => cli::eval::exec(args),
        Command::Run(args) => cli::run::exec(args),
        Command::Judge(args) => cli::judge::exec(args),
        Command::List(args) => cli::list::exec(args),
        Command::Validate(args) => cli::validate::exec(args),
        Command::Batches(args) => cli::batches::exec(args),
        Command::Train(args) => cli::train::exec(args),
        Command::RankPhase(args) => cli::rank_phase::exec(args),
        Command::Estimate(args) => cli::estimate::exec(args),
        Command::Verify(args) => cli::verify::exec(args),
        Command::Export(args) => cli::export::exec(args),
        Command::Diff(args) => cli::diff::exec(args),
        Command::Report(ReportCommand::Merge(args)) => cli::merge::exec(args),
    }
}

/// Whether `e` is a write to a closed standard output.
fn broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn main() -> ExitCode {
    ckpt_harness::run::host_memory::limit_malloc_arenas();
    let cli = Cli::parse();
    match dispatch(cli.command) {
        Ok(code) => ExitCode::from(code),
        Err(e) if broken_pipe(&e) => ExitCode::from(exit_codes::BROKEN_PIPE),
        Err(e) => {
            eprintln!(
                "error: {}",
                error_text::printable(&error_text::one_line(&e))
            );
            let stopped = e.downcast_ref::<cli::train::Stopped>().is_some();
            ExitCode::from(if stopped {
                exit_codes::FAILED
            } else {
                exit_codes::INVALID
            })
        }
    }
}
