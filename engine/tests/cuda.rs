//! The CUDA backend against PyTorch's oracle and against the CPU backend, its determinism, resume
//! and memory reclaim. Trials that need a GPU are listed as ignored where
//! `CudaDevice::probe` fails (decided when the list is built), so test runners report them as
//! skipped; `--include-ignored` runs them on a GPU machine.
//!
//! The oracle files are read from `$CKPT_GOLDEN_DIR` when set (a copy of `golden/`), else from
//! the repository's `golden/`.

mod common;

use ckpt_engine::backend::count::Like;
use ckpt_engine::backend::cuda::nccl::{self, Nccl};
use ckpt_engine::backend::cuda::nvrtc;
use ckpt_engine::config::{Init, Precision, TrainConfig};
use ckpt_engine::estimate::{estimate, EstimateConfig};
use ckpt_engine::model::loss::LossKind;
use ckpt_engine::model::{param_specs, weights, Batch, Checkpointing, LlamaConfig};
use ckpt_engine::optim::{AdamWConfig, Schedule};
use ckpt_engine::parallel::{Parallel, Shard};
use ckpt_engine::trainer::StepStats;
use ckpt_engine::{CpuDevice, CudaDevice, Device, EngineError, Fault, State, Trainer};
use libtest_mimic::{Arguments, Failed, Trial};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

type Outcome = Result<(), Failed>;

/// GPU trials run one at a time, so the free-memory figures of one are not another's.
static GPU: Mutex<()> = Mutex::new(());

fn main() {
    let args = Arguments::from_args();
    let gpu = CudaDevice::probe();
    let no_gpu = gpu.is_err();
    match &gpu {
        Ok(name) => eprintln!("CUDA trials run on {name}"),
        Err(why) => eprintln!("CUDA trials are ignored: {why}"),
    }
    let on_gpu = |name: &str, f: fn() -> Outcome| {
        Trial::test(name, move || {
            let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
            f()
        })
        .with_ignored_flag(no_gpu)
    };
    let trials = vec![
        Trial::test("nvrtc_compiles_the_kernels", nvrtc_compiles_the_kernels)
            .with_ignored_flag(nvrtc::available().is_err()),
        Trial::test("opening_a_device_agrees_with_probe", move || {
            opening_agrees_with_probe(no_gpu)
        }),
        on_gpu("oracle_fp32", || oracle(Precision::Fp32)),
        on_gpu("oracle_bf16_mixed", || oracle(Precision::Bf16Mixed)),
        on_gpu("cpu_and_gpu_agree_fp32", || {
            cpu_vs_gpu(Precision::Fp32, Checkpointing::None, LossKind::Standard)
        }),
        on_gpu("cpu_and_gpu_agree_bf16_mixed", || {
            cpu_vs_gpu(
                Precision::Bf16Mixed,
                Checkpointing::None,
                LossKind::Standard,
            )
        }),
        on_gpu(
            "cpu_and_gpu_agree_fp32_full_checkpointing_chunked_loss",
            || cpu_vs_gpu(Precision::Fp32, Checkpointing::Full, CHUNKED),
        ),
        on_gpu(
            "cpu_and_gpu_agree_bf16_mixed_selective_checkpointing_chunked_loss",
            || cpu_vs_gpu(Precision::Bf16Mixed, Checkpointing::Selective, CHUNKED),
        ),
        on_gpu("cpu_and_gpu_agree_on_rows_longer_than_a_block", long_rows),
        on_gpu("cpu_and_gpu_agree_with_dropout", cpu_vs_gpu_with_dropout),
        on_gpu("gpu_resume_is_bitwise_equal_with_dropout", || {
            resume_with(Precision::Bf16Mixed, 0.1)
        }),
        on_gpu("two_gpu_runs_are_bitwise_equal", deterministic),
        on_gpu("gpu_resume_is_bitwise_equal_fp32", || {
            resume(Precision::Fp32)
        }),
        on_gpu("gpu_resume_is_bitwise_equal_bf16_mixed", || {
            resume(Precision::Bf16Mixed)
        }),
        on_gpu("dropping_a_trainer_returns_its_memory", memory_reclaimed),
        on_gpu(
            "step_peaks_equal_the_cuda_memory_model",
            step_peaks_match_the_model,
        ),
        on_gpu("model_level_faults_act_on_the_gpu", model_level_faults),
        on_gpu(
            "the_gpu_records_its_name_libraries_and_kernels",
            execution_record,
        ),
        on_gpu(
            "ranks_sharing_the_gpu_train_the_bits_of_one_and_the_memory_model_s",
            || ranks_train_one_devices_bits(Cards::Shared),
        ),
        Trial::test(
            "ranks_on_gpus_of_their_own_train_the_bits_of_one_and_the_memory_model_s",
            || {
                let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
                ranks_train_one_devices_bits(Cards::OwnEach)
            },
        )
        .with_ignored_flag(CudaDevice::count() < 2),
        Trial::test("nccl_loads_under_its_soname", nccl_loads)
            .with_ignored_flag(Nccl::get().is_err()),
    ];
    libtest_mimic::run(&args, trials).exit();
}

