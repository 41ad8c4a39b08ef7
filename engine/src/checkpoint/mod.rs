//! Checkpoints: one directory per step holding `model.safetensors` + `config.json` (loadable by
//! Hugging Face transformers), `optimizer.safetensors` (AdamW moments, fp32 master weights where
//! the precision keeps them) and `trainer_state.json` (see [`state`]).
//!
//! Saving writes a temporary directory beside the final one, fsyncs every file and the directory,
//! renames it into place, then replaces the `latest` pointer by rename: a crash at any instant
//! leaves the previous checkpoint loadable. Loading checks presence, sizes, the run's
//! configuration, dtypes and shapes, allocates every tensor in its final place, and reads each
//! file once straight into them while verifying its checksum; it names exactly what is wrong.

pub mod files;
pub mod state;
mod verify;

use crate::backend::CpuDevice;
use crate::error::{EngineError, Result};
use crate::memory::Category;
use crate::model::{param_specs, LlamaConfig, ParamSpec, Params};
use crate::optim::Moments;
use crate::tensor::{Elem, Tensor};
use files::{rename_synced, sync_dir, write_synced, MappedFile};
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};
use state::{first_difference, FileRecord, TrainerState, VersionProbe, FORMAT_VERSION};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
pub use verify::{verify, FileVerdict};

/// The weights file, in Hugging Face's layout.
pub const MODEL_FILE: &str = "model.safetensors";
/// The Hugging Face configuration.
pub const CONFIG_FILE: &str = "config.json";
/// AdamW state and master weights.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Step, schedule, loader, RNG, fingerprint and checksums.
pub const STATE_FILE: &str = "trainer_state.json";
/// The file in a run directory naming its newest checkpoint.
pub const LATEST_FILE: &str = "latest";

/// The directory name of the checkpoint after `step` steps.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// One tensor to write: name, dtype, shape and raw little-endian bytes.
pub struct Entry<'a> {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Raw bytes: borrowed from a host tensor, or a copy fetched from a device.
    pub data: Cow<'a, [u8]>,
}

impl<'a> Entry<'a> {
    /// An entry for a tensor.
    pub fn tensor<E: Elem>(name: String, t: &'a Tensor<E>) -> Self {
        Entry {
            name,
            dtype: match E::DTYPE {
                crate::tensor::DType::F32 => Dtype::F32,
                crate::tensor::DType::Bf16 => Dtype::BF16,
            },
            shape: t.shape().to_vec(),
            data: Cow::Borrowed(t.as_bytes()),
        }
    }
}

/// sha256 over entries' names, dtypes, shapes and bytes, in order.
pub fn entries_digest(entries: &[Entry<'_>]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for e in entries {
        h.update(format!("{}:{}:{:?}:", e.name, e.dtype, e.shape).as_bytes());
        h.update(&e.data);
    }
    format!("{:x}", h.finalize())
}

