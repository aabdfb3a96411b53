"""What this machine has, detected without importing torch or any engine.

``detect_hardware()`` returns a frozen :class:`HardwareProfile`. Every probe that
fails (no NVML library, no sysfs, a command that is missing) becomes a note in
``profile.notes``; detection never raises. Profiles serialize to JSON and load back,
so selection can be planned for any machine (``localrun plan --hardware PROFILE.json``).

Only NVML, ``nvidia-smi``, sysfs, ``/proc``, ``sysctl`` and, when asked for and
installed, OpenVINO's device list are consulted. CUDA libraries, ``nvcc`` or pip
``nvidia-*`` wheels prove nothing: a GPU counts only when NVML or ``nvidia-smi`` sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any, Literal

SCHEMA_VERSION = 1
GiB = 1024**3
MiB = 1024**2

GPUVendor = Literal["nvidia", "amd", "intel", "apple", "other"]

#: CPU features that matter to inference kernels, as /proc/cpuinfo spells them.
CPU_FLAGS: tuple[str, ...] = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
    # ARM (/proc/cpuinfo "Features"); "neon" is reported as asimd on aarch64
    "neon", "asimd", "asimddp", "i8mm", "sve", "sve2", "bf16",
)

#: PCI vendor ids (sysfs ``device/vendor``).
PCI_VENDORS: dict[str, GPUVendor] = {"0x10de": "nvidia", "0x1002": "amd", "0x8086": "intel"}

#: Intel discrete GPU PCI device-id ranges (inclusive): Alchemist, Battlemage.
INTEL_DISCRETE_IDS: tuple[tuple[int, int, str], ...] = (
    (0x5690, 0x56BF, "Intel Arc A-series (Alchemist)"),
    (0xE202, 0xE2FF, "Intel Arc B-series (Battlemage)"),
)
INTEL_GPU_NAMES: dict[int, str] = {0x56A0: "Intel Arc A770", 0x56A1: "Intel Arc A750",
                                   0xE20B: "Intel Arc B580", 0xE20C: "Intel Arc B570"}
#: Intel NPU PCI ids (driver intel_vpu).
INTEL_NPU_NAMES: dict[int, str] = {0x7D1D: "Intel NPU (Meteor Lake)",
                                   0xAD1D: "Intel NPU (Arrow Lake)",
                                   0x643E: "Intel NPU (Lunar Lake)"}
NPU_DRIVERS: dict[str, str] = {"intel_vpu": "intel", "amdxdna": "amd"}

#: The PCI slot of Intel's integrated GPU.
INTEL_IGPU_SLOT = "0000:00:02.0"

#: Where CUDA libraries are commonly found; their presence alone is not a GPU.
CUDA_HINT_PATHS: tuple[str, ...] = ("/usr/local/cuda", "/opt/cuda")

_NVIDIA_SMI_FIELDS = ("index", "uuid", "name", "compute_cap", "driver_version",
                      "memory.total", "memory.free")


@dataclass(frozen=True)
class CPUInfo:
    vendor: str | None = None  # "GenuineIntel", "AuthenticAMD", "ARM", "Apple"
    model: str | None = None
    arch: str = ""  # "x86_64", "arm64", "aarch64"
    physical_cores: int | None = None
    logical_cores: int | None = None
    usable_cores: int | None = None  # affinity and cgroup quota applied
    flags: tuple[str, ...] = ()

    @property
    def is_intel(self) -> bool:
        return (self.vendor or "").lower() in ("genuineintel", "intel")

    @property
    def is_amd(self) -> bool:
        return (self.vendor or "").lower() in ("authenticamd", "amd")


@dataclass(frozen=True)
class GPUInfo:
    vendor: GPUVendor
    name: str
    index: int = 0  # position among GPUs of the same vendor
    memory_total: int | None = None  # bytes; None when unknown or unified
    memory_free: int | None = None
    compute_capability: str | None = None  # NVIDIA, "8.6"
    driver: str | None = None  # NVIDIA driver version or the Linux kernel driver
    integrated: bool = False
    arch_target: str | None = None  # AMD gfx target, e.g. "gfx1100"
    pci_id: str | None = None  # "0x8086:0x56a0"
    source: str = ""  # nvml, nvidia-smi, kfd, sysfs, openvino, profile

    @property
    def cc(self) -> tuple[int, int] | None:
        if not self.compute_capability:
            return None
        m = re.match(r"(\d+)\.(\d+)", self.compute_capability)
        return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class NPUInfo:
    vendor: str
    name: str
    driver: str | None = None
    pci_id: str | None = None
    source: str = ""


@dataclass(frozen=True)
class AppleInfo:
    chip: str  # "Apple M2 Pro"
    unified_memory: int  # bytes
    performance_cores: int | None = None
    efficiency_cores: int | None = None
    rosetta: bool = False  # this Python runs translated (x86_64 on arm64)


@dataclass(frozen=True)
class HardwareProfile:
    os: str  # "Linux", "Darwin", "Windows"
    os_version: str
    arch: str
    cpu: CPUInfo
    ram_total: int | None = None  # bytes, after the container limit
    ram_available: int | None = None
    ram_limit: int | None = None  # the cgroup limit when one applies
    gpus: tuple[GPUInfo, ...] = ()
    npus: tuple[NPUInfo, ...] = ()
    apple: AppleInfo | None = None
    notes: tuple[str, ...] = ()  # failed probes and things worth knowing
    name: str | None = None  # a label for described (not detected) machines

    # -- views -------------------------------------------------------------------------
    def gpus_of(self, vendor: GPUVendor) -> tuple[GPUInfo, ...]:
        return tuple(g for g in self.gpus if g.vendor == vendor)

    @property
    def nvidia_gpus(self) -> tuple[GPUInfo, ...]:
        return self.gpus_of("nvidia")

    @property
    def is_apple_silicon(self) -> bool:
        return self.apple is not None

    # -- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {"schema": SCHEMA_VERSION, **d}

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HardwareProfile:
        """Build a profile from ``to_dict()`` output (or a hand-written description).

        Unknown keys are ignored; missing ones take their defaults.
        """
        from localrun.errors import LocalrunError

        try:
            d = dict(data)
            d.pop("schema", None)
            cpu = _build(CPUInfo, d.pop("cpu", None) or {})
            gpus = tuple(_build(GPUInfo, g) for g in d.pop("gpus", None) or ())
            npus = tuple(_build(NPUInfo, n) for n in d.pop("npus", None) or ())
            apple_d = d.pop("apple", None)
            apple = _build(AppleInfo, apple_d) if apple_d else None
            d["notes"] = tuple(d.get("notes") or ())
            d.setdefault("os", "Linux")
            d.setdefault("os_version", "")
            d.setdefault("arch", cpu.arch)
            profile: HardwareProfile = _build(
                cls, {**d, "cpu": cpu, "gpus": gpus, "npus": npus, "apple": apple})
            return profile
        except (TypeError, ValueError, AttributeError) as e:
            raise LocalrunError(
                f"Not a hardware profile: {e}",
                hint="write one with: localrun doctor --json > profile.json",
            ) from e

    @classmethod
    def from_json(cls, text: str) -> HardwareProfile:
        from localrun.errors import LocalrunError

        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise LocalrunError(f"Hardware profile is not valid JSON: {e}",
                                hint="write one with: localrun doctor --json > profile.json"
                                ) from e
        if not isinstance(data, dict):
            raise LocalrunError("Hardware profile must be a JSON object",
                                hint="write one with: localrun doctor --json > profile.json")
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | PathLike[str]) -> HardwareProfile:
        from localrun.errors import ModelFileError

        p = Path(path).expanduser()
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ModelFileError(str(p), e.strerror or str(e),
                                 hint="write one with: localrun doctor --json > profile.json"
                                 ) from e
        return cls.from_json(text)


def _build(cls: type[Any], data: Mapping[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in names}
    for k in ("flags",):
        if k in kwargs and kwargs[k] is not None:
            kwargs[k] = tuple(kwargs[k])
    return cls(**kwargs)


# ======================================================================================
# Detection
# ======================================================================================


class _Notes:
    """Collects probe failures; a failed probe is a sentence, never an exception."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, text: str) -> None:
        if text not in self.items:
            self.items.append(text)


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _run(cmd: list[str], timeout: float = 5.0) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=4)
def detect_hardware(*, probe_openvino: bool = False) -> HardwareProfile:
    """Detect this machine once per process (cached); never raises.

    ``probe_openvino=True`` also asks OpenVINO for its device list when openvino is
    installed (it imports the OpenVINO runtime, so it is off by default).
    """
    notes = _Notes()
    system = platform.system()
    arch = platform.machine() or ""
    os_version = _os_version(system)
    apple: AppleInfo | None = None
    if system == "Darwin":
        cpu, apple, ram_total = _probe_darwin(arch, notes)
        ram_available, ram_limit = None, None
        if apple is not None:
            arch = "arm64"
    else:
        cpu = _guarded(lambda: _probe_cpu_linux(arch, notes) if system == "Linux"
                       else _probe_cpu_generic(arch), CPUInfo(arch=arch), "CPU", notes)
        ram_total, ram_available, ram_limit = _guarded(
            lambda: _probe_ram(system, notes), (None, None, None), "memory", notes)
    gpus: list[GPUInfo] = []
    npus: list[NPUInfo] = []
    if system != "Darwin":
        gpus += _guarded(lambda: _probe_nvidia(notes), [], "NVIDIA GPU", notes)
    if system == "Linux":
        gpus += _guarded(lambda: _probe_amd_kfd(notes), [], "AMD GPU", notes)
        extra_gpus, npus = _guarded(lambda: _probe_pci(gpus, notes), ([], []), "PCI", notes)
        gpus += extra_gpus
    if probe_openvino:
        ov_gpus, ov_npus = _guarded(lambda: _probe_openvino(gpus, npus, notes), ([], []),
                                    "OpenVINO device", notes)
        gpus += ov_gpus
        npus += ov_npus
    if apple is not None:
        gpus.append(GPUInfo("apple", apple.chip + " GPU", memory_total=apple.unified_memory,
                            integrated=True, source="sysctl"))
    return HardwareProfile(
        os=system, os_version=os_version, arch=arch, cpu=cpu, ram_total=ram_total,
        ram_available=ram_available, ram_limit=ram_limit, gpus=tuple(gpus),
        npus=tuple(npus), apple=apple, notes=tuple(notes.items),
    )


