"""LoRA adapters: loaded with a model, and chosen per request where the engine can.

**At load** (``localrun.load(model, adapters=[...])``, a preset's ``--adapter``,
``localrun serve --lora``): each adapter is a path, a scale (1 = as trained, 0 = loaded
but off) and a name (the file's stem, or ``name=PATH``); ``PATH[:SCALE]`` and
``name=PATH[:SCALE]`` are its text form. Which engines load which kind (:data:`ENGINES`):
llama.cpp GGUF adapters (``convert_lora_to_gguf.py``), several at once, each with its
scale; MLX an mlx-lm adapter folder (``adapters.safetensors``), one; vLLM PEFT folders,
one per request at scale 1. Other engines refuse adapters (UnsupportedFeatureError
naming those three). An adapter trained for another architecture is refused before the
model loads (the GGUF header's ``general.architecture``).

**Per request** (``Model.chat(..., adapters=...)``, the server's ``lora`` field, as
llama-server's): the set of adapters the reply runs under, replacing the load-time one
(adapters not named are off): ``{"name": scale}``, or a list of names, indices, ``(name,
scale)`` pairs or ``{"id"|"name": ..., "scale": ...}`` objects; ``[]`` is the base model.
llama.cpp switches the set between requests on one loaded model (its KV cache reused
only under the same set); vLLM routes the request to the adapter; MLX applies its
adapter at load and refuses another set.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from localrun.errors import InvalidSamplingError, LocalrunError, UnsupportedFeatureError

AdapterKind = Literal["gguf", "mlx", "peft"]


class AdapterError(LocalrunError, ValueError):
    """A LoRA adapter that cannot be used as asked: no file there, not an adapter, a
    scale out of range, an engine that loads none (:mod:`localrun.adapters`)."""


class AdapterMismatchError(AdapterError):
    """An adapter trained for another architecture than the model it is loaded on."""

    def __init__(self, adapter: str, adapter_arch: str, model: str, model_arch: str):
        self.adapter = adapter
        self.adapter_arch = adapter_arch
        self.model = model
        self.model_arch = model_arch
        super().__init__(
            f"The adapter {adapter} is for the {adapter_arch!r} architecture, and the model "
            f"{model} is {model_arch!r}",
            hint="load the adapter on the base model it was trained from (its "
            "general.architecture must match the model's)")


class AdapterNotLoadedError(AdapterError, LookupError):
    """A request names an adapter the model was not loaded with."""

    def __init__(self, name: str, loaded: Sequence[str]):
        self.name = name
        self.loaded = tuple(loaded)
        shown = (f"it has {', '.join(repr(n) for n in self.loaded)}" if self.loaded
                 else "it has none")
        super().__init__(
            f"No adapter {name!r} is loaded on this model ({shown})",
            hint="name one of those (by name or by its index), or load the model with it: "
            "localrun.load(MODEL, adapters=[PATH]) / localrun serve MODEL --lora PATH")


#: Largest scale an adapter takes (either sign): 1 is the adapter as trained.
MAX_SCALE = 4.0
SCALE_ALLOWED = f"a number from {-MAX_SCALE:g} to {MAX_SCALE:g} (1 = as trained, 0 = off)"
CHOICE_ALLOWED = ("adapter names or indices, (name, scale) pairs, {'id'|'name': ..., "
                  "'scale': ...} objects, or a {name: scale} mapping")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class EngineAdapters:
    """What one engine does with adapters."""

    kinds: tuple[AdapterKind, ...]  # what it loads
    per_request: bool  # another set per request, on one loaded model
    several: bool  # more than one active at once
    scales: bool  # a scale other than 1 (and 0)


#: The engines that load adapters (any other refuses them).
ENGINES: dict[str, EngineAdapters] = {
    "llama.cpp": EngineAdapters(("gguf",), per_request=True, several=True, scales=True),
    "mlx": EngineAdapters(("mlx",), per_request=False, several=False, scales=True),
    "vllm": EngineAdapters(("peft",), per_request=True, several=False, scales=False),
}

#: How to get an adapter of the kind an engine loads from another kind.
CONVERT: dict[tuple[AdapterKind, AdapterKind], str] = {
    ("peft", "gguf"): "convert it with llama.cpp's convert_lora_to_gguf.py --base MODEL_DIR",
    ("peft", "mlx"): "mlx-lm trains its own adapter folders (mlx_lm.lora); a PEFT adapter "
                     "needs its weights transposed into adapters.safetensors",
    ("gguf", "peft"): "vLLM loads PEFT adapter folders (adapter_config.json + "
                      "adapter_model.safetensors), the form the GGUF was converted from",
}


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter: a file or folder, its scale and (optionally) a name of its own."""

    path: str
    scale: float = 1.0
    name: str | None = None

    @property
    def label(self) -> str:
        """Its name: the one given, else the file's stem (the folder's name)."""
        return self.name or default_name(self.path)

    @property
    def display(self) -> str:
        """``[name=]PATH[:SCALE]``, as it was written."""
        head = f"{self.name}={self.path}" if self.name else self.path
        return head if self.scale == 1.0 else f"{head}:{self.scale:g}"


