"""Speculative decoding, the part every engine shares: which engine speculates how
(:data:`SUPPORT`), and the auto policy that keeps it on only where it measurably wins.

A speculative round drafts ``k`` tokens (from the prompt's n-grams, :mod:`.ngram`, or a
draft model) and has the target model score the last token and the ``k`` drafts in one
batched decode; the drafts the target would have chosen itself are kept, and the target's
own token at the first miss comes free. Whether that wins depends on two measured things:
how much a decode of ``k + 1`` tokens costs against a decode of one (llama.cpp's CPU
kernels: about 1.1x for an F32 model here, about 4x for Q8_0, whose batched kernel is
slow) and how many drafts are accepted (a copying task: nearly all; open chat: few).

**The auto policy** (``speculative="auto"``) is a cost model kept per loaded model
(:class:`History`: the seconds of a one-token step, the cost of each batch size relative
to it, the draft model's cost, recent acceptance) and a per-request :class:`Governor`
that, before each round, picks the draft length with the most expected tokens per unit
of cost (accepting each draft with the request's measured rate), or none when plain
decoding is expected to win by :data:`MARGIN`. So a model whose batches cost too much,
or a request whose drafts miss, decodes plainly after a round or two (and tries again
only rarely, :data:`EXPLORE_EVERY`); a request that cannot gain loses at most those
rounds.
"""

from __future__ import annotations

import time
from collections import deque

from localrun.errors import LocalrunError
from localrun.types import SpeculativeMode

#: Most tokens drafted per round (llama-lookup's default is 3; a copying task gains from
#: more where a batch costs little more than one token).
DRAFT_MAX = 8
#: Plain decoding wins ties: a round must be expected to give this much more per second.
MARGIN = 0.05
#: Acceptance a model starts from before any request measured its own (optimistic, so
#: that a first round is tried; one miss brings it down).
PRIOR_ACCEPTANCE = 0.6
#: Weight (in drafted tokens) of the model's history in a request's acceptance estimate.
PRIOR_WEIGHT = 4.0
#: Tokens decoded plainly, after auto stopped drafting, before it tries one round again,
#: and the draft that round needs at least (a long repeat in the text).
EXPLORE_EVERY = 256
EXPLORE_DRAFT = 4
#: Samples kept per figure, and how many a batch size's cost needs before it counts.
SAMPLES = 4
MIN_SAMPLES = 3


class History:
    """What one loaded model has measured: a one-token step's seconds, each batch size's
    cost relative to it, a drafted token's cost (draft models), and recent acceptance.

    Timings on a busy machine only ever come out slower than the work is, so each
    figure is the least of its recent samples, and a batch size's cost counts only once
    it has :data:`MIN_SAMPLES` of them (until then auto tries that size again)."""

    def __init__(self) -> None:
        self._steps: deque[float] = deque(maxlen=8)
        self._ratios: dict[int, deque[float]] = {}
        self._draft: deque[float] = deque(maxlen=SAMPLES)
        self.acceptance = PRIOR_ACCEPTANCE

    @property
    def step(self) -> float:
        return min(self._steps) if self._steps else 0.0

    @property
    def ratio(self) -> dict[int, float]:
        return {n: min(r) for n, r in self._ratios.items() if len(r) >= MIN_SAMPLES}

    @property
    def draft_ratio(self) -> float | None:
        return min(self._draft) if len(self._draft) >= MIN_SAMPLES else None

    def plain(self, seconds: float) -> None:
        self._steps.append(seconds)

    def batch(self, n: int, seconds: float) -> None:
        if self.step > 0:
            self._ratios.setdefault(n, deque(maxlen=SAMPLES)).append(
                max(seconds / self.step, 0.5))

    def drafted(self, n: int, seconds: float) -> None:
        if self.step > 0 and n > 0:
            self._draft.append(seconds / n / self.step)

    def cost(self, n: int) -> float | None:
        """A decode of ``n`` tokens in one-token steps; None when not measured (nor a
        smaller size: the cost grows with n, so a smaller size's is a floor)."""
        ratio = self.ratio
        if n in ratio:
            return ratio[n]
        below = [m for m in ratio if m < n]
        above = [m for m in ratio if m > n]
        if below and above:
            lo, hi = max(below), min(above)
            t = (n - lo) / (hi - lo)
            return ratio[lo] + t * (ratio[hi] - ratio[lo])
        if below:  # a floor: optimistic, so that a longer round is tried
            return ratio[max(below)]
        return None


