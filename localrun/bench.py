"""Benchmark harness and statistics for ``localrun bench``. It measures; it never prints.

A benchmark number means nothing without its context, so every report carries the
model (architecture, parameters, format, quant and group size), the engine and its
version, the host (CPU, cores, RAM, GPUs, OS, load average), the memory bandwidth this
process measured, the workload shape and the date. Prefill and decode are measured
separately, latencies are reported as p50/p95/p99, and throughput is measured at each
concurrency level.

How it measures (the details matter when comparing engines):

- Prompts are synthetic words, exact in token count for the model's own tokenizer
  (``Model.count_tokens``; BOS included when the model adds one), sent raw (no chat
  template) so ``usage.prompt_tokens`` equals the requested length; every report checks
  it (``prompt_tokens_exact``). Every request gets a different first word, so no engine
  can reuse a previous request's KV cache unless ``--shared-prefix`` asks for exactly that.
- Decoding is greedy (temperature 0, every filter and penalty off) with
  ``max_tokens = gen_tokens``. A model may still stop at end-of-sequence: the actual
  count is recorded (``output_tokens``, ``short_requests``) and
  TPOT = (e2e - TTFT) / (tokens - 1) uses it.
- Concurrency 1 streams each request (``Model.stream``) and timestamps every chunk:
  TTFT is the first chunk with text. Concurrency c > 1 sends ``runs`` rounds of c
  requests through ``Model.batch_iter(max_concurrency=c)``; an engine that batches runs
  them at once, the others queue them. Per request, e2e runs from the round's start to
  its Completion, TTFT = e2e - (Completion.timings.total - Completion.timings.ttft), so
  queueing counts in both, as a user would see it. ``mode`` says which happened,
  measured from whether the requests' service intervals overlapped.
- Peak memory: Linux's VmHWM, reset before each model loads (``/proc/self/clear_refs``)
  so each (model, backend) gets its own peak; else the process peak
  (``peak_rss_scope``). VRAM: this process's memory on NVIDIA GPUs through NVML,
  sampled after loading and after each workload; ``None`` where NVML is absent.
- Roofline: decode is bound by reading every weight once per token, so
  share = weight_bytes x decode tokens/s / read bandwidth, with the bandwidth measured
  here by a single-threaded scan of a buffer several times the last-level cache. A
  multi-threaded engine, or a model small enough to sit in the cache, can exceed 1.0.

The JSON schema (``BenchReport.to_dict``) is documented field by field in docs/bench.md;
``schema_version`` changes whenever a field changes meaning or disappears.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localrun.errors import BenchError, LocalrunError

if TYPE_CHECKING:
    from localrun.api import Model
    from localrun.formats.detect import DetectedModel
    from localrun.hardware import HardwareProfile

SCHEMA_VERSION = 1

#: Greedy decoding with every filter and penalty off: the same work on every engine.
GREEDY: dict[str, Any] = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                          "repetition_penalty": 1.0}

Progress = Callable[[str], None]

# -- statistics ------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between closest ranks.

    This is numpy's default (Hyndman & Fan type 7): p50 of [1, 2, 3, 4] is 2.5, and
    p99 of few samples lies just below the maximum.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside 0..100")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """Distribution of one metric over a workload's requests (seconds)."""

    n: int
    mean: float
    min: float
    max: float
    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            raise ValueError("summary of no values")
        return cls(n=len(values), mean=sum(values) / len(values), min=min(values),
                   max=max(values), p50=percentile(values, 50), p95=percentile(values, 95),
                   p99=percentile(values, 99))


def tpot(e2e: float, ttft: float, tokens: int) -> float | None:
    """Time per output token after the first: (e2e - TTFT) / (tokens - 1).

    None below two tokens, where there is no inter-token interval to measure.
    """
    if tokens < 2:
        return None
    return max(e2e - ttft, 0.0) / (tokens - 1)


def tokens_per_second(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50) if values else None


def roofline_share(weight_bytes: int | None, decode_tps: float | None,
                   bandwidth_bytes_per_s: float | None) -> float | None:
    """Share of the memory-bandwidth roofline reached in decode.

    Each decode step reads every weight once, so at best
    tokens/s = bandwidth / weight bytes; the share is weight_bytes x tokens/s / bandwidth.
    """
    if not weight_bytes or not decode_tps or not bandwidth_bytes_per_s:
        return None
    return weight_bytes * decode_tps / bandwidth_bytes_per_s


# -- memory bandwidth probe ------------------------------------------------------------


@dataclass(frozen=True)
class Bandwidth:
    """Memory bandwidth measured by this process (GB/s = 1e9 bytes/s)."""

    read_gb_per_s: float  # single-threaded scan (memchr): the roofline's denominator
    copy_gb_per_s: float  # single-threaded memmove, STREAM-style (2 x bytes / time)
    buffer_bytes: int
    repeats: int
    llc_bytes: int | None
    method: str = ("best of N single-threaded passes over a buffer larger than the "
                   "last-level cache: read = bytes.find scan, copy = memmove")


