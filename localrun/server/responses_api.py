"""OpenAI's Responses API routes: ``POST /v1/responses``, ``GET``/``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` — for the ``openai``
SDK's ``responses.*``, the OpenAI Agents SDK's default model and Codex.

Shapes and checks are in :mod:`localrun.server.protocol.responses`, the answer and its
stream in :mod:`localrun.server.protocol.responses_out`. Stored responses (``store``,
OpenAI's default, and ``previous_response_id``) are kept by
:mod:`localrun.server.responses_store`: one SQLite file in localrun's home, opened on the
first request that needs it and closed when the server stops; its calls block, so they
run in a thread. A response belongs to the API key that created it (the key presented,
whatever the server's own; none is the owner "local"): another key's id is a missing id.
Whether the store can be used, the previous response and the request's size are checked
before any model loads; a request refused changes nothing stored.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from localrun.server import responses_store as rs
from localrun.server.errors import APIError, bad_request, unsupported
from localrun.server.imagefetch import fetch_image_urls, has_image_urls
from localrun.server.jobs import Job
from localrun.server.protocol import responses as rq
from localrun.server.protocol import responses_out as ro
from localrun.server.protocol.common import SSE_HEADERS, parse
from localrun.server.protocol.spec import operation
from localrun.types import Completion

router = APIRouter()
T = TypeVar("T")
PATH = "/v1/responses"


# -- the store ---------------------------------------------------------------------------------

@dataclass
class _Slot:
    """The app's store, opened on first use (a failed open is tried again next time)."""

    store: rs.ResponseStore | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _slot(app: Any) -> _Slot:
    slot = getattr(app.state, "responses", None)
    if slot is None:
        slot = app.state.responses = _Slot()
    return slot


async def open_store(request: Request) -> rs.ResponseStore:
    """The server's store (503 when it cannot be used)."""
    slot = _slot(request.app)
    if slot.store is None:
        async with slot.lock:
            if slot.store is None:
                slot.store = await _call(rs.open_default)
    return slot.store


def close_store(app: Any) -> None:
    """Close the app's store (the server stops)."""
    slot = getattr(app.state, "responses", None)
    if slot is not None and slot.store is not None:
        slot.store.close()
        slot.store = None


def store_error(e: rs.ResponseStoreError | rs.ResponseTooLargeError) -> APIError:
    text = e.message + (f" ({e.hint})" if e.hint else "")
    if isinstance(e, rs.StoreBusyError):
        return APIError(503, text, code="store_busy", headers={"Retry-After": "1"})
    if isinstance(e, rs.ResponseTooLargeError):
        return APIError(400, text, param="input", code="response_too_large")
    return APIError(503, text, code="store_unavailable")


