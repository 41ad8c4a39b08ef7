//! The CUDA kernels' logic, checked without a GPU: `kernels.cu` is compiled as host C++ under an
//! emulation of the CUDA execution model (`cuda_host/emulator.h`: a block's threads are OS
//! threads, `__syncthreads` a barrier, blocks run one after another) and its kernels are run on
//! small random inputs against the CPU backend's. This covers the attention kernels (the tiled
//! forward pass and dq, dk, dv) and residual dropout (whose masks must be the CPU's, bit for
//! bit). Memory coalescing, occupancy and speed are a GPU's to show (`tests/cuda.rs`).
//!
//! Needs a C++20 compiler (`$CXX`, else `c++`); without one the trials are listed as ignored.
//! The compiler is told not to fuse multiplies and adds, as NVRTC is (`--fmad=false`).

use ckpt_engine::backend::cpu::attention::{attention_backward, attention_forward, AttnShape};
use ckpt_engine::backend::cpu::kernels::{dropout_add, dropout_backward};
use ckpt_engine::backend::cuda::attention_tiles;
use ckpt_engine::model::dropout::{Dropout, Site, DRAW_SHIFT};
use ckpt_engine::{CpuDevice, Elem};
use half::bf16;
use libtest_mimic::{Arguments, Failed, Trial};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
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
        trial("dropout_f32_is_the_cpu_s_bit_for_bit", dropout::<f32>),
        trial("dropout_bf16_is_the_cpu_s_bit_for_bit", dropout::<bf16>),
    ];
    libtest_mimic::run(&args, trials).exit();
}

fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

fn work_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda_host")
}

/// Why no C++20 compiler with `<barrier>` can be used here, if none can.
fn compiler_missing() -> Option<String> {
    let dir = work_dir();
    std::fs::create_dir_all(&dir).ok()?;
    let probe = dir.join("probe.cpp");
    std::fs::write(
        &probe,
        "#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n",
    )
    .ok()?;
    let out = Command::new(compiler())
        .args(["-std=c++20", "-pthread", "-o"])
        .arg(dir.join("probe"))
        .arg(&probe)
        .output();
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
    if source.matches(shared).count() != 3 {
        return Err(format!("kernels.cu declares dynamic shared memory other than `{shared}` three times; update cuda_host.rs").into());
    }
    Ok(source
        .replace(shared, "float* dyn = dynamic_shared;")
        .replace("extern \"C\" ", ""))
}

/// Compiles the driver once; its path.
fn driver() -> Result<PathBuf, Failed> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = work_dir();
            let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_host");
            let kernels = host_kernels().map_err(|e| format!("{e:?}"))?;
            std::fs::write(dir.join("kernels.cpp"), kernels).map_err(|e| e.to_string())?;
            for f in ["emulator.h", "driver.cpp"] {
                std::fs::copy(here.join(f), dir.join(f)).map_err(|e| format!("{f}: {e}"))?;
            }
            let exe = dir.join("driver");
            let out = Command::new(compiler())
                .args([
                    "-std=c++20",
                    "-O1",
                    "-ffp-contract=off",
                    "-pthread",
                    "-w",
                    "-o",
                ])
                .arg(&exe)
                .arg(dir.join("driver.cpp"))
                .output()
                .map_err(|e| e.to_string())?;
            if !out.status.success() {
                return Err(format!(
                    "compiling kernels.cu as C++ failed:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            Ok(exe)
        })
        .clone()
        .map_err(Failed::from)
}

