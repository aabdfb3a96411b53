"""``localrun.plan()``: what would run a model on a machine, without downloading or loading.

Steps, each adding to the Plan: (1) the hardware (detected, or a described machine),
(2) the model reference (a local file or folder gives its format, quantization and
size), (3) selection, (4) the Hub: which repo and files, and whether they fit in
memory (:mod:`localrun.hub`, API calls only, no weights). Local models skip step 4.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from localrun import hardware as _hardware
from localrun.hardware import GiB, HardwareProfile
from localrun.memory import gpu_share
from localrun.selection import Plan, PlanRequest, Preference, select

if TYPE_CHECKING:
    from localrun.hub import FetchPlan


def plan(
    model: str | None = None,
    *,
    backend: str = "auto",
    hardware: HardwareProfile | None = None,
    installed: Mapping[str, str] | None = None,
    prefer: Preference = "auto",
    allow_unoptimized: bool = False,
    context: int | None = None,
    quant: str | None = None,
    hub: bool = True,
) -> Plan:
    """Plan engine, format, quantization and device for ``model`` on this (or a described) host.

    ``hardware`` plans for another machine (``HardwareProfile.load("mac16.json")``);
    ``installed`` maps engine name to version (default: the engines installed here).
    For a model that is not on disk, ``hub=True`` adds the Hub step: the repo, the files
    and whether they fit in the device's memory at ``context`` (Hub API calls only,
    no weights are downloaded). Raises FormatMismatchError for an explicit backend that
    cannot run a local model's format, NoSuitableEngineError when no engine can run it.
    """
    from localrun.errors import FormatMismatchError, LocalrunError

    try:
        return plan_fetch(model, backend=backend, hardware=hardware, installed=installed,
                          prefer=prefer, allow_unoptimized=allow_unoptimized, context=context,
                          quant=quant, hub=hub)[0]
    except FormatMismatchError:
        raise
    except LocalrunError as e:
        if not hub:
            raise
        # The engine choice stands without the Hub; say what the Hub step could not do.
        chosen = plan_fetch(model, backend=backend, hardware=hardware, installed=installed,
                            prefer=prefer, allow_unoptimized=allow_unoptimized, hub=False)[0]
        note = f"Hub step skipped: {e.message}" + (f" ({e.hint})" if e.hint else "")
        return replace(chosen, notes=(*chosen.notes, note))


def plan_fetch(
    model: str | None = None,
    *,
    backend: str = "auto",
    hardware: HardwareProfile | None = None,
    installed: Mapping[str, str] | None = None,
    prefer: Preference = "auto",
    allow_unoptimized: bool = False,
    context: int | None = None,
    quant: str | None = None,
    hub: bool = True,
) -> tuple[Plan, FetchPlan | None]:
    """Like :func:`plan`, also returning the Hub's FetchPlan (None for local models)."""
    from localrun.backends import installed_backends

    # Looked up on the module at call time, not bound at import: a binding made while a
    # test had replaced detect_hardware (tests/test_devices.py) outlived that test.
    profile = hardware if hardware is not None else _hardware.detect_hardware()
    engines = dict(installed) if installed is not None else installed_backends()
    request = request_for(model, backend=backend, prefer=prefer,
                          allow_unoptimized=allow_unoptimized, quant=quant)
    chosen = select(profile, engines, request)
    if request.format is not None or not hub or model is None:
        return chosen, None
    return _with_hub(chosen, model, profile, engines, backend, context, quant, allow_unoptimized,
                     request)