async def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """A store call, in a thread; its typed errors as answers."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except rs.InvalidListParamError as e:
        raise bad_request(f"{e.message} ({e.hint})", e.param) from None
    except (rs.ResponseStoreError, rs.ResponseTooLargeError) as e:
        raise store_error(e) from None


def presented_key(request: Request) -> str | None:
    """The API key the request carries (``Authorization: Bearer`` or ``x-api-key``)."""
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return request.headers.get("x-api-key", "").strip() or None


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.",
                    type="invalid_request_error", code="not_found")


def _size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


# -- POST /v1/responses ------------------------------------------------------------------------

@router.post(PATH, **operation("POST", PATH, "OpenAI", request=rq.ResponsesRequest,
                               response=ro.Response, stream=ro.StreamEvent,
                               summary="Responses"))
async def create(request: Request) -> Any:
    req = await parse(request, rq.ResponsesRequest)
    gen = req.generation()  # a malformed request is a 400 before the store is read
    keep = req.store is not False
    continues = req.previous_response_id is not None
    store = await open_store(request) if keep or continues else None
    owner = store.owner_for(presented_key(request)) if store is not None else rs.LOCAL_OWNER
    previous = None
    if store is not None and req.previous_response_id is not None:
        previous = await _call(store.conversation, req.previous_response_id, owner)
        if previous is None:
            raise APIError(400, f"Previous response with id '{req.previous_response_id}' "
                           "not found (it was deleted, is older than the store keeps, was "
                           "sent with store: false, or belongs to another API key)",
                           param="previous_response_id", code="previous_response_not_found")
        gen = req.continued(gen, previous)
    if has_image_urls(gen.messages):  # fetched here, or refused: the library never fetches
        from localrun.server.state import state_of

        assert gen.messages is not None
        gen.messages = await fetch_image_urls(
            gen.messages, state_of(request).config.allow_image_urls, "input")
    items = [rq.stored_item(i) for i in req.items()]
    turns = (previous or []) + rq.to_messages(req.items())
    size = _size(items) + _size(turns) if store is not None and keep else 0
    if store is not None and size > store.max_item_bytes:
        raise APIError(400, f"This conversation is too large to store: {size:,} bytes, over "
                       f"the {store.max_item_bytes:,}-byte limit of one stored response (send "
                       "store: false, or start a new conversation without "
                       "previous_response_id)", param="input", code="response_too_large")
    fields = ro.head(rs.new_response_id(), req)
    custom = req.custom_tools

    async def save(response: ro.Response, c: Completion) -> None:
        if store is not None and keep:
            await _call(store.put, response.id, owner, ro.dumped(response), input_items=items,
                        conversation=[*turns, ro.assistant_turn(c)], model=req.model)

    effort = req.effort

    def call(handle: Any, token: Any) -> Any:
        # reasoning.effort, for a model that thinks (one that does not ignores it)
        run = gen
        if effort is not None and getattr(handle, "reasoning", None) is not None:
            run = replace(gen, sampling={**gen.sampling, "reasoning_effort": effort})
        return run.call(handle, token)

    job, first = await Job.generate(request, "responses", gen.model, call,
                                    context=gen.context, keep_alive=gen.keep_alive,
                                    stream=gen.stream)
    if gen.stream:
        wire = ro.ResponsesSSE(fields, custom)
        return StreamingResponse(_stream(job, first, wire, save),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    completion = await job.collect(first)
    response = ro.whole(fields, completion, custom)
    await save(response, completion)
    return JSONResponse(ro.dumped(response))


async def _stream(job: Job, first: Any, wire: ro.ResponsesSSE,
                  save: Callable[[ro.Response, Completion], Any]) -> AsyncIterator[bytes]:
    """The stream; at its end the response is stored, then ``response.completed`` sent
    (a failure to store is the stream's error event instead)."""
    async for data in job.pump(first, wire):
        yield data
    if wire.final is None:  # it failed: the wire wrote its error
        return
    assert wire.completion is not None
    try:
        await save(wire.final, wire.completion)
    except APIError as e:
        yield wire.error(e)
        return
    yield wire.finish()


# -- stored responses ----------------------------------------------------------------------------

@router.get(PATH + "/{response_id}", **operation(
    "GET", PATH + "/{response_id}", "OpenAI", response=ro.Response,
    summary="A stored response"))
async def retrieve(request: Request, response_id: str) -> Any:
    if request.query_params.get("stream", "false").lower() not in ("false", "0", ""):
        raise unsupported("stream", "a stored response is not streamed again: get it whole")
    store = await open_store(request)
    found = await _call(store.get, response_id, store.owner_for(presented_key(request)))
    if found is None:
        raise not_found(response_id)
    return JSONResponse(found.response)


@router.delete(PATH + "/{response_id}", **operation(
    "DELETE", PATH + "/{response_id}", "OpenAI", response=ro.DeletedResponse,
    summary="Delete a stored response"))
async def delete(request: Request, response_id: str) -> Any:
    store = await open_store(request)
    if not await _call(store.delete, response_id, store.owner_for(presented_key(request))):
        raise not_found(response_id)
    return JSONResponse(ro.dumped(ro.DeletedResponse(id=response_id,
                                                     object="response.deleted", deleted=True)))


@router.get(PATH + "/{response_id}/input_items", **operation(
    "GET", PATH + "/{response_id}/input_items", "OpenAI", response=ro.InputItemList,
    summary="A stored response's input items"))
async def input_items(request: Request, response_id: str) -> Any:
    q = request.query_params
    raw = q.get("limit")
    limit = rs.LIST_LIMIT_DEFAULT
    if raw is not None:
        try:
            limit = int(raw)
        except ValueError:
            raise bad_request(f"Invalid 'limit': {raw!r} is not an integer (send 1 to "
                              f"{rs.LIST_LIMIT_MAX})", "limit") from None
    order = q.get("order", rs.LIST_ORDER_DEFAULT)
    store = await open_store(request)
    page = await _call(store.input_items, response_id, store.owner_for(presented_key(request)),
                       after=q.get("after"), before=q.get("before"), limit=limit,
                       order=order)  # type: ignore[arg-type]
    if page is None:
        raise not_found(response_id)
    return JSONResponse(page.to_json())
