"""The harness: load each target, run every workload on it, and build the report."""

from __future__ import annotations

import datetime
import gc
import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from localrun.bench.facts import model_facts
from localrun.bench.probes import (
    Bandwidth,
    loadavg,
    measure_bandwidth,
    reset_peak_rss,
    rss_bytes,
    vram_bytes,
)
from localrun.bench.prompts import Prompts
from localrun.bench.report import (
    SCHEMA_VERSION,
    BenchReport,
    ImageResult,
    MemoryResult,
    ModelContext,
    PrefixCacheResult,
    RequestSample,
    RunResult,
    Skipped,
    Workload,
    WorkloadResult,
    host_context,
    summarize_workload,
)
from localrun.bench.stats import Summary, tpot
from localrun.bench.targets import BenchConfig, Target, plan_targets
from localrun.errors import BenchError, LocalrunError

if TYPE_CHECKING:
    from localrun.api import Model

#: Greedy decoding with every filter and penalty off: the same work on every engine.
GREEDY: dict[str, Any] = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                          "repetition_penalty": 1.0}

Progress = Callable[[str], None]


def measure_stream(model: Model, text: str, gen_tokens: int,
                   speculative: str | None = None) -> RequestSample:
    """One raw greedy request through ``Model.stream``, timestamping each chunk."""
    t0 = time.perf_counter()
    first = 0.0
    extra: dict[str, Any] = {"speculative": speculative} if speculative else {}
    with model.stream(text, raw=True, max_tokens=gen_tokens, **GREEDY, **extra) as stream:
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
                         c.finish_reason, 0.0, c.timings.drafted_tokens,
                         c.timings.accepted_tokens)


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
    prompts = Prompts(model)
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
            if c == 1 and config.speculative:  # each mode on the same prompts
                texts = [prompts.make(p) for _ in range(config.runs)]
                for spec in config.speculative:
                    t = time.perf_counter()
                    samples = [measure_stream(model, text, gen, spec) for text in texts]
                    workloads.append(summarize_workload(
                        samples, prompt_tokens=p, gen_tokens=gen, concurrency=c,
                        wall_s=time.perf_counter() - t, mode=f"stream, speculative {spec}",
                        weight_bytes=weight_bytes, bandwidth_bytes_per_s=bw,
                        speculative=spec))
                cold = workloads[-len(config.speculative)]
                continue
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
    images: tuple[ImageResult, ...] = ()
    if config.image is not None:
        say(f"{label}: image {config.image}")
        images = (_image(model, config, label),)
    _, peak = rss_bytes()
    rss_before, scoped = memory_start
    memory = MemoryResult(rss_before, rss_after_load, peak, "model" if scoped else "process",
                          max(vram) if vram else None)
    return RunResult(ctx, memory, tuple(workloads), tuple(prefix), images)


def _image(model: Model, config: BenchConfig, label: str) -> ImageResult:
    from localrun.bench.images import measure_image
    from localrun.images import read_image

    assert config.image is not None
    session = model._session
    if session is None or not session.accepts_images:
        raise BenchError(f"{label} takes no images: --image needs a vision model",
                         hint="bench a GGUF with its mmproj beside it, or an OpenVINO VLM")
    return measure_image(model, read_image(config.image), config.image, config.gen_tokens,
                         config.runs, config.warmup, GREEDY)


def _prefix_cache(model: Model, prompts: Prompts, p: int, gen: int, runs: int,
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
    load_start = loadavg()
    targets, skipped = plan_targets(config.models, config.backend)
    need = max(config.prompt_tokens) + config.gen_tokens + 8
    if config.image is not None:  # an image takes up to 1024 tokens (the default budget)
        need = max(need, 1024 + 64 + config.gen_tokens + 8)
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
            model = load(t.detected.path, backend=t.backend, context=need,
                         exact=config.exact)
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
    load_end = loadavg()
    cores = hw.cpu.usable_cores or hw.cpu.logical_cores or 0
    if load_start and cores and load_start[0] > 0.5 * cores:
        notes.append(f"the host was busy when the run started (load average "
                     f"{load_start[0]:.2f} on {cores} usable cores): expect noise")
    return BenchReport(SCHEMA_VERSION, localrun.__version__, date,
                       host_context(hw, load_start, load_end), bandwidth,
                       Workload(config.prompt_tokens, config.gen_tokens, config.concurrency,
                                config.runs, config.warmup, config.shared_prefix,
                                config.image),
                       tuple(results), tuple(skipped), tuple(notes))
