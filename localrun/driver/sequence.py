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

from localrun.adapters import chosen_adapters
from localrun.backends import logprobs as logprob_math
from localrun.backends.base import GenerationStats, Prompt, Session
from localrun.driver.prompt import assistant_prefill, check_prefill, encode_prompt
from localrun.driver.reasoning import ChatSetup, Splitter, merged, thinking_prompt
from localrun.driver.stopping import StopMatcher
from localrun.errors import (
    ContextOverflowError,
    IncompleteOutputError,
    LocalrunError,
    StructuredOutputError,
)
from localrun.images import message_images
from localrun.reasoning import ReasoningRequest, refuse
from localrun.sampling import ResolvedSampling, resolve
from localrun.structured.calls import ToolCall
from localrun.structured.constraint import Constraint
from localrun.structured.formats import has_tool_turns
from localrun.structured.output import (
    OutputProcessor,
    PreparedChat,
    StructuredRequest,
    prepare_chat,
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
    reasoning: ReasoningRequest | None = None  # think / reasoning_effort / thinking_budget
    #: a raw prompt's structured plan, made when the call's arguments were checked
    raw: PreparedChat | None = None

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
                  prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
                  reasoning: str | None = None) -> Completion:
    """The Completion of a reply, with what structured output made of it."""
    if outcome is None:
        return Completion(text, finish, usage, timings, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs, reasoning=reasoning)
    if outcome.tool_calls:
        text = text.strip()  # what surrounded the calls (newlines between blocks)
    completion = Completion(text, finish, usage, timings, outcome.tool_calls, outcome.parsed,
                            logprobs, prompt_logprobs, reasoning)
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
    return Timings(ttft=ttft, prefill_tps=prefill_tps, decode_tps=decode_tps, total=t_end - t0,
                   drafted_tokens=stats.drafted_tokens, accepted_tokens=stats.accepted_tokens)


def structured_plan(session: Session, messages: list[Message] | None,
                    structured: StructuredRequest | None, chat: ChatSetup | None = None,
                    raw: PreparedChat | None = None) -> PreparedChat | None:
    """How a request with structured output or tool turns runs on this session (``raw``:
    a raw prompt's, made already when its arguments were checked)."""
    if messages is None:
        if raw is not None:
            return raw
        return raw_plan(structured) if structured is not None else None
    if structured is None and not has_tool_turns(messages):
        return None
    return prepare_chat(structured, messages,
                     chat.template if chat is not None else session.chat_template)


