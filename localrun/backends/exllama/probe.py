"""What a load needs from the host: a GPU the engine has kernels for, and its free VRAM,
found before the engine (which builds its CUDA extension on import) is imported."""

from __future__ import annotations

from typing import Any

from localrun.backends.exllama.errors import no_gpu_error
from localrun.backends.exllama.facts import SPECS
from localrun.backends.installed import missing
from localrun.hardware import GPUInfo, HardwareProfile

#: GPU vendors each engine has kernels for (both build for CUDA and ROCm).
ENGINE_VENDORS: dict[str, tuple[str, ...]] = {
    "exllamav2": ("nvidia", "amd"), "exllamav3": ("nvidia", "amd"),
}


def detected_gpus(engine: str, profile: HardwareProfile | None = None) -> list[GPUInfo]:
    """The GPUs this host has that the engine has kernels for (NVML / nvidia-smi / sysfs)."""
    if profile is None:
        from localrun.hardware import detect_hardware

        profile = detect_hardware()
    return [g for g in profile.gpus if g.vendor in ENGINE_VENDORS.get(engine, ("nvidia",))
            and not g.integrated]


def probe_cuda(engine: str, profile: HardwareProfile | None = None) -> list[int]:
    """Free bytes of each CUDA device torch sees, or raise before the engine is imported.

    A host where neither NVML, ``nvidia-smi`` nor sysfs shows a GPU and no torch is
    installed is refused at once: importing the engine there would try to build its
    CUDA extension first. Otherwise torch decides (``torch.cuda.is_available()``), and
    ``torch.cuda.mem_get_info`` gives the free memory right now.
    """
    import importlib
    import importlib.util

    gpus = detected_gpus(engine, profile)
    if not gpus and importlib.util.find_spec("torch") is None:
        raise no_gpu_error(engine, "no GPU was found on this host (NVML, nvidia-smi and sysfs "
                           "show none)")
    try:
        torch: Any = importlib.import_module("torch")
    except ImportError as e:
        raise missing(SPECS[engine], reason=f"torch is missing ({e})") from e
    if not torch.cuda.is_available():
        detail = ("torch sees no CUDA device (a CPU-only torch build, or the driver is not "
                  "loaded)") if gpus else "no GPU was found on this host"
        raise no_gpu_error(engine, detail)
    return [int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())]
