"""The engines localrun drives: their table (:data:`BACKENDS`, each engine's own
:class:`~localrun.backends.spec.BackendSpec` from its package's ``facts.py``) and what is
asked of it: spellings, options, installed versions, loading. Nothing here imports an
engine until :func:`get_backend`.

Each engine is one folder, ``backends/<engine>/``: its facts (``facts.py``, pure data:
the table row, the formats it runs and on what conditions, what it allocates, its
options), its session, and whatever else only it uses. Adding one means its folder, its
name in ``spec.BackendName`` and in :data:`ENGINES` below, and its host rules in
:mod:`localrun.planning.selection`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from localrun.backends import installed
from localrun.backends.exllama.facts import EXLLAMAV2, EXLLAMAV3
from localrun.backends.llama_cpp.facts import SPEC as LLAMA_CPP
from localrun.backends.mlx.facts import SPEC as MLX
from localrun.backends.onnx.facts import SPEC as ONNX
from localrun.backends.openvino.facts import SPEC as OPENVINO
from localrun.backends.remote.facts import SPEC as REMOTE
from localrun.backends.spec import BackendName, BackendSpec, Build, Option
from localrun.backends.vllm.facts import SPEC as VLLM
from localrun.memory import EngineMemory, memory_row

if TYPE_CHECKING:
    from localrun.backends.base import Backend
    from localrun.errors import EngineNotInstalledError

__all__ = ["BACKENDS", "BACKEND_ALIASES", "ENGINES", "ENGINE_OPTIONS", "BackendName",
           "BackendSpec", "Build", "Option", "build_devices", "canonical_backend",
           "engine_memory", "engine_options", "engine_version", "get_backend",
           "install_hint", "installed_backends", "installed_build", "is_installed",
           "not_installed"]

#: Every engine's facts, in the order of ``spec.BackendName``.
ENGINES: tuple[BackendSpec, ...] = (LLAMA_CPP, MLX, EXLLAMAV2, EXLLAMAV3, OPENVINO, ONNX,
                                    VLLM, REMOTE)
#: The engine table: name -> its facts.
BACKENDS: dict[str, BackendSpec] = {s.name: s for s in ENGINES}

#: Other spellings users type for --backend (each engine's ``aliases``).
BACKEND_ALIASES: dict[str, str] = {a: s.name for s in BACKENDS.values() for a in s.aliases}


def engine_memory(backend: str | None, device: str | None = None) -> EngineMemory:
    """What the engine named ``backend`` allocates besides its weights on ``device`` (None:
    its default device): its own facts' row (:func:`localrun.memory.memory_row`), else
    the safe default for an engine unknown here (f16, the full fixed overhead)."""
    return memory_row(BACKENDS.get(backend) if backend is not None else None, device)


def canonical_backend(name: str) -> str:
    """Map any accepted spelling to a backend name; raise for unknown names."""
    from localrun.errors import LocalrunError

    key = name.strip().lower()
    if key in BACKENDS:
        return key
    if key in BACKEND_ALIASES:
        return BACKEND_ALIASES[key]
    raise LocalrunError(
        f"Unknown backend {name!r}",
        hint="use one of: auto, " + ", ".join(BACKENDS),
    )


#: Engine options each backend takes through ``localrun.load(..., name=value)``:
#: name -> (kind of value, what it does); see :data:`localrun.backends.spec.Option`.
ENGINE_OPTIONS: dict[str, dict[str, Option]] = {
    name: dict(spec.options) for name, spec in BACKENDS.items()}


def engine_options(name: str) -> dict[str, str]:
    """{option: what it does} for a backend: the list its errors show."""
    return {k: why for k, (_, why) in BACKENDS[canonical_backend(name)].options.items()}


def installed_build(name: str) -> Build | None:
    """The GPU build installed in place of the engine's plain distribution, if any."""
    return installed.installed_build(BACKENDS[canonical_backend(name)])


def engine_version(name: str) -> str | None:
    """The installed version of the engine, read from metadata only (a GPU build as a
    local version label: ``0.8.0+cuda``; vLLM's from its own environment)."""
    spec = BACKENDS[canonical_backend(name)]
    if spec.home == "own-env":  # vLLM, the one engine with an environment of its own
        from localrun.backends.vllm.env import vllm_version

        return vllm_version()
    return installed.installed_version(spec)


def build_devices(version: str) -> tuple[str, ...]:
    """Device kinds an engine version string (from :func:`engine_version`) adds to the CPU."""
    _, _, label = version.partition("+")
    return (label,) if label else ()


def is_installed(name: str) -> bool:
    return engine_version(name) is not None


def installed_backends() -> dict[str, str]:
    """{backend name: engine version} for every installed engine (no imports)."""
    out = {}
    for name, spec in BACKENDS.items():
        if spec.home == "nowhere":  # a server elsewhere: nothing to install, never planned
            continue
        v = engine_version(name)
        if v is not None:
            out[name] = v
    return out


def install_hint(name: str, device: str = "cpu") -> str:
    """The command that installs an engine: its GPU build's extra for ``device`` where it
    has one ("cuda:0" -> onnx-cuda), its own environment for vLLM."""
    spec = BACKENDS[canonical_backend(name)]
    if spec.home == "own-env":
        from localrun.backends.vllm.env import INSTALL_HINT

        return INSTALL_HINT
    return installed.pip_hint(spec, device)


def not_installed(name: str, *, reason: str | None = None) -> EngineNotInstalledError:
    """The error for an engine that is missing (or fails to import), with its install hint."""
    spec = BACKENDS[canonical_backend(name)]
    return installed.missing(spec, reason=reason, hint=install_hint(spec.name))


def get_backend(name: str) -> Backend:
    """Import and instantiate a backend. Raises EngineNotInstalledError with the extra."""
    spec = BACKENDS[canonical_backend(name)]
    if spec.home == "own-env":  # found at load time, in its own environment (vllm_env)
        return importlib.import_module(spec.module).BACKEND  # type: ignore[no-any-return]
    if not is_installed(spec.name):
        raise not_installed(spec.name)
    module = importlib.import_module(spec.module)
    backend: Backend = module.BACKEND
    return backend
