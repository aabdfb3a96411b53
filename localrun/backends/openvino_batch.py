"""Continuous batching for OpenVINO GenAI sessions: the session's :class:`Batcher`.

``LLMPipeline`` runs one request at a time; ``ContinuousBatchingPipeline`` schedules
many sequences through one model, adding and dropping them between steps. It is a
second pipeline over the same folder, built the first time sequences overlap and kept
with the session (for SmolLM2-135M int4 it costs ~100 MB more). The driver's engine
thread drives it: ``add_request`` with the token ids localrun counted, ``step()``,
then ``read()`` the new token ids of each handle, so each sequence streams, stops on
its own (a stop string matched, its caller went away) and frees its slot for the next
waiting one. A cancelled handle's KV blocks are freed by the next ``step()``; without
that the pipeline reports leaked blocks when it is destroyed.

The session gives what the batcher needs explicitly (its EOS ids, a detokenizer, its
GenerationConfig builder), so this module does not import the session's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from localrun.backends.base import Batcher, GenerationStats, Prompt
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.structured.engines import is_openvino_grammar_error, openvino_schema_error
from localrun.types import FinishReason

#: Tokens the scheduler may process in one step (prefill chunks + one per decoding
#: sequence). The engine default (256) splits the prefill of a batch of short chat
#: prompts over many steps; 1024 keeps a 16-prompt batch's prefill to a step or two.
MAX_BATCHED_TOKENS = 1024
#: Sequences in flight at once: the pipeline's KV cache grows as they need it, and 32
#: is the batch of ContinuousBatchingPipeline.generate() localrun is measured against.
CAPACITY = 32


class _Sequence:
    __slots__ = ("cancelled", "constraint", "detok", "handle", "reason", "stats")

    def __init__(self, handle: Any, detok: Callable[[int], str], stats: GenerationStats,
                 constraint: Constraint | None) -> None:
        self.handle = handle
        self.detok = detok
        self.stats = stats
        self.constraint = constraint
        self.reason: FinishReason | None = None
        self.cancelled = False


class ContinuousBatcher(Batcher):
    """A ContinuousBatchingPipeline over the session's model folder."""

    capacity = CAPACITY

    def __init__(self, path: str, device: str, properties: dict[str, Any], *,
                 eos: frozenset[int], detokenizer: Callable[[], Callable[[int], str]],
                 config: Callable[[ResolvedSampling], Any]) -> None:
        import numpy as np
        import openvino
        import openvino_genai as og

        self._np, self._ov = np, openvino
        scheduler = og.SchedulerConfig()
        scheduler.max_num_batched_tokens = MAX_BATCHED_TOKENS
        scheduler.dynamic_split_fuse = True
        # cache_size 0 and num_kv_blocks 0: the KV cache grows as sequences need it.
        self.pipe: Any = og.ContinuousBatchingPipeline(path, scheduler, device, properties)
        self._running = og.GenerationStatus.RUNNING
        self._finish_stop = og.GenerationFinishReason.STOP
        self._eos = eos
        self._detokenizer = detokenizer
        self._config = config
        self._active: dict[int, _Sequence] = {}

    def add(self, key: int, prompt: Prompt, sampling: ResolvedSampling,
            stats: GenerationStats) -> None:
        ids = self._ov.Tensor(self._np.asarray([list(prompt.tokens)], dtype=self._np.int64))
        try:
            handle = self.pipe.add_request(key, ids, self._config(sampling))
        except RuntimeError as e:  # XGrammar refusing this sequence's schema
            raise _mapped(e, sampling.constraint) from e
        stats.started = time.perf_counter()
        stats.prefill_tokens = len(prompt.tokens)
        self._active[key] = _Sequence(handle, self._detokenizer(), stats, sampling.constraint)

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
        out: list[tuple[int, str | None]] = []
        eos, running, finish_stop = self._eos, self._running, self._finish_stop
        for key, seq in list(self._active.items()):
            handle = seq.handle
            if not seq.cancelled:
                stats = seq.stats
                while handle.can_read():
                    for res in handle.read().values():
                        for t in res.generated_ids:
                            if t in eos:
                                seq.reason = "stop"
                                continue
                            stats.completion_tokens += 1
                            out.append((key, seq.detok(int(t))))
                        if res.finish_reason == finish_stop:
                            seq.reason = "stop"
                if handle.get_status() == running:
                    continue
            seq.stats.finish_reason = seq.reason or "length"
            del self._active[key]
            out.append((key, None))
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


def batch_properties(props: dict[str, Any], device: str,
                     compute: str | None = None) -> dict[str, Any]:
    """The session's load properties, as ContinuousBatchingPipeline takes them.

    That pipeline is paged attention only, and the CPU plugin refuses ATTENTION_BACKEND
    (it is LLMPipeline's). Paged attention on the CPU takes a KV cache of the compute
    precision or a quantized one: the single-sequence pipeline's f32 cache only where
    the CPU computes in f32 ("expect kvcache type bf16" on AVX-512 BF16/AMX). Elsewhere
    the cache takes the compute precision (``compute``; by default the hint given, else
    the plugin's), which keeps keys and values as computed, as the f32 cache does; the
    engine's own default, u8, quantizes them, and greedy replies then left the
    single-sequence ones as early as their first token.
    """
    out = dict(props)
    out.pop("ATTENTION_BACKEND", None)
    if device.startswith("CPU") and out.get("KV_CACHE_PRECISION") == "f32":
        precision = compute or _cpu_precision(out.get("INFERENCE_PRECISION_HINT"))
        if precision != "f32":
            out["KV_CACHE_PRECISION"] = precision
    return out


def _cpu_precision(hint: Any) -> str:
    """The CPU plugin's compute precision: the hint given, or its default on this CPU."""
    if hint:
        return str(hint).lower()
    import openvino

    return str(openvino.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name())
