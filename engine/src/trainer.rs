//! The training loop: one [`Trainer::step`] is load the step's micro-batches → forward/backward
//! over each, accumulating gradients → clip → AdamW → refresh the compute weights, on any
//! [`Device`]. The trainer owns what is the same on every device (the data, the schedule, the
//! dropout generator, the checkpoints); the [`State`] owns the tensors. Everything a trainer
//! allocates is freed when it is dropped.
//!
//! A checkpoint is saved synchronously ([`Trainer::save`]) or in the background
//! ([`Trainer::save_async`]): the state is copied into host staging buffers counted under
//! [`Category::Io`], a writer thread runs the same crash-safe [`checkpoint::save`], and the
//! trainer joins it at a fixed point (the end of the next step, the next save,
//! [`Trainer::finish_saves`] or the drop), freeing the staging buffers only then, so the bytes a
//! step holds do not depend on how fast the disk is.

use crate::checkpoint::state::{RngState, ScheduleState, TrainerState, FORMAT_VERSION};
use crate::checkpoint::{self, LoadRequest, RankReads, SaveRequest, Tensors};
use crate::config::{Init, Precision, TrainConfig};
use crate::data::{DataLoader, LoaderState, SampleId};
use crate::device::Device;
use crate::environment::EnvChange;
use crate::error::{EngineError, Result};
use crate::fault::Fault;
use crate::memory::{Category, Lease, MemoryStats, MemoryTracker};
use crate::model::{weights, Batch, Dropout, Params};
use crate::optim::Moments;
use crate::parallel::buffered::BufferedRank;
use crate::parallel::collective::Collective;
use crate::parallel::sockets::Meeting;
use crate::parallel::source::{HostTensors, RowSource};
use crate::ranks::Ranks;
use crate::state::State;
use crate::tensor::Tensor;
use crate::validation::Evaluation;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

/// What one step did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// The step's 0-based index.
    pub step: u64,
    /// Mean loss of the step's batches: their token losses summed over their counted labels.
    pub loss: f32,
    /// Learning rate applied.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Labels counted, over all the step's micro-batches.
    pub tokens: usize,
    /// sha256 of the token ids and labels of the step's micro-batches in order: which data the
    /// step saw.
    pub batch_digest: String,
    /// The samples of the rows of the step's micro-batches, in order (the run's sample ledger).
    #[serde(default)]
    pub samples: Vec<SampleId>,
    /// Each micro-batch's tokens per row, in order: the step's shape, which text data padded
    /// to each micro-batch's longest sample changes from step to step.
    #[serde(default)]
    pub seq_lens: Vec<usize>,
    /// Blocks recomputed in the backward pass.
    pub recomputed_blocks: usize,
    /// Each block's tokens per expert (empty for a dense block) in a MoE model, one micro-batch's
    /// after the other: the step's expert buffers depend on them. Empty for a dense model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens_per_expert: Vec<Vec<u32>>,
    /// Memory figures, peaks covering this step only (rank 0's in a data-parallel run).
    pub memory: MemoryStats,
    /// Every rank's memory figures, in rank order, in a data-parallel run; empty for one rank.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_memory: Vec<MemoryStats>,
    /// The evaluations of the validation split run with the step (after it, where it is due
    /// one), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evaluations: Vec<Evaluation>,
}

/// Digests of the training state, to compare a resumed run with the run it continues.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateDigest {
    /// Steps taken.
    pub step: u64,
    /// sha256 over every `model.safetensors` tensor (name, dtype, shape, bytes).
    pub params: String,
    /// sha256 over every `optimizer.safetensors` tensor (masters and moments).
    pub optimizer: String,
    /// AdamW updates taken.
    pub optimizer_steps: u64,
    /// The learning rate the next step will use.
    pub next_lr: f64,
    /// The data loader's position.
    pub loader: LoaderState,
    /// The dropout generator's state.
    pub rng: RngState,
}

