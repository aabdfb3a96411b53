"""MLX sequences side by side (mlx-lm's ``BatchGenerator``), and the prompt caches kept
between calls (KV reuse), for the MLX session (:mod:`localrun.backends.mlx.session`).

**Batching.** :class:`MLXBatcher` is the session's
:class:`~localrun.backends.base.Batcher`: ``add`` inserts a sequence into a
``BatchGenerator`` (its prompt, its own sampler and logits processors, its token limit,
the model's end-of-sequence ids as stop tokens), ``step`` is one ``BatchGenerator.next()``
(one decode token for every sequence in flight, and a prefill chunk of the newly
admitted ones), ``cancel`` removes a sequence from the generator, which frees its KV
rows. mlx streams are thread-local, so every mlx call runs on the session's mlx worker
thread: the driver's scheduler thread calls the Batcher, and each method hands its work
to that thread (``Worker.call``) and waits for it.

**Sampling** is the single path's, sequence by sequence: greedy (argmax) at temperature
0; otherwise the temperature first, then top_k, top_p, min_p (:func:`seeded_sampler`),
and the repetition penalty over the last :data:`REPETITION_CONTEXT` tokens (prompt
included) as a logits processor, after the structured-output mask (llguidance, the same
processor as the single path: a constraint is enforced per sequence). **Seeds are per
sequence**: mlx's ``mx.random.seed`` is one global stream, which sequences sharing a
step would draw from in turn (a reply would depend on its neighbours), so each sequence
draws from its own key chain, ``mx.random.key(seed)`` split once per token. That chain
is exactly the global stream ``mx.random.seed(seed)`` starts, so a seed gives the same
reply alone or in a batch, next to any other sequences.

**KV reuse.** :class:`PrefixCache` keeps the prompt caches (``make_prompt_cache``) of
the last few sequences with the tokens they hold (prompt and reply). A new prompt takes
the entry sharing its longest common prefix, cut to that prefix (a view of the stored
keys and values, or a trimmed copy: the entry stays whole for the next caller), and
only the rest is prefilled: the next turn of a chat prefills the new user message, an
agent's repeated system prompt and tools are prefilled once. Both the single path and
the batcher take and give back entries. Bounded: :data:`PREFIX_ENTRIES` entries, and
older ones only while all stay under :data:`PREFIX_BYTES`.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from localrun.backends._worker import Worker
from localrun.backends.base import Batcher, GenerationStats, Prompt
from localrun.backends.logprobs import Scorer
from localrun.backends.mlx.constraints import mlx_processor
from localrun.errors import LocalrunError
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.structured.grammar import TokenMask
from localrun.types import FinishReason

#: Tokens the repetition penalty looks back over (llama.cpp's default repeat_last_n).
REPETITION_CONTEXT = 64

#: Sequences in flight at once, by device. On Metal a step of many sequences costs little
#: more than one (mlx-lm's own completion batch size is 32). mlx's CPU kernels gain
#: nothing from a batch (8 sequences at once took the CPU time of running them in turn,
#: docs/results/kv_reuse.md): there the batch only lets every reply progress at once, and
#: a small one keeps each reply's pace tolerable.
CAPACITY = {"metal": 32, "cpu": 8}
#: New sequences prefilled together in one step (mlx-lm's default).
PREFILL_BATCH = 8

#: Prompt caches kept between calls, most recently used last.
PREFIX_ENTRIES = 4
#: Bytes the kept caches may take together; the most recent one is kept whatever its
#: size (it is what the next turn of a conversation needs).
PREFIX_BYTES = 1 << 30


# -- per-sequence sampling (both paths) ------------------------------------------------------


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


# -- KV reuse ---------------------------------------------------------------------------


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def cache_length(cache: Sequence[Any]) -> int:
    """Tokens a prompt cache holds (0: it does not say, as a recurrent state)."""
    return max((int(c.size()) for c in cache), default=0)


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: list[Any]
    nbytes: int


class PrefixCache:
    """Prompt caches of recent sequences and the tokens they hold. Used on the mlx
    worker thread only."""

    def __init__(self, model: Any, entries: int = PREFIX_ENTRIES,
                 budget: int = PREFIX_BYTES) -> None:
        self._model = model
        self._max = entries
        self._budget = budget
        self._entries: list[_Entry] = []  # most recently used last

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def most_bytes(self, context_bytes: int | None) -> int:
        """The most the kept caches take together, for a model whose cache of its whole
        context (rounded up to mlx-lm's 256-token steps) is ``context_bytes`` (None:
        unknown, the budget): an entry holds at most that, older entries stay only
        while all fit the budget, and the newest stays whatever its size."""
        if context_bytes is None:
            return self._budget
        return min(self._max * context_bytes, max(self._budget, context_bytes))

    def borrow(self, tokens: Sequence[int]) -> tuple[list[Any], int]:
        """A prompt cache for ``tokens`` and how many of them it already holds (0: a new
        empty cache). At least the last token is left to prefill: its logits give the
        first reply token. The stored entry is not changed."""
        from mlx_lm.models.cache import make_prompt_cache

        best: _Entry | None = None
        n = 0
        for e in self._entries:
            k = common_prefix(e.tokens, tokens)
            if k > n:
                best, n = e, k
        n = min(n, len(tokens) - 1)
        if best is not None and n > 0:
            cache = _prefix_of(best.cache, len(best.tokens), n)
            if cache is not None:
                self._entries.remove(best)
                self._entries.append(best)
                return cache, n
        return make_prompt_cache(self._model), 0

    def keep(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Offer a finished sequence's cache holding ``tokens`` (its prompt and reply).
        A cache whose length does not match is not kept (its content is unknown)."""
        import mlx.core as mx

        held = tuple(tokens)
        if not held or cache_length(cache) != len(held):
            return
        for e in list(self._entries):
            if e.tokens[:len(held)] == held:  # an entry already holds all of it
                self._entries.remove(e)
                self._entries.append(e)
                return
            if held[:len(e.tokens)] == e.tokens:  # the new one holds all of that entry
                self._entries.remove(e)
        # A cache cut out of a batch is a lazy slice of the whole batch's keys: computing
        # it now lets the batch's buffers go.
        mx.eval([c.state for c in cache])
        self._entries.append(_Entry(held, cache, sum(int(c.nbytes) for c in cache)))
        while len(self._entries) > self._max or (
                len(self._entries) > 1 and self.nbytes > self._budget):
            self._entries.pop(0)

    def clear(self) -> None:
        self._entries.clear()


