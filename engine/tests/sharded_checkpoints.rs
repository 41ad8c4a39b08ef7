//! Sharded checkpoints: several ranks save a file each and an index, nothing gathered; the
//! whole tensors read back are one device's; a chunk out of place, a damaged rank file or ranks
//! that leave a row unsaved are refused, naming the tensor, and never replace `latest`.

mod common;

use ckpt_engine::checkpoint::shards::{rank_file_name, Index};
use ckpt_engine::checkpoint::{
    self, files, verify, MODEL_FILE, SHARDS_FILE, STATE_FILE, STATE_SUM_FILE,
};
use ckpt_engine::config::Precision;
use ckpt_engine::parallel::{Checkpoints, Parallel, Shard};
use ckpt_engine::{CpuDevice, Fault, TrainConfig, Trainer};
use proptest::prelude::*;
use std::path::{Path, PathBuf};

/// A Llama with a 37-token vocabulary (neither 3 nor 4 divides it) and 12 micro-batches a step.
fn cfg(world_size: usize, shard: Shard) -> TrainConfig {
    let cfg = common::train_config(common::llama(37, 16, 2), Precision::Bf16Mixed, 1, 8, 6);
    on_ranks(cfg, 12, world_size, shard)
}

/// Makes chunks `i` and `j` of `tensor` (of equal size) trade places in the file: each keeps
/// its rows, the other's bytes.
fn swap_chunks(tensor: &mut ckpt_engine::checkpoint::shards::TensorIndex, i: usize, j: usize) {
    let (a, b) = (tensor.chunks[i].clone(), tensor.chunks[j].clone());
    tensor.chunks[i] = ckpt_engine::checkpoint::shards::ChunkIndex {
        offsets: a.offsets.clone(),
        ..b.clone()
    };
    tensor.chunks[j] = ckpt_engine::checkpoint::shards::ChunkIndex {
        offsets: b.offsets,
        ..a
    };
}

/// `cfg` at `accumulation` micro-batches a step on `world_size` ranks sharded by `shard`.
fn on_ranks(
    mut cfg: TrainConfig,
    accumulation: usize,
    world_size: usize,
    shard: Shard,
) -> TrainConfig {
    cfg.accumulation = accumulation;
    cfg.parallel = Parallel {
        world_size,
        shard,
        ..Parallel::default()
    };
    cfg
}

fn dev() -> CpuDevice {
    CpuDevice::new(4, u64::MAX).unwrap()
}

/// Trains `cfg` `steps` steps and saves into `run`; returns the trainer and the checkpoint.
fn trained(cfg: &TrainConfig, steps: usize, run: &Path) -> (Trainer<CpuDevice>, PathBuf) {
    let mut t = Trainer::new(cfg.clone(), dev()).unwrap();
    for _ in 0..steps {
        t.step().unwrap();
    }
    let dir = t.save(run, None).unwrap();
    (t, dir)
}

fn index(dir: &Path) -> Index {
    serde_json::from_slice(&std::fs::read(dir.join(SHARDS_FILE)).unwrap()).unwrap()
}

/// Writes `index` as the checkpoint's index, with its record and the state's checksum updated,
/// as a consistent writer would: only the index's own checks can refuse it.
fn rewrite_index(dir: &Path, index: &Index) {
    let text = serde_json::to_vec_pretty(index).unwrap();
    std::fs::write(dir.join(SHARDS_FILE), &text).unwrap();
    let state_path = dir.join(STATE_FILE);
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state_path).unwrap()).unwrap();
    state["files"][SHARDS_FILE] = serde_json::to_value(files::record(&text)).unwrap();
    let bytes = serde_json::to_vec(&state).unwrap();
    std::fs::write(&state_path, &bytes).unwrap();
    let sum = format!("{}  {STATE_FILE}\n", files::sha256_hex(&bytes));
    std::fs::write(dir.join(STATE_SUM_FILE), sum).unwrap();
}

/// `verify`'s verdicts on `dir` that name a problem: `(file, problem)`.
fn problems(dir: &Path) -> Vec<(String, String)> {
    let (_, verdicts) = verify(dir).unwrap();
    verdicts
        .into_iter()
        .filter_map(|v| Some((v.name, v.problem?)))
        .collect()
}

