//! The process's peak resident host memory. On Linux the peak (`VmHWM` in `/proc/self/status`)
//! can be reset by writing `5` to `/proc/self/clear_refs` where the kernel permits it; elsewhere,
//! or without permission, the peak covers the whole process so far.

/// Resets the peak to the current resident size; whether that was permitted.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The peak resident bytes, where the platform reports them.
pub fn peak() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_vm_hwm(&status)
}

fn parse_vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vm_hwm_in_bytes() {
        let status = "Name:\tx\nVmPeak:\t  2000 kB\nVmHWM:\t   1536 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(parse_vm_hwm(status), Some(1536 * 1024));
        assert_eq!(parse_vm_hwm("Name:\tx\n"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_peak_is_at_least_a_touched_buffer() {
        let before = peak().unwrap();
        let buf = vec![1u8; 64 << 20];
        std::hint::black_box(&buf);
        assert!(peak().unwrap() >= before.max(64 << 20), "{:?}", peak());
    }
}
