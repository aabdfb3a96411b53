"""Many llama.cpp sequences decoded together in one context (continuous batching), and the
KV cells they leave behind kept for the next calls (prefix reuse): the session's
:class:`~localrun.backends.base.Batcher`, on llama-cpp-python's low-level API, driven
through the :class:`~.engine.Engine` the session hands it.

**One context, one KV stream per slot.** A second ``llama_context`` over the session's
model (the weights are shared) with :attr:`~LlamaCppBatcher.capacity` slots, each a KV
stream as long as the session's context (``n_seq_max`` = capacity, ``kv_unified`` off):
a sequence reaches the whole context as it could alone and its attention sees only its
own cells, at the positions they would have alone (one unified stream would sum its
neighbours' cells in another order). The price is memory: capacity x the session's KV
cache, within :data:`~.memory.KV_BUDGET`.

**A step** decodes one token of every generating sequence in one ``llama_decode`` (one
row per slot, in slot order; or a decode each where this build multiplies a few tokens
at once slower than one: :meth:`LlamaCppBatcher.calibrate`), each drawing from its own
sampler chain (:func:`~.sampling.sequence_chain`); then new prompts are fed, each alone
in its decode, about ``n_batch`` tokens per step. llama.cpp cuts a batch over several
streams into ubatches of *consecutive* seq ids, so sequences in flight stay on
consecutive slots.

**The single path's tokens.** llama.cpp's CPU kernels are not batch-invariant, so a
prompt is fed alone, in the pieces ``Llama.generate`` feeds it in, and a reused prefix
is cut where recomputing the rest keeps those pieces' kernels
(:func:`~.reuse.reusable_prefix`): a sequence's tokens are ``Session.generate``'s from a
clean context while it stays under 256 cells (past that, a split-KV kernel may part
them, as in llama-server). Constraints and log probabilities are per sequence, as there.

**Speculative decoding** (prompt lookup: :mod:`~localrun.backends.ngram`'s drafts from
the sequence's own tokens). A sequence decoded in a decode of its own (alone, or where
this build runs a decode per sequence) verifies its drafts in that decode, each row drawn
from its own sampler chain, under the auto policy (:class:`~..speculative.Governor`, one
cost :class:`~..speculative.History` for the batch context), as the single path does
(:mod:`.speculative`: the same exact-mode limit); sequences decoded together do not draft
(the batch is already their win). A draft model drafts on the single path only.

**KV reuse.** A slot keeps the cells of the sequence that last ran in it; a new prompt
takes the free slot sharing the longest usable prefix (by default every common cell,
the reply's included: :func:`~.reuse.fast_prefix`; with ``exact``, the previous
prompt's cells, not its reply's, as above; at least :data:`MIN_REUSE` tokens, else the
least recently used slot),
trims it and prefills the rest, or copies a longer prefix from another slot when that
saves at least :data:`MIN_COPY` tokens. Measurements: docs/results/llama_batch.md.
"""

from __future__ import annotations

import codecs
import ctypes
import time
from typing import TYPE_CHECKING, Any

from localrun.adapters import Active
from localrun.backends.base import Batcher, GenerationStats, Prompt
from localrun.backends.llama_cpp.engine import Engine
from localrun.backends.llama_cpp.memory import batch_slots, kv_bytes_per_token, stream_tokens
from localrun.backends.llama_cpp.openmp import release_pool
from localrun.backends.llama_cpp.reuse import fast_prefix, reusable_prefix
from localrun.backends.llama_cpp.sampling import sequence_chain
from localrun.backends.logprobs import llama_row
from localrun.backends.ngram import NgramDrafter
from localrun.backends.prefix import common_prefix
from localrun.backends.speculative import Governor, History, Timer
from localrun.errors import GenerationError, LocalrunError
from localrun.sampling import ResolvedSampling
from localrun.structured.grammar import TokenMask

if TYPE_CHECKING:
    from localrun.backends.llama_cpp.speculative import Speculation

