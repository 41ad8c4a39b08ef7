//! Initial weights: read from a Hugging Face Llama directory, or drawn from a seeded generator;
//! and named f32 tensors written back to safetensors.

use super::config::LlamaConfig;
use super::params::{param_specs, ParamSpec, Params};
use crate::error::{EngineError, Result};
use crate::memory::{Category, MemoryTracker};
use crate::tensor::Tensor;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::Path;

/// Reads a whole regular file, naming it on failure (a FIFO or a device is refused unread).
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    crate::regular_file::read(path, "a safetensors file of weights")
}

/// Parses safetensors bytes, naming the file on failure.
pub fn parse_safetensors<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| EngineError::bad_file(path, format!("not a valid safetensors file: {e}")))
}

/// A floating-point tensor's values widened to f32 (F32, BF16 and F16 are accepted).
pub fn tensor_f32(
    path: &Path,
    name: &str,
    view: &safetensors::tensor::TensorView<'_>,
) -> Result<Vec<f32>> {
    let data = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(EngineError::bad_file(
                path,
                format!("{name} has dtype {other:?}; expected F32, BF16 or F16"),
            ))
        }
    })
}

/// Reads `config.json` and `model.safetensors` from a Hugging Face Llama directory.
pub fn load_hf_dir(
    host: &MemoryTracker,
    dir: &Path,
    category: Category,
) -> Result<(LlamaConfig, Params<Tensor<f32>>)> {
    let cfg = LlamaConfig::from_hf_file(&dir.join("config.json"))?;
    let path = dir.join("model.safetensors");
    let bytes = read_file(&path)?;
    let params = load_params(host, &cfg, &path, &bytes, category)?;
    Ok((cfg, params))
}

/// Builds every parameter of `cfg` from safetensors `bytes` read from `path`. A missing, extra
/// or mis-shaped tensor is an error naming it.
pub fn load_params(
    host: &MemoryTracker,
    cfg: &LlamaConfig,
    path: &Path,
    bytes: &[u8],
    category: Category,
) -> Result<Params<Tensor<f32>>> {
    let st = parse_safetensors(path, bytes)?;
    let specs = param_specs(cfg);
    let expected: std::collections::BTreeSet<&str> =
        specs.iter().map(|s| s.name.as_str()).collect();
    let mut extra: Vec<String> = st
        .names()
        .into_iter()
        .filter(|n| !expected.contains(*n))
        .map(|n| n.to_string())
        .collect();
    extra.sort();
    // Tied checkpoints sometimes carry the head anyway; accept it only if it is the embedding.
    if cfg.tie_word_embeddings && extra.iter().any(|n| n == "lm_head.weight") {
        let head = tensor_f32(
            path,
            "lm_head.weight",
            &st.tensor("lm_head.weight").expect("listed"),
        )?;
        let embed = st
            .tensor("model.embed_tokens.weight")
            .map_err(|_| missing(path, "model.embed_tokens.weight"))?;
        if head != tensor_f32(path, "model.embed_tokens.weight", &embed)? {
            return Err(EngineError::bad_file(
                path,
                "lm_head.weight differs from model.embed_tokens.weight but config.json sets tie_word_embeddings: true; set it to false or remove lm_head.weight",
            ));
        }
        extra.retain(|n| n != "lm_head.weight");
    }
    if let Some(name) = extra.first() {
        return Err(EngineError::bad_file(
            path,
            format!("unexpected tensor {name}: the Llama config has no such parameter (is config.json from another model?)"),
        ));
    }
    Params::try_new(cfg, |spec| {
        let view = st
            .tensor(&spec.name)
            .map_err(|_| missing(path, &spec.name))?;
        if view.shape() != spec.shape.as_slice() {
            return Err(EngineError::bad_file(
                path,
                format!(
                    "{} has shape {:?}, the config needs {:?}",
                    spec.name,
                    view.shape(),
                    spec.shape
                ),
            ));
        }
        let values = tensor_f32(path, &spec.name, &view)?;
        Ok(Tensor::from_f32(host, &spec.shape, &values, category)?)
    })
}

fn missing(path: &Path, name: &str) -> EngineError {
    EngineError::bad_file(path, format!("tensor {name} is missing"))
}

/// Seeded random weights: matrices from N(0, std²), norms one. The same seed gives the same
/// weights on every machine.
pub fn init_params(
    host: &MemoryTracker,
    cfg: &LlamaConfig,
    seed: u64,
    std: f32,
    category: Category,
) -> Result<Params<Tensor<f32>>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let normal = Normal::new(0.0f32, std)
        .map_err(|e| EngineError::Config(format!("init std {std}: {e}")))?;
    Params::try_new(cfg, |spec: &ParamSpec| {
        let mut t = Tensor::<f32>::zeros(host, &spec.shape, category)?;
        if spec.is_norm {
            t.fill(1.0);
        } else {
            t.as_mut_slice()
                .iter_mut()
                .for_each(|x| *x = normal.sample(&mut rng));
        }
        Ok(t)
    })
}

/// Writes named f32 tensors as a safetensors file.
pub fn save_f32_tensors(
    path: &Path,
    tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) -> Result<()> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (shape, data))| {
            let view = safetensors::tensor::TensorView::new(
                Dtype::F32,
                shape.clone(),
                bytemuck::cast_slice(data),
            )
            .expect("shape matches data");
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| EngineError::bad_file(path, format!("could not write safetensors: {e}")))
}
