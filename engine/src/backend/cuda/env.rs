//! The CUDA device's execution record: the GPU, the driver, NVRTC, cuBLAS and the kernels, read
//! once when the device is opened. cuDNN is not loaded by the engine, so it is not recorded.

use super::nvrtc;
use crate::device::DeviceKind;
use crate::environment::{ExecutionEnv, GpuEnv};
use crate::error::{EngineError, Result};
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{sys as drv_sys, CudaContext};

/// The record of the GPU of `ctx`, called `name`, of compute capability `(major, minor)`, that
/// the cuBLAS handle `blas` computes on, running bf16 attention on tensor cores or not. Only
/// called once the libraries are known to load.
pub(crate) fn record(
    ctx: &CudaContext,
    name: &str,
    (major, minor): (i32, i32),
    blas: blas_sys::cublasHandle_t,
    tensor_core_attention: bool,
) -> Result<ExecutionEnv> {
    let failed = |what: &str, e: String| EngineError::Cuda(format!("{what}: {e}"));
    let sm_count = ctx
        .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| failed("the multiprocessor count", e.to_string()))?;
    let sm_count = u32::try_from(sm_count)
        .map_err(|_| failed("the multiprocessor count", format!("{sm_count} reported")))?;
    let mut driver = 0;
    // SAFETY: the pointer is valid for writing; libcuda is loaded.
    unsafe { drv_sys::cuDriverGetVersion(&mut driver) }
        .result()
        .map_err(|e| failed("cuDriverGetVersion", e.to_string()))?;
    let mut cublas = 0;
    // SAFETY: the handle is live and the pointer valid for writing.
    unsafe { blas_sys::cublasGetVersion_v2(blas, &mut cublas) }
        .result()
        .map_err(|e| failed("cublasGetVersion", e.to_string()))?;
    let (nvrtc_major, nvrtc_minor) = nvrtc::version().map_err(EngineError::Cuda)?;
    Ok(ExecutionEnv {
        gpu: Some(GpuEnv {
            name: name.into(),
            sm_count,
            compute_capability: format!("{major}.{minor}"),
            driver: driver_version(driver),
            nvrtc: format!("{nvrtc_major}.{nvrtc_minor}"),
            cublas: cublas_version(cublas),
            cudnn: None,
            kernel_sha256: nvrtc::kernel_sha256(&arch(major, minor)),
            attention: Some(
                if tensor_core_attention {
                    "tensor-cores"
                } else {
                    "tiled"
                }
                .into(),
            ),
        }),
        ..ExecutionEnv::new(DeviceKind::Cuda.name())
    })
}

/// The architecture NVRTC compiles for on a GPU of compute capability `major.minor`.
pub(crate) fn arch(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

/// `cuDriverGetVersion`'s number (`1000 · major + 10 · minor`) as `major.minor`.
fn driver_version(v: i32) -> String {
    format!("{}.{}", v / 1000, v % 1000 / 10)
}

/// `cublasGetVersion`'s number (`10000 · major + 100 · minor + patch`) as `major.minor.patch`.
fn cublas_version(v: i32) -> String {
    format!("{}.{}.{}", v / 10000, v % 10000 / 100, v % 100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_as_the_headers_compose_them() {
        assert_eq!(driver_version(13000), "13.0");
        assert_eq!(driver_version(12080), "12.8");
        assert_eq!(cublas_version(130002), "13.0.2");
        assert_eq!(cublas_version(120903), "12.9.3");
        assert_eq!(arch(9, 0), "sm_90");
    }
}
