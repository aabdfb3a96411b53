"""The OpenAI API's routes: /v1/chat/completions, /v1/completions, /v1/models,
/v1/embeddings. Their shapes, checks and streams are in
:mod:`localrun.server.protocol.openai`; each route reads its request, translates it into
the library's one generation request and answers through
:func:`~localrun.server.protocol.common.respond`.
"""

from __future__ import annotations

import base64
import secrets
import struct
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from localrun.server.errors import APIError, bad_request, unsupported
from localrun.server.jobs import Job
from localrun.server.protocol import openai as oa
from localrun.server.protocol.common import dump, parse, respond
from localrun.server.protocol.openai_out import Echo
from localrun.server.protocol.spec import operation
from localrun.server.state import state_of

router = APIRouter()


@router.post("/v1/chat/completions", **operation(
    "POST", "/v1/chat/completions", "OpenAI", request=oa.ChatCompletionRequest,
    response=oa.ChatCompletion, stream=oa.ChatCompletionChunk, summary="Chat Completions"))
async def chat_completions(request: Request) -> Any:
    req = await parse(request, oa.ChatCompletionRequest)
    gen = req.generation()
    cid = "chatcmpl-" + secrets.token_hex(12)
    scored = bool(req.logprobs or req.top_logprobs)
    return await respond(request, "chat", gen,
                         lambda job: oa.ChatSSE(cid, req.model, req.include_usage, scored,
                                                gen.several),
                         lambda job, c: oa.chat_completion(cid, req.model, c, scored))


@router.post("/v1/completions", **operation(
    "POST", "/v1/completions", "OpenAI", request=oa.CompletionRequest,
    response=oa.TextCompletion, stream=oa.TextCompletion, summary="Completions"))
async def completions(request: Request) -> Any:
    req = await parse(request, oa.CompletionRequest)
    gen = req.generation()
    cid = "cmpl-" + secrets.token_hex(12)
    echo = Echo(gen.prompts or [gen.prompt or ""], gen.n, bool(req.echo),
                req.logprobs is not None)
    return await respond(request, "completions", gen,
                         lambda job: oa.TextSSE(cid, req.model, req.include_usage, echo),
                         lambda job, c: oa.text_completion(cid, req.model, c, echo))


# -- /v1/models -------------------------------------------------------------------------

@router.get("/v1/models", **operation("GET", "/v1/models", "OpenAI", response=oa.ModelList,
                                      summary="Models loaded and on disk"))
async def list_models(request: Request) -> Any:
    from localrun.server.catalog import model_list

    return JSONResponse({"object": "list", "data": await model_list(state_of(request))})


@router.get("/v1/models/{model_id:path}", **operation(
    "GET", "/v1/models/{model_id}", "OpenAI", response=oa.ModelEntry, summary="One model"))
async def get_model(request: Request, model_id: str) -> Any:
    from localrun.server.catalog import model_list

    for entry in await model_list(state_of(request)):
        if entry["id"] == model_id:
            return JSONResponse(entry)
    raise APIError(404, f"The model '{model_id}' is neither loaded nor on disk (any name "
                   "localrun accepts still loads on its first request)", param="model",
                   code="model_not_found")


# -- /v1/embeddings ---------------------------------------------------------------------

@router.post("/v1/embeddings", **operation(
    "POST", "/v1/embeddings", "OpenAI", request=oa.EmbeddingRequest,
    response=oa.EmbeddingList, summary="Embeddings"))
async def embeddings(request: Request) -> Any:
    req = await parse(request, oa.EmbeddingRequest)
    texts = embedding_inputs(req.input, "input")
    model, dimensions = req.model, req.dimensions

    def work(handle: Any) -> Any:
        if dimensions is not None and dimensions != handle.dimensions:
            raise unsupported("dimensions", f"{model} gives {handle.dimensions}-dimensional "
                              "embeddings; leave 'dimensions' out or send that number")
        return handle.embed(texts, truncate=False)

    _, result = await Job.call(request, "embeddings", model, work, kind="embed",
                               param="input")
    b64 = req.encoding_format == "base64"
    return JSONResponse(dump(oa.EmbeddingList(
        object="list", model=model,
        data=[oa.EmbeddingData(object="embedding", index=i,
                               embedding=encode_vector(vec) if b64 else vec)
              for i, vec in enumerate(result.vectors)],
        usage=oa.EmbeddingUsage(prompt_tokens=result.tokens, total_tokens=result.tokens))))


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
