"""localrun's own sampler over an engine's logits (numpy): one call's tokens, chosen.

ONNX Runtime GenAI's backend samples every token with it (onnx_genai's module docstring
says why: a Generator kept across calls has its search options fixed). What it does with
the logits of each step, in the order transformers applies its processors and warpers:

=====================  =========================================================
option                 what is done
=====================  =========================================================
constraint             (the backend) llguidance's mask first: disallowed at -inf
repetition_penalty     every token of the sequence (prompt and reply), as ONNX
                       Runtime GenAI and transformers do: score / penalty, or
                       score * penalty below 0 (llama.cpp and MLX: the last 64)
temperature 0          greedy: the best score (the lowest id among equals)
temperature > 0        softmax(score / temperature) over the kept tokens
top_k (0 = off)        the top_k best scores, ties included (transformers' TopK)
top_p (1 = off)        the smallest set of most likely tokens, among the top_k, whose
                       probability reaches top_p (:func:`_nucleus`, a partial sort)
min_p (0 = off)        drops p < min_p * p_max at the temperature (transformers'
                       MinPLogitsWarper), after top_k and top_p
seed                   numpy's PCG64(seed), one per call: the same seed, the same
                       draws (the driver draws a seed when the caller gives none)
=====================  =========================================================

A draw walks the kept tokens best first (top_k, top_p; by id among equals), or by id
(min_p alone, no filter), and takes the first whose running weight passes one uniform
number times the kept tokens' total: one ``rng.random()`` per token.

Only the kept tokens are ever sorted (top_k and top_p find their pool in one pass over the
vocabulary), so a token costs a small share of a small model's step, where the engine's own
sampler sorts the whole vocabulary at top_p alone. Timings: docs/results/kv_reuse.md,
"Decode overhead" (scripts/bench_onnx_steps.py).
"""

from __future__ import annotations

import math
from typing import Any

from localrun.sampling import ResolvedSampling

#: Below this temperature float32 weights overflow; it samples the best token anyway.
MIN_TEMPERATURE = 1e-4

#: Tokens per block of a draw over the whole vocabulary: numpy's cumsum takes ~8 ns a
#: token (0.4 ms over a 49k vocabulary, as long as a small model's decode step), block
#: sums ~0.5 ns.
BLOCK = 1024

#: top_k's threshold for its pool: the k-th best of every STRIDE-th score. At least k
#: scores reach it (those k), so one pass over the vocabulary finds a pool that holds
#: the top k (about k * STRIDE tokens), and only the pool is sorted.
STRIDE = 8


