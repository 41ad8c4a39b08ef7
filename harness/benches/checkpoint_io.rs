//! Checkpoint save and load throughput next to a plain sequential write (with fsync) and read of
//! the same number of bytes, measured in the same run. Prints one JSON line.
//!
//! The plain read is `std::fs::read`: the bytes end up in fresh memory, as a load's must. A
//! streaming read into one reused 8 MiB buffer (`cat file > /dev/null`) is reported beside it;
//! it never touches fresh memory, so from the page cache it runs several times faster than
//! anything that keeps the bytes.
//!
//! `CKPT_BENCH_HIDDEN`, `CKPT_BENCH_LAYERS`, `CKPT_BENCH_VOCAB` size the model (default ≈ 58M
//! parameters, ≈ 700 MB per checkpoint with AdamW moments); `CKPT_BENCH_REPEATS` (default 3)
//! sets how many times each is measured (best of), a save and the plain write in turn, a load
//! and the plain reads in turn.
//!
//! The plain write goes as a save's files go: into a new file each time, fsynced, and the one
//! before removed after it. A save keeps the previous checkpoint until the new one is durable,
//! so it never writes into the blocks the previous one frees; truncating one file and writing it
//! again does, and on a virtual disk whose first write to a block costs more, that ran 2.5 to 3
//! times as fast as writing a new file and made an unfair reference.
//!
//! The same state is saved sharded by 4 ranks, timed in turn with a plain write + fsync of its
//! bytes (`sharded_save_vs_plain`). It and one device's save of that state are resumed, each
//! checkpoint on one device and on 3 fully sharded ranks (each reading only its rows), the four
//! in turn each round.
//! `sharded_vs_single_device_read_on_one_device` and `..._on_3_ranks` compare the two
//! checkpoints resumed onto the same ranks (1 or more when the sharded checkpoint loads no slower
//! per byte); `sharded_vs_single_device_read` compares the sharded one on 3 ranks with one
//! device's on one device, which adds the cost of resuming on more ranks than cores.
//!
//! The harness's digest of the trained state (`Trainer::state_digest`, taken at every save and
//! resume point) is timed in turn with one sha256 stream over the same tensors' bytes
//! (`state_digest_vs_one_sha256_stream`: above 1 where its tensors are hashed on several cores).

use ckpt_engine::config::TrainConfig;
use ckpt_engine::data::DataConfig;
use ckpt_engine::parallel::{Parallel, Shard};
use ckpt_engine::{CpuDevice, LlamaConfig, Trainer};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

/// The plain file saves are compared with: each write a new file, fsynced, after which the
/// previous one is removed.
struct PlainFile {
    dir: PathBuf,
    writes: usize,
}

impl PlainFile {
    fn new(dir: &Path) -> Self {
        PlainFile {
            dir: dir.to_path_buf(),
            writes: 0,
        }
    }

    /// The file the last write made.
    fn path(&self) -> PathBuf {
        self.dir.join(format!("plain-{}.bin", self.writes))
    }

    /// Writes `bytes` bytes into a new file and fsyncs it, then removes the previous one.
    fn write(&mut self, bytes: u64) {
        let previous = self.path();
        self.writes += 1;
        plain_write(&self.path(), bytes);
        if self.writes > 1 {
            std::fs::remove_file(previous).unwrap();
        }
    }
}

fn plain_write(path: &Path, bytes: u64) {
    let block = vec![0x5au8; 8 << 20];
    let mut f = std::fs::File::create(path).unwrap();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len() as u64) as usize;
        f.write_all(&block[..n]).unwrap();
        left -= n as u64;
    }
    f.sync_all().unwrap();
}

fn plain_read(path: &Path) -> u64 {
    let bytes = std::fs::read(path).unwrap();
    std::hint::black_box(&bytes);
    bytes.len() as u64
}

fn stream_read(path: &Path) -> u64 {
    let mut f = std::fs::File::open(path).unwrap();
    let mut block = vec![0u8; 8 << 20];
    let (mut total, mut sum) = (0u64, 0u64);
    loop {
        let n = f.read(&mut block).unwrap();
        if n == 0 {
            break;
        }
        sum = sum.wrapping_add(block[n - 1] as u64);
        total += n as u64;
    }
    std::hint::black_box(sum);
    total
}

/// What [`sharded_against_single`] measures.
struct Sharded {
    /// Bytes and seconds of each resume: by checkpoint (one device's, the sharded one), then by
    /// where it resumes (one device, 3 ranks).
    reads: [[(u64, f64); 2]; 2],
    /// Seconds of the 4 ranks' save.
    save_s: f64,
    /// Seconds of a plain write + fsync of as many bytes.
    write_s: f64,
}