const CHUNKED: LossKind = LossKind::Chunked { chunk_tokens: 48 };

fn nvrtc_compiles_the_kernels() -> Outcome {
    for arch in ["sm_80", "sm_90"] {
        let cubin = nvrtc::compile(arch)?;
        if !cubin.starts_with(b"\x7fELF") {
            return Err(format!("NVRTC's output for {arch} is not an ELF cubin").into());
        }
    }
    Ok(())
}

/// Without a GPU, opening one is a `NoGpu` error value (never a panic); with one, it opens.
fn opening_agrees_with_probe(no_gpu: bool) -> Outcome {
    let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
    match (CudaDevice::new(0, None), no_gpu) {
        (Err(EngineError::NoGpu(why)), true) if !why.is_empty() => Ok(()),
        (Ok(_), false) => Ok(()),
        (Err(e), _) => Err(format!("opening GPU 0 failed: {e}").into()),
        (Ok(dev), true) => Err(format!("probe failed but {dev:?} opened").into()),
    }
}

fn oracle_dir() -> PathBuf {
    let golden = std::env::var_os("CKPT_GOLDEN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden"));
    golden.join("oracle/llama_tiny")
}

/// Reads `input_ids` and `labels` (`[B, T]` int64) from the oracle's batch file.
fn read_batch(path: &Path) -> Result<Batch, Failed> {
    let bytes = weights::read_file(path)?;
    let st = weights::parse_safetensors(path, &bytes)?;
    let get = |name: &str| -> Result<(Vec<usize>, Vec<i64>), Failed> {
        let view = st.tensor(name).map_err(|e| format!("{name}: {e}"))?;
        let data = view
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        Ok((view.shape().to_vec(), data))
    };
    let (shape, ids) = get("input_ids")?;
    let (_, labels) = get("labels")?;
    Ok(Batch {
        batch: shape[0],
        seq: shape[1],
        input_ids: ids.iter().map(|&i| i as u32).collect(),
        labels,
        positions: None,
    })
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|a| (*a as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// A run configuration around the oracle's model: only the optimizer and precision matter.
fn oracle_config(model: LlamaConfig, precision: Precision, adamw: AdamWConfig) -> TrainConfig {
    let mut cfg = common::train_config(model, precision, 2, 16, 1);
    cfg.init = Init::HfDir { path: oracle_dir() };
    cfg.optimizer = adamw;
    cfg.schedule = Schedule::Constant;
    cfg
}

/// Relative tolerances against the oracle.
struct Tolerances {
    /// Loss of the initial weights.
    loss: f64,
    /// Each gradient (relative L2).
    grad: f64,
    /// Loss before each AdamW step.
    adamw_loss: f64,
    /// Each parameter after the AdamW steps (relative L2).
    param: f64,
}

/// fp32 as the CPU's oracle test; bf16-mixed as docs/PRECISION.md, and the AdamW-step losses
/// from their measurements (docs/CUDA.md): the third, after two steps at lr 1e-2 that take the
/// loss from 5.5 to 1.2, magnifies the parameters' 1.7e-2 of bf16 rounding to 2.6e-2 on the
/// CPU, 2.3e-2 on an H200 with the tiled attention kernels and 1.4e-3 with the tensor-core ones.
fn tolerances(precision: Precision) -> Tolerances {
    match precision {
        Precision::Fp32 => Tolerances {
            loss: 1e-5,
            grad: 1e-4,
            adamw_loss: 1e-5,
            param: 1e-4,
        },
        Precision::Bf16Mixed => Tolerances {
            loss: 2e-3,
            grad: 1e-1,
            adamw_loss: 5e-2,
            param: 5e-2,
        },
    }
}

fn oracle(precision: Precision) -> Outcome {
    let dir = oracle_dir();
    let expected: serde_json::Value =
        serde_json::from_slice(&weights::read_file(&dir.join("expected.json"))?)?;
    let a = &expected["adamw"];
    let f = |v: &serde_json::Value| v.as_f64().expect("a number");
    let adamw = AdamWConfig {
        lr: f(&a["lr"]),
        betas: [f(&a["betas"][0]), f(&a["betas"][1])],
        eps: f(&a["eps"]),
        weight_decay: f(&a["weight_decay"]),
        grad_clip: None,
    };
    let dev = CudaDevice::new(0, None)?;
    let cfg_master = match precision {
        Precision::Fp32 => ckpt_engine::Category::Params,
        Precision::Bf16Mixed => ckpt_engine::Category::Optimizer,
    };
    let (model, master) = weights::load_hf_dir(dev.staging(), &dir, cfg_master)?;
    let batch = read_batch(&dir.join("batch.safetensors"))?;
    let cfg = oracle_config(model.clone(), precision, adamw.clone());
    let master = master.try_map(|t| dev.upload(t))?;
    let mut gpu = State::new(&cfg, dev.clone(), master, None)?;
    let tol = tolerances(precision);

    let pass = gpu.forward_backward(&batch, None)?;
    let loss64 = f(&expected["loss_f64"]);
    let loss_err = ((pass.loss as f64 - loss64) / loss64).abs();
    eprintln!("{precision:?} oracle: loss relative error {loss_err:.2e}");
    let exp_path = dir.join("expected.safetensors");
    let exp_bytes = weights::read_file(&exp_path)?;
    let exp = weights::parse_safetensors(&exp_path, &exp_bytes)?;
    let want = |name: &str| -> Result<Vec<f32>, Failed> {
        let view = exp.tensor(name).map_err(|e| format!("{name}: {e}"))?;
        Ok(weights::tensor_f32(&exp_path, name, &view)?)
    };
    let specs = param_specs(&model);
    let mut failures = Vec::new();
    if loss_err > tol.loss {
        failures.push(format!(
            "loss relative error {loss_err:.2e} > {:e}",
            tol.loss
        ));
    }
    let mut worst = (0.0f64, String::new());
    for (spec, t) in specs.iter().zip(gpu.grads().tensors()) {
        let got = dev.to_host(t)?;
        let err = rel_l2(&got, &want(&format!("grad.{}", spec.name))?);
        if err > worst.0 {
            worst = (err, spec.name.clone());
        }
        if err > tol.grad {
            failures.push(format!(
                "grad.{}: relative L2 {err:.2e} > {:e}",
                spec.name, tol.grad
            ));
        }
    }
    eprintln!(
        "{precision:?} oracle: worst gradient {:.2e} ({})",
        worst.0, worst.1
    );

    let losses: Vec<f64> = a["losses_f64"]
        .as_array()
        .expect("losses")
        .iter()
        .map(f)
        .collect();
    for want_loss in &losses {
        let pass = gpu.forward_backward(&batch, None)?;
        let err = ((pass.loss as f64 - want_loss) / want_loss).abs();
        eprintln!("{precision:?} oracle: AdamW-step loss relative error {err:.2e}");
        if err > tol.adamw_loss {
            failures.push(format!(
                "AdamW loss {} vs {want_loss}: {err:.2e}",
                pass.loss
            ));
        }
        gpu.adamw_step(adamw.lr)?;
    }
    let mut worst = (0.0f64, String::new());
    for (spec, t) in specs.iter().zip(gpu.weights().master().tensors()) {
        let got = dev.to_host(t)?;
        let err = rel_l2(&got, &want(&format!("after_adamw.{}", spec.name))?);
        if err > worst.0 {
            worst = (err, spec.name.clone());
        }
        if err > tol.param {
            failures.push(format!(
                "after_adamw.{}: relative L2 {err:.2e} > {:e}",
                spec.name, tol.param
            ));
        }
    }
    eprintln!(
        "{precision:?} oracle: worst parameter after AdamW {:.2e} ({})",
        worst.0, worst.1
    );
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n").into())
    }
}

/// The trainer configuration of the comparison runs: 4 rows of 32 tokens, vocab 256, hidden 64,
/// 2 layers, clipping, warmup + cosine.
fn run_config(precision: Precision, checkpointing: Checkpointing, loss: LossKind) -> TrainConfig {
    let mut cfg = common::train_config(common::llama(256, 64, 2), precision, 4, 32, STEPS as u64);
    cfg.checkpointing = checkpointing;
    cfg.loss = loss;
    cfg
}

const STEPS: usize = 20;

fn train<D: Device>(trainer: &mut Trainer<D>, steps: usize) -> Result<Vec<StepStats>, Failed> {
    (0..steps)
        .map(|_| trainer.step().map_err(Failed::from))
        .collect()
}

/// Largest relative loss difference over 20 steps the GPU may show against the CPU: the two
/// sum in different orders, and training amplifies the differences step by step. About 2.5
/// times the figures measured on an H100 (docs/CUDA.md): 1.3e-4 in fp32, 8.0e-3 in bf16-mixed.
fn agreement(precision: Precision) -> f64 {
    match precision {
        Precision::Fp32 => 5e-4,
        Precision::Bf16Mixed => 2e-2,
    }
}

/// Largest relative difference of the step-0 gradient norm the GPU may show against the CPU (the
/// same weights and batch, products summed in another order). Measured on an H100
/// (docs/CUDA.md): 2.0e-8 in fp32, 2.8e-4 in bf16-mixed, in one configuration; the limits leave
/// room for the others (checkpointing, the chunked loss, dropout), and a wrong gradient of any
/// tensor moves the norm by far more.
fn first_norm_agreement(precision: Precision) -> f64 {
    match precision {
        Precision::Fp32 => 1e-6,
        Precision::Bf16Mixed => 1e-3,
    }
}

fn cpu_vs_gpu(precision: Precision, checkpointing: Checkpointing, loss: LossKind) -> Outcome {
    agree(run_config(precision, checkpointing, loss))
}

/// Residual dropout draws the same masks on both devices, recomputed blocks included.
fn cpu_vs_gpu_with_dropout() -> Outcome {
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        let mut cfg = run_config(precision, Checkpointing::Selective, CHUNKED);
        cfg.dropout = 0.1;
        agree(cfg)?;
    }
    Ok(())
}

