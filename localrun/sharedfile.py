"""A small file that several localrun processes read, change and write back (the pull
records, ``hub/pulls.py``; the presets, ``naming/presets.py``): each change under a lock
file where the OS has one, each write atomic (a temporary file beside it, then
``os.replace``), so that two at once neither lose a change nor leave a half-written file
(``service.py``'s unit files are written so too).
Imports nothing of localrun: any module may use it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Serialize read-modify-write of ``path`` between processes (its folder made first;
    raises OSError where it cannot be). Windows has no ``fcntl``: the atomic replace
    still keeps the file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def write_atomic(path: Path, data: str | bytes, *, mode: int | None = None) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` whole or not at all: a temporary file in
    its folder (``.<name>-*``; ``mode``: its permissions from the start), then
    ``os.replace``; the temporary file goes on any failure, which is raised (OSError
    where the folder or the disk refuses)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix, dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
