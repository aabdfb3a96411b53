"""The data every backend speaks: messages, sampling options, chunks and completions."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypedDict

from localrun.adapters import Adapter
from localrun.structured.calls import ToolCall, ToolCallDelta

#: "tool_calls": the reply is one or more tool calls (``Completion.tool_calls``).
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]
Role = Literal["system", "user", "assistant", "tool"]
#: Speculative decoding (``load(speculative=...)``, or per call): "auto" keeps it on only
#: where it measurably wins; "prompt-lookup" drafts from the prompt's n-grams; "draft"
#: from a draft model (``draft_model=``); "off" never.
SpeculativeMode = Literal["off", "auto", "prompt-lookup", "draft"]
SPECULATIVE_MODES: tuple[SpeculativeMode, ...] = ("off", "auto", "prompt-lookup", "draft")


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
    #: an assistant turn's thinking (``Completion.reasoning``), for templates that show it
    reasoning_content: str
    #: images (bytes, a local path, a data: URI, a :class:`localrun.images.Image`), as
    #: Ollama sends them; normalized: the decoded images, in the order of the markers in
    #: ``content`` (content parts ``{"type": "image_url"}`` / ``{"type": "image"}`` too)
    images: list[Any]


#: Most alternatives ``top_logprobs`` may ask for per token (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position: its text, its bytes, its id and the
    model's log probability of it."""

    token: str
    bytes: bytes
    id: int
    logprob: float

    def to_dict(self) -> dict[str, Any]:
        return {"token": self.token, "bytes": list(self.bytes), "id": self.id,
                "logprob": self.logprob}


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a reply or prompt with the model's log probability of it given the
    tokens before it: ln p under the model's own distribution (the raw logits' log-softmax
    over the whole vocabulary, before penalties, temperature, filters and masks).

    ``token`` is its text as the reply shows it (special tokens, such as the end of
    sequence, show as ""; a token that ends inside a UTF-8 character shows U+FFFD) and
    ``bytes`` its exact bytes; ``top_logprobs`` the ``top_logprobs`` most likely tokens
    at its position, best first (by id among equals). ``logprob`` is None for a prompt's
    first token (nothing comes before it). OpenAI's shapes follow directly:
    :func:`chat_logprobs` (Chat Completions) and :func:`completion_logprobs` (legacy
    Completions)."""

    token: str
    bytes: bytes
    id: int
    logprob: float | None
    top_logprobs: tuple[TopLogprob, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"token": self.token, "bytes": list(self.bytes), "id": self.id,
                "logprob": self.logprob,
                "top_logprobs": [t.to_dict() for t in self.top_logprobs]}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI Chat Completions' ``choices[].logprobs``: ``{"content": [{token, logprob,
    bytes, top_logprobs: [{token, logprob, bytes}]}]}`` (a prompt's first token, which
    has no logprob, is left out)."""

    def one(t: TopLogprob | TokenLogprob) -> dict[str, Any]:
        return {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.top_logprobs]}
                        for e in entries if e.logprob is not None]}


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int = 0
                        ) -> dict[str, Any]:
    """Legacy Completions' ``choices[].logprobs``: ``{tokens, token_logprobs,
    top_logprobs, text_offset}``. Each ``top_logprobs`` dict maps token text to logprob
    and holds the chosen token too (as OpenAI and vLLM do; two tokens of the same text
    keep the higher); a prompt's first token has None there and in ``token_logprobs``.
    ``text_offset``: the character offset of the first token (0 when the entries begin
    with the echoed prompt, else the prompt text's length)."""
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    at = text_offset
    for e in entries:
        offsets.append(at)
        at += len(e.token)
        if e.logprob is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for token, logprob in (*((t.token, t.logprob) for t in e.top_logprobs),
                               (e.token, e.logprob)):
            if logprob > top.get(token, float("-inf")):
                top[token] = logprob
        tops.append(top)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