def _with_hub(chosen: Plan, model: str, profile: HardwareProfile, engines: Mapping[str, str],
              backend: str, context: int | None, quant: str | None, allow_unoptimized: bool,
              request: PlanRequest) -> tuple[Plan, FetchPlan]:
    from localrun import hub as hubmod
    from localrun.errors import FormatMismatchError, NoVariantError, OfflineMissingError

    def attempt(p: Plan) -> FetchPlan:
        return hubmod.plan_fetch(model, backend=p.backend,
                                 memory_budget_bytes=memory_budget(profile, p.device, p.backend),
                                 context=context, quant=quant, device=p.device.split(":")[0],
                                 allow_unoptimized=allow_unoptimized)

    try:
        fp = attempt(chosen)
    except (NoVariantError, FormatMismatchError, OfflineMissingError) as e:
        if backend != "auto":
            raise
        chosen, fp = _other_engine(e, chosen, profile, engines, model, attempt)
    if chosen.backend == "vllm" and request.weights_bytes is None:
        # Its tensor-parallel group was sized from the parameter count in the name
        # ("Mixtral-8x22B" reads as 22B) or not at all: size it from the Hub's weights.
        sized = select(profile, engines, replace(request, weights_bytes=fp.memory.weights_bytes))
        if sized.backend == "vllm":
            fp = attempt(sized) if sized.device != chosen.device else fp
            chosen = sized
    mem = fp.memory.to_dict()
    mem.update(budget=fp.budget_bytes, context=fp.context, max_context=fp.max_context,
               fits=fp.fits, verdict=fp.verdict)
    filled = replace(
        chosen, repo=fp.repo, quantization=fp.quant or chosen.quantization,
        format=fp.format, files=tuple(f.path for f in fp.files), memory=mem,
        reasons=(*chosen.reasons, *fp.reasons, *_offload_reasons(profile, chosen, fp)),
    )
    return filled, fp


def _offload_reasons(profile: HardwareProfile, chosen: Plan, fp: FetchPlan) -> list[str]:
    """llama.cpp on a GPU too small for the whole model: say that it offloads part."""
    vram = _vram(profile, chosen.device) if chosen.backend == "llama.cpp" else None
    est = fp.memory
    if vram is None or est.total_bytes <= vram:
        return []
    share = gpu_share(est.weights_bytes, est.kv_cache_bytes, vram)
    return [f"the model needs {est.total_bytes / GiB:.1f} GiB with its KV cache, "
            f"{chosen.device} has {vram / GiB:.1f} GiB free: llama.cpp offloads about "
            f"{share:.0%} of its layers to the GPU (computed from the free VRAM at load) "
            "and runs the rest on the CPU"]


def _other_engine(e: Exception, chosen: Plan, profile: HardwareProfile,
                  engines: Mapping[str, str], model: str,
                  attempt: Callable[[Plan], FetchPlan]) -> tuple[Plan, FetchPlan]:
    """Auto mode, when the chosen engine has nothing to run: the next engine that does.

    A repo that is itself a variant decides the format: an engine that runs it natively.
    A model with no variant for this engine (none published, or only stale catalog
    entries): the next installed engine in this host's order that has one, GGUF on
    llama.cpp usually. Offline, with nothing cached for this engine: an engine the same
    name was downloaded for earlier. The plan says what happened in one line.
    """
    from localrun import hub as hubmod
    from localrun.errors import (
        FormatMismatchError,
        LocalrunError,
        NoVariantError,
        OfflineMissingError,
    )

    assert isinstance(e, LocalrunError)
    if isinstance(e, FormatMismatchError):
        order = [b for b in e.native_backends if b != chosen.backend]
    elif isinstance(e, OfflineMissingError):
        pulled = hubmod.pulled_backends(model)
        order = [b for b in _next_engines(profile, engines, chosen.backend) if b in pulled]
    else:
        order = _next_engines(profile, engines, chosen.backend)
    if not order:
        raise e
    for other in order[:4]:  # each try is a Hub search; a handful of engines is plenty
        fallback = replace(chosen, backend=other, device=_device_for(profile, other),
                           format=_native_format(other))
        try:
            fp = attempt(fallback)
        except LocalrunError:
            continue
        note = (f"{e.message}; {model} was downloaded for {other}: using it"
                if isinstance(e, OfflineMissingError) else f"{e.message}; using {other} instead")
        # What the first engine's search passed over (stale catalog entries), then why
        # the engine changed, then the new engine's own plan.
        passed = e.passed_over if isinstance(e, NoVariantError) else ()
        return fallback, replace(fp, reasons=(*passed, note, *fp.reasons))
    raise e


