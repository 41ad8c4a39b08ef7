//! `ckpt-harness eval`: the loss and gradients of a Hugging Face model on one batch, and
//! optionally the parameters after N AdamW steps on that batch, for comparison with PyTorch.

use super::exit_codes;
use anyhow::{bail, Context, Result};
use ckpt_engine::backend::cpu::bf16_dot::Bf16Products;
use ckpt_engine::model::loss::LossKind;
use ckpt_engine::model::{param_specs, weights, LlamaConfig, Model, PassOutput};
use ckpt_engine::optim::{AdamW, AdamWConfig};
use ckpt_engine::state::rounded;
use ckpt_engine::Precision;
use ckpt_engine::{Batch, Category, Checkpointing, CpuDevice, Params, Tensor};
use safetensors::Dtype;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `eval`'s arguments.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// Hugging Face Llama directory (config.json + model.safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// safetensors file with `input_ids` and `labels` ([B, T] int64, -100 ignored).
    #[arg(long)]
    pub batch: PathBuf,
    /// Write `grad.<name>` (and `after_adamw.<name>`) tensors to this safetensors file.
    #[arg(long)]
    pub grads_out: Option<PathBuf>,
    /// AdamW steps to take on the batch; prints the loss before each.
    #[arg(long, default_value_t = 0)]
    pub adamw_steps: usize,
    /// Learning rate of the AdamW steps (constant).
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Decoupled weight decay, on every parameter.
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f64,
    /// β₁,β₂.
    #[arg(long, value_parser = parse_betas, default_value = "0.9,0.999")]
    pub betas: [f64; 2],
    /// Denominator epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f64,
    /// Step arithmetic.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
    /// Worker threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

fn parse_betas(text: &str) -> Result<[f64; 2], String> {
    let parts: Vec<&str> = text.split(',').collect();
    let [a, b] = parts.as_slice() else {
        return Err(format!("expected two numbers like 0.9,0.95, got {text:?}"));
    };
    let num = |s: &str| s.trim().parse::<f64>().map_err(|e| format!("{s:?}: {e}"));
    Ok([num(a)?, num(b)?])
}

/// Evaluates and prints the report as one JSON line; exits 0.
pub fn exec(args: EvalArgs) -> Result<u8> {
    let req = EvalRequest {
        model: args.model,
        batch: args.batch,
        grads_out: args.grads_out,
        adamw_steps: args.adamw_steps,
        adamw: AdamWConfig {
            lr: args.lr,
            betas: args.betas,
            eps: args.eps,
            weight_decay: args.weight_decay,
            grad_clip: None,
        },
        precision: args.precision,
        threads: args.threads,
    };
    let line = serde_json::to_string(&run(&req)?)?;
    writeln!(std::io::stdout(), "{line}")?;
    Ok(exit_codes::SUCCESS)
}

/// What to evaluate.
#[derive(Clone, Debug)]
pub struct EvalRequest {
    /// Hugging Face Llama directory.
    pub model: PathBuf,
    /// safetensors file with `input_ids` and `labels`.
    pub batch: PathBuf,
    /// Where to write `grad.<name>` (and `after_adamw.<name>`).
    pub grads_out: Option<PathBuf>,
    /// AdamW steps to take on the batch.
    pub adamw_steps: usize,
    /// AdamW settings of those steps (constant lr, no clipping).
    pub adamw: AdamWConfig,
    /// Step arithmetic.
    pub precision: Precision,
    /// Worker threads (0 = one per core).
    pub threads: usize,
}

/// What `eval` prints.
#[derive(Clone, Debug, Serialize)]
pub struct EvalReport {
    /// Loss of the initial weights: the cross-entropy, plus `router_aux_loss_coef × aux` for a
    /// MoE model.
    pub loss: f32,
    /// The cross-entropy alone (MoE models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ce: Option<f32>,
    /// The load-balancing loss before its coefficient (MoE models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux: Option<f32>,
    /// Loss before each AdamW step (present with `adamw_steps > 0`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub losses: Option<Vec<f32>>,
}

