"""The host's CPU, memory and, on a Mac, its Apple Silicon chip: /proc, sysfs, cgroups,
sysctl."""

from __future__ import annotations

import dataclasses
import os
import platform
import re

from localrun.hardware.profile import AppleInfo, CPUInfo, GiB
from localrun.hardware.system import Notes, read_text, run_command, to_int

#: CPU features that matter to inference kernels, as /proc/cpuinfo spells them.
CPU_FLAGS: tuple[str, ...] = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
    # ARM (/proc/cpuinfo "Features"); "neon" is reported as asimd on aarch64
    "neon", "asimd", "asimddp", "i8mm", "sve", "sve2", "bf16",
)


# -- CPU ------------------------------------------------------------------------------

_ARM_IMPLEMENTERS = {"0x41": "ARM", "0x61": "Apple", "0x51": "Qualcomm", "0x48": "HiSilicon",
                     "0x46": "Fujitsu", "0xc0": "Ampere", "0x4e": "NVIDIA"}


def parse_cpuinfo(text: str, arch: str) -> CPUInfo:
    """Parse /proc/cpuinfo text (x86 or ARM) into a CPUInfo (usable_cores left unset)."""
    first: dict[str, str] = {}
    cores: set[tuple[str, str]] = set()
    logical = 0
    phys_id = core_id = None
    for line in [*text.splitlines(), ""]:
        if not line.strip():
            if core_id is not None:
                cores.add((phys_id or "0", core_id))
            phys_id = core_id = None
            continue
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            logical += 1
        elif key == "physical id":
            phys_id = value
        elif key == "core id":
            core_id = value
        first.setdefault(key, value)
    flags_raw = (first.get("flags") or first.get("Features") or "").split()
    flags = [f for f in CPU_FLAGS if f in flags_raw]
    if "asimd" in flags_raw and "neon" not in flags:
        flags.insert(0, "neon")
    vendor = first.get("vendor_id")
    if vendor is None and "CPU implementer" in first:
        vendor = _ARM_IMPLEMENTERS.get(first["CPU implementer"].lower(), first["CPU implementer"])
    model = first.get("model name") or first.get("Model") or first.get("Hardware")
    return CPUInfo(
        vendor=vendor, model=model, arch=arch,
        physical_cores=len(cores) or None, logical_cores=logical or None,
        flags=tuple(flags),
    )


def probe_cpu_linux(arch: str, notes: Notes) -> CPUInfo:
    text = read_text("/proc/cpuinfo")
    if text is None:
        notes.add("cannot read /proc/cpuinfo: CPU model and instruction sets unknown")
        return probe_cpu_generic(arch)
    info = parse_cpuinfo(text, arch)
    if info.model is None:
        model = read_text("/proc/device-tree/model")  # Raspberry Pi and other boards
        if model:
            info = dataclasses.replace(info, model=model.rstrip("\x00"))
    logical = info.logical_cores or os.cpu_count()
    physical = info.physical_cores
    if physical is None and arch.lower() in ("aarch64", "arm64"):
        physical = logical  # ARM cores have no SMT siblings in /proc/cpuinfo
    return dataclasses.replace(info, logical_cores=logical, physical_cores=physical,
                               usable_cores=_usable_cores(logical, notes))


def probe_cpu_generic(arch: str) -> CPUInfo:
    n = os.cpu_count()
    return CPUInfo(vendor=None, model=platform.processor() or None, arch=arch,
                   logical_cores=n, usable_cores=n)


