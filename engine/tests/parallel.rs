//! Data parallelism on CPU ranks: every world size and sharding stage trains the bits of one
//! rank (losses, gradient norms, batches, weights and optimizer state), a checkpoint resumes at
//! another world size bit for bit, each rank's memory is the counting ranks' to the byte, and
//! each data-parallel fault breaks exactly what it targets.

mod common;

use ckpt_engine::backend::count::{Like, Routes};
use ckpt_engine::checkpoint::{step_dir_name, STATE_FILE};
use ckpt_engine::config::Precision;
use ckpt_engine::estimate::{estimate, recorded_rank_steps, EstimateConfig, StepEstimate};
use ckpt_engine::model::loss::LossKind;
use ckpt_engine::model::Checkpointing;
use ckpt_engine::parallel::sockets::Meeting;
use ckpt_engine::parallel::source::{RowSource, Which};
use ckpt_engine::parallel::{Checkpoints, Parallel, Shard, Transport};
use ckpt_engine::ranks::Ranks;
use ckpt_engine::state::Weights;
use ckpt_engine::{
    Category, CpuDevice, EngineError, Fault, MemoryTracker, StateDigest, TrainConfig, Trainer,
};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A vocabulary that neither 3 nor 4 divides.
const VOCAB: usize = 37;

/// A Llama with grouped-query attention on 12 micro-batches a step, with dropout (so each
/// micro-batch's generator offset shows) and clipping.
fn dense(precision: Precision) -> TrainConfig {
    let mut cfg = common::train_config(common::llama(VOCAB, 16, 2), precision, 1, 8, 6);
    cfg.accumulation = 12;
    cfg.dropout = 0.1;
    cfg.optimizer.grad_clip = Some(0.5);
    cfg
}

/// [`dense`] as a Qwen3-MoE: 4 experts, top-2, with full checkpointing.
fn moe() -> TrainConfig {
    let mut cfg = dense(Precision::Fp32);
    cfg.model = common::qwen3_moe(cfg.model, 8);
    cfg.checkpointing = Checkpointing::Full;
    cfg
}

/// [`moe`] in `precision`.
fn moe_in(precision: Precision) -> TrainConfig {
    TrainConfig { precision, ..moe() }
}

/// [`dense`] with the LM head tied to the embedding.
fn tied(precision: Precision) -> TrainConfig {
    let mut cfg = dense(precision);
    cfg.model.tie_word_embeddings = true;
    cfg
}

fn with(cfg: &TrainConfig, world_size: usize, shard: Shard, faults: &[Fault]) -> TrainConfig {
    TrainConfig {
        parallel: Parallel {
            world_size,
            shard,
            ..Parallel::default()
        },
        faults: faults.iter().copied().collect(),
        ..cfg.clone()
    }
}

/// What a run shows of itself: each step's loss, gradient norm and batch (bits), and the state
/// at the end.
#[derive(Debug, PartialEq)]
struct Run {
    steps: Vec<(u32, u64, String)>,
    end: StateDigest,
}

fn run(cfg: &TrainConfig, steps: u64) -> Run {
    let mut t = Trainer::new(cfg.clone(), CpuDevice::new(4, u64::MAX).unwrap()).unwrap();
    trained(&mut t, steps)
}

/// What `t` shows of itself over `steps` steps.
fn trained(t: &mut Trainer<CpuDevice>, steps: u64) -> Run {
    let steps = (0..steps)
        .map(|_| {
            let s = t.step().unwrap();
            (s.loss.to_bits(), s.grad_norm.to_bits(), s.batch_digest)
        })
        .collect();
    Run {
        steps,
        end: t.state_digest().unwrap(),
    }
}

#[test]
fn every_world_size_and_stage_trains_the_bits_of_one_rank() {
    let cases = [
        ("dense fp32", dense(Precision::Fp32)),
        ("dense bf16-mixed", dense(Precision::Bf16Mixed)),
        ("tied fp32", tied(Precision::Fp32)),
        ("tied bf16-mixed", tied(Precision::Bf16Mixed)),
        ("qwen3-moe", moe()),
    ];
    each_stage_trains_the_bits_of_one_rank(&cases, 1..=4, 3, Transport::Channels);
}

/// Asserts that each of `cases`, at every world size of `worlds` and every stage over
/// `transport`, gives the per-step figures and final state of one rank in `steps` steps.
fn each_stage_trains_the_bits_of_one_rank(
    cases: &[(&str, TrainConfig)],
    worlds: std::ops::RangeInclusive<usize>,
    steps: u64,
    transport: Transport,
) {
    for (name, cfg) in cases {
        let one = run(cfg, steps);
        for world in worlds.clone() {
            for shard in [Shard::None, Shard::Optimizer, Shard::Gradients, Shard::Full] {
                let mut at = with(cfg, world, shard, &[]);
                at.parallel.transport = transport;
                assert_eq!(
                    run(&at, steps),
                    one,
                    "{name}, world size {world}, shard {shard:?}, {transport:?}"
                );
            }
        }
    }
}

#[test]
fn ranks_over_rendezvous_sends_train_the_bits_of_one_rank() {
    // Each send waits for the receive that takes it, as NCCL's do. The ring of `gradients` and
    // `full` hands a sum on before it receives the next, and an all-gather sends to every rank
    // before it receives: this holds because every rank keeps a receive posted for each peer.
    each_stage_trains_the_bits_of_one_rank(&transport_cases(), 2..=4, 2, Transport::Rendezvous);
}

