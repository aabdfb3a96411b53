"""localrun.backends._worker: engine calls on another thread, pieces on the caller's.

The engine here is a stand-in with the property that matters: it serves one call at a
time, and refuses a second while the first still runs (OpenVINO's LLMPipeline and
mlx's one thread both do). Real engines go through the same code in
tests/test_conformance.py (cancel, abandoned streams, four threads).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator

import pytest

from localrun.backends._worker import Relay, Worker


class OneAtATime:
    """An engine that emits numbered pieces until told to halt, one call at a time."""

    def __init__(self) -> None:
        self._busy = threading.Lock()
        self.calls = 0
        self.ended: list[int] = []  # pieces each finished call emitted
        self.threads: set[str] = set()

    def run(self, relay: Relay[str], pieces: int, delay: float = 0.0) -> str:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("engine busy: the previous call has not ended")
        try:
            self.calls += 1
            self.threads.add(threading.current_thread().name)
            n = 0
            while n < pieces and not relay.halted:
                relay.put(f"p{n}")
                n += 1
                time.sleep(delay)
            return "halted" if relay.halted else "done"
        finally:
            self.ended.append(n)
            self._busy.release()


def generate(submit: Callable[[Relay[str]], None], out: dict[str, str]
             ) -> Generator[str, None, None]:
    """The shape every backend's generate() has: read pieces, then the result, and close
    the relay in ``finally`` whatever happens."""
    relay: Relay[str] = Relay()
    submit(relay)
    try:
        yield from relay
        out["result"] = relay.result()
    finally:
        out["closed"] = str(relay.close())


@pytest.fixture()
def worker() -> Iterator[Worker]:
    w = Worker("test-worker")
    yield w
    w.stop()


def test_pieces_then_result_on_the_workers_thread(worker: Worker) -> None:
    engine, out = OneAtATime(), dict[str, str]()
    pieces = list(generate(lambda r: worker.submit(r.job(lambda: engine.run(r, 3))), out))
    assert pieces == ["p0", "p1", "p2"]
    assert out == {"result": "done", "closed": "done"}
    assert engine.threads == {"test-worker"}


def test_early_close_frees_the_engine_for_the_next_call(worker: Worker) -> None:
    engine, out = OneAtATime(), dict[str, str]()
    # a long reply (10 s at this pace), abandoned after two pieces
    gen = generate(lambda r: worker.submit(r.job(lambda: engine.run(r, 10_000, 0.001))), out)
    assert [next(gen), next(gen)] == ["p0", "p1"]
    t0 = time.perf_counter()
    gen.close()
    # close() returned only once the call had ended: the engine is free now
    assert len(engine.ended) == 1 and engine.ended[0] < 10_000
    assert out == {"closed": "halted"}
    assert time.perf_counter() - t0 < 2.0
    # and the next call is served at once, not refused as busy
    out2 = dict[str, str]()
    assert list(generate(lambda r: worker.submit(r.job(lambda: engine.run(r, 2))), out2)) \
        == ["p0", "p1"]
    assert out2["result"] == "done" and engine.calls == 2


def test_engine_error_reaches_the_caller_and_the_worker_goes_on(worker: Worker) -> None:
    def broken(relay: Relay[str]) -> str:
        relay.put("half")
        raise ValueError("engine failed")

    out = dict[str, str]()
    gen = generate(lambda r: worker.submit(r.job(lambda: broken(r))), out)
    assert next(gen) == "half"
    with pytest.raises(ValueError, match="engine failed"):
        next(gen)
    assert out == {"closed": "None"}  # close() after an error returns no result
    assert worker.call(lambda: 41 + 1) == 42


def test_thread_per_call_is_joined_on_early_close() -> None:
    engine, out = OneAtATime(), dict[str, str]()
    started: list[threading.Thread] = []

    def submit(relay: Relay[str]) -> None:
        relay.start(lambda: engine.run(relay, 10_000, 0.001), name="test-call")
        started.append(relay._thread)  # type: ignore[arg-type]

    gen = generate(submit, out)
    assert next(gen) == "p0"
    gen.close()
    assert not started[0].is_alive() and out == {"closed": "halted"}
    again = generate(lambda r: r.start(lambda: engine.run(r, 1), name="test-call"), {})
    assert list(again) == ["p0"]


def test_worker_call_returns_and_raises_on_the_worker(worker: Worker) -> None:
    assert worker.call(lambda: threading.current_thread().name) == "test-worker"
    with pytest.raises(KeyError):
        worker.call(lambda: dict[str, int]()["missing"])
