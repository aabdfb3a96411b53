from __future__ import annotations

import pytest

from localrun import memory
from localrun.memory import ModelShape
from tests.hubserver import gguf_bytes

QWEN = ModelShape(n_layers=24, n_kv_heads=2, head_dim=64, trained_context=32768)


def test_kv_cache_formula() -> None:
    # layers x KV heads x head dim x context x 2 (K and V) x 2 bytes (f16)
    assert memory.kv_cache_bytes(QWEN, 1000) == 24 * 2 * 64 * 1000 * 2 * 2
    est = memory.estimate(10**9, QWEN, 4096)
    assert est.total_bytes == 10**9 + est.kv_cache_bytes + memory.overhead_bytes(10**9)


def test_max_context() -> None:
    w = 500 * 2**20
    budget = w + memory.overhead_bytes(w) + QWEN.kv_bytes_per_token() * 5000
    ctx = memory.max_context(w, QWEN, budget, limit=32768)
    assert ctx == 5000 // 256 * 256
    assert memory.estimate(w, QWEN, ctx).total_bytes <= budget
    assert memory.max_context(w, QWEN, 10**12, limit=32768) == 32768
    assert memory.max_context(w, QWEN, w) == 0


def test_shapes_from_gguf_and_configs() -> None:
    meta = memory.gguf_metadata_from_bytes(gguf_bytes())
    assert memory.shape_from_gguf_metadata(meta) == QWEN
    with pytest.raises(EOFError):
        memory.gguf_metadata_from_bytes(gguf_bytes()[:60])
    cfg = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
           "hidden_size": 896, "max_position_embeddings": 32768}
    assert memory.shape_from_config(cfg) == QWEN
    genai = {"model": {"context_length": 4096, "decoder": {
        "num_hidden_layers": 32, "num_key_value_heads": 8, "head_size": 96}}}
    assert memory.shape_from_config(genai) == ModelShape(32, 8, 96, 4096)


def test_available_ram() -> None:
    assert memory.available_ram_bytes() > 0
