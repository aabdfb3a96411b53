"""What ``localrun bench`` measures about the host and its own process: memory
bandwidth, peak RSS, VRAM through NVML, the load average."""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from localrun.memory import available_ram_bytes


@dataclass(frozen=True)
class Bandwidth:
    """Memory bandwidth measured by this process (GB/s = 1e9 bytes/s)."""

    read_gb_per_s: float  # single-threaded scan (memchr): the roofline's denominator
    copy_gb_per_s: float  # single-threaded memmove, STREAM-style (2 x bytes / time)
    buffer_bytes: int
    repeats: int
    llc_bytes: int | None
    method: str = ("best of N single-threaded passes over a buffer larger than the "
                   "last-level cache: read = bytes.find scan, copy = memmove")


def last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache, from sysfs (Linux); None elsewhere."""
    best = None
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (idx / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            size = int(digits) * mult
            best = size if best is None else max(best, size)
    return best


def measure_bandwidth(buffer_bytes: int | None = None, repeats: int = 5) -> Bandwidth:
    """Measure read and copy bandwidth with plain bytearrays (no numpy).

    The default buffer is 4x the last-level cache, at least 256 MiB and at most 1 GiB
    (and a quarter of the available memory), so that the passes stream from DRAM.
    """
    llc = last_level_cache_bytes()
    if buffer_bytes is None:
        buffer_bytes = min(max(256 * 2**20, 4 * (llc or 0)), 2**30)
        avail = available_ram_bytes()
        if avail:
            buffer_bytes = max(min(buffer_bytes, avail // 4), 16 * 2**20)
    # Filling writes every page: a calloc'ed buffer would map the shared zero page
    # and "read" at cache speed.
    src = bytearray(b"\x02") * buffer_bytes
    best_read = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        src.find(b"\x01")  # absent: memchr scans the whole buffer
        best_read = min(best_read, time.perf_counter() - t)
    dst = bytearray(b"\x03") * buffer_bytes
    best_copy = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        dst[:] = src
        best_copy = min(best_copy, time.perf_counter() - t)
    del src, dst
    return Bandwidth(read_gb_per_s=buffer_bytes / best_read / 1e9,
                     copy_gb_per_s=2 * buffer_bytes / best_copy / 1e9,
                     buffer_bytes=buffer_bytes, repeats=repeats, llc_bytes=llc)


# -- process memory --------------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux >= 4.0: clear_refs 5). False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> tuple[int | None, int | None]:
    """(current RSS, peak RSS) of this process in bytes; None where unknown."""
    cur = peak = None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if peak is None:
        try:
            import resource
            import sys

            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak = maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes vs KiB
        except (ImportError, OSError):
            pass
    return cur, peak


def vram_bytes() -> int | None:
    """GPU memory this process holds on NVIDIA GPUs (NVML); None when not measurable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no GPU: not measurable
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        pid, total = os.getpid(), 0
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory:
                    total += int(proc.usedGpuMemory)
        return total
    except Exception:  # e.g. NotSupported in containers without PID visibility
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except (OSError, AttributeError):
        return None
