"""GPUs and NPUs: NVIDIA through NVML or nvidia-smi, AMD through ROCm's kfd topology,
Intel GPUs and NPUs from sysfs, and OpenVINO's device list when asked for."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from localrun.hardware.profile import GiB, GPUInfo, GPUVendor, MiB, NPUInfo
from localrun.hardware.system import Notes, read_text, run_command, to_int

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


# -- NVIDIA ---------------------------------------------------------------------------


def probe_nvidia(notes: Notes) -> list[GPUInfo]:
    gpus = probe_nvml(notes)
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
    if gpus and read_text("/sys/devices/soc0/family") == "Tegra":
        # Jetson: the GPU shares system RAM; budget from RAM, not from a VRAM figure.
        gpus = [dataclasses.replace(g, integrated=True, memory_total=None, memory_free=None)
                for g in gpus]
        notes.add("NVIDIA Tegra/Jetson: the GPU uses unified memory (sized from RAM)")
    return gpus


def probe_nvml(notes: Notes) -> list[GPUInfo] | None:
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


def _probe_nvidia_smi(notes: Notes) -> list[GPUInfo]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    fields = list(_NVIDIA_SMI_FIELDS)
    for _ in range(2):
        out = run_command([exe, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"])
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
        out.append(GPUInfo("nvidia", name, to_int(row.get("index")) or len(out),
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


def probe_amd_kfd(notes: Notes) -> list[GPUInfo]:
    if not KFD_NODES.is_dir():
        return []
    gpus: list[GPUInfo] = []
    for node in sorted(KFD_NODES.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
        props = _props(read_text(node / "properties") or "")
        version = props.get("gfx_target_version", 0)
        if not version:
            continue  # a CPU node
        dev = DRM / f"renderD{props.get('drm_render_minor', -1)}" / "device"
        vram = to_int(read_text(dev / "mem_info_vram_total"))
        used = to_int(read_text(dev / "mem_info_vram_used"))
        gtt = to_int(read_text(dev / "mem_info_gtt_total"))
        name = read_text(dev / "product_name") or f"AMD GPU {gfx_target(version)}"
        integrated = bool(vram is not None and vram <= 4 * GiB and gtt and gtt >= 4 * vram)
        gpus.append(GPUInfo("amd", name, len(gpus), vram,
                            (vram - used) if vram is not None and used is not None else None,
                            driver="amdgpu", integrated=integrated,
                            arch_target=gfx_target(version), source="kfd"))
    if not gpus and KFD_NODES.is_dir():
        notes.add("ROCm kfd present but lists no GPU nodes")
    return gpus


def _pci_id(dev: Path) -> tuple[str | None, int | None]:
    vendor = (read_text(dev / "vendor") or "").lower() or None
    device = read_text(dev / "device")
    try:
        return vendor, int(device, 16) if device else None
    except ValueError:
        return vendor, None


def _driver(dev: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(dev / "driver"))
    except OSError:
        return None


def probe_pci(known: list[GPUInfo], notes: Notes) -> tuple[list[GPUInfo], list[NPUInfo]]:
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


def probe_openvino(gpus: list[GPUInfo], npus: list[NPUInfo],
                    notes: Notes) -> tuple[list[GPUInfo], list[NPUInfo]]:
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
