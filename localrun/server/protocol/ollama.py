"""Ollama's shapes: /api/chat, /api/generate, /api/embed, /api/embeddings, /api/show,
/api/pull — the requests, their translation into a :class:`~.common.Generation`, the
answers and the NDJSON stream (:class:`NDJSON`).

Ollama's names map to localrun's: ``num_predict`` → max_tokens, ``repeat_penalty`` →
repetition_penalty, ``num_ctx`` → the context the model is loaded with, ``format``
("json" or a JSON Schema) → structured output, ``keep_alive`` → how long the model stays
loaded after this request, ``think`` (true/false, or "low"/"medium"/"high": an effort
level) → the thinking switch. A thinking model's thinking is ``message.thinking``
(``thinking`` on /api/generate), streamed in lines whose content is ""; an earlier
turn's ``thinking`` goes back to the chat template. ``logprobs``/``top_logprobs`` give
each line's tokens with their log probabilities. Options localrun cannot honour are
refused with 400, never dropped. ``stream`` defaults to true, as in Ollama.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from localrun.server.config import parse_duration
from localrun.server.errors import APIError, bad_request
from localrun.server.jobs import Wire
from localrun.server.protocol.common import (
    Generation,
    Int,
    Passed,
    Shape,
    invalid,
    takes_only,
)
from localrun.server.protocol.images import ollama_images
from localrun.server.protocol.openai import TEXT, TEXT_INPUTS, ToolParam
from localrun.structured.calls import new_call_id
from localrun.types import Chunk, Completion, TokenLogprob, chat_logprobs

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
#: the library's sampling names → Ollama's (errors name the field the client sent)
NAMES = {"max_tokens": "options.num_predict", "temperature": "options.temperature",
         "top_p": "options.top_p", "top_k": "options.top_k", "min_p": "options.min_p",
         "repetition_penalty": "options.repeat_penalty", "seed": "options.seed",
         "stop": "options.stop", "response_format": "format", "think": "think",
         "reasoning_effort": "think"}
FINISH = {"stop": "stop", "length": "length", "tool_calls": "stop", "cancelled": "stop"}
#: Ollama's think levels (localrun's reasoning_effort names them alike)
THINK_LEVELS = ("low", "medium", "high")


# -- requests ------------------------------------------------------------------------------

class Options(Shape):
    num_predict: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    num_ctx: Int | None = Field(default=None, ge=16)

    UNKNOWN: ClassVar = UNSUPPORTED_OPTIONS

    def sampling(self) -> tuple[dict[str, Any], bool]:
        """(sampling kwargs, fill): ``num_predict`` < 0 means "until the context is
        full", resolved once the model (and its context) is known."""
        fill = self.num_predict is not None and self.num_predict < 0
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        out = {"max_tokens": None if fill else self.num_predict,
               "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
               "min_p": self.min_p, "repetition_penalty": self.repeat_penalty,
               "seed": self.seed, "stop": tuple(s for s in stop if s) or None}
        return {k: v for k, v in out.items() if v is not None}, fill


class OllamaFunctionCall(Passed):
    name: str
    arguments: dict[str, Any] | str | None = None


class OllamaToolCall(Passed):
    id: str | None = None
    function: OllamaFunctionCall


class OllamaMessage(Shape):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = None
    thinking: str | None = None  # an earlier reply's thinking: to the template, which may show it
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class Generating(Shape):
    """What /api/chat and /api/generate share."""

    model: str
    options: Options | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: str | float | None = None
    stream: bool | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None

    def refuse(self) -> None:
        super().refuse()
        if isinstance(self.think, str) and self.think not in THINK_LEVELS:
            raise invalid(f"think={self.think!r}: send true, false, or an effort level "
                          f"({', '.join(THINK_LEVELS)})", "think")

    def thinking(self) -> dict[str, Any]:
        """``think`` as the library's options: the switch, or an effort level."""
        if self.think is None:
            return {}
        if isinstance(self.think, str):
            return {"reasoning_effort": self.think}
        return {"think": self.think}

    def scored(self) -> dict[str, Any]:
        """``logprobs``/``top_logprobs`` as sampling options."""
        out = {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs}
        return {k: v for k, v in out.items() if v is not None}

    def held(self) -> dict[str, Any]:
        """How the model is held: its context, its keep-alive."""
        opts = self.options or Options()
        return {"context": opts.num_ctx, "keep_alive": keep_alive(self.keep_alive)}

    def response_format(self) -> dict[str, Any] | None:
        value = self.format
        if value in (None, ""):
            return None
        if value == "json":
            return {"type": "json_object"}
        if isinstance(value, dict):
            return {"type": "json_schema", "json_schema": {"name": "response", "schema": value}}
        raise bad_request(f"Invalid 'format': {json.dumps(value)[:60]} (\"json\" or a JSON "
                          "Schema object)", "format")