/// A checkpoint an asynchronous save has not finished yet.
enum PendingSave {
    /// A writer thread writes the staged copy.
    Writing {
        /// The thread running [`checkpoint::save`] (or [`checkpoint::save_as_rank`] over the
        /// connections for saves it holds, which it returns).
        writer: JoinHandle<(Result<PathBuf>, Option<BufferedRank>)>,
        /// The staging buffers' bytes on the host tracker, one lease per tensor or chunk: given back when
        /// the writer is joined.
        staging: Vec<Lease>,
    },
    /// [`Fault::AsyncSaveReadsLiveWeights`]: nothing was copied; the checkpoint is written from
    /// the live tensors when the save is finished.
    Deferred {
        /// The run directory to save into.
        run_dir: PathBuf,
        /// Checkpoints to keep.
        keep_last: Option<usize>,
        /// The trainer state at the save (boxed: the variant would otherwise dwarf the other).
        state: Box<TrainerState>,
    },
}

/// A model in training on one device.
pub struct Trainer<D: Device> {
    cfg: TrainConfig,
    ranks: Ranks<D>,
    loader: DataLoader,
    /// The validation split's loader, where the run has one.
    validation: Option<DataLoader>,
    step: u64,
    rng: RngState,
    resumed_at: u64,
    pending: Option<PendingSave>,
    /// Where the loader stood when the trainer was resumed; `None` for a fresh run.
    resumed_loader: Option<LoaderState>,
    /// How the resumed checkpoint's execution environment differs from the device's.
    env_changes: Vec<EnvChange>,
    /// The ranks that saved the resumed checkpoint sharded (1 for one device's layout); `None`
    /// for a fresh run.
    saved_world_size: Option<usize>,
    /// The run's identity, read once when the trainer is built (a token file's content).
    identity: serde_json::Value,
    /// [`Fault::OptimizerStateAllocatedAtLoad`]: the zeroed copy of every rank's moments made
    /// at load, freed at the end of the first resumed step.
    allocated_at_load: Vec<D::Tensor<f32>>,
}

impl<D: Device> Trainer<D> {
    /// Builds a fresh trainer: initial weights, gradients and the data loader; with
    /// `parallel.world_size` above 1, one rank per device of [`Device::ranks`].
    pub fn new(cfg: TrainConfig, dev: D) -> Result<Self> {
        Self::new_placed(cfg, dev, Placing::Here)
    }

    /// Builds rank `rank` of a fresh run whose `parallel.world_size` ranks are processes of
    /// their own, each started with the same `cfg`: this process trains that rank on its share
    /// of `dev` (the run's device, shared out as among ranks in one process),
    /// and meets the others through `meeting` (rank 0 listens; the others are given its
    /// address). Every rank draws the same batches and takes the same steps; each step's
    /// figures are the whole run's, with the bits of one device.
    pub fn new_rank(cfg: TrainConfig, dev: D, rank: usize, meeting: Meeting) -> Result<Self> {
        Self::new_placed(cfg, dev, Placing::Rank { rank, meeting })
    }

    /// [`Trainer::new`] with its ranks built as `placing` says: [`Trainer::new_rank`] for
    /// [`Placing::Rank`].
    pub fn new_placed(cfg: TrainConfig, dev: D, placing: Placing) -> Result<Self> {
        cfg.validate()?;
        placing.check(&cfg)?;
        let master = initial_weights(&cfg, &dev)?;
        let ranks = match (cfg.parallel.world_size, placing) {
            (1, Placing::Here) => Ranks::single(State::new(
                &cfg,
                dev.clone(),
                master.try_map(|t| dev.upload(t))?,
                None,
            )?),
            (_, placing) => {
                let host = HostTensors {
                    master: &master,
                    moments: None,
                };
                placing.build(&cfg, &dev, Some(&host), None)?
            }
        };
        Self::assemble(cfg, ranks)
    }

    fn assemble(cfg: TrainConfig, ranks: Ranks<D>) -> Result<Self> {
        let (loader, validation) = cfg.loaders()?;
        let rng = RngState {
            seed: cfg.shuffle_seed,
            offset: 0,
        };
        let identity = cfg.identity()?;
        Ok(Trainer {
            cfg,
            ranks,
            loader,
            validation,
            step: 0,
            rng,
            resumed_at: 0,
            pending: None,
            resumed_loader: None,
            env_changes: Vec::new(),
            saved_world_size: None,
            identity,
            allocated_at_load: Vec::new(),
        })
    }

