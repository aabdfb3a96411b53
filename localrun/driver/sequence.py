"""One sequence, from its request to its Completion: every per-sequence fact, once.

:class:`Generation` resolves the sampling (the caller's values, then the model's own
defaults, then the catalog's, then localrun's neutral ones), renders and encodes the
prompt, refuses one over the context, adds the structured-output constraint, clamps
``max_tokens`` to what the context leaves, fixes the seed, and then turns the engine's
text pieces into chunks (stop strings, structured output) and, at the end, usage,
timings and the Completion. Which thread feeds it, and whether the engine runs it
alone or in a batch, is :mod:`localrun.driver.scheduler`'s business.
"""

from __future__ import annotations

import numbers
import queue
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from localrun.backends import logprobs as logprob_math
from localrun.backends.base import GenerationStats, Prompt, Session
from localrun.errors import (
    ContextOverflowError,
    IncompleteOutputError,
    LocalrunError,
    StructuredOutputError,
)
from localrun.sampling import ResolvedSampling, resolve
from localrun.stopping import StopMatcher
from localrun.structured.calls import ToolCall
from localrun.structured.formats import has_tool_turns
from localrun.structured.output import (
    ChatPlan,
    OutputProcessor,
    StructuredRequest,
    plan_chat,
    raw_plan,
)
from localrun.types import (
    CancelToken,
    Chunk,
    Completion,
    FinishReason,
    Message,
    Sampling,
    Timings,
    TokenLogprob,
    Usage,
)

#: What the engine side hands a sequence's consumer: (sequence, payload, tokens). The
#: payload is a text piece, None (the sequence ended), or the error that ended it;
#: tokens is the engine's completion-token count as of that piece.
Event = tuple["Generation", "str | BaseException | None", int]
Sink = queue.SimpleQueue[Event]


@dataclass(frozen=True)
class Request:
    """One sequence as the caller asked for it (already validated)."""

    messages: list[Message] | None  # None: raw text
    text: str | None
    sampling: Sampling
    structured: StructuredRequest | None = None
    tokens: tuple[int, ...] | None = None  # a raw prompt given as token ids (then no text)

    def __post_init__(self) -> None:
        # Every call's text passes here (stream, chat, complete, batch): a lone surrogate
        # (a JSON "\ud800" escape, a str decoded with surrogateescape) is no Unicode
        # text, and a tokenizer's encode would fail on it mid-request.
        if self.text is not None:
            check_text(self.text, "the prompt")
        for i, m in enumerate(self.messages or ()):
            check_text(m, f"message {i}")


def token_ids(value: object) -> tuple[int, ...] | None:
    """A raw prompt given as token ids (a list, tuple or array of integers), or None when
    ``value`` is not one."""
    if isinstance(value, (str, bytes, Mapping)):
        return None
    if hasattr(value, "tolist"):  # a numpy array
        value = value.tolist()
    if not isinstance(value, Sequence):
        return None
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value):
        return None
    return tuple(int(t) for t in value)


def check_text(value: object, where: str) -> None:
    """LocalrunError if a string in ``value`` (a str, or the dicts and lists of a
    message) holds a lone surrogate, which no tokenizer can encode."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if v.isascii():
                continue
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise LocalrunError(
                    f"Cannot encode {where}: {e.object[e.start:e.end]!r} at character "
                    f"{e.start} is a lone surrogate, not a Unicode character",
                    hint="pass valid Unicode text (decode bytes with errors='replace'; "
                    "a character beyond U+FFFF is one str character, not two halves)"
                ) from None
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


class Outcome:
    """What the structured-output layer adds to a reply; filled before its last chunk."""

    __slots__ = ("error", "parsed", "tool_calls")

    def __init__(self) -> None:
        self.tool_calls: tuple[ToolCall, ...] = ()
        self.parsed: Any = None
        self.error: StructuredOutputError | None = None


def completion_of(text: str, finish: FinishReason, usage: Usage, timings: Timings,
                  outcome: Outcome | None, logprobs: tuple[TokenLogprob, ...] | None = None,
                  prompt_logprobs: tuple[TokenLogprob, ...] | None = None) -> Completion:
    """The Completion of a reply, with what structured output made of it."""
    if outcome is None:
        return Completion(text, finish, usage, timings, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs)
    if outcome.tool_calls:
        text = text.strip()  # what surrounded the calls (newlines between blocks)
    completion = Completion(text, finish, usage, timings, outcome.tool_calls, outcome.parsed,
                            logprobs, prompt_logprobs)
    if isinstance(outcome.error, IncompleteOutputError):
        outcome.error.completion = completion
    return completion


def timings_of(stats: GenerationStats, n_prompt: int, t0: float, t_first: float,
               t_end: float) -> Timings:
    """Timings from the engine's own figures where it gave them, else the wall clock."""
    ttft = (t_first - t0) if t_first else (t_end - t0)
    if stats.prefill_seconds > 0:
        prefill_tps = stats.prefill_tokens / stats.prefill_seconds
    else:
        prefill_tps = n_prompt / ttft if ttft > 0 else 0.0
    if stats.decode_seconds > 0 and stats.decode_tokens > 0:
        decode_tps = stats.decode_tokens / stats.decode_seconds
    elif stats.completion_tokens > 1 and t_first:
        decode_tps = (stats.completion_tokens - 1) / max(t_end - t_first, 1e-9)
    else:
        decode_tps = 0.0
    return Timings(ttft=ttft, prefill_tps=prefill_tps, decode_tps=decode_tps, total=t_end - t0)


