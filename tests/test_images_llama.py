"""Images on llama.cpp through mtmd, with the vl-gguf fixture (a tiny random Qwen2.5-VL:
its text GGUF and its mmproj beside it): localrun's Python API end to end."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HAVE_LLAMA
from tests.imageutil import data_uri, png
from tests.models import test_model

pytest.importorskip("PIL", reason="Pillow is not installed (pip install -e '.[llama-cpp]')")
pytestmark = pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not installed "
                                "(pip install -e '.[llama-cpp]')")

IMG = png(112, 84)  # 8x6 patches of 14 -> 4x3 merged: 12 image embeddings
OTHER = png(112, 84, seed=90)
TEXT = "Describe this."
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12}


def ask(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def image(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_uri(data)}}


@pytest.fixture(scope="module")
def vl() -> Iterator[Any]:
    import localrun

    with localrun.load(str(test_model("vl-gguf")), backend="llama.cpp", context=2048,
                       threads=1) as m:
        yield m


def test_the_projector_beside_the_gguf_is_found(vl: Any) -> None:
    assert vl._session.accepts_images
    assert Path(vl._session._vision.projector).name == "mmproj-Tiny-Qwen2.5-VL.F16.gguf"


def test_an_image_changes_the_greedy_reply_and_counts_its_tokens(vl: Any) -> None:
    text = vl.chat(TEXT, **GREEDY)
    with_image = vl.chat(ask(image(IMG), TEXT), **GREEDY)
    assert text.text.strip() and with_image.text.strip()
    assert with_image.text != text.text
    # 12 embeddings + <|vision_start|> + <|vision_end|> (mtmd adds both)
    assert with_image.usage.prompt_tokens == text.usage.prompt_tokens + 14
    assert vl.count_prompt_tokens(ask(image(IMG), TEXT)) == with_image.usage.prompt_tokens
    other = vl.chat(ask(image(OTHER), TEXT), **GREEDY)
    assert other.text != with_image.text  # the pixels matter, not only that there is one


def test_the_reply_is_llama_cpp_pythons_own_for_the_same_image(vl: Any) -> None:
    """MTMDChatHandler (llama-cpp-python's own path) answers the same conversation with
    the same greedy reply: the same prompt reaches the same context."""
    import llama_cpp.mtmd_cpp  # noqa: F401 - the quiet log callback is localrun's already
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import MTMDChatHandler

    folder = test_model("vl-gguf")
    handler = MTMDChatHandler(clip_model_path=str(folder / "mmproj-Tiny-Qwen2.5-VL.F16.gguf"),
                              verbose=False)
    llm = Llama(str(folder / "Tiny-Qwen2.5-VL.F16.gguf"), chat_handler=handler, n_ctx=2048,
                verbose=False, seed=0, n_threads=1)
    try:
        uri = data_uri(IMG)
        raw = llm.create_chat_completion(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                          {"type": "text", "text": TEXT}]}],
            max_tokens=12, temperature=0.0)
    finally:
        llm.close()
    assert vl.chat(ask(image(IMG), TEXT), **GREEDY).text == raw["choices"][0]["message"][
        "content"]


def test_two_images_in_one_message(vl: Any) -> None:
    one = vl.chat(ask(image(IMG), TEXT), **GREEDY)
    two = vl.chat(ask(image(IMG), image(OTHER), TEXT), **GREEDY)
    assert two.text.strip() and two.usage.prompt_tokens == one.usage.prompt_tokens + 14


def test_an_image_in_turn_1_and_a_question_in_turn_2(vl: Any) -> None:
    first = ask(image(IMG), TEXT)
    reply = vl.chat(first, **GREEDY)
    convo = [*first, {"role": "assistant", "content": reply.text},
             {"role": "user", "content": "And the colours?"}]
    second = vl.chat(convo, **GREEDY)
    plain = vl.chat([{"role": "user", "content": TEXT},
                     {"role": "assistant", "content": reply.text},
                     {"role": "user", "content": "And the colours?"}], **GREEDY)
    assert second.text.strip()
    assert second.usage.prompt_tokens == plain.usage.prompt_tokens + 14
    assert second.text != plain.text


def test_streaming_gives_the_same_reply_and_usage(vl: Any) -> None:
    whole = vl.chat(ask(image(IMG), TEXT), **GREEDY)
    chunks = list(vl.stream(ask(image(IMG), TEXT), **GREEDY))
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_image_as_bytes_path_and_ollama_images_are_the_same(vl: Any, tmp_path: Path) -> None:
    f = tmp_path / "img.png"
    f.write_bytes(IMG)
    want = vl.chat(ask(image(IMG), TEXT), **GREEDY).text
    assert vl.chat(ask({"type": "image", "image": IMG}, TEXT), **GREEDY).text == want
    assert vl.chat(ask({"type": "image", "image": str(f)}, TEXT), **GREEDY).text == want
    assert vl.chat([{"role": "user", "content": TEXT, "images": [f]}], **GREEDY).text == want


def test_batch_with_images_runs_each_alone_and_matches(vl: Any) -> None:
    items: list[Any] = [ask(image(IMG), TEXT), TEXT, ask(image(OTHER), TEXT)]
    got = vl.batch(items, **GREEDY)
    assert [c.text for c in got] == [vl.chat(i, **GREEDY).text for i in items]


def test_a_text_call_after_an_image_call_is_unchanged(vl: Any) -> None:
    before = vl.chat(TEXT, **GREEDY)
    vl.chat(ask(image(IMG), TEXT), **GREEDY)
    after = vl.chat(TEXT, **GREEDY)
    assert (after.text, after.usage) == (before.text, before.usage)


def test_the_image_token_budget_scales_a_large_image_down() -> None:
    import localrun

    big = png(448, 448)  # 16x16 merged = 256 embeddings unscaled
    with localrun.load(str(test_model("vl-gguf")), backend="llama.cpp", context=2048,
                       threads=1, image_tokens=64) as m:
        small = m.chat(ask(image(big), TEXT), **GREEDY)
        text = m.chat(TEXT, **GREEDY)
    assert 0 < small.usage.prompt_tokens - text.usage.prompt_tokens <= 64 + 2


def test_a_text_only_model_refuses_images_naming_what_can() -> None:
    import localrun
    from localrun.images import ImagesUnsupportedError

    with localrun.load(str(test_model("gguf-q4_1")), backend="llama.cpp", context=512,
                       threads=1) as m:
        with pytest.raises(ImagesUnsupportedError) as e:
            m.chat(ask(image(IMG), TEXT), max_tokens=2)
        assert "without a vision projector" in e.value.message
        assert "mmproj" in (e.value.hint or "")
        assert m.chat("Hi", max_tokens=2).text is not None  # still usable


def test_a_missing_mmproj_option_is_a_model_file_error(tmp_path: Path) -> None:
    import localrun
    from localrun.errors import ModelFileError

    with pytest.raises(ModelFileError, match="the mmproj file does not exist"):
        localrun.load(str(test_model("vl-gguf")), backend="llama.cpp", context=512,
                      mmproj=str(tmp_path / "none.gguf"))


def test_an_explicit_mmproj_and_base64_roundtrip(tmp_path: Path) -> None:
    import localrun

    folder = test_model("vl-gguf")
    alone = tmp_path / "model.gguf"
    alone.symlink_to(folder / "Tiny-Qwen2.5-VL.F16.gguf")
    with localrun.load(str(alone), backend="llama.cpp", context=512, threads=1) as m:
        assert not m._session.accepts_images  # nothing beside it
    with localrun.load(str(alone), backend="llama.cpp", context=512, threads=1,
                       mmproj=str(folder / "mmproj-Tiny-Qwen2.5-VL.F16.gguf")) as m:
        uri = "data:image/png;base64," + base64.b64encode(IMG).decode()
        assert m.chat(ask({"type": "image_url", "image_url": {"url": uri}}, TEXT),
                      **GREEDY).text.strip()


def test_bench_image_reports_tokens_encode_time_and_prefill_per_token(tmp_path: Path) -> None:
    from localrun.bench import BenchConfig, run_bench

    f = tmp_path / "img.png"
    f.write_bytes(IMG)
    report = run_bench(BenchConfig(
        models=(str(test_model("vl-gguf")),), backend="llama.cpp", prompt_tokens=(16,),
        gen_tokens=4, concurrency=(1,), runs=2, warmup=1, image=str(f),
        bandwidth_bytes=16 * 2**20))
    [im] = report.results[0].images
    assert (im.width, im.height, im.image_tokens) == (112, 84, 14)
    assert im.encode_s is not None and im.encode_s.p50 > 0
    assert im.prefill_per_image_token_s is not None
    assert report.to_dict()["workload"]["image"] == str(f)
