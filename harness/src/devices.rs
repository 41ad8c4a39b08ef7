//! Every device-specific decision of the harness: which devices exist, whether one is present,
//! and opening one with a suite's capacity to run work on it.

use anyhow::Result;
pub use ckpt_engine::DeviceKind;
use ckpt_engine::{CpuDevice, CudaDevice, Device};

/// Work that runs on any device: the harness opens the device a trial names and hands it over.
pub trait OnDevice {
    /// What the work returns.
    type Output;
    /// Runs on `dev`.
    fn run<D: Device>(self, dev: D) -> Result<Self::Output>;
}

/// Whether a device of `kind` is present: its description, or why not.
pub fn probe(kind: DeviceKind) -> Result<String, String> {
    ckpt_engine::backend::probe(kind)
}

/// Whether the first step on a device of `kind` loads library code into host memory that later
/// steps reuse, so that a phase's host growth is its own only after a step has run: CUDA's
/// driver loads cuBLAS's kernels as they are first used (on an H200, 120 MiB of resident memory
/// at the first step of a process and 141 MiB more at the first Mixtral step).
pub fn warms_up(kind: DeviceKind) -> bool {
    kind == DeviceKind::Cuda
}

/// Opens a device of `kind` and runs `work` on it: on the CPU with `threads` workers and
/// `capacity` bytes, the host's available memory when the suite sets none (so a run too large
/// for the machine is refused, not aborted); on CUDA `capacity` under the card's own.
pub fn run_on<W: OnDevice>(
    kind: DeviceKind,
    threads: usize,
    capacity: Option<u64>,
    work: W,
) -> Result<W::Output> {
    match kind {
        DeviceKind::Cpu => work.run(CpuDevice::with_host_capacity(threads, capacity)?),
        DeviceKind::Cuda => work.run(CudaDevice::new(0, capacity)?),
    }
}
