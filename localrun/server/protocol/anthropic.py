"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens`` —
the requests (checked, then translated into a :class:`~.common.Generation`), the answer,
and the stream (:class:`MessagesSSE`, over the shared :class:`~.blocks.Blocks`).

Supported: ``system`` (a string or text blocks), text, ``tool_use`` and ``tool_result``
content blocks, custom ``tools`` with an ``input_schema``, ``tool_choice`` (auto, any,
tool, none), ``stop_sequences``, ``max_tokens``, ``temperature``/``top_p``/``top_k``,
``output_config.format`` (a JSON Schema the reply follows), ``stream`` with Anthropic's
event sequence, ``tool_choice.disable_parallel_tool_use`` (at most one call).

Thinking (a model whose chat template thinks): ``thinking: {"type": "enabled",
"budget_tokens": N}`` is a hard budget of N tokens (any N >= 0; Anthropic's minimum of
1,024 is its models', not localrun's), ``{"type": "adaptive"}`` (and ``between_tools``)
lets the model think as its template does, ``output_config.effort`` is an effort level
(``xhigh`` and ``max`` are ``high``: no budget), ``{"type": "disabled"}`` switches it off
— and so does leaving ``thinking`` out, as Claude clients expect no thinking blocks
unless they ask. The reply's thinking is a ``thinking`` block before the rest, streamed
as ``thinking_delta`` s and closed by a ``signature_delta``; its ``signature`` is an
HMAC-SHA256 of the thinking under a secret this server process draws at start, opaque to
clients. Thinking blocks sent back in an assistant turn go to the chat template (which
shows or drops them, as the model's own does); their signatures are not checked.

Image blocks (a base64 source, or a url one where the server fetches them) go to the
model with the text around them (:mod:`.images`). Refused with a 400 that says so:
documents, server tools (web search, code execution, ...), redacted thinking.
``cache_control`` marks and ``metadata`` are accepted and change nothing (the engines
reuse a prompt's cached cells by themselves).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from localrun.server.errors import APIError
from localrun.server.protocol.blocks import Block, BlockEvent, BlockWire, blocks_of, sse
from localrun.server.protocol.common import (
    Generation,
    Int,
    Passed,
    Shape,
    invalid,
    never,
    refused,
)
from localrun.server.protocol.images import AnthropicImageBlock
from localrun.types import Completion

NAMES = {"stop": "stop_sequences", "response_format": "output_config.format",
         "thinking_budget": "thinking.budget_tokens", "think": "thinking",
         "reasoning_effort": "output_config.effort", "parallel_tool_calls":
         "tool_choice.disable_parallel_tool_use"}
BLOCK_REASONS = {
    "image": "images in a tool result are not taken: send them in the user turn's content",
    "document": "documents are not supported yet: send their text in a "
    "text block", "redacted_thinking": "redacted thinking is encrypted by the server that "
    "wrote it and localrun cannot read it: leave the block out"}
#: Anthropic's effort levels as localrun's (above "high": no budget, as "high")
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
#: the secret the thinking blocks' signatures are keyed with, one per server process
_SECRET = secrets.token_bytes(32)


def signature(thinking: str) -> str:
    """A thinking block's ``signature``: HMAC-SHA256 of its text under this process's
    secret, base64 (opaque to clients, as Anthropic's)."""
    digest = hmac.new(_SECRET, thinking.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


# -- requests ------------------------------------------------------------------------------

class OtherBlock(Shape):
    """A content block of a type localrun does not take (document, redacted thinking, ...):
    refused, saying why."""

    model_config = ConfigDict(json_schema_extra=never)
    type: str

    def refuse(self) -> None:
        raise refused("", BLOCK_REASONS.get(self.type, f"content blocks of type {self.type!r} "
                                            "(localrun takes text, tool_use and tool_result "
                                            "blocks)"))


class TextBlockParam(Shape):
    type: Literal["text"]
    text: str

    IGNORED: ClassVar = ("cache_control", "citations")


def _text_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text" if kind == "text" else "other"


ResultBlockParam = Annotated[Annotated[TextBlockParam, Tag("text")]
                             | Annotated[OtherBlock, Tag("other")], Discriminator(_text_tag)]


class ToolUseBlockParam(Shape):
    """A tool call of an earlier assistant turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]

    IGNORED: ClassVar = ("cache_control", "caller")


class ToolResultBlockParam(Shape):
    """What a tool call returned, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultBlockParam] | None = None
    is_error: bool | None = None

    IGNORED: ClassVar = ("cache_control",)

    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(b.text for b in content if isinstance(b, TextBlockParam))
        text = content or ""
        return f"Error: {text}" if self.is_error else text


class ThinkingBlockParam(Shape):
    """An earlier reply's thinking, sent back in its assistant turn (its signature as
    it came; localrun does not check it)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None

    IGNORED: ClassVar = ("cache_control",)


def _block_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("text", "tool_use", "tool_result", "thinking", "image") \
        else "other"


ContentBlockParam = Annotated[
    Annotated[TextBlockParam, Tag("text")] | Annotated[ToolUseBlockParam, Tag("tool_use")]
    | Annotated[AnthropicImageBlock, Tag("image")]
    | Annotated[ToolResultBlockParam, Tag("tool_result")]
    | Annotated[ThinkingBlockParam, Tag("thinking")] | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_tag)]


class MessageParam(Shape):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlockParam]

    def refuse(self) -> None:
        super().refuse()
        if isinstance(self.content, list):
            for i, block in enumerate(self.content):
                if isinstance(block, ToolUseBlockParam) and self.role != "assistant":
                    raise invalid("a tool_use block belongs to an assistant turn",
                                  f"content[{i}]")
                if isinstance(block, ToolResultBlockParam) and self.role != "user":
                    raise invalid("a tool_result block belongs to a user turn",
                                  f"content[{i}]")
                if isinstance(block, ThinkingBlockParam) and self.role != "assistant":
                    raise invalid("a thinking block belongs to an assistant turn",
                                  f"content[{i}]")

    def to_library(self) -> list[dict[str, Any]]:
        """The turn as the library's messages: a user turn's tool results are tool
        messages (before its text); an assistant turn's tool_use blocks its tool_calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        texts = [b.text for b in self.content if isinstance(b, TextBlockParam)]
        out: list[dict[str, Any]] = []
        if self.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                for b in self.content if isinstance(b, ToolUseBlockParam)]
            msg: dict[str, Any] = {"role": "assistant",
                                   "content": "\n".join(texts) if texts or not calls else None}
            if calls:
                msg["tool_calls"] = calls
            thought = [b.thinking for b in self.content if isinstance(b, ThinkingBlockParam)]
            if thought:
                msg["reasoning_content"] = "\n".join(thought)
            return [msg]
        for b in self.content:
            if isinstance(b, ToolResultBlockParam):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        if any(isinstance(b, AnthropicImageBlock) for b in self.content):  # in block order
            out.append({"role": self.role, "content": [
                b.to_library() if isinstance(b, AnthropicImageBlock) else
                {"type": "text", "text": b.text} for b in self.content
                if isinstance(b, (AnthropicImageBlock, TextBlockParam))]})
        elif texts or not out:
            out.append({"role": self.role, "content": "\n".join(texts)})
        return out


class AnthropicTool(Shape):
    """A custom tool: its arguments follow ``input_schema`` (a JSON Schema)."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None

    IGNORED: ClassVar = ("cache_control", "strict", "eager_input_streaming")

    def refuse(self) -> None:
        if self.type not in (None, "custom"):
            raise refused("", f"server tools ({self.type}) are not run by localrun: send "
                          "custom tools, each with a name and an input_schema")
        if self.input_schema is None:
            raise invalid("a tool needs 'input_schema' (a JSON Schema of its input)",
                          "input_schema")
        super().refuse()

    def to_library(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class AnthropicToolChoice(Shape):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def refuse(self) -> None:
        super().refuse()
        if self.type == "tool" and not self.name:
            raise invalid("tool_choice of type 'tool' needs the tool's 'name'", "name")

    def to_library(self) -> str:
        return {"auto": "auto", "any": "required", "none": "none"}.get(self.type) \
            or self.name or ""


class ThinkingParam(Shape):
    """``thinking``: enabled (with a budget), adaptive or between_tools (as the template
    thinks), disabled."""

    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: Int | None = Field(default=None, ge=0)
    display: Literal["summarized", "omitted"] | None = None

    def refuse(self) -> None:
        super().refuse()
        if self.type == "enabled" and self.budget_tokens is None:
            raise invalid("thinking of type 'enabled' needs 'budget_tokens' (the most tokens "
                          "of thinking, e.g. 1024)", "budget_tokens")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise invalid(f"'budget_tokens' goes with thinking of type 'enabled', not "
                          f"{self.type!r}", "budget_tokens")


class OutputFormat(Passed):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Shape):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensRequest(Shape):
    """``POST /v1/messages/count_tokens``: a conversation, counted as the model's chat
    template renders it (with its tools)."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None

    IGNORED: ClassVar = ("cache_control",)

    def conversation(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        system = self.system if isinstance(self.system, str) or self.system is None else \
            "\n".join(b.text for b in self.system)
        if system:
            out.append({"role": "system", "content": system})
        for m in self.messages:
            out += m.to_library()
        return out

    def structured(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            out["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt.schema_}}
        if self.tools:
            out["tools"] = [t.to_library() for t in self.tools]
        # Anthropic's auto and none need no tools; the library's "auto" would
        if self.tool_choice is not None and (self.tools or self.tool_choice.type in (
                "any", "tool")):
            out["tool_choice"] = self.tool_choice.to_library()
            if self.tool_choice.disable_parallel_tool_use and self.tools:
                out["parallel_tool_calls"] = False
        return out

    def reasoning(self) -> dict[str, Any]:
        """The thinking options: off unless ``thinking`` asks (Claude clients expect no
        thinking blocks otherwise), a budget, an effort level."""
        t = self.thinking
        effort = self.output_config.effort if self.output_config is not None else None
        if t is None or t.type == "disabled":
            return {"think": False}
        if t.budget_tokens is not None:  # a budget of 0: no thinking
            return {"thinking_budget": t.budget_tokens}
        if effort is not None:
            return {"reasoning_effort": EFFORTS[effort]}
        return {"think": True}

    @property
    def omitted(self) -> bool:
        """``thinking.display`` "omitted": thinking blocks carry no text, only a signature."""
        return self.thinking is not None and self.thinking.display == "omitted"


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: Int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    def generation(self) -> Generation:
        sampling: dict[str, Any] = {"max_tokens": self.max_tokens}
        for key in ("temperature", "top_p", "top_k"):
            if getattr(self, key) is not None:
                sampling[key] = getattr(self, key)
        stops = tuple(s for s in self.stop_sequences or () if s)
        if stops:
            sampling["stop"] = stops
        return Generation(self.model, messages=self.conversation(), sampling=sampling,
                          structured=self.structured(), reasoning=self.reasoning(),
                          stream=bool(self.stream), names=NAMES).check()


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


# -- answers -------------------------------------------------------------------------------

class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: Any


class ThinkingBlock(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str


OutBlock = TextBlock | ThinkingBlock | ToolUseBlock


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class Message(BaseModel):
    """A whole Messages answer (``message_start`` carries one with no content yet)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[OutBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


class TextDelta(BaseModel):
    type: Literal["text_delta"]
    text: str


class InputJSONDelta(BaseModel):
    type: Literal["input_json_delta"]
    partial_json: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"]
    thinking: str


class SignatureDelta(BaseModel):
    type: Literal["signature_delta"]
    signature: str


class StopDelta(BaseModel):
    stop_reason: str | None
    stop_sequence: str | None


class ErrorBody(BaseModel):
    type: str
    message: str


class StreamEvent(BaseModel):
    """One event of a Messages stream (``event: TYPE`` then ``data: {...}``)."""

    type: Literal["message_start", "content_block_start", "content_block_delta",
                  "content_block_stop", "message_delta", "message_stop", "ping", "error"]
    message: Message | None = None
    index: int | None = None
    content_block: OutBlock | None = None
    delta: TextDelta | InputJSONDelta | ThinkingDelta | SignatureDelta | StopDelta | None = None
    usage: MessageUsage | None = None
    error: ErrorBody | None = None


def stop_reason(c: Completion, stop_sequence: str | None) -> StopReason:
    if c.finish_reason == "length":
        return "max_tokens"
    if c.finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if stop_sequence else "end_turn"


def _block(b: Block, omitted: bool = False) -> OutBlock:
    if b.kind == "text":
        return TextBlock(type="text", text=b.text)
    if b.kind == "thinking":
        return ThinkingBlock(type="thinking", thinking="" if omitted else b.text,
                             signature=signature(b.text))
    return ToolUseBlock(type="tool_use", id=b.call_id, name=b.name, input=b.input)


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def message(mid: str, model: str, c: Completion, stop_sequence: str | None,
            omitted: bool = False) -> Message:
    """The whole answer (``omitted``: thinking blocks without their text)."""
    return Message(id=mid, type="message", role="assistant", model=model,
                   content=[_block(b, omitted) for b in blocks_of(c, reasoning=True)],
                   stop_reason=stop_reason(c, stop_sequence),
                   stop_sequence=stop_sequence if c.finish_reason == "stop" else None,
                   usage=MessageUsage(input_tokens=c.usage.prompt_tokens,
                                      output_tokens=c.usage.completion_tokens))


class MessagesSSE(BlockWire):
    """Anthropic's stream: ``message_start``, a ``ping``, then per block
    ``content_block_start``/``_delta``/``_stop`` (``thinking_delta`` s and a
    ``signature_delta``, text deltas, or a tool call's ``input_json_delta`` fragments),
    ``message_delta`` (stop reason, usage), ``message_stop``; an ``error`` event when it
    fails after it began. ``omitted``: thinking blocks carry no text deltas."""

    def __init__(self, job: Any, mid: str, model: str, omitted: bool = False) -> None:
        super().__init__(reasoning=True)
        self.job = job
        self.mid = mid
        self.model = model
        self.omitted = omitted

    def _send(self, **fields: Any) -> bytes:
        event = StreamEvent(**fields)
        return sse(event.model_dump_json(exclude_unset=True), fields["type"])

    def begin(self) -> Iterable[bytes]:
        stream = self.job.stream
        prompt = getattr(stream, "prompt_tokens", None) or 0
        start = Message(id=self.mid, type="message", role="assistant", model=self.model,
                        content=[], stop_reason=None, stop_sequence=None,
                        usage=MessageUsage(input_tokens=prompt, output_tokens=0))
        yield self._send(type="message_start", message=start)
        yield self._send(type="ping")

    def event(self, event: BlockEvent) -> Iterable[bytes]:
        if event.kind == "start":
            block: OutBlock = TextBlock(type="text", text="")
            if event.block == "thinking":
                block = ThinkingBlock(type="thinking", thinking="", signature="")
            elif event.block == "tool_call":
                block = ToolUseBlock(type="tool_use", id=event.call_id, name=event.name,
                                     input={})
            yield self._send(type="content_block_start", index=event.index, content_block=block)
        elif event.kind == "delta":
            delta: TextDelta | InputJSONDelta | ThinkingDelta = \
                TextDelta(type="text_delta", text=event.text)
            if event.block == "thinking":
                if self.omitted:
                    return
                delta = ThinkingDelta(type="thinking_delta", thinking=event.text)
            elif event.block == "tool_call":
                delta = InputJSONDelta(type="input_json_delta", partial_json=event.text)
            yield self._send(type="content_block_delta", index=event.index, delta=delta)
        else:
            if event.block == "thinking":
                yield self._send(type="content_block_delta", index=event.index,
                                 delta=SignatureDelta(type="signature_delta",
                                                      signature=signature(event.text)))
            yield self._send(type="content_block_stop", index=event.index)

    def end(self, completion: Completion) -> Iterable[bytes]:
        stop = getattr(self.job.stream, "stop_sequence", None)
        usage = MessageUsage(input_tokens=completion.usage.prompt_tokens,
                             output_tokens=completion.usage.completion_tokens)
        yield self._send(type="message_delta", delta=StopDelta(
            stop_reason=stop_reason(completion, stop),
            stop_sequence=stop if completion.finish_reason == "stop" else None), usage=usage)
        yield self._send(type="message_stop")

    def error(self, error: APIError) -> bytes:
        body = error.anthropic_body()
        return sse(json.dumps(body, ensure_ascii=False), "error")
