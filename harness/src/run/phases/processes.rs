//! The phases of a suite whose ranks are processes of their own (`parallel.processes`). Each
//! phase starts one `ckpt-harness rank-phase` process per rank; the ranks meet over loopback
//! TCP through a file of the phase (rank 0 writes the port the system gave it there, as with
//! `train --rank --meet-file`), run the phase as `Trial::phase` runs it, and each writes the
//! phase as it saw it: its own bytes, its own resident host memory. The harness puts the ranks'
//! records side by side, as it puts the ranks of one process, after checking that they agree
//! on every step's loss, gradient norm and batch.

use super::{Leg, PhaseRun, RankPhase, Trial, Watch};
use crate::atomic_file;
use crate::devices::{self, DeviceKind, OnDevice};
use crate::run::meeting::MeetAt;
use crate::run::output_tail;
use anyhow::{bail, Context, Result};
use ckpt_engine::{Device, Placing, StateDigest};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long the other ranks are given to end once one has failed, before they are killed: the
/// phase has failed, and what they print is only its consequence (a rank whose peer died
/// after meeting it fails at once; one still waiting for a peer to meet would wait a minute).
const GRACE: Duration = Duration::from_secs(5);

/// Lines of a failed rank's output shown in the error.
const TAIL_LINES: usize = 8;

/// One phase for the processes of its ranks to run: written by the harness, read by each
/// `rank-phase` process.
#[derive(Debug, Serialize, Deserialize)]
pub struct RankJob {
    /// The suite file.
    suite: PathBuf,
    /// The device the ranks share out.
    device: DeviceKind,
    /// The trial's run directories.
    work: PathBuf,
    /// The phase: the checkpoint it resumes from and where it saves.
    leg: Leg,
    /// Its ranks.
    world: usize,
    /// The file the ranks meet through: rank 0 writes the address it listens at there.
    meet_file: PathBuf,
}

/// The `ckpt-harness` program that runs each rank: `CKPT_HARNESS` where set; else this process's
/// own program when it is `ckpt-harness`; else, for a test program that cargo built into
/// `target/<profile>/deps`, the `ckpt-harness` cargo built in the directory above it.
fn rank_program() -> Result<PathBuf> {
    if let Some(program) = std::env::var_os("CKPT_HARNESS") {
        return Ok(program.into());
    }
    let exe = std::env::current_exe().context("cannot find this program's own path")?;
    let name = format!("ckpt-harness{}", std::env::consts::EXE_SUFFIX);
    if exe.file_name() == Some(name.as_ref()) {
        return Ok(exe);
    }
    match exe.parent().and_then(Path::parent).map(|dir| dir.join(&name)) {
        Some(beside) if beside.is_file() => Ok(beside),
        _ => bail!(
            "parallel.processes runs each rank as `ckpt-harness rank-phase`, but this program ({}) is not ckpt-harness and none was built in the directory above it; set CKPT_HARNESS to the ckpt-harness program",
            exe.display()
        ),
    }
}

/// Runs `leg` of `trial` on `world` ranks, each a process of its own, and puts their records
/// together; `watch` is told of the phase and its steps once the ranks have ended. A rank whose
/// device refused an allocation, or whose resume refused its checkpoint, ends the phase early
/// as it would in one process (the others, left waiting for it, fail; their errors are that
/// one's consequence). Any other failure of a rank is an error naming it, with its output's end.
pub(crate) fn phase<D: Device>(
    trial: &Trial<'_, D>,
    leg: &Leg,
    world: usize,
    reference_digests: &BTreeMap<u64, StateDigest>,
    watch: &mut impl Watch,
) -> Result<PhaseRun> {
    let phase = leg.phase;
    let dir = trial.work.join("ranks");
    let meet_file = dir.join(format!("{phase}.meet"));
    match std::fs::remove_file(&meet_file) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("{}: cannot remove", meet_file.display()))
        }
        _ => {}
    }
    let job = RankJob {
        suite: trial.suite.path.clone(),
        device: trial.kind,
        work: trial.work.to_path_buf(),
        leg: leg.clone(),
        world,
        meet_file,
    };
    let job_file = dir.join(format!("{phase}.job.json"));
    atomic_file::write(&job_file, &serde_json::to_vec_pretty(&job)?)?;
    let program = rank_program()?;
    let tracker = trial.dev.tracker().clone();
    let from = leg.resumes.as_ref().map_or(0, |(_, step)| *step);
    watch.phase_started(phase, from, trial.end(), &tracker);
    let ranks: Vec<RankProcess> = (0..world)
        .map(|rank| RankProcess::start(&program, &job_file, &dir, phase, rank))
        .collect::<Result<_>>()?;
    let ended = wait_all(ranks)?;
    let mut ran = put_together(ended)
        .with_context(|| format!("phase {phase} on {world} ranks in processes of their own"))?;
    if ran.record.resumed_digest.is_some() {
        ran.record.reference_digest = reference_digests.get(&from).cloned();
    }
    for step in &ran.record.steps {
        watch.step_started(phase, step.step);
        watch.step_done(phase, step);
    }
    watch.releasing(phase);
    watch.phase_done(&ran.record, &tracker);
    Ok(ran)
}