class LogitsSampler:
    """One call's choice of each token from an engine's logits, in transformers' order:
    repetition penalty, temperature, top_k, top_p, min_p (the module's table)."""

    def __init__(self, sampling: ResolvedSampling, prompt: Any) -> None:
        import numpy as np

        self._np = np
        self.sampling = sampling
        self.penalty = sampling.repetition_penalty
        # the penalty's tokens: the whole sequence, prompt included
        self.seen: set[int] | None = None
        self.seen_ids = np.unique(prompt) if self.penalty != 1.0 else None
        if self.seen_ids is not None:
            self.seen = {int(t) for t in self.seen_ids}
        self.rng = None if sampling.greedy else np.random.Generator(
            np.random.PCG64(sampling.seed))
        self.temperature = max(sampling.temperature, MIN_TEMPERATURE)
        #: greedy without a penalty: what the kept Generator's own search does
        self.plain = self.rng is None and self.seen is None
        #: float32 scratch of the vocabulary's size (the weights), made at the first draw
        self._work: Any = None
        self._starts: Any = None  # the first token of each BLOCK

    def choose(self, scores: Any) -> int:
        """The next token; ``scores`` (float32, one per vocabulary entry) may be changed."""
        np = self._np
        if self.seen_ids is not None:
            ids = self.seen_ids
            ids = ids[(ids >= 0) & (ids < scores.shape[0])]
            hit = scores[ids]
            scores[ids] = np.where(hit < 0, hit * self.penalty, hit / self.penalty)
        if self.rng is None:
            token = int(np.argmax(scores))
        else:
            if self._work is None or self._work.shape[0] != scores.shape[0]:
                self._work = np.empty(scores.shape[0], dtype=np.float32)
                self._starts = np.arange(0, scores.shape[0], BLOCK)
            kept, cum = _filtered(scores, self.sampling, self._work)
            token = self._draw_all(scores) if kept is None else self._draw(kept, cum)
        if self.seen is not None and token not in self.seen:
            self.seen.add(token)
            self.seen_ids = np.append(self.seen_ids, token)
        return token

    def _draw(self, kept: Any, cum: Any) -> int:
        """One of ``kept``, by ``cum`` (their running weights): the first past r * total."""
        np = self._np
        assert self.rng is not None
        r = self.rng.random() * cum[-1]
        i = int(np.searchsorted(cum, r, side="right"))  # the first past r: weight > 0
        if i == cum.shape[0]:  # rounding took r to the total: the last that can come
            i = int(np.searchsorted(cum, cum[-1]))
        return int(kept[i])

    def _draw_all(self, scores: Any) -> int:
        """One token from softmax(scores / temperature) over the whole vocabulary: a
        block of :data:`BLOCK` tokens by the blocks' sums, then the token inside it."""
        np = self._np
        assert self.rng is not None
        weights = np.subtract(scores, scores.max(), out=self._work)
        weights *= np.float32(1.0 / self.temperature)
        np.exp(weights, out=weights)  # 1 for the best token, 0 for a masked one
        starts = self._starts
        sums = np.add.reduceat(weights, starts, dtype=np.float64)
        cum = np.cumsum(sums)
        r = self.rng.random() * cum[-1]
        b = int(np.searchsorted(cum, r, side="right"))  # the first block past r: sum > 0
        if b == cum.shape[0]:  # rounding took r to the total
            b = int(np.flatnonzero(sums)[-1])
        block = weights[starts[b]:starts[b] + BLOCK]
        inner = np.cumsum(block, dtype=np.float64)
        i = int(np.searchsorted(inner, r - (cum[b - 1] if b else 0.0), side="right"))
        if i == block.shape[0]:  # rounding again: the block's last token that can come
            i = int(np.flatnonzero(block)[-1])
        return i + int(starts[b])


def kept_tokens(scores: Any, sampling: ResolvedSampling) -> Any:
    """The token ids top_k, top_p and min_p keep of the (penalized) ``scores``, or None
    when none of them is on: top_k's best, top_p's nucleus among those, then min_p's
    p >= min_p * p_max (p_max is in every set, so the sets intersect). A masked token
    (-inf) is never kept, even where fewer than top_k others remain: it cannot come."""
    return _filtered(scores, sampling, None)[0]


def _filtered(scores: Any, sampling: ResolvedSampling, work: Any) -> tuple[Any, Any]:
    """(ids, cum): the kept tokens in the order a draw walks them (best first, by id
    among equals; by id for min_p alone) and the running sum of their weights
    exp((score - best) / T), float64; (None, None) when no filter is on. ``work``: a
    float32 scratch of the vocabulary's size, or None (one is made)."""
    import numpy as np

    temperature = max(sampling.temperature, MIN_TEMPERATURE)
    min_p = sampling.min_p
    if 0 < sampling.top_k < scores.shape[0]:
        ids, neg = _top_k(scores, sampling.top_k)
        if not ids.shape[0]:  # every token masked: nothing can come; the first, then
            return np.zeros(1, dtype=np.intp), np.ones(1)
        # float64 weights: k of them cost nothing, and the top_p cut sums exactly
        cum = np.cumsum(np.exp((neg[0] - neg) * np.float64(1.0 / temperature)))
        n = ids.shape[0]
        if sampling.top_p < 1.0:
            n = min(int(np.searchsorted(cum, sampling.top_p * cum[-1])) + 1, n)
        if min_p > 0:  # best first: min_p keeps a prefix (float32, as the scores)
            cut = -neg[0] + temperature * math.log(min_p)
            n = min(n, int(np.searchsorted(neg, -cut, side="right")))
        return ids[:n], cum[:n]
    if sampling.top_p < 1.0:
        return _nucleus(scores, sampling.top_p, temperature, min_p, work)
    if min_p > 0:  # by id: the tokens at least min_p times as likely as the best
        best = scores.max()
        ids = np.flatnonzero(scores >= best + temperature * math.log(min_p))
        w = np.subtract(scores[ids], best, dtype=np.float32)
        w *= np.float32(1.0 / temperature)
        return ids, np.cumsum(np.exp(w, out=w), dtype=np.float64)
    return None, None


