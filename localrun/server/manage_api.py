"""Managing models over HTTP: Ollama's ``/api/create``, ``/api/copy`` and ``/api/delete``
(presets, and what localrun pulled), and loading or unloading a model ahead of any
request, as llama-server's router mode does it (``POST /models/load``,
``POST /models/unload``; the same under ``/v1`` for clients whose base URL ends there).
Shapes in :mod:`localrun.server.protocol.manage`.

Who may do what (:mod:`localrun.server.policy`): presets are localrun's own small files,
made, copied and removed by any client the server answers (web pages are kept out by the
Host, Origin and JSON checks; a server without a key listens on loopback only). What a
preset is made from is checked as a request's model name is: a path needs
``--allow-local-paths`` (or the key); a model not downloaded may be named, and loads only
where downloads are allowed. Deleting a model's files needs ``--allow-delete`` (or the
key) and removes only what localrun pulled under that name, as ``localrun rm`` does
(:func:`localrun.hub.plan_removal`); a removal that would touch anything else (a repo
another program downloaded) is refused, 409, for ``localrun rm`` on the server, which
lists it and asks. Loading follows the same rules as a request for the model; a model
named on serve's command line stays loaded (409).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from localrun.errors import LocalrunError
from localrun.server.catalog import FOREVER, on_disk, rfc3339, shows_paths
from localrun.server.copies import file_id
from localrun.server.errors import APIError, bad_request, unsupported
from localrun.server.ollama_api import NDJSON  # (imported first: its routes list first)
from localrun.server.policy import check_delete, check_model
from localrun.server.protocol import manage as mg
from localrun.server.protocol.common import parse
from localrun.server.protocol.ollama import keep_alive
from localrun.server.protocol.spec import operation
from localrun.server.state import ServerState, state_of

router = APIRouter()


# -- /api/create, /api/copy -----------------------------------------------------------------

@router.post("/api/create", **operation(
    "POST", "/api/create", "Ollama", request=mg.CreateRequest, response=mg.Status,
    stream=mg.Status, stream_type=NDJSON, summary="Create a preset (a model with a system "
    "prompt and parameters)"))
async def create(request: Request) -> Any:
    st = state_of(request)
    req = await parse(request, mg.CreateRequest)
    name = mg.model_name(req)
    preset = await asyncio.to_thread(_create, st, req, name)
    if req.stream is False:
        return JSONResponse({"status": "success"})
    statuses = [f"using model {_shown(st, preset.model)}", f"writing preset {preset.name}",
                "success"]

    async def lines() -> AsyncIterator[bytes]:
        for status in statuses:
            yield (json.dumps({"status": status}, ensure_ascii=False) + "\n").encode()

    return StreamingResponse(lines(), media_type=NDJSON)


def _create(st: ServerState, req: mg.CreateRequest, name: str) -> Any:
    """Make and save the preset ``req`` describes (blocking: a worker thread)."""
    from localrun.naming import presetfile, presets
    from localrun.sampling import SAMPLING_OPTIONS

    _check(lambda: presets.check_name(name), "model")
    spec = presetfile.PresetSpec()
    if req.modelfile:
        spec = _check(lambda: presetfile.parse(req.modelfile or "", "modelfile"), "modelfile")
        if spec.adapters:
            raise unsupported("modelfile", f"ADAPTER: {mg.NO_ADAPTERS}")
    base = req.from_ or spec.model
    if not base:
        raise bad_request("Missing required parameter 'from': the model (or preset) the "
                          "preset runs", "from")
    if presets.lookup(base) is None:  # a preset's model was checked when it was made
        check_model(st.config, base, loads=False)
    values = req.parameters.values() if req.parameters is not None else {}
    sampling = {**spec.sampling, **{k: v for k, v in values.items() if k in SAMPLING_OPTIONS}}
    system, examples = _messages(req, spec)
    _check(lambda: presets.make(name, base), "from")  # what it runs, named alone
    preset = _check(lambda: presets.make(
        name, base, system=system, sampling=sampling,
        context=values.get("context", spec.context),
        backend=values.get("backend", spec.backend),
        allow_unoptimized=bool(values.get("allow_unoptimized", spec.allow_unoptimized)),
        messages=examples), "parameters" if values else "modelfile")
    _check(lambda: presets.save(preset), "model")
    return preset


def _messages(req: mg.CreateRequest, spec: Any) -> tuple[str | None, list[tuple[str, str]]]:
    """The system prompt and example turns: ``messages`` (a leading system one is the
    system prompt, where ``system`` is not given) over the Modelfile's."""
    system = req.system if req.system is not None else spec.system
    if req.messages is None:
        return system, list(spec.messages)
    examples: list[tuple[str, str]] = []
    for i, m in enumerate(req.messages):
        if m.role == "system":
            if i or req.system is not None:
                raise bad_request(f"Invalid 'messages[{i}].role': a system message may only "
                                  "open the list, where 'system' is not given (a preset has "
                                  "one system prompt)", f"messages[{i}].role",
                                  code="invalid_value")
            system = m.content
        else:
            examples.append((m.role, m.content))
    return system, examples


