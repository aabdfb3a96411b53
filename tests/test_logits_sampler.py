"""localrun's numpy sampler (ONNX Runtime GenAI's tokens) against its table's semantics.

The sampler sorts only the tokens that can matter (a strided guess for top_k's pool, a
few likely ones for top_p) for speed; these tests hold it to a whole-vocabulary sort at
the vocabulary's real size (SmolLM2: 49152), where the shortcuts act, including where
they are hardest: ties at the top_k-th score and at top_p's boundary, likely tokens all
in (or all out of) the strided sample, a nucleus that needs the unlikely tail, masked
tokens, min_p after top_p, a tiny temperature. No model is loaded.
"""

from __future__ import annotations

from typing import Any

import pytest

np = pytest.importorskip("numpy", reason="the ONNX backend's sampler runs on numpy")

from localrun.backends.logits_sampler import (  # noqa: E402
    STRIDE,
    LogitsSampler,
    kept_tokens,
)
from localrun.sampling import ResolvedSampling  # noqa: E402

VOCAB = 49152


def opts(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
         seed: int = 0) -> ResolvedSampling:
    return ResolvedSampling(max_tokens=8, temperature=temperature, top_p=top_p, top_k=top_k,
                            min_p=min_p, repetition_penalty=1.0, seed=seed, stop=())


def whole_sort_keep(scores: Any, s: ResolvedSampling) -> list[int]:
    """The kept tokens, best first (by id among equals), from a sort of the whole
    vocabulary in float64, as the module's table defines them: top_k with ties, then
    the nucleus (tokens while the mass before them is under top_p), then min_p. A
    masked token (-inf) is never kept."""
    x = scores.astype(np.float64)
    t = max(s.temperature, 1e-4)
    order = np.lexsort((np.arange(x.shape[0]), -x))
    order = order[np.isfinite(x[order])]
    if s.top_k:
        order = order[x[order] >= np.sort(x[order])[-min(s.top_k, order.shape[0])]]
    if s.top_p < 1.0:
        cum = np.cumsum(np.exp((x[order] - x.max()) / t))
        order = order[:int(np.searchsorted(cum, s.top_p * cum[-1])) + 1]
    if s.min_p > 0:
        order = order[x[order] >= x.max() + t * np.log(s.min_p)]
    return [int(i) for i in order]


