"""The Ollama API, for tools built on it: /api/chat, /api/generate, /api/embed, /api/tags,
/api/show, /api/ps, /api/version, /api/pull.

Ollama's names map to localrun's: ``num_predict`` → max_tokens, ``repeat_penalty`` →
repetition_penalty, ``num_ctx`` → the context the model is loaded with (a model asked
for with another ``num_ctx`` loads again at that size), ``format`` ("json" or a JSON
Schema) → structured output, ``keep_alive`` → how long the model stays loaded after
this request. Options localrun cannot honour are refused with 400, never dropped.
Streams are NDJSON, one object per line; ``stream`` defaults to true, as in Ollama.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from localrun import __version__
from localrun.server.catalog import (
    details,
    disk_models,
    ollama_ps,
    ollama_tags,
    rfc3339,
    shows_paths,
)
from localrun.server.config import parse_duration
from localrun.server.errors import APIError, bad_request, unsupported
from localrun.server.jobs import Call, Job, Wire
from localrun.server.openai_api import embedding_inputs
from localrun.server.params import (
    Fields,
    check_sampling,
    each_message,
    read_json,
    read_model_request,
    sampling_kwargs,
)
from localrun.server.policy import check_pull
from localrun.server.state import state_of, to_api_error
from localrun.structured.calls import new_call_id
from localrun.types import CancelToken, Chunk, Completion

router = APIRouter()

NDJSON = "application/x-ndjson"
SAMPLING_OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature",
                    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repeat_penalty": "repetition_penalty", "seed": "seed", "stop": "stop"}
PARAM_NAMES = {v: f"options.{k}" for k, v in SAMPLING_OPTIONS.items()}
#: Ollama options localrun has no equivalent for; refused by name.
UNSUPPORTED_OPTIONS = {
    "num_keep": "prompt-cache retention is the engine's", "tfs_z": "no tail-free sampling",
    "typical_p": "no typical sampling", "repeat_last_n": "the penalty window is the engine's",
    "presence_penalty": "use repeat_penalty", "frequency_penalty": "use repeat_penalty",
    "mirostat": "no mirostat sampling", "mirostat_tau": "no mirostat sampling",
    "mirostat_eta": "no mirostat sampling", "penalize_newline": "not implemented",
    "numa": "set at load, not per request", "num_batch": "set at load, not per request",
    "num_gpu": "localrun places layers itself (localrun plan shows where)",
    "main_gpu": "choose the device when loading", "low_vram": "not implemented",
    "vocab_only": "not implemented", "use_mmap": "the engine decides",
    "use_mlock": "not implemented", "num_thread": "set at load, not per request",
    "logits_all": "not implemented", "embedding_only": "not implemented",
    "f16_kv": "not implemented",
}
FINISH = {"stop": "stop", "length": "length", "tool_calls": "stop", "cancelled": "stop"}


def _options(f: Fields) -> tuple[dict[str, Any], int | None, bool]:
    """(sampling kwargs, num_ctx, fill_context): ``num_predict`` < 0 means "until the
    context is full", resolved once the model (and its context) is known."""
    opts = f.obj("options") or {}
    o = Fields(opts, "options.")
    num_predict = o.integer("num_predict")
    fill = num_predict is not None and num_predict < 0
    kwargs = sampling_kwargs(
        max_tokens=None if fill else num_predict, temperature=o.number("temperature"),
        top_p=o.number("top_p"), top_k=o.integer("top_k"), min_p=o.number("min_p"),
        repetition_penalty=o.number("repeat_penalty"), seed=o.integer("seed"), stop=o.stop("stop"))
    num_ctx = o.integer("num_ctx", minimum=16)
    for key in opts:
        if key in UNSUPPORTED_OPTIONS and opts[key] is not None:
            raise unsupported(f"options.{key}", UNSUPPORTED_OPTIONS[key])
    o.refuse_unread()
    check_sampling(kwargs, PARAM_NAMES)
    return kwargs, num_ctx, fill


def _keep_alive(f: Fields) -> Any:
    value = f.raw("keep_alive")
    if value is None:
        return "default"
    try:
        return parse_duration(value)
    except Exception as e:  # LocalrunError: a bad duration
        raise bad_request(str(e), "keep_alive") from None


def _format(f: Fields) -> dict[str, Any] | None:
    value = f.raw("format")
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": value}}
    raise bad_request(f"Invalid 'format': {json.dumps(value)[:60]} (\"json\" or a JSON Schema "
                      "object)", "format")


