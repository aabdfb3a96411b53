"""Model.batch / batch_iter on the real llama.cpp engine with the real embedded model."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest

from localrun.backends.base import Batcher, GenerationStats, Prompt, Session
from localrun.batch import BatchError, BatchItem
from localrun.errors import (
    ContextOverflowError,
    GenerationError,
    InvalidSamplingError,
    LocalrunError,
)
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
    for i, r in llama_model.batch_iter(PROMPTS, cancel=cancel, max_concurrency=1, **GREEDY):
        results[i] = r
        cancel.cancel()  # after the first result: the rest do not start
    assert sorted(results) == list(range(len(PROMPTS)))
    assert results[0].finish_reason != "cancelled"
    for i in range(1, len(PROMPTS)):
        assert results[i].finish_reason == "cancelled"
        assert results[i].usage.completion_tokens == 0
    assert llama_model.chat("Hi", max_tokens=2).usage.completion_tokens == 2  # still usable


# -- the engine-batching path of the driver ------------------------------------------------
#
# The driver's batch path (stop strings, per-sequence cancels, finish reasons, failures)
# driven by a Batcher made of real llama.cpp sessions: one session per slot, each
# running one sequence, and every step each running sequence yields its next piece, so
# pieces of different sequences really arrive interleaved, and a freed slot takes the
# next waiting prompt, as in a continuous batcher. (OpenVINO's real continuous batching
# is tested below when it is installed.)

#: Sessions (slots) of the interleaving engine: at most this many sequences at once.
SLOTS = 4


class InterleavingBatcher(Batcher):
    capacity = SLOTS

    def __init__(self, engine: Interleaving) -> None:
        self.engine = engine
        self.free = list(engine.slots)
        self.running: dict[int, tuple[Session, Iterator[str]]] = {}
        self.cancelled: set[int] = set()
        self.explode = False

    def add(self, key: int, prompt: Prompt, sampling: ResolvedSampling,
            stats: GenerationStats) -> None:
        engine = self.engine
        engine.samplings.append(sampling)
        engine.admitted += 1
        if engine.admitted - 1 == engine.fail_at:
            self.explode = True  # the next step fails, with this sequence in flight
        stats.started = time.perf_counter()
        stats.prefill_tokens = len(prompt.tokens)
        slot = self.free.pop()
        self.running[key] = slot, slot.generate(prompt, sampling, CancelToken(), stats)
        engine.most_at_once = max(engine.most_at_once, len(self.running))

    def cancel(self, key: int) -> None:
        self.cancelled.add(key)

    def step(self) -> list[tuple[int, str | None]]:
        if self.explode:
            self.explode = False
            raise RuntimeError("engine exploded")
        out: list[tuple[int, str | None]] = []
        for key, (slot, pieces) in list(self.running.items()):  # one step: a piece each
            piece = None if key in self.cancelled else next(pieces, None)
            if piece is None:
                pieces.close()  # type: ignore[attr-defined]
                del self.running[key]
                self.cancelled.discard(key)
                self.free.append(slot)
                out.append((key, None))
            else:
                self.engine.order.append(key)
                out.append((key, piece))
        return out

    def close(self) -> None:
        for key in list(self.running):
            self.cancel(key)
        self.step()


class Interleaving(Session):
    def __init__(self, slots: Sequence[Session], fail_at: int | None = None) -> None:
        self.inner = slots[0]
        self.slots = list(slots)
        self.info = self.inner.info
        self.sampling_defaults = self.inner.sampling_defaults
        self.fail_at = fail_at  # the step after this sequence's admission fails
        self.admitted = 0  # sequences the batcher took
        self.samplings: list[ResolvedSampling] = []  # what each call was resolved to
        self.order: list[int] = []  # the sequence of each piece yielded, in order
        self.most_at_once = 0
        self._batcher: InterleavingBatcher | None = None

    def encode_chat(self, messages: Sequence[Any]) -> Prompt:
        return self.inner.encode_chat(messages)

    def encode_text(self, text: str) -> Prompt:
        return self.inner.encode_text(text)

    def generate(self, prompt: Prompt, sampling: ResolvedSampling, cancel: CancelToken,
                 stats: GenerationStats) -> Iterator[str]:
        self.samplings.append(sampling)
        return self.inner.generate(prompt, sampling, cancel, stats)

    def batcher(self) -> Batcher:
        if self._batcher is None:
            self._batcher = InterleavingBatcher(self)
        return self._batcher


def interleaved(order: Sequence[int]) -> bool:
    """Whether some sequence's pieces were split by another sequence's piece."""
    seen: set[int] = set()
    for prev, k in zip([None, *order], order, strict=False):
        if k != prev and k in seen:
            return True
        seen.add(k)
    return False


def test_interleaved_helper() -> None:
    assert interleaved([0, 1, 0, 1]) and interleaved([0, 0, 1, 0])
    assert not interleaved([0, 0, 1, 1, 2]) and not interleaved([])


@pytest.fixture(scope="module")
def llama_slots(default_gguf: Any) -> Iterator[list[Session]]:
    """More llama.cpp sessions of the embedded model, loaded as llama_model is."""
    import localrun

    models = [localrun.load(str(default_gguf), backend="llama.cpp", context=2048, exact=True)
              for _ in range(SLOTS - 1)]
    try:
        yield [m._session for m in models]
    finally:
        for m in models:
            m.close()


@pytest.fixture()
def batching_model(llama_model: Any, llama_slots: list[Session]) -> Iterator[Any]:
    """A Model over the interleaving engine, with llama_model's sampling defaults."""
    from localrun.api import Model

    engine = Interleaving([llama_model._session, *llama_slots])
    # Not closed: its sessions belong to llama_model and llama_slots.
    yield Model(engine, llama_model._driver.defaults)


