"""The OpenAI API: /v1/chat/completions, /v1/completions, /v1/models, /v1/embeddings.

Shapes follow OpenAI's API reference as the official ``openai`` Python client reads
them (streamed tool-call deltas always carry ``index``; a stream with
``stream_options.include_usage`` ends with a chunk whose ``choices`` is empty).
"""

from __future__ import annotations

import base64
import json
import secrets
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from localrun import __version__
from localrun.server.errors import APIError, bad_request, unsupported
from localrun.server.jobs import Event, Job
from localrun.server.params import Fields, check_sampling, read_json, sampling_kwargs
from localrun.server.state import state_of, to_api_error
from localrun.types import CancelToken, Completion

router = APIRouter()

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop"}
FINGERPRINT = f"localrun-{__version__}"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: accepted, with no effect on the reply (OpenAI uses them for its own bookkeeping)
NO_EFFECT = ("user", "metadata")
PARAMS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
          "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
          "seed": "seed", "stop": "stop"}


def _sampling(f: Fields) -> dict[str, Any]:
    max_tokens = f.integer("max_completion_tokens", minimum=1)
    legacy = f.integer("max_tokens", minimum=1)
    if max_tokens is not None and legacy is not None and max_tokens != legacy:
        raise bad_request("Both 'max_tokens' and 'max_completion_tokens' are set, to "
                          f"{legacy} and {max_tokens}: send one", "max_tokens")
    kwargs = sampling_kwargs(
        max_tokens=max_tokens if max_tokens is not None else legacy,
        temperature=f.number("temperature"), top_p=f.number("top_p"), top_k=f.integer("top_k"),
        min_p=f.number("min_p"), repetition_penalty=f.number("repetition_penalty"),
        seed=f.integer("seed"), stop=f.stop("stop"))
    check_sampling(kwargs, PARAMS)
    f.refuse_if("n", 1, "localrun returns one choice per request (send n=1 or leave it out)")
    f.refuse_if("logprobs", False, "log probabilities are not available from every engine")
    f.refuse_if("top_logprobs", 0, "log probabilities are not available from every engine")
    f.refuse_if("logit_bias", {}, "logit bias is not implemented")
    f.refuse_if("frequency_penalty", 0, "use repetition_penalty (localrun's, the same on "
                "every engine)")
    f.refuse_if("presence_penalty", 0, "use repetition_penalty (localrun's, the same on "
                "every engine)")
    f.refuse_if("store", False, "localrun keeps no record of requests")
    if f.raw("service_tier") not in (None, "auto", "default"):
        raise unsupported("service_tier", "localrun has one tier: send auto or default")
    return kwargs


def _stream_flags(f: Fields) -> tuple[bool, bool]:
    stream = bool(f.flag("stream"))
    opts = f.obj("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true",
                              "stream_options")
        sub = Fields(opts, "stream_options.")
        include_usage = bool(sub.flag("include_usage"))
        sub.refuse_unread()
    return stream, include_usage


