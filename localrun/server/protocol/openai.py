"""OpenAI's shapes: Chat Completions, Completions, Embeddings and the model list — the
requests (checked, then translated into a :class:`~.common.Generation`), the answers,
the stream's chunks, and the streams' :class:`~localrun.server.jobs.Wire` s.

Shapes follow OpenAI's API reference as the official ``openai`` Python client reads them
(streamed tool-call deltas always carry ``index``; a stream with
``stream_options.include_usage`` ends with a chunk whose ``choices`` is empty).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from localrun import __version__
from localrun.server.errors import APIError, bad_request, unsupported
from localrun.server.jobs import Wire
from localrun.server.protocol.blocks import sse
from localrun.server.protocol.common import (
    Generation,
    Int,
    Passed,
    Shape,
    invalid,
    refused,
    takes_only,
)
from localrun.types import Chunk, Completion

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop"}
FINGERPRINT = f"localrun-{__version__}"
LOGPROBS_LATER = "log probabilities are not available from every engine"
PENALTY = "use repetition_penalty (localrun's, the same on every engine)"
#: what a prompt or an embedding input takes (token arrays are refused, saying so)
TEXT = {"type": "string", "minLength": 1}
TEXT_INPUT = {"anyOf": [TEXT, {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 1}]}
TEXT_INPUTS = {"anyOf": [TEXT, {"type": "array", "items": TEXT, "minItems": 1}]}


# -- requests ------------------------------------------------------------------------------

class StreamOptions(Shape):
    include_usage: bool | None = None


class FunctionCall(Passed):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallParam(Passed):
    """A tool call of an earlier assistant turn, sent back."""

    id: str | None = None
    type: str | None = None
    function: FunctionCall


class ContentPart(Shape):
    """A part of a message's content: text parts only (localrun's engines take text)."""

    type: str = Field(json_schema_extra=takes_only({"const": "text"}))
    text: str | None = Field(default=None, json_schema_extra=takes_only({"type": "string"}))

    def refuse(self) -> None:
        if self.type != "text":
            raise refused("", f"content parts of type {self.type!r} (only text parts are "
                          "supported: localrun's engines take text)")
        if self.text is None:
            raise invalid("a text part needs 'text' (a string)", "text")
        super().refuse()


class ChatMessage(Shape):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    refusal: str | None = None

    REFUSED: ClassVar = {"refusal": (None, "a refusal cannot be sent back")}

    def refuse(self) -> None:
        super().refuse()
        if self.content is None and not self.tool_calls:
            raise invalid("'content' is missing (only an assistant turn with tool_calls may "
                          "omit it)", "content")

    def to_library(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text or "" for p in content)
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content}
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            value = getattr(self, key)
            if value is not None:
                msg[key] = value
        return msg


class FunctionDef(Passed):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(Passed):
    type: str = "function"
    function: FunctionDef | None = None


class NamedFunction(Passed):
    name: str


class ToolChoiceParam(Passed):
    type: str = "function"
    function: NamedFunction | None = None


class JSONSchemaSpec(Passed):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Passed):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")


class Sampled(Shape):
    """The fields Chat Completions and Completions share."""

    model: str
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Int | None = None
    logit_bias: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    store: bool | None = None
    service_tier: str | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None

    #: OpenAI's bookkeeping, as ``user`` and ``metadata``: accepted, no effect
    IGNORED: ClassVar = ("prompt_cache_key", "safety_identifier")
    REFUSED: ClassVar = {
        "n": (1, "localrun returns one choice per request (send n=1 or leave it out)"),
        "logit_bias": ({}, "logit bias is not implemented"),
        "frequency_penalty": (0, PENALTY), "presence_penalty": (0, PENALTY),
        "store": (False, "localrun keeps no record of requests")}

    def refuse(self) -> None:
        super().refuse()
        if self.service_tier not in (None, "auto", "default"):
            raise refused("service_tier", "localrun has one tier: send auto or default")
        if self.stream_options is not None and not self.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true",
                          "stream_options")

    def sampling(self, max_tokens: int | None = None) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        out = {"max_tokens": self.max_tokens if max_tokens is None else max_tokens,
               "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
               "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
               "seed": self.seed, "stop": tuple(s for s in stop if s) or None}
        return {k: v for k, v in out.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(Sampled):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[ToolParam] | None = None
    tool_choice: str | ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    reasoning_effort: str | None = None

    REFUSED: ClassVar = {
        **Sampled.REFUSED,
        "logprobs": (False, LOGPROBS_LATER), "top_logprobs": (0, LOGPROBS_LATER),
        "parallel_tool_calls": (True, "false is not enforced: localrun lets a model make "
                                "several calls in one turn"),
        "reasoning_effort": (None, "reasoning is not separated from the reply yet")}

    def generation(self) -> Generation:
        legacy, new = self.max_tokens, self.max_completion_tokens
        if legacy is not None and new is not None and legacy != new:
            raise bad_request("Both 'max_tokens' and 'max_completion_tokens' are set, to "
                              f"{legacy} and {new}: send one", "max_tokens")
        structured: dict[str, Any] = {}
        if self.response_format is not None and self.response_format.type != "text":
            structured["response_format"] = self.response_format.model_dump(
                by_alias=True, exclude_none=True)
        if self.tools:
            structured["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.tool_choice is not None:
            structured["tool_choice"] = self.tool_choice if isinstance(
                self.tool_choice, str) else self.tool_choice.model_dump(exclude_none=True)
        return Generation(self.model, messages=[m.to_library() for m in self.messages],
                          sampling=self.sampling(new if new is not None else legacy),
                          structured=structured, stream=bool(self.stream)).check()


class CompletionRequest(Sampled):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[Int] | list[list[Int]] = Field(
        json_schema_extra=takes_only(TEXT_INPUT))
    echo: bool | None = None
    best_of: Int | None = None
    suffix: str | None = None
    logprobs: Int | None = None

    REFUSED: ClassVar = {
        **Sampled.REFUSED, "logprobs": (0, LOGPROBS_LATER),
        "echo": (False, "the prompt is not echoed back"),
        "best_of": (1, "localrun returns one choice per request"),
        "suffix": ("", "fill-in-the-middle is not implemented")}

    def generation(self) -> Generation:
        return Generation(self.model, prompt=_prompt(self.prompt), sampling=self.sampling(),
                          stream=bool(self.stream)).check()


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


class EmbeddingRequest(Shape):
    """``POST /v1/embeddings``."""

    model: str
    input: str | list[str] | list[Int] | list[list[Int]] = Field(
        json_schema_extra=takes_only(TEXT_INPUTS))
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Int | None = Field(default=None, ge=1)
    user: str | None = None


# -- answers -------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, c: Completion) -> Usage:
        u = c.usage
        return cls(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                   total_tokens=u.prompt_tokens + u.completion_tokens)


class FunctionOut(BaseModel):
    name: str | None = None
    arguments: str


class ToolCallOut(BaseModel):
    index: int | None = None  # streamed deltas only
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: str


class ChatCompletion(BaseModel):
    """A whole Chat Completions answer."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One event of a Chat Completions stream (``data: {...}``; the last is ``[DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class TextCompletion(BaseModel):
    """A Completions answer, and one event of its stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[TextChoice]
    usage: Usage | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelEntry(BaseModel):
    """A model: loaded ones say how (``contexts``: every context a copy is loaded at)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelEntry]


