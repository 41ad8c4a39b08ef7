//! The CPU's products give the same bits whatever the CPU's caches. `gemm` reads the cache sizes
//! from `/sys/devices/system/cpu/cpu*/cache` and blocks the inner dimension by them; the engine
//! pins that blocking (`backend::cpu::matmul`). The test runs itself again in a mount namespace
//! (`unshare` from util-linux) where other caches are bind-mounted over every CPU's, and compares
//! the products' bits with its own. So that it cannot pass by the fake caches going unseen, the
//! child also reports the cache size it read and `gemm`'s own unpinned products, which must move
//! under at least one of the fakes.
//!
//! Needs root, or unprivileged user namespaces (`unshare --map-root-user`); where neither works
//! the test fails, naming the fix (CI runs it as root).

use ckpt_engine::backend::cpu::matmul::matmul;
use ckpt_engine::device::{n, out, t};
use ckpt_engine::{Category, CpuDevice, Tensor};
use std::path::Path;
use std::process::Command;

/// Set in the child: print the digests instead of comparing them.
const CHILD: &str = "CKPT_CACHES_CHILD";

/// Products whose inner dimension `gemm` blocks by the caches: more than 512 deep, more than
/// 64 × 64 outputs. `(m, n, k, a transposed, b transposed, accumulate)`.
const SHAPES: [(usize, usize, usize, bool, bool, bool); 5] = [
    (96, 80, 1500, false, false, false),
    (130, 70, 700, true, false, true),
    (65, 1100, 2048, false, true, false),
    (300, 200, 530, false, false, false),
    (2, 400, 1000, false, false, false),
];

/// A fake cache directory: `(level, type, size, ways, shared_cpu_list)` per `index<i>`.
type Caches = [(u32, &'static str, &'static str, u32, &'static str); 4];

/// Other caches; `gemm`'s own blocking moves under the first on CPUs with AVX2 only and under
/// the second with AVX-512 too (its wider kernels need a larger L1 before the inner block grows
/// past 512).
const FAKES: [(&str, Caches); 4] = [
    (
        "a 128 KiB 32-way L1d, 2 MiB L2, 8 MiB L3",
        [
            (1, "Data", "128K", 32, "0"),
            (1, "Instruction", "32K", 8, "0"),
            (2, "Unified", "2048K", 16, "0"),
            (3, "Unified", "8M", 16, "0-1"),
        ],
    ),
    (
        "a 256 KiB 16-way L1d, 2 MiB L2, 32 MiB L3",
        [
            (1, "Data", "256K", 16, "0"),
            (1, "Instruction", "32K", 8, "0"),
            (2, "Unified", "2048K", 16, "0"),
            (3, "Unified", "32M", 16, "0-1"),
        ],
    ),
    (
        "a 48 KiB 12-way L1d, 1.25 MiB L2, 30 MiB L3",
        [
            (1, "Data", "48K", 12, "0"),
            (1, "Instruction", "32K", 8, "0"),
            (2, "Unified", "1280K", 10, "0"),
            (3, "Unified", "30M", 12, "0-1"),
        ],
    ),
    (
        "a 32 KiB 8-way L1d, 256 KiB L2, 2 MiB L3",
        [
            (1, "Data", "32K", 8, "0"),
            (1, "Instruction", "32K", 8, "0"),
            (2, "Unified", "256K", 4, "0"),
            (3, "Unified", "2M", 16, "0-1"),
        ],
    ),
];

/// Deterministic operand values in [-1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// FNV-1a over the bits of `c`.
fn digest(acc: u64, c: &[f32]) -> u64 {
    c.iter().fold(acc, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01B3)
    })
}