def encode_prompt(session: Session, messages: list[Message] | None, text: str | None,
                  plan: ChatPlan | None, tokens: Sequence[int] | None = None) -> Prompt:
    """The prompt tokens of one request: the engine's own chat rendering, or localrun's
    (a conversation with tools), plus the assistant-turn prefill of a forced call; or
    the caller's own token ids, as they are."""
    if tokens is not None:
        return session.encode_ids(tokens)
    if messages is None:
        return session.encode_text(text or "")
    if plan is None:
        return session.encode_chat(messages)
    if plan.render_here:
        from localrun.templates import render_chat

        rendered = render_chat(session.chat_template, plan.messages,
                               bos_token=session.bos_token, eos_token=session.eos_token,
                               tools=plan.template_tools)
        return session.encode_rendered(rendered + plan.prefill)
    prompt = session.encode_chat(plan.messages)  # type: ignore[arg-type]
    if plan.prefill:
        if prompt.text is None:
            raise StructuredOutputError(f"{session.info.backend} gave no rendered prompt to "
                                        "start a forced tool call from",
                                        hint="use tool_choice='auto'")
        return session.encode_rendered(prompt.text + plan.prefill)
    return prompt


def structured_plan(session: Session, messages: list[Message] | None,
                    structured: StructuredRequest | None) -> ChatPlan | None:
    """How a request with structured output or tool turns runs on this session."""
    if messages is None:
        return raw_plan(structured) if structured is not None else None
    if structured is None and not has_tool_turns(messages):
        return None
    return plan_chat(structured, messages, session.chat_template)


def constrained(session: Session, sampling: ResolvedSampling, plan: ChatPlan | None
                ) -> ResolvedSampling:
    """``sampling`` with the plan's constraint, once the engine said it can enforce it."""
    if plan is None or plan.constraint is None:
        return sampling
    session.check_constraint(plan.constraint)
    return replace(sampling, constraint=plan.constraint)


def limited(sampling: ResolvedSampling, room: int) -> ResolvedSampling:
    """``sampling`` as a backend receives it: ``max_tokens`` within the ``room`` the
    context leaves after the prompt, and a concrete seed (drawn once, here, when the
    caller gave none), so that no backend computes either again."""
    seed = sampling.seed if sampling.seed is not None else secrets.randbits(32)
    return replace(sampling, max_tokens=min(sampling.max_tokens, room), seed=seed)


#: What a sequence cancelled before it began comes back as.
NOT_STARTED = Completion("", "cancelled", Usage(0, 0), Timings())


