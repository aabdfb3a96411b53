"""Images on OpenVINO GenAI through VLMPipeline, with the vl-openvino fixture (the tiny
random Qwen2.5-VL's IR): localrun's Python API end to end, and its counts against the
engine's own."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.imageutil import data_uri, png
from tests.models import test_model

pytest.importorskip("PIL", reason="Pillow is not installed (pip install -e '.[openvino]')")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("openvino_genai") is None,
                                reason="openvino-genai is not installed "
                                "(pip install -e '.[openvino]')")

IMG = png(112, 84)  # 8x6 patches of 14 -> 4x3 merged: 12 image embeddings
OTHER = png(112, 84, seed=90)
TEXT = "Describe this."
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12}


def ask(*images: bytes) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": data_uri(i)}} for i in images),
        {"type": "text", "text": TEXT}]}]


@pytest.fixture(scope="module")
def vl() -> Iterator[Any]:
    import localrun

    with localrun.load(str(test_model("vl-openvino")), backend="openvino", context=2048,
                       threads=1) as m:
        yield m


def engine_count(m: Any) -> int:
    return int(m._session.last_perf.get_num_input_tokens())


def test_a_vlm_folder_loads_on_vlmpipeline(vl: Any) -> None:
    assert type(vl._session).__name__ == "OpenVINOVisionSession"
    assert vl._session.accepts_images and vl.info.backend == "openvino"


def test_an_image_changes_the_reply_and_the_counts_are_the_engines(vl: Any) -> None:
    text = vl.chat(TEXT, **GREEDY)
    assert text.usage.prompt_tokens == engine_count(vl)
    one = vl.chat(ask(IMG), **GREEDY)
    assert one.usage.prompt_tokens == engine_count(vl) == text.usage.prompt_tokens + 14
    assert one.text.strip() and one.text != text.text
    two = vl.chat(ask(IMG, OTHER), **GREEDY)
    assert two.usage.prompt_tokens == engine_count(vl) == one.usage.prompt_tokens + 14
    assert vl.chat(ask(OTHER), **GREEDY).text != one.text


def test_the_reply_is_vlmpipelines_own(vl: Any) -> None:
    """The raw pipeline (its own chat template, the image first) answers alike."""
    import openvino as ov
    import openvino_genai

    from localrun.images import read_image

    pipe = openvino_genai.VLMPipeline(str(test_model("vl-openvino")), "CPU")
    cfg = openvino_genai.GenerationConfig()
    cfg.max_new_tokens = 12
    raw = pipe.generate(TEXT, images=[ov.Tensor(read_image(IMG).array())],
                        generation_config=cfg)
    assert vl.chat(ask(IMG), **GREEDY).text == raw.texts[0]


def test_image_in_turn_1_question_in_turn_2_and_streaming(vl: Any) -> None:
    first = vl.chat(ask(IMG), **GREEDY)
    convo = [*ask(IMG), {"role": "assistant", "content": first.text},
             {"role": "user", "content": "And the colours?"}]
    second = vl.chat(convo, **GREEDY)
    assert second.text.strip() and second.usage.prompt_tokens == engine_count(vl)
    chunks = list(vl.stream(convo, **GREEDY))
    assert "".join(c.text for c in chunks) == second.text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == second.usage.prompt_tokens


@pytest.mark.parametrize("every", [0.0, 60.0])
def test_tokens_cross_to_the_caller_in_lists_and_none_is_lost(
        vl: Any, every: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The streamer wakes the caller for the first token, then at most every
    ``WAKE_EVERY_S`` with the tokens since: woken for every token (0 s) or only for the
    first and at the end (60 s), the stream is the same reply, a piece per token, and
    the counts are the engine's."""
    from localrun.backends._worker import Relay
    from localrun.backends.openvino import vision

    want = vl.chat(ask(IMG), **GREEDY)
    wakes: list[int] = []
    put = Relay.put

    def counted(self: Any, piece: Any) -> None:
        wakes.append(len(piece))
        put(self, piece)

    monkeypatch.setattr(vision, "WAKE_EVERY_S", every)
    monkeypatch.setattr(Relay, "put", counted)
    chunks = list(vl.stream(ask(IMG), **GREEDY))
    assert "".join(c.text for c in chunks) == want.text
    assert chunks[-1].usage == want.usage
    n = want.usage.completion_tokens
    assert n > 2 and sum(wakes) == n
    assert wakes == ([1] * n if every == 0 else [1, n - 1]), wakes


class Spy:
    """The session's pipeline or tokenizer, counting calls by name and recording the
    thread of each ``generate``."""

    def __init__(self, real: Any) -> None:
        self.real, self.calls, self.threads = real, [], []

    def __getattr__(self, name: str) -> Any:
        import threading

        attr = getattr(self.real, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **k: Any) -> Any:
            self.calls.append(name)
            self.threads.append(threading.current_thread())
            return attr(*a, **k)

        return call


