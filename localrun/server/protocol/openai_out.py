"""OpenAI's answers: Chat Completions and Completions (whole, and their streams' chunks
and :class:`~localrun.server.jobs.Wire` s), Embeddings and the model list.

Shapes follow OpenAI's API reference as the official ``openai`` Python client reads them
(streamed tool-call deltas always carry ``index``; a stream with
``stream_options.include_usage`` ends with a chunk whose ``choices`` is empty). A
thinking model's thinking is ``message.reasoning_content`` (deltas' too, as vLLM and
DeepSeek write it) and ``usage.completion_tokens_details.reasoning_tokens``; log
probabilities are each choice's ``logprobs`` in the endpoint's own shape
(:func:`~localrun.types.chat_logprobs`, :func:`~localrun.types.completion_logprobs`).
A request for several choices (``n``, a list of prompts, ``echo`` streamed) streams each
choice whole as it ends, under its ``index``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from localrun import __version__
from localrun.server.errors import APIError
from localrun.server.jobs import Choices, Wire
from localrun.server.protocol.blocks import sse
from localrun.server.protocol.common import takes_only
from localrun.types import Chunk, Completion, chat_logprobs, completion_logprobs

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop"}
FINGERPRINT = f"localrun-{__version__}"

_TOP: dict[str, Any] = {"type": "object", "properties": {
    "token": {"type": "string"}, "logprob": {"type": "number"},
    "bytes": {"type": "array", "items": {"type": "integer"}}}}
#: Chat Completions' ``choices[].logprobs`` (the JSON Schema /openapi.json shows)
CHAT_LOGPROBS = {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"content": {
    "type": "array", "items": {**_TOP, "properties": {
        **_TOP["properties"], "top_logprobs": {"type": "array", "items": _TOP}}}}}}]}
#: legacy Completions' ``choices[].logprobs``
TEXT_LOGPROBS = {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
    "tokens": {"type": "array", "items": {"type": "string"}},
    "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
    "top_logprobs": {"type": "array", "items": {
        "type": ["object", "null"], "additionalProperties": {"type": "number"}}},
    "text_offset": {"type": "array", "items": {"type": "integer"}}}}]}


# -- answers -------------------------------------------------------------------------------

class TokenDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    #: a thinking model's: the thinking's share of completion_tokens
    completion_tokens_details: TokenDetails | None = None

    @classmethod
    def of(cls, c: Completion) -> Usage:
        u = c.usage
        out = cls(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                  total_tokens=u.prompt_tokens + u.completion_tokens)
        if u.reasoning_tokens or c.reasoning is not None:
            out.completion_tokens_details = TokenDetails(reasoning_tokens=u.reasoning_tokens)
        return out


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
    #: a thinking model's thinking (vLLM's and DeepSeek's field), set only where it thought
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = Field(json_schema_extra=takes_only(CHAT_LOGPROBS))
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
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: dict[str, Any] | None = Field(json_schema_extra=takes_only(CHAT_LOGPROBS))
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
    logprobs: dict[str, Any] | None = Field(json_schema_extra=takes_only(TEXT_LOGPROBS))
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


def each(c: Completion) -> tuple[Completion, ...]:
    """A reply's choices: several (:class:`~localrun.server.jobs.Choices`), or itself."""
    return c.choices if isinstance(c, Choices) else (c,)


def _message(c: Completion) -> AssistantMessage:
    calls = [ToolCallOut(id=t.id, type="function",
                         function=FunctionOut(name=t.name, arguments=t.arguments))
             for t in c.tool_calls]
    message = AssistantMessage(role="assistant", content=(c.text or None) if calls else c.text,
                               refusal=None)
    if c.reasoning is not None:
        message.reasoning_content = c.reasoning
    if calls:
        message.tool_calls = calls
    return message


def chat_completion(cid: str, model: str, c: Completion, logprobs: bool = False
                    ) -> ChatCompletion:
    """The whole answer; ``logprobs``: the request asked for them."""
    choices = [ChatChoice(index=i, message=_message(one),
                          logprobs=chat_logprobs(one.logprobs or ()) if logprobs else None,
                          finish_reason=FINISH[one.finish_reason])
               for i, one in enumerate(each(c))]
    return ChatCompletion(id=cid, object="chat.completion", created=int(time.time()),
                          model=model, system_fingerprint=FINGERPRINT, choices=choices,
                          usage=Usage.of(c))


