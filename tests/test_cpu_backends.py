"""What the CPU backends share since issue 12: the driver's token limit and seed, and one
ChatTemplateError, on every CPU engine with the real fixture models (tests/models.py).

The driver hands each backend ``max_tokens`` already clamped to the context and a seed
that is always an int; a backend only does engine work with them. A chat template that
refuses a conversation is one typed error, with the template's own words, on every engine.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import localrun
from localrun.backends import BACKENDS, is_installed
from localrun.errors import ChatTemplateError
from localrun.templates import render_chat
from localrun.types import Message
from tests.fake_openai import FakeOpenAI
from tests.models import test_model

#: (backend, fixture): one fixture per CPU engine.
CASES: tuple[tuple[str, str], ...] = (
    ("llama.cpp", "gguf-q4_1"),
    ("mlx", "mlx-4bit"),
    ("openvino", "openvino-int4"),
    ("onnx", "onnx-int4"),
)
IDS = [b for b, _ in CASES]

#: small, so that a reply runs into the context's end within a few dozen tokens
CONTEXT = 256

#: Mistral's rule, as its templates word it: two turns of one role in a row are refused.
REFUSING = (
    "{% for m in messages %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TWO_USERS: list[Message] = [{"role": "user", "content": "Hi"},
                            {"role": "user", "content": "Hello?"}]


def _skip_unless_installed(backend: str) -> None:
    if not is_installed(backend):
        spec = BACKENDS[backend]
        pytest.skip(f"{spec.title} is not installed (pip install -e '.[{spec.extra}]')")


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def small(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """(backend, Model) loaded with a context of CONTEXT tokens, once for this module."""
    backend, fixture = request.param
    _skip_unless_installed(backend)
    with localrun.load(str(test_model(fixture)), backend=backend, context=CONTEXT) as model:
        yield backend, model


# -- the token limit -------------------------------------------------------------------


def test_reply_stops_at_the_context_end(small: tuple[str, Any]) -> None:
    """max_tokens far past the context: the driver clamps it, the engine stops there and
    says "length", and the prompt and the reply fill the context exactly."""
    _, model = small
    prompt = ", ".join(str(i) for i in range(1, 50)) + ","
    c = model.complete(prompt, temperature=0, max_tokens=1000)
    assert c.finish_reason == "length", c.text
    assert c.usage.prompt_tokens + c.usage.completion_tokens == CONTEXT
    assert c.usage.completion_tokens > 10  # the counting went on to the end
    # a request that fits is untouched: exactly max_tokens
    d = model.complete(prompt, temperature=0, max_tokens=5)
    assert (d.finish_reason, d.usage.completion_tokens) == ("length", 5)
    assert c.text.startswith(d.text)


# -- the seed --------------------------------------------------------------------------


def test_unseeded_calls_sample_and_seeded_ones_repeat(small: tuple[str, Any]) -> None:
    """Without a seed the driver draws one per call (any 32-bit value): the replies vary
    and no engine refuses the seed; the largest seed there is repeats like any other."""
    _, model = small
    kw: dict[str, Any] = {"temperature": 1.0, "max_tokens": 8}
    texts = [model.chat("Tell me about cats.", **kw).text for _ in range(4)]
    assert len(set(texts)) > 1, texts
    top = 2**32 - 1
    a = model.chat("Tell me about cats.", seed=top, **kw).text
    assert a == model.chat("Tell me about cats.", seed=top, **kw).text


def test_onnx_takes_every_32_bit_seed() -> None:
    """localrun samples ONNX Runtime GenAI's tokens itself (numpy's PCG64, seeded per
    call), so a seed counts in full: s and s + 2**31 sample differently (the engine's
    int32 random_seed, used before, took seeds mod 2**31)."""
    _skip_unless_installed("onnx")
    kw: dict[str, Any] = {"temperature": 1.0, "max_tokens": 10}
    with localrun.load(str(test_model("onnx-int4")), backend="onnx", context=CONTEXT) as m:
        low = m.chat("Tell me about dogs.", seed=2**31 - 1, **kw).text
        high = m.chat("Tell me about dogs.", seed=2**32 - 1, **kw).text
        assert high != low
        assert m.chat("Tell me about dogs.", seed=2**32 - 1, **kw).text == high


def test_remote_sends_the_drawn_seed() -> None:
    """The remote backend sends the seed the driver gives, drawn per call when unset."""
    server = FakeOpenAI(["org/model"], max_model_len=64).start()
    try:
        with localrun.load("org/model", backend="remote", base_url=server.url) as m:
            for _ in range(3):
                m.chat([{"role": "user", "content": "a b c"}], temperature=0.8, max_tokens=2)
        seeds = [r["seed"] for r in server.requests if "messages" in r]
    finally:
        server.stop()
    assert len(seeds) == 3 and all(isinstance(s, int) and 0 <= s < 2**32 for s in seeds)
    assert len(set(seeds)) > 1


# -- ChatTemplateError -------------------------------------------------------------------


def _refusing_copy(src: Path, dst: Path) -> Path:
    """The fixture folder (symlinks) with its chat template replaced by REFUSING, where
    each engine reads it: chat_template.jinja / tokenizer_config.json (MLX, ONNX), the
    tokenizer IR's rt_info (OpenVINO)."""
    folder = dst / src.name
    folder.mkdir()
    edits: dict[str, Callable[[str], str]] = {
        "chat_template.jinja": lambda _: REFUSING,
        "tokenizer_config.json": lambda t: json.dumps(
            {k: v for k, v in json.loads(t).items() if k != "chat_template"}),
        "openvino_tokenizer.xml": lambda t: re.sub(
            r'(<chat_template value=")[^"]*"',
            lambda m: m.group(1) + html.escape(REFUSING, quote=True) + '"', t),
    }
    for f in src.iterdir():
        if f.name in edits:
            (folder / f.name).write_text(edits[f.name](f.read_text(encoding="utf-8")),
                                         encoding="utf-8")
        else:
            (folder / f.name).symlink_to(f)
    return folder


