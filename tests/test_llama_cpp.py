"""The Model contract on the real llama.cpp engine with the real embedded model."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

import localrun
from localrun.errors import ContextOverflowError, FormatMismatchError, ModelFileError
from tests.conftest import requires_llama

pytestmark = requires_llama

GREEDY = {"temperature": 0.0, "max_tokens": 48}

# Simple questions a 135M model answers under greedy decoding, with accepted words.
ROBUST = [
    ("What is 2+2?", ("4", "four")),
    ("What is the opposite of hot?", ("cold",)),
    ("How many legs does a dog have?", ("4", "four")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What are the three primary colors?", ("red", "blue", "yellow")),
]


@pytest.mark.parametrize(("question", "words"), ROBUST)
def test_greedy_answers(llama_model: Any, question: str, words: tuple[str, ...]) -> None:
    c = llama_model.chat(question, **GREEDY)
    assert any(w in c.text.lower() for w in words), c.text


def test_completion_fields(llama_model: Any) -> None:
    c = llama_model.chat("What is 2+2?", **GREEDY)
    assert c.finish_reason == "stop"
    assert c.usage.prompt_tokens > 10
    assert c.usage.completion_tokens > 0
    t = c.timings
    assert 0 < t.ttft <= t.total
    assert t.prefill_tps > 0 and t.decode_tps > 0


def test_prompt_tokens_match_tokenizer(llama_model: Any) -> None:
    rendered = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    c = llama_model.chat("Hi", max_tokens=1)
    engine = llama_model._session._engine.llm  # the engine's own tokenizer, special tokens parsed
    assert c.usage.prompt_tokens == len(engine.tokenize(rendered.encode(), add_bos=False,
                                                        special=True))


def test_completion_tokens_counted(llama_model: Any) -> None:
    c = llama_model.complete("Once upon a time", max_tokens=7, temperature=0)
    assert c.finish_reason == "length"
    assert c.usage.completion_tokens == 7


def test_info(llama_model: Any) -> None:
    i = llama_model.info
    assert (i.backend, i.format, i.quantization) == ("llama.cpp", "gguf", "Q4_1")
    assert i.engine_version and i.engine_version != "unknown"
    assert i.context_length == 2048 and i.trained_context_length == 8192
    assert Path(i.path).is_file()


def test_stop_string_removed(llama_model: Any) -> None:
    full = llama_model.chat("Count from 1 to 10, separated by commas.", **GREEDY).text
    assert "5" in full, full
    c = llama_model.chat("Count from 1 to 10, separated by commas.", stop=["5"], **GREEDY)
    assert c.finish_reason == "stop"
    assert "5" not in c.text
    assert full.startswith(c.text)


def test_max_tokens_gives_length(llama_model: Any) -> None:
    c = llama_model.chat("Write a long story about a dragon.", temperature=0, max_tokens=5)
    assert c.finish_reason == "length"
    assert c.usage.completion_tokens == 5


def test_same_seed_same_text(llama_model: Any) -> None:
    kw = {"temperature": 1.0, "max_tokens": 24, "seed": 1234}
    a = llama_model.chat("Tell me about cats.", **kw).text
    b = llama_model.chat("Tell me about cats.", **kw).text
    others = {llama_model.chat("Tell me about cats.", temperature=1.0, max_tokens=24,
                               seed=s).text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1  # seeds actually change the sample


def test_stream_equals_non_stream(llama_model: Any) -> None:
    q = "Name three animals that live in the sea."
    c = llama_model.chat(q, **GREEDY)
    chunks = list(llama_model.stream(q, **GREEDY))
    assert "".join(ch.text for ch in chunks) == c.text
    last = chunks[-1]
    assert last.finish_reason == c.finish_reason
    assert last.usage == c.usage and last.timings is not None
    assert all(ch.usage is None for ch in chunks[:-1])


def test_threads_share_one_model(llama_model: Any) -> None:
    results: list[str] = []
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(3):
                c = llama_model.chat(f"Say the number {i * 3 + j}.", temperature=0, max_tokens=8)
                results.append(c.finish_reason)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert len(results) == 12


def test_context_overflow_is_typed(llama_model: Any) -> None:
    with pytest.raises(ContextOverflowError) as info:
        llama_model.chat("word " * 5000)
    e = info.value
    assert e.context == 2048 and e.prompt_tokens > 2048
    assert str(e.prompt_tokens) in str(e) and "2048" in str(e)
    assert "--context" in (e.hint or "")
    # and the model is still usable
    assert llama_model.chat("What is 2+2?", **GREEDY).text


def test_cancel_mid_stream(llama_model: Any) -> None:
    token = localrun.CancelToken()
    stream = llama_model.stream("Write a very long story about the sea.", temperature=0,
                                max_tokens=400, cancel=token)
    for n, _chunk in enumerate(stream, 1):
        if n == 5:
            token.cancel()
    assert stream.completion is not None
    assert stream.completion.finish_reason == "cancelled"
    assert stream.completion.usage.completion_tokens < 20
    assert llama_model.chat("What is 2+2?", **GREEDY).finish_reason == "stop"


def test_cancel_from_another_thread(llama_model: Any) -> None:
    token = localrun.CancelToken()
    timer = threading.Timer(0.3, token.cancel)
    timer.start()
    t0 = time.perf_counter()
    c = llama_model.chat("Write a very long essay about history.", temperature=0,
                         max_tokens=2000, cancel=token)
    assert c.finish_reason == "cancelled"
    assert time.perf_counter() - t0 < 10


def test_abandoned_stream_frees_the_model(llama_model: Any) -> None:
    stream = llama_model.stream("Tell me a story.", max_tokens=50)
    next(stream)
    stream.close()
    assert llama_model.chat("Hi", max_tokens=2).usage.completion_tokens >= 1


def test_same_thread_nested_call_is_refused(default_gguf: Path) -> None:
    # a model of its own: the shared one may have built its batcher (other tests), and
    # then a lone stream runs there and a nested call joins it (below)
    with localrun.load(str(default_gguf), context=256) as m:
        stream = m.stream("Tell me a story.", max_tokens=50)
        next(stream)  # the single path: this thread owns the engine
        with pytest.raises(localrun.LocalrunError, match="open stream"):
            m.chat("Hi")
        stream.close()
        assert m.max_concurrency >= 2  # builds the batcher: lone streams run there now
        stream = m.stream("Tell me a story.", max_tokens=50)
        next(stream)
        assert m.chat("Hi", max_tokens=2).usage.completion_tokens >= 1
        stream.close()


def test_raw_completion(llama_model: Any) -> None:
    c = llama_model.complete("The capital of France is", temperature=0, max_tokens=5)
    assert "paris" in c.text.lower()


@pytest.mark.parametrize("cut", ["half", "garbage"])
def test_damaged_gguf_is_typed_error(default_gguf: Path, tmp_path: Path, cut: str) -> None:
    bad = tmp_path / "bad.gguf"
    data = default_gguf.read_bytes()
    bad.write_bytes(data[: len(data) // 2] if cut == "half" else b"GGUF\x03" + b"\x00" * 4000)
    with pytest.raises(ModelFileError):
        localrun.load(str(bad))
    # the process survived; a good model still loads
    with localrun.load(str(default_gguf), context=256) as m:
        assert m.chat("Hi", max_tokens=2).usage.completion_tokens >= 1


def test_default_model_and_alias() -> None:
    with localrun.load(context=256) as m:
        assert m.info.quantization == "Q4_1"
    with localrun.load("smollm2:135m", context=256) as m:
        assert m.info.format == "gguf"


def test_unknown_model_suggests() -> None:
    with pytest.raises(localrun.UnknownModelError) as info:
        localrun.load("smollm2:13m")
    assert "smollm2:135m" in str(info.value)


def test_closed_model(default_gguf: Path) -> None:
    m = localrun.load(str(default_gguf), context=256)
    m.close()
    m.close()  # idempotent
    with pytest.raises(localrun.LocalrunError, match="closed"):
        m.chat("Hi")


def test_gguf_on_mlx_is_refused_before_import(default_gguf: Path) -> None:
    with pytest.raises(FormatMismatchError) as info:
        localrun.load(str(default_gguf), backend="mlx")
    assert "--backend llama.cpp" in (info.value.hint or "")


# -- device, offload, flash attention and engine options (issue 11, item 6) --------------
#
# llama-cpp-python here is a CPU build: it accepts the GPU arguments and ignores them, so
# the real Llama runs behind a recorder that checks every keyword against the real
# signature (Llama(**kwargs) swallows unknown names: a misspelt one would pass silently).
# What a GPU build then does with them is untested here.


class LlamaRecorder:
    """Stands in for llama_cpp.Llama: records the keywords, then builds the real one."""

    calls: ClassVar[list[dict[str, Any]]] = []

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        import inspect

        import llama_cpp

        real = llama_cpp.llama.Llama
        params = inspect.signature(real.__init__).parameters
        named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        unknown = set(kwargs) - named
        assert not unknown, f"Llama() would swallow {unknown}"
        cls.calls.append(dict(kwargs))
        return real(*args, **kwargs)


@pytest.fixture()
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    import llama_cpp

    from localrun.backends.llama_cpp import devices as backend

    LlamaRecorder.calls = []
    monkeypatch.setattr(llama_cpp, "Llama", LlamaRecorder)
    # no NVML on this host: say nothing about free VRAM unless a test does
    monkeypatch.setattr(backend, "free_vram", lambda kind, indices: None, raising=False)
    return LlamaRecorder.calls


def test_cpu_device_offloads_nothing(default_gguf: Path, recorded: list[dict[str, Any]]
                                     ) -> None:
    with localrun.load(str(default_gguf), device="cpu", context=256) as m:
        assert recorded[-1]["n_gpu_layers"] == 0
        assert m.info.device == "cpu"


def test_cuda_index_pins_one_gpu(default_gguf: Path, recorded: list[dict[str, Any]]) -> None:
    import llama_cpp

    with localrun.load(str(default_gguf), device="cuda:1", context=256) as m:
        kw = recorded[-1]
        assert kw["main_gpu"] == 1 and kw["split_mode"] == llama_cpp.LLAMA_SPLIT_MODE_NONE
        assert kw["n_gpu_layers"] == -1
        assert m.chat("Hi", max_tokens=2).usage.completion_tokens >= 1  # CPU build: runs
        assert m.info.device == "cpu"  # this build cannot offload: it says where it runs


def test_several_gpus_split_layers_by_free_vram(default_gguf: Path,
                                                recorded: list[dict[str, Any]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import llama_cpp

    from localrun.backends.llama_cpp import devices as backend

    monkeypatch.setattr(backend, "free_vram", lambda kind, indices: [6 * 2**30, 2 * 2**30])
    with localrun.load(str(default_gguf), device="cuda:2,0", context=256):
        kw = recorded[-1]
        assert kw["split_mode"] == llama_cpp.LLAMA_SPLIT_MODE_LAYER
        assert kw["tensor_split"] == [6 * 2**30, 0.0, 2 * 2**30]  # GPU 1 left out
        assert "main_gpu" not in kw and kw["n_gpu_layers"] == -1


def test_model_larger_than_free_vram_is_partly_offloaded(
        default_gguf: Path, recorded: list[dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from localrun.backends.llama_cpp import devices as backend
    from localrun.memory import overhead_bytes

    size = default_gguf.stat().st_size
    layers = []
    for free in (overhead_bytes(size) + size // 4, overhead_bytes(size) + size // 2):
        monkeypatch.setattr(backend, "free_vram", lambda kind, indices, f=free: [f])
        with localrun.load(str(default_gguf), device="cuda:0", context=256) as m:
            n = recorded[-1]["n_gpu_layers"]
            offload = m._session.placement.offload
            assert offload is not None and offload.total == 31  # 30 blocks + output
            assert 0 < n < 31 and n == offload.layers
            assert f"{n}/31 layers" in m._session.placement.device
        layers.append(n)
    assert layers[0] < layers[1]  # more free VRAM, more layers
    # everything fits: all layers; nothing fits: the CPU
    monkeypatch.setattr(backend, "free_vram", lambda kind, indices: [8 * 2**30])
    with localrun.load(str(default_gguf), device="cuda:0", context=256):
        assert recorded[-1]["n_gpu_layers"] == -1
    monkeypatch.setattr(backend, "free_vram", lambda kind, indices: [64 * 2**20])
    with localrun.load(str(default_gguf), device="cuda:0", context=256) as m:
        assert recorded[-1]["n_gpu_layers"] == 0
        assert m._session.placement.device == "cpu"
    # an explicit n_gpu_layers wins over the estimate
    with localrun.load(str(default_gguf), device="cuda:0", context=256, n_gpu_layers=7):
        assert recorded[-1]["n_gpu_layers"] == 7


def test_flash_attention_follows_llama_server(default_gguf: Path,
                                              recorded: list[dict[str, Any]]) -> None:
    import llama_cpp

    with localrun.load(str(default_gguf), context=256) as m:
        # llama-cpp-python 0.3.x maps the bool to enabled/disabled (no "auto"): auto = on
        assert recorded[-1]["flash_attn"] is True
        ctx = m._session._engine.llm.context_params
        assert ctx.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        assert m.chat("What is 2+2?", **GREEDY).finish_reason == "stop"
    with localrun.load(str(default_gguf), context=256, flash_attn=False) as m:
        assert recorded[-1]["flash_attn"] is False
        ctx = m._session._engine.llm.context_params
        assert ctx.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    # a quantized KV cache (it needs flash attention) loads and answers
    with localrun.load(str(default_gguf), context=256, kv_cache="q8_0") as m:
        assert recorded[-1]["type_k"] == recorded[-1]["type_v"] == llama_cpp.GGML_TYPE_Q8_0
        assert m.chat("Hi", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(localrun.LocalrunError, match="needs flash attention"):
        localrun.load(str(default_gguf), context=256, kv_cache="q4_0", flash_attn=False)


def test_auto_flash_attention_on_a_tristate_binding(default_gguf: Path) -> None:
    """A llama-cpp-python that takes flash_attn_type gets llama.cpp's own AUTO."""
    from localrun.backends.llama_cpp.devices import placement
    from localrun.formats.gguf import read_gguf

    gguf = read_gguf(default_gguf)
    kw = placement(None, {}, gguf, 256, flash_attn_type=True).kwargs
    assert kw["flash_attn_type"] == "LLAMA_FLASH_ATTN_TYPE_AUTO" and "flash_attn" not in kw
    kw = placement(None, {"flash_attn": False}, gguf, 256, flash_attn_type=True).kwargs
    assert kw["flash_attn_type"] == "LLAMA_FLASH_ATTN_TYPE_DISABLED"