def _check(make: Any, param: str) -> Any:
    """``make()``, with a preset's error as a 400 naming ``param``."""
    from localrun.naming.presets import PresetError

    try:
        return make()
    except PresetError as e:
        text = e.message + (f" ({e.hint})" if e.hint else "")
        raise bad_request(text, param, code="invalid_value") from None


@router.post("/api/copy", **operation(
    "POST", "/api/copy", "Ollama", request=mg.CopyRequest, response=mg.Status,
    summary="Copy a preset (a model: a new preset that runs it)"))
async def copy(request: Request) -> Any:
    st = state_of(request)
    req = await parse(request, mg.CopyRequest)
    await asyncio.to_thread(_copy, st, req.source, req.destination)
    return JSONResponse({"status": "success"})


def _copy(st: ServerState, source: str, destination: str) -> None:
    from localrun.naming import presets

    _check(lambda: presets.check_name(destination), "destination")
    found = _check(lambda: presets.lookup(source), "source")
    if found is not None:
        if found.name.lower() == destination.lower():
            raise bad_request(f"'{destination}' is the preset being copied: name another",
                              "destination", code="invalid_value")
        _check(lambda: presets.save(replace(found, name=destination,
                                            created_at=time.time())), "destination")
        return
    check_model(st.config, source, loads=False)  # a path: only where paths are allowed
    if on_disk(source) is None:
        raise APIError(404, f"model '{source}' not found (neither a preset nor on disk; "
                       "GET /api/tags lists them)", param="source", code="model_not_found")
    _check(lambda: presets.save(presets.make(destination, source)), "destination")


# -- /api/delete -----------------------------------------------------------------------------

@router.delete("/api/delete", **operation(
    "DELETE", "/api/delete", "Ollama", request=mg.DeleteRequest, response=mg.Status,
    summary="Delete a preset, or what localrun pulled under a name (--allow-delete)"))
async def delete(request: Request) -> Any:
    from localrun.naming import presets

    st = state_of(request)
    name = mg.model_name(await parse(request, mg.DeleteRequest))
    preset = st.manager.presets.get(name)
    if preset is not None:
        gone = await asyncio.to_thread(_check, lambda: presets.remove(preset.name), "model")
        for m in st.manager.models.values():
            m.presets.discard(gone.name)
        return JSONResponse({"status": "success", "deleted": "preset", "model": gone.name})
    check_delete(st.config, name)
    removal = await asyncio.to_thread(_plan, name)
    beyond = _not_pulled(removal)
    if beyond:
        n = len(beyond)
        raise APIError(409, f"Deleting '{name}' would also delete {n} file{'s' * (n > 1)} "
                       "localrun did not pull under that name (downloaded by another program "
                       f"or under another name): over the API, localrun deletes only what it "
                       f"pulled. Run `localrun rm {name}` on the server: it lists what goes "
                       "and asks", param="model", code="not_pulled")
    await _let_go(st, name, removal.files)
    from localrun import hub

    freed = await asyncio.to_thread(hub.remove, removal)
    kept = [{"what": k.what, "reason": k.reason} for k in removal.kept] \
        if shows_paths(st) else [{"reason": k.reason} for k in removal.kept]
    return JSONResponse({"status": "success", "deleted": "model", "model": name,
                         "files": len(removal.files), "freed_bytes": freed,
                         "forgotten": list(removal.forgets), "kept": kept})


def _plan(name: str) -> Any:
    """What ``localrun rm NAME`` would remove; 404 when nothing was pulled as it."""
    from localrun import hub

    try:
        removal = hub.plan_removal(name)
    except LocalrunError as e:
        raise APIError(404, e.message + (f" ({e.hint})" if e.hint else ""), param="model",
                       code="model_not_found") from None
    if not removal.files and not removal.forgets:
        raise APIError(404, f"Nothing pulled as '{name}' is in the Hugging Face cache",
                       param="model", code="model_not_found")
    return removal


