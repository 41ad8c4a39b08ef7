//! The shape of a Llama-family decoder, read from a Hugging Face `config.json` by its
//! `model_type` ([`Family`]) or written inline, and written back so transformers loads it.

use crate::device::router::RouteSpec;
use crate::error::{EngineError, Result, Setting};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The shape of a Llama-family decoder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaConfig {
    /// Token vocabulary size.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Decoder blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than the query heads).
    pub num_key_value_heads: usize,
    /// Width of one head; `hidden_size / num_attention_heads` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// Rotary embedding base.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// Whether the LM head reuses the token embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Longest sequence the model is configured for.
    #[serde(default = "default_positions")]
    pub max_position_embeddings: usize,
    /// Which member of the family: what its block adds to Llama's.
    #[serde(default, skip_serializing_if = "Family::is_llama")]
    pub family: Family,
    /// Keys a query attends to at most (Mistral, Mixtral); `None` attends to every earlier key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// The mixture-of-experts MLP (Qwen3-MoE, Mixtral); `None` for a dense model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
}

/// A mixture-of-experts MLP: a router picks each token's top-k experts, each a SwiGLU MLP of its
/// own, and their outputs are summed weighted by the router's probabilities. A load-balancing
/// loss (transformers' `load_balancing_loss_func`) is added to the cross-entropy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    /// Experts in each MoE layer.
    pub num_experts: usize,
    /// Experts each token is routed to (top-k).
    pub num_experts_per_tok: usize,
    /// Width of each expert's SwiGLU.
    pub moe_intermediate_size: usize,
    /// Whether a token's top-k probabilities are divided by their sum (always so in Mixtral).
    #[serde(default = "default_true")]
    pub norm_topk_prob: bool,
    /// Weight of the load-balancing loss in the training loss.
    #[serde(default = "default_aux_coef")]
    pub router_aux_loss_coef: f64,
    /// Layer `l` is MoE when `(l + 1)` is a multiple of this (Qwen3-MoE).
    #[serde(default = "default_sparse_step")]
    pub decoder_sparse_step: usize,
    /// Layers that keep a dense MLP of `intermediate_size` (Qwen3-MoE).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mlp_only_layers: Vec<usize>,
}

impl MoeConfig {
    /// How block `layer`'s router routes.
    pub fn route_spec(&self, layer: usize) -> RouteSpec {
        RouteSpec {
            experts: self.num_experts,
            top_k: self.num_experts_per_tok,
            normalize: self.norm_topk_prob,
            layer,
        }
    }

    /// Whether layer `layer` has the MoE MLP.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }

    fn validate(&self, family: Family, layers: usize, ffn: usize) -> Result<(), Setting> {
        let (e, k) = (self.num_experts, self.num_experts_per_tok);
        let zero = [
            ("num_experts", e),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("decoder_sparse_step", self.decoder_sparse_step),
        ]
        .into_iter()
        .find(|(_, v)| *v == 0);
        if let Some((key, _)) = zero {
            return Err(Setting::new(
                key,
                "num_experts, moe_intermediate_size and decoder_sparse_step must be at least 1",
            ));
        }
        if k == 0 || k > e {
            return Err(Setting::new(
                "num_experts_per_tok",
                format!("num_experts_per_tok is {k}; it must be between 1 and num_experts ({e})"),
            ));
        }
        let c = self.router_aux_loss_coef;
        if !c.is_finite() || c < 0.0 {
            return Err(Setting::new(
                "router_aux_loss_coef",
                format!("router_aux_loss_coef is {c}; it must be a finite number of at least 0"),
            ));
        }
        if let Some(l) = self.mlp_only_layers.iter().find(|&&l| l >= layers) {
            return Err(Setting::new(
                "mlp_only_layers",
                format!(
                    "mlp_only_layers names layer {l}; the model has layers 0 to {}",
                    layers - 1
                ),
            ));
        }
        if family == Family::Mixtral && ffn != self.moe_intermediate_size {
            return Err(Setting::new(
                "moe_intermediate_size",
                format!(
                    "mixtral's experts are its MLP: intermediate_size ({ffn}) must equal moe_intermediate_size ({})",
                    self.moe_intermediate_size
                ),
            ));
        }
        if family == Family::Mixtral
            && (!self.norm_topk_prob
                || self.decoder_sparse_step != 1
                || !self.mlp_only_layers.is_empty())
        {
            let key = if !self.norm_topk_prob {
                "norm_topk_prob"
            } else if self.decoder_sparse_step != 1 {
                "decoder_sparse_step"
            } else {
                "mlp_only_layers"
            };
            return Err(Setting::new(
                key,
                "mixtral renormalises the top-k probabilities and routes every layer: \
                 remove norm_topk_prob, decoder_sparse_step and mlp_only_layers",
            ));
        }
        if !(0..layers).any(|l| self.is_moe_layer(l)) {
            return Err(Setting::new(
                "decoder_sparse_step",
                "no layer is MoE: decoder_sparse_step and mlp_only_layers leave every MLP dense",
            ));
        }
        Ok(())
    }
}