fn resume_error(cfg: &TrainConfig, run: &Path) -> String {
    match Trainer::resume(cfg.clone(), dev(), run) {
        Ok(_) => panic!("{} resumed", run.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn ranks_save_a_file_each_and_an_index_whose_whole_tensors_are_one_device_s() {
    let tmp = tempfile::tempdir().unwrap();
    for shard in [Shard::None, Shard::Optimizer, Shard::Full] {
        let sharded = cfg(4, shard);
        let (t, dir) = trained(&sharded, 2, &tmp.path().join(format!("{shard:?}")));
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        for rank in 0..4 {
            assert!(
                names.contains(&rank_file_name(rank, 4)),
                "{shard:?}: {names:?}"
            );
        }
        assert!(names.contains(&SHARDS_FILE.to_string()), "{names:?}");
        assert!(
            !names.contains(&MODEL_FILE.to_string()),
            "nothing gathered: {names:?}"
        );

        let index = index(&dir);
        assert_eq!(index.world_size, 4);
        let embed = index
            .model
            .iter()
            .find(|t| t.name == "model.embed_tokens.weight")
            .unwrap();
        let rows: Vec<(usize, usize)> = embed
            .chunks
            .iter()
            .map(|c| (c.offsets[0], c.sizes[0]))
            .collect();
        assert_eq!(rows, [(0, 10), (10, 10), (20, 10), (30, 7)], "{shard:?}");

        // The whole tensors on disk are the live state's, and one device's save of it.
        let digest = t.state_digest().unwrap();
        let on_disk = checkpoint::tensor_digests(&dir).unwrap();
        assert_eq!(
            on_disk,
            [digest.params.clone(), digest.optimizer.clone()],
            "{shard:?}"
        );
        let mut gathered = sharded.clone();
        gathered.parallel.checkpoints = Checkpoints::Gathered;
        let (_, whole) = trained(
            &gathered,
            2,
            &tmp.path().join(format!("{shard:?}-gathered")),
        );
        assert!(whole.join(MODEL_FILE).exists());
        assert_eq!(
            checkpoint::tensor_digests(&whole).unwrap(),
            on_disk,
            "{shard:?}"
        );

        // Exported, the sharded checkpoint's weights are one device's file, byte for byte.
        let out = tmp.path().join(format!("{shard:?}-export"));
        assert_eq!(checkpoint::export(&dir, &out).unwrap(), dir);
        let exported = std::fs::read(out.join(MODEL_FILE)).unwrap();
        assert_eq!(
            exported,
            std::fs::read(whole.join(MODEL_FILE)).unwrap(),
            "{shard:?}"
        );
        let again = checkpoint::export(&dir, &out).unwrap_err().to_string();
        assert!(
            again.contains("is not empty; export into a new directory"),
            "{again}"
        );
        let (_, verdicts) = verify(&dir).unwrap();
        assert_eq!(
            verdicts.len(),
            7,
            "state, config, index and 4 rank files: {verdicts:?}"
        );
        assert!(verdicts.iter().all(|v| v.problem.is_none()), "{verdicts:?}");
    }
}

#[test]
fn more_ranks_than_rows_leave_empty_chunks_out_and_still_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let mut wide = cfg(12, Shard::Full);
    wide.model.hidden_size = 8;
    let (_, dir) = trained(&wide, 1, &run);
    let index = index(&dir);
    let norm = index
        .model
        .iter()
        .find(|t| t.name == "model.norm.weight")
        .unwrap();
    assert_eq!(norm.shape, [8]);
    assert_eq!(norm.chunks.len(), 8, "ranks 8 to 11 hold no row of it");
    let mut narrow = wide.clone();
    narrow.parallel = Parallel {
        world_size: 3,
        shard: Shard::Optimizer,
        ..Parallel::default()
    };
    let mut single = wide.clone();
    single.parallel = Parallel::default();
    let mut whole = Trainer::new(single, dev()).unwrap();
    let mut resumed = Trainer::resume(narrow, dev(), &run).unwrap();
    whole.step().unwrap();
    let want = whole.step().unwrap();
    let got = resumed.step().unwrap();
    assert_eq!(got.loss.to_bits(), want.loss.to_bits());
    assert_eq!(
        resumed.state_digest().unwrap(),
        whole.state_digest().unwrap()
    );
}

#[test]
fn a_chunk_out_of_place_is_refused_naming_its_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let sharded = cfg(4, Shard::Optimizer);
    let (_, dir) = trained(&sharded, 2, &run);
    let mut swapped = index(&dir);
    let tensor = swapped
        .optimizer
        .iter_mut()
        .find(|t| t.name == "model.embed_tokens.weight.exp_avg")
        .unwrap();
    // Two chunks of equal size trade places: each is intact, the tensor is not.
    swap_chunks(tensor, 0, 1);
    rewrite_index(&dir, &swapped);
    let e = resume_error(&sharded, &run);
    assert!(
        e.contains("model.embed_tokens.weight.exp_avg assembled from its chunks has XXH3-128"),
        "{e}"
    );
    assert!(e.contains("a chunk is out of place"), "{e}");
    let e = checkpoint::tensor_digests(&dir).unwrap_err().to_string();
    assert!(
        e.contains("model.embed_tokens.weight.exp_avg assembled"),
        "{e}"
    );
    let bad = problems(&dir);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert_eq!(bad[0].0, SHARDS_FILE);
    assert!(bad[0].1.contains("a chunk is out of place"), "{}", bad[0].1);

    // A chunk moved off its rows leaves a gap the index's own check names.
    let mut gap = index(&dir);
    gap.model[0].chunks[1].offsets[0] += 1;
    rewrite_index(&dir, &gap);
    let e = resume_error(&sharded, &run);
    assert!(e.contains("does not continue its rows at 10"), "{e}");
}

#[test]
fn a_damaged_rank_file_is_refused_naming_it_and_verify_finds_it() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let sharded = cfg(3, Shard::Full);
    let (_, dir) = trained(&sharded, 1, &run);
    let rank2 = dir.join(rank_file_name(2, 3));
    let mut bytes = std::fs::read(&rank2).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x10;
    std::fs::write(&rank2, &bytes).unwrap();
    let e = resume_error(&sharded, &run);
    assert!(e.contains(&rank_file_name(2, 3)), "{e}");
    assert!(e.contains("checksum mismatch"), "{e}");
    // Read rank by rank, the damaged chunk is named with its tensor, rows and bytes.
    assert!(
        e.contains("the chunk of lm_head.weight.exp_avg_sq (rows 26..37) at bytes"),
        "{e}"
    );
    let bad = problems(&dir);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert_eq!(bad[0].0, rank_file_name(2, 3));
    // The whole tensors read for the digests (as for `export`) name the chunk too.
    let e = checkpoint::tensor_digests(&dir).unwrap_err().to_string();
    assert!(
        e.contains("checksum mismatch: the chunk of lm_head.weight.exp_avg_sq (rows 26..37)"),
        "{e}"
    );
}

