//! The exit statuses of every `ckpt-harness` command, in one place, and the text each command's
//! `--help` lists them with.

use std::fmt::Write;

/// The command did what it was asked and everything it checked passed.
pub const SUCCESS: u8 = 0;
/// The command ran and what it checked failed: a trial failed, a checkpoint is damaged.
pub const FAILED: u8 = 1;
/// Bad input kept the command from running, or from finishing: an invalid suite or argument, a
/// missing or unreadable file, no suites found (the status clap gives a bad argument too).
pub const INVALID: u8 = 2;
/// Standard output was closed before the command finished writing (`ckpt-harness run | head`):
/// the command stops quietly with the status a shell reports for a process ended by SIGPIPE.
pub const BROKEN_PIPE: u8 = 141;

/// The `Exit status:` section of a command's help: `codes` and their meanings, then bad input
/// (`INVALID`, with `also` for what else the command counts as bad input).
fn help(codes: &[(u8, &str)], also: &str) -> String {
    let mut out = String::from("Exit status:\n");
    let invalid =
        format!("bad input: an invalid suite or argument, a missing or unreadable file{also}");
    for (code, meaning) in codes.iter().chain(&[(INVALID, invalid.as_str())]) {
        let _ = writeln!(out, "  {code:>3}  {meaning}");
    }
    out
}

/// `help` followed by `BROKEN_PIPE`, for the commands that stop quietly on a closed output.
fn quiet_on_close(help: String) -> String {
    format!("{help}  {BROKEN_PIPE:>3}  standard output was closed before the command finished\n")
}

/// `run`'s exit statuses.
pub fn run_help() -> String {
    quiet_on_close(help(
        &[
            (
                SUCCESS,
                "every trial passed (a negative control passes when exactly its expected checks fail)",
            ),
            (FAILED, "a trial failed, or could not run; the reports are written all the same; with --fail-on-regression, also when something regressed against --baseline"),
        ],
        ", no suite file found under the paths given, a --baseline that is not a summary.json, a --bench that is not a figures file",
    ))
}

/// `diff`'s exit statuses.
pub fn diff_help() -> String {
    quiet_on_close(help(
        &[
            (SUCCESS, "nothing regressed (other changes may be listed)"),
            (
                FAILED,
                "something regressed: a check newly failing or skipped, a step peak up more than 2%, step time up more than 10%, a loss trajectory that moved, a benchmark figure down more than 10%",
            ),
        ],
        ", or a file that is not a summary.json ckpt-harness wrote",
    ))
}

/// `report merge`'s exit statuses.
pub fn merge_help() -> String {
    quiet_on_close(help(
        &[
            (SUCCESS, "every merged trial passed"),
            (FAILED, "a merged trial failed; with --fail-on-regression, also when something regressed against --baseline"),
        ],
        ", a directory without summaries, a file that is not a summary.json, a trial found in two partitions, benchmark figures in two, a --bench that is not a figures file",
    ))
}

/// `validate`'s exit statuses.
pub fn validate_help() -> String {
    quiet_on_close(help(
        &[(SUCCESS, "every suite is valid")],
        " (each invalid suite is named with its place)",
    ))
}

/// `verify`'s exit statuses.
pub fn verify_help() -> String {
    quiet_on_close(help(
        &[
            (SUCCESS, "every checkpoint is intact"),
            (
                FAILED,
                "something is damaged: a file, the state file, or a run's latest pointer",
            ),
        ],
        ", or nothing to verify and nothing damaged: a path that does not exist, is neither a checkpoint nor a run directory, or holds a checkpoint of a newer build",
    ))
}

/// `train`'s exit statuses.
pub fn train_help() -> String {
    quiet_on_close(help(
        &[
            (SUCCESS, "trained and saved"),
            (
                FAILED,
                "training stopped: a step's loss or gradient norm, or the weights, turned non-finite, or a save failed (a full disk); latest still names the last checkpoint saved",
            ),
        ],
        "",
    ))
}

/// The exit statuses of the commands that either do their job or stop on bad input (`list`,
/// `eval`).
pub fn plain_help() -> String {
    quiet_on_close(help(&[(SUCCESS, "done")], ""))
}

/// `estimate`'s exit statuses.
pub fn estimate_help() -> String {
    quiet_on_close(help(
        &[
            (
                SUCCESS,
                "estimated; a suite's memory.budget holds for the run as configured",
            ),
            (
                FAILED,
                "a suite's memory.budget is exceeded (the table says where and by how much)",
            ),
        ],
        "",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_help_lists_its_statuses_and_the_shared_ones() {
        let run = run_help();
        for line in [
            "    0  every trial",
            "    1  a trial failed",
            "    2  bad input",
            "no suite file found",
            "  141  standard output was closed",
        ] {
            assert!(run.contains(line), "{run}");
        }
        let verify = verify_help();
        assert!(verify.contains("    1  something is damaged"), "{verify}");
        assert!(verify.contains("nothing to verify"), "{verify}");
        assert!(
            diff_help().contains("    1  something regressed"),
            "{}",
            diff_help()
        );
        assert!(
            merge_help().contains("a trial found in two partitions"),
            "{}",
            merge_help()
        );
        let estimate = estimate_help();
        assert!(
            estimate.contains("    1  a suite's memory.budget is exceeded"),
            "{estimate}"
        );
        assert!(
            verify.contains("  141  standard output was closed"),
            "{verify}"
        );
        assert!(
            train_help().contains("    1  training stopped"),
            "{}",
            train_help()
        );
        assert!(
            plain_help().contains("    2  bad input"),
            "{}",
            plain_help()
        );
    }
}