/// The runs a transport other than channels is tried on: one of each precision, tied
/// embeddings and a mixture of experts.
fn transport_cases() -> [(&'static str, TrainConfig); 3] {
    [
        ("dense bf16-mixed", dense(Precision::Bf16Mixed)),
        ("tied fp32", tied(Precision::Fp32)),
        ("qwen3-moe", moe()),
    ]
}

#[test]
fn ranks_over_sockets_train_the_bits_of_one_rank() {
    // Every message is a frame on a TCP connection of its pair of ranks, as between ranks in
    // processes of their own: the same bits as over channels.
    each_stage_trains_the_bits_of_one_rank(&transport_cases(), 2..=4, 2, Transport::Sockets);
}

/// Set in a child process of [`ranks_in_processes_of_their_own_train_save_and_resume_as_one_process`]:
/// the case, the phase, the rank it runs, rank 0's address and the run directory.
const AS_RANK: &str = "CKPT_TEST_AS_RANK";

/// What a child rank prints before its run (on the line libtest began with the test's name).
const RUN_LINE: &str = "rank's run: ";

/// Steps each process's rank trains.
const PROCESS_STEPS: u64 = 3;

/// The runs split over processes: each stage, both precisions, tied embeddings and a mixture of
/// experts, world sizes 2 to 4, checkpoints sharded and gathered; each with the world size its
/// checkpoint resumes at.
fn process_cases() -> [(&'static str, TrainConfig, usize); 4] {
    let mut gathered = with(&dense(Precision::Fp32), 2, Shard::None, &[]);
    gathered.parallel.checkpoints = Checkpoints::Gathered;
    [
        (
            "dense bf16-mixed, 3 ranks, full",
            with(&dense(Precision::Bf16Mixed), 3, Shard::Full, &[]),
            2,
        ),
        (
            "qwen3-moe, 2 ranks, gradients",
            with(&moe(), 2, Shard::Gradients, &[]),
            4,
        ),
        (
            "tied fp32, 4 ranks, optimizer",
            with(&tied(Precision::Fp32), 4, Shard::Optimizer, &[]),
            3,
        ),
        ("dense fp32, 2 ranks, none, gathered", gathered, 3),
    ]
}

/// A phase of a run split over processes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// [`PROCESS_STEPS`] steps from the start, saved (see [`trained_and_saved`]).
    Train,
    /// The last step again, resumed at the case's other world size from the checkpoint before
    /// it.
    Resume,
}

/// A CPU device of one thread, as each rank of a run in one process has.
fn one_thread() -> CpuDevice {
    CpuDevice::new(1, u64::MAX).unwrap()
}

/// What rank `rank` of case `case` shows of itself in `phase`, run by this process, meeting the
/// other ranks' processes through `meeting`, in the run directory `dir`.
fn run_rank(case: usize, phase: Phase, rank: usize, meeting: Meeting, dir: &Path) -> Run {
    let (_, cfg, resume_world) = &process_cases()[case];
    match phase {
        Phase::Train => {
            let mut t = Trainer::new_rank(cfg.clone(), one_thread(), rank, meeting).unwrap();
            trained_and_saved(&mut t, dir)
        }
        Phase::Resume => {
            let mut cfg = cfg.clone();
            cfg.parallel.world_size = *resume_world;
            let from = dir.join(step_dir_name(PROCESS_STEPS - 1));
            let mut t = Trainer::resume_rank(cfg, one_thread(), rank, meeting, &from).unwrap();
            trained(&mut t, 1)
        }
    }
}

/// What `t` shows of itself over [`PROCESS_STEPS`] steps, saved into `dir` in the background
/// before its last step (the step joins the save) and at the end.
fn trained_and_saved(t: &mut Trainer<CpuDevice>, dir: &Path) -> Run {
    let before = trained(t, PROCESS_STEPS - 1);
    t.save_async(dir, None).unwrap();
    let last = trained(t, 1);
    let saved = t.save(dir, None).unwrap();
    assert_eq!(saved, dir.join(step_dir_name(PROCESS_STEPS)));
    Run {
        steps: [before.steps, last.steps].concat(),
        end: last.end,
    }
}

/// Every file of the run directory `dir` (its checkpoints' files under their directory's
/// name), by path.
fn files_of(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            for (inner, bytes) in files_of(&path) {
                files.insert(format!("{name}/{inner}"), bytes);
            }
        } else {
            files.insert(name, std::fs::read(&path).unwrap());
        }
    }
    files
}

