"""The Ollama API's routes, for tools built on it: /api/chat, /api/generate, /api/embed,
/api/embeddings, /api/tags, /api/show, /api/ps, /api/version, /api/pull (and the
management routes in :mod:`localrun.server.manage_api`). Their shapes,
name mapping (``num_predict`` → max_tokens, ``num_ctx`` → the context a model is loaded
with, a model asked for with another ``num_ctx`` loading again at that size, ...) and the
NDJSON stream are in :mod:`localrun.server.protocol.ollama`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from localrun import __version__
from localrun.formats.projector import sees_images
from localrun.server.catalog import (
    ollama_ps,
    on_disk,
    preset_show,
    rfc3339,
    show_body,
    shows_paths,
    tags_list,
)
from localrun.server.errors import APIError, bad_request, unsupported
from localrun.server.jobs import Job
from localrun.server.openai_api import embedding_inputs
from localrun.server.policy import check_pull
from localrun.server.protocol import ollama as ol
from localrun.server.protocol.common import parse, respond
from localrun.server.protocol.spec import operation
from localrun.server.state import state_of, to_api_error

router = APIRouter()
NDJSON = "application/x-ndjson"


# -- /api/chat, /api/generate -----------------------------------------------------------

@router.post("/api/chat", **operation(
    "POST", "/api/chat", "Ollama", request=ol.ChatRequest, response=ol.Answer,
    stream=ol.Answer, stream_type=NDJSON, summary="Chat"))
async def chat(request: Request) -> Any:
    req = await parse(request, ol.ChatRequest)
    if not req.messages:  # Ollama's way to load (or, with keep_alive 0, unload) a model
        return await _hold(request, req.model, chat=True, **req.held())
    gen = req.generation()
    scored = bool(req.logprobs or req.top_logprobs)
    return await respond(request, "api_chat", gen,
                         lambda job: ol.NDJSON(job, req.model, True, scored),
                         lambda job, c: ol.NDJSON(job, req.model, True, scored).whole(c),
                         media_type=NDJSON)


@router.post("/api/generate", **operation(
    "POST", "/api/generate", "Ollama", request=ol.GenerateRequest, response=ol.Answer,
    stream=ol.Answer, stream_type=NDJSON, summary="Generate"))
async def generate(request: Request) -> Any:
    req = await parse(request, ol.GenerateRequest)
    gen = req.generation()
    model = req.model
    if not req.prompt:  # Ollama's way to load (or, with keep_alive 0, unload) a model
        return await _hold(request, model, chat=False, context=gen.context,
                           keep_alive=gen.keep_alive)
    scored = bool(req.logprobs or req.top_logprobs)
    return await respond(request, "api_generate", gen,
                         lambda job: ol.NDJSON(job, model, False, scored),
                         lambda job, c: ol.NDJSON(job, model, False, scored).whole(c),
                         media_type=NDJSON)


async def _hold(request: Request, model: str, *, chat: bool, context: int | None,
                keep_alive: Any) -> Any:
    """A request with nothing to generate: load ``model`` (a preset's name: its model)
    and keep it ``keep_alive``, or with ``keep_alive`` 0 unload it. ``done_reason`` says
    "load", or "unload" where something was unloaded (or goes once its requests end);
    a model the server keeps (named on its command line), or one not loaded, gets
    neither."""
    st = state_of(request)
    answer: dict[str, Any] = {"model": model, "created_at": rfc3339()}
    answer.update({"message": {"role": "assistant", "content": ""}} if chat
                  else {"response": ""})
    answer["done"] = True
    if keep_alive == 0:
        await st.admit(model, loads=False)  # a path: only where paths are allowed
        if await st.manager.unload(model):
            answer["done_reason"] = "unload"
        return JSONResponse(answer)
    lease = await st.acquire(model, context=context, keep_alive=keep_alive)
    lease.release()
    answer["done_reason"] = "load"
    return JSONResponse(answer)


# -- /api/embed, /api/embeddings --------------------------------------------------------

@router.post("/api/embed", **operation("POST", "/api/embed", "Ollama",
                                       request=ol.EmbedRequest, summary="Embed"))
async def embed(request: Request) -> Any:
    req = await parse(request, ol.EmbedRequest)
    texts = embedding_inputs(req.input, "input")
    model, dimensions = req.model, req.dimensions
    num_ctx = req.options.num_ctx if req.options is not None else None
    truncate = req.truncate is not False
    job, result = await Job.call(request, "api_embed", model,
                                 lambda h: h.embed(texts, truncate=truncate), kind="embed",
                                 context=num_ctx, keep_alive=ol.keep_alive(req.keep_alive),
                                 param="input")
    if dimensions is not None and dimensions != len(result.vectors[0]):
        raise unsupported("dimensions", f"{model} gives {len(result.vectors[0])}-dimensional "
                          "embeddings; leave 'dimensions' out or send that number")
    ns = 1_000_000_000
    return JSONResponse({"model": model, "embeddings": result.vectors,
                         "total_duration": int((time.monotonic() - job.t0) * ns),
                         "load_duration": 0, "prompt_eval_count": result.tokens})


@router.post("/api/embeddings", **operation("POST", "/api/embeddings", "Ollama",
                                            request=ol.EmbeddingsRequest,
                                            summary="Embed one prompt (older route)"))
async def embeddings_legacy(request: Request) -> Any:
    req = await parse(request, ol.EmbeddingsRequest)
    texts = embedding_inputs(req.prompt, "prompt")
    _, result = await Job.call(request, "api_embed", req.model,
                               lambda h: h.embed(texts, truncate=True), kind="embed",
                               keep_alive=ol.keep_alive(req.keep_alive), param="input")
    return JSONResponse({"embedding": result.vectors[0]})


# -- models -----------------------------------------------------------------------------

@router.get("/api/tags", **operation("GET", "/api/tags", "Ollama", summary="Models on disk"))
async def tags(request: Request) -> Any:
    return JSONResponse({"models": await tags_list(state_of(request))})


@router.get("/api/ps", **operation("GET", "/api/ps", "Ollama", summary="Models loaded"))
async def ps(request: Request) -> Any:
    return JSONResponse({"models": ollama_ps(state_of(request))})


@router.get("/api/version", **operation("GET", "/api/version", "Ollama", summary="Version"))
async def version() -> Any:
    return JSONResponse({"version": __version__})


@router.post("/api/show", **operation("POST", "/api/show", "Ollama", request=ol.ShowRequest,
                                      summary="One model's details"))
async def show(request: Request) -> Any:
    st = state_of(request)
    model = (await parse(request, ol.ShowRequest)).model
    paths = shows_paths(st)
    preset = st.manager.presets.get(model)
    if preset is not None:
        return JSONResponse(await asyncio.to_thread(preset_show, st, preset))
    for m in st.manager.models.values():
        if m.name == model:
            i = m.info
            body = show_body(i.format, i.architecture, i.quantization, i.context_length,
                             m.kind == "embed", i.path if paths else None)
            if getattr(m.handle, "reasoning", None) is not None:  # localrun.Model.reasoning
                body["capabilities"].append("thinking")
            if getattr(getattr(m.handle, "_session", None), "accepts_images", False):
                body["capabilities"].append("vision")
            return JSONResponse(body)
    not_found = APIError(404, f"model '{model}' not found (neither loaded nor on disk; "
                         f"POST /api/pull to download it)", param="model",
                         code="model_not_found")
    try:
        await st.admit(model, loads=False)  # a local path: only where they are allowed
    except APIError as e:
        # a relative path shaped like a name: answered as one that is not there
        raise not_found if e.code == "pull_not_allowed" else e from None
    found = await asyncio.to_thread(on_disk, model)
    if found is None:
        raise not_found
    fmt, arch, quant, ctx, embeds, path = found
    body = show_body(fmt, arch, quant, ctx, embeds, path if paths else None)
    if not embeds and await asyncio.to_thread(_thinks, path):
        body["capabilities"].append("thinking")
    if not embeds and await asyncio.to_thread(sees_images, path):
        body["capabilities"].append("vision")
    return JSONResponse(body)


def _thinks(path: str) -> bool:
    """Whether the model at ``path`` thinks, as its chat template says (a GGUF's
    metadata, a folder's tokenizer files); False where it cannot be read."""
    from pathlib import Path

    from localrun.errors import LocalrunError
    from localrun.reasoning import detect

    try:
        p = Path(path)
        if p.is_dir():
            from localrun.backends.hf_config import read_chat_template

            return detect(read_chat_template(p).template) is not None
        from localrun.formats.gguf import is_gguf, read_gguf

        return is_gguf(p) and detect(read_gguf(p, check_size=False).chat_template) is not None
    except (OSError, ValueError, LocalrunError):
        return False


# -- /api/pull --------------------------------------------------------------------------

@router.post("/api/pull", **operation("POST", "/api/pull", "Ollama", request=ol.PullRequest,
                                      summary="Download a model (--allow-pull)"))
async def pull(request: Request) -> Any:
    st = state_of(request)
    req = await parse(request, ol.PullRequest)
    model = req.model or req.name or ""
    if not model:
        raise bad_request("Missing required parameter 'model'", "model")
    stream = req.stream is not False
    preset = st.manager.presets.get(model)
    if preset is not None:  # a preset's name pulls the model it runs
        model = preset.model
    await asyncio.to_thread(check_pull, st.config, model)  # 403 unless downloads are allowed
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def emit(item: dict[str, Any] | None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def work() -> None:
        try:
            _pull(model, st.config.backend, emit)
        except BaseException as e:
            emit({"error": to_api_error(e).message, "status": _status_of(e)})
        finally:
            emit(None)

    threading.Thread(target=work, daemon=True, name="localrun-pull").start()

    if not stream:
        last: dict[str, Any] = {}
        while (item := await queue.get()) is not None:
            last = item
        if "error" in last:
            raise APIError(int(last.get("status", 500)), str(last["error"]))
        return JSONResponse({"status": "success"})

    async def lines() -> AsyncIterator[bytes]:
        while (item := await queue.get()) is not None:
            if "error" in item:
                item.pop("status", None)  # the HTTP status: the stream has begun with 200
            yield (json.dumps(item, ensure_ascii=False) + "\n").encode()

    return StreamingResponse(lines(), media_type=NDJSON)


def _status_of(e: BaseException) -> int:
    return to_api_error(e).status


def _pull(model: str, backend: str, emit: Any) -> None:
    from localrun import hub
    from localrun.resolve import plan_target

    emit({"status": "pulling manifest"})
    download = plan_target(model, backend=backend).download  # planned once
    if download is None or download.local_path is not None:  # on disk already
        emit({"status": "success"})
        return

    def progress(p: Any) -> None:
        emit({"status": f"pulling {p.file.rsplit('/', 1)[-1]}", "digest": p.file,
              "total": p.file_total or 0, "completed": p.file_done})

    hub.fetch(download, progress=progress)  # refuses a model that does not fit first
    emit({"status": "verifying sha256 digest"})
    emit({"status": "writing manifest"})
    emit({"status": "success"})


# -- / ----------------------------------------------------------------------------------

@router.head("/", include_in_schema=False)
@router.get("/", **operation("GET", "/", "Ollama",
                             summary="'localrun is running' (Ollama's liveness check)"))
async def root() -> Any:
    return PlainTextResponse("localrun is running")