/// Writes a safetensors file straight from tensor buffers (no staging copy), fsynced.
fn write_safetensors(path: &Path, entries: &[Entry<'_>]) -> Result<FileRecord> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0usize;
    for e in entries {
        let end = offset + e.data.len();
        header.insert(
            e.name.clone(),
            serde_json::json!({"dtype": e.dtype.to_string(), "shape": e.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut header = serde_json::to_vec(&header).expect("plain JSON");
    header.resize(header.len().next_multiple_of(8), b' ');
    let len = (header.len() as u64).to_le_bytes();
    let mut parts: Vec<&[u8]> = vec![&len, &header];
    parts.extend(entries.iter().map(|e| &*e.data));
    write_synced(path, &parts)
}

/// What a checkpoint holds, borrowed from a trainer.
pub struct SaveRequest<'a> {
    /// Model shape.
    pub config: &'a LlamaConfig,
    /// `model.safetensors` tensors (the weights the passes use) in Hugging Face names.
    pub model: Vec<Entry<'a>>,
    /// `optimizer.safetensors` tensors.
    pub optimizer: Vec<Entry<'a>>,
    /// `trainer_state.json` without `files` (filled in here).
    pub state: TrainerState,
}

/// Writes a checkpoint for `req.state.global_step` into `run_dir`, atomically, points `latest` at
/// it and keeps only the newest `keep_last` checkpoints. Returns the checkpoint's directory.
pub fn save(run_dir: &Path, req: SaveRequest<'_>, keep_last: Option<usize>) -> Result<PathBuf> {
    std::fs::create_dir_all(run_dir).map_err(|e| EngineError::io(run_dir, e))?;
    remove_stale_temporaries(run_dir)?;
    let name = step_dir_name(req.state.global_step);
    let tmp = run_dir.join(format!(".tmp-{name}-{}", std::process::id()));
    std::fs::create_dir(&tmp).map_err(|e| EngineError::io(&tmp, e))?;

    let mut state = req.state;
    // The two tensor files are written concurrently: hashing one need not wait for the other.
    let (model, optimizer) = std::thread::scope(|scope| {
        let model = scope.spawn(|| write_safetensors(&tmp.join(MODEL_FILE), &req.model));
        let optimizer = write_safetensors(&tmp.join(OPTIMIZER_FILE), &req.optimizer);
        (model.join().expect("writing does not panic"), optimizer)
    });
    state.files.insert(MODEL_FILE.into(), model?);
    state.files.insert(OPTIMIZER_FILE.into(), optimizer?);
    let config = serde_json::to_vec_pretty(&req.config.to_hf_json()).expect("plain JSON");
    let record = write_synced(&tmp.join(CONFIG_FILE), &[&config])?;
    state.files.insert(CONFIG_FILE.into(), record);
    let state_json = serde_json::to_vec_pretty(&state).expect("plain JSON");
    write_synced(&tmp.join(STATE_FILE), &[&state_json])?;
    sync_dir(&tmp)?;

    let dest = run_dir.join(&name);
    if dest.exists() {
        // Re-saving a step: move the old copy aside first so the rename below cannot fail on a
        // non-empty directory, and `latest` never points at a half-replaced one.
        let old = run_dir.join(format!(".old-{name}-{}", std::process::id()));
        rename_synced(&dest, &old, run_dir)?;
        rename_synced(&tmp, &dest, run_dir)?;
        std::fs::remove_dir_all(&old).map_err(|e| EngineError::io(&old, e))?;
    } else {
        rename_synced(&tmp, &dest, run_dir)?;
    }
    let pointer = run_dir.join(format!(".{LATEST_FILE}.tmp"));
    write_synced(&pointer, &[format!("{name}\n").as_bytes()])?;
    rename_synced(&pointer, &run_dir.join(LATEST_FILE), run_dir)?;
    if let Some(keep) = keep_last {
        prune(run_dir, keep.max(1), &name)?;
    }
    Ok(dest)
}

/// Removes temporary directories a crashed save left behind.
fn remove_stale_temporaries(run_dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(run_dir).map_err(|e| EngineError::io(run_dir, e))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".tmp-") || name.starts_with(".old-") {
            let path = entry.path();
            std::fs::remove_dir_all(&path).map_err(|e| EngineError::io(&path, e))?;
        }
    }
    Ok(())
}

/// The checkpoint directories of a run, oldest first.
pub fn list(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(run_dir).map_err(|e| EngineError::io(run_dir, e))?;
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
        })
        .collect();
    dirs.sort();
    Ok(dirs)
}

fn prune(run_dir: &Path, keep: usize, latest: &str) -> Result<()> {
    let dirs = list(run_dir)?;
    let excess = dirs.len().saturating_sub(keep);
    for dir in dirs.into_iter().take(excess) {
        if dir.file_name().is_some_and(|n| n == latest) {
            continue;
        }
        std::fs::remove_dir_all(&dir).map_err(|e| EngineError::io(&dir, e))?;
    }
    Ok(())
}