def last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache, from sysfs (Linux); None elsewhere."""
    best = None
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (idx / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            size = int(digits) * mult
            best = size if best is None else max(best, size)
    return best


def measure_bandwidth(buffer_bytes: int | None = None, repeats: int = 5) -> Bandwidth:
    """Measure read and copy bandwidth with plain bytearrays (no numpy).

    The default buffer is 4x the last-level cache, at least 256 MiB and at most 1 GiB
    (and a quarter of the available memory), so that the passes stream from DRAM.
    """
    llc = last_level_cache_bytes()
    if buffer_bytes is None:
        buffer_bytes = min(max(256 * 2**20, 4 * (llc or 0)), 2**30)
        avail = _meminfo_available()
        if avail:
            buffer_bytes = max(min(buffer_bytes, avail // 4), 16 * 2**20)
    # Filling writes every page: a calloc'ed buffer would map the shared zero page
    # and "read" at cache speed.
    src = bytearray(b"\x02") * buffer_bytes
    best_read = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        src.find(b"\x01")  # absent: memchr scans the whole buffer
        best_read = min(best_read, time.perf_counter() - t)
    dst = bytearray(b"\x03") * buffer_bytes
    best_copy = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        dst[:] = src
        best_copy = min(best_copy, time.perf_counter() - t)
    del src, dst
    return Bandwidth(read_gb_per_s=buffer_bytes / best_read / 1e9,
                     copy_gb_per_s=2 * buffer_bytes / best_copy / 1e9,
                     buffer_bytes=buffer_bytes, repeats=repeats, llc_bytes=llc)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# -- process memory --------------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux >= 4.0: clear_refs 5). False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> tuple[int | None, int | None]:
    """(current RSS, peak RSS) of this process in bytes; None where unknown."""
    cur = peak = None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if peak is None:
        try:
            import resource
            import sys

            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak = maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes vs KiB
        except (ImportError, OSError):
            pass
    return cur, peak


def vram_bytes() -> int | None:
    """GPU memory this process holds on NVIDIA GPUs (NVML); None when not measurable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no GPU: not measurable
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        pid, total = os.getpid(), 0
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory:
                    total += int(proc.usedGpuMemory)
        return total
    except Exception:  # e.g. NotSupported in containers without PID visibility
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


# -- prompts exact in tokens -----------------------------------------------------------

#: Plain, common words; random sequences of them rarely make a model stop early.
_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend "
    "father power hour game line end member law car city community name president team "
    "minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air "
    "teacher force education foot boy age policy music market sense nation plan college "
    "interest death experience effect class control care field development role effort rate "
    "heart drug show leader light voice wife police mind price report decision son view "
    "relationship town road arm difference value building action model season society tax "
    "director position player record paper space ground form event official matter center "
    "couple site project activity star table need court oil situation cost industry figure "
    "street image phone data picture practice piece land product doctor wall patient worker "
    "news test movie north love support technology step baby computer type attention film "
    "tree source organization hair window evidence population truth song river stone cloud "
    "garden bridge island forest mountain "
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

FILLERS: tuple[str, ...] = (" the", " a", " of", " and", " to", " in", ".", ",", " is", " it")


def synthetic_words(seed: int, n: int) -> list[str]:
    """n words; the first depends only on ``seed`` so neighbouring seeds differ at once."""
    rng = random.Random(seed)
    return [WORDS[seed % len(WORDS)]] + [rng.choice(WORDS) for _ in range(n - 1)]


def exact_prompt(count_tokens: Callable[[str], int], n_tokens: int, *, seed: int,
                 head: str = "") -> str:
    """Text that is exactly ``n_tokens`` tokens for ``count_tokens`` (BOS included).

    ``head`` starts every prompt (a shared prefix); words seeded by ``seed`` follow. The
    word count is found by bisection, then single-token fillers close the gap.
    """
    def text_of(k: int) -> str:
        body = " ".join(words[:k])
        return f"{head} {body}" if head and body else (head or body)

    words = synthetic_words(seed, 2 * n_tokens + 8)
    lo, hi = 0, len(words)
    if count_tokens(text_of(0)) > n_tokens:
        raise BenchError(f"Cannot build a {n_tokens}-token prompt: the model's tokenizer "
                         f"needs {count_tokens(text_of(0))} tokens for the shortest one",
                         hint="ask for more prompt tokens (--prompt-tokens)")
    while lo < hi:  # largest k whose text fits in n_tokens
        mid = (lo + hi + 1) // 2
        if count_tokens(text_of(mid)) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    text = text_of(lo)
    have = count_tokens(text)
    while have < n_tokens:
        for filler in FILLERS:
            n = count_tokens(text + filler)
            if have < n <= n_tokens:
                text, have = text + filler, n
                break
        else:
            break
    if have != n_tokens:
        raise BenchError(f"Cannot build a prompt of exactly {n_tokens} tokens for this "
                         f"tokenizer (closest: {have})",
                         hint="try a slightly different --prompt-tokens value")
    return text


# -- one request -----------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSample:
    """One request's measurements (seconds; start_s relative to its workload's start)."""

    prompt_tokens: int
    output_tokens: int
    ttft_s: float  # as the caller saw it, queueing included
    e2e_s: float
    tpot_s: float | None
    service_ttft_s: float  # Completion.timings.ttft: from when the engine took it up
    reported_prefill_tps: float  # Completion.timings: engine counters where it has them
    reported_decode_tps: float
    finish_reason: str
    start_s: float  # when the engine took it up


