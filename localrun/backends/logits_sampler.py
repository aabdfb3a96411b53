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

Cost per token on a 2-core x86 CPU, 49152-token vocabulary: ~0.2 ms for top_p 0.9
without top_k (the engine's own sampler took ~9 ms more: it sorts the vocabulary).
"""

from __future__ import annotations

import math
from typing import Any

from localrun.sampling import ResolvedSampling

#: Below this temperature float32 weights overflow; it samples the best token anyway.
MIN_TEMPERATURE = 1e-4

#: Tokens per block of a draw: numpy's cumsum takes ~8 ns a token (0.4 ms over a 49k
#: vocabulary, as long as a small model's decode step), block sums ~0.5 ns.
BLOCK = 1024


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
            token = self._draw(scores, kept_tokens(scores, self.sampling))
        if self.seen is not None and token not in self.seen:
            self.seen.add(token)
            self.seen_ids = np.append(self.seen_ids, token)
        return token

    def _draw(self, scores: Any, kept: Any) -> int:
        """One token from softmax(scores / temperature) over ``kept`` (None: all): a
        block of :data:`BLOCK` tokens by the blocks' sums, then the token inside it."""
        np = self._np
        assert self.rng is not None
        pool = scores if kept is None else scores[kept]
        weights = np.subtract(pool, pool.max(), dtype=np.float32)
        weights /= np.float32(self.temperature)
        np.exp(weights, out=weights)  # 1 for the best token, 0 for a masked one
        starts = np.arange(0, weights.shape[0], BLOCK)
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
        i += int(starts[b])
        return i if kept is None else int(kept[i])


def kept_tokens(scores: Any, sampling: ResolvedSampling) -> Any:
    """The token ids top_k, top_p and min_p keep of the (penalized) ``scores``, or None
    when none of them is on: top_k's best, top_p's nucleus among those, then min_p's
    p >= min_p * p_max (p_max is in every set, so the sets intersect)."""
    import numpy as np

    size = scores.shape[0]
    top_k = sampling.top_k if 0 < sampling.top_k < size else 0
    kept = None
    if sampling.top_p < 1.0:
        kept = _nucleus(scores, sampling)
    elif top_k:
        kept = _top_k(scores, top_k)
    if sampling.min_p > 0:
        temperature = max(sampling.temperature, MIN_TEMPERATURE)
        cut = scores.max() + temperature * math.log(sampling.min_p)
        kept = np.flatnonzero(scores >= cut) if kept is None else kept[scores[kept] >= cut]
    return kept


def _top_k(scores: Any, k: int) -> Any:
    """The ids of the k best scores (ties at the k-th included, as transformers' TopK),
    best first (by id among equals). They lie among the tokens near the best: the pool
    widens until it holds k, so the whole vocabulary is rarely partitioned."""
    import numpy as np

    best = scores.max()
    width = 8.0
    pool = np.flatnonzero(scores >= best - width)
    while pool.shape[0] < k:
        width = width * 4 if width < 1e4 else math.inf
        pool = np.flatnonzero(scores >= best - width)
    if pool.shape[0] > k:
        near = scores[pool]
        cut = np.partition(near, near.shape[0] - k)[near.shape[0] - k]
        pool = pool[near >= cut]
    return pool[np.argsort(-scores[pool], kind="stable")]


def _nucleus(scores: Any, sampling: ResolvedSampling) -> Any:
    """The token ids of the top_p nucleus of softmax(scores / T) over the top_k.

    Sorting the whole vocabulary costs ~3-8 ms a token on a 2-core CPU (as much as a
    SmolLM2-135M step), so only the most likely tokens are sorted: the top_k
    (:func:`_top_k`); without top_k, the tokens at least 1e-3 times as likely as the
    best, then eight times more tokens while their mass stays short of top_p."""
    import numpy as np

    size = scores.shape[0]
    best = scores.max()
    inv_t = np.float32(1.0 / max(sampling.temperature, MIN_TEMPERATURE))
    if 0 < sampling.top_k < size:
        pool = _top_k(scores, sampling.top_k)
        mass = np.cumsum(np.exp((scores[pool] - best) * inv_t), dtype=np.float64)
        n = int(np.searchsorted(mass, sampling.top_p * mass[-1])) + 1
        return pool[:min(n, pool.shape[0])]
    probs = np.subtract(scores, best, dtype=np.float32)
    probs *= inv_t
    np.exp(probs, out=probs)  # relative to the best token's: 1 for it
    target = sampling.top_p * float(probs.sum(dtype=np.float64))
    # first the tokens at least 1e-3 times as likely as the best (a few hundred), unless
    # the distribution is flat (a high temperature): then the k most likely
    top = np.flatnonzero(probs >= 1e-3)
    k = 0 if top.shape[0] <= 2048 else 64
    while True:
        if k:  # the k most likely, ties included
            top = np.flatnonzero(scores >= np.partition(scores, size - k)[size - k]) \
                if k < size else np.arange(size)
        top = top[np.argsort(-scores[top], kind="stable")]  # by id among equals
        mass = np.cumsum(probs[top], dtype=np.float64)
        if mass[-1] >= target or top.shape[0] >= size:
            n = int(np.searchsorted(mass, target)) + 1
            return top[:min(n, top.shape[0])]
        k = min(max(k, top.shape[0], 8) * 8, size)
