"""localrun bench MODEL [MODEL ...]: latency, throughput and memory, engines side by side."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from localrun.cli.options import Exact

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from localrun.bench import BenchReport, RunResult, Summary


def bench(
    models: Annotated[list[str], typer.Argument(
        help="Models to benchmark: .gguf files, model folders, or names such as "
        "smollm2:135m. Give the same model in several formats to compare engines.")],
    backend: Annotated[str, typer.Option(
        "--backend", "-b", help="Engine: auto (the one localrun picks), all (every "
        "installed engine that runs the model's format natively), or a name.")] = "auto",
    prompt_tokens: Annotated[str, typer.Option(
        "--prompt-tokens", help="Prompt lengths in tokens, comma-separated; exact for "
        "each model's tokenizer.")] = "128,512,2048",
    gen_tokens: Annotated[int, typer.Option(
        "--gen-tokens", help="Tokens to generate per request (greedy).")] = 128,
    concurrency: Annotated[str, typer.Option(
        "--concurrency", help="Concurrency levels, comma-separated.")] = "1,4,8",
    runs: Annotated[int, typer.Option(
        "--runs", help="Measured requests per workload (rounds of C requests when "
        "concurrency C > 1).")] = 5,
    warmup: Annotated[int, typer.Option(
        "--warmup", help="Unmeasured requests per prompt length first.")] = 1,
    shared_prefix: Annotated[bool, typer.Option(
        "--shared-prefix", help="Also measure TTFT when consecutive prompts share all "
        "but their last tokens (prefix caching).")] = False,
    image: Annotated[Path | None, typer.Option(
        "--image", help="Also measure what this image costs a vision model: its tokens, "
        "TTFT with and without it, the engine's encode time, prefill per image token.")
    ] = None,
    speculative: Annotated[str | None, typer.Option(
        "--speculative", help="Speculative decoding modes to compare at concurrency 1, "
        "comma-separated, each on the same prompts: off, auto, prompt-lookup, draft "
        "(e.g. off,auto).")] = None,
    json_file: Annotated[Path | None, typer.Option(
        "--json", help="Write the full report as JSON (schema: docs/bench.md).")] = None,
    plot_file: Annotated[Path | None, typer.Option(
        "--plot", help="Write latency percentiles and throughput vs concurrency as a "
        "self-contained HTML file.")] = None,
    exact: Exact = False,
) -> None:
    """Benchmark models: TTFT, TPOT and end-to-end latency (p50/p95/p99), prefill and
    decode tokens/s, requests/s and tokens/s per concurrency level, peak memory, and
    decode's share of the memory-bandwidth roofline, with the full context (model,
    quant, engine, hardware, workload) in every report.

    Examples:

      localrun bench smollm2:135m --prompt-tokens 128 --concurrency 1,4

      localrun bench m.gguf m-mlx/ m-ov/ m-onnx/ --backend all --json b.json --plot b.html

      localrun bench smollm2:135m --shared-prefix --runs 10

      localrun bench ./qwen2.5-vl.gguf --image photo.png --prompt-tokens 128
      localrun bench model.F32.gguf --speculative off,auto --concurrency 1
    """
    from localrun.bench import BenchConfig, parse_int_list, run_bench, write_plot
    from localrun.errors import BenchError

    if plot_file is not None and plot_file.suffix.lower() not in (".html", ".htm"):
        raise BenchError(f"Cannot write a plot to {plot_file.name}: the plot is "
                         "self-contained HTML", hint="name it with .html, e.g. --plot bench.html")
    config = BenchConfig(
        models=tuple(models), backend=backend.strip().lower(),
        prompt_tokens=parse_int_list(prompt_tokens, "--prompt-tokens"),
        gen_tokens=gen_tokens, concurrency=parse_int_list(concurrency, "--concurrency"),
        runs=runs, warmup=warmup, shared_prefix=shared_prefix,
        image=str(image) if image is not None else None,
        speculative=_modes(speculative), exact=exact)
    config.validate()
    from rich.console import Console

    err = Console(stderr=True, highlight=False)
    if err.is_terminal:
        with err.status("starting") as status:
            report = run_bench(config, progress=lambda msg: status.update(_e(msg)))
    else:  # a log, not a spinner: one line per step
        report = run_bench(config, progress=lambda msg: err.print(_e(msg)))
    # Piped output has no width: keep table rows whole rather than wrapped at 80.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    print_report(console, report)
    if json_file is not None:
        json_file.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
        err.print(f"JSON report: {_e(json_file)}")
    if plot_file is not None:
        write_plot(report, plot_file)
        err.print(f"plot: {_e(plot_file)}")


def _modes(text: str | None) -> tuple[str, ...]:
    """--speculative off,auto -> ("off", "auto"), each checked (the list in the error)."""
    from localrun.sampling import check_speculative

    if text is None:
        return ()
    modes = [check_speculative(part) for part in text.split(",")]
    return tuple(dict.fromkeys(m for m in modes if m is not None))


def _e(value: object) -> str:
    from rich.markup import escape

    return escape(str(value))


def _ms(s: Summary | None, scale: float = 1000.0) -> str:
    if s is None:
        return "n/a"
    digits = 0 if s.p99 * scale >= 100 else 1 if s.p99 * scale >= 10 else 2
    return "/".join(f"{v * scale:.{digits}f}" for v in (s.p50, s.p95, s.p99))


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "n/a" if v is None else format(v, fmt)


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def print_report(console: Console, report: BenchReport) -> None:
    h, w, bw = report.host, report.workload, report.bandwidth
    gpus = ", ".join(f"{g['name']} ({_bytes(g['memory_total_bytes'])})" for g in h.gpus) or "none"
    load = (f"{h.load_average_start[0]:.2f}" if h.load_average_start else "n/a")
    console.print(f"[bold]Host[/]: {_e(h.cpu_model)}, {_e(h.usable_cores)} usable cores, "
                  f"{_bytes(h.ram_total_bytes)} RAM, GPUs: {_e(gpus)}; {_e(h.os)} "
                  f"{_e(h.os_version)}; load average at start {load}")
    console.print(f"[bold]Memory bandwidth[/] (measured here): read {bw.read_gb_per_s:.1f} GB/s, "
                  f"copy {bw.copy_gb_per_s:.1f} GB/s ({_bytes(bw.buffer_bytes)} buffer, "
                  f"single thread)")
    console.print(f"[bold]Workload[/]: prompts {_e(', '.join(map(str, w.prompt_tokens)))} tokens "
                  f"({_e(w.prompt_kind)}), {w.gen_tokens} generated, concurrency "
                  f"{_e(', '.join(map(str, w.concurrency)))}, {w.runs} runs + {w.warmup} warmup; "
                  f"{_e(w.sampling)}")
    console.print(f"localrun {_e(report.localrun_version)} · {_e(report.date)}")
    for r in report.results:
        _run_table(console, r)
    if len(report.results) > 1:
        _side_by_side(console, report)
    for s in report.skipped:
        console.print(f"[yellow]skipped[/] {_e(s.model)} on {_e(s.backend or '-')}: "
                      f"{_e(s.reason)}")
    for note in report.notes:
        console.print(f"[yellow]note[/]: {_e(note)}")


#: The run table's columns: what identifies a row, then latency, then throughput. A
#: console too narrow for all of them gets two tables (each with the identifying ones)
#: rather than cut cells.
_KEY_COLUMNS = ("prompt", "conc", "mode")
_LATENCY_COLUMNS = ("TTFT ms p50/95/99", "TPOT ms p50/95/99", "e2e s p50/95/99")
_RATE_COLUMNS = ("prefill tok/s", "decode tok/s", "req/s", "out tok/s", "tokens", "roofline")


def _table(columns: tuple[str, ...], rows: list[dict[str, str]]) -> Table:
    from rich.table import Table

    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in columns:
        # fold, never crop: on a console too narrow even for half the columns a value
        # breaks across lines, every digit kept
        table.add_column(col, justify="left" if col == "mode" else "right", overflow="fold")
    for row in rows:
        table.add_row(*(row[c] for c in columns))
    return table


def _run_table(console: Console, r: RunResult) -> None:
    from localrun.bench.report import params_label

    m, mem = r.model, r.memory
    quant = m.quantization or "unquantized"
    group = f", group {m.group_size}" if m.group_size else ""
    console.print()
    console.print(f"[bold]{_e(m.reference)}[/] · {_e(m.name or '')} · {_e(m.architecture)} · "
                  f"{params_label(m.parameters)} params ({_e(m.parameters_source)}) · "
                  f"{_e(m.format)} {_e(quant)}{_e(group)} · weights {_bytes(m.weight_bytes)}")
    console.print(f"  engine {_e(m.backend)} {_e(m.engine_version)} · context "
                  f"{m.context_length} · load {m.load_s:.2f} s · peak RSS "
                  f"{_bytes(mem.peak_rss_bytes)} ({_e(mem.peak_rss_scope)}) · after load "
                  f"{_bytes(mem.rss_after_load_bytes)} · VRAM {_bytes(mem.vram_bytes)}")
    rows = []
    for wl in r.workloads:
        tokens = (f"{wl.output_tokens_mean:.0f}/{wl.gen_tokens}" if wl.short_requests
                  else f"{wl.gen_tokens}")
        exact = "" if wl.prompt_tokens_exact else "*"
        mode = wl.mode if wl.acceptance is None else \
            f"{wl.mode} ({wl.acceptance:.0%} of drafts kept)"
        values = (f"{wl.prompt_tokens}{exact}", str(wl.concurrency), mode,
                  _ms(wl.ttft), _ms(wl.tpot), _ms(wl.e2e, 1.0),
                  _num(wl.prefill_tokens_per_s), _num(wl.decode_tokens_per_s),
                  _num(wl.requests_per_s, ".2f"), _num(wl.output_tokens_per_s),
                  tokens, "n/a" if wl.roofline_share is None else f"{wl.roofline_share:.0%}")
        rows.append(dict(zip(_KEY_COLUMNS + _LATENCY_COLUMNS + _RATE_COLUMNS, values,
                             strict=True)))
    whole = _table(_KEY_COLUMNS + _LATENCY_COLUMNS + _RATE_COLUMNS, rows)
    natural = console.measure(whole, options=console.options.update_width(10_000)).maximum
    if natural <= console.width:
        console.print(whole)
    else:
        console.print(_table(_KEY_COLUMNS + _LATENCY_COLUMNS, rows))
        console.print(_table(_KEY_COLUMNS + _RATE_COLUMNS, rows))
    for pc in r.prefix_cache:
        console.print(f"  shared prefix ({pc.shared_prefix_tokens} of {pc.prompt_tokens} "
                      f"tokens): TTFT p50 {pc.cold_ttft.p50 * 1000:.1f} ms cold -> "
                      f"{pc.warm_ttft.p50 * 1000:.1f} ms warm, {pc.ttft_gain:.2f}x")
    for im in r.images:
        encode = (f", encode {im.encode_s.p50 * 1000:.1f} ms" if im.encode_s is not None
                  else ", encode n/a")
        per = (f", prefill {im.prefill_per_image_token_s * 1000:.2f} ms per image token"
               if im.prefill_per_image_token_s is not None else "")
        console.print(f"  image {_e(im.image)} ({im.width}x{im.height}, {im.image_tokens} "
                      f"tokens): TTFT p50 {im.text_ttft.p50 * 1000:.1f} ms without -> "
                      f"{im.image_ttft.p50 * 1000:.1f} ms with it{encode}{per}")
    if any(wl.short_requests for wl in r.workloads):
        console.print("  tokens a/b: the model stopped at end-of-sequence before b tokens "
                      "in some requests (mean a); TPOT uses the actual counts")


def _side_by_side(console: Console, report: BenchReport) -> None:
    from rich.table import Table

    from localrun.bench import series_name

    c = 1 if 1 in report.workload.concurrency else report.workload.concurrency[0]
    cmax = max(report.workload.concurrency)
    console.print()
    console.print(f"[bold]Side by side[/] (concurrency {c}; throughput at concurrency {cmax})")
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("model", "engine", "prompt", "TTFT p50 ms", "TPOT p50 ms", "prefill tok/s",
                "decode tok/s", f"out tok/s @{cmax}", "peak RSS", "roofline"):
        table.add_column(col, justify="left" if col in ("model", "engine") else "right")
    for r in report.results:
        by = {(wl.prompt_tokens, wl.concurrency): wl for wl in r.workloads}
        for p in report.workload.prompt_tokens:
            wl = by.get((p, c))
            top = by.get((p, cmax))
            if wl is None:
                continue
            table.add_row(_e(r.model.reference), _e(series_name(r)), str(p),
                          f"{wl.ttft.p50 * 1000:.1f}",
                          "n/a" if wl.tpot is None else f"{wl.tpot.p50 * 1000:.1f}",
                          _num(wl.prefill_tokens_per_s), _num(wl.decode_tokens_per_s),
                          _num(top.output_tokens_per_s if top else None),
                          _bytes(r.memory.peak_rss_bytes),
                          "n/a" if wl.roofline_share is None else f"{wl.roofline_share:.0%}")
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
