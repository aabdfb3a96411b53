"""How each MLX sequence samples, alone or in a batch: greedy (argmax) at temperature 0;
otherwise the temperature first, then top_k, top_p, min_p (:func:`seeded_sampler`), and
the repetition penalty over the last :data:`REPETITION_CONTEXT` tokens (prompt included)
as a logits processor, after the structured-output mask.

**Seeds are per sequence**: mlx's ``mx.random.seed`` is one global stream, which
sequences sharing a step would draw from in turn (a reply would depend on its
neighbours), so each sequence draws from its own key chain, ``mx.random.key(seed)``
split once per token. That chain is exactly the global stream ``mx.random.seed(seed)``
starts, so a seed gives the same reply alone or in a batch, next to any other sequences.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from localrun.backends.mlx.constraints import mlx_processor
from localrun.sampling import ResolvedSampling
from localrun.structured.grammar import TokenMask

#: Tokens the repetition penalty looks back over (llama.cpp's default repeat_last_n).
REPETITION_CONTEXT = 64


def seeded_sampler(sampling: ResolvedSampling) -> Callable[[Any], Any] | None:
    """A sampler drawing from this sequence's own key chain; None at temperature 0
    (greedy: the generator's shared argmax, one call for every greedy sequence).

    The log-probabilities are divided by the temperature and renormalized first (so a
    low temperature cannot underflow top_p's probabilities to 0), then top_k, top_p and
    min_p act in transformers' order; mlx-lm's ``make_sampler`` would apply the
    temperature last and top_p before top_k (so top_p=0.05 at temperature 50 would keep
    only the most likely token). The draw is mlx-lm's ``categorical_sampling`` with the
    sequence's key. mlx-lm's ``logits_processors`` (repetition penalty, structured
    output) run before any sampler, as transformers' processors run before its warpers.
    """
    if sampling.greedy:
        return None
    import mlx.core as mx
    from mlx_lm import sample_utils as su

    inv_t = 1.0 / sampling.temperature
    top_k, top_p, min_p = sampling.top_k, sampling.top_p, sampling.min_p
    key = mx.random.key(0 if sampling.seed is None else sampling.seed)

    def sample(logprobs: Any) -> Any:
        nonlocal key
        x = logprobs * inv_t
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if 0 < top_k < x.shape[-1]:
            x = su.apply_top_k(x, top_k)
        if 0 < top_p < 1.0:
            x = su.apply_top_p(x, top_p)
        if min_p > 0:
            x = su.apply_min_p(x, min_p, 1)
        # mx.random.seed(s) then categorical() draws key(s) split as here, token by token
        key, sub = mx.random.split(key)
        return mx.random.categorical(x, key=sub)

    return sample


def sequence_processors(sampling: ResolvedSampling, mask: TokenMask | None,
                        n_prompt: int) -> list[Callable[[Any, Any], Any]]:
    """The logits processors of one sequence: the structured-output mask first (the
    penalty then sees only allowed tokens), then the repetition penalty. mlx-lm calls
    them with every token so far, of which the first ``n_prompt`` are the prompt."""
    procs: list[Callable[[Any, Any], Any]] = []
    if mask is not None:
        procs.append(mlx_processor(mask, n_prompt))
    if sampling.repetition_penalty != 1.0:
        from mlx_lm.sample_utils import make_logits_processors

        procs.extend(make_logits_processors(repetition_penalty=sampling.repetition_penalty,
                                            repetition_context_size=REPETITION_CONTEXT))
    return procs


def reuse_processors(sampling: ResolvedSampling, mask: TokenMask | None,
                     tokens: Sequence[int], reused: int
                     ) -> list[Callable[[Any, Any], Any]] | None:
    """:func:`sequence_processors` for ``generate_step`` over a cache already holding
    ``tokens[:reused]``. It passes the processors only the tokens it was given (the rest
    of the prompt) and the reply: the penalty's window of cached tokens goes in front,
    so that it sees what it sees without reuse. None: no processors."""
    head = list(tokens[max(reused - REPETITION_CONTEXT, 0):reused])
    procs = sequence_processors(sampling, mask, len(head) + len(tokens) - reused)
    if not procs:
        return None
    if not head:
        return procs
    import mlx.core as mx

    before = mx.array(head)

    def run(given: Any, logits: Any) -> Any:
        context = mx.concatenate([before, given.astype(before.dtype)])
        for p in procs:
            logits = p(context, logits)
        return logits

    return [run]


class RawLogits:
    """Log probabilities are the raw model's (:mod:`localrun.backends.logprobs`), but
    mlx-lm hands over its log-softmax after the logits processors (the penalty, the
    mask): where a sequence has processors, this one goes first and keeps each step's
    raw logits, in order (mlx-lm computes a step ahead, so a queue)."""

    def __init__(self) -> None:
        self.rows: deque[Any] = deque()

    def __call__(self, _tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        # a new array: the processors after it assign into ``logits`` (__setitem__
        # rebinds that array object to the changed values)
        self.rows.append(mx.array(logits))
        return logits

    def row(self, given: Any) -> Any:
        """The raw row of the token just drawn, as float32 numpy: the kept one, or
        ``given`` (mlx-lm's own log-softmax, raw where there are no processors)."""
        import mlx.core as mx
        import numpy as np

        row = self.rows.popleft() if self.rows else given
        return np.array(row.astype(mx.float32)).reshape(-1)


def with_raw(procs: list[Callable[[Any, Any], Any]] | None, wanted: bool
             ) -> tuple[list[Callable[[Any, Any], Any]] | None, RawLogits | None]:
    """``procs`` with a :class:`RawLogits` first where log probabilities are asked for
    (a RawLogits without rows where there are none: mlx-lm's own are raw then)."""
    if not wanted:
        return procs, None
    raw = RawLogits()
    return ([raw, *procs] if procs else procs), raw