/// `cfg` trained 20 steps on the CPU and the GPU: the losses agree within the precision's
/// tolerance, and tokens, recomputed blocks and batches are equal.
fn agree(cfg: TrainConfig) -> Outcome {
    let (precision, checkpointing, loss, dropout) =
        (cfg.precision, cfg.checkpointing, cfg.loss, cfg.dropout);
    let mut cpu = Trainer::new(cfg.clone(), CpuDevice::new(0, u64::MAX)?)?;
    let mut gpu = Trainer::new(cfg, CudaDevice::new(0, None)?)?;
    let (c, g) = (train(&mut cpu, STEPS)?, train(&mut gpu, STEPS)?);
    let rel = |a: f64, b: f64| ((a - b) / b).abs();
    let first = rel(g[0].loss as f64, c[0].loss as f64);
    let first_norm = rel(g[0].grad_norm, c[0].grad_norm);
    let worst = c
        .iter()
        .zip(&g)
        .map(|(c, g)| rel(g.loss as f64, c.loss as f64))
        .fold(0.0, f64::max);
    eprintln!(
        "{precision:?} {checkpointing:?} {loss:?} dropout {}: step 0 loss {first:.2e}, grad norm {first_norm:.2e}; worst loss over {STEPS} steps {worst:.2e} (CPU {} -> {}, GPU {} -> {})",
        dropout, c[0].loss, c[STEPS - 1].loss, g[0].loss, g[STEPS - 1].loss
    );
    for (c, g) in c.iter().zip(&g) {
        if (c.tokens, c.recomputed_blocks, &c.batch_digest)
            != (g.tokens, g.recomputed_blocks, &g.batch_digest)
        {
            return Err(
                format!("step {}: tokens, recomputed blocks or batch differ", c.step).into(),
            );
        }
    }
    let norm_tol = first_norm_agreement(precision);
    if first_norm > norm_tol {
        return Err(format!(
            "step 0 gradient norms differ by {first_norm:.2e} relative, more than {norm_tol:e}"
        )
        .into());
    }
    let tol = agreement(precision);
    if worst > tol {
        return Err(format!("losses differ by {worst:.2e} relative, more than {tol:e}").into());
    }
    Ok(())
}

