"""OpenVINO GenAI's ContinuousBatchingPipeline as the session's
:class:`~localrun.backends.base.Batcher`, driven through the :class:`~.engine.Engine` the
session hands it.

On the CPU and GPUs every sequence runs through one ``ContinuousBatchingPipeline``
(paged attention), alone or with others: the driver's engine thread ``add_request``\\ s
the token ids localrun counted, calls ``step()``, then ``read()``\\ s the new token ids
of each handle, so each sequence streams, stops on its own (a stop string matched, its
caller went away) and frees its slot for the next waiting one. A cancelled handle's KV
blocks are freed by the next ``step()``; without that the pipeline reports leaked
blocks when it is destroyed.

**KV reuse across calls.** The scheduler's prefix caching keeps the KV blocks of
finished sequences, indexed by the tokens they hold, and a new prompt starts from the
longest run of whole blocks it shares with any of them: the next turn of a chat
prefills only the new turn, and a system prompt an agent sends again and again (or
several, alternating) is prefilled once. The cache is one context's worth of blocks
(:func:`~.engine.kv_blocks`); blocks no sequence in flight holds are overwritten least
recently used first.

``step()`` holds the GIL for the whole engine step (the binding does not release it,
unlike ``generate()``): other Python threads run between steps. A step's text pieces
come from one detokenizer call per window length (:mod:`.text`).
"""

from __future__ import annotations

import time
from typing import Any

from localrun.backends.base import Batcher, GenerationStats, Prompt
from localrun.backends.logprobs import Scorer, TokenBytes
from localrun.backends.openvino.constraints import mapped_error
from localrun.backends.openvino.engine import Engine
from localrun.backends.openvino.text import Detokenizer, TextWindow
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.types import FinishReason

#: Sequences in flight at once: the pipeline's KV cache grows as they need it, and 32
#: is the batch of ContinuousBatchingPipeline.generate() localrun is measured against.
CAPACITY = 32


class _Sequence:
    __slots__ = ("cancelled", "constraint", "handle", "reason", "stats", "window")

    def __init__(self, handle: Any, stats: GenerationStats,
                 constraint: Constraint | None) -> None:
        self.handle = handle
        self.stats = stats
        self.constraint = constraint
        self.window = TextWindow()
        self.reason: FinishReason | None = None
        self.cancelled = False


class ContinuousBatcher(Batcher):
    """The session's ContinuousBatchingPipeline, stepped by the driver's engine thread."""

    capacity = CAPACITY
    #: the session's own pipeline: its sequences share the one KV cache it was opened
    #: with (kv_blocks), which the session's memory already counts
    reserved_bytes = 0

    def __init__(self, engine: Engine) -> None:
        import numpy as np
        import openvino

        self._np, self._ov = np, openvino
        self._engine = engine
        self.pipe: Any = engine.pipe
        og = engine.og
        self._running = og.GenerationStatus.RUNNING
        self._finish_stop = og.GenerationFinishReason.STOP
        self._eos = engine.eos
        decode_many = engine.decode_many
        self._detok = Detokenizer(decode_many)
        self._active: dict[int, _Sequence] = {}
        # log probabilities: each token's text decoded alone (an IR folder has no
        # tokenizer.json), memoized
        self._scorer = Scorer(TokenBytes(None, lambda t: decode_many([[t]])[0]))

    def add(self, key: int, prompt: Prompt, sampling: ResolvedSampling,
            stats: GenerationStats) -> None:
        ids = self._ov.Tensor(self._np.asarray([list(prompt.tokens)], dtype=self._np.int64))
        config = self._engine.config(sampling)
        if stats.logprobs is not None:  # the chosen token's, raw (logprobs.OPENVINO_RAW)
            config.logprobs = 1
        try:
            handle = self.pipe.add_request(key, ids, config)
        except RuntimeError as e:  # XGrammar refusing this sequence's schema
            raise mapped_error(e, sampling.constraint) from e
        stats.started = time.perf_counter()
        stats.prefill_tokens = len(prompt.tokens)
        self._active[key] = _Sequence(handle, stats, sampling.constraint)

    def cancel(self, key: int) -> None:
        seq = self._active.get(key)
        if seq is not None and not seq.cancelled:
            seq.handle.cancel()
            seq.cancelled = True

    def step(self) -> list[tuple[int, str | None]]:
        try:
            self.pipe.step()
        except RuntimeError as e:  # XGrammar refusing a schema mid-step
            constraint = next((s.constraint for s in self._active.values()
                               if s.constraint is not None), None)
            raise mapped_error(e, constraint) from e
        eos, running, finish_stop = self._eos, self._running, self._finish_stop
        new: list[tuple[int, _Sequence, list[int]]] = []
        ended: list[int] = []
        for key, seq in self._active.items():
            handle = seq.handle
            if not seq.cancelled:
                tokens: list[int] = []
                entries = seq.stats.logprobs
                while handle.can_read():
                    for res in handle.read().values():
                        if entries is not None:  # before the pieces (base.GenerationStats)
                            entries += map(self._scorer.given, res.generated_ids,
                                           res.generated_log_probs)
                        for t in res.generated_ids:
                            if t in eos:
                                seq.reason = "stop"
                            else:
                                tokens.append(int(t))
                        if res.finish_reason == finish_stop:
                            seq.reason = "stop"
                if tokens:
                    new.append((key, seq, tokens))
                if handle.get_status() == running:
                    continue
            ended.append(key)
        out = self._texts(new)
        for key in ended:
            seq = self._active.pop(key)
            seq.stats.finish_reason = seq.reason or "length"
            out.append((key, None))
        return out

    def _texts(self, new: list[tuple[int, _Sequence, list[int]]]
               ) -> list[tuple[int, str | None]]:
        """(key, piece) per token; a step gives a sequence one token, rarely more (then
        its tokens go in rounds, so each one's piece is its own)."""
        out: list[tuple[int, str | None]] = []
        rounds = max((len(tokens) for _, _, tokens in new), default=0)
        for r in range(rounds):
            batch = [(key, seq, tokens[r]) for key, seq, tokens in new if len(tokens) > r]
            pieces = self._detok.pieces([(seq.window, t) for _, seq, t in batch])
            for (key, seq, _), piece in zip(batch, pieces, strict=True):
                seq.stats.completion_tokens += 1
                out.append((key, piece))
        return out

    def close(self) -> None:
        if self.pipe is None:
            return
        for seq in self._active.values():
            seq.handle.cancel()
        self._active.clear()
        try:  # free the cancelled requests' blocks before the pipeline goes
            self.pipe.step()
            while self.pipe.has_non_finished_requests():
                self.pipe.step()
        finally:
            self.pipe = None
