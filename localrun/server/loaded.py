"""One loaded model as the server holds it (:class:`Loaded`), and one request's hold on
it (:class:`Lease`). :mod:`localrun.server.manager` decides which are loaded and when
they go; a preset's request holds the shared copy of its model through a lease that
answers as the preset (:attr:`Lease.handle`, :class:`localrun.server.copies.PresetModel`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from localrun.errors import LocalrunError
from localrun.server.config import ServerConfig
from localrun.server.copies import FileId, PresetModel
from localrun.server.sizing import Batch, Kind, kept_bytes
from localrun.types import ModelInfo

if TYPE_CHECKING:
    from localrun.naming.presets import Preset
    from localrun.server.manager import ModelManager

#: ``--parallel``'s default for a model on the CPU whose engine batches: requests it runs
#: at once. A CPU's decode is bound by memory bandwidth: past a few sequences each reply
#: slows nearly in proportion for little more throughput (docs/results/llama_batch.md:
#: 8 small-model sequences cost about two single steps), and every slot holds a KV cache.
#: On a GPU the engine's own capacity is the default. LM Studio's default is 4 too.
DEFAULT_PARALLEL_CPU = 4

log = logging.getLogger("localrun.server")

#: A loaded model's key: what it is, which file (copies.file_id), which engine opened it,
#: at what context. A preset is no part of it: its requests share its model's copy.
Key = tuple[Kind, FileId, str, int | None]


@dataclass(eq=False)
class Loaded:
    """One loaded model (a ``localrun.Model``, or an embedder) and its queue."""

    name: str  # its model as first requested: what /api/ps, logs and metrics call it
    kind: Kind
    context: int | None  # the context the engine loaded it with
    handle: Any
    info: ModelInfo
    size: int  # bytes it is counted as (estimate, see sizing.footprint)
    pinned: bool  # named on the command line: no keep-alive expiry
    keep_alive: float | None
    load_seconds: float
    slots: int  # requests it runs at once (several: together in its engine's batch)
    file: FileId = ""  # the file its engine opened (copies.file_id)
    #: contexts requests asked for that it serves: ours, and the engine's own rounding
    #: where that differs from what copies.ModelFile.context predicted
    serves: set[int] = field(default_factory=set)
    #: the presets whose requests it has served (and the one named on the command line)
    presets: set[str] = field(default_factory=set)
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None  # monotonic; None: not scheduled
    active: int = 0  # admitted: running + waiting
    running: int = 0
    #: an unload was asked for while requests were running: it goes when they end
    closing: bool = False
    ema_seconds: float = 2.0  # recent request duration, for Retry-After
    sem: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self.sem = asyncio.Semaphore(self.slots)

    @property
    def key(self) -> Key:
        return (self.kind, self.file, self.info.backend, self.context)

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
    """One request's hold on a model: a place in its queue, then its slot. ``preset``:
    the preset the request named, applied to each call on the shared copy."""

    def __init__(self, manager: ModelManager, loaded: Loaded, keep_alive: float | None,
                 preset: Preset | None = None) -> None:
        self.manager = manager
        self.loaded = loaded
        self.keep_alive = keep_alive
        self.preset = preset
        self.has_slot = False
        self.released = False
        self.started = time.monotonic()
        self.queued_seconds = 0.0

    @property
    def handle(self) -> Any:
        """The model this request calls: the loaded copy, as the preset where it named
        one (its system prompt, example turns and sampling defaults, per call)."""
        h = self.loaded.handle
        return PresetModel(h, self.preset) if self.preset is not None else h

    def release(self) -> None:
        """Give back the slot and the place (idempotent; on the event loop thread)."""
        if self.released:
            return
        self.released = True
        self.manager._release(self)


# -- how many requests a model runs at once ---------------------------------------------

def wanted(config: ServerConfig, name: str, kind: Kind, handle: Any) -> Batch:
    """Requests ``handle`` would run at once: ``--parallel`` (by default
    :data:`DEFAULT_PARALLEL_CPU` on the CPU, the engine's capacity elsewhere), at
    most what its engine batches; 1 for an engine that runs one sequence at a time,
    and for embedders. The model is told first (``Model.limit_concurrency``), so
    that its batcher holds no more slots than that. One that would hold memory per
    slot from the start (llama.cpp's batch context) is not built here: its slots
    and their bytes are known without it (``Model.batch_slots``), and
    :func:`settle` builds it once memory has had its say. Any other is built to
    learn its capacity (that holds nothing up front); ``--parallel 1`` builds none."""
    parallel, kept = config.parallel, kept_bytes(handle, kind)
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

def settle(name: str, handle: Any, batch: Batch, slots: int) -> tuple[int, int | None]:
    """Build the batcher of a model that runs ``slots`` of ``batch.want`` at once,
    where :func:`wanted` left it unbuilt, with those slots (none for 1); the slots
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