def measure_stream(model: Model, text: str, gen_tokens: int) -> RequestSample:
    """One raw greedy request through ``Model.stream``, timestamping each chunk."""
    t0 = time.perf_counter()
    first = 0.0
    with model.stream(text, raw=True, max_tokens=gen_tokens, **GREEDY) as stream:
        for chunk in stream:
            if not first and chunk.text:
                first = time.perf_counter()
        end = time.perf_counter()
    c = stream.completion
    assert c is not None
    ttft = (first or end) - t0
    n = c.usage.completion_tokens
    return RequestSample(c.usage.prompt_tokens, n, ttft, end - t0, tpot(end - t0, ttft, n),
                         c.timings.ttft, c.timings.prefill_tps, c.timings.decode_tps,
                         c.finish_reason, 0.0)


def measure_round(model: Model, texts: Sequence[str], gen_tokens: int,
                  ) -> tuple[list[RequestSample], float]:
    """``len(texts)`` requests at once through ``Model.batch_iter``; (samples, wall)."""
    from localrun.batch import BatchItem

    items = [BatchItem(t, raw=True) for t in texts]
    t_start = time.perf_counter()
    samples: list[RequestSample] = []
    for _, result in model.batch_iter(items, max_concurrency=len(items),
                                      max_tokens=gen_tokens, **GREEDY):
        t_done = time.perf_counter()
        if isinstance(result, LocalrunError):
            raise result
        tm, n = result.timings, result.usage.completion_tokens
        e2e = t_done - t_start
        decode_phase = max(tm.total - tm.ttft, 0.0)
        ttft = max(e2e - decode_phase, 0.0)
        samples.append(RequestSample(result.usage.prompt_tokens, n, ttft, e2e,
                                     tpot(e2e, ttft, n), tm.ttft, tm.prefill_tps,
                                     tm.decode_tps, result.finish_reason,
                                     max(e2e - tm.total, 0.0)))
    return samples, time.perf_counter() - t_start


def overlapped(samples: Sequence[RequestSample], slack: float = 1e-3) -> bool:
    """Did the engine work on two requests at once (their service intervals overlap)?"""
    spans = sorted((s.start_s, s.e2e_s) for s in samples)
    return any(nxt[0] < cur[1] - slack for cur, nxt in itertools.pairwise(spans))


# -- results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadResult:
    """Everything measured for one (prompt length, concurrency) on one model + backend."""

    prompt_tokens: int
    gen_tokens: int
    concurrency: int
    requests: int
    mode: str  # "stream" (c=1) | "batched" (engine overlapped them) | "queued" (one at a time)
    wall_s: float
    ttft: Summary
    tpot: Summary | None
    e2e: Summary
    prefill_tokens_per_s: float  # median of prompt_tokens / service TTFT
    decode_tokens_per_s: float | None  # median of 1 / TPOT, per request
    reported_prefill_tokens_per_s: float | None  # median of Completion.timings.prefill_tps
    reported_decode_tokens_per_s: float | None
    requests_per_s: float
    output_tokens_per_s: float  # all requests' tokens / wall time
    output_tokens_min: int
    output_tokens_mean: float
    output_tokens_max: int
    short_requests: int  # stopped before gen_tokens (end-of-sequence)
    prompt_tokens_exact: bool
    roofline_share: float | None
    samples: tuple[RequestSample, ...]


def summarize_workload(samples: Sequence[RequestSample], *, prompt_tokens: int,
                       gen_tokens: int, concurrency: int, wall_s: float, mode: str,
                       weight_bytes: int | None = None,
                       bandwidth_bytes_per_s: float | None = None) -> WorkloadResult:
    """Aggregate request samples into the workload's figures."""
    if not samples:
        raise ValueError("no samples")
    tpots = [s.tpot_s for s in samples if s.tpot_s is not None]
    decode = [1.0 / t for t in tpots if t > 0]
    prefill = [tokens_per_second(s.prompt_tokens, s.service_ttft_s) for s in samples]
    rep_pre = [s.reported_prefill_tps for s in samples if s.reported_prefill_tps > 0]
    rep_dec = [s.reported_decode_tps for s in samples if s.reported_decode_tps > 0]
    outs = [s.output_tokens for s in samples]
    decode_tps = median(decode)
    return WorkloadResult(
        prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, concurrency=concurrency,
        requests=len(samples), mode=mode, wall_s=wall_s,
        ttft=Summary.of([s.ttft_s for s in samples]),
        tpot=Summary.of(tpots) if tpots else None,
        e2e=Summary.of([s.e2e_s for s in samples]),
        prefill_tokens_per_s=median(prefill) or 0.0,
        decode_tokens_per_s=decode_tps,
        reported_prefill_tokens_per_s=median(rep_pre),
        reported_decode_tokens_per_s=median(rep_dec),
        requests_per_s=tokens_per_second(len(samples), wall_s),
        output_tokens_per_s=tokens_per_second(sum(outs), wall_s),
        output_tokens_min=min(outs), output_tokens_mean=sum(outs) / len(outs),
        output_tokens_max=max(outs),
        short_requests=sum(1 for n in outs if n < gen_tokens),
        prompt_tokens_exact=all(s.prompt_tokens == prompt_tokens for s in samples),
        roofline_share=roofline_share(weight_bytes, decode_tps, bandwidth_bytes_per_s),
        samples=tuple(samples),
    )