/// Ranks whose optimizer shards start a row late ([`Fault::ShardBoundaryOffByOne`]) leave a
/// row of every moment unsaved: the save is refused before anything is written, and `latest`
/// still names the checkpoint before.
#[test]
fn ranks_that_leave_a_row_unsaved_are_refused_and_latest_stays() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let mut faulty = cfg(4, Shard::Optimizer);
    faulty.precision = Precision::Fp32;
    faulty.faults = [Fault::ShardBoundaryOffByOne].into_iter().collect();
    let mut t = Trainer::new(faulty.clone(), dev()).unwrap();
    let before = t.save(&run, None).unwrap();
    t.step().unwrap();
    let e = t.save(&run, None).unwrap_err().to_string();
    assert!(e.contains("saving step 1"), "{e}");
    assert!(
        e.contains("do not tile it: rows 10..11 are saved by no rank"),
        "{e}"
    );
    assert!(e.contains("still names step-00000000"), "{e}");
    assert_eq!(checkpoint::resolve(&run).unwrap(), before);
    assert!(!run.join("step-00000001").exists());
    faulty.parallel.checkpoints = Checkpoints::Gathered;
    let mut t = Trainer::resume(faulty, dev(), &run).unwrap();
    t.step().unwrap();
    assert!(
        t.save(&run, None).is_ok(),
        "gathered, the row saves as zeros"
    );
}

/// [`Fault::MomentsAtSavedOffsets`] resumes at the saving world size untouched, and at another
/// one hands ranks other rows' moments: the optimizer state differs at once, the weights after
/// the first update.
#[test]
fn moments_at_the_saved_offsets_change_the_state_only_at_another_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let saved = cfg(4, Shard::Optimizer);
    let (t, _) = trained(&saved, 2, &run);
    let want = t.state_digest().unwrap();
    let faulty = |world_size: usize| {
        let mut c = saved.clone();
        c.parallel.world_size = world_size;
        c.faults = [Fault::MomentsAtSavedOffsets].into_iter().collect();
        Trainer::resume(c, dev(), &run).unwrap()
    };
    assert_eq!(
        faulty(4).state_digest().unwrap(),
        want,
        "the same world size"
    );
    let mut other = faulty(3);
    let got = other.state_digest().unwrap();
    assert_eq!(
        got.params, want.params,
        "the weights load where they belong"
    );
    assert_ne!(got.optimizer, want.optimizer, "the moments do not");
    let mut clean = saved.clone();
    clean.parallel.world_size = 3;
    let mut resumed = Trainer::resume(clean, dev(), &run).unwrap();
    assert_eq!(resumed.state_digest().unwrap(), want, "without the fault");
    resumed.step().unwrap();
    other.step().unwrap();
    assert_ne!(
        other.state_digest().unwrap().params,
        resumed.state_digest().unwrap().params
    );
}

