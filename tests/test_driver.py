"""The generation driver (localrun/driver/) on real engines: what a backend receives
(the clamped token limit, a drawn seed), and the scheduler that runs overlapping
streams from several threads through a session's Batcher."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from localrun.errors import GenerationError, ModelBusyError, ModelClosedError
from tests.conftest import requires_llama
from tests.test_batch import Interleaving, interleaved

requires_openvino = pytest.mark.skipif(
    importlib.util.find_spec("openvino_genai") is None,
    reason="openvino-genai is not installed (pip install -e '.[openvino]')")


class Recorder:
    """Records the prompt length and sampling the engine receives for each sequence,
    through Session.generate() or the session's Batcher (whichever the driver uses)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.batcher = session.batcher()
        self.seen: list[Any] = []

    def __enter__(self) -> Recorder:
        real_generate = self.session.generate

        def generate(prompt: Any, sampling: Any, cancel: Any, stats: Any) -> Iterator[str]:
            self.seen.append((len(prompt.tokens), sampling))
            return real_generate(prompt, sampling, cancel, stats)

        self.session.generate = generate
        if self.batcher is not None:
            real_add = self.batcher.add

            def add(key: int, prompt: Any, sampling: Any, stats: Any) -> None:
                self.seen.append((len(prompt.tokens), sampling))
                real_add(key, prompt, sampling, stats)

            self.batcher.add = add
        return self

    def __exit__(self, *exc: object) -> None:
        del self.session.generate  # the class's methods again
        if self.batcher is not None:
            del self.batcher.add


# -- what a backend receives -----------------------------------------------------------------

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"


@requires_llama
def test_limit_is_clamped_to_the_context_before_the_engine(default_gguf: Any) -> None:
    """max_tokens past the context's end: the engine is asked for exactly what is left
    (ctx - prompt), and the reply ends there with "length"."""
    import localrun

    with localrun.load(str(default_gguf), backend="llama.cpp", context=256,
                       exact=True) as m, \
            Recorder(m._session) as rec:
        ctx = m.info.context_length  # llama.cpp's smallest is 256
        c = m.complete(COUNTING, temperature=0, max_tokens=1000)
        (n_prompt, sampling), = rec.seen
        assert sampling.max_tokens == ctx - n_prompt
        assert c.finish_reason == "length"
        assert c.usage.prompt_tokens == n_prompt
        assert c.usage.completion_tokens == ctx - n_prompt
        short = m.complete(COUNTING, temperature=0, max_tokens=5)
        assert rec.seen[-1][1].max_tokens == 5 and short.usage.completion_tokens == 5


@requires_llama
def test_seed_is_drawn_once_by_the_driver(llama_model: Any) -> None:
    """Without a seed each call gets its own, drawn by the driver (an int reaches the
    engine), so two samples differ; the same seed gives the same reply."""
    opts = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 24}
    prompt = "Write a short poem about the sea."
    with Recorder(llama_model._session) as rec:
        a = llama_model.chat(prompt, **opts)
        b = llama_model.chat(prompt, **opts)
        seeds = [s.seed for _, s in rec.seen]
        assert all(isinstance(s, int) for s in seeds) and seeds[0] != seeds[1]
        assert a.text != b.text
        c = llama_model.chat(prompt, seed=1234, **opts)
        d = llama_model.chat(prompt, seed=1234, **opts)
        assert [s.seed for _, s in rec.seen[2:]] == [1234, 1234]
        assert c.text == d.text


# -- overlapping streams on a batching engine made of llama.cpp sessions ----------------------

@pytest.fixture(scope="module")
def llama_slot(default_gguf: Any) -> Iterator[Any]:
    import localrun

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llama-cpp]')")
    with localrun.load(str(default_gguf), backend="llama.cpp", context=2048,
                       exact=True) as m:
        yield m


