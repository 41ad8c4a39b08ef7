"""Memory figures for the record: torch.cuda's allocator statistics where CUDA is present,
else the process's resident host memory (`VmRSS`, and its peak `VmHWM`, from
`/proc/self/status`), each stated as such in the figure's `source`; and the training state
still alive, by category (`live`), where asked for."""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from . import live

Memory = dict[str, Any]


def _status_bytes(key: str) -> int | None:
    """The `/proc/self/status` figure on the line starting with `key`, in bytes."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_host_peak() -> bool:
    """Resets `VmHWM` to the current resident size where the kernel permits it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _host_peak() -> int | None:
    """The peak resident bytes: `VmHWM`, or `ru_maxrss` where there is no `/proc`."""
    peak = _status_bytes("VmHWM:")
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)


def uses_cuda(device: torch.device | str) -> bool:
    """Whether figures for `device` come from torch.cuda."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def reset_peak(device: torch.device | str) -> bool:
    """Resets the peak the next figures report; whether that was possible."""
    if uses_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
        return True
    return _reset_host_peak()


def snapshot(device: torch.device | str, peak_reset: bool) -> Memory:
    """The figures now, and the peaks since the last reset (`peak_reset` says whether there was
    one)."""
    if uses_cuda(device):
        return {
            "source": "cuda",
            "device": str(torch.device(device)),
            "peak_reset": peak_reset,
            "allocated": int(torch.cuda.memory_allocated(device)),
            "reserved": int(torch.cuda.memory_reserved(device)),
            "allocated_peak": int(torch.cuda.max_memory_allocated(device)),
            "reserved_peak": int(torch.cuda.max_memory_reserved(device)),
            "oom_count": int(torch.cuda.memory_stats(device).get("num_ooms", 0)),
        }
    out: Memory = {"source": "host_rss", "peak_reset": peak_reset}
    current = _status_bytes("VmRSS:")
    if current is not None:
        out["allocated"] = current
    peak = _host_peak()
    if peak is not None:
        out["allocated_peak"] = peak
    return out


def source(device: torch.device | str) -> str:
    """The `source` of the figures for `device`: `cuda` or `host_rss`."""
    return "cuda" if uses_cuda(device) else "host_rss"


def held(device: torch.device | str) -> Memory:
    """What is held now, before a trainer is built: the figures (peaks over the process so far)
    and the live training state by category (`live.by_category`)."""
    out = snapshot(device, False)
    out["by_category"] = live.by_category()
    return out
