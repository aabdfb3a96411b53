from __future__ import annotations

from pathlib import Path

import pytest

from localrun import memory
from localrun.memory import ModelShape
from tests.hubserver import gguf_bytes

QWEN = ModelShape(n_layers=24, n_kv_heads=2, head_dim=64, trained_context=32768)


#: SmolLM2-135M-Instruct (its config.json: 30 layers, 9 heads of which 3 KV heads,
#: hidden 576 -> head_dim 64, 8192 positions), the model of the test fixtures
SMOLLM2 = ModelShape(n_layers=30, n_kv_heads=3, head_dim=64, trained_context=8192)


def test_kv_cache_formula() -> None:
    # 2 (K and V) x 30 layers x 3 KV heads x 64 head dim x 2 bytes (f16) = 23,040 B/token
    assert memory.kv_cache_bytes(SMOLLM2, 1) == 23_040
    assert memory.kv_cache_bytes(SMOLLM2, 8192) == 188_743_680  # 180 MiB
    assert memory.kv_cache_bytes(SMOLLM2, 8192) == 180 * 2**20
    assert memory.kv_cache_bytes(SMOLLM2, 8192, 4) == 360 * 2**20  # f32 elements
    # Qwen2.5-0.5B: 2 x 24 x 2 x 64 x 2 B = 12,288 B/token
    assert memory.kv_cache_bytes(QWEN, 1000) == 12_288_000
    est = memory.estimate(10**9, SMOLLM2, 4096)
    assert est.kv_cache_bytes == 90 * 2**20
    # overhead: 256 MiB fixed + 5% of the weights
    assert est.overhead_bytes == 256 * 2**20 + 50_000_000
    assert est.total_bytes == 10**9 + 90 * 2**20 + 256 * 2**20 + 50_000_000


def test_smollm2_shape_read_from_the_real_gguf(default_gguf: Path) -> None:
    """The shape the formula above uses is what the embedded GGUF's header says."""
    with default_gguf.open("rb") as f:
        head = f.read(4 << 20)
    meta = memory.gguf_metadata_from_bytes(head)
    assert memory.shape_from_gguf_metadata(meta) == SMOLLM2


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
