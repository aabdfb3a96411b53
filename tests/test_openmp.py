"""llama.cpp's OpenMP worker pools (localrun/backends/llama_cpp/openmp.py): a thread that is done
with llama.cpp keeps none, so that the driver's engine thread's pool is the only one
and libgomp keeps spinning at its barriers (with more pool threads than CPUs it sleeps
at each of a decode step's hundreds of barriers: 4 sequences decoded together fell from
188 to 122 tokens/s on 2 cores)."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.conftest import requires_llama


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _on_a_live_thread(work: Callable[[], Any]) -> tuple[int, int]:
    """The process's thread count before and after ``work`` ran on a worker thread that
    is still alive when counted (its OpenMP pool, if kept, is counted too)."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()
        before = _threads()
        pool.submit(work).result()
        return before, _threads()


@pytest.fixture(scope="module")
def two_threads(default_gguf: Any) -> Any:
    import localrun
    from localrun.backends.llama_cpp.openmp import _mapped_libgomp

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads through /proc (Linux)")
    with localrun.load(str(default_gguf), backend="llama.cpp", context=512, threads=2) as m:
        m.complete("Hello", max_tokens=2, temperature=0)  # llama.cpp has loaded its runtime
        if not _mapped_libgomp():
            pytest.skip("this llama-cpp-python is not built with GNU OpenMP (libgomp)")
        yield m


@requires_llama
def test_a_lone_call_leaves_no_openmp_workers_on_its_thread(two_threads: Any) -> None:
    before, after = _on_a_live_thread(
        lambda: two_threads.complete("Count to five:", max_tokens=8, temperature=0))
    assert after == before


@requires_llama
def test_building_the_batcher_leaves_no_openmp_workers_on_its_thread(two_threads: Any
                                                                      ) -> None:
    """The batcher's calibration decodes on the thread that asks for it first."""
    assert getattr(two_threads._session, "_batcher", None) is None
    before, after = _on_a_live_thread(lambda: two_threads.max_concurrency)
    assert getattr(two_threads._session, "_batcher", None) is not None
    assert after == before


@requires_llama
def test_release_pool_is_harmless_without_a_pool() -> None:
    from localrun.backends.llama_cpp.openmp import release_pool

    release_pool()  # nothing decoded on this thread: no pool to give back
    release_pool()


@requires_llama
def test_an_idle_engine_thread_keeps_no_openmp_workers(two_threads: Any) -> None:
    """The driver's engine thread outlives its work by a while (IDLE_SECONDS), waiting
    for more; it gives its pool back as it starts waiting, not when it ends."""
    import time

    driver = two_threads._driver
    deadline = time.monotonic() + 30
    while driver._thread is not None:  # an earlier test's engine thread ends
        assert time.monotonic() < deadline
        time.sleep(0.05)
    before = _threads()
    results = two_threads.batch(["Count to five:", "Name three colours:"], temperature=0,
                                max_tokens=8)
    # how many tokens each reply got does not matter here (one may meet its end early)
    assert all(c.usage.completion_tokens > 0 for c in results), results
    # the engine thread lets go of the engine and its pool as it starts waiting; it stays
    # alive for IDLE_SECONDS (2) more: its OpenMP worker, kept, would be counted all along
    settled = time.monotonic() + 1.0
    while _threads() != before + 1 and time.monotonic() < settled:
        time.sleep(0.01)
    assert driver._thread is not None and driver._thread.is_alive()
    after = _threads()
    assert after == before + 1, (before, after)  # the engine thread alone: no OpenMP worker
