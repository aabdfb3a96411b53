"""What /v1/models, /api/tags, /api/ps and /api/show list: loaded models and models on disk."""

from __future__ import annotations

import asyncio
import os
from datetime import datetime, timezone
from typing import Any

from localrun.server.manager import Loaded
from localrun.server.state import ServerState
from localrun.stores import StoredModel

#: Ollama's way of saying "never expires" is a date far away; clients parse it as a date.
FOREVER = "2318-01-01T00:00:00Z"


def rfc3339(ts: float | None = None) -> str:
    t = datetime.fromtimestamp(time_now() if ts is None else ts, tz=timezone.utc)
    return t.isoformat(timespec="microseconds").replace("+00:00", "Z")


def time_now() -> float:
    import time

    return time.time()


def disk_models() -> list[StoredModel]:
    """Models on disk (Hugging Face cache, Ollama, LM Studio, the packaged default)."""
    from localrun import hub, stores

    found: list[StoredModel] = []
    for source in (hub.cached_models, stores.ollama_models, stores.lmstudio_models):
        try:
            found.extend(source())
        except Exception:
            continue
    default = stores.default_model()
    if default is not None:
        found.append(default)
    return found


def names_of(m: StoredModel) -> list[str]:
    return [*m.pulled_as, m.name] if m.pulled_as else [m.name]


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def shows_paths(st: ServerState) -> bool:
    """Whether answers name files on this machine: only to requests that hold the API
    key (every request, where one is set); a client without one learns names only."""
    return bool(st.config.api_key)


def loaded_entry(m: Loaded, paths: bool = False) -> dict[str, Any]:
    i = m.info
    entry = {"id": m.name, "object": "model", "created": int(m.loaded_at),
             "owned_by": "localrun", "loaded": True, "kind": m.kind, "backend": i.backend,
             "format": i.format, "quantization": i.quantization, "device": i.device,
             "context_length": i.context_length, "expires_at": m.expires_wall(),
             "parallel": m.slots}
    return {**entry, "path": i.path} if paths else entry


def loaded_entries(st: ServerState, paths: bool) -> list[dict[str, Any]]:
    """One entry per name loaded: copies of a model at other contexts (the manager keys
    models by file and context) are that entry's ``contexts``; its ``context_length`` is
    the largest, ``parallel`` their sum, ``expires_at`` the latest."""
    by_name: dict[str, dict[str, Any]] = {}
    for m in st.manager.models.values():
        entry = loaded_entry(m, paths)
        entry["contexts"] = [m.context or m.info.context_length]
        first = by_name.setdefault(m.name, entry)
        if first is entry:
            continue
        first["contexts"] = sorted({*first["contexts"], *entry["contexts"]})
        first["context_length"] = max(first["context_length"], entry["context_length"])
        first["parallel"] += entry["parallel"]
        ends = [first["expires_at"], entry["expires_at"]]
        first["expires_at"] = None if None in ends else max(ends)
    return list(by_name.values())


async def model_list(st: ServerState) -> list[dict[str, Any]]:
    """/v1/models: loaded first (as requested), then everything on disk by its names;
    each name once."""
    paths = shows_paths(st)
    out = loaded_entries(st, paths)
    seen = {e["id"] for e in out}
    for m in await asyncio.to_thread(disk_models):
        for name in names_of(m):
            if name in seen:
                continue
            seen.add(name)
            entry = {"id": name, "object": "model", "created": int(_mtime(m.path)),
                     "owned_by": "localrun", "loaded": False, "format": m.format,
                     "quantization": m.quant}
            out.append({**entry, "path": m.path} if paths else entry)
    return out


def details(fmt: str | None, arch: str | None, quant: str | None) -> dict[str, Any]:
    return {"parent_model": "", "format": fmt or "", "family": arch or "",
            "families": [arch] if arch else [], "parameter_size": "",
            "quantization_level": quant or ""}


def ollama_tags(st: ServerState, disk: list[StoredModel]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for m in disk:
        for name in names_of(m):
            if name in seen:
                continue
            seen.add(name)
            out.append({"name": name, "model": name, "modified_at": rfc3339(_mtime(m.path)),
                        "size": m.size, "digest": "", "details": details(m.format, None,
                                                                        m.quant)})
    for lm in st.manager.models.values():
        if lm.name not in seen:
            seen.add(lm.name)
            i = lm.info
            out.append({"name": lm.name, "model": lm.name, "modified_at": rfc3339(lm.loaded_at),
                        "size": _size(i.path), "digest": "",
                        "details": details(i.format, i.architecture, i.quantization)})
    return out


def ollama_ps(st: ServerState) -> list[dict[str, Any]]:
    out = []
    for m in st.manager.models.values():
        i = m.info
        expires = m.expires_wall()
        on_gpu = (i.device or "cpu").lower() not in ("cpu", "")
        out.append({"name": m.name, "model": m.name, "size": m.size, "digest": "",
                    "details": details(i.format, i.architecture, i.quantization),
                    "expires_at": FOREVER if expires is None else rfc3339(expires),
                    "size_vram": m.size if on_gpu else 0, "context_length": i.context_length,
                    "backend": i.backend, "device": i.device,
                    # localrun's: requests it runs at once, and how many do now
                    "parallel": m.slots, "running": m.running, "waiting": m.waiting})
    return out


def _size(path: str) -> int:
    from localrun.formats.detect import folder_bytes

    try:
        return folder_bytes(path)  # as far as detection looks (bounded)
    except OSError:
        return 0
