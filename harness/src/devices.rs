//! Every device-specific decision of the harness: which devices exist, whether one is present,
//! and how to open it with a suite's capacity.

use anyhow::Result;
use ckpt_engine::{CpuDevice, CudaDevice, Device};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A kind of device a suite can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// The CPU backend, with a simulated capacity.
    Cpu,
    /// The first CUDA device.
    Cuda,
}

impl DeviceKind {
    /// Every kind, in trial order.
    pub const ALL: [DeviceKind; 2] = [DeviceKind::Cpu, DeviceKind::Cuda];

    /// The lower-case name used in trial names, suites and reports.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }

    /// `Ok(description)` when the device is present, else why not.
    pub fn probe(self) -> Result<String, String> {
        match self {
            DeviceKind::Cpu => Ok(format!(
                "cpu ({} threads)",
                std::thread::available_parallelism().map_or(1, |n| n.get())
            )),
            DeviceKind::Cuda => cuda_probe(),
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether a CUDA device can be used: its description, or why not.
pub fn cuda_probe() -> Result<String, String> {
    CudaDevice::probe()
}

/// Opens a device of `kind`: on the CPU with `threads` workers, and `capacity` bytes where the
/// suite sets one (unlimited on the CPU otherwise, the card's own on CUDA).
pub fn open(kind: DeviceKind, threads: usize, capacity: Option<u64>) -> Result<Device> {
    match kind {
        DeviceKind::Cpu => Ok(CpuDevice::new(threads, capacity.unwrap_or(u64::MAX))?.into()),
        DeviceKind::Cuda => Ok(CudaDevice::new(0, capacity)?.into()),
    }
}
