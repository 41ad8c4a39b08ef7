//! How much memory this process may still take from the host: the least of what the machine
//! has available, what the process's cgroup limit leaves, and what its address-space and data
//! limits leave. `/proc/meminfo` alone ignores a container's limit and `ulimit -v`, under which
//! an allocation the machine could hold fails and the process aborts.
//!
//! Every source is read as text (from `/proc` and `/sys/fs/cgroup` on Linux) and parsed by a
//! pure function, so each rule is tested on the text a kernel writes.

use std::path::{Path, PathBuf};

/// The bytes this process may still allocate on the host, where the platform reports any limit.
pub fn available() -> Option<u64> {
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let status = read(Path::new("/proc/self/status")).unwrap_or_default();
    let machine = read(Path::new("/proc/meminfo")).and_then(|t| meminfo_available(&t));
    let rlimits = read(Path::new("/proc/self/limits")).and_then(|t| rlimits_left(&t, &status));
    let cgroup = read(Path::new("/proc/self/cgroup"))
        .and_then(|t| cgroup_left(&t, Path::new("/sys/fs/cgroup"), read));
    [machine, rlimits, cgroup].into_iter().flatten().min()
}

/// `MemAvailable` of `/proc/meminfo`'s text, in bytes.
fn meminfo_available(meminfo: &str) -> Option<u64> {
    kib_field(meminfo, "MemAvailable:")
}

/// The value of the `/proc` line starting with `key`, given in kB, in bytes.
fn kib_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// What the soft address-space and data limits of `/proc/self/limits`' text leave, given the
/// process's `VmSize` and `VmData` in `/proc/self/status`' text: the lesser of the two (`None`
/// when both are unlimited).
fn rlimits_left(limits: &str, status: &str) -> Option<u64> {
    let soft = |name: &str| -> Option<u64> {
        let rest = limits.lines().find_map(|l| l.strip_prefix(name))?;
        rest.split_whitespace().next()?.parse().ok()
    };
    let left = |limit: Option<u64>, used: &str| {
        limit.map(|l| l.saturating_sub(kib_field(status, used).unwrap_or(0)))
    };
    [
        left(soft("Max address space"), "VmSize:"),
        left(soft("Max data size"), "VmData:"),
    ]
    .into_iter()
    .flatten()
    .min()
}

/// What the memory limit of this process's cgroup leaves, from `/proc/self/cgroup`'s text and
/// the cgroup file system mounted at `root`, read through `read`: version 2's `memory.max` less
/// `memory.current` (the unified hierarchy, a `0::` line), else version 1's
/// `memory.limit_in_bytes` less `memory.usage_in_bytes` (the `memory` controller's line). The
/// process's own cgroup directory is looked up first, then the mount's root (a container sees
/// its own cgroup there); `None` when no limit is set.
fn cgroup_left(cgroup: &str, root: &Path, read: impl Fn(&Path) -> Option<String>) -> Option<u64> {
    let number =
        |dir: &Path, file: &str| -> Option<u64> { read(&dir.join(file))?.trim().parse().ok() };
    let dirs = |base: PathBuf, own: &str| [base.join(own.trim_start_matches('/')), base];
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, own) = (parts.next()?, parts.next()?, parts.next()?);
        let (base, limit, usage) = if controllers.is_empty() {
            (root.to_path_buf(), "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                root.join("memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        // Version 2 writes `max` for no limit; version 1 a number near 2^63.
        let found = dirs(base, own).into_iter().find_map(|dir| {
            let limit = number(&dir, limit)?;
            Some((limit, number(&dir, usage).unwrap_or(0)))
        });
        if let Some((limit, used)) = found.filter(|(l, _)| *l < 1 << 62) {
            return Some(limit.saturating_sub(used));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A `read` over the files `files` (path, content).
    fn files(files: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
        let map: BTreeMap<PathBuf, String> = files
            .iter()
            .map(|(p, c)| (PathBuf::from(p), c.to_string()))
            .collect();
        move |p: &Path| map.get(p).cloned()
    }

    #[test]
    fn the_machine_s_available_memory_is_mem_available() {
        let meminfo =
            "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo_available(meminfo), Some(20_000_000 * 1024));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn address_space_and_data_limits_leave_what_the_process_has_not_mapped() {
        let limits =
            "Limit                     Soft Limit           Hard Limit           Units     \n\
            Max data size             unlimited            unlimited            bytes     \n\
            Max address space         4294967296           unlimited            bytes     \n";
        let status = "VmPeak:\t 2000 kB\nVmSize:\t 1048576 kB\nVmData:\t 4096 kB\n";
        assert_eq!(rlimits_left(limits, status), Some(4294967296 - (1 << 30)));
        let data = limits.replace("4294967296  ", "unlimited   ").replace(
            "Max data size             unlimited ",
            "Max data size             8388608   ",
        );
        assert_eq!(rlimits_left(&data, status), Some(8388608 - 4096 * 1024));
        let none = limits.replace("4294967296  ", "unlimited   ");
        assert_eq!(rlimits_left(&none, status), None);
    }

    #[test]
    fn a_cgroup_v2_limit_leaves_its_max_less_its_current_use() {
        let cgroup = "0::/user.slice/job\n";
        let read = files(&[
            ("/cg/user.slice/job/memory.max", "1073741824\n"),
            ("/cg/user.slice/job/memory.current", "73741824\n"),
        ]);
        assert_eq!(
            cgroup_left(cgroup, Path::new("/cg"), read),
            Some(1_000_000_000)
        );
        // No limit: `max`.
        let read = files(&[("/cg/user.slice/job/memory.max", "max\n")]);
        assert_eq!(cgroup_left(cgroup, Path::new("/cg"), read), None);
        // A container sees its own cgroup at the mount's root.
        let read = files(&[("/cg/memory.max", "2048\n"), ("/cg/memory.current", "48\n")]);
        assert_eq!(cgroup_left(cgroup, Path::new("/cg"), read), Some(2000));
    }

    #[test]
    fn a_cgroup_v1_limit_is_read_from_the_memory_controller() {
        let cgroup = "9:name=systemd:/\n4:memory:/api/x\n3:cpuset:/\n0::/\n";
        let read = files(&[
            ("/cg/memory/api/x/memory.limit_in_bytes", "536870912\n"),
            ("/cg/memory/api/x/memory.usage_in_bytes", "36870912\n"),
            ("/cg/memory/memory.limit_in_bytes", "9223372036854771712\n"),
        ]);
        assert_eq!(
            cgroup_left(cgroup, Path::new("/cg"), read),
            Some(500_000_000)
        );
        // Version 1's "no limit" is a number near 2^63.
        let read = files(&[(
            "/cg/memory/api/x/memory.limit_in_bytes",
            "9223372036854771712\n",
        )]);
        assert_eq!(cgroup_left(cgroup, Path::new("/cg"), read), None);
    }
}
