"""What /v1/models, /api/tags, /api/ps and /api/show list: loaded models, presets and
models on disk.

A preset is listed under its own name, with the model it runs (``from``; Ollama's
``details.parent_model``); a file's path is named only to clients with the API key
(:func:`shows_paths`), so a preset made from a path shows the file's name to others.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from localrun.naming.stores import StoredModel
from localrun.server.manager import Loaded
from localrun.server.state import ServerState

if TYPE_CHECKING:
    from localrun.naming.presets import Preset

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
    from localrun import hub
    from localrun.naming import stores

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
             "parallel": m.slots, "pinned": m.pinned, "presets": sorted(m.presets),
             "adapters": adapter_entries(i.adapters, paths)}
    return {**entry, "path": i.path} if paths else entry


def adapter_entries(adapters: Any, paths: bool) -> list[dict[str, Any]]:
    """The LoRA adapters a model loaded with, as a request's ``lora`` names them (its
    ``id`` or ``name``) with their load-time scale (llama-server's /lora-adapters)."""
    return [{"id": k, "name": a.label, "scale": a.scale, **({"path": a.path} if paths else {})}
            for k, a in enumerate(adapters)]


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
        first["presets"] = sorted({*first["presets"], *entry["presets"]})
        first["pinned"] = first["pinned"] or entry["pinned"]
        first["context_length"] = max(first["context_length"], entry["context_length"])
        first["parallel"] += entry["parallel"]
        ends = [first["expires_at"], entry["expires_at"]]
        first["expires_at"] = None if None in ends else max(ends)
    return list(by_name.values())


async def model_list(st: ServerState) -> list[dict[str, Any]]:
    """/v1/models: loaded first (as requested), then presets, then everything on disk by
    its names; each name once."""
    paths = shows_paths(st)
    out = loaded_entries(st, paths)
    seen = {e["id"] for e in out}
    disk, saved = await asyncio.to_thread(_disk_and_presets, st)
    for p in saved:
        if p.name in seen:
            continue
        seen.add(p.name)
        loaded = any(p.name in m.presets for m in st.manager.models.values())
        out.append({"id": p.name, "object": "model", "created": int(p.created_at),
                    "owned_by": "localrun", "loaded": loaded, "preset": True,
                    "from": shown_model(p.model, paths),
                    "context_length": p.context})
    for m in disk:
        for name in names_of(m):
            if name in seen:
                continue
            seen.add(name)
            entry = {"id": name, "object": "model", "created": int(_mtime(m.path)),
                     "owned_by": "localrun", "loaded": False, "format": m.format,
                     "quantization": m.quant}
            out.append({**entry, "path": m.path} if paths else entry)
    return out


def _disk_and_presets(st: ServerState) -> tuple[list[StoredModel], list[Preset]]:
    return disk_models(), st.manager.presets.all()


async def tags_list(st: ServerState) -> list[dict[str, Any]]:
    """/api/tags: presets, then models on disk, then models loaded from elsewhere."""
    disk, saved = await asyncio.to_thread(_disk_and_presets, st)
    return ollama_tags(st, disk, saved)


def shown_model(model: str, paths: bool) -> str:
    """A preset's model as a client is told it: a path only with the key (else the
    file's or folder's name)."""
    from localrun.server.policy import looks_like_path

    if paths or not looks_like_path(model):
        return model
    return os.path.basename(model.rstrip("/\\")) or model


def details(fmt: str | None, arch: str | None, quant: str | None) -> dict[str, Any]:
    return {"parent_model": "", "format": fmt or "", "family": arch or "",
            "families": [arch] if arch else [], "parameter_size": "",
            "quantization_level": quant or ""}


def ollama_tags(st: ServerState, disk: list[StoredModel],
                saved: list[Preset] | None = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    paths = shows_paths(st)
    for p in saved or ():
        seen.add(p.name)
        base = next((m for m in disk if p.model in names_of(m) or p.model == m.path), None)
        info = details(base.format if base else None, None, base.quant if base else None)
        info["parent_model"] = shown_model(p.model, paths)
        out.append({"name": p.name, "model": p.name, "modified_at": rfc3339(p.created_at),
                    "size": base.size if base else 0, "digest": "", "details": info})
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
                    # localrun's: requests it runs at once, and how many do now; named
                    # on the command line (kept loaded); the presets it has served
                    "parallel": m.slots, "running": m.running, "waiting": m.waiting,
                    "pinned": m.pinned, "presets": sorted(m.presets),
                    "adapters": adapter_entries(i.adapters, shows_paths(st))})
    return out


