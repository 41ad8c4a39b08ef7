//! `ckpt-harness train`: trains a suite's model, saving checkpoints as the suite says and after
//! the last step it trains, and prints one JSON line per step. With `training.async_save` the
//! saves are written in the background, each finished by the end of the step after it (before
//! that step's line is printed) and the last before `train` exits.
//!
//! It holds the run directory's lock throughout, first puts right what interrupted saves left
//! there, refuses a run directory holding checkpoints of another configuration unless told to
//! overwrite them, and resumes a run whose `latest` is broken from its newest checkpoint that
//! loads, with a warning naming what it skipped. A resume in another execution environment than
//! the checkpoint's is noted with the fields that differ, and so is a resume at another world
//! size than a sharded checkpoint's.
//!
//! With `--rank R --meet ADDR` it trains one rank of the suite's `parallel.world_size` ranks,
//! each rank a `train` of its own (as torchrun starts a rank): rank 0 listens at `ADDR` (or,
//! with `--meet-file FILE` on one machine, at a port it writes into `FILE`), locks
//! and recovers the run directory, prints the steps and commits the checkpoints every rank
//! writes its part of (the run directory must be one every rank sees); a resume is from the
//! checkpoint named, without falling back to an older one.
//!
//! A step whose loss or gradient norm is not finite stops training before anything more is
//! saved, and so does a checkpoint holding a non-finite number in any rank's rows (where each
//! rank is a process, every rank stops on it alike): `latest` keeps naming the last
//! checkpoint of finite numbers, and `train` fails with [`Stopped`]. So does a save that fails
//! (a full disk): the message names the step and the checkpoint `latest` still names.

use super::exit_codes;
use crate::devices::{self, DeviceKind, OnDevice};
use crate::run::meeting::MeetAt;
use crate::suite::Suite;
use anyhow::{bail, Result};
use ckpt_engine::checkpoint::{self, Foreign, RunLock};
use ckpt_engine::environment;
use ckpt_engine::{Device, EngineError, Trainer};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `train`'s arguments.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// The suite file.
    pub suite: PathBuf,
    /// Run directory for checkpoints.
    #[arg(long)]
    pub out: PathBuf,
    /// Continue from this checkpoint (or run directory, following its `latest`).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Train until this many steps are done (default: the suite's max_steps). The last step
    /// trained is always saved.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Delete the checkpoints of another configuration that --out holds, instead of
    /// refusing to train into it.
    #[arg(long)]
    pub overwrite: bool,
    /// The device to train on.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Train only rank RANK of the suite's `parallel.world_size` ranks, each rank a `train`
    /// of its own, started with the same arguments and its own --rank (as torchrun starts
    /// them); the ranks meet at --meet or through --meet-file.
    #[arg(long, requires = "meeting")]
    pub rank: Option<usize>,
    /// Where the ranks of --rank meet (HOST:PORT): rank 0 listens there, every other rank
    /// connects to it.
    #[arg(long, group = "meeting", requires = "rank")]
    pub meet: Option<std::net::SocketAddr>,
    /// A file through which the ranks of --rank, all on this machine, meet: rank 0 listens
    /// at a port of the loopback the system gives it and writes its address there, the
    /// other ranks read it (no port to choose). It must not exist when the ranks start.
    #[arg(long, group = "meeting", requires = "rank")]
    pub meet_file: Option<PathBuf>,
}

/// Trains the suite as the arguments say; exits 0, or fails with [`Stopped`] or bad input.
pub fn exec(args: TrainArgs) -> Result<u8> {
    let suite = Suite::load(&args.suite)?;
    let meet = args
        .meet
        .map(MeetAt::Address)
        .or(args.meet_file.map(MeetAt::File));
    let opts = TrainOptions {
        out: &args.out,
        resume: args.resume.as_deref(),
        steps: args.steps,
        overwrite: args.overwrite,
        device: args.device,
        rank: args
            .rank
            .zip(meet)
            .map(|(rank, meet)| RankOf { rank, meet }),
    };
    run(&suite, &opts)?;
    Ok(exit_codes::SUCCESS)
}