/// Runs `phase` of case `case` on `world` ranks in the run directory `dir`, this process rank 0
/// and this test's binary started again as each other rank, and asserts that every rank shows
/// `want`.
fn in_processes(case: usize, phase: Phase, world: usize, dir: &Path, want: &Run) {
    let name = process_cases()[case].0;
    let this = std::env::current_exe().unwrap();
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let at = listener.local_addr().unwrap();
    let children: Vec<Child> = (1..world)
        .map(|rank| {
            Command::new(&this)
                .args([
                    "--exact",
                    "ranks_in_processes_of_their_own_train_save_and_resume_as_one_process",
                ])
                .args(["--nocapture", "--test-threads=1"])
                .env(
                    AS_RANK,
                    format!("{case} {phase:?} {rank} {at} {}", dir.display()),
                )
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let zero = run_rank(case, phase, 0, Meeting::Host(listener), dir);
    assert_eq!(&zero, want, "{name}, {phase:?}: rank 0");
    for (rank, child) in (1..).zip(children) {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{name}, {phase:?}: rank {rank}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = (stdout.lines()).find_map(|l| l.split_once(RUN_LINE).map(|(_, run)| run));
        assert_eq!(
            line,
            Some(format!("{want:?}").as_str()),
            "{name}, {phase:?}: rank {rank}"
        );
    }
}

#[test]
fn ranks_in_processes_of_their_own_train_save_and_resume_as_one_process() {
    // This test's own binary, started again with AS_RANK set, is each rank but 0: a process of
    // its own, meeting rank 0 (this process) over TCP.
    if let Ok(spec) = std::env::var(AS_RANK) {
        let [case, phase, rank, at, dir]: [&str; 5] =
            spec.splitn(5, ' ').collect::<Vec<_>>().try_into().unwrap();
        let phase = [Phase::Train, Phase::Resume]
            .into_iter()
            .find(|p| format!("{p:?}") == phase)
            .unwrap();
        let meeting = Meeting::At(at.parse().unwrap());
        let run = run_rank(
            case.parse().unwrap(),
            phase,
            rank.parse().unwrap(),
            meeting,
            Path::new(dir),
        );
        println!("{RUN_LINE}{run:?}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for (case, (name, cfg, resume_world)) in process_cases().iter().enumerate() {
        let one = run(&with(cfg, 1, Shard::None, &[]), PROCESS_STEPS);
        let dir = tmp.path().join(format!("processes-{case}"));
        std::fs::create_dir(&dir).unwrap();
        in_processes(case, Phase::Train, cfg.parallel.world_size, &dir, &one);

        // The same ranks in one process save the same files, byte for byte.
        let in_one = tmp.path().join(format!("one-process-{case}"));
        let mut t = Trainer::new(cfg.clone(), one_thread()).unwrap();
        trained_and_saved(&mut t, &in_one);
        let (theirs, ours) = (files_of(&dir), files_of(&in_one));
        let before = format!("{}/{STATE_FILE}", step_dir_name(PROCESS_STEPS - 1));
        assert!(ours.contains_key(&before), "{name}");
        let names = |files: &BTreeMap<String, Vec<u8>>| files.keys().cloned().collect::<Vec<_>>();
        assert_eq!(names(&theirs), names(&ours), "{name}");
        for (file, bytes) in &theirs {
            assert!(bytes == &ours[file], "{name}: {file} differs");
        }

        // Resumed at another world size, the last step again, with one device's bits.
        let last = Run {
            steps: one.steps[PROCESS_STEPS as usize - 1..].to_vec(),
            end: one.end.clone(),
        };
        in_processes(case, Phase::Resume, *resume_world, &dir, &last);
    }
}

/// Ranks 0 and 1 of `cfg`, each in a thread of this process, meeting over TCP.
fn two_ranks(cfg: &TrainConfig) -> [Trainer<CpuDevice>; 2] {
    two_ranks_made(|rank, meeting| Trainer::new_rank(cfg.clone(), one_thread(), rank, meeting))
        .map(Result::unwrap)
}

/// Ranks 0 and 1 as `make` builds each (given its rank and meeting), each in a thread of this
/// process, meeting over TCP.
fn two_ranks_made(
    make: impl Fn(usize, Meeting) -> ckpt_engine::Result<Trainer<CpuDevice>> + Sync,
) -> [ckpt_engine::Result<Trainer<CpuDevice>>; 2] {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let at = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let other = s.spawn(|| make(1, Meeting::At(at)));
        let zero = make(0, Meeting::Host(listener));
        [zero, other.join().unwrap()]
    })
}

#[test]
fn ranks_of_their_own_resume_only_tensors_whose_whole_hash_holds() {
    let cfg = with(&dense(Precision::Bf16Mixed), 2, Shard::Full, &[]);
    let mut ranks = two_ranks(&cfg);
    // Each process's rank has the share of the run's device a rank in one process has.
    let in_one = Trainer::new(cfg.clone(), one_thread()).unwrap();
    for (rank, t) in ranks.iter().enumerate() {
        let capacity = |t: &Trainer<CpuDevice>| t.tracker().stats().capacity;
        assert_eq!(
            capacity(t),
            in_one.ranks()[rank].device().tracker().stats().capacity
        );
        assert_eq!(capacity(t), u64::MAX / 2);
    }
    let run = tempfile::tempdir().unwrap();
    for stepped in at_once(&mut ranks, |t, _| t.step()) {
        stepped.unwrap();
    }
    let saved = at_once(&mut ranks, |t, _| t.save(run.path(), None)).map(Result::unwrap);
    drop(ranks);
    let resume =
        |rank, meeting| Trainer::resume_rank(cfg.clone(), one_thread(), rank, meeting, &saved[0]);
    for resumed in two_ranks_made(resume) {
        resumed.unwrap();
    }

    // A byte of rank 1's file changed: rank 0 finds the whole hash wrong, names the chunk, and
    // both ranks stop with its error.
    let file = saved[0].join("rank-00001-of-00002.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let [zero, one] = two_ranks_made(resume).map(|r| r.err().unwrap().to_string());
    assert_eq!(zero, one);
    assert!(
        zero.contains("rank-00001-of-00002.safetensors: checksum mismatch: the chunk of")
            && zero.contains("does not match its hash"),
        "{zero}"
    );
}

/// Both ranks' `act`, run at once (each in a thread).
fn at_once<T: Send>(
    ranks: &mut [Trainer<CpuDevice>; 2],
    act: impl Fn(&mut Trainer<CpuDevice>, usize) -> T + Sync,
) -> [T; 2] {
    let [zero, one] = ranks;
    std::thread::scope(|s| {
        let other = s.spawn(|| act(one, 1));
        [act(zero, 0), other.join().unwrap()]
    })
}

#[test]
fn a_save_that_fails_on_any_rank_fails_on_every_rank_and_latest_stays() {
    let cfg = with(&dense(Precision::Fp32), 2, Shard::Optimizer, &[]);
    let mut ranks = two_ranks(&cfg);
    let tmp = tempfile::tempdir().unwrap();
    let (run, elsewhere) = (tmp.path().join("run"), tmp.path().join("elsewhere"));
    std::fs::create_dir(&run).unwrap();
    std::fs::create_dir(&elsewhere).unwrap();
    for stepped in at_once(&mut ranks, |t, _| t.step()) {
        stepped.unwrap();
    }
    for saved in at_once(&mut ranks, |t, _| t.save(&run, None)) {
        saved.unwrap();
    }
    let first = files_of(&run);
    assert!(first.contains_key("step-00000001/shards.json"), "{first:?}");

    // Rank 1 is given a run directory where rank 0's temporary directory is not.
    for stepped in at_once(&mut ranks, |t, _| t.step()) {
        stepped.unwrap();
    }
    let [zero, one] = at_once(&mut ranks, |t, rank| {
        t.save(if rank == 0 { &run } else { &elsewhere }, None)
    })
    .map(|saved| saved.unwrap_err().to_string());
    for e in [&zero, &one] {
        assert!(
            e.contains("rank 1: it does not see rank 0's temporary directory")
                && e.contains("give every rank the same run directory"),
            "{e}"
        );
        assert!(
            e.contains("still names step-00000001, the previous checkpoint"),
            "{e}"
        );
    }
    assert!(
        one.starts_with("rank 1: rank 0 stopped the save: saving step 2"),
        "{one}"
    );
    assert_eq!(files_of(&run), first, "nothing of the failed save is left");

    // In the background too: the ranks learn it when the save is joined.
    for begun in at_once(&mut ranks, |t, rank| {
        t.save_async(if rank == 0 { &run } else { &elsewhere }, None)
    }) {
        begun.unwrap();
    }
    for e in at_once(&mut ranks, |t, _| t.finish_saves()).map(|f| f.unwrap_err().to_string()) {
        assert!(
            e.contains("rank 1: it does not see rank 0's temporary directory"),
            "{e}"
        );
    }
    assert_eq!(files_of(&run), first, "nothing of the failed save is left");

    // A rank that stops fails its peer's save, and the ranks' next step.
    let [mut zero, one] = ranks;
    drop(one);
    let e = zero.save(&run, None).unwrap_err().to_string();
    assert!(
        e.contains("rank 0: rank 1 stopped before the exchange finished"),
        "{e}"
    );
    assert_eq!(files_of(&run), first, "nothing of the failed save is left");
    let e = zero.step().unwrap_err();
    assert!(
        matches!(e, EngineError::PeerStopped { rank: 0, peer: 1 }),
        "{e}"
    );
    let e = zero.step().unwrap_err().to_string();
    assert!(e.contains("closed by an earlier failure"), "{e}");
    let e = Trainer::new_rank(
        with(&cfg, 1, Shard::None, &[]),
        one_thread(),
        0,
        Meeting::At("127.0.0.1:9".parse().unwrap()),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("a rank of its own takes a world_size of 2 or more"),
        "{e}"
    );
    let e = Trainer::resume_rank(
        with(&cfg, 2, Shard::None, &[]),
        one_thread(),
        2,
        Meeting::At("127.0.0.1:9".parse().unwrap()),
        &run,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("rank 2 of a run of 2 ranks"), "{e}");
}

#[test]
fn a_checkpoint_resumes_at_another_world_size_bit_for_bit() {
    let cases = [
        ((4, Shard::Optimizer), (3, Shard::Optimizer)),
        ((3, Shard::Optimizer), (2, Shard::None)),
        ((1, Shard::None), (4, Shard::Optimizer)),
        ((4, Shard::Optimizer), (1, Shard::None)),
        ((4, Shard::Gradients), (3, Shard::Gradients)),
        ((2, Shard::Gradients), (4, Shard::Optimizer)),
        ((4, Shard::Full), (3, Shard::Full)),
        ((3, Shard::Full), (1, Shard::None)),
        ((1, Shard::None), (2, Shard::Full)),
    ];
    resumes_bit_for_bit(&dense(Precision::Bf16Mixed), &cases);
}

/// Tied embeddings under full sharding save and resume across world sizes and stages with the
/// bits of one rank, in both precisions.
#[test]
fn tied_embeddings_fully_sharded_resume_at_another_world_size_bit_for_bit() {
    let cases = [
        ((4, Shard::Full), (3, Shard::Full)),
        ((2, Shard::Full), (1, Shard::None)),
        ((1, Shard::None), (3, Shard::Full)),
        ((3, Shard::Full), (4, Shard::Gradients)),
    ];
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        resumes_bit_for_bit(&tied(precision), &cases);
    }
}

/// A world size and the sharding stage of its ranks.
type World = (usize, Shard);

/// `cfg` trained two steps at each case's first world size and stage, saved in each layout and
/// resumed for two more at the second: the bits of four steps on one rank.
fn resumes_bit_for_bit(cfg: &TrainConfig, cases: &[(World, World)]) {
    let whole = run(cfg, 4);
    let layouts = [Checkpoints::Sharded, Checkpoints::Gathered];
    for ((saved_at, resumed_at), layout) in cases.iter().flat_map(|&c| layouts.map(|l| (c, l))) {
        let dir = tempfile::tempdir().unwrap();
        let dev = || CpuDevice::new(4, u64::MAX).unwrap();
        let mut first = with(cfg, saved_at.0, saved_at.1, &[]);
        first.parallel.checkpoints = layout;
        let mut t = Trainer::new(first, dev()).unwrap();
        let mut steps = Vec::new();
        for _ in 0..2 {
            let s = t.step().unwrap();
            steps.push((s.loss.to_bits(), s.grad_norm.to_bits(), s.batch_digest));
        }
        t.save(dir.path(), None).unwrap();
        drop(t);
        let second = with(cfg, resumed_at.0, resumed_at.1, &[]);
        let mut t = Trainer::resume(second, dev(), dir.path()).unwrap();
        for _ in 0..2 {
            let s = t.step().unwrap();
            steps.push((s.loss.to_bits(), s.grad_norm.to_bits(), s.batch_digest));
        }
        let resumed = Run {
            steps,
            end: t.state_digest().unwrap(),
        };
        assert_eq!(
            resumed, whole,
            "{:?}, tied {}: saved at {saved_at:?} ({layout:?}), resumed at {resumed_at:?}",
            cfg.precision, cfg.model.tie_word_embeddings
        );
    }
}

/// The moments of a rank with sharded optimizer state hold its rows only: the 37-row embedding
/// over 4 ranks is 10, 10, 10 and 7 rows.
#[test]
fn sharded_moments_hold_each_rank_s_rows_only() {
    let cfg = with(&dense(Precision::Fp32), 4, Shard::Optimizer, &[]);
    let mut t = Trainer::new(cfg, CpuDevice::new(4, u64::MAX).unwrap()).unwrap();
    t.step().unwrap();
    let rows: Vec<usize> = t
        .ranks()
        .iter()
        .map(|s| s.optimizer().moments().unwrap().exp_avg.tensors()[0].shape()[0])
        .collect();
    assert_eq!(rows, [10, 10, 10, 7]);
    let (_, optimizer) = t.state().checkpoint_entries().unwrap();
    assert_eq!(
        optimizer[0].shape,
        [10, 16],
        "rank 0's own entries are its shard"
    );
}

/// Each data-parallel fault leaves one rank's run alone and changes the bits at the world sizes
/// where it acts; a fault that only moves the sharded update leaves the losses of the step
/// before the update it spoils alone.
#[test]
fn each_data_parallel_fault_changes_the_bits_where_it_acts() {
    let cfg = dense(Precision::Fp32);
    let one = run(&cfg, 2);
    for (fault, shard) in [
        (Fault::GradientsSummedByRank, Shard::None),
        (Fault::MicroBatchesStrided, Shard::None),
        (Fault::ShardBoundaryOffByOne, Shard::Optimizer),
    ] {
        assert_eq!(
            run(&with(&cfg, 1, shard, &[fault]), 2),
            one,
            "{fault:?} at one rank"
        );
        let faulty = run(&with(&cfg, 3, shard, &[fault]), 2);
        assert_ne!(faulty.end.params, one.end.params, "{fault:?}: weights");
        assert_eq!(
            faulty.steps[0].2, one.steps[0].2,
            "{fault:?}: the same data"
        );
        match fault {
            Fault::ShardBoundaryOffByOne => {
                assert_eq!(
                    faulty.steps[0], one.steps[0],
                    "the first step's loss and norm"
                );
                assert_ne!(
                    faulty.steps[1].0, one.steps[1].0,
                    "the loss after the update"
                );
            }
            _ => assert_ne!(
                faulty.steps[0].1, one.steps[0].1,
                "{fault:?}: the first norm"
            ),
        }
    }
}

/// `only_rank_zero_experts_saved`: a Qwen3-MoE saved sharded on 4 ranks holds rank 0's expert
/// (4 experts, one a rank) in every expert's place, weights and moments, so a resume on 2 ranks
/// starts elsewhere than the saved trainer stood; one rank's save and a gathered save are
/// untouched, and the saving trainer's own state is too.
#[test]
fn only_rank_zero_s_experts_saved_replaces_the_other_ranks_experts() {
    let mut cfg = moe_in(Precision::Fp32);
    cfg.dropout = 0.0;
    let dev = || CpuDevice::new(4, u64::MAX).unwrap();
    for (world, layout, harmed) in [
        (1, Checkpoints::Sharded, false),
        (4, Checkpoints::Gathered, false),
        (4, Checkpoints::Sharded, true),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut saving = with(&cfg, world, Shard::Full, &[Fault::OnlyRankZeroExpertsSaved]);
        saving.parallel.checkpoints = layout;
        let mut t = Trainer::new(saving, dev()).unwrap();
        t.step().unwrap();
        let saved = t.state_digest().unwrap();
        t.save(dir.path(), None).unwrap();
        assert_eq!(t.state_digest().unwrap(), saved, "the trainer's own state");
        drop(t);
        let resumed = Trainer::resume(with(&cfg, 2, Shard::Full, &[]), dev(), dir.path())
            .unwrap()
            .state_digest()
            .unwrap();
        let at = format!("world {world}, {layout:?}");
        assert_eq!(resumed.params != saved.params, harmed, "{at}: weights");
        assert_eq!(
            resumed.optimizer != saved.optimizer,
            harmed,
            "{at}: moments"
        );
        assert_eq!(resumed.loader, saved.loader, "{at}: the data");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Each rank's memory in the first two steps on the CPU equals the estimate's for that rank
    /// (the same step run on counting ranks): the bytes at the start, the peak, the bytes at
    /// the peak by category, each category's peak and the bytes at the end; and an asynchronous
    /// save stages what the estimate says.
    #[test]
    fn each_rank_s_memory_equals_the_estimate(
        world in prop::sample::select(vec![1usize, 2, 3, 4, 6]),
        shard in prop::sample::select(vec![Shard::None, Shard::Optimizer, Shard::Gradients, Shard::Full]),
        bf16 in any::<bool>(),
        full_checkpointing in any::<bool>(),
        vocab in 17usize..41,
        threads in 1usize..5,
        tied_head in any::<bool>(),
        experts in any::<bool>(),
    ) {
        let precision = if bf16 { Precision::Bf16Mixed } else { Precision::Fp32 };
        let base = if experts { moe_in(precision) } else { dense(precision) };
        let mut cfg = with(&base, world, shard, &[]);
        cfg.model.vocab_size = vocab;
        cfg.model.tie_word_embeddings = tied_head;
        cfg.dropout = 0.0;
        cfg.checkpointing = match full_checkpointing {
            true => Checkpointing::Full,
            false => Checkpointing::None,
        };
        let cpu = CpuDevice::new(threads, u64::MAX).unwrap();
        let model = EstimateConfig::from_train(&cfg, Like::Cpu { threads: cpu.threads() });
        let est = estimate(&model).unwrap();
        let run_wide: Vec<[StepEstimate; 2]> = match est.ranks.is_empty() {
            true => vec![[est.first_step.clone(), est.later_step.clone()]],
            false => est.ranks.clone(),
        };
        prop_assert_eq!(run_wide.len(), world);
        let mut t = Trainer::new(cfg.clone(), cpu).unwrap();
        let trackers: Vec<MemoryTracker> =
            t.ranks().iter().map(|s| s.device().tracker().clone()).collect();
        for step in 0..2 {
            let start: Vec<_> = trackers.iter().map(|t| t.stats().current).collect();
            let stats = t.step().unwrap();
            // A MoE step is held to each rank's estimate at the routing it recorded.
            let want = match stats.tokens_per_expert.is_empty() {
                true => run_wide.clone(),
                false => {
                    let routes = Routes::Recorded(stats.tokens_per_expert.clone());
                    recorded_rank_steps(&model.clone().with_routes(routes), cfg.seq_len).unwrap()
                }
            };
            prop_assert_eq!(want.len(), world);
            let got = match stats.rank_memory.is_empty() {
                true => vec![stats.memory],
                false => stats.rank_memory,
            };
            for (rank, (got, want)) in got.iter().zip(&want).enumerate() {
                let want = &want[step];
                let at = format!("{precision:?}, experts {experts}, tied {tied_head}, world {world}, {shard:?}, step {step}, rank {rank}");
                prop_assert_eq!(start[rank], want.start, "{}: start", at);
                prop_assert_eq!(got.allocated.peak, want.peak, "{}: peak", at);
                prop_assert_eq!(got.at_peak, want.at_peak, "{}: at the peak", at);
                prop_assert_eq!(got.peak_by_category, want.peak_by_category, "{}", at);
                prop_assert_eq!(got.current, want.end, "{}: at the end", at);
            }
        }
        let dir = tempfile::tempdir().unwrap();
        t.save_async(dir.path(), None).unwrap();
        prop_assert_eq!(t.staging_bytes(), est.save_staging);
        t.finish_saves().unwrap();
    }
}

/// A Qwen3-MoE on 2, 3 and 4 ranks at every stage, in both precisions: each rank's memory in
/// each step is its estimate at the routing of the micro-batches it trained (which micro-batches
/// those are depends on the stage), to the byte. Its experts are wide enough that the ranks'
/// backward passes peak unlike each other, so one rank's estimate would not do for all.
#[test]
fn each_rank_of_a_moe_step_holds_its_own_routing_s_estimate() {
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        for world in [2, 3, 4] {
            for shard in [Shard::None, Shard::Optimizer, Shard::Gradients, Shard::Full] {
                let mut cfg = with(&moe_in(precision), world, shard, &[]);
                cfg.dropout = 0.0;
                // Rows enough that the busiest expert's differ from rank to rank, and experts
                // wide enough that its recomputed buffers make a backward pass's peak.
                (cfg.batch_size, cfg.seq_len) = (2, 16);
                if let Some(moe) = &mut cfg.model.moe {
                    moe.moe_intermediate_size = 256;
                }
                let cpu = CpuDevice::new(2, u64::MAX).unwrap();
                let model = EstimateConfig::from_train(
                    &cfg,
                    Like::Cpu {
                        threads: cpu.threads(),
                    },
                );
                let mut t = Trainer::new(cfg.clone(), cpu).unwrap();
                let trackers: Vec<MemoryTracker> = t
                    .ranks()
                    .iter()
                    .map(|s| s.device().tracker().clone())
                    .collect();
                let mut distinct = false;
                for step in 0..2 {
                    let start: Vec<_> = trackers.iter().map(|t| t.stats().current).collect();
                    let stats = t.step().unwrap();
                    let routes = Routes::Recorded(stats.tokens_per_expert.clone());
                    let want = recorded_rank_steps(&model.clone().with_routes(routes), cfg.seq_len)
                        .unwrap();
                    assert_eq!(want.len(), world);
                    let backward = |w: &[StepEstimate; 2]| w[step].phases.backward;
                    distinct |= want.iter().any(|w| backward(w) != backward(&want[0]));
                    for (rank, got) in stats.rank_memory.iter().enumerate() {
                        let want = &want[rank][step];
                        let at = format!(
                            "{precision:?}, world {world}, {shard:?}, step {step}, rank {rank}"
                        );
                        assert_eq!(start[rank], want.start, "{at}: start");
                        assert_eq!(got.allocated.peak, want.peak, "{at}: peak");
                        assert_eq!(got.at_peak, want.at_peak, "{at}: at the peak");
                        assert_eq!(got.peak_by_category, want.peak_by_category, "{at}");
                        assert_eq!(got.current, want.end, "{at}: at the end");
                    }
                }
                assert!(distinct, "{precision:?}, world {world}, {shard:?}: the ranks' backward passes peak alike");
            }
        }
    }
}

/// Sharding the optimizer state splits each rank's moments (and bf16-mixed master weights) by
/// rows: every rank holds less than one rank does, and together exactly what one rank holds.
#[test]
fn sharded_optimizer_state_takes_less_memory_on_every_rank() {
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        let cfg = dense(precision);
        let optimizer_bytes = |cfg: TrainConfig| held_after_a_step(cfg, Category::Optimizer);
        let one = optimizer_bytes(cfg.clone())[0];
        let none = optimizer_bytes(with(&cfg, 4, Shard::None, &[]));
        assert!(
            none.iter().all(|&b| b == one),
            "{precision:?}: {none:?} vs {one}"
        );
        let sharded = optimizer_bytes(with(&cfg, 4, Shard::Optimizer, &[]));
        assert!(
            sharded.iter().all(|&b| b < one / 3),
            "{precision:?}: {sharded:?} vs {one}"
        );
        assert_eq!(
            sharded.iter().sum::<u64>(),
            one,
            "{precision:?}: the shards tile"
        );
    }
}

