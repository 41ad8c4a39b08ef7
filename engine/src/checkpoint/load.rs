//! Loading a checkpoint: the state file and the run's identity first, then the headers
//! (names, dtypes, shapes), then every tensor allocated in its final place and each file read
//! once straight into them while its checksum is verified.

use super::cores::map_on_cores;
use super::files::{self, MappedFile};
use super::reading::{self, FileRead, Region};
use super::shards::TensorIndex;
use super::state::{comparable, first_difference, FileRecord, TrainerState};
use super::tensor_hash::{self, BlockSlots, TensorHash};
use super::{
    fingerprint, resolve, shards, state_file, step_of_dir_name, CONFIG_FILE, MODEL_FILE,
    OPTIMIZER_FILE, SHARDS_FILE, STATE_FILE,
};
use crate::error::{EngineError, Result};
use crate::memory::{Category, MemoryTracker};
use crate::model::{param_specs, LlamaConfig, ParamSpec, Params};
use crate::tensor::Tensor;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A verified checkpoint, tensors loaded onto a device.
pub struct Loaded {
    /// The trainer state.
    pub state: TrainerState,
    /// f32 master weights (from the optimizer file in bf16-mixed, else from the model file).
    pub master: Params<Tensor<f32>>,
    /// AdamW's first and second moments, if the optimizer had taken a step.
    pub moments: Option<[Params<Tensor<f32>>; 2]>,
    /// The ranks that saved it: a sharded checkpoint's index says; one device's layout is 1.
    pub saved_world_size: usize,
}

/// What the loading run expects of a checkpoint.
pub struct LoadRequest<'a> {
    /// Model shape.
    pub config: &'a LlamaConfig,
    /// The run's identity (see [`TrainerState::identity`]).
    pub identity: serde_json::Value,
    /// Whether master weights live in the optimizer file (bf16-mixed) rather than the model file.
    pub master_in_optimizer: bool,
    /// Category the master weights are counted under.
    pub master_category: Category,
    /// Whether a checkpoint without AdamW moments is accepted, resuming with zeroed moments
    /// (what [`crate::Fault::MomentsNotSaved`] does); otherwise it is refused as incomplete.
    pub fresh_moments_if_missing: bool,
}

/// A checkpoint checked up to its tensors: its state file, the run's identity and step, every
/// listed file present at its recorded size (mapped), and its configuration the run's.
pub(super) struct Opened {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// Its trainer state.
    pub state: TrainerState,
    /// Whether it is sharded (an index and a file per rank).
    pub sharded: bool,
    /// Every file the state lists, by name: its path and map.
    pub mapped: BTreeMap<String, (PathBuf, MappedFile)>,
}

/// Checks the checkpoint at `dir` (a checkpoint or a run directory) up to its tensors.
pub(super) fn open(dir: &Path, req: &LoadRequest<'_>) -> Result<Opened> {
    let dir = resolve(dir)?;
    let state = state_file::read(&dir)?.state;
    check_identity(&dir, &state, &req.identity)?;
    check_step(&dir, &state)?;
    let sharded = state.files.contains_key(SHARDS_FILE);
    let needed: &[&str] = if sharded {
        &[SHARDS_FILE, CONFIG_FILE]
    } else {
        &[MODEL_FILE, OPTIMIZER_FILE, CONFIG_FILE]
    };
    for name in needed {
        if !state.files.contains_key(*name) {
            return Err(EngineError::bad_file(
                dir.join(STATE_FILE),
                format!("lists no record of {name}; the checkpoint is incomplete"),
            ));
        }
    }
    let mut mapped = BTreeMap::new();
    for (name, record) in &state.files {
        if name.contains('/') || name.starts_with('.') {
            return Err(EngineError::bad_file(
                dir.join(STATE_FILE),
                format!("lists an invalid file name {name:?}"),
            ));
        }
        let path = dir.join(name);
        let file = MappedFile::open(&path)?;
        let len = file.bytes().len() as u64;
        if len != record.bytes {
            return Err(EngineError::bad_file(
                &path,
                format!("is {len} bytes, {} were written (truncated or replaced); restore it or resume from an earlier checkpoint", record.bytes),
            ));
        }
        mapped.insert(name.clone(), (path, file));
    }
    let (config_path, config_file) = &mapped[CONFIG_FILE];
    files::read_checked(config_path, &state.files[CONFIG_FILE], EARLIER)?;
    let saved_cfg = std::str::from_utf8(config_file.bytes())
        .map_err(|e| e.to_string())
        .and_then(LlamaConfig::from_hf_json)
        .map_err(|m| EngineError::bad_file(config_path, m))?;
    if &saved_cfg != req.config {
        return Err(EngineError::bad_file(
            config_path,
            "describes another model shape than the run's; resume with the model it was saved with",
        ));
    }
    Ok(Opened {
        dir,
        state,
        sharded,
        mapped,
    })
}

