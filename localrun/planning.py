"""``localrun.plan()``: what would run a model on a machine, without downloading or loading.

Steps, each adding to the Plan: (1) the hardware (detected, or a described machine),
(2) the model reference (a local file or folder gives its format, quantization and
size), (3) selection, (4) the Hub: which repo and files, and whether they fit in
memory (:mod:`localrun.hub`, API calls only, no weights). Local models skip step 4.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from localrun.hardware import HardwareProfile, detect_hardware
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

    profile = hardware if hardware is not None else detect_hardware()
    engines = dict(installed) if installed is not None else installed_backends()
    request = request_for(model, backend=backend, prefer=prefer,
                          allow_unoptimized=allow_unoptimized)
    chosen = select(profile, engines, request)
    if request.format is not None or not hub or model is None:
        return chosen, None
    return _with_hub(chosen, model, profile, backend, context, quant, allow_unoptimized)


def _with_hub(chosen: Plan, model: str, profile: HardwareProfile, backend: str,
              context: int | None, quant: str | None, allow_unoptimized: bool
              ) -> tuple[Plan, FetchPlan]:
    from localrun import hub as hubmod
    from localrun.errors import FormatMismatchError, NoVariantError

    def attempt(p: Plan) -> FetchPlan:
        return hubmod.plan_fetch(model, backend=p.backend,
                                 memory_budget_bytes=memory_budget(profile, p.device),
                                 context=context, quant=quant, device=p.device.split(":")[0],
                                 allow_unoptimized=allow_unoptimized)

    try:
        fp = attempt(chosen)
    except (NoVariantError, FormatMismatchError) as e:
        if backend != "auto":
            raise
        # Auto mode. A repo that is itself a variant decides the format: use an engine
        # that runs it natively. A model with no variant for this host's engine falls
        # back to GGUF on llama.cpp, which nearly every model is published for.
        natives = e.native_backends if isinstance(e, FormatMismatchError) else ["llama.cpp"]
        other = next((b for b in natives if b != chosen.backend), None)
        if other is None:
            raise
        fallback = replace(chosen, backend=other, device=_device_for(profile, other),
                           format=_native_format(other),
                           reasons=(*chosen.reasons, f"{e.message}; using {other} instead"))
        fp = attempt(fallback)
        chosen = fallback
    mem = fp.memory.to_dict()
    mem.update(budget=fp.budget_bytes, context=fp.context, max_context=fp.max_context,
               fits=fp.fits, verdict=fp.verdict)
    filled = replace(
        chosen, repo=fp.repo, quantization=fp.quant or chosen.quantization,
        format=fp.format, files=tuple(f.path for f in fp.files), memory=mem,
        reasons=(*chosen.reasons, *fp.reasons),
    )
    return filled, fp


def _native_format(backend: str) -> str:
    from localrun.backends import BACKENDS

    return BACKENDS[backend].formats[0]


def _device_for(profile: HardwareProfile, backend: str) -> str:
    """The device a fallback engine runs on: what selection would give it here."""
    plan = select(profile, {backend: "assumed"}, PlanRequest(backend=backend))
    return plan.device


#: Share of unified memory a Mac's GPU may wire by default (macOS recommends ~65-75%).
APPLE_GPU_SHARE = 0.70


def memory_budget(profile: HardwareProfile, device: str) -> int | None:
    """Bytes the plan's device can give a model: free VRAM, a Mac's GPU share of
    unified memory, or available RAM (after container limits)."""
    kind, _, index = device.partition(":")
    if kind in ("cuda", "rocm"):
        vendor = "nvidia" if kind == "cuda" else "amd"
        wanted = {int(i) for i in index.split(",") if i.isdigit()} if index else None
        gpus = [g for g in profile.gpus if g.vendor == vendor
                and (wanted is None or g.index in wanted)]
        sizes = [g.memory_free or g.memory_total for g in gpus]
        if sizes and all(sizes):
            return sum(s for s in sizes if s)
    if kind == "metal" and profile.apple is not None:
        return int(profile.apple.unified_memory * APPLE_GPU_SHARE)
    return profile.ram_available or profile.ram_total


def request_for(model: str | None, *, backend: str = "auto", prefer: Preference = "auto",
                allow_unoptimized: bool = False) -> PlanRequest:
    """A PlanRequest for a reference: local files are detected; names are left to the Hub."""
    from localrun.formats.detect import detect
    from localrun.resolve import _local_path
    from localrun.stores import DEFAULT_MODEL_ALIAS

    path = _local_path(model)
    if path is None:
        return PlanRequest(model=model, backend=backend, prefer=prefer,
                           allow_unoptimized=allow_unoptimized)
    found = detect(path)
    size = found.details.get("file_size")
    return PlanRequest(
        model=model or DEFAULT_MODEL_ALIAS, backend=backend, format=found.format,
        quantization=found.quantization, architecture=found.architecture,
        weights_bytes=size if isinstance(size, int) else None, prefer=prefer,
        allow_unoptimized=allow_unoptimized,
    )


__all__ = ["memory_budget", "plan", "plan_fetch", "request_for"]
