"""Which models are loaded, who is using them, and when they go.

Any name localrun accepts loads on its first request (plan → fit check → fetch, as
``localrun.load`` does). Each loaded model has ``slots`` and an admission queue: a model
whose engine batches (``Model.max_concurrency`` > 1) runs up to ``--parallel`` requests
at once, together in its engine's batch; any other runs one at a time. At most
``max_queue`` more wait, and the next one gets 429 with ``Retry-After``. A model counts
as what its engine holds running its slots at once (``Model.footprint``: weights,
overhead, KV cache, a batch context's streams, what it keeps between calls for KV
reuse); a batcher that holds memory per slot from the start (llama.cpp's) is sized to
what memory holds before it is built (``Model.limit_concurrency``; none at all when only
one request fits), by the one budget policy (:func:`localrun.memory.budget`). Idle
models unload after their keep-alive, and when a model about to load would not fit, idle
models go first, least recently used first.

A name is looked up on disk before the load lock is taken (bounded: formats/detect.py),
and the client may leave during any wait. Loaded models are keyed by file, engine and
the context the engine loads (:mod:`localrun.server.copies`): spellings of a file and
``num_ctx`` values that come to one context share a copy, at most ``MAX_COPIES``
contexts of a file are loaded at once, and the command line's models stay pinned. A
preset's name is its model plus per-request defaults: its requests share its model's
copy (at the preset's context and on its engine, which are part of the key as any
``num_ctx`` is), and each request's lease answers as the preset
(:class:`~localrun.server.loaded.Lease`). An unload asked for while requests run takes
effect when they end (``Loaded.closing``).

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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from localrun.backends.base import Footprint
from localrun.errors import LocalrunError, ModelTooLargeError
from localrun.memory import budget
from localrun.server.config import ServerConfig
from localrun.server.copies import (
    MAX_COPIES,
    Asked,
    FileId,
    ModelFile,
    Names,
    PresetTable,
    ask,
    file_id,
    identify,
    pick,
)
from localrun.server.errors import APIError, from_localrun
from localrun.server.loaded import DEFAULT_PARALLEL_CPU, Key, Lease, Loaded, settle, wanted
from localrun.server.metrics import Metrics
from localrun.server.sizing import (
    Batch,
    Kind,
    available_ram,
    estimate_bytes,
    plan_model,
)
from localrun.server.waiting import left, wait
from localrun.types import ModelInfo

__all__ = ["DEFAULT_PARALLEL_CPU", "Key", "Lease", "Loaded", "ModelManager", "Unloading"]

if TYPE_CHECKING:
    from localrun.resolve import Target

log = logging.getLogger("localrun.server")


@dataclass
class Unloading:
    """What :meth:`ModelManager.unload` did: the copies unloaded now, those that go when
    their requests end (``closing``), and those it keeps (named on the command line).
    True when something was unloaded or is going."""

    unloaded: list[Loaded]
    closing: list[Loaded]
    pinned: list[Loaded]

    def __bool__(self) -> bool:
        return bool(self.unloaded or self.closing)

    @property
    def freed(self) -> int:
        return sum(m.size for m in self.unloaded)


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
        self.presets = PresetTable()  # read again when presets.json changes
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
                load: Callable[..., Any] | None = None) -> list[Loaded]:
        """Load the command line's models before serving (errors reach the CLI as is);
        ``load(name)`` is the CLI's loader (download progress on the terminal). A
        preset's name loads its model (``load(model, context=, backend=,
        allow_unoptimized=)`` with the preset's values), pinned, and that copy then
        serves the model's own requests and the preset's alike."""
        out: list[Loaded] = []
        for name in names:
            asked = ask(name, None, self.config, self.presets)
            try:  # another spelling of a file named already: that copy
                got = identify(asked.model, "chat", asked.config)
            except Exception:
                got = None  # the loader says what is wrong with it
            mf = got[0] if got is not None else None
            found = self._pick("chat", mf, asked)
            if found is None:
                t0 = time.monotonic()
                lora = {"adapters": asked.config.adapters} if asked.config.adapters else {}
                if load is None:
                    handle = self._loader(asked.model, asked.config, asked.context)
                elif asked.preset is None:
                    handle = load(asked.model, **lora)
                else:
                    handle = load(asked.model, context=asked.context, backend=asked.backend,
                                  allow_unoptimized=asked.config.allow_unoptimized,
                                  exact=asked.config.exact, **lora)
                found = self._register(_shown(asked), "chat", asked.context, handle,
                                       time.monotonic() - t0, pinned=True, learn=False)
                out.append(found)
                mf = ModelFile.of(found.info)
            self._names.learn("chat", asked.model, asked.backend, mf)
            if asked.preset is not None:
                found.presets.add(asked.preset.name)
        return out

    # -- using a model ----------------------------------------------------------------

    def ask(self, name: str, context: int | None = None) -> Asked:
        """What ``name`` asks for (:func:`localrun.server.copies.ask`): a preset's model
        and values, else the name; a preset that cannot load is a 400."""
        try:
            return ask(name, context, self.config, self.presets)
        except LocalrunError as e:
            raise from_localrun(e, param="model") from None

    async def acquire(self, name: str, *, kind: Kind = "chat", context: int | None = None,
                      keep_alive: float | Literal["default"] | None = "default",
                      deadline: float | None = None,
                      abort: asyncio.Event | None = None) -> Lease:
        """Load ``name`` if needed (a preset's name: its model, shared), take a place in
        its queue (429 when full), then wait for its slot (until ``deadline``,
        monotonic)."""
        if not name or not isinstance(name, str):
            raise APIError(400, "Missing 'model': name the model to use (see GET /v1/models)",
                           param="model")
        asked = self.ask(name, context)
        loaded = await self._instance(asked, kind, deadline, abort)
        capacity = loaded.slots + self.config.max_queue
        if loaded.active >= capacity:
            self.metrics.rejected.labels(model=name, reason="queue_full").inc()
            retry = self.retry_after(loaded)
            raise APIError(
                429, f"Model '{name}' is busy: {loaded.running} running and {loaded.waiting} "
                f"waiting (--max-queue {self.config.max_queue}); retry in {retry} s",
                code="queue_full", headers={"Retry-After": str(retry)})
        ka = self.config.keep_alive if keep_alive == "default" else keep_alive
        lease = Lease(self, loaded, ka, asked.preset)
        loaded.active += 1
        loaded.expires_at = None
        loaded.closing = False  # asked for again: it stays
        if asked.preset is not None:
            loaded.presets.add(asked.preset.name)
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
        mine = self.models.get(m.key) is m
        if m.active == 0 and not m.pinned and m.closing and mine:
            self._schedule_unload(m, "asked to unload; its last request ended")
        elif m.active == 0 and not m.pinned and m.keep_alive is not None:
            m.expires_at = m.last_used + m.keep_alive
            if m.keep_alive == 0 and mine:
                self._schedule_unload(m, "keep_alive 0")
        self._gauge(m)

    def _gauge(self, m: Loaded) -> None:
        self.metrics.queue_depth.labels(model=m.name).set(m.waiting)
        self.metrics.running.labels(model=m.name).set(m.running)

    # -- loading and unloading --------------------------------------------------------

    async def _instance(self, asked: Asked, kind: Kind, deadline: float | None,
                        abort: asyncio.Event | None) -> Loaded:
        """The loaded copy that serves ``asked``, loaded if need be. A name not seen
        before is looked up on disk first, in a worker thread and without the load lock
        (bounded: a folder that is no model is refused quickly); the client may leave
        meanwhile (499), or the deadline pass (504)."""
        name = asked.model
        found = self._pick(kind, self._names.get(kind, name, asked.backend), asked)
        if found is not None:
            return found
        started = time.monotonic()
        got = await wait(asyncio.to_thread(identify, name, kind, asked.config), None,
                         left(deadline), abort, f"for '{asked.name}' to be found", started)
        mf, target = got if got is not None else (None, None)
        found = self._pick(kind, mf, asked)
        if found is not None:
            self._names.learn(kind, name, asked.backend, mf)
            return found
        lock = self._load_lock
        assert lock is not None, "ModelManager.start() was not called"
        # one load at a time: the fit check sees the truth
        await wait(lock.acquire(), lambda _: lock.release(), left(deadline), abort,
                   f"to load '{asked.name}' (another model is loading)", started)
        try:
            return await self._load(asked, kind, mf, target)
        finally:
            lock.release()

    async def _load(self, asked: Asked, kind: Kind, mf: ModelFile | None,
                    target: Target | None) -> Loaded:
        """Load ``asked.model`` (``mf``: its file, where it is on disk; ``target``: where
        :func:`identify` found it), holding the load lock."""
        name, context, config = asked.model, asked.context, asked.config
        if mf is not None:
            found = self._pick(kind, mf, asked) or \
                await self._within_copies(asked, kind, mf)
            if found is not None:
                self._names.learn(kind, name, asked.backend, mf)
                return found
        if target is None:  # not on disk: planned here, once (the Hub's model info, the
            # files, the estimate), and the loader downloads what the plan chose
            target = await asyncio.to_thread(plan_model, name, context, config)
        need = await asyncio.to_thread(estimate_bytes, name, context, config, target)
        if await self._make_room(need, asked.name) and _stale(target):
            target = await asyncio.to_thread(plan_model, name, context, config)
        loader = self._loader if kind == "chat" else self._embed_loader
        t0 = time.monotonic()
        while True:
            try:
                handle = await asyncio.to_thread(loader, name, config, context, target)
                break
            except ModelTooLargeError:
                # the library's own fit check (the download's): free what is idle and
                # plan again, then give up with its numbers
                victim = self._lru_idle()
                if victim is None:
                    raise
                await self._unload(victim, f"to make room for {asked.name}")
                if not target.fetched:
                    target = await asyncio.to_thread(plan_model, name, context, config)
        seconds = time.monotonic() - t0
        opened = ModelFile.of(handle.info)
        contexts = {f.context(kind, context, config) for f in (mf, opened) if f}
        same = self.models.get((kind, opened.id, handle.info.backend,
                                handle.info.context_length, handle.info.adapters,
                                handle.info.exact))
        if same is not None:  # a name first seen now (a Hub alias) for a loaded copy
            await asyncio.to_thread(handle.close)
            same.serves |= contexts
            self._names.learn(kind, name, asked.backend, opened)
            return same
        try:
            batch = await asyncio.to_thread(wanted, self.config, name, kind, handle)
            slots = await self._room_for_slots(name, batch)
            held = await asyncio.to_thread(settle, name, handle, batch, slots)
        except BaseException:
            await asyncio.to_thread(handle.close)
            raise
        m = self._register(_shown(asked), kind, context, handle, seconds, pinned=False,
                           held=held, learn=False)
        self._names.learn(kind, name, asked.backend, opened)
        m.serves |= contexts
        copies = self._copies(kind, m.file, m.info.backend)  # a Hub name's: known now
        idle = [c for c in copies if c is not m and c.active == 0 and not c.pinned]
        for other in idle[:len(copies) - MAX_COPIES]:
            await self._unload(other, f"{name} is loaded at context {m.context}: at most "
                               f"{MAX_COPIES} contexts of one model at once")
        return m

    def _copies(self, kind: Kind, file: FileId, backend: str | None = None
                ) -> list[Loaded]:
        """The loaded copies of one file (by one engine, where ``backend`` is given),
        least recently used first."""
        return sorted((m for m in self.models.values() if m.kind == kind and m.file == file
                       and backend in (None, m.info.backend)), key=lambda m: m.last_used)

    def _pick(self, kind: Kind, mf: ModelFile | None, asked: Asked) -> Loaded | None:
        """The loaded copy a request for ``asked`` (``mf``: its file) gets."""
        if mf is None:
            return None
        # with its adapters; an exact request (serve --exact, a preset saved with exact)
        # only on an exact copy: a fast copy's replies depend on its cache and batch. A
        # request in the default mode may run on either (an exact copy is correct, if
        # slower), as on a model the caller loaded and handed to the server.
        copies = [m for m in self._copies(kind, mf.id, mf.backend)
                  if kind != "chat" or (m.info.adapters == asked.config.adapters
                                        and (m.info.exact or not asked.config.exact))]
        return pick(copies, mf, kind, asked.model, asked.context, asked.config)

    async def _within_copies(self, asked: Asked, kind: Kind, mf: ModelFile
                             ) -> Loaded | None:
        """Where :data:`MAX_COPIES` contexts of ``mf`` are loaded already: the largest
        when it holds the context asked for, else none after the idle copy used least
        recently has gone (a 503 with the numbers while every copy is in use)."""
        copies = self._copies(kind, mf.id, mf.backend)
        if len(copies) < MAX_COPIES:
            return None
        name = asked.name
        want = mf.context(kind, asked.context, asked.config)
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
                  seconds: float, *, pinned: bool, held: Footprint | None = None,
                  learn: bool = True) -> Loaded:
        """Make a loaded ``handle`` servable (``learn``: its name leads to it, under the
        server's engine), counted as what its engine holds (``held``: its
        ``Model.footprint`` at the slots it runs). ``held`` None: its slots decided here,
        as many as ``--parallel`` asks and memory holds beside the models loaded (none
        unload: this is for the models named on the command line, before serving), as
        :meth:`_load` decides them."""
        if held is None:
            batch = wanted(self.config, name, kind, handle)
            held = settle(name, handle, batch, self._most_slots(name, batch, 0))
        info: ModelInfo = handle.info
        slots = held.slots
        m = Loaded(name=name, kind=kind, context=info.context_length or context,
                   handle=handle, info=info, size=held.total, pinned=pinned,
                   keep_alive=self.config.keep_alive, load_seconds=seconds, slots=slots,
                   file=file_id(info.path))
        self.models[m.key] = m
        if learn:
            self._names.learn(kind, name, self.config.backend, ModelFile.of(info))
        self.metrics.models_loaded.set(len(self.models))
        log.info("loaded %s (%s %s, %s) in %.2f s; %s", name, info.backend, info.format,
                 info.device or "?", seconds, "runs one request at a time" if slots == 1
                 else f"runs up to {slots} requests at once")
        return m

    async def _room_for_slots(self, name: str, batch: Batch) -> int:
        """Room for a model just loaded to run ``batch.want`` at once
        (:meth:`Batch.size`): idle models unload, least recently used first; what memory
        still cannot hold runs fewer at once."""
        slots = batch.want
        size = batch.size(slots)
        freed = 0
        while slots > 1 and not self._fits(size, freed, loaded=batch.one.running):
            victim = self._lru_idle()
            if victim is None:
                break
            freed += victim.size
            await self._unload(victim, f"least recently used; {name} runs {slots} requests "
                               f"at once in {size / 2**30:.2f} GiB")
        return self._most_slots(name, batch, freed)

    def _most_slots(self, name: str, batch: Batch, freed: int) -> int:
        """The most of ``batch.want`` a loaded model runs at once beside the others
        (:meth:`Batch.size`); 1 where no batcher fits. What it holds for one sequence is
        in memory already (``batch.one``), what more would hold is not yet."""
        fit = batch.want
        while fit > 1 and not self._fits(batch.size(fit), freed, loaded=batch.one.running):
            fit -= 1
        if fit < batch.want:
            log.warning("%s runs %d requests at once, not %d: memory cannot hold the "
                        "%.2f GiB that takes", name, fit, batch.want,
                        batch.size(batch.want) / 2**30)
        return fit

    def _fits(self, need: int, freed: int, *, loaded: int = 0) -> bool:
        """Whether a model of ``need`` bytes fits beside the others: the one budget policy
        (:func:`localrun.memory.budget`) under ``--max-memory`` (the models' sizes count),
        else against what the OS shows available, plus what unloading has given back but
        the OS may not show yet (``freed``) and what of it is in memory already
        (``loaded``)."""
        limit = self.config.max_memory
        if limit is not None:
            return need <= budget(None, limit=limit,
                                  used=sum(m.size for m in self.models.values()))
        return need <= budget(self._available(), freed=freed, resident=loaded)

    async def _make_room(self, need: int | None, name: str) -> int:
        """Unload idle models, least recently used first, until ``need`` bytes fit;
        the bytes freed."""
        if need is None:
            return 0
        freed = 0
        while not self._fits(need, freed):
            victim = self._lru_idle()
            if victim is None:
                break
            freed += victim.size
            await self._unload(victim, f"least recently used; {name} needs "
                               f"{need / 2**30:.2f} GiB")
        if self._fits(need, freed):
            return freed
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
        return freed

    def _lru_idle(self) -> Loaded | None:
        """The idle model used longest ago; models named on the command line stay."""
        idle = [m for m in self.models.values() if m.active == 0 and not m.pinned]
        return min(idle, key=lambda m: m.last_used) if idle else None

    async def unload(self, name: str, kind: Kind = "chat", why: str = "keep_alive 0"
                     ) -> Unloading:
        """Unload the copies of the model ``name`` runs (a preset's: its model's), under
        any spelling and at any context (Ollama's keep_alive 0): idle ones now, busy ones
        when their last request ends; a model named on the command line stays."""
        try:
            asked = self.ask(name)
        except APIError:  # a preset that cannot load: nothing of it is loaded either
            asked = Asked(name, name, None, self.config)
        known = self._names.get(kind, asked.model, asked.backend)
        files = {known.id} if known is not None else set()
        if not files:
            with contextlib.suppress(LocalrunError, APIError):
                got = await asyncio.to_thread(identify, asked.model, kind, asked.config)
                files |= {got[0].id} if got is not None else set()
        out = Unloading([], [], [])
        for m in [m for m in self.models.values() if m.kind == kind and (
                m.file in files or m.name in (name, asked.model) or name in m.presets)]:
            if m.pinned:
                log.info("%s for %s: it stays loaded (named on the command line)", why, name)
                out.pinned.append(m)
            elif m.active == 0:
                await self._unload(m, why)
                out.unloaded.append(m)
            else:  # its requests finish first (Ollama's way)
                m.closing = True
                out.closing.append(m)
        return out

    async def unload_copy(self, m: Loaded, why: str) -> None:
        """Unload the copy ``m`` (idle: the caller checked), whatever its names."""
        await self._unload(m, why)

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


def _shown(asked: Asked) -> str:
    """What a copy loaded for ``asked`` is called (/api/ps, logs, metrics): its model as
    named, or for a preset whose model is a path, the preset (answers name paths only
    to clients with the key)."""
    from localrun.server.policy import looks_like_path

    if asked.preset is not None and looks_like_path(asked.model):
        return asked.preset.name
    return asked.model


# -- what loads models -------------------------------------------------------------------

def _stale(target: Target) -> bool:
    """Whether a plan's fit was judged on less memory than there is now (a download that
    did not fit, planned before idle models were unloaded)."""
    return target.download is not None and not target.fetched and not target.download.fits


def _load_chat(name: str, config: ServerConfig, context: int | None,
               target: Target | None = None) -> Any:
    """Load ``name`` to chat: its ``target`` (resolved by the manager: downloaded here
    if need be, not resolved again), else :func:`localrun.load`."""
    import warnings

    from localrun.api import load, open_target
    from localrun.resolve import count_adapters, fetch_target

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unoptimized-format warning: the CLI said it
        if target is not None:
            target = count_adapters(target, config.adapters)  # refused or counted in the fit
            return open_target(replace(fetch_target(target), context=context or
                                       config.context), **config.load_options())
        return load(name, backend=config.backend, context=context or config.context,
                    allow_unoptimized=config.allow_unoptimized, **config.load_options())


def _load_embed(name: str, config: ServerConfig, context: int | None,
                target: Target | None = None) -> Any:
    from localrun.server.embeddings import load_embedder

    return load_embedder(name, backend=config.backend, context=context,
                         allow_unoptimized=config.allow_unoptimized, target=target)