/// Rows of 300 tokens with 64-wide heads: every kernel loop that strides by a block of 256
/// threads (attention keys and queries, RMSNorm, cross-entropy rows) runs more than once.
fn long_rows() -> Outcome {
    let mut model = common::llama(256, 256, 2);
    model.max_position_embeddings = 512;
    let cfg = common::train_config(model, Precision::Fp32, 2, 300, 3);
    let mut cpu = Trainer::new(cfg.clone(), CpuDevice::new(0, u64::MAX)?)?;
    let mut gpu = Trainer::new(cfg, CudaDevice::new(0, None)?)?;
    let (c, g) = (train(&mut cpu, 3)?, train(&mut gpu, 3)?);
    for (c, g) in c.iter().zip(&g) {
        let loss = ((g.loss - c.loss) / c.loss).abs() as f64;
        let norm = ((g.grad_norm - c.grad_norm) / c.grad_norm).abs();
        eprintln!(
            "long rows, step {}: loss {loss:.2e}, grad norm {norm:.2e}",
            c.step
        );
        if loss > 1e-4 || norm > 1e-3 {
            return Err(format!(
                "step {}: loss {} vs CPU {}, grad norm {} vs CPU {}",
                c.step, g.loss, c.loss, g.grad_norm, c.grad_norm
            )
            .into());
        }
    }
    Ok(())
}

