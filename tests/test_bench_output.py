"""What `localrun bench` shows: the terminal tables whole at any width, and an HTML plot
that says what the JSON says (issue 25, item 6). On a report built from synthetic
samples, so that no model has to run."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from localrun.bench import BenchReport, RequestSample, summarize_workload
from localrun.bench.probes import Bandwidth
from localrun.bench.report import (
    SCHEMA_VERSION,
    HostContext,
    MemoryResult,
    ModelContext,
    RunResult,
    Workload,
    params_label,
)

BUSY = ("the host was busy when the run started (load average 3.20 on 2 usable cores): "
        "expect noise")


def _samples(prompt: int, n: int) -> list[RequestSample]:
    return [RequestSample(prompt_tokens=prompt, output_tokens=128, ttft_s=0.1234 + i / 1000,
                          e2e_s=2.3456 + i / 100, tpot_s=0.01789 + i / 10000,
                          service_ttft_s=0.12, reported_prefill_tps=1000.0,
                          reported_decode_tps=55.0, finish_reason="length",
                          start_s=i * 0.5) for i in range(n)]


def _report() -> BenchReport:
    workloads = tuple(
        summarize_workload(_samples(p, 5), prompt_tokens=p, gen_tokens=128, concurrency=c,
                           wall_s=12.5, mode="stream" if c == 1 else "batched",
                           weight_bytes=98_362_432, bandwidth_bytes_per_s=12e9)
        for p in (128, 2048) for c in (1, 8))
    model = ModelContext(
        reference="smollm2:135m", name="SmolLM2 135M Instruct", path="/m.gguf",
        architecture="llama", parameters=134_515_008, parameters_source="gguf tensor table",
        format="gguf", quantization="Q4_1", group_size=32, weight_bytes=98_362_432,
        backend="llama.cpp", engine_version="0.3.36", context_length=8192, load_s=0.42)
    run = RunResult(model, MemoryResult(100 * 2**20, 250 * 2**20, 400 * 2**20, "model", None),
                    workloads, ())
    host = HostContext("Linux", "6.1", "x86_64", "AMD EPYC", 2, 2, 2, 24 * 2**30, (),
                       (3.2, 3.0, 2.9), (3.1, 3.0, 2.9))
    return BenchReport(SCHEMA_VERSION, "0.1.0", "2026-12-01T23:00:00Z", host,
                       Bandwidth(12.0, 10.0, 64 * 2**20, 3, 32 * 2**20),
                       Workload((128, 2048), 128, (1, 8), 5, 1, False), (run,), (),
                       (BUSY,))


def _printed(width: int) -> str:
    from localrun.cli.bench import print_report

    out = io.StringIO()
    console = Console(file=out, width=width, highlight=False, color_system=None)
    print_report(console, _report())
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 120, 200])
def test_the_run_table_is_whole_at_any_width(width: int) -> None:
    """Every figure of every row, uncut (no "…"), and no line past the console."""
    text = _printed(width)
    assert "…" not in text
    assert all(len(line) <= width for line in text.splitlines())
    for header in ("TTFT", "TPOT", "e2e", "prefill", "decode", "req/s", "out", "roofline"):
        assert header in text, (width, header)  # (a narrow console wraps "prefill tok/s")
    assert text.count("125/127/127") == 4  # TTFT p50/p95/p99 on each of the four rows
    assert text.count("17066.7") == 2  # prefill tok/s of the two 2048-token rows
    assert "135M params" in text and "note" in text and "busy" in text


def test_a_wide_console_gets_one_table_a_narrow_one_two() -> None:
    def headers(text: str) -> int:
        return len(re.findall(r"(?m)^prompt +conc +mode", text))

    assert headers(_printed(200)) == 1 and headers(_printed(100)) == 2


def test_the_html_says_what_the_json_says() -> None:
    from localrun.bench import render_html

    html = render_html(_report())
    assert "135M" in html and "134515008" not in html
    assert "busy" in html and "load average 3.20" in html


def test_params_label() -> None:
    assert [params_label(n) for n in (134_515_008, 1_543_714_304, None)] == [
        "135M", "1.54B", "unknown"]