def _top_k(scores: Any, k: int) -> tuple[Any, Any]:
    """(ids, -scores) of the k best scores (ties at the k-th included, as transformers'
    TopK), best first (by id among equals); masked tokens (-inf) left out. Their pool
    comes from one pass over the vocabulary (:data:`STRIDE`): only it is sorted."""
    import numpy as np

    sample = scores[::STRIDE]
    m = sample.shape[0]
    cut = np.partition(sample, m - k)[m - k] if m > k else -np.inf
    # at least k scores reach cut; at -inf, fewer than k are finite: those, then
    ids = np.flatnonzero(scores >= cut) if cut > -np.inf else np.flatnonzero(scores > cut)
    neg = np.negative(scores[ids])  # ascending = best first
    if neg.shape[0] > 16 * k:  # a pool larger than usual: its k best (ties) first
        keep = neg <= np.partition(neg, k - 1)[k - 1]
        ids = ids[keep]
        neg = neg[keep]
    order = np.argsort(neg, kind="stable")  # by id among equals: ids ascend
    neg = neg[order]
    n = neg.shape[0]
    if n > k:  # the k-th's ties too (a scalar test first: ties are rare)
        n = k if neg[k] > neg[k - 1] else int(np.searchsorted(neg, neg[k - 1], side="right"))
    return ids[order[:n]], neg[:n]


def _nucleus(scores: Any, top_p: float, temperature: float, min_p: float, work: Any
             ) -> tuple[Any, Any]:
    """(ids, cum): the top_p nucleus of softmax(scores / T), best first (by id among
    equals), with the running sum of its weights (relative to the best token's,
    float64); with min_p, the prefix of it that min_p keeps.

    Sorting the whole vocabulary costs ~3-8 ms a token on a 2-core CPU (as much as a
    SmolLM2-135M step), so only a set that holds the nucleus is sorted
    (:func:`_holding`), or min_p's tokens where they are fewer."""
    import numpy as np

    best = scores.max()
    probs = np.subtract(scores, best, out=work) if work is not None else scores - best
    probs *= np.float32(1.0 / temperature)
    np.exp(probs, out=probs)  # relative to the best token's: 1 for it
    target = top_p * float(probs.sum(dtype=np.float64))
    cut = best + temperature * math.log(min_p) if min_p > 0 else None
    top = None if cut is None else np.flatnonzero(scores >= cut)
    if top is None or top.shape[0] > 2048:
        top = _holding(probs, target)
    top = top[np.argsort(-scores[top], kind="stable")]
    cum = np.cumsum(probs[top], dtype=np.float64)
    n = min(int(np.searchsorted(cum, target)) + 1, top.shape[0])
    if cut is not None:  # best first: min_p keeps a prefix
        n = min(n, int(np.count_nonzero(scores[top[:n]] >= cut)))
    return top[:n], cum[:n]


def _holding(probs: Any, target: float) -> Any:
    """Token ids whose weights reach ``target``, with every token at least as likely as
    any of them (so the nucleus is theirs): those at least 1e-3 times as likely as the
    best (a few hundred), else the 64 most likely if those are many (a flat
    distribution), then 8 times more until their mass suffices. Sets are summed, not
    sorted, until one holds the nucleus."""
    import numpy as np

    size = probs.shape[0]
    top = np.flatnonzero(probs >= 1e-3)
    k = 0 if top.shape[0] <= 2048 else 64
    while True:
        if k >= size:
            return np.arange(size)
        if k:  # the k most likely, ties included
            top = np.flatnonzero(probs >= np.partition(probs, size - k)[size - k])
        # a margin over rounding: a cumsum of the sorted set must reach target too
        if probs[top].sum(dtype=np.float64) >= target * (1 + 1e-9):
            return top
        k = min(max(k, top.shape[0], 8) * 8, size)
