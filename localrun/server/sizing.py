"""What a served model takes in memory: its estimate before it loads (from its files or
its Hub plan), and what running several sequences at once adds (its batcher's slots,
what its engine keeps between calls). :mod:`localrun.server.manager` decides with these
which models fit beside each other."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from localrun.errors import LocalrunError
from localrun.server.config import ServerConfig
from localrun.types import ModelInfo

if TYPE_CHECKING:
    from localrun.memory import MemoryEstimate
    from localrun.resolve import Target

Kind = Literal["chat", "embed"]


def footprint(base: int, kv: int, slots: int, reserved: int | None) -> int:
    """Bytes a model runs ``slots`` sequences at once in: ``base`` (weights, overhead,
    one KV cache) plus what its batcher holds beyond that (``reserved``: llama.cpp's
    batch context, a KV cache per slot of its own; 0 where the sequences share the
    model's KV cache), or where that is not fixed (None: MLX, each sequence's cache
    growing with it), one KV cache of ``kv`` bytes per sequence beyond the first."""
    return base + (reserved if reserved is not None else (slots - 1) * kv)


@dataclass(frozen=True)
class Batch:
    """What a model just loaded would run at once (``want``), and what its batcher holds
    beyond the model's own: ``per_slot`` bytes for each slot, where it is not built yet
    and will hold that from the start (llama.cpp's KV streams); else ``reserved``, what
    the batcher built holds (see :func:`footprint`). ``kept``: what the engine keeps
    between calls for KV reuse (``Model.kept_cache_bytes``)."""

    want: int
    per_slot: int = 0
    reserved: int | None = 0
    kept: int = 0

    def reserved_at(self, slots: int) -> int | None:
        """What the batcher holds with ``slots`` of them (none at 1: none is built)."""
        if slots == 1:
            return 0
        return slots * self.per_slot if self.per_slot else self.reserved

    def size(self, base: int, kv: int, slots: int) -> int:
        """Bytes the model runs ``slots`` at once in (``base``: for one sequence)."""
        return footprint(base, kv, slots, self.reserved_at(slots)) + self.kept


def kept_bytes(handle: Any, kind: Kind) -> int:
    """What a chat model keeps between calls beyond its KV cache (embedders: nothing)."""
    return int(handle.kept_cache_bytes) if kind == "chat" else 0


def available_ram() -> int:
    from localrun.memory import available_ram_bytes

    return available_ram_bytes()


def estimate_bytes(name: str, context: int | None, config: ServerConfig,
                   target: Target | None = None) -> int | None:
    """Memory a model will take (weights + KV cache + overhead), before loading it.

    From the files for a model on disk (``target``: where it was found already); from
    the Hub plan for one that is not (None when neither can say: the library's own fit
    check then decides)."""
    from localrun.resolve import resolve_local

    ctx = context or config.context
    try:
        if target is None:
            target = resolve_local(name, backend=config.backend,
                                   allow_unoptimized=config.allow_unoptimized)
    except LocalrunError:
        target = None
    except Exception:
        return None
    if target is not None:
        est = estimate_path(target.path, ctx, target.backend, target.device)
        return est.total_bytes if est is not None else None
    try:
        from localrun.planning.plan import plan_fetch

        _, fetch = plan_fetch(name, backend=config.backend, context=ctx,
                              allow_unoptimized=config.allow_unoptimized)
    except Exception:
        return None
    return fetch.memory.total_bytes if fetch is not None else None


def estimate_loaded(info: ModelInfo, context: int | None) -> MemoryEstimate | None:
    """A loaded model's memory, at the context it was loaded with."""
    return estimate_path(info.path, info.context_length or context, info.backend,
                          info.device)


def estimate_path(path: str, context: int | None, backend: str | None = None,
                   device: str | None = None) -> MemoryEstimate | None:
    """The memory of the model at ``path`` on ``backend`` (on ``device``): its KV cache
    in the element size that engine allocates there, and its overhead."""
    from localrun.formats.detect import OPENVINO_MODEL_FILES, folder_bytes
    from localrun.memory import (
        context_window,
        estimate,
        shape_from_config,
        shape_from_gguf_metadata,
        shape_from_openvino_ir,
    )

    p = Path(path)
    try:
        if p.is_file():
            weights = p.stat().st_size
            from localrun.formats.gguf import read_gguf

            shape = shape_from_gguf_metadata(read_gguf(p, check_size=False).metadata)
        else:
            weights = folder_bytes(p)  # as far as detection looks (bounded)
            shape = None
            for cfg in ("config.json", "genai_config.json"):
                if (p / cfg).is_file():
                    shape = shape_from_config(json.loads((p / cfg).read_text("utf-8")))
                    if shape is not None:
                        break
            for ir in OPENVINO_MODEL_FILES if shape is None else ():
                if (p / ir).is_file():  # an IR without its config.json: its KV state
                    shape = shape_from_openvino_ir((p / ir).read_text("utf-8", "replace"))
                    break
    except (OSError, ValueError, LocalrunError):
        return None
    ctx = context_window(context, shape.trained_context if shape else None)
    return estimate(weights, shape, ctx, backend=backend, device=device)

