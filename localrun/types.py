"""The data every backend speaks: messages, sampling options, chunks and completions."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypedDict

FinishReason = Literal["stop", "length", "cancelled"]
Role = Literal["system", "user", "assistant", "tool"]


class Message(TypedDict):
    role: str
    content: str


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
    """One piece of a streamed reply. The last chunk has finish_reason, usage and timings."""

    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
