"""The public API: ``load()`` and :class:`Model`.

Everything an engine lacks is built here once: stop strings, usage on streams,
timings, a queue so that several threads can share a Model, cancellation between
tokens, and the model's own sampling defaults.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from localrun.backends.base import GenerationStats, Prompt, Session
from localrun.errors import (
    ContextOverflowError,
    GenerationError,
    IncompleteOutputError,
    LocalrunError,
    ModelBusyError,
    ModelClosedError,
    StructuredOutputError,
)
from localrun.sampling import ResolvedSampling, make_sampling, resolve
from localrun.structured.calls import ToolCall
from localrun.structured.formats import has_tool_turns
from localrun.structured.output import (
    ChatPlan,
    OutputProcessor,
    StructuredRequest,
    plan_chat,
    prepare,
    raw_plan,
)

if TYPE_CHECKING:
    from localrun.hub import FetchPlan, ProgressCallback
    from localrun.selection import Plan

__all__ = ["Model", "Stream", "load", "make_sampling"]
from localrun.stopping import StopMatcher
from localrun.templates import normalize_messages
from localrun.types import (
    CancelToken,
    Chunk,
    Completion,
    Message,
    ModelInfo,
    Sampling,
    Timings,
    Usage,
)

if TYPE_CHECKING:
    from localrun.batch import BatchInput


class _Outcome:
    """What the structured-output layer adds to a reply; filled before its last chunk."""

    __slots__ = ("error", "parsed", "tool_calls")

    def __init__(self) -> None:
        self.tool_calls: tuple[ToolCall, ...] = ()
        self.parsed: Any = None
        self.error: StructuredOutputError | None = None


class Stream:
    """An iterator of :class:`Chunk` for one reply; the last chunk carries usage.

    ``cancel()`` stops generation from any thread; ``completion`` holds the whole
    reply once the stream has ended. Closing it early (or leaving a ``with`` block)
    frees the Model for the next call.
    """

    def __init__(self, chunks: Iterator[Chunk], cancel: CancelToken,
                 outcome: _Outcome | None = None) -> None:
        self._chunks = chunks
        self._cancel = cancel
        self._outcome = outcome
        self._parts: list[str] = []
        self.completion: Completion | None = None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        chunk = next(self._chunks)
        self._parts.append(chunk.text)
        if chunk.finish_reason is not None:
            assert chunk.usage is not None and chunk.timings is not None
            self.completion = _completion(
                "".join(self._parts), chunk.finish_reason, chunk.usage, chunk.timings,
                self._outcome)
        return chunk

    def cancel(self) -> None:
        self._cancel.cancel()

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
        for _ in self:
            pass
        assert self.completion is not None
        if self._outcome is not None and self._outcome.error is not None:
            raise self._outcome.error
        return self.completion


def _completion(text: str, finish: Any, usage: Usage, timings: Timings,
                outcome: _Outcome | None) -> Completion:
    if outcome is None:
        return Completion(text, finish, usage, timings)
    if outcome.tool_calls:
        text = text.strip()  # what surrounded the calls (newlines between blocks)
    completion = Completion(text, finish, usage, timings, outcome.tool_calls, outcome.parsed)
    if isinstance(outcome.error, IncompleteOutputError):
        outcome.error.completion = completion
    return completion


def encode_prompt(session: Session, messages: list[Message] | None, text: str | None,
                  plan: ChatPlan | None) -> Prompt:
    """The prompt tokens of one request: the engine's own chat rendering, or localrun's
    (a conversation with tools), plus the assistant-turn prefill of a forced call."""
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


class Model:
    """A loaded model. Safe to share between threads: calls queue up, one runs at a time."""

    def __init__(self, session: Session, sampling_defaults: Mapping[str, Any] | None = None
                 ) -> None:
        self._session: Session | None = session
        self.info: ModelInfo = session.info
        # What the model's own files say wins over what localrun knows about the model.
        self._defaults = {**(sampling_defaults or {}), **session.sampling_defaults}
        self._lock = threading.Lock()
        self._owner: int | None = None

    # -- public API -------------------------------------------------------------------

    def chat(
        self,
        messages: str | Sequence[Message],
        *,
        cancel: CancelToken | None = None,
        response_format: Any = None,
        schema: Any = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        **sampling: Any,
    ) -> Completion:
        """Reply to a conversation (or a single user message) with the chat template.

        Structured output: ``schema=`` a JSON Schema dict or a pydantic model class
        (``Completion.parsed`` is then the reply as data, or the model instance), or
        ``response_format=`` in OpenAI's shape (``{"type": "json_object"}``,
        ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``).
        Tools: ``tools=`` OpenAI function dicts, Python functions or pydantic models;
        ``tool_choice=`` "auto" (default), "none", "required" or
        ``{"type": "function", "function": {"name": ...}}``. Calls come back in
        ``Completion.tool_calls`` with ``finish_reason="tool_calls"``; send results back
        as ``{"role": "tool", "tool_call_id": ..., "content": ...}`` messages. Schemas and
        forced calls are enforced by constrained decoding; an engine that cannot
        enforce them raises instead of answering unconstrained.
        """
        return self.stream(messages, cancel=cancel, response_format=response_format,
                           schema=schema, tools=tools, tool_choice=tool_choice,
                           **sampling).join()

    def complete(
        self, prompt: str, *, cancel: CancelToken | None = None, response_format: Any = None,
        schema: Any = None, **sampling: Any
    ) -> Completion:
        """Continue raw text, without the chat template (``schema=`` constrains it too)."""
        return self.stream(prompt, raw=True, cancel=cancel, response_format=response_format,
                           schema=schema, **sampling).join()

    def stream(
        self,
        messages: str | Sequence[Message],
        *,
        raw: bool = False,
        cancel: CancelToken | None = None,
        response_format: Any = None,
        schema: Any = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        **sampling: Any,
    ) -> Stream:
        """Stream a reply as :class:`Chunk` objects. ``raw=True`` skips the chat template.

        Sampling options: max_tokens, temperature (0 = greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop. Unset options take the model's own defaults.
        Structured output and tools as for :meth:`chat`; tool calls stream as
        ``Chunk.tool_calls`` deltas (a stable ``index``, the id and name first, then
        argument fragments that concatenate to the call's JSON arguments).
        """
        if raw and not isinstance(messages, str):
            raise LocalrunError("raw=True takes a prompt string", hint="pass the text itself")
        request = make_sampling(**sampling)
        structured = prepare(response_format, schema, tools, tool_choice)
        if raw:
            raw_plan(structured)  # tools need a chat turn: refuse now, not mid-stream
        msgs = None if raw else normalize_messages(messages)
        token = cancel or CancelToken()
        text = messages if isinstance(messages, str) and raw else None
        return self._stream(msgs, text, request, token, structured)

    def batch(
        self,
        items: Iterable[BatchInput],
        *,
        max_concurrency: int | None = None,
        cancel: CancelToken | None = None,
        response_format: Any = None,
        schema: Any = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        **sampling: Any,
    ) -> list[Completion]:
        """Reply to many prompts; the Completions come back in input order.

        Each item is a prompt string, a list of messages, or a
        :class:`localrun.batch.BatchItem` with its own sampling overrides; ``sampling``
        applies to all. Engines that batch run up to ``max_concurrency`` items at once
        (None: the engine decides); the others run them in turn. If any item fails,
        :class:`localrun.batch.BatchError` is raised once all have run: its ``results``
        hold every Completion and each failed item's error. ``cancel`` ends the batch:
        items in flight and those not started finish with ``finish_reason="cancelled"``.
        ``response_format``/``schema``/``tools``/``tool_choice`` (as for :meth:`chat`)
        apply to every item.
        """
        from localrun.batch import BatchError

        results: dict[int, Completion | LocalrunError] = dict(
            self.batch_iter(items, max_concurrency=max_concurrency, cancel=cancel,
                            response_format=response_format, schema=schema, tools=tools,
                            tool_choice=tool_choice, **sampling))
        ordered = [results[i] for i in range(len(results))]
        if any(isinstance(r, LocalrunError) for r in ordered):
            raise BatchError(ordered)
        return [r for r in ordered if isinstance(r, Completion)]

    def batch_iter(
        self,
        items: Iterable[BatchInput],
        *,
        max_concurrency: int | None = None,
        cancel: CancelToken | None = None,
        response_format: Any = None,
        schema: Any = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        **sampling: Any,
    ) -> Iterator[tuple[int, Completion | LocalrunError]]:
        """Like :meth:`batch`, but yield ``(index, result)`` as each item finishes.

        ``result`` is the item's Completion, or the LocalrunError that item hit (a
        prompt over the context, an invalid override, an engine failure, a reply whose
        JSON was cut short); the other items go on. Batch-wide mistakes (invalid shared
        sampling, a malformed schema or tool) raise at once.
        """
        from localrun.batch import run_batch

        structured = prepare(response_format, schema, tools, tool_choice)
        return run_batch(self, items, max_concurrency=max_concurrency, cancel=cancel,
                         sampling=sampling, structured=structured)

    @property
    def defaults(self) -> ResolvedSampling:
        """The sampling a call that sets no option runs with: the model's own defaults
        (GGUF ``general.sampling.*``, generation_config.json), else its model card's
        (catalog.json), else localrun's neutral ones. A call's own options override each."""
        return self._resolve(Sampling())

    def count_tokens(self, text: str) -> int:
        """Tokens of raw text for this model's tokenizer."""
        with self._hold():
            return len(self._live().encode_text(text).tokens)

    def close(self) -> None:
        """Free the engine's memory. Waits for a running call to finish."""
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        i = self.info
        return f"<localrun.Model {i.name or i.path} on {i.backend} ({i.format} {i.quantization})>"

    # -- internals --------------------------------------------------------------------

    def _live(self) -> Session:
        if self._session is None:
            raise ModelClosedError()
        return self._session

    def _resolve(self, request: Sampling) -> ResolvedSampling:
        """The one place a request meets the defaults: the caller's values, then the
        model's own, then what localrun knows about the model, then the neutral ones
        (chat, stream, complete and batch alike)."""
        return resolve(request, self._defaults)

    def _hold(self) -> _Held:
        if self._owner == threading.get_ident():
            raise ModelBusyError()
        return _Held(self)

    def _stream(self, messages: list[Message] | None, text: str | None, request: Sampling,
                cancel: CancelToken, structured: StructuredRequest | None = None) -> Stream:
        outcome = _Outcome() if structured is not None else None
        return Stream(self._run(messages, text, request, cancel, structured, outcome),
                      cancel, outcome)

    def _run(
        self,
        messages: list[Message] | None,
        text: str | None,
        request: Sampling,
        cancel: CancelToken,
        structured: StructuredRequest | None = None,
        outcome: _Outcome | None = None,
    ) -> Iterator[Chunk]:
        with self._hold():
            session = self._live()
            t0 = time.perf_counter()
            sampling = self._resolve(request)
            plan = structured_plan(session, messages, structured)
            prompt = encode_prompt(session, messages, text, plan)
            n_prompt = len(prompt.tokens)
            ctx = session.info.context_length
            if n_prompt >= ctx:
                raise ContextOverflowError(
                    n_prompt, ctx, trained_context=session.info.trained_context_length
                )
            sampling = constrained(session, sampling, plan)
            processor = OutputProcessor(plan) if plan is not None and structured is not None \
                else None
            yield from self._generate(session, prompt, sampling, cancel, t0, processor, outcome)

    def _generate(
        self,
        session: Session,
        prompt: Prompt,
        sampling: ResolvedSampling,
        cancel: CancelToken,
        t0: float,
        processor: OutputProcessor | None = None,
        outcome: _Outcome | None = None,
    ) -> Iterator[Chunk]:
        stats = GenerationStats()
        matcher = StopMatcher(sampling.stop)
        finish = None
        t_first = 0.0
        pieces = session.generate(prompt, sampling, cancel, stats)
        try:
            for piece in pieces:
                if not t_first:
                    t_first = time.perf_counter()
                if cancel.cancelled:
                    finish = "cancelled"
                    break
                out, hit = matcher.feed(piece)
                if out:
                    yield from _chunks(processor, out)
                if hit:
                    finish = "stop"
                    break
        except LocalrunError:
            raise
        except Exception as e:  # an engine failure must not look like a crash
            raise GenerationError(session.info.backend, f"{type(e).__name__}: {e}") from e
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()
        if finish is None:
            finish = "cancelled" if cancel.cancelled else (stats.finish_reason or "length")
            rest = matcher.flush()
            if rest:
                yield from _chunks(processor, rest)
        if processor is not None:
            content, deltas = processor.finish()
            if content or deltas:
                yield Chunk(content, tool_calls=tuple(deltas))
            result = processor.result(finish)
            finish = result.finish_reason or finish
            if outcome is not None:
                outcome.tool_calls, outcome.parsed = result.tool_calls, result.parsed
                outcome.error = result.error
        t_end = time.perf_counter()
        yield Chunk(
            "",
            finish_reason=finish,  # type: ignore[arg-type]
            usage=Usage(len(prompt.tokens), stats.completion_tokens),
            timings=_timings(stats, len(prompt.tokens), t0, t_first, t_end),
        )


def _chunks(processor: OutputProcessor | None, text: str) -> Iterator[Chunk]:
    if processor is None:
        yield Chunk(text)
        return
    content, deltas = processor.feed(text)
    if content or deltas:
        yield Chunk(content, tool_calls=tuple(deltas))


def _timings(
    stats: GenerationStats, n_prompt: int, t0: float, t_first: float, t_end: float
) -> Timings:
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


class _Held:
    """Queue for the Model: one call at a time, remembering which thread holds it."""

    __slots__ = ("_m",)

    def __init__(self, model: Model) -> None:
        self._m = model

    def __enter__(self) -> None:
        self._m._lock.acquire()
        self._m._owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self._m._owner = None
        self._m._lock.release()


def load(
    model: str | None = None,
    *,
    backend: str = "auto",
    context: int | None = None,
    device: str | None = None,
    threads: int | None = None,
    allow_unoptimized: bool = False,
    quant: str | None = None,
    progress: ProgressCallback | None = None,
    on_plan: Callable[[Plan, FetchPlan], None] | None = None,
    **engine_options: Any,
) -> Model:
    """Load a model and return a :class:`Model`.

    ``model`` is a local file or folder, or a name such as ``"smollm2:135m"``; ``None``
    is the embedded default model. ``backend="auto"`` picks the engine for this host
    and the model's format; naming one forces it (after the compatibility check).
    ``context`` is the context window in tokens (default: the model's trained
    context, capped at 8192, on every engine). ``device`` is where it runs (``"cpu"``,
    ``"cuda:1"``, ``"GPU.1"``, ``"NPU"``, ...; default: the device the plan chose for this
    host, as ``localrun plan`` shows it). ``allow_unoptimized=True`` lets an engine load
    a format it runs but has no optimized kernels for. Other keywords are engine options
    (``localrun.backends.engine_options(backend)`` lists them; others are refused).

    A name that is not on disk (``"qwen2.5:0.5b"``, ``"org/repo:Q4_K_M"``) is planned
    for this machine and downloaded into the Hugging Face cache first: ``on_plan``
    receives the plan before any download, ``progress`` receives download progress,
    ``quant`` picks a quant. A model that does not fit in memory is refused first.
    """
    from localrun.backends import get_backend
    from localrun.backends.base import LoadRequest
    from localrun.resolve import resolve

    if context is not None and (isinstance(context, bool) or not isinstance(context, int)
                                or context < 16):
        raise LocalrunError(f"Invalid context {context!r}",
                            hint="pass a number of tokens >= 16, e.g. context=4096")
    target = resolve(model, backend=backend, context=context, quant=quant,
                     allow_unoptimized=allow_unoptimized, progress=progress, on_plan=on_plan)
    engine = get_backend(target.backend)
    session = engine.load(
        LoadRequest(
            path=target.path,
            format=target.format,
            context=context,
            # the caller's device, else the one the plan chose for this host
            device=device or target.device,
            threads=threads,
            options=engine_options,
        )
    )
    return Model(session, target.sampling_defaults)