/// Reads and verifies the checkpoint at `dir` (a checkpoint or a run directory) into host
/// tensors leased from `host`.
pub fn load(host: &MemoryTracker, dir: &Path, req: &LoadRequest<'_>) -> Result<Loaded> {
    let Opened {
        dir,
        state,
        sharded,
        mapped,
    } = open(dir, req)?;
    let header = |name: &str| {
        let (path, file) = &mapped[name];
        Header::read(path, &state.files[name], file.bytes())
    };
    let source = if sharded {
        Source::Sharded {
            path: dir.join(SHARDS_FILE),
            index: shards::read_index(&dir, &state, EARLIER)?,
        }
    } else {
        Source::Whole {
            model: header(MODEL_FILE)?,
            optimizer: header(OPTIMIZER_FILE)?,
        }
    };
    let specs = param_specs(req.config);
    let master_suffix = if req.master_in_optimizer {
        ".master"
    } else {
        ""
    };
    let master_at = source.places(&specs, req.master_in_optimizer, master_suffix)?;
    let has_moments = specs
        .first()
        .is_some_and(|s| source.holds_optimizer(&format!("{}.exp_avg", s.name)));
    let moments_at = if state.optimizer_step == 0 {
        None
    } else if has_moments {
        Some([
            source.places(&specs, true, ".exp_avg")?,
            source.places(&specs, true, ".exp_avg_sq")?,
        ])
    } else if req.fresh_moments_if_missing {
        None
    } else {
        return Err(EngineError::bad_file(
            source.optimizer_path(),
            format!(
                "holds no AdamW moments although the optimizer took {} steps; the checkpoint is incomplete; resume from a checkpoint saved with its moments",
                state.optimizer_step
            ),
        ));
    };

    // Every tensor is allocated in its final place, then each file is read once into them.
    let zeros =
        |category: Category| move |s: &ParamSpec| Tensor::zeros_kept(host, &s.shape, category);
    let mut master = Params::try_new(req.config, zeros(req.master_category))?;
    let fresh_moments = state.optimizer_step > 0 && moments_at.is_none();
    let mut moments = if moments_at.is_some() || fresh_moments {
        Some([
            Params::try_new(req.config, zeros(Category::Optimizer))?,
            Params::try_new(req.config, zeros(Category::Optimizer))?,
        ])
    } else {
        None
    };
    let read_moments = moments_at.is_some();
    let mut places = master_at;
    places.extend(moments_at.into_iter().flatten().flatten());
    // Under block hashes a sharded checkpoint's chunks are checked by their tensors' whole
    // hashes, each block hashed as it is read; the rank files' own checksums would hash every
    // byte a second time.
    let block_hashed =
        matches!(&source, Source::Sharded { index, .. } if index.tensor_hash == TensorHash::Blocks);
    let slots: Vec<Vec<OnceLock<u128>>> = places
        .iter()
        .map(|place| match place {
            Place::Chunks(tensor) if block_hashed => {
                tensor_hash::empty_slots(tensor.bytes() as usize)
            }
            _ => Vec::new(),
        })
        .collect();
    let mut targets = byte_slices(&mut master);
    if let (true, Some([avg, sq])) = (read_moments, moments.as_mut()) {
        targets.extend(byte_slices(avg).into_iter().chain(byte_slices(sq)));
    }
    let mut regions: BTreeMap<String, Vec<Region<'_>>> = BTreeMap::new();
    for ((place, bytes), slots) in places.iter().zip(targets).zip(&slots) {
        place.add_regions(bytes, slots, &mut regions);
    }
    let reads: Vec<_> = mapped
        .iter()
        .filter(|(name, _)| ![CONFIG_FILE, SHARDS_FILE].contains(&name.as_str()))
        .map(|(name, (path, _))| FileRead {
            path,
            record: &state.files[name],
            checksummed: !block_hashed,
            regions: regions.remove(name.as_str()).unwrap_or_default(),
        })
        .collect();
    let files: Vec<(&Path, &FileRecord)> = reads.iter().map(|r| (r.path, r.record)).collect();
    for ((path, record), read) in files.into_iter().zip(reading::read_all(reads)) {
        if let Some(damaged) = read? {
            return Err(checksum_mismatch(path, record, damaged));
        }
    }
    if let Source::Sharded { path, index } = &source {
        let loaded = master
            .tensors_mut()
            .into_iter()
            .chain(moments.iter_mut().flatten().flat_map(|m| m.tensors_mut()));
        let assembled = places
            .iter()
            .zip(loaded)
            .zip(&slots)
            .filter_map(|((place, t), slots)| match place {
                Place::Chunks(tensor) => Some(Assembled {
                    tensor,
                    whole: bytemuck::cast_slice(t.as_slice()),
                    slots,
                }),
                Place::At(..) => None,
            });
        let assembled: Vec<_> = assembled.collect();
        check_assembled(&dir, path, index.tensor_hash, &mapped, &assembled)?;
    }
    if cfg!(target_endian = "big") {
        let tensors = master
            .tensors_mut()
            .into_iter()
            .chain(moments.iter_mut().flatten().flat_map(|m| m.tensors_mut()));
        for t in tensors {
            t.as_mut_slice()
                .iter_mut()
                .for_each(|x| *x = f32::from_bits(x.to_bits().swap_bytes()));
        }
    }
    let saved_world_size = match &source {
        Source::Sharded { index, .. } => index.world_size,
        Source::Whole { .. } => 1,
    };
    Ok(Loaded {
        state,
        master,
        moments,
        saved_world_size,
    })
}

