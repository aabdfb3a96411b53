"""The statistics of ``localrun bench``: percentiles, per-token times, the roofline."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


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