/// [`Fault::RngRestoredOnRankZeroOnly`] leaves one rank's resume alone; on several ranks the
/// others draw other dropout masks from the first resumed step on, while the saved state and the
/// resumed one are the run's.
#[test]
fn a_generator_restored_on_rank_zero_only_changes_the_other_ranks_masks() {
    let tmp = tempfile::tempdir().unwrap();
    for world in [1, 4] {
        let mut saved = cfg(world, Shard::Optimizer);
        saved.dropout = 0.1;
        let run = tmp.path().join(format!("run-{world}"));
        let (mut t, _) = trained(&saved, 2, &run);
        let before = t.state_digest().unwrap();
        let want = t.step().unwrap();
        let mut faulty = saved.clone();
        faulty.faults = [Fault::RngRestoredOnRankZeroOnly].into_iter().collect();
        let mut resumed = Trainer::resume(faulty, dev(), &run).unwrap();
        assert_eq!(
            resumed.state_digest().unwrap(),
            before,
            "world {world}: the saved state"
        );
        let got = resumed.step().unwrap();
        assert_eq!(
            got.batch_digest, want.batch_digest,
            "world {world}: the same data"
        );
        if world == 1 {
            assert_eq!(
                got.loss.to_bits(),
                want.loss.to_bits(),
                "one rank: untouched"
            );
        } else {
            assert_ne!(
                got.loss.to_bits(),
                want.loss.to_bits(),
                "{world} ranks: other masks"
            );
        }
    }
}

/// An index rewritten to claim more than its files hold (a tensor of 2^40 more rows whose last
/// chunk runs past its file's end) or chunks that overlap is refused by every reader, naming the
/// index, before anything of the claimed size is allocated.
#[test]
fn an_index_claiming_more_than_its_files_hold_is_refused_before_allocating() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let sharded = cfg(2, Shard::Full);
    let (_, dir) = trained(&sharded, 1, &run);
    let honest = index(&dir);

    let mut huge = honest.clone();
    let tensor = &mut huge.model[0];
    let row = (tensor.chunks[0].byte_range[1] - tensor.chunks[0].byte_range[0])
        / tensor.chunks[0].sizes[0] as u64;
    let more = 1usize << 40;
    tensor.shape[0] += more;
    let last = tensor.chunks.last_mut().unwrap();
    last.sizes[0] += more;
    last.byte_range[1] += more as u64 * row;
    rewrite_index(&dir, &huge);
    let past = "lies past the end of";
    let e = resume_error(&sharded, &run);
    assert!(e.contains(SHARDS_FILE) && e.contains(past), "{e}");
    let e = checkpoint::tensor_digests(&dir).unwrap_err().to_string();
    assert!(e.contains(past), "{e}");
    let e = checkpoint::export(&dir, &tmp.path().join("out"))
        .unwrap_err()
        .to_string();
    assert!(e.contains(past), "{e}");
    let bad = problems(&dir);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].1.contains(past), "{}", bad[0].1);

    let mut overlapping = honest.clone();
    let second = &mut overlapping.model[1].chunks[0];
    assert_eq!(second.file, honest.model[0].chunks[0].file);
    second.byte_range = second.byte_range.map(|b| b - 1);
    rewrite_index(&dir, &overlapping);
    let e = resume_error(&sharded, &run);
    assert!(e.contains("which overlap"), "{e}");

    rewrite_index(&dir, &honest);
    Trainer::resume(sharded, dev(), &run).unwrap();
}