/// A save of `trainer` into the run directory `run` and a plain write + fsync of as many bytes
/// into a new file of `plain`, timed in turn (best of `repeats`, so that a drift of the machine's
/// speed during the run moves both): the checkpoint, its bytes, and the save's and the write's
/// seconds.
fn save_against_plain<D: ckpt_engine::Device>(
    trainer: &mut Trainer<D>,
    run: &Path,
    plain: &mut PlainFile,
    repeats: usize,
) -> (PathBuf, u64, f64, f64) {
    let mut ckpt = PathBuf::new();
    let bytes = std::cell::Cell::new(0);
    let [save_s, write_s] = best_in_turn(
        repeats,
        &mut [
            &mut || {
                let t = Instant::now();
                ckpt = trainer.save(run, Some(1)).unwrap();
                let s = t.elapsed().as_secs_f64();
                bytes.set(dir_bytes(&ckpt));
                s
            },
            &mut || {
                let t = Instant::now();
                plain.write(bytes.get());
                t.elapsed().as_secs_f64()
            },
        ],
    );
    (ckpt, bytes.get(), save_s, write_s)
}

/// The bytes and seconds (best of `repeats`, the four taken in turn) of resuming one step of
/// `cfg` (at 12 micro-batches a step), by checkpoint (saved by one device; sharded by 4 ranks
/// with the optimizer state sharded) and by where it resumes (one device; 3 ranks under `shard:
/// full`, each reading its rows of every tensor, the ranks between them holding the
/// checkpoint's bytes once, as one device does); and the 4 ranks' save, with a plain write +
/// fsync of its bytes into a new file of `plain` (the save's and the write's seconds).
fn sharded_against_single(
    cfg: &TrainConfig,
    dir: &Path,
    plain: &mut PlainFile,
    repeats: usize,
) -> Sharded {
    let mut cfg = cfg.clone();
    cfg.accumulation = 12;
    let at = |world_size, shard| {
        let mut at = cfg.clone();
        at.parallel = Parallel {
            world_size,
            shard,
            ..Parallel::default()
        };
        at
    };
    let stepped = |saving| {
        let device = CpuDevice::new(2, u64::MAX).unwrap();
        let mut t = Trainer::new(at(saving, Shard::Optimizer), device).unwrap();
        t.step().unwrap();
        t
    };
    let single = stepped(1).save(&dir.join("world-1"), None).unwrap();
    let (sharded, _, save_s, write_s) =
        save_against_plain(&mut stepped(4), &dir.join("world-4"), plain, repeats);
    let saved = [single, sharded];
    let targets = [at(1, Shard::None), at(3, Shard::Full)];
    let mut seconds = [[f64::INFINITY; 2]; 2];
    for _ in 0..repeats {
        for (ckpt, row) in saved.iter().zip(&mut seconds) {
            for (resumed, best) in targets.iter().zip(row.iter_mut()) {
                let t = Instant::now();
                let loaded =
                    Trainer::resume(resumed.clone(), CpuDevice::new(2, u64::MAX).unwrap(), ckpt)
                        .unwrap();
                *best = best.min(t.elapsed().as_secs_f64());
                drop(loaded);
            }
        }
    }
    Sharded {
        reads: [0, 1].map(|c| [0, 1].map(|r| (dir_bytes(&saved[c]), seconds[c][r]))),
        save_s,
        write_s,
    }
}

/// The seconds of `trainer`'s state digest and of one sha256 stream over the same tensors' bytes,
/// one after another, timed in turn, best of `repeats`.
fn digest_against_one_stream<D: ckpt_engine::Device>(
    trainer: &Trainer<D>,
    repeats: usize,
) -> (f64, f64) {
    use sha2::{Digest, Sha256};
    let (model, optimizer) = trainer.state().checkpoint_entries().unwrap();
    let [digest_s, stream_s] = best_in_turn(
        repeats,
        &mut [
            &mut || {
                let t = Instant::now();
                std::hint::black_box(trainer.state_digest().unwrap());
                t.elapsed().as_secs_f64()
            },
            &mut || {
                let t = Instant::now();
                let mut h = Sha256::new();
                for e in model.iter().chain(&optimizer) {
                    h.update(&e.data);
                }
                std::hint::black_box(h.finalize());
                t.elapsed().as_secs_f64()
            },
        ],
    );
    (digest_s, stream_s)
}

