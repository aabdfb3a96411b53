"""The benchmark report: one dataclass per part of its JSON (docs/bench.md documents
every field) and the aggregation of request samples into a workload's figures."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from localrun.bench.probes import Bandwidth
from localrun.bench.stats import Summary, median, roofline_share, tokens_per_second

if TYPE_CHECKING:
    from localrun.hardware import HardwareProfile

#: Changes whenever a field changes meaning or disappears.
SCHEMA_VERSION = 1


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
    drafted_tokens: int = 0  # speculative decoding: drafts, and the ones kept
    accepted_tokens: int = 0


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
    #: the requests' speculative mode (bench --speculative), and the share of their
    #: drafts kept; None: not asked
    speculative: str | None = None
    acceptance: float | None = None


def summarize_workload(samples: Sequence[RequestSample], *, prompt_tokens: int,
                       gen_tokens: int, concurrency: int, wall_s: float, mode: str,
                       weight_bytes: int | None = None,
                       bandwidth_bytes_per_s: float | None = None,
                       speculative: str | None = None) -> WorkloadResult:
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
    drafted = sum(s.drafted_tokens for s in samples)
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
        speculative=speculative,
        acceptance=sum(s.accepted_tokens for s in samples) / drafted if drafted else None,
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
class ImageResult:
    """One image on one model: its tokens, and TTFT with and without it."""

    image: str  # the file, as named
    width: int
    height: int
    image_tokens: int  # prompt tokens with the image minus without
    text_ttft: Summary  # the question alone
    image_ttft: Summary  # the question and the image
    encode_s: Summary | None  # the engine's own image-encode time; None: not reported
    #: (image TTFT - text TTFT - encode) / image tokens, p50s (seconds per token)
    prefill_per_image_token_s: float | None


@dataclass(frozen=True)
class RunResult:
    model: ModelContext
    memory: MemoryResult
    workloads: tuple[WorkloadResult, ...]
    prefix_cache: tuple[PrefixCacheResult, ...]
    images: tuple[ImageResult, ...] = ()  # with --image


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
    image: str | None = None  # --image: the file whose cost is measured (bench/images.py)
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


def params_label(n: int | None) -> str:
    """A parameter count as people write it: 135M, 1.54B ("unknown" when not known)."""
    if n is None:
        return "unknown"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def host_context(hw: HardwareProfile, load_start: tuple[float, float, float] | None,
                 load_end: tuple[float, float, float] | None) -> HostContext:
    return HostContext(
        os=hw.os, os_version=hw.os_version, arch=hw.arch, cpu_model=hw.cpu.model,
        physical_cores=hw.cpu.physical_cores, logical_cores=hw.cpu.logical_cores,
        usable_cores=hw.cpu.usable_cores, ram_total_bytes=hw.ram_total,
        gpus=tuple({"name": g.name, "vendor": g.vendor, "memory_total_bytes": g.memory_total}
                   for g in hw.gpus),
        load_average_start=load_start, load_average_end=load_end)
