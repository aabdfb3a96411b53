"""From what the user typed to a model on disk, a format and a backend."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from localrun.backends import BACKENDS, canonical_backend, is_installed
from localrun.errors import EngineNotInstalledError, UnknownModelError
from localrun.formats import compat
from localrun.formats.detect import detect
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
        name = _auto_backend(found.format, display)
    else:
        name = canonical_backend(backend)
    level = compat.check(found.format, name, model=display, allow_unoptimized=allow_unoptimized)
    return Target(found.path, found.format, name, found.quantization, level)


def _auto_backend(format: str, model: str) -> str:
    natives = compat.native_backends(format)
    for name in natives:
        if is_installed(name):
            return name
    if natives:
        spec = BACKENDS[natives[0]]
        raise EngineNotInstalledError(spec.title, spec.extra)
    # No engine runs this format natively: refuse with the engines' own wants.
    return compat.check(format, "llama.cpp", model=model) and "llama.cpp"