/// Per-step (loss, grad norm) as bits.
fn bits(stats: &[StepStats]) -> Vec<(u32, u64)> {
    stats
        .iter()
        .map(|s| (s.loss.to_bits(), s.grad_norm.to_bits()))
        .collect()
}

fn deterministic() -> Outcome {
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        let cfg = run_config(precision, Checkpointing::Selective, LossKind::Standard);
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut t = Trainer::new(cfg.clone(), CudaDevice::new(0, None)?)?;
            let stats = train(&mut t, 8)?;
            runs.push((bits(&stats), t.state_digest()?));
        }
        if runs[0] != runs[1] {
            return Err(format!("{precision:?}: two runs differ").into());
        }
        eprintln!("{precision:?}: two 8-step runs are bitwise equal");
    }
    Ok(())
}

fn resume(precision: Precision) -> Outcome {
    resume_with(precision, 0.0)
}

/// 4 steps, save, resume in a new trainer, 4 steps: bitwise the 8 steps of one trainer.
fn resume_with(precision: Precision, dropout: f32) -> Outcome {
    let mut cfg = run_config(precision, Checkpointing::None, LossKind::Standard);
    cfg.dropout = dropout;
    let dev = CudaDevice::new(0, None)?;
    let mut reference = Trainer::new(cfg.clone(), dev.clone())?;
    let whole = train(&mut reference, 8)?;
    let digest = reference.state_digest()?;
    drop(reference);

    let dir = tempfile::tempdir()?;
    let mut first = Trainer::new(cfg.clone(), dev.clone())?;
    train(&mut first, 4)?;
    let saved = first.save(dir.path(), None)?;
    drop(first);
    let mut resumed = Trainer::resume(cfg, dev, &saved)?;
    if !resumed.env_changes().is_empty() {
        return Err(format!(
            "{precision:?}: a resume on the GPU that saved lists environment changes: {:?}",
            resumed.env_changes()
        )
        .into());
    }
    let rest = train(&mut resumed, 4)?;
    if bits(&rest) != bits(&whole[4..]) {
        return Err(format!(
            "{precision:?}: resumed losses {:?} differ from {:?}",
            rest.iter().map(|s| s.loss).collect::<Vec<_>>(),
            whole[4..].iter().map(|s| s.loss).collect::<Vec<_>>()
        )
        .into());
    }
    if resumed.state_digest()? != digest {
        return Err(format!("{precision:?}: the resumed run ends in a different state").into());
    }
    eprintln!(
        "{precision:?}, dropout {dropout}: 4 + save + resume + 4 steps is bitwise equal to 8 steps"
    );
    Ok(())
}