@pytest.fixture()
def interleaving(llama_model: Any, llama_slot: Any) -> Iterator[Any]:
    """A Model whose session batches (tests/test_batch.py's interleaving engine)."""
    from localrun.api import Model

    engine = Interleaving([llama_model._session, llama_slot._session])
    model = Model(engine, llama_model._driver.defaults)
    yield model
    model._driver.close()  # stops its engine thread; the sessions belong to the others


#: Prompts whose replies run past a few tokens (no early end-of-sequence).
STORIES = ["Write a long story about a dragon.", "Write a long story about a cat."]


def held(model: Any, text: str = "Tell me a story.") -> Any:
    """A stream that owns the engine (alone, on this thread) once its first chunk is in."""
    stream = model.stream(text, temperature=0, max_tokens=6)
    next(stream)
    return stream


def in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # handed to the test's thread
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def wait_for(cond: Any, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@requires_llama
def test_streams_from_two_threads_run_together(interleaving: Any) -> None:
    """Two threads' streams that start while the engine is busy go through the batcher
    together (their pieces interleave) and each gets exactly its reply alone."""
    engine = interleaving._session
    prompts = ["What is 2+2?", "Name a fruit."]
    alone = [interleaving.chat(p, temperature=0, max_tokens=10).text for p in prompts]
    assert engine.admitted == 0  # alone: through generate(), not the batcher
    first = held(interleaving)
    threads = [in_thread(lambda p=p: "".join(
        c.text for c in interleaving.stream(p, temperature=0, max_tokens=10)))
        for p in prompts]
    time.sleep(0.2)
    for _ in first:  # the engine comes free: both start, together
        pass
    for t, _ in threads:
        t.join(timeout=120)
    assert [out[0] for _, out in threads] == alone
    assert engine.admitted == 2 and engine.most_at_once == 2
    assert interleaved(engine.order)


@requires_llama
def test_closed_or_cancelled_stream_leaves_the_engine(interleaving: Any) -> None:
    """A consumer that closes its stream (or cancels its token) has its sequence
    cancelled in the batcher at the next step; the others run on, the next call is
    served."""
    from localrun.types import CancelToken

    engine = interleaving._session
    first = held(interleaving)
    token = CancelToken()
    long = interleaving.stream("Write a long story about a dragon.", temperature=0,
                               max_tokens=400)
    other = interleaving.stream("Write a long story about a cat.", temperature=0,
                                max_tokens=400, cancel=token)
    t1, _ = in_thread(lambda: next(long))
    t2, _ = in_thread(lambda: next(other))
    time.sleep(0.2)
    for _ in first:
        pass
    t1.join(timeout=120)
    t2.join(timeout=120)
    batcher = engine._batcher
    assert batcher is not None and len(batcher.running) == 2
    long.close()
    token.cancel()
    wait_for(lambda: not batcher.running)  # both dropped without running to 400 tokens
    rest = list(other)
    assert rest[-1].finish_reason == "cancelled"
    assert rest[-1].usage.completion_tokens < 100
    assert interleaving.chat("Hi", temperature=0, max_tokens=3).usage.completion_tokens == 3


@requires_llama
def test_engine_error_fails_the_streams_in_flight_and_the_next_run(interleaving: Any
                                                                   ) -> None:
    engine = interleaving._session
    engine.fail_at = 1  # the step after the second admission raises
    first = held(interleaving)
    threads = [in_thread(lambda p=p: interleaving.chat(p, temperature=0, max_tokens=40))
               for p in STORIES]
    time.sleep(0.2)
    for _ in first:
        pass
    for t, _ in threads:
        t.join(timeout=120)
    errors = [out[0] for _, out in threads]
    assert all(isinstance(e, GenerationError) and "engine exploded" in str(e)
               for e in errors), errors
    # the engine thread clears its batch right after failing the streams: under load
    # the assertion could run first (seen once in a whole-suite run)
    deadline = time.monotonic() + 10
    while engine._batcher.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine._batcher.running
    again = [in_thread(lambda p=p: interleaving.chat(p, temperature=0, max_tokens=4))
             for p in STORIES]
    for t, _ in again:
        t.join(timeout=120)
    assert [out[0].usage.completion_tokens for _, out in again] == [4, 4]


@requires_llama
def test_busy_and_closed(interleaving: Any) -> None:
    """A thread that opens a second call while its own alone-stream holds the engine is
    told so; close() waits for the running calls, stops the engine thread, and refuses
    later calls."""
    stream = held(interleaving)
    with pytest.raises(ModelBusyError):
        interleaving.chat("Hi", max_tokens=2)
    with pytest.raises(ModelBusyError):
        interleaving.count_tokens("Hi")
    stream.close()
    assert interleaving.count_tokens("Hello there") > 0
    t, out = in_thread(lambda: interleaving.batch(STORIES, temperature=0, max_tokens=3))
    t.join(timeout=120)
    assert [c.usage.completion_tokens for c in out[0]] == [3, 3]
    interleaving._driver.close()
    assert interleaving._driver._thread is None
    with pytest.raises(ModelClosedError):
        interleaving.chat("Hi", max_tokens=2)


# -- OpenVINO GenAI: its real continuous batching ---------------------------------------------

@pytest.fixture(scope="module")
def openvino_f32() -> Iterator[Any]:
    """Computing in f32, where the batching pipeline's greedy tokens are the
    single-sequence pipeline's (tests/test_batch.py says why)."""
    from tests.models import test_model

    path = test_model("openvino-int4")
    import localrun

    with localrun.load(str(path), backend="openvino", INFERENCE_PRECISION_HINT="f32") as m:
        yield m


@requires_openvino
def test_openvino_streams_from_two_threads_batch(openvino_f32: Any) -> None:
    """Two threads' streams run through ContinuousBatchingPipeline together (both in
    one engine step) and each ends with the greedy text it gets alone."""
    m = openvino_f32
    prompts = ["What is the capital of France?", "What do bees make?"]
    alone = [m.chat(p, temperature=0, max_tokens=16).text for p in prompts]
    batcher = m._session.batcher()
    real_step = batcher.step
    widths: list[int] = []

    def step() -> Any:
        widths.append(len(batcher._active))
        return real_step()

    batcher.step = step
    try:
        first = held(m)
        threads = [in_thread(lambda p=p: "".join(
            c.text for c in m.stream(p, temperature=0, max_tokens=16))) for p in prompts]
        time.sleep(0.2)
        for _ in first:
            pass
        for t, _ in threads:
            t.join(timeout=300)
    finally:
        del batcher.step
    assert [out[0] for _, out in threads] == alone
    # 3: the held stream itself runs through the batcher when the session batches alone
    assert max(widths) == 2 or (m._session.batch_alone and max(widths) == 3), widths
    assert m.chat("Hi", temperature=0, max_tokens=2).usage.completion_tokens >= 1


@requires_openvino
def test_openvino_closed_stream_is_cancelled_in_the_pipeline(openvino_f32: Any) -> None:
    m = openvino_f32
    batcher = m._session.batcher()
    cancelled: list[int] = []
    real_cancel = batcher.cancel

    def cancel(key: int) -> None:
        cancelled.append(key)
        real_cancel(key)

    batcher.cancel = cancel
    try:
        first = held(m)
        streams = [m.stream(p, temperature=0, max_tokens=300)
                   for p in ("Write a long story about a dragon.", "Describe the sea.")]
        threads = [in_thread(lambda s=s: next(s)) for s in streams]
        time.sleep(0.2)
        for _ in first:
            pass
        for t, _ in threads:
            t.join(timeout=300)
        streams[0].close()
        wait_for(lambda: len(batcher._active) <= 1, timeout=120)
        assert len(cancelled) == 1
        streams[1].close()
        wait_for(lambda: not batcher._active, timeout=120)
    finally:
        del batcher.cancel
    assert len(cancelled) == 2
    assert not m._session.batcher().pipe.has_non_finished_requests()
    assert m.chat("Hi", temperature=0, max_tokens=2).usage.completion_tokens >= 1