/// One line of `train`'s output.
#[derive(Serialize)]
struct StepLine {
    step: u64,
    loss: f32,
    lr: f64,
    grad_norm: f64,
    peak_bytes: u64,
}

/// Training that stopped part-way for a reason other than bad input: a step whose loss or
/// gradient norm turned non-finite, weights that did, or a save that failed. The message names
/// the step and the checkpoint `latest` still names.
#[derive(Debug)]
pub struct Stopped(String);

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Stopped {}

/// Where and how far `train` trains.
pub struct TrainOptions<'a> {
    /// The run directory checkpoints are saved in.
    pub out: &'a Path,
    /// The checkpoint, or run directory, to continue from.
    pub resume: Option<&'a Path>,
    /// Train until this many steps are done (default: the suite's `max_steps`).
    pub steps: Option<u64>,
    /// Delete `out`'s checkpoints of another configuration rather than refuse to train there.
    pub overwrite: bool,
    /// The device to train on.
    pub device: DeviceKind,
    /// The rank this `train` runs, where each rank is a process of its own.
    pub rank: Option<RankOf>,
}

impl TrainOptions<'_> {
    /// Whether this `train` does what one process does alone (lock, recover, delete, print):
    /// rank 0's, or the only one.
    fn leads(&self) -> bool {
        self.rank.as_ref().is_none_or(|r| r.rank == 0)
    }
}

/// One rank of ranks in processes of their own.
#[derive(Clone, Debug)]
pub struct RankOf {
    /// The rank this process runs.
    pub rank: usize,
    /// Where the ranks meet.
    pub meet: MeetAt,
}

/// Trains `suite` as `opts` says.
pub fn run(suite: &Suite, opts: &TrainOptions<'_>) -> Result<()> {
    suite.check_run()?;
    if let Some(path) = opts.resume {
        checkpoint::check_named_path(path)?;
    }
    let out = opts.out;
    if out.symlink_metadata().is_ok() && !out.is_dir() {
        bail!(
            "{}: --out is not a directory (a file, or a link to nothing); give the run directory to save into, or a path that does not exist yet",
            out.display()
        );
    }
    let _lock = opts.leads().then(|| RunLock::acquire(out)).transpose()?;
    if opts.leads() {
        for note in checkpoint::recover(out)? {
            eprintln!("note: {note}");
        }
    }
    let foreign = checkpoint::foreign(out, &suite.train.identity()?)?;
    if !foreign.is_empty() && !opts.overwrite {
        bail!(refusal(out, &foreign, opts.resume.is_some()));
    }
    let train = Train {
        suite,
        opts,
        foreign,
    };
    devices::run_on(opts.device, suite.file.threads, suite.capacity(), train)
}

/// One `train` command's work once the run directory is locked and checked, for whichever
/// device it names.
struct Train<'a> {
    suite: &'a Suite,
    opts: &'a TrainOptions<'a>,
    foreign: Vec<Foreign>,
}

