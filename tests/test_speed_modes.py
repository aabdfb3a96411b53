"""Fast by default, exact on request (issue 30, item 1), on every CPU engine here.

The default mode reuses every KV cell the engine holds (the last reply's too) and
computes in the engine's own precision: the next turn of a chat prefills only its new
message, and replies stay sane. ``exact=True`` keeps the guarantees the identity tests
hold (tests/test_llama_cpp_kv_reuse.py, test_onnx_kv_reuse.py, test_openvino_kv_reuse.py,
test_batch.py, test_conformance.py all load with it): there a reply's prompt is
prefilled again where a cold cache would compute it otherwise. The mode shows in
``Model.info.exact``.

Also item 5: ``load(max_concurrency=N)`` builds llama.cpp's batch context at load, so
the first ``Model.batch`` does not build it inside the request.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from localrun.errors import LocalrunError
from tests.models import test_model

GREEDY: dict[str, Any] = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                          "repetition_penalty": 1.0}
#: Questions with the words a right answer holds (as in tests/test_batch.py).
ANSWERS = (("What is 2+2?", ("4", "four")), ("What is the opposite of hot?", ("cold",)),
           ("How many legs does a dog have?", ("4", "four")),
           ("What color is the sky on a clear day?", ("blue",)),
           ("What are the three primary colors?", ("red", "blue", "yellow")))
#: (engine, fixture, module it needs)
ENGINES = [("llama.cpp", "gguf-q8_0", "llama_cpp"), ("onnx", "onnx-int4", "onnxruntime_genai"),
           ("mlx", "mlx-4bit", "mlx_lm"), ("openvino", "openvino-int4", "openvino_genai")]


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def engines(*names: str) -> list[Any]:
    return [pytest.param(e, f, marks=pytest.mark.skipif(
        not _have(m), reason=f"{e} is not installed (pip install -e '.[{e.split('.')[0]}]')"),
        id=e) for e, f, m in ENGINES if not names or e in names]


def load(backend: str, fixture: str, **kw: Any) -> Any:
    import localrun

    return localrun.load(str(test_model(fixture)), backend=backend, context=1024, **kw)


def assert_sane(model: Any) -> None:
    """At least 3 of the 5 questions answered right (as tests/test_batch.py asks of
    OpenVINO: a 135M model at int4 misses some)."""
    replies = [model.chat(q, max_tokens=32, **GREEDY).text for q, _ in ANSWERS]
    right = [r for r, (_, words) in zip(replies, ANSWERS, strict=True)
             if any(w in r.lower() for w in words)]
    assert len(right) >= 3, replies


class Prefills:
    """The tokens each call prefilled, from the stats the driver hands the engine (the
    single path's ``generate``, or the batcher's ``add``)."""

    def __init__(self, model: Any) -> None:
        self.seen: list[Any] = []
        session = model._session
        self._targets: list[tuple[Any, str, Callable[..., Any]]] = []
        self._wrap(session, "generate", 3)
        if session.batch_alone:  # every sequence runs through the batcher
            self._wrap(session.batcher(), "add", 3)

    def _wrap(self, obj: Any, name: str, at: int) -> None:
        real = getattr(obj, name)

        def spy(*args: Any) -> Any:
            self.seen.append(args[at])
            return real(*args)

        setattr(obj, name, spy)
        self._targets.append((obj, name, real))

    def last(self) -> int:
        return int(self.seen[-1].prefill_tokens)

    def close(self) -> None:
        for obj, name, _ in self._targets:
            delattr(obj, name)


def two_turns(model: Any) -> tuple[int, int, int, int]:
    """A chat's second turn after its first: (turn 1's prompt tokens, its reply's tokens,
    turn 2's prompt tokens, the tokens turn 2 prefilled)."""
    spy = Prefills(model)
    try:
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "Tell me about the sea."}]
        first = model.chat(messages, max_tokens=24, **GREEDY)
        messages += [{"role": "assistant", "content": first.text},
                     {"role": "user", "content": "Why is it salty?"}]
        second = model.chat(messages, max_tokens=8, **GREEDY)
        return (first.usage.prompt_tokens, first.usage.completion_tokens,
                second.usage.prompt_tokens, spy.last())
    finally:
        spy.close()