class Echo:
    """What a Completions choice writes besides the reply: the prompt (``echo``), and
    the log probabilities in legacy Completions' shape (``logprobs``), their offsets
    counted from the prompt's start (with ``echo``) or its end. ``prompts``: the
    request's, each text or token ids, ``n`` choices each."""

    def __init__(self, prompts: Sequence[str | Sequence[int]], n: int, echo: bool,
                 logprobs: bool) -> None:
        self.prompts = prompts
        self.n = n
        self.echo = echo
        self.logprobs = logprobs

    def prompt_text(self, index: int, c: Completion) -> str:
        """Choice ``index``'s prompt as text: the text sent, or its token ids' text."""
        prompt = self.prompts[min(index // self.n, len(self.prompts) - 1)]
        if isinstance(prompt, str):
            return prompt
        return "".join(t.token for t in c.prompt_logprobs or ())

    def choice(self, index: int, c: Completion) -> TextChoice:
        """A whole choice: its text (after the prompt, with ``echo``) and log probabilities."""
        head = self.prompt_text(index, c) if self.echo else ""
        lp = None
        if self.logprobs:
            entries = (*(c.prompt_logprobs or ()), *(c.logprobs or ())) if self.echo \
                else c.logprobs or ()
            # a token-id prompt's text is not rebuilt without echo: offsets start at 0
            start = 0 if self.echo or not isinstance(self.prompts[0], str) \
                else len(self.prompt_text(index, c))
            lp = completion_logprobs(entries, text_offset=start)
        return TextChoice(index=index, text=head + c.text, logprobs=lp,
                          finish_reason=FINISH[c.finish_reason])


def text_completion(cid: str, model: str, c: Completion, echo: Echo) -> TextCompletion:
    return TextCompletion(id=cid, object="text_completion", created=int(time.time()),
                          model=model, system_fingerprint=FINGERPRINT,
                          choices=[echo.choice(i, one) for i, one in enumerate(each(c))],
                          usage=Usage.of(c))


# -- streams -------------------------------------------------------------------------------

class ChatSSE(Wire):
    """Chat Completions' server-sent events: one choice piece by piece (thinking as
    ``reasoning_content`` deltas, then the answer), or several, each whole as it ends."""

    def __init__(self, cid: str, model: str, include_usage: bool, logprobs: bool = False,
                 several: bool = False) -> None:
        self.head: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk",
                                     "created": int(time.time()), "model": model,
                                     "system_fingerprint": FINGERPRINT}
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.several = several

    def _event(self, delta: Delta, finish: str | None = None, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> bytes:
        chunk = ChatCompletionChunk(**self.head, choices=[ChunkChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish)])
        if self.include_usage:
            chunk.usage = None
        return sse(chunk.model_dump_json(exclude_unset=True))

    def begin(self) -> Iterable[bytes]:
        if not self.several:
            yield self._event(Delta(role="assistant", content=""))

    def chunk(self, chunk: Chunk) -> Iterable[bytes]:
        scored = self.logprobs and bool(chunk.logprobs)
        if not (chunk.text or chunk.reasoning or chunk.tool_calls or scored):
            return
        delta = Delta()
        if chunk.reasoning:
            delta.reasoning_content = chunk.reasoning
        if chunk.text:
            delta.content = chunk.text
        if chunk.tool_calls:
            delta.tool_calls = [ToolCallOut(**d.to_dict()) for d in chunk.tool_calls]
        yield self._event(delta, logprobs=chat_logprobs(chunk.logprobs) if scored else None)

    def choice(self, index: int, completion: Completion) -> Iterable[bytes]:
        m = _message(completion)
        delta = Delta(role="assistant", content=m.content or "")
        if m.reasoning_content is not None:
            delta.reasoning_content = m.reasoning_content
        if m.tool_calls:
            delta.tool_calls = [ToolCallOut(index=i, **t.model_dump(exclude_unset=True))
                                for i, t in enumerate(m.tool_calls)]
        lp = chat_logprobs(completion.logprobs or ()) if self.logprobs else None
        yield self._event(delta, index=index, logprobs=lp)
        yield self._event(Delta(), FINISH[completion.finish_reason], index)

    def done(self, completion: Completion) -> Iterable[bytes]:
        if not isinstance(completion, Choices):
            yield self._event(Delta(), FINISH[completion.finish_reason])
        if self.include_usage:
            yield sse(ChatCompletionChunk(**self.head, choices=[], usage=Usage.of(
                completion)).model_dump_json(exclude_unset=True))
        yield b"data: [DONE]\n\n"

    def error(self, error: APIError) -> bytes:
        return sse(_json(error.openai_body()))


class TextSSE(Wire):
    """Completions' server-sent events: one choice piece by piece, or several (and an
    echoed prompt, whose log probabilities come with its end), each whole as it ends."""

    def __init__(self, cid: str, model: str, include_usage: bool, echo: Echo) -> None:
        self.head: dict[str, Any] = {"id": cid, "object": "text_completion",
                                     "created": int(time.time()), "model": model,
                                     "system_fingerprint": FINGERPRINT}
        self.include_usage = include_usage
        self.echo = echo
        prompt = echo.prompts[0]
        # the next token's offset: after the prompt's text (a token-id prompt's: 0)
        self.offset = len(prompt) if isinstance(prompt, str) else 0

    def _send(self, choice: TextChoice) -> bytes:
        chunk = TextCompletion(**self.head, choices=[choice])
        if self.include_usage:
            chunk.usage = None
        return sse(chunk.model_dump_json(exclude_unset=True))

    def chunk(self, chunk: Chunk) -> Iterable[bytes]:
        scored = self.echo.logprobs and bool(chunk.logprobs)
        if not (chunk.text or scored):
            return
        lp = None
        if scored:
            lp = completion_logprobs(chunk.logprobs, text_offset=self.offset)
            self.offset += sum(len(t.token) for t in chunk.logprobs)
        yield self._send(TextChoice(index=0, text=chunk.text, logprobs=lp, finish_reason=None))

    def choice(self, index: int, completion: Completion) -> Iterable[bytes]:
        yield self._send(self.echo.choice(index, completion))

    def done(self, completion: Completion) -> Iterable[bytes]:
        if not isinstance(completion, Choices):
            yield self._send(TextChoice(index=0, text="", logprobs=None,
                                        finish_reason=FINISH[completion.finish_reason]))
        if self.include_usage:
            yield sse(TextCompletion(**self.head, choices=[], usage=Usage.of(
                completion)).model_dump_json(exclude_unset=True))
        yield b"data: [DONE]\n\n"

    def error(self, error: APIError) -> bytes:
        return sse(_json(error.openai_body()))


def _json(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False)