impl OnDevice for Train<'_> {
    type Output = ();

    fn run<D: Device>(self, dev: D) -> Result<()> {
        let Train {
            suite,
            opts,
            foreign,
        } = self;
        let cfg = suite.train.clone();
        let mut trainer = match (opts.resume, &opts.rank) {
            (Some(path), None) => resume(suite, dev, path)?,
            (None, None) => Trainer::new(cfg, dev)?,
            (None, Some(r)) => Trainer::new_rank(cfg, dev, r.rank, r.meet.meeting(r.rank)?)?,
            (Some(path), Some(r)) => {
                let dir = checkpoint::resolve(path)?;
                let trainer =
                    Trainer::resume_rank(cfg, dev, r.rank, r.meet.meeting(r.rank)?, &dir)?;
                note_env_changes(&dir, &trainer);
                if opts.leads() {
                    note_world_change(&dir, &trainer);
                }
                trainer
            }
        };
        let target = opts.steps.unwrap_or(suite.max_steps());
        if target <= trainer.step_index() {
            let at = trainer.step_index();
            let what = match opts.steps {
                Some(_) => "--steps",
                None => "the suite's training.max_steps",
            };
            bail!("{what} is {target}, but the run is already at step {at}: nothing would be trained or saved; give a --steps above {at}");
        }
        if opts.leads() {
            checkpoint::remove_foreign(opts.out, &foreign)?;
            for f in &foreign {
                eprintln!("note: deleted {} ({})", f.dir.display(), f.difference);
            }
        }
        train_until(&mut trainer, suite, opts.out, target, opts.leads()).map_err(save_stops)
    }
}

/// A failed save as [`Stopped`]: it is not bad input, and its message already names the step
/// and what `latest` names.
fn save_stops(e: anyhow::Error) -> anyhow::Error {
    match e.downcast_ref::<EngineError>() {
        Some(EngineError::SaveFailed { message, .. }) => Stopped(message.clone()).into(),
        _ => e,
    }
}

/// Steps `trainer` until `target` steps are done, printing a line per step where it `prints`,
/// and saving into `out` where the suite says and after the last step.
fn train_until<D: Device>(
    trainer: &mut Trainer<D>,
    suite: &Suite,
    out: &Path,
    target: u64,
    prints: bool,
) -> Result<()> {
    let keep = suite.file.training.keep_last;
    let save = |trainer: &mut Trainer<D>| -> Result<()> {
        if let Some(name) = trainer.non_finite_tensor()? {
            let what = format!(
                "the weights step {} left hold a non-finite number ({name})",
                trainer.step_index().saturating_sub(1)
            );
            return Err(stopped(trainer, out, &what));
        }
        if suite.file.training.async_save {
            trainer.save_async(out, keep)?;
        } else {
            trainer.save(out, keep)?;
        }
        Ok(())
    };
    let mut stdout = std::io::stdout().lock();
    let mut saved = true;
    let from = trainer.step_index();
    while trainer.step_index() < target {
        let s = trainer.step()?;
        let line = StepLine {
            step: s.step,
            loss: s.loss,
            lr: s.lr,
            grad_norm: s.grad_norm,
            peak_bytes: s.memory.allocated.peak,
        };
        if prints {
            writeln!(stdout, "{}", serde_json::to_string(&line)?)?;
        }
        if !s.loss.is_finite() || !s.grad_norm.is_finite() {
            let what = format!(
                "step {}'s loss is {} and its gradient norm {}: training diverged",
                s.step, s.loss, s.grad_norm
            );
            return Err(stopped(trainer, out, &what));
        }
        saved = suite.saves_at(from, trainer.step_index());
        if saved {
            save(trainer)?;
        }
    }
    if !saved {
        save(trainer)?;
    }
    trainer.finish_saves()?;
    Ok(())
}

/// [`Stopped`] for `what`, in the run saved in `out`, once the saves in flight are finished:
/// what `latest` names, and what to do.
fn stopped<D: Device>(trainer: &mut Trainer<D>, out: &Path, what: &str) -> anyhow::Error {
    if let Err(e) = trainer.finish_saves() {
        return e.into();
    }
    let pointer = out.join(checkpoint::LATEST_FILE);
    let latest = match pointer.exists().then(|| checkpoint::resolve(out)) {
        Some(Ok(dir)) => format!(
            "{} still names {}, the last checkpoint saved. Lower optimizer.lr (or set optimizer.grad_clip), then train again, or resume from an earlier checkpoint",
            pointer.display(),
            dir.display()
        ),
        _ => format!(
            "{} holds no checkpoint of this run. Lower optimizer.lr (or set optimizer.grad_clip) and train again",
            out.display()
        ),
    };
    Stopped(format!(
        "{what}; training stopped without saving it, and {latest}"
    ))
    .into()
}