class Governor:
    """One request's speculation: how many drafts each round verifies, and its counts.

    ``mode`` "auto" picks by expected tokens per cost; "prompt-lookup" and "draft" always
    verify what is drafted (up to ``draft_max``); ``limit`` is the last position a round may
    reach (exact mode: where the engine's one-token kernels part from a batch's)."""

    def __init__(self, mode: SpeculativeMode, history: History, draft_max: int,
                 *, with_model: bool = False, limit: int | None = None) -> None:
        self.mode = mode
        self.history = history
        self.draft_max = draft_max
        self.with_model = with_model
        self.limit = limit
        self.drafted = 0
        self.accepted = 0
        self.rounds = 0
        self._misses = 0.0  # rounds that stopped before their last draft
        self._since = 0  # plain tokens since auto last tried a round

    @property
    def acceptance(self) -> float:
        """The chance a draft is accepted given the ones before it were: the request's
        own counts, with the model's history as a prior of :data:`PRIOR_WEIGHT` tokens."""
        h = self.history.acceptance
        seen = self.accepted + self._misses
        return (self.accepted + PRIOR_WEIGHT * h) / (seen + PRIOR_WEIGHT) if seen else h

    def length(self, available: int, position: int) -> int:
        """Drafts to verify in this round (0: decode one token plainly), out of
        ``available`` (what the n-gram drafter has, or ``draft_max`` for a draft model),
        for a round starting at ``position``."""
        k = min(available, self.draft_max)
        if self.limit is not None:
            k = min(k, self.limit - position)
        if k <= 0 or self.mode == "off":
            return 0
        if self.mode != "auto":
            return k
        h = self.history
        if h.step <= 0:  # measure a plain step first
            return 0
        best_k, unknown = self._best(k, self.acceptance)
        if best_k:
            self._since = 0
            return best_k
        if unknown:  # a size never measured: try it once (then it is known)
            return unknown
        self._since += 1
        if self._since >= EXPLORE_EVERY and k >= EXPLORE_DRAFT:
            # rarely, and only on a long draft (a long repeat in the text), try the
            # length that would win if every draft were kept: the text may have turned
            # copyable since acceptance was measured
            self._since = 0
            return self._best(k, 1.0)[0]
        return 0

    def _best(self, k: int, alpha: float) -> tuple[int, int]:
        """The draft length up to ``k`` with the most expected tokens per cost if each
        draft is kept with chance ``alpha`` (0: plain decoding wins by MARGIN), and the
        shortest length whose cost is not measured yet (0: none)."""
        h = self.history
        best_k, best, expected, p = 0, 1.0 + MARGIN, 1.0, 1.0
        unknown = 0
        for j in range(1, k + 1):
            p *= alpha
            expected += p
            cost = h.cost(j + 1)
            if cost is not None and self.with_model:
                cost = cost + j * h.draft_ratio if h.draft_ratio is not None else None
            if cost is None:
                unknown = unknown or j
                continue
            if expected / cost > best:
                best, best_k = expected / cost, j
        return best_k, unknown

    def record(self, drafted: int, accepted: int) -> None:
        """One round's outcome: ``accepted`` of ``drafted`` drafts kept."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        if accepted < drafted:
            self._misses += 1

    def finish(self) -> None:
        """Fold this request's acceptance into the model's history."""
        if self.drafted:
            seen = self.accepted + self._misses
            rate = self.accepted / seen if seen else self.history.acceptance
            self.history.acceptance += 0.5 * (rate - self.history.acceptance)


class Timer:
    """Seconds of a block (perf_counter), for the cost model's measurements."""

    __slots__ = ("_t", "seconds")

    def __enter__(self) -> Timer:
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t


#: What each engine does: the modes it runs (an engine missing here runs none).
SUPPORT: dict[str, tuple[SpeculativeMode, ...]] = {
    "llama.cpp": ("auto", "prompt-lookup", "draft"),
    "openvino": ("prompt-lookup", "draft"),
    "mlx": ("draft",),
    "vllm": ("prompt-lookup", "draft"),
    "exllamav2": ("draft",),
}


def supports(backend: str, mode: SpeculativeMode) -> bool:
    return mode == "off" or mode in SUPPORT.get(backend, ())


def check_support(backend: str, mode: SpeculativeMode | None, draft: bool) -> None:
    """Refuse an explicit mode (or a draft model) the engine does not run, naming the
    engines that do; "auto" and unset pass everywhere."""
    from localrun.errors import UnsupportedFeatureError

    wanted: list[SpeculativeMode] = [m for m in (mode,) if m in ("prompt-lookup", "draft")]
    if draft and "draft" not in wanted:
        wanted.append("draft")
    for m in wanted:
        if not supports(backend, m):
            option = "draft_model" if m == "draft" and mode != "draft" else \
                f"speculative={m!r}"
            raise UnsupportedFeatureError(
                backend, option, f"{backend} has no {m} speculative decoding in localrun",
                supported_by=[b for b, modes in SUPPORT.items() if m in modes])


class IncompatibleDraftError(LocalrunError, ValueError):
    """A draft model (speculative decoding) whose tokenizer is not the target's: its
    token ids would mean other text to the target."""

    def __init__(self, draft: str, target: str, reason: str) -> None:
        self.draft = draft
        self.target = target
        self.reason = reason
        super().__init__(
            f"The draft model {draft} cannot draft for {target}: {reason}",
            hint="pick a draft of the same model family and tokenizer (localrun plan shows "
                 "the catalog's draft), or load without draft_model")
