//! Models too large to run here, refused when the suite is read rather than by an allocation
//! that fails (or a process the system kills) once it runs: a lower bound on what the model
//! holds, from its shape alone, against the memory it would run in.

use ckpt_engine::memory::human_bytes;
use ckpt_engine::{LlamaConfig, Precision, Setting};

/// Bytes the engine's tables of a model's tensors (names, shapes, where each projection lives)
/// hold per layer at least, on the host whatever the device.
const TABLE_BYTES_PER_LAYER: u128 = 256;

/// Why `model` cannot run: its tables of tensors alone exceed `host` (the host memory this
/// process may allocate), or, on the CPU (`cpu`) without a `memory.capacity` of the suite's
/// (`capacity`: a suite that sets one may mean to run out of it), its weights alone exceed
/// `host`. The message names the key to change first, for its place in the file.
pub fn too_large(
    model: &LlamaConfig,
    precision: Precision,
    cpu: bool,
    capacity: Option<u64>,
    host: Option<u64>,
) -> Option<Setting> {
    let layers = model.num_hidden_layers as u128;
    let tables = layers * TABLE_BYTES_PER_LAYER;
    if let Some(host) = host.filter(|&h| tables > h as u128) {
        return Some(Setting::new(
            "num_hidden_layers",
            format!(
                "num_hidden_layers is {layers}: the engine's tables of its tensors alone take at least {} on the host, which has {} available; write fewer layers",
                human(tables),
                human_bytes(host)
            ),
        ));
    }
    let limit = host.filter(|_| cpu && capacity.is_none())?;
    let (h, v) = (model.hidden_size as u128, model.vocab_size as u128);
    let d = model.head_dim() as u128;
    let (q, kv) = (
        model.num_attention_heads as u128 * d,
        model.num_key_value_heads as u128 * d,
    );
    // Every family's layer holds its attention's projections and two norms at least.
    let per_layer = 2 * h * q + 2 * h * kv + 2 * h;
    let embedding = v * h;
    let params = embedding + layers * per_layer;
    let per_param: u128 = match precision {
        Precision::Fp32 => 4,
        Precision::Bf16Mixed => 6,
    };
    let weights = params * per_param;
    if weights <= limit as u128 {
        return None;
    }
    let (key, sizes) = if embedding >= layers * per_layer {
        (
            "vocab_size",
            format!("vocab_size is {v} and hidden_size {h}"),
        )
    } else if h > layers {
        (
            "hidden_size",
            format!("hidden_size is {h} and num_hidden_layers {layers}"),
        )
    } else {
        (
            "num_hidden_layers",
            format!("num_hidden_layers is {layers} and hidden_size {h}"),
        )
    };
    Some(Setting::new(
        key,
        format!(
            "{sizes}: its weights alone take at least {} ({params} parameters at {per_param} bytes), more than the {} of host memory the CPU device may use; write a smaller model",
            human(weights),
            human_bytes(limit)
        ),
    ))
}

/// `bytes` for people, however large.
fn human(bytes: u128) -> String {
    u64::try_from(bytes).map_or_else(|_| format!("{bytes} B"), human_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(layers: usize, hidden: usize, vocab: usize) -> LlamaConfig {
        LlamaConfig {
            max_position_embeddings: 64,
            ..LlamaConfig::new(vocab, hidden, 88, layers, 4, 4)
        }
    }

    #[test]
    fn a_model_whose_tables_exceed_the_host_is_refused_at_its_layers() {
        let m = model(100_000_000, 32, 64);
        let e = too_large(&m, Precision::Fp32, false, None, Some(1 << 30)).unwrap();
        assert_eq!(e.key, "num_hidden_layers");
        let e = e.message;
        assert!(
            e.starts_with("num_hidden_layers is 100000000: the engine's tables of its tensors alone take at least 23.8 GiB on the host, which has 1.0 GiB available"),
            "{e}"
        );
    }

    #[test]
    fn weights_beyond_the_cpu_s_memory_are_refused_naming_the_largest_part() {
        let host = Some(1 << 30);
        let deep = model(1_000_000, 32, 64);
        let e = too_large(&deep, Precision::Fp32, true, None, host).unwrap();
        assert_eq!(e.key, "num_hidden_layers");
        let e = e.message;
        assert!(
            e.starts_with(
                "num_hidden_layers is 1000000 and hidden_size 32: its weights alone take at least"
            ),
            "{e}"
        );
        let wide = model(2, 32, 100_000_000);
        let e = too_large(&wide, Precision::Bf16Mixed, true, None, host).unwrap();
        assert_eq!(e.key, "vocab_size");
        let e = e.message;
        assert!(e.starts_with("vocab_size is 100000000 and hidden_size 32: its weights alone take at least 17.9 GiB (3200"), "{e}");
        assert!(
            e.contains("at 6 bytes), more than the 1.0 GiB of host memory"),
            "{e}"
        );
        // Not on CUDA alone, nor under a capacity of the suite's own (which it may run out of).
        assert_eq!(too_large(&wide, Precision::Fp32, false, None, host), None);
        assert_eq!(too_large(&wide, Precision::Fp32, true, Some(1), host), None);
        assert_eq!(
            too_large(&model(2, 32, 64), Precision::Fp32, true, None, host),
            None
        );
    }
}
