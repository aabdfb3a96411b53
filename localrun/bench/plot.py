"""The plot: self-contained HTML with inline SVG, no dependency."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from localrun.bench.report import BenchReport, RunResult, params_label
from localrun.bench.stats import Summary
from localrun.errors import BenchError

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
                     f"<td>{_esc(m.architecture)}</td><td>{_esc(params_label(m.parameters))}</td>"
                     f"<td>{_esc(m.backend)} {_esc(m.engine_version)}</td></tr>")
    parts.append("</table>")
    # What the JSON says about the run's conditions (a busy host) and what did not run.
    parts += [f"<p class='note'><b>note</b>: {_esc(n)}</p>" for n in report.notes]
    parts += [f"<p class='note'><b>skipped</b> {_esc(s.model)} on {_esc(s.backend or '-')}: "
              f"{_esc(s.reason)}</p>" for s in report.skipped]
    parts.append("<p>Bars: p50; whisker tick: p95; whisker top: p99.</p>")
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
