"""What a plan says: the files to fetch, the variants considered, and whether it fits.

Pure data; :mod:`localrun.hub.planner` makes it, :mod:`localrun.hub.download` carries it out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from localrun.errors import ModelTooLargeError
from localrun.memory import MemoryEstimate

Source = Literal["hub", "cache", "ollama", "lmstudio", "local"]


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class PlannedFile:
    path: str  # relative to the repo root
    size: int
    sha256: str | None = None  # LFS checksum, when the Hub gave it
    cached: bool = False


@dataclass(frozen=True)
class QuantOption:
    """One variant considered, with what it would need (shown so users can choose)."""

    repo: str
    quant: str | None
    weights_bytes: int
    needed_bytes: int | None  # None until the model's shape was known
    fits: bool | None
    revision: str | None = None
    subfolder: str | None = None


@dataclass(frozen=True)
class Download:
    """What to fetch for one model on one engine, and whether it fits. Pure data.

    ``files`` are what :func:`~localrun.hub.fetch` downloads (only what the engine needs);
    ``primary`` the file the engine opens (first GGUF shard) or None for folders.
    ``fits`` is False when even the chosen variant exceeds ``budget_bytes`` at
    ``context``; :meth:`require_fit` turns that into ModelTooLargeError.
    """

    ref: str
    source: Source
    format: str
    backend: str
    repo: str | None
    revision: str | None
    commit: str | None
    quant: str | None
    subfolder: str | None
    files: tuple[PlannedFile, ...]
    primary: str | None
    local_path: str | None
    memory: MemoryEstimate
    budget_bytes: int | None
    context: int
    max_context: int | None
    fits: bool
    options: tuple[QuantOption, ...] = ()
    reasons: tuple[str, ...] = ()
    gated: bool = False
    asked_quant: str | None = None  # the quant the caller asked for (ref or quant=)

    @property
    def download_bytes(self) -> int:
        return sum(f.size for f in self.files if not f.cached)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def verdict(self) -> str:
        if self.budget_bytes is None:
            return f"needs {gib(self.memory.total_bytes)} (no memory budget given)"
        word = "fits" if self.fits else "does NOT fit"
        line = (f"{word}: needs {gib(self.memory.total_bytes)} of "
                f"{gib(self.budget_bytes)} at context {self.context:,}")
        if not self.fits and self.max_context:
            line += f"; the largest context that fits is {self.max_context:,}"
        return line

    def require_fit(self) -> None:
        """Raise ModelTooLargeError (with needed/available bytes) unless the plan fits."""
        if self.fits or self.budget_bytes is None:
            return
        raise ModelTooLargeError(
            self.repo or self.ref, quant=self.quant, needed_bytes=self.memory.total_bytes,
            available_bytes=self.budget_bytes, context=self.context,
            max_context=self.max_context or 0, breakdown=self.memory.breakdown())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory"] = self.memory.to_dict()
        d["download_bytes"] = self.download_bytes
        d["verdict"] = self.verdict
        return d


def describe_options(options: Iterable[QuantOption]) -> list[str]:
    """One line per variant considered (for `localrun plan` / `pull`)."""
    lines = []
    for o in options:
        need = gib(o.needed_bytes) if o.needed_bytes is not None else "?"
        mark = {True: "fits", False: "too big", None: "?"}[o.fits]
        lines.append(f"{o.repo}{'/' + o.subfolder if o.subfolder else ''}"
                     f"{':' + o.quant if o.quant else ''}: weights {gib(o.weights_bytes)}, "
                     f"needs {need} ({mark})")
    return lines
