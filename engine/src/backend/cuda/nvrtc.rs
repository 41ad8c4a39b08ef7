//! The kernel source compiled by NVRTC to a cubin at first use, and cached on disk.
//!
//! The cache key is the sha256 of the source and the options ([`kernel_sha256`]), the device
//! name, the architecture and NVRTC's version; the cache lives in `$CKPT_HARNESS_CACHE`, else
//! `$XDG_CACHE_HOME/ckpt-harness`, else `~/.cache/ckpt-harness`. A cache that cannot be read or
//! written only costs a compile.

use cudarc::nvrtc::{result, sys};
use sha2::{Digest, Sha256};
use std::ffi::CString;
use std::path::PathBuf;

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Whether libnvrtc can be loaded.
pub fn available() -> Result<(), String> {
    // SAFETY: only tries to open the library.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err("libnvrtc could not be loaded; install the CUDA toolkit's NVRTC (libnvrtc.so.13) and put its directory on LD_LIBRARY_PATH".into())
    }
}

/// NVRTC options for `arch` (such as `sm_90`): no fused multiply-add (each product and sum
/// rounds as the CPU's does), IEEE division and square root.
fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--fmad=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--std=c++17".into(),
    ]
}

/// NVRTC's version as (major, minor).
pub fn version() -> Result<(i32, i32), String> {
    available()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for writing.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion: {e}"))?;
    Ok((major, minor))
}

/// Compiles [`SOURCE`] for `arch` to a cubin; an error carries NVRTC's log.
pub fn compile(arch: &str) -> Result<Vec<u8>, String> {
    available()?;
    let src = CString::new(SOURCE).expect("the source has no NUL byte");
    let name = CString::new("kernels.cu").expect("no NUL byte");
    let prog = result::create_program(&src, Some(&name)).map_err(|e| format!("nvrtc: {e}"))?;
    let out = compile_program(prog, arch);
    // SAFETY: `prog` was created above and is destroyed once.
    let destroyed = unsafe { result::destroy_program(prog) };
    let cubin = out?;
    destroyed.map_err(|e| format!("nvrtcDestroyProgram: {e}"))?;
    Ok(cubin)
}

fn compile_program(prog: sys::nvrtcProgram, arch: &str) -> Result<Vec<u8>, String> {
    // SAFETY: `prog` is a live program; the options are NUL-free strings.
    if let Err(e) = unsafe { result::compile_program(prog, &options(arch)) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog) }
            .map(|raw| {
                let bytes: Vec<u8> = raw
                    .iter()
                    .map(|&c| c as u8)
                    .take_while(|&c| c != 0)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        return Err(format!(
            "kernels.cu does not compile for {arch} ({e}):\n{log}"
        ));
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled; `size` is valid for writing.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBINSize: {e}"))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds the `size` bytes NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBIN: {e}"))?;
    Ok(cubin)
}

/// sha256 of `parts`, each prefixed with its length, in hex.
fn digest(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for part in parts {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    format!("{:x}", h.finalize())
}

/// sha256 of [`SOURCE`] and the NVRTC options for `arch`, in hex: what the kernels are compiled
/// from, besides the compiler. A device's execution record holds it, and the cache key starts
/// with it.
pub fn kernel_sha256(arch: &str) -> String {
    digest(&[SOURCE, &options(arch).join(" ")])
}

/// The cubin for `arch` on the device called `device`: from the disk cache, or compiled (and
/// then stored in the cache when it can be).
pub fn cubin(device: &str, arch: &str) -> Result<Vec<u8>, String> {
    let (major, minor) = version()?;
    let key = digest(&[
        &kernel_sha256(arch),
        device,
        arch,
        &format!("nvrtc {major}.{minor}"),
    ]);
    let file = cache_dir().map(|d| d.join(format!("kernels-{key}.cubin")));
    if let Some(bytes) = file.as_ref().and_then(|f| std::fs::read(f).ok()) {
        return Ok(bytes);
    }
    let cubin = compile(arch)?;
    if let Some(file) = file {
        store(&file, &cubin);
    }
    Ok(cubin)
}

/// Writes `bytes` to `file` through a temporary and a rename, so a reader never sees half a
/// cubin. Failures are ignored: the cache is an optimisation.
fn store(file: &std::path::Path, bytes: &[u8]) {
    let Some(dir) = file.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = file.with_extension(format!("tmp-{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, file).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

fn cache_dir() -> Option<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("CKPT_HARNESS_CACHE") {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("ckpt-harness"));
    }
    var("HOME").map(|h| PathBuf::from(h).join(".cache").join("ckpt-harness"))
}
