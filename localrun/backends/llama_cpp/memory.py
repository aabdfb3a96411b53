"""What llama.cpp's KV cache takes: bytes per token in the cache type a model was loaded
with, and the batcher's slots (each a KV stream as long as the session's context) that
fit its budget."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from localrun.backends.llama_cpp.engine import Engine
from localrun.backends.llama_cpp.facts import KV_TYPES
from localrun.memory import available_ram_bytes, budget

#: Most sequences in flight. A decode step costs little more for 8 sequences than for 2
#: on a small CPU (docs/results/llama_batch.md), so 8 give the most tokens/s; more would
#: mostly add KV memory.
MAX_CAPACITY = 8
#: Bytes the batch context's KV cache may take (capacity x the session's KV cache), and
#: at most a quarter of the RAM available when the batcher is built: the ``reserve`` of
#: the one budget policy (:func:`localrun.memory.budget`).
KV_BUDGET = 2 << 30


def element_bytes(kwargs: Mapping[str, Any]) -> float:
    """Bytes per K or V element of the cache type ``Llama(**kwargs)`` gets (f16 unless
    ``type_k`` says otherwise)."""
    type_k = str(kwargs.get("type_k", "GGML_TYPE_F16"))
    return next((b for name, b in KV_TYPES.values() if name == type_k), 2.0)


def kv_bytes_per_token(engine: Engine) -> int:
    """KV cache bytes per token of the engine's model, in its KV cache type."""
    lc, model = engine.lc, engine.llm._model.model
    n_head = max(int(lc.llama_model_n_head(model)), 1)
    head_dim = int(lc.llama_model_n_embd(model)) // n_head
    if engine.shape is not None:  # the GGUF's own key/value length (Gemma's differs)
        head_dim = engine.shape.head_dim
    per = 2 * int(lc.llama_model_n_layer(model)) * int(lc.llama_model_n_head_kv(model))
    return int(per * head_dim * engine.kv_element_bytes)


def stream_tokens(engine: Engine) -> int:
    """Tokens of one slot's KV stream: the session's context (llama.cpp pads it to 256)."""
    return -(-int(engine.llm.n_ctx()) // 256) * 256


def batch_capacity(stream_bytes: int, available: int | None) -> int:
    """Slots that fit: each holds ``stream_bytes`` of KV cache (the session's context)."""
    room = budget(available, reserve=KV_BUDGET)
    return int(min(MAX_CAPACITY, room // max(stream_bytes, 1)))


def batch_slots(engine: Engine, max_concurrency: int | None) -> tuple[int, int]:
    """The slots a batcher would have if built now (those that fit, at most
    ``max_concurrency``; under 2: no batcher) and the bytes of KV cache each holds (a
    stream of the session's whole context), without building it."""
    stream = stream_tokens(engine) * kv_bytes_per_token(engine)
    fit = batch_capacity(stream, available_ram_bytes())
    return min(fit, max_concurrency or MAX_CAPACITY), stream  # a stream per slot