/// A tensor assembled from its chunks: its index entry, its bytes and (under block hashes) the
/// digests of the blocks hashed as they were read.
struct Assembled<'a> {
    tensor: &'a TensorIndex,
    whole: &'a [u8],
    slots: &'a [OnceLock<u128>],
}

/// Bytes left to hash from memory below which the tensors are checked on the calling thread:
/// starting threads for them took longer (0.35 ms) than hashing the few blocks that reading
/// leaves (0.15 ms for a 670 MB checkpoint's 10 of 10,000).
const CHECKED_IN_PLACE: usize = 8 << 20;

/// Checks each tensor assembled from its chunks against its whole hash, on every core, the most
/// bytes left to hash first (on this thread alone when they are few); the error of the first
/// tensor in order wins. Under block hashes, a tensor's chunks were read without their files'
/// checksums: when its whole hash fails, each chunk is checked against its own hash in the
/// mapped files of the checkpoint in `dir`, so that damage names its file, rows and bytes; with
/// every chunk intact, one is out of place.
fn check_assembled(
    dir: &Path,
    index_path: &Path,
    tensor_hash: TensorHash,
    mapped: &BTreeMap<String, (PathBuf, MappedFile)>,
    assembled: &[Assembled<'_>],
) -> Result<()> {
    let check = |a: &Assembled<'_>| {
        let found = match tensor_hash {
            TensorHash::Blocks => tensor_hash::finish_slots(a.slots, a.whole),
            TensorHash::Plain => tensor_hash.hex(a.whole),
        };
        if found != a.tensor.xxh3_128 && tensor_hash == TensorHash::Blocks {
            for chunk in &a.tensor.chunks {
                let file = mapped[&chunk.file].1.bytes();
                shards::checked_chunk(dir, a.tensor, chunk, file, EARLIER)?;
            }
        }
        shards::check_found(index_path, a.tensor, &found)
    };
    let left = |a: &Assembled<'_>| match tensor_hash {
        TensorHash::Blocks => tensor_hash::unhashed_bytes(a.slots, a.whole.len()),
        TensorHash::Plain => a.whole.len(),
    };
    if assembled.iter().map(left).sum::<usize>() < CHECKED_IN_PLACE {
        return assembled.iter().try_for_each(check);
    }
    map_on_cores(assembled, left, check).into_iter().collect()
}