    /// Continues the run saved in `checkpoint_dir` (a checkpoint, or a run directory whose
    /// `latest` names one): weights, optimizer state, step, schedule, loader position and
    /// dropout generator. The checkpoint must come from a run with the same
    /// [`TrainConfig::identity`]; where its execution environment differs from the device's,
    /// the trainer lists how ([`Trainer::env_changes`]).
    pub fn resume(cfg: TrainConfig, dev: D, checkpoint_dir: &Path) -> Result<Self> {
        Self::resume_placed(cfg, dev, checkpoint_dir, Placing::Here)
    }

    /// Continues, as rank `rank` of ranks in processes of their own, the run saved in
    /// `checkpoint_dir`, at the world size of `cfg` (any, whatever the checkpoint's): every
    /// rank is started with the same `cfg` and checkpoint, and meets the others through
    /// `meeting`, as for [`Trainer::new_rank`]. Each rank reads only its rows of a sharded
    /// checkpoint, and the ranks check every whole tensor's hash between them (see
    /// [`RankReads::check_placed_as_rank`]); a checkpoint of one device's layout is read whole
    /// by each.
    pub fn resume_rank(
        cfg: TrainConfig,
        dev: D,
        rank: usize,
        meeting: Meeting,
        checkpoint_dir: &Path,
    ) -> Result<Self> {
        Self::resume_placed(cfg, dev, checkpoint_dir, Placing::Rank { rank, meeting })
    }

    /// [`Trainer::resume`] with its ranks built as `placing` says: [`Trainer::resume_rank`]
    /// for [`Placing::Rank`].
    pub fn resume_placed(
        cfg: TrainConfig,
        dev: D,
        checkpoint_dir: &Path,
        placing: Placing,
    ) -> Result<Self> {
        cfg.validate()?;
        placing.check(&cfg)?;
        let req = LoadRequest {
            config: &cfg.model,
            identity: cfg.identity()?,
            master_in_optimizer: cfg.precision == Precision::Bf16Mixed,
            master_category: cfg.master_category(),
            fresh_moments_if_missing: cfg.faults.has(Fault::MomentsNotSaved),
        };
        let world = cfg.parallel.world_size;
        let env = dev.execution_env();
        // Several ranks read their own rows of a sharded checkpoint; a loader that keeps the
        // saving plan's offsets (the fault) reads whole tensors, as that loader did.
        let reads = match world > 1 && !cfg.faults.has(Fault::MomentsAtSavedOffsets) {
            true => RankReads::open(checkpoint_dir, &req)?,
            false => None,
        };
        let (ranks, state, saved_world_size) = match reads {
            Some(reads) => {
                let moments = reads.moments.then_some(reads.state.optimizer_step);
                let ranks = placing.build(&cfg, &dev, Some(&reads), moments)?;
                let placed = |which, param| ranks.placed(which, param);
                match ranks.checkpoint_connections()? {
                    Some(comm) => reads.check_placed_as_rank(placed, comm)?,
                    None => reads.check_placed(placed)?,
                }
                (ranks, reads.state, reads.saved_world_size)
            }
            None => Self::load_whole(&cfg, &dev, checkpoint_dir, &req, placing)?,
        };
        let env_changes = state
            .environment
            .as_ref()
            .map(|saved| saved.changes(&env))
            .unwrap_or_default();
        let mut trainer = Self::assemble(cfg, ranks)?;
        trainer.env_changes = env_changes;
        trainer.saved_world_size = Some(saved_world_size);
        if trainer.cfg.faults.has(Fault::RngRestoredOnRankZeroOnly) {
            trainer.ranks.lose_rng_but_on_rank_zero(state.rng.offset);
        }
        if trainer.cfg.faults.has(Fault::OptimizerStateAllocatedAtLoad) {
            trainer.allocated_at_load = trainer.ranks.zeroed_moments_copy()?;
        }
        let faults = &trainer.cfg.faults;
        if !faults.has(Fault::LoaderPositionNotRestored) {
            let mut loader = state.loader;
            if faults.has(Fault::LoaderPositionPerRank) {
                let samples = trainer.loader.samples();
                let read = (loader.epoch * samples + loader.position)
                    * trainer.cfg.parallel.world_size as u64;
                loader.epoch = read / samples;
                loader.position = read % samples;
            }
            if faults.has(Fault::EpochSkippedAtBoundary)
                && loader.position >= trainer.loader.samples()
            {
                loader.epoch += 2;
                loader.position = 0;
            }
            trainer.loader.set_state(loader);
        }
        trainer.resumed_loader = Some(trainer.loader.state());
        trainer.rng = RngState {
            offset: if faults.has(Fault::RngNotRestored) {
                0
            } else {
                state.rng.offset
            },
            ..state.rng
        };
        trainer.step = state.global_step;
        trainer.resumed_at = state.global_step;
        Ok(trainer)
    }

