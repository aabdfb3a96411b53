"""What each download resolved a model name to, so that the same name runs offline.

``localrun pull qwen2.5:0.5b`` asks the Hub which variant suits this host's engine
(a repo, a commit, maybe a subfolder, some files) and downloads it. Offline the Hub cannot
be asked again, and the HF cache alone does not say which cached repo an alias or a base
repo id became, so every download writes that answer down here: one record per
(name, engine, quant asked for). Plain file I/O; :mod:`localrun.hub` decides when a
record is still valid (its files must be in the cache).

Where: ``$LOCALRUN_HOME/pulls.json`` when ``LOCALRUN_HOME`` is set, else
``localrun/pulls.json`` next to the Hugging Face cache folder (its parent, e.g.
``~/.cache/huggingface/localrun/pulls.json``), so records move with ``HF_HOME`` /
``HF_HUB_CACHE`` and a test's private cache has private records. Each record also names
the cache it describes, so one ``LOCALRUN_HOME`` can serve several caches. Writes are
atomic (a temporary file, then ``os.replace``) under a lock file where the OS has one.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from localrun.sharedfile import locked, write_atomic

#: Overrides where localrun keeps its own state (the pull records).
HOME_ENV = "LOCALRUN_HOME"
FILE_NAME = "pulls.json"
VERSION = 1


@dataclass(frozen=True)
class PullRecord:
    """One download: the name as the user gave it, and what it resolved to."""

    name: str  # catalog alias ("qwen2.5:0.5b") or repo id ("org/name", "org/name@rev")
    backend: str
    quant: str | None  # the quant asked for (None: the engine's default choice)
    repo: str
    revision: str  # the branch (EXL bpw branches) or "main"
    commit: str | None
    format: str
    variant_quant: str | None  # the quant that was chosen
    subfolder: str | None
    primary: str | None  # the file the engine opens (GGUF), else None (a folder)
    files: tuple[str, ...]
    cache: str  # the HF hub cache folder the files were downloaded into
    pulled_at: float = 0.0  # Unix time
    #: files of ``files`` that were in the cache before localrun pulled them and that no
    #: other pull had downloaded (another program did): ``rm`` keeps them
    found: tuple[str, ...] = ()

    @property
    def display(self) -> str:
        """The name to type again: ``qwen2.5:0.5b``, ``org/name:Q8_0``."""
        return self.name + (f":{self.quant}" if self.quant else "")

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.name.lower(), self.backend, norm_quant(self.quant), self.cache)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["files"] = list(self.files)
        d["found"] = list(self.found)
        return d

    @classmethod
    def from_json(cls, d: Any) -> PullRecord | None:
        if not isinstance(d, dict):
            return None
        known = {f.name for f in fields(cls)}
        try:
            kwargs = {k: v for k, v in d.items() if k in known}
            kwargs["files"] = tuple(str(f) for f in kwargs.get("files", ()))
            kwargs["found"] = tuple(str(f) for f in kwargs.get("found", ()))
            rec = cls(**kwargs)
        except TypeError:
            return None
        if not (isinstance(rec.name, str) and isinstance(rec.repo, str)
                and isinstance(rec.backend, str)):
            return None
        return rec


def norm_quant(q: str | None) -> str:
    """``Q4_K_M`` / ``q4-k-m`` -> ``q4_k_m``; None -> ``""``."""
    return (q or "").strip().lower().replace("-", "_")


def records_path(cache_dir: str | os.PathLike[str]) -> Path:
    """The records file for the HF hub cache at ``cache_dir``."""
    home = os.environ.get(HOME_ENV)
    if home:
        return Path(home).expanduser() / FILE_NAME
    return Path(cache_dir).expanduser().resolve().parent / "localrun" / FILE_NAME


def _cache_key(cache_dir: str | os.PathLike[str]) -> str:
    return str(Path(cache_dir).expanduser().resolve())


def _read(path: Path) -> list[PullRecord]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # missing or damaged: start over rather than fail a run
    items = data.get("pulls", []) if isinstance(data, dict) else []
    return [r for r in (PullRecord.from_json(d) for d in items) if r is not None]


def load(cache_dir: str | os.PathLike[str]) -> list[PullRecord]:
    """The records for this cache, newest first."""
    key = _cache_key(cache_dir)
    recs = [r for r in _read(records_path(cache_dir)) if r.cache == key]
    return sorted(recs, key=lambda r: -r.pulled_at)


def _write(path: Path, recs: list[PullRecord]) -> None:
    body = json.dumps({"version": VERSION, "pulls": [r.to_json() for r in recs]}, indent=1)
    write_atomic(path, body + "\n")


def _update(cache_dir: str | os.PathLike[str],
            change: Callable[[list[PullRecord]], list[PullRecord]]) -> None:
    path = records_path(cache_dir)
    with locked(path):
        before = _read(path)
        after = change(before)
        if after != before:
            _write(path, after)


def remember(rec: PullRecord) -> None:
    """Add ``rec``, replacing the record of the same name, engine, quant and cache.

    Raises OSError when the folder cannot be written (callers treat records as a help,
    not a requirement)."""
    rec = replace(rec, cache=_cache_key(rec.cache), pulled_at=rec.pulled_at or time.time())
    _update(rec.cache, lambda recs: [r for r in recs if r.key != rec.key] + [rec])


def forget(cache_dir: str | os.PathLike[str], drop: Callable[[PullRecord], bool]) -> None:
    """Remove this cache's records for which ``drop`` is true."""
    key = _cache_key(cache_dir)
    _update(cache_dir, lambda recs: [r for r in recs if r.cache != key or not drop(r)])


def find(recs: list[PullRecord], name: str, *, backend: str | None = None) -> list[PullRecord]:
    """Records of ``name`` (case-insensitive; Hub repo ids are), for ``backend`` if given."""
    low = name.lower()
    return [r for r in recs if r.name.lower() == low and (backend is None or r.backend == backend)]


__all__ = ["HOME_ENV", "PullRecord", "find", "forget", "load", "norm_quant", "records_path",
           "remember"]