@dataclass(frozen=True)
class PrefixCacheResult:
    """TTFT with a prompt prefix shared with the previous request vs unique prompts."""

    prompt_tokens: int
    shared_prefix_tokens: int
    cold_ttft: Summary  # unique prompts (concurrency 1)
    warm_ttft: Summary  # same prefix as the request before, different tail
    ttft_gain: float  # cold p50 / warm p50: 1.0 = no reuse


@dataclass(frozen=True)
class MemoryResult:
    rss_before_load_bytes: int | None
    rss_after_load_bytes: int | None
    peak_rss_bytes: int | None
    peak_rss_scope: str  # "model" (reset before loading) | "process" (includes earlier ones)
    vram_bytes: int | None  # max sampled; None = not measurable here ("n/a")


@dataclass(frozen=True)
class ModelContext:
    reference: str  # what the user named
    name: str | None
    path: str
    architecture: str | None
    parameters: int | None
    parameters_source: str  # "gguf tensor table", "config.json (dense estimate)", "unknown"
    format: str
    quantization: str | None
    group_size: int | None  # elements per quantization block/group
    weight_bytes: int | None  # bytes of weights read per decoded token (roofline)
    backend: str
    engine_version: str
    context_length: int
    load_s: float


@dataclass(frozen=True)
class RunResult:
    model: ModelContext
    memory: MemoryResult
    workloads: tuple[WorkloadResult, ...]
    prefix_cache: tuple[PrefixCacheResult, ...]


@dataclass(frozen=True)
class Skipped:
    model: str
    backend: str | None
    reason: str


@dataclass(frozen=True)
class HostContext:
    os: str
    os_version: str
    arch: str
    cpu_model: str | None
    physical_cores: int | None
    logical_cores: int | None
    usable_cores: int | None
    ram_total_bytes: int | None
    gpus: tuple[dict[str, Any], ...]  # {"name", "vendor", "memory_total_bytes"}
    load_average_start: tuple[float, float, float] | None
    load_average_end: tuple[float, float, float] | None


@dataclass(frozen=True)
class Workload:
    prompt_tokens: tuple[int, ...]
    gen_tokens: int
    concurrency: tuple[int, ...]
    runs: int
    warmup: int
    shared_prefix: bool
    prompt_kind: str = "synthetic words, raw completion (no chat template)"
    sampling: str = "greedy: temperature 0, top_k 0, top_p 1, min_p 0, repetition_penalty 1"


@dataclass(frozen=True)
class BenchReport:
    schema_version: int
    localrun_version: str
    date: str  # ISO 8601, UTC, when the run started
    host: HostContext
    bandwidth: Bandwidth
    workload: Workload
    results: tuple[RunResult, ...]
    skipped: tuple[Skipped, ...]
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- configuration and targets ---------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    models: tuple[str, ...] = ("smollm2:135m",)
    backend: str = "auto"  # "auto", "all", or a backend name
    prompt_tokens: tuple[int, ...] = (128, 512, 2048)
    gen_tokens: int = 128
    concurrency: tuple[int, ...] = (1, 4, 8)
    runs: int = 5
    warmup: int = 1
    shared_prefix: bool = False
    bandwidth_bytes: int | None = None  # None: sized from the last-level cache

    def validate(self) -> None:
        def positive(name: str, values: Sequence[int], least: int = 1) -> None:
            if not values:
                raise BenchError(f"{name} needs at least one value")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or v < least:
                    raise BenchError(f"Invalid {name} value {v!r}: expected an integer >= "
                                     f"{least}")
        if not self.models:
            raise BenchError("No model to benchmark", hint="localrun bench smollm2:135m")
        positive("--prompt-tokens", self.prompt_tokens)
        positive("--gen-tokens", [self.gen_tokens])
        positive("--concurrency", self.concurrency)
        positive("--runs", [self.runs])
        positive("--warmup", [self.warmup], least=0)


@dataclass(frozen=True)
class Target:
    reference: str
    detected: DetectedModel
    backend: str


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    """'128,512, 2048' -> (128, 512, 2048); a bad item raises BenchError naming the flag."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise BenchError(f"Invalid {flag} value {part!r} in {text!r}",
                             hint=f"give positive integers separated by commas, e.g. "
                             f"{flag} 128,512")
        out.append(int(part))
    return tuple(dict.fromkeys(out))  # keep order, drop repeats


def locate(reference: str) -> DetectedModel:
    """A model reference (alias, file or folder) -> its detected format, no engine."""
    from localrun.formats.detect import detect
    from localrun.resolve import DEFAULT_NAMES, resolve_local
    from localrun.stores import default_model_path

    if reference.strip().lower() in DEFAULT_NAMES:
        return detect(default_model_path())
    path = Path(reference).expanduser()
    if not path.exists():
        resolve_local(reference)  # raises UnknownModelError with suggestions
    return detect(path)


def plan_targets(models: Sequence[str], backend: str
                 ) -> tuple[list[Target], list[Skipped]]:
    """Which (model, backend) pairs to run. ``all``: every installed engine that runs
    the model's format natively; ``auto``: the engine localrun would pick."""
    from localrun.backends import BACKENDS, canonical_backend, installed_backends
    from localrun.formats import compat
    from localrun.resolve import resolve_local

    targets: list[Target] = []
    skipped: list[Skipped] = []
    installed = installed_backends()
    for ref in models:
        found = locate(ref)
        if backend == "all":
            natives = [b for b in BACKENDS if compat.support(
                found.format, b, architecture=found.architecture,
                quantization=found.quantization) == "native"]
            usable = [b for b in natives if b in installed]
            for b in natives:
                if b not in installed:
                    skipped.append(Skipped(ref, b, f"engine not installed (pip install "
                                                    f"'localrun[{BACKENDS[b].extra}]')"))
            if not natives:
                skipped.append(Skipped(ref, None, f"no engine runs "
                                       f"{compat.title(found.format)} natively"))
            targets += [Target(ref, found, b) for b in usable]
        else:
            name = backend if backend == "auto" else canonical_backend(backend)
            target = resolve_local(found.path, backend=name)
            targets.append(Target(ref, found, target.backend))
    return targets, skipped