def _guarded(fn: Callable[[], Any], default: Any, what: str, notes: _Notes) -> Any:
    # The last line of defence: a probe bug must not break `localrun doctor`.
    try:
        return fn()
    except Exception as e:
        notes.add(f"{what} probe failed: {type(e).__name__}: {e}")
        return default


def _os_version(system: str) -> str:
    if system == "Darwin":
        return platform.mac_ver()[0] or platform.release()
    if system == "Linux":
        text = _read("/etc/os-release") or ""
        m = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', text, re.M)
        base = m.group(1) if m else "Linux"
        return f"{base} (kernel {platform.release()})"
    return platform.version() or platform.release()


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


def _probe_cpu_linux(arch: str, notes: _Notes) -> CPUInfo:
    text = _read("/proc/cpuinfo")
    if text is None:
        notes.add("cannot read /proc/cpuinfo: CPU model and instruction sets unknown")
        return _probe_cpu_generic(arch)
    info = parse_cpuinfo(text, arch)
    if info.model is None:
        model = _read("/proc/device-tree/model")  # Raspberry Pi and other boards
        if model:
            info = dataclasses.replace(info, model=model.rstrip("\x00"))
    logical = info.logical_cores or os.cpu_count()
    physical = info.physical_cores
    if physical is None and arch.lower() in ("aarch64", "arm64"):
        physical = logical  # ARM cores have no SMT siblings in /proc/cpuinfo
    return dataclasses.replace(info, logical_cores=logical, physical_cores=physical,
                               usable_cores=_usable_cores(logical, notes))


