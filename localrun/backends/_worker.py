"""Engine calls on another thread, text pieces back on the caller's.

Some engines cannot generate on the caller's thread (see the top of mlx.py and
openvino_genai.py for why). :class:`Relay` carries one generation across: the job
on the engine's thread puts pieces and ends with a result or an exception; the
caller's generator reads them, and when it is closed early (a stop string, a cancel,
an abandoned stream) :meth:`Relay.close` asks the job to halt (the job checks
:attr:`Relay.halted` between tokens) and waits for it to end, so the engine is free
for the next call when ``close`` returns. :class:`Worker` is one thread that runs
jobs in order, for engines whose every call must run on the same thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Worker:
    """One thread that runs jobs in order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; it must not raise (wrap it with :meth:`Relay.job`)."""
        self._jobs.put(job)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker and wait for its result (or its exception)."""
        box: list[Any] = []
        done = threading.Event()

        def job() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # re-raised on the caller's thread
                box.append((False, e))
            done.set()

        self.submit(job)
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def stop(self) -> None:
        """End the thread once the jobs queued before have run."""
        self._jobs.put(None)
        self._thread.join()


class _End:
    """The end of the job: its result, or the exception it raised."""

    __slots__ = ("error", "result")

    def __init__(self, result: object = None, error: BaseException | None = None) -> None:
        self.result = result
        self.error = error


class Relay(Generic[R]):
    """One generation's pieces from the engine's thread to the caller's generator.

    Engine side: :meth:`put` each piece, stop early once :attr:`halted` is true, and run
    the whole job through :meth:`job` (or :meth:`start`), which sends its result or
    exception across. Caller side: iterate for the pieces, then :meth:`result`; always
    :meth:`close` (in a ``finally``) before the engine is used again.
    """

    def __init__(self) -> None:
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()  # pieces, then an _End
        self._halt = threading.Event()
        self._end: _End | None = None
        self._thread: threading.Thread | None = None

    # -- engine side ----------------------------------------------------------------------

    def put(self, piece: Any) -> None:
        """One piece: text, or what the caller makes text of (OpenVINO's VLM path sends
        token ids and detokenizes on the caller's thread)."""
        self._out.put(piece)

    @property
    def halted(self) -> bool:
        """The caller has stopped reading: end the job at the next token."""
        return self._halt.is_set()

    def job(self, produce: Callable[[], R]) -> Callable[[], None]:
        """``produce`` as a job for a :class:`Worker`: its result or its exception ends
        the pieces."""

        def run() -> None:
            try:
                end = _End(produce())
            except BaseException as e:  # handed to the caller's thread
                end = _End(error=e)
            self._out.put(end)

        return run

    def start(self, produce: Callable[[], R], name: str) -> None:
        """Run ``produce`` on a thread of its own (joined by :meth:`close`)."""
        self._thread = threading.Thread(target=self.job(produce), name=name, daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """The pieces, until the job ends."""
        while self._end is None:
            item = self._out.get()
            if isinstance(item, _End):
                self._end = item
                return
            yield item

    def result(self) -> R:
        """What the job returned; re-raises its exception. Only once the pieces ended."""
        assert self._end is not None, "Relay.result() before the pieces ended"
        if self._end.error is not None:
            raise self._end.error
        return self._end.result  # type: ignore[return-value]

    def close(self) -> R | None:
        """Halt the job and wait until it has ended: the engine is free when this returns.
        Returns the job's result, None when it raised. Idempotent."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
        while self._end is None:  # closed early: skip the pieces nobody will read
            item = self._out.get()
            if isinstance(item, _End):
                self._end = item
        return None if self._end.error is not None else self._end.result  # type: ignore[return-value]