#: Common prefix (tokens) that makes a slot worth taking for its cells: below it (a
#: chat template's first line) the least recently used slot is taken, so that the
#: slots holding long prefixes keep them.
MIN_REUSE = 32
#: Prompt tokens a copy of another slot's cells must save to be worth its memcpy.
MIN_COPY = 32


class _Seq:
    """One sequence in flight: its tokens (prompt, then reply), how many of them have KV
    cells in its slot, and its own sampler chain, grammar matcher and UTF-8 decoder."""

    __slots__ = ("chain", "decoder", "drafter", "gov", "key", "limit", "lora", "mask",
                 "n_gen", "n_past", "n_prompt", "order", "out", "slot", "stats", "text",
                 "tokens", "top")

    def __init__(self, key: int, slot: int, tokens: list[int], n_past: int, limit: int,
                 chain: Any, mask: TokenMask | None, stats: GenerationStats,
                 order: int) -> None:
        self.key = key
        self.slot = slot
        self.tokens = tokens
        self.n_prompt = len(tokens)
        self.n_past = n_past  # tokens[:n_past] have cells (positions 0 .. n_past-1)
        self.limit = limit
        self.chain = chain
        self.mask = mask
        self.stats = stats
        self.order = order  # admission order: older prompts are prefilled first
        self.n_gen = 0
        self.out = -1  # row of this step's batch whose logits it samples from, or -1
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.top: int | None = None  # logprobs asked: the alternatives per token
        self.lora: Active = ()  # the adapter set it runs under (adapters.py)
        self.gov: Governor | None = None  # speculating: its drafts' governor ...
        self.drafter: NgramDrafter | None = None  # ... and the n-grams they come from
        self.text: str | None = None  # the prompt's text (fast mode: replies.py)


class _Slot:
    """One KV stream: the sequence running in it, or the tokens whose cells it kept."""

    __slots__ = ("cells", "id", "lora", "prompt", "seq", "used")

    def __init__(self, sid: int) -> None:
        self.id = sid
        self.seq: _Seq | None = None
        self.cells: list[int] = []  # when idle: the tokens at positions 0 .. len-1
        self.prompt = 0  # ... the first of which were its sequence's prompt
        self.used = 0.0  # perf_counter() when its last sequence ended (LRU)
        self.lora: Active = ()  # the adapter set its cells were computed under

    def held(self) -> tuple[list[int], int]:
        """The tokens whose cells the slot holds, and how many of them were prompt."""
        seq = self.seq
        if seq is None:
            return self.cells, self.prompt
        return seq.tokens[:seq.n_past], min(seq.n_prompt, seq.n_past)


