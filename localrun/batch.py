"""Batch generation: many prompts through one Model, each result as soon as it is done.

Engines that batch (``Session.supports_batch``) run up to ``max_concurrency``
sequences at once through ``Session.generate_batch``; the others run the items in
turn. Either way each item gets exactly what ``Model.chat`` would give it: the same
stop-string handling, usage and timings, built here once.

Errors are isolated per item: ``Model.batch_iter`` yields ``(index, Completion)`` or
``(index, LocalrunError)``, and ``Model.batch`` raises :class:`BatchError` (which holds
every finished Completion) when any item failed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from localrun.api import (
    _completion,
    _Outcome,
    _timings,
    constrained,
    encode_prompt,
    structured_plan,
)
from localrun.backends.base import GenerationStats, Prompt, Session
from localrun.errors import (
    ContextOverflowError,
    GenerationError,
    LocalrunError,
    ModelBusyError,
    ModelClosedError,
)
from localrun.sampling import ResolvedSampling, make_sampling
from localrun.stopping import StopMatcher
from localrun.structured.output import OutputProcessor, StructuredRequest
from localrun.templates import normalize_messages
from localrun.types import CancelToken, Completion, Message, Sampling, Timings, Usage

if TYPE_CHECKING:
    from localrun.api import Model

__all__ = ["BatchError", "BatchInput", "BatchItem", "BatchResult", "run_batch"]


@dataclass(frozen=True)
class BatchItem:
    """One batch entry with its own sampling overrides.

    ``input`` is a prompt string (sent as one user message through the chat template)
    or a list of ``{"role", "content"}`` messages; ``raw=True`` completes a string
    without the chat template. ``sampling`` holds the same options as ``Model.chat``
    (``{"temperature": 0, "max_tokens": 64}``) and overrides the batch-wide ones.
    """

    input: str | Sequence[Message]
    sampling: Mapping[str, Any] = field(default_factory=dict)
    raw: bool = False


BatchInput = str | Sequence[Message] | BatchItem
#: What batch_iter yields per item: its Completion, or the error that item hit.
BatchResult = Completion | LocalrunError


class BatchError(LocalrunError):
    """Some batch items failed. ``results`` holds every item's Completion or error."""

    def __init__(self, results: Sequence[BatchResult]) -> None:
        self.results: list[BatchResult] = list(results)
        self.errors: dict[int, LocalrunError] = {
            i: r for i, r in enumerate(self.results) if isinstance(r, LocalrunError)
        }
        first_i, first = next(iter(self.errors.items()))
        super().__init__(
            f"{len(self.errors)} of {len(self.results)} batch items failed "
            f"(item {first_i}: {first.message})",
            hint="BatchError.results holds each item's Completion or error; "
            "Model.batch_iter() hands them over one by one as they finish",
        )

    @property
    def completions(self) -> list[Completion | None]:
        """Each item's Completion, None where it failed."""
        return [r if isinstance(r, Completion) else None for r in self.results]


@dataclass(frozen=True)
class _Job:
    index: int
    messages: list[Message] | None  # None: raw text
    text: str | None
    request: Sampling
    structured: StructuredRequest | None = None


def _prepare(index: int, item: object, base: Sampling,
             structured: StructuredRequest | None = None) -> _Job:
    raw = False
    overrides: Mapping[str, Any] = {}
    if isinstance(item, BatchItem):
        raw, overrides, value = item.raw, item.sampling, item.input
    else:
        value = item  # type: ignore[assignment]
    request = make_sampling(base, **overrides)
    if raw:
        if not isinstance(value, str):
            raise LocalrunError("raw=True takes a prompt string", hint="pass the text itself")
        return _Job(index, None, value, request, structured)
    return _Job(index, normalize_messages(value), None, request, structured)


def _not_started() -> Completion:
    """What an item cancelled before it began comes back as."""
    return Completion("", "cancelled", Usage(0, 0), Timings())


def run_batch(
    model: Model,
    items: Iterable[BatchInput],
    *,
    max_concurrency: int | None,
    cancel: CancelToken | None,
    sampling: Mapping[str, Any],
    structured: StructuredRequest | None = None,
) -> Iterator[tuple[int, BatchResult]]:
    """Validate the batch-wide arguments now; return the iterator of results."""
    if max_concurrency is not None and (
        isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
        or max_concurrency < 1
    ):
        raise LocalrunError(f"Invalid max_concurrency {max_concurrency!r}",
                            hint="pass an integer >= 1, or None to let the engine decide")
    base = make_sampling(**sampling)
    jobs: list[_Job | tuple[int, LocalrunError]] = []
    for i, item in enumerate(list(items)):
        try:
            jobs.append(_prepare(i, item, base, structured))
        except LocalrunError as e:
            jobs.append((i, e))
    return _iterate(model, jobs, max_concurrency, cancel or CancelToken())