def constrained(session: Session, sampling: ResolvedSampling, plan: PreparedChat | None
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
    consumer's thread (they may be the same), or on the engine thread when ``eager``.

    A thinking model's sequence may run in two phases (:mod:`localrun.driver.reasoning`):
    when the first ends early (``switching``), the scheduler runs it again from the
    prompt the :class:`Splitter` wrote, as the same sequence (its counts and chunks go
    on)."""

    __slots__ = ("answer_constraint", "base", "cancel", "chat", "completion", "eager",
                 "ended", "first", "halted", "hit", "key", "lp_sent", "matcher", "outcome",
                 "parts", "prior", "processor", "prompt", "prompt_logprobs", "reasoning",
                 "request", "run_prompt", "sampling", "sink", "split", "stats", "switching",
                 "t0", "tokens", "trim")

    def __init__(self, request: Request, cancel: CancelToken, sink: Sink | None = None,
                 key: int = 0, eager: bool = False, chat: ChatSetup | None = None) -> None:
        self.request = request
        self.cancel = cancel  # the caller's token (a batch shares one)
        self.sink = sink  # where the engine thread sends this sequence's events
        self.key = key  # the Batcher's key
        self.chat = chat  # the model's chat template and reasoning format
        # Fed by the engine thread as its pieces come, the consumer woken only at its
        # end (a batch's items, a joined stream: nobody reads their pieces before).
        self.eager = eager
        self.ended = False  # an eager sequence's end was sent to its consumer
        self.outcome = Outcome() if request.structured is not None else None
        self.stats = GenerationStats()
        self.prompt: Prompt | None = None  # the request's prompt; None until prepared
        self.run_prompt: Prompt | None = None  # what the engine runs now (this phase's)
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
        self.lp_sent = 0  # logprob entries already put on a chunk
        self.prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # echo
        self.split: Splitter | None = None  # the thinking phase's reader, while it runs
        self.reasoning: list[str] | None = None  # the thinking, once the reply has some
        self.switching = False  # the first phase is over: the answer phase runs next
        self.base = 0  # tokens of the phases before this one
        self.prior: GenerationStats | None = None  # their engine figures
        self.answer_constraint: Constraint | None = None  # what the answer must match
        self.trim = False  # the answer phase's first blanks go (they follow </think>)

    # -- engine side ----------------------------------------------------------------

    def prepare(self, session: Session, defaults: Mapping[str, Any]) -> None:
        """Everything the engine needs, computed once: raises for this request only.
        For a sequence whose first phase is over, the answer phase instead."""
        if self.switching:
            self._answer_phase(session)
            return
        self.t0 = time.perf_counter()
        req = self.request
        sampling = resolve(req.sampling, defaults)
        sampling = replace(sampling, adapters=chosen_adapters(session, req.sampling.adapters))
        if sampling.echo and req.messages is not None:
            raise LocalrunError("echo=True takes a raw prompt, not a conversation",
                                hint="use Model.complete(prompt, echo=True)")
        logprob_math.check(session, sampling, req.tokens is not None)
        chat = self.chat
        messages, prefix = assistant_prefill(req.messages)
        check_prefill(session, prefix, req.structured, chat)
        plan = structured_plan(session, messages, req.structured, chat, req.raw)
        thinking = None
        if messages is not None and chat is not None and chat.reasoning is not None:
            prompt, thinking = thinking_prompt(session, chat, messages, plan,
                                               req.reasoning)
        else:
            if req.reasoning is not None and req.reasoning.think:
                raise refuse(req.reasoning, "this model does not think (its chat "
                             "template has no thinking block)")
            prompt = encode_prompt(session, messages, req.text, plan, req.tokens, chat,
                                   prefix)
        n_prompt = len(prompt.tokens)
        ctx = session.info.context_length
        if n_prompt >= ctx:
            raise ContextOverflowError(n_prompt, ctx,
                                       trained_context=session.info.trained_context_length)
        self.sampling = limited(constrained(session, sampling, plan), ctx - n_prompt)
        if thinking is not None:  # the answer's constraint waits for its own phase
            self.split = Splitter(thinking)
            self.reasoning = [] if self.split.opened else None
            self.answer_constraint = self.sampling.constraint
            self.sampling = replace(self.sampling, constraint=None)
        if sampling.echo:  # the prompt scored now, before anything is generated
            session.use_adapters(self.sampling.adapters)
            self.prompt_logprobs = tuple(session.prompt_logprobs(prompt, sampling.logprobs or 0))
        if sampling.logprobs is not None:
            self.stats.logprobs = []  # the engine's entries, one per token it chooses
        self.prompt = self.run_prompt = prompt
        if plan is not None and req.structured is not None:
            self.processor = OutputProcessor(plan)
        self.matcher = StopMatcher(self.sampling.stop)

    def _answer_phase(self, session: Session) -> None:
        """The answer phase of a thinking reply: the prompt the splitter wrote (the
        conversation, the thinking, its end marker), the tokens the first phase left,
        and the answer's constraint. ``sampling.max_tokens`` 0: no room is left."""
        split, sampling = self.split, self.sampling
        assert split is not None and split.switch is not None and sampling is not None
        used = split.tokens
        entries = self.stats.logprobs
        self.base += used
        self.prior = merged(self.prior, self.stats, used)
        self.stats = GenerationStats()
        if entries is not None:  # the engine's entries go on after the kept ones
            self.stats.logprobs = entries[:used]
        self.split = None
        self.switching = self.halted = False
        self.trim = True
        prompt = session.encode_rendered(split.switch)
        if self.prompt is not None and self.prompt.media is not None:  # the same images
            prompt = session.attach_images(prompt, message_images(self.request.messages))
        room = session.info.context_length - len(prompt.tokens)
        left = max(0, min(sampling.max_tokens - used, room))
        self.run_prompt = prompt
        self.sampling = replace(sampling, max_tokens=left, constraint=self.answer_constraint)
        if left and self.answer_constraint is not None:
            session.check_constraint(self.answer_constraint)

    @property
    def stopping(self) -> bool:
        """Whether the engine should drop this sequence now."""
        return self.halted or self.cancel.cancelled

    def resume(self, key: int) -> None:
        """Send a sequence whose first phase is over back to the engine, as ``key``."""
        self.key, self.ended, self.halted = key, False, False

    # -- consumer side --------------------------------------------------------------

    def feed(self, piece: str, tokens: int | None = None) -> list[Chunk]:
        """The chunks one engine piece gives (none while a stop string may be starting).
        ``tokens``: the engine's count as of this piece, kept if a stop string ends it."""
        if not self.first:
            self.first = time.perf_counter()
        count = self.stats.completion_tokens if tokens is None else tokens
        chunks: list[Chunk] = []
        split = self.split
        if split is not None:
            thought, piece = split.feed(piece, count)
            if split.opened and self.reasoning is None:
                self.reasoning = []
            if thought:
                chunks.append(self._think(thought))
            if split.switch is not None and not self.switching:
                self.switching = self.halted = True  # the engine stops; the answer follows
        if self.trim and piece:
            piece = piece.lstrip()
            self.trim = not piece
        if piece:
            out, hit = self.matcher.feed(piece)
            chunks += self._emit(out) if out else []
        else:
            hit = False
        if self.stats.logprobs is not None and chunks:
            self._attach(chunks, self.base + (split.tokens if self.switching and split
                                              else count))
        if self.processor is not None and self.processor.halt:
            hit = True  # a JSON value ran away, or the one call allowed is complete
        if hit:
            self.hit = True
            self.halted = True
            if tokens is not None:
                self.tokens = tokens
        return chunks

    def _think(self, text: str) -> Chunk:
        if self.reasoning is None:
            self.reasoning = []
        self.reasoning.append(text)
        return Chunk("", reasoning=text)

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
        split = self.split
        if split is not None and not self.switching:  # it ended while thinking
            thought, rest = split.flush(self.stats.completion_tokens)
            if thought:
                chunks.append(self._think(thought))
            if rest and reason is None:
                out, _ = self.matcher.feed(rest)
                chunks += self._emit(out) if out else []
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
        done = self.base + (self.tokens if self.tokens is not None
                            else self.stats.completion_tokens)
        if split is not None and self.switching:  # cancelled as the answer was due
            done = self.base + split.tokens
        usage = Usage(n_prompt, done, self.reasoning_tokens(done))
        stats = merged(self.prior, self.stats, self.stats.completion_tokens)
        timings = timings_of(stats, n_prompt, self.t0, self.first, time.perf_counter())
        logprobs = None
        if self.stats.logprobs is not None:
            # one entry per token counted, and the end-of-sequence token's (module types)
            logprobs = tuple(self.stats.logprobs[:done + int(engine_eos)])
        reasoning = "".join(self.reasoning) if self.reasoning is not None else None
        self.completion = completion_of("".join(self.parts), reason, usage, timings,
                                        self.outcome, logprobs, self.prompt_logprobs,
                                        reasoning)
        chunks.append(Chunk("", finish_reason=reason, usage=usage, timings=timings,
                            logprobs=logprobs[self.lp_sent:] if logprobs else ()))
        return chunks

    def reasoning_tokens(self, done: int) -> int:
        """Tokens of the reply that were thinking."""
        if self.reasoning is None:
            return 0
        split = self.split
        if split is None:  # the thinking was the first phase, now over
            return min(self.base, done)
        return min(split.reasoning_tokens or done, done)

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