def _probe_cpu_generic(arch: str) -> CPUInfo:
    n = os.cpu_count()
    return CPUInfo(vendor=None, model=platform.processor() or None, arch=arch,
                   logical_cores=n, usable_cores=n)


def _usable_cores(logical: int | None, notes: _Notes) -> int | None:
    usable = logical
    if hasattr(os, "sched_getaffinity"):
        usable = len(os.sched_getaffinity(0))
    quota = _read("/sys/fs/cgroup/cpu.max")  # cgroup v2: "max 100000" or "200000 100000"
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


def _probe_ram(system: str, notes: _Notes) -> tuple[int | None, int | None, int | None]:
    if system == "Windows":
        return _probe_ram_windows(notes)
    text = _read("/proc/meminfo")
    if text is None:
        notes.add("cannot read /proc/meminfo: RAM size unknown")
        return None, None, None
    total, avail = parse_meminfo(text)
    limit = None
    for limit_file, usage_file in CGROUP_MEMORY_FILES:
        raw = _read(limit_file)
        if raw is None:
            continue
        if raw == "max" or not raw.isdigit() or int(raw) >= 2**60:
            break
        limit = int(raw)
        used = _read(usage_file)
        if total is None or limit < total:
            notes.add(f"container memory limit {limit / GiB:.1f} GiB applies "
                      f"(host has {(total or 0) / GiB:.1f} GiB)")
            total = limit
            if used and used.isdigit():
                left = max(0, limit - int(used))
                avail = left if avail is None else min(avail, left)
        break
    return total, avail, limit