class ChatRequest(Generating):
    """``POST /api/chat`` (no messages, or none at all, loads the model, or unloads it
    with ``keep_alive`` 0, as ``/api/generate`` with no prompt does)."""

    messages: list[OllamaMessage] | None = None
    tools: list[ToolParam] | None = None

    def generation(self) -> Generation:
        if not self.messages:
            raise bad_request("Missing required parameter 'messages'", "messages")
        sampling, fill = (self.options or Options()).sampling()
        structured: dict[str, Any] = {}
        fmt = self.response_format()
        if fmt is not None:
            structured["response_format"] = fmt
        if self.tools:
            structured["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        return Generation(self.model, messages=_messages(self.messages),
                          sampling={**sampling, **self.scored()}, structured=structured,
                          reasoning=self.thinking(), stream=self.stream is not False,
                          fill=fill, names=NAMES, **self.held()).check()


class GenerateRequest(Generating):
    """``POST /api/generate`` (an empty prompt loads the model, or unloads it with
    ``keep_alive`` 0)."""

    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[Int] | None = None
    images: list[str] | None = None

    REFUSED: ClassVar = {**Generating.REFUSED,
                         "suffix": ("", "fill-in-the-middle is not implemented"),
                         "template": ("", "localrun renders the model's own chat template"),
                         "context": ([], "send the conversation to /api/chat instead")}

    def generation(self) -> Generation:
        if self.raw and self.images:
            raise bad_request("images need the chat template: leave raw out", "images")
        if self.raw and self.system:
            raise bad_request("'system' has no meaning with raw=true", "system")
        if self.raw and self.think not in (None, False):
            raise bad_request(f"think={json.dumps(self.think)} with raw=true: a raw prompt has "
                              "no chat template to think in (leave think out, or drop raw)",
                              "think")
        sampling, fill = (self.options or Options()).sampling()
        fmt = self.response_format()
        structured = {"response_format": fmt} if fmt is not None else {}
        common: dict[str, Any] = {"sampling": {**sampling, **self.scored()},
                                  "structured": structured,
                                  "stream": self.stream is not False, "fill": fill,
                                  "names": NAMES, **self.held()}
        if self.raw:
            return Generation(self.model, prompt=self.prompt or "", **common).check()
        common["reasoning"] = self.thinking()
        user: dict[str, Any] = {"role": "user", "content": self.prompt or ""}
        if self.images:
            user["images"] = ollama_images(self.images)
        messages = ([{"role": "system", "content": self.system}] if self.system else []) \
            + [user]
        return Generation(self.model, messages=messages, **common).check()


class EmbedOptions(Shape):
    num_ctx: Int | None = Field(default=None, ge=16)


class EmbedRequest(Shape):
    """``POST /api/embed``."""

    model: str
    input: str | list[str] | list[Int] | list[list[Int]] = Field(
        json_schema_extra=takes_only(TEXT_INPUTS))
    truncate: bool | None = None
    dimensions: Int | None = Field(default=None, ge=1)
    options: EmbedOptions | None = None
    keep_alive: str | float | None = None


class EmbeddingsRequest(Shape):
    """``POST /api/embeddings`` (Ollama's older embedding route: one prompt)."""

    model: str
    prompt: str = Field(json_schema_extra=takes_only(TEXT))
    keep_alive: str | float | None = None
    options: dict[str, Any] | None = None

    REFUSED: ClassVar = {"options": ({}, "send options to /api/embed")}


class ShowRequest(Shape):
    """``POST /api/show``."""

    model: str
    verbose: bool | None = None


class PullRequest(Shape):
    """``POST /api/pull`` (``name`` is the older spelling of ``model``)."""

    model: str | None = None
    name: str | None = None
    stream: bool | None = None
    insecure: bool | None = None

    REFUSED: ClassVar = {"insecure": (False, "downloads always use TLS")}


def keep_alive(value: Any) -> Any:
    if value is None:
        return "default"
    try:
        return parse_duration(value)
    except Exception as e:  # LocalrunError: a bad duration
        raise bad_request(str(e), "keep_alive") from None


