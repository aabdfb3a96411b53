"""What a served model takes in memory: its estimate before it loads (from its files or
its Hub plan), and once loaded what its engine holds for one request and for several at
once (:class:`Batch`, from ``Model.footprint``). :mod:`localrun.server.manager` decides with these
which models fit beside each other."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from localrun.backends.base import Footprint, loaded_estimate
from localrun.errors import LocalrunError
from localrun.server.config import ServerConfig
from localrun.types import ModelInfo

if TYPE_CHECKING:
    from localrun.memory import MemoryEstimate
    from localrun.resolve import Target

Kind = Literal["chat", "embed"]


@dataclass(frozen=True)
class Batch:
    """What a model just loaded would run at once (``want``) and what its engine holds
    for it (``Model.footprint``, the one memory contract): ``one`` for one sequence
    (nothing built for more), ``most`` for ``want`` at once. Its batcher may not be built
    yet (llama.cpp's, sized first): ``most`` then counts what it will reserve per slot."""

    want: int
    one: Footprint
    most: Footprint

    def at(self, slots: int) -> Footprint:
        """What the engine holds running ``slots`` (1 to ``want``) at once: per slot as
        ``most`` counts them (none at 1: no batcher is built)."""
        return self.one if slots == 1 else replace(self.most, slots=slots)

    def size(self, slots: int) -> int:
        """Bytes the model runs ``slots`` at once in, with what it keeps between calls."""
        return self.at(slots).total

    @staticmethod
    def alone(one: Footprint) -> Batch:
        """A model that runs one request at a time."""
        return Batch(1, one, one)


def available_ram() -> int:
    from localrun.memory import available_ram_bytes

    return available_ram_bytes()


def plan_model(name: str, context: int | None, config: ServerConfig) -> Target:
    """The Target of a model the server is about to load (:func:`localrun.resolve.plan_target`
    with the server's engine and context): a name not on disk is planned on the Hub here,
    once, and its estimate, engine and files go on to the loader."""
    from localrun.resolve import plan_target

    return plan_target(name, backend=config.backend, context=context or config.context,
                       allow_unoptimized=config.allow_unoptimized)


def estimate_bytes(name: str, context: int | None, config: ServerConfig,
                   target: Target | None = None) -> int | None:
    """Memory a model will take (weights + KV cache + overhead), before loading it.

    ``target``: the model resolved already (:func:`plan_model`, or where
    :func:`~localrun.server.copies.identify` found it on disk), else resolved here. A
    model on disk is sized from its files at the context asked for; one not downloaded
    yet by its plan. None when neither can say (the library's own fit check then
    decides)."""
    ctx = context or config.context
    if target is None:
        try:
            target = plan_model(name, ctx, config)
        except Exception:
            return None
    if not target.fetched:
        est = with_adapters(target.estimate, config.adapters)
        return est.total_bytes if est is not None else None
    est = with_adapters(estimate_path(target.path, ctx, target.backend, target.device),
                        config.adapters)
    return est.total_bytes if est is not None else None


def estimate_loaded(info: ModelInfo, context: int | None) -> MemoryEstimate | None:
    """A loaded model's memory, at the context it was loaded with (its LoRA adapters'
    files counted): an embedder's size (a chat model's is its ``footprint``)."""
    from localrun.backends import engine_memory

    if info.context_length is None and context:
        info = replace(info, context_length=context)
    return loaded_estimate(info, engine_memory(info.backend, info.device))


def with_adapters(est: MemoryEstimate | None, adapters: Any) -> MemoryEstimate | None:
    """``est`` with the bytes of the LoRA adapters loaded with the model."""
    if est is None or not adapters:
        return est
    from localrun.adapters import adapters_bytes

    return replace(est, adapter_bytes=adapters_bytes(adapters))


def estimate_path(path: str, context: int | None, backend: str | None = None,
                  device: str | None = None) -> MemoryEstimate | None:
    """The memory of the model at ``path`` on ``backend`` (on ``device``):
    :func:`localrun.memory.local_estimate` with that engine's memory row; None when its
    files cannot be read."""
    from localrun.backends import engine_memory
    from localrun.memory import local_estimate

    try:
        return local_estimate(Path(path), context, engine=engine_memory(backend, device))
    except (OSError, ValueError, LocalrunError):
        return None
