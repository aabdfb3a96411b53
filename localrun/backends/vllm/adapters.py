"""PEFT LoRA adapters on vLLM: served by the vLLM process, chosen per request.

At load, ``vllm serve --enable-lora --lora-modules NAME=PATH ... --max-lora-rank R
--max-loras N`` (vLLM 0.32's flags); a request runs under an adapter by naming it as its
``model`` (vLLM's LoRARequest per request), the base model by the base model's name.
vLLM has no per-request scale: an adapter is on (scale 1) or off, one per request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from localrun.adapters import Active, Adapter, AdapterError, default_set

#: vLLM's ``--max-lora-rank`` choices (vllm/config/lora.py, MaxLoRARanks)
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def rank(folder: str) -> int:
    """The adapter's rank (adapter_config.json's ``r``; 16, vLLM's default, if unsaid)."""
    try:
        cfg = json.loads((Path(folder) / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 16
    r = cfg.get("r") if isinstance(cfg, dict) else None
    return r if isinstance(r, int) and r > 0 else 16


def lora_flags(adapters: Sequence[Adapter]) -> list[str]:
    """The ``vllm serve`` flags that load ``adapters`` (none without any)."""
    if not adapters:
        return []
    top = max(rank(a.path) for a in adapters)
    fits = [r for r in MAX_LORA_RANKS if r >= top]
    if not fits:
        raise AdapterError(f"vLLM takes LoRA ranks up to {MAX_LORA_RANKS[-1]}, and an "
                           f"adapter here has rank {top}", hint="use llama.cpp (a GGUF adapter)")
    return ["--enable-lora", "--max-lora-rank", str(fits[0]), "--max-loras",
            str(len(adapters)), "--lora-modules", *[module(a) for a in adapters]]


def module(adapter: Adapter) -> str:
    """One ``--lora-modules`` value: ``NAME=PATH``, or vLLM's JSON form where that would
    be misread (vLLM reads a value with a comma, or none of "=", as JSON)."""
    if "," in adapter.path or "=" in adapter.label or "," in adapter.label:
        return json.dumps({"name": adapter.label, "path": adapter.path})
    return f"{adapter.label}={adapter.path}"


def served_adapter(model_id: str, active: Active | None,
                   loaded: Sequence[Adapter]) -> str:
    """The ``model`` a request names: its one adapter, else the base model."""
    chosen = default_set(loaded) if active is None else active
    if not chosen:
        return model_id
    if len(chosen) > 1:
        raise AdapterError(f"vLLM runs a request under one adapter, and "
                           f"{', '.join(n for n, _ in chosen)} were asked for",
                           hint="name one (or use llama.cpp, which combines them)")
    name, scale = chosen[0]
    if scale != 1.0:
        raise AdapterError(f"vLLM applies an adapter at scale 1 only, and {name} was asked "
                           f"at {scale:g}", hint="ask for scale 1, or use llama.cpp")
    return name
