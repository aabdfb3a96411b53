"""The engines localrun drives, as data. Nothing here imports an engine."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from localrun.backends.base import Backend

BackendName = Literal["llama.cpp", "mlx", "exllamav2", "exllamav3", "openvino", "onnx"]


@dataclass(frozen=True)
class BackendSpec:
    name: BackendName
    title: str  # how users know the engine
    module: str  # localrun module with the Backend class, imported only in load()
    dists: tuple[str, ...]  # distributions that must be installed
    extra: str  # the pip extra that installs it
    formats: tuple[str, ...]  # formats it runs with its optimized kernels


BACKENDS: dict[str, BackendSpec] = {
    s.name: s
    for s in (
        BackendSpec("llama.cpp", "llama.cpp (llama-cpp-python)", "localrun.backends.llama_cpp",
                    ("llama-cpp-python",), "llama-cpp", ("gguf",)),
        BackendSpec("mlx", "MLX (mlx-lm)", "localrun.backends.mlx",
                    ("mlx-lm", "mlx"), "mlx", ("mlx",)),
        BackendSpec("exllamav2", "ExLlamaV2", "localrun.backends.exllamav2",
                    ("exllamav2",), "exllamav2", ("exl2",)),
        BackendSpec("exllamav3", "ExLlamaV3", "localrun.backends.exllamav3",
                    ("exllamav3",), "exllamav3", ("exl3",)),
        BackendSpec("openvino", "OpenVINO GenAI", "localrun.backends.openvino_genai",
                    ("openvino-genai",), "openvino", ("openvino",)),
        BackendSpec("onnx", "ONNX Runtime GenAI", "localrun.backends.onnx_genai",
                    ("onnxruntime-genai",), "onnx", ("onnx",)),
    )
}

#: Other spellings users type for --backend.
BACKEND_ALIASES: dict[str, str] = {
    "llama-cpp": "llama.cpp", "llamacpp": "llama.cpp", "llama_cpp": "llama.cpp",
    "llama-cpp-python": "llama.cpp", "gguf": "llama.cpp",
    "mlx-lm": "mlx", "mlx_lm": "mlx",
    "exl2": "exllamav2", "exllama": "exllamav2", "exl3": "exllamav3",
    "openvino-genai": "openvino", "openvino_genai": "openvino", "ov": "openvino",
    "onnxruntime-genai": "onnx", "onnxruntime_genai": "onnx", "ort": "onnx",
    "onnx-genai": "onnx",
}


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


def engine_version(name: str) -> str | None:
    """The installed version of the engine's main distribution, read from metadata only."""
    spec = BACKENDS[canonical_backend(name)]
    versions = []
    for dist in spec.dists:
        try:
            versions.append(metadata.version(dist))
        except metadata.PackageNotFoundError:
            return None
    return versions[0] if versions else None


def is_installed(name: str) -> bool:
    return engine_version(name) is not None


def installed_backends() -> dict[str, str]:
    """{backend name: engine version} for every installed engine (no imports)."""
    out = {}
    for name in BACKENDS:
        v = engine_version(name)
        if v is not None:
            out[name] = v
    return out


def get_backend(name: str) -> Backend:
    """Import and instantiate a backend. Raises EngineNotInstalledError with the extra."""
    from localrun.errors import EngineNotInstalledError

    spec = BACKENDS[canonical_backend(name)]
    if not is_installed(spec.name):
        raise EngineNotInstalledError(spec.title, spec.extra)
    module = importlib.import_module(spec.module)
    backend: Backend = module.BACKEND
    return backend
