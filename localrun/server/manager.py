"""Which models are loaded, who is using them, and when they go.

Any name localrun accepts loads on its first request (plan → fit check → fetch, as
``localrun.load`` does). Each loaded model has ``slots`` and an admission queue: a model
whose engine batches (``Model.max_concurrency`` > 1) runs up to ``--parallel`` requests
at once, together in its engine's batch; any other runs one at a time. At most
``max_queue`` more wait, and the next one gets 429 with ``Retry-After``. A model counts
as its weights, overhead and one KV cache, plus what its engine's batcher holds beyond
that to run several at once (``Model.batch_reserved_bytes``: llama.cpp's batch context;
nothing where the sequences share the model's KV cache; where it is not fixed, one more
KV cache per slot), and what its engine keeps between calls for KV reuse
(``Model.kept_cache_bytes``: MLX's prompt caches). A batcher that holds memory per slot
from the start (llama.cpp's: a KV stream each, ``Model.batch_slots``) is sized to what
memory holds before it is built (``Model.limit_concurrency``; none at all when only one
request fits). Idle models unload after their keep-alive, and when a model about to
load would not fit, idle models go first, least recently used first.

A name is looked up on disk before the load lock is taken (bounded: formats/detect.py),
and the client may leave during any wait. Loaded models are keyed by file and the
context the engine loads (:mod:`localrun.server.copies`): spellings of a file and
``num_ctx`` values that come to one context share a copy, at most ``MAX_COPIES``
contexts of a file are loaded at once, and the command line's models stay pinned.

All bookkeeping happens on the event loop thread; engines load, run and close in
worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from localrun.errors import LocalrunError, ModelTooLargeError
from localrun.server.config import ServerConfig
from localrun.server.copies import (
    MAX_COPIES,
    FileId,
    ModelFile,
    Names,
    file_id,
    identify,
    pick,
)
from localrun.server.errors import APIError
from localrun.server.metrics import Metrics
from localrun.server.sizing import (
    Batch,
    Kind,
    available_ram,
    estimate_bytes,
    estimate_loaded,
    footprint,
    kept_bytes,
)
from localrun.server.waiting import left, wait
from localrun.types import ModelInfo

if TYPE_CHECKING:
    from localrun.memory import MemoryEstimate
    from localrun.resolve import Target

log = logging.getLogger("localrun.server")

#: ``--parallel``'s default for a model on the CPU whose engine batches: requests it runs
#: at once. A CPU's decode is bound by memory bandwidth: past a few sequences each reply
#: slows nearly in proportion for little more throughput (docs/results/llama_batch.md:
#: 8 small-model sequences cost about two single steps), and every slot holds a KV cache.
#: On a GPU the engine's own capacity is the default. LM Studio's default is 4 too.
DEFAULT_PARALLEL_CPU = 4

#: A loaded model's key: what it is, which file (copies.file_id), at what context.
Key = tuple[Kind, FileId, int | None]


@dataclass(eq=False)
class Loaded:
    """One loaded model (a ``localrun.Model``, or an embedder) and its queue."""

    name: str  # as first requested: what /api/ps, logs and metrics call it
    kind: Kind
    context: int | None  # the context the engine loaded it with
    handle: Any
    info: ModelInfo
    size: int  # bytes it is counted as (estimate, see footprint)
    pinned: bool  # named on the command line: no keep-alive expiry
    keep_alive: float | None
    load_seconds: float
    slots: int  # requests it runs at once (several: together in its engine's batch)
    file: FileId = ""  # the file its engine opened (copies.file_id)
    #: contexts requests asked for that it serves: ours, and the engine's own rounding
    #: where that differs from what copies.ModelFile.context predicted
    serves: set[int] = field(default_factory=set)
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None  # monotonic; None: not scheduled
    active: int = 0  # admitted: running + waiting
    running: int = 0
    ema_seconds: float = 2.0  # recent request duration, for Retry-After
    sem: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self.sem = asyncio.Semaphore(self.slots)

    @property
    def key(self) -> Key:
        return (self.kind, self.file, self.context)

    @property
    def waiting(self) -> int:
        return self.active - self.running

    def expires_wall(self) -> float | None:
        """Unix time it unloads (None: it stays)."""
        if self.pinned or self.keep_alive is None:
            return None
        if self.expires_at is not None:
            return time.time() + max(0.0, self.expires_at - time.monotonic())
        return time.time() + self.keep_alive  # busy now: keep-alive counts from the end


class Lease:
    """One request's hold on a model: a place in its queue, then its slot."""

    def __init__(self, manager: ModelManager, loaded: Loaded, keep_alive: float | None
                 ) -> None:
        self.manager = manager
        self.loaded = loaded
        self.keep_alive = keep_alive
        self.has_slot = False
        self.released = False
        self.started = time.monotonic()
        self.queued_seconds = 0.0

    def release(self) -> None:
        """Give back the slot and the place (idempotent; on the event loop thread)."""
        if self.released:
            return
        self.released = True
        self.manager._release(self)