@pytest.mark.parametrize(("backend", "fixture"), engines("llama.cpp", "onnx", "mlx"))
def test_the_next_turn_prefills_only_its_new_message(backend: str, fixture: str) -> None:
    """Default mode: the previous reply's cells are reused as the engine left them, so
    turn 2 prefills what the reply does not cover (the end-of-turn marker, the new user
    message) and not the reply again; the answers stay sane. (Before: llama.cpp and ONNX
    Runtime GenAI prefilled the reply again on every turn.)"""
    with load(backend, fixture) as m:
        assert m.info.exact is False
        n1, reply, n2, prefilled = two_turns(m)
        assert reply == 24  # a whole reply to reuse
        # the reply's last token was drawn, never fed: one more; retokenizing may differ
        assert prefilled <= n2 - n1 - reply + 4, (n1, reply, n2, prefilled)
        assert_sane(m)


@pytest.mark.parametrize(("backend", "fixture"), engines("llama.cpp", "onnx"))
def test_exact_prefills_the_reply_again(backend: str, fixture: str) -> None:
    """``exact=True``: the reply's cells, decoded a token at a time, are not what a cold
    prefill computes, so the next turn prefills the reply again (ONNX settles it in the
    pause between turns when there is one: off here, so that a slow turn cannot)."""
    options = {"SETTLE": False} if backend == "onnx" else {}
    with load(backend, fixture, exact=True, **options) as m:
        assert m.info.exact is True
        n1, reply, n2, prefilled = two_turns(m)
        assert prefilled >= n2 - n1, (n1, reply, n2, prefilled)


def test_llama_cpp_batcher_reuses_the_reply_too() -> None:
    """Through llama.cpp's batcher (a server's path, once it is built): the default
    keeps the slot's reply cells; exact keeps only its prompt's."""
    if not _have("llama_cpp"):
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llama-cpp]')")
    for exact in (False, True):
        with load("llama.cpp", "gguf-q8_0", max_concurrency=2, exact=exact) as m:
            assert m._session.batch_alone  # built at load: every call goes through it
            n1, reply, n2, prefilled = two_turns(m)
            if exact:
                assert prefilled >= n2 - n1, (n1, reply, n2, prefilled)
            else:
                assert prefilled <= n2 - n1 - reply + 4, (n1, reply, n2, prefilled)


def test_onnx_default_settles_nothing() -> None:
    """ONNX Runtime GenAI's settle (the reply prefilled again between turns, exact mode)
    has nothing to do by default: the reply's rows are reused as they are."""
    if not _have("onnxruntime_genai"):
        pytest.skip("onnxruntime-genai is not installed (pip install -e '.[onnx]')")
    with load("onnx", "onnx-int4") as m:
        m.chat("Tell me about the sea.", max_tokens=8, **GREEDY)
        assert m._session._last_settle is None
    with load("onnx", "onnx-int4", exact=True) as m:
        m.chat("Tell me about the sea.", max_tokens=8, **GREEDY)
        assert m._session._last_settle is not None


@pytest.mark.skipif(not _have("openvino_genai"),
                    reason="OpenVINO GenAI is not installed (pip install -e '.[openvino]')")
def test_openvino_computes_in_the_plugins_own_precision_by_default() -> None:
    """Default: the CPU plugin's own compute precision (bf16 on a CPU with AVX-512 BF16
    or AMX, else f32), its KV cache in it; exact: f32. Both answer sanely. (Its prefix
    cache reuses a reply's blocks in both modes: tests/test_openvino_kv_reuse.py.)"""
    from localrun.backends.openvino.devices import cpu_precision

    for exact, want in ((False, cpu_precision(None)), (True, "f32")):
        with load("openvino", "openvino-int4", exact=exact) as m:
            props = m._session.load_properties
            assert ("INFERENCE_PRECISION_HINT" in props) is exact
            assert props["KV_CACHE_PRECISION"] == want
            assert m.info.exact is exact
            assert_sane(m)


@pytest.mark.skipif(not _have("llama_cpp"),
                    reason="llama-cpp-python is not installed (pip install -e '.[llama-cpp]')")
