"""``localrun.plan()``: what would run a model on a machine, without downloading or loading.

Steps, each adding to the Plan: (1) the hardware (detected, or a described machine),
(2) the model reference (a local file or folder gives its format, quantization and
size), (3) selection, (4) the Hub: which repo and files, and whether they fit in
memory. Step 4 belongs to the Hub/fetch module; until it exists a plan for a
name that is not on disk has ``repo``/``files``/``memory`` left as None.
"""

from __future__ import annotations

from collections.abc import Mapping

from localrun.hardware import HardwareProfile, detect_hardware
from localrun.selection import Plan, PlanRequest, Preference, select


def plan(
    model: str | None = None,
    *,
    backend: str = "auto",
    hardware: HardwareProfile | None = None,
    installed: Mapping[str, str] | None = None,
    prefer: Preference = "auto",
    allow_unoptimized: bool = False,
) -> Plan:
    """Plan engine, format, quantization and device for ``model`` on this (or a described) host.

    ``hardware`` plans for another machine (``HardwareProfile.load("mac16.json")``);
    ``installed`` maps engine name to version (default: the engines installed here).
    Raises FormatMismatchError for an explicit backend that cannot run a local model's
    format, NoSuitableEngineError when no engine can run it on the host.
    """
    from localrun.backends import installed_backends

    profile = hardware if hardware is not None else detect_hardware()
    engines = dict(installed) if installed is not None else installed_backends()
    request = request_for(model, backend=backend, prefer=prefer,
                          allow_unoptimized=allow_unoptimized)
    return select(profile, engines, request)


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


__all__ = ["plan", "request_for"]
