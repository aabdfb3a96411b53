"""The Responses API's answers: the response object (whole, stored, and inside the
stream's lifecycle events), its output items, the stream (:class:`ResponsesSSE`, over
the shared :class:`~.blocks.Blocks`) and what ``GET``/``DELETE`` and ``input_items``
answer. Shapes as the official ``openai`` client parses them
(``openai/types/responses/``).

The stream, every event with its ``sequence_number`` (0, 1, 2, ...):
``response.created`` and ``response.in_progress`` (the response, ``in_progress``, no
output yet); per output item, in the order they begin, ``response.output_item.added``,
then for a message ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``; for a function call
``response.function_call_arguments.delta``... and ``.done``; for a custom tool's call
``response.custom_tool_call_input.delta`` and ``.done`` (its input whole, once the call
is complete: it is the string inside the call's JSON arguments); then
``response.output_item.done``. Last, ``response.completed`` — or
``response.incomplete`` when ``max_output_tokens`` cut the reply — with the whole
response and its usage. A failure after the stream began is an ``error`` event (OpenAI's
documented fields, and the same ``error`` object its API nests, which the official
client raises as an APIError), then ``response.failed``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel

from localrun.server.errors import APIError
from localrun.server.protocol.blocks import BlockEvent, BlockWire, blocks_of, sse
from localrun.server.protocol.responses import CUSTOM_ARG, ResponsesRequest
from localrun.server.responses_store import new_item_id
from localrun.types import Completion

ItemStatus = Literal["in_progress", "completed", "incomplete"]
Status = Literal["in_progress", "completed", "incomplete", "failed"]


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class FunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


class CustomToolCall(BaseModel):
    id: str
    type: Literal["custom_tool_call"]
    status: ItemStatus
    call_id: str
    name: str
    input: str


OutputItem = OutputMessage | FunctionCall | CustomToolCall


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ErrorInfo(BaseModel):
    code: str | None
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    """A response: as ``POST /v1/responses`` answers it, as stored, as the stream's
    lifecycle events carry it."""

    id: str
    object: Literal["response"]
    created_at: float
    status: Status
    background: bool
    error: ErrorInfo | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    service_tier: str
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None
    truncation: str
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]
    completed_at: float | None = None


class StreamError(BaseModel):
    type: str
    code: str | None
    message: str
    param: str | None


class StreamEvent(BaseModel):
    """One event of a Responses stream (``event: TYPE`` then ``data: {...}``)."""

    type: Literal[
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
        "response.output_item.done", "response.completed", "response.incomplete",
        "response.failed", "error"]
    sequence_number: int
    response: Response | None = None
    output_index: int | None = None
    item: OutputItem | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    logprobs: list[Any] | None = None
    arguments: str | None = None
    name: str | None = None
    input: str | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None
    error: StreamError | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class InputItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


# -- building them ---------------------------------------------------------------------------

def head(rid: str, req: ResponsesRequest, created_at: float | None = None) -> dict[str, Any]:
    """What a response says from the start: its id, and the request's settings echoed."""
    text = req.text
    fmt = text.format if text is not None else None
    tool_choice = req.tool_choice
    return {
        "id": rid, "object": "response", "created_at": created_at or time.time(),
        "background": False, "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None, "model": req.model,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
        "store": req.store is not False, "temperature": req.temperature,
        "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt
                 else {"type": "text"}, "verbosity": text.verbosity if text and
                 text.verbosity else "medium"},
        "tool_choice": tool_choice.model_dump(exclude_none=True) if isinstance(
            tool_choice, BaseModel) else tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or ()],
        "top_p": req.top_p, "truncation": req.truncation or "disabled", "user": req.user,
        "metadata": dict(req.metadata or {})}


def usage(c: Completion) -> ResponseUsage:
    u = c.usage
    return ResponseUsage(
        input_tokens=u.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=0),
        output_tokens=u.completion_tokens,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=getattr(u, "reasoning_tokens", 0) or 0),
        total_tokens=u.prompt_tokens + u.completion_tokens)