#[test]
fn a_world_size_that_does_not_divide_the_micro_batches_is_refused_with_both_numbers() {
    let cpu = CpuDevice::new(1, u64::MAX).unwrap();
    for (world, want) in [(5, "world_size is 5"), (0, "world_size is 0")] {
        let cfg = with(&dense(Precision::Fp32), world, Shard::None, &[]);
        let e = Trainer::new(cfg, cpu.clone())
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains(want), "{e}");
        if world == 5 {
            assert!(e.contains("12 micro-batches"), "{e}");
        }
    }
}

/// Sharding the gradients leaves each rank its rows of every gradient between steps, where the
/// other stages keep them whole: together the ranks hold one rank's gradient bytes.
#[test]
fn sharded_gradients_hold_each_rank_s_rows_between_steps() {
    let cfg = dense(Precision::Bf16Mixed);
    let grad_bytes = |cfg: TrainConfig| held_after_a_step(cfg, Category::Grads);
    let one = grad_bytes(cfg.clone())[0];
    let optimizer = grad_bytes(with(&cfg, 3, Shard::Optimizer, &[]));
    assert!(
        optimizer.iter().all(|&b| b == one),
        "{optimizer:?} vs {one}"
    );
    let sharded = grad_bytes(with(&cfg, 3, Shard::Gradients, &[]));
    assert!(sharded.iter().all(|&b| b < one / 2), "{sharded:?} vs {one}");
    assert_eq!(sharded.iter().sum::<u64>(), one, "the shards tile");
}