def test_batched_path_matches_sequential(batching_model: Any) -> None:
    """Pieces of 4 sequences arrive interleaved; each result is still exactly the
    sequential one (greedy: text, usage, finish reason)."""
    engine = batching_model._session
    sequential = batching_model.batch(PROMPTS, temperature=0, max_tokens=8, max_concurrency=1)
    assert engine.admitted == 0 and not engine.order  # concurrency 1: items ran in turn
    batched = batching_model.batch(PROMPTS, temperature=0, max_tokens=8, max_concurrency=8)
    assert engine.admitted == len(PROMPTS) and engine.most_at_once == SLOTS  # capacity
    assert interleaved(engine.order)
    for s, c in zip(sequential, batched, strict=True):
        assert 0 < c.usage.completion_tokens <= 8
        assert (c.text, c.usage, c.finish_reason) == (s.text, s.usage, s.finish_reason)
        assert 0 < c.timings.ttft <= c.timings.total


def test_batched_path_stop_strings_and_overflow(batching_model: Any) -> None:
    """A stop string ends its own sequence mid-batch; the one beside it runs on."""
    prompt = "Count from 1 to 10, separated by commas."
    results = dict(batching_model.batch_iter(
        [BatchItem(prompt, {"stop": ["5"]}), "word " * 3000, prompt],
        temperature=0, max_tokens=40))
    assert interleaved(batching_model._session.order)
    single = batching_model.chat(prompt, stop=["5"], temperature=0, max_tokens=40)
    assert results[0].finish_reason == "stop" and "5" not in results[0].text
    assert (results[0].text, results[0].usage) == (single.text, single.usage)
    assert results[2].text.startswith(results[0].text) and "5" in results[2].text
    assert isinstance(results[1], ContextOverflowError)


def test_batched_path_wakes_the_caller_once_per_item(batching_model: Any,
                                                     monkeypatch: Any) -> None:
    """A batch's pieces are fed on the engine thread: the caller's thread is woken once
    per item (its end), not for every token (each wake-up takes a core from the engine's
    threads between its decode steps); a stop string still ends its item mid-batch."""
    import queue

    from localrun.driver import scheduler

    gets: list[int] = []

    class Counting(queue.SimpleQueue):  # type: ignore[type-arg]
        def get(self, block: bool = True, timeout: float | None = None) -> Any:
            gets.append(threading.get_ident())
            return super().get(block, timeout)

    monkeypatch.setattr(scheduler.queue, "SimpleQueue", Counting)
    prompt = "Count from 1 to 10, separated by commas."
    items = [BatchItem(prompt, {"stop": ["5"]}), "Write a long story about a dragon.",
             "Write a long story about a cat."]
    results = batching_model.batch(items, temperature=0, max_tokens=24)
    assert interleaved(batching_model._session.order)
    tokens = sum(c.usage.completion_tokens for c in results)
    assert tokens > 3 * len(items)
    assert len(gets) == len(items) and set(gets) == {threading.get_ident()}
    assert results[0].finish_reason == "stop" and "5" not in results[0].text
    assert [c.finish_reason for c in results[1:]] == ["length", "length"]