def _iterate(
    model: Model,
    jobs: list[_Job | tuple[int, LocalrunError]],
    max_concurrency: int | None,
    cancel: CancelToken,
) -> Iterator[tuple[int, BatchResult]]:
    for j in jobs:
        if isinstance(j, tuple):
            yield j
    ready = [j for j in jobs if isinstance(j, _Job)]
    if not ready:
        return
    session = model._live()
    if session.supports_batch and (max_concurrency is None or max_concurrency > 1):
        yield from _batched(model, ready, max_concurrency, cancel)
    else:
        yield from _in_turn(model, ready, cancel)


def _in_turn(model: Model, jobs: list[_Job], cancel: CancelToken,
             ) -> Iterator[tuple[int, BatchResult]]:
    for job in jobs:
        if cancel.cancelled:
            yield job.index, _not_started()
            continue
        stream = model._stream(job.messages, job.text, job.request, cancel, job.structured)
        try:
            result: BatchResult = stream.join()
        except (ModelClosedError, ModelBusyError):
            raise  # not this item's fault: every later item would fail the same way
        except LocalrunError as e:
            result = e
        finally:
            stream.close()
        yield job.index, result


@dataclass
class _Seq:
    """One sequence of an engine batch, as the API layer tracks it."""

    index: int
    prompt: Prompt
    sampling: ResolvedSampling
    matcher: StopMatcher
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancel: CancelToken = field(default_factory=CancelToken)
    parts: list[str] = field(default_factory=list)
    first: float = 0.0
    hit: bool = False
    done: bool = False
    processor: OutputProcessor | None = None  # structured output / tool calls

    def add(self, text: str) -> None:
        if self.processor is not None:
            text = self.processor.feed(text)[0]
        self.parts.append(text)


def _encode(model: Model, session: Session, job: _Job) -> _Seq:
    sampling = model._resolve(job.request)
    plan = structured_plan(session, job.messages, job.structured)
    prompt = encode_prompt(session, job.messages, job.text, plan)
    ctx = session.info.context_length
    if len(prompt.tokens) >= ctx:
        raise ContextOverflowError(len(prompt.tokens), ctx,
                                   trained_context=session.info.trained_context_length)
    sampling = constrained(session, sampling, plan)
    processor = OutputProcessor(plan) if plan is not None and job.structured is not None \
        else None
    return _Seq(job.index, prompt, sampling, StopMatcher(sampling.stop), processor=processor)


def _finish(seq: _Seq, cancel: CancelToken, t0: float) -> BatchResult:
    seq.done = True
    if seq.hit:
        reason = "stop"
    else:
        seq.add(seq.matcher.flush())
        reason = ("cancelled" if cancel.cancelled else (seq.stats.finish_reason or "length"))
    outcome: _Outcome | None = None
    if seq.processor is not None:
        seq.parts.append(seq.processor.finish()[0])
        result = seq.processor.result(reason)
        reason = result.finish_reason or reason
        outcome = _Outcome()
        outcome.tool_calls, outcome.parsed, outcome.error = \
            result.tool_calls, result.parsed, result.error
    n_prompt = len(seq.prompt.tokens)
    timings = _timings(seq.stats, n_prompt, seq.stats.started or t0, seq.first,
                       time.perf_counter())
    completion = _completion("".join(seq.parts), reason,
                             Usage(n_prompt, seq.stats.completion_tokens), timings, outcome)
    if outcome is not None and outcome.error is not None:
        return outcome.error
    return completion


def _batched(
    model: Model, jobs: list[_Job], max_concurrency: int | None, cancel: CancelToken,
) -> Iterator[tuple[int, BatchResult]]:
    with model._hold():
        session = model._live()
        t0 = time.perf_counter()
        seqs: list[_Seq] = []
        for job in jobs:
            try:
                seqs.append(_encode(model, session, job))
            except LocalrunError as e:
                yield job.index, e
        if not seqs:
            return
        failure: LocalrunError | None = None
        pieces: Iterator[tuple[int, str | None]] | None = None
        try:
            pieces = session.generate_batch(
                [s.prompt for s in seqs], [s.sampling for s in seqs],
                [s.cancel for s in seqs], [s.stats for s in seqs], max_concurrency,
            )
            for k, piece in pieces:
                if cancel.cancelled:
                    for s in seqs:
                        s.cancel.cancel()
                seq = seqs[k]
                if seq.done:
                    continue
                if piece is None:
                    yield seq.index, _finish(seq, cancel, t0)
                    continue
                if seq.hit:
                    continue  # the engine has not seen the stop yet
                if not seq.first:
                    seq.first = time.perf_counter()
                out, hit = seq.matcher.feed(piece)
                seq.add(out)
                if hit:
                    seq.hit = True
                    seq.cancel.cancel()
        except LocalrunError as e:
            failure = e
        except Exception as e:  # an engine failure must not look like a crash
            failure = GenerationError(session.info.backend, f"{type(e).__name__}: {e}")
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()
        for seq in seqs:
            if not seq.done:
                # Sequences the engine ended without a final None still count as done.
                yield seq.index, (failure if failure is not None else
                                  _finish(seq, cancel, t0))
