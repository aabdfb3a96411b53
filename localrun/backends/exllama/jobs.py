"""The job driver: both engines' dynamic generators (ExLlamaV2DynamicGenerator, exllamav3
Generator) share ``enqueue / iterate / cancel`` and the result dicts they return, which
become :class:`~localrun.backends.base.GenerationStats`. :class:`JobBatcher` is the
session's :class:`~localrun.backends.base.Batcher` (the driver steps it when sequences
overlap); :func:`run_jobs` runs a fixed set of sequences through one (a lone
``generate()``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from localrun.backends.base import Batcher, GenerationStats, Prompt
from localrun.backends.exllama.errors import EngineJobError
from localrun.sampling import ResolvedSampling
from localrun.types import CancelToken, FinishReason

#: A finished job's ``eos_reason`` -> localrun's finish reason.
EOS_REASONS: dict[str, FinishReason] = {
    "stop_token": "stop",
    "stop_string": "stop",
    "end_filter": "stop",
    "max_new_tokens": "length",
}


def token_count(ids: object) -> int:
    """Tokens in a result's ``token_ids`` (a (1, n) tensor) or a plain sequence."""
    shape = getattr(ids, "shape", None)
    if shape is not None:
        return int(shape[-1]) if len(shape) else 1
    if isinstance(ids, Sequence):
        inner = ids[0] if ids and isinstance(ids[0], Sequence) else ids
        return len(inner)
    return 0


def apply_final_result(result: Mapping[str, Any], stats: GenerationStats) -> None:
    """Fill ``stats`` from a job's last result (``"eos": True``).

    ``new_tokens`` counts the stop token that ended the job; localrun does not (as on
    every other engine). ``time_prefill`` runs from the first prefill to the first
    sampled token, ``time_generate`` from there to the last one, so decode covers
    ``new_tokens - 1`` steps. Pages the engine found in its prefix cache were not
    prefilled again: they are left out of the prefill count.
    """
    reason = result.get("eos_reason")
    new = int(result.get("new_tokens", stats.completion_tokens))
    stats.finish_reason = EOS_REASONS.get(str(reason), "length")
    stats.completion_tokens = max(new - 1, 0) if reason == "stop_token" else new
    prompt = int(result.get("prompt_tokens", 0))
    cached = int(result.get("cached_tokens", 0))
    stats.prefill_tokens = max(prompt - cached, 1) if prompt else 0
    stats.prefill_seconds = max(float(result.get("time_prefill", 0.0)), 0.0)
    stats.decode_tokens = max(new - 1, 0)
    stats.decode_seconds = max(float(result.get("time_generate", 0.0)), 0.0)


#: Builds one engine job: (prompt, sampling, identifier) -> job object. The job's
#: ``max_new_tokens`` is ``sampling.max_tokens``, which the driver has already clamped
#: to the room the context leaves after the prompt.
MakeJob = Callable[[Prompt, ResolvedSampling, int], Any]


