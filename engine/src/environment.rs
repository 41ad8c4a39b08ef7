//! What bitwise resume depends on: the facts of the machine and of the libraries a run computes
//! with that can change its bits. Each device reports its record
//! ([`crate::Device::execution_env`]); a checkpoint keeps the record of the device that wrote
//! it, and a resume compares that with its own device's ([`ExecutionEnv::changes`]). A
//! difference is not an error, since a run may go on elsewhere, but the continuation is then not
//! guaranteed bit for bit.
//!
//! The CPU's thread count is not recorded: every kernel splits its outputs across threads and
//! never a reduction, so results do not depend on it. Nor are its cache sizes, from which `gemm`
//! would block the products' inner dimension: the CPU backend fixes that blocking
//! (`backend::cpu::matmul`), so its bits depend on the instruction set alone.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The engine's version, as its crate names it.
pub const ENGINE_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The record of one device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecutionEnv {
    /// The backend that computes: `cpu`, `cuda`, or `count` (the counting device, which
    /// computes nothing).
    pub backend: String,
    /// The engine's crate version.
    pub engine_version: String,
    /// On the CPU: the matrix kernels the `gemm` crate picks by instruction set, as
    /// `<arch> <kernels>` (`x86_64 avx512f`, `x86_64 fma`, `aarch64 neon`, else
    /// `<arch> scalar`), then ` avx512_bf16` where bf16 is multiplied with the dot-product
    /// instruction (`CKPT_CPU_BF16_PRODUCTS=dot`). Some small products sum in another order
    /// from one to another; the caches change nothing, the products' blocking being fixed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_kernels: Option<String>,
    /// On CUDA: the GPU and the libraries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuEnv>,
}

/// The GPU and the CUDA libraries a CUDA device computes with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuEnv {
    /// The GPU's name, as the driver reports it.
    pub name: String,
    /// Streaming multiprocessors (cuBLAS picks its kernels by them).
    pub sm_count: u32,
    /// Compute capability, as `major.minor`.
    pub compute_capability: String,
    /// The driver's CUDA version (`cuDriverGetVersion`), as `major.minor`.
    pub driver: String,
    /// NVRTC's version (`nvrtcVersion`), which compiles the kernels, as `major.minor`.
    pub nvrtc: String,
    /// cuBLAS's version (`cublasGetVersion`), as `major.minor.patch`.
    pub cublas: String,
    /// cuDNN's version where cuDNN is loaded; the engine does not load it, so absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cudnn: Option<String>,
    /// sha256 of the kernel source and NVRTC's options (`backend::cuda::nvrtc::kernel_sha256`).
    pub kernel_sha256: String,
    /// The bf16 attention kernels: `tensor-cores` or `tiled` (`CKPT_CUDA_ATTENTION`); absent in
    /// records written before the tensor-core kernels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<String>,
}

impl ExecutionEnv {
    /// The record of a device of `backend` holding this engine's version and no other fact.
    pub fn new(backend: &str) -> Self {
        ExecutionEnv {
            backend: backend.into(),
            engine_version: ENGINE_VERSION.into(),
            cpu_kernels: None,
            gpu: None,
        }
    }

    /// Every fact, by field name (`gpu.` before a GPU's), `None` where it is not recorded.
    fn facts(&self) -> [(&'static str, Option<String>); 12] {
        let gpu = self.gpu.as_ref();
        let of = |f: fn(&GpuEnv) -> Option<String>| gpu.and_then(f);
        [
            ("backend", Some(self.backend.clone())),
            ("engine_version", Some(self.engine_version.clone())),
            ("cpu_kernels", self.cpu_kernels.clone()),
            ("gpu.name", of(|g| Some(g.name.clone()))),
            ("gpu.sm_count", of(|g| Some(g.sm_count.to_string()))),
            (
                "gpu.compute_capability",
                of(|g| Some(g.compute_capability.clone())),
            ),
            ("gpu.driver", of(|g| Some(g.driver.clone()))),
            ("gpu.nvrtc", of(|g| Some(g.nvrtc.clone()))),
            ("gpu.cublas", of(|g| Some(g.cublas.clone()))),
            ("gpu.cudnn", of(|g| g.cudnn.clone())),
            ("gpu.kernel_sha256", of(|g| Some(g.kernel_sha256.clone()))),
            ("gpu.attention", of(|g| g.attention.clone())),
        ]
    }

    /// The facts that differ from this record (the saved one) to `now`, in field order; empty
    /// when they are the same.
    pub fn changes(&self, now: &ExecutionEnv) -> Vec<EnvChange> {
        let show = |v: Option<String>| v.unwrap_or_else(|| "absent".into());
        self.facts()
            .into_iter()
            .zip(now.facts())
            .filter(|((_, saved), (_, now))| saved != now)
            .map(|((field, saved), (_, now))| EnvChange {
                field: field.into(),
                saved: show(saved),
                now: show(now),
            })
            .collect()
    }
}

/// One fact of the execution environment that differs between a checkpoint and its resume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvChange {
    /// The field (`cpu_kernels`, `gpu.name`, ...).
    pub field: String,
    /// Its value where the checkpoint was saved (`absent` where not recorded).
    pub saved: String,
    /// Its value where the run resumed (`absent` where not recorded).
    pub now: String,
}