/// The best of `repeats` seconds of each of `timed`, which are run in turn each round.
fn best_in_turn<const K: usize>(
    repeats: usize,
    timed: &mut [&mut dyn FnMut() -> f64; K],
) -> [f64; K] {
    let mut best = [f64::INFINITY; K];
    for _ in 0..repeats {
        for (f, b) in timed.iter_mut().zip(&mut best) {
            *b = b.min(f());
        }
    }
    best
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing: run small then.
    let quick = !std::env::args().any(|a| a == "--bench");
    let hidden = env("CKPT_BENCH_HIDDEN", if quick { 64 } else { 512 });
    let model = LlamaConfig {
        max_position_embeddings: 64,
        ..LlamaConfig::new(
            env("CKPT_BENCH_VOCAB", if quick { 256 } else { 32000 }),
            hidden,
            hidden * 8 / 3,
            env("CKPT_BENCH_LAYERS", if quick { 2 } else { 8 }),
            8,
            4,
        )
    };
    let mut cfg = TrainConfig {
        data: DataConfig::Synthetic {
            seed: 0,
            samples: 16,
            branching: 4,
            min_len: None,
        },
        ..TrainConfig::new(model, 1, 16)
    };
    cfg.optimizer.grad_clip = None;
    let repeats = env("CKPT_BENCH_REPEATS", if quick { 1 } else { 3 });
    let tmp = tempfile::tempdir_in(std::env::var("CKPT_BENCH_DIR").unwrap_or_else(|_| ".".into()))
        .unwrap();
    let mut trainer = Trainer::new(cfg.clone(), CpuDevice::new(2, u64::MAX).unwrap()).unwrap();
    trainer.step().unwrap();
    let run = tmp.path().join("run");
    let mut plain = PlainFile::new(tmp.path());
    // Each figure and the plain I/O it is compared with are timed in turn, so that a drift of
    // the machine's speed during the run moves both.
    let (_, bytes, save_s, write_s) = save_against_plain(&mut trainer, &run, &mut plain, repeats);
    let (digest_s, stream_s) = digest_against_one_stream(&trainer, repeats);
    drop(trainer);
    let written = plain.path();
    let [load_s, read_s, stream_read_s] = best_in_turn(
        repeats,
        &mut [
            &mut || {
                let t = Instant::now();
                let resumed =
                    Trainer::resume(cfg.clone(), CpuDevice::new(2, u64::MAX).unwrap(), &run)
                        .unwrap();
                let s = t.elapsed().as_secs_f64();
                drop(resumed);
                s
            },
            &mut || {
                let t = Instant::now();
                assert_eq!(plain_read(&written), bytes);
                t.elapsed().as_secs_f64()
            },
            &mut || {
                let t = Instant::now();
                assert_eq!(stream_read(&written), bytes);
                t.elapsed().as_secs_f64()
            },
        ],
    );
    let shards = sharded_against_single(&cfg, tmp.path(), &mut plain, repeats);
    let [[single, single_on_3], [sharded_on_1, sharded]] = shards.reads;
    let gbs = |s: f64| bytes as f64 / s / 1e9;
    let rate = |(bytes, s): (u64, f64)| bytes as f64 / s / 1e9;
    println!(
        "{}",
        serde_json::json!({
            "bench": "checkpoint_io",
            "bytes": bytes,
            "save_gb_s": gbs(save_s),
            "plain_write_gb_s": gbs(write_s),
            "save_vs_plain": write_s / save_s,
            "sharded_save_gb_s": rate((sharded_on_1.0, shards.save_s)),
            "sharded_save_vs_plain": shards.write_s / shards.save_s,
            "load_gb_s": gbs(load_s),
            "plain_read_gb_s": gbs(read_s),
            "load_vs_plain": read_s / load_s,
            "stream_read_gb_s": gbs(stream_read_s),
            "load_vs_stream": stream_read_s / load_s,
            "single_device_read_gb_s": rate(single),
            "sharded_read_gb_s": rate(sharded),
            "sharded_vs_single_device_read": rate(sharded) / rate(single),
            "sharded_vs_single_device_read_on_one_device": rate(sharded_on_1) / rate(single),
            "sharded_vs_single_device_read_on_3_ranks": rate(sharded) / rate(single_on_3),
            "state_digest_gb_s": gbs(digest_s),
            "state_digest_vs_one_sha256_stream": stream_s / digest_s,
        })
    );
}