@dataclass(frozen=True)
class Usage:
    """Tokens of one call. ``completion_tokens`` counts the whole reply, its thinking
    included (as OpenAI counts it); ``reasoning_tokens`` the thinking alone (OpenAI's
    ``completion_tokens_details.reasoning_tokens``), 0 for a model that did not think."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0

    def __repr__(self) -> str:  # a model that does not think shows what it always did
        extra = f", reasoning_tokens={self.reasoning_tokens}" if self.reasoning_tokens else ""
        return (f"Usage(prompt_tokens={self.prompt_tokens}, "
                f"completion_tokens={self.completion_tokens}{extra})")

    def to_dict(self) -> dict[str, int]:
        """The counts as a dict; ``reasoning_tokens`` only where the model thought."""
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        if self.reasoning_tokens:
            out["reasoning_tokens"] = self.reasoning_tokens
        return out

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """Seconds and tokens/s of one generation.

    ``ttft`` is wall-clock time from the call to the first token of text;
    ``prefill_tps`` and ``decode_tps`` come from the engine's own counters where it
    reports them, else from wall-clock times; ``total`` is the whole call.
    ``drafted_tokens``/``accepted_tokens``: speculative decoding's drafts and the ones kept.
    """

    ttft: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    total: float = 0.0
    #: speculative decoding: tokens drafted, and how many of them the model kept (0, 0:
    #: it did not speculate)
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True)
class Chunk:
    """One piece of a streamed reply. The last chunk has finish_reason, usage and timings.

    ``tool_calls`` holds the tool-call pieces of this chunk: each call's first delta has
    its ``index``, ``id`` and ``name``, later ones argument fragments (see
    :class:`ToolCallDelta`).

    A thinking model's reply streams its thinking first, in chunks whose ``reasoning``
    holds it (their ``text`` is ""), then its answer in ``text``: no chunk holds both,
    and ``kind`` says which one a chunk is. A consumer that shows ``text`` alone shows
    the answer alone.
    """

    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    #: with ``logprobs=True``: the tokens whose text this chunk brings (or the chunks
    #: before it brought), in order, each at most once over the stream
    logprobs: tuple[TokenLogprob, ...] = ()
    #: a piece of the model's thinking (``Completion.reasoning``), never the answer
    reasoning: str = ""

    @property
    def kind(self) -> Literal["text", "reasoning"]:
        """"reasoning" for a piece of thinking, "text" for the answer (and the last chunk)."""
        return "reasoning" if self.reasoning else "text"


@dataclass(frozen=True)
class Completion:
    """A whole reply. ``text`` is its content (without the tool calls); ``tool_calls``
    the calls it made (``finish_reason="tool_calls"``); ``parsed`` the reply's JSON as
    Python data, or the pydantic model instance, when it was asked for with ``schema=``
    or ``response_format=``.

    ``logprobs`` (asked with ``logprobs=True``) holds one entry per token the engine
    chose, in order: each reply token, and the end-of-sequence token when the reply ended
    on one (its text is empty; ``usage.completion_tokens`` does not count it), as vLLM
    reports it. ``prompt_logprobs`` (``complete(..., echo=True)``) holds the prompt's
    tokens, the first with ``logprob=None``. None where they were not asked for.

    ``reasoning`` is a thinking model's thinking (its ``<think>`` block, without the
    markers), apart from ``text``; None when the reply has no thinking (the model does
    not think, or ``think=False``). ``usage.reasoning_tokens`` counts it."""

    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    tool_calls: tuple[ToolCall, ...] = ()
    parsed: Any = field(default=None, compare=False)
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    reasoning: str | None = None

    def to_dict(self) -> dict[str, Any]:
        skip = ("tool_calls", "parsed", "logprobs", "prompt_logprobs", "reasoning")
        out = {k: v for k, v in asdict(self).items() if k not in skip}
        out["usage"] = self.usage.to_dict()
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        for name in ("logprobs", "prompt_logprobs"):
            entries = getattr(self, name)
            if entries is not None:
                out[name] = [e.to_dict() for e in entries]
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
    #: the LoRA adapters loaded with it (name, path, load-time scale), in load order
    adapters: tuple[Adapter, ...] = ()
    #: loaded with ``exact=True``: greedy replies the same alone or batched, with a warm
    #: or cold cache; False: the engine's fastest (README, "Speed")
    exact: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Sampling:
    """Sampling options; ``None`` means "the model's own default".

    The same values mean the same thing on every backend: ``temperature=0`` is greedy
    decoding, ``top_k=0`` / ``top_p=1`` / ``min_p=0`` / ``repetition_penalty=1`` switch
    that filter off, ``stop`` strings end the reply and are not part of its text.
    ``logprobs``/``top_logprobs``/``echo`` ask for log probabilities (:class:`TokenLogprob`):
    always the model's own distribution, before the repetition penalty, the
    temperature, the filters and any structured-output mask, as OpenAI and vLLM report them.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    #: report each chosen token's log probability (``Completion.logprobs``)
    logprobs: bool | None = None
    #: and the most likely tokens at each position, 0 to :data:`MAX_TOP_LOGPROBS`
    #: (more than 0 implies ``logprobs``)
    top_logprobs: int | None = None
    #: raw prompts only: the prompt's tokens with their log probabilities
    #: (``Completion.prompt_logprobs``); with ``max_tokens=0`` nothing is generated
    echo: bool | None = None
    #: the LoRA adapters this reply runs under, instead of the load-time set
    #: (:mod:`localrun.adapters`: names, indices, (name, scale) pairs; () the base model)
    adapters: tuple[tuple[str | int, float | None], ...] | None = None
    #: this call's speculative decoding (:data:`SpeculativeMode`); None: the model's
    speculative: SpeculativeMode | None = None


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
