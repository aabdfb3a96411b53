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
from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from localrun import __version__
from localrun.server.errors import APIError, bad_request, unsupported
from localrun.server.jobs import Event, Job, Wire
from localrun.server.params import (
    Fields,
    check_sampling,
    each_message,
    read_model_request,
    sampling_kwargs,
)
from localrun.server.state import state_of
from localrun.types import Chunk, Completion

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
    out: list[dict[str, Any]] = []
    for where, f in each_message(raw):
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


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class _SSE(Wire):
    """OpenAI's server-sent events for one choice: ``choice(...)`` builds the endpoint's
    choice object (a chat delta or a text piece)."""

    def __init__(self, obj: str, cid: str, model: str, include_usage: bool) -> None:
        self.head: dict[str, Any] = {"id": cid, "object": obj, "created": int(time.time()),
                                     "model": model, "system_fingerprint": FINGERPRINT}
        self.include_usage = include_usage

    @abstractmethod
    def choice(self, piece: Any, finish: str | None) -> dict[str, Any]:
        """The one choice of an event (``piece`` None: the last one, with ``finish``)."""

    def _event(self, piece: Any, finish: str | None = None) -> bytes:
        data: dict[str, Any] = {**self.head, "choices": [self.choice(piece, finish)]}
        if self.include_usage:
            data["usage"] = None
        return _sse(data)

    def done(self, completion: Completion) -> Iterable[bytes]:
        yield self._event(None, FINISH[completion.finish_reason])
        if self.include_usage:
            yield _sse({**self.head, "choices": [], "usage": _usage(completion)})
        yield b"data: [DONE]\n\n"

    def error(self, error: APIError) -> bytes:
        return _sse(error.openai_body())


class _ChatSSE(_SSE):
    def choice(self, piece: Any, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": piece or {}, "logprobs": None, "finish_reason": finish}

    def begin(self) -> Iterable[bytes]:
        yield self._event({"role": "assistant", "content": ""})

    def chunk(self, chunk: Chunk) -> Iterable[bytes]:
        delta: dict[str, Any] = {}
        if chunk.text:
            delta["content"] = chunk.text
        if chunk.tool_calls:
            delta["tool_calls"] = [d.to_dict() for d in chunk.tool_calls]
        if delta:
            yield self._event(delta)


class _TextSSE(_SSE):
    def choice(self, piece: Any, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}

    def chunk(self, chunk: Chunk) -> Iterable[bytes]:
        if chunk.text:
            yield self._event(chunk.text)


async def _answer(job: Job, first: Event, wire: _SSE, stream: bool,
                  message: Callable[[Completion], dict[str, Any]]) -> Any:
    """A stream of ``wire``'s events, or one JSON object whose choice ``message`` makes."""
    if stream:
        return StreamingResponse(job.pump(first, wire), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    c = await job.collect(first)
    obj = wire.head["object"].removesuffix(".chunk")
    return JSONResponse({**wire.head, "object": obj,
                         "choices": [{"index": 0, **message(c), "logprobs": None,
                                      "finish_reason": FINISH[c.finish_reason]}],
                         "usage": _usage(c)})


# -- /v1/chat/completions ---------------------------------------------------------------

@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    f, model = await read_model_request(request)
    messages = _messages(f.array("messages"))
    sampling = _sampling(f)
    structured = _structured(f)
    stream, include_usage = _stream_flags(f)
    f.refuse_unread(NO_EFFECT)

    job, first = await Job.generate(
        request, "chat", model,
        lambda h, token: h.stream(messages, cancel=token, **structured, **sampling),
        stream=stream)
    wire = _ChatSSE("chat.completion.chunk", "chatcmpl-" + secrets.token_hex(12), model,
                    include_usage)
    return await _answer(job, first, wire, stream, _chat_message)


def _chat_message(c: Completion) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
    if c.tool_calls:
        message["tool_calls"] = [call.to_dict() for call in c.tool_calls]
        message["content"] = c.text or None
    return {"message": message}


# -- /v1/completions --------------------------------------------------------------------

@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    f, model = await read_model_request(request)
    prompt = _prompt(f.raw("prompt"))
    sampling = _sampling(f)
    stream, include_usage = _stream_flags(f)
    f.refuse_if("echo", False, "the prompt is not echoed back")
    f.refuse_if("best_of", 1, "localrun returns one choice per request")
    f.refuse_if("suffix", "", "fill-in-the-middle is not implemented")
    f.refuse_unread(NO_EFFECT)

    job, first = await Job.generate(
        request, "completions", model,
        lambda h, token: h.stream(prompt, raw=True, cancel=token, **sampling),
        stream=stream)
    wire = _TextSSE("text_completion", "cmpl-" + secrets.token_hex(12), model, include_usage)
    return await _answer(job, first, wire, stream, lambda c: {"text": c.text})


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
    f, model = await read_model_request(request)
    texts = embedding_inputs(f.raw("input"), "input")
    encoding = f.text("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad_request(f"Invalid 'encoding_format': {encoding!r} (float or base64)",
                          "encoding_format")
    dimensions = f.integer("dimensions", minimum=1)
    f.refuse_unread(("user",))

    def work(handle: Any) -> Any:
        if dimensions is not None and dimensions != handle.dimensions:
            raise unsupported("dimensions", f"{model} gives {handle.dimensions}-dimensional "
                              "embeddings; leave 'dimensions' out or send that number")
        return handle.embed(texts, truncate=False)

    _, result = await Job.call(request, "embeddings", model, work, kind="embed",
                               param="input")
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