class Generation:
    """One sequence: prepared once on the thread that runs the engine, fed on its
    consumer's thread (they may be the same), or on the engine thread when ``eager``."""

    __slots__ = ("cancel", "completion", "eager", "ended", "first", "halted", "hit", "key",
                 "lp_sent", "matcher", "outcome", "parts", "processor", "prompt",
                 "prompt_logprobs", "request", "sampling", "sink", "stats", "t0", "tokens")

    def __init__(self, request: Request, cancel: CancelToken, sink: Sink | None = None,
                 key: int = 0, eager: bool = False) -> None:
        self.request = request
        self.cancel = cancel  # the caller's token (a batch shares one)
        self.sink = sink  # where the engine thread sends this sequence's events
        self.key = key  # the Batcher's key
        # Fed by the engine thread as its pieces come, the consumer woken only at its
        # end (a batch's items, a joined stream: nobody reads their pieces before).
        self.eager = eager
        self.ended = False  # an eager sequence's end was sent to its consumer
        self.outcome = Outcome() if request.structured is not None else None
        self.stats = GenerationStats()
        self.prompt: Prompt | None = None  # None until prepared
        self.sampling: ResolvedSampling | None = None
        self.matcher = StopMatcher(())
        self.processor: OutputProcessor | None = None
        self.parts: list[str] = []
        self.t0 = 0.0
        self.first = 0.0  # perf_counter() at the first piece
        self.hit = False  # a stop string matched
        self.halted = False  # the consumer stopped it (stop string, closed stream)
        self.tokens: int | None = None  # completion tokens when the consumer stopped it
        self.completion: Completion | None = None
        self.lp_sent = 0  # stats.logprobs entries already put on a chunk
        self.prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # echo

    # -- engine side ----------------------------------------------------------------

    def prepare(self, session: Session, defaults: Mapping[str, Any]) -> None:
        """Everything the engine needs, computed once: raises for this request only."""
        self.t0 = time.perf_counter()
        req = self.request
        sampling = resolve(req.sampling, defaults)
        if sampling.echo and req.messages is not None:
            raise LocalrunError("echo=True takes a raw prompt, not a conversation",
                                hint="use Model.complete(prompt, echo=True)")
        logprob_math.check(session, sampling, req.tokens is not None)
        plan = structured_plan(session, req.messages, req.structured)
        prompt = encode_prompt(session, req.messages, req.text, plan, req.tokens)
        n_prompt = len(prompt.tokens)
        ctx = session.info.context_length
        if n_prompt >= ctx:
            raise ContextOverflowError(n_prompt, ctx,
                                       trained_context=session.info.trained_context_length)
        self.sampling = limited(constrained(session, sampling, plan), ctx - n_prompt)
        if sampling.echo:  # the prompt scored now, before anything is generated
            self.prompt_logprobs = tuple(session.prompt_logprobs(prompt, sampling.logprobs or 0))
        if sampling.logprobs is not None:
            self.stats.logprobs = []  # the engine's entries, one per token it chooses
        self.prompt = prompt
        if plan is not None and req.structured is not None:
            self.processor = OutputProcessor(plan)
        self.matcher = StopMatcher(self.sampling.stop)

    @property
    def stopping(self) -> bool:
        """Whether the engine should drop this sequence now."""
        return self.halted or self.cancel.cancelled

    # -- consumer side --------------------------------------------------------------

    def feed(self, piece: str, tokens: int | None = None) -> list[Chunk]:
        """The chunks one engine piece gives (none while a stop string may be starting).
        ``tokens``: the engine's count as of this piece, kept if a stop string ends it."""
        if not self.first:
            self.first = time.perf_counter()
        out, hit = self.matcher.feed(piece)
        chunks = self._emit(out) if out else []
        if self.stats.logprobs is not None and chunks:
            self._attach(chunks, self.stats.completion_tokens if tokens is None else tokens)
        if self.processor is not None and self.processor.runaway is not None:
            hit = True  # a JSON value ran away: ended here, as by a stop string
        if hit:
            self.hit = True
            self.halted = True
            if tokens is not None:
                self.tokens = tokens
        return chunks

    def _attach(self, chunks: list[Chunk], upto: int) -> None:
        """Put the entries of the tokens up to ``upto`` not on a chunk yet on the first of
        ``chunks`` (text held back for a stop string, or by structured output, takes its
        tokens' entries to the next chunk)."""
        entries = self.stats.logprobs
        assert entries is not None
        upto = min(upto, len(entries))
        if upto > self.lp_sent:
            chunks[0] = replace(chunks[0], logprobs=tuple(entries[self.lp_sent:upto]))
            self.lp_sent = upto

    def _emit(self, text: str) -> list[Chunk]:
        if self.processor is None:
            self.parts.append(text)
            return [Chunk(text)]
        content, deltas = self.processor.feed(text)
        self.parts.append(content)
        return [Chunk(content, tool_calls=tuple(deltas))] if content or deltas else []

    def finish(self, reason: FinishReason | None) -> list[Chunk]:
        """The last chunks, ending with the one that carries usage and timings.

        ``reason`` None: the engine ended it (its own reason, or "cancelled" when the
        caller cancelled), and text held back for a stop string that never came is
        released; "stop" (a stop string) and "cancelled" (seen between pieces) keep it.
        """
        if self.prompt is None:  # ended before it was prepared (cancelled while waiting)
            self.completion = NOT_STARTED
            return [Chunk("", finish_reason="cancelled", usage=Usage(0, 0), timings=Timings())]
        chunks: list[Chunk] = []
        engine_eos = False  # the engine ended it on an end-of-sequence token
        if reason is None:
            reason = "cancelled" if self.cancel.cancelled else \
                (self.stats.finish_reason or "length")
            engine_eos = reason == "stop"
            rest = self.matcher.flush()
            if rest:
                chunks += self._emit(rest)
        if self.processor is not None:
            content, deltas = self.processor.finish()
            if content or deltas:
                self.parts.append(content)
                chunks.append(Chunk(content, tool_calls=tuple(deltas)))
            result = self.processor.result(reason)
            reason = result.finish_reason or reason  # type: ignore[assignment]
            if self.outcome is not None:
                self.outcome.tool_calls, self.outcome.parsed = result.tool_calls, result.parsed
                self.outcome.error = result.error
        n_prompt = len(self.prompt.tokens)
        done = self.tokens if self.tokens is not None else self.stats.completion_tokens
        usage = Usage(n_prompt, done)
        timings = timings_of(self.stats, n_prompt, self.t0, self.first, time.perf_counter())
        logprobs = None
        if self.stats.logprobs is not None:
            # one entry per token counted, and the end-of-sequence token's (module types)
            logprobs = tuple(self.stats.logprobs[:done + int(engine_eos)])
        self.completion = completion_of("".join(self.parts), reason, usage, timings,
                                        self.outcome, logprobs, self.prompt_logprobs)
        chunks.append(Chunk("", finish_reason=reason, usage=usage, timings=timings,
                            logprobs=logprobs[self.lp_sent:] if logprobs else ()))
        return chunks

    def result(self) -> Completion | LocalrunError:
        """What a batch hands back for it once finished: the Completion, or the error
        of a structured reply that came out incomplete or invalid."""
        if self.outcome is not None and self.outcome.error is not None:
            return self.outcome.error
        assert self.completion is not None
        return self.completion