/// Fails unless the checkpoint at `dir`, whose state is `state`, belongs to a run of `identity`.
pub(crate) fn check_identity(
    dir: &Path,
    state: &TrainerState,
    identity: &serde_json::Value,
) -> Result<()> {
    let (recorded, current) = comparable(&state.identity, identity);
    if state.fingerprint == fingerprint(&state.identity) && recorded == current {
        return Ok(());
    }
    let diff = first_difference(&recorded, &current, "")
        .unwrap_or_else(|| "the recorded fingerprint does not match its configuration".into());
    let fix = if diff.starts_with("data.") {
        "resume on the data, tokenizer and chat template it was trained on (each is recorded by its size and sha256, not its path)".to_string()
    } else if diff.starts_with("batch_size") || diff.starts_with("accumulation") {
        batch_fix(&state.identity, identity)
    } else {
        "resume with the configuration it was saved with".to_string()
    };
    Err(EngineError::bad_file(
        dir.join(STATE_FILE),
        format!("checkpoint belongs to another run configuration ({diff}, checkpoint vs this run); {fix}"),
    ))
}

/// What to do about a resume whose micro-batch (`batch_size`) or number of micro-batches a step
/// (`accumulation`) differs from the checkpoint's `saved` identity: both global batches named,
/// and the keys to set.
fn batch_fix(saved: &serde_json::Value, now: &serde_json::Value) -> String {
    let batch = |identity: &serde_json::Value| {
        let size = identity["batch_size"].as_u64().unwrap_or(0);
        let accumulation = identity["accumulation"].as_u64().unwrap_or(1);
        (size, accumulation)
    };
    let ((size, accumulation), (now_size, now_accumulation)) = (batch(saved), batch(now));
    format!(
        "the global batch would go from {} to {} samples a step (batch_size × accumulation: {size} × {accumulation} saved, {now_size} × {now_accumulation} now), so every later step would train on other samples than the run it continues; set batch_size: {size} and training.accumulation: {accumulation} (another world size needs neither: it divides the accumulation)",
        size * accumulation,
        now_size * now_accumulation
    )
}

/// Fails when `dir` is named for another step (`step-N`) than its state's `global_step`: a
/// checkpoint copied or renamed over another would resume at a step other than the one named.
fn check_step(dir: &Path, state: &TrainerState) -> Result<()> {
    let named = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(step_of_dir_name);
    match named {
        Some(step) if step != state.global_step => Err(EngineError::bad_file(
            dir.join(STATE_FILE),
            format!(
                "holds the state after {} steps, but its directory is named for step {step} (copied or renamed?); resume from a checkpoint whose directory names its own step",
                state.global_step
            ),
        )),
        _ => Ok(()),
    }
}

