//! The devices: the CPU backend runs everywhere; the CUDA backend loads its libraries at run
//! time and reports their absence as an error; the counting device holds sizes only and is the
//! memory model.

pub mod count;
pub mod cpu;
pub mod cuda;

use crate::device::DeviceKind;
pub use count::CountingDevice;
pub use cpu::CpuDevice;
pub use cuda::CudaDevice;

/// `Ok(description)` when a device of `kind` is present here, else why not.
pub fn probe(kind: DeviceKind) -> Result<String, String> {
    match kind {
        DeviceKind::Cpu => Ok(format!(
            "cpu ({} threads)",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        )),
        DeviceKind::Cuda => CudaDevice::probe(),
    }
}