class ModelManager:
    def __init__(self, config: ServerConfig, metrics: Metrics,
                 loader: Callable[..., Any] | None = None,
                 embed_loader: Callable[..., Any] | None = None,
                 available_memory: Callable[[], int] | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self._loader = loader or _load_chat
        self._embed_loader = embed_loader or _load_embed
        self._available = available_memory or available_ram
        self.models: dict[Key, Loaded] = {}
        self._names = Names()  # names requests used, and the file each came to
        self._load_lock: asyncio.Lock | None = None
        self._reaper: asyncio.Task[None] | None = None

    # -- life cycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._load_lock = asyncio.Lock()
        for m in self.models.values():  # loaded before the loop ran (preload)
            m.sem = asyncio.Semaphore(m.slots)
        self._reaper = asyncio.create_task(self._reap_forever(), name="localrun-keep-alive")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for m in list(self.models.values()):
            await self._unload(m, "server stopping")

    def preload(self, names: tuple[str, ...],
                load: Callable[[str], Any] | None = None) -> list[Loaded]:
        """Load the command line's models before serving (errors reach the CLI as is);
        ``load(name)`` is the CLI's loader (download progress on the terminal)."""
        out: list[Loaded] = []
        for name in names:
            try:  # another spelling of a file named already: that copy
                got = identify(name, "chat", self.config)
            except Exception:
                got = None  # the loader says what is wrong with it
            mf = got[0] if got is not None else None
            if self._pick("chat", mf, name, None) is not None:
                self._names.learn("chat", name, mf)
                continue
            t0 = time.monotonic()
            handle = load(name) if load else self._loader(name, self.config, None)
            out.append(self._register(name, "chat", None, handle, time.monotonic() - t0,
                                      pinned=True, size=None))
        return out

    # -- using a model ----------------------------------------------------------------

    async def acquire(self, name: str, *, kind: Kind = "chat", context: int | None = None,
                      keep_alive: float | Literal["default"] | None = "default",
                      deadline: float | None = None,
                      abort: asyncio.Event | None = None) -> Lease:
        """Load ``name`` if needed, take a place in its queue (429 when full), then wait
        for its slot (until ``deadline``, monotonic)."""
        if not name or not isinstance(name, str):
            raise APIError(400, "Missing 'model': name the model to use (see GET /v1/models)",
                           param="model")
        loaded = await self._instance(name, kind, context, deadline, abort)
        capacity = loaded.slots + self.config.max_queue
        if loaded.active >= capacity:
            self.metrics.rejected.labels(model=name, reason="queue_full").inc()
            retry = self.retry_after(loaded)
            raise APIError(
                429, f"Model '{name}' is busy: {loaded.running} running and {loaded.waiting} "
                f"waiting (--max-queue {self.config.max_queue}); retry in {retry} s",
                code="queue_full", headers={"Retry-After": str(retry)})
        ka = self.config.keep_alive if keep_alive == "default" else keep_alive
        lease = Lease(self, loaded, ka)
        loaded.active += 1
        loaded.expires_at = None
        self._gauge(loaded)
        try:
            sem = loaded.sem
            await wait(sem.acquire(), lambda _: sem.release(), left(deadline), abort,
                       f"in the queue for '{name}'", lease.started)
        except BaseException:
            lease.release()
            raise
        lease.has_slot = True
        lease.queued_seconds = time.monotonic() - lease.started
        loaded.running += 1
        self._gauge(loaded)
        return lease

    def retry_after(self, loaded: Loaded) -> int:
        """Seconds until a place is likely free: the queue ahead × recent durations."""
        ahead = max(1, loaded.waiting + 1) / max(1, loaded.slots)
        return max(1, min(600, math.ceil(loaded.ema_seconds * ahead)))

    def _release(self, lease: Lease) -> None:
        m = lease.loaded
        if lease.has_slot:
            m.running -= 1
            m.sem.release()
            took = time.monotonic() - lease.started - lease.queued_seconds
            m.ema_seconds = 0.8 * m.ema_seconds + 0.2 * took
        m.active -= 1
        m.last_used = time.monotonic()
        if not m.pinned:  # a request's keep_alive never unpins one named at start
            m.keep_alive = lease.keep_alive  # Ollama's rule: the last request's, or default
        if m.active == 0 and not m.pinned and m.keep_alive is not None:
            m.expires_at = m.last_used + m.keep_alive
            if m.keep_alive == 0 and self.models.get(m.key) is m:
                self._schedule_unload(m, "keep_alive 0")
        self._gauge(m)

    def _gauge(self, m: Loaded) -> None:
        self.metrics.queue_depth.labels(model=m.name).set(m.waiting)
        self.metrics.running.labels(model=m.name).set(m.running)

    # -- loading and unloading --------------------------------------------------------

    async def _instance(self, name: str, kind: Kind, context: int | None,
                        deadline: float | None, abort: asyncio.Event | None) -> Loaded:
        """The loaded copy that serves ``name`` at ``context``, loaded if need be. A name
        not seen before is looked up on disk first, in a worker thread and without the
        load lock (bounded: a folder that is no model is refused quickly); the client may
        leave meanwhile (499), or the deadline pass (504)."""
        found = self._pick(kind, self._names.get(kind, name), name, context)
        if found is not None:
            return found
        started = time.monotonic()
        got = await wait(asyncio.to_thread(identify, name, kind, self.config), None,
                         left(deadline), abort, f"for '{name}' to be found", started)
        mf, target = got if got is not None else (None, None)
        found = self._pick(kind, mf, name, context)
        if found is not None:
            self._names.learn(kind, name, mf)
            return found
        lock = self._load_lock
        assert lock is not None, "ModelManager.start() was not called"
        # one load at a time: the fit check sees the truth
        await wait(lock.acquire(), lambda _: lock.release(), left(deadline), abort,
                   f"to load '{name}' (another model is loading)", started)
        try:
            return await self._load(name, kind, context, mf, target)
        finally:
            lock.release()

    async def _load(self, name: str, kind: Kind, context: int | None,
                    mf: ModelFile | None, target: Target | None) -> Loaded:
        """Load ``name`` (``mf``: its file, where it is on disk; ``target``: where
        :func:`identify` found it), holding the load lock."""
        if mf is not None:
            found = self._pick(kind, mf, name, context) or \
                await self._within_copies(name, kind, mf, context)
            if found is not None:
                self._names.learn(kind, name, mf)
                return found
        need = await asyncio.to_thread(estimate_bytes, name, context, self.config, target)
        await self._make_room(need, name)
        loader = self._loader if kind == "chat" else self._embed_loader
        t0 = time.monotonic()
        while True:
            try:
                handle = await asyncio.to_thread(loader, name, self.config, context)
                break
            except ModelTooLargeError:
                # the library's own fit check (a Hub model we could not size first):
                # free what is idle and try again, then give up with its numbers
                victim = self._lru_idle()
                if victim is None:
                    raise
                await self._unload(victim, f"to make room for {name}")
        seconds = time.monotonic() - t0
        opened = ModelFile.of(handle.info)
        asked = {f.context(kind, context, self.config) for f in (mf, opened) if f}
        same = self.models.get((kind, opened.id, handle.info.context_length))
        if same is not None:  # a name first seen now (a Hub alias) for a loaded copy
            await asyncio.to_thread(handle.close)
            same.serves |= asked
            self._names.learn(kind, name, opened)
            return same
        try:
            est = await asyncio.to_thread(estimate_loaded, handle.info, context)
            kv = est.kv_cache_bytes if est is not None else 0
            base = need if need is not None else (est.total_bytes if est is not None else 0)
            batch = await asyncio.to_thread(self._wanted, name, kind, handle)
            slots = await self._room_for_slots(name, base, kv, batch)
            slots, reserved = await asyncio.to_thread(self._settle, name, handle,
                                                      batch, slots)
        except BaseException:
            await asyncio.to_thread(handle.close)
            raise
        m = self._register(name, kind, context, handle, seconds, pinned=False,
                           size=need, slots=slots, estimate=est, reserved=reserved)
        m.serves |= asked
        copies = self._copies(kind, m.file)  # a Hub name's file is known only now
        idle = [c for c in copies if c is not m and c.active == 0 and not c.pinned]
        for other in idle[:len(copies) - MAX_COPIES]:
            await self._unload(other, f"{name} is loaded at context {m.context}: at most "
                               f"{MAX_COPIES} contexts of one model at once")
        return m

    def _copies(self, kind: Kind, file: FileId) -> list[Loaded]:
        """The loaded copies of one file, least recently used first."""
        return sorted((m for m in self.models.values() if m.kind == kind and m.file == file),
                      key=lambda m: m.last_used)

    def _pick(self, kind: Kind, mf: ModelFile | None, name: str, context: int | None
              ) -> Loaded | None:
        """The loaded copy a request for ``name`` (``mf``) at ``context`` gets."""
        if mf is None:
            return None
        return pick(self._copies(kind, mf.id), mf, kind, name, context, self.config)

    async def _within_copies(self, name: str, kind: Kind, mf: ModelFile,
                             context: int | None) -> Loaded | None:
        """Where :data:`MAX_COPIES` contexts of ``mf`` are loaded already: the largest
        when it holds the context asked for, else none after the idle copy used least
        recently has gone (a 503 with the numbers while every copy is in use)."""
        copies = self._copies(kind, mf.id)
        if len(copies) < MAX_COPIES:
            return None
        want = mf.context(kind, context, self.config)
        largest = max(copies, key=lambda m: m.context or 0)
        if (largest.context or 0) >= want:
            return largest
        idle = [m for m in copies if m.active == 0 and not m.pinned]
        if idle:
            await self._unload(idle[0], f"{name} at context {want} takes its place: at most "
                               f"{MAX_COPIES} contexts of one model at once")
            return None
        retry = min(self.retry_after(m) for m in copies)
        held = ", ".join(str(m.context) for m in sorted(copies, key=lambda m: m.context or 0))
        raise APIError(503, f"'{name}' is loaded at contexts {held}, all in use, and at most "
                       f"{MAX_COPIES} contexts of one model are loaded at once: context "
                       f"{want} has to wait; retry in {retry} s, or ask for a context of at "
                       f"most {largest.context}", code="too_many_copies",
                       headers={"Retry-After": str(retry)})

    def _register(self, name: str, kind: Kind, context: int | None, handle: Any,
                  seconds: float, *, pinned: bool, size: int | None,
                  slots: int | None = None, estimate: MemoryEstimate | None = None,
                  reserved: int | None = None) -> Loaded:
        """Make a loaded ``handle`` servable. ``size``: its estimate for one sequence
        (None: from its files); ``reserved``: what its batcher holds beyond that (see
        :func:`footprint`). ``slots`` None: decided here, as many as ``--parallel`` asks
        and memory holds beside the models loaded (none unload: this is for the models
        named on the command line, before serving), as :meth:`_load` decides them."""
        est = estimate or estimate_loaded(handle.info, context)
        if size is None:
            size = est.total_bytes if est is not None else 0
        kv = est.kv_cache_bytes if est is not None else 0
        if slots is None:
            batch = self._wanted(name, kind, handle)
            slots = self._most_slots(name, size, kv, batch, 0)
            slots, reserved = self._settle(name, handle, batch, slots)
        info: ModelInfo = handle.info
        size = footprint(size, kv, slots, reserved) + kept_bytes(handle, kind)
        m = Loaded(name=name, kind=kind, context=info.context_length or context,
                   handle=handle, info=info, size=size, pinned=pinned,
                   keep_alive=self.config.keep_alive, load_seconds=seconds, slots=slots,
                   file=file_id(info.path))
        self.models[m.key] = m
        self._names.learn(kind, name, ModelFile.of(info))
        self.metrics.models_loaded.set(len(self.models))
        log.info("loaded %s (%s %s, %s) in %.2f s; %s", name, info.backend, info.format,
                 info.device or "?", seconds, "runs one request at a time" if slots == 1
                 else f"runs up to {slots} requests at once")
        return m

    def _wanted(self, name: str, kind: Kind, handle: Any) -> Batch:
        """Requests ``handle`` would run at once: ``--parallel`` (by default
        :data:`DEFAULT_PARALLEL_CPU` on the CPU, the engine's capacity elsewhere), at
        most what its engine batches; 1 for an engine that runs one sequence at a time,
        and for embedders. The model is told first (``Model.limit_concurrency``), so
        that its batcher holds no more slots than that. One that would hold memory per
        slot from the start (llama.cpp's batch context) is not built here: its slots
        and their bytes are known without it (``Model.batch_slots``), and
        :meth:`_settle` builds it once memory has had its say. Any other is built to
        learn its capacity (that holds nothing up front); ``--parallel 1`` builds none."""
        parallel, kept = self.config.parallel, kept_bytes(handle, kind)
        if kind != "chat" or parallel == 1:
            return Batch(1, kept=kept)
        if parallel is None and (handle.info.device or "cpu").lower() == "cpu":
            parallel = DEFAULT_PARALLEL_CPU
        try:
            if parallel is not None:
                handle.limit_concurrency(parallel)
            plan: tuple[int, int] | None = handle.batch_slots
            if plan is not None:
                capacity, per_slot = plan
                return Batch(max(1, min(capacity, parallel or capacity)), per_slot,
                              kept=kept)
            capacity = max(1, int(handle.max_concurrency))
            want = min(parallel, capacity) if parallel is not None else capacity
            return Batch(want, reserved=handle.batch_reserved_bytes if want > 1 else 0,
                          kept=kept)
        except LocalrunError as e:  # the batcher could not be built: one at a time
            log.warning("%s runs one request at a time: %s", name, e)
            return Batch(1, kept=kept)

    def _settle(self, name: str, handle: Any, batch: Batch, slots: int
                ) -> tuple[int, int | None]:
        """Build the batcher of a model that runs ``slots`` of ``batch.want`` at once,
        where :meth:`_wanted` left it unbuilt, with those slots (none for 1); the slots
        it runs and what its batcher holds (:func:`footprint`)."""
        if not batch.per_slot:
            return slots, batch.reserved_at(slots)
        try:
            handle.limit_concurrency(slots)  # the batch context's KV streams; 1: none
            if slots > 1:  # built now: memory may hold fewer than when it was planned
                slots = min(slots, max(1, int(handle.max_concurrency)))
            reserved: int | None = handle.batch_reserved_bytes if slots > 1 else 0
        except LocalrunError as e:
            log.warning("%s runs one request at a time: %s", name, e)
            return 1, 0
        return slots, reserved

    async def _room_for_slots(self, name: str, base: int, kv: int, batch: Batch) -> int:
        """Room for a model just loaded (``base`` bytes for one sequence) to run
        ``batch.want`` at once (:func:`footprint`): idle models unload, least recently
        used first; what memory still cannot hold runs fewer at once."""
        slots = batch.want
        size = batch.size(base, kv, slots)
        freed = 0
        while slots > 1 and not self._fits(size, freed, loaded=base):
            victim = self._lru_idle()
            if victim is None:
                break
            freed += victim.size
            await self._unload(victim, f"least recently used; {name} runs {slots} requests "
                               f"at once in {size / 2**30:.2f} GiB")
        return self._most_slots(name, base, kv, batch, freed)

    def _most_slots(self, name: str, base: int, kv: int, batch: Batch, freed: int) -> int:
        """The most of ``batch.want`` a model (``base`` bytes for one sequence, loaded)
        runs at once beside the others (:func:`footprint`); 1 where no batcher fits.
        What its batcher holds is not in memory yet, or is counted in ``base``."""
        fit = batch.want
        while fit > 1 and not self._fits(batch.size(base, kv, fit), freed, loaded=base):
            fit -= 1
        if fit < batch.want:
            log.warning("%s runs %d requests at once, not %d: memory cannot hold the "
                        "%.2f GiB that takes", name, fit, batch.want,
                        batch.size(base, kv, batch.want) / 2**30)
        return fit

    def _fits(self, need: int, freed: int, *, loaded: int = 0) -> bool:
        """Whether a model of ``need`` bytes fits beside the others (``loaded``: bytes of
        it already in memory, which the OS no longer shows as available)."""
        if self.config.max_memory is not None:
            used = sum(m.size for m in self.models.values())
            return used + need <= self.config.max_memory
        # what is free now, plus what unloading has given back but the OS may not
        # show yet
        return need - loaded <= self._available() + freed

    async def _make_room(self, need: int | None, name: str) -> None:
        if need is None:
            return
        freed = 0
        while not self._fits(need, freed):
            victim = self._lru_idle()
            if victim is None:
                break
            freed += victim.size
            await self._unload(victim, f"least recently used; {name} needs "
                               f"{need / 2**30:.2f} GiB")
        if self._fits(need, freed):
            return
        if self.config.max_memory is not None:
            busy = [m.name for m in self.models.values() if m.active and not m.pinned]
            if busy:
                raise APIError(503, f"Not enough memory for '{name}' ({need / 2**30:.2f} GiB) "
                               f"while {', '.join(busy)} are in use (--max-memory "
                               f"{self.config.max_memory / 2**30:.2f} GiB)",
                               code="insufficient_memory", headers={"Retry-After": "5"})
            raise APIError(400, f"'{name}' needs {need / 2**30:.2f} GiB but --max-memory is "
                           f"{self.config.max_memory / 2**30:.2f} GiB (raise --max-memory, or "
                           "load it with a smaller context)", param="model",
                           code="model_too_large")
        # without --max-memory the library's own check decides (with its numbers)

    def _lru_idle(self) -> Loaded | None:
        """The idle model used longest ago; models named on the command line stay."""
        idle = [m for m in self.models.values() if m.active == 0 and not m.pinned]
        return min(idle, key=lambda m: m.last_used) if idle else None

    async def unload(self, name: str, kind: Kind = "chat") -> bool:
        """Unload the idle copies of ``name``, under any spelling (Ollama's keep_alive 0).
        A model named on the command line stays loaded: it answers normally."""
        files = {known.id} if (known := self._names.get(kind, name)) else set()
        if not files:
            with contextlib.suppress(LocalrunError, APIError):
                got = await asyncio.to_thread(identify, name, kind, self.config)
                files |= {got[0].id} if got is not None else set()
        done = False
        for m in [m for m in self.models.values()
                  if m.kind == kind and (m.file in files or m.name == name)]:
            if m.pinned:
                log.info("keep_alive 0 for %s: it stays loaded (named on the command line)",
                         name)
            elif m.active == 0:
                await self._unload(m, "keep_alive 0")
                done = True
        return done

    async def _unload(self, m: Loaded, why: str) -> None:
        if self.models.get(m.key) is not m:
            return
        del self.models[m.key]
        if not self._copies(m.kind, m.file):  # its names may mean another file next time
            self._names.forget(m.kind, m.file)
        self.metrics.models_loaded.set(len(self.models))
        log.info("unloading %s (%s)", m.name, why)
        await asyncio.to_thread(m.handle.close)

    def _schedule_unload(self, m: Loaded, why: str) -> None:
        async def go() -> None:
            if m.active == 0:
                await self._unload(m, why)

        asyncio.get_running_loop().create_task(go())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            await self.reap()

    async def reap(self) -> None:
        """Unload the idle models whose keep-alive has run out."""
        now = time.monotonic()
        for m in list(self.models.values()):
            if (m.active == 0 and not m.pinned and m.expires_at is not None
                    and m.expires_at <= now):
                await self._unload(m, "keep-alive expired")


# -- what loads models -------------------------------------------------------------------

def _load_chat(name: str, config: ServerConfig, context: int | None) -> Any:
    import warnings

    from localrun.api import load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unoptimized-format warning: the CLI said it
        return load(name, backend=config.backend, context=context or config.context,
                    allow_unoptimized=config.allow_unoptimized)


def _load_embed(name: str, config: ServerConfig, context: int | None) -> Any:
    from localrun.server.embeddings import load_embedder

    return load_embedder(name, backend=config.backend, context=context,
                         allow_unoptimized=config.allow_unoptimized)