/// What a damaged file's error tells to do instead.
pub(super) const EARLIER: &str = "resume from an earlier checkpoint";

/// The error for the file at `path`, recorded as `record`, whose bytes `damaged` do not match
/// their checksum (named unless they are the whole file).
fn checksum_mismatch(path: &Path, record: &FileRecord, damaged: Range<u64>) -> EngineError {
    let at = match damaged == (0..record.bytes) {
        true => String::new(),
        false => format!(" in bytes {}..{}", damaged.start, damaged.end),
    };
    EngineError::bad_file(
        path,
        format!("checksum mismatch{at}: the file changed after it was written (corruption?); restore it or {EARLIER}"),
    )
}

/// Reads the whole file at `path` and fails if it does not match its checksum.
fn verify_checksum(path: &Path, record: &FileRecord) -> Result<()> {
    match files::read_verified(path, record, Vec::new())? {
        None => Ok(()),
        Some(damaged) => Err(checksum_mismatch(path, record, damaged)),
    }
}

/// `err` about a file's content, unless the file does not match its checksum: then that is
/// the error, since damage explains any content error.
fn content_error(path: &Path, record: &FileRecord, err: EngineError) -> EngineError {
    match verify_checksum(path, record) {
        Ok(()) => err,
        Err(damaged) => damaged,
    }
}

/// Each tensor's bytes, in parameter order.
fn byte_slices(p: &mut Params<Tensor<f32>>) -> Vec<&mut [u8]> {
    p.tensors_mut()
        .into_iter()
        .map(|t| bytemuck::cast_slice_mut(t.as_mut_slice()))
        .collect()
}

/// Where a checkpoint's tensors are: two files of whole tensors, or chunks listed by an index.
enum Source<'a> {
    /// `model.safetensors` and `optimizer.safetensors`.
    Whole {
        model: Header<'a>,
        optimizer: Header<'a>,
    },
    /// A sharded checkpoint's index (see [`shards`]).
    Sharded { path: PathBuf, index: shards::Index },
}

/// Where one tensor's bytes are.
enum Place<'i> {
    /// At this offset of this file, whole.
    At(&'static str, u64),
    /// In these chunks.
    Chunks(&'i shards::TensorIndex),
}

impl Place<'_> {
    /// Adds the reads that fill `bytes` from this place to `regions` (by file), each chunk's
    /// hash blocks hashed into `slots` as it is read where there are slots.
    fn add_regions<'b>(
        &self,
        bytes: &'b mut [u8],
        slots: &'b [OnceLock<u128>],
        regions: &mut BTreeMap<String, Vec<Region<'b>>>,
    ) {
        match self {
            Place::At(file, offset) => regions
                .entry(file.to_string())
                .or_default()
                .push(Region::plain(*offset, bytes)),
            Place::Chunks(tensor) => {
                let whole = bytes.len();
                let mut at = 0;
                for (file, offset, into) in shards::regions(tensor, bytes) {
                    let blocks = (!slots.is_empty()).then_some(BlockSlots {
                        at,
                        bytes: whole,
                        digests: slots,
                    });
                    at += into.len();
                    regions.entry(file).or_default().push(Region {
                        offset,
                        into,
                        blocks,
                    });
                }
            }
        }
    }
}