@pytest.mark.parametrize(("backend", "fixture"), CASES, ids=IDS)
def test_template_refusal_is_one_typed_error(backend: str, fixture: str,
                                             tmp_path: Path) -> None:
    """Each engine renders the model's own template its own way (Jinja in localrun or
    transformers, Minja in OpenVINO and ONNX Runtime GenAI); a refusal is the same
    ChatTemplateError everywhere: the template's words, the roles sent, the hint, and
    none of the engines' source locations or template listings."""
    _skip_unless_installed(backend)
    src = test_model(fixture)
    path = src if src.is_file() else _refusing_copy(src, tmp_path)
    with localrun.load(str(path), backend=backend, context=CONTEXT) as model:
        if src.is_file():  # a GGUF carries its template inside: swap the one it read
            model._session._template = REFUSING  # type: ignore[union-attr]
        with pytest.raises(ChatTemplateError) as info:
            model.chat(TWO_USERS, max_tokens=2)
        e = info.value
        assert e.reason == "Conversation roles must alternate user/assistant/user/assistant/..."
        assert e.roles == ["user", "user"]
        assert "roles sent: user, user" in str(e) and "alternate" in (e.hint or "")
        assert isinstance(e, ValueError)  # the server answers it with 400
        # the model is still usable, with a conversation the template takes
        ok: list[Message] = [{"role": "user", "content": "Hi"}]
        assert model.chat(ok, temperature=0, max_tokens=2).usage.completion_tokens >= 1


def test_template_errors_of_any_kind_are_chat_template_errors() -> None:
    """Not only raise_exception: a template that fails while rendering (here it adds a
    missing content to a string) is the same typed error, not a TypeError traceback."""
    with pytest.raises(ChatTemplateError, match="roles sent: assistant") as info:
        render_chat("{{ messages[0]['role'] + messages[0]['content'] }}",
                    [{"role": "assistant", "content": None}])
    assert "concatenate" in info.value.reason or "NoneType" in info.value.reason
    with pytest.raises(ChatTemplateError, match="alternate"):
        render_chat(REFUSING, TWO_USERS)


# -- the one memory contract -------------------------------------------------------------


def test_footprint_of_one_and_four_is_what_the_engine_holds_and_the_server_counts(
        small: tuple[str, Any]) -> None:
    """``Model.footprint``: for one sequence, the model's estimate (weights, overhead, one
    KV cache) and what it keeps between calls; four at once add what the engine really
    holds for them: llama.cpp a KV stream of the context per slot, said before its batch
    context is built and then allocated as that (its own count of cells); MLX one
    context's KV cache per sequence beyond the first; OpenVINO nothing (one paged cache);
    ONNX Runtime GenAI runs one at a time. The server's sizing counts exactly that."""
    from localrun.server.config import ServerConfig
    from localrun.server.loaded import wanted

    backend, model = small
    session = model._session
    est = session.estimate()
    assert est is not None and est.total_bytes > est.weights_bytes > 0
    kv = est.kv_cache_bytes
    batcher = getattr(session, "_batcher", None)
    built = backend == "llama.cpp" and batcher is not None  # an earlier test overlapped
    one, four = model.footprint(1), model.footprint(4)
    assert one.slots == 1 and one.running == est.total_bytes + (
        batcher.reserved_bytes if built else 0)
    assert four.kept == one.kept and (one.kept > 0) == (backend == "mlx")
    if backend == "llama.cpp" and not built:
        from localrun.backends.llama_cpp.memory import kv_bytes_per_token

        assert kv > 0 and four == replace(one, slots=4, per_slot=kv)  # a stream per slot
        assert getattr(session, "_batcher", None) is None  # asking built nothing
        model.limit_concurrency(4)
        assert model.max_concurrency == 4  # built now, as sized
        cells = int(session.engine.lc.llama_n_ctx(session._batcher._ctx))
        assert cells * kv_bytes_per_token(session.engine) == four.total - one.total
        assert model.footprint(1).total == model.footprint(4).total == four.total  # held
    elif backend == "mlx":
        assert kv > 0 and four.per_slot == kv and four.slots == min(4, model.max_concurrency)
        assert four.total - one.total == (four.slots - 1) * kv
    elif backend == "openvino":
        assert four.per_slot == 0 and four.total == one.total
        assert four.slots == min(4, model.max_concurrency) > 1
    elif backend == "onnx":
        assert four == one and model.max_concurrency == 1
    batch = wanted(ServerConfig(parallel=4), "m", "chat", model)
    assert batch.one.total == model.footprint(1).total
    assert batch.size(batch.want) == model.footprint(batch.want).total