/// The CUDA device's execution record: every fact present, the kernels' hash NVRTC's own for
/// the GPU's architecture, and the record a checkpoint keeps.
fn execution_record() -> Outcome {
    let dev = CudaDevice::new(0, None)?;
    let env = dev.execution_env();
    let gpu = env.gpu.clone().ok_or("a CUDA device records no GPU")?;
    let numbers = |v: &str, parts: usize| {
        v.split('.').count() == parts && v.split('.').all(|p| p.parse::<u32>().is_ok())
    };
    let arch = format!("sm_{}", gpu.compute_capability.replace('.', ""));
    let checks = [
        ("backend is cuda", env.backend == "cuda"),
        ("no CPU kernels", env.cpu_kernels.is_none()),
        (
            "the GPU's name",
            !gpu.name.is_empty() && gpu.name == dev.name(),
        ),
        ("SMs", gpu.sm_count > 0),
        ("compute capability", numbers(&gpu.compute_capability, 2)),
        ("driver", numbers(&gpu.driver, 2) && gpu.driver != "0.0"),
        ("NVRTC", numbers(&gpu.nvrtc, 2) && gpu.nvrtc != "0.0"),
        ("cuBLAS", numbers(&gpu.cublas, 3) && gpu.cublas != "0.0.0"),
        ("no cuDNN", gpu.cudnn.is_none()),
        (
            "kernel hash",
            gpu.kernel_sha256 == nvrtc::kernel_sha256(&arch),
        ),
        (
            "attention kernels",
            gpu.attention.as_deref()
                == Some(if dev.uses_tensor_core_attention() {
                    "tensor-cores"
                } else {
                    "tiled"
                }),
        ),
    ];
    let wrong: Vec<&str> = checks.iter().filter(|(_, ok)| !ok).map(|c| c.0).collect();
    if !wrong.is_empty() {
        return Err(format!("the record is wrong in {wrong:?}: {env:?}").into());
    }
    let cfg = run_config(Precision::Fp32, Checkpointing::None, LossKind::Standard);
    let mut t = Trainer::new(cfg, dev)?;
    train(&mut t, 1)?;
    let dir = tempfile::tempdir()?;
    let saved = t.save(dir.path(), None)?;
    let state = ckpt_engine::checkpoint::state_file::read(&saved)
        .map_err(EngineError::from)?
        .state;
    if state.environment.as_ref() != Some(&env) {
        return Err(format!(
            "the checkpoint records {:?}, not {env:?}",
            state.environment
        )
        .into());
    }
    eprintln!("{env:?}");
    Ok(())
}

fn memory_reclaimed() -> Outcome {
    let dev = CudaDevice::new(0, None)?;
    let cfg = run_config(
        Precision::Bf16Mixed,
        Checkpointing::None,
        LossKind::Standard,
    );
    // A first run loads every kernel and lets cuBLAS settle, so the measured run sees only its
    // own allocations.
    let mut warm = Trainer::new(cfg.clone(), dev.clone())?;
    train(&mut warm, 2)?;
    drop(warm);
    dev.empty_pool()?;
    let before = dev.pool_stats()?;
    let mut t = Trainer::new(cfg, dev.clone())?;
    train(&mut t, 3)?;
    t.state_digest()?;
    let during = dev.pool_stats()?;
    drop(t);
    let allocated = dev.tracker().allocated();
    dev.empty_pool()?;
    let after = dev.pool_stats()?;
    let delta = before.driver_free as i64 - after.driver_free as i64;
    eprintln!(
        "memory: before {before:?}\n        during {during:?}\n        after {after:?}\n        tracker {allocated} B after drop, driver free {delta} B lower"
    );
    if allocated != 0 {
        return Err(format!("the tracker still counts {allocated} bytes").into());
    }
    if during.reserved_current == 0 {
        return Err("the pool reserved nothing while a trainer was alive".into());
    }
    if after.used_current != 0 || after.reserved_current != 0 {
        return Err(format!("the pool still holds memory after empty_pool: {after:?}").into());
    }
    if delta.abs() > 8 << 20 {
        return Err(format!("driver free memory is {delta} bytes lower than before").into());
    }
    Ok(())
}

