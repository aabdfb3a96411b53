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
from typing import TYPE_CHECKING, Any, Protocol

from localrun.backends.base import Footprint
from localrun.errors import LocalrunError
from localrun.server.config import ServerConfig
from localrun.server.copies import FileId, PresetModel
from localrun.server.sizing import Batch, Kind, estimate_loaded
from localrun.types import ModelInfo

if TYPE_CHECKING:
    from localrun.naming.presets import Preset

#: ``--parallel``'s default for a model on the CPU whose engine batches: requests it runs
#: at once. A CPU's decode is bound by memory bandwidth: past a few sequences each reply
#: slows nearly in proportion for little more throughput (docs/results/llama_batch.md:
#: 8 small-model sequences cost about two single steps), and every slot holds a KV cache.
#: On a GPU the engine's own capacity is the default. LM Studio's default is 4 too.
DEFAULT_PARALLEL_CPU = 4

log = logging.getLogger("localrun.server")

#: A loaded model's key: what it is, which file (copies.file_id), which engine opened it,
#: at what context, with which LoRA adapters, exact or fast. A preset is no part of it:
#: its requests share its model's copy (one loaded with the preset's adapters and mode,
#: where they differ from the model's).
Key = tuple[Kind, FileId, str, int | None, tuple[Any, ...], bool]


@dataclass(eq=False)
class Loaded:
    """One loaded model (a ``localrun.Model``, or an embedder) and its queue."""

    name: str  # its model as first requested: what /api/ps, logs and metrics call it
    kind: Kind
    context: int | None  # the context the engine loaded it with
    handle: Any
    info: ModelInfo
    size: int  # bytes it is counted as (its Model.footprint at its slots)
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
        return (self.kind, self.file, self.info.backend, self.context, self.info.adapters,
                self.info.exact)

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


class Holder(Protocol):
    """What a lease gives its slot and place back to (the server's ModelManager)."""

    def _release(self, lease: Lease) -> None: ...


class Lease:
    """One request's hold on a model: a place in its queue, then its slot. ``preset``:
    the preset the request named, applied to each call on the shared copy."""

    def __init__(self, manager: Holder, loaded: Loaded, keep_alive: float | None,
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
    :data:`DEFAULT_PARALLEL_CPU` on the CPU, the engine's capacity elsewhere), at most
    what its engine batches; 1 for an engine that runs one sequence at a time, and for
    embedders. The model is told first (``Model.limit_concurrency``), so that its
    batcher holds no more slots than that; what each count holds is its
    ``Model.footprint``, which builds no batcher that would hold memory per slot from
    the start (llama.cpp's batch context): :func:`settle` builds that once memory has
    had its say. ``--parallel 1`` builds none."""
    if kind != "chat":  # an embedder: its estimate, one input list at a time
        est = estimate_loaded(handle.info, handle.info.context_length)
        return Batch.alone(Footprint(1, est.total_bytes if est is not None else 0, 0, 0))
    one: Footprint = handle.footprint(1)
    parallel = config.parallel
    if parallel == 1:
        return Batch.alone(one)
    if parallel is None and (handle.info.device or "cpu").lower() == "cpu":
        parallel = DEFAULT_PARALLEL_CPU
    try:
        if parallel is not None:
            handle.limit_concurrency(parallel)
        most: Footprint = handle.footprint(parallel)
    except LocalrunError as e:  # the batcher could not be built: one at a time
        log.warning("%s runs one request at a time: %s", name, e)
        return Batch.alone(one)
    return Batch(most.slots, one, most) if most.slots > 1 else Batch.alone(one)


def settle(name: str, handle: Any, batch: Batch, slots: int) -> Footprint:
    """Run ``slots`` of ``batch.want`` at once: the batcher :func:`wanted` left unbuilt
    is built with those slots (none for 1), one built already runs no more than that;
    what the engine then holds (``Model.footprint``: its ``slots`` are those it runs)."""
    if batch.want == 1:
        return batch.one
    try:
        handle.limit_concurrency(slots)  # the batch context's KV streams; 1: none
        if slots > 1:  # built now: memory may hold fewer than when it was planned
            slots = min(slots, max(1, int(handle.max_concurrency)))
        held: Footprint = handle.footprint(slots)
    except LocalrunError as e:
        log.warning("%s runs one request at a time: %s", name, e)
        return batch.one
    return held