/// Full sharding leaves each rank its rows of every weight between steps, where the other
/// stages keep them whole: together the ranks hold one rank's weights, plus the rotary tables
/// (counted as params) that every rank keeps whole.
#[test]
fn fully_sharded_weights_hold_each_rank_s_rows_between_steps() {
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        let cfg = dense(precision);
        let param_bytes = |cfg: TrainConfig| held_after_a_step(cfg, Category::Params);
        let one = param_bytes(cfg.clone())[0];
        let full = param_bytes(with(&cfg, 3, Shard::Full, &[]));
        assert!(
            full.iter().all(|&b| b < one / 2),
            "{precision:?}: {full:?} vs {one}"
        );
        let gradients = param_bytes(with(&cfg, 3, Shard::Gradients, &[]));
        assert!(
            gradients.iter().all(|&b| b == one),
            "{precision:?}: {gradients:?}"
        );
        let sum: u64 = full.iter().sum();
        assert!(
            sum > one && sum < one + one / 2,
            "{precision:?}: {sum} vs {one}"
        );
    }
}

/// Full sharding takes tied embeddings on several ranks: the head's gradient, added after the
/// blocks' from logits computed again chunk by chunk, has the bits of one rank's, with the
/// chunked loss and full checkpointing at every world size.
#[test]
fn full_sharding_trains_tied_embeddings_with_the_chunked_loss_to_the_bits_of_one_rank() {
    let mut cfg = tied(Precision::Bf16Mixed);
    cfg.loss = LossKind::Chunked { chunk_tokens: 3 };
    cfg.checkpointing = Checkpointing::Full;
    let one = run(&cfg, 2);
    for world in 2..=4 {
        let full = with(&cfg, world, Shard::Full, &[]);
        full.validate().unwrap();
        assert_eq!(run(&full, 2), one, "world size {world}");
    }
}