def _not_pulled(removal: Any) -> list[str]:
    """The files ``removal`` would delete that no pull it forgets had downloaded (a repo
    id removes the repo as named, whoever downloaded it: ``localrun rm`` shows and asks;
    the API does not)."""
    pulled: set[tuple[str, str | None, str]] = set()
    for rec in removal._records:
        folder = "models--" + rec.repo.replace("/", "--")
        pulled |= {(folder.lower(), rec.commit, f) for f in rec.files if f not in rec.found}
    out = []
    for path in removal.files:
        parts = Path(path).parts
        if "snapshots" not in parts:
            out.append(path)
            continue
        i = parts.index("snapshots")
        folder, commit, rel = parts[i - 1].lower(), parts[i + 1], "/".join(parts[i + 2:])
        if (folder, commit, rel) not in pulled and (folder, None, rel) not in pulled:
            out.append(path)
    return out


async def _let_go(st: ServerState, name: str, files: tuple[str, ...]) -> None:
    """Unload the idle copies of the files about to go; 409 for one in use or pinned."""
    ids = {file_id(f) for f in files}
    for m in list(st.manager.models.values()):
        folder = m.info.path.rstrip("/") + "/"
        if m.file not in ids and not any(f.startswith(folder) for f in files):
            continue
        if m.pinned or m.active:
            why = ("it was named on localrun serve's command line" if m.pinned
                   else f"{m.active} request{'s' * (m.active > 1)} use it")
            raise APIError(409, f"'{name}' is loaded as {m.name} and {why}: its files stay",
                           param="model", code="model_in_use",
                           headers=None if m.pinned else {"Retry-After": "5"})
        await st.manager.unload_copy(m, f"its files are deleted ({name})")


# -- load and unload ahead of a request --------------------------------------------------------

def _load_routes(path: str) -> None:
    @router.post(path, **operation(
        "POST", path, "localrun", request=mg.LoadRequest, response=mg.Loading,
        summary="Load a model now (llama-server's router mode)"))
    async def load(request: Request) -> Any:
        st = state_of(request)
        req = await parse(request, mg.LoadRequest)
        ka = keep_alive(req.keep_alive)
        limit = st.config.request_timeout
        deadline = None if limit is None else time.monotonic() + limit
        try:
            lease = await st.acquire(req.model, keep_alive=ka, deadline=deadline)
        except APIError as e:
            if e.code != "model_not_generative":
                raise
            lease = await st.acquire(req.model, kind="embed", keep_alive=ka,
                                     deadline=deadline)
        m = lease.loaded
        lease.release()
        expires = m.expires_wall()
        return JSONResponse(mg.Loading(
            success=True, model=req.model, status="loaded",
            context_length=m.info.context_length, pinned=m.pinned,
            expires_at=FOREVER if expires is None else rfc3339(expires)
        ).model_dump(exclude_none=True))


def _unload_routes(path: str) -> None:
    @router.post(path, **operation(
        "POST", path, "localrun", request=mg.UnloadRequest, response=mg.Loading,
        summary="Unload a model (models named on serve's command line stay: 409)"))
    async def unload(request: Request) -> Any:
        st = state_of(request)
        model = (await parse(request, mg.UnloadRequest)).model
        await st.admit(model, loads=False)  # a path: only where paths are allowed
        why = "asked to unload"
        chat = await st.manager.unload(model, "chat", why=why)
        embed = await st.manager.unload(model, "embed", why=why)
        unloaded, closing = chat.unloaded + embed.unloaded, chat.closing + embed.closing
        pinned = chat.pinned + embed.pinned
        freed = chat.freed + embed.freed
        if pinned:
            also = f" ({len(unloaded)} other cop{'ies' if len(unloaded) > 1 else 'y'} " \
                "unloaded)" if unloaded else ""
            raise APIError(409, f"'{model}' stays loaded: it was named on localrun serve's "
                           f"command line, and those models stay until the server stops"
                           f"{also}; restart the server without it to free its memory",
                           param="model", code="model_pinned")
        status = "unloaded" if unloaded else "unloading" if closing else "not loaded"
        return JSONResponse(mg.Loading(success=True, model=model, status=status,
                                       freed_bytes=freed).model_dump(exclude_none=True))


for _prefix in ("", "/v1"):
    _load_routes(f"{_prefix}/models/load")
    _unload_routes(f"{_prefix}/models/unload")


def _shown(st: ServerState, model: str) -> str:
    from localrun.server.catalog import shown_model

    return shown_model(model, shows_paths(st))
