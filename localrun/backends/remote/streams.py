"""Many streaming requests to one server at once: the remote backend's Batcher.

Every sequence is its own streaming request, read by a thread of its own; the server's
scheduler (vLLM's continuous batching) does the batching. Cancelling a sequence shuts
its connection down at once (:class:`ClosingCancel`), so the server aborts the request
even while it has nothing to send (queued, or in a long prefill).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from localrun.backends.base import Batcher, GenerationStats, Prompt
from localrun.errors import GenerationError, LocalrunError
from localrun.sampling import ResolvedSampling
from localrun.types import CancelToken

#: ``Session.generate``: the pieces of one request
Generate = Callable[[Prompt, ResolvedSampling, CancelToken, GenerationStats], Iterator[str]]


class ClosingCancel(CancelToken):
    """A cancel token that also shuts its request's connection down.

    A stream's reader thread sits in ``recv()`` until the server's next event, which may
    be far off (a request queued behind others, a long prefill); shutting the socket down
    wakes it at once and tells the server the client is gone (vLLM then aborts the
    request). Over HTTP/1.1 each streaming request has a connection of its own, so no
    other request is touched."""

    __slots__ = ("_lock", "_sock")

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    def attach(self, response: Any) -> None:
        """The (httpx2) response being read; cancelling from now on shuts its socket
        down."""
        if not response.http_version.startswith("HTTP/1"):
            return  # an HTTP/2 connection carries other requests too: leave it be
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if not isinstance(sock, socket.socket):
            return
        with self._lock:
            self._sock = sock
        if self.cancelled:  # cancelled while the request was being sent
            self._shutdown()

    def detach(self) -> None:
        with self._lock:
            self._sock = None

    def cancel(self) -> None:
        super().cancel()
        self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            sock = self._sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


#: Requests in flight at once from one Model (the server queues what it cannot run).
REMOTE_CAPACITY = 64
#: Seconds a step waits for the server when nothing has arrived, before it hands control
#: back to the driver (which admits new sequences and sends cancels between steps).
STEP_WAIT = 0.05


class RequestBatcher(Batcher):
    """One streaming request per sequence, each read by a thread of its own into one
    queue; the server's scheduler does the batching, and a step hands over what the
    requests have streamed since the last one (waiting up to STEP_WAIT for something).

    A cancelled sequence ends at the next step, whatever its request is doing; its
    connection is shut down at once (:class:`ClosingCancel`), so the server aborts it,
    and what its thread reads afterwards is dropped."""

    capacity = REMOTE_CAPACITY
    reserved_bytes = 0  # the sequences' KV caches are the server's, not this process's

    def __init__(self, generate: Generate, backend: str) -> None:
        self._generate = generate
        self._backend = backend
        self._events: queue.SimpleQueue[tuple[int, str | None]] = queue.SimpleQueue()
        self._live: dict[int, ClosingCancel] = {}  # sequences the driver has in flight
        self._ended: list[int] = []  # cancelled, not reported yet
        self._threads: dict[int, threading.Thread] = {}  # requests still being read

    def add(self, key: int, prompt: Prompt, sampling: ResolvedSampling,
            stats: GenerationStats) -> None:
        cancel = self._live[key] = ClosingCancel()
        events, generate, backend = self._events, self._generate, self._backend
        stats.started = time.perf_counter()

        def work() -> None:
            try:
                for piece in generate(prompt, sampling, cancel, stats):
                    events.put((key, piece))
            except LocalrunError as e:  # this request's failure, not the others'
                if not cancel.cancelled:
                    stats.error = e
            except Exception as e:
                if not cancel.cancelled:
                    stats.error = GenerationError(backend, f"{type(e).__name__}: {e}")
            finally:
                events.put((key, None))

        thread = self._threads[key] = threading.Thread(
            target=work, daemon=True, name=f"localrun-remote-{key}")
        thread.start()

    def cancel(self, key: int) -> None:
        token = self._live.pop(key, None)
        if token is not None:
            token.cancel()
            self._ended.append(key)

    def step(self) -> list[tuple[int, str | None]]:
        out: list[tuple[int, str | None]] = [(key, None) for key in self._ended]
        self._ended.clear()
        got: list[tuple[int, str | None]] = []
        if not out:
            try:
                got.append(self._events.get(timeout=STEP_WAIT))
            except queue.Empty:
                return []
        while True:
            try:
                got.append(self._events.get_nowait())
            except queue.Empty:
                break
        for key, piece in got:
            if piece is None:
                self._threads.pop(key, None)
                if self._live.pop(key, None) is None:
                    continue  # a cancelled request's thread ending: already reported
            elif key not in self._live:
                continue
            out.append((key, piece))
        return out

    def close(self) -> None:
        """Cancel what is still in flight and wait (briefly) for its threads to end."""
        for key in list(self._live):
            self.cancel(key)
        deadline = time.monotonic() + 5.0
        for thread in list(self._threads.values()):
            thread.join(max(deadline - time.monotonic(), 0.0))
        self._ended.clear()
        self._threads.clear()