/// Reads `input_ids` and `labels` (`[B, T]` int64) from a safetensors file.
pub fn read_batch(path: &Path) -> Result<Batch> {
    let bytes =
        ckpt_engine::regular_file::read(path, "a safetensors file of input_ids and labels")?;
    let st = weights::parse_safetensors(path, &bytes)?;
    let get = |name: &str| -> Result<(Vec<usize>, Vec<i64>)> {
        let view = st
            .tensor(name)
            .map_err(|_| anyhow::anyhow!("{}: tensor {name} is missing", path.display()))?;
        if view.dtype() != Dtype::I64 || view.shape().len() != 2 {
            bail!(
                "{}: {name} is {:?} {:?}; expected a 2-D I64 tensor [batch, seq]",
                path.display(),
                view.dtype(),
                view.shape()
            );
        }
        let data = view
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        Ok((view.shape().to_vec(), data))
    };
    let (shape, ids) = get("input_ids")?;
    let (label_shape, labels) = get("labels")?;
    if shape != label_shape {
        bail!(
            "{}: input_ids is {shape:?} but labels is {label_shape:?}",
            path.display()
        );
    }
    let input_ids = ids
        .iter()
        .map(|&i| {
            u32::try_from(i).map_err(|_| {
                anyhow::anyhow!("{}: input id {i} is negative or too large", path.display())
            })
        })
        .collect::<Result<_>>()?;
    Ok(Batch {
        batch: shape[0],
        seq: shape[1],
        input_ids,
        labels,
        positions: None,
    })
}

fn zeros(dev: &CpuDevice, cfg: &LlamaConfig, category: Category) -> Result<Params<Tensor<f32>>> {
    Ok(Params::try_new(cfg, |s| {
        dev.zeros::<f32>(&s.shape, category)
    })?)
}

fn pass(
    dev: &CpuDevice,
    model: &Model<CpuDevice>,
    precision: Precision,
    master: &mut Params<Tensor<f32>>,
    grads: &mut Params<Tensor<f32>>,
    batch: &Batch,
) -> Result<PassOutput> {
    for g in grads.tensors_mut() {
        g.fill(0.0);
    }
    let out = match precision {
        Precision::Fp32 => model.forward_backward(
            dev,
            master,
            grads,
            batch,
            Checkpointing::None,
            LossKind::Standard,
        )?,
        Precision::Bf16Mixed => {
            let mut compute = rounded::<_, half::bf16>(dev, model.config(), master)?;
            model.forward_backward(
                dev,
                &mut compute,
                grads,
                batch,
                Checkpointing::None,
                LossKind::Standard,
            )?
        }
    };
    Ok(out)
}

fn named(
    cfg: &LlamaConfig,
    prefix: &str,
    p: &Params<Tensor<f32>>,
    out: &mut BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) {
    for (spec, t) in param_specs(cfg).iter().zip(p.tensors()) {
        out.insert(
            format!("{prefix}{}", spec.name),
            (spec.shape.clone(), t.to_f32_vec()),
        );
    }
}

/// Runs the evaluation.
pub fn run(req: &EvalRequest) -> Result<EvalReport> {
    let dev =
        CpuDevice::new(req.threads, u64::MAX)?.with_bf16_products(Bf16Products::from_env()?)?;
    let (cfg, mut master) = weights::load_hf_dir(dev.tracker(), &req.model, Category::Params)?;
    let batch = read_batch(&req.batch)?;
    let model = Model::new(&dev, cfg.clone())?;
    model
        .check_batch(&batch)
        .with_context(|| format!("{}: batch does not fit the model", req.batch.display()))?;
    let mut grads = zeros(&dev, &cfg, Category::Grads)?;
    let first = pass(&dev, &model, req.precision, &mut master, &mut grads, &batch)?;
    let mut out = BTreeMap::new();
    named(&cfg, "grad.", &grads, &mut out);
    let mut losses = None;
    if req.adamw_steps > 0 {
        let mut opt = AdamW::new(req.adamw.clone());
        let mut seen = Vec::with_capacity(req.adamw_steps);
        for _ in 0..req.adamw_steps {
            seen.push(pass(&dev, &model, req.precision, &mut master, &mut grads, &batch)?.loss);
            opt.update(&dev, &cfg, &mut master, &grads, req.adamw.lr)?;
        }
        named(&cfg, "after_adamw.", &master, &mut out);
        losses = Some(seen);
    }
    if let Some(path) = &req.grads_out {
        weights::save_f32_tensors(path, &out)?;
    }
    Ok(EvalReport {
        loss: first.loss,
        ce: first.aux.is_some().then_some(first.ce),
        aux: first.aux.map(|a| a as f32),
        losses,
    })
}
