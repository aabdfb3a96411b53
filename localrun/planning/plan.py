"""``localrun.plan()``: what would run a model on a machine, without downloading or loading.

Steps, each adding to the Plan: (1) the hardware (detected, or a described machine),
(2) the model reference (a local file or folder gives its format, quantization and
size), (3) selection, (4) the Hub: which repo and files, and whether they fit in
memory (:mod:`localrun.hub`, API calls only, no weights). Local models skip step 4: their
memory is estimated from their own files. Without the Hub (offline, unreachable), the
memory is estimated from what is known here: files an earlier download of the same name
left in the cache, else the parameter count the catalog or the name gives, at the
planned quantization; the plan says which.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from localrun import hardware as _hardware
from localrun import memory
from localrun.hardware import GiB, HardwareProfile
from localrun.memory import MemoryEstimate, ModelShape, gpu_share
from localrun.planning.selection import Plan, PlanRequest, Preference, select

if TYPE_CHECKING:
    from localrun.adapters import Adapter
    from localrun.errors import LocalrunError
    from localrun.formats.detect import DetectedModel
    from localrun.hub import Download


@dataclass(frozen=True)
class Planned:
    """What planning found for one model: the plan (engine, format, quant, device and
    why); the Hub's choice of files, where the model is not on disk (None otherwise, or
    without the Hub step); the memory estimate the fit was judged on; and, for a model
    on disk, what detection read from its files."""

    plan: Plan
    download: Download | None = None
    estimate: MemoryEstimate | None = None
    found: DetectedModel | None = None


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
    device: str | None = None,
    adapters: Sequence[Adapter | str | os.PathLike[str]] | None = None,
) -> Plan:
    """Plan engine, format, quantization and device for ``model`` on this (or a described) host.

    ``hardware`` plans for another machine (``HardwareProfile.find("mac-m2-16gb")``, or
    ``.load(path)`` of what ``localrun doctor --json`` wrote);
    ``installed`` maps engine name to version (default: the engines installed here).
    For a model that is not on disk, ``hub=True`` adds the Hub step: the repo, the files
    and whether they fit in the device's memory at ``context`` (Hub API calls only,
    no weights are downloaded); when the Hub cannot be reached, an estimate from what is
    known here (``memory["estimated_from"]`` says what). A model on disk is sized from
    its own files. ``device`` plans for that device (``"cpu"`` on a GPU host: a CPU
    engine and its quant), as ``load(device=)`` loads. Raises FormatMismatchError for an
    explicit backend that cannot run a local model's format, NoSuitableEngineError when
    no engine can run it.
    ``adapters`` (a preset's, unless given): LoRA adapters counted in the memory estimate
    (their files' bytes).
    """
    from localrun.errors import (
        FormatMismatchError,
        HubUnavailableError,
        LocalrunError,
        OfflineMissingError,
    )
    from localrun.naming.presets import lookup

    preset = lookup(model) if backend.strip().lower() != "remote" else None
    if preset is not None:  # a preset plans its model, engine and context
        model, backend, context, allow_unoptimized = preset.load_args(
            backend, context, allow_unoptimized)
        if adapters is None:
            adapters = preset.adapters
    if adapters:
        from localrun.adapters import normalize

        lora = normalize(adapters)
        return with_adapters(plan(model, backend=backend, hardware=hardware,
                                   installed=installed, prefer=prefer,
                                   allow_unoptimized=allow_unoptimized, context=context,
                                   quant=quant, hub=hub, device=device, adapters=()), lora)
    try:
        return with_images(with_draft(plan_model(
            model, backend=backend, hardware=hardware, installed=installed, prefer=prefer,
            allow_unoptimized=allow_unoptimized, context=context, quant=quant, hub=hub,
            device=device).plan, model, context), model)
    except FormatMismatchError:
        raise
    except LocalrunError as e:
        if not hub:
            raise
        # The engine choice stands without the Hub; say what the Hub step could not do,
        # and, when the Hub could not be asked, size the model from what is known here.
        chosen = plan_model(model, backend=backend, hardware=hardware, installed=installed,
                            prefer=prefer, allow_unoptimized=allow_unoptimized, hub=False,
                            device=device).plan
        chosen = replace(chosen, notes=(*chosen.notes,
                                        _hub_skipped(e, chosen, hardware is not None)))
        if model is None or not isinstance(e, (OfflineMissingError, HubUnavailableError)):
            return chosen  # the Hub answered (no variant, gated, ...): nothing to size
        basis = _offline_basis(model, chosen.format, quant or chosen.quantization)
        if basis is None:
            return replace(chosen, notes=(*chosen.notes, (
                f"memory not estimated: nothing here says how large {model} is (no earlier "
                "download of it in the cache, no parameter count in the catalog or the "
                "name)")))
        profile = hardware if hardware is not None else _hardware.detect_hardware()
        return with_draft(_with_estimate(chosen, basis, profile, context)[0], model,
                          context)


def with_draft(p: Plan, model: str | None, context: int | None) -> Plan:
    """``p`` with the catalog's draft model for its family (speculative decoding), where
    the engine drafts with one: its alias and its memory at the plan's format, quant and
    context (sized as an offline plan sizes a model)."""
    from localrun.backends.speculative import supports
    from localrun.errors import LocalrunError
    from localrun.naming.refs import parse_ref

    if model is None or not supports(p.backend, "draft"):
        return p
    try:
        entry = parse_ref(model).entry
    except LocalrunError:
        return p
    if entry is None or entry.draft is None:
        return p
    draft: dict[str, object] = {"model": entry.draft, "memory": None}
    basis = _offline_basis(entry.draft, p.format, p.quantization)
    if basis is not None:
        trained = basis.shape.trained_context if basis.shape else None
        from localrun.backends import engine_memory

        est = memory.estimate(basis.weights_bytes, basis.shape,
                              memory.context_window(context, trained),
                              engine=engine_memory(p.backend, p.device))
        draft["memory"] = {**est.to_dict(), "estimated_from": basis.source}
    return replace(p, draft=draft)


def with_images(p: Plan, model: str | None) -> Plan:
    """``p`` with its vision part, where the model has one: the projector (a GGUF's
    ``mmproj`` beside it or among the Hub files planned; an OpenVINO VLM folder's vision
    model) and the image-token budget, per image (the ``image_tokens`` engine option's
    default) and per request (at most :data:`localrun.images.MAX_IMAGES` images, each
    counted against the context)."""
    from localrun.formats.projector import MMPROJ, OPENVINO_VLM_FILES, projector_beside
    from localrun.images import DEFAULT_IMAGE_TOKENS, MAX_IMAGES

    projector: str | None = None
    size: int | None = None
    local = Path(model).expanduser() if model else None
    if local is not None and local.is_file() and local.suffix.lower() == ".gguf":
        found = projector_beside(local)
        if found is not None:
            projector, size = found.name, found.stat().st_size
    elif local is not None and local.is_dir():
        if all((local / f).is_file() for f in OPENVINO_VLM_FILES):
            projector = OPENVINO_VLM_FILES[-1]
        for gguf in sorted(local.glob("*.gguf")):
            found = None if MMPROJ.search(gguf.name) else projector_beside(gguf)
            if found is not None:
                projector, size = found.name, found.stat().st_size
                break
    elif p.files:
        projector = next((f for f in p.files if MMPROJ.search(f)), None)
    if projector is None:
        return p
    return replace(p, images={
        "projector": projector, "projector_bytes": size,
        "tokens_per_image": DEFAULT_IMAGE_TOKENS, "images_per_request": MAX_IMAGES,
        "tokens_per_request": DEFAULT_IMAGE_TOKENS * MAX_IMAGES})


def with_adapters(chosen: Plan, adapters: Sequence[Adapter]) -> Plan:
    """``chosen`` with its LoRA adapters' bytes in its memory estimate and verdict."""
    from localrun.adapters import adapters_bytes, for_engine

    for_engine(adapters, chosen.backend)  # an engine that loads none refuses them here
    n = adapters_bytes(adapters)
    mem = chosen.memory
    if not n or not mem:
        return chosen
    est = MemoryEstimate(int(mem["weights_bytes"]), int(mem["kv_cache_bytes"]),
                         int(mem["overhead_bytes"]), int(mem["context"]),
                         bool(mem.get("kv_known", True)), adapter_bytes=n)
    out = {**mem, **est.to_dict()}
    budget = mem.get("budget")
    if isinstance(budget, int):
        out.update(fits=est.total_bytes <= budget,
                   verdict=memory.verdict(est, budget, mem.get("max_context")))
    return replace(chosen, memory=out, notes=(
        *chosen.notes, f"{len(adapters)} LoRA adapter(s) counted: {n / 2**20:.1f} MiB"))


def _hub_skipped(e: LocalrunError, chosen: Plan, described: bool) -> str:
    """The plan's note for a Hub step that failed: what happened, and what would let it
    run. Offline, "run localrun pull first" would be circular (a pull needs the Hub too)
    and, for a described machine, wrong (a pull plans for this one)."""
    from localrun.errors import HubUnavailableError, OfflineMissingError

    if not isinstance(e, (OfflineMissingError, HubUnavailableError)):
        return f"Hub step skipped: {e.message}" + (f" ({e.hint})" if e.hint else "")
    what = (f"the repo and files for {chosen.backend} on the described machine"
            if described else f"the repo and files for {chosen.backend}")
    reach = ("unset HF_HUB_OFFLINE" if isinstance(e, OfflineMissingError)
             and "HF_HUB_OFFLINE" in e.reason else "connect to the Hub")
    return (f"Hub step skipped: {e.message}. Listing {what} needs the Hub: {reach}, or set "
            "HF_ENDPOINT=URL to use a mirror or proxy of it, and plan again")


def plan_model(
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
    device: str | None = None,
    memory_budget_bytes: int | None = None,
    found: DetectedModel | None = None,
) -> Planned:
    """Like :func:`plan`, with what the plan rests on: the Hub's Download (None for a
    model on disk), the memory estimate, what detection read (``found``: already read by
    the caller). ``memory_budget_bytes`` replaces the device's free memory in the fit."""
    from localrun.backends import installed_backends

    # Looked up on the module at call time, not bound at import: a binding made while a
    # test had replaced detect_hardware (tests/test_devices.py) outlived that test.
    profile = hardware if hardware is not None else _hardware.detect_hardware()
    engines = dict(installed) if installed is not None else installed_backends()
    request, found = request_for(model, backend=backend, prefer=prefer,
                                 allow_unoptimized=allow_unoptimized, quant=quant,
                                 device=device, found=found)
    chosen = select(profile, engines, request)
    if found is not None:  # a model on disk: its own files size it
        basis = _local_basis(found, request.shape)
        if basis is None:
            return Planned(chosen, found=found)
        sized, est = _with_estimate(chosen, basis, profile, context, memory_budget_bytes)
        return Planned(sized, estimate=est, found=found)
    if not hub or model is None:
        return Planned(chosen)
    planned, download = _with_hub(chosen, model, profile, engines, backend, context, quant,
                                  allow_unoptimized, request, memory_budget_bytes)
    return Planned(planned, download, download.memory)


def _with_hub(chosen: Plan, model: str, profile: HardwareProfile, engines: Mapping[str, str],
              backend: str, context: int | None, quant: str | None, allow_unoptimized: bool,
              request: PlanRequest, budget: int | None) -> tuple[Plan, Download]:
    from localrun import hub as hubmod
    from localrun.errors import FormatMismatchError, NoVariantError, OfflineMissingError

    def attempt(p: Plan) -> Download:
        return hubmod.plan_fetch(
            model, backend=p.backend, context=context, quant=quant,
            memory_budget_bytes=budget if budget is not None
            else memory_budget(profile, p.device, p.backend),
            device=p.device.split(":")[0], allow_unoptimized=allow_unoptimized)

    try:
        fp = attempt(chosen)
    except (NoVariantError, FormatMismatchError, OfflineMissingError) as e:
        if backend != "auto":
            raise
        chosen, fp = _other_engine(e, chosen, profile, engines, model, attempt,
                                   request.device)
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
        reasons=(*chosen.reasons, *fp.reasons, *_offload_reasons(profile, chosen, fp.memory)),
    )
    return filled, fp


def _offload_reasons(profile: HardwareProfile, chosen: Plan,
                     est: MemoryEstimate) -> list[str]:
    """llama.cpp on a GPU too small for the whole model: say that it offloads part."""
    vram = _vram(profile, chosen.device) if chosen.backend == "llama.cpp" else None
    if vram is None or est.total_bytes <= vram:
        return []
    share = gpu_share(est.weights_bytes, est.kv_cache_bytes, vram)
    return [f"the model needs {est.total_bytes / GiB:.1f} GiB with its KV cache, "
            f"{chosen.device} has {vram / GiB:.1f} GiB free: llama.cpp offloads about "
            f"{share:.0%} of its layers to the GPU (computed from the free VRAM at load) "
            "and runs the rest on the CPU"]


def _other_engine(e: Exception, chosen: Plan, profile: HardwareProfile,
                  engines: Mapping[str, str], model: str,
                  attempt: Callable[[Plan], Download],
                  device: str | None) -> tuple[Plan, Download]:
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
        order = [b for b in _next_engines(profile, engines, chosen.backend, device)
                 if b in pulled]
    else:
        order = _next_engines(profile, engines, chosen.backend, device)
    if not order:
        raise e
    for other in order[:4]:  # each try is a Hub search; a handful of engines is plenty
        fallback = replace(chosen, backend=other, device=_device_for(profile, other, device),
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
                  exclude: str, device: str | None) -> list[str]:
    """Installed engines in this host's order (its rules, then the fallbacks) that fit
    its hardware (on ``device``, where one was asked for), other than ``exclude``."""
    from localrun.planning.hosts import on_asked_device
    from localrun.planning.selection import DEVICE_FITS, PlanRequest, candidates

    out: list[str] = []
    for c in candidates(profile):
        if c.backend == exclude or c.backend in out or c.backend not in engines:
            continue
        req = PlanRequest(backend=c.backend, device=device)
        fits, _, _ = on_asked_device(profile, c, req, DEVICE_FITS[c.device](profile, c, req))
        if fits is not None:
            out.append(c.backend)
    return out


def _native_format(backend: str) -> str:
    from localrun.backends import BACKENDS

    return BACKENDS[backend].formats[0]


def _device_for(profile: HardwareProfile, backend: str, device: str | None) -> str:
    """The device a fallback engine runs on: what selection would give it here."""
    from localrun.backends import installed_backends

    version = installed_backends().get(backend, "assumed")  # the build decides ONNX's device
    plan = select(profile, {backend: version}, PlanRequest(backend=backend, device=device))
    return plan.device


# --- memory without the Hub ------------------------------------------------------------

@dataclass(frozen=True)
class _Basis:
    """What an estimate rests on: the weights' bytes, the shape (None: the KV cache is
    unknown), and where both came from, in words."""

    weights_bytes: int
    shape: ModelShape | None
    source: str


def _local_basis(found: DetectedModel, shape: ModelShape | None) -> _Basis | None:
    """A model on disk: the sizes of its weight files and the shape its GGUF header or
    config.json gives (:func:`memory.local_size`, as :func:`memory.local_estimate`;
    ``shape``: its GGUF header's, read already)."""
    path = Path(found.path)
    try:
        size = memory.local_size(path) if shape is None else \
            memory.LocalSize(memory.local_weights_bytes(path), shape, "GGUF header")
    except OSError:
        return None
    shape_note = f"the shape in its {size.shape_from}" if size.shape is not None \
        else "no shape (KV cache unknown)"
    return _Basis(size.weights_bytes, size.shape, f"the files of {path}: weights "
                  f"{size.weights_bytes / GiB:.2f} GiB, {shape_note}")


#: A number of bits in a quantization's name: 4.0bpw, 4bit, int4, bf16, 6_5 (EXL2 branch).
_BITS = re.compile(r"(\d+(?:[._]\d+)?)")


def bits_per_weight(quant: str | None, fmt: str) -> float | None:
    """Bits per weight of a quantization by its name (GGUF by its type), else the
    format's default target (None where that is "the largest that fits")."""
    from localrun.hub.fit import DEFAULT_TARGET
    from localrun.hub.variants import GGUF_BPW

    if quant:
        known = {k.lower(): v for k, v in GGUF_BPW.items()}.get(quant.lower())
        if known is not None:
            return known
        if fmt != "gguf" and (m := _BITS.search(quant)):
            return float(m.group(1).replace("_", "."))
    target = DEFAULT_TARGET.get(fmt)
    return target if target is not None and target != float("inf") else None


def _offline_basis(model: str, fmt: str, quant: str | None) -> _Basis | None:
    """Without the Hub: the parameter count and shape read from what an earlier download
    of ``model`` left in the cache (any engine), else the parameter count the catalog or
    the name gives; the weights at ``quant`` in ``fmt``."""
    from localrun.hub.fit import pulled_paths
    from localrun.hub.variants import model_size
    from localrun.naming.refs import parse_ref

    bpw = bits_per_weight(quant, fmt)
    if bpw is None:
        return None
    params: float | None = None
    counted = ""
    shape: ModelShape | None = None
    shaped = "KV cache not counted (the model's shape needs its config.json or GGUF header)"
    for path in pulled_paths(model):
        try:
            n = memory.local_parameters(path)
            found, where = memory.local_shape(path)
        except OSError:
            continue
        if n and params is None:
            params, counted = float(n), (f"{_size(n / 1e9)} parameters counted in "
                                         f"{path.name} (downloaded earlier)")
        if found is not None and shape is None:
            shape, shaped = found, f"the KV cache from the shape in the {where} of {path.name}"
    if params is None:
        ref = parse_ref(model)
        entry = ref.entry
        if entry is not None and entry.params_b:
            params = entry.params_b * 1e9
            counted = f"the catalog's parameter count ({_size(entry.params_b)})"
        else:
            names = [n for n in (entry.base if entry else None, ref.repo, ref.alias) if n]
            size = next((s for s in map(model_size, names) if s is not None), None)
            if size is None:
                return None
            params, counted = size * 1e9, f"the parameter count in its name ({_size(size)})"
    weights = memory.weights_at(params, bpw)
    label = quant or f"{bpw:g} bits"
    return _Basis(weights, shape, f"{counted} at {label} ({bpw:g} bits per weight): weights "
                  f"{weights / GiB:.1f} GiB; {shaped}")


def _size(billions: float) -> str:
    """135M, 1.5B, 72B."""
    return f"{billions * 1000:.3g}M" if billions < 1 else f"{billions:.3g}B"


def _with_estimate(chosen: Plan, basis: _Basis, profile: HardwareProfile,
                   context: int | None, budget: int | None = None
                   ) -> tuple[Plan, MemoryEstimate]:
    """``chosen`` with the memory ``basis`` needs at the context the engine loads, on
    its device, and whether that fits (in ``budget``, else the device's free memory)."""
    from localrun.backends import engine_memory

    if budget is None:
        budget = memory_budget(profile, chosen.device, chosen.backend)
    f = memory.fit(basis.weights_bytes, basis.shape, context, budget,
                   engine=engine_memory(chosen.backend, chosen.device))
    mem = f.estimate.to_dict()
    mem.update(budget=budget, context=f.context, max_context=f.max_context, fits=f.fits,
               verdict=memory.verdict(f.estimate, budget, f.max_context),
               estimated_from=basis.source)
    return replace(chosen, memory=mem, reasons=(
        *chosen.reasons, *_offload_reasons(profile, chosen, f.estimate))), f.estimate


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
                allow_unoptimized: bool = False, quant: str | None = None,
                device: str | None = None, found: DetectedModel | None = None
                ) -> tuple[PlanRequest, DetectedModel | None]:
    """A PlanRequest for a reference, and what detection read of a model on disk (None for
    a name, left to the Hub: the packaged default's name too, when another quant is asked
    for). ``found``: the model's files, detected by the caller already."""
    from localrun.formats.detect import detect
    from localrun.naming.refs import default_serves, is_default_name, local_path
    from localrun.naming.stores import DEFAULT_MODEL_ALIAS

    if found is None:
        path = local_path(model)
        if path is not None and is_default_name(model) and not default_serves(quant):
            path = None
        if path is None:
            return PlanRequest(model=model, backend=backend, prefer=prefer,
                               allow_unoptimized=allow_unoptimized, device=device), None
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
        allow_unoptimized=allow_unoptimized, shape=shape, device=device,
    ), found


__all__ = ["Planned", "memory_budget", "plan", "plan_model", "request_for"]
