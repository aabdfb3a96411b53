"""scripts/make_shape_model.py: a random-weight model of a given shape, with the SmolLM2
fixture's tokenizer, that llama.cpp loads, quantizes and runs (built here in its tiny
shape; the benchmark shapes are the same code with bigger numbers)."""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.conftest import requires_llama
from tests.models import test_model

pytestmark = requires_llama

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_shape_model",
                                                  ROOT / "scripts" / "make_shape_model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, Path, dict[str, Path]]:
    msm = _script()
    source = test_model("gguf-q8_0")
    out = tmp_path_factory.mktemp("shape")
    files = msm.build(msm.SHAPES["tiny"], out, ["q4_0"], tokenizer_gguf=source,
                      keep_f16=True, threads=1)
    return msm, source, files


def test_metadata_shape_and_tokenizer(built: tuple[ModuleType, Path, dict[str, Path]]) -> None:
    msm, source, files = built
    src, f16 = msm.read_metadata(source), msm.read_metadata(files["f16"])
    tok = [k for k in src.raw if k.startswith("tokenizer.")]
    assert "tokenizer.chat_template" in tok and "tokenizer.ggml.merges" in tok
    assert {k: f16.raw[k] for k in tok} == {k: src.raw[k] for k in tok}  # byte for byte
    shape = msm.SHAPES["tiny"]

    def u32(meta: Any, key: str) -> int:
        return int(struct.unpack("<II", meta.raw[key])[1])

    assert u32(f16, "llama.embedding_length") == shape.hidden == 64
    assert u32(f16, "llama.block_count") == shape.layers == 2
    assert u32(f16, "llama.attention.head_count_kv") == shape.kv_heads
    assert u32(f16, "llama.vocab_size") == 49152
    # every parameter written once: F16 matrices, F32 norms, plus the header
    norms = (2 * shape.layers + 1) * shape.hidden
    data = 2 * (shape.params(49152) - norms) + 4 * norms
    tokenizer = sum(len(src.raw[k]) for k in tok)
    assert data + tokenizer < files["f16"].stat().st_size < data + tokenizer + (64 << 10)


def test_llama_cpp_loads_and_quantizes(built: tuple[ModuleType, Path, dict[str, Path]]) -> None:
    import llama_cpp

    _, source, files = built
    prompt = b"<|im_start|>user\nOnce upon a time<|im_end|>\n"
    ref = llama_cpp.Llama(model_path=str(source), n_ctx=64, vocab_only=True, verbose=False)
    try:
        want = ref.tokenize(prompt, add_bos=False, special=True)
    finally:
        ref.close()
    for kind in ("f16", "q4_0"):
        llm = llama_cpp.Llama(model_path=str(files[kind]), n_ctx=128, n_threads=1,
                              n_threads_batch=1, logits_all=True, verbose=False)
        try:
            assert llm.n_vocab() == 49152
            assert llm.metadata["general.file_type"] == ("1" if kind == "f16" else "2")
            tokens = llm.tokenize(prompt, add_bos=False, special=True)
            assert tokens == want  # the same tokenizer as SmolLM2
            llm.eval(tokens)
            logits = np.asarray(llm.scores[:len(tokens)])
            assert np.isfinite(logits).all()
            assert logits.std() > 1e-3  # random weights give spread logits, not zeros
            eos = llm.token_eos()
            assert logits[-1, eos] == 0.0  # control tokens' rows are zero: never argmax
            assert logits[-1].max() > 0.0
        finally:
            llm.close()


def test_localrun_generates(built: tuple[ModuleType, Path, dict[str, Path]]) -> None:
    import localrun

    _, _, files = built
    with localrun.load(str(files["q4_0"]), backend="llama.cpp", context=256, threads=1) as m:
        c = m.chat("Tell me a story.", max_tokens=12, temperature=0.0)
    # greedy never picks EOS (its embedding row is zero), so the reply runs to max_tokens
    assert c.finish_reason == "length"
    assert c.usage.completion_tokens == 12


def test_same_seed_same_file_other_seed_differs(tmp_path: Path) -> None:
    msm = _script()
    source = test_model("gguf-q8_0")
    a = msm.write_f16(msm.SHAPES["tiny"], source, tmp_path / "a.gguf", seed=1)
    b = msm.write_f16(msm.SHAPES["tiny"], source, tmp_path / "b.gguf", seed=1)
    c = msm.write_f16(msm.SHAPES["tiny"], source, tmp_path / "c.gguf", seed=2)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.stat().st_size == c.stat().st_size


def test_gguf_reader_agrees(built: tuple[ModuleType, Path, dict[str, Path]]) -> None:
    """llama.cpp's own Python reader, where installed, reads the same tensor table."""
    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (optional)")
    msm, _, files = built
    r = gguf.GGUFReader(files["f16"])
    names = {t.name: list(t.shape) for t in r.tensors}
    h = msm.SHAPES["tiny"].hidden
    assert names["token_embd.weight"] == [h, 49152]
    assert names["blk.1.ffn_down.weight"] == [msm.SHAPES["tiny"].intermediate, h]
    emb = next(t for t in r.tensors if t.name == "token_embd.weight").data
    assert abs(float(np.asarray(emb, dtype=np.float32).std()) - 0.02) < 0.002
