"""MLX sequences side by side: mlx-lm's ``BatchGenerator`` as the session's
:class:`~localrun.backends.base.Batcher`, driven through the :class:`~.engine.Engine`
the session hands it.

``add`` inserts a sequence into a ``BatchGenerator`` (its prompt, its own sampler and
logits processors, :mod:`.sampling`; its token limit; the model's end-of-sequence ids as
stop tokens), ``step`` is one ``BatchGenerator.next()`` (one decode token for every
sequence in flight, and a prefill chunk of the newly admitted ones), ``cancel`` removes
a sequence from the generator, which frees its KV rows; a sequence starts from, and
leaves its cache to, the prompt caches the single path uses too (:mod:`.reuse`). mlx
streams are thread-local, so every mlx call runs on the session's mlx worker thread:
the driver's scheduler thread calls the Batcher, and each method hands its work to that
thread (``Worker.call``) and waits for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from localrun.backends.base import Batcher, GenerationStats, Prompt
from localrun.backends.mlx.engine import Engine
from localrun.backends.mlx.sampling import (
    RawLogits,
    seeded_sampler,
    sequence_processors,
    with_raw,
)
from localrun.errors import LocalrunError
from localrun.sampling import ResolvedSampling
from localrun.structured.grammar import TokenMask
from localrun.types import FinishReason

#: Sequences in flight at once, by device. On Metal a step of many sequences costs little
#: more than one (mlx-lm's own completion batch size is 32). mlx's CPU kernels gain
#: nothing from a batch (docs/results/kv_reuse.md): there the batch only lets every reply
#: progress at once, and a small one keeps each reply's pace tolerable.
CAPACITY = {"metal": 32, "cpu": 8}
#: New sequences prefilled together in one step (mlx-lm's default).
PREFILL_BATCH = 8


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

    def __init__(self, engine: Engine, capacity: int = CAPACITY["cpu"]) -> None:
        self._engine = engine
        self._worker = engine.worker
        self._prefixes = engine.prefixes
        self.capacity = capacity
        self._gen: Any = None  # the BatchGenerator, built on the first add
        self._seqs: dict[int, _Seq] = {}  # the generator's uid -> sequence
        self._uids: dict[int, int] = {}  # key -> uid
        self._ended: list[tuple[int, str | None]] = []  # ends for the next step to report

    # -- the Batcher contract (scheduler thread) ---------------------------------------

    def add(self, key: int, prompt: Prompt, sampling: ResolvedSampling,
            stats: GenerationStats) -> None:
        # llguidance, not mlx: compiled here, off the mlx thread
        grammar = self._engine.grammar
        mask = grammar.mask(sampling.constraint) if sampling.constraint is not None else None
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
                self._engine.model, stop_tokens=[[t] for t in sorted(self._engine.eos)],
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
        self._seqs[uid] = _Seq(key, stats, self._engine.detokenizer(), raw=raw,
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
                row = seq.raw.row(r.logprobs)
                stats.logprobs.append(self._engine.scorer.entry(row, r.token, seq.top))
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
