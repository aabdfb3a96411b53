"""The data every backend speaks: messages, sampling options, chunks and completions."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypedDict

from localrun.structured.calls import ToolCall, ToolCallDelta

#: "tool_calls": the reply is one or more tool calls (``Completion.tool_calls``).
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]
Role = Literal["system", "user", "assistant", "tool"]


class _MessageRequired(TypedDict):
    role: str
    content: str  # None is accepted for an assistant turn that only calls tools


class Message(_MessageRequired, total=False):
    """A chat turn in OpenAI's shape. Tool turns go back as
    ``{"role": "tool", "tool_call_id": ..., "content": ...}`` after an assistant turn
    ``{"role": "assistant", "content": None, "tool_calls": [call.to_dict(), ...]}``."""

    tool_calls: list[dict[str, Any]]
    tool_call_id: str
    name: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """Seconds and tokens/s of one generation.

    ``ttft`` is wall-clock time from the call to the first token of text;
    ``prefill_tps`` and ``decode_tps`` come from the engine's own counters where it
    reports them, else from wall-clock times; ``total`` is the whole call.
    """

    ttft: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    total: float = 0.0


@dataclass(frozen=True)
class Chunk:
    """One piece of a streamed reply. The last chunk has finish_reason, usage and timings.

    ``tool_calls`` holds the tool-call pieces of this chunk: each call's first delta has
    its ``index``, ``id`` and ``name``, later ones argument fragments (see
    :class:`ToolCallDelta`).
    """

    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class Completion:
    """A whole reply. ``text`` is its content (without the tool calls); ``tool_calls``
    the calls it made (``finish_reason="tool_calls"``); ``parsed`` the reply's JSON as
    Python data, or the pydantic model instance, when it was asked for with ``schema=``
    or ``response_format=``."""

    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    tool_calls: tuple[ToolCall, ...] = ()
    parsed: Any = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("tool_calls", "parsed")}
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.parsed is not None:
            dump = getattr(self.parsed, "model_dump", None)
            out["parsed"] = dump(mode="json") if callable(dump) else self.parsed
        return out


@dataclass(frozen=True)
class ModelInfo:
    backend: str
    engine_version: str
    format: str
    quantization: str | None
    path: str
    context_length: int
    trained_context_length: int | None = None
    architecture: str | None = None
    name: str | None = None
    device: str | None = None  # where it runs: "cpu", "gpu", "CPU", "GPU.1", "cuda:0", …

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Sampling:
    """Sampling options; ``None`` means "the model's own default".

    The same values mean the same thing on every backend: ``temperature=0`` is greedy
    decoding, ``top_k=0`` / ``top_p=1`` / ``min_p=0`` / ``repetition_penalty=1`` switch
    that filter off, ``stop`` strings end the reply and are not part of its text.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)


class CancelToken:
    """A handle that stops a running generation from any thread.

    Pass it as ``cancel=`` to ``Model.chat/stream/complete``; ``cancel()`` makes the
    call finish promptly with ``finish_reason="cancelled"`` and the Model stays usable.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def reset(self) -> None:
        self._event.clear()