/// The checkpoint a path names: a checkpoint directory itself, or a run directory whose
/// `latest` file names one.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    let pointer = path.join(LATEST_FILE);
    if path.join(STATE_FILE).exists() || !pointer.exists() {
        return Ok(path.to_path_buf());
    }
    let name = std::fs::read_to_string(&pointer).map_err(|e| EngineError::io(&pointer, e))?;
    let name = name.trim();
    if name.is_empty() || name.contains('/') {
        return Err(EngineError::bad_file(
            &pointer,
            format!("names {name:?}, not a checkpoint directory of this run"),
        ));
    }
    Ok(path.join(name))
}

/// A verified checkpoint, tensors loaded onto a device.
pub struct Loaded {
    /// The trainer state.
    pub state: TrainerState,
    /// f32 master weights (from the optimizer file in bf16-mixed, else from the model file).
    pub master: Params<Tensor<f32>>,
    /// AdamW moments, if the optimizer had taken a step.
    pub moments: Option<Moments>,
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

/// sha256 of a canonical JSON value.
pub fn fingerprint(identity: &serde_json::Value) -> String {
    files::sha256_hex(
        serde_json::to_string(identity)
            .expect("plain JSON")
            .as_bytes(),
    )
}

/// Reads and verifies the checkpoint at `dir` (a checkpoint or a run directory).
pub fn load(dev: &CpuDevice, dir: &Path, req: &LoadRequest<'_>) -> Result<Loaded> {
    let dir = resolve(dir)?;
    let state = read_state(&dir)?;
    if state.fingerprint != fingerprint(&req.identity) || state.identity != req.identity {
        let diff = first_difference(&state.identity, &req.identity, "")
            .unwrap_or_else(|| "the recorded fingerprint does not match its configuration".into());
        return Err(EngineError::bad_file(
            dir.join(STATE_FILE),
            format!("checkpoint belongs to another run configuration ({diff}, checkpoint vs this run); resume with the configuration it was saved with"),
        ));
    }
    for name in [MODEL_FILE, OPTIMIZER_FILE, CONFIG_FILE] {
        if !state.files.contains_key(name) {
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
    verify_checksum(config_path, &state.files[CONFIG_FILE])?;
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
    let header = |name: &str| {
        let (path, file) = &mapped[name];
        Header::read(path, &state.files[name], file.bytes())
    };
    let (model, opt) = (header(MODEL_FILE)?, header(OPTIMIZER_FILE)?);
    let specs = param_specs(req.config);
    let (master_file, master_suffix) = if req.master_in_optimizer {
        (&opt, ".master")
    } else {
        (&model, "")
    };
    let master_at = master_file.offsets(&specs, master_suffix)?;
    let has_moments = specs
        .first()
        .is_some_and(|s| opt.meta.info(&format!("{}.exp_avg", s.name)).is_some());
    let moments_at = if state.optimizer_step == 0 {
        None
    } else if has_moments {
        Some([
            opt.offsets(&specs, ".exp_avg")?,
            opt.offsets(&specs, ".exp_avg_sq")?,
        ])
    } else if req.fresh_moments_if_missing {
        None
    } else {
        return Err(EngineError::bad_file(
            opt.path,
            format!(
                "holds no AdamW moments although the optimizer took {} steps; the checkpoint is incomplete; resume from a checkpoint saved with its moments",
                state.optimizer_step
            ),
        ));
    };

    // Every tensor is allocated in its final place, then each file is read once into them.
    let zeros = |category: Category| move |s: &ParamSpec| dev.zeros::<f32>(&s.shape, category);
    let mut master = Params::try_new(req.config, zeros(req.master_category))?;
    let fresh_moments = state.optimizer_step > 0 && moments_at.is_none();
    let mut moments = if moments_at.is_some() || fresh_moments {
        Some(Moments {
            exp_avg: Params::try_new(req.config, zeros(Category::Optimizer))?,
            exp_avg_sq: Params::try_new(req.config, zeros(Category::Optimizer))?,
        })
    } else {
        None
    };
    let mut regions: BTreeMap<&str, Vec<(u64, &mut [u8])>> = BTreeMap::new();
    let master_name = if req.master_in_optimizer {
        OPTIMIZER_FILE
    } else {
        MODEL_FILE
    };
    regions
        .entry(master_name)
        .or_default()
        .extend(master_at.into_iter().zip(byte_slices(&mut master)));
    if let (Some(m), Some([avg_at, sq_at])) = (moments.as_mut(), moments_at) {
        let opt_regions = regions.entry(OPTIMIZER_FILE).or_default();
        opt_regions.extend(avg_at.into_iter().zip(byte_slices(&mut m.exp_avg)));
        opt_regions.extend(sq_at.into_iter().zip(byte_slices(&mut m.exp_avg_sq)));
    }
    let reads: Vec<(&PathBuf, Result<bool>)> = std::thread::scope(|scope| {
        let running: Vec<_> = mapped
            .iter()
            .filter(|(name, _)| name.as_str() != CONFIG_FILE)
            .map(|(name, (path, _))| {
                let record = &state.files[name];
                let regions = regions.remove(name.as_str()).unwrap_or_default();
                (
                    path,
                    scope.spawn(move || files::read_verified(path, record, regions)),
                )
            })
            .collect();
        running
            .into_iter()
            .map(|(path, reading)| (path, reading.join().expect("reading does not panic")))
            .collect()
    });
    for (path, read) in reads {
        if !read? {
            return Err(checksum_mismatch(path));
        }
    }
    if cfg!(target_endian = "big") {
        let tensors = master
            .tensors_mut()
            .into_iter()
            .chain(moments.iter_mut().flat_map(|m| {
                m.exp_avg
                    .tensors_mut()
                    .into_iter()
                    .chain(m.exp_avg_sq.tensors_mut())
            }));
        for t in tensors {
            t.as_mut_slice()
                .iter_mut()
                .for_each(|x| *x = f32::from_bits(x.to_bits().swap_bytes()));
        }
    }
    Ok(Loaded {
        state,
        master,
        moments,
    })
}

fn read_state(dir: &Path) -> Result<TrainerState> {
    let path = dir.join(STATE_FILE);
    if !dir.is_dir() {
        return Err(EngineError::bad_file(dir, "is not a checkpoint directory"));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| EngineError::io(&path, e))?;
    let probe: VersionProbe = serde_json::from_str(&text).map_err(|e| {
        EngineError::bad_file(
            &path,
            format!("not a trainer state ({e}); the file is damaged"),
        )
    })?;
    if probe.format_version > FORMAT_VERSION {
        return Err(EngineError::bad_file(
            &path,
            format!(
                "format version {} was written by a newer ckpt-harness; this build reads up to version {FORMAT_VERSION}; upgrade to load it",
                probe.format_version
            ),
        ));
    }
    serde_json::from_str(&text)
        .map_err(|e| EngineError::bad_file(&path, format!("{e}; the file is damaged")))
}

fn checksum_mismatch(path: &Path) -> EngineError {
    EngineError::bad_file(
        path,
        "checksum mismatch: the file changed after it was written (corruption?); restore it or resume from an earlier checkpoint",
    )
}

/// Reads the whole file at `path` and fails if it does not match its checksum.
fn verify_checksum(path: &Path, record: &FileRecord) -> Result<()> {
    if files::read_verified(path, record, Vec::new())? {
        Ok(())
    } else {
        Err(checksum_mismatch(path))
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
        if info.shape != spec.shape {
            return Err(format!(
                "{name} has shape {:?}, the config needs {:?}",
                info.shape, spec.shape
            ));
        }
        if info.dtype != Dtype::F32 {
            return Err(format!("{name} has dtype {}, expected F32", info.dtype));
        }
        Ok(self.data_start + info.data_offsets.0 as u64)
    }
}