/// A resume at another world size reads each rank's rows straight into its own tensors: the
/// host the ranks are cut from holds nothing while the checkpoint loads (it once held every
/// tensor whole), and each rank's load peaks at the bytes it keeps, its optimizer state being
/// exactly its rows of the moments (and master weights), not a whole tensor.
#[test]
fn each_rank_reads_only_its_rows_and_no_whole_tensor_is_held() {
    let tmp = tempfile::tempdir().unwrap();
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        let run = tmp.path().join(format!("{precision:?}"));
        let mut saved = cfg(4, Shard::Full);
        saved.precision = precision;
        trained(&saved, 2, &run);
        let mut resumed = cfg(3, Shard::Full);
        resumed.precision = precision;
        let dev = dev();
        let host = dev.tracker().clone();
        let t = Trainer::resume(resumed.clone(), dev, &run).unwrap();
        assert_eq!(
            host.stats().allocated.peak,
            0,
            "{precision:?}: the host held tensors while the ranks loaded"
        );
        // Moments, and in bf16-mixed the f32 master weights: f32 elements of optimizer state.
        let per_element = match precision {
            Precision::Fp32 => 2 * 4,
            Precision::Bf16Mixed => 3 * 4,
        };
        let specs = ckpt_engine::model::param_specs(&resumed.model);
        let whole: u64 = specs
            .iter()
            .map(|s| s.shape.iter().product::<usize>() as u64)
            .sum();
        for (rank, state) in t.ranks().iter().enumerate() {
            let stats = state.device().tracker().stats();
            assert_eq!(
                stats.allocated.peak, stats.allocated.current,
                "{precision:?} rank {rank}: the load held more than the rank keeps"
            );
            let rows: u64 = specs
                .iter()
                .map(|s| {
                    let row = s.shape.iter().skip(1).product::<usize>();
                    (ckpt_engine::parallel::plan::rows(s.shape[0], 3, rank).len() * row) as u64
                })
                .sum();
            assert!(rows < whole);
            assert_eq!(
                stats.current.get(ckpt_engine::Category::Optimizer),
                per_element * rows,
                "{precision:?} rank {rank}"
            );
        }
    }
}

/// Resumed at another world size, a chunk that two new ranks share (rows 10..20 of 37, saved by
/// rank 1 of 4, read by ranks 0 and 1 of 3) is checked once both hold their rows: damage in it
/// names its file, tensor, rows and bytes.
#[test]
fn a_damaged_chunk_two_ranks_share_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let (_, dir) = trained(&cfg(4, Shard::Optimizer), 2, &run);
    let chunk = index(&dir)
        .optimizer
        .into_iter()
        .find(|t| t.name == "model.embed_tokens.weight.exp_avg")
        .unwrap()
        .chunks
        .remove(1);
    assert_eq!((chunk.offsets[0], chunk.sizes[0]), (10, 10));
    let file = dir.join(&chunk.file);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[(chunk.byte_range[0] + chunk.byte_range[1]) as usize / 2] ^= 0x08;
    std::fs::write(&file, &bytes).unwrap();
    let e = resume_error(&cfg(3, Shard::Optimizer), &run);
    assert!(e.contains(&rank_file_name(1, 4)), "{e}");
    let [begin, end] = chunk.byte_range;
    assert!(
        e.contains(&format!(
            "checksum mismatch: the chunk of model.embed_tokens.weight.exp_avg (rows 10..20) at bytes {begin}..{end} does not match its hash"
        )),
        "{e}"
    );
}

/// [`Fault::LastUnevenShardDropped`]: saved on 4 ranks, the 37-row tensors lose rows 30..37
/// (rank 3's short shard), written by no rank; the save goes through as that writer's does,
/// and every load (on 3 ranks, on 4, on one device), `verify` and the digests refuse it, naming
/// the index, the tensor, the missing rows, the rank file the plan gave them and what to do.
/// Tensors the world size divides, one rank's save and a gathered save are untouched.
#[test]
fn a_checkpoint_missing_its_last_uneven_shard_is_refused_naming_the_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let mut faulty = cfg(4, Shard::Optimizer);
    faulty.faults = [Fault::LastUnevenShardDropped].into_iter().collect();
    let (t, dir) = trained(&faulty, 1, &run);
    let saved = index(&dir);
    let embed = &saved.model[0];
    assert_eq!(embed.name, "model.embed_tokens.weight");
    assert_eq!(embed.chunks.len(), 3, "rank 3's rows 30..37 are left out");
    assert!(saved
        .model
        .iter()
        .chain(&saved.optimizer)
        .filter(|t| t.shape[0] % 4 == 0)
        .all(|t| t.chunks.len() == 4));
    for world in [3, 4, 1] {
        let mut at = cfg(world, Shard::Optimizer);
        at.faults = faulty.faults.clone();
        let e = resume_error(&at, &run);
        assert!(e.contains(SHARDS_FILE), "{e}");
        assert!(
            e.contains("the chunks of model.embed_tokens.weight cover rows 0..30 of its 37: rows 30..37, which the saving plan gives rank-00003-of-00004.safetensors, are in no rank's file"),
            "{world}: {e}"
        );
        assert!(e.contains("resume from an earlier checkpoint"), "{e}");
    }
    let bad = problems(&dir);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert_eq!(bad[0].0, SHARDS_FILE);
    assert!(bad[0].1.contains("rows 30..37"), "{}", bad[0].1);
    let e = checkpoint::tensor_digests(&dir).unwrap_err().to_string();
    assert!(e.contains("rows 30..37"), "{e}");

    // One rank's save and a gathered save hold every row: they resume to the trainer's state.
    let want = t.state_digest().unwrap();
    for (world, checkpoints) in [(1, Checkpoints::Sharded), (4, Checkpoints::Gathered)] {
        let mut at = cfg(world, Shard::Optimizer);
        at.faults = faulty.faults.clone();
        at.parallel.checkpoints = checkpoints;
        let run = tmp.path().join(format!("{world}-{checkpoints:?}"));
        let (t, _) = trained(&at, 1, &run);
        assert_eq!(t.state_digest().unwrap(), want);
        let resumed = Trainer::resume(at, dev(), &run).unwrap();
        assert_eq!(
            resumed.state_digest().unwrap(),
            want,
            "{world} {checkpoints:?}"
        );
    }
}