def logits(seed: int, ties: bool = False) -> Any:
    """Vocabulary-sized scores shaped like a small model's: a long flat tail, a few
    hundred plausible tokens, a handful of likely ones. ``ties``: rounded to 0.25, so
    the k-th score and the nucleus boundary fall in groups of equal scores."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(VOCAB) * 2.0
    x[rng.choice(VOCAB, 300, replace=False)] += rng.uniform(4, 9, 300)
    x[rng.choice(VOCAB, 5, replace=False)] += 12
    if ties:
        x = np.round(x * 4) / 4
    return x.astype(np.float32)


CONFIGS = [
    opts(top_k=40), opts(top_k=40, top_p=0.9), opts(top_p=0.9), opts(temperature=0.7,
    top_p=0.95), opts(top_k=40, top_p=0.95, min_p=0.05), opts(top_p=0.9, min_p=0.02),
    opts(min_p=0.05), opts(temperature=2.5, top_p=0.5), opts(temperature=60.0, top_p=0.9),
    opts(top_k=1000, top_p=0.99), opts(top_k=3), opts(temperature=0.3, top_k=40, top_p=0.9),
]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("s", CONFIGS, ids=lambda s: f"T{s.temperature}-k{s.top_k}"
                         f"-p{s.top_p}-minp{s.min_p}")
def test_kept_tokens_are_a_whole_sorts(s: ResolvedSampling, ties: bool) -> None:
    """The tokens kept, and their order (best first, by id among equals; by id for min_p
    alone), are those of a sort of the whole vocabulary, with or without ties."""
    for seed in range(6):
        x = logits(seed, ties)
        want = whole_sort_keep(x, s)
        if not (s.top_k or s.top_p < 1.0):
            want.sort()
        assert kept_tokens(x.copy(), s).tolist() == want, seed


def test_top_k_keeps_every_tie_at_the_kth_score_wherever_it_is() -> None:
    """k = 3 with five tokens tied at the 3rd best score, in and out of the strided
    sample top_k's pool starts from: all five are kept (transformers' TopK)."""
    x = np.full(VOCAB, -5.0, dtype=np.float32)
    x[[7, 30001]] = [9.0, 8.0]
    tied = [1, 16 * 5, 16 * 5 + 3, 20000, VOCAB - 1]  # two of them sampled (id % 16 == 0)
    x[tied] = 6.0
    assert kept_tokens(x.copy(), opts(top_k=3)).tolist() == [7, 30001, *tied]
    assert kept_tokens(x.copy(), opts(top_k=2)).tolist() == [7, 30001]
    x[tied[1:]] = 5.99  # now one is the 3rd best alone
    assert kept_tokens(x.copy(), opts(top_k=3)).tolist() == [7, 30001, 1]


@pytest.mark.parametrize("where", [0, 1], ids=["likely-tokens-sampled", "none-sampled"])
def test_top_k_when_the_likely_tokens_share_one_stride_class(where: int) -> None:
    """The likely tokens all in the strided sample (its k-th best is high) or all out of
    it (its k-th best is in the tail): the pool still holds the top k."""
    rng = np.random.default_rng(where)
    x = (rng.standard_normal(VOCAB) * 2).astype(np.float32)
    likely = np.arange(where, VOCAB, STRIDE)[:200]
    x[likely] += 10
    for s in (opts(top_k=40), opts(top_k=40, top_p=0.9), opts(top_k=250)):
        assert kept_tokens(x.copy(), s).tolist() == whole_sort_keep(x, s)


def test_top_p_boundary() -> None:
    """Probabilities 0.5, 0.25, 0.125, 0.125: top_p just under 0.75 keeps 2 tokens, just
    over keeps 3 (of the tied pair, the lower id); under 0.5, the best alone."""
    x = np.full(VOCAB, -np.inf, dtype=np.float32)
    ids = [900, 40000, 12, 33]  # 12 and 33 tied
    x[ids] = np.log([0.5, 0.25, 0.125, 0.125])
    assert kept_tokens(x.copy(), opts(top_p=0.75 - 1e-4)).tolist() == [900, 40000]
    assert kept_tokens(x.copy(), opts(top_p=0.75 + 1e-4)).tolist() == [900, 40000, 12]
    assert kept_tokens(x.copy(), opts(top_p=0.5 - 1e-4)).tolist() == [900]
    assert kept_tokens(x.copy(), opts(top_p=0.5 + 1e-4)).tolist() == [900, 40000]
    assert kept_tokens(x.copy(), opts(top_p=0.999)).tolist() == [900, 40000, 12, 33]


def test_a_nucleus_that_needs_the_unlikely_tail() -> None:
    """Three likely tokens with 60% of the mass, the rest spread over 40,000 tokens each
    under 1e-3 of the best's: top_p 0.9 needs thousands of the tail, in score order."""
    rng = np.random.default_rng(3)
    x = np.full(VOCAB, -np.inf, dtype=np.float32)
    tail = rng.choice(VOCAB, 40000, replace=False)
    x[tail] = np.log(rng.uniform(0.5, 1.5, 40000) * 0.4 / 40000)
    x[[5, 6, 7]] = np.log([0.3, 0.2, 0.1])
    for s in (opts(top_p=0.9), opts(top_p=0.9, min_p=1e-4), opts(top_p=0.7)):
        kept = kept_tokens(x.copy(), s).tolist()
        assert kept == whole_sort_keep(x, s)
    assert len(kept_tokens(x.copy(), opts(top_p=0.9))) > 10000


def test_min_p_comes_after_top_p() -> None:
    """p = 0.40, 0.30, 0.05 and 25 tokens at 0.01; top_p 0.795, min_p 0.1 (p >= 0.04).
    The nucleus of the whole distribution is the 3 likely tokens and 5 of the 0.01 ones;
    min_p then drops those 5. min_p first would leave 0.40 / 0.30 / 0.05 renormalized,
    whose 0.795 nucleus is 2 tokens."""
    x = np.full(VOCAB, -np.inf, dtype=np.float32)
    small = list(range(100, 125))
    x[[3000, 2000, 1000]] = np.log([0.40, 0.30, 0.05])
    x[small] = np.log(0.01)
    assert kept_tokens(x.copy(), opts(top_p=0.795)).tolist() == [3000, 2000, 1000, *small[:5]]
    for s in (opts(top_p=0.795, min_p=0.1), opts(top_k=20, top_p=0.795, min_p=0.1)):
        assert kept_tokens(x.copy(), s).tolist() == [3000, 2000, 1000]