def _next_engines(profile: HardwareProfile, engines: Mapping[str, str],
                  exclude: str) -> list[str]:
    """Installed engines in this host's order (its rules, then the fallbacks) that fit
    its hardware, other than ``exclude``."""
    from localrun.selection import DEVICE_FITS, PlanRequest, candidates

    out: list[str] = []
    for c in candidates(profile):
        if c.backend == exclude or c.backend in out or c.backend not in engines:
            continue
        device, _, _ = DEVICE_FITS[c.device](profile, c, PlanRequest(backend=c.backend))
        if device is not None:
            out.append(c.backend)
    return out


def _native_format(backend: str) -> str:
    from localrun.backends import BACKENDS

    return BACKENDS[backend].formats[0]


def _device_for(profile: HardwareProfile, backend: str) -> str:
    """The device a fallback engine runs on: what selection would give it here."""
    from localrun.backends import installed_backends

    version = installed_backends().get(backend, "assumed")  # the build decides ONNX's device
    plan = select(profile, {backend: version}, PlanRequest(backend=backend))
    return plan.device


#: Share of unified memory a Mac's GPU may wire by default (macOS recommends ~65-75%).
APPLE_GPU_SHARE = 0.70


def _vram(profile: HardwareProfile, device: str) -> int | None:
    """Free VRAM of the plan's CUDA/ROCm GPUs (total where free is unknown)."""
    kind, _, index = device.partition(":")
    if kind not in ("cuda", "rocm"):
        return None
    vendor = "nvidia" if kind == "cuda" else "amd"
    wanted = {int(i) for i in index.split(",") if i.isdigit()} if index else None
    gpus = [g for g in profile.gpus if g.vendor == vendor
            and (wanted is None or g.index in wanted)]
    sizes = [g.memory_free or g.memory_total for g in gpus]
    return sum(s for s in sizes if s) if sizes and all(sizes) else None


def memory_budget(profile: HardwareProfile, device: str, backend: str | None = None
                  ) -> int | None:
    """Bytes the plan's device can give a model: free VRAM, a Mac's GPU share of
    unified memory, or available RAM (after container limits). llama.cpp on a GPU also
    has the RAM: the layers that do not fit in VRAM run on the CPU (partial offload)."""
    ram = profile.ram_available or profile.ram_total
    vram = _vram(profile, device)
    if vram is not None:
        return vram + (ram or 0) if backend == "llama.cpp" else vram
    if device.partition(":")[0] == "metal" and profile.apple is not None:
        return int(profile.apple.unified_memory * APPLE_GPU_SHARE)
    return ram


def request_for(model: str | None, *, backend: str = "auto", prefer: Preference = "auto",
                allow_unoptimized: bool = False, quant: str | None = None) -> PlanRequest:
    """A PlanRequest for a reference: local files are detected; names are left to the Hub
    (the packaged default's name too, when another quant is asked for)."""
    from localrun.formats.detect import detect
    from localrun.refs import default_serves, is_default_name, local_path
    from localrun.stores import DEFAULT_MODEL_ALIAS

    path = local_path(model)
    if path is not None and is_default_name(model) and not default_serves(quant):
        path = None
    if path is None:
        return PlanRequest(model=model, backend=backend, prefer=prefer,
                           allow_unoptimized=allow_unoptimized)
    found = detect(path)
    size = found.details.get("file_size")
    shape = None
    if found.format == "gguf":  # its layers size a partial GPU offload
        from localrun.formats.gguf import read_gguf
        from localrun.memory import shape_from_gguf_metadata

        shape = shape_from_gguf_metadata(read_gguf(found.path).metadata)
    return PlanRequest(
        model=model or DEFAULT_MODEL_ALIAS, backend=backend, format=found.format,
        quantization=found.quantization, architecture=found.architecture,
        weights_bytes=size if isinstance(size, int) else None, prefer=prefer,
        allow_unoptimized=allow_unoptimized, shape=shape,
    )


__all__ = ["memory_budget", "plan", "plan_fetch", "request_for"]