/// Every step's tracker peak, and the bytes of every category at it, equal the CUDA memory
/// model's, for both precisions, every checkpointing policy, both loss kinds, with and without
/// dropout.
fn step_peaks_match_the_model() -> Outcome {
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        for checkpointing in [
            Checkpointing::None,
            Checkpointing::Full,
            Checkpointing::Selective,
        ] {
            for (loss, dropout) in [(LossKind::Standard, 0.0), (CHUNKED, 0.1)] {
                let mut cfg = run_config(precision, checkpointing, loss);
                cfg.dropout = dropout;
                let model = estimate(&EstimateConfig::from_train(&cfg, Like::Cuda))?;
                let dev = CudaDevice::new(0, None)?;
                let mut t = Trainer::new(cfg, dev)?;
                for s in train(&mut t, 3)? {
                    let want = model.at_step(s.step);
                    let got = (s.memory.allocated.peak, s.memory.at_peak);
                    if got != (want.peak, want.at_peak) {
                        return Err(format!(
                            "{precision:?} {checkpointing:?} {loss:?} dropout {dropout} step {}: measured peak {} ({:?}), the model says {} ({:?})",
                            s.step, got.0, got.1, want.peak, want.at_peak
                        )
                        .into());
                    }
                }
            }
        }
    }
    eprintln!("12 configurations (6 with dropout) × 3 steps: every step peak equals the CUDA memory model");
    Ok(())
}

/// One step of a fault run: allocated bytes after it, recomputed blocks, and whether its peak
/// exceeded the CUDA memory model's.
#[derive(Debug)]
struct FaultStep {
    held: u64,
    recomputed: usize,
    over_model: bool,
}

/// `steps` steps of `cfg` on a fresh device, and the bytes still counted once the trainer is
/// dropped.
fn fault_run(cfg: &TrainConfig, steps: usize) -> Result<(Vec<FaultStep>, u64), Failed> {
    let model = estimate(&EstimateConfig::from_train(cfg, Like::Cuda))?;
    let dev = CudaDevice::new(0, None)?;
    let mut t = Trainer::new(cfg.clone(), dev.clone())?;
    let mut rows = Vec::new();
    for _ in 0..steps {
        let s = t.step()?;
        rows.push(FaultStep {
            held: dev.tracker().allocated(),
            recomputed: s.recomputed_blocks,
            over_model: s.memory.allocated.peak > model.at_step(s.step).peak,
        });
    }
    drop(t);
    Ok((rows, dev.tracker().allocated()))
}

/// The faults that act inside the model and the optimizer do on the GPU what they do on the
/// CPU (engine/tests/faults.rs): nested blocks keep their activations, recomputed inputs pile
/// up step after step, and AdamW's moments outlive the trainer.
fn model_level_faults() -> Outcome {
    let clean = run_config(Precision::Fp32, Checkpointing::Full, LossKind::Standard);
    let layers = clean.model.num_hidden_layers;
    let (rows, after_drop) = fault_run(&clean, 3)?;
    if rows.iter().any(|r| r.recomputed != layers || r.over_model) || after_drop != 0 {
        return Err(
            format!("the clean run misbehaves: {rows:?}, {after_drop} B after drop").into(),
        );
    }
    let with = |fault: Fault| {
        let mut cfg = clean.clone();
        cfg.faults = [fault].into_iter().collect();
        cfg
    };
    // Step 0's peak on the GPU is where AdamW's moments are first allocated, after the passes
    // have freed their activations (the CPU's workspace puts it in the passes); from step 1 the
    // moments are resident and the peak is in the passes, where the kept activations sit.
    let (rows, _) = fault_run(&with(Fault::CheckpointingSkippedNested), 3)?;
    if rows.iter().any(|r| r.recomputed != 1) || rows[1..].iter().any(|r| !r.over_model) {
        return Err(format!("checkpointing_skipped_nested: {rows:?}").into());
    }
    let (rows, after_drop) = fault_run(&with(Fault::RecomputeInputsKept), 3)?;
    let input = (clean.batch_size * clean.seq_len * clean.model.hidden_size * 4) as u64;
    let grows = rows
        .windows(2)
        .all(|w| w[1].held - w[0].held == input * layers as u64);
    if !grows || after_drop != 0 {
        return Err(format!("recompute_inputs_kept: {rows:?}, {after_drop} B after drop").into());
    }
    let (_, after_drop) = fault_run(&with(Fault::OptimizerStateRetained), 2)?;
    let moments = 2 * 4 * clean.model.num_params() as u64;
    if after_drop != moments {
        return Err(format!(
            "optimizer_state_retained: {after_drop} B after drop, the moments are {moments} B"
        )
        .into());
    }
    eprintln!("checkpointing_skipped_nested, recompute_inputs_kept and optimizer_state_retained act on the GPU");
    Ok(())
}

