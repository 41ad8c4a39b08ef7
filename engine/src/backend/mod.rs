//! Compute backends. The CPU backend runs everywhere; kernels on it split outputs across
//! threads, never a reduction, so results do not depend on the thread count.

pub mod cpu;

pub use cpu::CpuDevice;