impl Source<'_> {
    /// The place of each `spec.name + suffix`, from the optimizer's tensors or the model's,
    /// checking that it is present, f32 and of the spec's shape.
    fn places(
        &self,
        specs: &[ParamSpec],
        in_optimizer: bool,
        suffix: &str,
    ) -> Result<Vec<Place<'_>>> {
        match self {
            Source::Whole { model, optimizer } => {
                let (header, file) = if in_optimizer {
                    (optimizer, OPTIMIZER_FILE)
                } else {
                    (model, MODEL_FILE)
                };
                Ok(header
                    .offsets(specs, suffix)?
                    .into_iter()
                    .map(|at| Place::At(file, at))
                    .collect())
            }
            Source::Sharded { path, index } => {
                let list = if in_optimizer {
                    &index.optimizer
                } else {
                    &index.model
                };
                specs
                    .iter()
                    .map(|spec| {
                        let name = format!("{}{suffix}", spec.name);
                        let tensor = list
                            .iter()
                            .find(|t| t.name == name)
                            .ok_or_else(|| format!("tensor {name} is missing"));
                        tensor
                            .and_then(|t| {
                                match_spec(&name, &t.shape, t.dtype, spec)
                                    .map(|()| Place::Chunks(t))
                            })
                            .map_err(|m| EngineError::bad_file(path, m))
                    })
                    .collect()
            }
        }
    }

    /// Whether the optimizer's tensors hold one named `name`.
    fn holds_optimizer(&self, name: &str) -> bool {
        match self {
            Source::Whole { optimizer, .. } => optimizer.meta.info(name).is_some(),
            Source::Sharded { index, .. } => index.optimizer.iter().any(|t| t.name == name),
        }
    }

    /// The file that holds, or lists, the optimizer's tensors.
    fn optimizer_path(&self) -> &Path {
        match self {
            Source::Whole { optimizer, .. } => optimizer.path,
            Source::Sharded { path, .. } => path,
        }
    }
}

/// Fails unless a tensor `name` of `shape` and `dtype` is what `spec` needs: f32 of its shape.
pub(super) fn match_spec(
    name: &str,
    shape: &[usize],
    dtype: Dtype,
    spec: &ParamSpec,
) -> std::result::Result<(), String> {
    if shape != spec.shape {
        return Err(format!(
            "{name} has shape {shape:?}, the config needs {:?}",
            spec.shape
        ));
    }
    if dtype != Dtype::F32 {
        return Err(format!("{name} has dtype {dtype}, expected F32"));
    }
    Ok(())
}

/// A safetensors file's header, parsed from its memory map (only the header's pages are read).
struct Header<'a> {
    path: &'a Path,
    record: &'a FileRecord,
    /// File offset of the data section.
    data_start: u64,
    meta: Metadata,
}

impl<'a> Header<'a> {
    fn read(path: &'a Path, record: &'a FileRecord, bytes: &[u8]) -> Result<Self> {
        match SafeTensors::read_metadata(bytes) {
            Ok((n, meta)) => Ok(Header {
                path,
                record,
                data_start: (8 + n) as u64,
                meta,
            }),
            Err(e) => Err(content_error(
                path,
                record,
                EngineError::bad_file(path, format!("not a valid safetensors file: {e}")),
            )),
        }
    }

    /// The file offset of each `spec.name + suffix`, checking that it is present, f32 and of
    /// the spec's shape.
    fn offsets(&self, specs: &[ParamSpec], suffix: &str) -> Result<Vec<u64>> {
        specs
            .iter()
            .map(|spec| {
                self.offset(spec, suffix).map_err(|m| {
                    content_error(self.path, self.record, EngineError::bad_file(self.path, m))
                })
            })
            .collect()
    }