def test_unknown_engine_option_is_refused_with_the_valid_ones(
        default_gguf: Path, recorded: list[dict[str, Any]]) -> None:
    from localrun.errors import InvalidOptionError, UnknownOptionError

    with pytest.raises(UnknownOptionError) as info:
        localrun.load(str(default_gguf), context=256, flash_atn=True)
    e = info.value
    assert "flash_atn" in str(e) and "did you mean flash_attn" in str(e)
    assert "n_gpu_layers" in (e.hint or "") and "kv_cache" in (e.hint or "")
    assert not recorded  # refused before the engine saw it
    with pytest.raises(InvalidOptionError, match="n_gpu_layers"):
        localrun.load(str(default_gguf), context=256, n_gpu_layers="all")
    with pytest.raises(localrun.LocalrunError, match="Unknown device 'tpu'"):
        localrun.load(str(default_gguf), context=256, device="tpu")


def test_threads_caps_prompt_threads_too(default_gguf: Path) -> None:
    """``threads=1`` is one thread for prompts as well as for decoding (llama.cpp's own
    ``-t``); left alone, llama-cpp-python would give prompts every logical CPU."""
    with localrun.load(str(default_gguf), backend="llama.cpp", context=512, threads=1) as m:
        params = m._session._engine.llm.context_params
        assert (params.n_threads, params.n_threads_batch) == (1, 1)
