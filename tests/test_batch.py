"""Model.batch / batch_iter on the real llama.cpp engine with the real embedded model."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from localrun.backends.base import GenerationStats, Prompt, Session
from localrun.batch import BatchError, BatchItem
from localrun.errors import ContextOverflowError, InvalidSamplingError, LocalrunError
from localrun.sampling import ResolvedSampling
from localrun.types import CancelToken, Completion

# The llama_model fixture skips (saying why) when llama-cpp-python is missing.

GREEDY = {"temperature": 0.0, "max_tokens": 12}
PROMPTS = [
    "What is 2+2?",
    "What is the opposite of hot?",
    "How many legs does a dog have?",
    "What color is the sky on a clear day?",
    "Name a fruit.",
]


def test_order_and_results_match_chat(llama_model: Any) -> None:
    batch = llama_model.batch(PROMPTS, **GREEDY)
    assert len(batch) == len(PROMPTS)
    for prompt, c in zip(PROMPTS, batch, strict=True):
        single = llama_model.chat(prompt, **GREEDY)
        assert (c.text, c.finish_reason, c.usage) == (single.text, single.finish_reason,
                                                      single.usage), prompt
        assert 0 < c.timings.ttft <= c.timings.total


def test_batch_iter_yields_every_index_once(llama_model: Any) -> None:
    seen = [i for i, r in llama_model.batch_iter(PROMPTS[:3], **GREEDY)
            if isinstance(r, Completion)]
    assert sorted(seen) == [0, 1, 2]


def test_messages_and_raw_items(llama_model: Any) -> None:
    msgs = [{"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the opposite of hot?"}]
    a, b = llama_model.batch([msgs, BatchItem("Once upon a time", raw=True)], **GREEDY)
    assert a.text == llama_model.chat(msgs, **GREEDY).text
    assert b.text == llama_model.complete("Once upon a time", **GREEDY).text


def test_stop_strings_and_usage_as_chat(llama_model: Any) -> None:
    prompt = "Count from 1 to 10, separated by commas."
    (c,) = llama_model.batch([BatchItem(prompt, {"stop": ["5"]})], temperature=0, max_tokens=48)
    single = llama_model.chat(prompt, stop=["5"], temperature=0, max_tokens=48)
    assert c.finish_reason == "stop" and "5" not in c.text
    assert (c.text, c.usage) == (single.text, single.usage)


def test_per_item_overrides(llama_model: Any) -> None:
    out = llama_model.batch(
        [BatchItem("Write a long story about a dragon.", {"max_tokens": 3}),
         "Write a long story about a dragon."],
        temperature=0, max_tokens=9)
    assert out[0].usage.completion_tokens == 3 and out[0].finish_reason == "length"
    assert out[1].usage.completion_tokens == 9


def test_one_failure_keeps_the_others(llama_model: Any) -> None:
    items = ["What is 2+2?", "word " * 3000, BatchItem("Hi", {"temperature": -1}), "Hi"]
    with pytest.raises(BatchError) as info:
        llama_model.batch(items, **GREEDY)
    e = info.value
    assert isinstance(e.errors[1], ContextOverflowError)
    assert isinstance(e.errors[2], InvalidSamplingError)
    assert sorted(e.errors) == [1, 2]
    done = e.completions
    assert done[0] is not None and done[3] is not None and done[0].text
    assert e.hint  # every error teaches


def test_batch_wide_mistakes_raise_at_once(llama_model: Any) -> None:
    with pytest.raises(InvalidSamplingError):
        llama_model.batch_iter(PROMPTS, temperature=-1)
    with pytest.raises(LocalrunError, match="max_concurrency"):
        llama_model.batch(PROMPTS, max_concurrency=0)


def test_cancel_midway(llama_model: Any) -> None:
    cancel = CancelToken()
    results: dict[int, Any] = {}
    for i, r in llama_model.batch_iter(PROMPTS, cancel=cancel, **GREEDY):
        results[i] = r
        cancel.cancel()  # after the first result: the rest do not start
    assert sorted(results) == list(range(len(PROMPTS)))
    assert results[0].finish_reason != "cancelled"
    for i in range(1, len(PROMPTS)):
        assert results[i].finish_reason == "cancelled"
        assert results[i].usage.completion_tokens == 0
    assert llama_model.chat("Hi", max_tokens=2).usage.completion_tokens == 2  # still usable


# -- the engine-batching path of the API layer --------------------------------------------
#
# No engine on this machine batches in every install, so the shared layer's batch path
# (stop strings, per-sequence cancels, finish reasons, failures) is driven here through
# the real llama.cpp session by an adapter that honours the generate_batch contract while
# running its sequences in turn, interleaving what it yields.


class InTurnBatching(Session):
    supports_batch = True

    def __init__(self, inner: Session, fail_at: int | None = None) -> None:
        self.inner = inner
        self.info = inner.info
        self.sampling_defaults = inner.sampling_defaults
        self.fail_at = fail_at
        self.max_seen: int | None = -1
        self.samplings: list[ResolvedSampling] = []  # what each call was resolved to

    def encode_chat(self, messages: Sequence[Any]) -> Prompt:
        return self.inner.encode_chat(messages)

    def encode_text(self, text: str) -> Prompt:
        return self.inner.encode_text(text)

    def generate(self, prompt: Prompt, sampling: ResolvedSampling, cancel: CancelToken,
                 stats: GenerationStats) -> Iterator[str]:
        self.samplings.append(sampling)
        return self.inner.generate(prompt, sampling, cancel, stats)

    def generate_batch(self, prompts: Sequence[Prompt], samplings: Sequence[ResolvedSampling],
                       cancels: Sequence[CancelToken], stats: Sequence[GenerationStats],
                       max_concurrency: int | None) -> Iterator[tuple[int, str | None]]:
        self.max_seen = max_concurrency
        self.samplings.extend(samplings)
        for k, prompt in enumerate(prompts):
            if k == self.fail_at:
                raise RuntimeError("engine exploded")
            pieces = self.inner.generate(prompt, samplings[k], cancels[k], stats[k])
            try:
                for piece in pieces:
                    yield k, piece
                    if cancels[k].cancelled:
                        break
            finally:
                pieces.close()  # type: ignore[attr-defined]
            yield k, None


@pytest.fixture()
def batching_model(llama_model: Any) -> Iterator[Any]:
    session = llama_model._session
    adapter = InTurnBatching(session)
    llama_model._session = adapter
    try:
        yield llama_model
    finally:
        llama_model._session = session


def test_batched_path_matches_sequential_leading_tokens(batching_model: Any) -> None:
    # Under greedy decoding each batched result starts with the same 8 tokens as its
    # sequential counterpart: max_tokens=8 makes the whole reply that leading span.
    sequential = batching_model.batch(PROMPTS, temperature=0, max_tokens=8, max_concurrency=1)
    assert batching_model._session.max_seen == -1  # concurrency 1: items ran in turn
    batched = batching_model.batch(PROMPTS, temperature=0, max_tokens=8, max_concurrency=8)
    assert batching_model._session.max_seen == 8
    for s, c in zip(sequential, batched, strict=True):
        assert 0 < c.usage.completion_tokens <= 8
        assert (c.text, c.usage, c.finish_reason) == (s.text, s.usage, s.finish_reason)
        assert 0 < c.timings.ttft <= c.timings.total


def test_batched_path_stop_strings_and_overflow(batching_model: Any) -> None:
    prompt = "Count from 1 to 10, separated by commas."
    results = dict(batching_model.batch_iter(
        [BatchItem(prompt, {"stop": ["5"]}), "word " * 3000, prompt],
        temperature=0, max_tokens=40))
    assert results[0].finish_reason == "stop" and "5" not in results[0].text
    assert results[2].text.startswith(results[0].text) and "5" in results[2].text
    assert isinstance(results[1], ContextOverflowError)


def test_batched_path_engine_failure_is_per_item(batching_model: Any) -> None:
    batching_model._session.fail_at = 1
    results = dict(batching_model.batch_iter(PROMPTS[:3], temperature=0, max_tokens=4))
    assert isinstance(results[0], Completion) and results[0].usage.completion_tokens > 0
    assert isinstance(results[1], LocalrunError) and isinstance(results[2], LocalrunError)
    assert "engine exploded" in str(results[1])


def test_batch_resolves_sampling_like_chat(batching_model: Any) -> None:
    """The embedded SmolLM2 samples with the same defaults in a batch as in chat: its
    catalog defaults (temperature 0.2, top_p 0.9) under any default of the session."""
    from localrun.stores import DEFAULT_MODEL_SAMPLING

    session = batching_model._session
    batching_model.chat("Hi", max_tokens=1)
    chat = session.samplings[-1]
    session.samplings.clear()
    batching_model.batch(["Hi", BatchItem("Hello", {"top_k": 5})], max_tokens=1,
                         max_concurrency=2)
    assert session.max_seen == 2 and len(session.samplings) == 2  # the engine-batch path
    plain, overridden = session.samplings
    assert plain == chat
    assert (chat.temperature, chat.top_p) == (DEFAULT_MODEL_SAMPLING["temperature"],
                                              DEFAULT_MODEL_SAMPLING["top_p"])
    assert overridden.temperature == chat.temperature and overridden.top_k == 5


def test_batch_from_threads_queues(llama_model: Any) -> None:
    out: list[list[Completion]] = []
    threads = [threading.Thread(target=lambda: out.append(
        llama_model.batch(PROMPTS[:2], temperature=0, max_tokens=4))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(out) == 2 and [c.text for c in out[0]] == [c.text for c in out[1]]


# -- OpenVINO GenAI: real continuous batching ------------------------------------------

requires_openvino = pytest.mark.skipif(
    importlib.util.find_spec("openvino_genai") is None,
    reason="openvino-genai is not installed (pip install 'localrun[openvino]')")

ROBUST = ["What is 2+2?", "What is the opposite of hot?", "How many legs does a dog have?",
          "What color is the sky on a clear day?", "What are the three primary colors?",
          "What is the capital of France?", "Name a fruit.", "What do bees make?"]


@pytest.fixture(scope="module")
def openvino_model() -> Iterator[Any]:
    from tests.models import test_model

    path = test_model("openvino-int4")
    import localrun
    from localrun.backends.openvino_batch import batching_session

    with localrun.load(str(path), backend="openvino") as m:
        batching_session(m._session)  # no-op once the session has its own hook
        assert m._session.supports_batch
        yield m


@requires_openvino
def test_openvino_batched_matches_sequential_leading_tokens(openvino_model: Any) -> None:
    # max_tokens=8: each whole reply is the leading span compared.
    sequential = openvino_model.batch(ROBUST, temperature=0, max_tokens=8, max_concurrency=1)
    batched = openvino_model.batch(ROBUST, temperature=0, max_tokens=8, max_concurrency=8)
    for s, c in zip(sequential, batched, strict=True):
        assert c.usage == s.usage and c.finish_reason == s.finish_reason
        assert c.text == s.text
        assert 0 < c.timings.ttft <= c.timings.total and c.timings.decode_tps > 0


@requires_openvino
def test_openvino_batched_stop_strings_usage_and_errors(openvino_model: Any) -> None:
    prompt = "Count from 1 to 10, separated by commas."
    items = [BatchItem(prompt, {"stop": ["5"]}), "word " * 9000, prompt, "Hi"]
    results = dict(openvino_model.batch_iter(items, temperature=0, max_tokens=40,
                                             max_concurrency=2))
    single = openvino_model.chat(prompt, stop=["5"], temperature=0, max_tokens=40)
    assert results[0].finish_reason == "stop" and results[0].text == single.text
    assert results[0].usage.prompt_tokens == single.usage.prompt_tokens
    assert isinstance(results[1], ContextOverflowError)
    assert "5" in results[2].text and results[2].text.startswith(results[0].text)
    assert results[3].finish_reason in ("stop", "length")


@requires_openvino
def test_openvino_batch_cancel_and_reuse(openvino_model: Any) -> None:
    cancel = CancelToken()
    got: dict[int, Any] = {}
    for i, r in openvino_model.batch_iter(ROBUST * 2, cancel=cancel, temperature=0,
                                          max_tokens=24, max_concurrency=2):
        got[i] = r
        cancel.cancel()
    assert sorted(got) == list(range(len(ROBUST) * 2))
    assert sum(r.finish_reason == "cancelled" for r in got.values()) >= len(ROBUST)
    again = openvino_model.batch(ROBUST[:2], temperature=0, max_tokens=4, max_concurrency=2)
    assert all(c.usage.completion_tokens > 0 for c in again)
