"""Download progress: the reports :func:`~localrun.hub.fetch` gives its callback, and the
meter both download paths (localrun's HTTP, huggingface_hub's Xet) count bytes into."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from localrun.hub.chosen import PlannedFile


@dataclass(frozen=True)
class DownloadProgress:
    """Reported to fetch()'s callback as bytes arrive. ``delta`` is negative when a file
    starts over: a server that answers a resume request with the whole file, a Xet try
    that failed, a checksum mismatch. ``file_done`` starts above 0 when an earlier
    download of the file is continued."""

    file: str
    index: int  # 1-based, among the files being downloaded
    count: int
    delta: int
    file_done: int
    file_total: int | None
    done: int
    total: int


ProgressCallback = Callable[[DownloadProgress], None]


class Meter:
    """Turns byte positions of each file into :class:`DownloadProgress` reports."""

    def __init__(self, progress: ProgressCallback | None, todo: Sequence[PlannedFile]) -> None:
        self.progress = progress
        self.count = len(todo)
        self.total = sum(f.size for f in todo)
        self.done = 0

    def file(self, f: PlannedFile, index: int) -> FileMeter:
        return FileMeter(self, f, index)


class FileMeter:
    def __init__(self, meter: Meter, f: PlannedFile, index: int) -> None:
        self.meter = meter
        self.f = f
        self.index = index
        self.at_bytes = 0
        self.file_total: int | None = f.size or None

    def at(self, position: int, file_total: int | None = None) -> None:
        """The file now holds ``position`` bytes (less than before after a restart)."""
        if file_total is not None:
            self.file_total = file_total
        delta = position - self.at_bytes
        if delta == 0:
            return
        self.at_bytes = position
        m = self.meter
        m.done += delta
        if m.progress is not None:
            m.progress(DownloadProgress(self.f.path, self.index, m.count, delta, position,
                                        self.file_total, m.done, m.total))

    def add(self, n: int, file_total: int | None = None) -> None:
        self.at(self.at_bytes + n, file_total)


def bar_class(meter: FileMeter) -> type:
    """A tqdm stand-in for huggingface_hub's ``tqdm_class`` that forwards byte counts.

    It implements what ``xet_get`` (through ``XetDownloadProgressReporter``) and
    ``http_get`` call on a bar, the surface of huggingface_hub's own aggregated bar
    (``update_transfer`` makes the Xet reporter count reconstructed file bytes, the same
    bytes the HTTP path counts), and draws nothing: the caller renders.
    """

    class _Bar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.total = kwargs.get("total")
            self.n = int(kwargs.get("initial") or 0)
            self.format_dict: dict[str, Any] = {}
            meter.at(self.n, self.total)

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            d = int(n or 0)
            self.n += d
            meter.add(d, self.total)

        def update_transfer(self, n: float | None = 1) -> None:
            return None  # bytes on the wire (Xet: compressed, deduplicated), not file bytes

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            return None

        set_transfer_postfix_str = set_description = set_description_str = set_postfix_str

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            return None

        def close(self) -> None:
            return None

    return _Bar