/// A member of the Llama family, as Hugging Face's `model_type` names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// Llama: RMSNorm, rotary embedding, grouped-query attention, SwiGLU.
    #[default]
    Llama,
    /// Llama's block, with attention limited to a sliding window of keys.
    Mistral,
    /// Llama's block with a bias on the query, key and value projections.
    Qwen2,
    /// Llama's block with an RMSNorm on each head's queries and keys before the rotary embedding.
    Qwen3,
    /// Llama's block with fused projections: `qkv_proj` [q; k; v] and `gate_up_proj` [gate; up]
    /// (phi-4's architecture).
    Phi3,
    /// Qwen3's attention with a mixture-of-experts MLP ([`MoeConfig`]).
    Qwen3Moe,
    /// Mistral's attention with a mixture-of-experts MLP ([`MoeConfig`]); experts stored as
    /// `block_sparse_moe.experts.{e}.w1` (gate), `w2` (down), `w3` (up).
    Mixtral,
}

impl Family {
    /// Every family, as `model_type` names it.
    pub const ALL: [Family; 7] = [
        Family::Llama,
        Family::Mistral,
        Family::Qwen2,
        Family::Qwen3,
        Family::Phi3,
        Family::Qwen3Moe,
        Family::Mixtral,
    ];

    /// Hugging Face's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Phi3 => "phi3",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Mixtral => "mixtral",
        }
    }

    /// The transformers class that loads it.
    fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Phi3 => "Phi3ForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
        }
    }

    fn is_llama(&self) -> bool {
        *self == Family::Llama
    }

    /// Whether each head's queries and keys pass an RMSNorm of their own (`q_norm`, `k_norm`).
    pub fn qk_norm(self) -> bool {
        matches!(self, Family::Qwen3 | Family::Qwen3Moe)
    }

    /// Whether the query, key and value projections have a bias.
    pub fn qkv_bias(self) -> bool {
        self == Family::Qwen2
    }

    /// Whether q, k, v and gate, up are stored fused, one tensor each.
    pub fn fused(self) -> bool {
        self == Family::Phi3
    }

    /// Whether the MLP is a mixture of experts.
    pub fn moe(self) -> bool {
        matches!(self, Family::Qwen3Moe | Family::Mixtral)
    }

    /// Whether the model honours a `sliding_window` (Mistral's and Mixtral's attention).
    pub fn sliding(self) -> bool {
        matches!(self, Family::Mistral | Family::Mixtral)
    }
}

fn default_eps() -> f64 {
    1e-5
}
fn default_theta() -> f64 {
    10000.0
}
fn default_positions() -> usize {
    2048
}
fn default_true() -> bool {
    true
}
fn default_aux_coef() -> f64 {
    0.001
}
fn default_sparse_step() -> usize {
    1
}

/// The fields of a Hugging Face config.json the engine reads; the rest are ignored.
#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<HfRope>,
    rope_scaling: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
    #[serde(alias = "num_experts")]
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    router_aux_loss_coef: Option<f64>,
    router_jitter_noise: Option<f64>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
}

impl HfConfig {
    /// The MoE MLP of a `qwen3_moe` or `mixtral` config, with transformers' defaults.
    fn moe(&self, family: Family) -> Result<Option<MoeConfig>, String> {
        if let Some(j) = self.router_jitter_noise.filter(|&j| j != 0.0) {
            return Err(format!(
                "router_jitter_noise is {j}; only deterministic routing (0.0) is supported"
            ));
        }
        Ok(match family {
            Family::Qwen3Moe => Some(MoeConfig {
                num_experts: self.num_local_experts.unwrap_or(128),
                num_experts_per_tok: self.num_experts_per_tok.unwrap_or(8),
                moe_intermediate_size: self.moe_intermediate_size.unwrap_or(768),
                norm_topk_prob: self.norm_topk_prob.unwrap_or(false),
                router_aux_loss_coef: self.router_aux_loss_coef.unwrap_or_else(default_aux_coef),
                decoder_sparse_step: self.decoder_sparse_step.unwrap_or(1),
                mlp_only_layers: self.mlp_only_layers.clone().unwrap_or_default(),
            }),
            Family::Mixtral => Some(MoeConfig {
                num_experts: self.num_local_experts.unwrap_or(8),
                num_experts_per_tok: self.num_experts_per_tok.unwrap_or(2),
                moe_intermediate_size: self.intermediate_size,
                norm_topk_prob: true,
                router_aux_loss_coef: self.router_aux_loss_coef.unwrap_or_else(default_aux_coef),
                decoder_sparse_step: 1,
                mlp_only_layers: Vec::new(),
            }),
            _ => None,
        })
    }
}