def _messages(raw: list[OllamaMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    calls_by_name: dict[str, str] = {}
    for m in raw:
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.images:
            msg["images"] = ollama_images(m.images)
        if m.thinking is not None and m.role == "assistant":
            msg["reasoning_content"] = m.thinking
        if m.tool_calls:
            msg["tool_calls"] = []
            for call in m.tool_calls:
                fn = call.function
                args = fn.arguments or {}
                cid = call.id or new_call_id()
                calls_by_name[fn.name] = cid
                msg["tool_calls"].append({"id": cid, "type": "function", "function": {
                    "name": fn.name,
                    "arguments": args if isinstance(args, str) else json.dumps(args)}})
            if not m.content:
                msg["content"] = None
        if m.role == "tool":
            answers = m.tool_call_id or (calls_by_name.get(m.tool_name) if m.tool_name
                                         else None)
            if answers is None and calls_by_name:
                answers = list(calls_by_name.values())[-1]
            if answers is not None:
                msg["tool_call_id"] = answers
        out.append(msg)
    return out


# -- answers -------------------------------------------------------------------------------

class OutFunction(BaseModel):
    index: int
    name: str
    arguments: dict[str, Any] | str


class OutToolCall(BaseModel):
    id: str
    function: OutFunction


class OutMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None  # a thinking model's thinking
    tool_calls: list[OutToolCall] | None = None


class OutTop(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class OutLogprob(OutTop):
    top_logprobs: list[OutTop] | None = None


class Answer(BaseModel):
    """/api/chat's answer (``message``) or /api/generate's (``response``); a stream is
    one per line, the last with ``done`` and the timings (nanoseconds)."""

    model: str
    created_at: str
    message: OutMessage | None = None
    response: str | None = None
    thinking: str | None = None  # /api/generate's: a thinking model's thinking
    logprobs: list[OutLogprob] | None = None
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


def tool_calls(c: Completion) -> list[dict[str, Any]]:
    """A reply's tool calls as Ollama writes them (arguments as an object)."""
    out = []
    for i, call in enumerate(c.tool_calls):
        try:
            args: Any = json.loads(call.arguments)
        except ValueError:
            args = call.arguments
        out.append({"id": call.id, "function": {"index": i, "name": call.name,
                                                "arguments": args}})
    return out


def _stats(job: Any, c: Completion) -> dict[str, Any]:
    ns = 1_000_000_000
    loaded = job.loaded
    started_wall = time.time() - (time.monotonic() - job.t0)
    load = loaded.load_seconds if loaded.loaded_at >= started_wall else 0.0
    t = c.timings
    return {"done": True, "done_reason": FINISH[c.finish_reason],
            "total_duration": int((time.monotonic() - job.t0) * ns),
            "load_duration": int(load * ns),
            "prompt_eval_count": c.usage.prompt_tokens,
            "prompt_eval_duration": int(t.ttft * ns),
            "eval_count": c.usage.completion_tokens,
            "eval_duration": int(max(0.0, t.total - t.ttft) * ns)}


def _line(data: Any) -> bytes:
    return (json.dumps(data, ensure_ascii=False) + "\n").encode()


class NDJSON(Wire):
    """Ollama's stream: one object per line (the thinking's lines first, their content
    ""), the last with ``done`` and the timings. ``scored``: the request asked for log
    probabilities, which each line carries for the tokens it brings."""

    def __init__(self, job: Any, model: str, chat: bool, scored: bool = False) -> None:
        self.job = job
        self.model = model
        self.chat = chat
        self.scored = scored

    def piece(self, text: str, thinking: str | None = None,
              logprobs: tuple[TokenLogprob, ...] | None = None) -> dict[str, Any]:
        from localrun.server.catalog import rfc3339

        out: dict[str, Any] = {"model": self.model, "created_at": rfc3339()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if thinking is not None:
                out["message"]["thinking"] = thinking
        else:
            out["response"] = text
            if thinking is not None:
                out["thinking"] = thinking
        if self.scored and logprobs is not None:
            out["logprobs"] = chat_logprobs(logprobs)["content"]
        out["done"] = False
        return out

    def whole(self, c: Completion) -> Answer:
        """The non-streamed answer: the reply, its thinking, tool calls, the timings."""
        out = self.piece(c.text, c.reasoning, c.logprobs or ())
        if self.chat and c.tool_calls:
            out["message"]["tool_calls"] = tool_calls(c)
        out.update(_stats(self.job, c))
        return Answer.model_validate(out)

    def chunk(self, chunk: Chunk) -> Iterable[bytes]:
        if chunk.reasoning:
            yield _line(self.piece("", chunk.reasoning, chunk.logprobs))
        elif chunk.text and not chunk.tool_calls:
            yield _line(self.piece(chunk.text, None, chunk.logprobs))
        elif self.scored and chunk.logprobs:  # tokens a stop string held back, the end's
            yield _line(self.piece("", None, chunk.logprobs))

    def done(self, completion: Completion) -> Iterable[bytes]:
        if self.chat and completion.tool_calls:  # Ollama sends each call whole
            calls = self.piece("")
            calls["message"]["tool_calls"] = tool_calls(completion)
            yield _line(calls)
        last = self.piece("")
        last.update(_stats(self.job, completion))
        yield _line(last)

    def error(self, error: APIError) -> bytes:
        return _line(error.ollama_body())
