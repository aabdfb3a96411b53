"""ExLlamaV2/V3 load options: their table, and validation.

The engines' titles and accepted options are their facts
(:mod:`localrun.backends.exllama.facts`: :data:`ENGINE_TITLES` and :data:`OPTIONS` are
read from there); the parsing, which takes more spellings than the table's kinds, stays
here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from localrun.backends.exllama.facts import SPECS
from localrun.errors import InvalidOptionError

Engine = Literal["exllamav2", "exllamav3"]
KVCache = Literal["fp16", "q8", "q6", "q4"]

ENGINES: tuple[Engine, ...] = ("exllamav2", "exllamav3")
ENGINE_TITLES: dict[str, str] = {e: SPECS[e].title for e in ENGINES}

KV_CACHE_CHOICES: tuple[KVCache, ...] = ("fp16", "q8", "q6", "q4")
KV_CACHE_ALIASES: dict[str, KVCache] = {
    "fp16": "fp16", "f16": "fp16", "float16": "fp16", "16": "fp16",
    "q8": "q8", "8": "q8", "int8": "q8",
    "q6": "q6", "6": "q6",
    "q4": "q4", "4": "q4", "int4": "q4",
}

#: The options each backend accepts through ``localrun.load(..., **options)``: {name: help}.
OPTIONS: dict[str, dict[str, str]] = {
    e: {name: why for name, (_, why) in SPECS[e].options.items()} for e in ENGINES}


def title(engine: str) -> str:
    """The engine's name as users read it ("ExLlamaV2"); any other name as it is."""
    return ENGINE_TITLES.get(engine, engine)


@dataclass(frozen=True)
class LoadOptions:
    kv_cache: KVCache = "fp16"
    gpu_split: tuple[float, ...] | None = None
    tensor_parallel: bool | None = None  # None: decide from the GPUs (exllamav3)
    paged: bool | None = None  # None: decide from flash-attn (exllamav2)


def parse_kv_cache(engine: str, value: object) -> KVCache:
    """``fp16 | q8 | q6 | q4`` (also 16/8/6/4); raise InvalidOptionError otherwise."""
    key = str(value).strip().lower() if isinstance(value, (str, int)) and \
        not isinstance(value, bool) else None
    if key is None or key not in KV_CACHE_ALIASES:
        raise InvalidOptionError(title(engine), "kv_cache", value, ", ".join(KV_CACHE_CHOICES))
    return KV_CACHE_ALIASES[key]


def parse_options(engine: str, options: Mapping[str, Any]) -> LoadOptions:
    """Validate ``LoadRequest.options`` against :data:`OPTIONS`; unknown names are errors."""
    name_of = title(engine)
    known = OPTIONS[engine]
    for name, value in options.items():
        if name not in known:
            raise InvalidOptionError(name_of, name, value,
                                     "options " + ", ".join(sorted(known)))
    kv: KVCache = parse_kv_cache(engine, options["kv_cache"]) if "kv_cache" in options \
        else "fp16"
    split: tuple[float, ...] | None = None
    if options.get("gpu_split") is not None:
        raw = options["gpu_split"]
        if isinstance(raw, str):
            raw = [p for p in re.split(r"[,\s]+", raw.strip()) if p]
        try:
            split = tuple(float(x) for x in raw)
        except (TypeError, ValueError):
            split = None
        if not split or any(not math.isfinite(x) or x < 0 for x in split) or \
                not any(x > 0 for x in split):
            raise InvalidOptionError(name_of, "gpu_split", options["gpu_split"],
                                     known["gpu_split"])
    flags: dict[str, bool | None] = {}
    for name in ("tensor_parallel", "paged"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise InvalidOptionError(name_of, name, value, "True or False")
        flags[name] = value
    return LoadOptions(kv, split, flags["tensor_parallel"], flags["paged"])