def _usable_cores(logical: int | None, notes: Notes) -> int | None:
    usable = logical
    if hasattr(os, "sched_getaffinity"):
        usable = len(os.sched_getaffinity(0))
    quota = read_text("/sys/fs/cgroup/cpu.max")  # cgroup v2: "max 100000" or "200000 100000"
    if quota:
        parts = quota.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                limit = max(1, int(int(parts[0]) // int(parts[1])))
                if usable is None or limit < usable:
                    notes.add(f"container CPU quota limits this process to {limit} cores")
                    usable = limit
            except ValueError:
                pass
    return usable


# -- RAM ------------------------------------------------------------------------------


def parse_meminfo(text: str) -> tuple[int | None, int | None]:
    vals: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if m:
            vals[m.group(1)] = int(m.group(2)) * 1024
    return vals.get("MemTotal"), vals.get("MemAvailable", vals.get("MemFree"))


#: cgroup (limit file, usage file); a limit of "max" or about 2**63 means none.
CGROUP_MEMORY_FILES: tuple[tuple[str, str], ...] = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def probe_ram(system: str, notes: Notes) -> tuple[int | None, int | None, int | None]:
    if system == "Windows":
        return _probe_ram_windows(notes)
    text = read_text("/proc/meminfo")
    if text is None:
        notes.add("cannot read /proc/meminfo: RAM size unknown")
        return None, None, None
    total, avail = parse_meminfo(text)
    limit = None
    for limit_file, usage_file in CGROUP_MEMORY_FILES:
        raw = read_text(limit_file)
        if raw is None:
            continue
        if raw == "max" or not raw.isdigit() or int(raw) >= 2**60:
            break
        limit = int(raw)
        used = read_text(usage_file)
        if total is None or limit < total:
            notes.add(f"container memory limit {limit / GiB:.1f} GiB applies "
                      f"(host has {(total or 0) / GiB:.1f} GiB)")
            total = limit
            if used and used.isdigit():
                left = max(0, limit - int(used))
                avail = left if avail is None else min(avail, left)
        break
    return total, avail, limit


def _probe_ram_windows(notes: Notes) -> tuple[int | None, int | None, int | None]:
    import ctypes

    class MemoryStatusEx(ctypes.Structure):
        _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                    ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                    ("ullTotalPageFile", ctypes.c_ulonglong),
                    ("ullAvailPageFile", ctypes.c_ulonglong),
                    ("ullTotalVirtual", ctypes.c_ulonglong),
                    ("ullAvailVirtual", ctypes.c_ulonglong),
                    ("sullAvailExtendedVirtual", ctypes.c_ulonglong)]

    stat = MemoryStatusEx()
    stat.dwLength = ctypes.sizeof(MemoryStatusEx)
    windll = getattr(ctypes, "windll", None)
    if windll is None or not windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(stat)):
        notes.add("GlobalMemoryStatusEx failed: RAM size unknown")
        return None, None, None
    return int(stat.ullTotalPhys), int(stat.ullAvailPhys), None


# -- macOS ----------------------------------------------------------------------------

_SYSCTL_KEYS = ("hw.memsize", "machdep.cpu.brand_string", "hw.optional.arm64",
                "hw.perflevel0.physicalcpu", "hw.perflevel1.physicalcpu",
                "sysctl.proc_translated", "hw.physicalcpu", "hw.logicalcpu")


def _sysctl(key: str) -> str | None:
    out = run_command(["sysctl", "-n", key])
    if out is None or out.returncode != 0:
        return None
    return out.stdout.strip() or None


def probe_darwin(arch: str, notes: Notes) -> tuple[CPUInfo, AppleInfo | None, int | None]:
    vals = {k: _sysctl(k) for k in _SYSCTL_KEYS}
    if vals["hw.memsize"] is None:
        notes.add("sysctl failed: CPU and memory unknown")
    brand = vals["machdep.cpu.brand_string"]
    mem = to_int(vals["hw.memsize"])
    arm64 = vals["hw.optional.arm64"] == "1"
    translated = vals["sysctl.proc_translated"] == "1"
    if translated:
        notes.add("this Python runs under Rosetta (x86_64 on Apple Silicon): MLX and Metal "
                  "cannot be used from it; install an arm64 Python")
    cpu = CPUInfo(
        vendor="Apple" if arm64 else "GenuineIntel", model=brand, arch="arm64" if arm64 else arch,
        physical_cores=to_int(vals["hw.physicalcpu"]), logical_cores=to_int(vals["hw.logicalcpu"]),
        usable_cores=to_int(vals["hw.logicalcpu"]), flags=("neon",) if arm64 else (),
    )
    apple = None
    if arm64:
        apple = AppleInfo(chip=brand or "Apple Silicon", unified_memory=mem or 0,
                          performance_cores=to_int(vals["hw.perflevel0.physicalcpu"]),
                          efficiency_cores=to_int(vals["hw.perflevel1.physicalcpu"]),
                          rosetta=translated)
    return cpu, apple, mem
