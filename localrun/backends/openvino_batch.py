"""Continuous batching for OpenVINO GenAI sessions (``Session.generate_batch``).

``LLMPipeline`` runs one request at a time; ``ContinuousBatchingPipeline`` schedules
many sequences through one model, adding and dropping them between steps. It is a
second pipeline over the same folder, built on the first batch and kept with the
session (for SmolLM2-135M int4 it costs ~100 MB more). We drive it ourselves:
``add_request`` with the token ids localrun counted, ``step()``, then ``read()`` the
new token ids of each handle, so each sequence streams, stops on its own cancel
token (a stop string matched) and admits the next queued prompt as soon as a slot
frees up (``max_concurrency``).

The OpenVINO session opts in with::

    supports_batch = True

    def generate_batch(self, *args: Any) -> Iterator[tuple[int, str | None]]:
        from localrun.backends.openvino_batch import generate_batch
        return generate_batch(self, *args)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from localrun.backends.base import GenerationStats, Prompt, Session
from localrun.sampling import ResolvedSampling
from localrun.structured.engines import is_openvino_grammar_error, openvino_schema_error
from localrun.types import CancelToken, FinishReason

#: Tokens the scheduler may process in one step (prefill chunks + one per decoding
#: sequence). The engine default (256) splits the prefill of a batch of short chat
#: prompts over many steps; 1024 keeps a 16-prompt batch's prefill to a step or two.
MAX_BATCHED_TOKENS = 1024
#: When the caller gives no max_concurrency: enough to fill this CPU's SIMD lanes with
#: a small model, few enough that each sequence's KV cache stays small.
DEFAULT_CONCURRENCY = 16


class ContinuousBatcher:
    """A ContinuousBatchingPipeline over the session's model folder."""

    def __init__(self, path: str, device: str, properties: dict[str, Any]) -> None:
        import openvino_genai as og

        self._og = og
        config = og.SchedulerConfig()
        config.max_num_batched_tokens = MAX_BATCHED_TOKENS
        config.dynamic_split_fuse = True
        # cache_size 0 and num_kv_blocks 0: the KV cache grows as sequences need it.
        self.pipe = og.ContinuousBatchingPipeline(path, config, device, properties)

    def run(
        self,
        session: Any,
        prompts: Sequence[Prompt],
        samplings: Sequence[ResolvedSampling],
        cancels: Sequence[CancelToken],
        stats: Sequence[GenerationStats],
        max_concurrency: int | None,
    ) -> Iterator[tuple[int, str | None]]:
        import numpy as np
        import openvino

        from localrun.backends.openvino_genai import IncrementalDetokenizer

        og, pipe = self._og, self.pipe
        running = og.GenerationStatus.RUNNING
        finish_stop = og.GenerationFinishReason.STOP
        eos = session._eos
        decode = session._tok.decode
        width = max_concurrency or DEFAULT_CONCURRENCY
        pending = deque(range(len(prompts)))
        active: dict[int, tuple[Any, IncrementalDetokenizer]] = {}
        ctx = session.info.context_length
        try:
            while pending or active:
                while pending and len(active) < width:
                    k = pending.popleft()
                    limit = min(samplings[k].max_tokens, ctx - len(prompts[k].tokens))
                    if cancels[k].cancelled or limit <= 0:
                        stats[k].finish_reason = "length" if limit <= 0 else None
                        yield k, None
                        continue
                    ids = openvino.Tensor(np.asarray([list(prompts[k].tokens)], dtype=np.int64))
                    handle = pipe.add_request(k, ids, session._config(samplings[k], limit))
                    stats[k].started = time.perf_counter()
                    stats[k].prefill_tokens = len(prompts[k].tokens)
                    active[k] = (handle, IncrementalDetokenizer(decode))
                pipe.step()
                for k, (handle, detok) in list(active.items()):
                    reason: FinishReason | None = None
                    while handle.can_read():
                        for out in handle.read().values():
                            for t in out.generated_ids:
                                if t in eos:
                                    reason = "stop"
                                    continue
                                stats[k].completion_tokens += 1
                                yield k, detok.add(int(t))
                            if out.finish_reason == finish_stop:
                                reason = "stop"
                    if cancels[k].cancelled:
                        handle.cancel()
                    elif handle.get_status() == running:
                        continue
                    stats[k].finish_reason = reason or "length"
                    del active[k]
                    yield k, None
        except RuntimeError as e:  # XGrammar refusing a schema (raised by add_request/step)
            constraint = next((s.constraint for s in samplings if s.constraint is not None),
                              None)
            if constraint is not None and is_openvino_grammar_error(e):
                raise openvino_schema_error(constraint, e) from e
            raise
        finally:
            for handle, _ in active.values():  # closed early: free their KV blocks
                handle.cancel()
            # A cancelled request's blocks are freed by the next step; without it the
            # pipeline reports leaked blocks when it is destroyed.
            pipe.step()
            while pipe.has_non_finished_requests():
                pipe.step()


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


def generate_batch(
    session: Session,
    prompts: Sequence[Prompt],
    samplings: Sequence[ResolvedSampling],
    cancels: Sequence[CancelToken],
    stats: Sequence[GenerationStats],
    max_concurrency: int | None,
) -> Iterator[tuple[int, str | None]]:
    """``Session.generate_batch`` for an OpenVINO GenAI session."""
    batcher: ContinuousBatcher | None = getattr(session, "_batcher", None)
    if batcher is None:
        device = getattr(session, "device", "CPU")
        props = batch_properties(getattr(session, "load_properties", {}) or {}, device)
        batcher = ContinuousBatcher(session.info.path, device, props)
        session._batcher = batcher  # type: ignore[attr-defined]
    return batcher.run(session, prompts, samplings, cancels, stats, max_concurrency)


def batching_session(session: Session) -> Session:
    """Turn on batching for a loaded OpenVINO session until its own hook lands."""
    cls = type(session)
    if getattr(cls, "supports_batch", False):
        return session
    name = cls.__name__ + "WithBatching"
    sub = type(name, (cls,), {"supports_batch": True, "generate_batch": generate_batch})
    session.__class__ = sub
    return session
