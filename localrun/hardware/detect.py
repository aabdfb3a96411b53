"""``detect_hardware()``: every probe, each guarded, into one :class:`HardwareProfile`."""

from __future__ import annotations

import functools
import platform
import re
from collections.abc import Callable
from typing import Any

from localrun.hardware import accelerators, host
from localrun.hardware.profile import AppleInfo, CPUInfo, GPUInfo, HardwareProfile, NPUInfo
from localrun.hardware.system import Notes, read_text


@functools.lru_cache(maxsize=4)
def detect_hardware(*, probe_openvino: bool = False) -> HardwareProfile:
    """Detect this machine once per process (cached); never raises.

    ``probe_openvino=True`` also asks OpenVINO for its device list when openvino is
    installed (it imports the OpenVINO runtime, so it is off by default).
    """
    notes = Notes()
    system = platform.system()
    arch = platform.machine() or ""
    os_version = _os_version(system)
    apple: AppleInfo | None = None
    if system == "Darwin":
        cpu, apple, ram_total = host.probe_darwin(arch, notes)
        ram_available, ram_limit = None, None
        if apple is not None:
            arch = "arm64"
    else:
        cpu = _guarded(lambda: host.probe_cpu_linux(arch, notes) if system == "Linux"
                       else host.probe_cpu_generic(arch), CPUInfo(arch=arch), "CPU", notes)
        ram_total, ram_available, ram_limit = _guarded(
            lambda: host.probe_ram(system, notes), (None, None, None), "memory", notes)
    gpus: list[GPUInfo] = []
    npus: list[NPUInfo] = []
    if system != "Darwin":
        gpus += _guarded(lambda: accelerators.probe_nvidia(notes), [], "NVIDIA GPU", notes)
    if system == "Linux":
        gpus += _guarded(lambda: accelerators.probe_amd_kfd(notes), [], "AMD GPU", notes)
        extra_gpus, npus = _guarded(lambda: accelerators.probe_pci(gpus, notes), ([], []),
                                    "PCI", notes)
        gpus += extra_gpus
    if probe_openvino:
        ov_gpus, ov_npus = _guarded(lambda: accelerators.probe_openvino(gpus, npus, notes),
                                    ([], []), "OpenVINO device", notes)
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


#: The probe that asks one vendor's driver about its GPUs now (memory free included).
_GPU_PROBES: dict[str, Callable[[Notes], list[GPUInfo]]] = {
    "nvidia": accelerators.probe_nvidia, "amd": accelerators.probe_amd_kfd}


def gpus_now(vendor: str) -> list[GPUInfo]:
    """One vendor's GPUs as its driver reports them now (their free memory changes as
    models load): that vendor's probe alone, never raising. The profile
    :func:`detect_hardware` keeps for the process is not probed again."""
    probe = _GPU_PROBES.get(vendor)
    if probe is None or platform.system() == "Darwin":
        return []
    notes = Notes()
    return list(_guarded(lambda: probe(notes), [], f"{vendor} GPU", notes))


def _guarded(fn: Callable[[], Any], default: Any, what: str, notes: Notes) -> Any:
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
        text = read_text("/etc/os-release") or ""
        m = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', text, re.M)
        base = m.group(1) if m else "Linux"
        return f"{base} (kernel {platform.release()})"
    return platform.version() or platform.release()
