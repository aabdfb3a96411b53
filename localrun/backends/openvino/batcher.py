"""OpenVINO GenAI's ContinuousBatchingPipeline as the session's :class:`Batcher`.

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
(:func:`kv_blocks`); blocks no sequence in flight holds are overwritten least recently
used first.

``step()`` holds the GIL for the whole engine step (the binding does not release it,
unlike ``generate()``): other Python threads run between steps.

Text: a step yields one token for up to ``CAPACITY`` sequences; their text pieces come
from ONE detokenizer call per window length (:class:`Detokenizer`), not one call per
token, which took 2-3% of a 32-prompt batch's engine thread.

The session gives what the batcher needs explicitly (its pipeline, EOS ids, the
tokenizer's batch decode, its GenerationConfig builder), so this module does not import
the session's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from localrun.backends.base import Batcher, GenerationStats, Prompt
from localrun.backends.logprobs import Scorer, TokenBytes
from localrun.backends.openvino.constraints import is_openvino_grammar_error, openvino_schema_error
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.types import FinishReason

#: Tokens the scheduler may process in one step (prefill chunks + one per decoding
#: sequence). The engine default (256) splits the prefill of a batch of short chat
#: prompts over many steps; 1024 keeps a 16-prompt batch's prefill to a step or two.
MAX_BATCHED_TOKENS = 1024
#: Sequences in flight at once: the pipeline's KV cache grows as they need it, and 32
#: is the batch of ContinuousBatchingPipeline.generate() localrun is measured against.
CAPACITY = 32
#: Tokens per KV block: the engine's own choice per device (kv_cache_manager.hpp).
KV_BLOCK_TOKENS = {"CPU": 32, "GPU": 16}
#: Tokens decoded together before a sequence's detokenizer window restarts.
DETOKENIZE_WINDOW = 8

#: The tokenizer's batch decode: token lists in, one text per list out.
DecodeMany = Callable[[list[list[int]]], list[str]]


def kv_blocks(context: int, device: str) -> int:
    """KV blocks for ``context`` tokens: the cache memory planning counts (one full
    context). Sequences in flight share it (the scheduler admits what fits and
    preempts when decoding outgrows it); what they leave holds earlier prompts'
    prefixes until new tokens need the room, least recently used first. The engine's
    own default instead grows the cache only as far as the sequences in flight need,
    so the next prompt overwrote the last one's blocks and the KV of an alternated
    system prompt was gone by its next turn."""
    block = KV_BLOCK_TOKENS["GPU" if device.startswith("GPU") else "CPU"]
    return -(-context // block) + 1


def open_pipeline(path: str, device: str, properties: dict[str, Any], *, context: int,
                  prefix_caching: bool = True) -> Any:
    """A ContinuousBatchingPipeline over a model folder (or GGUF file)."""
    import openvino_genai as og

    scheduler = og.SchedulerConfig()
    scheduler.max_num_batched_tokens = MAX_BATCHED_TOKENS
    scheduler.dynamic_split_fuse = True
    scheduler.enable_prefix_caching = prefix_caching
    scheduler.num_kv_blocks = kv_blocks(context, device)
    return og.ContinuousBatchingPipeline(path, scheduler, device, properties)


class TextWindow:
    """One sequence's detokenizer state: the recent tokens decoded together.

    A token's text is what decoding the window adds to the window's previous text; a
    byte-level token that ends mid-character adds nothing until the character is whole.
    After DETOKENIZE_WINDOW tokens the window restarts from the last token (one token
    of context keeps SentencePiece's leading spaces right) once a token has added text;
    the text of that one-token window is decoded with the next token's window, in the
    same call.
    """

    __slots__ = ("text", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.text: str | None = ""  # None: the window restarted; decode it again


class Detokenizer:
    """Text pieces for new tokens of many sequences, one decode call per window length.

    Windows of the same length go to the tokenizer together; lengths are not mixed
    because a batch decode pads the shorter lists with the pad token, which some
    tokenizers do not skip."""

    def __init__(self, decode_many: DecodeMany) -> None:
        self._decode = decode_many

    def pieces(self, new: Sequence[tuple[TextWindow, int]]) -> list[str]:
        """The piece each (window, token) adds; one token per window per call."""
        jobs: list[list[int]] = []
        for window, token in new:
            if window.text is None:
                jobs.append(list(window.tokens))
            window.tokens.append(token)
            jobs.append(list(window.tokens))
        texts = iter(self._decode_grouped(jobs))
        out: list[str] = []
        for window, _ in new:
            if window.text is None:
                window.text = next(texts)
            full = next(texts)
            if full.endswith("\ufffd"):  # a character still incomplete
                out.append("")
                continue
            piece = full[len(window.text):]
            out.append(piece)
            window.text = full
            # Restart only after a token that added text: OpenVINO's detokenizers drop
            # the bytes of a character still incomplete (no "\ufffd" to see), and a
            # restart then would lose them for good.
            n = len(window.tokens)
            if (piece and n >= DETOKENIZE_WINDOW) or n >= 4 * DETOKENIZE_WINDOW:
                del window.tokens[:-1]
                window.text = None
        return out

    def _decode_grouped(self, jobs: list[list[int]]) -> list[str]:
        groups: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(len(job), []).append(i)
        out = [""] * len(jobs)
        for idx in groups.values():
            for i, text in zip(idx, self._decode([jobs[i] for i in idx]), strict=True):
                out[i] = text
        return out


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

    def __init__(self, pipe: Any, *, eos: frozenset[int], decode_many: DecodeMany,
                 config: Callable[[ResolvedSampling], Any]) -> None:
        import numpy as np
        import openvino
        import openvino_genai as og

        self._np, self._ov = np, openvino
        self.pipe: Any = pipe
        self._running = og.GenerationStatus.RUNNING
        self._finish_stop = og.GenerationFinishReason.STOP
        self._eos = eos
        self._detok = Detokenizer(decode_many)
        self._config = config
        self._active: dict[int, _Sequence] = {}
        # log probabilities: each token's text decoded alone (an IR folder has no
        # tokenizer.json), memoized
        self._scorer = Scorer(TokenBytes(None, lambda t: decode_many([[t]])[0]))

    def add(self, key: int, prompt: Prompt, sampling: ResolvedSampling,
            stats: GenerationStats) -> None:
        ids = self._ov.Tensor(self._np.asarray([list(prompt.tokens)], dtype=self._np.int64))
        config = self._config(sampling)
        if stats.logprobs is not None:  # the chosen token's, raw (logprobs.OPENVINO_RAW)
            config.logprobs = 1
        try:
            handle = self.pipe.add_request(key, ids, config)
        except RuntimeError as e:  # XGrammar refusing this sequence's schema
            raise _mapped(e, sampling.constraint) from e
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
            raise _mapped(e, constraint) from e
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


def _mapped(error: RuntimeError, constraint: Constraint | None) -> Exception:
    if constraint is not None and is_openvino_grammar_error(error):
        return openvino_schema_error(constraint, error)
    return error


def cpu_precision(hint: Any) -> str:
    """The CPU plugin's compute precision: the hint given, or its default on this CPU
    (bf16 where the CPU has AVX-512 BF16 or AMX, else f32)."""
    if hint:
        return str(hint).lower()
    import openvino

    return str(openvino.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name())
