"""Anthropic's Messages API routes: ``POST /v1/messages`` and
``/v1/messages/count_tokens``, for the ``anthropic`` SDK and the agents built on it
(``ANTHROPIC_BASE_URL=http://127.0.0.1:PORT``). Shapes, checks and the stream are in
:mod:`localrun.server.protocol.anthropic`; the key may come as ``x-api-key`` (the
SDK's way) or ``Authorization: Bearer``; ``anthropic-version`` and ``anthropic-beta``
headers are accepted and change nothing; every error is in Anthropic's shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from localrun.server.errors import APIError
from localrun.server.jobs import Job
from localrun.server.protocol import anthropic as an
from localrun.server.protocol.common import Generation, dump, parse, renamed, respond
from localrun.server.protocol.spec import operation

router = APIRouter()


@router.post("/v1/messages", **operation(
    "POST", "/v1/messages", "Anthropic", request=an.MessagesRequest, response=an.Message,
    stream=an.StreamEvent, summary="Messages"))
async def messages(request: Request) -> Any:
    req = await parse(request, an.MessagesRequest)
    gen = req.generation()
    mid = an.message_id()
    return await respond(
        request, "messages", gen, lambda job: an.MessagesSSE(job, mid, req.model, req.omitted),
        lambda job, c: an.message(mid, req.model, c,
                                  getattr(job.stream, "stop_sequence", None), req.omitted))


@router.post("/v1/messages/count_tokens", **operation(
    "POST", "/v1/messages/count_tokens", "Anthropic", request=an.CountTokensRequest,
    response=an.TokenCount, summary="Count a conversation's tokens"))
async def count_tokens(request: Request) -> Any:
    req = await parse(request, an.CountTokensRequest)
    # checked before the model loads, as a reply's request is; counted as the reply's
    # prompt is rendered (its tools, its thinking switch)
    gen = Generation(req.model, messages=req.conversation(), structured=req.structured(),
                     reasoning=req.reasoning(), names=an.NAMES).check()
    try:
        _, n = await Job.call(request, "count_tokens", req.model,
                              lambda h: h.count_prompt_tokens(gen.messages, **gen.structured,
                                                              **gen.reasoning))
    except APIError as e:  # thinking asked of a model that does not think
        raise renamed(e, an.NAMES) from None
    return JSONResponse(dump(an.TokenCount(input_tokens=n)))