    /// The ranks of `cfg` on `dev` from the checkpoint at `dir` read whole into host tensors
    /// (one device's checkpoint, or one rank), the checkpoint's trainer state and the ranks that
    /// saved it (1 for one device's layout): one rank uploaded here, several built from the host
    /// tensors as `placing` says.
    fn load_whole(
        cfg: &TrainConfig,
        dev: &D,
        dir: &Path,
        req: &LoadRequest<'_>,
        placing: Placing,
    ) -> Result<(Ranks<D>, TrainerState, usize)> {
        let loaded = checkpoint::load(&dev.host(), dir, req)?;
        let ranks = match cfg.parallel.world_size {
            1 => {
                let master = loaded.master.try_map(|t| dev.upload(t))?;
                let upload = |p: Params<_>| p.try_map(|t| dev.upload(t));
                let moments = match loaded.moments {
                    Some([exp_avg, exp_avg_sq]) => Some((
                        Moments {
                            exp_avg: upload(exp_avg)?,
                            exp_avg_sq: upload(exp_avg_sq)?,
                        },
                        loaded.state.optimizer_step,
                    )),
                    None => None,
                };
                Ranks::single(State::new(cfg, dev.clone(), master, moments)?)
            }
            world => {
                let mut moments = loaded.moments;
                if cfg.faults.has(Fault::MomentsAtSavedOffsets) {
                    for m in moments.iter_mut().flatten() {
                        misplace_rows(m, loaded.saved_world_size, world);
                    }
                }
                let host = HostTensors {
                    master: &loaded.master,
                    moments: moments.as_ref(),
                };
                let step = moments.as_ref().map(|_| loaded.state.optimizer_step);
                placing.build(cfg, dev, Some(&host), step)?
            }
        };
        Ok((ranks, loaded.state, loaded.saved_world_size))
    }

    /// Saves a checkpoint of the current state under `run_dir` (see [`checkpoint::save`]),
    /// keeping the newest `keep_last`; returns its directory. It writes straight from the
    /// tensors, staging nothing; call [`Trainer::finish_saves`] first when an asynchronous save
    /// into the same run directory may still be in flight.
    ///
    /// Where the ranks are processes of their own, every rank calls it at once with the same
    /// run directory, on a filesystem they share: each writes its own file and rank 0 commits
    /// the checkpoint (see [`checkpoint::save_as_rank`]).
    pub fn save(&self, run_dir: &Path, keep_last: Option<usize>) -> Result<PathBuf> {
        let req = SaveRequest {
            config: &self.cfg.model,
            tensors: self.checkpoint_tensors()?,
            state: self.trainer_state(),
        };
        write_checkpoint(
            run_dir,
            req,
            keep_last,
            self.ranks.checkpoint_connections()?,
        )
    }