# -- model facts -----------------------------------------------------------------------


def gguf_facts(path: str) -> tuple[int, int | None]:
    """(parameter count, elements per block of the dominant quant type) from the
    GGUF tensor table."""
    import mmap

    from localrun.formats.gguf import GGML_TYPES, _Reader

    params = 0
    bytes_by_type: dict[int, int] = {}
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        r = _Reader(mm)
        r.pos = 8
        n_tensors = r.scalar("<Q")
        n_kv = r.scalar("<Q")
        for _ in range(n_kv):
            r.skip_string()
            r.value(r.scalar("<I"))
        for _ in range(n_tensors):
            r.skip_string()
            n_el = 1
            for _ in range(r.scalar("<I")):
                n_el *= r.scalar("<Q")
            ttype = r.scalar("<I")
            r.scalar("<Q")  # offset
            params += n_el
            traits = GGML_TYPES.get(ttype)
            if traits is not None:
                bytes_by_type[ttype] = bytes_by_type.get(ttype, 0) + n_el // traits[1] * traits[2]
    quantized = {t: b for t, b in bytes_by_type.items() if GGML_TYPES[t][1] > 1}
    group = GGML_TYPES[max(quantized, key=lambda t: quantized[t])][1] if quantized else None
    return params, group


def config_parameters(config: dict[str, Any]) -> int | None:
    """Parameters of a dense decoder (llama/qwen/mistral shape) from config.json."""
    try:
        h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        vocab, inter = int(config["vocab_size"]), int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        hd = int(config.get("head_dim") or h // heads)
    except (KeyError, TypeError, ValueError):
        return None
    attn = h * heads * hd * 2 + h * kv * hd * 2
    if config.get("attention_bias") or config.get("model_type") == "qwen2":
        attn += heads * hd + 2 * kv * hd
    per_layer = attn + 3 * h * inter + 2 * h
    tied = config.get("tie_word_embeddings", True)
    return vocab * h * (1 if tied else 2) + layers * per_layer + h


def _json_file(path: Path) -> dict[str, Any]:
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def model_facts(found: DetectedModel) -> tuple[int | None, str, int | None, int | None]:
    """(parameters, where that came from, quant group size, weight bytes)."""
    import re

    if found.format == "gguf":
        from localrun.formats.gguf import read_gguf

        try:
            n_params, block = gguf_facts(found.path)
        except Exception:  # an odd tensor table must not sink the benchmark
            n_params, block = 0, None
        return (n_params or None, "gguf tensor table" if n_params else "unknown", block,
                read_gguf(found.path).tensor_bytes or None)
    folder = Path(found.path)
    config = _json_file(folder / "config.json")
    params = config_parameters(config) if config else None
    source = "config.json (dense estimate)" if params else "unknown"
    raw: Any = None
    if found.format == "mlx":
        q = config.get("quantization")
        raw = q.get("group_size") if isinstance(q, dict) else None
    elif found.format == "openvino":
        qc = _json_file(folder / "openvino_config.json").get("quantization_config")
        raw = qc.get("group_size") if isinstance(qc, dict) else None
    if raw is None and found.format in ("onnx", "openvino"):
        m = re.search(r"(?:block|group)[-_]?(?:size[-_]?)?(\d+)", str(folder).lower())
        raw = int(m.group(1)) if m else None
    fgroup = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    return params, source, fgroup, _weight_bytes(folder, found)


def _weight_bytes(folder: Path, found: DetectedModel) -> int | None:
    if found.format == "openvino":
        xml = str(found.details.get("model_file", "openvino_model.xml"))
        files = [folder / (xml[:-4] + ".bin")]
    elif found.format == "onnx":
        files = [f for f in folder.iterdir() if f.name.endswith((".onnx", ".onnx.data", ".data"))]
    else:
        files = list(folder.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files if f.is_file())
    return total or None


def host_context(hw: HardwareProfile, load_start: tuple[float, float, float] | None,
                 load_end: tuple[float, float, float] | None) -> HostContext:
    return HostContext(
        os=hw.os, os_version=hw.os_version, arch=hw.arch, cpu_model=hw.cpu.model,
        physical_cores=hw.cpu.physical_cores, logical_cores=hw.cpu.logical_cores,
        usable_cores=hw.cpu.usable_cores, ram_total_bytes=hw.ram_total,
        gpus=tuple({"name": g.name, "vendor": g.vendor, "memory_total_bytes": g.memory_total}
                   for g in hw.gpus),
        load_average_start=load_start, load_average_end=load_end)


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except (OSError, AttributeError):
        return None


# -- the harness -----------------------------------------------------------------------


class _Prompts:
    """Exact-length prompts with a fresh first word each, for one loaded model."""

    def __init__(self, model: Model) -> None:
        self._count = model.count_tokens
        self._seed = 0

    def make(self, n_tokens: int, head: str = "") -> str:
        self._seed += 1
        return exact_prompt(self._count, n_tokens, seed=self._seed, head=head)


def bench_model(model: Model, target: Target, config: BenchConfig, bandwidth: Bandwidth,
                *, load_s: float, memory_start: tuple[int | None, bool],
                progress: Progress | None = None) -> RunResult:
    """Run every workload of ``config`` on one loaded model."""
    say = progress or (lambda _msg: None)
    params, source, group, weight_bytes = model_facts(target.detected)
    info = model.info
    ctx = ModelContext(
        reference=target.reference, name=info.name, path=info.path,
        architecture=info.architecture or target.detected.architecture, parameters=params,
        parameters_source=source, format=info.format, quantization=info.quantization,
        group_size=group, weight_bytes=weight_bytes, backend=info.backend,
        engine_version=info.engine_version, context_length=info.context_length,
        load_s=load_s)
    rss_after_load, _ = rss_bytes()
    vram = [v for v in (vram_bytes(),) if v is not None]
    prompts = _Prompts(model)
    bw = bandwidth.read_gb_per_s * 1e9
    gen = config.gen_tokens
    workloads: list[WorkloadResult] = []
    prefix: list[PrefixCacheResult] = []
    label = f"{target.reference} · {info.backend}"
    for p in config.prompt_tokens:
        for i in range(config.warmup):
            say(f"{label}: warmup {i + 1}/{config.warmup} (prompt {p})")
            measure_stream(model, prompts.make(p), gen)
        cold: WorkloadResult | None = None
        for c in config.concurrency:
            say(f"{label}: prompt {p} tokens, concurrency {c}, {config.runs} run(s)")
            if c == 1:
                texts = [prompts.make(p) for _ in range(config.runs)]
                t = time.perf_counter()
                samples = [measure_stream(model, text, gen) for text in texts]
                wall, mode = time.perf_counter() - t, "stream"
            else:
                rounds = [[prompts.make(p) for _ in range(c)] for _ in range(config.runs)]
                samples, wall, batched = [], 0.0, False
                for texts in rounds:
                    got, w = measure_round(model, texts, gen)
                    samples += got
                    wall += w
                    batched = batched or overlapped(got)
                mode = "batched" if batched else "queued"
            result = summarize_workload(samples, prompt_tokens=p, gen_tokens=gen,
                                        concurrency=c, wall_s=wall, mode=mode,
                                        weight_bytes=weight_bytes, bandwidth_bytes_per_s=bw)
            workloads.append(result)
            if c == 1:
                cold = result
            v = vram_bytes()
            if v is not None:
                vram.append(v)
        if config.shared_prefix:
            say(f"{label}: shared prefix, prompt {p}")
            prefix.append(_prefix_cache(model, prompts, p, gen, config.runs, cold))
    _, peak = rss_bytes()
    rss_before, scoped = memory_start
    memory = MemoryResult(rss_before, rss_after_load, peak, "model" if scoped else "process",
                          max(vram) if vram else None)
    return RunResult(ctx, memory, tuple(workloads), tuple(prefix))


def _prefix_cache(model: Model, prompts: _Prompts, p: int, gen: int, runs: int,
                  cold: WorkloadResult | None) -> PrefixCacheResult:
    tail = max(1, min(32, p // 4))
    head = prompts.make(p - tail) if p - tail > 0 else ""
    shared = model.count_tokens(head) if head else 0
    if cold is None:
        cold_samples = [measure_stream(model, prompts.make(p), gen) for _ in range(runs)]
    else:
        cold_samples = list(cold.samples)
    measure_stream(model, prompts.make(p, head), gen)  # primes the cache with the prefix
    warm = [measure_stream(model, prompts.make(p, head), gen) for _ in range(runs)]
    cold_s = Summary.of([s.ttft_s for s in cold_samples])
    warm_s = Summary.of([s.ttft_s for s in warm])
    return PrefixCacheResult(p, shared, cold_s, warm_s,
                             cold_s.p50 / warm_s.p50 if warm_s.p50 > 0 else 0.0)


def run_bench(config: BenchConfig, *, progress: Progress | None = None) -> BenchReport:
    """Benchmark every (model, backend) pair of ``config``; return the report.

    With ``backend="all"`` a pair that fails to load is recorded in ``skipped`` and the
    others go on; with a named backend or ``auto`` the error is raised.
    """
    import localrun
    from localrun.api import load
    from localrun.hardware import detect_hardware

    config.validate()
    say = progress or (lambda _msg: None)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_start = _loadavg()
    targets, skipped = plan_targets(config.models, config.backend)
    need = max(config.prompt_tokens) + config.gen_tokens + 8
    for t in targets:
        trained = t.detected.context_length
        if trained and need > trained:
            raise BenchError(f"{t.reference} has a {trained}-token context; the workload "
                             f"needs {need} (longest prompt + --gen-tokens)",
                             hint="use smaller --prompt-tokens or --gen-tokens")
    if not targets:
        why = "; ".join(f"{s.model} {s.backend or ''}: {s.reason}" for s in skipped)
        raise BenchError(f"Nothing to benchmark ({why})",
                         hint="install an engine for the model's format, or name --backend")
    hw = detect_hardware()
    say("measuring memory bandwidth")
    bandwidth = measure_bandwidth(config.bandwidth_bytes)
    results: list[RunResult] = []
    notes: list[str] = []
    for t in targets:
        say(f"loading {t.reference} on {t.backend}")
        gc.collect()
        scoped = reset_peak_rss()
        rss_before, _ = rss_bytes()
        t0 = time.perf_counter()
        try:
            model = load(t.detected.path, backend=t.backend, context=need)
        except (LocalrunError, ImportError) as e:
            if config.backend != "all":
                raise
            msg = e.message if isinstance(e, LocalrunError) else f"{type(e).__name__}: {e}"
            skipped.append(Skipped(t.reference, t.backend, f"failed to load: {msg}"))
            continue
        load_s = time.perf_counter() - t0
        try:
            results.append(bench_model(model, t, config, bandwidth, load_s=load_s,
                                       memory_start=(rss_before, scoped), progress=say))
        finally:
            model.close()
    load_end = _loadavg()
    cores = hw.cpu.usable_cores or hw.cpu.logical_cores or 0
    if load_start and cores and load_start[0] > 0.5 * cores:
        notes.append(f"the host was busy when the run started (load average "
                     f"{load_start[0]:.2f} on {cores} usable cores): expect noise")
    return BenchReport(SCHEMA_VERSION, localrun.__version__, date,
                       host_context(hw, load_start, load_end), bandwidth,
                       Workload(config.prompt_tokens, config.gen_tokens, config.concurrency,
                                config.runs, config.warmup, config.shared_prefix),
                       tuple(results), tuple(skipped), tuple(notes))


# -- plot: self-contained HTML with inline SVG, no dependency ---------------------------

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf")


def _esc(s: object) -> str:
    import html

    return str(html.escape(str(s)))


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    exp = 10.0 ** math.floor(math.log10(v))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * exp >= v:
            return m * exp
    return 10.0 * exp


def _axes(svg: list[str], title: str, unit: str, top: float, w: int, h: int, left: int,
          bottom: int) -> None:
    svg.append(f'<text x="{w / 2}" y="16" text-anchor="middle" font-weight="bold">'
               f'{_esc(title)}</text>')
    for k in range(5):
        v = top * k / 4
        y = h - bottom - (h - bottom - 30) * k / 4
        svg.append(f'<line x1="{left}" x2="{w - 10}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'stroke="#ddd"/><text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">'
                   f'{v:g}</text>')
    svg.append(f'<text x="12" y="{(h - bottom) / 2 + 15}" transform="rotate(-90 12 '
               f'{(h - bottom) / 2 + 15})" text-anchor="middle">{_esc(unit)}</text>')


def _legend(svg: list[str], names: Sequence[str], w: int, h: int) -> None:
    x = 60
    for i, name in enumerate(names):
        color = _COLORS[i % len(_COLORS)]
        svg.append(f'<rect x="{x}" y="{h - 16}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{x + 14}" y="{h - 7}">{_esc(name)}</text>')
        x += 20 + 7 * len(name)


def svg_percentiles(title: str, unit: str, categories: Sequence[str],
                    series: Sequence[tuple[str, Sequence[Summary | None]]],
                    scale: float = 1.0) -> str:
    """Grouped bars at p50 with a whisker to p99 and a tick at p95, per category."""
    w, h, left, bottom = 720, 300, 60, 50
    top = _nice_max(max((s.p99 * scale for _, vals in series for s in vals if s), default=1))
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="11">']
    _axes(svg, title, unit, top, w, h, left, bottom)
    plot_h = h - bottom - 30
    group_w = (w - left - 20) / max(len(categories), 1)
    bar_w = group_w * 0.8 / max(len(series), 1)

    def y(v: float) -> float:
        return h - bottom - plot_h * min(v * scale / top, 1.0)

    for ci, cat in enumerate(categories):
        gx = left + 10 + ci * group_w
        svg.append(f'<text x="{gx + group_w * 0.4:.1f}" y="{h - bottom + 14}" '
                   f'text-anchor="middle">{_esc(cat)}</text>')
        for si, (_, vals) in enumerate(series):
            s = vals[ci] if ci < len(vals) else None
            if s is None:
                continue
            color = _COLORS[si % len(_COLORS)]
            x = gx + si * bar_w
            cx = x + bar_w * 0.45
            svg.append(f'<rect x="{x:.1f}" y="{y(s.p50):.1f}" width="{bar_w * 0.9:.1f}" '
                       f'height="{h - bottom - y(s.p50):.1f}" fill="{color}" opacity="0.8">'
                       f'<title>p50 {s.p50 * scale:.4g} · p95 {s.p95 * scale:.4g} · p99 '
                       f'{s.p99 * scale:.4g} {_esc(unit)}</title></rect>'
                       f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(s.p50):.1f}" '
                       f'y2="{y(s.p99):.1f}" stroke="#000"/>'
                       f'<line x1="{cx - 4:.1f}" x2="{cx + 4:.1f}" y1="{y(s.p95):.1f}" '
                       f'y2="{y(s.p95):.1f}" stroke="#000"/>'
                       f'<line x1="{cx - 6:.1f}" x2="{cx + 6:.1f}" y1="{y(s.p99):.1f}" '
                       f'y2="{y(s.p99):.1f}" stroke="#000"/>')
    _legend(svg, [n for n, _ in series], w, h)
    svg.append("</svg>")
    return "".join(svg)


def svg_lines(title: str, unit: str, xs: Sequence[int],
              series: Sequence[tuple[str, Sequence[float | None]]]) -> str:
    """One line per series over the x values (concurrency levels), log-spaced evenly."""
    w, h, left, bottom = 720, 300, 60, 50
    top = _nice_max(max((v for _, vals in series for v in vals if v), default=1))
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="11">']
    _axes(svg, title, unit, top, w, h, left, bottom)
    plot_h = h - bottom - 30
    step = (w - left - 60) / max(len(xs) - 1, 1)
    px = [left + 20 + i * step for i in range(len(xs))]
    for i, x in enumerate(xs):
        svg.append(f'<text x="{px[i]:.1f}" y="{h - bottom + 14}" text-anchor="middle">'
                   f'c={x}</text>')
    for si, (name, vals) in enumerate(series):
        color = _COLORS[si % len(_COLORS)]
        pts = [(px[i], h - bottom - plot_h * v / top) for i, v in enumerate(vals) if v]
        if len(pts) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            svg.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                       f'stroke-width="2"/>')
        for cx, cy in pts:
            svg.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{color}">'
                       f'<title>{_esc(name)}</title></circle>')
    _legend(svg, [n for n, _ in series], w, h)
    svg.append("</svg>")
    return "".join(svg)