def _refuse_thinking(f: Fields) -> None:
    think = f.raw("think")
    if think not in (None, False):
        raise unsupported("think", "reasoning traces are not separated from the reply yet")
    f.refuse_if("logprobs", False, "log probabilities are not available from every engine")
    f.refuse_if("top_logprobs", 0, "log probabilities are not available from every engine")


def _messages(raw: list[Any] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    calls_by_name: dict[str, str] = {}
    for where, f in each_message(raw):
        role = f.text("role", required=True)
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"Invalid '{where}.role': {role!r}", f"{where}.role")
        content = f.text("content")
        f.refuse_if("images", [], "image input is not supported by localrun's engines yet")
        f.raw("thinking")  # an earlier reply's reasoning: not sent back to the model
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        calls = f.array("tool_calls")
        if calls:
            msg["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"'{where}.tool_calls[{j}]' needs function.name",
                                      f"{where}.tool_calls[{j}]")
                args = fn.get("arguments") or {}
                cid = call.get("id") if isinstance(call.get("id"), str) else new_call_id()
                calls_by_name[fn["name"]] = cid
                msg["tool_calls"].append({"id": cid, "type": "function", "function": {
                    "name": fn["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args)}})
            if not content:
                msg["content"] = None
        tool_name = f.text("tool_name")
        call_id = f.text("tool_call_id")
        if role == "tool":
            cid = call_id or (calls_by_name.get(tool_name) if tool_name else None)
            if cid is None and calls_by_name:
                cid = list(calls_by_name.values())[-1]
            if cid is not None:
                msg["tool_call_id"] = cid
        f.refuse_unread()
        out.append(msg)
    return out


def _tool_calls(c: Completion) -> list[dict[str, Any]]:
    out = []
    for i, call in enumerate(c.tool_calls):
        try:
            args: Any = json.loads(call.arguments)
        except ValueError:
            args = call.arguments
        out.append({"id": call.id, "function": {"index": i, "name": call.name,
                                                "arguments": args}})
    return out


def _stats(job: Job, c: Completion) -> dict[str, Any]:
    ns = 1_000_000_000
    loaded = job.loaded
    load = loaded.load_seconds if loaded.loaded_at >= job_started_wall(job) else 0.0
    t = c.timings
    return {"done": True, "done_reason": FINISH[c.finish_reason],
            "total_duration": int((time.monotonic() - job.t0) * ns),
            "load_duration": int(load * ns),
            "prompt_eval_count": c.usage.prompt_tokens,
            "prompt_eval_duration": int(t.ttft * ns),
            "eval_count": c.usage.completion_tokens,
            "eval_duration": int(max(0.0, t.total - t.ttft) * ns)}


def job_started_wall(job: Job) -> float:
    return time.time() - (time.monotonic() - job.t0)


def _line(data: Any) -> bytes:
    return (json.dumps(data, ensure_ascii=False) + "\n").encode()


class _NDJSON(Wire):
    """Ollama's stream: one object per line, the last with ``done`` and the timings."""

    def __init__(self, job: Job, model: str, chat: bool) -> None:
        self.job = job
        self.model = model
        self.chat = chat

    def piece(self, text: str) -> dict[str, Any]:
        if self.chat:
            return {"model": self.model, "created_at": rfc3339(),
                    "message": {"role": "assistant", "content": text}, "done": False}
        return {"model": self.model, "created_at": rfc3339(), "response": text, "done": False}

    def whole(self, c: Completion) -> dict[str, Any]:
        """The non-streamed answer: the reply, its tool calls, the timings."""
        out = self.piece(c.text)
        if self.chat and c.tool_calls:
            out["message"]["tool_calls"] = _tool_calls(c)
        out.update(_stats(self.job, c))
        return out

    def chunk(self, chunk: Chunk) -> Iterable[bytes]:
        if chunk.text and not chunk.tool_calls:
            yield _line(self.piece(chunk.text))

    def done(self, completion: Completion) -> Iterable[bytes]:
        if self.chat and completion.tool_calls:  # Ollama sends each call whole
            calls = self.piece("")
            calls["message"]["tool_calls"] = _tool_calls(completion)
            yield _line(calls)
        last = self.piece("")
        last.update(_stats(self.job, completion))
        yield _line(last)

    def error(self, error: APIError) -> bytes:
        return _line(error.ollama_body())


async def _generate(request: Request, endpoint: str, model: str, call: Call, *,
                    stream: bool, chat: bool, num_ctx: int | None, keep_alive: Any) -> Any:
    """Run ``call`` and answer as Ollama's NDJSON stream or one JSON object."""
    job, first = await Job.generate(request, endpoint, model, call, context=num_ctx,
                                    keep_alive=keep_alive, stream=stream)
    wire = _NDJSON(job, model, chat)
    if stream:
        return StreamingResponse(job.pump(first, wire), media_type=NDJSON)
    return JSONResponse(wire.whole(await job.collect(first)))


# -- /api/chat, /api/generate -----------------------------------------------------------

@router.post("/api/chat")
async def chat(request: Request) -> Any:
    f, model = await read_model_request(request)
    messages = _messages(f.array("messages"))
    sampling, num_ctx, fill = _options(f)
    structured: dict[str, Any] = {}
    fmt = _format(f)
    if fmt is not None:
        structured["response_format"] = fmt
    tools = f.array("tools")
    if tools:
        structured["tools"] = tools
    keep_alive = _keep_alive(f)
    stream = f.flag("stream") is not False
    _refuse_thinking(f)
    f.refuse_unread()

    def call(handle: Any, token: CancelToken) -> Any:
        return handle.stream(messages, cancel=token, **structured,
                             **_filled(sampling, fill, handle))

    return await _generate(request, "api_chat", model, call, stream=stream, chat=True,
                           num_ctx=num_ctx, keep_alive=keep_alive)


def _filled(sampling: dict[str, Any], fill: bool, handle: Any) -> dict[str, Any]:
    """``num_predict`` < 0: as many tokens as the loaded context holds."""
    return {**sampling, "max_tokens": handle.info.context_length} if fill else sampling


@router.post("/api/generate")
async def generate(request: Request) -> Any:
    st = state_of(request)
    f, model = await read_model_request(request)
    prompt = f.text("prompt") or ""
    system = f.text("system")
    raw = bool(f.flag("raw"))
    sampling, num_ctx, fill = _options(f)
    fmt = _format(f)
    keep_alive = _keep_alive(f)
    stream = f.flag("stream") is not False
    f.refuse_if("suffix", "", "fill-in-the-middle is not implemented")
    f.refuse_if("template", "", "localrun renders the model's own chat template")
    f.refuse_if("context", [], "send the conversation to /api/chat instead")
    f.refuse_if("images", [], "image input is not supported by localrun's engines yet")
    _refuse_thinking(f)
    f.refuse_unread()
    if raw and system:
        raise bad_request("'system' has no meaning with raw=true", "system")

    if not prompt:  # Ollama's way to load (or, with keep_alive 0, unload) a model
        if keep_alive == 0:
            await st.manager.unload(model)
            return JSONResponse({"model": model, "created_at": rfc3339(), "response": "",
                                 "done": True, "done_reason": "unload"})
        lease = await st.acquire(model, context=num_ctx, keep_alive=keep_alive)
        lease.release()
        return JSONResponse({"model": model, "created_at": rfc3339(), "response": "",
                             "done": True, "done_reason": "load"})

    extra: dict[str, Any] = {"response_format": fmt} if fmt is not None else {}
    text: Any = prompt if raw else (
        ([{"role": "system", "content": system}] if system else [])
        + [{"role": "user", "content": prompt}])

    def call(handle: Any, token: CancelToken) -> Any:
        return handle.stream(text, raw=raw, cancel=token, **extra,
                             **_filled(sampling, fill, handle))

    return await _generate(request, "api_generate", model, call, stream=stream, chat=False,
                           num_ctx=num_ctx, keep_alive=keep_alive)


# -- /api/embed, /api/embeddings --------------------------------------------------------

@router.post("/api/embed")
async def embed(request: Request) -> Any:
    f, model = await read_model_request(request)
    texts = embedding_inputs(f.raw("input"), "input")
    truncate = f.flag("truncate") is not False
    dimensions = f.integer("dimensions", minimum=1)
    opts = Fields(f.obj("options") or {}, "options.")
    num_ctx = opts.integer("num_ctx", minimum=16)
    opts.refuse_unread()
    keep_alive = _keep_alive(f)
    f.refuse_unread()
    job, result = await Job.call(request, "api_embed", model,
                                 lambda h: h.embed(texts, truncate=truncate), kind="embed",
                                 context=num_ctx, keep_alive=keep_alive, param="input")
    if dimensions is not None and dimensions != len(result.vectors[0]):
        raise unsupported("dimensions", f"{model} gives {len(result.vectors[0])}-dimensional "
                          "embeddings; leave 'dimensions' out or send that number")
    ns = 1_000_000_000
    return JSONResponse({"model": model, "embeddings": result.vectors,
                         "total_duration": int((time.monotonic() - job.t0) * ns),
                         "load_duration": 0, "prompt_eval_count": result.tokens})


@router.post("/api/embeddings")
async def embeddings_legacy(request: Request) -> Any:
    f, model = await read_model_request(request)
    texts = embedding_inputs(f.text("prompt", required=True) or "", "prompt")
    keep_alive = _keep_alive(f)
    f.refuse_if("options", {}, "send options to /api/embed")
    f.refuse_unread()
    _, result = await Job.call(request, "api_embed", model,
                               lambda h: h.embed(texts, truncate=True), kind="embed",
                               keep_alive=keep_alive, param="input")
    return JSONResponse({"embedding": result.vectors[0]})


# -- models -----------------------------------------------------------------------------

@router.get("/api/tags")
async def tags(request: Request) -> Any:
    st = state_of(request)
    disk = await asyncio.to_thread(disk_models)
    return JSONResponse({"models": ollama_tags(st, disk)})


@router.get("/api/ps")
async def ps(request: Request) -> Any:
    return JSONResponse({"models": ollama_ps(state_of(request))})


@router.get("/api/version")
async def version() -> Any:
    return JSONResponse({"version": __version__})


@router.post("/api/show")
async def show(request: Request) -> Any:
    st = state_of(request)
    f, model = await read_model_request(request)
    f.raw("verbose")
    f.refuse_unread()
    paths = shows_paths(st)
    for m in st.manager.models.values():
        if m.name == model:
            i = m.info
            return JSONResponse(_show(i.format, i.architecture, i.quantization,
                                      i.context_length, m.kind == "embed",
                                      i.path if paths else None))
    not_found = APIError(404, f"model '{model}' not found (neither loaded nor on disk; "
                         f"POST /api/pull to download it)", param="model",
                         code="model_not_found")
    try:
        await st.admit(model, loads=False)  # a local path: only where they are allowed
    except APIError as e:
        # a relative path shaped like a name: answered as one that is not there
        raise not_found if e.code == "pull_not_allowed" else e from None
    found = await asyncio.to_thread(_detect, model)
    if found is None:
        raise not_found
    fmt, arch, quant, ctx, embeds, path = found
    return JSONResponse(_show(fmt, arch, quant, ctx, embeds, path if paths else None))


def _detect(model: str) -> tuple[str, str | None, str | None, int | None, bool, str] | None:
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


def _show(fmt: str, arch: str | None, quant: str | None, ctx: int | None, embeds: bool,
          path: str | None) -> dict[str, Any]:
    info: dict[str, Any] = {"general.architecture": arch or ""}
    if arch and ctx:
        info[f"{arch}.context_length"] = ctx
    caps = ["embedding"] if embeds else ["completion", "tools"]
    return {"modelfile": "", "parameters": "", "template": "", "license": "",
            "details": details(fmt, arch, quant), "model_info": info, "capabilities": caps,
            "modified_at": rfc3339(), "localrun": {"path": path} if path else {}}


# -- /api/pull --------------------------------------------------------------------------

@router.post("/api/pull")
async def pull(request: Request) -> Any:
    st = state_of(request)
    f = Fields(await read_json(request))
    model = f.text("model") or f.text("name") or ""
    if not model:
        raise bad_request("Missing required parameter 'model'", "model")
    stream = f.flag("stream") is not False
    f.refuse_if("insecure", False, "downloads always use TLS")
    f.raw("name")
    f.refuse_unread()
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
            yield _line(item)

    return StreamingResponse(lines(), media_type=NDJSON)


def _status_of(e: BaseException) -> int:
    return to_api_error(e).status


def _pull(model: str, backend: str, emit: Any) -> None:
    from localrun import hub
    from localrun.planning import plan_fetch

    emit({"status": "pulling manifest"})
    _, fetch = plan_fetch(model, backend=backend)
    if fetch is None or fetch.local_path is not None:
        emit({"status": "success"})
        return
    fetch.require_fit()
    def progress(p: Any) -> None:
        emit({"status": f"pulling {p.file.rsplit('/', 1)[-1]}", "digest": p.file,
              "total": p.file_total or 0, "completed": p.file_done})

    hub.fetch(fetch, progress=progress)
    emit({"status": "verifying sha256 digest"})
    emit({"status": "writing manifest"})
    emit({"status": "success"})


# -- / ----------------------------------------------------------------------------------

@router.get("/")
async def root() -> Any:
    return PlainTextResponse("localrun is running")


@router.head("/")
async def root_head() -> Any:
    return Response(status_code=200)