def default_name(path: str) -> str:
    p = Path(path)
    return p.stem if p.suffix.lower() == ".gguf" else p.name


def check_scale(scale: object, where: str) -> float:
    """``scale`` as a float; AdapterError unless it is a number within :data:`MAX_SCALE`."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not math.isfinite(scale) or abs(scale) > MAX_SCALE:
        raise AdapterError(f"{where}: scale {scale!r} is out of range",
                           hint=f"give {SCALE_ALLOWED}, e.g. PATH:0.5")
    return float(scale)


def parse_adapter(text: str) -> Adapter:
    """``[name=]PATH[:SCALE]``: a trailing ``:NUMBER`` is the scale (1.0 without one)."""
    name = None
    head, eq, rest = text.partition("=")
    if eq and _NAME.match(head) and rest:
        name, text = head, rest
    path, sep, tail = text.rpartition(":")
    if sep and path:
        try:
            scale = float(tail)
        except ValueError:
            return Adapter(text, 1.0, name)
        return Adapter(path, check_scale(scale, f"adapter {text}"), name)
    return Adapter(text, 1.0, name)


def adapter_kind(path: Path) -> AdapterKind | None:
    """What kind of adapter is at ``path`` (from its files), or None."""
    if path.is_file():
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError:
            return None
        return "gguf" if magic == b"GGUF" else None
    if (path / "adapters.safetensors").is_file():
        return "mlx"
    if any((path / n).is_file() for n in ("adapter_model.safetensors", "adapter_model.bin")):
        return "peft"
    return None


def normalize(items: Sequence[Adapter | str | os.PathLike[str]] | None) -> tuple[Adapter, ...]:
    """The adapters ``load()`` was given, each checked: there, a scale in range, names
    unique. Cheap (no engine): done before the model is resolved or downloaded."""
    if items is None:
        return ()
    if isinstance(items, (str, os.PathLike, Adapter)):
        items = [items]
    out: list[Adapter] = []
    for item in items:
        if isinstance(item, Adapter):
            a = item
        elif isinstance(item, (str, os.PathLike)):
            a = parse_adapter(os.fspath(item))
        else:
            raise AdapterError(f"Cannot read {item!r} as an adapter",
                               hint="pass paths ('style.gguf', 'style.gguf:0.5', "
                               "'name=style.gguf') or localrun.Adapter(path, scale, name)")
        path = Path(a.path).expanduser()
        if not path.exists():
            raise AdapterError(f"No adapter at {a.path}",
                               hint="give the path of a LoRA adapter file (GGUF) or folder")
        scale = check_scale(a.scale, f"adapter {a.path}")
        if a.name is not None and not _NAME.match(a.name):
            raise AdapterError(f"Cannot name an adapter {a.name!r}",
                               hint="letters, digits, '.', '_' and '-'")
        out.append(Adapter(str(path.resolve()), scale, a.name))
    names = [a.label for a in out]
    for n in names:
        if names.count(n) > 1:
            raise AdapterError(f"Two adapters are named {n!r}",
                               hint="name them apart: name=PATH (e.g. style=./a/x.gguf)")
    return tuple(out)


def for_engine(adapters: Sequence[Adapter], backend: str) -> None:
    """Refuse adapters ``backend`` cannot load, before the model loads."""
    if not adapters:
        return
    eng = ENGINES.get(backend)
    if eng is None:
        raise UnsupportedFeatureError(
            backend, "adapters", "this engine loads no LoRA adapters",
            supported_by=tuple(ENGINES))
    for a in adapters:
        kind = adapter_kind(Path(a.path))
        if kind not in eng.kinds:
            want = eng.kinds[0]
            what = {"gguf": "a GGUF adapter file", "mlx": "an mlx-lm adapter folder",
                    "peft": "a PEFT adapter folder"}
            hint = CONVERT.get((kind, want)) if kind else None
            raise AdapterError(
                f"{a.path} is {what[kind] if kind else 'no LoRA adapter localrun knows'}; "
                f"{backend} loads {what[want]}",
                hint=hint or f"give {what[want]} (or load the model with another engine)")
        if not eng.scales and a.scale not in (0.0, 1.0):
            raise AdapterError(f"{backend} applies an adapter at scale 1 only (not "
                               f"{a.scale:g}): {a.path}",
                               hint="give scale 1 (on) or 0 (loaded, off until a request "
                               "names it), or use llama.cpp with a GGUF adapter")
    active = [a for a in adapters if a.scale != 0]
    if not eng.several and len(active if eng.per_request else adapters) > 1:
        raise AdapterError(f"{backend} runs one adapter at a time, and {len(adapters)} were "
                           "given" + (" on" if eng.per_request else ""),
                           hint="load one (on vLLM, others at scale 0: a request then names "
                           "the one it runs under)" if eng.per_request else "load one")


def check_gguf(adapter: Adapter, model_path: str, model_arch: str | None) -> None:
    """A GGUF adapter is a LoRA adapter for the model's architecture (its header)."""
    from localrun.errors import ModelFileError
    from localrun.formats.gguf import read_gguf

    try:
        meta = read_gguf(adapter.path).metadata
    except ModelFileError as e:
        raise AdapterError(f"{adapter.path} is not a LoRA adapter: {e.message}",
                           hint="give an adapter made by llama.cpp's convert_lora_to_gguf.py"
                           ) from None
    kind = meta.get("general.type")
    if kind != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterError(f"{adapter.path} is not a LoRA adapter (general.type {kind!r}, "
                           f"adapter.type {meta.get('adapter.type')!r})",
                           hint="give an adapter made by llama.cpp's convert_lora_to_gguf.py")
    arch = meta.get("general.architecture")
    if model_arch and arch != model_arch:
        raise AdapterMismatchError(adapter.path, str(arch), model_path, model_arch)