class JobBatcher(Batcher):
    """Sequences as jobs on a dynamic generator (ExLlamaV2DynamicGenerator or exllamav3
    Generator): ``add`` enqueues a job, ``step`` is one ``generator.iterate()``, ``cancel``
    is ``generator.cancel(job)``. The generator batches the jobs it can fit and queues
    the rest itself.

    Results are matched to sequences by their ``"job"`` object (``"serial"`` as a
    fallback): every result of both engines carries those, while ``"identifier"`` is
    missing from exllamav3's failed-job results. A job the engine failed alone
    (exllamav3 reports allocation and prefill failures as an ``"error"`` result and
    serves on), or one that left the engine's queues without a final result, ends only
    its own sequence, with ``stats.error`` an :class:`EngineJobError`. An exception out
    of ``iterate()`` itself (ExLlamaV2 contains no failures, nor does exllamav3 in the
    forward pass) comes out of :meth:`step`.

    Text the engine still holds back when a stop token ends a job (the result's
    ``"held"``: the stop token's own piece, and any incomplete UTF-8 before it) is not
    part of the reply. A requeued job (exllamav3 ``"requeue"``) is the same job object
    with the same serial: still one sequence.
    """

    #: the jobs share the pages of the cache the session allocated at load
    reserved_bytes = 0

    def __init__(self, generator: Any, make_job: MakeJob, engine: str = "",
                 capacity: int | None = None) -> None:
        self.generator = generator
        self._make_job = make_job
        self._engine = engine
        #: the generator's own batch size (it queues jobs beyond it)
        self.capacity = capacity or int(getattr(generator, "max_batch_size", 0) or 16)
        self._jobs: dict[int, Any] = {}  # key -> the engine's job, while in flight
        self._stats: dict[int, GenerationStats] = {}
        self._by_job: dict[int, int] = {}  # id(job) -> key
        self._by_serial: dict[int, int] = {}
        self._ended: list[tuple[int, str | None]] = []  # ends for the next step to report

    def add(self, key: int, prompt: Prompt, sampling: ResolvedSampling,
            stats: GenerationStats) -> None:
        stats.started = time.perf_counter()
        stats.prefill_tokens = len(prompt.tokens)  # the final result takes cached pages off
        if sampling.max_tokens <= 0:  # the prompt left no room for a reply
            stats.finish_reason = "length"
            self._ended.append((key, None))
            return
        job = self._make_job(prompt, sampling, key)
        serial = self.generator.enqueue(job)
        self._jobs[key] = job
        self._stats[key] = stats
        self._by_job[id(job)] = key
        if isinstance(serial, int) and not isinstance(serial, bool):
            self._by_serial[serial] = key

    def cancel(self, key: int) -> None:
        job = self._forget(key)
        if job is None:
            return  # already ended (and reported)
        self._ended.append((key, None))
        with contextlib.suppress(Exception):  # the engine may be gone (a failed step)
            self.generator.cancel(job)

    def step(self) -> list[tuple[int, str | None]]:
        out, self._ended = self._ended, []
        if not self._jobs:
            return out
        for r in self.generator.iterate():
            key = self._key_of(r)
            if key is None:
                continue
            stage = r.get("stage")
            if stage == "error":
                self._fail(key, r.get("error"))
                out.append((key, None))
                continue
            if stage != "streaming":
                continue  # "started", "prefill": progress through the prompt
            stats = self._stats[key]
            count = token_count(r["token_ids"]) if "token_ids" in r else 0
            text = r.get("text", "")
            if count or text:
                stats.completion_tokens += count
                out.append((key, text))
            if r.get("eos"):
                self._forget(key)
                apply_final_result(r, stats)
                out.append((key, None))
        remaining = getattr(self.generator, "num_remaining_jobs", None)
        if self._jobs and remaining is not None and remaining() == 0:
            # The engine holds none of them: waiting would spin forever on empty results.
            for key in list(self._jobs):
                self._fail(key, None)
                out.append((key, None))
        return out

    def close(self) -> None:
        for key in list(self._jobs):
            self.cancel(key)
        self._ended.clear()

    def _forget(self, key: int) -> Any:
        job = self._jobs.pop(key, None)
        self._stats.pop(key, None)
        if job is not None:
            self._by_job.pop(id(job), None)
        for serial in [s for s, k in self._by_serial.items() if k == key]:
            del self._by_serial[serial]
        return job

    def _fail(self, key: int, error: object) -> None:
        """The engine gave up on this job alone (None: it vanished from the queues)."""
        stats = self._stats[key]
        self._forget(key)
        failure = EngineJobError(self._engine, {key: error}, numbered=False)
        failure.__cause__ = error if isinstance(error, BaseException) else None
        stats.error = failure

    def _key_of(self, r: Mapping[str, Any]) -> int | None:
        job = r.get("job")
        key = self._by_job.get(id(job)) if job is not None else None
        if key is not None and self._jobs.get(key) is job:
            return key
        serial = r.get("serial")
        return self._by_serial.get(serial) if isinstance(serial, int) else None


def run_jobs(
    generator: Any,
    make_job: MakeJob,
    prompts: Sequence[Prompt],
    samplings: Sequence[ResolvedSampling],
    cancels: Sequence[CancelToken],
    stats: Sequence[GenerationStats],
    max_concurrency: int | None,
    engine: str = "",
) -> Iterator[tuple[int, str | None]]:
    """Run these sequences to their end through a :class:`JobBatcher` on ``generator``.

    Yields ``(index, text)`` as the engine streams, then ``(index, None)`` once a
    sequence is done (finished, cancelled, or given no room). At most
    ``max_concurrency`` jobs are queued at once. A cancel token set between steps
    cancels that job in the engine; closing this iterator cancels every job still
    queued. A job the engine failed alone ends only its own sequence (no ``None``
    for it): the others run on, and one :class:`EngineJobError` naming every failed
    sequence is raised once they are done.
    """
    batcher = JobBatcher(generator, make_job, engine)
    waiting = list(range(len(prompts)))
    live: set[int] = set()
    failed: dict[int, object] = {}  # index -> the engine's error (None: the job vanished)
    cap = max_concurrency or len(prompts)
    try:
        while waiting or live:
            for i in [i for i in live if cancels[i].cancelled]:
                batcher.cancel(i)
            while waiting and len(live) < cap:
                i = waiting.pop(0)
                if cancels[i].cancelled:
                    yield i, None
                    continue
                batcher.add(i, prompts[i], samplings[i], stats[i])
                live.add(i)
            for i, piece in batcher.step():
                if piece is None:
                    live.discard(i)
                    error = stats[i].error
                    if isinstance(error, EngineJobError):
                        failed.update(error.failures)
                        continue
                yield i, piece
    finally:
        batcher.close()
    if failed:
        first = failed[min(failed)]
        raise EngineJobError(engine, failed, numbered=len(prompts) > 1) from (
            first if isinstance(first, BaseException) else None)
