"""Who runs the engine, and when: one :class:`Driver` per Model.

A session is never used from two threads at once. Whoever uses it *owns* the engine:

- a call running alone owns it on the caller's own thread (``Session.generate``, no
  hand-off between threads: a single stream costs what it always did);
- sessions without a Batcher run calls one at a time that way, in turn; a thread that
  asks again while its own stream is open gets ModelBusyError instead of a deadlock;
- sessions with a :class:`~localrun.backends.base.Batcher` get one engine thread as
  soon as sequences overlap (two streams from two threads, a batch): it admits waiting
  sequences up to ``capacity`` between steps, steps while any is in flight, and sends
  each sequence's pieces to its own consumer's queue, where stop strings, structured
  output and the Completion are made (:class:`~localrun.driver.sequence.Generation`).
  A consumer that stops (stop string, closed stream, cancelled token) gets its sequence
  cancelled at the next step; an engine error fails the sequences in flight and the
  next ones run; the thread ends when idle and ``close()`` waits for the work to end.

The batcher is built on the first overlap, not at load (OpenVINO's costs a second
pipeline), and only then does the driver know whether the session has one.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections import deque
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from localrun.backends.base import Batcher, Footprint, Session
from localrun.driver.reasoning import ChatSetup, chat_setup
from localrun.driver.sequence import NOT_STARTED, Event, Generation, Request, Sink, Stream
from localrun.errors import GenerationError, LocalrunError, ModelBusyError, ModelClosedError
from localrun.sampling import ResolvedSampling, resolve
from localrun.types import CancelToken, Chunk, Completion, FinishReason, Sampling

#: Seconds an engine thread with nothing to do waits for more before it ends.
IDLE_SECONDS = 2.0

#: What a batch yields per item: its Completion, or the error that item hit.
BatchResult = Completion | LocalrunError


def engine_failure(backend: str, error: BaseException) -> LocalrunError:
    """An engine's exception as the caller sees it (a crash must not look like one)."""
    if isinstance(error, LocalrunError):
        return error
    return GenerationError(backend, f"{type(error).__name__}: {error}")