def adapters_bytes(adapters: Sequence[Adapter]) -> int:
    """Bytes the adapters' weights take (their files), for the memory estimate."""
    total = 0
    for a in adapters:
        p = Path(a.path)
        try:
            if p.is_file():
                total += p.stat().st_size
            elif p.is_dir():
                total += sum(f.stat().st_size for f in p.iterdir()
                             if f.is_file() and f.suffix in (".safetensors", ".bin", ".gguf"))
        except OSError:
            continue
    return total


# -- per request ----------------------------------------------------------------------------

#: One entry of a request's choice, as read: an adapter's name or index, and its scale
#: (None: the adapter's own)
Choice = tuple[tuple[str | int, float | None], ...]
#: The set a reply runs under: (name, scale) of each active adapter, in load order
Active = tuple[tuple[str, float], ...]


def read_choice(value: Any) -> Choice:
    """A request's ``adapters`` (``lora``) in one shape; InvalidSamplingError otherwise."""

    def bad(why: str = "") -> InvalidSamplingError:
        return InvalidSamplingError("adapters", value, CHOICE_ALLOWED + why)

    def scale_of(s: Any) -> float | None:
        if s is None:
            return None
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) \
                or abs(s) > MAX_SCALE:
            raise InvalidSamplingError("adapters", value, "scales: " + SCALE_ALLOWED)
        return float(s)

    def key_of(k: Any) -> str | int:
        if isinstance(k, bool) or not isinstance(k, (str, int)) or k == "":
            raise bad()
        return k

    if isinstance(value, Mapping):
        return tuple((key_of(k), scale_of(s)) for k, s in value.items())
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return ((key_of(value), None),)
    if not isinstance(value, (list, tuple)):
        raise bad()
    out: list[tuple[str | int, float | None]] = []
    for item in value:
        if isinstance(item, Mapping):
            keys = [k for k in ("id", "name") if item.get(k) is not None]
            if len(keys) != 1 or set(item) - {"id", "name", "scale"}:
                raise bad(" (each object: one of id or name, and scale)")
            out.append((key_of(item[keys[0]]), scale_of(item.get("scale"))))
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            out.append((key_of(item[0]), scale_of(item[1])))
        else:
            out.append((key_of(item), None))
    return tuple(out)


