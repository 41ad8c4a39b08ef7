//! The model's parameters: one table ([`Layout`]) says every tensor's Hugging Face name and shape
//! and where each projection of a block lives in them, as llm.c's parameter table does; weights,
//! gradients and optimizer moments are each a list of tensors in that table's order
//! ([`Params`]). A family's layout is its only difference in storage: Phi-3's fused `qkv_proj`
//! holds q, k and v as blocks of rows of one tensor; Qwen2 adds bias vectors; Qwen3 per-head
//! norms; Qwen3-MoE and Mixtral a router and one tensor per expert and projection, as on the Hub.

use super::config::{Family, LlamaConfig};

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

/// Rows `start..start + len` of the `[rows, cols]` parameter `tensor`: a whole weight, or one
/// projection of a fused one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    /// Index of the tensor in the layout.
    pub tensor: usize,
    /// The first row.
    pub start: usize,
    /// Rows in the block: the projection's output width.
    pub len: usize,
}

impl Rows {
    /// All `len` rows of `tensor`.
    pub fn whole(tensor: usize, len: usize) -> Self {
        Rows {
            tensor,
            start: 0,
            len,
        }
    }
}

/// A SwiGLU MLP's weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ffn {
    /// Gate and up projections `[ffn, hidden]`.
    pub gate_up: [Rows; 2],
    /// Down projection `[hidden, ffn]`.
    pub down: Rows,
}

/// A decoder block's MLP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mlp {
    /// One SwiGLU MLP every token passes through.
    Dense(Ffn),
    /// A router `[experts, hidden]` and one SwiGLU MLP per expert.
    Moe {
        /// The router's weight.
        router: usize,
        /// The experts, in order.
        experts: Vec<Ffn>,
    },
}

/// Where one decoder block's parameters are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerLayout {
    /// Query, key and value projections.
    pub qkv: [Rows; 3],
    /// Their biases (Qwen2).
    pub qkv_bias: Option<[usize; 3]>,
    /// Output projection `[hidden, heads·d]`.
    pub o: Rows,
    /// RMSNorm of each query head and each key head, `[d]` each (Qwen3).
    pub qk_norm: Option<[usize; 2]>,
    /// The MLP.
    pub mlp: Mlp,
    /// RMSNorm before attention `[hidden]`.
    pub input_norm: usize,
    /// RMSNorm before the MLP `[hidden]`.
    pub post_norm: usize,
}

/// Every parameter of a model: names and shapes in Hugging Face's `named_parameters()` order,
/// and where the passes find each weight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Every tensor, in order.
    pub specs: Vec<ParamSpec>,
    /// Token embedding `[vocab, hidden]`.
    pub embed: usize,
    /// Decoder blocks.
    pub layers: Vec<LayerLayout>,
    /// Final RMSNorm `[hidden]`.
    pub final_norm: usize,
    /// LM head `[vocab, hidden]`: its own, or the embedding when tied.
    pub head: usize,
}

impl Layout {
    /// The tensors of `group`, in layout order: a block's are those named
    /// `model.layers.{l}.`.
    pub fn tensors_of(&self, group: super::Group) -> Vec<usize> {
        use super::Group;
        match group {
            Group::Head => vec![self.head],
            Group::FinalNorm => vec![self.final_norm],
            Group::Embed => vec![self.embed],
            Group::Layer(l) => {
                let prefix = format!("model.layers.{l}.");
                (0..self.specs.len())
                    .filter(|&i| self.specs[i].name.starts_with(&prefix))
                    .collect()
            }
        }
    }