def _size(path: str) -> int:
    from localrun.formats.detect import folder_bytes

    try:
        return folder_bytes(path)  # as far as detection looks (bounded)
    except OSError:
        return 0


# -- /api/show ----------------------------------------------------------------------------

def on_disk(model: str) -> tuple[str, str | None, str | None, int | None, bool, str] | None:
    """A model on this machine by any of its names, as /api/show describes it: format,
    architecture, quant, trained context, embedding-only, path; None if not here."""
    from localrun.errors import LocalrunError
    from localrun.resolve import resolve_local
    from localrun.server.embeddings import embedding_only

    try:
        target = resolve_local(model)
    except LocalrunError:
        for m in disk_models():
            if model in (m.name, *m.pulled_as):
                try:
                    target = resolve_local(m.path)
                except LocalrunError:
                    return None
                break
        else:
            return None
    from localrun.formats.detect import detect

    d = detect(target.path)
    return (d.format, d.architecture, d.quantization, d.context_length,
            embedding_only(target.path, target.format), target.path)


def show_body(fmt: str, arch: str | None, quant: str | None, ctx: int | None,
              embeds: bool, path: str | None) -> dict[str, Any]:
    info: dict[str, Any] = {"general.architecture": arch or ""}
    if arch and ctx:
        info[f"{arch}.context_length"] = ctx
    caps = ["embedding"] if embeds else ["completion", "tools"]
    return {"modelfile": "", "parameters": "", "template": "", "license": "",
            "details": details(fmt, arch, quant), "model_info": info, "capabilities": caps,
            "modified_at": rfc3339(), "localrun": {"path": path} if path else {}}


#: the preset's names for what Ollama's ``parameters`` text calls otherwise
OLLAMA_PARAMETERS = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}


def ollama_parameters(p: Preset) -> str:
    """A preset's values as Ollama's /api/show writes ``parameters``: one per line, the
    name padded to 30 columns, ``stop`` once per string (quoted)."""
    lines = []
    for key, value in p.sampling.items():
        name = OLLAMA_PARAMETERS.get(key, key)
        for v in (value if key == "stop" else (value,)):
            shown = json.dumps(v, ensure_ascii=False) if key == "stop" else str(v)
            lines.append(f"{name:<30} {shown}")
    if p.context is not None:
        lines.append(f"{'num_ctx':<30} {p.context}")
    return "\n".join(lines)


def preset_show(st: ServerState, p: Preset) -> dict[str, Any]:
    """/api/show for a preset: its model's details where that is on disk, the preset
    as a Modelfile (``localrun show``'s text), its ``parameters``, ``system`` and
    example ``messages``. Blocking (reads the disk): call it in a worker thread."""
    from localrun.naming.presetfile import format_preset
    from localrun.naming.presets import Adapter

    paths = shows_paths(st)
    found = on_disk(p.model)
    fmt, arch, quant, ctx, embeds, path = found or ("", None, None, None, False, None)
    body = show_body(fmt, arch, quant, p.context or ctx, embeds, path if paths else None)
    shown = p if paths else replace(p, model=shown_model(p.model, False), adapters=tuple(
        Adapter(os.path.basename(a.path), a.scale) for a in p.adapters))
    body["modelfile"] = format_preset(shown)
    body["parameters"] = ollama_parameters(p)
    body["system"] = p.system or ""
    body["messages"] = [{"role": r, "content": c} for r, c in p.messages]
    body["details"]["parent_model"] = shown.model
    body["modified_at"] = rfc3339(p.created_at)
    return body
