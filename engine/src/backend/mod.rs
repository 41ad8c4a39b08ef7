//! The devices: the CPU backend runs everywhere; the CUDA backend loads its libraries at run
//! time and reports their absence as an error; the counting device holds sizes only and is the
//! memory model.

pub mod count;
pub mod cpu;
pub mod cuda;

use crate::device::DeviceKind;
use crate::error::{EngineError, Result};
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

/// `offset..offset + len` when it lies within `total` (bytes or elements); else an error
/// naming all three.
pub(crate) fn span(total: usize, offset: usize, len: usize) -> Result<std::ops::Range<usize>> {
    match offset.checked_add(len) {
        Some(end) if end <= total => Ok(offset..end),
        _ => Err(EngineError::Config(format!(
            "a span of {len} from {offset} runs past the {total} a tensor holds"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::span;

    #[test]
    fn a_span_is_the_range_within_its_tensor_and_an_error_past_it() {
        assert_eq!(span(10, 2, 8).unwrap(), 2..10);
        assert_eq!(span(10, 10, 0).unwrap(), 10..10);
        let past = span(10, 3, 8).unwrap_err().to_string();
        assert!(past.contains("of 8 from 3 runs past the 10"), "{past}");
        assert!(span(10, usize::MAX, 2).is_err(), "an end past usize::MAX");
    }
}
