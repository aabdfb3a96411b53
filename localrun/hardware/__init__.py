"""What this machine has, detected without importing torch or any engine.

``detect_hardware()`` returns a frozen :class:`HardwareProfile`. Every probe that
fails (no NVML library, no sysfs, a command that is missing) becomes a note in
``profile.notes``; detection never raises. Profiles serialize to JSON and load back,
so selection can be planned for any machine (``localrun plan --hardware PROFILE.json``).

Only NVML, ``nvidia-smi``, sysfs, ``/proc``, ``sysctl`` and, when asked for and
installed, OpenVINO's device list are consulted. CUDA libraries, ``nvcc`` or pip
``nvidia-*`` wheels prove nothing: a GPU counts only when NVML or ``nvidia-smi`` sees it.

The package, by job: ``profile`` (the data and its JSON), ``detect`` (``detect_hardware``,
every probe guarded), ``host`` (CPU, memory, Apple Silicon), ``accelerators`` (NVIDIA,
AMD, Intel GPUs and NPUs, OpenVINO's devices), ``system`` (file and command reads, notes).
"""

from __future__ import annotations

from localrun.hardware.accelerators import gfx_target, parse_nvidia_smi
from localrun.hardware.detect import detect_hardware, gpus_now
from localrun.hardware.host import parse_cpuinfo, parse_meminfo
from localrun.hardware.profile import (
    SCHEMA_VERSION,
    AppleInfo,
    CPUInfo,
    GiB,
    GPUInfo,
    GPUVendor,
    HardwareProfile,
    MiB,
    NPUInfo,
)

__all__ = [
    "SCHEMA_VERSION",
    "AppleInfo",
    "CPUInfo",
    "GPUInfo",
    "GPUVendor",
    "GiB",
    "HardwareProfile",
    "MiB",
    "NPUInfo",
    "detect_hardware",
    "gfx_target",
    "gpus_now",
    "parse_cpuinfo",
    "parse_meminfo",
    "parse_nvidia_smi",
]