/// A Llama whose embedding and head span several 64 KiB hash blocks (1000 rows of 256 bytes),
/// in fp32, on 60 micro-batches a step (every world size from 1 to 5 divides them).
fn blocks_cfg(world_size: usize, shard: Shard) -> TrainConfig {
    let cfg = common::train_config(common::llama(1000, 64, 1), Precision::Fp32, 1, 8, 6);
    on_ranks(cfg, 60, world_size, shard)
}

/// Format version 5's whole-tensor hash, written out: XXH3-128 of the 16-byte little-endian
/// XXH3-128 digests of the tensor's row-major bytes cut into 64 KiB blocks.
fn block_hash(bytes: &[u8]) -> String {
    let digests: Vec<u8> = bytes
        .chunks(64 << 10)
        .flat_map(|b| xxhash_rust::xxh3::xxh3_128(b).to_le_bytes())
        .collect();
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&digests))
}

/// Every tensor of one device's checkpoint file `file` in `dir`: name and bytes.
fn whole_tensors(dir: &Path, file: &str) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(dir.join(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| (name, view.data().to_vec()))
        .collect()
}

#[test]
fn a_whole_tensor_hash_is_its_blocks_and_the_same_at_every_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, one) = trained(&blocks_cfg(1, Shard::None), 1, &tmp.path().join("one"));
    let mut want = std::collections::BTreeMap::new();
    for file in [MODEL_FILE, checkpoint::OPTIMIZER_FILE] {
        for (name, bytes) in whole_tensors(&one, file) {
            want.insert(name, block_hash(&bytes));
        }
    }
    let embed = &want["model.embed_tokens.weight"];
    for world in 2..=5 {
        let run = tmp.path().join(format!("world-{world}"));
        let (_, dir) = trained(&blocks_cfg(world, Shard::Optimizer), 1, &run);
        let index = index(&dir);
        assert_eq!(index.world_size, world);
        let found: std::collections::BTreeMap<String, String> = index
            .model
            .iter()
            .chain(&index.optimizer)
            .map(|t| (t.name.clone(), t.xxh3_128.clone()))
            .collect();
        assert_eq!(found, want, "world size {world}");
        assert_eq!(&found["model.embed_tokens.weight"], embed);
    }
}

/// Two chunks of a tensor of several hash blocks trade places (rows 250..500 and 500..750 of
/// 1000): resumed on 3 ranks from 4, rank 1 hashes the blocks inside its rows 334..668 as it
/// reads them, and the whole hash fails, naming the tensor; damage in a chunk inside one rank's
/// rows names the chunk. On one device, which reads the chunks without their files' checksums
/// and hashes the blocks as they arrive, the same.
#[test]
fn a_chunk_swapped_or_damaged_inside_ranks_rows_fails_its_whole_hash() {
    for resumed in [blocks_cfg(3, Shard::Full), blocks_cfg(1, Shard::None)] {
        a_chunk_swapped_or_damaged_fails_on(resumed);
    }
}