#[derive(Deserialize)]
struct HfRope {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
    partial_rotary_factor: Option<f64>,
}

impl LlamaConfig {
    /// A Llama of this shape, the rest as a suite or a `config.json` that leaves it out gets
    /// it: heads `hidden_size / num_attention_heads` wide, RMSNorm ε 1e-5, rotary θ 10000, 2048
    /// positions, untied embeddings, full attention and a dense MLP. Every model built in code
    /// (tests, benches, fuzz targets, `estimate`'s flags) starts here and changes what it
    /// needs, so that a new setting is added in one place.
    pub fn new(
        vocab_size: usize,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        num_key_value_heads: usize,
    ) -> Self {
        LlamaConfig {
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim: None,
            rms_norm_eps: default_eps(),
            rope_theta: default_theta(),
            tie_word_embeddings: false,
            max_position_embeddings: default_positions(),
            family: Family::default(),
            sliding_window: None,
            moe: None,
        }
    }

    /// Reads a Hugging Face `config.json` of the Llama family.
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let bytes = crate::regular_file::read(path, "a Hugging Face config.json")?;
        let text = String::from_utf8(bytes)
            .map_err(|e| EngineError::bad_file(path, format!("is not UTF-8 text: {e}")))?;
        Self::from_hf_json(&text).map_err(|m| EngineError::bad_file(path, m))
    }

    /// Parses the text of a Hugging Face `config.json` of the Llama family.
    pub fn from_hf_json(text: &str) -> Result<Self, String> {
        let hf: HfConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let model_type = hf.model_type.as_deref().unwrap_or("llama");
        let Some(family) = Family::ALL
            .into_iter()
            .find(|f| f.model_type() == model_type)
        else {
            let known: Vec<&str> = Family::ALL.iter().map(|f| f.model_type()).collect();
            return Err(format!(
                "model_type is \"{model_type}\"; the engine trains {}",
                known.join(", ")
            ));
        };
        // Qwen's configs carry a window that applies only with `use_sliding_window`.
        let sliding_window = match family {
            Family::Mistral | Family::Mixtral => hf.sliding_window,
            _ if hf.use_sliding_window == Some(true) => {
                return Err("use_sliding_window is true; only full attention is supported".into())
            }
            _ => None,
        };
        if let Some(f) = hf
            .rope_parameters
            .as_ref()
            .and_then(|r| r.partial_rotary_factor)
        {
            if f != 1.0 {
                return Err(format!(
                    "rope_parameters.partial_rotary_factor is {f}; only rotary embeddings over the whole head (1.0) are supported"
                ));
            }
        }
        let rope_type = hf
            .rope_parameters
            .as_ref()
            .and_then(|r| r.rope_type.clone());
        if let Some(t) = rope_type.filter(|t| t != "default") {
            return Err(format!(
                "rope_parameters.rope_type is \"{t}\"; only \"default\" rotary embeddings are supported"
            ));
        }
        if hf.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(
                "rope_scaling is set; only unscaled rotary embeddings are supported".into(),
            );
        }
        for (flag, name) in [
            (hf.attention_bias, "attention_bias"),
            (hf.mlp_bias, "mlp_bias"),
        ] {
            if flag == Some(true) {
                return Err(format!(
                    "{name} is true; the engine's {model_type} has no such biases"
                ));
            }
        }
        if let Some(act) = hf.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(format!(
                "hidden_act is \"{act}\"; only \"silu\" is supported"
            ));
        }
        let moe = hf.moe(family)?;
        let cfg = LlamaConfig {
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: hf.num_attention_heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf.head_dim,
            rms_norm_eps: hf.rms_norm_eps.unwrap_or_else(default_eps),
            rope_theta: hf
                .rope_parameters
                .and_then(|r| r.rope_theta)
                .or(hf.rope_theta)
                .unwrap_or_else(default_theta),
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: hf.max_position_embeddings.unwrap_or_else(default_positions),
            family,
            sliding_window,
            moe,
        };
        cfg.validate().map_err(|e| e.message)?;
        Ok(cfg)
    }

    /// A Hugging Face `config.json` for this shape, which the family's transformers class
    /// (`LlamaForCausalLM`, `Qwen3ForCausalLM`, …) loads.
    pub fn to_hf_json(&self) -> serde_json::Value {
        let mut json = serde_json::json!({
            "architectures": [self.family.architecture()],
            "model_type": self.family.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "pad_token_id": null,
            "attention_bias": false,
            "mlp_bias": false,
            "torch_dtype": "float32",
        });
        if let Some(d) = self.head_dim {
            json["head_dim"] = d.into();
        }
        if self.family.sliding() {
            json["sliding_window"] = self.sliding_window.into();
        }
        if let Some(m) = &self.moe {
            json["num_local_experts"] = m.num_experts.into();
            json["num_experts_per_tok"] = m.num_experts_per_tok.into();
            json["router_aux_loss_coef"] = m.router_aux_loss_coef.into();
            json["output_router_logits"] = true.into();
            if self.family == Family::Qwen3Moe {
                json["moe_intermediate_size"] = m.moe_intermediate_size.into();
                json["norm_topk_prob"] = m.norm_topk_prob.into();
                json["decoder_sparse_step"] = m.decoder_sparse_step.into();
                json["mlp_only_layers"] = m.mlp_only_layers.clone().into();
            }
        }
        json
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Checks the shape is buildable; the message says which value to change.
    pub fn validate(&self) -> Result<(), Setting> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(Setting::new(
                    name,
                    format!("{name} is 0; it must be at least 1"),
                ));
            }
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(Setting::new(
                "num_attention_heads",
                format!(
                    "num_attention_heads ({}) does not divide hidden_size ({}); choose a divisor or set head_dim",
                    self.num_attention_heads, self.hidden_size
                ),
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(Setting::new(
                "num_key_value_heads",
                format!(
                    "num_key_value_heads ({}) does not divide num_attention_heads ({})",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if self.head_dim == Some(0) {
            return Err(Setting::new(
                "head_dim",
                "head_dim is 0; write an even width of at least 2, or remove it to use hidden_size / num_attention_heads",
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            let key = match self.head_dim {
                Some(_) => "head_dim",
                None => "num_attention_heads",
            };
            return Err(Setting::new(
                key,
                format!(
                    "head dimension {} is odd; rotary embeddings need an even head dimension",
                    self.head_dim()
                ),
            ));
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        for (key, x) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
        ] {
            if !positive(x) {
                return Err(Setting::new(
                    key,
                    "rms_norm_eps and rope_theta must be positive",
                ));
            }
        }
        match (&self.moe, self.family.moe()) {
            (Some(m), true) => m
                .validate(self.family, self.num_hidden_layers, self.intermediate_size)
                .map_err(|e| e.under("moe")),
            (None, false) => Ok(()),
            (None, true) => Err(Setting::new(
                "moe",
                format!(
                    "family {} needs its experts: add moe (num_experts, num_experts_per_tok, moe_intermediate_size)",
                    self.family.model_type()
                ),
            )),
            (Some(_), false) => Err(Setting::new(
                "moe",
                format!(
                    "family {} has a dense MLP: remove moe, or choose qwen3_moe or mixtral",
                    self.family.model_type()
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_theta_from_either_place() {
        let base = r#""vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1"#;
        let old = LlamaConfig::from_hf_json(&format!("{{{base}, \"rope_theta\": 500.0}}")).unwrap();
        assert_eq!(old.rope_theta, 500.0);
        let new = LlamaConfig::from_hf_json(&format!(
            "{{{base}, \"rope_parameters\": {{\"rope_theta\": 42.0, \"rope_type\": \"default\"}}}}"
        ))
        .unwrap();
        assert_eq!(new.rope_theta, 42.0);
        assert_eq!(new.head_dim(), 4);
        let round_trip = LlamaConfig::from_hf_json(&new.to_hf_json().to_string()).unwrap();
        assert_eq!(round_trip, new);
    }

    #[test]
    fn rejects_heads_that_do_not_divide() {
        let err = LlamaConfig::from_hf_json(
            r#"{"vocab_size": 10, "hidden_size": 10, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 3}"#,
        )
        .unwrap_err();
        assert!(err.contains("does not divide hidden_size"), "{err}");
    }
}