def default_set(loaded: Sequence[Adapter]) -> Active:
    """The set a request that names none runs under: the load-time scales."""
    return tuple((a.label, a.scale) for a in loaded if a.scale != 0)


def choose(loaded: Sequence[Adapter], choice: Choice | None, *, backend: str,
           per_request: bool) -> Active:
    """The set a request runs under: ``choice`` read against the loaded adapters
    (AdapterNotLoadedError for one that is not there), scale 0 left out; the load-time
    set where ``choice`` is None. An engine without per-request sets refuses another."""
    default = default_set(loaded)
    if choice is None:
        return default
    labels = [a.label for a in loaded]
    scales: dict[str, float] = {}
    for key, scale in choice:
        if isinstance(key, int):
            if not 0 <= key < len(loaded):
                raise AdapterNotLoadedError(f"#{key}", labels)
            a = loaded[key]
        else:
            found = [a for a in loaded if a.label == key] or \
                [a for a in loaded if a.label.lower() == key.lower()]
            if not found:
                raise AdapterNotLoadedError(key, labels)
            a = found[0]
        scales[a.label] = scale if scale is not None else (a.scale or 1.0)
    active = tuple((n, scales[n]) for n in labels if scales.get(n, 0.0) != 0.0)
    if not per_request and active != default:
        raise UnsupportedFeatureError(
            backend, "adapters", f"{backend} applies its adapters at load; a request cannot "
            "choose another set", supported_by=tuple(e for e, f in ENGINES.items()
                                                      if f.per_request))
    return active


__all__ = [
    "ENGINES",
    "MAX_SCALE",
    "Active",
    "Adapter",
    "Choice",
    "adapter_kind",
    "adapters_bytes",
    "check_gguf",
    "check_scale",
    "choose",
    "chosen_adapters",
    "default_set",
    "for_engine",
    "normalize",
    "parse_adapter",
    "read_choice",
]


def chosen_adapters(session: Any, choice: Choice | None) -> Active:
    """:func:`choose` for a loaded session (its ``info.adapters``; per request where
    "adapters" is in its ``features``): the driver's one call, per sequence."""
    loaded = session.info.adapters
    if not loaded and not choice:
        return ()
    return choose(loaded, choice, backend=session.info.backend,
                  per_request="adapters" in session.features)