/// One rank's process and the files it writes.
struct RankProcess {
    rank: usize,
    child: Child,
    out: PathBuf,
    log: PathBuf,
    /// Whether it was killed, [`GRACE`] after another rank failed.
    killed: bool,
}

impl RankProcess {
    /// Starts rank `rank` of `job_file`'s phase, its output and log in `dir`.
    fn start(
        program: &Path,
        job_file: &Path,
        dir: &Path,
        phase: crate::record::Phase,
        rank: usize,
    ) -> Result<Self> {
        let out = dir.join(format!("{phase}.rank{rank}.json"));
        let log = dir.join(format!("{phase}.rank{rank}.log"));
        let log_file = std::fs::File::create(&log)
            .with_context(|| format!("{}: cannot create", log.display()))?;
        let child = Command::new(program)
            .arg("rank-phase")
            .arg(job_file)
            .arg("--rank")
            .arg(rank.to_string())
            .arg("--out")
            .arg(&out)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("cannot start {} for rank {rank}", program.display()))?;
        Ok(RankProcess {
            rank,
            child,
            out,
            log,
            killed: false,
        })
    }

    /// The last lines of what the rank printed ([`output_tail::last_lines`]), as one line.
    fn tail(&self) -> String {
        output_tail::last_lines(&self.log, TAIL_LINES).join(" | ")
    }
}

/// A rank's process left running when the phase gives up on it (another rank would not start,
/// or waiting failed) is killed, not left to wait for peers that never come.
impl Drop for RankProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.child.kill().ok();
            self.child.wait().ok();
        }
    }
}

/// A rank's process once it has ended: the phase as it saw it, or why it has none.
struct Ended {
    process: RankProcess,
    /// How many ranks ended before it.
    order: usize,
    run: Result<PhaseRun>,
}