    /// Saves a checkpoint of the current state under `run_dir` in the background, keeping the
    /// newest `keep_last`: finishes the save before it (see [`Trainer::finish_saves`]), copies
    /// every tensor of the checkpoint into host staging buffers counted under
    /// [`Category::Io`] on the host tracker ([`Device::host`]: the device's own on the CPU),
    /// hands them to a writer thread that runs [`checkpoint::save`] (temporary directory,
    /// fsync, rename, then `latest`), and returns. The checkpoint is complete, and its staging
    /// buffers freed, once the trainer joins the writer: at the end of the next step, at the
    /// next save, at [`Trainer::finish_saves`] or when the trainer is dropped. A crash before
    /// then leaves the previous checkpoint as `latest`. Where the ranks are processes of their
    /// own, the writer runs [`checkpoint::save_as_rank`] over the connections kept for saves,
    /// and every rank calls this and joins its writer at the same points.
    pub fn save_async(&mut self, run_dir: &Path, keep_last: Option<usize>) -> Result<()> {
        self.finish_saves()?;
        let state = self.trainer_state();
        if self.cfg.faults.has(Fault::AsyncSaveReadsLiveWeights) {
            self.pending = Some(PendingSave::Deferred {
                run_dir: run_dir.to_path_buf(),
                keep_last,
                state: Box::new(state),
            });
            return Ok(());
        }
        let tensors = self.checkpoint_tensors()?;
        let host = self.device().host();
        let staging = tensors
            .sizes()
            .into_iter()
            .map(|bytes| host.allocate(bytes, Category::Io))
            .collect::<std::result::Result<Vec<Lease>, _>>()?;
        let tensors = tensors.into_owned();
        let config = self.cfg.model.clone();
        let dir = run_dir.to_path_buf();
        let connections = self.ranks.take_checkpoint_connections()?;
        let writer = std::thread::Builder::new()
            .name("checkpoint-writer".into())
            .spawn(move || {
                let req = SaveRequest {
                    config: &config,
                    tensors,
                    state,
                };
                let comm = connections.as_ref().map(|c| c as &dyn Collective);
                (write_checkpoint(&dir, req, keep_last, comm), connections)
            })
            .map_err(|e| EngineError::io(run_dir, e))?;
        self.pending = Some(PendingSave::Writing { writer, staging });
        Ok(())
    }

    /// Waits for the asynchronous save in flight, if any, and frees its staging buffers;
    /// returns the checkpoint's directory (`None` when no save was in flight). A failed write
    /// returns the error a synchronous save would have.
    pub fn finish_saves(&mut self) -> Result<Option<PathBuf>> {
        match self.pending.take() {
            None => Ok(None),
            Some(PendingSave::Writing { writer, staging }) => {
                let (written, connections) = writer.join().unwrap_or_else(|_| {
                    let e = EngineError::Config(
                        "the checkpoint writer thread panicked; the checkpoint was not written and `latest` still names the one before".into(),
                    );
                    (Err(e), None)
                });
                drop(staging);
                if let Some(connections) = connections {
                    self.ranks.give_back_checkpoint_connections(connections);
                }
                written.map(Some)
            }
            Some(PendingSave::Deferred {
                run_dir,
                keep_last,
                state,
            }) => {
                let req = SaveRequest {
                    config: &self.cfg.model,
                    tensors: self.checkpoint_tensors()?,
                    state: *state,
                };
                let comm = self.ranks.checkpoint_connections()?;
                write_checkpoint(&run_dir, req, keep_last, comm).map(Some)
            }
        }
    }

    /// The bytes the staging buffers of the asynchronous save in flight hold (0 when none is).
    pub fn staging_bytes(&self) -> u64 {
        match &self.pending {
            Some(PendingSave::Writing { staging, .. }) => staging.iter().map(Lease::bytes).sum(),
            _ => 0,
        }
    }