class LlamaCppBatcher(Batcher):
    """Sequences of one loaded llama.cpp model through one multi-slot context (see the
    module docstring): ``capacity`` slots of ``n_ctx_seq`` tokens each."""

    def __init__(self, engine: Engine, capacity: int, n_ctx_seq: int,
                 together: int | None = None, *, exact: bool = True,
                 speculation: Speculation | None = None) -> None:
        import numpy as np

        lc = engine.lc
        llm = engine.llm
        self._lc = lc
        self._engine = engine
        self.exact = exact  # False: keep every common cell (module docstring)
        self._speculation = speculation  # the session's (its mode, draft length, limit)
        self._history = History()  # what a verify batch costs in this context
        self.capacity = capacity
        self.n_ctx_seq = n_ctx_seq
        self.reserved_bytes = capacity * n_ctx_seq * kv_bytes_per_token(engine)  # its KV
        params = lc.llama_context_params.from_buffer_copy(llm.context_params)
        params.n_seq_max = capacity
        params.n_ctx = capacity * n_ctx_seq
        params.n_batch = max(int(params.n_batch), capacity)  # a step's tokens fit one batch
        params.kv_unified = False
        ctx = lc.llama_init_from_model(llm._model.model, params)
        if not ctx:
            raise LocalrunError(
                f"llama.cpp could not make a batch context of {capacity} x {n_ctx_seq} tokens",
                hint="load the model with a smaller context (context=...)")
        self._ctx: Any = ctx
        # llama.cpp takes n_threads_batch for any decode of more than one token; a step's
        # one token per sequence is decode work (memory-bound) and gets the session's
        # n_threads, as a lone decode does; prompt chunks get n_threads_batch, as there
        self._threads = {"decode": (int(params.n_threads), int(params.n_threads)),
                         "prefill": (int(params.n_threads), int(params.n_threads_batch))}
        self._mode = ""
        self._mem = lc.llama_get_memory(ctx)
        self._n_vocab = engine.n_vocab
        self._n_batch = int(lc.llama_n_batch(ctx))
        # a prompt chunk is one ubatch (see _chunk)
        self._n_chunk = min(self._n_batch, int(lc.llama_n_ubatch(ctx)))
        # The batch's arrays are ours (numpy, so that a prompt chunk is one slice
        # assignment); llama_decode only reads the struct. Never llama_batch_free'd.
        n = self._n_batch
        self._np = np
        self._token = np.zeros(n, dtype=np.int32)
        self._pos = np.zeros(n, dtype=np.int32)
        self._nsid = np.ones(n, dtype=np.int32)
        self._sid = np.zeros(n, dtype=np.int32)
        self._logits = np.zeros(n, dtype=np.int8)
        sid_ptrs = (ctypes.POINTER(ctypes.c_int32) * n)()
        base = self._sid.ctypes.data
        for i in range(n):
            sid_ptrs[i] = ctypes.cast(base + 4 * i, ctypes.POINTER(ctypes.c_int32))
        self._sid_ptrs = sid_ptrs
        batch = lc.llama_batch()
        batch.token = self._token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.embd = None
        batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.n_seq_id = self._nsid.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.seq_id = ctypes.cast(sid_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        batch.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = batch
        self._slots = [_Slot(i) for i in range(capacity)]
        self._seqs: dict[int, _Seq] = {}
        self._ended: list[tuple[int, str | None]] = []  # ends for the next step to report
        self._admitted = 0
        #: fewest generating sequences decoded in one llama_decode; fewer get one each
        self.together = together if together is not None else self.calibrate()

    # -- the Batcher contract ------------------------------------------------------------

    def add(self, key: int, prompt: Prompt, sampling: ResolvedSampling,
            stats: GenerationStats) -> None:
        if self._ctx is None:
            raise LocalrunError("the llama.cpp batcher is closed",
                                hint="load the model again")
        if key in self._seqs:
            raise LocalrunError(f"sequence {key} is already in the llama.cpp batch")
        stats.started = time.perf_counter()
        tokens = list(prompt.tokens)
        if not tokens:
            raise LocalrunError("llama.cpp cannot generate from an empty prompt",
                                hint="give a prompt of at least one token")
        limit = min(sampling.max_tokens, self.n_ctx_seq - len(tokens))
        if limit <= 0:  # the driver keeps prompts within the context; never a crash here
            stats.finish_reason = "length"
            self._ended.append((key, None))
            return
        grammar = self._engine.grammar
        mask = grammar.mask(sampling.constraint) if sampling.constraint is not None else None
        loras = self._engine.loras
        lora = loras.key(sampling.adapters) if loras is not None else ()
        slot, keep = self._place(tokens, lora)
        self._admitted += 1
        chain = sequence_chain(self._engine, sampling, mask)
        seq = _Seq(key, slot.id, tokens, keep, limit, chain, mask, stats, self._admitted)
        seq.lora = slot.lora = lora
        seq.top = sampling.logprobs if stats.logprobs is not None else None
        seq.text = None if self.exact else prompt.text
        spec = self._speculation
        mode = spec.mode_for(sampling, sampling.speculative) if spec is not None else "off"
        if spec is not None and mode != "off":
            from localrun.backends.llama_cpp.speculative import SPLIT_KV_CELLS

            seq.gov = Governor("auto" if mode == "auto" else "prompt-lookup", self._history,
                               spec.draft_max,
                               limit=SPLIT_KV_CELLS - 1 if spec.exact else None)
        slot.seq = seq
        self._seqs[key] = seq
        stats.prefill_tokens = len(tokens) - keep

    def cancel(self, key: int) -> None:
        seq = self._seqs.get(key)
        if seq is None:
            return  # already ended (and reported)
        self._release(seq)
        self._ended.append((key, None))

    def step(self) -> list[tuple[int, str | None]]:
        events, self._ended = self._ended, []
        live = [s.seq for s in self._slots if s.seq is not None]
        if not live or self._ctx is None:
            return events
        lc, ctx = self._lc, self._ctx
        sample = lc.llama_sampler_sample
        drawn: list[tuple[_Seq, int]] = []
        decoding = [q for q in live if q.n_gen and q.n_past == len(q.tokens) - 1]
        if len(decoding) >= self.together and len({q.lora for q in decoding}) == 1:
            # one decode (slot order: consecutive streams); under several adapter sets,
            # a decode each (below), each under its own
            t0 = time.perf_counter()
            self._decode([(q, 1) for q in decoding], live, "decode")
            for q in decoding:
                drawn.append((q, self._scored(q, sample(q.chain.sampler, ctx, q.out))))
            dt = time.perf_counter() - t0
            for q in decoding:
                q.stats.decode_tokens += 1
                q.stats.decode_seconds += dt
        else:  # a decode each, faster on this build (see calibrate); drawn at once
            for q in decoding:
                if q.gov is not None and self._speculate(q, live, events):
                    continue
                t0 = time.perf_counter()
                self._decode([(q, 1)], live, "decode")
                drawn.append((q, self._scored(q, sample(q.chain.sampler, ctx, q.out))))
                q.stats.decode_tokens += 1
                dt = time.perf_counter() - t0
                q.stats.decode_seconds += dt
                if q.gov is not None:
                    self._history.plain(dt)
        rows = 0
        for q in sorted((q for q in live if not q.n_gen or q.n_past < len(q.tokens) - 1),
                        key=lambda q: q.order):
            k = self._chunk(q)
            if rows and rows + k > self._n_batch:
                break  # the rest next step: a step stays about n_batch tokens long
            t0 = time.perf_counter()
            self._decode([(q, k)], live, "prefill")  # a decode of its own: see _chunk
            if q.out >= 0:
                drawn.append((q, self._scored(q, sample(q.chain.sampler, ctx, q.out))))
            q.stats.prefill_seconds += time.perf_counter() - t0
            rows += k
        for q, token in drawn:
            self._take(q, token, events)
        return events

    def _speculate(self, q: _Seq, live: list[_Seq],
                   events: list[tuple[int, str | None]]) -> bool:
        """One speculative round for ``q``: its last token and the drafts its governor
        takes, in one decode of their own, each row drawn from ``q``'s chain while the
        drafts match; the rows past the last kept one lose their cells. False: no
        drafts this round (decode it plainly)."""
        gov, drafter = q.gov, q.drafter
        assert gov is not None
        if drafter is None:  # counted once its first token is out, not in its TTFT
            drafter = q.drafter = NgramDrafter(q.tokens)
        n_past = q.n_past  # == len(q.tokens) - 1: the last token has no cells yet
        # drafts past the slot's context or the token limit could never be kept
        room = min(self.n_ctx_seq - n_past - 1, q.limit - q.n_gen - 1)
        proposal = drafter.draft(min(gov.draft_max, room)) if room > 0 else []
        k = gov.length(len(proposal), n_past) if proposal else 0
        if k <= 0:
            return False
        drafts = proposal[:k]
        rows = [q.tokens[n_past], *drafts]
        n, np = len(rows), self._np
        self._token[:n] = rows
        self._pos[:n] = np.arange(n_past, n_past + n, dtype=np.int32)
        self._sid[:n] = q.slot
        self._logits[:n] = 1
        self._batch.n_tokens = n
        if self._engine.loras is not None:
            self._engine.loras.use(self._ctx, q.lora)
        if self._mode != "prefill":  # a batch of tokens: llama.cpp's batch threads
            self._lc.llama_set_n_threads(self._ctx, *self._threads["prefill"])
            self._mode = "prefill"
        with Timer() as t:
            rc = self._lc.llama_decode(self._ctx, self._batch)
        if rc != 0:
            self._forget_cells(live)
            raise GenerationError("llama.cpp", f"llama_decode returned {rc} for a verify "
                                  f"batch of {n} tokens")
        self._history.batch(n, t.seconds)
        sample, is_eog = self._lc.llama_sampler_sample, self._engine.is_eog
        taken: list[int] = []
        while True:  # row i's token: a kept draft while it matches drafts[i]
            token = int(sample(q.chain.sampler, self._ctx, len(taken)))
            taken.append(token)
            if len(taken) > k or token != drafts[len(taken) - 1] or is_eog(token):
                break
        # the drafts kept: every row's token but the last, and the last too where it
        # is a draft itself (an end-of-generation token the text had)
        last = len(taken) - 1
        gov.record(k, last + (last < k and taken[last] == drafts[last]))
        keep = n_past + len(taken)  # the last token's and the kept drafts' cells
        if keep < n_past + n:
            self._lc.llama_memory_seq_rm(self._mem, q.slot, keep, -1)
        q.n_past = keep
        q.stats.decode_tokens += len(taken)
        q.stats.decode_seconds += t.seconds
        for token in taken:
            if q.key not in self._seqs:
                break  # ended (the token limit, an end-of-generation token)
            self._take(q, token, events)
        return True

    def _scored(self, seq: _Seq, token: int) -> int:
        """``token``, with its log-probability entry kept first when asked for: from the
        row it was drawn from, before the next decode overwrites the logits."""
        if seq.top is not None and seq.stats.logprobs is not None:
            row = llama_row(self._lc, self._ctx, seq.out, self._n_vocab)
            seq.stats.logprobs.append(self._engine.scorer.entry(row, token, seq.top))
        return token

    def _take(self, seq: _Seq, token: int, events: list[tuple[int, str | None]]) -> None:
        """A token drawn for ``seq``: its end, or its piece."""
        key = seq.key
        if self._engine.is_eog(token):
            seq.stats.finish_reason = "stop"
            tail = seq.decoder.decode(b"", final=True)
            if tail:
                events.append((key, tail))
            self._end(seq, events)
            return
        if seq.mask is not None:
            try:
                seq.mask.consume(token)
            except LocalrunError as e:  # this sequence alone: the others go on
                seq.stats.error = e
                self._end(seq, events)
                return
        seq.tokens.append(token)
        if seq.drafter is not None:
            seq.drafter.extend((token,))
        seq.n_gen += 1
        seq.stats.completion_tokens = seq.n_gen
        piece = seq.decoder.decode(self._engine.piece(token))
        if seq.n_gen >= seq.limit:
            seq.stats.finish_reason = "length"
            events.append((key, piece + seq.decoder.decode(b"", final=True)))
            self._end(seq, events)
        else:
            events.append((key, piece))

    def idle(self) -> None:
        release_pool()  # another thread may decode while this one waits (openmp.py)

    def close(self) -> None:
        ctx, self._ctx = getattr(self, "_ctx", None), None
        if ctx is None:
            return
        for seq in list(self._seqs.values()):
            self._ended.append((seq.key, None))
            self._release(seq)
        if self._engine.loras is not None:
            self._engine.loras.forget(ctx)
        self._lc.llama_free(ctx)

    def calibrate(self, repeats: int = 3) -> int:
        """The fewest sequences one decode of a token each runs faster than a decode per
        sequence (``capacity + 1``: never), timed now on empty slots (the fastest of
        ``repeats``). llama.cpp's CPU matmul for two tokens or more takes another kernel
        (llamafile's tinyBLAS), which on some CPUs costs several times the one-token
        kernel per step (docs/results/llama_batch.md); there, a few sequences run faster
        one decode each. Both give the same logits, bit for bit, so the choice changes
        speed only."""

        def timed(n: int) -> float:
            best = float("inf")
            for _ in range(repeats):
                for i in range(n):
                    self._token[i], self._pos[i], self._sid[i] = 0, 0, i
                    self._logits[i] = 1
                self._batch.n_tokens = n
                t0 = time.perf_counter()
                rc = self._lc.llama_decode(self._ctx, self._batch)
                best = min(best, time.perf_counter() - t0)
                for i in range(n):
                    self._lc.llama_memory_seq_rm(self._mem, i, -1, -1)
                if rc != 0:
                    raise GenerationError("llama.cpp", f"llama_decode returned {rc} for a "
                                          f"calibration batch of {n} tokens")
            return best

        self._lc.llama_set_n_threads(self._ctx, *self._threads["decode"])
        self._mode = "decode"
        one = timed(1)
        n = 2
        while n <= self.capacity:
            if timed(n) < n * one:
                return n  # and more: a step's cost grows slower than its sequences
            n = self.capacity if n < self.capacity <= 2 * n else 2 * n
        return self.capacity + 1

    # -- placing a new sequence ------------------------------------------------------------

    def _place(self, tokens: list[int], lora: Active = ()) -> tuple[_Slot, int]:
        """The slot a new prompt runs in, and how many of its tokens already have cells
        there (trimmed to them, copied from another slot when that saves enough); cells
        count only in a slot whose cells were computed under the same adapter set."""
        free = [s for s in self._slots if s.seq is None]
        if not free:
            raise LocalrunError(f"all {self.capacity} llama.cpp batch slots are busy",
                                hint="admit no more than Batcher.capacity sequences")
        live = sorted(s.id for s in self._slots if s.seq is not None)
        if live:
            lo, hi = live[0], live[-1]
            gaps = [s for s in free if lo < s.id < hi]
            candidates = gaps or [s for s in free if s.id in (lo - 1, hi + 1)]
        else:
            candidates = free
        n, chunk = len(tokens), self._n_chunk

        def reuse(slot: _Slot) -> int:
            if slot.lora != lora:
                return 0
            cells, prompt = slot.held()
            if not self.exact:
                return fast_prefix(n, common_prefix(cells, tokens))
            return reusable_prefix(n, common_prefix(cells, tokens), chunk, prompt)

        reuses = {s.id: reuse(s) for s in self._slots}

        def worth(slot: _Slot) -> tuple[int, float]:
            n = reuses[slot.id]
            return (n if n >= MIN_REUSE else 0), -slot.used

        slot = max(candidates, key=worth)  # the longest prefix, else the LRU slot
        keep = reuses[slot.id]
        source = max(self._slots, key=lambda s: reuses[s.id])
        if source is not slot and reuses[source.id] - keep >= MIN_COPY:
            keep = reuses[source.id] if self._copy(source.id, slot.id) else 0
        self._lc.llama_memory_seq_rm(self._mem, slot.id, keep, -1)
        return slot, keep

    def _copy(self, src: int, dst: int) -> bool:
        """Copy slot ``src``'s cells into slot ``dst`` (cleared first); False if llama.cpp
        could not (``dst`` is then empty)."""
        lc, np = self._lc, self._np
        lc.llama_memory_seq_rm(self._mem, dst, -1, -1)
        size = int(lc.llama_state_seq_get_size(self._ctx, src))
        if size <= 0:
            return False
        buf = np.empty(size, dtype=np.uint8)
        ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        got = int(lc.llama_state_seq_get_data(self._ctx, ptr, size, src))
        if got <= 0 or int(lc.llama_state_seq_set_data(self._ctx, ptr, got, dst)) <= 0:
            lc.llama_memory_seq_rm(self._mem, dst, -1, -1)
            return False
        return True

    # -- one step ------------------------------------------------------------------------

    def _chunk(self, seq: _Seq) -> int:
        """Prompt tokens to feed ``seq`` now, alone in their decode: up to the next
        multiple of the chunk size, so that every prompt token is computed in a ubatch of
        the size it has in ``Llama.generate`` (see :func:`reusable_prefix`)."""
        chunk = self._n_chunk
        return min(len(seq.tokens), (seq.n_past // chunk + 1) * chunk) - seq.n_past

    def _decode(self, feed: list[tuple[_Seq, int]], live: list[_Seq], mode: str) -> None:
        """One llama_decode of ``k`` next tokens of each sequence; the logits of a
        sequence's last token are kept (``seq.out``) when that is the last it has."""
        np = self._np
        if self._engine.loras is not None:  # every sequence of one decode shares its set
            self._engine.loras.use(self._ctx, feed[0][0].lora)
        if mode != self._mode:
            self._lc.llama_set_n_threads(self._ctx, *self._threads[mode])
            self._mode = mode
        n = 0
        for seq, k in feed:
            start = seq.n_past
            if k == 1:
                self._token[n] = seq.tokens[start]
                self._pos[n] = start
                self._sid[n] = seq.slot
                self._logits[n] = 0
            else:
                self._token[n:n + k] = seq.tokens[start:start + k]
                self._pos[n:n + k] = np.arange(start, start + k, dtype=np.int32)
                self._sid[n:n + k] = seq.slot
                self._logits[n:n + k] = 0
            n += k
            seq.n_past = start + k
            if seq.n_past == len(seq.tokens):
                self._logits[n - 1] = 1
                seq.out = n - 1
            else:
                seq.out = -1
        self._batch.n_tokens = n
        rc = self._lc.llama_decode(self._ctx, self._batch)
        if rc != 0:
            self._forget_cells(live)
            raise GenerationError("llama.cpp", f"llama_decode returned {rc} for a batch of "
                                  f"{n} tokens over {len(feed)} sequences")

    def _end(self, seq: _Seq, events: list[tuple[int, str | None]]) -> None:
        self._release(seq)
        events.append((seq.key, None))

    def _release(self, seq: _Seq) -> None:
        """The sequence leaves; its slot keeps its cells for the next prompts."""
        slot = self._slots[seq.slot]
        slot.cells, slot.prompt = slot.held()
        slot.seq = None
        slot.used = time.perf_counter()
        del self._seqs[seq.key]
        seq.chain.close()
        if seq.text is not None and seq.stats.error is None:
            self._engine.remember(seq.text, seq.tokens[:seq.n_prompt],
                                  seq.tokens[seq.n_prompt:])
        if seq.gov is not None:
            seq.stats.drafted_tokens = seq.gov.drafted
            seq.stats.accepted_tokens = seq.gov.accepted
            seq.gov.finish()

    def _forget_cells(self, live: list[_Seq]) -> None:
        """After a failed decode: what the slots hold is no longer known; clear them."""
        for seq in live:
            self._lc.llama_memory_seq_rm(self._mem, seq.slot, -1, -1)
            seq.n_past = 0


def make_batcher(engine: Engine, max_concurrency: int | None, *, exact: bool = True,
                 speculation: Speculation | None = None) -> LlamaCppBatcher | None:
    """The batcher for a loaded model: the slots that fit, at most ``max_concurrency``
    (None: no batcher where fewer than 2 fit)."""
    capacity, _ = batch_slots(engine, max_concurrency)
    if capacity < 2:
        return None
    return LlamaCppBatcher(engine, capacity, stream_tokens(engine), exact=exact,
                           speculation=speculation)
