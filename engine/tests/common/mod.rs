//! Shared builders for the training-loop tests: a tiny Llama, as a Qwen3-MoE too, and a short
//! run on synthetic data.

// Every test crate compiles this module; not every one uses each builder.
#![allow(dead_code)]

use ckpt_engine::config::{Init, Precision, TrainConfig};
use ckpt_engine::data::DataConfig;
use ckpt_engine::model::config::MoeConfig;
use ckpt_engine::model::{Family, LlamaConfig};
use ckpt_engine::optim::Schedule;

/// A Llama with grouped-query attention (4 query heads, 2 key/value heads), an MLP twice the
/// residual width and untied embeddings.
pub fn llama(vocab: usize, hidden: usize, layers: usize) -> LlamaConfig {
    LlamaConfig {
        max_position_embeddings: 128,
        ..LlamaConfig::new(vocab, hidden, 2 * hidden, layers, 4, 2)
    }
}

/// `model` as a Qwen3-MoE: every layer's MLP 4 experts of SwiGLU width `width`, each token
/// routed to 2.
pub fn qwen3_moe(model: LlamaConfig, width: usize) -> LlamaConfig {
    LlamaConfig {
        family: Family::Qwen3Moe,
        moe: Some(MoeConfig {
            num_experts: 4,
            num_experts_per_tok: 2,
            moe_intermediate_size: width,
            norm_topk_prob: true,
            router_aux_loss_coef: 0.01,
            decoder_sparse_step: 1,
            mlp_only_layers: vec![],
        }),
        ..model
    }
}

/// A run of `model` on the seeded synthetic Markov data, with rows of varying length (padded
/// with ignored labels), AdamW with clipping and a warmup + cosine schedule over `horizon` steps.
pub fn train_config(
    model: LlamaConfig,
    precision: Precision,
    batch_size: usize,
    seq_len: usize,
    horizon: u64,
) -> TrainConfig {
    let mut run = TrainConfig {
        init: Init::Random {
            seed: 11,
            std: 0.02,
        },
        precision,
        schedule: Schedule::WarmupCosine {
            warmup_steps: 2,
            horizon,
            min_lr_ratio: 0.1,
        },
        data: DataConfig::Synthetic {
            seed: 5,
            samples: 256,
            branching: 2,
            min_len: Some(seq_len / 4),
        },
        shuffle_seed: 3,
        ..TrainConfig::new(model, batch_size, seq_len)
    };
    run.optimizer.lr = 1e-2;
    run
}
