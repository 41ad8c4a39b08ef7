//! The process's resident host memory: its current size (`VmRSS` in `/proc/self/status`) and its
//! peak (`VmHWM`). On Linux the peak can be reset to the current size by writing `5` to
//! `/proc/self/clear_refs` where the kernel permits it; elsewhere, or without permission, the
//! peak covers the whole process so far.

/// The malloc arenas glibc may keep: one, the main thread's, that every thread allocates from.
const MALLOC_ARENAS: i32 = 1;

/// Limits glibc's malloc to one arena; call it first in `main`, before any thread
/// starts. glibc otherwise gives each thread that allocates an arena of its own (up to eight a
/// core), which keeps what that thread freed for it alone. The CPU device runs a training step on
/// whichever of its pool's threads takes it, and each suite's device has new ones: the step's
/// small tensors would fault in pages of arena after arena while the freed pages of the others
/// stay resident, and a phase's resident size would grow by what the allocator keeps rather than
/// by what the phase holds (10 to 12 MiB in a 4-thread phase that adds 2 MiB with one arena).
/// With two, the main thread's and one the others share, the figures vary with which of them
/// each thread is handed; with one they stay where they were before steps ran on the pool
/// (see docs/PERFORMANCE.md).
pub fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets a parameter of the allocator; it is called before other
    // threads exist, and a value it refuses leaves the default in place.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS);
    }
}

/// Resets the peak to the current resident size; whether that was permitted.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The peak resident bytes, where the platform reports them.
pub fn peak() -> Option<u64> {
    status_bytes("VmHWM:")
}

/// The resident bytes now, where the platform reports them.
pub fn current() -> Option<u64> {
    status_bytes("VmRSS:")
}

fn status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_kib(&status, key)
}

/// The figure of the `/proc/self/status` line starting with `key`, in bytes.
fn parse_kib(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vm_hwm_and_vm_rss_in_bytes() {
        let status = "Name:\tx\nVmPeak:\t  2000 kB\nVmHWM:\t   1536 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(parse_kib(status, "VmHWM:"), Some(1536 * 1024));
        assert_eq!(parse_kib(status, "VmRSS:"), Some(1000 * 1024));
        assert_eq!(parse_kib("Name:\tx\n", "VmHWM:"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_peak_and_the_current_size_hold_a_touched_buffer() {
        let before = peak().unwrap();
        let buf = vec![1u8; 64 << 20];
        std::hint::black_box(&buf);
        assert!(peak().unwrap() >= before.max(64 << 20), "{:?}", peak());
        assert!(current().unwrap() >= 64 << 20, "{:?}", current());
    }
}
