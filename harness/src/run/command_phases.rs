//! The phases of a suite whose `engine: {command}` names another trainer: each phase the suite
//! plans runs as that command, in its own run directory, resuming from the checkpoint an
//! earlier phase saved, appending its `ckpt-record/1` lines to a file of its own; the phases'
//! files, read in order, are the run the checks judge.

use crate::devices::DeviceKind;
use crate::record::jsonl::to_run;
use crate::record::RunRecord;
use crate::run::{output_tail, phases};
use crate::suite::engine::CommandEngine;
use crate::suite::Suite;
use anyhow::{anyhow, bail, Context, Result};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Lines of a failed phase's output shown in the error.
const TAIL_LINES: usize = 20;

/// Runs every phase of `suite` as `engine`'s command on `device`, with run directories and
/// records under `work`; the record they wrote. A phase that exits non-zero, runs past its
/// timeout or writes no record stops the run with an error naming it and its output's end.
pub fn run(
    suite: &Suite,
    engine: &CommandEngine,
    device: DeviceKind,
    work: &Path,
) -> Result<RunRecord> {
    let planned = crate::forecast::plan(suite);
    let records = work.join("records");
    std::fs::create_dir_all(&records)
        .with_context(|| format!("{}: cannot create", records.display()))?;
    let cwd = match suite.path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let mut text = String::new();
    for (p, leg) in planned.iter().zip(phases::legs(&planned, work)) {
        let phase = p.phase.to_string();
        let run_dir = leg
            .saves_into
            .clone()
            .unwrap_or_else(|| work.join(format!("checkpoints-{phase}")));
        std::fs::create_dir_all(&run_dir)
            .with_context(|| format!("{}: cannot create", run_dir.display()))?;
        let record = records.join(format!("{phase}.jsonl"));
        let (resume_dir, resume_step) = leg
            .resumes
            .clone()
            .map_or((String::new(), 0), |(d, s)| (d.display().to_string(), s));
        let saves: Vec<String> = (p.from + 1..=p.end)
            .filter(|&s| suite.saves_at(p.from, s))
            .map(|s| s.to_string())
            .collect();
        let values: BTreeMap<&str, String> = BTreeMap::from([
            ("phase", phase.clone()),
            ("record", record.display().to_string()),
            ("run_dir", run_dir.display().to_string()),
            ("device", device.to_string()),
            ("total_steps", p.end.to_string()),
            ("horizon", suite.max_steps().to_string()),
            ("save_steps", saves.join(",")),
            ("resume_step", resume_step.to_string()),
            ("resume_dir", resume_dir),
        ]);
        let words = engine
            .words(&values, leg.resumes.is_some())
            .map_err(|e| anyhow!("{}: engine: {e}", suite.path.display()))?;
        let log = work.join(format!("{phase}.log"));
        run_phase(engine, &words, &cwd, &values, &log)
            .with_context(|| format!("phase {phase}: `{}`", words.join(" ")))?;
        if !record.exists() {
            bail!(
                "phase {phase} wrote no record to {}: the command must append its ckpt-record/1 lines to {{record}} or $CKPT_RECORD",
                record.display()
            );
        }
        let lines = to_run::text(&record)?;
        text.push_str(&lines);
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
    }
    to_run::from_text(text, &format!("{} records", suite.file.name))
}

/// Runs one phase's `words` in `cwd` with its output in `log`; an error when it fails, with
/// the log's last lines.
fn run_phase(
    engine: &CommandEngine,
    words: &[String],
    cwd: &Path,
    values: &BTreeMap<&str, String>,
    log: &Path,
) -> Result<()> {
    let out =
        std::fs::File::create(log).with_context(|| format!("{}: cannot create", log.display()))?;
    let err = out.try_clone()?;
    let mut child = Command::new(&words[0])
        .args(&words[1..])
        .current_dir(cwd)
        .envs(&engine.env)
        .env("CKPT_RECORD", &values["record"])
        .env("CKPT_PHASE", &values["phase"])
        .env("CKPT_RUN_DIR", &values["run_dir"])
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .with_context(|| format!("cannot start {:?} in {}", words[0], cwd.display()))?;
    let limit = Duration::from_secs(engine.timeout_seconds);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "ran past engine.timeout_seconds ({} s) and was stopped{}",
                engine.timeout_seconds,
                tail(log)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if !status.success() {
        bail!("exited with {status}{}", tail(log));
    }
    Ok(())
}

/// The last lines of `log` ([`output_tail::last_lines`]), as `; its output ended: ...`, or
/// nothing when it is empty.
fn tail(log: &Path) -> String {
    let last = output_tail::last_lines(log, TAIL_LINES);
    if last.is_empty() {
        String::new()
    } else {
        format!("; its output ended:\n{}", last.join("\n"))
    }
}
