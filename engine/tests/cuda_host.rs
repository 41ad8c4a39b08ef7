//! The CUDA kernels' logic, checked without a GPU: `kernels.cu` is compiled as host C++ under an
//! emulation of the CUDA execution model (`cuda_host/emulator.h`: a block's threads are OS
//! threads, `__syncthreads` a barrier, blocks run one after another) and its kernels are run on
//! small random inputs against the CPU backend's: the attention kernels (the tiled forward pass
//! and dq, dk, dv, and the same on tensor cores, whose warp-level instructions the emulator
//! implements by PTX's fragment layouts), residual dropout (whose masks must be the CPU's, bit for bit), RMSNorm
//! forward and backward, the rotary embedding both ways, bias rows and their gradient, a MoE
//! layer's row scaling, row scatter-adds and row dot products, SwiGLU forward and backward, the embedding forward and backward, the cross-entropy rows, AdamW, the
//! gradient norm's partial sums and the bf16 copy of the master weights: every kernel in the
//! file.
//! Memory coalescing, occupancy and speed are a GPU's to show (`tests/cuda.rs`).
//!
//! Needs a C++20 compiler (`$CXX`, else `c++`); without one the trials are listed as ignored.
//! The compiler is told not to fuse multiplies and adds, as NVRTC is (`--fmad=false`).

mod common;

use ckpt_engine::backend::cuda::{attention_tiles, tensor_core_keys, TC_ROWS};
use ckpt_engine::device::dropout::{Dropout, Site, DRAW_SHIFT};
use ckpt_engine::device::rope::{RopeSpec, RopeTable};
use ckpt_engine::device::AttnShape;
use ckpt_engine::memory::Category;
use ckpt_engine::optim::{grad_norm, AdamW, AdamWConfig};
use ckpt_engine::Device;
use ckpt_engine::{CpuDevice, Elem};
use ckpt_engine::{Params, Tensor};
use half::bf16;
use libtest_mimic::{Arguments, Failed, Trial};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

type Outcome = Result<(), Failed>;