/// Runs the driver on `inputs` (written back to back) through files named after `name`, which
/// concurrent trials must not share; returns what it wrote.
fn run_driver(name: &str, args: &[String], inputs: &[&[u8]]) -> Result<Vec<u8>, Failed> {
    let dir = work_dir();
    let (input, output) = (
        dir.join(format!("{name}.in")),
        dir.join(format!("{name}.out")),
    );
    std::fs::write(&input, inputs.concat())?;
    let out = Command::new(driver()?)
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
/// least 1).
fn rel_diff<E: Elem>(got: &[E], want: &[E]) -> f64 {
    let scale = want
        .iter()
        .map(|x| x.to_f32().abs() as f64)
        .fold(1.0, f64::max);
    got.iter()
        .zip(want)
        .map(|(a, b)| (a.to_f32() as f64 - b.to_f32() as f64).abs())
        .fold(0.0, f64::max)
        / scale
}

/// The tiled attention forward and backward passes against the CPU's, on shapes that cover
/// grouped heads, head widths 8 to 256 and rows shorter, longer and not a multiple of a tile.
fn attention<E: Elem>(tolerance: f64) -> Outcome {
    let dev = CpuDevice::new(1, u64::MAX)?;
    let shapes = [
        (2, 37, 4, 2, 16),
        (1, 70, 2, 1, 64),
        (1, 33, 4, 4, 32),
        (2, 5, 2, 2, 8),
        (1, 20, 2, 1, 128),
        (1, 19, 1, 1, 256),
        (1, 1, 2, 1, 64),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for (batch, seq, heads, kv_heads, head_dim) in shapes {
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
        let mut out = vec![E::default(); qn];
        let mut lse = vec![0f32; ln];
        attention_forward(&dev, s, &q, &k, &v, &mut out, &mut lse)?;
        let (mut dq, mut dk, mut dv) = (
            vec![E::default(); qn],
            vec![E::default(); kn],
            vec![E::default(); kn],
        );
        attention_backward(
            &dev, s, &q, &k, &v, &out, &lse, &dout, &mut dq, &mut dk, &mut dv,
        )?;

        let args: Vec<String> = ["attention".to_string(), elem_name::<E>().into()]
            .into_iter()
            .chain(
                [
                    batch,
                    seq,
                    heads,
                    kv_heads,
                    head_dim,
                    tiles.forward_queries,
                    tiles.forward_keys,
                    tiles.backward,
                ]
                .map(|n| n.to_string()),
            )
            .collect();
        let bytes = run_driver(
            &format!("attention-{}", elem_name::<E>()),
            &args,
            &[
                bytemuck::cast_slice(&q),
                bytemuck::cast_slice(&k),
                bytemuck::cast_slice(&v),
                bytemuck::cast_slice(&dout),
            ],
        )?;
        let mut rest = bytes.as_slice();
        let g_out: Vec<E> = split(&mut rest, qn);
        let g_lse: Vec<f32> = split(&mut rest, ln);
        let g_dq: Vec<E> = split(&mut rest, qn);
        let g_dk: Vec<E> = split(&mut rest, kn);
        let g_dv: Vec<E> = split(&mut rest, kn);
        let diffs = [
            ("out", rel_diff(&g_out, &out)),
            ("lse", rel_diff(&g_lse, &lse)),
            ("dq", rel_diff(&g_dq, &dq)),
            ("dk", rel_diff(&g_dk, &dk)),
            ("dv", rel_diff(&g_dv, &dv)),
        ];
        let shown: Vec<String> = diffs.iter().map(|(w, d)| format!("{w} {d:.1e}")).collect();
        eprintln!("{s:?} {tiles:?}: {}", shown.join(", "));
        if let Some((what, d)) = diffs.iter().find(|(_, d)| *d > tolerance) {
            return Err(format!(
                "{s:?}: {what} differs from the CPU's by {d:.2e} (tolerance {tolerance:e})"
            )
            .into());
        }
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
        let (mut out, mut dy) = (vec![E::default(); n], vec![E::default(); n]);
        dropout_add(&dev, &mask, &x, &y, &mut out);
        dropout_backward(&dev, &mask, &dout, &mut dy);
        let args = [
            "dropout".to_string(),
            elem_name::<E>().into(),
            n.to_string(),
            mask.key().to_string(),
            mask.threshold().to_string(),
            DRAW_SHIFT.to_string(),
            format!("{:e}", mask.scale()),
        ];
        let bytes = run_driver(
            &format!("dropout-{}", elem_name::<E>()),
            &args,
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