def test_requests_run_on_the_sessions_one_thread_until_it_closes() -> None:
    """Every call on one thread of the session's (before: a new thread per request paid
    for the CPU plugin's per-thread state each time, docs/results/images.md); closing
    the model ends it."""
    import threading

    import localrun

    m = localrun.load(str(test_model("vl-openvino")), backend="openvino", context=2048,
                      threads=1)
    try:
        pipe = m._session._pipe = Spy(m._session._pipe)
        m.chat(ask(IMG), **GREEDY)
        list(m.stream(ask(IMG), **GREEDY))
        m.chat(TEXT, **GREEDY)
        assert pipe.calls == ["generate"] * 3
        [thread] = set(pipe.threads)
        assert thread is not threading.current_thread() and thread.is_alive()
    finally:
        m.close()
    assert not thread.is_alive()


def test_a_prompt_with_images_is_tokenized_once(vl: Any) -> None:
    """localrun counts the text's tokens in one tokenizer call and adds the images'
    (before: the rendered prompt was tokenized again without its markers); the count is
    still the engine's. The reply is detokenized on the caller's thread (before: on the
    engine's streamer thread, inside its callback)."""
    import threading

    session = vl._session
    real, real_decode = session._tok, session._decode
    session._tok = tok = Spy(real)
    decodes: list[Any] = []

    def decode(lists: list[list[int]]) -> list[str]:
        decodes.append(threading.current_thread())
        return real_decode(lists)  # type: ignore[no-any-return]

    session._decode = decode
    try:
        one = vl.chat(ask(IMG, OTHER), **GREEDY)
    finally:
        session._tok, session._decode = real, real_decode
    assert tok.calls.count("encode") == 1
    assert one.usage.prompt_tokens == engine_count(vl)
    assert decodes and set(decodes) == {threading.current_thread()}


def test_replies_stream_through_the_tokenizers_library_where_it_decodes_alike(
        vl: Any, tmp_path: Path) -> None:
    """The ``tokenizers`` library decodes each streamed token where it turns the sample
    texts' tokens back as OpenVINO's detokenizer does (before: OpenVINO's detokenizer,
    a model run per token); a folder without tokenizer.json, or a tokenizer that decodes
    otherwise, keeps OpenVINO's. The reply is the same either way."""
    pytest.importorskip("tokenizers", reason="the tokenizers library is not installed "
                        "(pip install -e '.[openvino]')")
    from localrun.backends.openvino.vision import fast_decode

    session = vl._session
    tok, folder = session._tok, Path(session.info.path)

    def encode(t: str) -> list[int]:
        return session._encode(t, special=False)  # type: ignore[no-any-return]

    eos = tok.get_eos_token_id()
    assert session._decode.__module__ == "localrun.backends.openvino.vision"
    assert fast_decode(folder, tok, encode, eos) is not tok.decode
    assert fast_decode(tmp_path, tok, encode, eos) == tok.decode  # no tokenizer.json

    class Otherwise:
        def decode(self, lists: list[list[int]]) -> list[str]:
            return [t.upper() for t in tok.decode(lists)]

    other = Otherwise()
    assert fast_decode(folder, other, encode, eos) == other.decode
    fast = vl.chat(ask(IMG), **GREEDY)
    session._decode = tok.decode
    try:
        assert vl.chat(ask(IMG), **GREEDY).text == fast.text
        assert "".join(c.text for c in vl.stream(ask(IMG), **GREEDY)) == fast.text
    finally:
        session._decode = fast_decode(folder, tok, encode, eos)


def test_the_image_token_budget_scales_a_large_image_down() -> None:
    import localrun

    with localrun.load(str(test_model("vl-openvino")), backend="openvino", context=2048,
                       threads=1, image_tokens=64) as m:
        text = m.chat(TEXT, **GREEDY)
        big = m.chat(ask(png(448, 448)), **GREEDY)  # 256 embeddings unscaled
        assert big.usage.prompt_tokens == engine_count(m)
    assert 0 < big.usage.prompt_tokens - text.usage.prompt_tokens <= 64 + 2


def test_a_text_only_openvino_model_refuses_images() -> None:
    import localrun
    from localrun.images import ImagesUnsupportedError

    with localrun.load(str(test_model("openvino-int4")), backend="openvino", context=512,
                       threads=1) as m, pytest.raises(ImagesUnsupportedError,
                                                      match="images is not available"):
        m.chat(ask(IMG), max_tokens=2)


def test_bench_image_on_openvino(tmp_path: Path) -> None:
    from localrun.bench import BenchConfig, run_bench

    f = tmp_path / "img.png"
    f.write_bytes(IMG)
    report = run_bench(BenchConfig(
        models=(str(test_model("vl-openvino")),), backend="openvino", prompt_tokens=(16,),
        gen_tokens=4, concurrency=(1,), runs=2, warmup=1, image=str(f),
        bandwidth_bytes=16 * 2**20))
    [im] = report.results[0].images
    assert im.image_tokens == 14
    assert im.encode_s is not None and im.encode_s.p50 > 0
