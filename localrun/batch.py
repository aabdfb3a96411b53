"""Batch generation: many prompts through one Model, each result as soon as it is done.

This module validates a batch (its items, their sampling overrides, the concurrency)
and hands the items to the Model's driver (:mod:`localrun.driver`): sessions with an
engine batcher run up to ``max_concurrency`` sequences at once on the engine thread,
the others run the items in turn. Either way each item gets exactly what
``Model.chat`` would give it: the same sampling resolution, token limit, stop-string
handling, usage and timings, built once in the driver.

Errors are isolated per item: ``Model.batch_iter`` yields ``(index, Completion)`` or
``(index, LocalrunError)``, and ``Model.batch`` raises :class:`BatchError` (which holds
every finished Completion) when any item failed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from localrun.driver import BatchResult, Driver, Request
from localrun.driver.sequence import token_ids
from localrun.errors import LocalrunError
from localrun.reasoning import ReasoningRequest, refuse
from localrun.sampling import make_sampling
from localrun.structured.output import StructuredRequest
from localrun.templates import normalize_messages
from localrun.types import CancelToken, Completion, Message, Sampling

__all__ = ["BatchError", "BatchInput", "BatchItem", "BatchResult", "run_batch"]


@dataclass(frozen=True)
class BatchItem:
    """One batch entry with its own sampling overrides.

    ``input`` is a prompt string (sent as one user message through the chat template)
    or a list of ``{"role", "content"}`` messages; ``raw=True`` completes a string, or a
    list of token ids, without the chat template. ``sampling`` holds the same options as
    ``Model.chat`` (``{"temperature": 0, "max_tokens": 64}``) and overrides the batch-wide
    ones.
    """

    input: str | Sequence[Message] | Sequence[int]
    sampling: Mapping[str, Any] = field(default_factory=dict)
    raw: bool = False


BatchInput = str | Sequence[Message] | BatchItem


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


def _request(item: object, base: Sampling, structured: StructuredRequest | None,
             reasoning: ReasoningRequest | None = None) -> Request:
    raw = False
    overrides: Mapping[str, Any] = {}
    if isinstance(item, BatchItem):
        raw, overrides, value = item.raw, item.sampling, item.input
    else:
        value = item  # type: ignore[assignment]
    request = make_sampling(base, **overrides)
    if raw:
        if reasoning is not None and reasoning.think:
            raise refuse(reasoning, "a raw prompt has no chat template to think in")
        if isinstance(value, str):
            return Request(None, value, request, structured)
        tokens = token_ids(value)  # lm-evaluation-harness sends token ids
        if not tokens:
            raise LocalrunError("raw=True takes a prompt string or a non-empty list of "
                                "token ids", hint="pass the text itself, or its token ids")
        return Request(None, None, request, structured, tokens)
    return Request(normalize_messages(value), None, request, structured, None, reasoning)


def run_batch(
    driver: Driver,
    items: Iterable[BatchInput],
    *,
    max_concurrency: int | None,
    cancel: CancelToken | None,
    sampling: Mapping[str, Any],
    structured: StructuredRequest | None = None,
    reasoning: ReasoningRequest | None = None,
) -> Iterator[tuple[int, BatchResult]]:
    """Validate the batch-wide arguments now; return the iterator of results."""
    if max_concurrency is not None and (
        isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
        or max_concurrency < 1
    ):
        raise LocalrunError(f"Invalid max_concurrency {max_concurrency!r}",
                            hint="pass an integer >= 1, or None to let the engine decide")
    base = make_sampling(**sampling)
    jobs: list[tuple[int, Request]] = []
    invalid: list[tuple[int, BatchResult]] = []
    for i, item in enumerate(list(items)):
        try:
            jobs.append((i, _request(item, base, structured, reasoning)))
        except LocalrunError as e:
            invalid.append((i, e))
    return _iterate(driver, invalid, jobs, max_concurrency, cancel or CancelToken())


def _iterate(driver: Driver, invalid: list[tuple[int, BatchResult]],
             jobs: list[tuple[int, Request]], max_concurrency: int | None,
             cancel: CancelToken) -> Iterator[tuple[int, BatchResult]]:
    yield from invalid  # items refused as given come first
    yield from driver.batch(jobs, max_concurrency, cancel)