def custom_input(arguments: str) -> str:
    """A custom tool's input: the string its function call's arguments hold."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_ARG), str):
        return str(value[CUSTOM_ARG])
    return arguments


def _item_status(c: Completion | None) -> ItemStatus:
    return "incomplete" if c is not None and c.finish_reason == "length" else "completed"


def _text_item(iid: str, text: str, status: ItemStatus) -> OutputMessage:
    return OutputMessage(id=iid, type="message", role="assistant", status=status,
                         content=[OutputText(type="output_text", text=text, annotations=[],
                                             logprobs=[])] if status != "in_progress" else [])


def _call_item(iid: str, call_id: str, name: str, arguments: str, status: ItemStatus,
               custom: frozenset[str]) -> FunctionCall | CustomToolCall:
    if name in custom:
        return CustomToolCall(id=iid, type="custom_tool_call", status=status, call_id=call_id,
                              name=name, input=custom_input(arguments))
    return FunctionCall(id=iid, type="function_call", status=status, call_id=call_id,
                        name=name, arguments=arguments)


def output_items(c: Completion, custom: frozenset[str]) -> list[OutputItem]:
    status = _item_status(c)
    out: list[OutputItem] = []
    for b in blocks_of(c):
        if b.kind == "text":
            out.append(_text_item(new_item_id("message"), b.text, status))
        else:
            out.append(_call_item(new_item_id("function_call"), b.call_id, b.name,
                                  b.arguments, status, custom))
    return out


def finished(fields: dict[str, Any], c: Completion, output: list[OutputItem]) -> Response:
    """The whole response, once ``c`` is done."""
    cut = c.finish_reason == "length"
    return Response(**{**fields, "status": "incomplete" if cut else "completed",
                       "incomplete_details": IncompleteDetails(reason="max_output_tokens")
                       if cut else None, "output": output, "usage": usage(c),
                       "completed_at": None if cut else time.time()})


def whole(fields: dict[str, Any], c: Completion, custom: frozenset[str]) -> Response:
    return finished(fields, c, output_items(c, custom))


def assistant_turn(c: Completion) -> dict[str, Any]:
    """The reply as the library's assistant message (what a continuation reads)."""
    msg: dict[str, Any] = {"role": "assistant", "content": c.text}
    if c.tool_calls:
        msg["content"] = c.text or None
        msg["tool_calls"] = [{"id": t.id, "type": "function", "function": {
            "name": t.name, "arguments": t.arguments}} for t in c.tool_calls]
    return msg


def dumped(r: BaseModel) -> dict[str, Any]:
    out: dict[str, Any] = r.model_dump(mode="json", exclude_unset=True)
    return out


# -- the stream ------------------------------------------------------------------------------