def _probe_ram_windows(notes: _Notes) -> tuple[int | None, int | None, int | None]:
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
    out = _run(["sysctl", "-n", key])
    if out is None or out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _probe_darwin(arch: str, notes: _Notes) -> tuple[CPUInfo, AppleInfo | None, int | None]:
    vals = {k: _sysctl(k) for k in _SYSCTL_KEYS}
    if vals["hw.memsize"] is None:
        notes.add("sysctl failed: CPU and memory unknown")
    brand = vals["machdep.cpu.brand_string"]
    mem = _int(vals["hw.memsize"])
    arm64 = vals["hw.optional.arm64"] == "1"
    translated = vals["sysctl.proc_translated"] == "1"
    if translated:
        notes.add("this Python runs under Rosetta (x86_64 on Apple Silicon): MLX and Metal "
                  "cannot be used from it; install an arm64 Python")
    cpu = CPUInfo(
        vendor="Apple" if arm64 else "GenuineIntel", model=brand, arch="arm64" if arm64 else arch,
        physical_cores=_int(vals["hw.physicalcpu"]), logical_cores=_int(vals["hw.logicalcpu"]),
        usable_cores=_int(vals["hw.logicalcpu"]), flags=("neon",) if arm64 else (),
    )
    apple = None
    if arm64:
        apple = AppleInfo(chip=brand or "Apple Silicon", unified_memory=mem or 0,
                          performance_cores=_int(vals["hw.perflevel0.physicalcpu"]),
                          efficiency_cores=_int(vals["hw.perflevel1.physicalcpu"]),
                          rosetta=translated)
    return cpu, apple, mem


# -- NVIDIA ---------------------------------------------------------------------------


def _probe_nvidia(notes: _Notes) -> list[GPUInfo]:
    gpus = _probe_nvml(notes)
    if gpus is None:
        gpus = _probe_nvidia_smi(notes)
    if not gpus:
        found = [p for p in CUDA_HINT_PATHS if Path(p).exists()]
        nvcc = shutil.which("nvcc")
        if nvcc:
            found.append(nvcc)
        if found:
            notes.add("CUDA libraries/toolkit found (" + ", ".join(found) + ") but no NVIDIA "
                      "GPU with a working driver: CUDA is not counted as a GPU")
    if gpus and _read("/sys/devices/soc0/family") == "Tegra":
        # Jetson: the GPU shares system RAM; budget from RAM, not from a VRAM figure.
        gpus = [dataclasses.replace(g, integrated=True, memory_total=None, memory_free=None)
                for g in gpus]
        notes.add("NVIDIA Tegra/Jetson: the GPU uses unified memory (sized from RAM)")
    return gpus


def _probe_nvml(notes: _Notes) -> list[GPUInfo] | None:
    """GPUs through NVML, or None when NVML cannot answer (then try nvidia-smi)."""
    try:
        import pynvml
    except ImportError:
        notes.add("nvidia-ml-py is not installed: NVML probe skipped (pip install nvidia-ml-py)")
        return None
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError) as e:
        notes.add(f"NVML unavailable ({e}): no NVIDIA driver, so no usable NVIDIA GPU")
        return None
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        out = []
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = _text(pynvml.nvmlDeviceGetName(h))
            total = free = None
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                total, free = int(mem.total), int(mem.free)
            except pynvml.NVMLError as e:  # unified-memory parts (GB10, Jetson)
                notes.add(f"NVML cannot report memory of GPU {i} ({name}): {e}")
            cc = None
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                cc = f"{major}.{minor}"
            except pynvml.NVMLError as e:
                notes.add(f"NVML cannot report compute capability of GPU {i}: {e}")
            out.append(GPUInfo("nvidia", name, i, total, free, cc, driver,
                               integrated=_nvidia_integrated(name), source="nvml"))
        return out
    except (pynvml.NVMLError, OSError) as e:
        notes.add(f"NVML query failed: {e}")
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError, OSError):
            pynvml.nvmlShutdown()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _nvidia_integrated(name: str) -> bool:
    return bool(re.search(r"\b(GB10|Tegra|Orin|Xavier|Jetson)\b", name, re.I))