fn main() {
    let args = Arguments::from_args();
    let missing = compiler_missing();
    if let Some(why) = &missing {
        eprintln!("CUDA host-emulation trials are ignored: {why}");
    }
    let trial =
        |name: &str, f: fn() -> Outcome| Trial::test(name, f).with_ignored_flag(missing.is_some());
    let trials = vec![
        trial("attention_f32_matches_the_cpu", || attention::<f32>(1e-5)),
        trial("attention_bf16_matches_the_cpu", || attention::<bf16>(1e-2)),
        trial(
            "a_causal_mask_off_by_one_fails_the_attention_check",
            broken_causal_mask_fails,
        ),
        trial(
            "a_document_mask_off_by_one_fails_the_attention_check",
            || {
                fault_fails(
                    "j0 + jj >= first) {\n                float dot",
                    "j0 + jj + 1 >= first) {\n                float dot",
                    "a document mask off by one",
                    |exe| attention_on::<f32>(exe, Kernels::Tiled, 1e-5),
                )
            },
        ),
        trial(
            "attention_on_tensor_cores_matches_the_cpu",
            attention_tensor_cores,
        ),
        trial(
            "a_tensor_core_document_mask_off_by_one_fails_the_attention_check",
            || {
                tensor_core_fault_fails(
                    "j <= i && j >= first[e >> 1] ? a.scale",
                    "j <= i && j + 1 >= first[e >> 1] ? a.scale",
                    "a document mask off by one",
                )
            },
        ),
        trial(
            "a_tensor_core_causal_mask_off_by_one_fails_the_attention_check",
            || {
                tensor_core_fault_fails(
                    "s[n][e] = j <= i && j >= first[e >> 1]",
                    "s[n][e] = j < i && j >= first[e >> 1]",
                    "a causal mask off by one",
                )
            },
        ),
        trial(
            "reading_a_tile_before_its_copies_land_fails_the_attention_check",
            || {
                tensor_core_fault_fails(
                    "            cp_async_wait<1>();\n",
                    "",
                    "a tile read before its cp.async copies were waited for",
                )
            },
        ),
        trial(
            "a_b_fragment_transposed_the_wrong_way_fails_the_attention_check",
            || {
                tensor_core_fault_fails(
                    "ldmatrix_x4_trans(f, tile + (k0 + lane % 8 + (m & 1) * 8) * sd + n0 + (m >> 1) * 8);",
                    "ldmatrix_x4_trans(f, tile + (k0 + lane % 8 + (m >> 1) * 8) * sd + n0 + (m & 1) * 8);",
                    "a B fragment loaded with its halves swapped",
                )
            },
        ),
        trial("dropout_f32_is_the_cpu_s_bit_for_bit", dropout::<f32>),
        trial("dropout_bf16_is_the_cpu_s_bit_for_bit", dropout::<bf16>),
        trial("rmsnorm_f32_matches_the_cpu", || rmsnorm::<f32>(1e-5)),
        trial("rmsnorm_bf16_matches_the_cpu", || rmsnorm::<bf16>(1e-2)),
        trial(
            "a_weight_gradient_share_missing_a_row_fails_the_rmsnorm_check",
            || {
                fault_fails(
                    "u64 end = begin + share < rows ? begin + share : rows;",
                    "u64 end = begin + share - 1 < rows ? begin + share - 1 : rows;",
                    "a weight gradient share missing its last row",
                    |exe| rmsnorm_on::<f32>(exe, 1e-5),
                )
            },
        ),
        trial("rope_f32_is_the_cpu_s_bit_for_bit", rope_both_ways::<f32>),
        trial("rope_bf16_is_the_cpu_s_bit_for_bit", rope_both_ways::<bf16>),
        trial("bias_f32_is_the_cpu_s_bit_for_bit", bias::<f32>),
        trial("bias_bf16_is_the_cpu_s_bit_for_bit", bias::<bf16>),
        trial("moe_rows_f32_are_the_cpu_s_bit_for_bit", moe_rows::<f32>),
        trial("moe_rows_bf16_are_the_cpu_s_bit_for_bit", moe_rows::<bf16>),
        trial("swiglu_f32_is_the_cpu_s_bit_for_bit", swiglu::<f32>),
        trial("swiglu_bf16_is_the_cpu_s_bit_for_bit", swiglu::<bf16>),
        trial("embedding_f32_is_the_cpu_s_bit_for_bit", embedding::<f32>),
        trial("embedding_bf16_is_the_cpu_s_bit_for_bit", embedding::<bf16>),
        trial("cross_entropy_f32_matches_a_reference", || {
            xent::<f32>(1e-5)
        }),
        trial("cross_entropy_bf16_matches_a_reference", || {
            xent::<bf16>(1e-2)
        }),
        trial("optimizer_kernels_match_the_cpu", optimizer),
        trial(
            "sum_of_squares_partials_are_the_cpu_s_bit_for_bit",
            sum_of_squares_partials,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

fn work_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda_host")
}

/// A directory of this process's own under [`work_dir`]: test runners may run several trial
/// processes at once.
fn process_dir(what: &str) -> Result<PathBuf, String> {
    let dir = work_dir().join(format!("{what}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}

/// Why no C++20 compiler with `<barrier>` can be used here, if none can.
fn compiler_missing() -> Option<String> {
    let dir = match process_dir("probe") {
        Ok(d) => d,
        Err(e) => return Some(format!("cannot create a work directory: {e}")),
    };
    let probe = dir.join("probe.cpp");
    let program = "#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n";
    if let Err(e) = std::fs::write(&probe, program) {
        return Some(format!("{}: {e}", probe.display()));
    }
    let out = Command::new(compiler())
        .args(["-std=c++20", "-pthread", "-o"])
        .arg(dir.join("probe"))
        .arg(&probe)
        .output();
    let _ = std::fs::remove_dir_all(&dir);
    match out {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "{} cannot compile C++20 with <barrier>: {}",
            compiler(),
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .next()
                .unwrap_or("")
        )),
        Err(e) => Some(format!("no C++ compiler ({}): {e}; set CXX", compiler())),
    }
}

/// `kernels.cu` as host C++: dynamic shared memory becomes the emulator's buffer, and the
/// kernels lose their C linkage (the driver calls the templates directly).
fn host_kernels() -> Result<String, Failed> {
    let source = include_str!("../src/backend/cuda/kernels.cu");
    let shared = "extern __shared__ float dyn[];";
    if source.matches(shared).count() != 6 {
        return Err(format!("kernels.cu declares dynamic shared memory other than `{shared}` six times; update cuda_host.rs").into());
    }
    Ok(source
        .replace(shared, "float* dyn = dynamic_shared;")
        .replace("extern \"C\" ", ""))
}

/// The driver built from `kernels.cu` as it is, once per process.
fn driver() -> Result<PathBuf, Failed> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| build(host_kernels().map_err(|e| format!("{e:?}"))?))
        .clone()
        .map_err(Failed::from)
}

/// Compiles the driver around `kernels` (host C++), once per content of its sources and
/// compiler: the binary is named after their hash, built in a temporary directory of the
/// build's own and renamed into place, so concurrent builds, within a trial process or across
/// several, share it safely.
fn build(kernels: String) -> Result<PathBuf, String> {
    let sources = [
        (
            "emulator.h",
            include_str!("cuda_host/emulator.h").to_string(),
        ),
        (
            "driver.cpp",
            include_str!("cuda_host/driver.cpp").to_string(),
        ),
        ("kernels.cpp", kernels),
    ];
    let mut hash = Sha256::new();
    hash.update(compiler().as_bytes());
    for (name, text) in &sources {
        hash.update(name.as_bytes());
        hash.update(text.as_bytes());
    }
    let key: String = hash.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let exe = work_dir().join(format!("driver-{key}"));
    if exe.exists() {
        return Ok(exe);
    }
    let temp = tempfile::Builder::new()
        .prefix("build")
        .tempdir_in(work_dir())
        .map_err(|e| format!("a build directory in {}: {e}", work_dir().display()))?;
    let dir = temp.path();
    for (name, text) in &sources {
        std::fs::write(dir.join(name), text).map_err(|e| format!("{name}: {e}"))?;
    }
    let out = Command::new(compiler())
        .args([
            "-std=c++20",
            "-O1",
            "-ffp-contract=off",
            "-pthread",
            "-w",
            "-o",
        ])
        .arg(dir.join("driver"))
        .arg(dir.join("driver.cpp"))
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "compiling kernels.cu as C++ failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    std::fs::rename(dir.join("driver"), &exe).map_err(|e| e.to_string())?;
    Ok(exe)
}

/// Runs the driver for `what` on `inputs` (written back to back) through files in a temporary
/// directory of the call's own; returns what it wrote.
fn run_driver(
    exe: &Path,
    what: &str,
    args: &[String],
    inputs: &[&[u8]],
) -> Result<Vec<u8>, Failed> {
    let dir = tempfile::Builder::new()
        .prefix(what)
        .tempdir_in(work_dir())?;
    let (input, output) = (dir.path().join("in"), dir.path().join("out"));
    std::fs::write(&input, inputs.concat())?;
    let out = Command::new(exe)
        .args(args)
        .arg(&input)
        .arg(&output)
        .output()?;
    if !out.status.success() {
        return Err(format!("driver {args:?}: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(std::fs::read(&output)?)
}

fn elem_name<E: Elem>() -> &'static str {
    match E::DTYPE {
        ckpt_engine::DType::F32 => "f32",
        ckpt_engine::DType::Bf16 => "bf16",
    }
}

fn random<E: Elem>(rng: &mut ChaCha8Rng, n: usize) -> Vec<E> {
    (0..n)
        .map(|_| E::from_f32(rng.random_range(-2.0f32..2.0)))
        .collect()
}

/// Splits `bytes` into arrays of the given element counts.
fn split<E: bytemuck::Pod>(bytes: &mut &[u8], n: usize) -> Vec<E> {
    let (head, tail) = bytes.split_at(n * std::mem::size_of::<E>());
    *bytes = tail;
    head.chunks_exact(std::mem::size_of::<E>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

/// The largest difference of `got` from `want`, over the largest magnitude of `want` (at
/// least 1); infinite where one is NaN and the other is not.
fn rel_diff<E: Elem>(got: &[E], want: &[E]) -> f64 {
    let scale = want
        .iter()
        .map(|x| x.to_f32().abs() as f64)
        .fold(1.0, f64::max);
    got.iter()
        .zip(want)
        .map(|(a, b)| {
            let (a, b) = (a.to_f32() as f64, b.to_f32() as f64);
            match (a.is_nan(), b.is_nan()) {
                (false, false) => (a - b).abs(),
                (true, true) => 0.0,
                _ => f64::INFINITY,
            }
        })
        .fold(0.0, f64::max)
        / scale
}

/// The tiled attention forward and backward passes against the CPU's, on shapes that cover
/// grouped heads, head widths 8 to 256 and rows shorter, longer and not a multiple of a tile,
/// each once as whole sequences and once packed with documents of random lengths.
fn attention<E: Elem>(tolerance: f64) -> Outcome {
    attention_on::<E>(&driver()?, Kernels::Tiled, tolerance)
}

/// Which attention kernels a comparison runs.
#[derive(Clone, Copy)]
enum Kernels {
    /// The tiled f32-arithmetic kernels, for every storage type and head width.
    Tiled,
    /// The tensor-core kernels: bf16 storage, head widths 16 to 128 in steps of 16.
    TensorCores,
}

/// The tensor-core attention kernels against the CPU's, bf16, on a shape of every head width
/// they have kernels for: grouped heads, one row, and rows spanning several tiles of both sides.
fn attention_tensor_cores() -> Outcome {
    attention_on::<bf16>(&driver()?, Kernels::TensorCores, 1e-2)
}

/// The tensor-core kernels built with `fault` in place of `right` fail the comparison with the
/// CPU.
fn tensor_core_fault_fails(right: &str, fault: &str, what: &str) -> Outcome {
    fault_fails(right, fault, what, |exe| {
        attention_on::<bf16>(exe, Kernels::TensorCores, 1e-2)
    })
}

/// `check` fails, by a difference from the CPU, with a driver built with `fault` in place of
/// `right` (found exactly once in kernels.cu).
fn fault_fails(right: &str, fault: &str, what: &str, check: impl Fn(&Path) -> Outcome) -> Outcome {
    let kernels = host_kernels()?;
    if kernels.matches(right).count() != 1 {
        return Err(format!("`{right}` is not in kernels.cu once; update this control").into());
    }
    let broken = build(kernels.replace(right, fault))?;
    match check(&broken) {
        Err(e) if format!("{e:?}").contains("differs from the CPU's") => Ok(()),
        Err(e) => Err(format!("failed for another reason: {e:?}").into()),
        Ok(()) => Err(format!("{what} passed the check").into()),
    }
}

/// The negative control of [`attention`]: the same comparison with a driver whose forward pass
/// lets no query row see its own key fails.
fn broken_causal_mask_fails() -> Outcome {
    let right = "if (row_ok && j0 + jj <= i && j0 + jj >= first) {\n                float dot";
    let kernels = host_kernels()?;
    if kernels.matches(right).count() != 1 {
        return Err("the forward pass's causal mask is not where this control expects it".into());
    }
    let broken = build(kernels.replace(right, &right.replace("<= i", "< i")))?;
    match attention_on::<f32>(&broken, Kernels::Tiled, 1e-5) {
        Err(e) if format!("{e:?}").contains("differs from the CPU's") => Ok(()),
        Err(e) => Err(format!("failed for another reason: {e:?}").into()),
        Ok(()) => Err("a causal mask off by one passed the attention check".into()),
    }
}

/// [`attention`] with the driver at `exe`, running `kernels`.
fn attention_on<E: Elem>(exe: &Path, kernels: Kernels, tolerance: f64) -> Outcome {
    let dev = CpuDevice::new(1, u64::MAX)?;
    let shapes: &[_] = match kernels {
        Kernels::Tiled => &[
            (2, 37, 4, 2, 16),
            (1, 70, 2, 1, 64),
            (1, 33, 4, 4, 32),
            (2, 5, 2, 2, 8),
            (1, 20, 2, 1, 128),
            (1, 19, 1, 1, 256),
            (1, 1, 2, 1, 64),
        ],
        Kernels::TensorCores => &[
            (2, 37, 4, 2, 16),
            (1, 70, 2, 1, 64),
            (2, 130, 8, 2, 64),
            (1, 33, 4, 4, 32),
            (1, 150, 2, 1, 128),
            (1, 20, 2, 2, 80),
            (1, 1, 2, 1, 64),
            (1, 65, 3, 1, 48),
            (1, 40, 2, 1, 96),
            (1, 17, 1, 1, 112),
        ],
    };
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let packings = shapes
        .iter()
        .flat_map(|&shape| [(shape, false), (shape, true)]);
    for ((batch, seq, heads, kv_heads, head_dim), packed) in packings {
        let s = AttnShape {
            batch,
            seq,
            heads,
            kv_heads,
            head_dim,
        };
        let tiles = attention_tiles(head_dim).ok_or("no tiles")?;
        let (qn, kn, ln) = (
            batch * seq * heads * head_dim,
            batch * seq * kv_heads * head_dim,
            batch * heads * seq,
        );
        let (q, k, v, dout) = (
            random::<E>(&mut rng, qn),
            random::<E>(&mut rng, kn),
            random::<E>(&mut rng, kn),
            random::<E>(&mut rng, qn),
        );
        let positions = packed.then(|| documents(&mut rng, batch, seq));
        let tpos = positions.as_ref();
        let [tq, tk, tv, tdout] = [&q, &k, &v, &dout].map(|x| on_cpu(&dev, x));
        let mut tout = on_cpu(&dev, &vec![E::default(); qn]);
        let mut tlse = on_cpu(&dev, &vec![0f32; ln]);
        dev.attention_forward(s, tpos, &tq, &tk, &tv, &mut tout, &mut tlse)?;
        let [mut tdq, mut tdk, mut tdv] =
            [qn, kn, kn].map(|n| on_cpu(&dev, &vec![E::default(); n]));
        let saved = (&tout, &tlse);
        dev.attention_backward(
            s, tpos, &tq, &tk, &tv, saved, &tdout, &mut tdq, &mut tdk, &mut tdv,
        )?;
        let (out, lse) = (tout.as_slice(), tlse.as_slice());
        let (dq, dk, dv) = (tdq.as_slice(), tdk.as_slice(), tdv.as_slice());

        let shape = [batch, seq, heads, kv_heads, head_dim];
        let (command_name, args, what) = match kernels {
            Kernels::Tiled => (
                "attention",
                [
                    &shape[..],
                    &[tiles.forward_queries, tiles.forward_keys, tiles.backward],
                    &[usize::from(packed)],
                ]
                .concat(),
                format!("{s:?} {tiles:?}, packed: {packed}"),
            ),
            Kernels::TensorCores => {
                let keys = tensor_core_keys(head_dim).ok_or("no tensor-core kernels")?;
                (
                    "attention-tc",
                    [&shape[..], &[keys, usize::from(packed)]].concat(),
                    format!("{s:?} on tensor cores, {TC_ROWS} x {keys} tiles, packed: {packed}"),
                )
            }
        };
        let args: Vec<String> = args.iter().map(|n| n.to_string()).collect();
        let bytes = run_driver(
            exe,
            &format!("{command_name}-{}", elem_name::<E>()),
            &command::<E>(command_name, &args),
            &[
                bytemuck::cast_slice(&q),
                bytemuck::cast_slice(&k),
                bytemuck::cast_slice(&v),
                bytemuck::cast_slice(&dout),
                bytemuck::cast_slice(positions.as_deref().unwrap_or_default()),
            ],
        )?;
        let mut rest = bytes.as_slice();
        let g_out: Vec<E> = split(&mut rest, qn);
        let g_lse: Vec<f32> = split(&mut rest, ln);
        let g_dq: Vec<E> = split(&mut rest, qn);
        let g_dk: Vec<E> = split(&mut rest, kn);
        let g_dv: Vec<E> = split(&mut rest, kn);
        within(
            &what,
            &[
                ("out", rel_diff(&g_out, out)),
                ("lse", rel_diff(&g_lse, lse)),
                ("dq", rel_diff(&g_dq, dq)),
                ("dk", rel_diff(&g_dk, dk)),
                ("dv", rel_diff(&g_dv, dv)),
            ],
            tolerance,
        )?;
    }
    Ok(())
}

/// `dropout_add` and `dropout_bwd` give the CPU's bits: the same masks, the same arithmetic.
fn dropout<E: Elem>() -> Outcome {
    let dev = CpuDevice::new(1, u64::MAX)?;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let n = 3000;
    let (x, y, dout) = (
        random::<E>(&mut rng, n),
        random::<E>(&mut rng, n),
        random::<E>(&mut rng, n),
    );
    for (p, layer, site) in [(0.1, 0, Site::Attention), (0.5, 3, Site::Mlp)] {
        let mask = Dropout {
            p,
            seed: 1234,
            offset: 17,
        }
        .mask(layer, site);
        let [tx, ty, tdout] = [&x, &y, &dout].map(|v| on_cpu(&dev, v));
        let [mut tout, mut tdy] = [n, n].map(|n| on_cpu(&dev, &vec![E::default(); n]));
        dev.dropout_add(&mask, &tx, &ty, &mut tout)?;
        dev.dropout_backward(&mask, &tdout, &mut tdy)?;
        let (out, dy) = (tout.as_slice().to_vec(), tdy.as_slice().to_vec());
        let args = [
            n.to_string(),
            mask.key().to_string(),
            mask.threshold().to_string(),
            DRAW_SHIFT.to_string(),
            format!("{:e}", mask.scale()),
        ];
        let bytes = run_driver(
            &driver()?,
            &format!("dropout-{}", elem_name::<E>()),
            &command::<E>("dropout", &args),
            &[
                bytemuck::cast_slice(&x),
                bytemuck::cast_slice(&y),
                bytemuck::cast_slice(&dout),
            ],
        )?;
        let mut rest = bytes.as_slice();
        let g_out: Vec<E> = split(&mut rest, n);
        let g_dy: Vec<E> = split(&mut rest, n);
        let kept = (0..n as u64).filter(|&i| mask.keeps(i)).count();
        eprintln!("p {p}: {kept} of {n} kept");
        if g_out != out || g_dy != dy {
            let first = (0..n).find(|&i| g_out[i] != out[i] || g_dy[i] != dy[i]);
            return Err(format!(
                "p {p}: the emulated kernels differ from the CPU's, first at element {first:?}"
            )
            .into());
        }
    }
    Ok(())
}

/// The arguments of a driver command: its name, the element type, then `rest`.
fn command<E: Elem>(name: &str, rest: &[String]) -> Vec<String> {
    [name.to_string(), elem_name::<E>().into()]
        .into_iter()
        .chain(rest.iter().cloned())
        .collect()
}

/// A tensor of the CPU device holding `values`.
fn on_cpu<E: Elem>(dev: &CpuDevice, values: &[E]) -> Tensor<E> {
    let mut t = dev
        .zeros::<E>(&[values.len()], Category::Activations)
        .expect("an unlimited device");
    t.as_mut_slice().copy_from_slice(values);
    t
}

/// Fails with the first of `diffs` above `tolerance`.
fn within(what: &str, diffs: &[(&str, f64)], tolerance: f64) -> Outcome {
    let shown: Vec<String> = diffs.iter().map(|(w, d)| format!("{w} {d:.1e}")).collect();
    eprintln!("{what}: {}", shown.join(", "));
    match diffs.iter().find(|(_, d)| *d > tolerance) {
        Some((w, d)) => Err(format!(
            "{what}: {w} differs from the CPU's by {d:.2e} (tolerance {tolerance:e})"
        )
        .into()),
        None => Ok(()),
    }
}

/// RMSNorm forward, the input gradient (accumulated onto an existing one) and the weight
/// gradient, on rows narrower and wider than a block, and more rows than the weight
/// gradient's block has warps.
fn rmsnorm<E: Elem>(tolerance: f64) -> Outcome {
    rmsnorm_on::<E>(&driver()?, tolerance)
}

/// [`rmsnorm`] with the driver at `exe`.
fn rmsnorm_on<E: Elem>(exe: &Path, tolerance: f64) -> Outcome {
    let dev = CpuDevice::new(1, u64::MAX)?;
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    for (rows, h) in [(5, 24), (3, 700), (100, 40)] {
        let n = rows * h;
        let (x, w, dy, dx0) = (
            random::<E>(&mut rng, n),
            random::<E>(&mut rng, h),
            random::<E>(&mut rng, n),
            random::<E>(&mut rng, n),
        );
        let eps = 1e-5f32;
        let [tx, tw, tdy] = [&x, &w, &dy].map(|v| on_cpu(&dev, v));
        let mut ty = on_cpu(&dev, &vec![E::default(); n]);
        let mut trinv = on_cpu(&dev, &vec![0f32; rows]);
        dev.rmsnorm_forward(&tx, &tw, eps, &mut ty, &mut trinv)?;
        let (mut tdx, mut tdw) = (on_cpu(&dev, &dx0), on_cpu(&dev, &vec![0f32; h]));
        dev.rmsnorm_backward(&tdy, &tx, &tw, &trinv, &mut tdx, &mut tdw)?;
        let (y, rinv) = (ty.as_slice(), trinv.as_slice());
        let (dx, dw) = (tdx.as_slice(), tdw.as_slice());
        let args = [rows.to_string(), h.to_string(), format!("{eps:e}")];
        let bytes = run_driver(
            exe,
            &format!("rmsnorm-{}", elem_name::<E>()),
            &command::<E>("rmsnorm", &args),
            &[
                bytemuck::cast_slice(&x),
                bytemuck::cast_slice(&w),
                bytemuck::cast_slice(&dy),
                bytemuck::cast_slice(&dx0),
            ],
        )?;
        let mut rest = bytes.as_slice();
        let g_y: Vec<E> = split(&mut rest, n);
        let g_rinv: Vec<f32> = split(&mut rest, rows);
        let g_dx: Vec<E> = split(&mut rest, n);
        let g_dw: Vec<f32> = split(&mut rest, h);
        within(
            &format!("rmsnorm {rows}x{h}"),
            &[
                ("y", rel_diff(&g_y, y)),
                ("rinv", rel_diff(&g_rinv, rinv)),
                ("dx", rel_diff(&g_dx, dx)),
                ("dw", rel_diff(&g_dw, dw)),
            ],
            tolerance,
        )?;
    }
    Ok(())
}

/// A packed batch's positions: each of `batch` sequences of `seq` tokens cut into documents of
/// random lengths, each token's position its place in its document.
fn documents(rng: &mut ChaCha8Rng, batch: usize, seq: usize) -> Vec<u32> {
    let mut positions = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        let mut left = seq;
        while left > 0 {
            let len = rng.random_range(1..=left.min(seq / 2 + 1));
            positions.extend(0..len as u32);
            left -= len;
        }
    }
    positions
}

/// The rotary embedding and its inverse give the CPU's bits (the same products, unfused),
/// with rows at positions past the first sequence, and with a packed batch's positions.
fn rope_both_ways<E: Elem>() -> Outcome {
    let dev = CpuDevice::new(1, u64::MAX)?;
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let (seq, batch, heads, head_dim, positions) = (7, 3, 3, 16, 9);
    let (rows, width) = (seq * batch, heads * head_dim);
    let spec = RopeSpec {
        head_dim,
        theta: 10000.0,
        positions,
    };
    let (table, tables) = (
        RopeTable::new(head_dim, 10000.0, positions)?,
        dev.rope_tables(spec)?,
    );
    for packed in [false, true] {
        let at = packed.then(|| documents(&mut rng, batch, seq));
        let x = random::<E>(&mut rng, rows * width);
        let mut t = on_cpu(&dev, &x);
        dev.rope(&mut t, (width, seq), &tables, at.as_ref(), false)?;
        let once = t.as_slice().to_vec();
        dev.rope(&mut t, (width, seq), &tables, at.as_ref(), true)?;
        let back = t.as_slice().to_vec();
        let args =
            [rows, width, seq, table.half, positions, usize::from(packed)].map(|v| v.to_string());
        let bytes = run_driver(
            &driver()?,
            &format!("rope-{}", elem_name::<E>()),
            &command::<E>("rope", &args),
            &[
                bytemuck::cast_slice(&x),
                bytemuck::cast_slice(&table.cos),
                bytemuck::cast_slice(&table.sin),
                bytemuck::cast_slice(at.as_deref().unwrap_or_default()),
            ],
        )?;
        let mut rest = bytes.as_slice();
        let g_once: Vec<E> = split(&mut rest, rows * width);
        let g_back: Vec<E> = split(&mut rest, rows * width);
        if g_once != once || g_back != back {
            return Err(format!(
                "the emulated rotary embedding differs from the CPU's (packed: {packed})"
            )
            .into());
        }
    }
    Ok(())
}

/// A bias added to every row, and its gradient summed over the rows in order, give the CPU's
/// bits, on rows narrower and wider than a block.
fn bias<E: Elem>() -> Outcome {
    let dev = CpuDevice::new(1, u64::MAX)?;
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    for (rows, width) in [(7, 24), (33, 300)] {
        let n = rows * width;
        let (y, b, dy) = (
            random::<E>(&mut rng, n),
            random::<E>(&mut rng, width),
            random::<E>(&mut rng, n),
        );
        let [mut ty, tb, tdy] = [&y, &b, &dy].map(|v| on_cpu(&dev, v));
        let mut tdb = on_cpu(&dev, &vec![0f32; width]);
        dev.add_bias(&mut ty, &tb)?;
        dev.bias_grad(&tdy, &mut tdb)?;
        let bytes = run_driver(
            &driver()?,
            &format!("bias-{}", elem_name::<E>()),
            &command::<E>("bias", &[rows.to_string(), width.to_string()]),
            &[
                bytemuck::cast_slice(&y),
                bytemuck::cast_slice(&b),
                bytemuck::cast_slice(&dy),
            ],
        )?;
        let mut rest = bytes.as_slice();
        let g_y: Vec<E> = split(&mut rest, n);
        let g_db: Vec<f32> = split(&mut rest, width);
        if g_y != ty.as_slice() || g_db != tdb.as_slice() {
            return Err(format!("{rows}x{width}: the emulated bias differs from the CPU's").into());
        }
    }
    Ok(())
}

/// A MoE layer's row kernels give the CPU's bits: rows scaled by their weights, expert rows
/// added (weighted and not) into their batch rows, and row dot products, on rows narrower and
/// wider than a block.
fn moe_rows<E: Elem>() -> Outcome {
    let dev = CpuDevice::new(1, u64::MAX)?;
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for (n, width, dst_rows) in [(5, 24, 9), (40, 300, 64)] {
        let len = n * width;
        let mut rows: Vec<u32> = (0..dst_rows as u32).collect();
        for i in 0..n {
            rows.swap(i, rng.random_range(i..dst_rows));
        }
        rows.truncate(n);
        let (src, w, dst) = (
            random::<E>(&mut rng, len),
            random::<E>(&mut rng, n),
            random::<E>(&mut rng, dst_rows * width),
        );
        let (x, y) = (random::<E>(&mut rng, len), random::<E>(&mut rng, len));
        let [mut scaled, tsrc, tw, mut weighted, mut plain, tx, ty] =
            [&src, &src, &w, &dst, &dst, &x, &y].map(|v| on_cpu(&dev, v));
        let mut dots = on_cpu(&dev, &vec![0f32; n]);
        let ids = dev.ids(&rows)?;
        dev.scale_rows(&mut scaled, &tw)?;
        dev.scatter_add_rows(&tsrc, &ids, Some(&tw), &mut weighted)?;
        dev.scatter_add_rows(&tsrc, &ids, None, &mut plain)?;
        dev.row_dots(&tx, &ty, &mut dots)?;
        let bytes = run_driver(
            &driver()?,
            &format!("moe-rows-{}", elem_name::<E>()),
            &command::<E>(
                "moe_rows",
                &[n.to_string(), width.to_string(), dst_rows.to_string()],
            ),
            &[
                bytemuck::cast_slice(&src),
                bytemuck::cast_slice(&rows),
                bytemuck::cast_slice(&w),
                bytemuck::cast_slice(&dst),
                bytemuck::cast_slice(&x),
                bytemuck::cast_slice(&y),
            ],
        )?;
        let mut rest = bytes.as_slice();
        let g_scaled: Vec<E> = split(&mut rest, len);
        let g_weighted: Vec<E> = split(&mut rest, dst_rows * width);
        let g_plain: Vec<E> = split(&mut rest, dst_rows * width);
        let g_dots: Vec<f32> = split(&mut rest, n);
        for (what, same) in [
            ("scaled rows", g_scaled == scaled.as_slice()),
            ("weighted sums", g_weighted == weighted.as_slice()),
            ("sums", g_plain == plain.as_slice()),
            ("row dot products", g_dots == dots.as_slice()),
        ] {
            if !same {
                return Err(
                    format!("{n}x{width}: the emulated {what} differ from the CPU's").into(),
                );
            }
        }
    }
    Ok(())
}

/// SwiGLU forward and backward give the CPU's bits (the GPU's `exp` is the CPU's polynomial).
fn swiglu<E: Elem>() -> Outcome {
    let dev = CpuDevice::new(1, u64::MAX)?;
    let mut rng = ChaCha8Rng::seed_from_u64(19);
    let n = 2000;
    let (gate, up, dact) = (
        random::<E>(&mut rng, n),
        random::<E>(&mut rng, n),
        random::<E>(&mut rng, n),
    );
    let [tgate, tup, tdact] = [&gate, &up, &dact].map(|v| on_cpu(&dev, v));
    let [mut act, mut dgate, mut dup] = [n, n, n].map(|n| on_cpu(&dev, &vec![E::default(); n]));
    dev.swiglu_forward(&tgate, &tup, &mut act)?;
    dev.swiglu_backward(&tdact, (&tgate, &tup), &mut dgate, &mut dup)?;
    let (act, dgate, dup) = (act.as_slice(), dgate.as_slice(), dup.as_slice());
    let bytes = run_driver(
        &driver()?,
        &format!("swiglu-{}", elem_name::<E>()),
        &command::<E>("swiglu", &[n.to_string()]),
        &[
            bytemuck::cast_slice(&gate),
            bytemuck::cast_slice(&up),
            bytemuck::cast_slice(&dact),
        ],
    )?;
    let mut rest = bytes.as_slice();
    let g_act: Vec<E> = split(&mut rest, n);
    let g_dgate: Vec<E> = split(&mut rest, n);
    let g_dup: Vec<E> = split(&mut rest, n);
    within(
        "swiglu",
        &[
            ("act", rel_diff(&g_act, act)),
            ("dgate", rel_diff(&g_dgate, dgate)),
            ("dup", rel_diff(&g_dup, dup)),
        ],
        0.0,
    )
}

/// The embedding's rows and its gradient, summed per id in token order as the CPU sums them;
/// ids repeat and some never occur.
fn embedding<E: Elem>() -> Outcome {
    let dev = CpuDevice::new(1, u64::MAX)?;
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let (rows, width, vocab) = (40, 300, 17);
    let table = random::<E>(&mut rng, vocab * width);
    let ids: Vec<u32> = (0..rows)
        .map(|_| rng.random_range(0..vocab as u32 - 3))
        .collect();
    let dout = random::<E>(&mut rng, rows * width);
    let (ttable, tdout) = (on_cpu(&dev, &table), on_cpu(&dev, &dout));
    let mut tout = on_cpu(&dev, &vec![E::default(); rows * width]);
    dev.embedding_forward(&ttable, &ids, &mut tout)?;
    let mut tdtable = on_cpu(&dev, &vec![0f32; vocab * width]);
    dev.embedding_backward(&tdout, &ids, &mut tdtable)?;
    let (out, dtable) = (tout.as_slice(), tdtable.as_slice());
    let args = [rows, width, vocab].map(|v| v.to_string());
    let bytes = run_driver(
        &driver()?,
        &format!("embedding-{}", elem_name::<E>()),
        &command::<E>("embedding", &args),
        &[
            bytemuck::cast_slice(&table),
            bytemuck::cast_slice(&ids),
            bytemuck::cast_slice(&dout),
        ],
    )?;
    let mut rest = bytes.as_slice();
    let g_out: Vec<E> = split(&mut rest, rows * width);
    let g_dtable: Vec<f32> = split(&mut rest, vocab * width);
    if g_out != out || g_dtable != dtable {
        return Err("the emulated embedding differs from the CPU's".into());
    }
    Ok(())
}

/// Cross-entropy rows (one ignored) against a plain softmax in f64: the gradient
/// `scale · (softmax − onehot)` and the row loss.
fn xent<E: Elem>(tolerance: f64) -> Outcome {
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    let (rows, vocab, scale) = (4, 700, 0.25f32);
    let logits = random::<E>(&mut rng, rows * vocab);
    let labels: Vec<i64> = vec![3, -100, 699, 256];
    let (mut grad, mut loss) = (vec![E::default(); rows * vocab], vec![0f32; rows]);
    for (r, &label) in labels.iter().enumerate() {
        if label < 0 {
            continue;
        }
        let row: Vec<f64> = logits[r * vocab..(r + 1) * vocab]
            .iter()
            .map(|x| x.to_f32() as f64)
            .collect();
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
        for (j, x) in row.iter().enumerate() {
            let onehot = if j as i64 == label { 1.0 } else { 0.0 };
            grad[r * vocab + j] = E::from_f32((scale as f64 * ((x - lse).exp() - onehot)) as f32);
        }
        loss[r] = (lse - row[label as usize]) as f32;
    }
    let args = [rows.to_string(), vocab.to_string(), format!("{scale:e}")];
    let bytes = run_driver(
        &driver()?,
        &format!("xent-{}", elem_name::<E>()),
        &command::<E>("xent", &args),
        &[bytemuck::cast_slice(&logits), bytemuck::cast_slice(&labels)],
    )?;
    let mut rest = bytes.as_slice();
    let g_grad: Vec<E> = split(&mut rest, rows * vocab);
    let g_loss: Vec<f32> = split(&mut rest, rows);
    // The gradient is at most `scale` in size: compare it relative to that.
    let scaled = |g: &[E]| -> Vec<f32> { g.iter().map(|x| x.to_f32() / scale).collect() };
    within(
        "cross-entropy",
        &[
            ("gradient", rel_diff(&scaled(&g_grad), &scaled(&grad))),
            ("loss", rel_diff(&g_loss, &loss)),
        ],
        tolerance,
    )
}

/// Two AdamW updates, the gradient norm, clipping's scaling and the bf16 copy, against the CPU
/// optimizer on the parameters of a tiny model (flattened: the kernels are element-wise).
fn optimizer() -> Outcome {
    let dev = CpuDevice::new(1, u64::MAX)?;
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let model = common::llama(40, 16, 2);
    let tensor = |rng: &mut ChaCha8Rng, shape: &[usize]| -> ckpt_engine::Result<Tensor<f32>> {
        let mut t = dev.zeros::<f32>(shape, Category::Params)?;
        let values = random::<f32>(rng, t.numel());
        t.as_mut_slice().copy_from_slice(&values);
        Ok(t)
    };
    let mut params = Params::try_new(&model, |s| tensor(&mut rng, &s.shape))?;
    let grads = Params::try_new(&model, |s| tensor(&mut rng, &s.shape))?;
    let flat = |p: &Params<Tensor<f32>>| -> Vec<f32> {
        p.tensors()
            .iter()
            .flat_map(|t| t.as_slice().to_vec())
            .collect()
    };
    let cfg = AdamWConfig {
        lr: 3e-3,
        betas: [0.9, 0.95],
        eps: 1e-8,
        weight_decay: 0.1,
        grad_clip: None,
    };
    let mut opt = AdamW::new(cfg.clone());
    let (mut p, g) = (flat(&params), flat(&grads));
    let n = p.len();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    for step in 1..=2 {
        // The arguments the optimizer derives (`AdamWConfig::args`), from the same f64 arithmetic.
        let lr = cfg.lr;
        let [b1, b2] = cfg.betas;
        let (bc1, bc2) = (1.0 - b1.powi(step), 1.0 - b2.powi(step));
        let (b1, b2) = (b1 as f32, b2 as f32);
        let args = [
            (1.0 - lr * cfg.weight_decay) as f32,
            1.0 - b1,
            b2,
            1.0 - b2,
            cfg.eps as f32,
            (lr / bc1) as f32,
            bc2.sqrt() as f32,
        ]
        .map(|x| format!("{x:e}"));
        let args: Vec<String> = [n.to_string(), "4096".to_string()]
            .into_iter()
            .chain(args)
            .collect();
        opt.update(&dev, &model, &mut params, &grads, lr)?;
        let bytes = run_driver(
            &driver()?,
            "optimizer",
            &command::<f32>("optimizer", &args),
            &[
                bytemuck::cast_slice(&p),
                bytemuck::cast_slice(&g),
                bytemuck::cast_slice(&m),
                bytemuck::cast_slice(&v),
            ],
        )?;
        let mut rest = bytes.as_slice();
        p = split(&mut rest, n);
        m = split(&mut rest, n);
        v = split(&mut rest, n);
        let partial: Vec<f64> = split(&mut rest, n.div_ceil(4096));
        let half: Vec<bf16> = split(&mut rest, n);
        let clipped: Vec<f32> = split(&mut rest, n);
        if clipped != g.iter().map(|&x| x * 0.375).collect::<Vec<_>>() {
            return Err("clipping's scaling differs from the CPU's".into());
        }
        let moments = opt.moments().ok_or("no moments after an update")?;
        if p != flat(&params) || m != flat(&moments.exp_avg) || v != flat(&moments.exp_avg_sq) {
            return Err(format!("step {step}: AdamW differs from the CPU's").into());
        }
        if half != p.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>() {
            return Err("the bf16 copy differs from the CPU's rounding".into());
        }
        let norm = partial.iter().sum::<f64>().sqrt();
        let want = grad_norm(&dev, &grads)?;
        if ((norm - want) / want).abs() > 1e-12 {
            return Err(format!("gradient norm {norm} against the CPU's {want}").into());
        }
    }
    Ok(())
}

/// The gradient norm's partial sums of lists of tensors in one launch each (empty tensors, short
/// last chunks, a chunk and one element, a list as long as a launch takes), whose values span
/// forty orders of magnitude so that any other order of addition shows: each chunk's partial is
/// the CPU's sum of squares of that chunk, bit for bit.
fn sum_of_squares_partials() -> Outcome {
    let dev = CpuDevice::new(1, u64::MAX)?;
    let mut rng = ChaCha8Rng::seed_from_u64(47);
    let lists: [Vec<usize>; 2] = [
        vec![0, 1, 4095, 4096, 4097, 3 * 4096 + 5, 0, 37, 70_001],
        (1..=64).map(|i| i * 97).collect(),
    ];
    for lengths in lists {
        let tensors: Vec<Vec<f32>> = lengths
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|_| rng.random_range(-2.0f32..2.0) * 10f32.powi(rng.random_range(-20..20)))
                    .collect()
            })
            .collect();
        let listed = lengths.iter().map(usize::to_string).collect::<Vec<_>>();
        let args = ["4096".to_string(), listed.join(",")];
        let inputs: Vec<&[u8]> = tensors.iter().map(|t| bytemuck::cast_slice(t)).collect();
        let bytes = run_driver(
            &driver()?,
            "sumsq",
            &command::<f32>("sumsq", &args),
            &inputs,
        )?;
        let chunks: Vec<&[f32]> = tensors.iter().flat_map(|t| t.chunks(4096)).collect();
        let partial: Vec<f64> = split(&mut bytes.as_slice(), chunks.len());
        for (i, (chunk, got)) in chunks.iter().zip(&partial).enumerate() {
            let want = dev.sum_squares(&on_cpu(&dev, chunk))?;
            if got.to_bits() != want.to_bits() {
                return Err(
                    format!("lengths {lengths:?}: chunk {i}: {got:e}, the CPU's {want:e}").into(),
                );
            }
        }
    }
    Ok(())
}
