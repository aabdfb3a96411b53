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

The package, by job: ``stats`` (percentiles, TPOT, the roofline), ``probes`` (bandwidth,
RSS, VRAM, load), ``prompts`` (exact token counts), ``report`` (the report's dataclasses
and a workload's aggregation), ``targets`` (configuration, which model on which engine),
``facts`` (parameters, group size, weight bytes), ``harness`` (the runs), ``plot`` (HTML).
"""

from __future__ import annotations

from localrun.bench.facts import (
    config_parameters,
    gguf_facts,
    model_facts,
)
from localrun.bench.harness import (
    GREEDY,
    Progress,
    bench_model,
    measure_round,
    measure_stream,
    overlapped,
    run_bench,
)
from localrun.bench.plot import (
    render_html,
    series_name,
    svg_lines,
    svg_percentiles,
    write_plot,
)
from localrun.bench.probes import (
    Bandwidth,
    last_level_cache_bytes,
    loadavg,
    measure_bandwidth,
    reset_peak_rss,
    rss_bytes,
    vram_bytes,
)
from localrun.bench.prompts import (
    FILLERS,
    WORDS,
    Prompts,
    exact_prompt,
    synthetic_words,
)
from localrun.bench.report import (
    SCHEMA_VERSION,
    BenchReport,
    HostContext,
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
from localrun.bench.stats import (
    Summary,
    median,
    percentile,
    roofline_share,
    tokens_per_second,
    tpot,
)
from localrun.bench.targets import (
    BenchConfig,
    Target,
    locate,
    parse_int_list,
    plan_targets,
)

__all__ = [
    "FILLERS",
    "GREEDY",
    "SCHEMA_VERSION",
    "WORDS",
    "Bandwidth",
    "BenchConfig",
    "BenchReport",
    "HostContext",
    "MemoryResult",
    "ModelContext",
    "PrefixCacheResult",
    "Progress",
    "Prompts",
    "RequestSample",
    "RunResult",
    "Skipped",
    "Summary",
    "Target",
    "Workload",
    "WorkloadResult",
    "bench_model",
    "config_parameters",
    "exact_prompt",
    "gguf_facts",
    "host_context",
    "last_level_cache_bytes",
    "loadavg",
    "locate",
    "measure_bandwidth",
    "measure_round",
    "measure_stream",
    "median",
    "model_facts",
    "overlapped",
    "parse_int_list",
    "percentile",
    "plan_targets",
    "render_html",
    "reset_peak_rss",
    "roofline_share",
    "rss_bytes",
    "run_bench",
    "series_name",
    "summarize_workload",
    "svg_lines",
    "svg_percentiles",
    "synthetic_words",
    "tokens_per_second",
    "tpot",
    "vram_bytes",
    "write_plot",
]