def series_name(r: RunResult) -> str:
    q = f" {r.model.quantization}" if r.model.quantization else ""
    return f"{r.model.backend} · {r.model.format}{q}"


def render_html(report: BenchReport) -> str:
    """The plot: latency percentiles and throughput vs concurrency per backend."""
    w = report.workload
    prompts = [str(p) for p in w.prompt_tokens]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>localrun bench "
             f"{_esc(report.date)}</title><style>body{{font-family:sans-serif;margin:20px}}"
             f"td,th{{padding:2px 8px;text-align:left}}</style></head><body>"
             f"<h1>localrun bench</h1><p>{_esc(report.date)} · localrun "
             f"{_esc(report.localrun_version)} · {_esc(report.host.cpu_model)} "
             f"({_esc(report.host.usable_cores)} usable cores), "
             f"{(report.host.ram_total_bytes or 0) / 2**30:.1f} GiB RAM, {_esc(report.host.os)} "
             f"· read bandwidth {report.bandwidth.read_gb_per_s:.1f} GB/s</p>"
             f"<p>workload: prompts {_esc(', '.join(prompts))} tokens, {w.gen_tokens} generated, "
             f"concurrency {_esc(', '.join(map(str, w.concurrency)))}, {w.runs} runs, "
             f"{_esc(w.sampling)}</p><table><tr><th>series</th><th>model</th><th>arch</th>"
             f"<th>params</th><th>engine</th></tr>"]
    for r in report.results:
        m = r.model
        parts.append(f"<tr><td>{_esc(series_name(r))}</td><td>{_esc(m.reference)}</td>"
                     f"<td>{_esc(m.architecture)}</td><td>{_esc(m.parameters)}</td>"
                     f"<td>{_esc(m.backend)} {_esc(m.engine_version)}</td></tr>")
    parts.append("</table><p>Bars: p50; whisker tick: p95; whisker top: p99.</p>")
    c_lat = 1 if 1 in w.concurrency else w.concurrency[0]

    def pick(r: RunResult, metric: str, p: int, c: int) -> Summary | None:
        for wl in r.workloads:
            if wl.prompt_tokens == p and wl.concurrency == c:
                value: Summary | None = getattr(wl, metric)
                return value
        return None

    for metric, label, scale, unit in (("ttft", "TTFT", 1000.0, "ms"),
                                       ("tpot", "TPOT", 1000.0, "ms"),
                                       ("e2e", "End-to-end latency", 1.0, "s")):
        series = [(series_name(r), [pick(r, metric, p, c_lat) for p in w.prompt_tokens])
                  for r in report.results]
        parts.append(svg_percentiles(f"{label} by prompt tokens (concurrency {c_lat})",
                                     unit, prompts, series, scale))
    for p in w.prompt_tokens:
        for attr, label, unit in (("output_tokens_per_s", "Output tokens/s", "tokens/s"),
                                  ("requests_per_s", "Requests/s", "requests/s")):
            series_l: list[tuple[str, list[float | None]]] = []
            for r in report.results:
                by_c = {wl.concurrency: getattr(wl, attr) for wl in r.workloads
                        if wl.prompt_tokens == p}
                series_l.append((series_name(r), [by_c.get(c) for c in w.concurrency]))
            parts.append(svg_lines(f"{label} vs concurrency (prompt {p} tokens)", unit,
                                   list(w.concurrency), series_l))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_plot(report: BenchReport, path: str | os.PathLike[str]) -> Path:
    """Write the plot as self-contained HTML (``.html``/``.htm``) and return its path."""
    p = Path(path)
    if p.suffix.lower() not in (".html", ".htm"):
        raise BenchError(f"Cannot write a plot to {p.name}: the plot is self-contained HTML",
                         hint="name the file with .html, e.g. --plot bench.html")
    p.write_text(render_html(report), encoding="utf-8")
    return p