/// Waits for every rank to end; once one has failed, the others get [`GRACE`] before they are
/// killed.
fn wait_all(mut running: Vec<RankProcess>) -> Result<Vec<Ended>> {
    let mut ended: Vec<(RankProcess, ExitStatus)> = Vec::new();
    let mut deadline: Option<Instant> = None;
    while !running.is_empty() {
        let mut i = 0;
        while i < running.len() {
            match running[i].child.try_wait()? {
                Some(status) => {
                    if !status.success() && deadline.is_none() {
                        deadline = Some(Instant::now() + GRACE);
                    }
                    ended.push((running.swap_remove(i), status));
                }
                None => i += 1,
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            for p in running.iter_mut().filter(|p| !p.killed) {
                p.killed = p.child.kill().is_ok();
            }
        }
        if !running.is_empty() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let mut ended: Vec<Ended> = ended
        .into_iter()
        .enumerate()
        .map(|(order, (process, status))| {
            let run = if status.success() {
                read_run(&process.out)
            } else {
                Err(anyhow::anyhow!("{status}"))
            };
            Ended {
                process,
                order,
                run,
            }
        })
        .collect();
    ended.sort_by_key(|e| e.process.rank);
    Ok(ended)
}

/// The phase as a rank wrote it to `out`.
fn read_run(out: &Path) -> Result<PhaseRun> {
    let text = std::fs::read(out).with_context(|| format!("{}: cannot read", out.display()))?;
    serde_json::from_slice(&text).with_context(|| format!("{}: not a phase record", out.display()))
}

/// The ranks' phases as one record: rank 0's at the top level, every rank's figures in rank
/// order in `ranks` (with its process's host memory). Where a rank failed but another ended
/// the phase early (an allocation refused, a checkpoint refused), the phase is that rank's
/// record alone: the others failed for want of it.
fn put_together(ended: Vec<Ended>) -> Result<PhaseRun> {
    if ended.iter().all(|e| e.run.is_ok()) {
        let runs = ended.into_iter().filter_map(|e| e.run.ok()).collect();
        return side_by_side(runs);
    }
    let early = ended.iter().find_map(|e| {
        e.run
            .as_ref()
            .ok()
            .filter(|r| r.record.oom.is_some() || r.record.refused.is_some())
    });
    if let Some(early) = early {
        let mut record = early.record.clone();
        record.ranks.clear();
        record.steps.iter_mut().for_each(|s| s.ranks.clear());
        return Ok(PhaseRun {
            record,
            digests: early.digests.clone(),
            samples_per_epoch: early.samples_per_epoch,
            dataset_samples: early.dataset_samples,
        });
    }
    let mut failed: Vec<&Ended> = ended.iter().filter(|e| e.run.is_err()).collect();
    // The first to end is the likeliest cause; the others mostly lost it as a peer.
    failed.sort_by_key(|e| e.order);
    let lines: Vec<String> = failed
        .iter()
        .filter_map(|e| {
            let why = e.run.as_ref().err()?;
            let tail = e.process.tail();
            Some(match (e.process.killed, tail.is_empty()) {
                (true, _) => format!(
                    "rank {} stopped {} s after",
                    e.process.rank,
                    GRACE.as_secs()
                ),
                (false, true) => format!("rank {} failed ({why:#})", e.process.rank),
                (false, false) => format!("rank {} failed ({why:#}): {tail}", e.process.rank),
            })
        })
        .collect();
    bail!("{}", lines.join("; "))
}

/// Every rank's phase (`runs`, in rank order) as one record: rank 0's at the top level, with
/// the first ending of the phase early any rank recorded, and each rank's figures in `ranks`.
fn side_by_side(mut runs: Vec<PhaseRun>) -> Result<PhaseRun> {
    if runs.len() == 1 {
        return Ok(runs.remove(0));
    }
    agree(&runs)?;
    let oom = runs.iter().find_map(|r| r.record.oom.clone());
    let refused = runs.iter().find_map(|r| r.record.refused.clone());
    if runs.iter().any(|r| r.record.ranks.is_empty()) {
        // No trainer was built: there are no ranks' figures to put side by side.
        let mut first = runs.swap_remove(0);
        first.record.oom = first.record.oom.take().or(oom);
        first.record.refused = first.record.refused.take().or(refused);
        return Ok(first);
    }
    let ranks = runs
        .iter()
        .map(|r| RankPhase {
            host: Some(r.record.host.clone()),
            ..r.record.ranks.first().cloned().unwrap_or_default()
        })
        .collect();
    let step_ranks: Vec<Vec<_>> = (0..runs[0].record.steps.len())
        .map(|i| {
            runs.iter()
                .map(|r| r.record.steps[i].ranks.first().cloned().unwrap_or_default())
                .collect()
        })
        .collect();
    // Each rank's evaluations: its peak and its own model's, in rank order.
    let eval_ranks: Vec<(Vec<u64>, Vec<u64>)> = (0..runs[0].record.evaluations.len())
        .map(|i| {
            let of_rank = |r: &PhaseRun| {
                let e = &r.record.evaluations[i];
                (e.memory.allocated.peak, e.predicted_peaks.first().copied())
            };
            let (peaks, predicted): (Vec<u64>, Vec<Option<u64>>) = runs.iter().map(of_rank).unzip();
            (peaks, predicted.into_iter().flatten().collect())
        })
        .collect();
    let mut merged = runs.swap_remove(0);
    merged.record.ranks = ranks;
    for (evaluation, (peaks, predicted)) in merged.record.evaluations.iter_mut().zip(eval_ranks) {
        evaluation.rank_peaks = peaks;
        evaluation.predicted_peaks = predicted;
    }
    merged.record.oom = merged.record.oom.take().or(oom);
    merged.record.refused = merged.record.refused.take().or(refused);
    for (step, ranks) in merged.record.steps.iter_mut().zip(step_ranks) {
        step.ranks = ranks;
    }
    Ok(merged)
}

/// An error unless every rank trained the same steps with the same loss, gradient norm and
/// batch as rank 0, bit for bit: each takes them from the whole step's reductions.
fn agree(runs: &[PhaseRun]) -> Result<()> {
    let first = &runs[0].record.steps;
    for (rank, run) in runs.iter().enumerate().skip(1) {
        let steps = &run.record.steps;
        if steps.len() != first.len() {
            bail!(
                "rank {rank} trained {} steps and rank 0 {}: ranks in processes of their own must train the same steps",
                steps.len(),
                first.len()
            );
        }
        let (evaluations, first_evaluations) =
            (&run.record.evaluations, &runs[0].record.evaluations);
        if evaluations.len() != first_evaluations.len() {
            bail!(
                "rank {rank} evaluated {} times and rank 0 {}: ranks in processes of their own must evaluate together",
                evaluations.len(),
                first_evaluations.len()
            );
        }
        for (mine, theirs) in evaluations.iter().zip(first_evaluations) {
            if mine.loss.to_bits() != theirs.loss.to_bits()
                || mine.batch_digest != theirs.batch_digest
            {
                bail!(
                    "rank {rank} recorded the evaluation after step {} as loss {:e}, batches {}; rank 0 as {:e}, {}: the ranks must agree bit for bit",
                    mine.step,
                    mine.loss,
                    mine.batch_digest,
                    theirs.loss,
                    theirs.batch_digest
                );
            }
        }
        for (mine, theirs) in steps.iter().zip(first) {
            let same = mine.loss.to_bits() == theirs.loss.to_bits()
                && mine.grad_norm.to_bits() == theirs.grad_norm.to_bits()
                && mine.batch_digest == theirs.batch_digest;
            if !same {
                bail!(
                    "rank {rank} recorded step {} as loss {:e}, gradient norm {:e}, batch {}; rank 0 as {:e}, {:e}, {}: the ranks must agree bit for bit",
                    mine.step,
                    mine.loss,
                    mine.grad_norm,
                    mine.batch_digest,
                    theirs.loss,
                    theirs.grad_norm,
                    theirs.batch_digest
                );
            }
        }
    }
    Ok(())
}

/// `ckpt-harness rank-phase`: runs rank `rank` of the phase `job_file` describes and writes
/// the phase as it saw it to `out` (whole, or not at all).
pub fn serve(job_file: &Path, rank: usize, out: &Path) -> Result<()> {
    let text =
        std::fs::read(job_file).with_context(|| format!("{}: cannot read", job_file.display()))?;
    let job: RankJob = serde_json::from_slice(&text)
        .with_context(|| format!("{}: not a rank job", job_file.display()))?;
    if rank >= job.world {
        bail!(
            "--rank {rank}: the phase runs on {} ranks; give a rank below that",
            job.world
        );
    }
    let suite = crate::suite::Suite::load(&job.suite)?;
    let work = OneRank {
        suite: &suite,
        job: &job,
        rank,
    };
    let ran = devices::run_on(job.device, suite.file.threads, suite.capacity(), work)?;
    atomic_file::write(out, &serde_json::to_vec(&ran)?)
}

/// One rank of a phase, as work for the device its job names.
struct OneRank<'a> {
    suite: &'a crate::suite::Suite,
    job: &'a RankJob,
    rank: usize,
}

impl OnDevice for OneRank<'_> {
    type Output = PhaseRun;

    fn run<D: Device>(self, dev: D) -> Result<PhaseRun> {
        let OneRank { suite, job, rank } = self;
        let trial = Trial::new(suite, job.device, &job.work, &dev)?;
        let place = match job.world {
            1 => Placing::Here,
            _ => Placing::Rank {
                rank,
                meeting: MeetAt::File(job.meet_file.clone()).meeting(rank)?,
            },
        };
        if devices::warms_up(job.device) {
            super::warm_up(suite, 1, super::warm_up_steps(suite, trial.end()), &dev);
        }
        trial.phase(&job.leg, job.world, place, &BTreeMap::new(), &mut ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{PhaseRecord, StepRecord};

    fn run(steps: &[(f32, f64)]) -> PhaseRun {
        PhaseRun {
            record: PhaseRecord {
                steps: (0u64..)
                    .zip(steps)
                    .map(|(step, &(loss, grad_norm))| StepRecord {
                        step,
                        loss,
                        grad_norm,
                        ..StepRecord::default()
                    })
                    .collect(),
                ..PhaseRecord::default()
            },
            ..PhaseRun::default()
        }
    }

    #[test]
    fn ranks_that_disagree_on_a_step_or_on_how_many_are_named() {
        let same = [(3.5, 0.25), (3.25, 0.5)];
        assert!(agree(&[run(&same), run(&same), run(&same)]).is_ok());
        let off = [(3.5, 0.25), (f32::from_bits(3.25f32.to_bits() + 1), 0.5)];
        let e = agree(&[run(&same), run(&same), run(&off)]).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("rank 2 recorded step 1 as loss 3.2500002e0"),
            "{e}"
        );
        let e = agree(&[run(&same), run(&same[..1])]).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("rank 1 trained 1 steps and rank 0 2"),
            "{e}"
        );
    }
}