/// Each rank's bytes of `category` after the first step of `cfg` (one device's, for one rank).
fn held_after_a_step(cfg: TrainConfig, category: Category) -> Vec<u64> {
    let mut t = Trainer::new(cfg, CpuDevice::new(4, u64::MAX).unwrap()).unwrap();
    let s = t.step().unwrap();
    let ranks = match s.rank_memory.is_empty() {
        true => vec![s.memory],
        false => s.rank_memory,
    };
    ranks.iter().map(|m| m.current.get(category)).collect()
}

/// Rows of every whole tensor made up from their place, counting the bytes each kind is read.
#[derive(Default)]
struct CountedRows {
    read: [std::sync::atomic::AtomicU64; 3],
}

impl CountedRows {
    /// The value of element `at` of row `row` of parameter `param`'s `which` tensor.
    fn value(which: Which, param: usize, row: usize, at: usize) -> f32 {
        (which as usize * 7 + param * 3) as f32 + row as f32 * 0.37 + at as f32 * 0.0013
    }
}

impl RowSource for CountedRows {
    fn read_rows(
        &self,
        which: Which,
        param: usize,
        rows: std::ops::Range<usize>,
        _keep: std::ops::Range<usize>,
        dst: &mut [u8],
    ) -> ckpt_engine::Result<()> {
        self.read[which as usize].fetch_add(dst.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let values: &mut [f32] = bytemuck::cast_slice_mut(dst);
        let row = values.len() / rows.len().max(1);
        for (r, chunk) in rows.zip(values.chunks_mut(row.max(1))) {
            for (at, v) in chunk.iter_mut().enumerate() {
                *v = Self::value(which, param, r, at);
            }
        }
        Ok(())
    }
}

/// Under bf16-mixed, each rank reads each row of the master weights it needs once: fully
/// sharded, or not sharded, its master rows, which the compute weights are rounded from; with
/// the optimizer state or the gradients sharded, the compute weights' whole rows, which its
/// master rows are copied out of.
#[test]
fn bf16_mixed_ranks_read_their_master_rows_once() {
    let cfg = dense(Precision::Bf16Mixed);
    let specs = ckpt_engine::model::param_specs(&cfg.model);
    let whole: u64 = specs
        .iter()
        .map(|s| 4 * s.shape.iter().product::<usize>() as u64)
        .sum();
    for (shard, master_reads) in [
        (Shard::Full, whole),
        (Shard::None, 3 * whole),
        (Shard::Optimizer, 3 * whole),
        (Shard::Gradients, 3 * whole),
    ] {
        let cfg = with(&cfg, 3, shard, &[]);
        let source = CountedRows::default();
        let devices = (0..3)
            .map(|_| CpuDevice::new(1, u64::MAX).unwrap())
            .collect();
        let ranks = Ranks::new(&cfg, devices, Some(&source), None).unwrap();
        let read = source.read[Which::Master as usize].load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(read, master_reads, "{shard:?}: bytes of master rows read");
        for (rank, state) in ranks.states().iter().enumerate() {
            let Weights::Bf16Mixed { master, compute } = state.weights() else {
                panic!("{shard:?}: rank {rank} is not bf16-mixed");
            };
            for (i, (m, c)) in master
                .tensors()
                .into_iter()
                .zip(compute.tensors())
                .enumerate()
            {
                let m = m.as_slice();
                let c = c.as_slice();
                if matches!(shard, Shard::Full | Shard::None) {
                    let rounded: Vec<half::bf16> =
                        m.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    assert_eq!(c, rounded, "{shard:?} rank {rank} param {i}");
                }
                let row = specs[i].shape.iter().skip(1).product::<usize>().max(1);
                let first = c.len() / row;
                let expected: Vec<half::bf16> = (0..c.len())
                    .map(|k| {
                        let rows = match shard {
                            Shard::Full => {
                                ckpt_engine::parallel::plan::rows(specs[i].shape[0], 3, rank).start
                            }
                            _ => 0,
                        };
                        half::bf16::from_f32(CountedRows::value(
                            Which::Master,
                            i,
                            rows + k / row,
                            k % row,
                        ))
                    })
                    .collect();
                assert_eq!(c, expected, "{shard:?} rank {rank} param {i}: {first} rows");
                let held = match shard {
                    Shard::None => 0..specs[i].shape[0],
                    _ => ckpt_engine::parallel::plan::rows(specs[i].shape[0], 3, rank),
                };
                let master_rows: Vec<f32> = held
                    .flat_map(|r| {
                        (0..row).map(move |at| CountedRows::value(Which::Master, i, r, at))
                    })
                    .collect();
                assert_eq!(
                    m, master_rows,
                    "{shard:?} rank {rank} param {i}: master rows"
                );
            }
        }
    }
}
