//! The model's parameters by Hugging Face name, as one struct generic over what is stored per
//! parameter: weights, gradients and optimizer moments all share this layout.

use super::config::LlamaConfig;

/// One parameter's name and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// Hugging Face tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Whether this is an RMSNorm scale (initialised to one).
    pub is_norm: bool,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The parameters of one decoder block.
#[derive(Debug)]
pub struct LayerParams<T> {
    /// Query projection `[heads·d, hidden]`.
    pub q: T,
    /// Key projection `[kv_heads·d, hidden]`.
    pub k: T,
    /// Value projection `[kv_heads·d, hidden]`.
    pub v: T,
    /// Output projection `[hidden, heads·d]`.
    pub o: T,
    /// RMSNorm of each query head `[d]` (Qwen3).
    pub q_norm: Option<T>,
    /// RMSNorm of each key head `[d]` (Qwen3).
    pub k_norm: Option<T>,
    /// MLP gate projection `[ffn, hidden]`.
    pub gate: T,
    /// MLP up projection `[ffn, hidden]`.
    pub up: T,
    /// MLP down projection `[hidden, ffn]`.
    pub down: T,
    /// RMSNorm before attention `[hidden]`.
    pub input_norm: T,
    /// RMSNorm before the MLP `[hidden]`.
    pub post_norm: T,
}

/// Every parameter of the model.
#[derive(Debug)]
pub struct Params<T> {
    /// Token embedding `[vocab, hidden]`.
    pub embed: T,
    /// Decoder blocks.
    pub layers: Vec<LayerParams<T>>,
    /// Final RMSNorm `[hidden]`.
    pub final_norm: T,
    /// LM head `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<T>,
}

impl LlamaConfig {
    /// Parameters in the model (tied embeddings counted once).
    pub fn num_params(&self) -> usize {
        param_specs(self).iter().map(|s| s.numel()).sum()
    }
}

/// Every parameter's name and shape, in Hugging Face's `named_parameters()` order.
pub fn param_specs(cfg: &LlamaConfig) -> Vec<ParamSpec> {
    let (h, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let qw = cfg.num_attention_heads * cfg.head_dim();
    let kvw = cfg.num_key_value_heads * cfg.head_dim();
    let spec = |name: String, shape: Vec<usize>| ParamSpec {
        is_norm: name.ends_with("norm.weight"),
        name,
        shape,
    };
    let mut out = vec![spec("model.embed_tokens.weight".into(), vec![v, h])];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.push(spec(format!("{p}.self_attn.q_proj.weight"), vec![qw, h]));
        out.push(spec(format!("{p}.self_attn.k_proj.weight"), vec![kvw, h]));
        out.push(spec(format!("{p}.self_attn.v_proj.weight"), vec![kvw, h]));
        out.push(spec(format!("{p}.self_attn.o_proj.weight"), vec![h, qw]));
        if cfg.qk_norm {
            for name in ["q_norm", "k_norm"] {
                out.push(spec(
                    format!("{p}.self_attn.{name}.weight"),
                    vec![cfg.head_dim()],
                ));
            }
        }
        out.push(spec(format!("{p}.mlp.gate_proj.weight"), vec![f, h]));
        out.push(spec(format!("{p}.mlp.up_proj.weight"), vec![f, h]));
        out.push(spec(format!("{p}.mlp.down_proj.weight"), vec![h, f]));
        out.push(spec(format!("{p}.input_layernorm.weight"), vec![h]));
        out.push(spec(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
        ));
    }
    out.push(spec("model.norm.weight".into(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(spec("lm_head.weight".into(), vec![v, h]));
    }
    out
}

impl<T> Params<T> {
    /// Builds every parameter with `make`, called once per [`param_specs`] entry, in order.
    pub fn try_new<E>(
        cfg: &LlamaConfig,
        mut make: impl FnMut(&ParamSpec) -> Result<T, E>,
    ) -> Result<Self, E> {
        let specs = param_specs(cfg);
        let mut it = specs.iter();
        let mut next = || make(it.next().expect("param_specs lists every parameter"));
        let embed = next()?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for _ in 0..cfg.num_hidden_layers {
            layers.push(LayerParams {
                q: next()?,
                k: next()?,
                v: next()?,
                o: next()?,
                q_norm: cfg.qk_norm.then(&mut next).transpose()?,
                k_norm: cfg.qk_norm.then(&mut next).transpose()?,
                gate: next()?,
                up: next()?,
                down: next()?,
                input_norm: next()?,
                post_norm: next()?,
            });
        }
        let final_norm = next()?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(next()?)
        };
        Ok(Params {
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// Every parameter, in [`param_specs`] order.
    pub fn tensors(&self) -> Vec<&T> {
        let mut out = vec![&self.embed];
        for l in &self.layers {
            out.extend([&l.q, &l.k, &l.v, &l.o]);
            out.extend(l.q_norm.iter().chain(&l.k_norm));
            out.extend([&l.gate, &l.up, &l.down, &l.input_norm, &l.post_norm]);
        }
        out.push(&self.final_norm);
        out.extend(self.lm_head.as_ref());
        out
    }

    /// Every parameter, mutably, in [`param_specs`] order.
    pub fn tensors_mut(&mut self) -> Vec<&mut T> {
        let mut out = vec![&mut self.embed];
        for l in &mut self.layers {
            out.extend([&mut l.q, &mut l.k, &mut l.v, &mut l.o]);
            out.extend(l.q_norm.iter_mut().chain(&mut l.k_norm));
            out.extend([
                &mut l.gate,
                &mut l.up,
                &mut l.down,
                &mut l.input_norm,
                &mut l.post_norm,
            ]);
        }
        out.push(&mut self.final_norm);
        out.extend(self.lm_head.as_mut());
        out
    }

    /// Each parameter through `f`, in [`param_specs`] order.
    pub fn try_map<U, E>(self, mut f: impl FnMut(T) -> Result<U, E>) -> Result<Params<U>, E> {
        let embed = f(self.embed)?;
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in self.layers {
            layers.push(LayerParams {
                q: f(l.q)?,
                k: f(l.k)?,
                v: f(l.v)?,
                o: f(l.o)?,
                q_norm: l.q_norm.map(&mut f).transpose()?,
                k_norm: l.k_norm.map(&mut f).transpose()?,
                gate: f(l.gate)?,
                up: f(l.up)?,
                down: f(l.down)?,
                input_norm: f(l.input_norm)?,
                post_norm: f(l.post_norm)?,
            });
        }
        Ok(Params {
            embed,
            layers,
            final_norm: f(self.final_norm)?,
            lm_head: self.lm_head.map(f).transpose()?,
        })
    }

    /// The LM head's weight: its own, or the embedding when tied.
    pub fn head(&self) -> &T {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}