def test_min_p_with_top_k_is_relative_to_the_best() -> None:
    """min_p compares with the best token's p (top_k always keeps it): with top_k 2 or 3,
    min_p 0.3 keeps p >= 0.3 * p_max of them, min_p 0.6 the best alone."""
    x = np.full(VOCAB, -3.0, dtype=np.float32)
    x[[10, 20, 30]] = [2.0, 2.0 + np.log(0.5), 2.0 + np.log(0.2)]
    assert kept_tokens(x.copy(), opts(top_k=2, min_p=0.3)).tolist() == [10, 20]
    assert kept_tokens(x.copy(), opts(top_k=3, min_p=0.3)).tolist() == [10, 20]
    assert kept_tokens(x.copy(), opts(top_k=2, min_p=0.6)).tolist() == [10]


def test_fewer_unmasked_tokens_than_top_k() -> None:
    """A structured-output mask leaves 10 tokens: top_k 40 keeps those 10 (the masked
    ones cannot come), and draws come only from them."""
    rng = np.random.default_rng(8)
    x = np.full(VOCAB, -np.inf, dtype=np.float32)
    allowed = np.sort(rng.choice(VOCAB, 10, replace=False))
    x[allowed] = rng.standard_normal(10).astype(np.float32)
    assert sorted(kept_tokens(x.copy(), opts(top_k=40)).tolist()) == allowed.tolist()
    s = opts(top_k=40, top_p=0.95, seed=3)
    assert kept_tokens(x.copy(), s).tolist() == whole_sort_keep(x, s)
    sampler = LogitsSampler(s, np.array([], dtype=np.int32))
    assert {sampler.choose(x.copy()) for _ in range(200)} <= set(allowed.tolist())


@pytest.mark.parametrize("s", [
    opts(temperature=1e-300), opts(temperature=1e-300, top_k=40), opts(temperature=1e-300,
    top_p=0.9), opts(temperature=1e-300, min_p=0.5), opts(temperature=1e-4, top_k=40,
    top_p=0.9), opts(temperature=1e-7, top_p=0.9),
], ids=["none", "top_k", "top_p", "min_p", "top_k-top_p", "1e-7"])
def test_a_tiny_temperature_draws_the_best_token(s: ResolvedSampling) -> None:
    """Below MIN_TEMPERATURE, 1 / T would overflow float32 (inf, then NaN weights); every
    draw is the best token (a runner-up 0.05 below it has weight exp(-500): none)."""
    x = logits(4)
    best = int(np.argmax(x))
    x[best - 1] = x[best] - 0.05
    sampler = LogitsSampler(s, np.array([], dtype=np.int32))
    with np.errstate(over="raise", invalid="raise"):  # no inf / NaN weights on the way
        assert {sampler.choose(x.copy()) for _ in range(100)} == {best}


@pytest.mark.parametrize("s", [
    opts(top_k=40, top_p=0.9, seed=1), opts(top_p=0.9, seed=2), opts(temperature=0.7, seed=3),
    opts(top_k=40, seed=4), opts(top_p=0.95, min_p=0.05, seed=5), opts(min_p=0.05, seed=6),
], ids=["top_k-top_p", "top_p", "temperature", "top_k", "top_p-min_p", "min_p"])
def test_draws_follow_the_kept_distribution_and_the_seed(s: ResolvedSampling) -> None:
    """Over a vocabulary-sized row: each token comes as often as softmax(score / T)
    renormalized over the kept tokens says (never one outside them), and the same seed
    draws the same tokens."""
    x = logits(5)
    x[np.argsort(-x)[:6]] = x.max() - np.arange(6, dtype=np.float32) * 0.4  # a spread head
    kept = whole_sort_keep(x, s) if (s.top_k or s.top_p < 1 or s.min_p) else list(range(VOCAB))
    t = s.temperature
    p = np.zeros(VOCAB)
    p[kept] = np.exp((x[kept].astype(np.float64) - x.max()) / t)
    p /= p.sum()
    draws = 3000
    sampler = LogitsSampler(s, np.array([], dtype=np.int32))
    got = np.array([sampler.choose(x.copy()) for _ in range(draws)])
    assert p[got].min() > 0  # only kept tokens
    likely = np.argsort(-p)[:8]
    counts = np.bincount(got, minlength=VOCAB)[likely]
    want = draws * p[likely]
    assert (np.abs(counts - want) < 5 * np.sqrt(want * (1 - p[likely])) + 2).all(), (
        counts, want)
    again = LogitsSampler(s, np.array([], dtype=np.int32))
    assert [again.choose(x.copy()) for _ in range(draws)] == got.tolist()