def _prefix_of(cache: list[Any], length: int, n: int) -> list[Any] | None:
    """A new cache holding the first ``n`` of the ``length`` tokens of ``cache``, which
    stays as it is; None where the cache cannot be cut (a recurrent or rotated one)."""
    from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, trim_prompt_cache

    if all(type(c) is KVCache for c in cache):
        new_kv: Any = KVCache  # untyped in mlx-lm
        out = []
        for c in cache:
            part = new_kv()
            # A slice is a new array: the generator's writes into it (it grows the
            # buffer on the first token) leave the stored keys alone.
            part.keys = c.keys[..., :n, :]
            part.values = c.values[..., :n, :]
            part.offset = n
            out.append(part)
        return out
    if n == length or can_trim_prompt_cache(cache):
        dup = copy.deepcopy(cache)
        if length > n:
            trim_prompt_cache(dup, length - n)
        return dup
    return None


# -- batching ---------------------------------------------------------------------------


@dataclass
class _Seq:
    key: int
    stats: GenerationStats
    detok: Any
    first: float = 0.0  # perf_counter() of the first reply token
    last: float = 0.0
    raw: RawLogits | None = None  # logprobs asked: where the raw logits are
    top: int = 0


class MLXBatcher(Batcher):
    """Sequences through one mlx-lm ``BatchGenerator`` (see the module docstring)."""

    def __init__(self, worker: Worker, model: Any, eos: frozenset[int],
                 detokenizer: Callable[[], Any], prefixes: PrefixCache,
                 mask: Callable[[Constraint], TokenMask], capacity: int = CAPACITY["cpu"],
                 scorer: Scorer | None = None) -> None:
        self._worker = worker
        self._scorer = scorer or Scorer(lambda t: b"")
        self._model = model
        self._eos = eos
        self._detokenizer = detokenizer
        self._prefixes = prefixes
        self._mask = mask
        self.capacity = capacity
        self._gen: Any = None  # the BatchGenerator, built on the first add
        self._seqs: dict[int, _Seq] = {}  # the generator's uid -> sequence
        self._uids: dict[int, int] = {}  # key -> uid
        self._ended: list[tuple[int, str | None]] = []  # ends for the next step to report

    # -- the Batcher contract (scheduler thread) ---------------------------------------

    def add(self, key: int, prompt: Prompt, sampling: ResolvedSampling,
            stats: GenerationStats) -> None:
        # llguidance, not mlx: compiled here, off the mlx thread
        mask = self._mask(sampling.constraint) if sampling.constraint is not None else None
        self._worker.call(lambda: self._add(key, prompt, sampling, stats, mask))

    def cancel(self, key: int) -> None:
        self._worker.call(lambda: self._cancel(key))

    def step(self) -> list[tuple[int, str | None]]:
        return self._worker.call(self._step)

    def close(self) -> None:
        self._worker.call(self._close)

    # -- on the mlx thread --------------------------------------------------------------

    def _generator(self) -> Any:
        if self._gen is None:
            from mlx_lm.generate import BatchGenerator

            self._gen = BatchGenerator(
                self._model, stop_tokens=[[t] for t in sorted(self._eos)],
                completion_batch_size=self.capacity,
                prefill_batch_size=min(PREFILL_BATCH, self.capacity))
        return self._gen

    def _add(self, key: int, prompt: Prompt, sampling: ResolvedSampling,
             stats: GenerationStats, mask: TokenMask | None) -> None:
        stats.started = time.perf_counter()
        if sampling.max_tokens <= 0:  # the prompt left no room for a reply
            stats.finish_reason = "length"
            self._ended.append((key, None))
            return
        tokens = list(prompt.tokens)
        if not tokens:
            raise LocalrunError("MLX cannot generate from an empty prompt",
                                hint="give a prompt of at least one token")
        gen = self._generator()
        cache, reused = self._prefixes.borrow(tokens)
        sampler = seeded_sampler(sampling)
        procs, raw = with_raw(sequence_processors(sampling, mask, len(tokens)),
                              stats.logprobs is not None)
        [uid] = gen.insert([tokens[reused:]], max_tokens=[sampling.max_tokens],
                           caches=[cache], all_tokens=[tokens[:reused]],
                           samplers=[sampler], logits_processors=[procs or []])
        stats.prefill_tokens = len(tokens) - reused
        self._seqs[uid] = _Seq(key, stats, self._detokenizer(), raw=raw,
                               top=sampling.logprobs or 0)
        self._uids[key] = uid

    def _cancel(self, key: int) -> None:
        uid = self._uids.get(key)
        if uid is None:
            return  # already ended (and reported)
        self._forget(uid)
        self._ended.append((key, None))
        if self._gen is None:
            return
        try:  # what it has prefilled and generated so far serves the next call too
            kept = self._gen.remove([uid], return_prompt_caches=True)
        except Exception:  # a prompt batch not started has no cache to cut
            self._gen.remove([uid])
            return
        for cache, tokens in kept.values():
            self._prefixes.keep(tokens, cache)

    def _step(self) -> list[tuple[int, str | None]]:
        out, self._ended = self._ended, []
        if not self._seqs or self._gen is None:
            return out
        try:
            _, responses = self._gen.next()
        except BaseException:
            self._reset()  # its batches may be half-updated: the next add builds anew
            raise
        now = time.perf_counter()
        for r in responses:
            seq = self._seqs.get(r.uid)
            if seq is None:
                continue
            stats = seq.stats
            reason: FinishReason | None = r.finish_reason  # "stop": r.token is an EOS id
            if seq.raw is not None and stats.logprobs is not None:  # before its piece
                stats.logprobs.append(self._scorer.entry(seq.raw.row(r.logprobs), r.token,
                                                         seq.top))
            if reason != "stop":
                seq.detok.add_token(r.token)
                stats.completion_tokens += 1
                seq.first = seq.first or now
                seq.last = now
                if reason is not None:
                    seq.detok.finalize()
                out.append((seq.key, seq.detok.last_segment))
            else:
                seq.detok.finalize()
                tail = seq.detok.last_segment  # text held back for a next token
                if tail:
                    out.append((seq.key, tail))
            n = stats.completion_tokens
            stats.prefill_seconds = (seq.first or now) - stats.started
            stats.decode_tokens = max(n - 1, 0)
            stats.decode_seconds = seq.last - seq.first if n > 1 else 0.0
            if reason is not None:
                stats.finish_reason = reason
                self._forget(r.uid)
                if r.prompt_cache is not None and r.all_tokens is not None:
                    self._prefixes.keep(r.all_tokens, r.prompt_cache)
                out.append((seq.key, None))
        return out

    def _forget(self, uid: int) -> None:
        seq = self._seqs.pop(uid, None)
        if seq is not None:
            self._uids.pop(seq.key, None)

    def _reset(self) -> None:
        gen, self._gen = self._gen, None
        self._seqs.clear()
        self._uids.clear()
        if gen is not None:
            gen.close()

    def _close(self) -> None:
        self._reset()
        self._ended.clear()
