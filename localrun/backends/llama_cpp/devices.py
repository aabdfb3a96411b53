"""Where llama.cpp puts a model: the device words it takes, the GPUs' free VRAM asked
now, and the ``Llama(**kwargs)`` that place it (whole on a GPU, split over several, or
the layers that fit: partial offload)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from localrun.backends.llama_cpp.facts import KV_TYPES, SPEC
from localrun.backends.options import check_options
from localrun.errors import LocalrunError
from localrun.formats.gguf import GGUFInfo
from localrun.memory import Offload, gpu_offload, kv_cache_bytes, shape_from_gguf_metadata

#: Device words llama.cpp takes. Each GPU kind is a llama.cpp build (CUDA, HIP, Vulkan,
#: Metal); "gpu" is whichever the installed build has. ``kind:N`` / ``kind:N,M`` name GPUs
#: in the order the build lists them (CUDA's order for CUDA and HIP builds).
GPU_KINDS = ("cuda", "rocm", "vulkan", "metal", "gpu")
#: GPU kind -> hardware vendor whose free VRAM sizes a partial offload.
VRAM_VENDOR: dict[str, str] = {"cuda": "nvidia", "rocm": "amd"}
DEVICE_HELP = "cpu, gpu, cuda, cuda:N, cuda:N,M, rocm:N, vulkan:N or metal"
_DEVICE = re.compile(rf"^(cpu|{'|'.join(GPU_KINDS)})(?::(\d+(?:,\d+)*))?$")


def default_threads() -> int:
    # llama-cpp-python's own default (cpu_count // 2) leaves half of a small machine
    # idle; on bigger ones half the logical CPUs is about the physical core count.
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return n if n <= 4 else n // 2


def parse_device(device: str | None) -> tuple[str, tuple[int, ...]]:
    """``(kind, GPU indices)`` for a device string; None: "gpu", every layer the build can."""
    if device is None:
        return "gpu", ()
    m = _DEVICE.match(device.strip().lower())
    if m is None:
        raise LocalrunError(f"Unknown device {device!r} for llama.cpp",
                            hint=f"use one of: {DEVICE_HELP}")
    kind, idx = m.group(1), m.group(2)
    if kind in ("cpu", "metal") and idx:
        raise LocalrunError(f"Unknown device {device!r} for llama.cpp",
                            hint=f"{kind} takes no index; use one of: {DEVICE_HELP}")
    return kind, tuple(sorted({int(i) for i in idx.split(",")})) if idx else ()


def free_vram(kind: str, indices: Sequence[int]) -> list[int] | None:
    """Free bytes of each GPU the model goes on, asked now (models loaded since the plan
    was made have taken some); None when unknown (no NVML/sysfs figure, Metal, Vulkan)."""
    vendor = VRAM_VENDOR.get(kind)
    if vendor is None:
        return None
    from localrun.hardware import gpus_now

    # that vendor's driver alone: the machine's profile is probed once per process
    gpus = [g for g in gpus_now(vendor) if not indices or g.index in indices]
    sizes = [g.memory_free for g in sorted(gpus, key=lambda g: g.index)]
    if not gpus or (indices and len(gpus) != len(indices)) or any(s is None for s in sizes):
        return None
    return [int(s) for s in sizes if s is not None]


@dataclass(frozen=True)
class Placement:
    """Where llama.cpp puts a model: the Llama() keyword arguments, and for ModelInfo."""

    kwargs: dict[str, Any]
    device: str  # "cpu", "cuda:0", "gpu", ...
    offload: Offload | None = None  # set when the free VRAM was checked


def placement(device: str | None, options: Mapping[str, Any], gguf: GGUFInfo, n_ctx: int, *,
              flash_attn_type: bool,
              vram: Callable[[str, Sequence[int]], list[int] | None] | None = None
              ) -> Placement:
    """The device and engine options as llama-cpp-python's ``Llama(**kwargs)``.

    ``device="cpu"`` keeps every layer on the CPU; ``cuda:N`` puts the whole model on GPU
    N (split mode none); ``cuda:N,M`` splits layers over those GPUs (by free VRAM); a
    model larger than the free VRAM gets the layers that fit (partial offload). Flash
    attention follows llama-server: "auto" unless told. ``flash_attn_type``: the
    installed Llama takes llama.cpp's tri-state ``flash_attn_type``; 0.3.x takes only a
    bool, where False means disabled, so "auto" is sent as True there (llama.cpp runs
    flash attention on CPU, CUDA, Metal, Vulkan and ROCm).
    """
    opts = check_options(SPEC, options)
    kind, indices = parse_device(device)
    kw: dict[str, Any] = {}
    offload: Offload | None = None
    if kind == "cpu":
        kw["n_gpu_layers"] = 0
    else:
        kw["n_gpu_layers"] = -1
        if len(indices) == 1:
            kw["split_mode"], kw["main_gpu"] = "LLAMA_SPLIT_MODE_NONE", indices[0]
        elif len(indices) > 1:
            kw["split_mode"] = "LLAMA_SPLIT_MODE_LAYER"
        free = (vram or free_vram)(kind, indices)
        if len(indices) > 1 and "tensor_split" not in opts:
            share: dict[int, float] = dict(zip(indices, map(float, free), strict=True)) \
                if free else dict.fromkeys(indices, 1.0)
            kw["tensor_split"] = [float(share.get(i, 0.0)) for i in range(max(indices) + 1)]
        shape = shape_from_gguf_metadata(gguf.metadata)
        if free and shape is not None and "n_gpu_layers" not in opts:
            kv_type = str(opts.get("kv_cache", "f16"))
            kv = int(kv_cache_bytes(shape, n_ctx, 1) * KV_TYPES[kv_type][1])
            offload = gpu_offload(gguf.tensor_bytes or gguf.file_size, shape.n_layers, kv,
                                  sum(free))
            if not offload.full:
                kw["n_gpu_layers"] = offload.layers
    flash = opts.pop("flash_attn", "auto")
    if "kv_cache" in opts:
        kv_type = str(opts.pop("kv_cache"))
        if kv_type != "f16" and flash is False:
            raise LocalrunError(f"kv_cache={kv_type!r} needs flash attention (llama.cpp cannot "
                                "build a quantized V cache without it)",
                                hint="leave flash_attn at 'auto', or use kv_cache='f16'")
        kw["type_k"] = kw["type_v"] = KV_TYPES[kv_type][0]
    if flash_attn_type:
        kw["flash_attn_type"] = {"auto": "LLAMA_FLASH_ATTN_TYPE_AUTO",
                                 True: "LLAMA_FLASH_ATTN_TYPE_ENABLED",
                                 False: "LLAMA_FLASH_ATTN_TYPE_DISABLED"}[flash]
    else:
        kw["flash_attn"] = flash is not False
    kw.update(opts)
    label = kind + (":" + ",".join(map(str, indices)) if indices else "")
    if kw["n_gpu_layers"] == 0:
        label = "cpu"
    elif offload is not None and not offload.full:
        label += f" ({offload.layers}/{offload.total} layers; the rest on cpu)"
    return Placement(kw, label, offload)


def engine_constants(lc: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Replace the names of llama.cpp enum values (kept readable above) with their values."""
    return {k: getattr(lc, v) if isinstance(v, str) and v.startswith(("LLAMA_", "GGML_"))
            else v for k, v in kwargs.items()}