    /// The tensors a checkpoint of the current state holds.
    fn checkpoint_tensors(&self) -> Result<Tensors<'_>> {
        let mut tensors = self.ranks.checkpoint_tensors()?;
        if self.cfg.faults.has(Fault::MomentsNotSaved) {
            tensors.without_moments();
        }
        Ok(tensors)
    }

    /// The `trainer_state.json` of a checkpoint of the current state, without its files.
    fn trainer_state(&self) -> TrainerState {
        let identity = self.identity.clone();
        TrainerState {
            format_version: FORMAT_VERSION,
            global_step: self.step,
            optimizer_step: self.ranks.first().optimizer_steps(),
            schedule: ScheduleState {
                schedule: self.cfg.schedule.clone(),
                peak_lr: self.cfg.optimizer.lr,
                next_lr: self.next_lr(),
            },
            loader: self.saved_loader_state(),
            rng: self.rng,
            fingerprint: checkpoint::fingerprint(&identity),
            identity,
            environment: Some(self.device().execution_env()),
            files: Default::default(),
        }
    }

    /// The loader position a checkpoint saves: where the loader stands, except that
    /// [`Fault::LoaderPositionCountsSteps`] counts one micro-batch per step taken and
    /// [`Fault::LoaderOffsetLostOnResave`] counts only the samples read since the resume and
    /// [`Fault::LoaderPositionPerRank`] one rank's share, and [`Fault::PackInFlightDropped`]
    /// leaves out the pack in flight.
    fn saved_loader_state(&self) -> LoaderState {
        let mut state = self.loader.state();
        if self.cfg.faults.has(Fault::PackInFlightDropped) {
            state.in_flight = None;
        }
        let samples = self.loader.samples();
        let faults = &self.cfg.faults;
        let world = self.cfg.parallel.world_size as u64;
        let read = match self.resumed_loader {
            _ if faults.has(Fault::LoaderPositionCountsSteps) => {
                self.step * self.cfg.batch_size as u64
            }
            _ if faults.has(Fault::LoaderPositionPerRank) => {
                (state.epoch * samples + state.position) / world
            }
            Some(from) if faults.has(Fault::LoaderOffsetLostOnResave) => {
                let at = |s: LoaderState| s.epoch * samples + s.position;
                at(state) - at(from)
            }
            _ => return state,
        };
        LoaderState {
            epoch: read / samples,
            position: read % samples,
            ..state
        }
    }

    /// The name of the first tensor of the checkpoint this trainer would save that holds a NaN
    /// or an infinity, in any rank's rows of it; where the ranks are processes of their own,
    /// every rank gets the same answer, and every rank must ask at once.
    pub fn non_finite_tensor(&self) -> Result<Option<String>> {
        self.ranks.non_finite_entry()
    }

    /// Digests of the weights, the optimizer state, the step, the next learning rate, the
    /// loader position and the dropout generator's state.
    pub fn state_digest(&self) -> Result<StateDigest> {
        let (model, optimizer) = self.ranks.checkpoint_entries()?;
        Ok(StateDigest {
            step: self.step,
            params: checkpoint::entries_digest(&model),
            optimizer: checkpoint::entries_digest(&optimizer),
            optimizer_steps: self.ranks.first().optimizer_steps(),
            next_lr: self.next_lr(),
            loader: self.loader.state(),
            rng: self.rng,
        })
    }

    fn next_lr(&self) -> f64 {
        let step = if self.cfg.faults.has(Fault::ScheduleReset) {
            self.step - self.resumed_at
        } else {
            self.step
        };
        self.cfg.schedule.lr(self.cfg.optimizer.lr, step)
    }

    /// How the execution environment recorded in the checkpoint this trainer resumed from
    /// differs from its device's, field by field. Empty for a fresh run, for a resume in the
    /// same environment, and for a checkpoint written before the environment was recorded. A
    /// difference is no error: the run continues, but not necessarily bit for bit.
    pub fn env_changes(&self) -> &[EnvChange] {
        &self.env_changes
    }

    /// The ranks that saved the checkpoint this trainer resumed from, where it was saved
    /// sharded; 1 for a checkpoint in one device's layout (whatever the ranks that saved it),
    /// `None` for a fresh run. A resume at another world size than a sharded checkpoint's cuts
    /// every tensor's rows anew for its ranks.
    pub fn saved_world_size(&self) -> Option<usize> {
        self.saved_world_size
    }

    /// The run's configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// The device the trainer computes on (rank 0's in a data-parallel run).
    pub fn device(&self) -> &D {
        self.ranks.first().device()
    }

    /// The tracker counting the device's bytes (rank 0's in a data-parallel run).
    pub fn tracker(&self) -> &MemoryTracker {
        self.ranks.first().device().tracker()
    }

    /// The tensors: weights, gradients and optimizer state (rank 0's in a data-parallel run).
    pub fn state(&self) -> &State<D> {
        self.ranks.first()
    }

    /// Every rank's tensors, in rank order (one for a run without data parallelism).
    pub fn ranks(&self) -> &[State<D>] {
        self.ranks.states()
    }

    /// Steps taken so far (the index of the next step).
    pub fn step_index(&self) -> u64 {
        self.step
    }

    /// The data loader.
    pub fn loader(&self) -> &DataLoader {
        &self.loader
    }

    /// One training step on the next `accumulation` batches (micro-batches); the dropout
    /// generator advances once per micro-batch. An asynchronous save in flight when it starts is
    /// finished at its end, before its figures are read: its staging buffers count in the
    /// step's peak, not in the bytes held at its end.
    pub fn step(&mut self) -> Result<StepStats> {
        let trackers = reset_trackers(&self.ranks);
        let seq = self.cfg.seq_len_at(self.step);
        let batches = self.loader.next_step(self.cfg.accumulation, seq)?;
        let dropout = (self.cfg.dropout > 0.0).then_some(Dropout {
            p: self.cfg.dropout,
            seed: self.rng.seed,
            offset: self.rng.offset,
        });
        let repeated = match self.cfg.faults.has(Fault::EvaluationRepeatedAtResume)
            && self.step == self.resumed_at
            && self.resumed_loader.is_some()
            && self.evaluation_due(self.step)
        {
            true => Some(self.evaluate()?),
            false => None,
        };
        trackers.iter().for_each(MemoryTracker::reset_peak);
        let lr = self.next_lr();
        let (pass, grad_norm) = self.ranks.train_step(&batches, dropout, lr)?;
        self.allocated_at_load.clear();
        self.finish_saves()?;
        let mut stats = StepStats {
            step: self.step,
            loss: pass.loss,
            lr,
            grad_norm,
            tokens: pass.tokens,
            batch_digest: Batch::digest_all(&batches),
            samples: self.loader.take_drawn(),
            seq_lens: batches.iter().map(|b| b.seq).collect(),
            recomputed_blocks: pass.recomputed_blocks,
            tokens_per_expert: pass.tokens_per_expert,
            memory: trackers[0].stats(),
            rank_memory: rank_memory(&trackers),
            evaluations: repeated.into_iter().collect(),
        };
        self.step += 1;
        self.rng.offset += self.cfg.accumulation as u64;
        if self.evaluation_due(self.step) {
            stats.evaluations.push(self.evaluate()?);
        }
        Ok(stats)
    }

    /// Whether the run evaluates its validation split after `steps` steps.
    fn evaluation_due(&self, steps: u64) -> bool {
        (self.cfg.validation.as_ref()).is_some_and(|v| v.due(steps))
    }

    /// Evaluates the validation split now ([`crate::validation`]): its loader reset, its
    /// micro-batches drawn and passed forward over the ranks, the loss summed in global order;
    /// the peak covers the evaluation only.
    pub fn evaluate(&mut self) -> Result<Evaluation> {
        let (Some(validation), Some(split)) = (&self.cfg.validation, &mut self.validation) else {
            return Err(EngineError::Config(
                "the run has no validation split to evaluate; write validation: {share: 0.1, every: N}".into(),
            ));
        };
        if !self.cfg.faults.has(Fault::ValidationLoaderNotReset) {
            split.set_state(LoaderState::default());
        }
        let rows = validation.rows(split.samples(), self.cfg.batch_size);
        let batches = (rows.into_iter())
            .map(|rows| split.next_rows(rows, self.cfg.seq_len))
            .collect::<Result<Vec<_>>>()?;
        let trackers = reset_trackers(&self.ranks);
        let passes = self.ranks.evaluate(&batches)?;
        let out = self.ranks.first().model().step_output(passes);
        Ok(Evaluation {
            step: self.step,
            loss: out.ce,
            tokens: out.tokens,
            batch_digest: Batch::digest_all(&batches),
            samples: split.take_drawn(),
            shapes: batches.iter().map(|b| (b.batch, b.seq)).collect(),
            memory: trackers[0].stats(),
            rank_memory: rank_memory(&trackers),
        })
    }
}