def _probe_nvidia_smi(notes: _Notes) -> list[GPUInfo]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    fields = list(_NVIDIA_SMI_FIELDS)
    for _ in range(2):
        out = _run([exe, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"])
        if out is not None and out.returncode == 0:
            return parse_nvidia_smi(out.stdout, fields)
        if "compute_cap" not in fields:
            break
        fields.remove("compute_cap")  # drivers <= 470 reject it
    msg = (out.stderr or out.stdout).strip().splitlines()[:1] if out is not None else []
    notes.add("nvidia-smi failed" + (f": {msg[0]}" if msg else "") +
              ": no usable NVIDIA GPU")
    return []


def parse_nvidia_smi(text: str, fields: Iterable[str] = _NVIDIA_SMI_FIELDS) -> list[GPUInfo]:
    names = list(fields)
    out: list[GPUInfo] = []
    for line in text.strip().splitlines():
        row = dict(zip(names, (c.strip() for c in line.split(",")), strict=False))
        row = {k: v for k, v in row.items() if v and not v.startswith("[")}  # [N/A]

        def mib(key: str, row: dict[str, str] = row) -> int | None:
            v = row.get(key)
            return int(float(v) * MiB) if v and re.fullmatch(r"[\d.]+", v) else None

        name = row.get("name", "NVIDIA GPU")
        out.append(GPUInfo("nvidia", name, _int(row.get("index")) or len(out),
                           mib("memory.total"), mib("memory.free"), row.get("compute_cap"),
                           row.get("driver_version"), integrated=_nvidia_integrated(name),
                           source="nvidia-smi"))
    return out


# -- AMD (ROCm kfd topology + drm sysfs) ------------------------------------------------

KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")
DRM = Path("/sys/class/drm")


def gfx_target(version: int) -> str:
    """110001 -> gfx1101, 90010 -> gfx90a (minor and stepping in hex)."""
    major, minor, step = version // 10000, version // 100 % 100, version % 100
    return f"gfx{major}{minor:x}{step:x}"


def _props(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _probe_amd_kfd(notes: _Notes) -> list[GPUInfo]:
    if not KFD_NODES.is_dir():
        return []
    gpus: list[GPUInfo] = []
    for node in sorted(KFD_NODES.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
        props = _props(_read(node / "properties") or "")
        version = props.get("gfx_target_version", 0)
        if not version:
            continue  # a CPU node
        dev = DRM / f"renderD{props.get('drm_render_minor', -1)}" / "device"
        vram = _int(_read(dev / "mem_info_vram_total"))
        used = _int(_read(dev / "mem_info_vram_used"))
        gtt = _int(_read(dev / "mem_info_gtt_total"))
        name = _read(dev / "product_name") or f"AMD GPU {gfx_target(version)}"
        integrated = bool(vram is not None and vram <= 4 * GiB and gtt and gtt >= 4 * vram)
        gpus.append(GPUInfo("amd", name, len(gpus), vram,
                            (vram - used) if vram is not None and used is not None else None,
                            driver="amdgpu", integrated=integrated,
                            arch_target=gfx_target(version), source="kfd"))
    if not gpus and KFD_NODES.is_dir():
        notes.add("ROCm kfd present but lists no GPU nodes")
    return gpus


def _pci_id(dev: Path) -> tuple[str | None, int | None]:
    vendor = (_read(dev / "vendor") or "").lower() or None
    device = _read(dev / "device")
    try:
        return vendor, int(device, 16) if device else None
    except ValueError:
        return vendor, None


def _driver(dev: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(dev / "driver"))
    except OSError:
        return None


def _probe_pci(known: list[GPUInfo], notes: _Notes) -> tuple[list[GPUInfo], list[NPUInfo]]:
    """Intel GPUs and NPUs from sysfs; also notes GPUs whose driver is not working."""
    gpus: list[GPUInfo] = []
    npus: list[NPUInfo] = []
    have = {g.vendor for g in known}
    if DRM.is_dir():
        for card in sorted(DRM.glob("card*")):
            if not re.fullmatch(r"card\d+", card.name):
                continue  # connectors such as card0-DP-1
            dev = card / "device"
            vendor_id, device_id = _pci_id(dev)
            vendor = PCI_VENDORS.get(vendor_id or "")
            pci = f"{vendor_id}:{device_id:#06x}" if vendor_id and device_id is not None else None
            if vendor == "intel" and device_id is not None:
                slot = os.path.basename(os.path.realpath(dev))
                discrete = _intel_discrete(device_id)
                integrated = discrete is None or slot == INTEL_IGPU_SLOT
                name = INTEL_GPU_NAMES.get(device_id) or discrete or "Intel integrated GPU"
                gpus.append(GPUInfo("intel", name, len(gpus), driver=_driver(dev),
                                    integrated=integrated, pci_id=pci, source="sysfs"))
            elif vendor in ("nvidia", "amd") and vendor not in have:
                notes.add(f"an {vendor.upper() if vendor == 'amd' else 'NVIDIA'} GPU is on the "
                          f"PCI bus ({card.name}, {pci}) but its driver/runtime does not answer "
                          "(driver " + (_driver(dev) or "none") + "): not used")
    accel = Path("/sys/class/accel")
    if accel.is_dir():
        for a in sorted(accel.glob("accel*")):
            dev = a / "device"
            driver = _driver(dev)
            if driver in NPU_DRIVERS:
                vendor_id, device_id = _pci_id(dev)
                name = (INTEL_NPU_NAMES.get(device_id or 0) if driver == "intel_vpu" else None) \
                    or ("Intel NPU" if driver == "intel_vpu" else "AMD XDNA NPU")
                pci = f"{vendor_id}:{device_id:#06x}" if vendor_id and device_id else None
                npus.append(NPUInfo(NPU_DRIVERS[driver], name, driver, pci, "sysfs"))
    return gpus, npus


def _intel_discrete(device_id: int) -> str | None:
    for lo, hi, family in INTEL_DISCRETE_IDS:
        if lo <= device_id <= hi:
            return family
    return None


# -- OpenVINO (optional; imports the OpenVINO runtime) --------------------------------


def _probe_openvino(gpus: list[GPUInfo], npus: list[NPUInfo],
                    notes: _Notes) -> tuple[list[GPUInfo], list[NPUInfo]]:
    from importlib import metadata

    try:
        metadata.version("openvino")
    except metadata.PackageNotFoundError:
        return [], []
    try:
        import openvino

        core = openvino.Core()
        devices = list(core.available_devices)
    except Exception as e:  # the runtime can fail in many ways (drivers, plugins)
        notes.add(f"OpenVINO device query failed: {type(e).__name__}: {e}")
        return [], []
    new_gpus: list[GPUInfo] = []
    new_npus: list[NPUInfo] = []
    have_intel_gpu = any(g.vendor == "intel" for g in gpus)
    for dev in devices:
        try:
            name = str(core.get_property(dev, "FULL_DEVICE_NAME"))
        except Exception:
            name = dev
        if dev.startswith("GPU") and not have_intel_gpu:
            kind = ""
            mem = None
            try:
                kind = str(core.get_property(dev, "DEVICE_TYPE")).lower()
                mem = int(core.get_property(dev, "GPU_DEVICE_TOTAL_MEM_SIZE"))
            except Exception:
                pass
            new_gpus.append(GPUInfo("intel", name, len(new_gpus), memory_total=mem,
                                    integrated="discrete" not in kind, source="openvino"))
        elif dev == "NPU" and not npus:
            new_npus.append(NPUInfo("intel", name, source="openvino"))
    return new_gpus, new_npus


__all__ = [
    "AppleInfo",
    "CPUInfo",
    "GPUInfo",
    "HardwareProfile",
    "NPUInfo",
    "detect_hardware",
]