fn a_chunk_swapped_or_damaged_fails_on(resumed: TrainConfig) {
    let world = resumed.parallel.world_size;
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let (_, dir) = trained(&blocks_cfg(4, Shard::Full), 1, &run);
    let name = "model.embed_tokens.weight.exp_avg";
    let mut swapped = index(&dir);
    let tensor = swapped
        .optimizer
        .iter_mut()
        .find(|t| t.name == name)
        .unwrap();
    assert_eq!(tensor.chunks.len(), 4);
    assert_eq!(tensor.chunks[1].sizes, tensor.chunks[2].sizes);
    swap_chunks(tensor, 1, 2);
    let saved = index(&dir);
    rewrite_index(&dir, &swapped);
    let e = resume_error(&resumed, &run);
    assert!(
        e.contains(&format!("{name} assembled from its chunks has XXH3-128")),
        "world size {world}: {e}"
    );
    assert!(
        e.contains("a chunk is out of place"),
        "world size {world}: {e}"
    );
    rewrite_index(&dir, &saved);
    Trainer::resume(resumed.clone(), dev(), &run).unwrap();

    // Rows 0..250 of 1000, saved by rank 0 of 4, lie inside rank 0 of 3's rows 0..334.
    let chunk = saved
        .optimizer
        .iter()
        .find(|t| t.name == name)
        .unwrap()
        .chunks[0]
        .clone();
    assert_eq!((chunk.offsets[0], chunk.sizes[0]), (0, 250));
    let file = dir.join(&chunk.file);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[chunk.byte_range[0] as usize + 1000] ^= 0x20;
    std::fs::write(&file, &bytes).unwrap();
    let e = resume_error(&resumed, &run);
    let [begin, end] = chunk.byte_range;
    assert!(
        e.contains(&format!(
            "checksum mismatch: the chunk of {name} (rows 0..250) at bytes {begin}..{end} does not match its hash"
        )),
        "world size {world}: {e}"
    );
    assert!(e.contains(&rank_file_name(0, 4)), "world size {world}: {e}");
}

/// A sharded checkpoint of format version 4, whose whole-tensor hashes are the XXH3-128 of the
/// tensors' bytes, still loads on 3 ranks, on one device, in `verify` and the digests, to the
/// state version 5 holds; labelled version 5, the same hashes are refused.
#[test]
fn a_version_4_sharded_checkpoint_with_plain_hashes_still_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let saved = blocks_cfg(4, Shard::Full);
    let (_, dir) = trained(&saved, 1, &run);
    let digests = checkpoint::tensor_digests(&dir).unwrap();
    let resumed = blocks_cfg(3, Shard::Full);
    let want = Trainer::resume(resumed.clone(), dev(), &run)
        .unwrap()
        .state_digest()
        .unwrap();

    let one = tmp.path().join("one");
    let mut gathered = saved.clone();
    gathered.parallel.checkpoints = Checkpoints::Gathered;
    let (_, whole) = trained(&gathered, 1, &one);
    let mut plain = std::collections::BTreeMap::new();
    for file in [MODEL_FILE, checkpoint::OPTIMIZER_FILE] {
        for (name, bytes) in whole_tensors(&whole, file) {
            let hash = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&bytes));
            plain.insert(name, hash);
        }
    }
    let mut v4 = index(&dir);
    for t in v4.model.iter_mut().chain(&mut v4.optimizer) {
        assert_ne!(t.xxh3_128, plain[&t.name]);
        t.xxh3_128 = plain[&t.name].clone();
    }
    rewrite_index(&dir, &v4);
    let e = resume_error(&resumed, &run);
    assert!(e.contains("assembled from its chunks has XXH3-128"), "{e}");

    set_format_version(&dir, 4);
    let got = Trainer::resume(resumed.clone(), dev(), &run).unwrap();
    assert_eq!(got.state_digest().unwrap(), want);
    let mut single = saved.clone();
    single.parallel = Parallel::default();
    Trainer::resume(single, dev(), &run).unwrap();
    assert_eq!(checkpoint::tensor_digests(&dir).unwrap(), digests);
    assert!(problems(&dir).is_empty(), "{:?}", problems(&dir));
}

/// Sets the format version `trainer_state.json` records, its checksum updated.
fn set_format_version(dir: &Path, version: u32) {
    let state_path = dir.join(STATE_FILE);
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state_path).unwrap()).unwrap();
    state["format_version"] = version.into();
    let bytes = serde_json::to_vec(&state).unwrap();
    std::fs::write(&state_path, &bytes).unwrap();
    let sum = format!("{}  {STATE_FILE}\n", files::sha256_hex(&bytes));
    std::fs::write(dir.join(STATE_SUM_FILE), sum).unwrap();
}