/// Every rank's tracker, in rank order, each with its peak reset: the figures of what follows.
fn reset_trackers<D: Device>(ranks: &Ranks<D>) -> Vec<MemoryTracker> {
    let trackers: Vec<MemoryTracker> = (ranks.states().iter())
        .map(|s| s.device().tracker().clone())
        .collect();
    trackers.iter().for_each(MemoryTracker::reset_peak);
    trackers
}

/// Every rank's figures from `trackers`, in rank order; none for one rank (its figures are the
/// run's own).
fn rank_memory(trackers: &[MemoryTracker]) -> Vec<MemoryStats> {
    match trackers.len() {
        1 => Vec::new(),
        _ => trackers.iter().map(MemoryTracker::stats).collect(),
    }
}

/// Where a run's ranks are built.
pub enum Placing {
    /// Every rank in this process.
    Here,
    /// Rank `rank` in this process, the others in processes of their own met through
    /// `meeting`.
    Rank {
        /// The rank this process trains.
        rank: usize,
        /// Where the ranks meet.
        meeting: Meeting,
    },
}

impl Placing {
    /// An error unless `cfg` can be built as this says: a rank of its own takes a world size of
    /// 2 or more and a rank below it.
    fn check(&self, cfg: &TrainConfig) -> Result<()> {
        let world = cfg.parallel.world_size;
        match *self {
            Placing::Rank { rank, .. } if world < 2 || rank >= world => Err(EngineError::Config(format!(
                "rank {rank} of a run of {world} ranks: a rank of its own takes a world_size of 2 or more and a rank below it"
            ))),
            _ => Ok(()),
        }
    }