def test_batched_path_engine_failure_is_per_item(batching_model: Any) -> None:
    """The engine fails in the step after admitting item 2: item 0 had finished and
    keeps its result; item 1, still running beside it, and item 2 get the error; the
    next batch runs as usual."""
    engine = batching_model._session
    engine.fail_at = 2
    results = dict(batching_model.batch_iter(
        [BatchItem(PROMPTS[0], {"max_tokens": 2}), PROMPTS[1], PROMPTS[2]],
        temperature=0, max_tokens=6, max_concurrency=2))
    assert interleaved(engine.order)
    assert isinstance(results[0], Completion) and results[0].usage.completion_tokens == 2
    assert isinstance(results[1], GenerationError) and isinstance(results[2], GenerationError)
    assert "engine exploded" in str(results[1])
    again = batching_model.batch(PROMPTS[:3], temperature=0, max_tokens=3, max_concurrency=3)
    assert [c.usage.completion_tokens for c in again] == [3, 3, 3]
    assert not engine._batcher.running  # the failed ones were dropped from the engine


def test_batched_path_cancel_midway(batching_model: Any) -> None:
    """Cancelling after the first result: the item in flight beside it ends cancelled
    with what it had generated, those not started yet end cancelled with nothing."""
    cancel = CancelToken()
    results: dict[int, Any] = {}
    for i, r in batching_model.batch_iter(PROMPTS, cancel=cancel, max_concurrency=2,
                                          **GREEDY):
        results[i] = r
        cancel.cancel()
    assert sorted(results) == list(range(len(PROMPTS)))
    done = [r for r in results.values() if r.finish_reason != "cancelled"]
    assert len(done) == 1 and done[0].usage.completion_tokens > 0
    started = [r for r in results.values() if r.usage.prompt_tokens]
    assert len(started) == 2  # the first to end, and the one beside it
    assert all(r.usage.completion_tokens == 0 for r in results.values()
               if not r.usage.prompt_tokens)
    again = batching_model.batch(PROMPTS[:2], temperature=0, max_tokens=2, max_concurrency=2)
    assert [c.usage.completion_tokens for c in again] == [2, 2]


def test_batch_resolves_sampling_like_chat(batching_model: Any) -> None:
    """The embedded SmolLM2 samples with the same defaults in a batch as in chat: its
    catalog defaults (temperature 0.2, top_p 0.9) under any default of the session."""
    from localrun.naming.stores import DEFAULT_MODEL_SAMPLING

    session = batching_model._session
    batching_model.chat("Hi", max_tokens=1)
    chat = session.samplings[-1]
    session.samplings.clear()
    batching_model.batch(["Hi", BatchItem("Hello", {"top_k": 5})], max_tokens=1,
                         max_concurrency=2)
    assert session.admitted == 2 and len(session.samplings) == 2  # the engine-batch path
    plain, overridden = session.samplings
    # the same resolution; each call draws its own seed (an int: engines never draw one)
    assert all(isinstance(s.seed, int) for s in (chat, plain, overridden))
    assert replace(plain, seed=None) == replace(chat, seed=None)
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
    reason="openvino-genai is not installed (pip install -e '.[openvino]')")

ROBUST = ["What is 2+2?", "What is the opposite of hot?", "How many legs does a dog have?",
          "What color is the sky on a clear day?", "What are the three primary colors?",
          "What is the capital of France?", "Name a fruit.", "What do bees make?"]


@pytest.fixture(scope="module")
def openvino_model() -> Iterator[Any]:
    from tests.models import test_model

    path = test_model("openvino-int4")
    import localrun

    with localrun.load(str(path), backend="openvino", exact=True) as m:
        yield m


@pytest.fixture(scope="module")
def openvino_f32() -> Iterator[Any]:
    """The fixture model computing in f32, where OpenVINO's greedy tokens do not depend
    on how sequences are batched.

    In bf16 (the CPU plugin's default on AVX-512 BF16/AMX CPUs) they do: the same 12
    prompts, 24 greedy tokens each, run 1 and 8 at a time through the same batching
    pipeline with the same bf16 KV cache, agreed on 7 of 12 replies (the others parted
    after 8 to 23 tokens), and 16 prompts run 8, 16 and 3 at a time gave three different
    sets of replies. In f32 the single-sequence pipeline (SDPA or paged attention) and
    the batching one at 1, 4 and 8 sequences gave the same 12 replies (2026.4).
    """
    from tests.models import test_model

    path = test_model("openvino-int4")
    import localrun

    with localrun.load(str(path), backend="openvino", INFERENCE_PRECISION_HINT="f32") as m:
        yield m


@requires_openvino
def test_openvino_batched_matches_sequential_at_f32(openvino_f32: Any) -> None:
    """Greedy replies batched are the replies one at a time, token for token: each
    prompt twice, in batches of 8 and of 16, against the prompts run one by one."""
    sequential = openvino_f32.batch(ROBUST, temperature=0, max_tokens=24, max_concurrency=1)
    for width in (8, 16):
        batched = openvino_f32.batch(ROBUST * 2, temperature=0, max_tokens=24,
                                     max_concurrency=width)
        for s, c in zip(sequential * 2, batched, strict=True):
            assert (c.text, c.usage, c.finish_reason) == (s.text, s.usage, s.finish_reason)
            assert 0 < c.timings.ttft <= c.timings.total and c.timings.decode_tps > 0