def chat_completion(cid: str, model: str, c: Completion) -> ChatCompletion:
    calls = [ToolCallOut(id=t.id, type="function",
                         function=FunctionOut(name=t.name, arguments=t.arguments))
             for t in c.tool_calls]
    message = AssistantMessage(role="assistant", content=(c.text or None) if calls else c.text,
                               refusal=None)
    if calls:
        message.tool_calls = calls
    return ChatCompletion(id=cid, object="chat.completion", created=int(time.time()),
                          model=model, system_fingerprint=FINGERPRINT,
                          choices=[ChatChoice(index=0, message=message, logprobs=None,
                                              finish_reason=FINISH[c.finish_reason])],
                          usage=Usage.of(c))


def text_completion(cid: str, model: str, c: Completion) -> TextCompletion:
    return TextCompletion(id=cid, object="text_completion", created=int(time.time()),
                          model=model, system_fingerprint=FINGERPRINT,
                          choices=[TextChoice(index=0, text=c.text, logprobs=None,
                                              finish_reason=FINISH[c.finish_reason])],
                          usage=Usage.of(c))


# -- streams -------------------------------------------------------------------------------

class ChatSSE(Wire):
    """Chat Completions' server-sent events for one choice."""

    def __init__(self, cid: str, model: str, include_usage: bool) -> None:
        self.head: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk",
                                     "created": int(time.time()), "model": model,
                                     "system_fingerprint": FINGERPRINT}
        self.include_usage = include_usage

    def _event(self, delta: Delta, finish: str | None = None) -> bytes:
        chunk = ChatCompletionChunk(**self.head, choices=[ChunkChoice(
            index=0, delta=delta, logprobs=None, finish_reason=finish)])
        if self.include_usage:
            chunk.usage = None
        return sse(chunk.model_dump_json(exclude_unset=True))

    def begin(self) -> Iterable[bytes]:
        yield self._event(Delta(role="assistant", content=""))

    def chunk(self, chunk: Chunk) -> Iterable[bytes]:
        if not chunk.text and not chunk.tool_calls:
            return
        delta = Delta()
        if chunk.text:
            delta.content = chunk.text
        if chunk.tool_calls:
            delta.tool_calls = [ToolCallOut(**d.to_dict()) for d in chunk.tool_calls]
        yield self._event(delta)

    def done(self, completion: Completion) -> Iterable[bytes]:
        yield self._event(Delta(), FINISH[completion.finish_reason])
        if self.include_usage:
            yield sse(ChatCompletionChunk(**self.head, choices=[], usage=Usage.of(
                completion)).model_dump_json(exclude_unset=True))
        yield b"data: [DONE]\n\n"

    def error(self, error: APIError) -> bytes:
        return sse(_json(error.openai_body()))


class TextSSE(Wire):
    """Completions' server-sent events for one choice."""

    def __init__(self, cid: str, model: str, include_usage: bool) -> None:
        self.head: dict[str, Any] = {"id": cid, "object": "text_completion",
                                     "created": int(time.time()), "model": model,
                                     "system_fingerprint": FINGERPRINT}
        self.include_usage = include_usage

    def _event(self, text: str, finish: str | None = None) -> bytes:
        chunk = TextCompletion(**self.head, choices=[TextChoice(
            index=0, text=text, logprobs=None, finish_reason=finish)])
        if self.include_usage:
            chunk.usage = None
        return sse(chunk.model_dump_json(exclude_unset=True))

    def chunk(self, chunk: Chunk) -> Iterable[bytes]:
        if chunk.text:
            yield self._event(chunk.text)

    def done(self, completion: Completion) -> Iterable[bytes]:
        yield self._event("", FINISH[completion.finish_reason])
        if self.include_usage:
            yield sse(TextCompletion(**self.head, choices=[], usage=Usage.of(
                completion)).model_dump_json(exclude_unset=True))
        yield b"data: [DONE]\n\n"

    def error(self, error: APIError) -> bytes:
        return sse(_json(error.openai_body()))


def _json(data: Any) -> str:
    import json

    return json.dumps(data, ensure_ascii=False)