    fn offset(&self, spec: &ParamSpec, suffix: &str) -> std::result::Result<u64, String> {
        let name = format!("{}{suffix}", spec.name);
        let info = self
            .meta
            .info(&name)
            .ok_or_else(|| format!("tensor {name} is missing"))?;
        match_spec(&name, &info.shape, info.dtype, spec)?;
        Ok(self.data_start + info.data_offsets.0 as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::super::files::sha256_hex;
    use super::super::testing::{config, save_step};
    use super::super::STATE_SUM_FILE;
    use super::*;

    /// Rewrites the trainer state of the checkpoint `dir` with `edit`, its checksum with it.
    fn edit_state(dir: &Path, edit: impl FnOnce(&mut TrainerState)) {
        let mut state = state_file::read(dir).ok().unwrap().state;
        edit(&mut state);
        let bytes = serde_json::to_vec(&state).unwrap();
        std::fs::write(dir.join(STATE_FILE), &bytes).unwrap();
        let sum = format!("{}  {STATE_FILE}\n", sha256_hex(&bytes));
        std::fs::write(dir.join(STATE_SUM_FILE), sum).unwrap();
    }

    fn load_error(dir: &Path) -> String {
        let state = state_file::read(dir).ok().unwrap().state;
        let req = LoadRequest {
            config: &config(),
            identity: state.identity,
            master_in_optimizer: false,
            master_category: Category::Params,
            fresh_moments_if_missing: false,
        };
        match load(&MemoryTracker::new(u64::MAX), dir, &req) {
            Ok(_) => panic!("{} loaded", dir.display()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_state_listing_a_file_outside_its_checkpoint_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        for name in ["sub/model.safetensors", ".hidden"] {
            let dir = save_step(&tmp.path().join(name.replace(['/', '.'], "_")), 1);
            edit_state(&dir, |s| {
                let record = s.files[MODEL_FILE].clone();
                s.files.insert(name.into(), record);
            });
            let e = load_error(&dir);
            assert!(
                e.contains(&format!("lists an invalid file name {name:?}")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_resume_changing_the_micro_batch_or_the_global_batch_names_both_and_the_keys() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_step(tmp.path(), 1);
        let mut state = state_file::read(&dir).ok().unwrap().state;
        state.identity = serde_json::json!({"batch_size": 4, "accumulation": 4});
        state.fingerprint = fingerprint(&state.identity);
        let refused =
            |now: serde_json::Value| check_identity(&dir, &state, &now).unwrap_err().to_string();
        let e = refused(serde_json::json!({"batch_size": 2, "accumulation": 4}));
        assert!(
            e.contains("(batch_size: 4 vs 2, checkpoint vs this run)"),
            "{e}"
        );
        assert!(
            e.contains("the global batch would go from 16 to 8 samples a step"),
            "{e}"
        );
        assert!(
            e.contains("set batch_size: 4 and training.accumulation: 4"),
            "{e}"
        );
        let e = refused(serde_json::json!({"batch_size": 4}));
        assert!(
            e.contains(
                "from 16 to 4 samples a step (batch_size × accumulation: 4 × 4 saved, 4 × 1 now)"
            ),
            "{e}"
        );
        let e = refused(serde_json::json!({"batch_size": 4, "accumulation": 4, "seq_len": 8}));
        assert!(
            e.ends_with("resume with the configuration it was saved with"),
            "{e}"
        );
    }

    #[test]
    fn identity_needs_both_the_fingerprint_and_the_recorded_identity() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_step(tmp.path(), 1);
        let state = state_file::read(&dir).ok().unwrap().state;
        let identity = state.identity.clone();
        check_identity(&dir, &state, &identity).unwrap();
        let mut wrong_print = state.clone();
        wrong_print.fingerprint = fingerprint(&serde_json::json!({"model": "another"}));
        assert!(check_identity(&dir, &wrong_print, &identity).is_err());
        let mut wrong_identity = state.clone();
        wrong_identity.identity = serde_json::json!({"model": "another"});
        assert!(check_identity(&dir, &wrong_identity, &identity).is_err());
    }

    #[test]
    fn a_checksum_mismatch_names_the_damaged_bytes_unless_they_are_the_whole_file() {
        let record = super::super::files::record(&[7u8; 100]);
        let path = Path::new("dir/optimizer.safetensors");
        let whole = checksum_mismatch(path, &record, 0..100).to_string();
        assert!(whole.contains("optimizer.safetensors"), "{whole}");
        assert!(
            whole.contains("checksum mismatch: the file changed"),
            "{whole}"
        );
        let part = checksum_mismatch(path, &record, 16..32).to_string();
        assert!(
            part.contains("checksum mismatch in bytes 16..32: the file changed"),
            "{part}"
        );
    }
}