/// Where the ranks of [`ranks_train_one_devices_bits`] run.
#[derive(Clone, Copy, Debug)]
enum Cards {
    /// On the machine's last GPU, which no rank after the first has a GPU beyond to take.
    Shared,
    /// From GPU 0, a GPU each (world sizes up to the machine's GPUs).
    OwnEach,
}

/// Data-parallel ranks (each its own stream, cuBLAS handle and tracker) on the GPUs `cards`
/// gives them: at world sizes 2, 3 and 4 (up to the machine's GPUs for `OwnEach`) and every
/// sharding stage, in both precisions, the steps' losses and gradient norms and the final state
/// are one device's bits, and every rank's step peaks and bytes by category are the CUDA memory
/// model's for that rank. A Llama with grouped-query attention, a vocabulary neither 3 nor 4
/// divides, 12 micro-batches a step.
fn ranks_train_one_devices_bits(cards: Cards) -> Outcome {
    let gpus = CudaDevice::count();
    let (first, worlds): (usize, Vec<usize>) = match cards {
        Cards::Shared => (gpus - 1, vec![2, 3, 4]),
        Cards::OwnEach => (0, (2..=4).filter(|&w| w <= gpus).collect()),
    };
    let open = || CudaDevice::new(first, None);
    for &world in &worlds {
        let ordinals: Vec<usize> = open()?.ranks(world)?.iter().map(|d| d.ordinal()).collect();
        let want: Vec<usize> = match cards {
            Cards::Shared => vec![first; world],
            Cards::OwnEach => (0..world).collect(),
        };
        if ordinals != want {
            return Err(format!(
                "{world} ranks ({cards:?}) run on GPUs {ordinals:?}, not {want:?}"
            )
            .into());
        }
    }
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        let mut base = common::train_config(common::llama(37, 64, 2), precision, 1, 16, 6);
        base.accumulation = 12;
        base.optimizer.grad_clip = Some(0.5);
        let run = |cfg: &TrainConfig| -> Result<(Vec<(u32, u64)>, String), Failed> {
            let mut t = Trainer::new(cfg.clone(), open()?)?;
            let steps = train(&mut t, 3)?;
            Ok((bits(&steps), format!("{:?}", t.state_digest()?)))
        };
        let one = run(&base)?;
        for &world_size in &worlds {
            for shard in [Shard::None, Shard::Optimizer, Shard::Gradients, Shard::Full] {
                let cfg = TrainConfig {
                    parallel: Parallel {
                        world_size,
                        shard,
                        ..Parallel::default()
                    },
                    ..base.clone()
                };
                let at = format!("{precision:?}, {world_size} ranks ({cards:?}), {shard:?}");
                if run(&cfg)? != one {
                    return Err(format!("{at}: the bits differ from one device's").into());
                }
                let model = estimate(&EstimateConfig::from_train(&cfg, Like::Cuda))?;
                let mut t = Trainer::new(cfg, open()?)?;
                for s in train(&mut t, 2)? {
                    for (rank, (got, want)) in s.rank_memory.iter().zip(&model.ranks).enumerate() {
                        let want = &want[s.step.min(1) as usize];
                        if (got.allocated.peak, got.at_peak) != (want.peak, want.at_peak) {
                            return Err(format!(
                                "{at}, step {}, rank {rank}: measured peak {} ({:?}), the model says {} ({:?})",
                                s.step, got.allocated.peak, got.at_peak, want.peak, want.at_peak
                            )
                            .into());
                        }
                    }
                }
            }
        }
    }
    eprintln!("ranks ({cards:?}): world sizes {worlds:?} at every stage train one device's bits, each rank's peaks the model's");
    Ok(())
}

/// NCCL opens under the name its packages install (`libnccl.so.2`, the only name PyTorch's
/// wheels ship it under: CI runs this with that directory alone on the loader's path, where
/// cudarc's own names find nothing) and is a version the engine takes.
fn nccl_loads() -> Outcome {
    let nccl = Nccl::get()?;
    if nccl.version() < nccl::OLDEST {
        return Err(format!("{nccl:?} loaded, older than {}", nccl::OLDEST).into());
    }
    eprintln!("{nccl:?}");
    Ok(())
}