impl fmt::Display for EnvChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} → {}", self.field, self.saved, self.now)
    }
}

/// `changes` in one line, `field: saved → now` each, separated by `; `.
pub fn describe(changes: &[EnvChange]) -> String {
    changes
        .iter()
        .map(EnvChange::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda() -> ExecutionEnv {
        ExecutionEnv {
            gpu: Some(GpuEnv {
                name: "NVIDIA H100 80GB HBM3".into(),
                sm_count: 132,
                compute_capability: "9.0".into(),
                driver: "13.0".into(),
                nvrtc: "13.0".into(),
                cublas: "13.0.2".into(),
                cudnn: None,
                kernel_sha256: "ab".repeat(32),
                attention: Some("tensor-cores".into()),
            }),
            ..ExecutionEnv::new("cuda")
        }
    }

    fn fields(changes: &[EnvChange]) -> Vec<&str> {
        changes.iter().map(|c| c.field.as_str()).collect()
    }

    #[test]
    fn the_same_record_has_no_changes() {
        let cpu = ExecutionEnv {
            cpu_kernels: Some("x86_64 fma".into()),
            ..ExecutionEnv::new("cpu")
        };
        assert!(cpu.changes(&cpu.clone()).is_empty());
        assert!(cuda().changes(&cuda()).is_empty());
    }

    #[test]
    fn exactly_the_differing_fields_are_listed_with_both_values() {
        let saved = cuda();
        type Edit = fn(&mut GpuEnv);
        let edits: [(&str, Edit); 9] = [
            ("gpu.name", |g| g.name = "NVIDIA A100".into()),
            ("gpu.sm_count", |g| g.sm_count = 108),
            ("gpu.compute_capability", |g| {
                g.compute_capability = "8.0".into()
            }),
            ("gpu.driver", |g| g.driver = "12.8".into()),
            ("gpu.nvrtc", |g| g.nvrtc = "12.9".into()),
            ("gpu.cublas", |g| g.cublas = "12.9.1".into()),
            ("gpu.cudnn", |g| g.cudnn = Some("9.1.0".into())),
            ("gpu.kernel_sha256", |g| g.kernel_sha256 = "cd".repeat(32)),
            ("gpu.attention", |g| g.attention = Some("tiled".into())),
        ];
        for (field, edit) in edits {
            let mut now = cuda();
            edit(now.gpu.as_mut().unwrap());
            assert_eq!(fields(&saved.changes(&now)), [field]);
        }
        let mut now = cuda();
        now.engine_version = "0.2.0".into();
        now.gpu.as_mut().unwrap().sm_count = 114;
        let changes = saved.changes(&now);
        assert_eq!(fields(&changes), ["engine_version", "gpu.sm_count"]);
        assert_eq!(
            describe(&changes),
            format!("engine_version: {ENGINE_VERSION} → 0.2.0; gpu.sm_count: 132 → 114")
        );
    }

    #[test]
    fn a_fact_recorded_on_one_side_only_is_absent_on_the_other() {
        let cpu = ExecutionEnv {
            cpu_kernels: Some("x86_64 avx512f".into()),
            ..ExecutionEnv::new("cpu")
        };
        let changes = cpu.changes(&cuda());
        assert_eq!(changes.len(), 10, "{changes:?}");
        assert_eq!(changes[0].to_string(), "backend: cpu → cuda");
        assert_eq!(
            changes[1].to_string(),
            "cpu_kernels: x86_64 avx512f → absent"
        );
        assert_eq!(
            changes[2].to_string(),
            "gpu.name: absent → NVIDIA H100 80GB HBM3"
        );
        assert!(!fields(&changes).contains(&"gpu.cudnn"), "absent on both");
    }

    #[test]
    fn a_record_reads_back_as_written_and_omits_what_it_lacks() {
        for env in [cuda(), ExecutionEnv::new("cpu")] {
            let json = serde_json::to_string(&env).unwrap();
            assert!(!json.contains("null"), "{json}");
            assert!(!json.contains("cudnn"), "{json}");
            assert_eq!(serde_json::from_str::<ExecutionEnv>(&json).unwrap(), env);
        }
    }
}