/// Why `train` will not write into `out`, and what to do instead. A resume is not told to
/// `--overwrite`: that would delete the checkpoints it means to continue.
fn refusal(out: &Path, foreign: &[Foreign], resuming: bool) -> String {
    let first = &foreign[0];
    let fix = if resuming {
        "Resume it with the suite and data it was saved with (token files, datasets, tokenizers and chat templates are recorded by their size and sha256, not their paths), or train into another --out"
    } else {
        "Train into another --out, resume it with the suite it was saved with, or pass --overwrite to delete those checkpoints first"
    };
    format!(
        "{} holds {} checkpoint(s) of another configuration ({}: {}, checkpoint vs this suite); training into it would mix two runs. {fix}",
        out.display(),
        foreign.len(),
        first.dir.display(),
        first.difference,
    )
}

/// The trainer resumed from `path`; when `path` is a run directory whose `latest` does not load,
/// from its newest checkpoint that does, with a warning naming what was skipped and why. A note
/// names the fields of the execution environment that differ from the checkpoint's.
fn resume<D: Device>(suite: &Suite, dev: D, path: &Path) -> Result<Trainer<D>> {
    let (state, latest) = (checkpoint::STATE_FILE, checkpoint::LATEST_FILE);
    if path.is_dir()
        && !path.join(state).exists()
        && !path.join(latest).exists()
        && checkpoint::list(path)?.is_empty()
    {
        bail!(
            "{}: holds no checkpoint (no {state}, no {latest} and no step- directories); give a checkpoint directory, or a run directory an earlier train saved into",
            path.display(),
        );
    }
    let found = checkpoint::load_newest(path, &suite.train.identity()?, |dir| {
        Trainer::resume(suite.train.clone(), dev.clone(), dir)
    })?;
    if !found.skipped.is_empty() {
        let skipped: Vec<String> = found.skipped.iter().map(|s| s.error.to_string()).collect();
        eprintln!(
            "warning: resuming from {}, the newest checkpoint that loads; skipped {}",
            found.dir.display(),
            skipped.join("; skipped ")
        );
    }
    if checkpoint::state_file::read(&found.dir).is_ok_and(|s| !s.protected) {
        eprintln!(
            "warning: {} is unprotected (format version 1, without {}): an edit to it cannot be detected; resuming from it as it is",
            found.dir.join(checkpoint::STATE_FILE).display(),
            checkpoint::STATE_SUM_FILE
        );
    }
    note_env_changes(&found.dir, &found.value);
    note_world_change(&found.dir, &found.value);
    Ok(found.value)
}

/// A note where `trainer` resumed the sharded checkpoint in `dir` at another world size than the
/// ranks that saved it.
fn note_world_change<D: Device>(dir: &Path, trainer: &Trainer<D>) {
    let world = trainer.config().parallel.world_size;
    let Some(saved) = (trainer.saved_world_size()).filter(|&n| n > 1 && n != world) else {
        return;
    };
    let how = match world {
        1 => "one rank: every tensor is put together whole from their chunks".to_owned(),
        _ => format!("{world} ranks: every tensor's rows are cut anew for them"),
    };
    eprintln!(
        "note: {} was saved sharded by {saved} ranks; resuming on {how} and checked against its whole hash",
        dir.display()
    );
}

/// A note naming the fields of the execution environment `trainer` runs in that differ from
/// those of the checkpoint in `dir` it resumed from.
fn note_env_changes<D: Device>(dir: &Path, trainer: &Trainer<D>) {
    let changes = trainer.env_changes();
    if !changes.is_empty() {
        eprintln!(
            "note: {} was saved in another execution environment ({}); training continues, but not necessarily bit for bit",
            dir.display(),
            environment::describe(changes)
        );
    }
}
