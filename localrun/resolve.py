"""From what the user typed to a model on disk, a format and a backend."""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass
from pathlib import Path

from localrun.backends import BACKENDS, canonical_backend, installed_backends
from localrun.errors import EngineNotInstalledError, UnknownModelError, UnoptimizedFormatWarning
from localrun.formats import compat
from localrun.formats.detect import DetectedModel, detect
from localrun.stores import DEFAULT_MODEL_ALIAS, default_model_path

#: Names that mean the packaged default model.
DEFAULT_NAMES = (DEFAULT_MODEL_ALIAS, "smollm2", "smollm2:135m-instruct", "default")


@dataclass(frozen=True)
class Target:
    path: str
    format: str
    backend: str
    quantization: str | None
    support: str  # "native" or "loads"


def _local_path(ref: str | None) -> Path | None:
    if ref is None or ref.strip().lower() in DEFAULT_NAMES:
        return default_model_path()
    p = Path(ref).expanduser()
    if p.exists():
        return p
    return None


def known_names() -> list[str]:
    return list(DEFAULT_NAMES)


def resolve_local(
    model: str | None, *, backend: str = "auto", allow_unoptimized: bool = False
) -> Target:
    """Resolve a reference to a local model and the backend that will run it."""
    path = _local_path(model)
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
    if backend == "auto":
        name = _auto_backend(found, display, allow_unoptimized)
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
    return Target(found.path, found.format, name, found.quantization, level)


def _auto_backend(found: DetectedModel, model: str, allow_unoptimized: bool) -> str:
    """This host's best installed engine that runs the model's format natively."""
    from localrun.hardware import detect_hardware
    from localrun.selection import PlanRequest, select

    size = found.details.get("file_size")
    plan = select(detect_hardware(), installed_backends(), PlanRequest(
        model=model, format=found.format, quantization=found.quantization,
        architecture=found.architecture, weights_bytes=size if isinstance(size, int) else None,
        allow_unoptimized=allow_unoptimized))
    if not plan.installed:
        spec = BACKENDS[plan.backend]
        raise EngineNotInstalledError(spec.title, spec.extra)
    return plan.backend
