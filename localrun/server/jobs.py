"""One request's run on a model: its queue place, its worker thread, its deadline, and
what stops it (the client going away, the timeout, the server draining).

The engine runs in a worker thread (``localrun.Model.stream`` blocks); its chunks reach
the event loop through a queue. The model's slot is given back when that thread ends,
not when the HTTP response does, so the next request never finds the engine still busy.

Both APIs drive a generation the same way (:meth:`Job.generate`, then :meth:`Job.collect`
for one JSON answer or :meth:`Job.pump` for a stream); only the bytes differ, and those
are each API's :class:`Wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from localrun.errors import IncompleteOutputError
from localrun.server.errors import APIError
from localrun.server.manager import Lease, Loaded, ModelManager
from localrun.server.metrics import Metrics
from localrun.server.sizing import Kind
from localrun.server.state import state_of, to_api_error
from localrun.types import CancelToken, Chunk, Completion, Timings, Usage

#: "choice": one choice of a request that asked for several, whole (:class:`Choices`)
EventKind = Literal["chunk", "choice", "done", "error"]

#: the jobs open on each event loop (a server's), for :func:`stop_all`
_open: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, set[Job]] = \
    weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Event:
    kind: EventKind
    chunk: Chunk | None = None
    completion: Completion | None = None
    result: Any = None  # what a non-streaming worker returned (embeddings)
    error: BaseException | None = None
    choice: int = 0  # a "choice" event's index


@dataclass(frozen=True)
class Choices(Completion):
    """The replies of one request that asked for several (``n`` > 1, a list of prompts,
    OpenAI's ``choices``), in choice order. As a Completion it holds their sums, which
    the metrics and the access log count: every choice's completion tokens, and each
    prompt's tokens once (``n`` choices of one prompt read it once, as OpenAI counts)."""

    choices: tuple[Completion, ...] = ()

    @classmethod
    def of(cls, completions: Sequence[Completion], per_prompt: int = 1) -> Choices:
        first = completions[0]
        prompt = sum(c.usage.prompt_tokens for c in completions[::max(1, per_prompt)])
        usage = Usage(prompt, sum(c.usage.completion_tokens for c in completions),
                      sum(c.usage.reasoning_tokens for c in completions))
        timings = Timings(ttft=min(c.timings.ttft for c in completions),
                          total=max(c.timings.total for c in completions))
        return cls(text=first.text, finish_reason=first.finish_reason, usage=usage,
                   timings=timings, choices=tuple(completions))


class ChoiceRun:
    """Several sequences of one request, batched through the model's driver
    (``Model.batch_iter``: they run together where the engine batches, at most its
    concurrency at once). Iterated, it yields ``(index, Completion)`` as each ends (a
    stream of whole choices); :meth:`join` waits for all and returns :class:`Choices`.
    A reply whose JSON ``max_tokens`` cut is that choice with finish "length" (as a
    single stream's); any other failure of one choice fails the request."""

    def __init__(self, handle: Any, items: Sequence[Any], token: CancelToken,
                 per_prompt: int = 1, **options: Any) -> None:
        self.results: dict[int, Completion] = {}
        self.count = len(items)
        self.per_prompt = per_prompt
        self._it = handle.batch_iter(list(items), cancel=token, **options)

    def __iter__(self) -> ChoiceRun:
        return self

    def __next__(self) -> tuple[int, Completion]:
        i, result = next(self._it)
        if isinstance(result, IncompleteOutputError) and result.completion is not None:
            result = result.completion
        if not isinstance(result, Completion):
            raise result
        self.results[i] = result
        return i, result

    def join(self) -> Choices:
        for _ in self:
            pass
        return Choices.of([self.results[i] for i in range(self.count)], self.per_prompt)

    def __enter__(self) -> ChoiceRun:
        return self

    def __exit__(self, *exc: object) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


class Wire(ABC):
    """How one API writes a generation as it streams (SSE, NDJSON, ...)."""

    def begin(self) -> Iterable[bytes]:
        """What goes out before the first piece."""
        return ()

    @abstractmethod
    def chunk(self, chunk: Chunk) -> Iterable[bytes]:
        """One piece of the reply (may write nothing)."""

    def choice(self, index: int, completion: Completion) -> Iterable[bytes]:
        """One choice of several, whole (a request that asked for several: only the
        dialects that have ``n`` take one)."""
        raise NotImplementedError(f"{type(self).__name__} writes one choice")

    @abstractmethod
    def done(self, completion: Completion) -> Iterable[bytes]:
        """The end: finish reason, usage, the stream's terminator."""

    @abstractmethod
    def error(self, error: APIError) -> bytes:
        """A failure after the response began (its status is already 200)."""


#: what a generation route runs: the loaded model's handle and the request's cancel
#: token in, a ``localrun.Stream`` out
Call = Callable[[Any, CancelToken], Any]


class Job:
    """Open with :meth:`open`; :meth:`run` starts the worker; :meth:`next` reads events;
    :meth:`close` always (idempotent, synchronous: safe in a cancelled generator)."""

    def __init__(self, request: Any, endpoint: str, metrics: Metrics,
                 timeout: float | None) -> None:
        self.request = request
        self.endpoint = endpoint
        self.metrics = metrics
        self.t0 = time.monotonic()
        self.deadline = None if timeout is None else self.t0 + timeout
        self.timeout = timeout
        self.token = CancelToken()
        self.lease: Lease | None = None
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.first_token_at: float | None = None
        self.completion: Any = None  # a Completion, or an embedding result
        self.disconnected = False
        self._thread: threading.Thread | None = None
        self._loop = asyncio.get_running_loop()
        self.gone = asyncio.Event()
        self._watcher = self._loop.create_task(self._watch_disconnect())
        self._closed = False
        self._ran: Any = None  # the worker's own Completion, even when nobody read it
        #: the run's ``localrun.Stream`` once it started (its ``prompt_tokens``, and its
        #: ``stop_sequence`` at the end, for the dialects that report them)
        self.stream: Any = None
        self.started_at = 0.0  # time.monotonic() when the worker started
        self.stopped: APIError | None = None  # why the server ended it (:meth:`stop`)
        _open.setdefault(self._loop, set()).add(self)

    @classmethod
    async def open(cls, request: Any, endpoint: str, model: str, *,
                   kind: Kind = "chat", context: int | None = None,
                   keep_alive: Any = "default") -> Job:
        """Take a place in ``model``'s queue (loading it first if need be), then its slot."""
        st = state_of(request)
        manager: ModelManager = st.manager
        job = cls(request, endpoint, manager.metrics, manager.config.request_timeout)
        note = getattr(request, "state", None)
        if note is not None:
            note.asked = model  # for the access log (metrics label only loaded models)
        try:
            job.lease = await st.acquire(model, kind=kind, context=context,
                                         keep_alive=keep_alive, deadline=job.deadline,
                                         abort=job.gone)
        except BaseException:
            job.close()
            if job.stopped is not None:  # the server stopped it while it waited
                raise job.stopped from None
            raise
        return job

    @classmethod
    async def generate(cls, request: Any, endpoint: str, model: str, call: Call, *,
                       context: int | None = None, keep_alive: Any = "default",
                       stream: bool = True) -> tuple[Job, Event]:
        """Open, start ``call(handle, token)`` and wait for its first event, before any
        header goes out: a failure there still gets its own status code (400 for a
        prompt over the context, 500 for an engine failure). ``stream`` False (one JSON
        answer): the reply comes as one "done" event, its pieces never cross threads."""
        job = await cls.open(request, endpoint, model, context=context, keep_alive=keep_alive)
        try:
            handle = job.handle
            job.run(lambda token: call(handle, token), whole=not stream)
            return job, await job.first()
        except BaseException:
            job.close()
            raise

    @classmethod
    async def call(cls, request: Any, endpoint: str, model: str,
                   work: Callable[[Any], Any], *, kind: Kind = "chat",
                   context: int | None = None, keep_alive: Any = "default",
                   param: str | None = None) -> tuple[Job, Any]:
        """Open, run ``work(handle)`` (not a stream: embeddings) and return the job (for
        its timings, already closed) and what ``work`` returned."""
        job = await cls.open(request, endpoint, model, kind=kind, context=context,
                             keep_alive=keep_alive)
        try:
            handle = job.handle
            job.run(lambda token: work(handle))
            event = await job.next()
            if event.kind == "error":
                assert event.error is not None
                raise to_api_error(event.error, param=param)
            return job, event.result
        finally:
            job.close()

    @property
    def loaded(self) -> Loaded:
        assert self.lease is not None
        return self.lease.loaded

    @property
    def handle(self) -> Any:
        """The model this request calls (a preset's: the shared copy, as the preset)."""
        assert self.lease is not None
        return self.lease.handle

    # -- reading what it made ---------------------------------------------------------

    async def first(self) -> Event:
        """The next event; an error raised as the answer's status."""
        event = await self.next()
        if event.kind == "error":
            assert event.error is not None
            raise to_api_error(event.error)
        return event

    async def collect(self, event: Event) -> Completion:
        """Read to the end from ``event`` for one JSON answer, and close."""
        try:
            while event.kind in ("chunk", "choice"):
                event = await self.next()
            if event.kind == "error":
                assert event.error is not None
                raise to_api_error(event.error)
            assert event.completion is not None
            return event.completion
        finally:
            self.close()

    async def pump(self, event: Event, wire: Wire) -> AsyncIterator[bytes]:
        """The response body of a stream, from ``event`` on, in ``wire``'s format; an
        error (the engine's, the request timeout) ends it in that format too. Closes the
        job however it ends (a client that went away cancels the run)."""
        try:
            for data in wire.begin():
                yield data
            while True:
                if event.kind == "chunk":
                    assert event.chunk is not None
                    for data in wire.chunk(event.chunk):
                        yield data
                elif event.kind == "choice":
                    assert event.completion is not None
                    for data in wire.choice(event.choice, event.completion):
                        yield data
                elif event.kind == "done":
                    assert event.completion is not None
                    for data in wire.done(event.completion):
                        yield data
                    return
                else:
                    assert event.error is not None
                    yield wire.error(to_api_error(event.error))
                    return
                event = await self.next()
        except APIError as e:  # the request timeout, mid-stream
            yield wire.error(e)
        finally:
            self.close()

    # -- the worker -------------------------------------------------------------------

    def run(self, work: Callable[[CancelToken], Any], whole: bool = False) -> None:
        """Start ``work(token)`` in a thread: it returns a Stream (chunks are forwarded,
        or with ``whole`` only its Completion: ``Stream.join()``) or any other value
        (forwarded as the "done" event's completion)."""
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._work, args=(work, whole), daemon=True,
                                        name=f"localrun-{self.endpoint}")
        self._thread.start()

    def _put(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
            self._loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def _work(self, work: Callable[[CancelToken], Any], whole: bool) -> None:
        try:
            result = work(self.token)
            if hasattr(result, "join") and hasattr(result, "__next__"):
                self.stream = result
                with result:
                    # one JSON answer: join() lets the engine thread feed the reply, and
                    # neither this thread nor the event loop wakes for each token
                    for item in () if whole else result:
                        if isinstance(item, tuple):  # a ChoiceRun's whole choice
                            self._put(Event("choice", completion=item[1], choice=item[0]))
                        else:
                            self._put(Event("chunk", chunk=item))
                    try:
                        completion = result.join()
                    except IncompleteOutputError as e:
                        # the reply's JSON was cut by max_tokens: OpenAI answers it with
                        # finish_reason "length", and so does localrun
                        completion = e.completion  # type: ignore[assignment]
                self._ran = completion
                self._put(Event("done", completion=completion))
            else:
                self._put(Event("done", result=result))
        except BaseException as e:
            self._put(Event("error", error=e))
        finally:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._worker_ended)

    def _worker_ended(self) -> None:
        if self.lease is not None:
            self.lease.release()
            ran = self._ran
            if self._closed and self.completion is None and isinstance(ran, Completion):
                # ended early (disconnect, timeout): the tokens it did generate count
                name = self.loaded.name
                self.metrics.prompt_tokens.labels(model=name).inc(ran.usage.prompt_tokens)
                self.metrics.completion_tokens.labels(model=name).inc(
                    ran.usage.completion_tokens)

    async def next(self) -> Event:
        """The next event; on the deadline the run is cancelled and 504 raised."""
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            event = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            self.token.cancel()
            raise APIError(504, f"Request timed out after {self.timeout:g} s "
                           "(--request-timeout); generation was stopped",
                           code="timeout") from None
        if self.first_token_at is None and (event.kind == "choice" or (
                event.kind == "chunk" and event.chunk is not None and (
                    event.chunk.text or event.chunk.reasoning or event.chunk.tool_calls))):
            self.first_token_at = time.monotonic()  # thinking is the reply's first token too
        if event.kind == "done":
            self.completion = event.completion if event.completion is not None \
                else event.result
        return event

    # -- ending -----------------------------------------------------------------------

    async def _watch_disconnect(self) -> None:
        try:
            while True:
                message = await self.request.receive()
                if message.get("type") == "http.disconnect":
                    break
        except Exception:
            return
        self.disconnected = True
        self.gone.set()  # gives up the place in the queue
        self.token.cancel()  # the engine stops at its next token

    def stop(self, error: APIError) -> None:
        """End this job with ``error`` (the server is stopping): a stream writes it as
        its last event, in its API's format; an answer not begun is ``error``."""
        if self._closed or self.stopped is not None:
            return
        self.stopped = error
        self.token.cancel()  # the engine stops at its next token
        self.gone.set()  # a wait for the model gives up (open() raises ``error``)
        self.queue.put_nowait(Event("error", error=error))

    def close(self) -> None:
        """Stop watching; cancel a run nobody will read; count the request."""
        if self._closed:
            return
        self._closed = True
        jobs = _open.get(self._loop)
        if jobs is not None:
            jobs.discard(self)
        self._watcher.cancel()
        if self._thread is None:
            if self.lease is not None:
                self.lease.release()  # never ran: the slot goes back now
        elif self.completion is None:
            self.token.cancel()  # ended early (error, disconnect, timeout)
        self._record()

    def _record(self) -> None:
        if self.lease is None:
            return
        name = self.loaded.name
        c = self.completion
        if self.first_token_at is not None:
            self.metrics.ttft.labels(model=name).observe(self.first_token_at - self.t0)
        elif isinstance(c, Completion) and c.timings.ttft > 0 and self.started_at:
            # a whole answer (no chunk events): the queue, then the engine's own TTFT
            ttft = self.started_at - self.t0 + c.timings.ttft
            self.metrics.ttft.labels(model=name).observe(ttft)
        if isinstance(c, Completion):
            usage = c.usage
            self.metrics.prompt_tokens.labels(model=name).inc(usage.prompt_tokens)
            self.metrics.completion_tokens.labels(model=name).inc(usage.completion_tokens)
            if usage.completion_tokens > 1 and c.timings.total > c.timings.ttft:
                tpot = (c.timings.total - c.timings.ttft) / (usage.completion_tokens - 1)
                self.metrics.tpot.labels(model=name).observe(tpot)
        note = getattr(self.request, "state", None)
        if note is not None:
            note.model = name
            if isinstance(c, Completion):
                note.prompt_tokens = c.usage.prompt_tokens
                note.completion_tokens = c.usage.completion_tokens
                note.finish = c.finish_reason
            elif c is not None and isinstance(getattr(c, "tokens", None), int):
                note.prompt_tokens = c.tokens
                self.metrics.prompt_tokens.labels(model=name).inc(c.tokens)
            note.queued = self.lease.queued_seconds


def stop_all(error: APIError) -> int:
    """End every job open on this event loop with ``error`` (:meth:`Job.stop`): how a
    server whose drain time is up ends the streams still running, with an error event
    rather than a cut. Returns how many there were."""
    jobs = list(_open.get(asyncio.get_running_loop(), ()))
    for job in jobs:
        job.stop(error)
    return len(jobs)