class Stream:
    """An iterator of :class:`Chunk` for one reply; the last chunk carries usage.

    ``cancel()`` stops generation from any thread; ``completion`` holds the whole
    reply once the stream has ended. Closing it early (or leaving a ``with`` block)
    frees the Model for the next call.
    """

    def __init__(self, chunks: Iterator[Chunk], cancel: CancelToken,
                 generation: Generation) -> None:
        self._chunks = chunks
        self._cancel = cancel
        self._gen = generation
        self._started = False
        self.completion: Completion | None = None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        self._started = True
        chunk = next(self._chunks)
        if chunk.finish_reason is not None:
            self.completion = self._gen.completion
        return chunk

    def cancel(self) -> None:
        self._cancel.cancel()

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's tokens, once it is encoded (before the first chunk); else None."""
        prompt = self._gen.prompt
        return None if prompt is None else len(prompt.tokens)

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the reply (``finish_reason`` "stop"), if one did."""
        return self._gen.matcher.matched

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def join(self) -> Completion:
        """Consume the rest of the stream and return the whole Completion.

        Raises :class:`~localrun.errors.IncompleteOutputError` when a reply asked for
        with ``schema=``/``response_format=`` (or a forced tool call) ended before its
        JSON was complete; the error's ``completion`` holds what was generated.
        """
        if not self._started:  # nobody reads its pieces: the engine thread may feed it
            self._gen.eager = True
        for _ in self:
            pass
        assert self.completion is not None
        outcome = self._gen.outcome
        if outcome is not None and outcome.error is not None:
            raise outcome.error
        return self.completion