#: Questions with the words a right answer holds (as in test_conformance.py).
ANSWERS = (("What is 2+2?", ("4", "four")), ("What is the opposite of hot?", ("cold",)),
           ("How many legs does a dog have?", ("4", "four")),
           ("What color is the sky on a clear day?", ("blue",)),
           ("What are the three primary colors?", ("red", "blue", "yellow")))


@requires_openvino
def test_openvino_batched_exact(openvino_model: Any) -> None:
    """With exact=True (f32 on the CPU: in bf16, the default, batching changed greedy
    replies, see openvino_f32) replies stay right, and the same batch gives the same
    replies again, the second time from the prefix cache. The pipeline keeps keys and
    values in the compute precision, not the engine's u8 default."""
    session = openvino_model._session
    if session.device == "CPU":
        assert "ATTENTION_BACKEND" not in session.load_properties
        props = session.load_properties
        assert props["KV_CACHE_PRECISION"] == props["INFERENCE_PRECISION_HINT"] == "f32"
    questions = [q for q, _ in ANSWERS]
    first = openvino_model.batch(questions, temperature=0, max_tokens=32, max_concurrency=5)
    right = [q for (q, words), c in zip(ANSWERS, first, strict=True)
             if any(w in c.text.lower() for w in words)]
    assert len(right) >= 3, [c.text for c in first]
    again = openvino_model.batch(questions, temperature=0, max_tokens=32, max_concurrency=5)
    assert [c.text for c in again] == [c.text for c in first]


def test_openvino_batch_properties() -> None:
    """The KV cache's element type on the CPU: paged attention (the batching pipeline)
    takes the compute precision unless told otherwise; LLMPipeline (SDPA) f32."""
    from localrun.backends.openvino.devices import cpu_kv_precision

    def kv(paged: bool = True, **props: str) -> str:
        return cpu_kv_precision(props, paged)

    assert kv(INFERENCE_PRECISION_HINT="bf16") == "bf16"
    assert kv(INFERENCE_PRECISION_HINT="f32") == "f32"
    assert kv(INFERENCE_PRECISION_HINT="F16") == "f16"
    assert kv(KV_CACHE_PRECISION="u8", INFERENCE_PRECISION_HINT="bf16") == "u8"
    assert kv(KV_CACHE_PRECISION="f32", INFERENCE_PRECISION_HINT="f32") == "f32"
    assert kv(False) == "f32" and kv(False, KV_CACHE_PRECISION="u8") == "u8"
    with pytest.raises(LocalrunError, match="f32 compute") as e:
        kv(KV_CACHE_PRECISION="f32", INFERENCE_PRECISION_HINT="bf16")
    assert "INFERENCE_PRECISION_HINT" in (e.value.hint or "")


@requires_openvino
def test_openvino_batched_stop_strings_usage_and_errors(openvino_f32: Any) -> None:
    prompt = "Count from 1 to 10, separated by commas."
    items = [BatchItem(prompt, {"stop": ["5"]}), "word " * 9000, prompt, "Hi"]
    results = dict(openvino_f32.batch_iter(items, temperature=0, max_tokens=40,
                                           max_concurrency=2))
    single = openvino_f32.chat(prompt, stop=["5"], temperature=0, max_tokens=40)
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


class StepSpy:
    """Stands in for a ContinuousBatchingPipeline: forwards every call to it, and after
    each ``step()`` records how many requests the engine itself reports it scheduled in
    that step (``PipelineMetrics.scheduled_requests``)."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self.scheduled: list[int] = []

    def step(self) -> None:
        self._pipe.step()
        self.scheduled.append(int(self._pipe.get_metrics().scheduled_requests))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


@requires_openvino
def test_openvino_runs_sequences_at_once(openvino_model: Any) -> None:
    """By OpenVINO's own count, steps run several sequences at once, and never more
    than max_concurrency."""
    batcher = openvino_model._session.batcher()  # built on first use, then kept
    spy = StepSpy(batcher.pipe)
    batcher.pipe = spy
    try:
        out = openvino_model.batch(ROBUST, temperature=0, max_tokens=8, max_concurrency=4)
    finally:
        batcher.pipe = spy._pipe
    assert max(spy.scheduled) == 4, spy.scheduled
    assert sum(n > 1 for n in spy.scheduled) >= 4  # not a one-step coincidence
    assert all(0 < c.usage.completion_tokens <= 8 for c in out)