/// The digest of every product of [`SHAPES`] through the engine (pinned blocking) and through
/// `gemm` called directly with the whole inner dimension (its own, cache-derived blocking).
fn products() -> (u64, u64) {
    let dev = CpuDevice::new(2, u64::MAX).unwrap();
    let tensor = |v: &[f32]| {
        Tensor::<f32>::from_f32(dev.tracker(), &[v.len()], v, Category::Activations).unwrap()
    };
    let (mut pinned, mut raw) = (0xCBF2_9CE4_8422_2325, 0xCBF2_9CE4_8422_2325);
    for (i, &(m, nn, k, ta, tb, acc)) in SHAPES.iter().enumerate() {
        let (a, b) = (
            values(m * k, 2 * i as u64),
            values(k * nn, 2 * i as u64 + 1),
        );
        let c0 = values(m * nn, 100 + i as u64);
        let (at, bt, mut c) = (tensor(&a), tensor(&b), tensor(&c0));
        let op = |x, transposed| if transposed { t(x) } else { n(x) };
        matmul(&dev, (m, nn, k), op(&at, ta), op(&bt, tb), out(&mut c), acc).unwrap();
        pinned = digest(pinned, c.as_slice());

        let mut c = c0.clone();
        let (a_rs, a_cs) = if ta { (1, m as isize) } else { (k as isize, 1) };
        let (b_rs, b_cs) = if tb {
            (1, k as isize)
        } else {
            (nn as isize, 1)
        };
        // SAFETY: a, b and c hold m·k, k·n and m·n elements laid out by these strides.
        unsafe {
            gemm::gemm(
                m,
                nn,
                k,
                c.as_mut_ptr(),
                1,
                nn as isize,
                acc,
                a.as_ptr(),
                a_cs,
                a_rs,
                b.as_ptr(),
                b_cs,
                b_rs,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(2),
            )
        };
        raw = digest(raw, &c);
    }
    (pinned, raw)
}

/// Writes `caches` as a `/sys/devices/system/cpu/cpu<N>/cache` directory under `dir`.
fn write_caches(dir: &Path, caches: &Caches) {
    for (i, (level, kind, size, ways, shared)) in caches.iter().enumerate() {
        let index = dir.join(format!("index{i}"));
        std::fs::create_dir_all(&index).unwrap();
        for (file, value) in [
            ("level", level.to_string()),
            ("type", kind.to_string()),
            ("size", size.to_string()),
            ("ways_of_associativity", ways.to_string()),
            ("coherency_line_size", "64".into()),
            ("shared_cpu_list", shared.to_string()),
        ] {
            std::fs::write(index.join(file), format!("{value}\n")).unwrap();
        }
    }
}

/// This test run again with `dir` bind-mounted over every CPU's cache directory; its stdout.
fn child_with(dir: &Path) -> String {
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private"]);
    if !is_root() {
        cmd.arg("--map-root-user");
    }
    let script = r#"set -e
for cpu in /sys/devices/system/cpu/cpu[0-9]*; do
    [ -d "$cpu/cache" ] && mount --bind "$0" "$cpu/cache"
done
exec "$@""#;
    let out = cmd
        .args(["sh", "-c", script])
        .arg(dir)
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "products_give_the_same_bits_whatever_the_cpu_caches",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run unshare (util-linux): {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the child under fake caches failed; unshare needs root or unprivileged user namespaces \
         (CI runs as root): {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Whether this process runs as root (the owner of its `/proc/self`).
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// The value of `child: <key> <value>` in the child's output (the first may follow the test
/// harness's `test ... ` on its line).
fn field<'a>(stdout: &'a str, key: &str) -> &'a str {
    let prefix = format!("child: {key} ");
    stdout
        .lines()
        .find_map(|l| l.split_once(&prefix).map(|(_, value)| value))
        .unwrap_or_else(|| panic!("no `{prefix}` line in {stdout}"))
}

#[test]
fn products_give_the_same_bits_whatever_the_cpu_caches() {
    let (pinned, raw) = products();
    if std::env::var_os(CHILD).is_some() {
        let l1 = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index0/size")
            .unwrap_or_default();
        println!("child: l1d {}", l1.trim());
        println!("child: pinned {pinned:016x}");
        println!("child: raw {raw:016x}");
        return;
    }
    println!(
        "here: the engine's products {pinned:016x}, gemm's own {raw:016x} ({})",
        match pinned == raw {
            true => "the same blocking on this CPU's caches",
            false => "another blocking on this CPU's caches",
        }
    );
    let mut moved = Vec::new();
    for (what, caches) in FAKES {
        let dir = tempfile::tempdir().unwrap();
        write_caches(dir.path(), &caches);
        let stdout = child_with(dir.path());
        assert_eq!(
            field(&stdout, "l1d"),
            caches[0].2,
            "the child did not see the fake caches ({what})"
        );
        assert_eq!(
            field(&stdout, "pinned"),
            format!("{pinned:016x}"),
            "the engine's products changed bits under {what}"
        );
        if field(&stdout, "raw") != format!("{raw:016x}") {
            moved.push(what);
        }
    }
    assert!(
        !moved.is_empty(),
        "gemm's own blocking gave the same bits under every fake cache: the test shows nothing"
    );
}
