"""What localrun knows about an engine, as types. Each engine states its facts in its own
package (``backends/<engine>/facts.py``: one :class:`BackendSpec`), and
:mod:`localrun.backends` collects them into :data:`localrun.backends.BACKENDS`.

The other per-engine tables are derived from those facts (``localrun.backends``'
``ENGINE_OPTIONS`` and ``BACKEND_ALIASES``; ``backends.compat``'s ``COMPAT``,
``CONDITIONS``, ``CONVERT`` and ``NATIVE_FORMAT``; ``hosts.MIN_COMPUTE``;
``selection.QUANT_PREFERENCE``; ``hub.fit.DEFAULT_TARGET`` and ``DEFAULT_TARGET_NAMES``;
``backends.engine_memory``; ``backends.exllama.options``' ``ENGINE_TITLES`` and
``OPTIONS``), and tests/test_backend_spec.py fails when one drifts. What depends on a
host rather than on one engine stays in its own table: which engine each kind of host
tries first (``selection.RULES``).

Pure data: importing this module imports no engine, and of localrun's only the type of a
memory row (:class:`localrun.memory.EngineMemory`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from localrun.memory import OVERHEAD_FIXED, EngineMemory, MiB

BackendName = Literal["llama.cpp", "mlx", "exllamav2", "exllamav3", "openvino", "onnx",
                      "vllm", "remote"]

#: How an engine option's value is checked (``backends.options.check_options``): "int",
#: "bool", "number", "numbers" (a list), "text", "switch" ("auto", True or False), or a
#: tuple of the accepted words.
OptionKind = str | tuple[str, ...]
#: An engine option: (kind of value, what it does, shown in errors and --help).
Option = tuple[OptionKind, str]

#: Where an engine is installed. "here": in this Python environment, from the pip extra;
#: "own-env": in an environment of its own that localrun runs as a server (vLLM pins its
#: torch); "nowhere": a server elsewhere, nothing to install or plan.
Home = Literal["here", "own-env", "nowhere"]

#: How well an engine runs a format. "native": it has optimized kernels for it. "loads":
#: it works, but it is not the engine's fast path (an explicit opt-in, with a warning).
#: "no": refused, naming the engines that run it and how to get the right variant.
Support = Literal["native", "loads", "no"]

__all__ = ["OVERHEAD_FIXED", "BackendName", "BackendSpec", "Build", "Condition",
           "EngineMemory", "Home", "MiB", "Option", "OptionKind", "Support", "needs_compute"]


@dataclass(frozen=True)
class Build:
    """Another distribution of an engine's main package, built for a GPU API.

    It installs the same module as the plain distribution (``import onnxruntime_genai``
    either way), so it is recognised from package metadata, never by importing.
    """

    dist: str  # e.g. "onnxruntime-genai-cuda"
    device: str  # the device kind it adds: "cuda", "dml"
    extra: str  # the localrun extra that installs it


@dataclass(frozen=True)
class Condition:
    """What a "loads" (or "native") pairing depends on; outside it, the pairing is "no"."""

    note: str
    architectures: tuple[str, ...] | None = None  # GGUF general.architecture values
    quantizations: tuple[str, ...] | None = None  # detected quantization names
    min_version: str | None = None  # engine version where this started to work


def needs_compute(cc: tuple[int, int]) -> str:
    """A GPU condition's words for a minimum compute capability."""
    return f"NVIDIA GPU with compute capability >= {cc[0]}.{cc[1]}"


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """One engine's facts. Every field is required, so a new engine cannot leave one out."""

    name: BackendName
    title: str  # how users know the engine
    module: str  # localrun module with the Backend (``BACKEND``), imported only in load()
    dists: tuple[str, ...]  # distributions that must be installed
    extra: str | None  # the pip extra that installs it (None: not pip-installed here)
    home: Home
    #: formats it runs with its optimized kernels; the first is the one it asks for
    formats: tuple[str, ...]
    #: formats it also loads without its optimized kernels ("loads")
    loads: tuple[str, ...]
    #: what a pairing with one of its formats (native or loads) depends on, by format
    conditions: Mapping[str, Condition]
    #: the variant a plan names when the model is not a file yet (None: nothing to choose)
    quant: str | None
    #: bits per weight the Hub's variant choice aims for in ``formats[0]``; the nearest
    #: variant that fits wins (inf: the largest that fits; None: the Hub is not asked)
    target_bpw: float | None
    #: one command that makes ``formats[0]`` from a Hugging Face model (for hints)
    convert: str
    #: lowest NVIDIA compute capability its CUDA kernels run on (None: no CUDA kernels,
    #: or none known)
    min_compute: tuple[int, int] | None
    #: engine options taken through ``localrun.load(..., name=value)``; anything else is
    #: refused with this list, so a misspelt option never passes silently
    options: Mapping[str, Option]
    #: other spellings users type for --backend
    aliases: tuple[str, ...]
    #: GPU builds that stand in for ``dists[0]`` (the plain one runs on the CPU only)
    builds: tuple[Build, ...]
    #: what it allocates besides its weights, by device kind ("cpu"; "*": any other);
    #: empty: the planner's safe default (f16, the full fixed overhead)
    memory: Mapping[str, EngineMemory]
    #: the device kind whose ``memory`` row counts when no device is named ("*": a GPU
    #: when there is one)
    default_device: str
    #: the module with its embedding mode (``load_embedder``); None: it does not embed
    embedder: str | None