def _messages(raw: list[Any] | None) -> list[dict[str, Any]]:
    if not raw:
        raise bad_request("'messages' must be a non-empty array", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content'", where)
        f = Fields(m, f"{where}.")
        role = f.text("role", required=True)
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system turn
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"Invalid '{where}.role': {role!r} (expected system, developer, "
                              "user, assistant or tool)", f"{where}.role")
        msg: dict[str, Any] = {"role": role, "content": _content(f.raw("content"), where)}
        calls = f.array("tool_calls")
        if calls:
            msg["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            v = f.text(key)
            if v is not None:
                msg[key] = v
        f.refuse_if("refusal", None, "a refusal cannot be sent back")
        f.refuse_unread()
        if msg["content"] is None and not calls:
            raise bad_request(f"'{where}.content' is missing (only an assistant turn with "
                              "tool_calls may omit it)", f"{where}.content")
        out.append(msg)
    return out


def _content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
                continue
            raise unsupported(f"{where}.content[{j}]", f"content parts of type {kind!r} "
                              "(only text parts are supported: localrun's engines take text)")
        return "".join(texts)
    raise bad_request(f"Invalid type for '{where}.content': expected a string or an array "
                      "of text parts", f"{where}.content")


def _structured(f: Fields) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rf = f.obj("response_format")
    if rf is not None and rf.get("type") != "text":
        out["response_format"] = rf
    tools = f.array("tools")
    if tools:
        out["tools"] = tools
    choice = f.raw("tool_choice")
    if choice is not None:
        out["tool_choice"] = choice
    if f.flag("parallel_tool_calls") is False:
        raise unsupported("parallel_tool_calls", "false is not enforced: localrun lets a "
                          "model make several calls in one turn")
    return out


def _usage(c: Completion) -> dict[str, int]:
    return {"prompt_tokens": c.usage.prompt_tokens,
            "completion_tokens": c.usage.completion_tokens,
            "total_tokens": c.usage.prompt_tokens + c.usage.completion_tokens}


async def _first(job: Job) -> Event:
    """The first event, before any header goes out: a failure here still gets its own
    status code (400 for a prompt over the context, 500 for an engine failure)."""
    event = await job.next()
    if event.kind == "error":
        assert event.error is not None
        raise to_api_error(event.error)
    return event


async def _collect(job: Job, event: Event) -> Completion:
    while event.kind == "chunk":
        event = await job.next()
    if event.kind == "error":
        assert event.error is not None
        raise to_api_error(event.error)
    assert event.completion is not None
    return event.completion


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


# -- /v1/chat/completions ---------------------------------------------------------------

@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    st = state_of(request)
    f = Fields(await read_json(request))
    model = f.text("model", required=True) or ""
    messages = _messages(f.array("messages"))
    sampling = _sampling(f)
    structured = _structured(f)
    stream, include_usage = _stream_flags(f)
    f.refuse_unread(NO_EFFECT)

    job = await Job.open(request, st.manager, "chat", model)
    try:
        handle = job.loaded.handle

        def work(token: CancelToken) -> Any:
            return handle.stream(messages, cancel=token, **structured, **sampling)

        job.run(work)
        first = await _first(job)
        cid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        if not stream:
            c = await _collect(job, first)
            job.close()
            message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
            if c.tool_calls:
                message["tool_calls"] = [call.to_dict() for call in c.tool_calls]
                message["content"] = c.text or None
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": created, "model": model,
                "system_fingerprint": FINGERPRINT,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": FINISH[c.finish_reason]}],
                "usage": _usage(c)})
    except BaseException:
        job.close()
        raise
    return StreamingResponse(_chat_stream(job, first, cid, created, model, include_usage),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _chat_stream(job: Job, event: Event, cid: str, created: int, model: str,
                       include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        data: dict[str, Any] = {
            "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish}]}
        if include_usage:
            data["usage"] = None
        return _sse(data)

    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            if event.kind == "chunk":
                assert event.chunk is not None
                delta: dict[str, Any] = {}
                if event.chunk.text:
                    delta["content"] = event.chunk.text
                if event.chunk.tool_calls:
                    delta["tool_calls"] = [d.to_dict() for d in event.chunk.tool_calls]
                if delta:
                    yield chunk(delta)
            elif event.kind == "done":
                c = event.completion
                assert c is not None
                yield chunk({}, FINISH[c.finish_reason])
                if include_usage:
                    yield _sse({"id": cid, "object": "chat.completion.chunk",
                                "created": created, "model": model,
                                "system_fingerprint": FINGERPRINT, "choices": [],
                                "usage": _usage(c)})
                yield b"data: [DONE]\n\n"
                return
            else:
                assert event.error is not None
                yield _sse(to_api_error(event.error).openai_body())
                return
            event = await job.next()
    except APIError as e:  # the request timeout, mid-stream
        yield _sse(e.openai_body())
    finally:
        job.close()


# -- /v1/completions --------------------------------------------------------------------

@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    st = state_of(request)
    f = Fields(await read_json(request))
    model = f.text("model", required=True) or ""
    prompt = _prompt(f.raw("prompt"))
    sampling = _sampling(f)
    stream, include_usage = _stream_flags(f)
    f.refuse_if("echo", False, "the prompt is not echoed back")
    f.refuse_if("best_of", 1, "localrun returns one choice per request")
    f.refuse_if("suffix", "", "fill-in-the-middle is not implemented")
    f.refuse_unread(NO_EFFECT)

    job = await Job.open(request, st.manager, "completions", model)
    try:
        handle = job.loaded.handle

        def work(token: CancelToken) -> Any:
            return handle.stream(prompt, raw=True, cancel=token, **sampling)

        job.run(work)
        first = await _first(job)
        cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
        if not stream:
            c = await _collect(job, first)
            job.close()
            return JSONResponse({
                "id": cid, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": FINGERPRINT,
                "choices": [{"index": 0, "text": c.text, "logprobs": None,
                             "finish_reason": FINISH[c.finish_reason]}],
                "usage": _usage(c)})
    except BaseException:
        job.close()
        raise
    return StreamingResponse(_text_stream(job, first, cid, created, model, include_usage),
                             media_type="text/event-stream", headers=SSE_HEADERS)


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and not all(isinstance(v, str) for v in value):
        raise unsupported("prompt", "token arrays (send the prompt as text)")
    if isinstance(value, list) and len(value) > 1:
        raise unsupported("prompt", "several prompts in one request (send one per request)")
    raise bad_request("'prompt' must be a non-empty string", "prompt")


async def _text_stream(job: Job, event: Event, cid: str, created: int, model: str,
                       include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(text: str, finish: str | None = None) -> bytes:
        data: dict[str, Any] = {
            "id": cid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            data["usage"] = None
        return _sse(data)

    try:
        while True:
            if event.kind == "chunk":
                assert event.chunk is not None
                if event.chunk.text:
                    yield chunk(event.chunk.text)
            elif event.kind == "done":
                c = event.completion
                assert c is not None
                yield chunk("", FINISH[c.finish_reason])
                if include_usage:
                    yield _sse({"id": cid, "object": "text_completion", "created": created,
                                "model": model, "choices": [], "usage": _usage(c)})
                yield b"data: [DONE]\n\n"
                return
            else:
                assert event.error is not None
                yield _sse(to_api_error(event.error).openai_body())
                return
            event = await job.next()
    except APIError as e:
        yield _sse(e.openai_body())
    finally:
        job.close()


# -- /v1/models -------------------------------------------------------------------------

@router.get("/v1/models")
async def list_models(request: Request) -> Any:
    from localrun.server.catalog import model_list

    return JSONResponse({"object": "list", "data": await model_list(state_of(request))})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> Any:
    from localrun.server.catalog import model_list

    for entry in await model_list(state_of(request)):
        if entry["id"] == model_id:
            return JSONResponse(entry)
    raise APIError(404, f"The model '{model_id}' is neither loaded nor on disk (any name "
                   "localrun accepts still loads on its first request)", param="model",
                   code="model_not_found")


# -- /v1/embeddings ---------------------------------------------------------------------

@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Any:
    st = state_of(request)
    f = Fields(await read_json(request))
    model = f.text("model", required=True) or ""
    texts = embedding_inputs(f.raw("input"), "input")
    encoding = f.text("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad_request(f"Invalid 'encoding_format': {encoding!r} (float or base64)",
                          "encoding_format")
    dimensions = f.integer("dimensions", minimum=1)
    f.refuse_unread(("user",))

    job = await Job.open(request, st.manager, "embeddings", model, kind="embed")
    try:
        handle = job.loaded.handle
        if dimensions is not None and dimensions != handle.dimensions:
            raise unsupported("dimensions", f"{model} gives {handle.dimensions}-dimensional "
                              "embeddings; leave 'dimensions' out or send that number")
        job.run(lambda token: handle.embed(texts, truncate=False))
        event = await job.next()
        if event.kind == "error":
            assert event.error is not None
            raise to_api_error(event.error, param="input")
        result = event.result
    finally:
        job.close()
    assert result is not None
    data = [{"object": "embedding", "index": i,
             "embedding": encode_vector(vec) if encoding == "base64" else vec}
            for i, vec in enumerate(result.vectors)]
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": result.tokens,
                                   "total_tokens": result.tokens}})


def embedding_inputs(value: Any, param: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{param}' must be a string or a non-empty array of strings", param)
    for i, v in enumerate(value):
        if not isinstance(v, str):
            if isinstance(v, (int, list)):
                raise unsupported(f"{param}[{i}]", "token arrays (send text)")
            raise bad_request(f"'{param}[{i}]' must be a string", f"{param}[{i}]")
        if not v:
            raise bad_request(f"'{param}[{i}]' is empty", f"{param}[{i}]")
    return list(value)


def encode_vector(vec: list[float]) -> str:
    """OpenAI's base64 encoding: little-endian float32, as the client decodes it."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