def test_exact_is_checked_and_shown() -> None:
    """``exact`` takes a bool (else one line with the hint), and ``run --json`` shows the
    mode in ``info``."""
    import subprocess

    import localrun
    from tests.conftest import localrun_cmd

    with pytest.raises(LocalrunError, match="Invalid exact 'yes'") as e:
        localrun.load(str(test_model("gguf-q8_0")), exact="yes")  # type: ignore[arg-type]
    assert "exact=True" in (e.value.hint or "")
    path = str(test_model("gguf-q8_0"))
    for flags, want in (((), False), (("--exact",), True)):
        r = subprocess.run([*localrun_cmd(), "run", path, "Hi", "-n", "2", "--json",
                            "--context", "256", *flags], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["info"]["exact"] is want


# -- item 5: the batch context is built at load when the model will batch --------------

@pytest.fixture()
def gguf() -> Iterator[str]:
    if not _have("llama_cpp"):
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llama-cpp]')")
    yield str(test_model("gguf-q8_0"))


def test_load_with_max_concurrency_builds_the_batch_context_before_the_first_batch(
        gguf: str) -> None:
    """``load(max_concurrency=4)``: the batch context (and its calibration) exists when
    load returns, so the first ``Model.batch`` runs in it instead of building it; a
    plain load builds none until the first overlap (its memory is not taken unasked)."""
    import localrun
    from localrun.backends.llama_cpp.batcher import LlamaCppBatcher

    with localrun.load(gguf, backend="llama.cpp", context=512, max_concurrency=4) as m:
        session = m._session
        built = session._batcher
        assert isinstance(built, LlamaCppBatcher) and built._ctx is not None
        assert built.capacity == 4 and session.batch_alone
        assert m._driver._can_batch is True
        out = m.batch(["1, 2, 3,", "a, b, c,", "Hi", "Yes"], max_tokens=2, temperature=0)
        assert len(out) == 4 and session._batcher is built  # the same one, not rebuilt
    with localrun.load(gguf, backend="llama.cpp", context=512) as m:
        assert m._session._batcher is None and m._driver._can_batch is None


def test_a_preset_keeps_exact(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                              gguf: str) -> None:
    """``localrun create NAME --from MODEL --exact``: the preset stores the mode, and a
    load by its name is exact (a plain load of its model is not)."""
    import subprocess

    import localrun
    from localrun.naming import presets
    from tests.conftest import localrun_cmd

    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = subprocess.run([*localrun_cmd(), "create", "steady", "--from", gguf, "--exact"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "exact" in r.stdout
    assert presets.get("steady").exact is True
    with localrun.load("steady", context=256) as m:
        assert m.info.exact is True
    assert presets.Preset.from_json(presets.get("steady").to_json()).exact is True


def _off_split_reply(model: Any, messages: list[dict[str, str]]) -> Any:
    """A sampled reply whose text does not tokenize back into the tokens that produced
    it (BPE splits a text one way; sampling may take another): the first of a few seeds,
    None if none does on this build."""
    llm = model._session.engine.llm
    for seed in range(24):
        reply = model.chat(messages, temperature=1.5, top_p=1.0, top_k=0, seed=seed,
                           max_tokens=24)
        _, ids = list(model._session.engine.replies._seen.items())[-1]
        generated = list(ids[reply.usage.prompt_tokens:])
        again = llm.tokenize(reply.text.encode(), add_bos=False, special=False)
        if len(generated) == reply.usage.completion_tokens and again != generated:
            return reply
    return None


@pytest.mark.parametrize("batching", [False, True], ids=["single path", "batcher"])
def test_the_next_turn_reuses_a_reply_that_does_not_tokenize_back(batching: bool) -> None:
    """Default mode, llama.cpp: a reply whose text tokenizes into other tokens than the
    ones generated is fed on the next turn as generated (backends/llama_cpp/replies.py),
    so the turn prefills its new message only, not the reply from the first differing
    token on (before: most of the reply again, as llama-server does). Exact mode
    tokenizes every prompt alike, whatever ran before."""
    with load("llama.cpp", "gguf-q4_1", max_concurrency=2 if batching else None) as m:
        messages = [{"role": "user", "content": "Invent ten words of a new language."}]
        first = _off_split_reply(m, messages)
        if first is None:
            pytest.skip("no sampled reply of 24 seeds tokenized differently on this build")
        turn2 = [*messages, {"role": "assistant", "content": first.text},
                 {"role": "user", "content": "Again."}]
        spy = Prefills(m)
        try:
            second = m.chat(turn2, max_tokens=4, **GREEDY)
        finally:
            spy.close()
        n1, reply = first.usage.prompt_tokens, first.usage.completion_tokens
        assert spy.last() <= second.usage.prompt_tokens - n1 - reply + 2, (
            n1, reply, second.usage.prompt_tokens, spy.last())