    /// The ranks of `cfg` built as this says, each from its rows of `source` (with
    /// `moments_at`, the moments too): every rank on its device of `dev`'s [`Device::ranks`],
    /// or this process's rank on its share of `dev`.
    fn build<D: Device>(
        self,
        cfg: &TrainConfig,
        dev: &D,
        source: Option<&dyn RowSource>,
        moments_at: Option<u64>,
    ) -> Result<Ranks<D>> {
        match self {
            Placing::Here => {
                let devices = dev.ranks(cfg.parallel.world_size)?;
                Ranks::new(cfg, devices, source, moments_at)
            }
            Placing::Rank { rank, meeting } => {
                Ranks::of_process(cfg, dev.clone(), rank, meeting, source, moments_at)
            }
        }
    }
}

/// Writes the checkpoint `req` into `run_dir`, keeping the newest `keep_last`: on its own, or
/// where the ranks are processes of their own, with the others over `comm` (see
/// [`checkpoint::save_as_rank`]).
fn write_checkpoint(
    run_dir: &Path,
    req: SaveRequest<'_>,
    keep_last: Option<usize>,
    comm: Option<&dyn Collective>,
) -> Result<PathBuf> {
    match comm {
        Some(comm) => checkpoint::save_as_rank(run_dir, req, keep_last, comm),
        None => checkpoint::save(run_dir, req, keep_last),
    }
}

/// A fresh run's f32 weights on the host: drawn from `cfg.init`'s seed, or read from its
/// Hugging Face directory.
fn initial_weights<D: Device>(cfg: &TrainConfig, dev: &D) -> Result<Params<Tensor<f32>>> {
    let (host, category) = (dev.host(), cfg.master_category());
    Ok(match &cfg.init {
        Init::Random { seed, std } => {
            weights::init_params(&host, &cfg.model, *seed, *std, category)?
        }
        Init::HfDir { path } => weights::load_hf_dir(&host, path, category)?.1,
    })
}

/// Finishes an asynchronous save still in flight: its writer never outlives the trainer. Its
/// error, which nothing can return here, is written to stderr; call [`Trainer::finish_saves`]
/// before dropping a trainer to handle it.
impl<D: Device> Drop for Trainer<D> {
    fn drop(&mut self) {
        if let Err(e) = self.finish_saves() {
            eprintln!("error: the asynchronous checkpoint save failed: {e}");
        }
    }
}

/// [`Fault::MomentsAtSavedOffsets`]: every tensor of `p` rearranged so that the rows rank `r`
/// of `world` takes are the ones at rank `r` of `saved`'s offset (its own count of them, zeros
/// past the end): what a loader keeping the saving plan's offsets hands each rank.
fn misplace_rows(p: &mut Params<crate::tensor::Tensor<f32>>, saved: usize, world: usize) {
    for t in p.tensors_mut() {
        let shape = t.shape().to_vec();
        let (_, row) = crate::parallel::plan::shard_of(&shape, world, 0);
        let d0 = shape.first().copied().unwrap_or(1);
        let old = t.as_mut_slice().to_vec();
        let new = t.as_mut_slice();
        for rank in 0..world {
            let rows = crate::parallel::plan::rows(d0, world, rank);
            let from = crate::parallel::plan::rows(d0, saved, rank).start;
            for (i, dst) in rows.enumerate() {
                let src = from + i;
                let into = &mut new[dst * row..(dst + 1) * row];
                match old.get(src * row..(src + 1) * row) {
                    Some(bytes) => into.copy_from_slice(bytes),
                    None => into.fill(0.0),
                }
            }
        }
    }
}