/// One field of a chunk of the index set to another value, as a writer with a bug, or a hand
/// edit, would leave it.
#[derive(Clone, Debug)]
enum ChunkEdit {
    /// Its first row.
    FirstRow(usize),
    /// Its rows.
    Rows(usize),
    /// Its first byte in its file, moved by this many bytes.
    Begin(i64),
    /// Its end in its file, moved by this many bytes.
    End(i64),
    /// The rank file it names: one of the checkpoint's 4, or one it does not have.
    File(usize),
    /// Its hash.
    Hash(u128),
    /// Its place traded with another chunk of its tensor's: each keeps its rows, the other's
    /// file, bytes and hash (the chunks of a weight loaded in the wrong order).
    TradedWith(usize),
}

fn chunk_edits() -> impl Strategy<Value = ChunkEdit> {
    prop_oneof![
        (0usize..40).prop_map(ChunkEdit::FirstRow),
        (0usize..40).prop_map(ChunkEdit::Rows),
        prop_oneof![-300i64..300, Just(i64::MAX / 2)].prop_map(ChunkEdit::Begin),
        prop_oneof![-300i64..300, Just(i64::MAX / 2)].prop_map(ChunkEdit::End),
        (0usize..5).prop_map(ChunkEdit::File),
        any::<u128>().prop_map(ChunkEdit::Hash),
        (0usize..4).prop_map(ChunkEdit::TradedWith),
    ]
}

/// `edit` applied to chunk `at` of `tensor`.
fn edit_chunk(
    tensor: &mut ckpt_engine::checkpoint::shards::TensorIndex,
    at: usize,
    edit: &ChunkEdit,
) {
    let moved = |at: u64, by: i64| at.saturating_add_signed(by);
    let chunk = &mut tensor.chunks[at];
    match *edit {
        ChunkEdit::FirstRow(row) => chunk.offsets[0] = row,
        ChunkEdit::Rows(rows) => chunk.sizes[0] = rows,
        ChunkEdit::Begin(by) => chunk.byte_range[0] = moved(chunk.byte_range[0], by),
        ChunkEdit::End(by) => chunk.byte_range[1] = moved(chunk.byte_range[1], by),
        ChunkEdit::File(rank) => chunk.file = rank_file_name(rank, 4),
        ChunkEdit::Hash(h) => chunk.xxh3_128 = format!("{h:032x}"),
        ChunkEdit::TradedWith(other) => {
            let other = other % tensor.chunks.len();
            swap_chunks(tensor, at, other);
        }
    }
}

/// Whatever one field of one chunk of the index is changed to, with the index's checksum
/// re-recorded (so that only the index's own checks and the tensors' hashes stand between it
/// and the state), a resume on one device and on 3 ranks either refuses it naming a file of
/// the checkpoint, or resumes exactly the saved state: never a panic, never other bits.
#[test]
fn any_edit_of_a_chunk_in_the_index_is_refused_naming_a_file_or_resumes_the_saved_state() {
    use proptest::test_runner::{Config, TestRunner};
    let tmp = tempfile::tempdir().unwrap();
    let (_, saved) = trained(&cfg(4, Shard::Full), 2, &tmp.path().join("saved"));
    let resumed = |world: usize, dir: &Path| Trainer::resume(cfg(world, Shard::Full), dev(), dir);
    let reference: Vec<_> = [1, 3]
        .map(|w| resumed(w, &saved).unwrap().state_digest().unwrap())
        .to_vec();
    let honest = index(&saved);
    let tensors = honest.model.len() + honest.optimizer.len();
    let mut runner = TestRunner::new(Config {
        cases: 48,
        failure_persistence: None,
        ..Config::default()
    });
    let cases = (0..tensors, 0usize..4, chunk_edits(), 0usize..2);
    runner
        .run(&cases, |(tensor, chunk, edit, world)| {
            let copy = tempfile::tempdir().unwrap();
            let dir = copy.path().join(saved.file_name().unwrap());
            std::fs::create_dir(&dir).unwrap();
            for entry in std::fs::read_dir(&saved).unwrap() {
                let name = entry.unwrap().file_name();
                std::fs::copy(saved.join(&name), dir.join(&name)).unwrap();
            }
            let mut edited = honest.clone();
            let model = edited.model.len();
            let t = match tensor < model {
                true => &mut edited.model[tensor],
                false => &mut edited.optimizer[tensor - model],
            };
            let chunks = t.chunks.len();
            edit_chunk(t, chunk % chunks, &edit);
            rewrite_index(&dir, &edited);
            match resumed([1, 3][world], &dir) {
                Ok(t) => prop_assert_eq!(&t.state_digest().unwrap(), &reference[world]),
                Err(e) => {
                    let e = e.to_string();
                    prop_assert!(e.contains(&*dir.to_string_lossy()), "{edit:?}: {e}");
                }
            }
            Ok(())
        })
        .unwrap();
}