    /// The layout of `cfg`'s family and shape.
    pub fn of(cfg: &LlamaConfig) -> Self {
        let (h, f, v, d) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.vocab_size,
            cfg.head_dim(),
        );
        let (qw, kvw) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
        let family = cfg.family;
        let mut specs = Vec::new();
        let mut add = |name: String, shape: Vec<usize>| {
            specs.push(ParamSpec {
                is_norm: name.ends_with("norm.weight"),
                name,
                shape,
            });
            specs.len() - 1
        };
        // A `[rows, hidden]` weight for each of `parts` (name, rows), or one fused weight
        // `fused` stacking them; the blocks of rows of each part.
        let projections = |add: &mut dyn FnMut(String, Vec<usize>) -> usize,
                           fused: String,
                           parts: &[(String, usize)]| {
            let mut start = 0;
            let fused = family
                .fused()
                .then(|| add(fused, vec![parts.iter().map(|p| p.1).sum(), h]));
            parts
                .iter()
                .map(|(name, len)| {
                    let rows = match fused {
                        Some(tensor) => Rows {
                            tensor,
                            start,
                            len: *len,
                        },
                        None => Rows::whole(add(name.clone(), vec![*len, h]), *len),
                    };
                    start += len;
                    rows
                })
                .collect::<Vec<_>>()
        };
        let embed = add("model.embed_tokens.weight".into(), vec![v, h]);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let a = format!("model.layers.{l}.self_attn");
            let qkv = projections(
                &mut add,
                format!("{a}.qkv_proj.weight"),
                &[
                    (format!("{a}.q_proj.weight"), qw),
                    (format!("{a}.k_proj.weight"), kvw),
                    (format!("{a}.v_proj.weight"), kvw),
                ],
            );
            let qkv_bias = family.qkv_bias().then(|| {
                [("q", qw), ("k", kvw), ("v", kvw)]
                    .map(|(p, len)| add(format!("{a}.{p}_proj.bias"), vec![len]))
            });
            let o = Rows::whole(add(format!("{a}.o_proj.weight"), vec![h, qw]), h);
            let qk_norm = family
                .qk_norm()
                .then(|| ["q", "k"].map(|p| add(format!("{a}.{p}_norm.weight"), vec![d])));
            let moe = cfg.moe.as_ref().filter(|m| m.is_moe_layer(l));
            let mlp = match moe {
                None => {
                    let m = format!("model.layers.{l}.mlp");
                    let gate_up = projections(
                        &mut add,
                        format!("{m}.gate_up_proj.weight"),
                        &[
                            (format!("{m}.gate_proj.weight"), f),
                            (format!("{m}.up_proj.weight"), f),
                        ],
                    );
                    let down = Rows::whole(add(format!("{m}.down_proj.weight"), vec![h, f]), h);
                    Mlp::Dense(Ffn {
                        gate_up: [gate_up[0], gate_up[1]],
                        down,
                    })
                }
                Some(m) => {
                    let (e, f) = (m.num_experts, m.moe_intermediate_size);
                    let [block, gate, down, up] = match family {
                        Family::Mixtral => ["block_sparse_moe", "w1", "w2", "w3"],
                        _ => ["mlp", "gate_proj", "down_proj", "up_proj"],
                    };
                    let b = format!("model.layers.{l}.{block}");
                    let router = add(format!("{b}.gate.weight"), vec![e, h]);
                    let experts = (0..e)
                        .map(|x| {
                            let x = format!("{b}.experts.{x}");
                            let mut proj = |name: &str, shape: Vec<usize>| {
                                Rows::whole(
                                    add(format!("{x}.{name}.weight"), shape.clone()),
                                    shape[0],
                                )
                            };
                            let gate = proj(gate, vec![f, h]);
                            let (up, down) = match family {
                                Family::Mixtral => {
                                    let down = proj(down, vec![h, f]);
                                    (proj(up, vec![f, h]), down)
                                }
                                _ => (proj(up, vec![f, h]), proj(down, vec![h, f])),
                            };
                            Ffn {
                                gate_up: [gate, up],
                                down,
                            }
                        })
                        .collect();
                    Mlp::Moe { router, experts }
                }
            };
            let p = format!("model.layers.{l}");
            layers.push(LayerLayout {
                qkv: [qkv[0], qkv[1], qkv[2]],
                qkv_bias,
                o,
                qk_norm,
                mlp,
                input_norm: add(format!("{p}.input_layernorm.weight"), vec![h]),
                post_norm: add(format!("{p}.post_attention_layernorm.weight"), vec![h]),
            });
        }
        let final_norm = add("model.norm.weight".into(), vec![h]);
        let head = if cfg.tie_word_embeddings {
            embed
        } else {
            add("lm_head.weight".into(), vec![v, h])
        };
        Layout {
            specs,
            embed,
            layers,
            final_norm,
            head,
        }
    }
}

/// Every parameter's name and shape, in Hugging Face's `named_parameters()` order.
pub fn param_specs(cfg: &LlamaConfig) -> Vec<ParamSpec> {
    Layout::of(cfg).specs
}

impl LlamaConfig {
    /// Parameters in the model (tied embeddings counted once).
    pub fn num_params(&self) -> usize {
        param_specs(self).iter().map(|s| s.numel()).sum()
    }
}

/// Every parameter of a model, in its [`Layout`]'s order: weights, gradients or moments.
#[derive(Debug)]
pub struct Params<T> {
    tensors: Vec<T>,
}

impl<A, B> Params<(A, B)> {
    /// The pairs' first and second parts, each as a [`Params`] of its own.
    pub fn unzip(self) -> (Params<A>, Params<B>) {
        let (a, b) = self.tensors.into_iter().unzip();
        (Params { tensors: a }, Params { tensors: b })
    }
}

impl<T> Params<T> {
    /// Builds every parameter with `make`, called once per [`param_specs`] entry, in order.
    pub fn try_new<E>(
        cfg: &LlamaConfig,
        make: impl FnMut(&ParamSpec) -> Result<T, E>,
    ) -> Result<Self, E> {
        Ok(Params {
            tensors: param_specs(cfg)
                .iter()
                .map(make)
                .collect::<Result<_, E>>()?,
        })
    }

    /// `f` applied to every parameter, in order, by reference.
    pub fn try_map_ref<U, E>(&self, f: impl FnMut(&T) -> Result<U, E>) -> Result<Params<U>, E> {
        Ok(Params {
            tensors: self.tensors.iter().map(f).collect::<Result<_, E>>()?,
        })
    }

    /// Every parameter, in [`param_specs`] order.
    pub fn tensors(&self) -> Vec<&T> {
        self.tensors.iter().collect()
    }

    /// Every parameter, mutably, in [`param_specs`] order.
    pub fn tensors_mut(&mut self) -> Vec<&mut T> {
        self.tensors.iter_mut().collect()
    }

    /// Each parameter through `f`, in [`param_specs`] order.
    pub fn try_map<U, E>(self, f: impl FnMut(T) -> Result<U, E>) -> Result<Params<U>, E> {
        Ok(Params {
            tensors: self.tensors.into_iter().map(f).collect::<Result<_, E>>()?,
        })
    }

    /// The parameter at `index` of the layout.
    pub fn get(&self, index: usize) -> &T {
        &self.tensors[index]
    }

    /// The parameter at `index` of the layout, mutably.
    pub fn get_mut(&mut self, index: usize) -> &mut T {
        &mut self.tensors[index]
    }
}