class Driver:
    """The one place a Model's sequences meet its session."""

    def __init__(self, session: Session, catalog_defaults: Mapping[str, Any] | None = None,
                 chat_template: str | None = None, reasoning: str | None = None) -> None:
        self.session: Session | None = session
        self.backend = session.info.backend
        self._template, self._reasoning = chat_template, reasoning  # the caller's, the catalog's
        self._chat = chat_setup(session, chat_template, reasoning)
        self._chat_source = session.chat_template  # what _chat was read from
        # What the model's own files say wins over what localrun knows about the model.
        self.defaults = {**(catalog_defaults or {}), **session.sampling_defaults}
        self._cv = threading.Condition()
        self._owner: int | None = None  # the thread that runs the engine now
        self._want = 0  # threads waiting to own it (the engine thread gives way)
        self._waiting: deque[Generation] = deque()  # for the engine thread
        self._flight: dict[int, Generation] = {}  # key -> sequence in the batcher
        self._dropping: set[int] = set()  # keys the batcher was told to cancel
        self._batcher: Batcher | None = None
        self._can_batch: bool | None = None  # None: not asked yet
        self._limit: int | None = None  # most sequences at once the caller asked for
        self._thread: threading.Thread | None = None
        self._closed = False
        self._keys = itertools.count(1)

    @property
    def chat(self) -> ChatSetup:
        """The chat template conversations are rendered with, and how the model thinks
        (read again when the session's template changes and the caller gave none)."""
        session = self.session
        if session is not None and session.chat_template is not self._chat_source:
            self._chat_source = session.chat_template
            self._chat = chat_setup(session, self._template, self._reasoning)
        return self._chat

    # -- per call -------------------------------------------------------------------

    def resolve(self, request: Sampling) -> ResolvedSampling:
        """The one place a request meets the defaults (seed and limit come later)."""
        return resolve(request, self.defaults)

    def stream(self, request: Request, cancel: CancelToken) -> Stream:
        """One sequence as a Stream; nothing runs before its first ``next()``."""
        gen = Generation(request, cancel, chat=self.chat)
        return Stream(self._chunks(gen), cancel, gen)

    def _chunks(self, gen: Generation) -> Iterator[Chunk]:
        if self._route(alone=_has_images(gen.request)):
            yield from self._run_here(gen)
            return
        gen.sink = queue.SimpleQueue()
        gen.key = next(self._keys)
        self._enqueue([gen])
        done = False
        try:
            while True:
                _, payload, tokens = gen.sink.get()
                if isinstance(payload, BaseException):
                    done = True
                    raise payload
                if payload is None:  # the end (an eager sequence: its only event)
                    if gen.switching and not gen.cancel.cancelled:  # the answer phase
                        gen.resume(next(self._keys))
                        self._enqueue([gen])
                        continue
                    done = True
                    yield from gen.finish("stop" if gen.hit else None)
                    return
                if gen.switching:
                    continue  # what the engine made before it stopped the first phase
                if gen.cancel.cancelled:  # as on the caller's thread: stop between pieces
                    done = gen.halted = True
                    yield from gen.finish("cancelled")
                    return
                chunks = gen.feed(payload, tokens)
                if gen.hit:
                    done = True
                    yield from chunks
                    yield from gen.finish("stop")
                    return
                yield from chunks
        finally:
            if not done:
                gen.halted = True  # closed early: the engine drops it at its next step

    def _run_here(self, gen: Generation) -> Iterator[Chunk]:
        """One sequence through ``Session.generate`` on this thread (which owns the
        engine until the sequence ends or the stream is closed)."""
        try:
            session = self.session
            assert session is not None
            gen.prepare(session, self.defaults)
            while True:  # once, or twice for a thinking reply's answer phase
                assert gen.run_prompt is not None and gen.sampling is not None
                if not gen.sampling.max_tokens:  # echo alone, or no room for the answer
                    gen.stats.finish_reason = "length"
                    yield from gen.finish(None)
                    return
                finish = yield from self._pieces(session, gen)
                if gen.switching and finish is None:
                    gen.prepare(session, self.defaults)
                    continue
                yield from gen.finish(finish)
                return
        finally:
            self._release()

    def _pieces(self, session: Session, gen: Generation
                ) -> Generator[Chunk, None, FinishReason | None]:
        """One phase of a sequence through ``Session.generate``: its chunks, and how it
        ended (None: the engine ended it, or the first phase of a thinking reply)."""
        assert gen.run_prompt is not None and gen.sampling is not None
        cancel = gen.cancel
        pieces = session.generate(gen.run_prompt, gen.sampling, cancel, gen.stats)
        try:
            for piece in pieces:
                if cancel.cancelled:
                    return "cancelled"
                yield from gen.feed(piece)
                if gen.hit:
                    return "stop"
                if gen.switching:
                    return None
        except LocalrunError:
            raise
        except Exception as e:  # an engine failure must not look like a crash
            raise engine_failure(self.backend, e) from e
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()
        return None

    def batch(self, jobs: Sequence[tuple[int, Request]], width: int | None,
              cancel: CancelToken) -> Iterator[tuple[int, BatchResult]]:
        """Run ``jobs`` (index, request), at most ``width`` in flight (None: the engine
        decides); yield ``(index, result)`` as each ends."""
        if not jobs:
            return
        if (width or len(jobs)) > 1 and len(jobs) > 1 and self._batching() and \
                not any(_has_images(r) for _, r in jobs):
            yield from self._batched(jobs, width, cancel)
            return
        for i, request in jobs:  # in turn, each exactly as a stream
            if cancel.cancelled:
                yield i, NOT_STARTED
                continue
            stream = self.stream(request, cancel)
            try:
                result: BatchResult = stream.join()
            except (ModelClosedError, ModelBusyError):
                raise  # not this item's fault: every later item would fail the same way
            except LocalrunError as e:
                result = e
            finally:
                stream.close()
            yield i, result

    def _batched(self, jobs: Sequence[tuple[int, Request]], width: int | None,
                 cancel: CancelToken) -> Iterator[tuple[int, BatchResult]]:
        sink: Sink = queue.SimpleQueue()
        todo = deque(jobs)
        live: dict[Generation, int] = {}
        cap = width or len(jobs)
        try:
            while todo or live:
                if cancel.cancelled:
                    while todo:
                        i, request = todo.popleft()
                        yield i, NOT_STARTED
                fresh: list[Generation] = []
                while todo and len(live) < cap:
                    i, request = todo.popleft()
                    gen = Generation(request, cancel, sink, next(self._keys), eager=True,
                                     chat=self.chat)
                    live[gen] = i
                    fresh.append(gen)
                if fresh:
                    self._enqueue(fresh)
                if not live:
                    break
                # Eager sequences: the engine thread fed them, and sends only their end.
                gen, payload, _ = sink.get()
                index = live.pop(gen, None)
                if index is None:
                    continue  # an end that came after its sequence was done
                if isinstance(payload, BaseException):
                    if not isinstance(payload, LocalrunError):
                        raise payload
                    yield index, payload
                elif gen.switching and not cancel.cancelled:  # a thinking reply's answer
                    gen.resume(next(self._keys))
                    live[gen] = index
                    self._enqueue([gen])
                else:
                    gen.finish("stop" if gen.hit else None)
                    yield index, gen.result()
        finally:
            for gen in live:
                gen.halted = True

    def limit(self, n: int) -> None:
        """Run at most ``n`` sequences at once. Given before the batcher is built, the
        session builds no more slots than that (``Session.max_concurrency``), and none
        at all for 1; later it only caps how many the engine thread admits."""
        with self._cv:
            session = self._live(threading.get_ident())
            self._limit = n
            if self._can_batch is None:  # not built yet: the session sizes it
                session.max_concurrency = n
                if n == 1:
                    self._can_batch = False

    def capacity(self) -> int:
        """Sequences that run at once: the batcher's capacity (asking the session for it
        the first time) within :meth:`limit`, 1 when the session runs one at a time."""
        batcher = self._batcher if self._batching() else None
        return self._room(batcher.capacity) if batcher is not None else 1

    def _room(self, capacity: int) -> int:
        return min(capacity, self._limit) if self._limit is not None else capacity

    def footprint(self, slots: int | None) -> Footprint:
        """The session's :meth:`~localrun.backends.base.Session.footprint`, its slots
        within :meth:`limit` (the engine's batcher may be built to learn its capacity,
        except one that holds memory per slot from the start)."""
        with self.exclusive() as session:
            if self._can_batch is False:  # no batcher (limit 1, or none could be built)
                slots = 1
            try:
                held = session.footprint(slots)
            except LocalrunError:
                raise
            except Exception as e:
                raise engine_failure(self.backend, e) from e
        if self._limit is not None and held.slots > self._limit:
            return replace(held, slots=self._limit)
        return held

    def count_tokens(self, text: str) -> int:
        with self.exclusive() as session:
            return session.count_tokens(text)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[Session]:
        """The session, owned by this thread for the block (between engine steps)."""
        me = threading.get_ident()
        with self._cv:
            while True:
                session = self._live(me)
                if self._owner is None:
                    self._owner = me
                    break
                self._wait_to_own()
        try:
            yield session
        finally:
            self._release()

    def close(self) -> Session | None:
        """Refuse new calls, wait for the running ones, stop the engine thread and close
        the batcher; the session is returned for the caller to close (None: closed)."""
        me = threading.get_ident()
        with self._cv:
            if self.session is None:
                return None
            if self._owner == me:
                raise ModelBusyError()
            self._closed = True
            self._cv.notify_all()
            while self._owner is not None or self._waiting or self._flight or self._thread:
                self._cv.wait()
            session, self.session = self.session, None
            batcher, self._batcher = self._batcher, None
        if batcher is not None:
            batcher.close()
        return session

    # -- ownership ------------------------------------------------------------------

    def _live(self, me: int) -> Session:
        """The session, for a thread that does not own it (cv held)."""
        if self._closed or self.session is None:
            raise ModelClosedError()
        if self._owner == me:
            raise ModelBusyError()
        return self.session

    def _route(self, alone: bool = False) -> bool:
        """For one new sequence: True, this thread now owns the engine and runs it here;
        False, it goes to the engine thread (the session batches and others overlap).
        ``alone``: it runs here whatever else runs (a prompt with images, which no
        batcher takes); the engine thread's sequences wait meanwhile."""
        me = threading.get_ident()
        contended = False
        with self._cv:
            while True:
                session = self._live(me)
                free = self._owner is None
                idle = free and not self._waiting and not self._flight
                wants_batcher = not alone and self._can_batch is not False and (
                    session.batch_alone or contended or not idle)
                if not wants_batcher:
                    if free:
                        self._owner = me
                        return True
                elif self._can_batch:
                    return False
                elif free:  # overlap, and not known yet whether the session batches
                    self._find_batcher(me)
                    continue
                contended = True
                self._wait_to_own()

    def _batching(self) -> bool:
        """Whether several sequences at once go to the engine thread (asks the session
        for its batcher the first time)."""
        me = threading.get_ident()
        with self._cv:
            while True:
                self._live(me)
                if self._can_batch is not None:
                    return self._can_batch
                if self._owner is None:
                    self._find_batcher(me)
                    continue
                self._wait_to_own()

    def _find_batcher(self, me: int) -> None:
        """Ask the session for its batcher, owning the engine meanwhile (cv held)."""
        session = self.session
        assert session is not None
        self._owner = me
        self._cv.release()
        batcher: Batcher | None = None
        error: BaseException | None = None
        try:
            batcher = session.batcher()
        except Exception as e:
            error = e
        finally:
            self._cv.acquire()
            self._owner = None
            self._cv.notify_all()
        # A batcher that cannot be built leaves the session running one call at a time.
        self._batcher, self._can_batch = batcher, batcher is not None
        if error is not None:
            raise engine_failure(self.backend, error) from error

    def _wait_to_own(self) -> None:
        """Wait for a change, counted among the threads the engine thread gives way to
        between its steps (cv held)."""
        self._want += 1
        try:
            self._cv.wait()
        finally:
            self._want -= 1
            if not self._want:
                self._cv.notify_all()  # the engine thread may go on

    def _release(self) -> None:
        with self._cv:
            self._owner = None
            self._cv.notify_all()

    def _enqueue(self, gens: list[Generation]) -> None:
        with self._cv:
            if self._closed or self.session is None:
                raise ModelClosedError()
            self._waiting.extend(gens)
            if self._thread is None:
                self._thread = threading.Thread(target=self._engine, daemon=True,
                                                name="localrun-engine")
                self._thread.start()
            self._cv.notify_all()

    # -- the engine thread ----------------------------------------------------------

    def _engine(self) -> None:
        me = threading.get_ident()
        try:
            while (taken := self._next_round(me)) is not None:
                self._round(*taken)
        except BaseException as e:  # a bug: never leave a consumer waiting on a dead thread
            self._fail_all(engine_failure(self.backend, e))
        finally:
            with self._cv:
                if self._owner == me:
                    self._owner = None
                if self._thread is threading.current_thread():
                    self._thread = None
                self._cv.notify_all()

    def _next_round(self, me: int) -> tuple[list[Generation], list[Generation]] | None:
        """Wait until there is work and the engine is ours, then take from the waiting
        ones those that went away and those to admit; None: time to end. (One hold of
        the lock a step: this runs once per generated token.)"""
        timed_out = False
        with self._cv:
            while True:
                waiting = self._waiting
                work = bool(waiting or self._flight)
                if work and not self._want and self._owner in (None, me):
                    self._owner = me
                    break
                if self._owner == me:  # nothing to do, or someone waits to own it
                    self._owner = None
                    self._cv.notify_all()
                    if not work and self._batcher is not None:
                        self._batcher.idle()  # this thread's own resources only
                if not work and (self._closed or timed_out):
                    self._thread = None  # decided under the lock: _enqueue starts another
                    self._cv.notify_all()
                    return None
                timed_out = not self._cv.wait(IDLE_SECONDS)
            if not waiting:
                return [], []
            dropped = [g for g in waiting if g.stopping]
            for g in dropped:
                waiting.remove(g)
            assert self._batcher is not None
            room = max(self._room(self._batcher.capacity) - len(self._flight), 0)
            return dropped, [waiting.popleft() for _ in range(min(room, len(waiting)))]

    def _round(self, dropped: list[Generation], admit: list[Generation]) -> None:
        """Admit, cancel, step once, and hand the pieces over."""
        batcher, session = self._batcher, self.session
        assert batcher is not None and session is not None
        for g in dropped:
            _send(g, None)  # never started: it ends as cancelled, with no usage
        for g in admit:
            self._admit(batcher, session, g)
        flight = self._flight
        try:
            for key, g in flight.items():
                if (g.halted or g.cancel.cancelled) and key not in self._dropping:
                    self._dropping.add(key)
                    batcher.cancel(key)
            events = batcher.step() if flight else []
        except Exception as e:
            self._fail_flight(batcher, engine_failure(self.backend, e))
            return
        self._dispatch(events)

    def _admit(self, batcher: Batcher, session: Session, gen: Generation) -> None:
        try:
            gen.prepare(session, self.defaults)
        except BaseException as e:  # this request's own mistake, raised to its caller
            _send(gen, e)
            return
        assert gen.run_prompt is not None and gen.sampling is not None
        if not gen.sampling.max_tokens:  # echo alone, or no room for a thinking's answer
            gen.stats.finish_reason = "length"
            _send(gen, None)
            return
        try:
            batcher.add(gen.key, gen.run_prompt, gen.sampling, gen.stats)
        except Exception as e:
            _send(gen, engine_failure(self.backend, e))
            return
        self._flight[gen.key] = gen

    def _dispatch(self, events: list[tuple[int, str | None]]) -> None:
        flight = self._flight
        # The engine's token count as of each piece (a step may give one sequence more
        # than one): what a stop string that ends the sequence there reports.
        counts: dict[int, int] = {}
        sends: list[Event] = []
        ended: list[int] = []
        for key, piece in reversed(events):
            gen = flight.get(key)
            if gen is None:
                continue
            if piece is None:
                ended.append(key)
                sends.append((gen, gen.stats.error, gen.stats.completion_tokens))
                continue
            n = counts.get(key, gen.stats.completion_tokens)
            counts[key] = n - 1
            sends.append((gen, piece, n))
        for key in ended:
            flight.pop(key, None)
            self._dropping.discard(key)
        for event in reversed(sends):
            gen = event[0]
            if gen.eager:
                _feed_here(gen, event)
                continue
            sink = gen.sink
            assert sink is not None
            sink.put(event)

    def _fail_flight(self, batcher: Batcher, error: LocalrunError) -> None:
        """An engine error: every sequence in flight fails with it; the batcher is asked
        to drop them, so that the next sequences start clean."""
        flight, self._flight = self._flight, {}
        self._dropping.clear()
        for gen in flight.values():
            _send(gen, error)
        with contextlib.suppress(Exception):
            for key in flight:
                batcher.cancel(key)
            batcher.step()

    def _fail_all(self, error: LocalrunError) -> None:
        with self._cv:
            gens = [*self._waiting, *self._flight.values()]
            self._waiting.clear()
            self._flight.clear()
            self._dropping.clear()
        for gen in gens:
            _send(gen, error)


def _feed_here(gen: Generation, event: Event) -> None:
    """An eager sequence's event, on the engine thread: a piece is fed to it here (its
    consumer is not woken for it); its end (the engine's, a stop string's, an error) is
    sent, once. A stop string leaves it halted: the batcher drops it at the next step."""
    if gen.ended:
        return  # pieces and the end of a sequence a stop string already ended
    _, payload, tokens = event
    if isinstance(payload, str):
        try:
            gen.feed(payload, tokens)
        except Exception as e:  # this sequence's own failure, raised to its caller
            gen.halted = True
            payload = e
        else:
            if not gen.hit:
                return
            payload = None  # ended by a stop string: its consumer finishes it as "stop"
    gen.ended = True
    assert gen.sink is not None
    gen.sink.put((gen, payload, tokens))


def _send(gen: Generation, payload: str | BaseException | None, tokens: int = 0) -> None:
    assert gen.sink is not None
    event: Event = (gen, payload, tokens)
    gen.sink.put(event)


def _has_images(request: Request) -> bool:
    """Whether a request's conversation carries images (it then runs alone)."""
    return any(m.get("images") for m in request.messages or ())