class ResponsesSSE(BlockWire):
    """The Responses stream (see the module's docstring). ``done()`` writes everything
    but the last event: the route stores the response (:attr:`final`) first, then sends
    :meth:`finish` — so a client that reads ``response.completed`` can continue from it.

    Blank text around tool calls (the newlines between them) is no output item, as it is
    none in the whole answer (the library strips it): a text block is announced at its
    first non-blank piece, so output indexes count the items sent, not the blocks."""

    def __init__(self, fields: dict[str, Any], custom: frozenset[str]) -> None:
        super().__init__()
        self.fields = fields
        self.custom = custom
        self.seq = 0
        self.slot: dict[int, int] = {}  # block → output index, once announced
        self.ids: dict[int, str] = {}  # output index → item id
        self.parts: dict[int, list[str]] = {}  # block → its text (or arguments) so far
        self.items: dict[int, OutputItem] = {}  # output index → item
        self.completion: Completion | None = None
        self.final: Response | None = None

    def _send(self, kind: str, **fields: Any) -> bytes:
        event = StreamEvent(type=kind, sequence_number=self.seq, **fields)  # type: ignore[arg-type]
        self.seq += 1
        return sse(event.model_dump_json(exclude_unset=True), kind)

    def _response(self, status: Status, **fields: Any) -> Response:
        output = [self._so_far(o) for o in sorted(self.items)]
        return Response(**{**self.fields, "status": status, "output": output, "usage": None,
                           **fields})

    def _so_far(self, o: int) -> OutputItem:
        """Item ``o`` as it stands: one cut short by a failure is "incomplete"."""
        item = self.items[o]
        if item.status != "in_progress":
            return item
        block = next(b for b, out in self.slot.items() if out == o)
        so_far = "".join(self.parts[block])
        if isinstance(item, OutputMessage):
            return _text_item(item.id, so_far, "incomplete")
        return _call_item(item.id, item.call_id, item.name, so_far, "incomplete", self.custom)

    def begin(self) -> Iterable[bytes]:
        yield self._send("response.created", response=self._response("in_progress"))
        yield self._send("response.in_progress", response=self._response("in_progress"))

    def event(self, event: BlockEvent) -> Iterable[bytes]:
        if event.block == "text":
            yield from self._text(event, event.index)
        else:
            yield from self._call(event, event.index)

    def _announce(self, block: int, item: OutputItem) -> int:
        o = self.slot[block] = len(self.slot)
        self.ids[o] = item.id
        self.items[o] = item
        return o

    def _text(self, event: BlockEvent, b: int) -> Iterable[bytes]:
        if event.kind == "start":
            self.parts[b] = []
            return
        if event.kind == "delta":
            self.parts[b].append(event.text)
            if b in self.slot:
                o = self.slot[b]
                yield self._send("response.output_text.delta", item_id=self.ids[o],
                                 output_index=o, content_index=0, delta=event.text,
                                 logprobs=[])
            elif event.text.strip():
                yield from self._open_text(b)
            return
        text = "".join(self.parts[b])
        if b not in self.slot:
            # blank: no item where the reply has tool calls (a call follows, or came before)
            c = self.completion
            if c is None or c.tool_calls:
                return
            yield from self._open_text(b)
        o = self.slot[b]
        item = self.items[o] = _text_item(self.ids[o], text, _item_status(self.completion))
        yield self._send("response.output_text.done", item_id=item.id, output_index=o,
                         content_index=0, text=text, logprobs=[])
        yield self._send("response.content_part.done", item_id=item.id, output_index=o,
                         content_index=0, part=item.content[0])
        yield self._send("response.output_item.done", output_index=o, item=item)

    def _open_text(self, b: int) -> Iterable[bytes]:
        """A text item announced, with what its block held so far as one delta."""
        item = _text_item(new_item_id("message"), "", "in_progress")
        o = self._announce(b, item)
        yield self._send("response.output_item.added", output_index=o, item=item)
        yield self._send("response.content_part.added", item_id=item.id, output_index=o,
                         content_index=0, part=OutputText(type="output_text", text="",
                                                          annotations=[], logprobs=[]))
        text = "".join(self.parts[b])
        if text:
            yield self._send("response.output_text.delta", item_id=item.id, output_index=o,
                             content_index=0, delta=text, logprobs=[])

    def _call(self, event: BlockEvent, b: int) -> Iterable[bytes]:
        if event.kind == "start":
            self.parts[b] = []
            item = _call_item(new_item_id("function_call"), event.call_id, event.name, "",
                              "in_progress", self.custom)
            o = self._announce(b, item)
            yield self._send("response.output_item.added", output_index=o, item=item)
            return
        o = self.slot[b]
        iid = self.ids[o]
        if event.kind == "delta":
            self.parts[b].append(event.text)
            # a custom tool's input is the string inside the arguments: sent whole, at the end
            if not isinstance(self.items[o], CustomToolCall):
                yield self._send("response.function_call_arguments.delta", item_id=iid,
                                 output_index=o, delta=event.text)
            return
        item = self.items[o] = _call_item(iid, event.call_id, event.name, event.text,
                                          _item_status(self.completion), self.custom)
        if isinstance(item, CustomToolCall):
            if item.input:
                yield self._send("response.custom_tool_call_input.delta", item_id=iid,
                                 output_index=o, delta=item.input)
            yield self._send("response.custom_tool_call_input.done", item_id=iid,
                             output_index=o, input=item.input)
        else:
            yield self._send("response.function_call_arguments.done", item_id=iid,
                             output_index=o, arguments=event.text, name=event.name)
        yield self._send("response.output_item.done", output_index=o, item=item)

    def done(self, completion: Completion) -> Iterable[bytes]:
        self.completion = completion  # the last block closes knowing how the reply ended
        yield from super().done(completion)

    def end(self, completion: Completion) -> Iterable[bytes]:
        self.final = finished(self.fields, completion,
                              [self.items[o] for o in sorted(self.items)])
        return ()

    def finish(self) -> bytes:
        """The last event: ``response.completed`` (or ``response.incomplete``)."""
        assert self.final is not None
        kind = "response.incomplete" if self.final.status == "incomplete" else \
            "response.completed"
        return self._send(kind, response=self.final)

    def error(self, error: APIError) -> bytes:
        inner = StreamError(type=error.type, code=error.code, message=error.message,
                            param=error.param)
        failed = self._response("failed", error=ErrorInfo(
            code=error.code or "server_error", message=error.message))
        return self._send("error", code=error.code, message=error.message,
                          param=error.param, error=inner) + \
            self._send("response.failed", response=failed)
